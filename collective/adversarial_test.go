package collective_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs/collective"
)

// Adversarial tests: what a demanding user does to a communicator —
// mismatched calls, bad roots, empty and one-element vectors, aliased
// buffers, panicking operations, contexts that end on one rank only,
// many requests in flight, odd splits, calls after poisoning or Close.
// Contexts are hang guards only: no test asserts on time.

// guardCtx is a hang guard shorter than testCtx, for calls expected to
// fail: a rank that hangs fails the test with the context's error
// instead of holding the whole run.
func guardCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// verifyNoLeaks fails t if a goroutine started since it was called is
// still running (soft0's process-wide listeners stay: they are not the
// package's). Call it deferred at the start of the test.
func verifyNoLeaks(t *testing.T) func() {
	t.Helper()
	opts := []goleak.Option{goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/goverbs/verbs/internal/soft.(*service).acceptLoop")}
	return func() { goleak.VerifyNone(t, opts...) }
}

// notByGuard fails the test if err is the hang guard's deadline: the
// call should have failed for its own reason.
func notByGuard(t testing.TB, r int, what string, err error) {
	t.Helper()
	if errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("rank %d: %s: hung until the hang guard: %v", r, what, err)
	}
}

// advCall is one rank's part of an adversarial case.
type advCall func(ctx context.Context, c *collective.Comm, r int) error

// TestAdvMismatchedCalls: ranks that disagree on the call — its kind,
// op, element type, count or root, with every collective kind against
// another — never complete it silently: every rank fails the call itself
// or, where it could not see the difference (a broadcast's root
// receives nothing), its next call; at least one rank names the
// mismatch (ErrMismatch), no rank waits for the hang guard (no
// Options.Timeout is set), and the communicator is poisoned everywhere.
func TestAdvMismatchedCalls(t *testing.T) {
	i64 := func(n int) []int64 { return make([]int64, n) }
	cases := []struct {
		name string
		p    int
		call advCall
	}{
		{"allreduce/broadcast", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.Broadcast(ctx, c, i64(4), 0)
			}
			return collective.Allreduce(ctx, c, nil, i64(4), collective.Sum)
		}},
		{"allreduce/broadcast count 0", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.Broadcast(ctx, c, i64(0), 1)
			}
			return collective.Allreduce(ctx, c, nil, i64(0), collective.Sum)
		}},
		{"allreduce count 0/1", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Allreduce(ctx, c, nil, i64(r), collective.Sum)
		}},
		{"allreduce sum/min", 4, func(ctx context.Context, c *collective.Comm, r int) error {
			op := collective.Sum
			if r == 3 {
				op = collective.Min
			}
			return collective.Allreduce(ctx, c, nil, i64(3), op)
		}},
		{"allreduce int64/uint64", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Allreduce(ctx, c, nil, make([]uint64, 2), collective.Sum)
			}
			return collective.Allreduce(ctx, c, nil, i64(2), collective.Sum)
		}},
		{"allreduce float32/int32 ring", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 2 {
				return collective.Allreduce(ctx, c, nil, make([]float32, 1<<18), collective.Sum)
			}
			return collective.Allreduce(ctx, c, nil, make([]int32, 1<<18), collective.Sum)
		}},
		{"broadcast roots", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Broadcast(ctx, c, i64(5), r%2)
		}},
		{"reduce roots", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			root := 0
			if r == 2 {
				root = 1
			}
			return collective.Reduce(ctx, c, i64(2), i64(2), collective.Sum, root)
		}},
		{"gather/scatter", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Scatter(ctx, c, i64(6), i64(2), 0)
			}
			return collective.Gather(ctx, c, i64(2), i64(6), 0)
		}},
		{"allgather/alltoall", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Alltoall(ctx, c, i64(4), i64(4))
			}
			return collective.Allgather(ctx, c, i64(2), i64(4))
		}},
		{"scan/exscan", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.ExScan(ctx, c, nil, i64(2), collective.Sum)
			}
			return collective.Scan(ctx, c, nil, i64(2), collective.Sum)
		}},
		{"reduce-scatter/allreduce", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.ReduceScatter(ctx, c, i64(4), i64(2), collective.Sum)
			}
			return collective.Allreduce(ctx, c, nil, i64(4), collective.Sum)
		}},
		{"barrier/allreduce", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Barrier(ctx, c)
			}
			return collective.Allreduce(ctx, c, nil, i64(1), collective.Sum)
		}},
		{"split/barrier", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 2 {
				return collective.Barrier(ctx, c)
			}
			s, err := c.Split(ctx, 0, r)
			if s != nil {
				s.Close()
			}
			return err
		}},
		{"custom ops of two names, chunks", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			name := "first"
			if r == 2 {
				name = "second"
			}
			op := collective.Custom(name, func(inout, in []int64) {
				for i := range inout {
					inout[i] += in[i]
				}
			})
			return collective.Allreduce(ctx, c, nil, make([]int64, 3000), op)
		}},
		{"custom ops of two names", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			op := collective.Custom("first", func(inout, in []int64) {
				for i := range inout {
					inout[i] += in[i]
				}
			})
			if r == 1 {
				op = collective.Custom("second", func(inout, in []int64) {
					for i := range inout {
						inout[i] *= in[i]
					}
				})
			}
			return collective.Allreduce(ctx, c, nil, []int64{2, 3}, op)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, tc.p, collective.Options{ChunkSize: 4096})
			// Each rank goes on to a barrier at once, as a program would:
			// a rank that receives nothing from the disagreeing rank in
			// the call learns of it from the next one (documented).
			first, next := make([]error, tc.p), make([]error, tc.p)
			parallel(tc.p, func(r int) error {
				first[r] = tc.call(guardCtx(t), cs[r], r)
				next[r] = collective.Barrier(guardCtx(t), cs[r])
				return nil
			})
			mismatch := false
			for r := range tc.p {
				t.Logf("rank %d: %v; then %v", r, first[r], next[r])
				notByGuard(t, r, "mismatched call", first[r])
				notByGuard(t, r, "barrier after", next[r])
				mismatch = mismatch || errors.Is(first[r], collective.ErrMismatch) || errors.Is(next[r], collective.ErrMismatch)
				if first[r] == nil && next[r] == nil {
					t.Errorf("rank %d: the mismatched call and the next both succeeded", r)
				}
				if first[r] != nil && !errors.Is(next[r], collective.ErrPoisoned) {
					t.Errorf("rank %d: barrier after a failed call: %v, want ErrPoisoned", r, next[r])
				}
			}
			if !mismatch {
				t.Errorf("no rank reported ErrMismatch")
			}
		})
	}
}

