package collective_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs/collective"
)

// TestMismatchReachesEveryRank: when one rank calls Allreduce with
// another count than the others, the ranks that exchange with it detect
// the mismatch; every other rank, waiting for a rank that gave the call
// up, must fail too (ErrMismatch, from the rank that detected it), not
// wait forever: the calls' contexts have no deadline (a hang guard
// fails the test).
func TestMismatchReachesEveryRank(t *testing.T) {
	for _, p := range []int{3, 4, 8} {
		for _, alg := range []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{ChunkSize: 256, Algorithm: alg})
				done := make(chan []error, 1)
				go func() {
					done <- parallel(p, func(r int) error {
						v := make([]int64, 100*p)
						if r == p-1 {
							v = append(v, 0) // one element more
						}
						return collective.Allreduce(context.Background(), cs[r], nil, v, collective.Sum)
					})
				}()
				select {
				case errs := <-done:
					for r, err := range errs {
						if !errors.Is(err, collective.ErrMismatch) {
							t.Errorf("rank %d: %v, want ErrMismatch", r, err)
						}
						t.Logf("rank %d: %v", r, err)
					}
				case <-time.After(2 * time.Minute):
					t.Fatal("the ranks that did not see the mismatch still wait")
				}
				// The communicator is poisoned everywhere.
				noErrors(t, "", parallel(p, func(r int) error {
					if err := collective.Barrier(context.Background(), cs[r]); !errors.Is(err, collective.ErrPoisoned) {
						return fmt.Errorf("barrier after the mismatch: %v, want ErrPoisoned", err)
					}
					return nil
				}))
			})
		}
	}
}

// TestAlgorithmDisagreement: ranks whose Options.Algorithm differ
// would run different algorithms under the same call description: New
// refuses them with ErrMismatch, as it refuses different ChunkSize and
// Slots. Before, it took them, and rank 0's Reduce returned nil with
// rank 1's vector as the sum. (Found by a review.)
func TestAlgorithmDisagreement(t *testing.T) {
	ns := nodes(t, 2)
	ctx := testCtx(t)
	cs := make([]*collective.Comm, 2)
	errs := parallel(2, func(r int) error {
		alg := collective.AlgRing
		if r == 1 {
			alg = collective.AlgRecursiveDoubling
		}
		var err error
		cs[r], err = collective.New(ctx, ns[r], collective.Options{Algorithm: alg})
		return err
	})
	for r, err := range errs {
		if err == nil {
			cs[r].Close()
		}
		if !errors.Is(err, collective.ErrMismatch) {
			t.Errorf("rank %d: New with Options.Algorithm %v against another rank's %v: %v, want ErrMismatch",
				r, []collective.Algorithm{collective.AlgRing, collective.AlgRecursiveDoubling}[r],
				[]collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRing}[r], err)
		}
	}
}
