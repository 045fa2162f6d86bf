package session

import (
	"testing"
	"unsafe"
)

// TestHoldDefersFree: a region freed while a request in flight holds it
// (a send whose wait was cancelled) is invalid at once, but its memory
// is not handed out again, nor its arena released, until the last
// unhold: an Alloc meanwhile gets other memory.
func TestHoldDefersFree(t *testing.T) {
	a, _ := pair(t, Config{})
	for _, size := range []int{64, 8 << 20} { // a size class; a region with its own arena
		r, err := a.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		addr := uintptr(unsafe.Pointer(&r.Bytes()[0]))
		before := a.mem.Stats()
		for range 2 { // two requests in flight read it
			if !r.hold() {
				t.Fatal("hold of a valid region failed")
			}
		}
		if err := r.Free(); err != nil {
			t.Fatal(err)
		}
		if r.Valid() || r.hold() {
			t.Fatalf("%d bytes: a freed region is still valid", size)
		}
		n, err := a.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		if uintptr(unsafe.Pointer(&n.Bytes()[0])) == addr {
			t.Fatalf("%d bytes: the held memory was handed out again", size)
		}
		n.Free()
		if got := a.mem.Stats(); got.InUse != before.InUse {
			t.Fatalf("%d bytes: in use %d while held, want %d", size, got.InUse, before.InUse)
		}
		r.unhold()
		if got := a.mem.Stats(); got.InUse != before.InUse {
			t.Fatalf("%d bytes: in use %d after one of two unholds, want %d", size, got.InUse, before.InUse)
		}
		r.unhold()
		if got := a.mem.Stats(); got.InUse >= before.InUse {
			t.Fatalf("%d bytes: in use %d after the last unhold, want less than %d", size, got.InUse, before.InUse)
		}
	}
}
