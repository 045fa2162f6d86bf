package channel_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// TestOperationErrors runs every kind of failing operation on a fresh
// pair of channels and checks the status the requester gets, whether the
// channel is broken afterwards, and that the peer's memory outside the
// target was not touched.
func TestOperationErrors(t *testing.T) {
	const size = 64 << 10
	tests := []struct {
		name   string
		opts   channel.Options
		run    func(ctx context.Context, a, b *side) error
		status verbs.Status // of the requester's completion; 0: no completion error
		posted bool         // false: the post itself is refused (no completion)
		broken bool
	}{
		{name: "write with a wrong rkey", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				r := b.buf.Remote()
				r.RKey ^= 0x5a5a
				return a.ch.Write(ctx, r.At(0), a.sge(0, 8))
			}},
		{name: "write past the end of the region", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				return a.ch.Write(ctx, b.buf.Remote().At(size-4), a.sge(0, 8))
			}},
		{name: "read past the end of the region", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				return a.ch.Read(ctx, b.buf.Remote().At(size), a.sge(0, 1))
			}},
		{name: "read before the region", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				return a.ch.Read(ctx, verbs.RemoteAddr{Addr: b.buf.Remote().Addr - 8, RKey: b.buf.RKey()}, a.sge(0, 8))
			}},
		{name: "fetch-and-add with a wrong rkey", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				r := b.buf.Remote()
				r.RKey++
				_, err := a.ch.FetchAdd(ctx, r.At(0), 1)
				return err
			}},
		{name: "write to a region without remote write", status: verbs.StatusRemAccessErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				ro, err := b.pd.Alloc(4096, verbs.AccessRemoteRead)
				if err != nil {
					return err
				}
				defer ro.Close()
				return a.ch.Write(ctx, ro.Remote().At(0), a.sge(0, 8))
			}},
		{name: "local buffer outside its region", status: verbs.StatusLocProtErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				// 8 bytes from 4 before the end: SGE would refuse it.
				sge := verbs.SGE{Addr: a.buf.Addr() + size - 4, Length: 8, LKey: a.buf.LKey()}
				return a.ch.Write(ctx, b.buf.Remote().At(0), sge)
			}},
		{name: "send without a receive and no RNR retries", status: verbs.StatusRNRRetryExcErr, posted: true, broken: true,
			opts: channel.Options{QP: verbs.QPSpec{RNRRetry: -1}},
			run: func(ctx context.Context, a, b *side) error {
				return a.ch.Send(ctx, a.sge(0, 8))
			}},
		{name: "send larger than the receive buffer", status: verbs.StatusRemInvReqErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				h, err := b.ch.PostReceive(b.sge(0, 4))
				if err != nil {
					return err
				}
				defer h.Release()
				serr := a.ch.Send(ctx, a.sge(0, 8))
				// The receiver gets a local length error.
				var ce *verbs.CompletionError
				if err := h.Wait(ctx); !errors.As(err, &ce) || ce.Status != verbs.StatusLocLenErr {
					return fmt.Errorf("receiver: %v, want a local length error (sender: %w)", err, serr)
				}
				return serr
			}},
		{name: "peer closed", status: verbs.StatusRetryExcErr, posted: true, broken: true,
			run: func(ctx context.Context, a, b *side) error {
				if err := b.ch.Close(); err != nil {
					return err
				}
				return a.ch.Write(ctx, b.buf.Remote().At(0), a.sge(0, 8))
			}},
		{name: "misaligned atomic is refused", posted: false, broken: false,
			run: func(ctx context.Context, a, b *side) error {
				_, err := a.ch.CompareSwap(ctx, b.buf.Remote().At(4), 0, 1)
				return err
			}},
		{name: "too many SGEs is refused", posted: false, broken: false,
			run: func(ctx context.Context, a, b *side) error {
				sgl := make([]verbs.SGE, a.ch.QueuePair().Cap().MaxSendSGE+1)
				for i := range sgl {
					sgl[i] = a.sge(i, 1)
				}
				return a.ch.Write(ctx, b.buf.Remote().At(0), sgl...)
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newPair(t, tc.opts)
			ctx := testCtx(t)
			for i := range b.buf.Bytes() {
				b.buf.Bytes()[i] = 0xee
			}
			err := tc.run(ctx, a, b)
			var oe *channel.OpError
			if !errors.As(err, &oe) || oe.Peer != 0 {
				t.Fatalf("error %v, want a *channel.OpError for peer 0", err)
			}
			var ce *verbs.CompletionError
			if tc.posted {
				if !errors.As(err, &ce) || ce.Status != tc.status {
					t.Fatalf("error %v, want completion status %v", err, tc.status)
				}
			} else {
				var ve *verbs.OpError
				if errors.As(err, &ce) || !errors.As(err, &ve) {
					t.Fatalf("error %v, want a refused post (*verbs.OpError), no completion", err)
				}
			}
			if got := errors.Is(a.ch.Err(), channel.ErrBroken); got != tc.broken {
				t.Errorf("broken = %v (Err() = %v), want %v", got, a.ch.Err(), tc.broken)
			}
			if tc.broken {
				// Broken for good: later operations fail at once with the cause.
				err := a.ch.Write(ctx, b.buf.Remote().At(0), a.sge(0, 1))
				if !errors.Is(err, channel.ErrBroken) || !errors.As(err, &ce) || ce.Status != tc.status {
					t.Errorf("write on the broken channel: %v, want ErrBroken wrapping the first failure", err)
				}
			} else if err := a.ch.Write(ctx, b.buf.Remote().At(0), a.sge(0, 1)); err != nil {
				t.Errorf("the channel does not work after a refused post: %v", err)
			}
			if tc.posted && tc.name != "peer closed" {
				// No failed operation wrote to the peer's memory.
				for i, c := range b.buf.Bytes() {
					if c != 0xee {
						t.Fatalf("peer byte %d = %#x: a failed operation wrote to the peer", i, c)
					}
				}
			}
		})
	}
}

