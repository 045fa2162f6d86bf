package channel_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// More adversarial tests (see adversarial_test.go for the conventions:
// deadlines are hang guards, settle only makes an interleaving likely).

// remote returns the address of off in s.buf, for the peer's one-sided
// operations.
func (s *side) remote(off int) verbs.RemoteAddr {
	return verbs.RemoteAddr{Addr: s.buf.Addr() + uint64(off), RKey: s.buf.RKey()}
}

// TestAdv2BatchWaitsForHandlesOfAnotherChannel: a Batch of one channel
// waits (Wait, WaitAll, WaitAny) for the Handle of a receive posted on
// another channel, whose message has arrived: the wait polls that
// channel's completion queue, and returns the receive. (WaitAll and
// WaitAny polled the scope's own completion queue only, where the
// completion never comes, and slept until the context ended.) WaitAny
// of handles in flight on two channels cannot poll both: it fails at
// once with ErrNotSupported.
func TestAdv2BatchWaitsForHandlesOfAnotherChannel(t *testing.T) {
	waits := []struct {
		name string
		wait func(b *channel.Batch, h channel.Handle) error
	}{
		{"Wait", func(b *channel.Batch, h channel.Handle) error { return b.Wait(h) }},
		{"WaitAll", func(b *channel.Batch, h channel.Handle) error { return b.WaitAll(h) }},
		{"WaitAny", func(b *channel.Batch, h channel.Handle) error {
			i, err := b.WaitAny(h)
			if err == nil && i != 0 {
				return errors.New("WaitAny returned another index")
			}
			return err
		}},
	}
	for _, spin := range []int{channel.SpinNever, channel.SpinAdaptive} {
		for _, w := range waits {
			t.Run(fmt.Sprintf("%s/spin%d", w.name, spin), func(t *testing.T) {
				opts := channel.Options{SpinPolls: spin}
				x, _ := newPair(t, opts)
				u, v := newPair(t, opts)
				ctx := guard(t, 20*time.Second)
				h, err := u.ch.PostReceive(u.sge(0, 8))
				if err != nil {
					t.Fatal(err)
				}
				defer h.Release()
				// The send completes when the message landed: its
				// receive's completion waits in u's completion queue.
				if err := v.ch.Send(ctx, v.sge(0, 8)); err != nil {
					t.Fatal(err)
				}
				err = x.ch.Batch(ctx, func(b *channel.Batch) error { return w.wait(b, h) })
				if err != nil {
					t.Fatalf("waiting in a batch of another channel: %v", err)
				}
				if got := h.Received(); got.Len != 8 {
					t.Fatalf("received %+v, want 8 bytes", got)
				}
			})
		}
	}
	t.Run("WaitAnyOfTwoChannels", func(t *testing.T) {
		x, _ := newPair(t, channel.Options{})
		u, _ := newPair(t, channel.Options{})
		ctx := guard(t, 20*time.Second)
		hx, err := x.ch.PostReceive(x.sge(0, 8))
		if err != nil {
			t.Fatal(err)
		}
		defer hx.Release()
		hu, err := u.ch.PostReceive(u.sge(0, 8))
		if err != nil {
			t.Fatal(err)
		}
		defer hu.Release()
		err = x.ch.Batch(ctx, func(b *channel.Batch) error {
			_, err := b.WaitAny(hx, hu)
			return err
		})
		if !errors.Is(err, verbs.ErrNotSupported) || errors.Is(err, verbs.ErrTimeout) {
			t.Fatalf("WaitAny of two channels' handles: %v, want ErrNotSupported at once", err)
		}
	})
}

// TestAdv2BatchWaitsAfterReleasingItsHandles: a scope that released the
// handles of its completed operations (as the slot-exhaustion error
// advises) holds no slot; when other goroutines hold every slot, its
// next operation waits for one rather than failing at once with
// ErrQueueFull, claiming the scope held them all (it counted released
// handles).
func TestAdv2BatchWaitsAfterReleasingItsHandles(t *testing.T) {
	const slots = 2
	x, y := newPair(t, channel.Options{MaxOutstanding: slots})
	ctx := guard(t, 20*time.Second)
	var wg sync.WaitGroup
	defer wg.Wait()
	err := x.ch.Batch(ctx, func(b *channel.Batch) error {
		for range slots {
			h := b.Write(y.remote(0), x.sge(0, 8))
			if err := b.Wait(h); err != nil {
				return err
			}
			h.Release()
		}
		// Receives posted outside the scope take every slot; another
		// goroutine releases them once the peer's messages came.
		var hs []channel.Handle
		for range slots {
			h, err := x.ch.PostReceive(x.sge(64, 8))
			if err != nil {
				return err
			}
			hs = append(hs, h)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			settle()
			for _, h := range hs {
				if err := y.ch.Send(ctx, y.sge(0, 8)); err != nil {
					t.Error(err)
				}
				if err := h.Wait(ctx); err != nil {
					t.Error(err)
				}
				h.Release()
			}
		}()
		return b.Wait(b.Write(y.remote(8), x.sge(0, 8)))
	})
	if err != nil {
		t.Fatalf("a write of a scope that holds no slot: %v", err)
	}
}

