package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// TestBarrierSleepersWokenByBells: with doorbells on demand (bells.go),
// ranks that sleep in a barrier because a rank is late are woken by
// doorbells their peers ring because the sleepers said they sleep. The
// alarms, which would otherwise wake them, are an hour apart: a doorbell
// that is not rung leaves the barrier waiting until the test's deadline.
// The late rank enters only once every other rank sleeps (a condition,
// not a timing).
func TestBarrierSleepersWokenByBells(t *testing.T) {
	for _, alg := range barAlgorithms {
		for _, n := range []int{2, 3, 4} {
			for _, late := range []int{0, n - 1} {
				t.Run(fmt.Sprintf("%v/n=%d/late=%d", alg, n, late), func(t *testing.T) {
					rs := barWorld(t, n, alg)
					if !rs[0].b.onDemand {
						t.Skip("every signal rings a doorbell here: the ranks outnumber the processors by more than spinwait.MaxYieldRanks")
					}
					for _, r := range rs {
						r.b.spin.Every = time.Hour
					}
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					for round := range 3 {
						before := make([]uint64, n)
						for i, r := range rs {
							before[i] = r.b.sleeps.Load()
						}
						barNoErrors(t, barAll(rs, func(r *barRank) error {
							if r.id == late {
								if err := barUntilAsleep(ctx, rs, before, late); err != nil {
									return fmt.Errorf("round %d: %w", round, err)
								}
							}
							if err := r.b.wait(ctx, nil); err != nil {
								return fmt.Errorf("round %d: %w", round, err)
							}
							return nil
						}))
						if t.Failed() {
							return
						}
					}
				})
			}
		}
	}
}

// barUntilAsleep waits until every rank but late has gone to sleep since
// before.
func barUntilAsleep(ctx context.Context, rs []*barRank, before []uint64, late int) error {
	err := verbstest.Until(ctx, func() bool {
		for i, r := range rs {
			if i != late && r.b.sleeps.Load() == before[i] {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("the other ranks never slept: %w", err)
	}
	return nil
}

// TestBellFailureNamesItsPeer: a doorbell that fails while a wait is for
// another peer (rank 0 signalled rank 1, which sleeps and whose queue
// pair broke, and waits for rank 2) names rank 1, the rank whose
// transport broke, not rank 2, which the wait was for. Seen once in
// TestFailureReachesEveryRank (8 ranks, the last killed: a survivor
// blamed a live rank).
func TestBellFailureNamesItsPeer(t *testing.T) {
	rs := barWorld(t, 3, Dissemination)
	b := rs[0].b
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.onDemand {
		t.Skip("doorbells are rung on every signal here (waits do not spin): no doorbell on demand to fail")
	}
	b.book.Wrote(1)
	atomic.StoreUint64(b.word64(b.sleepOff(1)), 1) // rank 1 says it sleeps
	rs[0].mc.Peer(1).Break()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g := &group{size: 3, steps: []step{{wait: true, peer: 2}}}
	peer, err := b.run(ctx, g)
	if peer != 1 || !errors.Is(err, channel.ErrBroken) {
		t.Fatalf("run = peer %d, %v; want peer 1 and the broken channel", peer, err)
	}
	var pf *peerFault
	if errors.As(err, &pf) {
		t.Errorf("run returned the wrapper %v, want its error", err)
	}
}