// TestCancellation cancels every kind of blocking call that can wait for
// the peer, and calls every operation with a context that has already
// ended.
func TestCancellation(t *testing.T) {
	blocking := []struct {
		name string
		run  func(ctx context.Context, a, b *side) error
	}{
		{"receive, nobody sends", func(ctx context.Context, a, b *side) error {
			_, err := b.ch.Receive(ctx, b.sge(0, 8))
			return err
		}},
		{"send, no receive posted", func(ctx context.Context, a, b *side) error {
			return a.ch.Send(ctx, a.sge(0, 8))
		}},
		{"send with immediate, no receive posted", func(ctx context.Context, a, b *side) error {
			return a.ch.SendImm(ctx, 7, a.sge(0, 8))
		}},
		{"write with immediate, no receive posted", func(ctx context.Context, a, b *side) error {
			return a.ch.WriteImm(ctx, b.buf.Remote().At(0), 7, a.sge(0, 8))
		}},
	}
	for _, tc := range blocking {
		t.Run("deadline/"+tc.name, func(t *testing.T) {
			a, b := newPair(t, channel.Options{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
			defer cancel()
			err := tc.run(ctx, a, b)
			if !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, channel.ErrBroken) {
				t.Fatalf("%v, want ErrTimeout, DeadlineExceeded and ErrBroken", err)
			}
			broken := a.ch
			if tc.name == "receive, nobody sends" {
				broken = b.ch
			}
			if !errors.Is(broken.Err(), channel.ErrBroken) {
				t.Errorf("Err() = %v, want ErrBroken", broken.Err())
			}
			// The request was flushed: nothing is left in flight.
			if err := broken.Drain(testCtx(t)); err != nil {
				t.Errorf("drain: %v", err)
			}
		})
		t.Run("cancel/"+tc.name, func(t *testing.T) {
			a, b := newPair(t, channel.Options{})
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(20*time.Millisecond, cancel)
			if err := tc.run(ctx, a, b); !errors.Is(err, context.Canceled) || !errors.Is(err, verbs.ErrTimeout) {
				t.Fatalf("%v, want Canceled and ErrTimeout", err)
			}
		})
	}

	ended, cancel := context.WithCancel(context.Background())
	cancel()
	a, b := newPair(t, channel.Options{})
	ops := []struct {
		name string
		run  func() error
	}{
		{"send", func() error { return a.ch.Send(ended, a.sge(0, 1)) }},
		{"send with immediate", func() error { return a.ch.SendImm(ended, 1, a.sge(0, 1)) }},
		{"receive", func() error { _, err := a.ch.Receive(ended, a.sge(0, 1)); return err }},
		{"write", func() error { return a.ch.Write(ended, b.buf.Remote().At(0), a.sge(0, 1)) }},
		{"write with immediate", func() error { return a.ch.WriteImm(ended, b.buf.Remote().At(0), 1, a.sge(0, 1)) }},
		{"read", func() error { return a.ch.Read(ended, b.buf.Remote().At(0), a.sge(0, 1)) }},
		{"compare-and-swap", func() error { _, err := a.ch.CompareSwap(ended, b.buf.Remote().At(0), 0, 1); return err }},
		{"fetch-and-add", func() error { _, err := a.ch.FetchAdd(ended, b.buf.Remote().At(0), 1); return err }},
		{"batch wait", func() error {
			return a.ch.Batch(ended, func(bt *channel.Batch) error {
				return bt.Wait(bt.Write(b.buf.Remote().At(0), a.sge(0, 1)))
			})
		}},
	}
	for _, tc := range ops {
		t.Run("ended/"+tc.name, func(t *testing.T) {
			if err := tc.run(); !errors.Is(err, context.Canceled) {
				t.Errorf("%v, want context.Canceled", err)
			}
		})
	}
	// Calls with an ended context never post: the channel is fine.
	if err := a.ch.Write(testCtx(t), b.buf.Remote().At(0), a.sge(0, 1)); err != nil {
		t.Errorf("write after the ended calls: %v", err)
	}
}

// TestPeerClosedWhileBlocked: a send that waits for the peer's receive
// fails when the peer closes its channel.
func TestPeerClosedWhileBlocked(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	errc := make(chan error, 1)
	go func() { errc <- a.ch.Send(testCtx(t), a.sge(0, 8)) }() // no receive: RNR retries
	time.Sleep(20 * time.Millisecond)
	if err := b.ch.Close(); err != nil {
		t.Fatal(err)
	}
	err := <-errc
	var ce *verbs.CompletionError
	if !errors.As(err, &ce) || !errors.Is(a.ch.Err(), channel.ErrBroken) {
		t.Fatalf("send while the peer closed: %v (Err() %v), want a completion error and a broken channel", err, a.ch.Err())
	}
}

// TestMultiBatchPanicPollsEverything: a panic inside a MultiChannel batch
// still polls every operation posted to every peer before it propagates.
func TestMultiBatchPanicPollsEverything(t *testing.T) {
	rs := newGroup(t, 3)
	ctx := testCtx(t)
	r := rs[0]
	var hs []channel.Handle
	func() {
		defer func() {
			if v := recover(); v != "boom" {
				t.Errorf("recovered %v, want the scope's panic", v)
			}
		}()
		r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
			for i := range 32 {
				p := 1 + i%2
				hs = append(hs, b.Peer(p).Write(rs[p].buf.Remote().At(uint64(8*i)), r.sge(8*i, 8)))
			}
			if err := b.Flush(); err != nil {
				return err
			}
			panic("boom")
		})
	}()
	for i, h := range hs {
		if err := h.Wait(ctx); !errors.Is(err, channel.ErrStale) {
			t.Fatalf("handle %d survived the scope: %v", i, err)
		}
	}
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := r.mc.Drain(short); err != nil {
		t.Errorf("operations left in flight after the panic: %v", err)
	}
	if err := r.mc.Err(); err != nil {
		t.Errorf("a peer broke: %v", err)
	}
}

