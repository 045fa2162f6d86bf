package cluster

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/verbstest"
)

// Helpers of this file are prefixed with "share".

// shareWorld builds n connected nodes in this process (NewNode, an
// in-memory exchange, Connect), closed when t ends.
func shareWorld(t testing.TB, n int, alg BarrierAlgorithm) []*Node {
	t.Helper()
	verbstest.CheckLeaks(t)
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	nodes := make([]*Node, n)
	for i := range nodes {
		dev, err := verbs.Open(verbs.SoftDevice)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "device", dev.Close) })
		pd, err := dev.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "pd", pd.Close) })
		if nodes[i], err = NewNode(pd, i, n, NodeOptions{Barrier: alg}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "node", nodes[i].Close) })
	}
	out := make([][][]byte, n)
	for i, nd := range nodes {
		var err error
		if out[i], err = nd.LocalEndpoints(nil); err != nil {
			t.Fatal(err)
		}
	}
	for i, nd := range nodes {
		in := make([][]byte, n)
		for j := range n {
			in[j] = out[j][i]
		}
		if err := nd.Connect(in); err != nil {
			t.Fatal(err)
		}
	}
	return nodes
}

// shareAll runs f on every node concurrently and returns the errors,
// indexed by rank.
func shareAll(nodes []*Node, f func(nd *Node) error) []error { return runAll(nodes, f) }

// shareLens are the lengths the contributions cycle through.
var shareLens = []int{0, 1, 7, 40, MaxShare - 1, MaxShare}

// shareData is rank's contribution to call k of a test: its length
// cycles through shareLens (different ranks, different lengths), its
// bytes depend on rank, k and the position.
func shareData(rank, k int) []byte {
	b := make([]byte, shareLens[(rank+k)%len(shareLens)])
	for i := range b {
		b[i] = byte(rank*131 + k*7 + i)
	}
	return b
}

// shareCheck checks the result of call k of a world of n.
func shareCheck(got [][]byte, n, k int) error {
	if len(got) != n {
		return fmt.Errorf("call %d: %d entries, want %d", k, len(got), n)
	}
	for j, b := range got {
		if want := shareData(j, k); !bytes.Equal(b, want) || b == nil {
			return fmt.Errorf("call %d: rank %d's entry is %d bytes %x, want %d bytes %x", k, j, len(b), b, len(want), want)
		}
	}
	return nil
}

// shareCtx is a hang guard, not a bound.
func shareCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestShare: worlds of 1, 2, 3 and 5 ranks (every barrier algorithm)
// run Shares in a row, each rank contributing a different length each
// time (0 and MaxShare included), interleaved with world barriers and
// barriers of a subgroup; every rank gets every rank's bytes, its own
// entry a copy of what it passed, and no rank leaves a Share before
// every rank has entered it.
func TestShare(t *testing.T) {
	for i, n := range []int{1, 2, 3, 5} {
		for j, alg := range barAlgorithms {
			if (i+j)%2 == 1 && n != 5 {
				continue // every size and every algorithm, not every pair
			}
			t.Run(fmt.Sprintf("%d/%s", n, strings.ReplaceAll(alg.String(), " ", "-")), func(t *testing.T) {
				nodes := shareWorld(t, n, alg)
				ctx := shareCtx(t)
				const calls = 24
				var arrived [calls]atomic.Int32
				barNoErrors(t, shareAll(nodes, func(nd *Node) error {
					r := nd.Rank()
					for k := range calls {
						data := shareData(r, k)
						arrived[k].Add(1)
						got, err := nd.Share(ctx, data)
						if err != nil {
							return fmt.Errorf("call %d: %w", k, err)
						}
						if a := arrived[k].Load(); a != int32(n) {
							return fmt.Errorf("call %d: left after %d of %d arrivals", k, a, n)
						}
						if err := shareCheck(got, n, k); err != nil {
							return err
						}
						// The own entry is a copy: the caller keeps data.
						clear(data)
						if err := shareCheck(got, n, k); err != nil {
							return fmt.Errorf("after clearing data: %w", err)
						}
						switch {
						case k%3 == 1:
							err = nd.Barrier(ctx, nil)
						case k%3 == 2 && n > 2 && r < 2:
							err = nd.Barrier(ctx, []int{0, 1})
						}
						if err != nil {
							return fmt.Errorf("barrier after call %d: %w", k, err)
						}
					}
					return nil
				}))
				for _, nd := range nodes {
					if err := nd.Channel().Err(); err != nil {
						t.Errorf("rank %d: transport broke: %v", nd.Rank(), err)
					}
				}
			})
		}
	}
}

