package collective_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestAlltoall: world sizes 1–9, blocks of 0, 1, a prime number of
// elements and several chunks (all peers at once), and beyond
// AlltoallPairwiseMin (pairwise), in place or not.
func TestAlltoall(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		t.Run(name("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			for _, m := range []int{0, 1, 13, 3001} {
				for _, inPlace := range []bool{false, true} {
					t.Run(name("m=%d/inplace=%v", m, inPlace), func(t *testing.T) {
						checkAlltoall[int32](t, cs, m, inPlace)
						checkAlltoall[collective.BFloat16](t, cs, m, inPlace)
					})
				}
			}
			if p == 3 || p == 4 {
				m := collective.AlltoallPairwiseMin/8 + 7
				checkAlltoall[float64](t, cs, m, false)
				checkAlltoall[float64](t, cs, m, true)
			}
		})
	}
}

// checkAlltoall: rank r's block j of recv is rank j's block r of send.
func checkAlltoall[T collective.Number](t *testing.T, cs []*collective.Comm, m int, inPlace bool) {
	t.Helper()
	p := len(cs)
	ins, outs := make([][]T, p), make([][]T, p)
	for r := range p {
		ins[r] = make([]T, p*m)
		for i := range ins[r] {
			ins[r][i] = T(r*131 + i) // wraps for the small types: still distinct per (r, i) mostly
		}
	}
	noErrors(t, "alltoall", parallel(p, func(r int) error {
		send := slices.Clone(ins[r])
		if inPlace {
			outs[r] = send
			return collective.Alltoall(testCtx(t), cs[r], nil, outs[r])
		}
		outs[r] = make([]T, p*m)
		err := collective.Alltoall(testCtx(t), cs[r], send, outs[r])
		if !slices.Equal(send, ins[r]) {
			t.Errorf("rank %d: send changed", r)
		}
		return err
	}))
	for r := range p {
		for j := range p {
			if got, want := outs[r][j*m:(j+1)*m], ins[j][r*m:(r+1)*m]; !slices.Equal(got, want) {
				t.Fatalf("%T m=%d: rank %d's block from rank %d differs", want, m, r, j)
			}
		}
	}
}

// TestAlltoallv: blocks of varying lengths (zero included) at scattered
// places, with gaps that must stay untouched, in place with symmetric
// counts.
func TestAlltoallv(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 8, 9} {
		t.Run(name("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			for _, scale := range []int{1, 1000} {
				t.Run(name("scale=%d", scale), func(t *testing.T) {
					count := func(from, to int) int { return (from*3 + to*5) % 7 * scale } // 0 for some pairs
					checkAlltoallv(t, cs, count, false)
					sym := func(from, to int) int { return (from + to) % 5 * scale }
					checkAlltoallv(t, cs, sym, true)
				})
			}
		})
	}
}

// checkAlltoallv runs Alltoallv with count(from, to) elements from rank
// from to rank to, blocks in reverse order of ranks and a gap of 3
// elements before each.
func checkAlltoallv(t *testing.T, cs []*collective.Comm, count func(from, to int) int, inPlace bool) {
	t.Helper()
	const gap = 3
	p := len(cs)
	layout := func(n func(j int) int) ([]int, []int, int) {
		counts, displs, at := make([]int, p), make([]int, p), 0
		for j := p - 1; j >= 0; j-- {
			at += gap
			counts[j], displs[j] = n(j), at
			at += counts[j]
		}
		return counts, displs, at
	}
	sends, recvs := make([][]uint32, p), make([][]uint32, p)
	scounts, sdispls, rcounts, rdispls := make([][]int, p), make([][]int, p), make([][]int, p), make([][]int, p)
	for r := range p {
		var n int
		scounts[r], sdispls[r], n = layout(func(j int) int { return count(r, j) })
		sends[r] = make([]uint32, n)
		for i := range sends[r] {
			sends[r][i] = uint32(r<<24 | i)
		}
		rcounts[r], rdispls[r], n = layout(func(j int) int { return count(j, r) })
		recvs[r] = make([]uint32, n)
		for i := range recvs[r] {
			recvs[r][i] = 0xdeadbeef
		}
		if inPlace {
			recvs[r] = slices.Clone(sends[r])
		}
	}
	noErrors(t, "alltoallv", parallel(p, func(r int) error {
		if inPlace {
			return collective.Alltoallv(testCtx(t), cs[r], nil, nil, nil, recvs[r], rcounts[r], rdispls[r])
		}
		return collective.Alltoallv(testCtx(t), cs[r], sends[r], scounts[r], sdispls[r], recvs[r], rcounts[r], rdispls[r])
	}))
	for r := range p {
		in := make([]bool, len(recvs[r]))
		for j := range p {
			got := recvs[r][rdispls[r][j]:][:rcounts[r][j]]
			want := sends[j][sdispls[j][r]:][:scounts[j][r]]
			if !slices.Equal(got, want) {
				t.Fatalf("rank %d's block from rank %d differs", r, j)
			}
			for i := range got {
				in[rdispls[r][j]+i] = true
			}
		}
		for i, v := range recvs[r] {
			want := uint32(0xdeadbeef)
			if inPlace {
				want = sends[r][i]
			}
			if !in[i] && v != want {
				t.Fatalf("rank %d: recv[%d] outside the blocks changed to %#x", r, i, v)
			}
		}
	}
}

