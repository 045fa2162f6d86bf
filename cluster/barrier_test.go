package cluster

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// Helpers of this file are prefixed with "bar" so that they cannot clash
// with the other tests of the package.

// barRank is one rank of an in-process world: its own device context, PD,
// MultiChannel and barrier.
type barRank struct {
	id  int
	dev *verbs.Context
	pd  *verbs.ProtectionDomain
	mc  *channel.MultiChannel
	b   *barrier
}

// barWorld builds n connected ranks using alg, with every cleanup
// registered on t (barrier, MultiChannel, PD, device), and checks for
// leaked verbs objects and goroutines.
func barWorld(t testing.TB, n int, alg BarrierAlgorithm) []*barRank {
	t.Helper()
	verbstest.CheckLeaks(t)
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	rs := make([]*barRank, n)
	for i := range rs {
		r := &barRank{id: i}
		var err error
		if r.dev, err = verbs.Open(verbs.SoftDevice); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "device", r.dev.Close) })
		if r.pd, err = r.dev.AllocPD(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "pd", r.pd.Close) })
		if r.mc, err = channel.NewMulti(r.pd, n, i, channel.Options{Doorbells: 16}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "multichannel", r.mc.Close) })
		if r.b, err = newBarrier(r.mc, alg); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { barClose(t, "barrier", r.b.close) })
		rs[i] = r
	}
	eps := make([][]verbs.Endpoint, n)
	infos := make([][]byte, n)
	for i, r := range rs {
		var err error
		if eps[i], err = r.mc.Endpoints(); err != nil {
			t.Fatal(err)
		}
		infos[i] = r.b.localInfo()
	}
	for i, r := range rs {
		mine := make([]verbs.Endpoint, n)
		for j := range n {
			mine[j] = eps[j][i]
		}
		if err := r.mc.Connect(mine); err != nil {
			t.Fatal(err)
		}
		if err := r.b.setRemote(infos); err != nil {
			t.Fatal(err)
		}
	}
	return rs
}

func barClose(t testing.TB, what string, f func() error) {
	t.Helper()
	if err := f(); err != nil {
		t.Errorf("close %s: %v", what, err)
	}
}

func barCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// barAll runs f on every rank of rs concurrently and returns the errors,
// indexed like rs.
func barAll(rs []*barRank, f func(r *barRank) error) []error { return runAll(rs, f) }

// runAll runs f on every element of xs concurrently and returns the
// errors, indexed like xs.
func runAll[T any](xs []T, f func(T) error) []error {
	errs := make([]error, len(xs))
	var wg sync.WaitGroup
	for i, x := range xs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(x)
		}()
	}
	wg.Wait()
	return errs
}

func barNoErrors(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", i, err)
		}
	}
}

var barAlgorithms = []BarrierAlgorithm{BinaryTree, Dissemination, Centralized}

// barRounds runs rounds barriers of group (nil: world) on the ranks of rs
// that are in it, and asserts with counters that no rank leaves a round
// before every member has entered it. A different rank is late in each
// round.
func barRounds(ctx context.Context, rs []*barRank, group []int, rounds int) []error {
	size := len(rs)
	members := rs
	if group != nil {
		size = len(group)
		members = make([]*barRank, 0, len(group))
		for _, g := range group {
			members = append(members, rs[g])
		}
	}
	arrived := make([]atomic.Int32, rounds)
	left := make([]atomic.Int32, rounds)
	return barAll(members, func(r *barRank) error {
		for k := range rounds {
			if r.id == members[k%size].id {
				time.Sleep(50 * time.Microsecond) // late arriver: skew, not an assertion
			}
			if k > 0 && left[k-1].Load() == 0 {
				return fmt.Errorf("round %d: entered before anyone left round %d", k, k-1)
			}
			arrived[k].Add(1)
			if err := r.b.wait(ctx, group); err != nil {
				return fmt.Errorf("round %d: %w", k, err)
			}
			if got := arrived[k].Load(); got != int32(size) {
				return fmt.Errorf("round %d: left the barrier when %d of %d ranks had arrived", k, got, size)
			}
			left[k].Add(1)
		}
		return nil
	})
}