// TestShareTooLong: a contribution over MaxShare fails at once with a
// clear error and no effect: when every rank passes one, and when one
// rank does and then calls again with a valid one (the others calling
// once), the next Share and barrier work.
func TestShareTooLong(t *testing.T) {
	for _, tc := range []struct {
		name   string
		liars  []int // ranks that first pass MaxShare+1 bytes
		others bool  // the other ranks call Share too (with the long data)
	}{
		{"every rank", []int{0, 1, 2}, false},
		{"rank 1, then again", []int{1}, false},
		{"rank 0, then again", []int{0}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 3
			nodes := shareWorld(t, n, BinaryTree)
			ctx := shareCtx(t)
			barNoErrors(t, shareAll(nodes, func(nd *Node) error {
				r := nd.Rank()
				for _, l := range tc.liars {
					if l != r {
						continue
					}
					_, err := nd.Share(ctx, make([]byte, MaxShare+1))
					if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d bytes, at most MaxShare (%d)", MaxShare+1, MaxShare)) {
						return fmt.Errorf("too long: %v, want an error naming both lengths", err)
					}
					if err := nd.Err(); err != nil {
						return fmt.Errorf("Err after a refused Share: %v", err)
					}
				}
				for k := range 3 {
					got, err := nd.Share(ctx, shareData(r, k))
					if err != nil {
						return fmt.Errorf("call %d after the refusal: %w", k, err)
					}
					if err := shareCheck(got, n, k); err != nil {
						return err
					}
					if err := nd.Barrier(ctx, nil); err != nil {
						return fmt.Errorf("barrier after call %d: %w", k, err)
					}
				}
				return nil
			}))
		})
	}
}

// TestShareCorrupt: a peer's box holding a header no correct peer writes
// (a length over MaxShare; a call number from the future or from before
// the previous call) fails the Share with ErrShareCorrupt naming the
// rank of the box, without a panic and without waiting for the
// context; the barrier is then poisoned. A header of another generation
// is not taken for this call's (the Share waits, here until its short
// context ends).
func TestShareCorrupt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		header func(gen uint64, call uint32) uint64 // the header planted in rank 1's box at rank 0, for call
		detail string                               // "" for a timeout
	}{
		{"length", func(gen uint64, call uint32) uint64 { return gen<<48 | uint64(call)<<16 | (MaxShare + 1) }, "holds 257 bytes, more than MaxShare (256)"},
		{"length 0xffff", func(gen uint64, call uint32) uint64 { return gen<<48 | uint64(call)<<16 | 0xffff }, "holds 65535 bytes"},
		{"future", func(gen uint64, call uint32) uint64 { return gen<<48 | uint64(call+1)<<16 | 8 }, "holds call 5, a later call than this one (4)"},
		{"far future", func(gen uint64, call uint32) uint64 { return gen<<48 | uint64(call+1000)<<16 }, "holds call 1004, a later call"},
		{"past", func(gen uint64, call uint32) uint64 { return gen<<48 | uint64(call-2)<<16 | 8 }, "holds call 2, an earlier call than this one (4)"},
		{"other generation", func(gen uint64, call uint32) uint64 { return (gen+1)<<48 | uint64(call)<<16 | 8 }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nodes := shareWorld(t, 2, BinaryTree)
			ctx := shareCtx(t)
			for k := range 3 {
				barNoErrors(t, shareAll(nodes, func(nd *Node) error {
					got, err := nd.Share(ctx, shareData(nd.Rank(), k))
					if err == nil {
						err = shareCheck(got, 2, k)
					}
					return err
				}))
			}
			// Rank 1 is not calling: its box at rank 0 holds call 3.
			b := nodes[0].bar
			w := b.word64(b.boxOff(1))
			if got := uint32(atomic.LoadUint64(w) >> 16); got != 3 {
				t.Fatalf("rank 1's box at rank 0 holds call %d, want 3", got)
			}
			atomic.StoreUint64(w, tc.header(b.gen, 4))
			wctx := ctx
			if tc.detail == "" {
				var cancel context.CancelFunc
				wctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
				defer cancel()
			}
			_, err := nodes[0].Share(wctx, shareData(0, 3))
			if tc.detail == "" {
				if !errors.Is(err, verbs.ErrTimeout) || errors.Is(err, ErrShareCorrupt) {
					t.Fatalf("Share: %v, want a timeout (the header is not this generation's)", err)
				}
			} else if !errors.Is(err, ErrShareCorrupt) || errors.Is(err, verbs.ErrTimeout) ||
				!strings.Contains(err.Error(), "rank 1's box") || !strings.Contains(err.Error(), tc.detail) {
				t.Fatalf("Share: %v, want ErrShareCorrupt naming rank 1 and saying %q", err, tc.detail)
			}
			t.Log(err)
			if err := nodes[0].Barrier(ctx, nil); !errors.Is(err, ErrPoisoned) {
				t.Errorf("barrier after a failed Share: %v, want ErrPoisoned", err)
			}
			if err := nodes[0].Err(); err != nil {
				t.Errorf("Err: %v, want nil (no rank failed)", err)
			}
		})
	}
}

