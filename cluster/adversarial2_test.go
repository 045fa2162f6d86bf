package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// Second adversarial pass: what a demanding user and a stranger on the
// network try, beyond adversarial_test.go. Helpers of this file are
// prefixed with "adv2". Contexts here are hang guards, never bounds that
// a test asserts.

// TestAdv2NodeListDeep: a node list item made of many bracket groups
// ("a[1][1][1]...") is refused at once, without expanding it: every group
// adds at least a digit to every name it makes, so an item of more groups
// than a host name has characters (253) makes no valid name. Before,
// ExpandNodeList recursed once per group before it found a name too
// long: 100 000 groups (300 KB) took a 100 MB stack, and a list of 3 MB
// (a few more groups) killed the process with "goroutine stack exceeds
// 1000000000-byte limit", which no recover catches.
func TestAdv2NodeListDeep(t *testing.T) {
	for _, groups := range []int{maxNodeName + 1, 40_000, 1 << 20} {
		in := "a" + strings.Repeat("[1]", groups)
		names, err := ExpandNodeList(in)
		if err == nil {
			t.Fatalf("%d groups: %d names, want an error", groups, len(names))
		}
		if !strings.Contains(err.Error(), "253") {
			t.Errorf("%d groups: %.200v, want an error saying names have at most 253 characters", groups, err)
		}
		if len(err.Error()) > 1024 {
			t.Errorf("%d groups: an error of %d bytes", groups, len(err.Error()))
		}
	}
	// As many groups as a name may have characters is fine.
	in := strings.Repeat("[1]", maxNodeName)
	names, err := ExpandNodeList(in)
	if err != nil || len(names) != 1 || names[0] != strings.Repeat("1", maxNodeName) {
		t.Errorf("%d groups: %v, %v; want one name of %d ones", maxNodeName, names, err, maxNodeName)
	}
	// Through the environment (Linux bounds a variable to 128 KiB).
	env := map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n" + strings.Repeat("[0]", 40_000)}
	if _, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); !errors.Is(err, ErrEnvValue) {
		t.Errorf("Slurm node list of 40 000 groups: %.200v, want ErrEnvValue", err)
	}
}

// TestAdv2FromEnvClosesListener: FromEnv handed a listener
// (EnvOptions.Join.Listener) closes it when it fails, as Join does
// whatever its error and Exchange does with ExchangeConfig.Listener:
// here when the environment is refused before any exchange (no
// launcher, a bad variable, an unknown launcher forced). Before, a
// failed ParseLaunch returned with the listener still open: the caller,
// told by Join that a failed join releases it, kept its port and
// descriptor.
func TestAdv2FromEnvClosesListener(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		opts EnvOptions
	}{
		{"no launcher", map[string]string{}, EnvOptions{}},
		{"bad size", map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "x", "GOVERBS_ROOT": "127.0.0.1:1"}, EnvOptions{}},
		{"unknown launcher", map[string]string{"GOVERBS_RANK": "0"}, EnvOptions{Launcher: "lsf"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			opts := tc.opts
			opts.Lookup = advLookup(tc.env)
			opts.Join.Listener = ln
			n, err := FromEnv(context.Background(), opts)
			if err == nil {
				n.Close()
				t.Fatal("FromEnv: no error")
			}
			var ee *EnvError
			if !errors.As(err, &ee) {
				t.Errorf("FromEnv: %v, want an *EnvError", err)
			}
			// A closed listener fails Accept at once; an open one would
			// wait for a connection: dial it so that the test cannot hang.
			if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
				c.Close()
			}
			if c, err := ln.Accept(); !errors.Is(err, net.ErrClosed) {
				if c != nil {
					c.Close()
				}
				t.Errorf("after FromEnv failed: Accept: %v, want net.ErrClosed (the listener was left open)", err)
			}
		})
	}
}

// TestAdv2ListenZonedRoot: rank 0 listens on the address of GOVERBS_ROOT
// when it is an IP address, IPv6 with a zone too ([fe80::1%lo]:7000,
// which checkAddr accepts): before, net.ParseIP did not take the zone
// for an IP address, so rank 0 listened on every interface (":7000")
// rather than on the one link-local address it was given.
func TestAdv2ListenZonedRoot(t *testing.T) {
	for root, want := range map[string]string{
		"[fe80::1%lo]:7000":   "[fe80::1%lo]:7000",
		"[::1]:7000":          "[::1]:7000",
		"127.0.0.1:7000":      "127.0.0.1:7000",
		"node-0.cluster:7000": ":7000",
	} {
		env := map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": root}
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)})
		if err != nil {
			t.Errorf("GOVERBS_ROOT=%s: %v", root, err)
			continue
		}
		if l.Listen != want {
			t.Errorf("GOVERBS_ROOT=%s: Listen %q, want %q", root, l.Listen, want)
		}
	}
}

