package mem

import (
	"slices"
	"testing"
	"unsafe"

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

func TestOverlappingOffsetOwner(t *testing.T) {
	r, err := Alloc(3*PageSize, "test", false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Free()
	base := unsafe.Pointer(unsafe.SliceData(r.Bytes()))
	goMem := make([]byte, 64)
	tests := []struct {
		name    string
		p       unsafe.Pointer
		n       int
		overlap bool
		off     int64
		inside  bool
	}{
		{"whole", base, 3 * PageSize, true, 0, true},
		{"middle page", unsafe.Add(base, PageSize), PageSize, true, int64(PageSize), true},
		{"unaligned", unsafe.Add(base, 100), 7, true, 100, true},
		{"last byte", unsafe.Add(base, 3*PageSize-1), 1, true, int64(3*PageSize - 1), true},
		{"past the end", unsafe.Add(base, 3*PageSize-1), 2, true, 0, false},
		{"go memory", unsafe.Pointer(&goMem[0]), len(goMem), false, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rs := Overlapping(tt.p, tt.n)
			if got := slices.Contains(rs, r); got != tt.overlap {
				t.Errorf("Overlapping contains the region: %v, want %v", got, tt.overlap)
			}
			off, ok := r.Offset(tt.p, tt.n)
			if ok != tt.inside || (ok && off != tt.off) {
				t.Errorf("Offset = %d, %v; want %d, %v", off, ok, tt.off, tt.inside)
			}
		})
	}
	if r.Owner() != nil {
		t.Errorf("Owner of a new region = %v, want nil", r.Owner())
	}
	r.SetOwner("mr")
	if r.Owner() != "mr" {
		t.Errorf("Owner = %v, want what SetOwner recorded", r.Owner())
	}
	if err := r.Free(); err != nil {
		t.Fatal(err)
	}
	if rs := Overlapping(base, 3*PageSize); slices.Contains(rs, r) {
		t.Errorf("a freed region is still found by Overlapping")
	}
}
