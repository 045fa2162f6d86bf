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
// rxe0 and rxe1, every algorithm family of allreduce, broadcast,
// allgather and alltoall over several chunks, a barrier and a split.
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
				// The rooted and gathering collectives too, on the same
				// algorithm family.
				bc := make([]int64, 2000)
				if r == 1 {
					for i := range bc {
						bc[i] = int64(i)
					}
				}
				if err := collective.Broadcast(testCtx(t), cs[r], bc, 1); err != nil {
					return err
				}
				ag := make([]int32, 3*700)
				mine := make([]int32, 700)
				for i := range mine {
					mine[i] = int32(r*700 + i)
				}
				if err := collective.Allgather(testCtx(t), cs[r], mine, ag); err != nil {
					return err
				}
				a2a := make([]int32, 3*500)
				if err := collective.Alltoall(testCtx(t), cs[r], ag[:3*500], a2a); err != nil {
					return err
				}
				for i := range bc {
					if bc[i] != int64(i) {
						return fmt.Errorf("broadcast element %d = %d", i, bc[i])
					}
				}
				for i := range ag {
					if ag[i] != int32(i) {
						return fmt.Errorf("allgather element %d = %d", i, ag[i])
					}
				}
				for j := range 3 { // block j came from rank j's block r of ag
					for i := range 500 {
						if want := int32(r*500 + i); a2a[j*500+i] != want {
							return fmt.Errorf("alltoall block %d element %d = %d, want %d", j, i, a2a[j*500+i], want)
						}
					}
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
