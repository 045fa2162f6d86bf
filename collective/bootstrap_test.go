package collective_test

import (
	"fmt"
	"testing"

	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// TestNewLeavesReceivesAlone: New exchanges the window descriptions
// without sends or receives on the node's channels, so that their
// receive queues may serve other purposes: with a zero-length receive
// (a doorbell) posted on every channel of every node, New succeeds on
// every rank, no receive is consumed, and the communicators work. (A
// send landing in a zero-length receive would break the queue pair.)
func TestNewLeavesReceivesAlone(t *testing.T) {
	for _, p := range []int{2, 3, 5} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			verbstest.CheckLeaks(t)
			ns := nodes(t, p)
			var hs []channel.Handle
			for _, nd := range ns {
				for _, j := range nd.Channel().Peers() {
					h, err := nd.Channel().Peer(j).PostReceive()
					if err != nil {
						t.Fatal(err)
					}
					hs = append(hs, h)
				}
			}
			defer func() {
				for _, h := range hs {
					h.Release()
				}
			}()
			cs := commsOn(t, ns, collective.Options{})
			for _, h := range hs {
				if done, err := h.Poll(); done || err != nil {
					t.Errorf("a doorbell receive posted at a rank for rank %d completed (%v, %v): New used a send", h.Peer(), done, err)
				}
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
			}
		})
	}
}
