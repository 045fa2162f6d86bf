package collective

import (
	"fmt"
	"testing"
)

// benchN is the number of elements of the reduction benchmarks.
const benchN = 1 << 14

// BenchmarkReduce measures the reduction kernels (dst ⊕= src on benchN
// elements, bytes/s of dst), next to the baselines of a plain Go loop
// dst[i] += src[i] on float32 and float64 and of copy(dst, src) of as
// many bytes, in the same run.
func BenchmarkReduce(b *testing.B) {
	b.Run("baseline/copy", func(b *testing.B) {
		d, s := make([]byte, 4*benchN), make([]byte, 4*benchN)
		b.SetBytes(int64(len(d)))
		for b.Loop() {
			copy(d, s)
		}
	})
	b.Run("baseline/float32", func(b *testing.B) {
		d, s := make([]float32, benchN), make([]float32, benchN)
		b.SetBytes(int64(4 * benchN))
		for b.Loop() {
			plainSum32(d, s)
		}
	})
	b.Run("baseline/float64", func(b *testing.B) {
		d, s := make([]float64, benchN), make([]float64, benchN)
		b.SetBytes(int64(8 * benchN))
		for b.Loop() {
			plainSum64(d, s)
		}
	})
	ops := []Op{Sum, Prod, Min, Max, And, Or, Xor}
	benchType[int8](b, ops)
	benchType[int16](b, ops)
	benchType[int32](b, ops)
	benchType[int64](b, ops)
	benchType[uint8](b, ops)
	benchType[uint16](b, ops)
	benchType[uint32](b, ops)
	benchType[uint64](b, ops)
	benchType[float32](b, ops)
	benchType[float64](b, ops)
	benchType[BFloat16](b, ops)
	benchType[Float16](b, ops)
	benchType[float32](b, []Op{Custom("custom", func(inout, in []float32) {
		for i := range inout {
			inout[i] += in[i]
		}
	})})
}

// plainSum32 and plainSum64 are the baseline: the plain Go loop.
//
//go:noinline
func plainSum32(d, s []float32) {
	for i := range d {
		d[i] += s[i]
	}
}

//go:noinline
func plainSum64(d, s []float64) {
	for i := range d {
		d[i] += s[i]
	}
}

func benchType[T Number](b *testing.B, ops []Op) {
	for _, op := range ops {
		red, err := reducerFor[T](op)
		if err != nil {
			continue // not defined on T
		}
		b.Run(fmt.Sprintf("%v/%v", op, typeName[T]()), func(b *testing.B) {
			d, s := make([]T, benchN), make([]T, benchN)
			for i := range d {
				d[i], s[i] = T(i%7+1), T(i%5+1)
			}
			db, sb := bytesOf(d), bytesOf(s)
			b.SetBytes(int64(len(db)))
			for b.Loop() {
				red(db, sb, true)
			}
		})
	}
}

func typeName[T Number]() string {
	return dtypeName(dtypeOf[T]())
}
