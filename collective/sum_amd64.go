package collective

import "golang.org/x/sys/cpu"

// The vector kernels of Sum on float32 and float64 (sum_amd64.s, AVX2):
// out[i] = left[i] + right[i] for the first n elements, n a multiple of
// vecF32 or vecF64; the caller does the rest in Go. Each element is one
// IEEE 754 addition, as in Go, so the results are the same bits, but
// for the payload of the NaN two NaN operands give (the left one's,
// quieted; Go's loop gives either, as its compilation goes).

//go:noescape
func addF32(out, left, right *float32, n int)

//go:noescape
func addF64(out, left, right *float64, n int)

const (
	vecF32 = 32 // float32 per iteration of addF32
	vecF64 = 16
)

// haveVec reports whether the vector kernels run on this processor.
var haveVec = cpu.X86.HasAVX2
