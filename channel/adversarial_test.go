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

// TestAdvHandoff: operations posted by many goroutines at once, each
// Handle waited on by another goroutine and released by a third, over
// every kind of posted operation, in rounds (every goroutine's operation
// of a round must complete before the next round starts: a waiter left
// asleep with nobody polling hangs its round). Each operation's own
// result is checked: the bytes read back, the prior values of the
// atomics (they add up), the immediate data of the receives.
func TestAdvHandoff(t *testing.T) {
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			const workers, rounds = 6, 60
			x, y := newPair(t, channel.Options{SpinPolls: m.spin, MaxOutstanding: 2 * workers})
			ctx := guard(t, 15*time.Second)
			type job struct {
				h     channel.Handle
				check func() error
			}
			waitq := make(chan job, workers)
			releaseq := make(chan channel.Handle, workers)
			var waiters, releasers sync.WaitGroup
			var done sync.WaitGroup // operations of the current round
			var failures atomic.Int32
			fail := func(err error) {
				if failures.Add(1) <= 5 {
					t.Error(err)
				}
			}
			for range workers {
				waiters.Add(1)
				go func() {
					defer waiters.Done()
					for j := range waitq {
						if err := j.h.Wait(ctx); err != nil {
							fail(err)
						} else if err := j.check(); err != nil {
							fail(err)
						}
						if err := j.h.Wait(ctx); err != nil {
							fail(fmt.Errorf("second wait: %w", err))
						}
						releaseq <- j.h
					}
				}()
				releasers.Add(1)
				go func() {
					defer releasers.Done()
					for h := range releaseq {
						h.Release()
						if err := h.Err(); !errors.Is(err, channel.ErrStale) {
							fail(fmt.Errorf("after Release: %v, want ErrStale", err))
						}
						done.Done()
					}
				}()
			}
			var immMu sync.Mutex
			imms := make(map[uint32]int) // immediate data received in the round
			for round := range rounds {
				done.Add(workers)
				var posters sync.WaitGroup
				for w := range workers {
					posters.Add(1)
					go func() {
						defer posters.Done()
						off := 1024 * w // this worker's area at x and at y
						v := uint64(round<<8 | w)
						var j job
						var err error
						switch (round + w) % 5 {
						case 0: // write, checked at y
							x.put(off, v)
							j.h, err = x.ch.PostWrite(y.buf.Remote().At(uint64(off)), x.sge(off, 8))
							j.check = func() error {
								if got := y.get(off); got != v {
									return fmt.Errorf("round %d worker %d: wrote %d, y holds %d", round, w, v, got)
								}
								return nil
							}
						case 1: // read
							y.put(off+8, v)
							j.h, err = x.ch.PostRead(y.buf.Remote().At(uint64(off+8)), x.sge(off+8, 8))
							j.check = func() error {
								if got := x.get(off + 8); got != v {
									return fmt.Errorf("round %d worker %d: read %d, want %d", round, w, got, v)
								}
								return nil
							}
						case 2, 3: // fetch-and-add, compare-and-swap on its own word
							word := y.buf.Remote().At(uint64(off + 16))
							y.put(off+16, v)
							if (round+w)%5 == 2 {
								j.h, err = x.ch.PostFetchAdd(word, 3)
							} else {
								j.h, err = x.ch.PostCompareSwap(word, v, v+3)
							}
							j.check = func() error {
								if prior, now := j.h.Value(), y.get(off+16); prior != v || now != v+3 {
									return fmt.Errorf("round %d worker %d: atomic prior %d, now %d; want %d, %d", round, w, prior, now, v, v+3)
								}
								return nil
							}
						case 4: // write with immediate into a receive of y's
							r, rerr := y.ch.PostReceive()
							if rerr != nil {
								fail(rerr)
								done.Done()
								return
							}
							x.put(off+24, v)
							j.h, err = x.ch.PostWriteImm(y.buf.Remote().At(uint64(off+24)), uint32(v), x.sge(off+24, 8))
							j.check = func() error {
								defer r.Release()
								if err := r.Wait(ctx); err != nil {
									return err
								}
								// The receives of a round's writes with
								// immediate data are taken in the order
								// they were posted: this one's may be
								// another worker's.
								got := r.Received()
								immMu.Lock()
								imms[got.Imm]++
								immMu.Unlock()
								if !got.Write || !got.HasImm || y.get(off+24) != v {
									return fmt.Errorf("round %d worker %d: received %+v, value %d, want a write with immediate data, value %d", round, w, got, y.get(off+24), v)
								}
								return nil
							}
						}
						if err != nil {
							fail(fmt.Errorf("round %d worker %d: post: %w", round, w, err))
							done.Done()
							return
						}
						waitq <- j
					}()
				}
				posters.Wait()
				done.Wait()
				for w := range workers {
					if (round+w)%5 == 4 {
						if v := uint32(round<<8 | w); imms[v] != 1 {
							t.Errorf("round %d: immediate data %d received %d times", round, v, imms[v])
						}
					}
				}
				clear(imms)
				if failures.Load() > 0 {
					break
				}
			}
			close(waitq)
			waiters.Wait()
			close(releaseq)
			releasers.Wait()
			if err := x.ch.Err(); err != nil {
				t.Fatalf("channel broke: %v", err)
			}
			if err := x.ch.Drain(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAdvCancelledWaitsResume: many goroutines wait for receives of
// their own; their contexts are cancelled all at once while messages
// arrive. Each wait returns either its receive's completion or the
// context's error, without breaking the channel; then every handle,
// waited again by a goroutine of its own with no deadline but the hang
// guard, completes with its own message.
func TestAdvCancelledWaitsResume(t *testing.T) {
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			const n = 16
			x, y := newPair(t, channel.Options{SpinPolls: m.spin})
			ctx := guard(t, 10*time.Second)
			hs := make([]channel.Handle, n)
			for i := range hs {
				var err error
				if hs[i], err = x.ch.PostReceive(x.sge(1024+64*i, 64)); err != nil {
					t.Fatal(err)
				}
			}
			// Receives are taken in the order they were posted: message i
			// lands in receive i.
			send := func(i int) {
				y.put(8*i, uint64(5000+i))
				if err := y.ch.Send(ctx, y.sge(8*i, 8)); err != nil {
					t.Error(err)
				}
			}
			check := func(i int) {
				if r := hs[i].Received(); r.Len != 8 || x.get(1024+64*i) != uint64(5000+i) {
					t.Errorf("receive %d: %+v, value %d", i, r, x.get(1024+64*i))
				}
			}
			cctx, cancel := context.WithCancel(ctx)
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range hs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = hs[i].Wait(cctx)
				}()
			}
			senders := make(chan struct{})
			go func() {
				defer close(senders)
				for i := range n / 2 {
					send(i)
					if i == n/4 {
						cancel()
					}
				}
			}()
			wg.Wait()
			<-senders
			cancel()
			for i, err := range errs {
				switch {
				case err == nil:
					check(i)
				case !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.Canceled):
					t.Errorf("receive %d: %v, want its completion or ErrTimeout and Canceled", i, err)
				case i >= n/2 && hs[i].Done():
					t.Errorf("receive %d is done with no message sent for it", i)
				}
			}
			if err := x.ch.Err(); err != nil {
				t.Fatalf("a handle's cancelled wait broke the channel: %v", err)
			}
			for i := range hs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := hs[i].Wait(ctx); err != nil {
						t.Errorf("receive %d waited again: %v", i, err)
						return
					}
					check(i)
					hs[i].Release()
				}()
			}
			for i := n / 2; i < n; i++ {
				send(i)
			}
			wg.Wait()
			if err := x.ch.Drain(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAdvCancelledBlockingCalls: blocking receives on many goroutines,
// whose contexts end all at once. A cancelled blocking call breaks the
// channel to take its request back: every call returns (the cancelled
// ones with ErrTimeout and ErrBroken, the others with the flush), none
// hangs on another's break, and the channel then has nothing in flight.
func TestAdvCancelledBlockingCalls(t *testing.T) {
	const n = 12
	x, _ := newPair(t, channel.Options{})
	ctx := guard(t, 10*time.Second)
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		c := cctx
		if i%3 == 0 {
			c = ctx // not cancelled: flushed by the others' break
		}
		go func() {
			defer wg.Done()
			_, errs[i] = x.ch.Receive(c, x.sge(64*i, 64))
		}()
	}
	settle()
	cancel()
	wg.Wait()
	for i, err := range errs {
		var ce *verbs.CompletionError
		switch {
		case err == nil:
			t.Errorf("receive %d succeeded with no message sent", i)
		case errors.Is(err, verbs.ErrTimeout) && errors.Is(err, channel.ErrBroken):
		case errors.As(err, &ce) && ce.Status == verbs.StatusWRFlushErr:
		case errors.Is(err, channel.ErrBroken): // posted after the break
		default:
			t.Errorf("receive %d: %v, want a timeout that broke the channel, or a flush", i, err)
		}
	}
	if ctx.Err() != nil {
		t.Error("the receives returned only when the hang guard ended")
	}
	if err := x.ch.Drain(ctx); err != nil {
		t.Errorf("drain: %v", err)
	}
}

