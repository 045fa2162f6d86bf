package collective_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// TestSplit splits 7 ranks by rank mod 3 with reversed keys (rank 6 has
// no color) and reduces within each part.
func TestSplit(t *testing.T) {
	const p = 7
	cs := world(t, p, collective.Options{})
	subs := make([]*collective.Comm, p)
	noErrors(t, "split", parallel(p, func(r int) error {
		color := r % 3
		if r == 6 {
			color = collective.Undefined
		}
		var err error
		subs[r], err = cs[r].Split(testCtx(t), color, -r)
		return err
	}))
	t.Cleanup(func() { closeAll(t, subs) })
	if subs[6] != nil {
		t.Fatalf("rank 6 (Undefined) got a communicator of %d ranks", subs[6].Size())
	}
	// Color 0: ranks 3, 0 (keys -3, 0); color 1: 4, 1; color 2: 5, 2.
	for r := range 6 {
		s := subs[r]
		if s.Size() != 2 {
			t.Fatalf("rank %d: sub-communicator of %d ranks, want 2", r, s.Size())
		}
		wantRank := 1
		if r >= 3 {
			wantRank = 0
		}
		if s.Rank() != wantRank || s.WorldRank(s.Rank()) != r {
			t.Errorf("rank %d: position %d (world %d), want %d", r, s.Rank(), s.WorldRank(s.Rank()), wantRank)
		}
	}
	got := make([][]int32, p)
	noErrors(t, "allreduce on the parts", parallel(6, func(r int) error {
		got[r] = []int32{int32(r), 1}
		return collective.Allreduce(testCtx(t), subs[r], nil, got[r], collective.Sum)
	}))
	for r := range 6 {
		if want := []int32{int32(r%3 + r%3 + 3), 2}; got[r][0] != want[0] || got[r][1] != want[1] {
			t.Errorf("rank %d: %v, want %v", r, got[r], want)
		}
	}
	// The parent still works, and so does a Dup of a part.
	noErrors(t, "parent barrier", parallel(p, func(r int) error { return collective.Barrier(testCtx(t), cs[r]) }))
}

// TestDupIndependentOrder interleaves calls on a communicator and its
// duplicate; each keeps its own order.
func TestDupIndependentOrder(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	dups := make([]*collective.Comm, p)
	noErrors(t, "dup", parallel(p, func(r int) error {
		var err error
		dups[r], err = cs[r].Dup(testCtx(t))
		return err
	}))
	t.Cleanup(func() { closeAll(t, dups) })
	a, b := make([][]float64, p), make([][]float64, p)
	noErrors(t, "interleaved", parallel(p, func(r int) error {
		a[r], b[r] = []float64{float64(r)}, []float64{float64(10 * r)}
		// Rank 0 issues on the dup first, the others on the parent first:
		// the two orders are independent, so nothing deadlocks.
		first, second := cs[r], dups[r]
		x, y := a[r], b[r]
		if r == 0 {
			first, second, x, y = dups[r], cs[r], b[r], a[r]
		}
		req := collective.IAllreduce(testCtx(t), first, nil, x, collective.Sum)
		if err := collective.Allreduce(testCtx(t), second, nil, y, collective.Sum); err != nil {
			return err
		}
		return req.Wait(testCtx(t))
	}))
	for r := range p {
		if a[r][0] != 3 || b[r][0] != 30 {
			t.Errorf("rank %d: %v %v, want [3] [30]", r, a[r], b[r])
		}
	}
}

// TestNonBlockingOrder issues several non-blocking calls then a blocking
// one; they complete in the order issued, with the right results.
func TestNonBlockingOrder(t *testing.T) {
	const p, k = 4, 6
	cs := world(t, p, collective.Options{ChunkSize: 4096})
	noErrors(t, "requests", parallel(p, func(r int) error {
		ctx := testCtx(t)
		bufs := make([][]int64, k)
		reqs := make([]*collective.Request, k)
		for i := range k {
			bufs[i] = make([]int64, 1000*i+1)
			for j := range bufs[i] {
				bufs[i][j] = int64(r + i + j)
			}
			if i == 2 {
				reqs[i] = collective.IBarrier(ctx, cs[r])
				continue
			}
			reqs[i] = collective.IAllreduce(ctx, cs[r], nil, bufs[i], collective.Max)
		}
		last := []int64{int64(r)}
		if err := collective.Allreduce(ctx, cs[r], nil, last, collective.Sum); err != nil {
			return err
		}
		// The blocking call ran after every request: all are done.
		for i, req := range reqs {
			if done, err := req.Test(); !done || err != nil {
				return fmt.Errorf("request %d after the blocking call: done %v, err %v", i, done, err)
			}
			select {
			case <-req.Done():
			default:
				return fmt.Errorf("request %d: Test says done, Done is not closed", i)
			}
		}
		if last[0] != 6 {
			return fmt.Errorf("blocking allreduce: %d, want 6", last[0])
		}
		for i := range k {
			if i == 2 {
				continue
			}
			for j, v := range bufs[i] {
				if want := int64(p - 1 + i + j); v != want {
					return fmt.Errorf("request %d element %d = %d, want %d", i, j, v, want)
				}
			}
		}
		return nil
	}))
}

