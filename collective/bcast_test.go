package collective_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// rootedAlgs are the algorithms the rooted collectives can be forced to.
var rootedAlgs = []collective.Algorithm{collective.AlgAuto, collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing}

// fill returns n elements of T distinct per rank and index.
func fill[T collective.Number](r, n int) []T {
	s := make([]T, n)
	for i := range s {
		s[i] = T((r*7919 + i*31 + 1) % 113)
	}
	return s
}

func equal[T comparable](a, b []T) int {
	if len(a) != len(b) {
		return -2
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// bcastCase runs Broadcast of n elements of T from root on cs and
// checks every rank's buffer.
func bcastCase[T collective.Number](t *testing.T, cs []*collective.Comm, n, root int) {
	t.Helper()
	p := len(cs)
	bufs := make([][]T, p)
	want := fill[T](root, n)
	noErrors(t, "broadcast", parallel(p, func(r int) error {
		if r == root {
			bufs[r] = fill[T](root, n)
		} else {
			bufs[r] = fill[T](r+100, n)
		}
		return collective.Broadcast(testCtx(t), cs[r], bufs[r], root)
	}))
	for r := range p {
		if i := equal(bufs[r], want); i != -1 {
			t.Fatalf("rank %d: element %d = %v, want %v", r, i, bufs[r][i], want[i])
		}
	}
}

func TestBroadcast(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		for _, alg := range rootedAlgs {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				for _, n := range []int{0, 1, 13, 9973} {
					for _, root := range []int{0, p / 2, p - 1} {
						t.Run(fmt.Sprintf("n=%d/root=%d", n, root), func(t *testing.T) {
							bcastCase[int32](t, cs, n, root)
						})
					}
				}
				bcastCase[float64](t, cs, 70001, p/3)
				bcastCase[uint8](t, cs, 4097, p-1)
				bcastCase[collective.BFloat16](t, cs, 3001, 0)
			})
		}
	}
}

// TestBroadcastArgs: every rank passing a root out of range gets ErrArgs
// and the communicator still works.
func TestBroadcastArgs(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	for _, root := range []int{-1, p, 1 << 40} {
		errs := parallel(p, func(r int) error {
			return collective.Broadcast(testCtx(t), cs[r], make([]int64, 5), root)
		})
		for r, err := range errs {
			if !errors.Is(err, collective.ErrArgs) {
				t.Fatalf("root %d: rank %d: %v, want ErrArgs", root, r, err)
			}
		}
	}
	bcastCase[int64](t, cs, 5, 1)
}

// mismatchOutcome checks the outcome of a call on which ranks disagree:
// every rank failed with a collective error other than ErrArgs
// (ErrMismatch, a timeout, or a peer's abandonment of the call where
// the transport propagates it), or succeeded (a rank that received
// nothing from a disagreeing rank cannot know); then a barrier surfaces
// the disagreement at every rank that had not seen it. Nothing hangs:
// Options.Timeout bounds every call.
func mismatchOutcome(t *testing.T, cs []*collective.Comm, errs []error) {
	t.Helper()
	failed := func(err error) bool {
		var ce *collective.Error
		return errors.As(err, &ce) && !errors.Is(err, collective.ErrArgs)
	}
	for r, err := range errs {
		if err != nil && !failed(err) {
			t.Errorf("rank %d: %v, want ErrMismatch or a timeout", r, err)
		}
	}
	after := parallel(len(cs), func(r int) error { return collective.Barrier(testCtx(t), cs[r]) })
	for r := range cs {
		if errs[r] == nil && after[r] == nil {
			t.Errorf("rank %d: the disagreeing call and the next barrier both succeeded", r)
		}
		if after[r] != nil && !failed(after[r]) {
			t.Errorf("rank %d: barrier after the disagreement: %v", r, after[r])
		}
	}
}

// mismatchTimeout bounds the calls of the mismatch tests: the ranks that
// wait for a message that never comes fail after it.
const mismatchTimeout = 3 * time.Second