// TestAdv2ReleaseWhileAnotherWaits: a Handle released by one goroutine
// while another waits for it (against Handle's contract, a careless
// hand-off): the waiter returns ErrStale, whether it polls or sleeps,
// and whether the operation then completes and its slot serves a new
// one. It slept until its context ended, also once the operation had
// completed; the new operation completes with its own message.
func TestAdv2ReleaseWhileAnotherWaits(t *testing.T) {
	for _, spin := range []int{channel.SpinNever, channel.SpinAdaptive, channel.SpinAlways} {
		for _, reuse := range []bool{false, true} {
			t.Run(fmt.Sprintf("spin%d/reuse=%v", spin, reuse), func(t *testing.T) {
				x, y := newPair(t, channel.Options{SpinPolls: spin, MaxOutstanding: 1})
				ctx := guard(t, 20*time.Second)
				h, err := x.ch.PostReceive(x.sge(0, 8))
				if err != nil {
					t.Fatal(err)
				}
				waited := make(chan error, 1)
				go func() { waited <- h.Wait(ctx) }()
				settle()
				h.Release()
				y.put(0, 1)
				if err := y.ch.Send(ctx, y.sge(0, 8)); err != nil {
					t.Fatal(err)
				}
				if reuse {
					// The only slot comes back with the detached
					// receive's completion: wait for it.
					if err := x.ch.Drain(ctx); err != nil {
						t.Fatal(err)
					}
					h2, err := x.ch.PostReceive(x.sge(8, 8))
					if err != nil {
						t.Fatal(err)
					}
					y.put(0, 2)
					if err := y.ch.Send(ctx, y.sge(0, 8)); err != nil {
						t.Fatal(err)
					}
					if err := h2.Wait(ctx); err != nil {
						t.Fatalf("the slot's next operation: %v", err)
					}
					h2.Release()
					if got := x.get(8); got != 2 {
						t.Fatalf("the slot's next receive got %d, want 2", got)
					}
				}
				if err := <-waited; !errors.Is(err, channel.ErrStale) {
					t.Fatalf("Wait of a handle another goroutine released: %v, want ErrStale", err)
				}
			})
		}
	}
}

// TestAdv2PostsDoNotWaitBehindAFullQueue: the send queue is full (a send
// waits for a receive the peer never posts), and a blocking send waits
// for room in it. Meanwhile the Post methods, which never block, fail at
// once with ErrQueueFull, and calls whose contexts end wait no longer
// than their contexts: the waiting send held the peer's posting lock
// for as long as it waited, and every other post to the peer waited for
// the lock, past its own context (here until the test's end).
func TestAdv2PostsDoNotWaitBehindAFullQueue(t *testing.T) {
	calls := []struct {
		name string
		call func(ctx context.Context, x, y *side) error
		want error
	}{
		{"PostWrite", func(_ context.Context, x, y *side) error {
			h, err := x.ch.PostWrite(y.remote(0), x.sge(0, 8))
			h.Release()
			return err
		}, verbs.ErrQueueFull},
		{"PostWriteUnsignaled", func(_ context.Context, x, y *side) error {
			return x.ch.PostWriteUnsignaled(y.remote(0), x.sge(0, 8))
		}, verbs.ErrQueueFull},
		{"Write", func(ctx context.Context, x, y *side) error {
			return x.ch.Write(ctx, y.remote(0), x.sge(0, 8))
		}, verbs.ErrTimeout},
		{"WriteInline", func(ctx context.Context, x, y *side) error {
			return x.ch.WriteInline(ctx, y.remote(0), []byte{1})
		}, verbs.ErrTimeout},
		{"Batch", func(ctx context.Context, x, y *side) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error { return b.Wait(b.Write(y.remote(0), x.sge(0, 8))) })
		}, verbs.ErrTimeout},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			x, y := newPair(t, channel.Options{QP: verbs.QPSpec{MaxSendWR: 1}})
			// The send that fills the queue, and the blocking send that
			// waits for room; both end when the test does.
			h, err := x.ch.PostSend(x.sge(0, 8))
			if err != nil {
				t.Fatal(err)
			}
			defer h.Release()
			long, cancel := context.WithCancel(context.Background())
			sent := make(chan error, 1)
			go func() { sent <- x.ch.Send(long, x.sge(0, 8)) }()
			defer func() {
				cancel()
				<-sent
			}()
			settle()
			ctx, cancelCall := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancelCall()
			done := make(chan error, 1)
			go func() { done <- c.call(ctx, x, y) }()
			select {
			case err := <-done:
				if !errors.Is(err, c.want) {
					t.Fatalf("%s: %v, want %v", c.name, err, c.want)
				}
			case <-guard(t, 10*time.Second).Done():
				cancel() // lets the call go on, to end the test
				t.Fatalf("%s waited behind a send waiting for room in the queue", c.name)
			}
		})
	}
}

