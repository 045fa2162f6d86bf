package collective_test

import (
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestCustomOrder: a non-commutative Custom operation (composition of
// affine maps) is combined in rank order by every reduction and every
// algorithm asked for (Allreduce's ring and ReduceScatter's ring give
// way to rank-order algorithms for Custom ops): each result equals the
// left-to-right fold over the ranks.
func TestCustomOrder(t *testing.T) {
	for _, p := range []int{2, 3, 4, 5, 7, 8, 9} {
		for _, alg := range []collective.Algorithm{collective.AlgAuto, collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(name("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 1024})
				for _, n := range []int{1, 37, 1000} {
					ins := make([][]uint64, p)
					for r := range p {
						ins[r] = affineInput(r, p*n)
					}
					// Allreduce: every rank gets the fold over all ranks.
					outs := make([][]uint64, p)
					noErrors(t, "allreduce", parallel(p, func(r int) error {
						outs[r] = make([]uint64, p*n)
						return collective.Allreduce(testCtx(t), cs[r], ins[r], outs[r], affineOp)
					}))
					for r := range p {
						for i := range p * n {
							if want := affineFold(ins, 0, p, i); outs[r][i] != want {
								t.Fatalf("allreduce n=%d: rank %d element %d = %#x, want %#x", p*n, r, i, outs[r][i], want)
							}
						}
					}
					// ReduceScatter: block r at rank r.
					noErrors(t, "reduce-scatter", parallel(p, func(r int) error {
						outs[r] = make([]uint64, n)
						return collective.ReduceScatter(testCtx(t), cs[r], ins[r], outs[r], affineOp)
					}))
					for r := range p {
						for i := range n {
							if want := affineFold(ins, 0, p, r*n+i); outs[r][i] != want {
								t.Fatalf("reduce-scatter n=%d: rank %d element %d = %#x, want %#x", n, r, i, outs[r][i], want)
							}
						}
					}
					// Scan and ExScan: the fold over ranks 0 to r (r−1).
					for _, excl := range []bool{false, true} {
						noErrors(t, "scan", parallel(p, func(r int) error {
							outs[r] = make([]uint64, p*n)
							if excl {
								return collective.ExScan(testCtx(t), cs[r], ins[r], outs[r], affineOp)
							}
							return collective.Scan(testCtx(t), cs[r], ins[r], outs[r], affineOp)
						}))
						for r := range p {
							hi := r + 1
							if excl {
								hi = r
							}
							for i := range p * n {
								want := uint64(0)
								if hi > 0 {
									want = affineFold(ins, 0, hi, i)
								}
								if outs[r][i] != want {
									t.Fatalf("scan exclusive=%v: rank %d element %d = %#x, want %#x", excl, r, i, outs[r][i], want)
								}
							}
						}
					}
				}
			})
		}
	}
}

// TestRequestDoneAfterLaterCall: a blocking call issued after a
// non-blocking one waits for it (Request's documentation; TestNonBlockingOrder
// asserts the request is done once the blocking call returned, and
// failed now and then for this), but the request's goroutine closed Done
// only after end() handed the turn on, so the later call could return
// while the earlier request still read as not done (65-143 of 100000
// rounds). The request hands the turn on once complete now (handOn).
func TestRequestDoneAfterLaterCall(t *testing.T) {
	cs := world(t, 1, collective.Options{})
	c := cs[0]
	ctx := testCtx(t)
	bad := 0
	for i := range 100000 {
		req := collective.IBarrier(ctx, c)
		if err := collective.Barrier(ctx, c); err != nil {
			t.Fatal(err)
		}
		if done, _ := req.Test(); !done {
			bad++
			if bad == 1 {
				t.Logf("iteration %d: the request issued before a blocking call that returned is not done", i)
			}
		}
		req.Wait(ctx)
	}
	if bad > 0 {
		t.Fatalf("%d of 100000 requests not done after the blocking call issued after them returned", bad)
	}
}
