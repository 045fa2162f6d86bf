package channel_test

import (
	"context"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/channel"
)

// What a call reports when it and other events cross: a failure a Batch
// scope's WaitAll reported, a handle it released, a blocking atomic whose
// context ended as it completed. (Found by a review of channel.)

// TestBatchWaitAllReportedFailure: an operation that failed before it
// had a slot (here: the channel is broken) is reported by an explicit
// WaitAll(h); fn handles it and returns nil. Batch's contract: it returns
// the failure of such an operation only if "no WaitAll reported" it; it
// returned it again (only WaitAll() without handles cleared them).
func TestBatchWaitAllReportedFailure(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	a.ch.Break()
	seen := false
	err := a.ch.Batch(ctx, func(bt *channel.Batch) error {
		h := bt.Write(b.buf.Remote().At(0), a.sge(0, 8))
		if werr := bt.WaitAll(h); werr != nil {
			seen = true // handled: e.g. fall back to another path
		}
		return nil
	})
	if !seen {
		t.Fatal("WaitAll(h) did not report the failed write")
	}
	if err != nil {
		t.Fatalf("Batch returned %v for a failure its WaitAll(h) already reported, want nil", err)
	}
}

// TestBatchWaitAllAfterRelease: a scope releases the handle of an
// operation whose result it read (as the scope's slot-exhaustion error
// advises), then waits for everything with WaitAll(). Every operation
// succeeded; WaitAll must return nil, not ErrStale for the released one
// (it is no failure, and no longer an operation of the scope), which it
// returned before.
func TestBatchWaitAllAfterRelease(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	var werr error
	err := a.ch.Batch(ctx, func(bt *channel.Batch) error {
		h := bt.Write(b.buf.Remote().At(0), a.sge(0, 8))
		if err := bt.Wait(h); err != nil {
			return err
		}
		h.Release()
		bt.Write(b.buf.Remote().At(8), a.sge(8, 8))
		werr = bt.WaitAll()
		return nil
	})
	if err != nil {
		t.Fatalf("batch: %v", err)
	}
	if werr != nil {
		t.Fatalf("WaitAll() after releasing a completed handle: %v, want nil (both writes succeeded)", werr)
	}
}

// TestCancelledAtomicThatCompleted: a blocking CompareSwap
// whose context ends while its (successful) completion sits in the CQ,
// not yet dispatched because the goroutine that polls for everyone is busy
// (here: it lingers in its Wait's ready condition, as a descheduled poller
// would). The call abandons the request: it breaks the channel and waits
// for the "flush", which turns out to be the successful completion; it
// reported that the request was flushed and returned no prior value,
// though the swap happened and the channel knew it: a caller that takes
// a lock with CompareSwap was told it did not get it, and the lock stayed
// taken for good. It now returns the result (the channel is broken all
// the same).
func TestCancelledAtomicThatCompleted(t *testing.T) {
	a, b := newPair(t, channel.Options{SpinPolls: channel.SpinNever})
	ctx := testCtx(t)
	word := b.word(256)
	ctx2, cancel2 := context.WithCancel(ctx)
	defer cancel2()
	var armed, done atomic.Bool
	holding := make(chan struct{})
	stack := make([]byte, 64<<10)
	errc := make(chan error, 1)
	go func() {
		errc <- a.ch.Wait(ctx, func() bool {
			if done.Load() {
				return true
			}
			if !armed.Load() || !strings.Contains(string(stack[:runtime.Stack(stack, false)]), "readyLocked") {
				return false
			}
			armed.Store(false)
			close(holding) // the poller's role is held: nothing is dispatched
			deadline := time.Now().Add(10 * time.Second)
			n := 0
			for time.Now().Before(deadline) {
				// soft0 moves requests and responses when a CQ is
				// polled: b's idle CQ does it, without dispatching
				// anything of a's. 200 rounds after the swap, the
				// CAS's successful completion waits in a's CQ
				// (checked with a print in abandon: status success).
				b.ch.Progress()
				if atomic.LoadUint64(word) == 1 {
					n++
				}
				if n == 200 {
					break
				}
				time.Sleep(50 * time.Microsecond)
			}
			cancel2() // the swap has been done: the CAS's context ends
			for !a.ch.Broken() && time.Now().Before(deadline) {
				time.Sleep(50 * time.Microsecond)
			}
			done.Store(true)
			return true
		})
	}()
	sleepingOnCQ(ctx, t)
	armed.Store(true)
	r, err := a.ch.PostReceive(a.sge(1024, 8)) // released at once: wakes the poller
	if err != nil {
		t.Fatal(err)
	}
	r.Release()
	select {
	case <-holding:
	case err := <-errc:
		t.Fatalf("the poller's Wait ended before it held the role: %v", err)
	}
	prior, err := a.ch.CompareSwap(ctx2, b.buf.Remote().At(256), 0, 1)
	if werr := <-errc; werr != nil {
		t.Fatalf("wait: %v", werr)
	}
	if got := atomic.LoadUint64(word); got != 1 {
		t.Fatalf("remote word %d, want 1: the swap did not happen", got)
	}
	if err != nil {
		t.Fatalf("CompareSwap: prior %d, %v; but the swap happened and its completion was successful (want prior 0, nil)", prior, err)
	}
}
