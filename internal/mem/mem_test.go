package mem

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestAllocFree(t *testing.T) {
	for _, n := range []int{1, 100, PageSize, PageSize + 1, 3*PageSize - 7} {
		r, err := Alloc(n, "test", true)
		if err != nil {
			t.Fatal(err)
		}
		b := r.Bytes()
		if len(b) != n || cap(b) != n {
			t.Fatalf("Alloc(%d): len %d cap %d", n, len(b), cap(b))
		}
		if uintptr(r.Ptr())%uintptr(PageSize) != 0 {
			t.Fatalf("Alloc(%d) not page aligned", n)
		}
		for i := range b {
			if b[i] != 0 {
				t.Fatalf("not zeroed at %d", i)
			}
			b[i] = byte(i)
		}
		if r.FD() < 0 {
			t.Fatal("no memfd")
		}
		if err := r.Free(); err != nil {
			t.Fatal(err)
		}
		if err := r.Free(); err != nil {
			t.Fatal("second Free:", err)
		}
	}
	if _, err := Alloc(0, "x", false); err == nil {
		t.Fatal("Alloc(0) succeeded")
	}
}

// TestAllocSealed: a holder of the descriptor (a peer process) can neither
// shrink nor grow the memory, nor lift or add seals; the mapping stays
// usable.
func TestAllocSealed(t *testing.T) {
	r, err := Alloc(3*PageSize, "sealed", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Free()
	if !Sealed(r.FD()) {
		t.Fatal("the memfd is not sealed")
	}
	for _, size := range []int64{0, int64(PageSize), int64(4 * PageSize)} {
		if err := unix.Ftruncate(r.FD(), size); err == nil {
			t.Errorf("ftruncate to %d succeeded", size)
		}
	}
	if _, err := unix.FcntlInt(uintptr(r.FD()), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); err == nil {
		t.Error("a seal was added")
	}
	b := r.Bytes()
	b[len(b)-1] = 1
	if b[len(b)-1] != 1 {
		t.Fatal("mapping unusable")
	}
	// An unsealed memfd is not Sealed.
	fd, err := unix.MemfdCreate("plain", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if Sealed(fd) {
		t.Error("an unsealed memfd is reported sealed")
	}
	if Sealed(-1) {
		t.Error("a bad descriptor is reported sealed")
	}
}
