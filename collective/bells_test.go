package collective_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// TestSleepersWokenByBells: with doorbells on demand (bells.go), a rank
// that sleeps in a call because a peer is late must be woken by the
// peer's doorbell, which the peer rings because the sleeper announced its
// sleep. The alarms, which would otherwise wake it, are an hour apart: a
// bell that is not rung leaves the call waiting until the test's deadline.
// The late rank enters only once every other rank sleeps.
func TestSleepersWokenByBells(t *testing.T) {
	cases := []struct {
		name string
		p    int
		run  func(ctx context.Context, c *collective.Comm, r, p int) error
	}{
		{"barrier/butterfly", 2, func(ctx context.Context, c *collective.Comm, r, p int) error {
			return collective.Barrier(ctx, c)
		}},
		{"barrier/dissemination", 3, func(ctx context.Context, c *collective.Comm, r, p int) error {
			return collective.Barrier(ctx, c)
		}},
		{"allreduce/8B", 4, func(ctx context.Context, c *collective.Comm, r, p int) error {
			return sumCheck(ctx, c, r, p, 2)
		}},
		{"allreduce/2MiB", 2, func(ctx context.Context, c *collective.Comm, r, p int) error {
			return sumCheck(ctx, c, r, p, 1<<18)
		}},
		{"alltoall", 3, func(ctx context.Context, c *collective.Comm, r, p int) error {
			send, recv := make([]int32, 4*p), make([]int32, 4*p)
			for i := range send {
				send[i] = int32(r*1000 + i)
			}
			if err := collective.Alltoall(ctx, c, send, recv); err != nil {
				return err
			}
			for q := range p {
				for k := range 4 {
					if got, want := recv[q*4+k], int32(q*1000+r*4+k); got != want {
						return fmt.Errorf("block from rank %d, element %d: %d, want %d", q, k, got, want)
					}
				}
			}
			return nil
		}},
	}
	for _, tc := range cases {
		for _, late := range []int{0, tc.p - 1} {
			t.Run(fmt.Sprintf("%s/p=%d/late=%d", tc.name, tc.p, late), func(t *testing.T) {
				cs := world(t, tc.p, collective.Options{})
				if !collective.BellsOnDemand(cs[0]) {
					t.Skip("every write rings a doorbell here: the ranks outnumber the processors by more than spinwait.MaxYieldRanks")
				}
				for _, c := range cs {
					collective.SetAlarmEvery(c, time.Hour)
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				for round := range 3 {
					before := make([]uint64, tc.p)
					for r, c := range cs {
						before[r] = collective.Sleeps(c)
					}
					noErrors(t, fmt.Sprintf("round %d", round), parallel(tc.p, func(r int) error {
						if r == late {
							if err := untilAsleep(ctx, cs, before, late); err != nil {
								return err
							}
						}
						return tc.run(ctx, cs[r], r, tc.p)
					}))
				}
			})
		}
	}
}

// untilAsleep waits until every rank but late has gone to sleep since
// before.
func untilAsleep(ctx context.Context, cs []*collective.Comm, before []uint64, late int) error {
	err := verbstest.Until(ctx, func() bool {
		for r, c := range cs {
			if r != late && collective.Sleeps(c) == before[r] {
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

// sumCheck runs an Allreduce (Sum) of n float64 and checks its result.
func sumCheck(ctx context.Context, c *collective.Comm, r, p, n int) error {
	send, recv := make([]float64, n), make([]float64, n)
	for i := range send {
		send[i] = float64(r + i)
	}
	if err := collective.Allreduce(ctx, c, send, recv, collective.Sum); err != nil {
		return err
	}
	for i, v := range recv {
		if want := float64(p*i + p*(p-1)/2); v != want {
			return fmt.Errorf("element %d: %v, want %v", i, v, want)
		}
	}
	return nil
}
