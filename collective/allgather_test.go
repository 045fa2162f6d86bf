package collective_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"testing"

	"github.com/goverbs/verbs/collective"
)

var allgatherAlgs = []collective.Algorithm{collective.AlgAuto, collective.AlgRecursiveDoubling, collective.AlgRing}

func TestAllgather(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		for _, alg := range allgatherAlgs {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				for _, n := range []int{0, 1, 13, 9973} {
					for _, mode := range []string{"copy", "nil", "alias"} {
						t.Run(fmt.Sprintf("n=%d/%s", n, mode), func(t *testing.T) {
							allgatherCase[int64](t, cs, n, mode)
						})
					}
				}
				allgatherCase[float32](t, cs, 30011, "copy")
				allgatherCase[collective.BFloat16](t, cs, 7, "nil")
				allgatherCase[uint16](t, cs, 2, "alias")
			})
		}
	}
}

func allgatherCase[T collective.Number](t *testing.T, cs []*collective.Comm, n int, mode string) {
	t.Helper()
	p := len(cs)
	recvs := make([][]T, p)
	noErrors(t, "allgather", parallel(p, func(r int) error {
		send := fill[T](r, n)
		recvs[r] = make([]T, p*n)
		switch mode {
		case "nil":
			copy(recvs[r][r*n:], send)
			send = nil
		case "alias":
			copy(recvs[r][r*n:], send)
			send = recvs[r][r*n : (r+1)*n]
		}
		return collective.Allgather(testCtx(t), cs[r], send, recvs[r])
	}))
	for r := range p {
		for j := range p {
			if i := equal(recvs[r][j*n:(j+1)*n], fill[T](j, n)); i != -1 {
				t.Fatalf("rank %d, block of rank %d: element %d = %v", r, j, i, recvs[r][j*n+i])
			}
		}
	}
}

func TestAllgatherv(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 7, 8, 9} {
		for _, alg := range allgatherAlgs {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				for _, scale := range []int{1, 2003} {
					for _, shape := range []string{"contiguous", "gaps", "reverse"} {
						for _, inPlace := range []bool{false, true} {
							counts, displs, n := vlayout(p, scale, shape == "reverse")
							if shape == "contiguous" {
								n = 0
								for r := range p {
									displs[r] = n
									n += counts[r]
								}
							}
							recvs := make([][]uint32, p)
							noErrors(t, "allgatherv", parallel(p, func(r int) error {
								send := fill[uint32](r, counts[r])
								recvs[r] = make([]uint32, n)
								if inPlace {
									copy(recvs[r][displs[r]:], send)
									send = nil
								}
								return collective.Allgatherv(testCtx(t), cs[r], send, recvs[r], counts, displs)
							}))
							for r := range p {
								for j := range p {
									if i := equal(recvs[r][displs[j]:displs[j]+counts[j]], fill[uint32](j, counts[j])); i != -1 {
										t.Fatalf("scale %d %s in place %v: rank %d, block of rank %d: element %d", scale, shape, inPlace, r, j, i)
									}
								}
							}
						}
					}
				}
			})
		}
	}
}

func TestAllgatherArgs(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	buf := make([]int32, 20)
	cases := []struct {
		name string
		call func(r int) error
	}{
		{"recv", func(r int) error { return collective.Allgather(testCtx(t), cs[r], make([]int32, 2), make([]int32, 7)) }},
		{"recv/in place", func(r int) error { return collective.Allgather(testCtx(t), cs[r], nil, make([]int32, 7)) }},
		{"overlap", func(r int) error { return collective.Allgather(testCtx(t), cs[r], buf[5:7], buf[:6]) }},
		{"counts", func(r int) error {
			return collective.Allgatherv(testCtx(t), cs[r], nil, buf, []int{1, 2}, []int{0, 1, 3})
		}},
		{"outside", func(r int) error {
			return collective.Allgatherv(testCtx(t), cs[r], nil, buf, []int{1, 2, 3}, []int{0, 1, 18})
		}},
		{"blocks overlap", func(r int) error {
			return collective.Allgatherv(testCtx(t), cs[r], nil, buf, []int{1, 2, 3}, []int{0, 1, 2})
		}},
		{"send length", func(r int) error {
			return collective.Allgatherv(testCtx(t), cs[r], make([]int32, 5), buf, []int{1, 2, 3}, []int{0, 1, 3})
		}},
		{"v/overlap", func(r int) error {
			return collective.Allgatherv(testCtx(t), cs[r], buf[10:10+r+1], buf, []int{1, 2, 3}, []int{0, 1, 3})
		}},
	}
	for _, tc := range cases {
		errs := parallel(p, tc.call)
		for r, err := range errs {
			if !errors.Is(err, collective.ErrArgs) {
				t.Fatalf("%s: rank %d: %v, want ErrArgs", tc.name, r, err)
			}
		}
	}
	allgatherCase[int32](t, cs, 3, "copy")
}