func TestBarrierAlgorithmString(t *testing.T) {
	for _, tc := range []struct {
		a    BarrierAlgorithm
		want string
	}{
		{Auto, "auto"}, {BinaryTree, "binary tree"}, {Dissemination, "dissemination"}, {Centralized, "centralized"},
		{BarrierAlgorithm(7), "BarrierAlgorithm(7)"},
	} {
		if got := tc.a.String(); got != tc.want {
			t.Errorf("%d: %q, want %q", int(tc.a), got, tc.want)
		}
	}
	var zero BarrierAlgorithm
	if zero != Auto {
		t.Error("the zero BarrierAlgorithm is not Auto")
	}
}

func TestBarrierWorld(t *testing.T) {
	for _, alg := range barAlgorithms {
		for _, n := range []int{1, 2, 3, 4, 7, 8} {
			t.Run(fmt.Sprintf("%v/%d", strings.ReplaceAll(alg.String(), " ", "-"), n), func(t *testing.T) {
				rs := barWorld(t, n, alg)
				rounds := 60
				if testing.Short() {
					rounds = 10
				}
				barNoErrors(t, barRounds(barCtx(t), rs, nil, rounds))
				for _, r := range rs {
					if r.b.world.epoch != uint64(rounds) {
						t.Errorf("rank %d: world epoch %d after %d barriers", r.id, r.b.world.epoch, rounds)
					}
					if err := r.mc.Err(); err != nil {
						t.Errorf("rank %d: transport broke: %v", r.id, err)
					}
				}
			})
		}
	}
}

// TestBarrierSubgroups interleaves barriers of the world, of disjoint
// subgroups that run different numbers of barriers, and of overlapping
// ones.
func TestBarrierSubgroups(t *testing.T) {
	const n = 7
	evens, odds := []int{0, 2, 4, 6}, []int{1, 3, 5}
	pairs := [][]int{{0, 1}, {2, 3}, {4, 5}, {6}}
	for _, alg := range barAlgorithms {
		t.Run(strings.ReplaceAll(alg.String(), " ", "-"), func(t *testing.T) {
			rs := barWorld(t, n, alg)
			ctx := barCtx(t)
			const rounds = 8
			type key struct {
				group string
				round int
			}
			var mu sync.Mutex
			arrived := map[key]int{}
			check := func(r *barRank, group []int, round int) error {
				k := key{fmt.Sprint(group), round}
				mu.Lock()
				arrived[k]++
				mu.Unlock()
				if err := r.b.wait(ctx, group); err != nil {
					return fmt.Errorf("group %v round %d: %w", group, round, err)
				}
				mu.Lock()
				got := arrived[k]
				mu.Unlock()
				size := n
				if group != nil {
					size = len(group)
				}
				if got != size {
					return fmt.Errorf("group %v round %d: left when %d of %d had arrived", group, round, got, size)
				}
				return nil
			}
			errs := barAll(rs, func(r *barRank) error {
				parity, times := evens, 3
				if r.id%2 == 1 {
					parity, times = odds, 5
				}
				pair := pairs[r.id/2]
				for k := range rounds {
					if err := check(r, nil, k); err != nil {
						return err
					}
					// Disjoint groups, different numbers of barriers.
					for i := range times {
						if err := check(r, parity, k*times+i); err != nil {
							return err
						}
					}
					// Overlapping groups, in the same order on every rank.
					if err := check(r, pair, k); err != nil {
						return err
					}
					if r.id >= 2 && r.id <= 4 {
						if err := check(r, []int{2, 3, 4}, k); err != nil {
							return err
						}
					}
					// The full list is the world.
					if err := check(r, []int{0, 1, 2, 3, 4, 5, 6}, k); err != nil {
						return err
					}
				}
				return nil
			})
			barNoErrors(t, errs)
		})
	}
}

