package collective

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"sync"
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
	elem reflect.Type // Custom: T
	red  reducer      // Custom: f as a reducer
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
	if f == nil {
		return Op{}
	}
	return Op{kind: opCustom, name: name, elem: reflect.TypeFor[T](), red: custom(f)}
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

// reducerFor returns the reducer of op on T. The reducers of the
// predefined operations are cached: a func value of a generic function
// instantiated inside a generic function is a closure (it binds the
// instantiation's dictionary), allocated each time it is taken.
func reducerFor[T Number](op Op) (reducer, error) {
	if op.kind == opCustom {
		return customReducer[T](op)
	}
	key := reducerKey{reflect.TypeFor[T](), op.kind}
	reducers.RLock()
	r, ok := reducers.m[key]
	reducers.RUnlock()
	if ok {
		return r, nil
	}
	r, err := newReducer[T](op)
	if err != nil {
		return nil, err
	}
	reducers.Lock()
	reducers.m[key] = r
	reducers.Unlock()
	return r, nil
}

type reducerKey struct {
	t reflect.Type
	k opKind
}

var reducers = struct {
	sync.RWMutex
	m map[reducerKey]reducer
}{m: make(map[reducerKey]reducer)}

func newReducer[T Number](op Op) (reducer, error) {
	var z T
	switch any(z).(type) {
	case BFloat16:
		return halfReducer[BFloat16](op)
	case Float16:
		return halfReducer[Float16](op)
	}
	switch op.kind {
	case opSum:
		return sumBytes[T], nil
	case opProd:
		return prodBytes[T], nil
	case opMin:
		return minBytes[T], nil
	case opMax:
		return maxBytes[T], nil
	case opAnd, opOr, opXor:
		k := reflect.TypeFor[T]().Kind()
		if k == reflect.Float32 || k == reflect.Float64 {
			return nil, fmt.Errorf("%w: %v on %v", ErrBadOp, op, reflect.TypeFor[T]())
		}
		switch op.kind {
		case opAnd:
			return andBytes, nil
		case opOr:
			return orBytes, nil
		}
		return xorBytes, nil
	case opCustom:
		return customReducer[T](op)
	}
	return nil, fmt.Errorf("%w: the zero Op", ErrBadOp)
}

