package channel_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// rank is one member of an in-process group for MultiChannel tests.
type rank struct {
	t   testing.TB
	id  int
	dev *verbs.Context
	pd  *verbs.ProtectionDomain
	mc  *channel.MultiChannel
	buf *verbs.MemoryRegion
}

// sge returns the SGE of n bytes at off of r.buf, or fails the test.
func (r *rank) sge(off, n int) verbs.SGE { return verbstest.SGE(r.t, r.buf, off, n) }

// newGroup builds n ranks, each with its own device context, and connects
// every pair.
func newGroup(t *testing.T, n int) []*rank {
	t.Helper()
	verbstest.CheckLeaks(t)
	rs := make([]*rank, n)
	for i := range rs {
		r := &rank{t: t, id: i}
		var err error
		if r.dev, err = verbs.Open(verbs.SoftDevice); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeOrFail(t, "device", r.dev.Close) })
		if r.pd, err = r.dev.AllocPD(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeOrFail(t, "pd", r.pd.Close) })
		if r.buf, err = r.pd.Alloc(64<<10, verbs.AccessRemoteAll); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeOrFail(t, "mr", r.buf.Close) })
		if r.mc, err = channel.NewMulti(r.pd, n, i, channel.Options{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { closeOrFail(t, "multichannel", r.mc.Close) })
		rs[i] = r
	}
	eps := make([][]verbs.Endpoint, n)
	for i, r := range rs {
		var err error
		if eps[i], err = r.mc.Endpoints(); err != nil {
			t.Fatal(err)
		}
	}
	for i, r := range rs {
		mine := make([]verbs.Endpoint, n)
		for j := range n {
			mine[j] = eps[j][i] // what peer j created for rank i
		}
		if err := r.mc.Connect(mine); err != nil {
			t.Fatal(err)
		}
	}
	return rs
}

// forAll runs f for every rank concurrently.
func forAll(t *testing.T, rs []*rank, f func(r *rank) error) {
	t.Helper()
	var wg sync.WaitGroup
	for _, r := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(r); err != nil {
				t.Errorf("rank %d: %v", r.id, err)
			}
		}()
	}
	wg.Wait()
}

func TestMultiChannelCollectives(t *testing.T) {
	const n = 4
	rs := newGroup(t, n)
	ctx := testCtx(t)
	regions := make([]verbs.RemoteRegion, n)
	for i, r := range rs {
		regions[i] = r.buf.Remote()
	}

	t.Run("scatter write", func(t *testing.T) {
		// Rank i writes i*10+j into slot i of rank j.
		forAll(t, rs, func(r *rank) error {
			dsts := make([]verbs.RemoteAddr, n)
			bufs := make([]verbs.SGE, n)
			for j := range n {
				binary.NativeEndian.PutUint64(r.buf.Bytes()[8*j:], uint64(r.id*10+j))
				dsts[j] = regions[j].At(uint64(1024 + 8*r.id))
				bufs[j] = r.sge(8*j, 8)
			}
			return r.mc.ScatterWrite(ctx, nil, dsts, bufs)
		})
		for j, r := range rs {
			for i := range n {
				if i == j {
					continue
				}
				if got := binary.NativeEndian.Uint64(r.buf.Bytes()[1024+8*i:]); got != uint64(i*10+j) {
					t.Errorf("rank %d slot %d = %d, want %d", j, i, got, i*10+j)
				}
			}
		}
	})

	t.Run("gather read", func(t *testing.T) {
		forAll(t, rs, func(r *rank) error {
			binary.NativeEndian.PutUint64(r.buf.Bytes()[2048:], uint64(100+r.id))
			return nil
		})
		forAll(t, rs, func(r *rank) error {
			peers := r.mc.Peers()
			srcs := make([]verbs.RemoteAddr, len(peers))
			bufs := make([]verbs.SGE, len(peers))
			for k, p := range peers {
				srcs[k] = regions[p].At(2048)
				bufs[k] = r.sge(3072+8*p, 8)
			}
			if err := r.mc.GatherRead(ctx, peers, srcs, bufs); err != nil {
				return err
			}
			for _, p := range peers {
				if got := binary.NativeEndian.Uint64(r.buf.Bytes()[3072+8*p:]); got != uint64(100+p) {
					return fmt.Errorf("read %d from peer %d", got, p)
				}
			}
			return nil
		})
	})

	t.Run("scatter send and gather receive", func(t *testing.T) {
		forAll(t, rs, func(r *rank) error {
			bufs := make([]verbs.SGE, n)
			for j := range n {
				binary.NativeEndian.PutUint64(r.buf.Bytes()[4096+8*j:], uint64(1000*r.id+j))
				bufs[j] = r.sge(4096+8*j, 8)
			}
			recv := make([]verbs.SGE, n)
			for j := range n {
				recv[j] = r.sge(5120+64*j, 64)
			}
			got := make([]channel.Received, n)
			errc := make(chan error, 1)
			go func() { errc <- r.mc.GatherReceive(ctx, nil, recv, got) }()
			if err := r.mc.ScatterSend(ctx, nil, bufs); err != nil {
				return err
			}
			if err := <-errc; err != nil {
				return err
			}
			for j := range n {
				if j == r.id {
					continue
				}
				if v := binary.NativeEndian.Uint64(r.buf.Bytes()[5120+64*j:]); got[j].Len != 8 || v != uint64(1000*j+r.id) {
					return fmt.Errorf("from peer %d: %+v value %d", j, got[j], v)
				}
			}
			return nil
		})
	})

	t.Run("multicast send", func(t *testing.T) {
		root := rs[0]
		copy(root.buf.Bytes()[8192:], "to everyone")
		errs := make(chan error, n)
		for _, r := range rs[1:] {
			go func() {
				_, err := r.mc.Peer(0).Receive(ctx, r.sge(9000, 64))
				errs <- err
			}()
		}
		if err := root.mc.MulticastSend(ctx, nil, root.sge(8192, 11)); err != nil {
			t.Fatal(err)
		}
		for range n - 1 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		for _, r := range rs[1:] {
			if got := string(r.buf.Bytes()[9000:9011]); got != "to everyone" {
				t.Errorf("rank %d got %q", r.id, got)
			}
		}
	})

	t.Run("peer-indexed batch", func(t *testing.T) {
		// Every rank fetch-and-adds a counter on every other rank.
		forAll(t, rs, func(r *rank) error {
			return r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
				for _, p := range r.mc.Peers() {
					b.Peer(p).FetchAdd(regions[p].At(12288), 1)
				}
				return b.WaitAll()
			})
		})
		for _, r := range rs {
			if got := binary.NativeEndian.Uint64(r.buf.Bytes()[12288:]); got != n-1 {
				t.Errorf("rank %d counter = %d, want %d", r.id, got, n-1)
			}
		}
	})
}