func TestBroadcastMismatch(t *testing.T) {
	cases := []struct {
		name  string
		p     int
		alg   collective.Algorithm
		root  func(r int) int
		count func(r int) int
	}{
		{"root", 3, collective.AlgRecursiveDoubling, func(r int) int { return min(r, 1) }, func(int) int { return 7 }},
		{"root/chain", 4, collective.AlgRing, func(r int) int { return r % 2 }, func(int) int { return 9000 }},
		{"count", 4, collective.AlgAuto, func(int) int { return 0 }, func(r int) int { return 5 + r%2 }},
		{"count/large", 5, collective.AlgRabenseifner, func(int) int { return 2 }, func(r int) int { return 20000 + r/4 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, tc.p, collective.Options{Algorithm: tc.alg, ChunkSize: 4096, Timeout: mismatchTimeout})
			bufs := make([][]float32, tc.p)
			errs := parallel(tc.p, func(r int) error {
				bufs[r] = fill[float32](r, tc.count(r))
				return collective.Broadcast(testCtx(t), cs[r], bufs[r], tc.root(r))
			})
			for r, err := range errs {
				// A rank that succeeded holds what the root it named sent.
				if want := fill[float32](tc.root(r), tc.count(r)); err == nil && equal(bufs[r], want) != -1 {
					t.Errorf("rank %d succeeded with a buffer that is not root %d's", r, tc.root(r))
				}
			}
			mismatchOutcome(t, cs, errs)
		})
	}
}

func TestBroadcastElementTypeMismatch(t *testing.T) {
	cs := world(t, 2, collective.Options{Timeout: mismatchTimeout})
	errs := parallel(2, func(r int) error {
		if r == 0 {
			return collective.Broadcast(testCtx(t), cs[r], make([]int32, 4), 0)
		}
		return collective.Broadcast(testCtx(t), cs[r], make([]uint32, 4), 0)
	})
	if errs[0] != nil || !errors.Is(errs[1], collective.ErrMismatch) {
		t.Fatalf("errors %v, want nil at the root and ErrMismatch at rank 1", errs)
	}
}