// TestAdvRootOutOfRange: a root outside [0, size) — negative, size, a
// huge value that truncates to a valid int32 — fails with ErrArgs at
// every rank, for every rooted collective and its non-blocking twin,
// and leaves the communicator usable.
func TestAdvRootOutOfRange(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	for _, root := range []int{-1, p, 1 << 32, -1 << 32} {
		calls := map[string]advCall{
			"broadcast": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Broadcast(ctx, c, make([]int32, 3), root)
			},
			"reduce": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Reduce(ctx, c, make([]int32, 3), make([]int32, 3), collective.Sum, root)
			},
			"gather": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Gather(ctx, c, make([]int32, 1), make([]int32, p), root)
			},
			"gatherv": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Gatherv(ctx, c, make([]int32, 1), make([]int32, p), []int{1, 1, 1}, []int{0, 1, 2}, root)
			},
			"scatter": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Scatter(ctx, c, make([]int32, p), make([]int32, 1), root)
			},
			"scatterv": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Scatterv(ctx, c, make([]int32, p), []int{1, 1, 1}, []int{0, 1, 2}, make([]int32, 1), root)
			},
			"ibroadcast": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.IBroadcast(ctx, c, make([]int32, 3), root).Wait(ctx)
			},
			"ireduce": func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.IReduce(ctx, c, make([]int32, 3), make([]int32, 3), collective.Max, root).Wait(ctx)
			},
		}
		for name, call := range calls {
			errs := parallel(p, func(r int) error { return call(guardCtx(t), cs[r], r) })
			for r, err := range errs {
				if !errors.Is(err, collective.ErrArgs) {
					t.Errorf("%s root %d: rank %d: %v, want ErrArgs", name, root, r, err)
				}
			}
		}
	}
	got := make([][]int32, p)
	noErrors(t, "allreduce after bad roots", parallel(p, func(r int) error {
		got[r] = []int32{int32(r)}
		return collective.Allreduce(guardCtx(t), cs[r], nil, got[r], collective.Sum)
	}))
	for r := range p {
		if got[r][0] != 3 {
			t.Errorf("rank %d: %d, want 3", r, got[r][0])
		}
	}
}

// TestAdvTinyCounts: every collective with zero and one element per
// rank (and per block), at 2, 3 and 5 ranks, with every algorithm:
// results exact, nothing written outside the vectors (a guard element
// after each), and the communicator usable after.
func TestAdvTinyCounts(t *testing.T) {
	const guard = -7777
	for _, p := range []int{2, 3, 5} {
		for _, alg := range []collective.Algorithm{collective.AlgAuto, collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 256})
				for _, m := range []int{0, 1} {
					// withGuard returns a slice of n elements followed by a guard.
					withGuard := func(n int) ([]int64, func() bool) {
						b := make([]int64, n+1)
						b[n] = guard
						return b[:n], func() bool { return b[n] == guard }
					}
					type res struct {
						name string
						got  []int64
						want []int64
						ok   func() bool
					}
					results := make([][]res, p)
					noErrors(t, fmt.Sprintf("m=%d", m), parallel(p, func(r int) error {
						ctx := guardCtx(t)
						c := cs[r]
						add := func(name string, got, want []int64, ok func() bool) {
							results[r] = append(results[r], res{name, got, want, ok})
						}
						// Allreduce: sum of ranks+1.
						ar, ok := withGuard(m)
						for i := range ar {
							ar[i] = int64(r + 1)
						}
						if err := collective.Allreduce(ctx, c, nil, ar, collective.Sum); err != nil {
							return fmt.Errorf("allreduce: %w", err)
						}
						add("allreduce", ar, slices.Repeat([]int64{int64(p * (p + 1) / 2)}, m), ok)
						// Broadcast from the last rank.
						bc, ok := withGuard(m)
						if r == p-1 {
							for i := range bc {
								bc[i] = 42
							}
						}
						if err := collective.Broadcast(ctx, c, bc, p-1); err != nil {
							return fmt.Errorf("broadcast: %w", err)
						}
						add("broadcast", bc, slices.Repeat([]int64{42}, m), ok)
						// Reduce at rank 1 (max of ranks).
						rs := slices.Repeat([]int64{int64(r)}, m)
						rr, ok := withGuard(m)
						if err := collective.Reduce(ctx, c, rs, rr, collective.Max, 1); err != nil {
							return fmt.Errorf("reduce: %w", err)
						}
						if r == 1 {
							add("reduce", rr, slices.Repeat([]int64{int64(p - 1)}, m), ok)
						}
						// Allgather.
						ag, ok := withGuard(m * p)
						if err := collective.Allgather(ctx, c, slices.Repeat([]int64{int64(r)}, m), ag); err != nil {
							return fmt.Errorf("allgather: %w", err)
						}
						var want []int64
						for j := range p {
							want = append(want, slices.Repeat([]int64{int64(j)}, m)...)
						}
						add("allgather", ag, want, ok)
						// Alltoall: block j of rank r holds r*10+j.
						as := make([]int64, m*p)
						for j := range p {
							for k := range m {
								as[j*m+k] = int64(r*10 + j)
							}
						}
						at, ok := withGuard(m * p)
						if err := collective.Alltoall(ctx, c, as, at); err != nil {
							return fmt.Errorf("alltoall: %w", err)
						}
						want = nil
						for j := range p {
							want = append(want, slices.Repeat([]int64{int64(j*10 + r)}, m)...)
						}
						add("alltoall", at, want, ok)
						// ReduceScatter: block b of every rank holds b+r.
						rsIn := make([]int64, m*p)
						for b := range p {
							for k := range m {
								rsIn[b*m+k] = int64(b + r)
							}
						}
						rsOut, ok := withGuard(m)
						if err := collective.ReduceScatter(ctx, c, rsIn, rsOut, collective.Sum); err != nil {
							return fmt.Errorf("reduce-scatter: %w", err)
						}
						add("reduce-scatter", rsOut, slices.Repeat([]int64{int64(p*r + p*(p-1)/2)}, m), ok)
						// Gather and Scatter at rank 0.
						gr, ok := withGuard(m * p)
						if err := collective.Gather(ctx, c, slices.Repeat([]int64{int64(r + 5)}, m), gr, 0); err != nil {
							return fmt.Errorf("gather: %w", err)
						}
						if r == 0 {
							want = nil
							for j := range p {
								want = append(want, slices.Repeat([]int64{int64(j + 5)}, m)...)
							}
							add("gather", gr, want, ok)
						}
						sc, ok := withGuard(m)
						var scIn []int64
						if r == 0 {
							for j := range p {
								scIn = append(scIn, slices.Repeat([]int64{int64(j * 3)}, m)...)
							}
						}
						if err := collective.Scatter(ctx, c, scIn, sc, 0); err != nil {
							return fmt.Errorf("scatter: %w", err)
						}
						add("scatter", sc, slices.Repeat([]int64{int64(r * 3)}, m), ok)
						// Scan and ExScan of r+1.
						sn, ok := withGuard(m)
						if err := collective.Scan(ctx, c, slices.Repeat([]int64{int64(r + 1)}, m), sn, collective.Sum); err != nil {
							return fmt.Errorf("scan: %w", err)
						}
						add("scan", sn, slices.Repeat([]int64{int64((r + 1) * (r + 2) / 2)}, m), ok)
						ex, ok := withGuard(m)
						for i := range ex {
							ex[i] = -1
						}
						if err := collective.ExScan(ctx, c, slices.Repeat([]int64{int64(r + 1)}, m), ex, collective.Sum); err != nil {
							return fmt.Errorf("exscan: %w", err)
						}
						wantEx := int64(r * (r + 1) / 2)
						if r == 0 {
							wantEx = -1 // untouched
						}
						add("exscan", ex, slices.Repeat([]int64{wantEx}, m), ok)
						return collective.Barrier(ctx, c)
					}))
					for r := range p {
						for _, x := range results[r] {
							if !slices.Equal(x.got, x.want) {
								t.Errorf("m=%d rank %d %s: %v, want %v", m, r, x.name, x.got, x.want)
							}
							if !x.ok() {
								t.Errorf("m=%d rank %d %s: wrote past the vector", m, r, x.name)
							}
						}
					}
				}
			})
		}
	}
}

