package collective_test

import (
	"context"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestHotPathAllocatesNothing: a warmed-up ReduceScatter(V), Alltoall(v),
// Allgatherv (its description's hash of the counts included), Scan and
// ExScan allocates nothing, at any rank (AllocsPerRun counts the
// allocations of the whole process: rank 0 runs in it, the others in
// goroutines running as many calls).
func TestHotPathAllocatesNothing(t *testing.T) {
	const p = 3
	for _, alg := range []collective.Algorithm{collective.AlgRing, collective.AlgRabenseifner} {
		cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 1024})
		bufs := make([][]float32, p)
		outs := make([][]float32, p)
		for r := range p {
			bufs[r], outs[r] = make([]float32, p*700), make([]float32, p*700)
		}
		counts := []int{1, 2, 3}
		vcounts, vdispls := []int{2, 2, 2}, []int{0, 5, 10}
		for _, tc := range []struct {
			name string
			call func(ctx context.Context, c *collective.Comm, r int) error
		}{
			{"reduce-scatter", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.ReduceScatter(ctx, c, bufs[r], outs[r][:700], collective.Sum)
			}},
			{"reduce-scatter in place", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.ReduceScatter(ctx, c, nil, outs[r], collective.Max)
			}},
			{"reduce-scatter-v", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.ReduceScatterV(ctx, c, bufs[r][:6], outs[r][:counts[r]], counts, collective.Sum)
			}},
			{"alltoall", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Alltoall(ctx, c, bufs[r], outs[r])
			}},
			{"alltoall in place", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Alltoall(ctx, c, nil, outs[r])
			}},
			{"alltoallv", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Alltoallv(ctx, c, bufs[r], vcounts, vdispls, outs[r], vcounts, vdispls)
			}},
			{"allgatherv", func(ctx context.Context, c *collective.Comm, r int) error { // Bruck below AllgatherSmallMax (p = 3), or the ring
				return collective.Allgatherv(ctx, c, bufs[r][:vcounts[r]], outs[r][:12], vcounts, vdispls)
			}},
			{"scan", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Scan(ctx, c, bufs[r], outs[r], collective.Sum)
			}},
			{"exscan", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.ExScan(ctx, c, nil, outs[r], collective.Min)
			}},
		} {
			t.Run(name("%v/%s", alg, tc.name), func(t *testing.T) {
				if a := allocsPerCall(t, cs, tc.call); a > 0 {
					t.Errorf("%.2f allocations per call, want 0", a)
				}
			})
		}
	}
}

// allocsPerCall returns the allocations of the process per call of
// call at every rank, warmed up.
func allocsPerCall(t *testing.T, cs []*collective.Comm, call func(ctx context.Context, c *collective.Comm, r int) error) float64 {
	const runs = 50
	ctx := testCtx(t)
	p := len(cs)
	noErrors(t, "warm-up", parallel(p, func(r int) error { return call(ctx, cs[r], r) }))
	done := make(chan error, p)
	for r := 1; r < p; r++ {
		go func() {
			var err error
			for range runs + 1 { // AllocsPerRun's warm-up run, then runs
				if err = call(ctx, cs[r], r); err != nil {
					break
				}
			}
			done <- err
		}()
	}
	var err error
	allocs := testing.AllocsPerRun(runs, func() {
		if e := call(ctx, cs[0], 0); e != nil && err == nil {
			err = e
		}
	})
	for r := 1; r < p; r++ {
		if e := <-done; e != nil {
			t.Fatalf("a rank: %v", e)
		}
	}
	if err != nil {
		t.Fatalf("rank 0: %v", err)
	}
	return allocs
}

// TestGatheredAllocatesNothing: where the ranks outnumber the processors,
// the gathering barrier and the small allreduce gathered at rank 0
// allocate nothing either, warmed up, at any rank.
func TestGatheredAllocatesNothing(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	for _, c := range cs {
		collective.SetBarrierGather(c, true)
	}
	bufs := make([][]float64, p)
	for r := range p {
		bufs[r] = make([]float64, 16)
	}
	for _, tc := range []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"barrier", func(ctx context.Context, c *collective.Comm, _ int) error { return collective.Barrier(ctx, c) }},
		{"allreduce", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Allreduce(ctx, c, nil, bufs[r], collective.Sum)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := cs[0].AllreduceAlgorithm(len(bufs[0])*8, 8); got != "gather" {
				t.Fatalf("allreduce algorithm %q, want gather", got)
			}
			if a := allocsPerCall(t, cs, tc.call); a > 0 {
				t.Errorf("%.2f allocations per call, want 0", a)
			}
		})
	}
}
