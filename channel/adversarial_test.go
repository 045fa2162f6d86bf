package channel_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// Adversarial tests: the channel stressed and misused the way its users
// do, many goroutines at once. Context deadlines in them are hang guards
// only: a wait that should end by itself and does not fails the test
// when its guard fires, and no assertion depends on how long anything
// takes.

// guard returns a context that ends after d: a hang guard for a wait
// that must end by itself much sooner.
func guard(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// settle gives goroutines started just before time to reach the wait
// they are about to block in. Nothing is asserted on it: it only makes
// the interleaving under test likely.
func settle() { time.Sleep(20 * time.Millisecond) }

// put writes v into the 8 bytes of s.buf at off.
func (s *side) put(off int, v uint64) {
	binary.NativeEndian.PutUint64(s.buf.Bytes()[off:], v)
}

// get reads the 8 bytes of s.buf at off.
func (s *side) get(off int) uint64 {
	return binary.NativeEndian.Uint64(s.buf.Bytes()[off:])
}

// TestAdvReleasedInFlight: a Handle released while its operation is in
// flight (a receive no message has reached yet, a send waiting for the
// peer's receive) is stale at once, like a completed one: Release again
// does nothing, Wait returns ErrStale without waiting, the queries
// report nothing. When the operation later completes the channel is
// intact: Drain finds nothing in flight, and every slot of the pool
// serves a new operation with its own bytes.
func TestAdvReleasedInFlight(t *testing.T) {
	const slots = 4
	ops := []struct {
		name string
		// post posts an operation at x that stays in flight until finish
		// runs.
		post   func(t *testing.T, x, y *side) channel.Handle
		finish func(t *testing.T, ctx context.Context, x, y *side)
	}{
		{"receive", func(t *testing.T, x, y *side) channel.Handle {
			h, err := x.ch.PostReceive(x.sge(0, 64))
			if err != nil {
				t.Fatal(err)
			}
			return h
		}, func(t *testing.T, ctx context.Context, x, y *side) {
			if err := y.ch.Send(ctx, y.sge(0, 8)); err != nil {
				t.Fatal(err)
			}
		}},
		{"send waiting for a receive", func(t *testing.T, x, y *side) channel.Handle {
			h, err := x.ch.PostSend(x.sge(0, 8))
			if err != nil {
				t.Fatal(err)
			}
			return h
		}, func(t *testing.T, ctx context.Context, x, y *side) {
			if _, err := y.ch.Receive(ctx, y.sge(0, 64)); err != nil {
				t.Fatal(err)
			}
		}},
	}
	misuses := []struct {
		name string
		use  func(t *testing.T, h channel.Handle)
	}{
		{"release twice", func(t *testing.T, h channel.Handle) { h.Release() }},
		{"wait", func(t *testing.T, h channel.Handle) {
			if err := h.Wait(guard(t, 5*time.Second)); !errors.Is(err, channel.ErrStale) {
				t.Errorf("Wait after Release: %v, want ErrStale at once", err)
			}
		}},
		{"query", func(t *testing.T, h channel.Handle) {
			if err := h.Err(); !errors.Is(err, channel.ErrStale) {
				t.Errorf("Err after Release: %v, want ErrStale", err)
			}
			if done, err := h.Poll(); done || !errors.Is(err, channel.ErrStale) {
				t.Errorf("Poll after Release: %v %v, want false, ErrStale", done, err)
			}
			if h.Done() || h.Peer() != -1 {
				t.Errorf("after Release: Done %v, Peer %d; want false, -1", h.Done(), h.Peer())
			}
		}},
	}
	for _, op := range ops {
		for _, m := range misuses {
			t.Run(op.name+"/"+m.name, func(t *testing.T) {
				x, y := newPair(t, channel.Options{MaxOutstanding: slots})
				ctx := guard(t, 10*time.Second)
				h := op.post(t, x, y)
				h.Release()
				m.use(t, h)
				op.finish(t, ctx, x, y)
				if err := x.ch.Drain(ctx); err != nil {
					t.Fatalf("drain after the released operation completed: %v", err)
				}
				if err := x.ch.Err(); err != nil {
					t.Fatalf("channel broke: %v", err)
				}
				// Every slot serves one receive of a message of its own.
				hs := make([]channel.Handle, slots)
				for i := range hs {
					var err error
					if hs[i], err = x.ch.PostReceive(x.sge(1024+64*i, 64)); err != nil {
						t.Fatalf("receive %d: %v", i, err)
					}
				}
				for i := range hs {
					y.put(512+8*i, uint64(1000+i))
					if err := y.ch.Send(ctx, y.sge(512+8*i, 8)); err != nil {
						t.Fatalf("send %d: %v", i, err)
					}
				}
				for i, h := range hs {
					if err := h.Wait(ctx); err != nil {
						t.Fatalf("receive %d: %v", i, err)
					}
					if r := h.Received(); r.Len != 8 || x.get(1024+64*i) != uint64(1000+i) {
						t.Errorf("receive %d: %+v, value %d", i, r, x.get(1024+64*i))
					}
					h.Release()
				}
				if err := x.ch.Drain(ctx); err != nil {
					t.Fatalf("final drain: %v", err)
				}
			})
		}
	}
}

// TestAdvBatchReleaseInFlight: a Handle of a Batch released inside the
// scope while its receive is in flight (as the scope's slot-exhaustion
// error advises) does not hold the scope's end: Batch returns without
// breaking the channel, and the receive's slot comes back when it
// completes.
func TestAdvBatchReleaseInFlight(t *testing.T) {
	x, y := newPair(t, channel.Options{MaxOutstanding: 4})
	ctx := guard(t, 10*time.Second)
	err := x.ch.Batch(ctx, func(b *channel.Batch) error {
		r := b.Receive(x.sge(0, 64))
		w := b.Write(y.buf.Remote().At(0), x.sge(128, 8))
		if err := b.Wait(w); err != nil {
			return err
		}
		r.Release()
		r.Release()
		if err := r.Err(); !errors.Is(err, channel.ErrStale) {
			return fmt.Errorf("a released receive: %v, want ErrStale", err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("batch: %v", err)
	}
	if err := x.ch.Err(); err != nil {
		t.Fatalf("the batch broke the channel: %v", err)
	}
	if err := y.ch.Send(ctx, y.sge(0, 8)); err != nil {
		t.Fatal(err)
	}
	if err := x.ch.Drain(ctx); err != nil {
		t.Fatalf("drain: %v", err)
	}
}

// TestAdvReleaseRacesCompletion: receives are released by one goroutine
// while the peer's messages complete them, so that each Release races
// with its completion (detached first, or completed first). Every slot
// comes back exactly once: Drain finds nothing in flight, and the whole
// pool then serves receives that each get their own message.
func TestAdvReleaseRacesCompletion(t *testing.T) {
	const slots, rounds = 16, 20
	x, y := newPair(t, channel.Options{MaxOutstanding: slots})
	ctx := guard(t, 10*time.Second)
	for round := range rounds {
		hs := make(chan channel.Handle, slots)
		for i := range slots {
			h, err := x.ch.PostReceive(x.sge(64*i, 64))
			if err != nil {
				t.Fatalf("round %d receive %d: %v", round, i, err)
			}
			hs <- h
		}
		close(hs)
		released := make(chan struct{})
		go func() {
			defer close(released)
			for h := range hs {
				if round%2 == 0 {
					h.Poll() // and move completions along
				}
				h.Release()
			}
		}()
		for i := range slots {
			if err := y.ch.Send(ctx, y.sge(8*i, 8)); err != nil {
				t.Fatalf("round %d send %d: %v", round, i, err)
			}
		}
		<-released
		if err := x.ch.Drain(ctx); err != nil {
			t.Fatalf("round %d: drain: %v", round, err)
		}
	}
	hs := make([]channel.Handle, slots)
	for i := range hs {
		var err error
		if hs[i], err = x.ch.PostReceive(x.sge(4096+64*i, 64)); err != nil {
			t.Fatalf("receive %d after the races: %v", i, err)
		}
	}
	if _, err := x.ch.PostReceive(x.sge(0, 8)); !errors.Is(err, verbs.ErrQueueFull) {
		t.Errorf("receive beyond the pool: %v, want ErrQueueFull (a slot came back twice)", err)
	}
	for i := range hs {
		y.put(1024+8*i, uint64(7000+i))
		if err := y.ch.Send(ctx, y.sge(1024+8*i, 8)); err != nil {
			t.Fatal(err)
		}
	}
	for i, h := range hs {
		if err := h.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if got := x.get(4096 + 64*i); got != uint64(7000+i) {
			t.Errorf("receive %d: %d, want %d", i, got, 7000+i)
		}
		h.Release()
	}
}

// TestAdvSlotWaitersWokenByRelease: with every slot held by a completed
// Handle nobody has released yet, blocking calls (and Batch operations)
// wait for a slot. Releasing the handles from another goroutine, one by
// one, must let every waiter go on, whether the waiters poll the
// completion queue or sleep: nothing else will happen on the queue.
func TestAdvSlotWaitersWokenByRelease(t *testing.T) {
	const slots = 2
	kinds := []struct {
		name string
		run  func(ctx context.Context, x, y *side, i int) error
	}{
		{"blocking write", func(ctx context.Context, x, y *side, i int) error {
			return x.ch.Write(ctx, y.buf.Remote().At(uint64(256+8*i)), x.sge(256+8*i, 8))
		}},
		{"batch", func(ctx context.Context, x, y *side, i int) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error {
				return b.Wait(b.Write(y.buf.Remote().At(uint64(256+8*i)), x.sge(256+8*i, 8)))
			})
		}},
	}
	for _, m := range spinModes {
		for _, k := range kinds {
			for _, waiters := range []int{1, 3} {
				t.Run(fmt.Sprintf("%s/%s/%d", m.name, k.name, waiters), func(t *testing.T) {
					testSlotWaiters(t, m.spin, slots, waiters, k.run)
				})
			}
		}
	}
}

// testSlotWaiters runs a case of TestAdvSlotWaitersWokenByRelease:
// waiters goroutines run run while every slot is held.
func testSlotWaiters(t *testing.T, spin, slots, waiters int, run func(ctx context.Context, x, y *side, i int) error) {
	x, y := newPair(t, channel.Options{SpinPolls: spin, MaxOutstanding: slots})
	ctx := guard(t, 10*time.Second)
	held := make([]channel.Handle, slots)
	for i := range held {
		var err error
		if held[i], err = x.ch.PostWrite(y.buf.Remote().At(0), x.sge(0, 8)); err != nil {
			t.Fatal(err)
		}
		if err := held[i].Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	errs := make(chan error, waiters)
	for i := range waiters {
		x.put(256+8*i, uint64(i+1))
		go func() { errs <- run(ctx, x, y, i) }()
	}
	settle()
	for _, h := range held {
		h.Release()
	}
	for range waiters {
		if err := <-errs; err != nil {
			t.Errorf("waiter for a slot: %v", err)
		}
	}
	if ctx.Err() != nil {
		// A wait that finds its condition true when its context ends
		// succeeds: the guard had to end it.
		t.Errorf("the waiters for a slot went on only when their context ended")
	}
	for i := range waiters {
		if got := y.get(256 + 8*i); got != uint64(i+1) {
			t.Errorf("write %d: %d landed, want %d", i, got, i+1)
		}
	}
}

// TestAdvDoorbellWaiters: many goroutines sleep in Channel.Wait, each for
// a word of its own that the peer writes with immediate data (a
// doorbell), in an order of the peer's; every one of them wakes with its
// word written, whoever of them polls.
func TestAdvDoorbellWaiters(t *testing.T) {
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			const waiters, rounds = 8, 20
			x, y := newPair(t, channel.Options{Doorbells: 4, SpinPolls: m.spin})
			ctx := guard(t, 10*time.Second)
			for round := 1; round <= rounds; round++ {
				var wg sync.WaitGroup
				for w := range waiters {
					wg.Add(1)
					go func() {
						defer wg.Done()
						word := x.word(64 * w)
						if err := x.ch.Wait(ctx, func() bool { return atomic.LoadUint64(word) >= uint64(round) }); err != nil {
							t.Errorf("round %d waiter %d: %v", round, w, err)
						}
					}()
				}
				for k := range waiters {
					w := (k*5 + round) % waiters // a permutation
					y.put(4096+8*w, uint64(round))
					if err := y.ch.WriteImm(ctx, x.buf.Remote().At(uint64(64*w)), uint32(w), y.sge(4096+8*w, 8)); err != nil {
						t.Errorf("round %d: write %d of word %d: %v (rung %d)", round, k, w, err, x.ch.Rung())
						break
					}
				}
				wg.Wait()
				if t.Failed() {
					return
				}
			}
			if err := x.ch.Err(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAdvConditionWaitersWokenByCompletions: one goroutine sleeps in
// Channel.Wait for a condition of its own (a flag nobody sets): it is
// the one polling the completion queue. Meanwhile another goroutine waits
// for a condition that completions bring about: Drain for the completion
// of a receive, a blocking write for room in a full send queue. When the
// completions come it must go on, although the poller's own condition
// stays false; also when other goroutines went to sleep before it (for
// completions or slots that do not come): the poller that leaves hands
// its role to the first of them, which polls and sleeps on.
func TestAdvConditionWaitersWokenByCompletions(t *testing.T) {
	type env struct {
		t      *testing.T
		ctx    context.Context // the hang guard
		octx   context.Context // the others' waits: ended at cleanup
		x, y   *side
		others int
		wg     *sync.WaitGroup // the others
	}
	cases := []struct {
		name string
		opts channel.Options
		// start puts the others and then the waiter to sleep, its
		// result to errc; complete makes the completions it waits for
		// come. cleanup runs after the others' waits ended.
		start    func(e env, errc chan<- error) (cleanup func())
		complete func(e env)
	}{
		{"drain", channel.Options{MaxOutstanding: 3}, func(e env, errc chan<- error) func() {
			// Two completed writes hold two slots, the receive the
			// third: the others wait for a slot.
			var held []channel.Handle
			for range 2 {
				h, err := e.x.ch.PostWrite(e.y.buf.Remote().At(0), e.x.sge(0, 8))
				if err != nil {
					e.t.Fatal(err)
				}
				if err := h.Wait(e.ctx); err != nil {
					e.t.Fatal(err)
				}
				held = append(held, h)
			}
			r, err := e.x.ch.PostReceive(e.x.sge(0, 64))
			if err != nil {
				e.t.Fatal(err)
			}
			for i := range e.others {
				e.wg.Add(1)
				go func() {
					defer e.wg.Done()
					err := e.x.ch.Write(e.octx, e.y.buf.Remote().At(uint64(64*i)), e.x.sge(64*i, 8))
					if err != nil && !errors.Is(err, context.Canceled) {
						e.t.Errorf("a write waiting for a slot: %v", err)
					}
				}()
			}
			if e.others > 0 {
				settle()
			}
			go func() { errc <- e.x.ch.Drain(e.ctx) }()
			return func() {
				for _, h := range held {
					h.Release()
				}
				r.Release()
			}
		}, func(e env) {
			if err := e.y.ch.Send(e.ctx, e.y.sge(0, 8)); err != nil {
				e.t.Fatal(err)
			}
		}},
		{"room in the send queue", channel.Options{QP: verbs.QPSpec{MaxSendWR: 2}}, func(e env, errc chan<- error) func() {
			// The others wait for receives no message comes for.
			var recvs []channel.Handle
			for range e.others {
				h, err := e.x.ch.PostReceive(e.x.sge(0, 64))
				if err != nil {
					e.t.Fatal(err)
				}
				recvs = append(recvs, h)
				e.wg.Add(1)
				go func() {
					defer e.wg.Done()
					if err := h.Wait(e.octx); !errors.Is(err, context.Canceled) {
						e.t.Errorf("a receive no message came for: %v", err)
					}
				}()
			}
			if e.others > 0 {
				settle()
			}
			// Two sends fill the queue; y has no receive for them yet.
			var sends []channel.Handle
			for range 2 {
				h, err := e.x.ch.PostSend(e.x.sge(0, 8))
				if err != nil {
					e.t.Fatal(err)
				}
				sends = append(sends, h)
			}
			e.x.put(64, 77)
			go func() { errc <- e.x.ch.Write(e.ctx, e.y.buf.Remote().At(64), e.x.sge(64, 8)) }()
			return func() {
				for _, h := range sends {
					if err := h.Wait(e.ctx); err != nil {
						e.t.Error(err)
					}
					h.Release()
				}
				for _, h := range recvs {
					h.Release()
				}
				if got := e.y.get(64); got != 77 {
					e.t.Errorf("the write that waited for room: %d landed, want 77", got)
				}
			}
		}, func(e env) {
			for range 2 {
				if _, err := e.y.ch.Receive(e.ctx, e.y.sge(0, 64)); err != nil {
					e.t.Fatal(err)
				}
			}
		}},
	}
	for _, m := range spinModes {
		for _, tc := range cases {
			for _, others := range []int{0, 3} {
				t.Run(fmt.Sprintf("%s/%s/%d others", m.name, tc.name, others), func(t *testing.T) {
					opts := tc.opts
					opts.SpinPolls = m.spin
					x, y := newPair(t, opts)
					ctx := guard(t, 10*time.Second)
					octx, stopOthers := context.WithCancel(ctx)
					defer stopOthers()
					e := env{t: t, ctx: ctx, octx: octx, x: x, y: y, others: others, wg: new(sync.WaitGroup)}
					var flag atomic.Bool
					pollerDone := make(chan error, 1)
					go func() { pollerDone <- x.ch.Wait(octx, flag.Load) }()
					settle() // the poller polls, then sleeps on the completion channel
					errc := make(chan error, 1)
					cleanup := tc.start(e, errc)
					settle() // the waiter sleeps: the poller has the queue
					tc.complete(e)
					if err := <-errc; err != nil {
						t.Errorf("the waiter: %v", err)
					}
					if ctx.Err() != nil {
						// A wait that finds its condition true when its
						// context ends succeeds: the guard had to end it.
						t.Errorf("the waiter went on only when its context ended")
					}
					stopOthers()
					if err := <-pollerDone; !errors.Is(err, context.Canceled) {
						t.Errorf("the poller's wait: %v, want its context's end", err)
					}
					e.wg.Wait()
					cleanup()
					if err := x.ch.Err(); err != nil {
						t.Errorf("channel broke: %v", err)
					}
				})
			}
		}
	}
}

// TestAdvCloseWhileReadingResults: Close runs while goroutines read the
// prior values of completed atomics (Handle.Value, in a loop, and the
// blocking FetchAdd) and post inline writes, which go through the
// channel's scratch memory. None of them may touch that memory once
// Close frees it (a fault kills the process: before, Value checked that
// the channel was open and then read the memory, and Close could free
// it in between), and every call returns nil or ErrClosed or ErrBroken.
// Repeated, for the interleavings.
func TestAdvCloseWhileReadingResults(t *testing.T) {
	const iterations, workers = 80, 8
	for it := range iterations {
		t.Run(fmt.Sprint(it), func(t *testing.T) {
			x, y := newPair(t, channel.Options{})
			ctx := guard(t, 10*time.Second)
			var wg sync.WaitGroup
			var ops atomic.Int64
			errc := make(chan error, workers)
			for w := range workers {
				dst := y.buf.Remote().At(uint64(64 * w))
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						var err error
						switch w % 4 {
						case 0:
							_, err = x.ch.FetchAdd(ctx, dst, 1)
						case 1, 2:
							var h channel.Handle
							if h, err = x.ch.PostCompareSwap(dst, 0, 0); errors.Is(err, verbs.ErrQueueFull) {
								err = x.ch.Progress() // the inline writes fill the queue
								break
							} else if err != nil {
								break
							}
							for !h.Done() {
								if _, err = h.Poll(); err != nil {
									break
								}
							}
							for range 100 {
								if v := h.Value(); v != 0 {
									err = fmt.Errorf("compare-and-swap of a zero word: prior value %d", v)
								}
							}
							h.Release()
						case 3:
							err = x.ch.WriteInline(ctx, dst, []byte("inline!!"))
						}
						if err != nil {
							if !errors.Is(err, channel.ErrClosed) && !errors.Is(err, channel.ErrBroken) {
								errc <- err
							}
							return
						}
						ops.Add(1)
					}
				}()
			}
			for ops.Load() < 100 {
				time.Sleep(50 * time.Microsecond)
			}
			if err := x.ch.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
			wg.Wait()
			close(errc)
			for err := range errc {
				t.Errorf("a call running into Close: %v, want nil, ErrClosed or ErrBroken", err)
			}
		})
	}
}