// TestAdvCloseUnderLoad: Close runs while goroutines post and wait with
// every kind of call (blocking, posted and waited, batches, inline
// writes, receives that no message will reach, and waits for a slot of
// the exhausted pool). Close returns, every goroutine returns with
// ErrClosed or the broken channel's error (nothing else, no panic), and
// nothing of the channel is left running (TestMain's goleak). The same
// when the peer closes instead: the goroutines see the failure that
// broke the channel, or ErrBroken, and nothing stays in flight.
func TestAdvCloseUnderLoad(t *testing.T) {
	const perKind = 2
	loops := []struct {
		name string
		// once runs one operation of the loop at x (worker w, area off).
		once func(ctx context.Context, x, y *side, off int) error
	}{
		{"write", func(ctx context.Context, x, y *side, off int) error {
			return x.ch.Write(ctx, y.buf.Remote().At(uint64(off)), x.sge(off, 64))
		}},
		{"read", func(ctx context.Context, x, y *side, off int) error {
			return x.ch.Read(ctx, y.buf.Remote().At(uint64(off)), x.sge(off, 64))
		}},
		{"fetch-and-add", func(ctx context.Context, x, y *side, off int) error {
			_, err := x.ch.FetchAdd(ctx, y.buf.Remote().At(uint64(off)), 1)
			return err
		}},
		{"posted write", func(ctx context.Context, x, y *side, off int) error {
			h, err := x.ch.PostWrite(y.buf.Remote().At(uint64(off)), x.sge(off, 64))
			if errors.Is(err, verbs.ErrQueueFull) {
				return x.ch.Progress() // every slot in use: let them complete
			}
			if err != nil {
				return err
			}
			defer h.Release()
			if err := h.Wait(ctx); err != nil {
				return err
			}
			if v := h.Value(); v != 0 {
				return fmt.Errorf("a write's handle has a value: %d", v)
			}
			return nil
		}},
		{"posted compare-and-swap", func(ctx context.Context, x, y *side, off int) error {
			h, err := x.ch.PostCompareSwap(y.buf.Remote().At(uint64(off)), 0, 0)
			if errors.Is(err, verbs.ErrQueueFull) {
				return x.ch.Progress()
			}
			if err != nil {
				return err
			}
			defer h.Release()
			if err := h.Wait(ctx); err != nil {
				return err
			}
			h.Value() // races with Close's end
			return nil
		}},
		{"batch", func(ctx context.Context, x, y *side, off int) error {
			return x.ch.Batch(ctx, func(b *channel.Batch) error {
				// Two slots at most: with the small pool, the batches
				// and the receives (which hold theirs until Close) must
				// leave slots to the others, or a batch that holds one
				// and waits for another can wait forever.
				for i := range 2 {
					b.Write(y.buf.Remote().At(uint64(off+16*i)), x.sge(off+16*i, 16))
				}
				return b.WaitAll()
			})
		}},
		{"inline write", func(ctx context.Context, x, y *side, off int) error {
			return x.ch.WriteInline(ctx, y.buf.Remote().At(uint64(off)), []byte("inline!!"))
		}},
		{"receive", func(ctx context.Context, x, y *side, off int) error {
			h, err := x.ch.PostReceive(x.sge(off, 64))
			if errors.Is(err, verbs.ErrQueueFull) {
				return x.ch.Progress()
			}
			if err != nil {
				return err
			}
			defer h.Release()
			return h.Wait(ctx) // no message comes
		}},
	}
	type variant struct {
		name string
		opts channel.Options
		peer bool // the peer closes, not x
	}
	var variants []variant
	for _, m := range []struct {
		name string
		opts channel.Options
	}{
		{"default", channel.Options{}},
		{"small pool, sleeping", channel.Options{MaxOutstanding: 8, SpinPolls: channel.SpinNever, QP: verbs.QPSpec{MaxSendWR: 4, MaxRecvWR: 4}}},
	} {
		variants = append(variants, variant{m.name, m.opts, false}, variant{m.name + ", the peer closes", m.opts, true})
	}
	for _, m := range variants {
		t.Run(m.name, func(t *testing.T) {
			x, y := newPair(t, m.opts)
			ctx := guard(t, 10*time.Second)
			var ops atomic.Int64
			var wg sync.WaitGroup
			type failure struct {
				what string
				err  error
			}
			failures := make(chan failure, len(loops)*perKind)
			for k, l := range loops {
				for i := range perKind {
					wg.Add(1)
					go func() {
						defer wg.Done()
						off := 2048 * (k*perKind + i)
						for {
							err := l.once(ctx, x, y, off)
							if err != nil {
								var ce *verbs.CompletionError
								switch {
								case errors.Is(err, channel.ErrBroken):
								case !m.peer && errors.Is(err, channel.ErrClosed):
								case m.peer && errors.As(err, &ce): // the failure that broke x
								default:
									failures <- failure{l.name, err}
								}
								return
							}
							ops.Add(1)
						}
					}()
				}
			}
			for ops.Load() < 200 {
				time.Sleep(time.Millisecond)
			}
			closing := x
			if m.peer {
				closing = y
			}
			if err := closing.ch.Close(); err != nil {
				t.Errorf("close under load: %v", err)
			}
			wg.Wait()
			close(failures)
			for f := range failures {
				t.Errorf("%s after Close: %v, want ErrClosed or ErrBroken (or a completion error, when the peer closed)", f.what, f.err)
			}
			if ctx.Err() != nil {
				t.Error("the goroutines returned only when their context ended")
			}
			want := channel.ErrClosed
			if m.peer {
				want = channel.ErrBroken
			}
			if err := x.ch.Write(ctx, y.buf.Remote().At(0), x.sge(0, 8)); !errors.Is(err, want) {
				t.Errorf("write after Close: %v, want %v", err, want)
			}
			if m.peer {
				if err := x.ch.Drain(ctx); err != nil {
					t.Errorf("drain after the peer closed: %v", err)
				}
			}
		})
	}
}

