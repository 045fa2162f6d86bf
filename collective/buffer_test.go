package collective_test

import (
	"context"
	"errors"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// allocAll allocates a Buffer of n elements at every rank of cs, closed
// at the end of the test.
func allocAll[T collective.Number](t *testing.T, cs []*collective.Comm, n int) []*collective.Buffer[T] {
	t.Helper()
	bs := make([]*collective.Buffer[T], len(cs))
	for r, c := range cs {
		b, err := collective.Alloc[T](c, n)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Slice()) != n {
			t.Fatalf("Alloc(%d): %d elements", n, len(b.Slice()))
		}
		t.Cleanup(func() {
			if err := b.Close(); err != nil {
				t.Errorf("close buffer: %v", err)
			}
		})
		bs[r] = b
	}
	return bs
}

// TestBufferCollectives: collectives whose data lies in Buffers send it
// from there (chunks counted by ZeroCopied) and give the same results as
// from Go memory: allreduce in place and out of place with every
// algorithm, broadcast from every root, allgather, on worlds of 2 to 4
// ranks, also on a communicator made by Split.
func TestBufferCollectives(t *testing.T) {
	const n = 3*65536 + 17 // 768 KiB of int32: several chunks, uneven parts
	for _, p := range []int{2, 3, 4} {
		for _, alg := range []collective.Algorithm{collective.AlgAuto, collective.AlgRabenseifner, collective.AlgRing} {
			t.Run(name("p=%d/%v", p, alg), func(t *testing.T) {
				cs := world(t, p, collective.Options{Algorithm: alg})
				bs := allocAll[int32](t, cs, n)
				zc := func() uint64 {
					var s uint64
					for _, c := range cs {
						s += collective.ZeroCopied(c)
					}
					return s
				}
				want := make([]int32, n)
				for r := range p {
					for i, v := range fill[int32](r, n) {
						want[i] += v
					}
				}
				check := func(what string, got func(r int) []int32, want []int32) {
					t.Helper()
					for r := range p {
						if i := equal(got(r), want); i != -1 {
							t.Fatalf("%s: rank %d: element %d = %v, want %v", what, r, i, got(r)[i], want[i])
						}
					}
				}
				before := zc()
				noErrors(t, "allreduce in place", parallel(p, func(r int) error {
					copy(bs[r].Slice(), fill[int32](r, n))
					return collective.Allreduce(testCtx(t), cs[r], nil, bs[r].Slice(), collective.Sum)
				}))
				check("allreduce in place", func(r int) []int32 { return bs[r].Slice() }, want)
				noErrors(t, "allreduce out of place", parallel(p, func(r int) error {
					clear(bs[r].Slice())
					return collective.Allreduce(testCtx(t), cs[r], fill[int32](r, n), bs[r].Slice(), collective.Sum)
				}))
				check("allreduce out of place", func(r int) []int32 { return bs[r].Slice() }, want)
				for root := range p {
					noErrors(t, "broadcast", parallel(p, func(r int) error {
						copy(bs[r].Slice(), fill[int32](r+10*root, n))
						return collective.Broadcast(testCtx(t), cs[r], bs[r].Slice(), root)
					}))
					check(name("broadcast from %d", root), func(r int) []int32 { return bs[r].Slice() }, fill[int32](root+10*root, n))
				}
				part := n / p
				noErrors(t, "allgather", parallel(p, func(r int) error {
					copy(bs[r].Slice()[r*part:], fill[int32](r, part))
					return collective.Allgather(testCtx(t), cs[r], nil, bs[r].Slice()[:p*part])
				}))
				var all []int32
				for r := range p {
					all = append(all, fill[int32](r, part)...)
				}
				check("allgather", func(r int) []int32 { return bs[r].Slice()[:p*part] }, all)
				if zc() == before {
					t.Fatal("no chunk was sent from a Buffer")
				}
				// A communicator made from this one uses the Buffers too.
				subs := make([]*collective.Comm, p)
				noErrors(t, "dup", parallel(p, func(r int) (err error) {
					subs[r], err = cs[r].Dup(testCtx(t))
					return err
				}))
				t.Cleanup(func() { closeAll(t, subs) })
				noErrors(t, "allreduce on the dup", parallel(p, func(r int) error {
					copy(bs[r].Slice(), fill[int32](r, n))
					return collective.Allreduce(testCtx(t), subs[r], nil, bs[r].Slice(), collective.Sum)
				}))
				check("allreduce on the dup", func(r int) []int32 { return bs[r].Slice() }, want)
				var subZC uint64
				for _, s := range subs {
					subZC += collective.ZeroCopied(s)
				}
				if subZC == 0 {
					t.Fatal("the dup sent no chunk from a Buffer")
				}
			})
		}
	}
}

