package collective

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"unsafe"
)

// Number is the constraint of the element types of collectives: Go's
// integer and floating-point types of fixed size, and BFloat16 and
// Float16 (16-bit floating-point numbers stored as uint16, reduced in
// float32 and rounded back to nearest even).
type Number interface {
	~int8 | ~int16 | ~int32 | ~int64 | ~uint8 | ~uint16 | ~uint32 | ~uint64 | ~float32 | ~float64
}

// BFloat16 is a brain floating-point number (8 bits of exponent, 7 of
// mantissa) stored in a uint16. Collectives reduce BFloat16 elements in
// float32 and round the result to the nearest even BFloat16.
type BFloat16 uint16

// Float16 is an IEEE 754 half-precision number (5 bits of exponent, 10
// of mantissa) stored in a uint16. Collectives reduce Float16 elements
// in float32 and round the result to the nearest even Float16.
type Float16 uint16

// BFloat16From rounds f to the nearest BFloat16 (ties to even; NaN stays
// NaN).
func BFloat16From(f float32) BFloat16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet and a NaN
		return BFloat16(b>>16 | 0x40)
	}
	b += 0x7fff + (b >> 16 & 1)
	return BFloat16(b >> 16)
}

// Float32 returns b as a float32 (exactly).
func (b BFloat16) Float32() float32 { return math.Float32frombits(uint32(b) << 16) }

// Float16From rounds f to the nearest Float16 (ties to even; values
// beyond the range become infinities, NaN stays NaN).
func Float16From(f float32) Float16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int(b>>23&0xff) - 127 + 15
	mant := b & 0x7fffff
	switch {
	case b&0x7fffffff > 0x7f800000: // NaN
		return Float16(sign | 0x7e00)
	case exp >= 0x1f: // infinity, or too large: infinity
		return Float16(sign | 0x7c00)
	case exp <= 0: // subnormal or zero
		if exp < -10 {
			return Float16(sign)
		}
		mant |= 0x800000
		shift := uint32(14 - exp)
		h := mant >> shift
		rem := mant & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rem > half || rem == half && h&1 == 1 {
			h++
		}
		return Float16(sign | uint16(h))
	}
	h := uint32(exp)<<10 | mant>>13
	rem := mant & 0x1fff
	if rem > 0x1000 || rem == 0x1000 && h&1 == 1 {
		h++ // may carry into the exponent, up to infinity: correct
	}
	return Float16(sign | uint16(h))
}

// Float32 returns h as a float32 (exactly).
func (h Float16) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h >> 10 & 0x1f)
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp == 0 && mant == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal: normalise
		e := uint32(127 - 15 + 1)
		for mant&0x400 == 0 {
			mant <<= 1
			e--
		}
		return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
}

// Op is a reduction operation: one of the predefined Sum, Prod, Min,
// Max, And, Or, Xor, or a user-defined element-wise function (Custom).
// The bitwise operations apply to integer types only.
//
// Every algorithm combines two partial results in the order of the ranks
// they stem from (the lower ranks' partial result is the left operand),
// and computes each element's result once and distributes it, so that
// every rank gets the same bits; see each collective for the order of
// its reduction.
type Op struct {
	kind opKind
	name string
	fn   any          // Custom: func(inout, in []T) with inout the right operand
	elem reflect.Type // Custom: T
}

type opKind uint8

const (
	opNone opKind = iota
	opSum
	opProd
	opMin
	opMax
	opAnd
	opOr
	opXor
	opCustom
)

// The predefined operations.
var (
	Sum  = Op{kind: opSum, name: "sum"}
	Prod = Op{kind: opProd, name: "prod"}
	// Min and Max follow Go's min and max: a NaN operand gives NaN, and
	// −0 is smaller than +0.
	Min = Op{kind: opMin, name: "min"}
	Max = Op{kind: opMax, name: "max"}
	And = Op{kind: opAnd, name: "and"}
	Or  = Op{kind: opOr, name: "or"}
	Xor = Op{kind: opXor, name: "xor"}
)

// Custom returns a user-defined operation on elements of type T: f
// combines in into inout element by element (inout[i] = inout[i] ⊕
// in[i]), where in holds the partial result of the lower ranks, so f may
// be non-commutative; it must be associative. f must not retain the
// slices or call into the communicator. Using the Op with another
// element type fails with ErrBadOp.
func Custom[T Number](name string, f func(inout, in []T)) Op {
	return Op{kind: opCustom, name: name, fn: f, elem: reflect.TypeFor[T]()}
}

func (o Op) String() string {
	if o.name == "" {
		return "no op"
	}
	return o.name
}

// ErrBadOp: the operation does not apply to the element type (a bitwise
// operation on floating-point numbers, a Custom operation of another
// type) or is the zero Op.
var ErrBadOp = errors.New("collective: operation not defined for the element type")