// TestMismatchedCalls: ranks that call different collectives, or the
// same with different counts, fail with ErrMismatch (or, at a rank that
// cannot see the difference, the call's timeout) — never a hang or a
// silent wrong result — and the communicator is then poisoned.
func TestMismatchedCalls(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"kind", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.Barrier(ctx, c)
			}
			return collective.Allreduce(ctx, c, nil, []int32{1}, collective.Sum)
		}},
		{"count", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Allreduce(ctx, c, nil, make([]int32, 10+r%2), collective.Sum)
		}},
		{"op", func(ctx context.Context, c *collective.Comm, r int) error {
			op := collective.Sum
			if r == 2 {
				op = collective.Max
			}
			return collective.Allreduce(ctx, c, nil, make([]int32, 5), op)
		}},
		{"type", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Allreduce(ctx, c, nil, make([]float32, 4), collective.Sum)
			}
			return collective.Allreduce(ctx, c, nil, make([]int32, 4), collective.Sum)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const p = 3
			cs := world(t, p, collective.Options{Timeout: 3 * time.Second})
			errs := parallel(p, func(r int) error { return tc.call(testCtx(t), cs[r], r) })
			mismatch := 0
			for r, err := range errs {
				switch {
				case errors.Is(err, collective.ErrMismatch):
					mismatch++
					t.Logf("rank %d: %v", r, err)
				case err == nil:
					t.Errorf("rank %d: no error", r)
				default:
					t.Logf("rank %d (cannot see the mismatch): %v", r, err)
				}
			}
			if mismatch == 0 {
				t.Errorf("no rank reported ErrMismatch")
			}
			for r := range p {
				if err := collective.Barrier(testCtx(t), cs[r]); !errors.Is(err, collective.ErrPoisoned) {
					t.Errorf("rank %d: barrier after the mismatch: %v, want ErrPoisoned", r, err)
				}
			}
		})
	}
}

// TestBadArguments: invalid arguments fail at once with ErrArgs and
// leave the communicator usable.
func TestBadArguments(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	buf := make([]float64, 8)
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"lengths", collective.Allreduce(testCtx(t), cs[0], make([]float64, 3), make([]float64, 4), collective.Sum)},
		{"overlap", collective.Allreduce(testCtx(t), cs[0], buf[:6], buf[2:], collective.Sum)},
		{"bitwise on floats", collective.Allreduce(testCtx(t), cs[0], nil, buf, collective.Xor)},
		{"zero op", collective.Allreduce(testCtx(t), cs[0], nil, buf, collective.Op{})},
		{"custom of another type", collective.Allreduce(testCtx(t), cs[0], nil, buf,
			collective.Custom("i32", func(inout, in []int32) {}))},
	} {
		if !errors.Is(tc.err, collective.ErrArgs) {
			t.Errorf("%s: %v, want ErrArgs", tc.name, tc.err)
		}
	}
	if _, err := collective.New(testCtx(t), cs[0].Node(), collective.Options{Slots: 1}); !errors.Is(err, collective.ErrArgs) {
		t.Errorf("New with 1 slot: %v, want ErrArgs", err)
	}
	noErrors(t, "allreduce after bad arguments", parallel(p, func(r int) error {
		return collective.Allreduce(testCtx(t), cs[r], nil, []int64{int64(r)}, collective.Sum)
	}))
}

