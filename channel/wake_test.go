package channel_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// The goroutine that polls a channel's CQ for everyone sleeps on the CQ's
// completion channel once it stops spinning. Some of the conditions it
// waits for change without a completion: a peer broken on an idle queue
// pair, a handle released by another goroutine, a post rolled back. The
// tests below put the poller to sleep first (sleepingOnCQ), then change
// the condition; before the engine woke the CQ's Wait for such changes
// (CompletionQueue.Wake), each waited until its context ended. (A post
// rolled back nudges the same way; a Drain sees its count only inside
// the post, too briefly to sleep there on purpose in a test.)

// sleepingOnCQ waits until some goroutine sleeps in a CompletionQueue's
// Wait, or fails the test when ctx ends.
func sleepingOnCQ(ctx context.Context, t *testing.T) {
	t.Helper()
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		for _, g := range strings.Split(string(buf[:n]), "\n\n") {
			if strings.Contains(g, "verbs.(*CompletionQueue).Wait(") {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no goroutine went to sleep on the CQ: %v", ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// waitResult waits for the error a waiting goroutine sends, or fails the
// test: the wait never returned (its own context is the test's, longer).
func waitResult(t *testing.T, errc <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-errc:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s still waits 10 s after its condition came true", what)
		return nil
	}
}

// TestWaitWokenByBreak: Wait for Broken returns once Break breaks the
// channel, on an idle queue pair (no doorbells, nothing in flight: the
// break flushes nothing, and no completion comes).
func TestWaitWokenByBreak(t *testing.T) {
	testWaitWokenByBreak(t, verbs.SoftDevice, verbs.SoftDevice)
}

func testWaitWokenByBreak(t *testing.T, devA, devB string) {
	a, _ := newPairOn(t, devA, devB, channel.Options{SpinPolls: channel.SpinNever})
	ctx := testCtx(t)
	errc := make(chan error, 1)
	go func() { errc <- a.ch.Wait(ctx, a.ch.Broken) }()
	sleepingOnCQ(ctx, t)
	a.ch.Break()
	if err := waitResult(t, errc, "Wait(Broken)"); err != nil {
		t.Fatalf("Wait(Broken) after Break: %v, want nil", err)
	}
}

// TestHandleWaitStaleOnRelease: a Handle.Wait that polls for everyone
// returns ErrStale when another goroutine releases the handle (against
// Handle's contract, but it must not wait on for a slot that completes no
// more).
func TestHandleWaitStaleOnRelease(t *testing.T) {
	testHandleWaitStaleOnRelease(t, verbs.SoftDevice, verbs.SoftDevice)
}

func testHandleWaitStaleOnRelease(t *testing.T, devA, devB string) {
	a, _ := newPairOn(t, devA, devB, channel.Options{SpinPolls: channel.SpinNever})
	ctx := testCtx(t)
	h, err := a.ch.PostReceive(a.sge(0, 64)) // the peer never sends
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- h.Wait(ctx) }()
	sleepingOnCQ(ctx, t)
	h.Release()
	if err := waitResult(t, errc, "Handle.Wait"); !errors.Is(err, channel.ErrStale) {
		t.Fatalf("Handle.Wait after Release: %v, want ErrStale", err)
	}
}

// TestCloseWithIdleWait: Close of a channel with one receive posted
// (flushed at once by the break) while a goroutine sleeps in Channel.Wait
// for a condition of its own. Close should take about as long as the
// flush; it waits instead for the whole FlushGrace (here an hour), or
// until the waiter's context ends: the waiter, which polls the CQ for
// everyone, dispatches the flush, goes back to sleep in the CQ before Close
// marks the channel closed, and nothing wakes it (Close woke the CQ once,
// when it broke the queue pair, before that). It is a race, which the
// poller won in 15 of 20 rounds here: the test fails at the first stall.
func TestCloseWithIdleWait(t *testing.T) {
	for round := range 20 {
		stalled := closeWithIdleWait(t)
		if stalled {
			t.Fatalf("round %d: Close still blocked 3 s later with nothing in flight: it waits (FlushGrace, 1 h) for the poller asleep on the CQ, which nothing wakes; it returned only when the Wait's own context ended", round)
		}
	}
}

func closeWithIdleWait(t *testing.T) (stalled bool) {
	a, _ := newPair(t, channel.Options{SpinPolls: channel.SpinNever, FlushGrace: time.Hour})
	_, err := a.ch.PostReceive(a.sge(0, 64)) // flushed by Close
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer wcancel()
	errc := make(chan error, 1)
	go func() { errc <- a.ch.Wait(wctx, func() bool { return false }) }()
	sleepingOnCQ(testCtx(t), t)
	done := make(chan error, 1)
	go func() { done <- a.ch.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("close: %v", err)
		}
	case <-time.After(3 * time.Second):
		stalled = true
		<-done
	}
	if err := <-errc; !errors.Is(err, channel.ErrClosed) && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Wait: %v, want ErrClosed", err)
	}
	return stalled
}