// customReducer returns the reducer of a Custom op on T, built when the
// Op was made.
func customReducer[T Number](op Op) (reducer, error) {
	if op.elem != reflect.TypeFor[T]() || op.red == nil {
		return nil, fmt.Errorf("%w: %v is defined on %v, not %v", ErrBadOp, op, op.elem, reflect.TypeFor[T]())
	}
	return op.red, nil
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

// The reducers of the predefined operations are top-level generic
// functions: taking one as a func value allocates nothing.

func sumBytes[T Number](dst, src []byte, srcLow bool) {
	d, s := elems[T](dst), elems[T](src)
	s = s[:len(d)]
	if srcLow {
		for i := range d {
			d[i] = s[i] + d[i]
		}
		return
	}
	for i := range d {
		d[i] += s[i]
	}
}

func prodBytes[T Number](dst, src []byte, srcLow bool) {
	d, s := elems[T](dst), elems[T](src)
	s = s[:len(d)]
	if srcLow {
		for i := range d {
			d[i] = s[i] * d[i]
		}
		return
	}
	for i := range d {
		d[i] *= s[i]
	}
}

func minBytes[T Number](dst, src []byte, srcLow bool) {
	d, s := elems[T](dst), elems[T](src)
	s = s[:len(d)]
	if srcLow {
		for i := range d {
			d[i] = min(s[i], d[i])
		}
		return
	}
	for i := range d {
		d[i] = min(d[i], s[i])
	}
}

func maxBytes[T Number](dst, src []byte, srcLow bool) {
	d, s := elems[T](dst), elems[T](src)
	s = s[:len(d)]
	if srcLow {
		for i := range d {
			d[i] = max(s[i], d[i])
		}
		return
	}
	for i := range d {
		d[i] = max(d[i], s[i])
	}
}

// Bitwise operations are commutative: byte-wise on whole buffers, eight
// bytes at a time.

func andBytes(dst, src []byte, _ bool) {
	src = src[:len(dst)]
	for ; len(dst) >= 8; dst, src = dst[8:], src[8:] {
		*(*uint64)(unsafe.Pointer(&dst[0])) &= *(*uint64)(unsafe.Pointer(&src[0]))
	}
	for i := range dst {
		dst[i] &= src[i]
	}
}

func orBytes(dst, src []byte, _ bool) {
	src = src[:len(dst)]
	for ; len(dst) >= 8; dst, src = dst[8:], src[8:] {
		*(*uint64)(unsafe.Pointer(&dst[0])) |= *(*uint64)(unsafe.Pointer(&src[0]))
	}
	for i := range dst {
		dst[i] |= src[i]
	}
}

func xorBytes(dst, src []byte, _ bool) {
	src = src[:len(dst)]
	for ; len(dst) >= 8; dst, src = dst[8:], src[8:] {
		*(*uint64)(unsafe.Pointer(&dst[0])) ^= *(*uint64)(unsafe.Pointer(&src[0]))
	}
	for i := range dst {
		dst[i] ^= src[i]
	}
}

// custom wraps a user function as a reducer (once, in Custom).
func custom[T Number](f func(inout, in []T)) reducer {
	return func(dst, src []byte, srcLow bool) {
		d, s := elems[T](dst), elems[T](src)
		s = s[:len(d)]
		if srcLow {
			// dst = src ⊕ dst: f(inout, in) computes inout ⊕ in with inout
			// on the left, so compute into src (the receive slot or scratch,
			// library memory) and copy back.
			f(s, d)
			copy(d, s)
			return
		}
		f(d, s)
	}
}

// halfFloat is BFloat16 or Float16.
type halfFloat[H any] interface {
	~uint16
	Float32() float32
	round(float32) H
}

func (BFloat16) round(f float32) BFloat16 { return BFloat16From(f) }
func (Float16) round(f float32) Float16   { return Float16From(f) }

func halfReducer[H halfFloat[H]](op Op) (reducer, error) {
	switch op.kind {
	case opSum:
		return halfSum[H], nil
	case opProd:
		return halfProd[H], nil
	case opMin:
		return halfMin[H], nil
	case opMax:
		return halfMax[H], nil
	case opCustom:
		return customReducer[H](op)
	case opNone:
		return nil, fmt.Errorf("%w: the zero Op", ErrBadOp)
	}
	return nil, fmt.Errorf("%w: %v on %v", ErrBadOp, op, reflect.TypeFor[H]())
}

func halfSum[H halfFloat[H]](dst, src []byte, srcLow bool) {
	d, s := elems[H](dst), elems[H](src)
	s = s[:len(d)]
	for i := range d {
		a, b := d[i].Float32(), s[i].Float32()
		if srcLow {
			a, b = b, a
		}
		d[i] = d[i].round(a + b)
	}
}

func halfProd[H halfFloat[H]](dst, src []byte, srcLow bool) {
	d, s := elems[H](dst), elems[H](src)
	s = s[:len(d)]
	for i := range d {
		a, b := d[i].Float32(), s[i].Float32()
		if srcLow {
			a, b = b, a
		}
		d[i] = d[i].round(a * b)
	}
}

func halfMin[H halfFloat[H]](dst, src []byte, srcLow bool) {
	d, s := elems[H](dst), elems[H](src)
	s = s[:len(d)]
	for i := range d {
		a, b := d[i].Float32(), s[i].Float32()
		if srcLow {
			a, b = b, a
		}
		d[i] = d[i].round(min(a, b))
	}
}

func halfMax[H halfFloat[H]](dst, src []byte, srcLow bool) {
	d, s := elems[H](dst), elems[H](src)
	s = s[:len(d)]
	for i := range d {
		a, b := d[i].Float32(), s[i].Float32()
		if srcLow {
			a, b = b, a
		}
		d[i] = d[i].round(max(a, b))
	}
}
