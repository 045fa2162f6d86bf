package collective_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// vlayout returns counts and displacements of p blocks of varying sizes
// (some empty), with gaps between them, in reverse rank order if reverse,
// and the length of the buffer holding them.
func vlayout(p, scale int, reverse bool) (counts, displs []int, n int) {
	counts, displs = make([]int, p), make([]int, p)
	for k := range p {
		r := k
		if reverse {
			r = p - 1 - k
		}
		counts[r] = (r*7 + 3) % 5 * scale
		displs[r] = n + 1
		n += counts[r] + 1
	}
	return counts, displs, n
}

func TestGather(t *testing.T) {
	rootedCases(t, gatherCase[int32], func(t *testing.T, cs []*collective.Comm) {
		gatherCase[float64](t, cs, 20011, len(cs)/3, "copy")
		gatherCase[collective.Float16](t, cs, 3, len(cs)-1, "nil")
	})
}

// rootedCases runs check, a fixed-count rooted call's case, in worlds of
// 1 to 9 ranks for vectors of several lengths n, several roots and every
// mode (copy, nil, alias), then more in the same world.
func rootedCases(t *testing.T, check func(t *testing.T, cs []*collective.Comm, n, root int, mode string), more func(t *testing.T, cs []*collective.Comm)) {
	for _, p := range []int{1, 2, 3, 4, 5, 6, 7, 8, 9} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			for _, n := range []int{0, 1, 13, 9973} {
				for _, root := range []int{0, p / 2, p - 1} {
					for _, mode := range []string{"copy", "nil", "alias"} {
						t.Run(fmt.Sprintf("n=%d/root=%d/%s", n, root, mode), func(t *testing.T) {
							check(t, cs, n, root, mode)
						})
					}
				}
			}
			more(t, cs)
		})
	}
}

func gatherCase[T collective.Number](t *testing.T, cs []*collective.Comm, n, root int, mode string) {
	t.Helper()
	p := len(cs)
	var recv []T
	noErrors(t, "gather", parallel(p, func(r int) error {
		send := fill[T](r, n)
		if r != root {
			return collective.Gather(testCtx(t), cs[r], send, nil, root)
		}
		recv = make([]T, p*n)
		switch mode {
		case "nil":
			copy(recv[r*n:], send)
			send = nil
		case "alias":
			copy(recv[r*n:], send)
			send = recv[r*n : (r+1)*n]
		}
		return collective.Gather(testCtx(t), cs[r], send, recv, root)
	}))
	for r := range p {
		if i := equal(recv[r*n:(r+1)*n], fill[T](r, n)); i != -1 {
			t.Fatalf("rank %d's block: element %d = %v", r, i, recv[r*n+i])
		}
	}
}

func TestGatherv(t *testing.T) {
	rootedVCases(t, func(t *testing.T, cs []*collective.Comm, counts, displs []int, n, root int, where string) {
		p := len(cs)
		for _, inPlace := range []bool{false, true} {
			recv := make([]int16, n)
			for i := range recv {
				recv[i] = -1
			}
			noErrors(t, "gatherv", parallel(p, func(r int) error {
				send := fill[int16](r, counts[r])
				if r != root {
					return collective.Gatherv(testCtx(t), cs[r], send, nil, nil, nil, root)
				}
				if inPlace {
					copy(recv[displs[r]:], send)
					send = nil
				}
				return collective.Gatherv(testCtx(t), cs[r], send, recv, counts, displs, root)
			}))
			for r := range p {
				if i := equal(recv[displs[r]:displs[r]+counts[r]], fill[int16](r, counts[r])); i != -1 {
					t.Fatalf("%s: rank %d's block: element %d", where, r, i)
				}
				if recv[displs[r]-1] != -1 {
					t.Fatalf("the gap before rank %d's block was written", r)
				}
			}
		}
	})
}

// rootedVCases runs check, a v-variant rooted call's case, in worlds of
// 1 to 9 ranks for the blocks of vlayout (counts, displs, in a buffer of
// n elements; two scales, in rank order and reversed) and two roots;
// where names the case.
func rootedVCases(t *testing.T, check func(t *testing.T, cs []*collective.Comm, counts, displs []int, n, root int, where string)) {
	for _, p := range []int{1, 2, 3, 5, 8, 9} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096})
			for _, scale := range []int{1, 3001} {
				for _, reverse := range []bool{false, true} {
					for _, root := range []int{0, p - 1} {
						counts, displs, n := vlayout(p, scale, reverse)
						check(t, cs, counts, displs, n, root, fmt.Sprintf("scale %d reverse %v root %d", scale, reverse, root))
					}
				}
			}
		})
	}
}

func TestScatter(t *testing.T) {
	rootedCases(t, scatterCase[uint32], func(t *testing.T, cs []*collective.Comm) {
		scatterCase[float32](t, cs, 20011, len(cs)/3, "copy")
		scatterCase[int8](t, cs, 5, len(cs)-1, "nil")
	})
}