// TestAdvMultiOnePeerBroken: a MultiChannel rank drives three peers from
// several goroutines each; the queue pair to one of them breaks in the
// middle. The goroutines of that peer end with ErrBroken, and only they:
// the others go on after the break, their counters add up exactly, and
// the broken peer's counter holds at least what its successful calls
// added.
// Collective calls then fail naming the broken peer only, while their
// operations to the other peers complete.
func TestAdvMultiOnePeerBroken(t *testing.T) {
	const n, perPeer, rounds, victim = 4, 2, 300, 2
	rs := newGroup(t, n)
	ctx := guard(t, 15*time.Second)
	r := rs[0]
	var wg sync.WaitGroup
	var ok [n]atomic.Uint64 // successful fetch-and-adds per peer
	var broke atomic.Bool
	started := make(chan struct{}, (n-1)*perPeer)
	for _, p := range r.mc.Peers() {
		for g := range perPeer {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ch := r.mc.Peer(p)
				counter := rs[p].buf.Remote().At(uint64(16384 + 8*g))
				off := 1024 * (p*perPeer + g)
				// The broken peer's goroutines go on until it breaks;
				// the others for rounds operations and rounds more after
				// the break.
				after := 0
				for i := 0; p == victim || after < rounds; i++ {
					if i == 10 {
						started <- struct{}{}
					}
					if broke.Load() {
						after++
					}
					var err error
					if i%2 == 0 {
						_, err = ch.FetchAdd(ctx, counter, 1)
					} else {
						var h channel.Handle
						if h, err = ch.PostFetchAdd(counter, 1); err == nil {
							err = h.Wait(ctx)
							h.Release()
						}
					}
					if err != nil {
						if p != victim || !errors.Is(err, channel.ErrBroken) {
							t.Errorf("peer %d goroutine %d round %d: %v", p, g, i, err)
						}
						return
					}
					ok[p].Add(1)
					// And a write and read back, checked.
					binary.NativeEndian.PutUint64(r.buf.Bytes()[off:], uint64(i))
					if err := ch.Write(ctx, rs[p].buf.Remote().At(uint64(off)), r.sge(off, 8)); err != nil {
						if p != victim || !errors.Is(err, channel.ErrBroken) {
							t.Errorf("peer %d goroutine %d round %d: write: %v", p, g, i, err)
						}
						return
					}
				}
			}()
		}
	}
	for range cap(started) {
		<-started
	}
	r.mc.Peer(victim).Break()
	broke.Store(true)
	wg.Wait()
	for _, p := range r.mc.Peers() {
		var sum uint64
		for g := range perPeer {
			sum += binary.NativeEndian.Uint64(rs[p].buf.Bytes()[16384+8*g:])
		}
		switch {
		case p != victim && (sum != ok[p].Load() || sum < perPeer*rounds):
			t.Errorf("peer %d: counters %d, successful adds %d, want equal and at least %d", p, sum, ok[p].Load(), perPeer*rounds)
		case p == victim && sum < ok[p].Load():
			t.Errorf("broken peer %d: counters %d, successful adds %d", p, sum, ok[p].Load())
		}
	}
	err := r.mc.Err()
	var oe *channel.OpError
	if !errors.As(err, &oe) || oe.Peer != victim || !errors.Is(err, channel.ErrBroken) {
		t.Errorf("Err() = %v, want the broken peer %d", err, victim)
	}
	for _, p := range r.mc.Peers() {
		if broken := r.mc.Peer(p).Broken(); broken != (p == victim) {
			t.Errorf("peer %d: Broken() = %v", p, broken)
		}
	}
	// A scatter write to every peer: the broken one fails, by name; the
	// others' writes land.
	dsts := make([]verbs.RemoteAddr, n)
	bufs := make([]verbs.SGE, n)
	for _, p := range r.mc.Peers() {
		binary.NativeEndian.PutUint64(r.buf.Bytes()[32768+8*p:], uint64(900+p))
		dsts[p] = rs[p].buf.Remote().At(32768)
		bufs[p] = r.sge(32768+8*p, 8)
	}
	err = r.mc.ScatterWrite(ctx, nil, dsts, bufs)
	if !errors.As(err, &oe) || oe.Peer != victim || !errors.Is(err, channel.ErrBroken) {
		t.Errorf("scatter write: %v, want a failure of peer %d", err, victim)
	}
	for _, p := range r.mc.Peers() {
		if got := binary.NativeEndian.Uint64(rs[p].buf.Bytes()[32768:]); p != victim && got != uint64(900+p) {
			t.Errorf("scatter write to peer %d: %d landed, want %d", p, got, 900+p)
		}
	}
	if err := r.mc.Drain(ctx); err != nil {
		t.Errorf("drain: %v", err)
	}
}

