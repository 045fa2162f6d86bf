package collective_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// TestAllreduceSendQueueFull runs every algorithm on nodes whose queue
// pairs hold only a few send requests, so that the flag and ack writes
// of the transport often find the send queue full and are left owed: an
// owed write must still go out while the step's other messages are in
// flight (a rank whose send is done owes its last flag to a peer that
// waits for it before it sends the rest of its own message; a peer
// waiting for an owed ack has no credit to send). The deadline is a
// hang guard: the transport used to wait for those writes forever.
func TestAllreduceSendQueueFull(t *testing.T) {
	for _, p := range []int{2, 3, 4} {
		for _, alg := range []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				verbstest.CheckLeaks(t)
				opts := cluster.NodeOptions{}
				opts.Channel.QP.MaxSendWR = 8
				ns := nodesWith(t, p, opts)
				cs := make([]*collective.Comm, p)
				noErrors(t, "new", parallel(p, func(r int) error {
					var err error
					cs[r], err = collective.New(testCtx(t), ns[r], collective.Options{Algorithm: alg, ChunkSize: 4096})
					return err
				}))
				t.Cleanup(func() {
					for _, c := range cs {
						c.Close()
					}
				})
				const n = 50000 // 100 chunks of 4 KiB per rank
				bufs := make([][]int64, p)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				noErrors(t, "allreduce", parallel(p, func(r int) error {
					bufs[r] = make([]int64, n)
					for i := range bufs[r] {
						bufs[r][i] = int64(r*1000 + i)
					}
					for range 3 {
						if err := collective.Allreduce(ctx, cs[r], nil, bufs[r], collective.Max); err != nil {
							return err
						}
					}
					return collective.Barrier(ctx, cs[r])
				}))
				for r := range p {
					for i, v := range bufs[r] {
						if want := int64((p-1)*1000 + i); v != want {
							t.Fatalf("rank %d element %d = %d, want %d", r, i, v, want)
						}
					}
				}
			})
		}
	}
}