// TestAdvCustomOpPanics: a Custom operation that panics (its doc says
// it should not, but user code does) must not take the communicator and
// the other ranks down with it: the call at a rank where it panicked
// returns ErrOpPanicked naming the panic (the panic does not escape,
// not even from the library's goroutine of a non-blocking request, where
// nothing could recover it), the other ranks' calls fail (their peer
// gave up) instead of waiting for it — or complete, where their part
// needed no combining —, their next calls fail, and Close returns on
// every rank. Allreduce, Reduce, Scan, ExScan, ReduceScatter, blocking
// and not.
func TestAdvCustomOpPanics(t *testing.T) {
	// Every rank's operation panics: whichever ranks combine (the
	// algorithm decides) panic.
	boom := collective.Custom("boom", func(inout, in []int64) {
		panic("user operation exploded")
	})
	calls := []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, n int, nb bool) error
	}{
		{"allreduce", func(ctx context.Context, c *collective.Comm, n int, nb bool) error {
			v := make([]int64, n)
			if nb {
				return collective.IAllreduce(ctx, c, nil, v, boom).Wait(ctx)
			}
			return collective.Allreduce(ctx, c, nil, v, boom)
		}},
		{"reduce", func(ctx context.Context, c *collective.Comm, n int, nb bool) error {
			s, d := make([]int64, n), make([]int64, n)
			if nb {
				return collective.IReduce(ctx, c, s, d, boom, 1).Wait(ctx)
			}
			return collective.Reduce(ctx, c, s, d, boom, 1)
		}},
		{"scan", func(ctx context.Context, c *collective.Comm, n int, nb bool) error {
			v := make([]int64, n)
			if nb {
				return collective.IScan(ctx, c, nil, v, boom).Wait(ctx)
			}
			return collective.Scan(ctx, c, nil, v, boom)
		}},
		{"exscan", func(ctx context.Context, c *collective.Comm, n int, nb bool) error {
			v := make([]int64, n)
			if nb {
				return collective.IExScan(ctx, c, nil, v, boom).Wait(ctx)
			}
			return collective.ExScan(ctx, c, nil, v, boom)
		}},
		{"reduce-scatter", func(ctx context.Context, c *collective.Comm, n int, nb bool) error {
			v := make([]int64, 3*n)
			if nb {
				return collective.IReduceScatter(ctx, c, nil, v, boom).Wait(ctx)
			}
			return collective.ReduceScatter(ctx, c, nil, v, boom)
		}},
	}
	for _, tc := range calls {
		for _, nb := range []bool{false, true} {
			for _, n := range []int{1, 3000} { // one small message, and a vector of several chunks
				t.Run(fmt.Sprintf("%s/nonblocking=%v/n=%d", tc.name, nb, n), func(t *testing.T) {
					const p = 3
					cs := world(t, p, collective.Options{ChunkSize: 4096})
					errs := parallel(p, func(r int) (err error) {
						defer func() {
							if v := recover(); v != nil {
								err = fmt.Errorf("the panic reached the caller: %v", v)
							}
						}()
						return tc.call(guardCtx(t), cs[r], n, nb)
					})
					named := false
					for r, err := range errs {
						t.Logf("rank %d: %.200v", r, err)
						notByGuard(t, r, "call with a panicking op", err)
						if err != nil && containsAll(err.Error(), "reached the caller") {
							t.Errorf("rank %d: %v", r, err)
						}
						named = named || errors.Is(err, collective.ErrOpPanicked) && containsAll(err.Error(), "user operation exploded")
					}
					if !named {
						t.Errorf("no rank's error is ErrOpPanicked naming the panic")
					}
					// A rank whose part of the call needed no combining
					// (ExScan's rank 0) may complete it; its next call fails
					// (the peer gave up), the others' are poisoned.
					for r, err := range parallel(p, func(r int) error { return collective.Barrier(guardCtx(t), cs[r]) }) {
						notByGuard(t, r, "barrier after", err)
						if errs[r] != nil && !errors.Is(err, collective.ErrPoisoned) {
							t.Errorf("rank %d: barrier after a failed call: %v, want ErrPoisoned", r, err)
						}
						if errs[r] == nil && !errors.Is(err, collective.ErrPeerAborted) {
							t.Errorf("rank %d: barrier after: %v, want ErrPeerAborted", r, err)
						}
					}
				})
			}
		}
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !contains(s, sub) {
			return false
		}
	}
	return true
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// TestAdvCancelOneRank: one rank's context ends — before its call
// begins (the others are in the call already), or while its call waits
// for a late peer — and the others' contexts do not: that rank fails
// with its context's error, and every other rank fails too (its peer
// gave up: ErrPeerAborted) instead of waiting for the hang guard, the
// late one as soon as it calls; later calls are poisoned everywhere; and
// a new communicator on the same nodes reduces correctly.
func TestAdvCancelOneRank(t *testing.T) {
	for _, tc := range []struct {
		name     string
		n        int
		midCall  bool
		cancelIn time.Duration
	}{{"before the call, small", 4, false, 0}, {"before the call, ring", 1 << 17, false, 0},
		{"waiting, small", 4, true, 2 * time.Millisecond}, {"waiting, ring", 1 << 17, true, 2 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			const p = 3
			ns := nodes(t, p)
			cs := commsOn(t, ns, collective.Options{ChunkSize: 4096})
			victimCtx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if !tc.midCall {
				cancel()
			}
			victimDone := make(chan struct{})
			errs := parallel(p, func(r int) error {
				v := make([]float64, tc.n)
				switch r {
				case 0:
					defer close(victimDone)
					if tc.midCall {
						// Rank 2 calls only after rank 0's call ended: rank
						// 0's call is waiting for it when its context ends.
						time.AfterFunc(tc.cancelIn, cancel)
					}
					return collective.Allreduce(victimCtx, cs[0], nil, v, collective.Sum)
				case 2:
					if tc.midCall {
						<-victimDone
					}
				}
				return collective.Allreduce(guardCtx(t), cs[r], nil, v, collective.Sum)
			})
			for r, err := range errs {
				t.Logf("rank %d: %v", r, err)
				notByGuard(t, r, "allreduce", err)
			}
			if !errors.Is(errs[0], context.Canceled) {
				t.Errorf("rank 0: %v, want its context's cancellation", errs[0])
			}
			for r := 1; r < p; r++ {
				if !errors.Is(errs[r], collective.ErrPeerAborted) {
					t.Errorf("rank %d: %v, want ErrPeerAborted", r, errs[r])
				}
			}
			for r, err := range parallel(p, func(r int) error { return collective.Barrier(guardCtx(t), cs[r]) }) {
				if !errors.Is(err, collective.ErrPoisoned) {
					t.Errorf("rank %d: barrier after: %v, want ErrPoisoned", r, err)
				}
			}
			// A new communicator on the same nodes works.
			fresh := commsOn(t, ns, collective.Options{})
			got := make([][]float64, p)
			noErrors(t, "allreduce on a new communicator", parallel(p, func(r int) error {
				got[r] = []float64{float64(r), 1}
				return collective.Allreduce(guardCtx(t), fresh[r], nil, got[r], collective.Sum)
			}))
			for r := range p {
				if got[r][0] != 3 || got[r][1] != 3 {
					t.Errorf("rank %d: %v, want [3 3]", r, got[r])
				}
			}
		})
	}
}

