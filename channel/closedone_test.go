package channel_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// TestDoneAfterClose checks that every handle a Post method returned,
// posted while another goroutine closes the channel, reports Done once
// Close has returned: after Close nothing polls the completion queue, so
// an operation that was still counted in flight would leave its handle
// undone forever (and a caller looping on Done hung). Each operation
// either completed, or was flushed, or ended with the channel. With a
// flush grace of a microsecond, Close stops waiting for the flushes
// before they come (as with a device that does not flush in time); with
// the default, posts race the queue pair's break.
func TestDoneAfterClose(t *testing.T) {
	for _, tc := range []struct {
		name   string
		grace  time.Duration
		rounds int
	}{
		{"flush grace 1µs", time.Microsecond, 50},
		{"default flush grace", 0, 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testDoneAfterClose(t, verbs.SoftDevice, verbs.SoftDevice, tc.grace, tc.rounds)
		})
	}
}

func testDoneAfterClose(t *testing.T, devA, devB string, grace time.Duration, rounds int) {
	for r := range rounds {
		a, b := newPairOn(t, devA, devB, channel.Options{MaxOutstanding: 64, FlushGrace: grace})
		var (
			mu      sync.Mutex
			handles []channel.Handle
			wg      sync.WaitGroup
		)
		start := make(chan struct{})
		var posted sync.WaitGroup // each worker posted a few: some are in flight at Close
		posted.Add(4)
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				for i := 0; ; i++ {
					if i == 8 {
						posted.Done()
					}
					off := 1024*w + 64*(i%16)
					h, err := a.ch.PostWrite(b.buf.Remote().At(uint64(off)), a.sge(off, 64))
					if errors.Is(err, verbs.ErrQueueFull) {
						a.ch.Progress()
						continue
					}
					if err != nil {
						if i < 8 {
							posted.Done()
						}
						return // closed or broken
					}
					mu.Lock()
					handles = append(handles, h)
					mu.Unlock()
				}
			}()
		}
		close(start)
		posted.Wait()
		if err := a.ch.Close(); err != nil {
			t.Fatalf("round %d: close: %v", r, err)
		}
		wg.Wait()
		undone := 0
		mu.Lock()
		defer mu.Unlock()
		for _, h := range handles {
			if !h.Done() {
				undone++
				continue
			}
			if err := h.Err(); err != nil && !errors.Is(err, channel.ErrClosed) && !errors.Is(err, channel.ErrBroken) {
				t.Errorf("round %d: an operation ended by Close failed with %v, want nil, ErrClosed or ErrBroken", r, err)
			}
		}
		if undone > 0 {
			t.Fatalf("round %d: %d of %d handles posted while the channel closed do not report Done after Close returned", r, undone, len(handles))
		}
		for _, h := range handles {
			h.Release()
		}
	}
}

// TestCloseWaitsForLatePoller: Close gives up waiting for a poller still
// inside the completion queue after the flush grace, closes the queue and
// then waits (boundedly) for that poller to leave, so that the scratch
// memory is freed before Close returns and the protection domain closes
// right after it. Before, the poller freed it when it left, after Close
// returned, and closing the PD failed meanwhile ("still in use by 1
// object(s): memory region"; TestDoneAfterClose under load).
func TestCloseWaitsForLatePoller(t *testing.T) {
	a, _ := newPair(t, channel.Options{FlushGrace: time.Microsecond})
	inside := make(chan struct{})
	calls := 0
	done := make(chan error, 1)
	go func() {
		done <- a.ch.Wait(testCtx(t), func() bool {
			// Wait looks at its condition on entry, at the top of its
			// loop, then as the poller, after its poll: the third look
			// holds the right to poll (a poller descheduled inside the
			// CQ).
			if calls++; calls == 3 {
				close(inside)
				time.Sleep(100 * time.Millisecond)
				return true
			}
			return false
		})
	}()
	<-inside
	if err := a.ch.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.buf.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.pd.Close(); err != nil {
		t.Fatalf("close pd right after the channel's Close: %v", err)
	}
	<-done // nil or ErrClosed: what matters is that it returns
}