// reducer combines src into dst, both holding whole elements of the
// call's type: dst = src ⊕ dst if srcLow (src is the partial result of
// lower ranks), else dst = dst ⊕ src.
type reducer func(dst, src []byte, srcLow bool)

// reducerFor returns the reducer of op on T.
func reducerFor[T Number](op Op) (reducer, error) {
	var z T
	switch any(z).(type) {
	case BFloat16:
		return half(op, BFloat16.Float32, BFloat16From)
	case Float16:
		return half(op, Float16.Float32, Float16From)
	}
	switch op.kind {
	case opSum:
		return apply[T](func(a, b T) T { return a + b }), nil
	case opProd:
		return apply[T](func(a, b T) T { return a * b }), nil
	case opMin:
		return apply[T](func(a, b T) T { return min(a, b) }), nil
	case opMax:
		return apply[T](func(a, b T) T { return max(a, b) }), nil
	case opAnd, opOr, opXor:
		k := reflect.TypeFor[T]().Kind()
		if k == reflect.Float32 || k == reflect.Float64 {
			return nil, fmt.Errorf("%w: %v on %v", ErrBadOp, op, reflect.TypeFor[T]())
		}
		return bitwise[T](op.kind), nil
	case opCustom:
		f, ok := op.fn.(func(inout, in []T))
		if !ok {
			return nil, fmt.Errorf("%w: %v is defined on %v, not %v", ErrBadOp, op, op.elem, reflect.TypeFor[T]())
		}
		return custom(f), nil
	}
	return nil, fmt.Errorf("%w: the zero Op", ErrBadOp)
}

// elems views b (whole elements of T, aligned) as a []T.
func elems[T Number](b []byte) []T {
	var z T
	sz := int(unsafe.Sizeof(z))
	if len(b) < sz {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/sz)
}

// bytesOf views s as bytes.
func bytesOf[T Number](s []T) []byte {
	var z T
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))
}

// apply builds a reducer from a binary function, inlined into both
// loops by the compiler for each instantiation.
func apply[T Number](f func(a, b T) T) reducer {
	return func(dst, src []byte, srcLow bool) {
		d, s := elems[T](dst), elems[T](src)
		s = s[:len(d)]
		if srcLow {
			for i := range d {
				d[i] = f(s[i], d[i])
			}
			return
		}
		for i := range d {
			d[i] = f(d[i], s[i])
		}
	}
}

func bitwise[T Number](k opKind) reducer {
	return func(dst, src []byte, _ bool) {
		// Bitwise operations are commutative: byte-wise on the whole buffer.
		s := src[:len(dst)]
		for len(dst) >= 8 {
			a := *(*uint64)(unsafe.Pointer(&dst[0]))
			b := *(*uint64)(unsafe.Pointer(&s[0]))
			switch k {
			case opAnd:
				a &= b
			case opOr:
				a |= b
			default:
				a ^= b
			}
			*(*uint64)(unsafe.Pointer(&dst[0])) = a
			dst, s = dst[8:], s[8:]
		}
		for i := range dst {
			switch k {
			case opAnd:
				dst[i] &= s[i]
			case opOr:
				dst[i] |= s[i]
			default:
				dst[i] ^= s[i]
			}
		}
	}
}

func custom[T Number](f func(inout, in []T)) reducer {
	return func(dst, src []byte, srcLow bool) {
		d, s := elems[T](dst), elems[T](src)
		s = s[:len(d)]
		if srcLow {
			// dst = src ⊕ dst: f(inout, in) computes inout ⊕ in with inout on
			// the left, so swap through the source slot (library memory).
			f(s, d)
			copy(d, s)
			return
		}
		f(d, s)
	}
}

// half builds the reducer of a 16-bit float type reduced in float32.
func half[H ~uint16](op Op, to func(H) float32, from func(float32) H) (reducer, error) {
	var f func(a, b float32) float32
	switch op.kind {
	case opSum:
		f = func(a, b float32) float32 { return a + b }
	case opProd:
		f = func(a, b float32) float32 { return a * b }
	case opMin:
		f = func(a, b float32) float32 { return min(a, b) }
	case opMax:
		f = func(a, b float32) float32 { return max(a, b) }
	case opCustom:
		g, ok := op.fn.(func(inout, in []H))
		if !ok {
			return nil, fmt.Errorf("%w: %v is defined on %v, not %v", ErrBadOp, op, op.elem, reflect.TypeFor[H]())
		}
		return custom(g), nil
	default:
		return nil, fmt.Errorf("%w: %v on %v", ErrBadOp, op, reflect.TypeFor[H]())
	}
	return func(dst, src []byte, srcLow bool) {
		d, s := elems[H](dst), elems[H](src)
		s = s[:len(d)]
		for i := range d {
			a, b := to(d[i]), to(s[i])
			if srcLow {
				a, b = b, a
			}
			d[i] = from(f(a, b))
		}
	}, nil
}