// TestAdvManyRequests: 24 non-blocking collectives of every kind issued
// at once on each rank, waited for in reverse order (and some in a
// shuffled order) while another goroutine polls Test on all of them:
// each completes with its own correct result (they run in issue order),
// Test agrees with Wait once done, and Wait after completion returns the
// same error again.
func TestAdvManyRequests(t *testing.T) {
	const p, rounds = 3, 4
	cs := world(t, p, collective.Options{ChunkSize: 1024})
	type check struct {
		name string
		ok   func() bool
	}
	checks := make([][]check, p)
	noErrors(t, "requests", parallel(p, func(r int) error {
		ctx := guardCtx(t)
		c := cs[r]
		var reqs []*collective.Request
		add := func(name string, q *collective.Request, ok func() bool) {
			reqs = append(reqs, q)
			checks[r] = append(checks[r], check{name, ok})
		}
		for k := range rounds {
			ar := []int64{int64(r), int64(k)}
			add(fmt.Sprintf("iallreduce %d", k), collective.IAllreduce(ctx, c, nil, ar, collective.Sum),
				func() bool { return slices.Equal(ar, []int64{3, int64(p * k)}) })
			big := make([]float32, 5000)
			for i := range big {
				big[i] = float32(r + i)
			}
			add(fmt.Sprintf("iallreduce big %d", k), collective.IAllreduce(ctx, c, nil, big, collective.Max),
				func() bool { return big[0] == float32(p-1) && big[4999] == float32(p-1+4999) })
			bc := make([]int32, 700)
			if r == k%p {
				for i := range bc {
					bc[i] = int32(k*1000 + i)
				}
			}
			add(fmt.Sprintf("ibroadcast %d", k), collective.IBroadcast(ctx, c, bc, k%p),
				func() bool { return bc[0] == int32(k*1000) && bc[699] == int32(k*1000+699) })
			ag := make([]uint8, p)
			add(fmt.Sprintf("iallgather %d", k), collective.IAllgather(ctx, c, []uint8{uint8(r + k)}, ag),
				func() bool { return slices.Equal(ag, []uint8{uint8(k), uint8(1 + k), uint8(2 + k)}) })
			add(fmt.Sprintf("ibarrier %d", k), collective.IBarrier(ctx, c), func() bool { return true })
			sc := make([]int64, 1)
			add(fmt.Sprintf("iscan %d", k), collective.IScan(ctx, c, []int64{int64(r + 1)}, sc, collective.Sum),
				func() bool { return sc[0] == int64((r+1)*(r+2)/2) })
		}
		// A poller: Test on every request until all are done.
		var wg sync.WaitGroup
		var pollErr error
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				all := true
				for _, q := range reqs {
					done, err := q.Test()
					if done && err != nil && pollErr == nil {
						pollErr = err
					}
					all = all && done
				}
				if all {
					return
				}
				time.Sleep(50 * time.Microsecond)
			}
		}()
		// Wait in reverse order.
		for i := len(reqs) - 1; i >= 0; i-- {
			if err := reqs[i].Wait(ctx); err != nil {
				return fmt.Errorf("request %d (%s): %w", i, checks[r][i].name, err)
			}
		}
		wg.Wait()
		if pollErr != nil {
			return fmt.Errorf("Test reported %w", pollErr)
		}
		for i, q := range reqs {
			if done, err := q.Test(); !done || err != nil {
				return fmt.Errorf("request %d: Test after Wait: %v, %v", i, done, err)
			}
			if err := q.Wait(ctx); err != nil {
				return fmt.Errorf("request %d: second Wait: %w", i, err)
			}
		}
		return nil
	}))
	for r := range p {
		for _, ch := range checks[r] {
			if !ch.ok() {
				t.Errorf("rank %d: %s: wrong result", r, ch.name)
			}
		}
	}
}

// TestAdvSplitShapes: Split with every rank the same color (keys all
// tied: the order of the parent), every rank its own color (size-1
// communicators whose collectives are local), negative colors of any
// value (no communicator), keys that tie within a color (ties by parent
// rank) and reversed keys: sizes, ranks and a collective on each part
// are right, and the parent still works.
func TestAdvSplitShapes(t *testing.T) {
	const p = 5
	cs := world(t, p, collective.Options{})
	for _, tc := range []struct {
		name       string
		color, key func(r int) int
		wantSize   func(r int) int // 0: no communicator
		wantRank   func(r int) int
	}{
		{"same color, tied keys", func(int) int { return 7 }, func(int) int { return 0 },
			func(int) int { return p }, func(r int) int { return r }},
		{"same color, reversed keys", func(int) int { return 0 }, func(r int) int { return -r },
			func(int) int { return p }, func(r int) int { return p - 1 - r }},
		{"all different", func(r int) int { return 100 + r }, func(int) int { return 1 },
			func(int) int { return 1 }, func(int) int { return 0 }},
		{"negative colors", func(r int) int {
			if r%2 == 0 {
				return -5 - r // any negative color means none
			}
			return 1
		}, func(r int) int { return 3 }, func(r int) int {
			if r%2 == 0 {
				return 0
			}
			return 2
		}, func(r int) int { return r / 2 }},
		{"ties within colors", func(r int) int { return r % 2 }, func(r int) int {
			if r == 4 {
				return -1
			}
			return 9
		}, func(r int) int { return []int{3, 2}[r%2] }, func(r int) int { return []int{1, 0, 2, 1, 0}[r] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			subs := make([]*collective.Comm, p)
			noErrors(t, "split", parallel(p, func(r int) error {
				var err error
				subs[r], err = cs[r].Split(guardCtx(t), tc.color(r), tc.key(r))
				return err
			}))
			defer closeAll(t, subs)
			sums := make([][]int64, p)
			for r := range p {
				s := subs[r]
				if want := tc.wantSize(r); want == 0 {
					if s != nil {
						t.Fatalf("rank %d: a communicator of %d ranks, want none", r, s.Size())
					}
					continue
				} else if s == nil || s.Size() != want || s.Rank() != tc.wantRank(r) || s.WorldRank(s.Rank()) != r {
					t.Fatalf("rank %d: %v, want size %d rank %d", r, describe(s), want, tc.wantRank(r))
				}
			}
			noErrors(t, "allreduce on the parts", parallel(p, func(r int) error {
				if subs[r] == nil {
					return nil
				}
				sums[r] = []int64{int64(r), 1}
				return collective.Allreduce(guardCtx(t), subs[r], nil, sums[r], collective.Sum)
			}))
			for r := range p {
				if subs[r] == nil {
					continue
				}
				var want int64
				for q := range p {
					if subs[q] != nil && tc.color(q) == tc.color(r) {
						want += int64(q)
					}
				}
				if sums[r][0] != want || sums[r][1] != int64(subs[r].Size()) {
					t.Errorf("rank %d: %v, want [%d %d]", r, sums[r], want, subs[r].Size())
				}
			}
			noErrors(t, "parent barrier", parallel(p, func(r int) error { return collective.Barrier(guardCtx(t), cs[r]) }))
		})
	}
}

func describe(c *collective.Comm) string {
	if c == nil {
		return "no communicator"
	}
	return fmt.Sprintf("size %d rank %d (world %d)", c.Size(), c.Rank(), c.WorldRank(c.Rank()))
}