func TestBarrierBadGroups(t *testing.T) {
	rs := barWorld(t, 4, BinaryTree)
	ctx := barCtx(t)
	r := rs[1]
	for _, tc := range []struct {
		name   string
		peers  []int
		want   error
		detail string
	}{
		{"empty", []int{}, ErrBadGroup, "empty group"},
		{"unordered", []int{2, 1, 3}, ErrBadGroup, "ascending order"},
		{"duplicate", []int{0, 1, 1, 3}, ErrBadGroup, "rank 1 appears twice"},
		{"negative", []int{-1, 1}, ErrBadGroup, "outside the world"},
		{"out of range", []int{1, 4}, ErrBadGroup, "outside the world"},
		{"self missing", []int{0, 2, 3}, ErrNotInGroup, "rank 1 is not in [0 2 3]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := r.b.wait(ctx, tc.peers)
			var be *BarrierError
			if !errors.Is(err, tc.want) || !errors.As(err, &be) || !strings.Contains(err.Error(), tc.detail) {
				t.Fatalf("wait(%v) = %v, want %v saying %q", tc.peers, err, tc.want, tc.detail)
			}
			if be.Rank != 1 || be.Peer != -1 || be.Algorithm != BinaryTree {
				t.Errorf("BarrierError %+v", be)
			}
		})
	}
	// Neither does a context that ended before the call.
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if err := r.b.wait(ended, nil); !errors.Is(err, context.Canceled) || !errors.Is(err, verbs.ErrTimeout) {
		t.Errorf("wait with an ended context: %v, want Canceled and ErrTimeout", err)
	}
	// Bad groups do not poison: the world still synchronises.
	barNoErrors(t, barRounds(ctx, rs, nil, 3))
}

// TestBarrierMissingRank: a rank that never arrives makes the others time
// out; their barrier is then poisoned until every rank resets it.
func TestBarrierMissingRank(t *testing.T) {
	for _, alg := range barAlgorithms {
		t.Run(strings.ReplaceAll(alg.String(), " ", "-"), func(t *testing.T) {
			const n = 4
			rs := barWorld(t, n, alg)
			ctx := barCtx(t)
			barNoErrors(t, barRounds(ctx, rs, nil, 2))
			present := rs[:n-1] // rank 3 stays away
			errs := barAll(present, func(r *barRank) error {
				short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
				defer cancel()
				return r.b.wait(short, nil)
			})
			for i, err := range errs {
				var be *BarrierError
				if !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &be) {
					t.Fatalf("rank %d: %v, want a BarrierError wrapping verbs.ErrTimeout and DeadlineExceeded", i, err)
				}
				if be.Epoch != 2 || be.Peer < 0 || be.Group != nil {
					t.Errorf("rank %d: %+v", i, be)
				}
			}
			// Poisoned: fails at once, even with time to spare, for any group.
			for _, r := range present {
				for _, g := range [][]int{nil, {0, 1, 2}} {
					if err := r.b.wait(ctx, g); !errors.Is(err, ErrPoisoned) || !errors.Is(err, verbs.ErrTimeout) {
						t.Errorf("rank %d group %v after the timeout: %v, want ErrPoisoned wrapping the timeout", r.id, g, err)
					}
				}
			}
			// Every rank resets (the missing one too); the world works again.
			for _, r := range rs {
				if err := r.b.reset(); err != nil {
					t.Fatal(err)
				}
			}
			barNoErrors(t, barRounds(ctx, rs, nil, 20))
			barNoErrors(t, barRounds(ctx, rs, []int{0, 3}, 5))
		})
	}
}