// adv2CountingListener counts the bytes read from each connection it
// accepted (in order of acceptance).
type adv2CountingListener struct {
	net.Listener
	mu    sync.Mutex
	reads []*atomic.Int64
}

func (l *adv2CountingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	n := new(atomic.Int64)
	l.mu.Lock()
	l.reads = append(l.reads, n)
	l.mu.Unlock()
	return &adv2CountingConn{Conn: c, n: n}, nil
}

// most returns the most bytes read from one connection.
func (l *adv2CountingListener) most() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var m int64
	for _, n := range l.reads {
		m = max(m, n.Load())
	}
	return m
}

type adv2CountingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c *adv2CountingConn) Read(b []byte) (int, error) {
	k, err := c.Conn.Read(b)
	c.n.Add(int64(k))
	return k, err
}

// TestAdv2CardShareBound: in a card exchange (ExchangeCards, which Join
// and FromEnv use) every message a rank receives from a peer has a size
// known from the world, at most a card of maxCardLen bytes and the items
// (the rendezvous root: Size items; an all-to-all peer: one): a member of
// the job (it knows the token) that sends a larger one is refused as soon
// as its records pass that bound, having made the rank read at most one
// record more. Before, the rank read up to MaxFrame (64 MiB by default)
// of each peer's message before it decoded it and refused the card:
// every peer at once made a rendezvous root of 256 ranks hold 256 × 64
// MiB, where SECURITY.md bounds what an authenticated rank makes the root
// hold by a card of (MaxFrame−4)/Size−4 bytes (here 256 KiB) and its
// items.
func TestAdv2CardShareBound(t *testing.T) {
	const n, w = 256, ItemSize
	maxCard := maxCardLen(DefaultMaxFrame, n, w)
	for _, tc := range []struct {
		name  string
		mode  Mode
		bound int // the largest share
	}{
		{"rendezvous root", Rendezvous, 12 + maxCard + n*w},
		{"all-to-all acceptor", AllToAll, 12 + maxCard + w},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, n)
			ln := &adv2CountingListener{Listener: lns[0]}
			ctx := xContext(t, advGuard)
			cfg := func(r int) ExchangeConfig {
				return ExchangeConfig{Rank: r, Size: n, Mode: tc.mode, Addrs: addrs, Job: "job", Token: []byte("token")}
			}
			done := make(chan error, 1)
			go func() {
				c := cfg(0)
				c.Listener = ln
				_, _, err := ExchangeCards(ctx, c, xCard(0), xItems(0, n, w))
				done <- err
			}()
			// Rank 1, a member of the job, sends an 8 MiB share: a card
			// of 8 MiB and its items.
			x, err := newCardExchange(cfg(1), xCard(1), xItems(1, n, w))
			if err != nil {
				t.Fatal(err)
			}
			k, err := x.dial(ctx, 0, addrs[0])
			if err != nil {
				t.Fatal(err)
			}
			defer k.c.Close()
			defer k.stopWatch()
			items := xItems(1, n, w)
			if tc.mode == AllToAll {
				items = items[:w]
			}
			x.send(k, encodeCardShare(make([]byte, 8<<20), items)) // the root stops reading
			err = <-done
			var xe *ExchangeError
			if !errors.Is(err, ErrFrameTooLarge) || !errors.As(err, &xe) || xe.Peer != 1 {
				t.Errorf("rank 0: %v, want ErrFrameTooLarge naming rank 1", err)
			}
			// The handshake, then at most one record past the bound.
			limit := int64(helloLen + proofLen + wireSize(tc.bound) + recordHeader + recordMax + aeadOverhead)
			if got := ln.most(); got > limit {
				t.Errorf("rank 0 read %d bytes from rank 1 (a share is at most %d bytes; want at most %d read)", got, tc.bound, limit)
			}
			t.Logf("rank 0: read %d bytes: %v", ln.most(), err)
		})
	}
}

