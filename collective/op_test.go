package collective

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"reflect"
	"testing"
)

// The reducers of the predefined operations, on every element type,
// against references written independently here: integers in math/big
// (then wrapped to the type's width), float32 in float64 (rounding twice
// is harmless for +, ×), float64 in math/big, the 16-bit types decoded
// and rounded by formulas of their own (halfFormat).

var predefined = []Op{Sum, Prod, Min, Max, And, Or, Xor}

func TestReduceOps(t *testing.T) {
	testIntOps[int8](t)
	testIntOps[int16](t)
	testIntOps[int32](t)
	testIntOps[int64](t)
	testIntOps[uint8](t)
	testIntOps[uint16](t)
	testIntOps[uint32](t)
	testIntOps[uint64](t)
	testOps(t, floatValues[float32](), func(k opKind, a, b float32) (float32, bool) {
		if k == opMin || k == opMax {
			return refMinMax(k, a, b), true
		}
		r, ok := refFloat64(k, float64(a), float64(b))
		return float32(r), ok
	}, sameFloat[float32])
	testOps(t, floatValues[float64](), func(k opKind, a, b float64) (float64, bool) {
		if k == opMin || k == opMax {
			return refMinMax(k, a, b), true
		}
		return refFloat64Big(k, a, b)
	}, sameFloat[float64])
	testOps(t, halfValues[BFloat16](bf16), func(k opKind, a, b BFloat16) (BFloat16, bool) {
		r, ok := refHalf(bf16, k, uint16(a), uint16(b))
		return BFloat16(r), ok
	}, func(x, y BFloat16) bool { return bf16.same(uint16(x), uint16(y)) })
	testOps(t, halfValues[Float16](f16), func(k opKind, a, b Float16) (Float16, bool) {
		r, ok := refHalf(f16, k, uint16(a), uint16(b))
		return Float16(r), ok
	}, func(x, y Float16) bool { return f16.same(uint16(x), uint16(y)) })
}

