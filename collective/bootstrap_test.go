package collective_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// TestCountersRingDoorbells: the node's channels carry doorbells (their
// receive queues refuse receives), New exchanges the window descriptions
// without sends (cluster.Node.Share), and the counters a collective
// writes at its peers ring the peers' doorbells where every write must
// (RingAlways: waits that do not spin), and ring none where doorbells are
// on demand (bells.go) and no rank announced a sleep. Every result is
// right and no channel broke.
func TestCountersRingDoorbells(t *testing.T) {
	for _, p := range []int{2, 3, 5} {
		for _, always := range []bool{true, false} {
			t.Run(fmt.Sprintf("p=%d/always=%v", p, always), func(t *testing.T) {
				verbstest.CheckLeaks(t)
				ns := nodes(t, p)
				for _, nd := range ns {
					j := nd.Channel().Peers()[0]
					if _, err := nd.Channel().Peer(j).PostReceive(); !errors.Is(err, verbs.ErrNotSupported) {
						t.Fatalf("a receive on a node's channel: %v, want ErrNotSupported (doorbells)", err)
					}
				}
				cs := commsOn(t, ns, collective.Options{})
				if !always && !collective.BellsOnDemand(cs[0]) {
					t.Skip("every write rings a doorbell here: the ranks outnumber the processors by more than spinwait.MaxYieldRanks")
				}
				for _, c := range cs {
					if always {
						collective.RingAlways(c)
					}
				}
				// A rank that announces a sleep (a goroutine descheduled
				// for a millisecond) is rung: try again, a few times.
				for attempt := 0; ; attempt++ {
					before, announced := make([]uint64, p), make([]uint64, p)
					for r, nd := range ns {
						// Count the doorbells of what came before (New's).
						if err := nd.Channel().Progress(); err != nil {
							t.Fatal(err)
						}
						before[r], announced[r] = nd.Channel().Rung(), collective.Announcements(cs[r])
					}
					bufs := make([][]int64, p)
					noErrors(t, "allreduce", parallel(p, func(r int) error {
						bufs[r] = []int64{int64(r), 1}
						return collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Sum)
					}))
					slept := false
					for r := range ns {
						slept = slept || collective.Announcements(cs[r]) != announced[r]
					}
					if !always && slept {
						if attempt == 10 {
							t.Skip("a rank announced a sleep in every one of 10 allreduces: the machine is too busy to check that no doorbell rang")
						}
						continue
					}
					for r, b := range bufs {
						if b[0] != int64(p*(p-1)/2) || b[1] != int64(p) {
							t.Errorf("rank %d: allreduce gave %v, want [%d %d]", r, b, p*(p-1)/2, p)
						}
						// The doorbells' completions are counted as the
						// channel polls.
						mc := ns[r].Channel()
						if always {
							if err := mc.Wait(testCtx(t), func() bool { return mc.Rung() > before[r] }); err != nil {
								t.Errorf("rank %d: no doorbell rang during the allreduce (%d before, %d after): %v", r, before[r], mc.Rung(), err)
							}
						} else {
							if err := mc.Progress(); err != nil {
								t.Errorf("rank %d: %v", r, err)
							}
							if mc.Rung() != before[r] {
								t.Errorf("rank %d: %d doorbells rang during an allreduce whose ranks never slept", r, mc.Rung()-before[r])
							}
						}
						if err := ns[r].Channel().Err(); err != nil {
							t.Errorf("rank %d: %v", r, err)
						}
					}
					break
				}
			})
		}
	}
}
