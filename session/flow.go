package session

import (
	"context"
	"runtime"
	"sync/atomic"
	"time"
)

// Credit-based flow control of one direction of a queue pair: the sender
// may have at most as many messages outstanding as the receiver has
// receive buffers posted, so it never meets "receiver not ready".
//
// The receiver counts the buffers it posted again (reposted, a wrapping
// 32-bit count) and tells the sender: in the header of every message it
// sends the other way (piggyback), and, when the sender may be running
// low, by an RDMA write of the count into the sender's control block
// (creditWord), which consumes no receive buffer of the sender's. A
// 4-byte aligned write is never torn.

// sendFlow is the sender's side.
type sendFlow struct {
	r    uint32        // receive buffers the peer posted at the start
	sent atomic.Uint32 // messages sent (wrapping)
	seen atomic.Uint32 // the latest reposted count learnt by piggyback
	word *uint32       // the count the peer writes into our control block
	// progress polls the completion queue of the queue pair the count
	// arrives on (channel.Progress): a provider that places remote
	// writes only when it is polled (soft0) places the count then.
	progress func() error
}

// newer reports whether wrapping count a is after b.
func newer(a, b uint32) bool { return int32(a-b) > 0 }

// reposted is the latest reposted count the peer told us.
func (f *sendFlow) reposted() uint32 {
	w, s := atomic.LoadUint32(f.word), f.seen.Load()
	if newer(w, s) {
		return w
	}
	return s
}

// learn records a piggybacked count.
func (f *sendFlow) learn(n uint32) {
	for {
		s := f.seen.Load()
		if !newer(n, s) || f.seen.CompareAndSwap(s, n) {
			return
		}
	}
}

// tryTake takes a credit if there is one.
func (f *sendFlow) tryTake() bool {
	for {
		s := f.sent.Load()
		if int32(f.r+f.reposted()-s) <= 0 {
			return false
		}
		if f.sent.CompareAndSwap(s, s+1) {
			return true
		}
	}
}

// has reports whether a credit is free.
func (f *sendFlow) has() bool { return int32(f.r+f.reposted()-f.sent.Load()) > 0 }

// take takes a credit, waiting for one until ctx or the session ends
// (done).
func (f *sendFlow) take(ctx context.Context, done <-chan struct{}) error {
	for {
		if err := f.wait(ctx, done); err != nil {
			return err
		}
		if f.tryTake() {
			return nil
		}
	}
}

// wait waits until a credit is free (without taking it), until ctx or
// the session ends (done). Credits come back without a completion (by
// RDMA write), so a waiting sender polls its control block: it yields
// first, then sleeps for intervals that grow to a millisecond, and
// drives the progress of its queue pair (progress) before each look.
// Without that drive, soft0 placed the count only when its connection's
// reader took over from the pollers that had stopped (up to two
// pollerGrace later): a fifth of the 64 KiB messages of
// BenchmarkXprocBandwidth/shm/session waited for a credit, 0.52 ms on
// average.
func (f *sendFlow) wait(ctx context.Context, done <-chan struct{}) error {
	for i := 0; i < 64; i++ {
		if f.has() || f.drive() {
			return nil
		}
		// A yield may take a whole time slice of the processor when
		// other threads compete for it: 64 of them kept cancelled sends
		// and Close waiting about a second beside two CPU-bound loops.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			return errSessionEnded
		default:
		}
		runtime.Gosched()
	}
	d := 10 * time.Microsecond
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		if f.has() || f.drive() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			return errSessionEnded
		case <-t.C:
		}
		d = min(2*d, time.Millisecond)
		t.Reset(d)
	}
}

// drive drives the progress of the queue pair the count arrives on and
// reports whether a credit is free then.
func (f *sendFlow) drive() bool {
	if f.progress == nil {
		return false
	}
	f.progress()
	return f.has()
}

// recvFlow is the receiver's side.
type recvFlow struct {
	r          uint32
	reposted   atomic.Uint32 // buffers posted again (wrapping)
	consumed   atomic.Uint32 // messages received
	advertised atomic.Uint32 // the latest count the sender was told
}

// told records that the sender was told count n.
func (f *recvFlow) told(n uint32) {
	for {
		a := f.advertised.Load()
		if !newer(n, a) || f.advertised.CompareAndSwap(a, n) {
			return
		}
	}
}

// shouldWrite reports whether the sender must be told the reposted
// count by a write now: there is something new to tell, and the sender
// may be low on credits (fewer than half of the buffers, as far as we
// know: the count must reach a sender that streams before it runs dry)
// or a quarter of the buffers were posted again since it was last told.
//
// The second rule is for a receiver that is behind: what it has not
// consumed yet still counts as the sender's credits in its view, so with
// as many messages in flight as buffers the first rule wrote only once
// half of the buffers were consumed since the last count, and the sender
// waited for every such half (on a timer, since the count comes without a
// completion). BenchmarkXprocBandwidth/unix with 16 buffers and 16
// messages in flight: 0.74-0.91 GB/s with the first rule alone, 3.4-3.6
// with both (64 buffers: unchanged). It costs a write per quarter of the
// buffers in a stream that goes one way, whose reverse direction carries
// no counts.
func (f *recvFlow) shouldWrite() (uint32, bool) {
	rep, adv := f.reposted.Load(), f.advertised.Load()
	if rep == adv {
		return rep, false
	}
	credits := int32(f.r + adv - f.consumed.Load())
	return rep, credits < int32(max(f.r/2, 1)) || rep-adv >= max(f.r/4, 1)
}