// TestAlltoallvMismatch: a rank that sends another number of elements
// than its peer expects makes the peer fail with ErrMismatch naming both
// lengths.
func TestAlltoallvMismatch(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	errs := runAll(t, p, func(ctx context.Context, r int) error {
		counts := []int{2, 2, 2}
		rcounts := []int{2, 2, 2}
		if r == 0 {
			counts[1] = 3 // rank 1 expects 2
		}
		return collective.Alltoallv(ctx, cs[r], make([]int32, 7), counts, []int{0, 2, 4}, make([]int32, 6), rcounts, []int{0, 2, 4})
	})
	var e *collective.Error
	if !errors.Is(errs[1], collective.ErrMismatch) || !errors.As(errs[1], &e) || e.Peer != 0 {
		t.Fatalf("rank 1: %v, want ErrMismatch with peer 0", errs[1])
	}
	for _, s := range []string{"12 bytes", "expects 8", "recvcounts[0] = 2 elements of 4 bytes"} {
		if !strings.Contains(errs[1].Error(), s) {
			t.Errorf("rank 1's error %q does not say %q", errs[1], s)
		}
	}
	expectMismatch(t, cs, errs)
}

// TestAlltoallMismatch: ranks that disagree on the block length fail
// with ErrMismatch.
func TestAlltoallMismatch(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	expectMismatch(t, cs, runAll(t, p, func(ctx context.Context, r int) error {
		m := 4 + r/2
		return collective.Alltoall(ctx, cs[r], make([]int16, p*m), make([]int16, p*m))
	}))
}

// TestAlltoallBadArguments: invalid arguments fail at once with ErrArgs
// and leave the communicator usable.
func TestAlltoallBadArguments(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	c := cs[0]
	ctx := testCtx(t)
	buf := make([]int32, 16)
	two := []int{0, 0}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"odd length", collective.Alltoall(ctx, c, make([]int32, 7), make([]int32, 7))},
		{"lengths", collective.Alltoall(ctx, c, make([]int32, 6), make([]int32, 8))},
		{"overlap", collective.Alltoall(ctx, c, buf[:8], buf[4:12])},
		{"in place, odd length", collective.Alltoall(ctx, c, nil, make([]int32, 3))},
		{"v: counts length", collective.Alltoallv(ctx, c, buf[:4], []int{1}, two, buf[8:], two, two)},
		{"v: displs length", collective.Alltoallv(ctx, c, buf[:4], two, two, buf[8:], two, []int{0, 0, 0})},
		{"v: negative count", collective.Alltoallv(ctx, c, buf[:4], []int{-1, 1}, two, buf[8:], two, two)},
		{"v: negative displacement", collective.Alltoallv(ctx, c, buf[:4], two, []int{0, -1}, buf[8:], two, two)},
		{"v: send block outside", collective.Alltoallv(ctx, c, buf[:4], []int{2, 2}, []int{0, 3}, buf[8:], []int{2, 2}, two)},
		{"v: recv block outside", collective.Alltoallv(ctx, c, buf[:4], two, two, buf[8:], []int{0, 1 << 62}, []int{0, 1 << 62})},
		{"v: own block", collective.Alltoallv(ctx, c, buf[:4], []int{1, 0}, two, buf[8:], []int{2, 0}, two)},
		{"v: overlap", collective.Alltoallv(ctx, c, buf[:8], two, two, buf[4:], two, two)},
		{"v: nil send with counts", collective.Alltoallv(ctx, c, nil, []int{1, 1}, two, buf[8:], []int{1, 1}, two)},
	} {
		if !errors.Is(tc.err, collective.ErrArgs) {
			t.Errorf("%s: %v, want ErrArgs", tc.name, tc.err)
		}
	}
	checkAlltoall[int32](t, cs, 5, false)
}

// TestAlltoallvOverlappingRecv: Alltoallv documents that the receive
// blocks must not overlap (Gatherv and Allgatherv refuse such layouts
// with ErrArgs); it accepted them: two peers' messages landed on the
// same elements, whichever was consumed last won. (Found by a review.)
func TestAlltoallvOverlappingRecv(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{})
	errs := parallel(p, func(r int) error {
		send := []int32{int32(10*r + 0), int32(10*r + 1), int32(10*r + 2)}
		ones := []int{1, 1, 1}
		sd := []int{0, 1, 2}
		recv := make([]int32, 2)
		rd := []int{0, 1, 1} // blocks 1 and 2 overlap
		return collective.Alltoallv(testCtx(t), cs[r], send, ones, sd, recv, ones, rd)
	})
	for r, err := range errs {
		if !errors.Is(err, collective.ErrArgs) {
			t.Errorf("rank %d: %v, want ErrArgs (recv blocks overlap)", r, err)
		}
	}
}