// TestShareReset: after a Share failed on one rank (its context ended:
// the other rank never came), ResetBarrier on every rank makes Shares
// work again: the stale boxes of the abandoned call are not taken for
// the new ones.
func TestShareReset(t *testing.T) {
	nodes := shareWorld(t, 3, Dissemination)
	ctx := shareCtx(t)
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	// Ranks 0 and 1 call; rank 2 does not: both time out, rank 2's box
	// at 0 and 1 stays old, theirs at rank 2 hold the abandoned call.
	barNoErrors(t, shareAll(nodes[:2], func(nd *Node) error {
		if _, err := nd.Share(short, shareData(nd.Rank(), 99)); !errors.Is(err, verbs.ErrTimeout) {
			return fmt.Errorf("Share without rank 2: %v, want a timeout", err)
		}
		if _, err := nd.Share(ctx, shareData(nd.Rank(), 0)); !errors.Is(err, ErrPoisoned) {
			return fmt.Errorf("Share after a timeout: %v, want ErrPoisoned", err)
		}
		return nil
	}))
	barNoErrors(t, shareAll(nodes, func(nd *Node) error {
		if err := nd.ResetBarrier(); err != nil {
			return err
		}
		for k := range 4 {
			got, err := nd.Share(ctx, shareData(nd.Rank(), k))
			if err != nil {
				return fmt.Errorf("call %d after reset: %w", k, err)
			}
			if err := shareCheck(got, 3, k); err != nil {
				return err
			}
		}
		return nil
	}))
}

// TestShareNodeState: Share before Connect and after Close fails with
// ErrNodeState.
func TestShareNodeState(t *testing.T) {
	nodes := shareWorld(t, 2, BinaryTree)
	ctx := shareCtx(t)
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	defer barClose(t, "device", dev.Close)
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer barClose(t, "pd", pd.Close)
	nd, err := NewNode(pd, 0, 2, NodeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nd.Share(ctx, nil); !errors.Is(err, ErrNodeState) {
		t.Errorf("Share before Connect: %v, want ErrNodeState", err)
	}
	barClose(t, "node", nd.Close)
	barClose(t, "node", nodes[0].Close)
	if _, err := nodes[0].Share(ctx, nil); !errors.Is(err, ErrNodeState) {
		t.Errorf("Share after Close: %v, want ErrNodeState", err)
	}
}

// TestShareLayout: the flag region a rank advertises holds the
// mailboxes (n × (8 + MaxShare) bytes after the flag words), and a peer
// whose region is too short for them (a version-2 peer's size) is
// refused.
func TestShareLayout(t *testing.T) {
	nodes := shareWorld(t, 3, BinaryTree)
	b := nodes[0].bar
	if got, want := b.flags.Len(), flagWords(3)*flagBytes+3*(8+MaxShare); got != want {
		t.Errorf("flag region: %d bytes, want %d", got, want)
	}
	infos := [][]byte{nodes[0].bar.localInfo(), nodes[1].bar.localInfo(), nodes[2].bar.localInfo()}
	binary.LittleEndian.PutUint64(infos[2][24:], uint64(flagWords(3)*flagBytes))
	want := fmt.Sprintf("rank 2's flag region has %d bytes, want %d", flagWords(3)*flagBytes, regionBytes(3))
	if err := b.setRemote(infos); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("setRemote with a region without mailboxes: %v", err)
	}
}