// TestBufferReusedAtReturn: a call that sends from a Buffer returns only
// once the writes reading it were executed: the root of a broadcast
// overwrites its Buffer the moment its call returns, and every other
// rank still receives what the root broadcast. (The root's call is done
// when its last chunk is posted; soft0 copies the data of a large write
// over shared memory later, when the peer has acknowledged the request.)
func TestBufferReusedAtReturn(t *testing.T) {
	const n = 1 << 18 // 1 MiB of int32
	for _, p := range []int{2, 3} {
		t.Run(name("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{})
			bs := allocAll[int32](t, cs, n)
			for round := range 20 {
				root := round % p
				want := fill[int32](root+round, n)
				noErrors(t, "broadcast", parallel(p, func(r int) error {
					if r == root {
						copy(bs[r].Slice(), want)
					} else {
						clear(bs[r].Slice())
					}
					err := collective.Broadcast(testCtx(t), cs[r], bs[r].Slice(), root)
					if r == root {
						for i := range bs[r].Slice() {
							bs[r].Slice()[i] = -1
						}
					}
					return err
				}))
				for r := range p {
					if r == root {
						continue
					}
					if i := equal(bs[r].Slice(), want); i != -1 {
						t.Fatalf("round %d: rank %d: element %d = %d, want %d (the root changed its buffer after its call returned)",
							round, r, i, bs[r].Slice()[i], want[i])
					}
				}
			}
			if collective.ZeroCopied(cs[0]) == 0 {
				t.Fatal("no chunk was sent from a Buffer")
			}
		})
	}
}

// TestBufferClose: Close refuses a Buffer a call uses, frees it
// otherwise (twice is harmless); Alloc refuses a negative count.
func TestBufferClose(t *testing.T) {
	cs := world(t, 1, collective.Options{})
	b, err := collective.Alloc[float64](cs[0], 1000)
	if err != nil {
		t.Fatal(err)
	}
	release := collective.HoldBuffer(b)
	if err := b.Close(); !errors.Is(err, collective.ErrBufferBusy) {
		t.Fatalf("close of a buffer in use: %v, want ErrBufferBusy", err)
	}
	release()
	if err := b.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if b.Slice() != nil {
		t.Fatal("Slice after Close is not nil")
	}
	if _, err := collective.Alloc[int8](cs[0], -1); !errors.Is(err, collective.ErrArgs) {
		t.Fatalf("Alloc(-1): %v, want ErrArgs", err)
	}
}

// TestBufferHotPathAllocatesNothing: a warmed-up allreduce and broadcast
// sending from Buffers allocate nothing.
func TestBufferHotPathAllocatesNothing(t *testing.T) {
	const p, n = 2, 1 << 17
	for _, alg := range []collective.Algorithm{collective.AlgRing, collective.AlgRabenseifner} {
		cs := world(t, p, collective.Options{Algorithm: alg})
		bs := allocAll[float32](t, cs, n)
		for _, tc := range []struct {
			name string
			call func(ctx context.Context, c *collective.Comm, r int) error
		}{
			{"allreduce", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Allreduce(ctx, c, nil, bs[r].Slice(), collective.Max)
			}},
			{"broadcast", func(ctx context.Context, c *collective.Comm, r int) error {
				return collective.Broadcast(ctx, c, bs[r].Slice(), 0)
			}},
		} {
			t.Run(name("%v/%s", alg, tc.name), func(t *testing.T) {
				before := collective.ZeroCopied(cs[0]) + collective.ZeroCopied(cs[1])
				if a := allocsPerCall(t, cs, tc.call); a > 0 {
					t.Errorf("%.2f allocations per call, want 0", a)
				}
				if collective.ZeroCopied(cs[0])+collective.ZeroCopied(cs[1]) == before {
					t.Fatal("no chunk was sent from a Buffer")
				}
			})
		}
	}
}
