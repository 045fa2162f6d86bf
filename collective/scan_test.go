package collective_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestScan: inclusive and exclusive scans on world sizes 1–9, counts 0,
// 1, prime and several chunks, in place or not, against the reference
// (rank 0's recv untouched by ExScan).
func TestScan(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		t.Run(name("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			for _, n := range []int{0, 1, 13, 3001} {
				for _, inPlace := range []bool{false, true} {
					for _, excl := range []bool{false, true} {
						t.Run(name("n=%d/inplace=%v/exclusive=%v", n, inPlace, excl), func(t *testing.T) {
							checkScan[int64](t, cs, n, inPlace, excl, collective.Sum)
							checkScan[float32](t, cs, n, inPlace, excl, collective.Max)
						})
					}
				}
			}
		})
	}
}

// TestScanTypes: every element type, with Sum, Min and Max.
func TestScanTypes(t *testing.T) {
	const p = 5
	cs := world(t, p, collective.Options{ChunkSize: 256})
	for _, op := range []collective.Op{collective.Sum, collective.Min, collective.Max} {
		for _, excl := range []bool{false, true} {
			t.Run(name("%v/exclusive=%v", op, excl), func(t *testing.T) {
				const n = 101
				checkScan[int8](t, cs, n, false, excl, op)
				checkScan[int16](t, cs, n, false, excl, op)
				checkScan[int32](t, cs, n, false, excl, op)
				checkScan[int64](t, cs, n, false, excl, op)
				checkScan[uint8](t, cs, n, false, excl, op)
				checkScan[uint16](t, cs, n, false, excl, op)
				checkScan[uint32](t, cs, n, false, excl, op)
				checkScan[uint64](t, cs, n, false, excl, op)
				checkScan[float32](t, cs, n, false, excl, op)
				checkScan[float64](t, cs, n, false, excl, op)
				checkScan[collective.BFloat16](t, cs, n, false, excl, op)
				checkScan[collective.Float16](t, cs, n, true, excl, op)
			})
		}
	}
}

func checkScan[T collective.Number](t *testing.T, cs []*collective.Comm, n int, inPlace, excl bool, op collective.Op) {
	t.Helper()
	p := len(cs)
	ins, outs := make([][]T, p), make([][]T, p)
	for r := range p {
		ins[r] = input[T](r, n)
	}
	sentinel := val[T](99)
	noErrors(t, "scan", parallel(p, func(r int) error {
		send := slices.Clone(ins[r])
		if inPlace {
			outs[r] = send
			send = nil
		} else {
			outs[r] = make([]T, n)
			for i := range outs[r] {
				outs[r][i] = sentinel
			}
		}
		f := collective.Scan[T]
		if excl {
			f = collective.ExScan[T]
		}
		err := f(testCtx(t), cs[r], send, outs[r], op)
		if !inPlace && !slices.Equal(send, ins[r]) {
			t.Errorf("rank %d: send changed", r)
		}
		return err
	}))
	for r := range p {
		for i := range n {
			last := r
			if excl {
				last = r - 1
			}
			var want T
			switch {
			case last < 0 && inPlace:
				want = ins[0][i] // rank 0's recv untouched: its input
			case last < 0:
				want = sentinel
			default:
				want = ins[0][i]
				for j := 1; j <= last; j++ {
					want = combine(op, want, ins[j][i])
				}
			}
			if got := outs[r][i]; got != want {
				t.Fatalf("%T %v exclusive=%v: rank %d: element %d = %v, want %v", want, op, excl, r, i, got, want)
			}
		}
	}
}

// TestScanMismatch: ranks that disagree on the count, or call Scan and
// ExScan, fail with ErrMismatch.
func TestScanMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"count", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Scan(ctx, c, nil, make([]float64, 8+r/2), collective.Sum)
		}},
		{"scan and exscan", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.ExScan(ctx, c, nil, make([]float64, 8), collective.Sum)
			}
			return collective.Scan(ctx, c, nil, make([]float64, 8), collective.Sum)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const p = 3
			cs := world(t, p, collective.Options{})
			expectMismatch(t, cs, runAll(t, p, func(ctx context.Context, r int) error { return tc.call(ctx, cs[r], r) }))
		})
	}
}

// TestScanBadArguments: invalid arguments fail at once with ErrArgs and
// leave the communicator usable.
func TestScanBadArguments(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	c := cs[0]
	ctx := testCtx(t)
	buf := make([]float32, 8)
	for _, tc := range []struct {
		name  string
		err   error
		badOp bool
	}{
		{"lengths", collective.Scan(ctx, c, make([]float32, 3), make([]float32, 4), collective.Sum), false},
		{"overlap", collective.ExScan(ctx, c, buf[:6], buf[2:], collective.Sum), false},
		{"and on floats", collective.Scan(ctx, c, nil, buf, collective.And), true},
		{"custom of another type", collective.ExScan(ctx, c, nil, make([]int64, 3), affineOp), true},
		{"zero op", collective.Scan(ctx, c, nil, make([]int64, 3), collective.Op{}), true},
	} {
		if !errors.Is(tc.err, collective.ErrArgs) || tc.badOp != errors.Is(tc.err, collective.ErrBadOp) {
			t.Errorf("%s: %v, want ErrArgs (ErrBadOp: %v)", tc.name, tc.err, tc.badOp)
		}
	}
	checkScan[float32](t, cs, 7, false, false, collective.Sum)
	checkScan[float32](t, cs, 7, false, true, collective.Sum)
}