// TestBarrierTransportErrors: a broken transport fails the barrier with the
// transport's error and poisons it.
func TestBarrierTransportErrors(t *testing.T) {
	for _, alg := range barAlgorithms {
		t.Run(strings.ReplaceAll(alg.String(), " ", "-")+"/peer-closed", func(t *testing.T) {
			rs := barWorld(t, 2, alg)
			ctx := barCtx(t)
			barNoErrors(t, barRounds(ctx, rs, nil, 3))
			// Rank 0 goes away; rank 1's first signal goes to it (the
			// first step of every algorithm on a non-first rank).
			if err := rs[0].b.close(); err != nil {
				t.Fatal(err)
			}
			if err := rs[0].mc.Close(); err != nil {
				t.Fatal(err)
			}
			err := rs[1].b.wait(ctx, nil)
			var ce *verbs.CompletionError
			var be *BarrierError
			var re *RankError
			if !errors.Is(err, channel.ErrBroken) || !errors.As(err, &ce) || !errors.As(err, &be) || be.Peer != 0 ||
				!errors.As(err, &re) || re.Rank != 0 || !errors.Is(err, ErrPeerLost) {
				t.Fatalf("wait with the peer gone: %v, want a BarrierError naming peer 0 wrapping a RankError for rank 0, ErrPeerLost, channel.ErrBroken and a completion error", err)
			}
			if err := rs[1].b.wait(ctx, nil); !errors.Is(err, ErrPoisoned) || !errors.Is(err, channel.ErrBroken) || !errors.As(err, &re) || re.Rank != 0 {
				t.Errorf("wait after the failure: %v, want ErrPoisoned wrapping the cause", err)
			}
			if err := rs[1].b.reset(); err != nil {
				t.Fatal(err)
			}
			if err := rs[1].b.wait(ctx, nil); !errors.Is(err, ErrPoisoned) || !errors.As(err, &re) || re.Rank != 0 {
				t.Errorf("wait after a reset: %v, want ErrPoisoned naming rank 0 (a lost rank is for good)", err)
			}
			if err := rs[0].b.wait(ctx, nil); !errors.Is(err, channel.ErrClosed) {
				t.Errorf("wait on a closed barrier: %v, want ErrClosed", err)
			}
			if err := rs[0].b.reset(); !errors.Is(err, channel.ErrClosed) {
				t.Errorf("reset of a closed barrier: %v, want ErrClosed", err)
			}
		})
		t.Run(strings.ReplaceAll(alg.String(), " ", "-")+"/bad-rkey", func(t *testing.T) {
			rs := barWorld(t, 2, alg)
			ctx := barCtx(t)
			infos := [][]byte{rs[0].b.localInfo(), rs[1].b.localInfo()}
			infos[0][32] ^= 0x5a // rank 0's rkey, as rank 1 sees it
			if err := rs[1].b.setRemote(infos); err != nil {
				t.Fatal(err)
			}
			err := rs[1].b.wait(ctx, nil)
			var ce *verbs.CompletionError
			if !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr || !errors.Is(err, channel.ErrBroken) {
				t.Fatalf("wait with a wrong rkey: %v, want a remote access error and a broken channel", err)
			}
			if err := rs[1].mc.Peer(0).Err(); !errors.Is(err, channel.ErrBroken) {
				t.Errorf("channel to rank 0: %v, want ErrBroken", err)
			}
			if err := rs[1].b.wait(ctx, nil); !errors.Is(err, ErrPoisoned) {
				t.Errorf("after the failure: %v, want ErrPoisoned", err)
			}
		})
	}
}

