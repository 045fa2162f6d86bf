package collective_test

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// concat is an associative operation that is not commutative: the hex
// digits of one operand followed by those of the other (the operands
// have no zero digit). Whether f(inout, in) computes inout ⊕ in or
// in ⊕ inout (MPI's order) depends on the version of Custom's contract,
// so checkConcat accepts the digits of the ranks in rank order or in
// exactly the reverse order: both prove that every combination kept the
// ranks' order (for p ≥ 3, an algorithm that does not gives neither).
var concat = collective.Custom("concat", func(inout, in []uint64) {
	for i := range inout {
		inout[i] = inout[i]<<(4*((bits.Len64(in[i])+3)/4)) | in[i]
	}
})

// checkConcat checks got (the concat reduction of digits(r, n) over p
// ranks): every element in rank order, or every element in reverse.
func checkConcat(t *testing.T, p int, got []uint64) {
	t.Helper()
	if len(got) == 0 {
		return
	}
	reverse := got[0] != wantConcat(p, 0)
	for i, v := range got {
		want := wantConcat(p, i)
		if reverse {
			want = reverseDigits(want, p)
		}
		if v != want {
			t.Fatalf("concat: element %d = %#x, want %#x (ranks combined out of order)", i, v, want)
		}
	}
}

func reverseDigits(v uint64, p int) uint64 {
	var w uint64
	for range p {
		w = w<<4 | v&15
		v >>= 4
	}
	return w
}

// digits is rank r's operand for concat: element i is one hex digit.
func digits(r, n int) []uint64 {
	s := make([]uint64, n)
	for i := range s {
		s[i] = uint64((r+i)%15 + 1)
	}
	return s
}

func wantConcat(p, i int) uint64 {
	var v uint64
	for r := range p {
		v = v<<4 | uint64((r+i)%15+1)
	}
	return v
}

// reduceRun runs Reduce at every rank of cs with the operands of rank r
// from operand(r), to root, in place at the root if inPlace, and returns
// the root's result.
func reduceRun[T collective.Number](t *testing.T, cs []*collective.Comm, operand func(r int) []T, op collective.Op, root int, inPlace bool) []T {
	t.Helper()
	var res []T
	noErrors(t, "reduce", parallel(len(cs), func(r int) error {
		send := operand(r)
		if r != root {
			return collective.Reduce(testCtx(t), cs[r], send, nil, op, root)
		}
		if inPlace {
			res = send
			return collective.Reduce(testCtx(t), cs[r], nil, send, op, root)
		}
		res = make([]T, len(send))
		for i := range res {
			res[i] = 99
		}
		return collective.Reduce(testCtx(t), cs[r], send, res, op, root)
	}))
	return res
}

func TestReduce(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		for _, alg := range rootedAlgs {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				ns := []int{0, 1, 13, 9973}
				if alg == collective.AlgAuto {
					ns = nil // the large cases below
				}
				for _, n := range ns {
					for _, root := range []int{0, p / 2, p - 1} {
						for _, inPlace := range []bool{root == p/2} {
							t.Run(fmt.Sprintf("n=%d/root=%d/inplace=%v", n, root, inPlace), func(t *testing.T) {
								got := reduceRun(t, cs, func(r int) []int64 { return fill[int64](r, n) }, collective.Sum, root, inPlace)
								want := make([]int64, n)
								for r := range p {
									for i, v := range fill[int64](r, n) {
										want[i] += v
									}
								}
								if i := equal(got, want); i != -1 {
									t.Fatalf("element %d = %d, want %d", i, got[i], want[i])
								}
								if n < 13 {
									return
								}
								checkConcat(t, p, reduceRun(t, cs, func(r int) []uint64 { return digits(r, n) }, concat, root, inPlace))
							})
						}
					}
				}
				// Large (many chunks), other types and ops.
				n := 70001
				got := reduceRun(t, cs, func(r int) []uint8 { return fill[uint8](r, n) }, collective.Max, p/3, false)
				want := make([]uint8, n)
				for r := range p {
					for i, v := range fill[uint8](r, n) {
						want[i] = max(want[i], v)
					}
				}
				if i := equal(got, want); i != -1 {
					t.Fatalf("max: element %d = %d, want %d", i, got[i], want[i])
				}
				checkConcat(t, p, reduceRun(t, cs, func(r int) []uint64 { return digits(r, n) }, concat, p-1, true))
			})
		}
	}
}

