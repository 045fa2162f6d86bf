package collective_test

import (
	"fmt"
	"testing"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/internal/vmtest"
)

// TestCollectivesDevices runs collectives on the hardware provider over
// the VM's SoftRoCE devices (the VM tier): 3 ranks alternating between
// rxe0 and rxe1, every allreduce algorithm over several chunks, a barrier
// and a split.
func TestCollectivesDevices(t *testing.T) {
	devs := vmtest.Require(t)
	const p = 3
	ns := nodesOn(t, p, cluster.NodeOptions{}, devs)
	for _, alg := range []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
		t.Run(alg.String(), func(t *testing.T) {
			cs := commsOn(t, ns, collective.Options{Algorithm: alg, ChunkSize: 1024})
			const n = 3001
			bufs := make([][]float64, p)
			noErrors(t, "allreduce", parallel(p, func(r int) error {
				bufs[r] = make([]float64, n)
				for i := range bufs[r] {
					bufs[r][i] = float64(r*n + i)
				}
				if err := collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Sum); err != nil {
					return err
				}
				return collective.Barrier(testCtx(t), cs[r])
			}))
			for r := range p {
				for i, v := range bufs[r] {
					if want := float64(3*i + n*3); v != want {
						t.Fatalf("rank %d element %d = %v, want %v", r, i, v, want)
					}
				}
			}
			subs := make([]*collective.Comm, p)
			noErrors(t, "split", parallel(p, func(r int) error {
				var err error
				if subs[r], err = cs[r].Split(testCtx(t), r/2, r); err != nil {
					return err
				}
				v := []int32{int32(r)}
				if err := collective.Allreduce(testCtx(t), subs[r], nil, v, collective.Sum); err != nil {
					return err
				}
				if want := map[int]int32{0: 1, 1: 1, 2: 2}[r]; v[0] != want {
					return fmt.Errorf("sum over the split: %d, want %d", v[0], want)
				}
				return subs[r].Close()
			}))
		})
	}
}
