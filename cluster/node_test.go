package cluster_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/verbstest"
)

// loopbackConfig opens n listeners on 127.0.0.1 (ephemeral ports) and
// returns the configuration naming them, with the listeners by rank.
func loopbackConfig(t testing.TB, n int) (*cluster.Config, []net.Listener) {
	t.Helper()
	cfg := &cluster.Config{}
	lns := make([]net.Listener, n)
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		lns[i] = ln
		cfg.Hosts = append(cfg.Hosts, cluster.Host{Hostname: "127.0.0.1", Port: ln.Addr().(*net.TCPAddr).Port,
			Device: verbs.SoftDevice, Rank: i})
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg, lns
}

// member is one rank of a test world: its node and a region every peer
// may write (slot j, 8 bytes, belongs to rank j).
type member struct {
	node *cluster.Node
	mr   *verbs.MemoryRegion
}

// publish registers the member's region and returns its description.
func (m *member) publish(n *cluster.Node) ([]byte, error) {
	mr, err := n.PD().Alloc(8*n.Size()+8, verbs.AccessRemoteAll)
	if err != nil {
		return nil, err
	}
	m.mr = mr
	n.OnClose(mr.Close)
	return mr.Remote().MarshalBinary()
}

func (m *member) close() error { return m.node.Close() }

func remoteOf(b []byte) (verbs.RemoteRegion, error) {
	var r verbs.RemoteRegion
	err := r.UnmarshalBinary(b)
	return r, err
}

// joinWorld runs Join for every rank of a loopback world in goroutines
// and returns the members by rank. It fails the test if any rank fails.
func joinWorld(t *testing.T, n int, mode cluster.Mode, opts cluster.JoinOptions) []*member {
	t.Helper()
	verbstest.CheckLeaks(t)
	cfg, lns := loopbackConfig(t, n)
	ms := make([]*member, n)
	errs := make([]error, n)
	ctx := testContext(t)
	var wg sync.WaitGroup
	for i := range n {
		ms[i] = &member{}
		o := opts
		o.Mode, o.Listener = mode, lns[i]
		o.Prepare = ms[i].publish
		wg.Add(1)
		go func() {
			defer wg.Done()
			ms[i].node, errs[i] = cluster.Join(ctx, cfg, i, o)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("rank %d: join: %v", i, err)
		}
	}
	t.Cleanup(func() {
		for i, m := range ms {
			if m.node == nil {
				continue
			}
			if err := m.close(); err != nil {
				t.Errorf("rank %d: close: %v", i, err)
			}
		}
	})
	if t.Failed() {
		t.FailNow()
	}
	return ms
}

func testContext(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// forEach runs f for every member concurrently and reports failures.
func forEach(t *testing.T, ms []*member, f func(i int, m *member) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(ms))
	for i, m := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(i, m)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", i, err)
		}
	}
}

var worldSizes = []int{1, 2, 3, 4, 7, 8}