// testOps reduces every pair of vals with every predefined op (dst ⊕=
// src, in vectors of all pairs, both values of srcLow) and compares
// with ref, which returns false where the op is undefined on T (then
// reducerFor must fail with ErrBadOp).
func testOps[T Number](t *testing.T, vals []T, ref func(k opKind, a, b T) (T, bool), same func(x, y T) bool) {
	name := reflect.TypeFor[T]().Name()
	for _, op := range predefined {
		t.Run(fmt.Sprintf("%v/%s", op, name), func(t *testing.T) {
			_, defined := ref(op.kind, vals[0], vals[0])
			red, err := reducerFor[T](op)
			if !defined {
				if !errors.Is(err, ErrBadOp) {
					t.Fatalf("reducerFor: %v, want ErrBadOp", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			// All pairs, in one vector of odd length (the loops' tails).
			var as, bs []T
			for _, a := range vals {
				for _, b := range vals {
					as, bs = append(as, a), append(bs, b)
				}
			}
			as, bs = append(as, vals[1]), append(bs, vals[2])
			for _, srcLow := range []bool{false, true} {
				dst, src := append([]T(nil), as...), append([]T(nil), bs...)
				red(bytesOf(dst), bytesOf(src), srcLow)
				for i := range dst {
					want, _ := ref(op.kind, as[i], bs[i])
					if !same(dst[i], want) {
						t.Fatalf("srcLow %v: %v %v %v = %v, want %v", srcLow, as[i], op, bs[i], dst[i], want)
					}
				}
			}
		})
	}
}

// testIntOps checks the ops on an integer type, with the values at the
// ends of its range (where sums and products wrap around).
func testIntOps[T Number](t *testing.T) {
	k := reflect.TypeFor[T]().Kind()
	bits := reflect.TypeFor[T]().Bits()
	signed := k >= reflect.Int && k <= reflect.Int64
	toBig := func(v T) *big.Int {
		if signed {
			return big.NewInt(int64(v))
		}
		return new(big.Int).SetUint64(uint64(v))
	}
	mod := new(big.Int).Lsh(big.NewInt(1), uint(bits))
	half := new(big.Int).Rsh(mod, 1)
	fromBig := func(r *big.Int) T { // wrapped to the type's width
		r = new(big.Int).Mod(r, mod)
		if signed && r.Cmp(half) >= 0 {
			r.Sub(r, mod)
			return T(r.Int64())
		}
		return T(r.Uint64())
	}
	// The extremes, around zero, and random values.
	var vals []T
	lo, hi := new(big.Int), new(big.Int).Sub(mod, big.NewInt(1))
	if signed {
		lo.Neg(half)
		hi.Sub(half, big.NewInt(1))
	}
	for _, d := range []int64{0, 1, 2, 3} {
		vals = append(vals, fromBig(new(big.Int).Add(lo, big.NewInt(d))), fromBig(new(big.Int).Sub(hi, big.NewInt(d))))
	}
	vals = append(vals, 0, 1, 2, 3, 5, 7)
	if signed {
		vals = append(vals, fromBig(big.NewInt(-1)), fromBig(big.NewInt(-2)))
	}
	rng := rand.New(rand.NewPCG(1, uint64(bits)))
	for range 16 {
		vals = append(vals, T(rng.Uint64()))
	}
	testOps(t, vals, func(op opKind, a, b T) (T, bool) {
		x, y, r := toBig(a), toBig(b), new(big.Int)
		switch op {
		case opSum:
			r.Add(x, y)
		case opProd:
			r.Mul(x, y)
		case opMin:
			r.Set(x)
			if y.Cmp(x) < 0 {
				r.Set(y)
			}
		case opMax:
			r.Set(x)
			if y.Cmp(x) > 0 {
				r.Set(y)
			}
		case opAnd:
			r.And(x, y)
		case opOr:
			r.Or(x, y)
		case opXor:
			r.Xor(x, y)
		}
		return fromBig(r), true
	}, func(x, y T) bool { return x == y })
}

// floatValues: zeros of both signs, infinities, NaN, the smallest
// subnormal, the largest finite value (sums and products overflow),
// ordinary and random values.
func floatValues[F float32 | float64]() []F {
	var vals []F
	inf, nan := math.Inf(1), math.NaN()
	var maxv, tiny float64 = math.MaxFloat64, math.SmallestNonzeroFloat64
	if reflect.TypeFor[F]().Kind() == reflect.Float32 {
		maxv, tiny = math.MaxFloat32, math.SmallestNonzeroFloat32
	}
	for _, v := range []float64{0, math.Copysign(0, -1), 1, -1, 0.1, 3, 1e10, -2.5e-7, inf, -inf, nan, maxv, -maxv, tiny, -tiny} {
		vals = append(vals, F(v))
	}
	rng := rand.New(rand.NewPCG(2, 3))
	for range 12 {
		vals = append(vals, F(rng.NormFloat64()*1e3))
	}
	return vals
}

// sameFloat: the same value (NaN matches NaN: the payload of a NaN
// result is not defined), zeros with their sign.
func sameFloat[F float32 | float64](x, y F) bool {
	if x != x || y != y {
		return x != x && y != y
	}
	return x == y && math.Signbit(float64(x)) == math.Signbit(float64(y))
}

// refMinMax: Go's min and max as the spec states them, written out.
func refMinMax[F float32 | float64](k opKind, a, b F) F {
	switch {
	case a != a:
		return a
	case b != b:
		return b
	case a == 0 && b == 0: // −0 < +0
		if (k == opMin) == math.Signbit(float64(a)) {
			return a
		}
		return b
	case k == opMin && b < a, k == opMax && b > a:
		return b
	}
	return a
}

// refFloat64 computes a op b in float64 (exact for the sum and product
// of two float32s but for overflow and underflow, which the conversion to
// float32 then rounds as float32 arithmetic would).
func refFloat64(k opKind, a, b float64) (float64, bool) {
	switch k {
	case opSum:
		return a + b, true
	case opProd:
		return a * b, true
	}
	return 0, false
}

// refFloat64Big computes a op b for float64s exactly in math/big and
// rounds once to the nearest float64 (ties to even, subnormals,
// overflow to infinity); IEEE's special cases by their rules.
func refFloat64Big(k opKind, a, b float64) (float64, bool) {
	if k != opSum && k != opProd {
		return 0, false
	}
	switch {
	case math.IsNaN(a) || math.IsNaN(b):
		return math.NaN(), true
	case math.IsInf(a, 0) || math.IsInf(b, 0):
		if k == opSum {
			if math.IsInf(a, 0) && math.IsInf(b, 0) && math.Signbit(a) != math.Signbit(b) {
				return math.NaN(), true
			}
			if math.IsInf(a, 0) {
				return a, true
			}
			return b, true
		}
		if a == 0 || b == 0 {
			return math.NaN(), true
		}
		return math.Copysign(math.Inf(1), sign(a)*sign(b)), true
	}
	x := new(big.Float).SetPrec(4096).SetFloat64(a)
	y := new(big.Float).SetPrec(4096).SetFloat64(b)
	r := new(big.Float).SetPrec(4096)
	if k == opSum {
		r.Add(x, y)
	} else {
		r.Mul(x, y)
	}
	f, _ := r.Float64()
	if f == 0 { // the sign of a zero result: IEEE's rules
		switch {
		case k == opProd:
			f = math.Copysign(0, sign(a)*sign(b))
		case a == 0 && b == 0: // −0 only for (−0) + (−0)
			f = math.Copysign(0, max(sign(a), sign(b)))
		default:
			f = 0 // x + (−x) = +0 when rounding to nearest
		}
	}
	return f, true
}

func sign(f float64) float64 {
	if math.Signbit(f) {
		return -1
	}
	return 1
}

// halfFormat describes a 16-bit binary floating-point format, for the
// reference decoding and rounding.
type halfFormat struct {
	name       string
	expBits    int
	fracBits   int
	bias       int
	to         func(uint16) float32 // the package's conversions, under test
	from       func(float32) uint16
	maxFinite  float64
	minSubnorm float64
}

var (
	bf16 = newHalfFormat("bfloat16", 8, 7,
		func(h uint16) float32 { return BFloat16(h).Float32() },
		func(f float32) uint16 { return uint16(BFloat16From(f)) })
	f16 = newHalfFormat("float16", 5, 10,
		func(h uint16) float32 { return Float16(h).Float32() },
		func(f float32) uint16 { return uint16(Float16From(f)) })
)

func newHalfFormat(name string, expBits, fracBits int, to func(uint16) float32, from func(float32) uint16) halfFormat {
	h := halfFormat{name: name, expBits: expBits, fracBits: fracBits, bias: 1<<(expBits-1) - 1, to: to, from: from}
	emax := h.bias
	h.maxFinite = math.Ldexp(2-math.Ldexp(1, -fracBits), emax)
	h.minSubnorm = math.Ldexp(1, 1-h.bias-fracBits)
	return h
}

// value decodes h by the format's definition.
func (f halfFormat) value(h uint16) float64 {
	s := 1.0
	if h&0x8000 != 0 {
		s = -1
	}
	e := int(h>>f.fracBits) & (1<<f.expBits - 1)
	m := float64(h & (1<<f.fracBits - 1))
	switch e {
	case 1<<f.expBits - 1:
		if m != 0 {
			return math.NaN()
		}
		return s * math.Inf(1)
	case 0:
		return s * m * f.minSubnorm
	}
	return s * math.Ldexp(1+m/float64(int(1)<<f.fracBits), e-f.bias)
}

// round rounds x to the nearest value of the format, ties to even,
// beyond the largest finite value to infinity.
func (f halfFormat) round(x float64) float64 {
	if x == 0 || math.IsNaN(x) || math.IsInf(x, 0) {
		return x
	}
	ax := math.Abs(x)
	_, e := math.Frexp(ax) // ax = m·2^e, m in [½, 1)
	e = max(e-1, 1-f.bias) // unbiased exponent, subnormals share the smallest
	q := math.Ldexp(1, e-f.fracBits)
	r := math.RoundToEven(ax/q) * q
	if r > f.maxFinite {
		r = math.Inf(1)
	}
	return math.Copysign(r, x)
}

func (f halfFormat) isNaN(h uint16) bool {
	return math.IsNaN(f.value(h))
}

// same: equal bits, or both NaN.
func (f halfFormat) same(x, y uint16) bool {
	if f.isNaN(x) || f.isNaN(y) {
		return f.isNaN(x) && f.isNaN(y)
	}
	return x == y
}

// refHalf: the documented semantics (the op in float32, rounded to
// nearest even), with the reference decoding and rounding.
func refHalf(f halfFormat, k opKind, a, b uint16) (uint16, bool) {
	x, y := float32(f.value(a)), float32(f.value(b))
	var r float32
	switch k {
	case opSum:
		r = x + y
	case opProd:
		r = x * y
	case opMin:
		r = refMinMax(opMin, x, y)
	case opMax:
		r = refMinMax(opMax, x, y)
	default:
		return 0, false
	}
	return f.encode(f.round(float64(r))), true
}

// encode returns the bits of v, a value of the format (or NaN), by
// search over the format's values of v's sign.
func (f halfFormat) encode(v float64) uint16 {
	if math.IsNaN(v) {
		return 0x7fff
	}
	var s uint16
	if math.Signbit(v) {
		s = 0x8000
	}
	// The non-negative values are ordered as their bits: binary search.
	lo, hi := uint16(0), uint16(0x7fff)>>f.fracBits<<f.fracBits // +Inf
	av := math.Abs(v)
	for lo < hi {
		m := lo + (hi-lo)/2
		if f.value(m) < av {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if f.value(lo) != av {
		panic(fmt.Sprintf("%v is not a %s", v, f.name))
	}
	return s | lo
}

func halfValues[H ~uint16](f halfFormat) []H {
	var vals []H
	for _, v := range []float64{0, math.Copysign(0, -1), 1, -1, 0.1, 3, 100, -2.5e-3, math.Inf(1), math.Inf(-1),
		f.maxFinite, -f.maxFinite, f.minSubnorm, -f.minSubnorm, f.minSubnorm * 3} {
		vals = append(vals, H(f.encode(f.round(v))))
	}
	vals = append(vals, H(0x7fc1), H(0xffc1)) // NaNs (in both formats)
	rng := rand.New(rand.NewPCG(4, uint64(f.fracBits)))
	for len(vals) < 40 {
		h := uint16(rng.Uint32())
		if !f.isNaN(h) {
			vals = append(vals, H(h))
		}
	}
	return vals
}

// TestHalfConversions checks the conversions of BFloat16 and Float16:
// every one of the 65536 values decodes to the value of the format's
// definition and converts back to itself; float32 values round to the
// nearest value, ties to even (tried at every midpoint between
// neighbouring values and one float32 step either side of it, and at
// random float32 bits), subnormals included, beyond the largest value to
// infinity, NaN to NaN of the same sign.
func TestHalfConversions(t *testing.T) {
	for _, f := range []halfFormat{bf16, f16} {
		t.Run(f.name, func(t *testing.T) {
			for i := range 1 << 16 {
				h := uint16(i)
				v, got := f.value(h), f.to(h)
				if math.IsNaN(v) {
					if got == got {
						t.Fatalf("%#04x is a NaN, Float32 gives %v", h, got)
					}
					if back := f.from(got); !f.isNaN(back) || back&0x8000 != h&0x8000 {
						t.Fatalf("NaN %#04x converts back to %#04x", h, back)
					}
					continue
				}
				if float64(got) != v || math.Signbit(float64(got)) != math.Signbit(v) {
					t.Fatalf("%#04x: Float32 gives %v, want %v", h, got, v)
				}
				if back := f.from(got); back != h {
					t.Fatalf("%#04x → %v → %#04x", h, got, back)
				}
			}
			check := func(x float32) {
				t.Helper()
				got := f.from(x)
				if x != x {
					if !f.isNaN(got) || got&0x8000 != uint16(math.Float32bits(x)>>16)&0x8000 {
						t.Fatalf("NaN %#08x converts to %#04x", math.Float32bits(x), got)
					}
					return
				}
				want := f.round(float64(x))
				if gv := f.value(got); gv != want || math.Signbit(gv) != math.Signbit(want) {
					t.Fatalf("%v (%#08x) converts to %#04x = %v, want %v", x, math.Float32bits(x), got, gv, want)
				}
			}
			inf := uint16(0x7fff) >> f.fracBits << f.fracBits
			for h := range inf {
				lo, hi := f.value(h), f.maxFinite*2 // beyond the largest: the midpoint towards 2^(emax+1)
				if h+1 < inf {
					hi = f.value(h + 1)
				}
				if hi > f.maxFinite {
					hi = math.Ldexp(1, f.bias+1)
				}
				mid := float32((lo + hi) / 2) // exact: the formats have at most 11 bits
				if float64(mid) != (lo+hi)/2 {
					t.Fatalf("midpoint %v not exact", (lo+hi)/2)
				}
				for _, x := range []float32{float32(lo), mid, math.Nextafter32(mid, 0), math.Nextafter32(mid, math.MaxFloat32)} {
					check(x)
					check(-x)
				}
			}
			for _, x := range []float32{math.MaxFloat32, float32(math.Inf(1)), math.SmallestNonzeroFloat32, 0,
				math.Float32frombits(0x7f800001), math.Float32frombits(0x7fc00000), math.Float32frombits(0x7fffffff)} {
				check(x)
				check(-x)
			}
			rng := rand.New(rand.NewPCG(5, 6))
			for range 200000 {
				check(math.Float32frombits(rng.Uint32()))
			}
		})
	}
}

// TestReduceOpErrors: the bitwise operations on floating-point types, a
// Custom operation on another type, a nil Custom function and the zero
// Op fail with ErrBadOp.
func TestReduceOpErrors(t *testing.T) {
	customInt := Custom("f", func(inout, in []int32) {})
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"and/float32", errOf[float32](And)},
		{"or/float64", errOf[float64](Or)},
		{"xor/bfloat16", errOf[BFloat16](Xor)},
		{"and/float16", errOf[Float16](And)},
		{"custom int32/uint32", errOf[uint32](customInt)},
		{"custom int32/float32", errOf[float32](customInt)},
		{"custom int32/bfloat16", errOf[BFloat16](customInt)},
		{"custom bfloat16/float16", errOf[Float16](Custom("g", func(inout, in []BFloat16) {}))},
		{"custom nil", errOf[int32](Custom[int32]("nil", nil))},
		{"zero/int32", errOf[int32](Op{})},
		{"zero/float16", errOf[Float16](Op{})},
	} {
		if !errors.Is(tc.err, ErrBadOp) {
			t.Errorf("%s: %v, want ErrBadOp", tc.name, tc.err)
		}
	}
	if err := errOf[int32](customInt); err != nil {
		t.Errorf("custom on its own type: %v", err)
	}
}

func errOf[T Number](op Op) error {
	_, err := reducerFor[T](op)
	return err
}

// TestReduceCustomOrder: a Custom reducer puts the lower ranks' operand
// (src when srcLow) on the left of a non-commutative operation, and
// f(inout, in) gets in as its left operand.
func TestReduceCustomOrder(t *testing.T) {
	// x ⊕ y = 10x + y (mod 2^32): not commutative.
	op := Custom("digits", func(inout, in []uint32) {
		for i := range inout {
			inout[i] = 10*in[i] + inout[i]
		}
	})
	red, err := reducerFor[uint32](op)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		srcLow bool
		want   uint32
	}{{true, 12}, {false, 21}} {
		dst, src := []uint32{2, 2, 2}, []uint32{1, 1, 1}
		red(bytesOf(dst), bytesOf(src), tc.srcLow)
		for i, v := range dst {
			if v != tc.want {
				t.Errorf("srcLow %v: element %d = %d, want %d", tc.srcLow, i, v, tc.want)
			}
		}
	}
	red(nil, nil, true) // empty: f not called with nothing to do, no panic
}

// TestReducerCacheByType: the reducers are cached per element type code
// and operation (reducerFor), so types that share a code share a reducer
// and the others do not: uint16, BFloat16 and Float16 hold the same bits
// and sum differently, whatever order they are first asked for in; a
// named float32 type sums as float32.
func TestReducerCacheByType(t *testing.T) {
	type celsius float32
	one, two := BFloat16From(1), BFloat16From(2)
	hOne, hTwo := Float16From(1), Float16From(2)
	for round := range 2 {
		sumOf := func(name string, a, b []byte) []byte {
			t.Helper()
			var r reducer
			var err error
			switch name {
			case "uint16":
				r, err = reducerFor[uint16](Sum)
			case "bfloat16":
				r, err = reducerFor[BFloat16](Sum)
			case "float16":
				r, err = reducerFor[Float16](Sum)
			case "celsius":
				r, err = reducerFor[celsius](Sum)
			}
			if err != nil {
				t.Fatalf("round %d, %s: %v", round, name, err)
			}
			dst := append([]byte(nil), a...)
			r(dst, b, false)
			return dst
		}
		order := []string{"bfloat16", "uint16", "float16", "celsius"}
		if round == 1 {
			order = []string{"celsius", "float16", "uint16", "bfloat16"}
		}
		for _, name := range order {
			var got, want uint64
			switch name {
			case "uint16":
				d := sumOf(name, bytesOf([]uint16{uint16(one)}), bytesOf([]uint16{uint16(two)}))
				got, want = uint64(elems[uint16](d)[0]), uint64(uint16(one)+uint16(two))
			case "bfloat16":
				d := sumOf(name, bytesOf([]BFloat16{one}), bytesOf([]BFloat16{two}))
				got, want = uint64(elems[BFloat16](d)[0]), uint64(BFloat16From(3))
			case "float16":
				d := sumOf(name, bytesOf([]Float16{hOne}), bytesOf([]Float16{hTwo}))
				got, want = uint64(elems[Float16](d)[0]), uint64(Float16From(3))
			case "celsius":
				d := sumOf(name, bytesOf([]celsius{1.5}), bytesOf([]celsius{2.25}))
				got, want = uint64(math.Float32bits(float32(elems[celsius](d)[0]))), uint64(math.Float32bits(3.75))
			}
			if got != want {
				t.Errorf("round %d: %s: 1+2 gave bits %#x, want %#x", round, name, got, want)
			}
		}
	}
}