// TestBarrierMismatchedOrder: ranks that call barriers of different groups
// in different orders get ErrBarrierMismatch (or time out), never a wrong
// release.
func TestBarrierMismatchedOrder(t *testing.T) {
	rs := barWorld(t, 3, BinaryTree)
	ctx := barCtx(t)
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	errs := barAll(rs, func(r *barRank) error {
		if r.id == 0 {
			// No deadline needed: rank 1's signal comes in any case.
			return r.b.wait(ctx, []int{0, 1}) // the others enter the world barrier
		}
		return r.b.wait(short, nil)
	})
	// In the tree of {0, 1}, rank 0 waits for rank 1's arrival; rank 1,
	// in the world tree, also signals rank 0 first: the signal matches in
	// generation and sequence but not in group.
	if !errors.Is(errs[0], ErrBarrierMismatch) {
		t.Errorf("rank 0: %v, want ErrBarrierMismatch", errs[0])
	}
	for i, err := range errs[1:] {
		if !errors.Is(err, verbs.ErrTimeout) {
			t.Errorf("rank %d: %v, want a timeout", i+1, err)
		}
	}
	for _, r := range rs {
		if err := r.b.reset(); err != nil {
			t.Fatal(err)
		}
	}
	barNoErrors(t, barRounds(ctx, rs, nil, 5))
}

func TestBarrierSetRemote(t *testing.T) {
	rs := barWorld(t, 3, Dissemination)
	good := func() [][]byte {
		return [][]byte{rs[0].b.localInfo(), rs[1].b.localInfo(), rs[2].b.localInfo()}
	}
	other, err := newBarrier(rs[0].mc, Centralized)
	if err != nil {
		t.Fatal(err)
	}
	defer barClose(t, "barrier", other.close)
	for _, tc := range []struct {
		name   string
		edit   func(infos [][]byte) [][]byte
		detail string
	}{
		{"count", func(in [][]byte) [][]byte { return in[:2] }, "2 flag descriptions for a world of 3"},
		{"short", func(in [][]byte) [][]byte { in[1] = in[1][:20]; return in }, "rank 1's flag description is 20 bytes"},
		{"nil", func(in [][]byte) [][]byte { in[2] = nil; return in }, "rank 2's flag description is 0 bytes"},
		{"magic", func(in [][]byte) [][]byte { in[0][0] = 'X'; return in }, "magic"},
		{"version", func(in [][]byte) [][]byte { in[1][4] = 9; return in }, "version 9"},
		{"algorithm", func(in [][]byte) [][]byte { in[2] = other.localInfo(); return in }, "every rank must use the same algorithm"},
		{"order", func(in [][]byte) [][]byte { in[0], in[1] = in[1], in[0]; return in }, "entry 0 holds the flag description of rank 1"},
		{"world size", func(in [][]byte) [][]byte { in[1][12] = 5; return in }, "world of 5 ranks"},
		{"region too small", func(in [][]byte) [][]byte { in[1][24] = 8; clear(in[1][25:32]); return in }, "has 8 bytes"},
		{"misaligned", func(in [][]byte) [][]byte { in[2][16] |= 3; return in }, "not 8-byte aligned"},
		{"no processor", func(in [][]byte) [][]byte { clear(in[1][44:48]); return in }, "rank 1 says it has no processor"},
		{"wraps", func(in [][]byte) [][]byte {
			for i := 16; i < 24; i++ {
				in[2][i] = 0xff
			}
			in[2][16] = 0xf8
			return in
		}, "wraps around"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := rs[0].b.setRemote(tc.edit(good())); err == nil || !strings.Contains(err.Error(), tc.detail) {
				t.Errorf("setRemote = %v, want an error saying %q", err, tc.detail)
			}
		})
	}
	// Nothing was kept: the world still synchronises.
	barNoErrors(t, barRounds(barCtx(t), rs, nil, 3))

	// Before setRemote, a barrier that needs peers fails clearly.
	if err := other.wait(barCtx(t), nil); !errors.Is(err, channel.ErrNotConnected) {
		t.Errorf("wait before setRemote: %v, want ErrNotConnected", err)
	}
	if err := other.wait(barCtx(t), []int{0}); err != nil {
		t.Errorf("a group of one: %v", err)
	}
}