// TestWorld builds worlds of every size in both exchange modes, checks
// ranks and published data, writes from every rank to every rank
// (all-to-all), and runs barriers asserting that no rank leaves before
// every rank has arrived.
func TestWorld(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.AllToAll, cluster.Rendezvous} {
		for _, n := range worldSizes {
			t.Run(fmt.Sprintf("%v/%d", mode, n), func(t *testing.T) {
				ms := joinWorld(t, n, mode, cluster.JoinOptions{Job: "test-world", Token: []byte("secret")})
				ctx := testContext(t)
				for i, m := range ms {
					if m.node.Rank() != i || m.node.Size() != n {
						t.Fatalf("rank %d: node says rank %d of %d", i, m.node.Rank(), m.node.Size())
					}
					if got := m.node.Channel().Len(); got != n {
						t.Fatalf("rank %d: channel to %d peers", i, got)
					}
				}
				// All-to-all write: rank i writes 1000*i+j into slot i of
				// rank j's region.
				forEach(t, ms, func(i int, m *member) error {
					src, err := m.node.PD().Alloc(8*n, verbs.AccessLocalWrite)
					if err != nil {
						return err
					}
					defer src.Close()
					var peers []int
					var dsts []verbs.RemoteAddr
					var bufs []verbs.SGE
					for j := range n {
						r, err := remoteOf(m.node.PeerData(j))
						if err != nil {
							return fmt.Errorf("rank %d's data: %w", j, err)
						}
						binary.LittleEndian.PutUint64(src.Bytes()[8*j:], uint64(1000*i+j))
						if j == i {
							binary.LittleEndian.PutUint64(m.mr.Bytes()[8*i:], uint64(1000*i+j))
							continue
						}
						peers = append(peers, j)
						dsts = append(dsts, r.At(uint64(8*i)))
						buf, err := src.SGE(8*j, 8)
						if err != nil {
							return err
						}
						bufs = append(bufs, buf)
					}
					if len(peers) > 0 {
						if err := m.node.Channel().ScatterWrite(ctx, peers, dsts, bufs); err != nil {
							return err
						}
					}
					// Once every rank passed this barrier, every write to
					// this rank has completed at its writer.
					return m.node.Barrier(ctx, nil)
				})
				for j, m := range ms {
					for i := range n {
						if got, want := binary.LittleEndian.Uint64(m.mr.Bytes()[8*i:]), uint64(1000*i+j); got != want {
							t.Errorf("rank %d, slot %d: %d, want %d", j, i, got, want)
						}
					}
				}
				// Barrier correctness: in round k every rank counts its
				// arrival, then waits; after the barrier the count must be
				// complete.
				const rounds = 20
				var arrived [rounds]atomic.Int64
				forEach(t, ms, func(i int, m *member) error {
					for k := range rounds {
						arrived[k].Add(1)
						if err := m.node.Barrier(ctx, nil); err != nil {
							return err
						}
						if got := arrived[k].Load(); got != int64(n) {
							return fmt.Errorf("round %d: left the barrier after %d of %d arrivals", k, got, n)
						}
					}
					return nil
				})
			})
		}
	}
}

// TestWorldAlgorithms checks that Join passes the barrier algorithm on
// (every algorithm synchronises a world of 4) and that Node says which it
// uses: the one asked for, or the one Auto picked — 4 ranks in one
// process: centralized where the machine has fewer than 4 processors.
func TestWorldAlgorithms(t *testing.T) {
	auto := cluster.Dissemination
	if runtime.NumCPU() < 4 {
		auto = cluster.Centralized
	}
	for _, alg := range []cluster.BarrierAlgorithm{cluster.Auto, cluster.BinaryTree, cluster.Dissemination, cluster.Centralized} {
		t.Run(alg.String(), func(t *testing.T) {
			const n = 4
			ms := joinWorld(t, n, cluster.AllToAll, cluster.JoinOptions{Node: cluster.NodeOptions{Barrier: alg}})
			ctx := testContext(t)
			want := alg
			if alg == cluster.Auto {
				want = auto
			}
			var arrived atomic.Int64
			forEach(t, ms, func(i int, m *member) error {
				if got := m.node.BarrierAlgorithm(); got != want {
					return fmt.Errorf("BarrierAlgorithm() = %v, want %v", got, want)
				}
				arrived.Add(1)
				if err := m.node.Barrier(ctx, nil); err != nil {
					return err
				}
				if got := arrived.Load(); got != n {
					return fmt.Errorf("left after %d of %d arrivals", got, n)
				}
				return nil
			})
		})
	}
}