// TestAdv2ConfigZonedIPv6: a configuration may name a rank by a
// link-local IPv6 address with its zone ("fe80::1%eth0"), an IP address
// as GOVERBS_ROOT may be, and the only form in which a link-local
// address can be dialed; two ranks at one address and port, one with and
// one without a zone, are still told apart only by the zone. Before,
// Validate refused it as a host name with the character ':'
// (ErrBadHostname): net.ParseIP takes no zone.
func TestAdv2ConfigZonedIPv6(t *testing.T) {
	c, err := ParseConfig([]byte(`{"hosts": [
		{"hostname": "fe80::1%lo", "port": 7000, "rank": 0},
		{"hostname": "fe80::1%eth0", "port": 7000, "rank": 1},
		{"hostname": "fe80::1", "port": 7000, "rank": 2}]}`))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	if got, want := c.Addrs(), []string{"[fe80::1%lo]:7000", "[fe80::1%eth0]:7000", "[fe80::1]:7000"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("Addrs: %q, want %q", got, want)
	}
	// The same zoned address twice is the same address.
	_, err = ParseConfig([]byte(`{"hosts": [
		{"hostname": "fe80::1%lo", "port": 7000, "rank": 0},
		{"hostname": "FE80:0::1%lo", "port": 7000, "rank": 1}]}`))
	if !errors.Is(err, ErrDuplicateAddress) {
		t.Errorf("one zoned address written twice: %v, want ErrDuplicateAddress", err)
	}
	// A zone is no licence for anything else, in a configuration or in
	// GOVERBS_ROOT (where netip took any zone: spaces, slashes, colons).
	for _, h := range []string{"fe80::1%", "fe80::1%a b", "fe80::1%a/b", "node%lo", "fe80::1%lo:7000", "1.2.3.4%lo"} {
		c := Config{Hosts: []Host{{Hostname: h, Port: 7000}}}
		if err := c.Validate(); !errors.Is(err, ErrBadHostname) {
			t.Errorf("hostname %q: %v, want ErrBadHostname", h, err)
		}
		env := map[string]string{"GOVERBS_RANK": "1", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": net.JoinHostPort(h, "7000")}
		if l, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); !errors.Is(err, ErrEnvValue) {
			t.Errorf("GOVERBS_ROOT=%s: %+v, %v; want ErrEnvValue", env["GOVERBS_ROOT"], l, err)
		}
	}
}

// TestAdv2LocalRankOutsideWorld: a local rank (this process' place among
// the ranks of its host, which programs use to pick a device or a
// processor) is refused when it is not smaller than the world size, with
// ErrEnvValue naming the variable, for every launcher that sets one.
// Before, OMPI_COMM_WORLD_LOCAL_RANK=7 in a world of 4 (a variable left
// over from another job, or set by hand) was taken as it was.
func TestAdv2LocalRankOutsideWorld(t *testing.T) {
	for _, tc := range []struct {
		env     map[string]string
		wantVar string
	}{
		{map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "4", "GOVERBS_LOCAL_RANK": "4", "GOVERBS_ROOT": "h:1"}, "GOVERBS_LOCAL_RANK"},
		{map[string]string{"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "9", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_RANK"},
		{map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "7", "GOVERBS_ROOT": "h:1"}, "OMPI_COMM_WORLD_LOCAL_RANK"},
		{map[string]string{"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "4", "PMI_KVSNAME": "k", "GOVERBS_ROOT": "h:1"}, "MPI_LOCALRANKID"},
		{map[string]string{"PMI_RANK": "0", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "5", "PMI_KVSNAME": "k", "GOVERBS_ROOT": "h:1"}, "PMI_LOCAL_RANK"},
		{map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1000000", "SLURM_NODELIST": "n1"}, "SLURM_LOCALID"},
	} {
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(tc.env)})
		var ee *EnvError
		if !errors.Is(err, ErrEnvValue) || !errors.As(err, &ee) || ee.Var != tc.wantVar {
			t.Errorf("%s=%s: %+v, %v; want ErrEnvValue naming %s", tc.wantVar, tc.env[tc.wantVar], l, err, tc.wantVar)
		}
	}
	// The largest local rank of the world is fine.
	env := map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "GOVERBS_ROOT": "h:1"}
	if l, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); err != nil || l.LocalRank != 3 {
		t.Errorf("local rank 3 of 4: %+v, %v", l, err)
	}
}

