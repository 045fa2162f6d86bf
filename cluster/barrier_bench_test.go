package cluster

import (
	"fmt"
	"strings"
	"testing"
)

// BenchmarkBarrier measures barrier latency per algorithm for p = 2, 4
// and 8 ranks (goroutines of this process, each with its own soft0
// context), next to the baseline measured first in the same run: the
// one-way latency L of a flag write, from a ping-pong of the barrier's own
// signal (an inline RDMA write) and wait (polling the flag).
//
// Each barrier sub-benchmark reports ns/op (one barrier, every rank), the
// baseline ⌈log2 p⌉ × L as ns-log2p-oneway, and their ratio as
// x-log2p-oneway. Run the one-way sub-benchmark with the others (do not
// filter it out), for example:
//
//	go test -run '^$' -bench Barrier -benchtime 2000x ./cluster/
func BenchmarkBarrier(b *testing.B) {
	var oneWay float64 // ns, from the first sub-benchmark
	b.Run("one-way-write", func(b *testing.B) {
		rs := barWorld(b, 2, Dissemination)
		ctx := barCtx(b)
		b0, b1 := rs[0].b, rs[1].b
		b.ReportAllocs()
		b.ResetTimer()
		errs := barAll(rs, func(r *barRank) error {
			for range b.N {
				if r.id == 0 {
					if err := b0.signal(ctx, b0.world, 1); err != nil {
						return err
					}
					if err := b0.await(ctx, b0.world, 1); err != nil {
						return err
					}
				} else {
					if err := b1.await(ctx, b1.world, 0); err != nil {
						return err
					}
					if err := b1.signal(ctx, b1.world, 0); err != nil {
						return err
					}
				}
			}
			return nil
		})
		b.StopTimer()
		barBenchErrors(b, errs)
		oneWay = float64(b.Elapsed().Nanoseconds()) / float64(b.N) / 2
		b.ReportMetric(oneWay, "ns/one-way")
	})
	for _, alg := range barAlgorithms {
		for _, p := range []int{2, 4, 8} {
			b.Run(fmt.Sprintf("%s/p=%d", strings.ReplaceAll(alg.String(), " ", "-"), p), func(b *testing.B) {
				rs := barWorld(b, p, alg)
				ctx := barCtx(b)
				b.ReportAllocs()
				b.ResetTimer()
				errs := barAll(rs, func(r *barRank) error {
					for range b.N {
						if err := r.b.wait(ctx, nil); err != nil {
							return err
						}
					}
					return nil
				})
				b.StopTimer()
				barBenchErrors(b, errs)
				if oneWay > 0 {
					base := float64(barLog2(p)) * oneWay
					b.ReportMetric(base, "ns-log2p-oneway")
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/base, "x-log2p-oneway")
				}
			})
		}
	}
}

func barBenchErrors(b *testing.B, errs []error) {
	b.Helper()
	for i, err := range errs {
		if err != nil {
			b.Fatalf("rank %d: %v", i, err)
		}
	}
}