// TestAdvPoisonedEverything: once a communicator is poisoned (a
// mismatch), every kind of call on it fails with ErrPoisoned wrapping
// the first failure — blocking and non-blocking, Split and Dup — at
// once and without sending, and Close still works on every rank.
func TestAdvPoisonedEverything(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	parallel(p, func(r int) error {
		return collective.Allreduce(guardCtx(t), cs[r], nil, make([]int32, 1+r), collective.Sum)
	})
	for r := range p {
		if cs[r].Err() == nil {
			t.Fatalf("rank %d: not poisoned after a mismatch", r)
		}
	}
	ctx := guardCtx(t)
	for r := range p {
		c := cs[r]
		v := make([]int32, p)
		for name, err := range map[string]error{
			"barrier":        collective.Barrier(ctx, c),
			"allreduce":      collective.Allreduce(ctx, c, nil, v, collective.Sum),
			"broadcast":      collective.Broadcast(ctx, c, v, 0),
			"reduce":         collective.Reduce(ctx, c, v, v, collective.Sum, 0),
			"allgather":      collective.Allgather(ctx, c, v[:1], v),
			"alltoall":       collective.Alltoall(ctx, c, nil, v),
			"reduce-scatter": collective.ReduceScatter(ctx, c, nil, v, collective.Sum),
			"gather":         collective.Gather(ctx, c, v[:1], v, 0),
			"scatter":        collective.Scatter(ctx, c, v, v[:1], 0),
			"scan":           collective.Scan(ctx, c, nil, v, collective.Sum),
			"exscan":         collective.ExScan(ctx, c, nil, v, collective.Sum),
			"iallreduce":     collective.IAllreduce(ctx, c, nil, v, collective.Sum).Wait(ctx),
			"ibarrier":       collective.IBarrier(ctx, c).Wait(ctx),
			"split": func() error {
				s, err := c.Split(ctx, 0, 0)
				if s != nil {
					return errors.New("got a communicator")
				}
				return err
			}(),
			"dup": func() error {
				s, err := c.Dup(ctx)
				if s != nil {
					return errors.New("got a communicator")
				}
				return err
			}(),
		} {
			if !errors.Is(err, collective.ErrPoisoned) || !errors.Is(err, collective.ErrMismatch) {
				t.Errorf("rank %d: %s on a poisoned communicator: %v, want ErrPoisoned wrapping ErrMismatch", r, name, err)
			}
		}
	}
}

// TestAdvCloseDuringCall: Close on a rank from another goroutine while
// that rank's collective waits for a peer that is late (and while
// non-blocking requests are queued behind it): the call in progress and
// the queued requests fail with ErrClosed, later calls too, Close
// returns, the peer's call fails (its peer closed or gave up) instead of
// hanging, and no goroutine of the package is left behind once the
// nodes are closed.
func TestAdvCloseDuringCall(t *testing.T) {
	defer verifyNoLeaks(t)()
	func() {
		const p = 2
		ns := nodes(t, p)
		cs := newComms(t, guardCtx(t), ns, collective.Options{})
		ctx := guardCtx(t)
		calling := make(chan struct{})
		var callErr error
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			close(calling)
			callErr = collective.Allreduce(ctx, cs[0], nil, make([]float64, 1000), collective.Sum)
		}()
		<-calling
		time.Sleep(5 * time.Millisecond) // let it start waiting (not needed for correctness)
		queued := []*collective.Request{
			collective.IBarrier(ctx, cs[0]),
			collective.IAllreduce(ctx, cs[0], nil, make([]int64, 3), collective.Sum),
		}
		if err := cs[0].Close(); err != nil {
			t.Errorf("rank 0: Close during a call: %v", err)
		}
		wg.Wait()
		if !errors.Is(callErr, collective.ErrClosed) {
			t.Errorf("rank 0: the call in progress: %v, want ErrClosed", callErr)
		}
		for i, q := range queued {
			if err := q.Wait(ctx); !errors.Is(err, collective.ErrClosed) {
				t.Errorf("rank 0: queued request %d: %v, want ErrClosed", i, err)
			}
		}
		if err := collective.Barrier(ctx, cs[0]); !errors.Is(err, collective.ErrClosed) {
			t.Errorf("rank 0: barrier after Close: %v, want ErrClosed", err)
		}
		// The late peer arrives: its call cannot complete.
		err := collective.Allreduce(ctx, cs[1], nil, make([]float64, 1000), collective.Sum)
		notByGuard(t, 1, "allreduce after the peer closed", err)
		if err == nil {
			t.Errorf("rank 1: allreduce with a peer that closed succeeded")
		}
		t.Logf("rank 1: %v", err)
		if err := cs[1].Close(); err != nil {
			t.Errorf("rank 1: Close: %v", err)
		}
		for _, n := range ns {
			n.Close()
		}
	}()
}

