package collective_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestReduceScatter: world sizes 1–9, the ring and recursive halving (and
// the automatic choice), counts 0, 1, prime and several chunks per block,
// in place or not, equal and varying blocks, against a reference sum and
// max (exact: small integers).
func TestReduceScatter(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		for _, alg := range []collective.Algorithm{collective.AlgAuto, collective.AlgRing, collective.AlgRabenseifner} {
			t.Run(name("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg, ChunkSize: 4096})
				for _, n := range []int{0, 1, 13, 3001} {
					for _, inPlace := range []bool{false, true} {
						t.Run(name("n=%d/inplace=%v", n, inPlace), func(t *testing.T) {
							checkReduceScatter[int32](t, cs, n, nil, inPlace, collective.Sum)
							checkReduceScatter[float64](t, cs, n, nil, inPlace, collective.Max)
						})
					}
				}
				for _, inPlace := range []bool{false, true} {
					t.Run(name("v/inplace=%v", inPlace), func(t *testing.T) {
						counts := make([]int, p)
						for j := range counts {
							counts[j] = (j*j*37 + 3) % 2003 // 3, 40, 151, 336, ... (prime count, several chunks)
							if j%3 == 1 {
								counts[j] = 0
							}
						}
						checkReduceScatter[int64](t, cs, 0, counts, inPlace, collective.Sum)
						checkReduceScatter[uint8](t, cs, 0, counts, inPlace, collective.Min)
					})
				}
			})
		}
	}
}

// TestReduceScatterLarge: a vector beyond RingMin on a world that is not
// a power of two takes the ring under AlgAuto.
func TestReduceScatterLarge(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	n := collective.RingMin/4/p + 1001
	checkReduceScatter[float32](t, cs, n, nil, false, collective.Sum)
	checkReduceScatter[float32](t, cs, n, nil, true, collective.Sum)
}

// TestReduceScatterTypes: every element type, with Sum, Min and Max.
func TestReduceScatterTypes(t *testing.T) {
	for _, p := range []int{3, 4} {
		cs := world(t, p, collective.Options{ChunkSize: 256})
		for _, op := range []collective.Op{collective.Sum, collective.Min, collective.Max} {
			t.Run(name("p=%d/%v", p, op), func(t *testing.T) {
				const n = 97
				checkReduceScatter[int8](t, cs, n, nil, false, op)
				checkReduceScatter[int16](t, cs, n, nil, false, op)
				checkReduceScatter[int32](t, cs, n, nil, false, op)
				checkReduceScatter[int64](t, cs, n, nil, false, op)
				checkReduceScatter[uint8](t, cs, n, nil, false, op)
				checkReduceScatter[uint16](t, cs, n, nil, false, op)
				checkReduceScatter[uint32](t, cs, n, nil, false, op)
				checkReduceScatter[uint64](t, cs, n, nil, false, op)
				checkReduceScatter[float32](t, cs, n, nil, false, op)
				checkReduceScatter[float64](t, cs, n, nil, false, op)
				checkReduceScatter[collective.BFloat16](t, cs, n, nil, false, op)
				checkReduceScatter[collective.Float16](t, cs, n, nil, true, op)
			})
		}
	}
}

// checkReduceScatter runs ReduceScatter (blocks of n) or ReduceScatterV
// (counts) at every rank of cs and checks the blocks against the
// reference, that send is unchanged, and in place that recv beyond the
// result is unchanged.
func checkReduceScatter[T collective.Number](t *testing.T, cs []*collective.Comm, n int, counts []int, inPlace bool, op collective.Op) {
	t.Helper()
	p := len(cs)
	off := make([]int, p+1)
	for j := range p {
		k := n
		if counts != nil {
			k = counts[j]
		}
		off[j+1] = off[j] + k
	}
	ins, outs := make([][]T, p), make([][]T, p)
	for r := range p {
		ins[r] = input[T](r, off[p])
	}
	noErrors(t, "reduce-scatter", parallel(p, func(r int) error {
		send := slices.Clone(ins[r])
		if inPlace {
			outs[r] = send
			send = nil
		} else {
			outs[r] = make([]T, off[r+1]-off[r])
			for i := range outs[r] {
				outs[r][i] = val[T](99)
			}
		}
		var err error
		if counts == nil {
			err = collective.ReduceScatter(testCtx(t), cs[r], send, outs[r], op)
		} else {
			err = collective.ReduceScatterV(testCtx(t), cs[r], send, outs[r], counts, op)
		}
		if !inPlace && !slices.Equal(send, ins[r]) {
			t.Errorf("rank %d: send changed", r)
		}
		return err
	}))
	for r := range p {
		for i := off[r]; i < off[r+1]; i++ {
			want := ins[0][i]
			for j := 1; j < p; j++ {
				want = combine(op, want, ins[j][i])
			}
			if got := outs[r][i-off[r]]; got != want {
				t.Fatalf("%T %v: rank %d: element %d of its block = %v, want %v", want, op, r, i-off[r], got, want)
			}
		}
		if inPlace && !slices.Equal(outs[r][off[r+1]-off[r]:], ins[r][off[r+1]-off[r]:]) {
			t.Fatalf("rank %d: in place, recv beyond the result changed", r)
		}
	}
}

