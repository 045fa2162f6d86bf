//go:build !amd64

package collective

// Without vector kernels (see sum_amd64.go) the Go loops do all.

func addF32(out, left, right *float32, n int) { panic("collective: no vector kernel") }
func addF64(out, left, right *float64, n int) { panic("collective: no vector kernel") }

const (
	vecF32 = 32
	vecF64 = 16
)

var haveVec = false