func TestAutoAlgorithm(t *testing.T) {
	many := func(n int, v uint64) []uint64 {
		s := make([]uint64, n)
		for i := range s {
			s[i] = v
		}
		return s
	}
	ints := func(n, v int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = v
		}
		return s
	}
	for _, tc := range []struct {
		name  string
		hosts []uint64
		cpus  []int
		want  BarrierAlgorithm
	}{
		{"one rank", many(1, 7), ints(1, 1), Dissemination},
		{"a processor each", many(2, 7), ints(2, 2), Dissemination},
		{"one too many", many(3, 7), ints(3, 2), Centralized},
		{"two hosts, a processor each", append(many(4, 1), many(4, 2)...), ints(8, 4), Dissemination},
		{"one host of two oversubscribed", append(many(4, 1), many(2, 2)...), append(ints(4, 4), ints(2, 1)...), Centralized},
		{"one rank sees fewer processors", many(2, 7), []int{2, 1}, Centralized},
		{"64 oversubscribed", many(64, 7), ints(64, 2), Centralized},
		{"65 oversubscribed", many(65, 7), ints(65, 2), BinaryTree},
		{"4096 with a processor each", many(4096, 7), ints(4096, 4096), Dissemination},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := autoAlgorithm(len(tc.hosts), oversubscribed(tc.hosts, tc.cpus)); got != tc.want {
				t.Errorf("Auto picks %v, want %v", got, tc.want)
			}
		})
	}
}

// TestBarrierAuto: every rank of a world that asks for Auto picks the same
// algorithm, from what the flag descriptions say of hosts and processors,
// and synchronises with it.
func TestBarrierAuto(t *testing.T) {
	cpus := runtime.NumCPU()
	for _, tc := range []struct {
		name string
		n    int
		edit func(info []byte) // applied to every rank's description
		want BarrierAlgorithm
	}{
		{"as found", 2, nil, autoAlgorithm(2, 2 > cpus)},
		{"as found, one more than processors", cpus + 1, nil, Centralized},
		{"one processor each", 3, func(in []byte) { binary.LittleEndian.PutUint32(in[44:], 1) }, Centralized},
		{"a processor each", 3, func(in []byte) { binary.LittleEndian.PutUint32(in[44:], 3) }, Dissemination},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs := barWorld(t, tc.n, Auto)
			infos := make([][]byte, tc.n)
			for i, r := range rs {
				infos[i] = r.b.localInfo()
				if tc.edit != nil {
					tc.edit(infos[i])
				}
			}
			for _, r := range rs {
				if err := r.b.setRemote(infos); err != nil {
					t.Fatal(err)
				}
			}
			for i, r := range rs {
				if got := BarrierAlgorithm(r.b.inUse.Load()); got != tc.want {
					t.Errorf("rank %d uses %v, want %v", i, got, tc.want)
				}
				if got := binary.LittleEndian.Uint16(r.b.localInfo()[6:]); got != uint16(Auto) {
					t.Errorf("rank %d describes algorithm %d, want Auto (%d): what it asked for", i, got, Auto)
				}
			}
			barNoErrors(t, barRounds(barCtx(t), rs, nil, 20))
			if tc.n > 2 {
				barNoErrors(t, barRounds(barCtx(t), rs, []int{0, tc.n - 1}, 5))
			}
		})
	}
}