func scatterCase[T collective.Number](t *testing.T, cs []*collective.Comm, n, root int, mode string) {
	t.Helper()
	p := len(cs)
	all := fill[T](root+50, p*n)
	recvs := make([][]T, p)
	noErrors(t, "scatter", parallel(p, func(r int) error {
		if r != root {
			recvs[r] = make([]T, n)
			return collective.Scatter(testCtx(t), cs[r], nil, recvs[r], root)
		}
		send := append([]T(nil), all...)
		switch mode {
		case "copy":
			recvs[r] = make([]T, n)
		case "nil":
			recvs[r] = send[r*n : (r+1)*n]
			return collective.Scatter(testCtx(t), cs[r], send, nil, root)
		case "alias":
			recvs[r] = send[r*n : (r+1)*n]
		}
		return collective.Scatter(testCtx(t), cs[r], send, recvs[r], root)
	}))
	for r := range p {
		if i := equal(recvs[r], all[r*n:(r+1)*n]); i != -1 {
			t.Fatalf("rank %d: element %d = %v", r, i, recvs[r][i])
		}
	}
}

func TestScatterv(t *testing.T) {
	rootedVCases(t, func(t *testing.T, cs []*collective.Comm, counts, displs []int, n, root int, where string) {
		p := len(cs)
		send := fill[float64](root, n)
		recvs := make([][]float64, p)
		noErrors(t, "scatterv", parallel(p, func(r int) error {
			recvs[r] = make([]float64, counts[r])
			if r != root {
				return collective.Scatterv(testCtx(t), cs[r], nil, nil, nil, recvs[r], root)
			}
			return collective.Scatterv(testCtx(t), cs[r], send, counts, displs, recvs[r], root)
		}))
		for r := range p {
			if i := equal(recvs[r], send[displs[r]:displs[r]+counts[r]]); i != -1 {
				t.Fatalf("%s: rank %d: element %d", where, r, i)
			}
		}
	})
}

func TestGatherScatterArgs(t *testing.T) {
	const p = 4
	cs := world(t, p, collective.Options{})
	buf := make([]int32, 40)
	cases := []struct {
		name string
		call func(r int) error
	}{
		{"gather/root", func(r int) error { return collective.Gather(testCtx(t), cs[r], make([]int32, 2), make([]int32, 8), p) }},
		{"scatter/root", func(r int) error {
			return collective.Scatter(testCtx(t), cs[r], make([]int32, 8), make([]int32, 2), -3)
		}},
		{"gatherv/root", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], make([]int32, 2), nil, nil, nil, 1<<33)
		}},
		{"scatterv/root", func(r int) error {
			return collective.Scatterv(testCtx(t), cs[r], nil, nil, nil, make([]int32, 2), p+1)
		}},
		// Every rank its own root with bad buffers: each fails alone.
		{"gather/recv", func(r int) error { return collective.Gather(testCtx(t), cs[r], make([]int32, 2), make([]int32, 7), r) }},
		{"gather/overlap", func(r int) error { return collective.Gather(testCtx(t), cs[r], buf[1:3], buf[:8], r) }},
		{"scatter/send", func(r int) error { return collective.Scatter(testCtx(t), cs[r], make([]int32, 9), make([]int32, 2), r) }},
		{"scatter/overlap", func(r int) error { return collective.Scatter(testCtx(t), cs[r], buf[:8], buf[7:9], r) }},
		{"gatherv/counts", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], nil, buf, []int{1, 1, 1}, []int{0, 1, 2}, r)
		}},
		{"gatherv/outside", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], nil, buf, []int{1, 1, 1, 2}, []int{0, 1, 2, 39}, r)
		}},
		{"gatherv/negative", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], nil, buf, []int{1, -1, 1, 2}, []int{0, 1, 2, 3}, r)
		}},
		{"gatherv/blocks overlap", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], nil, buf, []int{2, 2, 2, 2}, []int{0, 2, 5, 3}, r)
		}},
		{"gatherv/send length", func(r int) error {
			return collective.Gatherv(testCtx(t), cs[r], make([]int32, 3), buf, []int{2, 2, 2, 2}, []int{0, 2, 4, 6}, r)
		}},
		{"scatterv/outside", func(r int) error {
			return collective.Scatterv(testCtx(t), cs[r], buf, []int{1, 1, 1, 1 << 62}, []int{0, 1, 2, 3}, nil, r)
		}},
		{"scatterv/recv length", func(r int) error {
			return collective.Scatterv(testCtx(t), cs[r], buf, []int{1, 1, 1, 1}, []int{0, 1, 2, 3}, make([]int32, 2), r)
		}},
	}
	// From "gather/recv" on, every rank is its own root and finds its
	// arguments bad after the call took its turn: each gives the call up
	// (its peers could not have seen the arguments), which poisons the
	// communicator; those cases get a world each, and the one before
	// them (arguments every rank rejects alike, nothing sent) must stay
	// usable.
	ownRoot := false
	for _, tc := range cases {
		if tc.name == "gather/recv" {
			gatherCase[int32](t, cs, 3, 2, "copy")
			scatterCase[int32](t, cs, 3, 1, "copy")
			ownRoot = true
		}
		if ownRoot {
			cs = world(t, p, collective.Options{})
		}
		errs := parallel(p, tc.call)
		for r, err := range errs {
			if !errors.Is(err, collective.ErrArgs) {
				t.Fatalf("%s: rank %d: %v, want ErrArgs", tc.name, r, err)
			}
		}
		if ownRoot {
			for r, err := range parallel(p, func(r int) error { return collective.Barrier(testCtx(t), cs[r]) }) {
				if !errors.Is(err, collective.ErrPoisoned) || !errors.Is(err, collective.ErrArgs) {
					t.Fatalf("%s: rank %d: barrier after the call: %v, want ErrPoisoned wrapping ErrArgs", tc.name, r, err)
				}
			}
		}
	}
}

