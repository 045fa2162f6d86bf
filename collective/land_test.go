package collective_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestAllreduceLandsInBuffers: in the ring allreduce, a rank whose
// result goes into a Buffer announces it, and its left neighbour writes
// the allgather's blocks straight into it (chunks counted by Landed):
// worlds of 2 to 5 ranks, the ranks of even rank with Buffers and the
// others with Go memory (so landed and windowed allgathers meet in one
// call), in place and out of place (send in Go memory), with a count
// that splits in uneven blocks of several chunks, and on a communicator
// made by Split. Every rank gets the reference sum; a Buffer rank
// received every allgather chunk in place, a Go memory rank none.
func TestAllreduceLandsInBuffers(t *testing.T) {
	const n = 3<<18 + 7 // 3 MiB of int32 and a bit: several 1 MiB chunks
	for _, p := range []int{2, 3, 4, 5} {
		t.Run(name("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{Algorithm: collective.AlgRing})
			bs := allocAll[int32](t, cs, n)
			recv := make([][]int32, p)
			for r := range p {
				recv[r] = make([]int32, n)
				if r%2 == 0 {
					recv[r] = bs[r].Slice()
				}
			}
			want := make([]int32, n)
			for r := range p {
				for i, v := range fill[int32](r, n) {
					want[i] += v
				}
			}
			for _, inPlace := range []bool{true, false} {
				before := make([]uint64, p)
				for r := range p {
					before[r] = collective.Landed(cs[r])
				}
				noErrors(t, "allreduce", parallel(p, func(r int) error {
					if inPlace {
						copy(recv[r], fill[int32](r, n))
						return collective.Allreduce(testCtx(t), cs[r], nil, recv[r], collective.Sum)
					}
					clear(recv[r])
					return collective.Allreduce(testCtx(t), cs[r], fill[int32](r, n), recv[r], collective.Sum)
				}))
				for r := range p {
					if i := equal(recv[r], want); i != -1 {
						t.Fatalf("in place %v: rank %d: element %d = %d, want %d", inPlace, r, i, recv[r][i], want[i])
					}
					landed := collective.Landed(cs[r]) - before[r]
					if r%2 == 0 && landed == 0 {
						t.Errorf("in place %v: rank %d (Buffer) received no chunk in place", inPlace, r)
					}
					if r%2 == 1 && landed != 0 {
						t.Errorf("in place %v: rank %d (Go memory) received %d chunks in place", inPlace, r, landed)
					}
				}
			}
			// A communicator made by Split lands in the same Buffers.
			subs := make([]*collective.Comm, p)
			noErrors(t, "split", parallel(p, func(r int) (err error) {
				subs[r], err = cs[r].Split(testCtx(t), 0, p-1-r) // reversed: other neighbours
				return err
			}))
			t.Cleanup(func() { closeAll(t, subs) })
			noErrors(t, "allreduce on the split", parallel(p, func(r int) error {
				copy(bs[r].Slice(), fill[int32](r, n))
				return collective.Allreduce(testCtx(t), subs[r], nil, bs[r].Slice(), collective.Sum)
			}))
			for r := range p {
				if i := equal(bs[r].Slice(), want); i != -1 {
					t.Fatalf("split: rank %d: element %d = %d, want %d", r, i, bs[r].Slice()[i], want[i])
				}
				if collective.Landed(subs[r]) == 0 {
					t.Errorf("split: rank %d received no chunk in place", r)
				}
			}
		})
	}
}

// landChild is a rank of TestAllreduceLandsCrossProcess: with the
// default options (1 MiB chunks: soft0 shares the windows with the peer
// processes), the ranks of even rank in a Buffer and the others in Go
// memory, it runs three ring allreduces of landCount int32 in place,
// checks the sums, and prints "landed N" (the chunks it received in
// place) and "done". A failure prints "error: ...".
func landChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), xGuard)
	defer cancel()
	fail := func(format string, args ...any) int {
		fmt.Printf("error: "+format+"\n", args...)
		return 1
	}
	node, err := xJoin(ctx)
	if err != nil {
		return fail("join: %v", err)
	}
	defer node.Close()
	c, err := collective.New(ctx, node, collective.Options{Algorithm: collective.AlgRing})
	if err != nil {
		return fail("new: %v", err)
	}
	defer c.Close()
	r, p := c.Rank(), c.Size()
	v := make([]int32, landCount)
	if r%2 == 0 {
		b, err := collective.Alloc[int32](c, landCount)
		if err != nil {
			return fail("alloc: %v", err)
		}
		defer b.Close()
		v = b.Slice()
	}
	for k := range 3 {
		for i := range v {
			v[i] = int32(i*7 + r*k + r)
		}
		if err := collective.Allreduce(ctx, c, nil, v, collective.Sum); err != nil {
			return fail("allreduce %d: %v", k, err)
		}
		for i, got := range v {
			want := int32(0)
			for q := range p {
				want += int32(i*7 + q*k + q)
			}
			if got != want {
				return fail("allreduce %d: element %d is %d, want %d", k, i, got, want)
			}
		}
	}
	fmt.Printf("landed %d\n", collective.Landed(c))
	fmt.Println("done")
	return 0
}

// landCount is the vector of TestAllreduceLandsCrossProcess: 5 MiB and a
// bit of int32, several chunks per block of the ring.
const landCount = 5<<18 + 3

// TestAllreduceLandsCrossProcess: the landing allgather across processes
// over every soft0 transport (over shared memory, the writes into the
// windows and the Buffers are direct copies), worlds of 2 to 4 ranks
// mixing Buffers and Go memory: every rank gets the right sums, every
// Buffer rank received chunks in place and no Go memory rank did.
func TestAllreduceLandsCrossProcess(t *testing.T) {
	for _, tr := range []string{"shm", "unix", "tcp"} {
		for _, n := range []int{2, 3, 4} {
			t.Run(fmt.Sprintf("%s/%d", tr, n), func(t *testing.T) {
				for r, rr := range xprocWorld(t, "land", tr, n) {
					if rr.err != nil || !rr.done {
						t.Errorf("rank %d: exit %v, done %v:\n%s", r, rr.err, rr.done, rr.out)
						continue
					}
					var landed int
					if _, err := fmt.Sscanf(rr.out[strings.Index(rr.out, "landed "):], "landed %d", &landed); err != nil {
						t.Errorf("rank %d: no landed count: %v:\n%s", r, err, rr.out)
					}
					if r%2 == 0 && landed == 0 || r%2 == 1 && landed != 0 {
						t.Errorf("rank %d (Buffer: %v) received %d chunks in place", r, r%2 == 0, landed)
					}
				}
			})
		}
	}
}