// TestAdv2AllToAllBadShareAtOnce: in an all-to-all card exchange, a
// member of the job whose share is malformed (two items where one is
// due, a truncated vector) fails the exchange at once, naming it, while
// another rank has still to come, as a malformed share fails a
// rendezvous root at once, and whether this rank accepted the bad
// share or dialed its sender. Before, shares were decoded only once
// every peer's had arrived: the exchange waited for the missing rank
// until its context ended (here the hang guard; without a deadline,
// for ever) and then reported only the missing rank.
func TestAdv2AllToAllBadShareAtOnce(t *testing.T) {
	const n, w = 3, ItemSize
	for _, tc := range []struct {
		name  string
		share []byte
	}{
		{"two items", encodeCardShare(xCard(1), make([]byte, 2*w))},
		{"truncated", encodeCardShare(xCard(1), make([]byte, w))[:10]},
	} {
		for _, real := range []int{0, 2} { // the acceptor of rank 1, its dialer
			t.Run(fmt.Sprintf("%s/rank %d", tc.name, real), func(t *testing.T) {
				xNoLeaks(t)
				lns, addrs := xListeners(t, n)
				ctx := xContext(t, advGuard)
				cfg := func(r int) ExchangeConfig {
					return ExchangeConfig{Rank: r, Size: n, Mode: AllToAll, Addrs: addrs, Job: "job", Token: []byte("token")}
				}
				done := make(chan error, 1)
				go func() {
					c := cfg(real)
					c.Listener = lns[real]
					_, _, err := ExchangeCards(ctx, c, xCard(real), xItems(real, n, w))
					done <- err
				}()
				// Rank 1, a member of the job, sends its bad share to the
				// real rank; the third rank never comes.
				x, err := newCardExchange(cfg(1), xCard(1), xItems(1, n, w))
				if err != nil {
					t.Fatal(err)
				}
				var k *conn
				if real == 0 {
					if k, err = x.dial(ctx, 0, addrs[0]); err != nil {
						t.Fatal(err)
					}
					defer k.stopWatch()
					x.send(k, tc.share)
				} else {
					c, err := lns[1].Accept()
					if err != nil {
						t.Fatal(err)
					}
					stop := guard(ctx, c)
					defer stop()
					if k, err = x.accept(ctx, c, nil, nil, func(int) error { return nil }); err != nil {
						t.Fatal(err)
					}
					if _, err := x.recv(ctx, k); err != nil {
						t.Fatal(err)
					}
					x.send(k, tc.share)
				}
				defer k.c.Close()
				err = <-done
				var xe *ExchangeError
				if !errors.Is(err, ErrBadFrame) || !errors.As(err, &xe) || xe.Peer != 1 || errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("rank %d: %v, want ErrBadFrame naming rank 1 before the context ends", real, err)
				}
				t.Logf("rank %d: %v", real, err)
			})
		}
	}
}

