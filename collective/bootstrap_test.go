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
// writes at its peers are writes with immediate data, which ring the
// peers' doorbells: after New and an allreduce every rank's channel has
// rung, no channel broke, and the result is right.
func TestCountersRingDoorbells(t *testing.T) {
	for _, p := range []int{2, 3, 5} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			verbstest.CheckLeaks(t)
			ns := nodes(t, p)
			for _, nd := range ns {
				j := nd.Channel().Peers()[0]
				if _, err := nd.Channel().Peer(j).PostReceive(); !errors.Is(err, verbs.ErrNotSupported) {
					t.Fatalf("a receive on a node's channel: %v, want ErrNotSupported (doorbells)", err)
				}
			}
			cs := commsOn(t, ns, collective.Options{})
			before := make([]uint64, p)
			for r, nd := range ns {
				before[r] = nd.Channel().Rung()
			}
			bufs := make([][]int64, p)
			noErrors(t, "allreduce", parallel(p, func(r int) error {
				bufs[r] = []int64{int64(r), 1}
				return collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Sum)
			}))
			for r, b := range bufs {
				if b[0] != int64(p*(p-1)/2) || b[1] != int64(p) {
					t.Errorf("rank %d: allreduce gave %v, want [%d %d]", r, b, p*(p-1)/2, p)
				}
				// The doorbells' completions are counted as the channel
				// polls: Wait polls.
				mc := ns[r].Channel()
				if err := mc.Wait(testCtx(t), func() bool { return mc.Rung() > before[r] }); err != nil {
					t.Errorf("rank %d: no doorbell rang during the allreduce (%d before, %d after): %v", r, before[r], mc.Rung(), err)
				}
				if err := ns[r].Channel().Err(); err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}