func TestMultiChannelBadInput(t *testing.T) {
	rs := newGroup(t, 3)
	ctx := testCtx(t)
	r := rs[1]
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"self", r.mc.Peer(1).Write(ctx, rs[0].buf.Remote().At(0), r.sge(0, 1))},
		{"negative peer", r.mc.Peer(-1).Write(ctx, rs[0].buf.Remote().At(0), r.sge(0, 1))},
		{"peer out of range", r.mc.Peer(3).Send(ctx, r.sge(0, 1))},
		{"scatter to self", r.mc.ScatterWrite(ctx, []int{1}, []verbs.RemoteAddr{{}}, []verbs.SGE{{}})},
		{"batch to self", r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
			return b.Wait(b.Peer(1).Send(r.sge(0, 1)))
		})},
		{"batch to nobody", r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
			b.Peer(7).Send(r.sge(0, 1))
			return nil
		})},
	} {
		if !errors.Is(tc.err, channel.ErrNoPeer) {
			t.Errorf("%s: %v, want ErrNoPeer", tc.name, tc.err)
		}
	}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"argument count", r.mc.ScatterWrite(ctx, nil, make([]verbs.RemoteAddr, 2), make([]verbs.SGE, 2))},
		{"mismatched lists", r.mc.GatherRead(ctx, []int{0}, make([]verbs.RemoteAddr, 1), make([]verbs.SGE, 2))},
		{"results", r.mc.GatherReceive(ctx, nil, make([]verbs.SGE, 3), make([]channel.Received, 1))},
		{"connect", r.mc.Connect(nil)},
	} {
		if tc.err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	if _, err := channel.NewMulti(r.pd, 0, -1, channel.Options{}); err == nil {
		t.Error("NewMulti with 0 peers succeeded")
	}
	if _, err := channel.NewMulti(r.pd, 2, 2, channel.Options{}); err == nil {
		t.Error("NewMulti with self out of range succeeded")
	}
	if got := r.mc.Peers(); fmt.Sprint(got) != "[0 2]" || r.mc.Len() != 3 || r.mc.Self() != 1 {
		t.Errorf("Peers %v Len %d Self %d", got, r.mc.Len(), r.mc.Self())
	}
	if err := r.mc.Err(); err != nil {
		t.Errorf("Err() = %v", err)
	}
}

func TestMultiChannelOneRegistrationServesAll(t *testing.T) {
	rs := newGroup(t, 3)
	ctx := testCtx(t)
	r := rs[0]
	// The same SGE (one MR of one PD) written to both peers.
	copy(r.buf.Bytes(), "shared")
	for _, p := range r.mc.Peers() {
		if err := r.mc.Peer(p).Write(ctx, rs[p].buf.Remote().At(0), r.sge(0, 6)); err != nil {
			t.Fatal(err)
		}
		if got := string(rs[p].buf.Bytes()[:6]); got != "shared" {
			t.Errorf("peer %d got %q", p, got)
		}
	}
	if r.mc.PD() != r.pd {
		t.Error("PD() is not the PD of the multichannel")
	}
	if err := r.mc.Drain(ctx); err != nil {
		t.Error(err)
	}
}