// TestAdv2BatchGoexitDropsQueued: a Batch function ended by
// runtime.Goexit (t.FailNow, t.Fatal, t.Skip in a test) after queueing
// operations: as after a panic, the operations never flushed are
// dropped, not posted. They were posted, as after a normal return, and
// the exiting goroutine waited for them: here a send that no receive
// takes, until the context ended, which then broke the channel.
func TestAdv2BatchGoexitDropsQueued(t *testing.T) {
	x, _ := newPair(t, channel.Options{})
	ctx := guard(t, 10*time.Second)
	var h channel.Handle
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		x.ch.Batch(ctx, func(b *channel.Batch) error {
			h = b.Send(x.sge(0, 8))
			runtime.Goexit()
			return nil
		})
	}()
	select {
	case <-exited:
	case <-ctx.Done():
		t.Fatal("the goroutine ending a Batch with runtime.Goexit waited for its unposted send")
	}
	if err := x.ch.Err(); err != nil {
		t.Fatalf("the channel after a Batch ended by runtime.Goexit: %v", err)
	}
	if n := x.ch.Posted(); n != 0 {
		t.Fatalf("%d requests posted by a Batch ended by runtime.Goexit before it flushed them", n)
	}
	if err := h.Wait(ctx); !errors.Is(err, channel.ErrStale) {
		t.Fatalf("the dropped send's handle: %v, want ErrStale", err)
	}
}

// TestAdv2FailedConnectFlushesReceives: receives are posted before
// Connect (as allowed: a Handle, and a blocking Receive waiting in
// another goroutine), and Connect fails on a malformed endpoint (a
// stranger's, in an exchange). The channel is broken, and so are its
// receives: they complete with the flush, and Drain finds nothing in
// flight. They stayed posted on a queue pair left in INIT, and their
// waits slept until their contexts ended (forever without a deadline)
// although the channel said it was broken.
func TestAdv2FailedConnectFlushesReceives(t *testing.T) {
	bad := func(t *testing.T) verbs.Endpoint {
		ep, err := newSide(t, channel.Options{}).ch.Endpoint()
		if err != nil {
			t.Fatal(err)
		}
		ep.MTU = 3 << 5 // no such MTU
		return ep
	}
	endpoints := []struct {
		name string
		ep   func(t *testing.T) verbs.Endpoint
	}{
		{"zero", func(*testing.T) verbs.Endpoint { return verbs.Endpoint{} }},
		{"bad MTU", bad},
	}
	for _, e := range endpoints {
		t.Run(e.name, func(t *testing.T) {
			x := newSide(t, channel.Options{})
			ctx := guard(t, 10*time.Second)
			h, err := x.ch.PostReceive(x.sge(0, 8))
			if err != nil {
				t.Fatal(err)
			}
			defer h.Release()
			received := make(chan error, 1)
			go func() {
				_, err := x.ch.Receive(ctx, x.sge(8, 8))
				received <- err
			}()
			settle()
			if err := x.ch.Connect(e.ep(t)); err == nil {
				t.Fatal("Connect to a malformed endpoint succeeded")
			}
			if err := x.ch.Err(); !errors.Is(err, channel.ErrBroken) {
				t.Fatalf("Err after a failed Connect: %v, want ErrBroken", err)
			}
			if err := h.Wait(ctx); err == nil || errors.Is(err, verbs.ErrTimeout) {
				t.Fatalf("a receive posted before a failed Connect: %v, want its flush", err)
			}
			if err := <-received; !errors.Is(err, channel.ErrBroken) || errors.Is(err, verbs.ErrTimeout) {
				t.Fatalf("a blocking Receive waiting when Connect failed: %v, want ErrBroken", err)
			}
			if err := x.ch.Drain(ctx); err != nil {
				t.Fatalf("Drain after a failed Connect: %v", err)
			}
		})
	}
}