// TestReduceScatterMismatch: ranks that disagree on the block length or
// the counts fail with ErrMismatch (the others by the failure's
// cancellation), and the communicators are poisoned.
func TestReduceScatterMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"block length", func(ctx context.Context, c *collective.Comm, r int) error {
			n := 10 + r/2
			return collective.ReduceScatter(ctx, c, make([]int32, 3*n), make([]int32, n), collective.Sum)
		}},
		{"counts", func(ctx context.Context, c *collective.Comm, r int) error {
			counts := []int{4, 5, 6}
			if r == 2 {
				counts = []int{4, 6, 5}
			}
			return collective.ReduceScatterV(ctx, c, make([]int32, 15), make([]int32, counts[r]), counts, collective.Sum)
		}},
		{"equal and v", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.ReduceScatterV(ctx, c, make([]int32, 15), make([]int32, 5), []int{5, 5, 5}, collective.Sum)
			}
			return collective.ReduceScatter(ctx, c, make([]int32, 15), make([]int32, 5), collective.Sum)
		}},
		{"op", func(ctx context.Context, c *collective.Comm, r int) error {
			op := collective.Sum
			if r == 1 {
				op = collective.Max
			}
			return collective.ReduceScatter(ctx, c, make([]int32, 15), make([]int32, 5), op)
		}},
	} {
		for _, alg := range []collective.Algorithm{collective.AlgRing, collective.AlgRabenseifner} {
			t.Run(name("%s/%v", tc.name, alg), func(t *testing.T) {
				const p = 3
				cs := world(t, p, collective.Options{Algorithm: alg})
				expectMismatch(t, cs, runAll(t, p, func(ctx context.Context, r int) error { return tc.call(ctx, cs[r], r) }))
			})
		}
	}
}

// TestReduceScatterBadArguments: invalid arguments fail at once with
// ErrArgs (ErrBadOp for the op) and leave the communicator usable.
func TestReduceScatterBadArguments(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	c := cs[0]
	buf := make([]float64, 8)
	ctx := testCtx(t)
	for _, tc := range []struct {
		name  string
		err   error
		badOp bool
	}{
		{"send length", collective.ReduceScatter(ctx, c, make([]float64, 7), make([]float64, 4), collective.Sum), false},
		{"in place, odd length", collective.ReduceScatter(ctx, c, nil, make([]float64, 7), collective.Sum), false},
		{"overlap", collective.ReduceScatter(ctx, c, buf, buf[4:], collective.Sum), false},
		{"xor on floats", collective.ReduceScatter(ctx, c, make([]float64, 8), make([]float64, 4), collective.Xor), true},
		{"zero op", collective.ReduceScatter(ctx, c, make([]int32, 8), make([]int32, 4), collective.Op{}), true},
		{"custom of another type", collective.ReduceScatter(ctx, c, make([]uint32, 8), make([]uint32, 4), affineOp), true},
		{"v: counts length", collective.ReduceScatterV(ctx, c, make([]float64, 8), make([]float64, 4), []int{4, 4, 0}, collective.Sum), false},
		{"v: negative count", collective.ReduceScatterV(ctx, c, make([]float64, 8), make([]float64, 4), []int{-1, 9}, collective.Sum), false},
		{"v: huge counts", collective.ReduceScatterV(ctx, c, make([]float64, 8), make([]float64, 4), []int{1 << 62, 1 << 62}, collective.Sum), false},
		{"v: send length", collective.ReduceScatterV(ctx, c, make([]float64, 9), make([]float64, 4), []int{4, 4}, collective.Sum), false},
		{"v: recv length", collective.ReduceScatterV(ctx, c, make([]float64, 8), make([]float64, 5), []int{4, 4}, collective.Sum), false},
		{"v: in place length", collective.ReduceScatterV(ctx, c, nil, make([]float64, 5), []int{4, 4}, collective.Sum), false},
	} {
		if !errors.Is(tc.err, collective.ErrArgs) {
			t.Errorf("%s: %v, want ErrArgs", tc.name, tc.err)
		}
		if tc.badOp != errors.Is(tc.err, collective.ErrBadOp) {
			t.Errorf("%s: %v: ErrBadOp %v, want %v", tc.name, tc.err, !tc.badOp, tc.badOp)
		}
	}
	checkReduceScatter[float64](t, cs, 5, nil, false, collective.Sum)
}