// TestAdvInPlaceAliases: every in-place form (send nil, or send the very
// slice or block of recv the documentation names) gives the result of
// the out-of-place call, for small vectors and vectors of several
// chunks; and partly overlapping send and recv fail with ErrArgs at
// every rank, leaving the communicator usable.
func TestAdvInPlaceAliases(t *testing.T) {
	const p = 3
	for _, m := range []int{3, 3000} {
		t.Run(fmt.Sprintf("m=%d", m), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			val := func(r, i int) int64 { return int64(r*100000 + i) }
			noErrors(t, "in place", parallel(p, func(r int) error {
				ctx := guardCtx(t)
				c := cs[r]
				fill := func(n int) []int64 {
					v := make([]int64, n)
					for i := range v {
						v[i] = val(r, i)
					}
					return v
				}
				sumAt := func(i int) int64 {
					var s int64
					for q := range p {
						s += val(q, i)
					}
					return s
				}
				expect := func(name string, got []int64, want func(i int) int64) error {
					for i := range got {
						if got[i] != want(i) {
							return fmt.Errorf("%s: element %d is %d, want %d", name, i, got[i], want(i))
						}
					}
					return nil
				}
				// Allreduce: send nil, and send == recv.
				for _, same := range []bool{false, true} {
					v := fill(m)
					var send []int64
					if same {
						send = v
					}
					if err := collective.Allreduce(ctx, c, send, v, collective.Sum); err != nil {
						return err
					}
					if err := expect(fmt.Sprintf("allreduce (send == recv: %v)", same), v, sumAt); err != nil {
						return err
					}
				}
				// Allgather: send nil, and send = recv's own block.
				for _, own := range []bool{false, true} {
					recv := make([]int64, p*m)
					copy(recv[r*m:], fill(m))
					var send []int64
					if own {
						send = recv[r*m : (r+1)*m]
					}
					if err := collective.Allgather(ctx, c, send, recv); err != nil {
						return err
					}
					if err := expect("allgather", recv, func(i int) int64 { return val(i/m, i%m) }); err != nil {
						return err
					}
				}
				// Alltoall in place: block j of rank r is val(r, j*m+k).
				v := fill(p * m)
				if err := collective.Alltoall(ctx, c, nil, v); err != nil {
					return err
				}
				if err := expect("alltoall", v, func(i int) int64 { return val(i/m, r*m+i%m) }); err != nil {
					return err
				}
				// ReduceScatter in place: block r of the sum in v[:m].
				v = fill(p * m)
				if err := collective.ReduceScatter(ctx, c, nil, v, collective.Sum); err != nil {
					return err
				}
				if err := expect("reduce-scatter", v[:m], func(i int) int64 { return sumAt(r*m + i) }); err != nil {
					return err
				}
				// Scan with send == recv, ExScan with send nil.
				v = fill(m)
				if err := collective.Scan(ctx, c, v, v, collective.Sum); err != nil {
					return err
				}
				prefix := func(upto, i int) int64 {
					var s int64
					for q := 0; q < upto; q++ {
						s += val(q, i)
					}
					return s
				}
				if err := expect("scan", v, func(i int) int64 { return prefix(r+1, i) }); err != nil {
					return err
				}
				v = fill(m)
				if err := collective.ExScan(ctx, c, nil, v, collective.Sum); err != nil {
					return err
				}
				if r > 0 {
					if err := expect("exscan", v, func(i int) int64 { return prefix(r, i) }); err != nil {
						return err
					}
				}
				// Reduce at rank 1, in place there (send == recv), and
				// with send nil there.
				for _, same := range []bool{false, true} {
					v := fill(m)
					send := v
					if r == 1 && !same {
						send = nil
					}
					if err := collective.Reduce(ctx, c, send, v, collective.Sum, 1); err != nil {
						return err
					}
					if r == 1 {
						if err := expect("reduce", v, sumAt); err != nil {
							return err
						}
					}
				}
				// Gather at rank 2 with the root's send its own block of
				// recv, and Scatter from rank 2 with recv the root's block.
				recv := make([]int64, p*m)
				send := fill(m)
				if r == 2 {
					copy(recv[2*m:], send)
					send = recv[2*m : 3*m]
				}
				if err := collective.Gather(ctx, c, send, recv, 2); err != nil {
					return err
				}
				if r == 2 {
					if err := expect("gather", recv, func(i int) int64 { return val(i/m, i%m) }); err != nil {
						return err
					}
				}
				var scIn, scOut []int64
				scOut = make([]int64, m)
				if r == 2 {
					scIn = make([]int64, p*m)
					for i := range scIn {
						scIn[i] = val(9, i)
					}
					scOut = scIn[2*m : 3*m]
				}
				if err := collective.Scatter(ctx, c, scIn, scOut, 2); err != nil {
					return err
				}
				return expect("scatter", scOut, func(i int) int64 { return val(9, r*m+i) })
			}))
			// Partial overlaps: ErrArgs at every rank, nothing sent.
			for name, call := range map[string]advCall{
				"allreduce": func(ctx context.Context, c *collective.Comm, r int) error {
					b := make([]int64, m+1)
					return collective.Allreduce(ctx, c, b[1:], b[:m], collective.Sum)
				},
				"scan": func(ctx context.Context, c *collective.Comm, r int) error {
					b := make([]int64, m+1)
					return collective.Scan(ctx, c, b[:m], b[1:], collective.Sum)
				},
				"alltoall": func(ctx context.Context, c *collective.Comm, r int) error {
					b := make([]int64, p*m+1)
					return collective.Alltoall(ctx, c, b[1:], b[:p*m])
				},
				"reduce-scatter": func(ctx context.Context, c *collective.Comm, r int) error {
					b := make([]int64, p*m)
					return collective.ReduceScatter(ctx, c, b, b[:m], collective.Sum)
				},
				"allgather": func(ctx context.Context, c *collective.Comm, r int) error {
					b := make([]int64, p*m)
					return collective.Allgather(ctx, c, b[(r+1)%p*m:][:m], b)
				},
			} {
				for r, err := range parallel(p, func(r int) error { return call(guardCtx(t), cs[r], r) }) {
					if !errors.Is(err, collective.ErrArgs) {
						t.Errorf("%s with overlapping buffers: rank %d: %v, want ErrArgs", name, r, err)
					}
				}
			}
			noErrors(t, "barrier after", parallel(p, func(r int) error { return collective.Barrier(guardCtx(t), cs[r]) }))
		})
	}
}

// TestAdvOddSizes: vectors of 1-byte and 2-byte elements whose byte
// lengths straddle the small-message limit (LLMax) and the chunk size,
// odd and not multiples of 4 (small messages carry 4 bytes a word):
// Allreduce, Broadcast and Allgather give exact results at 2 and 3 ranks
// and write nothing past the vectors.
func TestAdvOddSizes(t *testing.T) {
	const chunk = 1024
	sizes := []int{1, 2, 3, 5, 7, collective.LLMax - 1, collective.LLMax, collective.LLMax + 1, collective.LLMax + 3,
		chunk + 1, 2*chunk - 1, 3*chunk + 5}
	for _, p := range []int{2, 3} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: chunk})
			noErrors(t, "odd sizes", parallel(p, func(r int) error {
				ctx := guardCtx(t)
				for _, n := range sizes {
					// int8, Max: element i of rank r is (i+r) mod 100.
					b := make([]int8, n+3)
					for i := range b {
						b[i] = int8((i + r) % 100)
					}
					if err := collective.Allreduce(ctx, cs[r], nil, b[:n], collective.Max); err != nil {
						return fmt.Errorf("int8 allreduce of %d: %w", n, err)
					}
					for i := range n {
						want := int8(0)
						for q := range p {
							want = max(want, int8((i+q)%100))
						}
						if b[i] != want {
							return fmt.Errorf("int8 allreduce of %d: element %d is %d, want %d", n, i, b[i], want)
						}
					}
					for i := n; i < n+3; i++ {
						if b[i] != int8((i+r)%100) {
							return fmt.Errorf("int8 allreduce of %d: element %d past the vector changed", n, i)
						}
					}
					// uint16, Sum, out of place.
					s, d := make([]uint16, n), make([]uint16, n+1)
					d[n] = 0xbeef
					for i := range s {
						s[i] = uint16(i*7 + r)
					}
					if err := collective.Allreduce(ctx, cs[r], s, d[:n], collective.Sum); err != nil {
						return fmt.Errorf("uint16 allreduce of %d: %w", n, err)
					}
					for i := range n {
						if want := uint16(p*i*7 + p*(p-1)/2); d[i] != want {
							return fmt.Errorf("uint16 allreduce of %d: element %d is %d, want %d", n, i, d[i], want)
						}
					}
					if d[n] != 0xbeef {
						return fmt.Errorf("uint16 allreduce of %d wrote past recv", n)
					}
					// Broadcast of bytes from the last rank.
					bc := make([]uint8, n+1)
					bc[n] = 0x5a
					if r == p-1 {
						for i := range n {
							bc[i] = uint8(i*13 + 1)
						}
					}
					if err := collective.Broadcast(ctx, cs[r], bc[:n], p-1); err != nil {
						return fmt.Errorf("broadcast of %d: %w", n, err)
					}
					for i := range n {
						if bc[i] != uint8(i*13+1) {
							return fmt.Errorf("broadcast of %d: byte %d is %d", n, i, bc[i])
						}
					}
					if bc[n] != 0x5a {
						return fmt.Errorf("broadcast of %d wrote past buf", n)
					}
					// Allgather of n bytes per rank.
					ag := make([]uint8, p*n+1)
					ag[p*n] = 0xa5
					mine := make([]uint8, n)
					for i := range mine {
						mine[i] = uint8(r*31 + i)
					}
					if err := collective.Allgather(ctx, cs[r], mine, ag[:p*n]); err != nil {
						return fmt.Errorf("allgather of %d: %w", n, err)
					}
					for q := range p {
						for i := range n {
							if ag[q*n+i] != uint8(q*31+i) {
								return fmt.Errorf("allgather of %d: rank %d's byte %d is %d", n, q, i, ag[q*n+i])
							}
						}
					}
					if ag[p*n] != 0xa5 {
						return fmt.Errorf("allgather of %d wrote past recv", n)
					}
				}
				return nil
			}))
		})
	}
}