// TestCollectiveFailureNamesPeer: a collective in which one peer's
// operation fails reports that peer and completes the others.
func TestCollectiveFailureNamesPeer(t *testing.T) {
	rs := newGroup(t, 4)
	ctx := testCtx(t)
	r := rs[0]
	copy(r.buf.Bytes(), "payload!")
	dsts := make([]verbs.RemoteAddr, 4)
	bufs := make([]verbs.SGE, 4)
	for j := 1; j < 4; j++ {
		dsts[j] = rs[j].buf.Remote().At(100)
		bufs[j] = r.sge(0, 8)
	}
	dsts[2].RKey ^= 0xff
	err := r.mc.ScatterWrite(ctx, nil, dsts, bufs)
	var oe *channel.OpError
	var ce *verbs.CompletionError
	if !errors.As(err, &oe) || oe.Peer != 2 || !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr {
		t.Fatalf("ScatterWrite = %v, want a remote access error of peer 2", err)
	}
	for _, j := range []int{1, 3} {
		if got := string(rs[j].buf.Bytes()[100:108]); got != "payload!" {
			t.Errorf("peer %d got %q", j, got)
		}
	}
	if !errors.Is(r.mc.Peer(2).Err(), channel.ErrBroken) || r.mc.Peer(1).Err() != nil || r.mc.Peer(3).Err() != nil {
		t.Errorf("peer errors: 1 %v, 2 %v, 3 %v; want only 2 broken", r.mc.Peer(1).Err(), r.mc.Peer(2).Err(), r.mc.Peer(3).Err())
	}
	if err := r.mc.Err(); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("MultiChannel.Err() = %v", err)
	}
	// The other peers still work.
	if err := r.mc.ScatterWrite(ctx, []int{1, 3}, dsts[1:2], bufs[1:2]); err == nil {
		// lists of 1 entry for 2 peers: refused
		t.Error("mismatched lists accepted")
	}
	if err := r.mc.ScatterWrite(ctx, []int{1, 3}, []verbs.RemoteAddr{dsts[1], dsts[3]}, []verbs.SGE{bufs[1], bufs[3]}); err != nil {
		t.Errorf("scatter write to the healthy peers: %v", err)
	}
}
