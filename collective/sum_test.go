package collective

import (
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"
)

// TestSumKernels: Sum on float32 and float64 with the vector kernel
// (where the processor has one) gives the same bits as the Go loop
// (sumBytes), in both operand orders, for every length around the
// kernel's vector size and misaligned slices, on values that include
// NaNs of several payloads, infinities, signed zeros, subnormals and
// sums that round. Where both operands are NaNs the result is a NaN
// whose payload Go does not specify either (its choice of operand
// varies with the compilation: -race changes it).
func TestSumKernels(t *testing.T) {
	if !haveVec {
		t.Log("no vector kernel on this processor: the Go loop is compared with itself")
	}
	vec := haveVec
	t.Cleanup(func() { haveVec = vec })
	for _, haveVec = range []bool{vec, false} {
		testSumKernels(t)
	}
}

func testSumKernels(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	f64 := []float64{math.NaN(), math.Float64frombits(0x7ff0000000000123), math.Float64frombits(0xfff8000000000456),
		math.Inf(1), math.Inf(-1), 0, math.Copysign(0, -1), 5e-324, -5e-324, 1, -1, 1e308, 0.1, 1 << 53}
	f32 := []float32{float32(math.NaN()), math.Float32frombits(0x7f800123), math.Float32frombits(0xffc00456),
		float32(math.Inf(1)), float32(math.Inf(-1)), 0, float32(math.Copysign(0, -1)), 1e-45, -1e-45, 1, -1, 3e38, 0.1, 1 << 24}
	set32 := func(b []byte, i int, r *rand.Rand) {
		v := float32(r.NormFloat64() * 1e3)
		if r.IntN(4) == 0 {
			v = f32[r.IntN(len(f32))]
		}
		*(*float32)(ptr(b, 4*i)) = v
	}
	set64 := func(b []byte, i int, r *rand.Rand) {
		v := r.NormFloat64() * 1e3
		if r.IntN(4) == 0 {
			v = f64[r.IntN(len(f64))]
		}
		*(*float64)(ptr(b, 8*i)) = v
	}
	t.Run("float32", func(t *testing.T) { checkKernel(t, rng, 4, sumF32, sumBytes[float32], set32) })
	t.Run("float64", func(t *testing.T) { checkKernel(t, rng, 8, sumF64, sumBytes[float64], set64) })
	// The combiners (own elsewhere than dst) against copying own into
	// dst and reducing: what ringAllreduce did before it had them.
	t.Run("float32/combiner", func(t *testing.T) {
		checkKernel(t, rng, 4, combined(combinerFor[float32](Sum)), sumBytes[float32], set32)
	})
	t.Run("float64/combiner", func(t *testing.T) {
		checkKernel(t, rng, 8, combined(combinerFor[float64](Sum)), sumBytes[float64], set64)
	})
}

// combined returns a reducer that combines dst's operand, copied to
// memory of its own (misaligned against dst by one byte when dst is
// long enough), with src into dst through comb, and fills that copy
// with garbage after.
func combined(comb combiner) reducer {
	return func(dst, src []byte, srcLow bool) {
		own := make([]byte, len(dst)+1)[1:]
		copy(own, dst)
		clear(dst)
		comb(dst, own, src, srcLow)
		for i := range own {
			own[i] = 0xa5
		}
	}
}

// TestCombinerFor: only Sum on float32 and float64 has a combiner (the
// rest copy and reduce).
func TestCombinerFor(t *testing.T) {
	for _, c := range []struct {
		name string
		comb combiner
		want bool
	}{
		{"sum float32", combinerFor[float32](Sum), true},
		{"sum float64", combinerFor[float64](Sum), true},
		{"max float32", combinerFor[float32](Max), false},
		{"sum int32", combinerFor[int32](Sum), false},
		{"sum bfloat16", combinerFor[BFloat16](Sum), false},
	} {
		if got := c.comb != nil; got != c.want {
			t.Errorf("%s: combiner %v, want %v", c.name, got, c.want)
		}
	}
}

// checkKernel compares red with ref on random vectors of esz-byte
// elements (set writes element i), for lengths 0 to 3·32+5 and at
// offsets 0 to 3 elements into the memory, in both orders.
func checkKernel(t *testing.T, rng *rand.Rand, esz int, red, ref reducer, set func(b []byte, i int, r *rand.Rand)) {
	t.Helper()
	for n := 0; n <= 3*32+5; n++ {
		for off := range 4 {
			for _, srcLow := range []bool{false, true} {
				d := make([]byte, (n+off)*esz)[off*esz:]
				s := make([]byte, (n+off)*esz)[off*esz:]
				for i := range n {
					set(d, i, rng)
					set(s, i, rng)
				}
				want := append([]byte(nil), d...)
				ref(want, s, srcLow)
				srcBefore := append([]byte(nil), s...)
				red(d, s, srcLow)
				for i := 0; i < len(d); i += esz {
					if string(d[i:i+esz]) != string(want[i:i+esz]) && !(isNaN(d[i:i+esz]) && isNaN(want[i:i+esz])) {
						t.Fatalf("n=%d off=%d srcLow=%v: element %d is %x, want %x", n, off, srcLow, i/esz, d[i:i+esz], want[i:i+esz])
					}
				}
				if string(s) != string(srcBefore) {
					t.Fatalf("n=%d off=%d srcLow=%v: src changed", n, off, srcLow)
				}
			}
		}
	}
}

func ptr(b []byte, off int) unsafe.Pointer { return unsafe.Pointer(&b[off]) }

// isNaN reports whether b (4 or 8 bytes, little endian) is a NaN.
func isNaN(b []byte) bool {
	if len(b) == 4 {
		v := *(*float32)(unsafe.Pointer(&b[0]))
		return v != v
	}
	v := *(*float64)(unsafe.Pointer(&b[0]))
	return v != v
}