// TestAdv2WaitReadyPanics: the ready function of Channel.Wait panics
// (at its first call, or a later one: one of them runs while the
// waiting goroutine polls for everyone), and the caller recovers. The
// channel goes on working: a write completes, and Close frees
// everything (newPair's leak check). The goroutine that polled kept the
// poller's role through the panic: every later wait slept for
// completions nobody polled, the write timed out and broke the channel,
// and Close could not free the scratch memory.
func TestAdv2WaitReadyPanics(t *testing.T) {
	for _, spin := range []int{channel.SpinNever, channel.SpinAdaptive, channel.SpinAlways, 4} {
		for at := 1; at <= 4; at++ {
			t.Run(fmt.Sprintf("spin%d/call%d", spin, at), func(t *testing.T) {
				x, y := newPair(t, channel.Options{SpinPolls: spin})
				ctx := guard(t, 10*time.Second)
				calls := 0
				var recovered any
				func() {
					defer func() { recovered = recover() }()
					// A condition that never holds: the wait ends with
					// its context, having called ready a few times.
					wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
					defer cancel()
					x.ch.Wait(wctx, func() bool {
						if calls++; calls == at {
							panic("ready panics")
						}
						return false
					})
				}()
				if recovered == nil {
					t.Fatalf("Wait returned without calling ready %d times", at)
				}
				if err := x.ch.Write(ctx, y.remote(0), x.sge(0, 8)); err != nil {
					t.Fatalf("a write after a ready function panicked: %v", err)
				}
			})
		}
	}
}

// TestAdv2WaitForQueuedOperation: a Batch operation is queued, not yet
// posted, and is waited for by something that does not post the
// Batch's queue: Handle.Wait (instead of Batch.Wait) inside the scope,
// Handle.Poll, and the waits of a nested scope. Nothing would ever
// complete it: each fails at once with ErrNotPosted (they slept until
// their contexts ended, forever without a deadline), the handle stays
// valid, and the Batch's own wait then posts it and it completes.
func TestAdv2WaitForQueuedOperation(t *testing.T) {
	waits := []struct {
		name string
		wait func(ctx context.Context, x *side, h channel.Handle) error
	}{
		{"Handle.Wait", func(ctx context.Context, _ *side, h channel.Handle) error { return h.Wait(ctx) }},
		{"Handle.Poll", func(ctx context.Context, _ *side, h channel.Handle) error {
			for ctx.Err() == nil {
				if done, err := h.Poll(); err != nil || done {
					return err
				}
				runtime.Gosched()
			}
			return fmt.Errorf("polled until the hang guard: %w", verbs.ErrTimeout)
		}},
		{"nested Wait", func(ctx context.Context, x *side, h channel.Handle) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error { return b.Wait(h) })
		}},
		{"nested WaitAll", func(ctx context.Context, x *side, h channel.Handle) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error { return b.WaitAll(h) })
		}},
		{"nested WaitAny", func(ctx context.Context, x *side, h channel.Handle) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error { _, err := b.WaitAny(h); return err })
		}},
	}
	for _, w := range waits {
		t.Run(w.name, func(t *testing.T) {
			x, y := newPair(t, channel.Options{})
			ctx := guard(t, 10*time.Second)
			x.put(0, 7)
			err := x.ch.Batch(ctx, func(b *channel.Batch) error {
				h := b.Write(y.remote(0), x.sge(0, 8))
				if err := w.wait(ctx, x, h); !errors.Is(err, channel.ErrNotPosted) || errors.Is(err, verbs.ErrTimeout) {
					t.Errorf("%s of a queued operation: %v, want ErrNotPosted at once", w.name, err)
				}
				return b.Wait(h)
			})
			if err != nil {
				t.Fatal(err)
			}
			if got := y.get(0); got != 7 {
				t.Fatalf("the write, waited for by its Batch after all, wrote %d, want 7", got)
			}
		})
	}
}