// TestCloseFailsLaterCalls: Close is collective; a rank's calls after
// its Close fail with ErrClosed, and a peer's calls that need a rank
// that has closed fail with ErrClosed naming it, without breaking the
// node's queue pairs (the world's barrier still works).
func TestCloseFailsLaterCalls(t *testing.T) {
	ns := nodes(t, 2)
	cs := commsOn(t, ns, collective.Options{})
	closed := make(chan error, 1)
	go func() { closed <- cs[0].Close() }() // waits for rank 1's Close
	err := collective.Barrier(testCtx(t), cs[1])
	var ce *collective.Error
	if !errors.Is(err, collective.ErrClosed) || !errors.As(err, &ce) || ce.Peer != 0 {
		t.Errorf("rank 1's barrier after rank 0 closed: %v, want ErrClosed naming peer 0", err)
	}
	if err := cs[1].Close(); err != nil {
		t.Errorf("rank 1: Close: %v", err)
	}
	if err := <-closed; err != nil {
		t.Errorf("rank 0: Close: %v", err)
	}
	if err := collective.Barrier(testCtx(t), cs[0]); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("barrier after Close: %v, want ErrClosed", err)
	}
	noErrors(t, "world barrier after the communicator closed", parallel(2, func(r int) error { return ns[r].Barrier(testCtx(t), nil) }))
}

// TestAllreduceAllocatesNothing: a warmed-up small allreduce allocates
// nothing (both ranks' allocations count).
func TestAllreduceAllocatesNothing(t *testing.T) {
	const runs = 200
	cs := world(t, 2, collective.Options{})
	bufs := [2][]float64{make([]float64, 1), make([]float64, 1)}
	ctx := testCtx(t)
	done := make(chan error, 1)
	go func() {
		var err error
		for range runs + 2 { // AllocsPerRun's warm-up run, then runs
			if err = collective.Allreduce(ctx, cs[1], nil, bufs[1], collective.Sum); err != nil {
				break
			}
		}
		done <- err
	}()
	var err error
	if err = collective.Allreduce(ctx, cs[0], nil, bufs[0], collective.Sum); err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(runs, func() {
		if e := collective.Allreduce(ctx, cs[0], nil, bufs[0], collective.Sum); e != nil {
			err = e
		}
	})
	if e := <-done; e != nil || err != nil {
		t.Fatal(e, err)
	}
	if allocs > 0 {
		t.Errorf("allreduce of 8 bytes: %.1f allocations per call, want 0", allocs)
	}
}

var _ = cluster.RankError{}

// TestNonBlockingEveryKind issues one non-blocking call of every kind,
// in the same order on every rank, waits for all, and checks each.
func TestNonBlockingEveryKind(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{ChunkSize: 1024})
	noErrors(t, "requests", parallel(p, func(r int) error {
		ctx := testCtx(t)
		c := cs[r]
		bc := []int32{int32(r), 7}
		red := []int64{int64(r + 1)}
		redOut := make([]int64, 1)
		ag := make([]int32, p)
		agv := make([]int32, p)
		rs := make([]int64, 1)
		a2a := make([]int32, p)
		gat := make([]int32, p)
		gatv := make([]int32, p)
		sct := make([]int32, 1)
		sctv := make([]int32, 1)
		scan := make([]int64, 1)
		exs := []int64{-1}
		ones := []int{1, 1, 1}
		displs := []int{0, 1, 2}
		src := []int32{10, 11, 12}
		reqs := []*collective.Request{
			collective.IBroadcast(ctx, c, bc, 1),
			collective.IReduce(ctx, c, red, redOut, collective.Sum, 2),
			collective.IAllgather(ctx, c, []int32{int32(r)}, ag),
			collective.IAllgatherv(ctx, c, []int32{int32(r)}, agv, ones, displs),
			collective.IReduceScatter(ctx, c, []int64{1, 2, 3}, rs, collective.Sum),
			collective.IReduceScatterV(ctx, c, []int64{1, 2, 3}, make([]int64, 1), ones, collective.Sum),
			collective.IAlltoall(ctx, c, []int32{int32(10 * r), int32(10*r + 1), int32(10*r + 2)}, a2a),
			collective.IAlltoallv(ctx, c, []int32{1, 2, 3}, ones, displs, make([]int32, p), ones, displs),
			collective.IGather(ctx, c, []int32{int32(r)}, gat, 0),
			collective.IGatherv(ctx, c, []int32{int32(r)}, gatv, ones, displs, 0),
			collective.IScatter(ctx, c, src, sct, 2),
			collective.IScatterv(ctx, c, src, ones, displs, sctv, 2),
			collective.IScan(ctx, c, []int64{int64(r + 1)}, scan, collective.Sum),
			collective.IExScan(ctx, c, []int64{int64(r + 1)}, exs, collective.Sum),
			collective.IBarrier(ctx, c),
		}
		for i, req := range reqs {
			if err := req.Wait(ctx); err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
		}
		check := func(what string, got, want any) error {
			if fmt.Sprint(got) != fmt.Sprint(want) {
				return fmt.Errorf("%s: %v, want %v", what, got, want)
			}
			return nil
		}
		wantExs := []int64{-1}
		if r > 0 {
			wantExs = []int64{int64(r * (r + 1) / 2)}
		}
		return errors.Join(
			check("broadcast", bc, []int32{1, 7}),
			func() error {
				if r == 2 {
					return check("reduce", redOut, []int64{6})
				}
				return nil
			}(),
			check("allgather", ag, []int32{0, 1, 2}),
			check("allgatherv", agv, []int32{0, 1, 2}),
			check("reduce-scatter", rs, []int64{int64(3 * (r + 1))}),
			check("alltoall", a2a, []int32{int32(r), int32(10 + r), int32(20 + r)}),
			func() error {
				if r == 0 {
					return errors.Join(check("gather", gat, []int32{0, 1, 2}), check("gatherv", gatv, []int32{0, 1, 2}))
				}
				return nil
			}(),
			check("scatter", sct, []int32{int32(10 + r)}),
			check("scatterv", sctv, []int32{int32(10 + r)}),
			check("scan", scan, []int64{int64((r + 1) * (r + 2) / 2)}),
			check("exscan", exs, wantExs),
		)
	}))
}