// shareSteps runs k Shares of a test world on nd, checking each, with a
// world barrier after every third.
func shareSteps(ctx context.Context, nd *Node, k int) error {
	for i := range k {
		got, err := nd.Share(ctx, shareData(nd.Rank(), i))
		if err != nil {
			return fmt.Errorf("call %d: %w", i, err)
		}
		if err := shareCheck(got, nd.Size(), i); err != nil {
			return err
		}
		if i%3 == 2 {
			if err := nd.Barrier(ctx, nil); err != nil {
				return fmt.Errorf("barrier after call %d: %w", i, err)
			}
		}
	}
	return nil
}

// TestShareCrossProcess: Shares between processes (one rank of the world
// in a child process, the others here: the harness of the failure
// tests), over every soft0 transport and both exchange modes: every rank
// gets every rank's bytes.
func TestShareCrossProcess(t *testing.T) {
	const calls = 30
	for _, tc := range []struct {
		transport string
		mode      Mode
		n, child  int
	}{
		{"shm", AllToAll, 2, 1},
		{"unix", Rendezvous, 3, 0},
		{"tcp", AllToAll, 4, 2},
		{"shm", Rendezvous, 5, 4},
	} {
		t.Run(fmt.Sprintf("%s/%v/%d", tc.transport, tc.mode, tc.n), func(t *testing.T) {
			xNoLeaks(t)
			restore, err := soft.ForceTransport(tc.transport)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(restore)
			lns, addrs := xListeners(t, tc.n)
			guard := xContext(t, 2*time.Minute)
			cmd, lines := failStart(t, tc.transport, lns[tc.child], fmt.Sprintf("rank,%d,%d,%d,%d,shares:%d,%s",
				Auto, tc.mode, tc.child, tc.n, calls, strings.Join(addrs, ";")))
			errs := make([]error, tc.n)
			var wg sync.WaitGroup
			for r := range tc.n {
				if r == tc.child {
					continue
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					xc := ExchangeConfig{Rank: r, Size: tc.n, Mode: tc.mode, Addrs: addrs}
					nd, err := join(guard, "soft0", xc, JoinOptions{Node: NodeOptions{Channel: channel.Options{QP: failQP}},
						Job: failJob, Token: []byte(failToken), Listener: lns[r]})
					if err != nil {
						errs[r] = err
						return
					}
					errs[r] = errors.Join(shareSteps(guard, nd, calls), nd.Close())
				}()
			}
			wg.Wait()
			barNoErrors(t, errs)
			var out []string
			for line := range lines {
				out = append(out, line)
			}
			if err := cmd.Wait(); err != nil || len(out) != 1 || out[0] != "done" {
				t.Errorf("child rank %d: %v, printed %q", tc.child, err, out)
			}
		})
	}
}

// TestShareFailure: a rank killed (SIGKILL) or stopped (SIGSTOP, past
// the liveness bound) while the world loops over Shares makes every
// other rank's current Share and the next fail, naming it (the failure
// tests' harness and checks).
func TestShareFailure(t *testing.T) {
	for _, tc := range []struct {
		n, victim int
		sig       syscall.Signal
		transport string
		alg       BarrierAlgorithm
	}{
		{3, 2, syscall.SIGKILL, "shm", BinaryTree},
		{4, 0, syscall.SIGKILL, "unix", Dissemination},
		{4, 1, syscall.SIGSTOP, "tcp", Centralized},
		{3, 0, syscall.SIGSTOP, "shm", BinaryTree},
	} {
		sig := map[syscall.Signal]string{syscall.SIGKILL: "SIGKILL", syscall.SIGSTOP: "SIGSTOP"}[tc.sig]
		t.Run(fmt.Sprintf("%d/rank-%d/%s/%s", tc.n, tc.victim, sig, tc.transport), func(t *testing.T) {
			failCheck(t, failWorldOf(t, tc.transport, tc.alg, Mode(tc.victim%2), tc.n, tc.victim, tc.sig, true), tc.victim)
		})
	}
}