func TestNewBarrierBadInput(t *testing.T) {
	rs := barWorld(t, 2, BinaryTree)
	if _, err := newBarrier(nil, BinaryTree); err == nil {
		t.Error("newBarrier(nil) succeeded")
	}
	if _, err := newBarrier(rs[0].mc, BarrierAlgorithm(4)); err == nil || !strings.Contains(err.Error(), "unknown algorithm 4") {
		t.Errorf("unknown algorithm: %v", err)
	}
	noSelf, err := channel.NewMulti(rs[0].pd, 2, -1, channel.Options{Doorbells: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer barClose(t, "multichannel", noSelf.Close)
	if _, err := newBarrier(noSelf, BinaryTree); err == nil || !strings.Contains(err.Error(), "no self rank") {
		t.Errorf("MultiChannel without self: %v", err)
	}
	noBells, err := channel.NewMulti(rs[0].pd, 2, 0, channel.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer barClose(t, "multichannel", noBells.Close)
	if _, err := newBarrier(noBells, BinaryTree); err == nil || !strings.Contains(err.Error(), "no doorbells") {
		t.Errorf("MultiChannel without doorbells: %v", err)
	}
}

// TestBarrierCloseDuringWait: close ends a wait in progress with
// ErrClosed, without poisoning, and is idempotent.
func TestBarrierCloseDuringWait(t *testing.T) {
	rs := barWorld(t, 2, Dissemination)
	errc := make(chan error, 1)
	go func() { errc <- rs[0].b.wait(barCtx(t), nil) }() // rank 1 never comes
	time.Sleep(20 * time.Millisecond)
	if err := rs[0].b.close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, channel.ErrClosed) {
		t.Errorf("wait interrupted by close: %v, want ErrClosed", err)
	}
	if err := rs[0].b.close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if err := rs[0].b.setRemote([][]byte{rs[0].b.localInfo(), rs[1].b.localInfo()}); !errors.Is(err, channel.ErrClosed) {
		t.Errorf("setRemote after close: %v, want ErrClosed", err)
	}
}

func TestBarrierSchedules(t *testing.T) {
	// Every signal has a matching wait, no pair is used twice in one
	// direction, and each rank sends the documented number of writes.
	for _, alg := range barAlgorithms {
		for p := 1; p <= 17; p++ {
			members := make([]int, p)
			for i := range members {
				members[i] = 10 + 3*i // any sorted ranks
			}
			sends := map[[2]int]int{}
			waits := map[[2]int]int{}
			maxSends := 0
			for me := range p {
				n := 0
				for _, s := range schedule(alg, members, me) {
					if s.wait {
						waits[[2]int{s.peer, members[me]}]++
					} else {
						sends[[2]int{members[me], s.peer}]++
						n++
					}
				}
				maxSends = max(maxSends, n)
			}
			for k, c := range sends {
				if c != 1 || waits[k] != 1 {
					t.Errorf("%v p=%d: pair %v: %d signals, %d waits", alg, p, k, c, waits[k])
				}
			}
			if len(waits) != len(sends) {
				t.Errorf("%v p=%d: %d waits for %d signals", alg, p, len(waits), len(sends))
			}
			tree := []int{0, 0, 1, 2, 2}[min(p, 4)] // children of the root, or of rank 1 plus its parent
			if p >= 5 {
				tree = 3
			}
			want := map[BarrierAlgorithm]int{BinaryTree: tree, Dissemination: barLog2(p), Centralized: p - 1}[alg]
			if maxSends != want {
				t.Errorf("%v p=%d: a rank sends up to %d writes, want %d", alg, p, maxSends, want)
			}
		}
	}
}

// barLog2 returns ⌈log2 p⌉ for p ≥ 1.
func barLog2(p int) int {
	k := 0
	for 1<<k < p {
		k++
	}
	return k
}

func TestBarrierWaitAllocatesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count: skipped in -short mode")
	}
	rs := barWorld(t, 3, BinaryTree)
	ctx := barCtx(t)
	pair := []int{0, 1}
	step := func(r *barRank) error {
		if err := r.b.wait(ctx, nil); err != nil {
			return err
		}
		if r.id < 2 {
			return r.b.wait(ctx, pair)
		}
		return nil
	}
	// AllocsPerRun runs the function runs+1 times; the partners keep
	// pace. (It counts the partners' allocations too.) The warm-up lets
	// soft0 fill its lazily allocated inline buffers (one per send queue
	// entry) and creates the groups.
	const runs, warm = 100, 300
	var wg sync.WaitGroup
	for _, r := range rs[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range runs + 1 + warm {
				if err := step(r); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	for range warm {
		if err := step(rs[0]); err != nil {
			t.Fatal(err)
		}
	}
	allocs := testing.AllocsPerRun(runs, func() {
		if err := step(rs[0]); err != nil {
			t.Fatal(err)
		}
	})
	wg.Wait()
	if allocs > 0 {
		t.Errorf("a barrier allocates %.2f times", allocs)
	}
}

// TestCloseReadsOnlyWrittenPeers: before it tears the queue pairs down,
// Node.Close reads from the peers to which a write may still be in
// flight, and from no other: after barriers, a rank of a binary tree of
// 16 reads from its parent and children at most. The old code read from
// every peer, which made soft0 connect every pair of ranks as a large
// world closed.
func TestCloseReadsOnlyWrittenPeers(t *testing.T) {
	const n = 16
	nodes := shareWorld(t, n, BinaryTree)
	ctx := barCtx(t)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, nd := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 5 {
				if errs[i] = nd.Barrier(ctx, nil); errs[i] != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	barNoErrors(t, errs)
	for i, nd := range nodes {
		tree := map[int]bool{2*i + 1: true, 2*i + 2: true}
		if i > 0 {
			tree[(i-1)/2] = true
		}
		// Signals are signaled writes: those whose completions were
		// reaped need no read; the others go to the tree's ranks only.
		got := nd.quiescePeers()
		for _, j := range got {
			if !tree[j] {
				t.Errorf("rank %d reads from rank %d, which it never wrote to (reads from %v)", i, j, got)
			}
		}
	}
}

// TestCloseTellsPartners: a rank that learned of a failure from another
// rank tells its partners before it closes, so that a partner whose
// queue pair to it then breaks names the rank that failed, not the rank
// that closed (the binary tree of 4: rank 1's partners are 0 and 3).
// Only partners are told: a world whose queue pairs connect on first use
// does not connect every pair as it fails.
func TestCloseTellsPartners(t *testing.T) {
	const n, dead, by = 4, 3, 2
	nodes := shareWorld(t, n, BinaryTree)
	ctx := barCtx(t)
	barNoErrors(t, runAll(nodes, func(nd *Node) error { return nd.Barrier(ctx, nil) }))
	// Rank 1 is told (by rank 2, as far as it knows) that rank 3 failed.
	atomic.StoreUint64(nodes[1].bar.poisonWord(), uint64(poisonMark)<<56|uint64(by)<<32|dead)
	if err := nodes[1].Close(); err != nil {
		t.Fatal(err)
	}
	err := nodes[0].Barrier(ctx, nil)
	var re *RankError
	if !errors.As(err, &re) || re.Rank != dead || !errors.Is(err, ErrPeerLost) {
		t.Fatalf("rank 0's barrier after rank 1 closed: %v, want a RankError naming rank %d", err, dead)
	}
	if v := atomic.LoadUint64(nodes[2].bar.poisonWord()); v != 0 {
		t.Errorf("rank 2, not a partner of rank 1, was told: %#x", v)
	}
}

// TestLocalRanks: the ranks of a world count those that share this
// machine (the host in the barrier information): all of a world in one
// process; one fewer when a rank says it is on another host. Before
// Connect a node counts itself.
func TestLocalRanks(t *testing.T) {
	rs := barWorld(t, 3, BinaryTree)
	for _, r := range rs {
		if got := r.b.local.Load(); got != 3 {
			t.Errorf("rank %d: %d local ranks, want 3", r.id, got)
		}
	}
	infos := [][]byte{rs[0].b.localInfo(), rs[1].b.localInfo(), rs[2].b.localInfo()}
	binary.LittleEndian.PutUint64(infos[2][36:], hostID()+1) // rank 2 elsewhere
	if err := rs[0].b.setRemote(infos); err != nil {
		t.Fatal(err)
	}
	if got := rs[0].b.local.Load(); got != 2 {
		t.Errorf("%d local ranks with rank 2 on another host, want 2", got)
	}
	nd, err := NewNode(rs[0].pd, 0, 2, NodeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer nd.Close()
	if got := nd.LocalRanks(); got != 1 {
		t.Errorf("before Connect: %d local ranks, want 1", got)
	}
}