// TestNodePhases checks the two-phase construction by hand (NewNode,
// LocalEndpoints, an in-memory exchange, Connect), the phase errors, and
// a subgroup barrier.
func TestNodePhases(t *testing.T) {
	verbstest.CheckLeaks(t)
	const n = 3
	nodes := make([]*cluster.Node, n)
	for i := range n {
		pd := verbstest.OpenPD(t, verbs.SoftDevice)
		var err error
		if nodes[i], err = cluster.NewNode(pd, i, n, cluster.NodeOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nodes[i].Close() })
	}
	ctx := testContext(t)
	if err := nodes[0].Connect(make([][]byte, n)); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("Connect before LocalEndpoints: %v, want ErrNodeState", err)
	}
	if err := nodes[0].Barrier(ctx, nil); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("Barrier before Connect: %v, want ErrNodeState", err)
	}
	out := make([][][]byte, n)
	for i, nd := range nodes {
		var err error
		if out[i], err = nd.LocalEndpoints([]byte{byte(10 + i)}); err != nil {
			t.Fatal(err)
		}
	}
	// A message meant for another rank is refused.
	bad := make([][]byte, n)
	for j := range n {
		bad[j] = out[j][0] // what rank j sent rank 0, handed to rank 1
	}
	bad[1] = out[1][1]
	if err := nodes[1].Connect(bad); err == nil {
		t.Error("Connect with another rank's messages succeeded")
	} else {
		t.Logf("Connect with another rank's messages: %v", err)
	}
	for i, nd := range nodes {
		in := make([][]byte, n)
		for j := range n {
			in[j] = out[j][i]
		}
		if i == 1 {
			// The refused Connect changed nothing: the right messages
			// still connect.
			if err := nd.Connect(in); err != nil {
				t.Fatalf("rank 1: Connect after a refused Connect: %v", err)
			}
			continue
		}
		if err := nd.Connect(in); err != nil {
			t.Fatal(err)
		}
	}
	if err := nodes[2].Connect(nil); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("second Connect: %v, want ErrNodeState", err)
	}
	for i, nd := range nodes {
		for j := range n {
			if got := nd.PeerData(j); len(got) != 1 || got[0] != byte(10+j) {
				t.Errorf("rank %d: PeerData(%d) = %v", i, j, got)
			}
		}
	}
	// A subgroup of ranks 0 and 2; rank 1 is not involved.
	var wg sync.WaitGroup
	for _, i := range []int{0, 2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := nodes[i].Barrier(ctx, []int{0, 2}); err != nil {
				t.Errorf("rank %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	var be *cluster.BarrierError
	if err := nodes[1].Barrier(ctx, []int{0, 2}); !errors.Is(err, cluster.ErrNotInGroup) || !errors.As(err, &be) {
		t.Errorf("barrier of a group without this rank: %v, want ErrNotInGroup", err)
	}
	// A peer's queue pair works: rank 0 reads rank 2's barrier-free data
	// path through the channel (ErrNoPeer for itself).
	if err := nodes[0].Channel().Peer(0).Err(); !errors.Is(err, channel.ErrNoPeer) {
		t.Errorf("self peer: %v, want ErrNoPeer", err)
	}
	for _, nd := range nodes {
		if err := nd.Close(); err != nil {
			t.Error(err)
		}
		if err := nd.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
	if err := nodes[0].Barrier(ctx, nil); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("Barrier after Close: %v, want ErrNodeState", err)
	}
}

// contextWithTimeoutOf derives a context that ends after the given
// number of seconds (a deadline for the exchange, not an assertion).
func contextWithTimeoutOf(ctx context.Context, seconds int) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, time.Duration(seconds)*time.Second)
}

// TestJoinMissingRank: rank 2 of 3 never starts; ranks 0 and 1 fail by
// their deadline with ErrPeerMissing, releasing everything Join opened
// and the memory Prepare registered (the leak check fails otherwise).
func TestJoinMissingRank(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.AllToAll, cluster.Rendezvous} {
		t.Run(mode.String(), func(t *testing.T) {
			verbstest.CheckLeaks(t)
			cfg, lns := loopbackConfig(t, 3)
			ctx, cancel := contextWithTimeoutOf(context.Background(), 1)
			defer cancel()
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for r := range 2 {
				m := &member{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					var n *cluster.Node
					n, errs[r] = cluster.Join(ctx, cfg, r, cluster.JoinOptions{Mode: mode, Listener: lns[r], Prepare: m.publish})
					if n != nil {
						n.Close()
					}
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if !errors.Is(err, cluster.ErrPeerMissing) && !(mode == cluster.Rendezvous && errors.Is(err, cluster.ErrAborted)) {
					t.Errorf("rank %d: %v, want ErrPeerMissing", r, err)
				}
				var xe *cluster.ExchangeError
				if !errors.As(err, &xe) {
					t.Errorf("rank %d: %T is not an *ExchangeError", r, err)
				}
			}
		})
	}
}