// TestAdv2OnCloseAfterClose: a function handed to OnClose once the node
// is closed runs at once (there is no later close to run it), and one
// handed while the node is open runs at Close, once. Before, OnClose on
// a closed node appended it to a list nobody would read again: the
// memory it was to release (package collective hands the node the
// windows of communicators closed after it) leaked.
func TestAdv2OnCloseAfterClose(t *testing.T) {
	pd := verbstest.OpenPD(t, verbs.SoftDevice)
	n, err := NewNode(pd, 0, 1, NodeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var before, after atomic.Int32
	n.OnClose(func() error { before.Add(1); return nil })
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if got := before.Load(); got != 1 {
		t.Errorf("OnClose before Close ran %d times, want 1", got)
	}
	n.OnClose(func() error { after.Add(1); return nil })
	if got := after.Load(); got != 1 {
		t.Errorf("OnClose after Close ran %d times, want 1 (at once)", got)
	}
	n.Close() // idempotent: runs nothing again
	if before.Load() != 1 || after.Load() != 1 {
		t.Errorf("a second Close ran OnClose functions again: %d, %d", before.Load(), after.Load())
	}
}

// TestAdv2TwoRanksLeaveAtOnce: in a world of 5 (in this process), two
// ranks, the root of the barriers' trees among them, close their nodes
// at once (they leave, as processes that exit do) while the three others
// wait for them in a barrier or a Share, with every barrier algorithm:
// every survivor fails before its context (the hang guard) ends, with a
// *RankError naming one of the two (ErrPeerLost), Err reports a failure
// of one of the two, and the next barrier fails at once (ErrPoisoned).
func TestAdv2TwoRanksLeaveAtOnce(t *testing.T) {
	leavers := map[int]bool{0: true, 3: true}
	for _, alg := range []BarrierAlgorithm{BinaryTree, Dissemination, Centralized} {
		for _, op := range []string{"barrier", "share"} {
			t.Run(fmt.Sprintf("%s/%s", strings.ReplaceAll(alg.String(), " ", "-"), op), func(t *testing.T) {
				nodes := shareWorld(t, 5, alg)
				ctx := xContext(t, advGuard)
				errs := runAll(nodes, func(nd *Node) error {
					if leavers[nd.Rank()] {
						return nd.Close()
					}
					if op == "barrier" {
						return nd.Barrier(ctx, nil)
					}
					_, err := nd.Share(ctx, []byte{byte(nd.Rank())})
					return err
				})
				names := func(err error) bool {
					var re *RankError
					return errors.As(err, &re) && leavers[re.Rank] && errors.Is(err, ErrPeerLost)
				}
				for r, err := range errs {
					if leavers[r] {
						if err != nil {
							t.Errorf("rank %d: Close: %v", r, err)
						}
						continue
					}
					if !names(err) || ctx.Err() != nil {
						t.Errorf("rank %d: %v, want a *RankError naming rank 0 or 3 before the guard", r, err)
						continue
					}
					if err := nodes[r].Err(); !names(err) {
						t.Errorf("rank %d: Err() = %v, want rank 0 or 3", r, err)
					}
					if err := nodes[r].Barrier(ctx, nil); !errors.Is(err, ErrPoisoned) || !names(err) {
						t.Errorf("rank %d: next barrier: %v, want ErrPoisoned naming rank 0 or 3", r, err)
					}
				}
			})
		}
	}
}

// TestAdv2CloseRacesEverything: while every rank of a world of 3 runs
// barriers and Shares in turn (in the same order, as collectives must
// be) and other goroutines of rank 1 call Err, PeerData, LocalRanks and
// BarrierAlgorithm in loops, rank 1 closes its node: every call returns
// (none hangs past the hang guard, none panics, the race detector sees
// nothing); once Close returned, every call of rank 1 fails with
// ErrNodeState; ranks 0 and 2 fail with a *RankError naming rank 1.
func TestAdv2CloseRacesEverything(t *testing.T) {
	nodes := shareWorld(t, 3, Dissemination)
	ctx := xContext(t, advGuard)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// loop runs f until it fails, or (if untilStop) stop is closed.
	loop := func(untilStop bool, f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				if untilStop {
					select {
					case <-stop:
						return
					default:
					}
				}
				if f() != nil {
					return
				}
			}
		}()
	}
	errs := make([]error, 3)
	for r, nd := range nodes {
		i := 0
		loop(false, func() error { // until the failure of rank 1
			i++
			if i%2 == 0 {
				errs[r] = nd.Barrier(ctx, nil)
			} else {
				_, errs[r] = nd.Share(ctx, []byte("x"))
			}
			return errs[r]
		})
	}
	n := nodes[1]
	loop(true, func() error { n.Err(); return nil })
	loop(true, func() error { n.PeerData(0); return nil })
	loop(true, func() error { n.LocalRanks(); n.BarrierAlgorithm(); return nil })
	time.Sleep(20 * time.Millisecond) // (let them run: any interleaving will do)
	if err := n.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := n.Barrier(ctx, nil); !errors.Is(err, ErrNodeState) {
		t.Errorf("Barrier after Close: %v, want ErrNodeState", err)
	}
	if _, err := n.Share(ctx, nil); !errors.Is(err, ErrNodeState) {
		t.Errorf("Share after Close: %v, want ErrNodeState", err)
	}
	if err := n.Err(); err != nil {
		t.Errorf("Err after Close: %v, want nil", err)
	}
	close(stop)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
		t.Fatal("calls still running at the hang guard")
	}
	for _, r := range []int{0, 2} {
		var re *RankError
		if !errors.As(errs[r], &re) || re.Rank != 1 || !errors.Is(errs[r], ErrPeerLost) {
			t.Errorf("rank %d: %v, want a *RankError naming rank 1", r, errs[r])
		}
	}
}

