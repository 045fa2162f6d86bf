package collective_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// Helpers of the tests of reduce-scatter, all-to-all and the scans: the
// element types, small integer values of every type (exact in every
// type, so that sums do not depend on their order), and the reference
// reductions.

// val returns the small integer x as a T.
func val[T collective.Number](x int) T {
	var z T
	switch any(z).(type) {
	case collective.BFloat16:
		return T(collective.BFloat16From(float32(x)))
	case collective.Float16:
		return T(collective.Float16From(float32(x)))
	}
	return T(x)
}

// num returns v as a float64 (exactly, for the small values of the tests).
func num[T collective.Number](v T) float64 {
	switch h := any(v).(type) {
	case collective.BFloat16:
		return float64(h.Float32())
	case collective.Float16:
		return float64(h.Float32())
	}
	return float64(v)
}

// combine is the reference of the predefined ops Sum, Min and Max.
func combine[T collective.Number](op collective.Op, a, b T) T {
	var z T
	switch any(z).(type) {
	case collective.BFloat16, collective.Float16:
		x, y := num(a), num(b)
		switch op.String() {
		case "sum":
			return val[T](int(x + y))
		case "min":
			return val[T](int(min(x, y)))
		}
		return val[T](int(max(x, y)))
	}
	switch op.String() {
	case "sum":
		return a + b // wraps around like the reduction's (the order does not matter)
	case "min":
		return min(a, b)
	}
	return max(a, b)
}

// input returns rank r's test vector of n elements: small values, every
// rank's different (sums of up to 9 ranks stay exact in Float16 and
// BFloat16: below 256).
func input[T collective.Number](r, n int) []T {
	v := make([]T, n)
	for i := range v {
		v[i] = val[T]((i*7 + r*5 + 1) % 27)
	}
	return v
}

// affine is a non-commutative, associative operation for the tests of
// the order of reduction: an element a<<32 | b is the map t ↦ a·t + b
// (mod 2^32), and x ⊕ y applies x then y.
func affine(x, y uint64) uint64 {
	ax, bx, ay, by := uint32(x>>32), uint32(x), uint32(y>>32), uint32(y)
	return uint64(ay*ax)<<32 | uint64(ay*bx+by)
}

// affineOp is affine as a Custom op: inout = in ⊕ inout.
var affineOp = collective.Custom("affine", func(inout, in []uint64) {
	for i := range inout {
		inout[i] = affine(in[i], inout[i])
	}
})

// affineInput is rank r's vector for affineOp: random maps.
func affineInput(r, n int) []uint64 {
	rng := rand.New(rand.NewPCG(uint64(r), uint64(n)))
	v := make([]uint64, n)
	for i := range v {
		v[i] = rng.Uint64() | 1<<32 // a odd: the maps are invertible, nothing collapses
	}
	return v
}

// affineFold is the reference: x_lo ⊕ … ⊕ x_hi−1 of element i, left to
// right.
func affineFold(in [][]uint64, lo, hi, i int) uint64 {
	acc := in[lo][i]
	for r := lo + 1; r < hi; r++ {
		acc = affine(acc, in[r][i])
	}
	return acc
}

// runAll runs f at every rank with a context that ends when a rank
// fails, so that the other ranks of a collective that cannot complete
// (a mismatch one rank saw) fail at once instead of by a deadline.
func runAll(t testing.TB, n int, f func(ctx context.Context, r int) error) []error {
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	var once sync.Once
	return parallel(n, func(r int) error {
		err := f(ctx, r)
		if err != nil {
			once.Do(cancel)
		}
		return err
	})
}

// expectMismatch checks that a rank reported ErrMismatch (a rank whose
// own messages matched, such as one that only sends, may complete), and
// that every rank's next call fails (ErrPoisoned; at a
// rank whose call the cancellation ended before it sent anything, which
// does not poison, ErrMismatch or the cancellation when another rank
// failed first).
func expectMismatch(t *testing.T, cs []*collective.Comm, errs []error) {
	t.Helper()
	mismatch := 0
	for r, err := range errs {
		switch {
		case errors.Is(err, collective.ErrMismatch):
			mismatch++
			t.Logf("rank %d: %v", r, err)
		case err == nil:
			t.Logf("rank %d: completed (its messages matched)", r)
		}
	}
	if mismatch == 0 {
		t.Errorf("no rank reported ErrMismatch: %v", errs)
	}
	for r, err := range runAll(t, len(cs), func(ctx context.Context, r int) error { return collective.Barrier(ctx, cs[r]) }) {
		if err == nil {
			t.Errorf("rank %d: barrier after the mismatch succeeded", r)
		}
	}
}

func name(format string, args ...any) string { return fmt.Sprintf(format, args...) }