// TestRootArgsThenMismatch: only the root's arguments are bad; the other
// ranks' sends fit in the root's windows, so their calls may complete
// before they see that the root gave the call up (rootArgs). The root's
// next call must not take their stale chunks for the new call's data:
// it fails (the communicator is poisoned since the root aborted: before
// that, it failed with ErrMismatch, its call's sequence number having
// advanced), never returns the old vectors as the new ones; the other
// ranks' next calls fail or complete unseen, never with the root's data.
func TestRootArgsThenMismatch(t *testing.T) {
	const p = 3
	cs := world(t, p, collective.Options{Timeout: mismatchTimeout})
	errs := parallel(p, func(r int) error {
		if r == 0 {
			return collective.Gather(testCtx(t), cs[r], make([]int64, 2), make([]int64, 5), 0)
		}
		return collective.Gather(testCtx(t), cs[r], fill[int64](r, 2), nil, 0)
	})
	if !errors.Is(errs[0], collective.ErrArgs) {
		t.Fatalf("first gather: %v, want ErrArgs at the root", errs)
	}
	for r := 1; r < p; r++ {
		if errs[r] != nil && (!errors.Is(errs[r], collective.ErrPeerAborted) || !errors.Is(errs[r], collective.ErrArgs)) {
			t.Fatalf("first gather at rank %d: %v, want success or ErrPeerAborted wrapping ErrArgs", r, errs[r])
		}
	}
	recv := make([]int64, 2*p)
	errs = parallel(p, func(r int) error {
		if r == 0 {
			return collective.Gather(testCtx(t), cs[r], fill[int64](100, 2), recv, 0)
		}
		return collective.Gather(testCtx(t), cs[r], fill[int64](100+r, 2), nil, 0)
	})
	if !errors.Is(errs[0], collective.ErrPoisoned) && !errors.Is(errs[0], collective.ErrMismatch) {
		t.Fatalf("second gather at the root: %v (recv %v), want ErrPoisoned or ErrMismatch", errs[0], recv)
	}
	for r := 1; r < p; r++ {
		var ce *collective.Error
		if errs[r] != nil && !errors.As(errs[r], &ce) {
			t.Errorf("second gather at rank %d: %v", r, errs[r])
		}
	}
}

func TestGatherScatterMismatch(t *testing.T) {
	const p = 4
	cases := []struct {
		name string
		call func(cs []*collective.Comm, r int) error
	}{
		{"gather/count", func(cs []*collective.Comm, r int) error {
			return collective.Gather(testCtx(t), cs[r], make([]int32, 3+r/3), make([]int32, p*3), 0)
		}},
		{"gather/root", func(cs []*collective.Comm, r int) error {
			return collective.Gather(testCtx(t), cs[r], make([]int32, 3), make([]int32, p*3), r/2)
		}},
		{"gatherv/length", func(cs []*collective.Comm, r int) error {
			return collective.Gatherv(testCtx(t), cs[r], make([]int32, 2+r/3), make([]int32, 8), []int{2, 2, 2, 2}, []int{0, 2, 4, 6}, 0)
		}},
		{"scatter/count", func(cs []*collective.Comm, r int) error {
			return collective.Scatter(testCtx(t), cs[r], make([]uint8, 4*p), make([]uint8, 4+r/3), 2)
		}},
		{"scatterv/length", func(cs []*collective.Comm, r int) error {
			return collective.Scatterv(testCtx(t), cs[r], make([]uint8, 8), []int{2, 2, 2, 2}, []int{0, 2, 4, 6}, make([]uint8, 2+r/2), 0)
		}},
		{"gather/scatter", func(cs []*collective.Comm, r int) error {
			if r == 3 {
				return collective.Scatter(testCtx(t), cs[r], make([]int32, 3*p), make([]int32, 3), 0)
			}
			return collective.Gather(testCtx(t), cs[r], make([]int32, 3), make([]int32, 3*p), 0)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, p, collective.Options{Timeout: mismatchTimeout})
			mismatchOutcome(t, cs, parallel(p, func(r int) error { return tc.call(cs, r) }))
		})
	}
}