func TestAllgatherMismatch(t *testing.T) {
	cases := []struct {
		name string
		p    int
		alg  collective.Algorithm
		call func(cs []*collective.Comm, r int) error
	}{
		{"count/doubling", 4, collective.AlgRecursiveDoubling, func(cs []*collective.Comm, r int) error {
			n := 3 + r/3
			return collective.Allgather(testCtx(t), cs[r], make([]int32, n), make([]int32, 4*n))
		}},
		{"count/bruck", 5, collective.AlgRecursiveDoubling, func(cs []*collective.Comm, r int) error {
			n := 3 + r/4
			return collective.Allgather(testCtx(t), cs[r], make([]int32, n), make([]int32, 5*n))
		}},
		{"count/ring", 3, collective.AlgRing, func(cs []*collective.Comm, r int) error {
			n := 5000 + r%2
			return collective.Allgather(testCtx(t), cs[r], make([]int32, n), make([]int32, 3*n))
		}},
		{"counts/v", 3, collective.AlgAuto, func(cs []*collective.Comm, r int) error {
			counts := []int{2, 2, 2 + r%2}
			return collective.Allgatherv(testCtx(t), cs[r], nil, make([]int32, 7), counts, []int{0, 2, 4})
		}},
		{"type", 2, collective.AlgAuto, func(cs []*collective.Comm, r int) error {
			if r == 0 {
				return collective.Allgather(testCtx(t), cs[r], make([]float32, 2), make([]float32, 4))
			}
			return collective.Allgather(testCtx(t), cs[r], make([]int32, 2), make([]int32, 4))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, tc.p, collective.Options{Algorithm: tc.alg, ChunkSize: 4096, Timeout: mismatchTimeout})
			mismatchOutcome(t, cs, parallel(tc.p, func(r int) error { return tc.call(cs, r) }))
		})
	}
}

// BenchmarkAllgather measures the allgather algorithms in an in-process
// world (size: bytes of recv): go test -run NONE -bench Allgather.
func BenchmarkAllgather(b *testing.B) {
	for _, p := range []int{4, 5, 8} {
		for _, size := range []int{1 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20} {
			for _, alg := range allgatherAlgs[1:] {
				b.Run(fmt.Sprintf("p=%d/%dKiB/%v", p, size>>10, alg), func(b *testing.B) {
					cs := world(b, p, collective.Options{Algorithm: alg})
					m := size / p
					recvs := make([][]byte, p)
					for r := range p {
						recvs[r] = make([]byte, p*m)
					}
					ctx := testCtx(b)
					b.SetBytes(int64(p * m))
					b.ResetTimer()
					noErrors(b, "allgather", parallel(p, func(r int) error {
						for range b.N {
							if err := collective.Allgather(ctx, cs[r], nil, recvs[r]); err != nil {
								return err
							}
						}
						return nil
					}))
				})
			}
		}
	}
}

// Each rank of a three-rank world contributes its rank and its square;
// every rank gets all of them, in rank order.
func ExampleAllgather() {
	out := make([][]int32, 3)
	rootedExampleWorld(3, func(c *collective.Comm) {
		r := int32(c.Rank())
		recv := make([]int32, 2*c.Size())
		if err := collective.Allgather(context.Background(), c, []int32{r, r * r}, recv); err != nil {
			log.Fatal(err)
		}
		out[r] = recv
	})
	for r, recv := range out {
		fmt.Printf("rank %d: %v\n", r, recv)
	}
	// Output:
	// rank 0: [0 0 1 1 2 4]
	// rank 1: [0 0 1 1 2 4]
	// rank 2: [0 0 1 1 2 4]
}
