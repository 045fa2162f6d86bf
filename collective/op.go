package collective

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"reflect"
	"runtime/debug"
	"sync/atomic"
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
// Every rank gets the same bits: each element's result is computed once,
// by one rank, and copied to the others, or computed by every rank in
// the same order. Which partial results are combined in which order is
// documented on each collective: it never depends on the calling rank,
// but it does depend on the algorithm (the rings combine each block in
// ring order, from a rank that depends on the block), so floating-point
// sums may differ in their last bits between algorithms and
// communicator sizes. Custom operations are always combined in rank
// order (the lower ranks' partial result on the left), so they may be
// non-commutative.
type Op struct {
	kind opKind
	name string
	elem reflect.Type // Custom: T
	red  reducer      // Custom: f as a reducer
	id   uint32       // Custom: opID(name), carried in the call's description
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

// Custom returns a user-defined operation on elements of type T. f
// combines in into inout element by element, in being the left operand:
// inout[i] = in[i] ⊕ inout[i], as MPI's user functions (in holds the
// partial result of lower ranks than inout's). ⊕ must be associative; it
// need not be commutative: every collective combines partial results in
// the order of the ranks they stem from (Allreduce uses Rabenseifner's
// algorithm or recursive doubling for Custom operations, never the ring,
// whatever Options.Algorithm says; ReduceScatter uses recursive
// halving), as documented on each collective.
//
// Ranks tell Custom operations apart by name: every rank passes an
// operation of the same name (calls whose operations are named
// differently fail with ErrMismatch, like calls with different
// predefined operations).
//
// f is called with slices of equal length (possibly empty), from the
// goroutine of the collective call, one call at a time per
// communicator; it may write inout and nothing else, must not retain
// the slices, must not call into the communicator, and should not
// panic: if it does, the call fails with ErrOpPanicked (naming what it
// panicked with), poisoning the communicator, and the other ranks' calls
// fail as their peer gave up; the panic does not go on. Using the Op
// with another element type than T fails with ErrBadOp.
func Custom[T Number](name string, f func(inout, in []T)) Op {
	if f == nil {
		return Op{}
	}
	return Op{kind: opCustom, name: name, elem: reflect.TypeFor[T](), red: custom(f), id: opID(name)}
}

// opID identifies a Custom operation by its name (FNV-1a), among the
// ranks: calls whose Custom operations have different names disagree
// (ErrMismatch), as calls with different predefined operations do.
func opID(name string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(name))
	return h.Sum32()
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
// lower ranks), else dst = dst ⊕ src. Without srcLow, a reducer may
// overwrite src (a Custom operation computes there), which must then be
// library memory (a window slot or scratch), never a caller's buffer;
// with srcLow, src is left unchanged.
type reducer func(dst, src []byte, srcLow bool)

// reducerFor returns the reducer of op on T. The reducers of the
// predefined operations are cached, per element type code (dtypeOf: types
// of one kind share a reducer, which works on bytes) and operation: a
// func value of a generic function instantiated inside a generic function
// is a closure (it binds the instantiation's dictionary), allocated each
// time it is taken. The cache is a table of atomic pointers: a map behind
// a read lock, keyed by reflect.Type, cost 60 ns per call, a tenth of
// what the rest of a 2-rank 8-byte Allreduce spends on the processor.
func reducerFor[T Number](op Op) (reducer, error) {
	if op.kind == opCustom {
		return customReducer[T](op)
	}
	slot := &reducers[dtypeOf[T]()%numDtypes][op.kind%opCustom]
	if r := slot.Load(); r != nil {
		return *r, nil
	}
	r, err := newReducer[T](op)
	if err != nil {
		return nil, err
	}
	slot.Store(&r)
	return r, nil
}

// numDtypes bounds the codes of dtypeOf.
const numDtypes = 32

var reducers [numDtypes][opCustom]atomic.Pointer[reducer]

func newReducer[T Number](op Op) (reducer, error) {
	var z T
	switch any(z).(type) {
	case BFloat16:
		return bf16Reducer(op)
	case Float16:
		return f16Reducer(op)
	}
	switch op.kind {
	case opSum:
		switch reflect.TypeFor[T]().Kind() {
		case reflect.Float32:
			return sumF32, nil
		case reflect.Float64:
			return sumF64, nil
		}
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

// sumF32 and sumF64 are Sum on float32 and float64 (sumTo, dst its own
// operand).
func sumF32(dst, src []byte, srcLow bool) { sumTo(dst, dst, src, srcLow, vecF32, addF32) }
func sumF64(dst, src []byte, srcLow bool) { sumTo(dst, dst, src, srcLow, vecF64, addF64) }

// combiner is a reducer that takes dst's operand from own: dst = src ⊕
// own if srcLow, else own ⊕ src, bit for bit what copying own into dst
// and reducing src into it gives, in one pass over the memory instead of
// two (ringAllreduce out of place combines each chunk received with the
// caller's input so). own is dst or does not overlap it.
type combiner func(dst, own, src []byte, srcLow bool)

// combinerFor returns the combiner of op on T, or nil where the copy and
// the reducer do (only Sum on float32 and float64 has one: their vector
// kernels take three operands).
func combinerFor[T Number](op Op) combiner {
	if op.kind != opSum {
		return nil
	}
	var z T
	switch any(z).(type) {
	case float32:
		return sumF32To
	case float64:
		return sumF64To
	}
	return nil
}

func sumF32To(dst, own, src []byte, srcLow bool) { sumTo(dst, own, src, srcLow, vecF32, addF32) }
func sumF64To(dst, own, src []byte, srcLow bool) { sumTo(dst, own, src, srcLow, vecF64, addF64) }

// sumTo is Sum on float32 or float64 into dst from own and src: the
// vector kernel add (sum_amd64.go) on whole vectors of vec elements, when
// the processor has it, and sumBytes on the rest. Bit for bit the same as
// sumBytes alone.
func sumTo[T float32 | float64](dst, own, src []byte, srcLow bool, vec int, add func(out, left, right *T, n int)) {
	d, o, s := elems[T](dst), elems[T](own), elems[T](src)
	if len(d) == 0 {
		return
	}
	o, s = o[:len(d)], s[:len(d)]
	k := 0
	if haveVec && len(d) >= vec {
		k = len(d) &^ (vec - 1)
		if srcLow {
			add(&d[0], &s[0], &o[0], k)
		} else {
			add(&d[0], &o[0], &s[0], k)
		}
	}
	var e T
	esz := int(unsafe.Sizeof(e))
	if &o[0] != &d[0] {
		copy(d[k:], o[k:])
	}
	sumBytes[T](dst[esz*k:], src[esz*k:], srcLow)
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

// custom wraps a user function as a reducer (once, in Custom). f(inout,
// in) computes inout = in ⊕ inout.
func custom[T Number](f func(inout, in []T)) reducer {
	return func(dst, src []byte, srcLow bool) {
		d, s := elems[T](dst), elems[T](src)
		if len(d) == 0 {
			return
		}
		s = s[:len(d)]
		if srcLow {
			callCustom(f, d, s) // d = s ⊕ d
			return
		}
		// dst = dst ⊕ src: computed into src (the receive slot or scratch,
		// library memory) and copied back.
		callCustom(f, s, d)
		copy(d, s)
	}
}

// ErrOpPanicked: a Custom operation panicked during the call. The call
// fails with it (the error says what the operation panicked with, and
// where), the communicator is poisoned and the peers give the call up;
// the panic does not go on.
var ErrOpPanicked = errors.New("collective: the Custom operation panicked")

// opPanic is what a Custom operation's panic becomes on its way out of
// the library's code: catchOp, deferred by the calls that reduce, turns
// it into the call's error.
type opPanic struct {
	v     any
	stack []byte
}

// callCustom calls the user's f, turning its panic into an *opPanic.
//
// A runtime.Goexit in f (t.Fatal in a test's operation) becomes an
// *opPanic too, so that catchOp ends the call and gives its turn up
// before the goroutine goes on exiting (a recovered panic raised during
// Goexit does not stop the Goexit).
func callCustom[T Number](f func(inout, in []T), inout, in []T) {
	returned := false
	defer func() {
		if v := recover(); v != nil {
			panic(&opPanic{v: v, stack: debug.Stack()})
		}
		if !returned {
			panic(&opPanic{v: "the operation called runtime.Goexit", stack: debug.Stack()})
		}
	}()
	f(inout, in)
	returned = true
}

// catchOp, deferred by a call that may reduce with a Custom operation
// once it has its turn (ticket t), ends the call with ErrOpPanicked
// (poisoning the communicator and telling the peers, as any failure)
// when the operation panicked, instead of leaving the call's turn held
// for ever; any other panic goes on.
func (c *Comm) catchOp(t uint64, err *error) {
	v := recover()
	if v == nil {
		return
	}
	p, ok := v.(*opPanic)
	if !ok {
		panic(v)
	}
	*err = c.end(t, c.fail(fmt.Errorf("%w: %v\n%s", ErrOpPanicked, p.v, p.stack), -1))
}

// The 16-bit floating-point types: each operation in float32, rounded
// back to nearest even. One loop per type and operation, so that the
// conversions are direct calls (BFloat16's inlined). The operands go in
// the order of the other reducers (the lower ranks' on the left): with
// NaNs of other signs or payloads the result's bits depend on it, and
// before, the ranks of a recursive doubling each put its own on the left
// and got different bits (TestHalfNaNBitsIdentical).

// halfOperands returns dst's elements and the left and right operands of
// a reducer: src then dst if srcLow, else dst then src.
func halfOperands[H BFloat16 | Float16](dst, src []byte, srcLow bool) (d, l, r []H) {
	d, s := elems[H](dst), elems[H](src)
	s = s[:len(d)]
	if srcLow {
		return d, s, d
	}
	return d, d, s
}

func bf16Reducer(op Op) (reducer, error) {
	switch op.kind {
	case opSum:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[BFloat16](dst, src, srcLow)
			for i := range d {
				d[i] = BFloat16From(l[i].Float32() + r[i].Float32())
			}
		}, nil
	case opProd:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[BFloat16](dst, src, srcLow)
			for i := range d {
				d[i] = BFloat16From(l[i].Float32() * r[i].Float32())
			}
		}, nil
	case opMin:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[BFloat16](dst, src, srcLow)
			for i := range d {
				d[i] = BFloat16From(min(l[i].Float32(), r[i].Float32()))
			}
		}, nil
	case opMax:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[BFloat16](dst, src, srcLow)
			for i := range d {
				d[i] = BFloat16From(max(l[i].Float32(), r[i].Float32()))
			}
		}, nil
	case opCustom:
		return customReducer[BFloat16](op)
	}
	return nil, halfBadOp[BFloat16](op)
}

func f16Reducer(op Op) (reducer, error) {
	switch op.kind {
	case opSum:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[Float16](dst, src, srcLow)
			for i := range d {
				d[i] = Float16From(l[i].Float32() + r[i].Float32())
			}
		}, nil
	case opProd:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[Float16](dst, src, srcLow)
			for i := range d {
				d[i] = Float16From(l[i].Float32() * r[i].Float32())
			}
		}, nil
	case opMin:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[Float16](dst, src, srcLow)
			for i := range d {
				d[i] = Float16From(min(l[i].Float32(), r[i].Float32()))
			}
		}, nil
	case opMax:
		return func(dst, src []byte, srcLow bool) {
			d, l, r := halfOperands[Float16](dst, src, srcLow)
			for i := range d {
				d[i] = Float16From(max(l[i].Float32(), r[i].Float32()))
			}
		}, nil
	case opCustom:
		return customReducer[Float16](op)
	}
	return nil, halfBadOp[Float16](op)
}

func halfBadOp[H Number](op Op) error {
	if op.kind == opNone {
		return fmt.Errorf("%w: the zero Op", ErrBadOp)
	}
	return fmt.Errorf("%w: %v on %v", ErrBadOp, op, reflect.TypeFor[H]())
}