// TestAdv2ConfigDuplicateKeys: a configuration with a key twice in one
// object (in any case: encoding/json matches field names without regard
// to case) is refused with ErrSyntax at the second: JSON leaves
// duplicates undefined and encoding/json keeps the last silently, so a
// host written {"rank": 0, ..., "rank": 1} (two edits merged), or a
// second "hosts" list, changed the world without a word.
func TestAdv2ConfigDuplicateKeys(t *testing.T) {
	for _, tc := range []struct{ name, in, where string }{
		{"rank twice", `{"hosts": [{"hostname": "a", "port": 1, "rank": 0, "rank": 1}]}`, "line 1, column 52"},
		{"port in two cases", `{"hosts": [{"hostname": "a", "port": 1, "Port": 2, "rank": 0}]}`, "line 1, column 41"},
		{"hosts twice", "{\"hosts\": [{\"hostname\": \"a\", \"port\": 1, \"rank\": 0}],\n \"hosts\": []}", "line 2, column 2"},
		{"hostname twice in the second host", `{"hosts": [{"hostname": "a", "port": 1, "rank": 0}, {"hostname": "b", "HOSTNAME": "c", "port": 1, "rank": 1}]}`, "line 1, column 71"},
		// encoding/json folds the long s (U+017F) to s, and the Kelvin
		// sign to k, which strings.ToLower did only for the Kelvin sign:
		// the long s passed, and its value won
		// (TestConfigDuplicateKeyFolded in foldKey's comment).
		{"hostname with a long s", `{"hosts": [{"hostname": "a", "port": 1, "rank": 0, "ho\u017ftname": "evil"}]}`, "line 1, column 52"},
		{"hosts with a long s", `{"hosts": [{"hostname": "a", "port": 1, "rank": 0}], "ho\u017fts": [{"hostname": "b", "port": 2, "rank": 0}]}`, "line 1, column 54"},
		{"rank with a Kelvin sign", `{"hosts": [{"hostname": "a", "port": 1, "rank": 0, "ran\u212a": 1}]}`, "line 1, column 52"},
	} {
		c, err := ParseConfig([]byte(tc.in))
		if !errors.Is(err, ErrSyntax) || !strings.Contains(err.Error(), tc.where) || !strings.Contains(err.Error(), "twice") {
			t.Errorf("%s: %+v, %v; want ErrSyntax at %s saying the key is there twice", tc.name, c, err, tc.where)
		}
	}
	// The same key in different objects is fine.
	if _, err := ParseConfig([]byte(`{"hosts": [{"hostname": "a", "port": 1, "rank": 0}, {"hostname": "b", "port": 1, "rank": 1}]}`)); err != nil {
		t.Errorf("two hosts: %v", err)
	}
}

