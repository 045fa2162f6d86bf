package mem

import "testing"

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