// TestAdvConcurrentComms: a communicator and its Dup used at once from
// two goroutines per rank, in loops that start at different moments on
// different ranks (so that waits sleep on the node's shared channel
// while the other communicator's traffic comes and goes): every result
// of both is exact; neither steals the other's wake-ups or data.
func TestAdvConcurrentComms(t *testing.T) {
	const p, iters = 3, 40
	cs := world(t, p, collective.Options{ChunkSize: 1024})
	dups := make([]*collective.Comm, p)
	noErrors(t, "dup", parallel(p, func(r int) error {
		var err error
		dups[r], err = cs[r].Dup(guardCtx(t))
		return err
	}))
	defer closeAll(t, dups)
	noErrors(t, "concurrent", parallel(2*p, func(i int) error {
		r, c := i%p, cs[i%p]
		if i >= p {
			c = dups[r]
		}
		ctx := guardCtx(t)
		if (r+i/p)%2 == 1 {
			time.Sleep(3 * time.Millisecond) // a late start: the peers wait (not asserted on)
		}
		for k := range iters {
			n := 1 + k*97%3000
			v := make([]int64, n)
			for j := range v {
				v[j] = int64(r + j + i/p*1000)
			}
			if err := collective.Allreduce(ctx, c, nil, v, collective.Sum); err != nil {
				return fmt.Errorf("comm %d iteration %d: %w", i/p, k, err)
			}
			for j := range v {
				if want := int64(p*(j+i/p*1000) + p*(p-1)/2); v[j] != want {
					return fmt.Errorf("comm %d iteration %d: element %d is %d, want %d", i/p, k, j, v[j], want)
				}
			}
			if k%10 == 9 {
				time.Sleep(time.Duration(r) * time.Millisecond)
			}
		}
		return nil
	}))
}

// TestAdvAbandonedTurn: a call whose context ends while it waits for its
// turn behind another call of the same rank (blocked on a late peer)
// fails with the context's error; the call ahead completes correctly once
// the peer comes; the abandoned call's place is skipped and poisons the
// communicator, so that the peer's matching call fails (its peer gave
// up) instead of hanging; a Request whose Wait's context ended can be
// waited for again and gives the call's own result; and nothing is left
// running after Close.
func TestAdvAbandonedTurn(t *testing.T) {
	defer verifyNoLeaks(t)()
	func() {
		const p = 2
		ns := nodes(t, p)
		cs := newComms(t, guardCtx(t), ns, collective.Options{})
		ctx := guardCtx(t)
		// Rank 0: a request that waits for rank 1, then a blocking call
		// behind it whose context ends while it waits for its turn.
		v0 := []int64{1, 2}
		first := collective.IAllreduce(ctx, cs[0], nil, v0, collective.Sum)
		shortCtx, cancel := context.WithCancel(ctx)
		time.AfterFunc(2*time.Millisecond, cancel)
		err := collective.Barrier(shortCtx, cs[0])
		if !errors.Is(err, context.Canceled) {
			t.Errorf("rank 0: barrier abandoned in the queue: %v, want its context's cancellation", err)
		}
		// Waiting for the request with an ended context: ErrTimeout, and
		// the request goes on.
		ended, cancelEnded := context.WithCancel(ctx)
		cancelEnded()
		if err := first.Wait(ended); err == nil {
			t.Errorf("rank 0: Wait with an ended context on a pending request: nil")
		}
		// Rank 1 comes: the allreduce completes; its barrier finds that
		// rank 0 gave that call up.
		v1 := []int64{10, 20}
		if err := collective.Allreduce(ctx, cs[1], nil, v1, collective.Sum); err != nil {
			t.Errorf("rank 1: allreduce: %v", err)
		}
		if err := first.Wait(ctx); err != nil {
			t.Errorf("rank 0: allreduce ahead of the abandoned call: %v", err)
		}
		if !slices.Equal(v0, []int64{11, 22}) || !slices.Equal(v1, []int64{11, 22}) {
			t.Errorf("allreduce results %v, %v, want [11 22]", v0, v1)
		}
		err = collective.Barrier(ctx, cs[1])
		notByGuard(t, 1, "barrier matching the abandoned one", err)
		if !errors.Is(err, collective.ErrPeerAborted) {
			t.Errorf("rank 1: barrier matching rank 0's abandoned one: %v, want ErrPeerAborted", err)
		}
		for r := range p {
			if err := collective.Barrier(ctx, cs[r]); !errors.Is(err, collective.ErrPoisoned) {
				t.Errorf("rank %d: barrier after: %v, want ErrPoisoned", r, err)
			}
		}
		closeAll(t, cs)
		for _, n := range ns {
			n.Close()
		}
	}()
}

// TestAdvSizeOne: communicators of one rank (every rank its own color,
// and a world of one node): every collective is a local copy or a no-op
// with the documented result, non-blocking twins too, Split and Dup of
// them work, and bad roots still fail with ErrArgs.
func TestAdvSizeOne(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	subs := make([]*collective.Comm, p)
	noErrors(t, "split", parallel(p, func(r int) error {
		var err error
		subs[r], err = cs[r].Split(guardCtx(t), r, 0)
		return err
	}))
	defer closeAll(t, subs)
	single := world(t, 1, collective.Options{})
	for i, c := range []*collective.Comm{subs[0], subs[1], single[0]} {
		ctx := guardCtx(t)
		if c.Size() != 1 || c.Rank() != 0 {
			t.Fatalf("communicator %d: size %d rank %d", i, c.Size(), c.Rank())
		}
		fail := func(name string, err error) {
			if err != nil {
				t.Errorf("communicator %d: %s: %v", i, name, err)
			}
		}
		in := []float64{1.5, -2, 3}
		out := make([]float64, 3)
		fail("barrier", collective.Barrier(ctx, c))
		fail("allreduce", collective.Allreduce(ctx, c, in, out, collective.Prod))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: allreduce %v, want %v", i, out, in)
		}
		fail("broadcast", collective.Broadcast(ctx, c, out, 0))
		clear(out)
		fail("reduce", collective.Reduce(ctx, c, in, out, collective.Min, 0))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: reduce %v", i, out)
		}
		clear(out)
		fail("allgather", collective.Allgather(ctx, c, in, out))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: allgather %v", i, out)
		}
		clear(out)
		fail("alltoall", collective.Alltoall(ctx, c, in, out))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: alltoall %v", i, out)
		}
		clear(out)
		fail("reduce-scatter", collective.ReduceScatter(ctx, c, in, out, collective.Sum))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: reduce-scatter %v", i, out)
		}
		clear(out)
		fail("gather", collective.Gather(ctx, c, in, out, 0))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: gather %v", i, out)
		}
		clear(out)
		fail("scatter", collective.Scatter(ctx, c, in, out, 0))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: scatter %v", i, out)
		}
		clear(out)
		fail("scan", collective.Scan(ctx, c, in, out, collective.Sum))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: scan %v", i, out)
		}
		ex := []float64{7, 7, 7}
		fail("exscan", collective.ExScan(ctx, c, in, ex, collective.Sum))
		if !slices.Equal(ex, []float64{7, 7, 7}) {
			t.Errorf("communicator %d: exscan changed rank 0's recv: %v", i, ex)
		}
		clear(out)
		fail("iallreduce", collective.IAllreduce(ctx, c, in, out, collective.Max).Wait(ctx))
		if !slices.Equal(out, in) {
			t.Errorf("communicator %d: iallreduce %v", i, out)
		}
		fail("ibarrier", collective.IBarrier(ctx, c).Wait(ctx))
		if err := collective.Broadcast(ctx, c, out, 1); !errors.Is(err, collective.ErrArgs) {
			t.Errorf("communicator %d: broadcast from root 1: %v, want ErrArgs", i, err)
		}
		d, err := c.Dup(ctx)
		fail("dup", err)
		if d != nil {
			fail("barrier on the dup", collective.Barrier(ctx, d))
			fail("close the dup", d.Close())
		}
		none, err := c.Split(ctx, collective.Undefined, 0)
		if err != nil || none != nil {
			t.Errorf("communicator %d: split with no color: %v, %v", i, none, err)
		}
	}
}