// TestAdvMultiBatchPeerBreaks: a MultiBatch has operations in flight to
// two peers when the queue pair to one of them breaks (another
// goroutine's Break): the scope still ends, the broken peer's operations
// report the flush, the other peer's complete with their bytes, and the
// other peer keeps working.
func TestAdvMultiBatchPeerBreaks(t *testing.T) {
	rs := newGroup(t, 3)
	ctx := guard(t, 10*time.Second)
	r := rs[0]
	binary.NativeEndian.PutUint64(r.buf.Bytes()[0:], 4242)
	err := r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
		// Receives from peer 1 that nothing will complete but the break.
		var held []channel.Handle
		for i := range 4 {
			held = append(held, b.Peer(1).Receive(r.sge(1024+64*i, 64)))
		}
		w := b.Peer(2).Write(rs[2].buf.Remote().At(512), r.sge(0, 8))
		if err := b.Flush(); err != nil {
			return err
		}
		go r.mc.Peer(1).Break()
		for i, h := range held {
			var ce *verbs.CompletionError
			if err := b.Wait(h); !errors.As(err, &ce) || ce.Status != verbs.StatusWRFlushErr {
				return fmt.Errorf("receive %d from the broken peer: %v, want a flush", i, err)
			}
		}
		return b.Wait(w)
	})
	if err != nil {
		t.Fatalf("batch: %v", err)
	}
	if got := binary.NativeEndian.Uint64(rs[2].buf.Bytes()[512:]); got != 4242 {
		t.Errorf("write to the working peer: %d landed, want 4242", got)
	}
	if _, err := r.mc.Peer(2).FetchAdd(ctx, rs[2].buf.Remote().At(520), 1); err != nil {
		t.Errorf("the working peer after the other broke: %v", err)
	}
	if !r.mc.Peer(1).Broken() || r.mc.Peer(2).Broken() {
		t.Errorf("broken: peer 1 %v, peer 2 %v; want true, false", r.mc.Peer(1).Broken(), r.mc.Peer(2).Broken())
	}
}