// TestAdv2HugeValuesShortErrors: a value of the environment as long as
// Linux lets a variable be (128 KiB), malformed, makes an error of at
// most a few hundred bytes that quotes its start and gives its length,
// for every variable ParseLaunch quotes. Before, the error quoted the
// whole value: a 128 KiB error message for a log line.
func TestAdv2HugeValuesShortErrors(t *testing.T) {
	huge := strings.Repeat("9", 128<<10)
	base := func(kv ...string) map[string]string {
		m := map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": "h:1"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		name string
		env  map[string]string
		opts EnvOptions
	}{
		{"world size", base("GOVERBS_WORLD_SIZE", huge+"x"), EnvOptions{}},
		{"root", base("GOVERBS_ROOT", huge), EnvOptions{}},
		{"root port", base("GOVERBS_ROOT", "h:"+huge), EnvOptions{}},
		{"root host", base("GOVERBS_ROOT", "h"+strings.Repeat(".h", 64<<10)+":1"), EnvOptions{}},
		{"root zone", base("GOVERBS_ROOT", "[fe80::1%"+strings.Repeat("a", 128<<10)+"]:1"), EnvOptions{}},
		{"listen", base("GOVERBS_LISTEN", huge), EnvOptions{}},
		{"kubernetes pattern", map[string]string{"JOB_COMPLETION_INDEX": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_HOST_PATTERN": huge}, EnvOptions{}},
		{"launcher", base(), EnvOptions{Launcher: huge}},
		{"slurm node list", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[" + huge + "]"}, EnvOptions{}},
	} {
		opts := tc.opts
		opts.Lookup = advLookup(tc.env)
		_, err := ParseLaunch(opts)
		if err == nil {
			t.Errorf("%s: no error", tc.name)
			continue
		}
		if n := len(err.Error()); n > 512 {
			t.Errorf("%s: an error of %d bytes: %.200s...", tc.name, n, err)
		}
	}
}

// TestAdv2FailWithoutCause: Node.Fail with a nil cause (a layer above
// that knows only that a rank is gone) records a failure whose message
// says so, wrapping ErrPeerLost; before, the message read "cluster: peer
// lost: %!w(<nil>)" (a nil given to %w).
func TestAdv2FailWithoutCause(t *testing.T) {
	nodes := shareWorld(t, 3, Dissemination)
	err := nodes[0].Fail(2, nil)
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 2 || !errors.Is(err, ErrPeerLost) || strings.Contains(err.Error(), "%!") {
		t.Errorf("Fail(2, nil): %v, want a *RankError naming rank 2, wrapping ErrPeerLost, without a formatting error", err)
	}
	if err := nodes[0].Err(); err == nil || strings.Contains(err.Error(), "%!") {
		t.Errorf("Err: %v", err)
	}
}

// TestAdv2NodeListBuildsOnce: a node list item's names are each built
// once: what ExpandNodeList allocates for 65 536 names of 205
// characters (200 groups of one number before [0-65535]) is of the
// order of the names themselves (13 MB), and a list whose names would
// be too long is refused before any is built. Before, the names were
// expanded group by group from the last, every name copied at every
// group: 1.3 GB allocated (and seconds of processor) for the 13 MB, and
// as much again to find that 252 such groups make names too long.
func TestAdv2NodeListBuildsOnce(t *testing.T) {
	allocated := func(s string) (uint64, []string, error) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		names, err := ExpandNodeList(s)
		runtime.ReadMemStats(&after)
		return after.TotalAlloc - before.TotalAlloc, names, err
	}
	in := strings.Repeat("[1]", 200) + "[0-65535]"
	n, names, err := allocated(in)
	if err != nil || len(names) != 65536 || names[65535] != strings.Repeat("1", 200)+"65535" {
		t.Fatalf("200 groups and [0-65535]: %d names, %v", len(names), err)
	}
	if n > 64<<20 {
		t.Errorf("200 groups and [0-65535]: %d MB allocated for %d MB of names", n>>20, 65536*205>>20)
	}
	n, names, err = allocated(strings.Repeat("[1]", 252) + "[0-65535]")
	if err == nil {
		t.Fatalf("names of 257 characters: %d names, no error", len(names))
	}
	if n > 1<<20 {
		t.Errorf("names of 257 characters: %d MB allocated before the error", n>>20)
	}
}

// TestAdv2RendezvousPortZero: GOVERBS_PORT=0 is refused with ErrEnvValue
// naming it, as a port 0 in GOVERBS_ROOT is (no rank could reach a
// rendezvous on a port chosen by the system), and so is a negative
// EnvOptions.Port. Before, GOVERBS_PORT=0 counted as unset: every rank
// went silently to DefaultPort (18515), and a negative Port made a root
// address such as "node01:-5", refused as a bad GOVERBS_ROOT that nobody
// had set.
func TestAdv2RendezvousPortZero(t *testing.T) {
	slurm := map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "node01"}
	for _, p := range []string{"0", "00", "65536"} {
		env := map[string]string{"GOVERBS_PORT": p}
		for k, v := range slurm {
			env[k] = v
		}
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)})
		var ee *EnvError
		if !errors.Is(err, ErrEnvValue) || !errors.As(err, &ee) || ee.Var != "GOVERBS_PORT" {
			t.Errorf("GOVERBS_PORT=%s: %+v, %v; want ErrEnvValue naming GOVERBS_PORT", p, l, err)
		}
	}
	for _, p := range []int{-5, 65536} {
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(slurm), Port: p})
		if !errors.Is(err, ErrEnvValue) || !strings.Contains(err.Error(), "EnvOptions.Port") {
			t.Errorf("EnvOptions.Port %d: %+v, %v; want ErrEnvValue naming EnvOptions.Port", p, l, err)
		}
	}
	// Unset (or blank), the default; set, itself; the option wins.
	for _, tc := range []struct {
		env  map[string]string
		port int
		want string
	}{
		{slurm, 0, "node01:18515"},
		{map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "node01", "GOVERBS_PORT": " "}, 0, "node01:18515"},
		{map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "node01", "GOVERBS_PORT": "7000"}, 0, "node01:7000"},
		{map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "node01", "GOVERBS_PORT": "7000"}, 9000, "node01:9000"},
	} {
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(tc.env), Port: tc.port})
		if err != nil || l.Root != tc.want {
			t.Errorf("%v, Port %d: root %q, %v; want %q", tc.env, tc.port, l.Root, err, tc.want)
		}
	}
}