// warmAllocs runs call at every rank warm times, then measures the
// allocations of runs more (at every rank: AllocsPerRun counts the whole
// process).
func warmAllocs(t *testing.T, p int, call func(r int) error) float64 {
	t.Helper()
	if testing.Short() {
		t.Skip("allocation count: skipped in -short mode")
	}
	const runs, warm = 50, 100
	var wg sync.WaitGroup
	for r := 1; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range runs + 1 + warm {
				if err := call(r); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for range warm {
		if err := call(0); err != nil {
			t.Fatal(err)
		}
	}
	allocs := testing.AllocsPerRun(runs, func() {
		if err := call(0); err != nil {
			t.Fatal(err)
		}
	})
	wg.Wait()
	return allocs
}

func TestRootedAllocatesNothing(t *testing.T) {
	const p = 4
	for _, alg := range rootedAlgs[1:] {
		t.Run(alg.String(), func(t *testing.T) {
			cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
			ctx := testCtx(t)
			type bufs struct{ a, b, c []float64 }
			bs := make([]bufs, p)
			for r := range bs {
				bs[r] = bufs{make([]float64, 3000), make([]float64, 3000), make([]float64, 3000*p)}
			}
			calls := []struct {
				name string
				f    func(r int) error
			}{
				{"broadcast", func(r int) error { return collective.Broadcast(ctx, cs[r], bs[r].a, 1) }},
				{"reduce", func(r int) error { return collective.Reduce(ctx, cs[r], bs[r].a, bs[r].b, collective.Sum, 2) }},
				{"gather", func(r int) error { return collective.Gather(ctx, cs[r], bs[r].a, bs[r].c, 3) }},
				{"scatter", func(r int) error { return collective.Scatter(ctx, cs[r], bs[r].c, bs[r].a, 0) }},
				{"allgather", func(r int) error { return collective.Allgather(ctx, cs[r], bs[r].a, bs[r].c) }},
			}
			// Reduce looks up its operation's reducer like Allreduce: it may
			// allocate no more than Allreduce does (nothing, once reducers
			// are cached).
			lookup := warmAllocs(t, p, func(r int) error { return collective.Allreduce(ctx, cs[r], bs[r].a, bs[r].b, collective.Sum) })
			for _, call := range calls {
				allowed := 0.0
				if call.name == "reduce" {
					// The same count at every rank; the ranks' calls overlap the
					// measured runs unevenly.
					allowed = math.Ceil(lookup/p) * p
				}
				if allocs := warmAllocs(t, p, call.f); allocs > allowed {
					t.Errorf("%s allocates %.2f times per call (all ranks), allowed %.2f", call.name, allocs, allowed)
				}
			}
		})
	}
}

// BenchmarkBroadcast measures the broadcast algorithms in an in-process
// world (ranks as goroutines): go test -run NONE -bench Broadcast.
func BenchmarkBroadcast(b *testing.B) {
	for _, p := range []int{4, 8} {
		for _, size := range []int{1 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20} {
			for _, alg := range rootedAlgs[1:] {
				b.Run(fmt.Sprintf("p=%d/%dKiB/%v", p, size>>10, alg), func(b *testing.B) {
					cs := world(b, p, collective.Options{Algorithm: alg})
					bufs := make([][]byte, p)
					for r := range bufs {
						bufs[r] = make([]byte, size)
					}
					ctx := testCtx(b)
					b.SetBytes(int64(size))
					b.ResetTimer()
					noErrors(b, "broadcast", parallel(p, func(r int) error {
						for range b.N {
							if err := collective.Broadcast(ctx, cs[r], bufs[r], 0); err != nil {
								return err
							}
						}
						return nil
					}))
				})
			}
		}
	}
}

// rootedExampleWorld runs f on n in-process ranks (exampleWorld).
func rootedExampleWorld(n int, f func(c *collective.Comm)) {
	if err := exampleWorld(n, func(c *collective.Comm) error { f(c); return nil }); err != nil {
		log.Fatal(err)
	}
}

// Rank 2 broadcasts a vector to the other ranks of a four-rank world
// (goroutines of this process here; processes on hosts in a real job).
func ExampleBroadcast() {
	out := make([][]float64, 4)
	rootedExampleWorld(4, func(c *collective.Comm) {
		buf := make([]float64, 3)
		if c.Rank() == 2 {
			buf = []float64{1.5, 2.5, 3.5}
		}
		if err := collective.Broadcast(context.Background(), c, buf, 2); err != nil {
			log.Fatal(err)
		}
		out[c.Rank()] = buf
	})
	for r, buf := range out {
		fmt.Printf("rank %d: %v\n", r, buf)
	}
	// Output:
	// rank 0: [1.5 2.5 3.5]
	// rank 1: [1.5 2.5 3.5]
	// rank 2: [1.5 2.5 3.5]
	// rank 3: [1.5 2.5 3.5]
}

// smallQueueWorld builds n in-process ranks whose queue pairs have a
// send queue of sendWR entries, so that the transport's writes find it
// full often, and a communicator on each.
func smallQueueWorld(t *testing.T, n, sendWR int, opts collective.Options) []*collective.Comm {
	t.Helper()
	return worldWith(t, n, opts, cluster.NodeOptions{Channel: channel.Options{QP: verbs.QPSpec{MaxSendWR: sendWR}}})
}

// TestSmallSendQueue: with a send queue of a few entries, the chunk
// flags and acks often find it full and are left owed; a rank waiting in
// a step must still post them, or its peer (waiting for the flag of a
// chunk, or for the credit of an ack) and it wait for each other until
// the timeout. Exchanges in both directions at once (the ring steps)
// and one-way streams both.
func TestSmallSendQueue(t *testing.T) {
	for _, p := range []int{2, 3} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			cs := smallQueueWorld(t, p, 4, collective.Options{Algorithm: collective.AlgRabenseifner, ChunkSize: 4096, Timeout: 30 * time.Second})
			for i := range 20 {
				bcastCase[float64](t, cs, 20000+i, i%p)
				bcastCase[int16](t, cs, 3+i, (i+1)%p)
			}
			for range 10 {
				bufs := make([][]int64, p)
				noErrors(t, "allreduce", parallel(p, func(r int) error {
					bufs[r] = fill[int64](r, 30011)
					return collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Sum)
				}))
			}
		})
	}
}