// TestOptionsTimeout: a call whose peer never comes fails by
// Options.Timeout (counted from its first wait), although its context
// has no deadline, and poisons the communicator. The peer's late call
// finds what the rank that gave up had sent (it had entered the
// barrier) and may complete; the peer's next call fails, told of the
// abandonment, instead of waiting for a partner that gave up.
func TestOptionsTimeout(t *testing.T) {
	cs := world(t, 2, collective.Options{Timeout: 200 * time.Millisecond})
	err := collective.Barrier(context.Background(), cs[0])
	if !errors.Is(err, verbs.ErrTimeout) || !strings.Contains(err.Error(), "Options.Timeout") {
		t.Fatalf("barrier without its peer: %v, want ErrTimeout from Options.Timeout", err)
	}
	if err := collective.Barrier(testCtx(t), cs[0]); !errors.Is(err, collective.ErrPoisoned) {
		t.Errorf("the next barrier: %v, want ErrPoisoned", err)
	}
	late := collective.Barrier(testCtx(t), cs[1])
	next := collective.Barrier(testCtx(t), cs[1])
	t.Logf("the peer's late barrier: %v; its next: %v", late, next)
	if late == nil && next == nil {
		t.Errorf("the peer's late barrier and the next both succeeded with a rank that gave up")
	}
}

// TestAlgorithmNames: BroadcastAlgorithm, AllgatherAlgorithm,
// ReduceScatterAlgorithm and AlltoallAlgorithm name what the collectives
// run (they share its choice: bcastAlg, allgatherAlg, rsAlg, the
// pairwise threshold), Options.Algorithm included where it applies.
// goverbs coll reported Options.Algorithm as asked for all four, also
// where it does not apply (TestCollAlgColumn).
func TestAlgorithmNames(t *testing.T) {
	const p = 3
	for _, tc := range []struct {
		alg                           collective.Algorithm
		bytes, esz                    int
		bcast, allgather, rs, alltoal string
	}{
		{collective.AlgAuto, 12, 4, "recursive doubling", "bruck", "rabenseifner", "all at once"},
		{collective.AlgAuto, collective.BcastSmallMax, 4, "ring", "ring", "rabenseifner", "all at once"},
		{collective.AlgAuto, collective.RingMin, 4, "ring", "ring", "ring", "pairwise"},
		{collective.AlgAuto, p * collective.AlltoallPairwiseMin, 4, "ring", "ring", "rabenseifner", "pairwise"},
		{collective.AlgRabenseifner, 8, 4, "recursive doubling", "bruck", "rabenseifner", "all at once"}, // 2 elements for 3 ranks
		{collective.AlgRabenseifner, 12, 4, "rabenseifner", "bruck", "rabenseifner", "all at once"},
		{collective.AlgRing, 12, 4, "ring", "ring", "ring", "all at once"},
	} {
		c := world(t, p, collective.Options{Algorithm: tc.alg})[0]
		got := []string{c.BroadcastAlgorithm(tc.bytes, tc.esz), c.AllgatherAlgorithm(tc.bytes), c.ReduceScatterAlgorithm(tc.bytes), c.AlltoallAlgorithm(tc.bytes)}
		if want := []string{tc.bcast, tc.allgather, tc.rs, tc.alltoal}; !slices.Equal(got, want) {
			t.Errorf("%v, %d bytes: broadcast, allgather, reduce-scatter, alltoall %q, want %q", tc.alg, tc.bytes, got, want)
		}
	}
}