// TestRendezvousColumnOverMaxFrame: in a rendezvous, every rank's
// vector of entries is within MaxFrame, but what rank 2 is sent is not:
// ranks 0 and 1 each send it an entry of 600 bytes (their vectors, 616
// bytes, fit a MaxFrame of 1024), its column is 1227 bytes. Every rank
// fails: the root with ErrFrameTooLarge, the others aborted by it.
// Before, the root sent the column unchecked: the root and rank 1
// succeeded, rank 2 failed reading it, and the world split.
func TestRendezvousColumnOverMaxFrame(t *testing.T) {
	const n, maxFrame = 3, 1024
	lns, addrs := xListeners(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // hang guard
	defer cancel()
	out := func(r int) [][]byte {
		o := make([][]byte, n)
		for j := range o {
			o[j] = xMessage(r, j)
		}
		if r != 2 {
			o[2] = bytes.Repeat([]byte{byte(r)}, 600)
		}
		return o
	}
	ins := make([][][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		c := ExchangeConfig{Rank: r, Size: n, Mode: Rendezvous, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token"), MaxFrame: maxFrame}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ins[r], errs[r] = Exchange(ctx, c, out(r))
		}()
	}
	wg.Wait()
	for r := range n {
		t.Logf("rank %d: err %v", r, errs[r])
	}
	if !errors.Is(errs[0], ErrFrameTooLarge) {
		t.Errorf("the root: %v, want ErrFrameTooLarge", errs[0])
	}
	for r := 1; r < n; r++ {
		if !errors.Is(errs[r], ErrAborted) || !strings.Contains(errs[r].Error(), "entries for rank 2") {
			t.Errorf("rank %d: %v, want ErrAborted naming rank 2's entries", r, errs[r])
		}
	}
}

// TestBarrierTurnHonoursCtx: the barriers and Shares of one node run one
// at a time, and a call waiting for its turn stops when its ctx ends,
// with a timeout (Node.Barrier: "a timeout when ctx ends first"; doc.go:
// nothing waits past the context). Before, the turn was the barrier's
// mutex, taken with no regard for the context: a Barrier or Share whose
// ctx had ended waited for the barrier in progress, here until the test
// ended that one's.
func TestBarrierTurnHonoursCtx(t *testing.T) {
	nodes := shareWorld(t, 2, Dissemination)
	long, cancelLong := context.WithCancel(context.Background())
	defer cancelLong()
	first := make(chan error, 1)
	go func() { first <- nodes[0].Barrier(long, nil) }() // rank 1 never comes
	// Let the first barrier take the lock (it polls until long ends).
	for nodes[0].bar.mu.TryLock() {
		nodes[0].bar.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
	for _, call := range []struct {
		name string
		f    func(ctx context.Context) error
	}{
		{"Barrier", func(ctx context.Context) error { return nodes[0].Barrier(ctx, nil) }},
		{"Share", func(ctx context.Context) error { _, err := nodes[0].Share(ctx, []byte("x")); return err }},
	} {
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		done := make(chan error, 1)
		go func() { done <- call.f(ended) }()
		select {
		case err := <-done:
			if !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.Canceled) {
				t.Errorf("%s with an ended ctx, another barrier in progress: %v, want ErrTimeout and context.Canceled", call.name, err)
			}
		case <-time.After(20 * time.Second): // hang guard
			t.Errorf("%s with an ended ctx still blocked after 20 s (waiting for the barrier in progress, whose ctx has not ended)", call.name)
			cancelLong()
			<-first
			t.Logf("%s returned once the other barrier ended: %v", call.name, <-done)
			return
		}
	}
	cancelLong()
	<-first
}
