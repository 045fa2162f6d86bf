package collective_test

import (
	"fmt"
	"testing"

	"github.com/goverbs/verbs/collective"
)

func TestAllreduceSum(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 7, 8, 9} {
		for _, alg := range []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			for _, n := range []int{0, 1, 13, 1000, 70001} {
				t.Run(fmt.Sprintf("p=%d/%v/n=%d", p, alg, n), func(t *testing.T) {
					cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
					bufs := make([][]int64, p)
					noErrors(t, "allreduce", parallel(p, func(r int) error {
						bufs[r] = make([]int64, n)
						for i := range bufs[r] {
							bufs[r][i] = int64(r*1000 + i)
						}
						return collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Sum)
					}))
					for r := range p {
						for i, v := range bufs[r] {
							want := int64(p*i + 1000*p*(p-1)/2)
							if v != want {
								t.Fatalf("rank %d element %d = %d, want %d", r, i, v, want)
							}
						}
					}
				})
			}
		}
	}
}