// TestAdvBufferCloseWhileQueued: a Buffer that a non-blocking call was
// issued on, still queued behind a call that waits for a late peer,
// cannot be closed (ErrBufferBusy, as Buffer's doc says while a call
// uses it) — closing it would free memory the call is about to read and
// write — and once the requests completed, with right results, it
// closes.
func TestAdvBufferCloseWhileQueued(t *testing.T) {
	const p, n = 2, 1 << 16 // 256 KiB of float32: sent in place from the Buffer
	for _, kind := range []string{"allreduce", "broadcast", "allgather"} {
		t.Run(kind, func(t *testing.T) {
			cs := world(t, p, collective.Options{})
			ctx := guardCtx(t)
			bufs := make([]*collective.Buffer[float32], p)
			for r := range p {
				var err error
				if bufs[r], err = collective.Alloc[float32](cs[r], n); err != nil {
					t.Fatal(err)
				}
				for i, v := 0, bufs[r].Slice(); i < n; i++ {
					v[i] = float32(r + 1)
				}
			}
			issue := func(r int) (*collective.Request, *collective.Request) {
				c, v := cs[r], bufs[r].Slice()
				first := collective.IBarrier(ctx, c)
				switch kind {
				case "allreduce":
					return first, collective.IAllreduce(ctx, c, nil, v, collective.Sum)
				case "broadcast":
					return first, collective.IBroadcast(ctx, c, v, 1)
				}
				return first, collective.IAllgather(ctx, c, v[r*n/p:(r+1)*n/p], v)
			}
			b0, q0 := issue(0)
			if err := bufs[0].Close(); !errors.Is(err, collective.ErrBufferBusy) {
				t.Errorf("Close of a Buffer a queued request uses: %v, want ErrBufferBusy", err)
			}
			b1, q1 := issue(1)
			for r, q := range []*collective.Request{b0, q0, b1, q1} {
				if err := q.Wait(ctx); err != nil {
					t.Fatalf("request %d: %v", r, err)
				}
			}
			want := map[string]float32{"allreduce": 3, "broadcast": 2}[kind]
			for r := range p {
				v := bufs[r].Slice()
				if v == nil {
					t.Fatalf("rank %d: the Buffer was closed under the request", r)
				}
				for i := 0; i < n; i += 997 {
					w := want
					if kind == "allgather" {
						w = float32(i/(n/p) + 1)
					}
					if v[i] != w {
						t.Fatalf("rank %d: element %d is %v, want %v", r, i, v[i], w)
					}
				}
				if err := bufs[r].Close(); err != nil {
					t.Errorf("rank %d: Close after the requests: %v", r, err)
				}
			}
		})
	}
}

// TestAdvNodeClosedUnderCall: the node closes (against the advice to
// close communicators first) while a rank's call waits for a late peer,
// and Close is called twice at once on the communicator: the call fails
// (no hang, no crash), every Close returns, and the peer's call fails
// (the rank is gone) instead of hanging.
func TestAdvNodeClosedUnderCall(t *testing.T) {
	const p = 2
	ns := nodes(t, p)
	cs := newComms(t, guardCtx(t), ns, collective.Options{})
	ctx := guardCtx(t)
	q := collective.IAllreduce(ctx, cs[0], nil, make([]float64, 5000), collective.Sum)
	time.Sleep(2 * time.Millisecond) // let it wait (not asserted on)
	if err := ns[0].Close(); err != nil {
		t.Logf("node 0: Close: %v", err)
	}
	err := q.Wait(ctx)
	notByGuard(t, 0, "allreduce under a closed node", err)
	if err == nil {
		t.Errorf("rank 0: allreduce whose node closed succeeded")
	}
	t.Logf("rank 0: %v", err)
	errs := parallel(2, func(int) error { return cs[0].Close() })
	t.Logf("rank 0: Close twice at once: %v", errs)
	err = collective.Allreduce(ctx, cs[1], nil, make([]float64, 5000), collective.Sum)
	notByGuard(t, 1, "allreduce with a peer whose node closed", err)
	if err == nil {
		t.Errorf("rank 1: allreduce with a peer whose node closed succeeded")
	}
	t.Logf("rank 1: %v", err)
	if err := cs[1].Close(); err != nil {
		t.Logf("rank 1: Close: %v", err)
	}
}

// TestAdvBufferCloseUnderBlockingCall: a blocking call on a Buffer that
// waits for its turn (behind a request waiting for a late peer), from
// another goroutine than the one that closes the Buffer: Close fails
// with ErrBufferBusy (the call would otherwise run on freed memory), the
// call completes right once the peer comes, and Close then succeeds.
func TestAdvBufferCloseUnderBlockingCall(t *testing.T) {
	const p, n = 2, 1 << 16
	cs := world(t, p, collective.Options{})
	ctx := guardCtx(t)
	bufs := make([]*collective.Buffer[float32], p)
	for r := range p {
		var err error
		if bufs[r], err = collective.Alloc[float32](cs[r], n); err != nil {
			t.Fatal(err)
		}
		for i, v := 0, bufs[r].Slice(); i < n; i++ {
			v[i] = float32(r + 1)
		}
	}
	first := collective.IBarrier(ctx, cs[0])
	before := collective.Issued(cs[0])
	callErr := make(chan error, 1)
	go func() { callErr <- collective.Allreduce(ctx, cs[0], nil, bufs[0].Slice(), collective.Sum) }()
	for collective.Issued(cs[0]) == before {
		time.Sleep(100 * time.Microsecond) // until the call took its place (and holds its Buffer)
	}
	if err := bufs[0].Close(); !errors.Is(err, collective.ErrBufferBusy) {
		t.Errorf("Close of a Buffer a blocking call waits with: %v, want ErrBufferBusy", err)
	}
	noErrors(t, "rank 1", []error{collective.Barrier(ctx, cs[1]), collective.Allreduce(ctx, cs[1], nil, bufs[1].Slice(), collective.Sum)})
	noErrors(t, "rank 0", []error{first.Wait(ctx), <-callErr})
	for r := range p {
		v := bufs[r].Slice()
		if v == nil || v[0] != 3 || v[n-1] != 3 {
			t.Fatalf("rank %d: the Buffer was closed or holds a wrong result", r)
		}
		if err := bufs[r].Close(); err != nil {
			t.Errorf("rank %d: Close after the call: %v", r, err)
		}
	}
}