// TestReduceRootIndependent: the floating-point result has the same bits
// whichever rank is the root (the bracketing does not depend on it).
func TestReduceRootIndependent(t *testing.T) {
	for _, p := range []int{3, 6, 8} {
		for _, alg := range rootedAlgs[1:] {
			t.Run(fmt.Sprintf("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				const n = 5003
				operand := func(r int) []float32 {
					s := make([]float32, n)
					for i := range s {
						// Magnitudes far apart: the sum depends on the bracketing.
						s[i] = float32(math.Ldexp(1+float64((r*31+i)%97)/97, (r*13+i)%40-20))
					}
					return s
				}
				ref := reduceRun(t, cs, operand, collective.Sum, 0, false)
				for root := 1; root < p; root++ {
					got := reduceRun(t, cs, operand, collective.Sum, root, root%2 == 0)
					for i := range n {
						if math.Float32bits(got[i]) != math.Float32bits(ref[i]) {
							t.Fatalf("root %d: element %d = %v, root 0 got %v", root, i, got[i], ref[i])
						}
					}
				}
			})
		}
	}
}

func TestReduceArgs(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	cases := []struct {
		name string
		call func(r int) error
	}{
		{"root", func(r int) error {
			return collective.Reduce(testCtx(t), cs[r], make([]int32, 4), make([]int32, 4), collective.Sum, -1)
		}},
		{"op", func(r int) error {
			return collective.Reduce(testCtx(t), cs[r], make([]float64, 4), make([]float64, 4), collective.Xor, 0)
		}},
		{"overlap", func(r int) error {
			b := make([]int32, 8)
			return collective.Reduce(testCtx(t), cs[r], b[:4], b[2:6], collective.Sum, r)
		}},
	}
	for _, tc := range cases {
		if tc.name == "overlap" {
			// Every rank its own root, finding its arguments bad after
			// the call took its turn: each gives the call up, which
			// poisons the communicator (rootArgs). The cases before
			// (rejected alike by every rank) left it usable.
			checkConcat(t, p, reduceRun(t, cs, func(r int) []uint64 { return digits(r, 5) }, concat, 1, false))
			cs = world(t, p, collective.Options{})
		}
		errs := parallel(p, tc.call)
		for r, err := range errs {
			if !errors.Is(err, collective.ErrArgs) {
				t.Fatalf("%s: rank %d: %v, want ErrArgs", tc.name, r, err)
			}
		}
	}
	for r, err := range parallel(p, func(r int) error { return collective.Barrier(testCtx(t), cs[r]) }) {
		if !errors.Is(err, collective.ErrPoisoned) || !errors.Is(err, collective.ErrArgs) {
			t.Fatalf("rank %d: barrier after the overlap: %v, want ErrPoisoned wrapping ErrArgs", r, err)
		}
	}
}

func TestReduceMismatch(t *testing.T) {
	cases := []struct {
		name  string
		p     int
		alg   collective.Algorithm
		root  func(r int) int
		count func(r int) int
		op    func(r int) collective.Op
	}{
		{"root", 4, collective.AlgRecursiveDoubling, func(r int) int { return r / 3 }, func(int) int { return 7 }, func(int) collective.Op { return collective.Sum }},
		{"root/rabenseifner", 5, collective.AlgRabenseifner, func(r int) int { return r % 2 }, func(int) int { return 9000 }, func(int) collective.Op { return collective.Sum }},
		{"count/chain", 3, collective.AlgRing, func(int) int { return 1 }, func(r int) int { return 100 + r }, func(int) collective.Op { return collective.Sum }},
		{"op", 4, collective.AlgAuto, func(int) int { return 0 }, func(int) int { return 10 },
			func(r int) collective.Op { return []collective.Op{collective.Sum, collective.Max}[r%2] }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, tc.p, collective.Options{Algorithm: tc.alg, ChunkSize: 4096, Timeout: mismatchTimeout})
			errs := parallel(tc.p, func(r int) error {
				n := tc.count(r)
				return collective.Reduce(testCtx(t), cs[r], make([]float64, n), make([]float64, n), tc.op(r), tc.root(r))
			})
			mismatchOutcome(t, cs, errs)
		})
	}
}

// BenchmarkRootedReduce measures the reduce algorithms in an in-process world:
// go test -run NONE -bench RootedReduce.
func BenchmarkRootedReduce(b *testing.B) {
	for _, p := range []int{4, 8} {
		for _, size := range []int{1 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20} {
			for _, alg := range rootedAlgs[1:] {
				b.Run(fmt.Sprintf("p=%d/%dKiB/%v", p, size>>10, alg), func(b *testing.B) {
					cs := world(b, p, collective.Options{Algorithm: alg})
					send, recv := make([][]float32, p), make([][]float32, p)
					for r := range p {
						send[r], recv[r] = make([]float32, size/4), make([]float32, size/4)
					}
					ctx := testCtx(b)
					b.SetBytes(int64(size))
					b.ResetTimer()
					noErrors(b, "reduce", parallel(p, func(r int) error {
						for range b.N {
							if err := collective.Reduce(ctx, cs[r], send[r], recv[r], collective.Sum, 0); err != nil {
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