// TestNodeFail: a failure a layer above the node reports (Node.Fail)
// reaches every rank: Err names the rank everywhere and every barrier
// fails with a *RankError naming it; the first report is kept; bad
// ranks are refused.
func TestNodeFail(t *testing.T) {
	const n = 3
	ms := joinWorld(t, n, cluster.AllToAll, cluster.JoinOptions{})
	nd := ms[0].node
	for _, bad := range []int{-1, 0, n} {
		if err := nd.Fail(bad, errors.New("x")); err == nil || errors.As(err, new(*cluster.RankError)) {
			t.Errorf("Fail(%d) = %v, want a refusal", bad, err)
		}
	}
	if err := nd.Err(); err != nil {
		t.Fatalf("Err before any failure: %v", err)
	}
	cause := errors.New("the collective's write to rank 2 failed")
	err := nd.Fail(2, cause)
	var re *cluster.RankError
	if !errors.As(err, &re) || re.Rank != 2 || !errors.Is(err, cause) || !errors.Is(err, cluster.ErrPeerLost) {
		t.Fatalf("Fail(2) = %v, want a *RankError for rank 2 wrapping the cause and ErrPeerLost", err)
	}
	if err := nd.Fail(1, errors.New("later")); !errors.As(err, &re) || re.Rank != 2 {
		t.Errorf("a second Fail: %v, want the first failure (rank 2) kept", err)
	}
	// Rank 1 learns it from its poison word, without a barrier of its own
	// having failed (rank 2, deemed dead, is not told); then the barriers
	// of ranks 0 and 1 fail, naming rank 2.
	ctx := testContext(t)
	for _, m := range ms[1:2] {
		for m.node.Err() == nil {
			if ctx.Err() != nil {
				t.Fatalf("rank %d never learnt of the failure", m.node.Rank())
			}
			m.node.Channel().Progress()
			time.Sleep(time.Millisecond)
		}
	}
	forEach(t, ms[:2], func(i int, m *member) error {
		err := m.node.Barrier(ctx, nil)
		var re *cluster.RankError
		if !errors.As(err, &re) || re.Rank != 2 || !errors.Is(err, cluster.ErrPoisoned) {
			return fmt.Errorf("barrier: %v, want ErrPoisoned with a *RankError for rank 2", err)
		}
		return nil
	})
}

// TestNodeCardPhases: the phases with cards by hand (NewNode, LocalCard,
// an in-memory exchange of the cards and items, ConnectCards): the queue
// pairs connect (a world barrier passes), PeerData is each rank's data;
// ConnectCards refuses a column of another world size and a card in
// another rank's slot, and follows LocalCard only.
func TestNodeCardPhases(t *testing.T) {
	verbstest.CheckLeaks(t)
	const n = 3
	nodes := make([]*cluster.Node, n)
	for i := range n {
		dev, err := verbs.Open(verbs.SoftDevice)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dev.Close() })
		pd, err := dev.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pd.Close() })
		if nodes[i], err = cluster.NewNode(pd, i, n, cluster.NodeOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nodes[i].Close() })
	}
	ctx := testContext(t)
	if err := nodes[0].ConnectCards(make([][]byte, n), make([]byte, n*cluster.ItemSize)); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("ConnectCards before LocalCard: %v, want ErrNodeState", err)
	}
	cards := make([][]byte, n)
	items := make([][]byte, n)
	for i, nd := range nodes {
		var err error
		if cards[i], items[i], err = nd.LocalCard([]byte{byte(20 + i)}); err != nil {
			t.Fatal(err)
		}
		if len(items[i]) != n*cluster.ItemSize {
			t.Fatalf("rank %d: %d bytes of items", i, len(items[i]))
		}
	}
	column := func(to int) []byte {
		var c []byte
		for j := range n {
			c = append(c, items[j][to*cluster.ItemSize:(to+1)*cluster.ItemSize]...)
		}
		return c
	}
	if err := nodes[1].ConnectCards(cards, column(1)[:2*cluster.ItemSize]); err == nil {
		t.Error("ConnectCards with a short column succeeded")
	}
	swapped := []([]byte){cards[0], cards[2], cards[1]}
	if err := nodes[1].ConnectCards(swapped, column(1)); err == nil {
		t.Error("ConnectCards with cards in the wrong slots succeeded")
	} else {
		t.Log(err)
	}
	forEach(t, []*member{{node: nodes[0]}, {node: nodes[1]}, {node: nodes[2]}}, func(i int, m *member) error {
		if err := m.node.ConnectCards(cards, column(i)); err != nil {
			return err
		}
		return m.node.Barrier(ctx, nil)
	})
	for i, nd := range nodes {
		for j := range n {
			if got := nd.PeerData(j); len(got) != 1 || got[0] != byte(20+j) {
				t.Errorf("rank %d: PeerData(%d) = %v", i, j, got)
			}
		}
	}
	if _, _, err := nodes[0].LocalCard(nil); !errors.Is(err, cluster.ErrNodeState) {
		t.Errorf("LocalCard after ConnectCards: %v, want ErrNodeState", err)
	}
}
