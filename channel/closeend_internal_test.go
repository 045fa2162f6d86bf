package channel

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
)

// TestCloseEndsUndispatched: a request whose completion Close did not see
// within the flush grace (here: the test holds the poller role while Close
// drains, as a poller stuck elsewhere or a device that flushes late would)
// completes with ErrClosed once Close has destroyed its queue pair; before,
// its handle stayed undone forever, and a caller looping on Done hung.
func TestCloseEndsUndispatched(t *testing.T) {
	a, h := receiveInFlight(t, 200*time.Millisecond)
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

// TestCloseEndsUndispatchedLate: Close gives up waiting for a poller that
// stays inside the CQ longer than the flush grace (descheduled, or a slow
// provider) and returns; the requests left in flight end with ErrClosed
// when that poller leaves, and the scratch memory it may still read for
// the completions it polled (atomic results) stays mapped until then.
// Before, their handles stayed undone for ever and the scratch memory
// was freed under the poller.
func TestCloseEndsUndispatchedLate(t *testing.T) {
	a, h := receiveInFlight(t, 50*time.Millisecond)
	a.e.pollMu.Lock() // a poller that stays in the CQ past Close
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	// The poller may still read atomic results there.
	scratch := uintptr(unsafe.Pointer(unsafe.SliceData(a.e.scratch.Bytes())))
	if m := mappingOf(t, scratch); !strings.Contains(m, "goverbs:") {
		t.Fatalf("the scratch memory was freed under the poller: its address is now mapped as %q", m)
	}
	a.e.unlockPoll() // the poller leaves
	if !h.Done() {
		t.Fatal("a receive in flight is not Done once the poller that Close waited for left")
	}
	if err := h.Err(); !errors.Is(err, ErrClosed) {
		t.Fatalf("its error: %v, want ErrClosed", err)
	}
	h.Release()
}

// mappingOf is the line of /proc/self/maps whose range holds addr ("" if
// none does).
func mappingOf(t *testing.T, addr uintptr) string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var lo, hi uintptr
		if _, err := fmt.Sscanf(sc.Text(), "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
			return sc.Text()
		}
	}
	return ""
}

// receiveInFlight returns a channel with flush grace grace and a receive
// posted on it that no message comes for: in flight until Close flushes
// it.
func receiveInFlight(t *testing.T, grace time.Duration) (*Channel, Handle) {
	t.Helper()
	a, _ := internalPairWith(t, Options{FlushGrace: grace})
	mr, err := a.PD().Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mr.Close() })
	h, err := a.PostReceive(verbs.SGE{Addr: mr.Addr(), Length: 64, LKey: mr.LKey()})
	if err != nil {
		t.Fatal(err)
	}
	return a, h
}