// TestMultiChannelConcurrentPeers: on every rank, one goroutine per peer
// runs blocking atomics and batches against that peer while the others do
// the same, all completions arriving on the one shared CQ; the counters
// must add up exactly.
func TestMultiChannelConcurrentPeers(t *testing.T) {
	const n, rounds = 4, 100
	rs := newGroup(t, n)
	ctx := testCtx(t)
	var wg sync.WaitGroup
	for _, r := range rs {
		for _, p := range r.mc.Peers() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ch := r.mc.Peer(p)
				counter := rs[p].buf.Remote().At(uint64(16384 + 8*r.id)) // one word per writer
				for i := range rounds {
					if i%2 == 0 {
						if _, err := ch.FetchAdd(ctx, counter, 1); err != nil {
							t.Errorf("rank %d to %d: %v", r.id, p, err)
							return
						}
						continue
					}
					err := r.mc.Batch(ctx, func(b *channel.MultiBatch) error {
						h := b.Peer(p).FetchAdd(counter, 2)
						return b.Wait(h)
					})
					if err != nil {
						t.Errorf("rank %d to %d (batch): %v", r.id, p, err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	for _, r := range rs {
		for j := range n {
			want := uint64(0)
			if j != r.id {
				want = rounds/2*1 + rounds/2*2
			}
			if got := binary.NativeEndian.Uint64(r.buf.Bytes()[16384+8*j:]); got != want {
				t.Errorf("rank %d counter of writer %d = %d, want %d", r.id, j, got, want)
			}
		}
	}
}

// TestMultiChannelPosted: Posted counts what was posted to a peer and may
// still be in flight: nothing at first, an unsignaled inline write until
// a signaled request retires it, and only for that peer.
func TestMultiChannelPosted(t *testing.T) {
	rs := newGroup(t, 3)
	ctx := testCtx(t)
	r := rs[0]
	if p1, p2 := r.mc.Peer(1).Posted(), r.mc.Peer(2).Posted(); p1 != 0 || p2 != 0 {
		t.Fatalf("before any request: Posted %d and %d, want 0", p1, p2)
	}
	dst := rs[1].buf.Remote().At(0)
	if err := r.mc.Peer(1).WriteInline(ctx, dst, []byte{1, 2, 3, 4, 5, 6, 7, 8}); err != nil {
		t.Fatal(err)
	}
	if p1, p2 := r.mc.Peer(1).Posted(), r.mc.Peer(2).Posted(); p1 != 1 || p2 != 0 {
		t.Fatalf("after an unsignaled write to peer 1: Posted %d and %d, want 1 and 0", p1, p2)
	}
	if err := r.mc.Peer(1).Write(ctx, dst, r.sge(0, 8)); err != nil {
		t.Fatal(err)
	}
	if p1 := r.mc.Peer(1).Posted(); p1 != 0 {
		t.Fatalf("after a signaled write retired it: Posted %d, want 0", p1)
	}
	if p := r.mc.Peer(0).Posted(); p != 0 {
		t.Fatalf("self: Posted %d, want 0", p)
	}
}

// TestZeroMultiConnect: a zero MultiChannel is as good as closed: its
// Connect fails with ErrClosed even with no endpoints (before, 0
// endpoints matched its 0 peers and Connect returned nil).
func TestZeroMultiConnect(t *testing.T) {
	var m channel.MultiChannel
	if err := m.Connect(nil); !errors.Is(err, channel.ErrClosed) {
		t.Errorf("zero MultiChannel: Connect(nil) = %v, want an error wrapping ErrClosed", err)
	}
	if err := m.Connect([]verbs.Endpoint{}); !errors.Is(err, channel.ErrClosed) {
		t.Errorf("zero MultiChannel: Connect([]) = %v, want an error wrapping ErrClosed", err)
	}
}

// TestNoPeerViewOperations: for self or an out-of-range i,
// MultiChannel.Peer returns a channel whose every operation fails with
// ErrNoPeer, as documented, the engine-wide Wait, Sleep and Progress
// too (before, they ran on the engine and returned nil).
func TestNoPeerViewOperations(t *testing.T) {
	rs := newGroup(t, 2)
	r := rs[0]
	ctx := guard(t, 20*time.Second)
	for _, i := range []int{0, -1, 2} {
		c := r.mc.Peer(i)
		if err := c.Wait(ctx, func() bool { return true }); !errors.Is(err, channel.ErrNoPeer) {
			t.Errorf("Peer(%d).Wait = %v, want ErrNoPeer", i, err)
		}
		if err := c.Sleep(ctx, func() bool { return true }); !errors.Is(err, channel.ErrNoPeer) {
			t.Errorf("Peer(%d).Sleep = %v, want ErrNoPeer", i, err)
		}
		if err := c.Progress(); !errors.Is(err, channel.ErrNoPeer) {
			t.Errorf("Peer(%d).Progress = %v, want ErrNoPeer", i, err)
		}
	}
}
