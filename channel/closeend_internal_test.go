package channel

import (
	"errors"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// TestCloseEndsUndispatched: a request whose completion Close did not see
// within the flush grace (here: the test holds the poller role while Close
// drains, as a poller stuck elsewhere or a device that flushes late would)
// completes with ErrClosed once Close has destroyed its queue pair; before,
// its handle stayed undone forever, and a caller looping on Done hung.
func TestCloseEndsUndispatched(t *testing.T) {
	a, _ := internalPairWith(t, Options{FlushGrace: 200 * time.Millisecond})
	mr, err := a.PD().Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	// A receive no message comes for: in flight until Close flushes it.
	h, err := a.PostReceive(verbs.SGE{Addr: mr.Addr(), Length: 64, LKey: mr.LKey()})
	if err != nil {
		t.Fatal(err)
	}
	a.e.pollMu.Lock() // nobody dispatches the flush while Close drains
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	// Close marks itself closed after the drain gave up, then waits (up
	// to the grace again) for the poller role.
	for !a.e.closed.Load() {
		time.Sleep(time.Millisecond)
	}
	a.e.unlockPoll()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if !h.Done() {
		t.Fatal("a receive in flight when Close returned is not Done")
	}
	if err := h.Err(); !errors.Is(err, ErrClosed) {
		t.Fatalf("its error: %v, want ErrClosed", err)
	}
	if _, ok := h.Completion(); ok {
		t.Error("it has a completion of its own")
	}
	h.Release()
}
