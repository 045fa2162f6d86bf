package collective_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
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

// TestAllreduceFullQueues runs large allreduces through channels that
// hold very few operations in flight, so that posting the writes of
// chunks, counters and acknowledgements often finds the queue full: an
// acknowledgement left unposted must still be sent, or the peer waits
// for its credit forever (a deadlock seen before under load).
func TestAllreduceFullQueues(t *testing.T) {
	for _, p := range []int{2, 3, 4} {
		for _, alg := range []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := worldWith(t, p, collective.Options{Algorithm: alg, ChunkSize: 1024},
					cluster.NodeOptions{Channel: channel.Options{MaxOutstanding: 4}})
				const n = 20011
				bufs := make([][]int32, p)
				noErrors(t, "allreduce", parallel(p, func(r int) error {
					bufs[r] = make([]int32, n)
					for i := range bufs[r] {
						bufs[r][i] = int32(r + i)
					}
					for range 3 {
						if err := collective.Allreduce(testCtx(t), cs[r], nil, bufs[r], collective.Max); err != nil {
							return err
						}
					}
					return nil
				}))
				for r := range p {
					for i, v := range bufs[r] {
						if v != int32(p-1+i) {
							t.Fatalf("rank %d element %d = %d, want %d", r, i, v, p-1+i)
						}
					}
				}
			})
		}
	}
}

// TestAllreduceRingOutOfPlace: the ring out of place takes its input
// from send as it goes (no copy into recv first): recv, filled with
// garbage, gets the sum, every block of it, and send is left unchanged;
// worlds of 2 to 5 ranks, counts of uneven blocks over several chunks,
// float64 sums the same bits at every rank and as in place.
func TestAllreduceRingOutOfPlace(t *testing.T) {
	for _, p := range []int{2, 3, 4, 5} {
		for _, n := range []int{p, 1000, 70001} {
			t.Run(fmt.Sprintf("p=%d/n=%d", p, n), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: collective.AlgRing, ChunkSize: 4096})
				gen := func(r, i int) float64 { return float64(r*1000+i) / 7 }
				send, recv, inPlace := make([][]float64, p), make([][]float64, p), make([][]float64, p)
				for r := range p {
					send[r], recv[r], inPlace[r] = make([]float64, n), make([]float64, n), make([]float64, n)
					for i := range n {
						send[r][i], recv[r][i], inPlace[r][i] = gen(r, i), -1e300, gen(r, i)
					}
				}
				noErrors(t, "allreduce out of place", parallel(p, func(r int) error {
					return collective.Allreduce(testCtx(t), cs[r], send[r], recv[r], collective.Sum)
				}))
				noErrors(t, "allreduce in place", parallel(p, func(r int) error {
					return collective.Allreduce(testCtx(t), cs[r], nil, inPlace[r], collective.Sum)
				}))
				for r := range p {
					for i := range n {
						if send[r][i] != gen(r, i) {
							t.Fatalf("rank %d: send[%d] changed to %v", r, i, send[r][i])
						}
						want := 0.0
						for q := range p {
							want += gen(q, i)
						}
						if d := recv[r][i] - want; d > 1e-9*want || d < -1e-9*want {
							t.Fatalf("rank %d: element %d = %v, want %v", r, i, recv[r][i], want)
						}
						if recv[r][i] != recv[0][i] || recv[r][i] != inPlace[r][i] {
							t.Fatalf("rank %d: element %d = %v, rank 0's %v, in place %v", r, i, recv[r][i], recv[0][i], inPlace[r][i])
						}
					}
				}
			})
		}
	}
}

// TestAllreduceGathered: where the ranks outnumber the processors, a
// small Allreduce is recursive doubling computed at rank 0 (every rank
// sends it its vector, it combines them in recursive doubling's order
// and sends the result back): the same bits as recursive doubling on
// every rank, for a float sum whose result depends on the order and for
// a custom operation that is not commutative, on every world size from
// 3 (with and without fold-in) and vector sizes up to GatherMax; beyond
// GatherMax, AlgAuto's choice as where every rank has a processor.
func TestAllreduceGathered(t *testing.T) {
	notCommutative := collective.Custom("2a+b", func(inout, in []int64) {
		for i := range inout {
			inout[i] = 2*inout[i] + in[i]
		}
	})
	for p := 3; p <= 9; p++ {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{})
			run := func(gather bool, n int) ([][]float64, [][]int64) {
				fs, is := make([][]float64, p), make([][]int64, p)
				for _, c := range cs {
					collective.SetBarrierGather(c, gather)
				}
				noErrors(t, "allreduce", parallel(p, func(r int) error {
					fs[r], is[r] = make([]float64, n), make([]int64, n)
					for i := range n {
						// Magnitudes 1e-8 to 1e8: the sum's bits depend on
						// the order of the additions.
						fs[r][i] = float64(i+1) * math.Pow(10, float64((r*7+i)%17-8))
						is[r][i] = int64(r*31 + i)
					}
					if err := collective.Allreduce(testCtx(t), cs[r], nil, fs[r], collective.Sum); err != nil {
						return err
					}
					return collective.Allreduce(testCtx(t), cs[r], nil, is[r], notCommutative)
				}))
				return fs, is
			}
			for _, n := range []int{0, 1, 13, collective.GatherMax/8 - 1, collective.GatherMax/8 + 1} {
				for _, c := range cs {
					collective.SetBarrierGather(c, true)
					got := c.AllreduceAlgorithm(n*8, 8)
					if gathers := n*8 <= collective.GatherMax; gathers != (got == "gather") {
						t.Fatalf("n=%d: rank %d's algorithm %q; gathers %v", n, c.Rank(), got, gathers)
					}
				}
				rdF, rdI := run(false, n)
				gF, gI := run(true, n)
				for r := range p {
					for i := range n {
						if math.Float64bits(gF[r][i]) != math.Float64bits(rdF[0][i]) || gI[r][i] != rdI[0][i] {
							t.Fatalf("n=%d: rank %d element %d: gathered %v, %d; recursive doubling %v, %d",
								n, r, i, gF[r][i], gI[r][i], rdF[0][i], rdI[0][i])
						}
					}
				}
			}
		})
	}
}

// TestHalfNaNBitsIdentical: results are bitwise identical on every rank
// (recursive doubling: every rank computes in the same order, the lower
// ranks' operand on the left), for the 16-bit types too: with NaNs of
// other signs or payloads the result's bits depend on the order, and the
// BFloat16 and Float16 Sum and Prod once put each rank's own operand on
// the left (rank 0 got 0xfe00, rank 1 0x7e00).
func TestHalfNaNBitsIdentical(t *testing.T) {
	cs := world(t, 2, collective.Options{Algorithm: collective.AlgRecursiveDoubling})
	for _, op := range []collective.Op{collective.Sum, collective.Prod} {
		t.Run("Float16/"+op.String(), func(t *testing.T) {
			halfNaNBitsIdentical(t, cs, op, [2]collective.Float16{0x7e00, 0xfe01}) // +NaN, -NaN
		})
		t.Run("BFloat16/"+op.String(), func(t *testing.T) {
			halfNaNBitsIdentical(t, cs, op, [2]collective.BFloat16{0x7fc1, 0xffc2})
		})
	}
}

// halfNaNBitsIdentical allreduces in[r] (and a 1) on the two ranks of cs
// with op and checks that both got the same bits.
func halfNaNBitsIdentical[H collective.BFloat16 | collective.Float16](t *testing.T, cs []*collective.Comm, op collective.Op, in [2]H) {
	out := make([][]H, 2)
	noErrors(t, "allreduce", parallel(2, func(r int) error {
		out[r] = []H{in[r], 1}
		return collective.Allreduce(guardCtx(t), cs[r], nil, out[r], op)
	}))
	if out[0][0] != out[1][0] {
		t.Errorf("rank 0 got %#04x, rank 1 got %#04x: not bitwise identical", uint16(out[0][0]), uint16(out[1][0]))
	}
}
