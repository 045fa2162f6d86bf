package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// Adversarial tests: what a user gets wrong and what a stranger on the
// network sends. Helpers of this file are prefixed with "adv". Contexts
// and read deadlines here are hang guards, never bounds that a test
// asserts.

// advGuard is the hang guard of these tests.
const advGuard = time.Minute

// TestAdvWorldSizeBound: a world size no process can hold (a malformed
// WORLD_SIZE, say) is an error from NewNode, an exchange and ParseLaunch,
// before anything is allocated for it; before MaxWorldSize, NewNode
// panicked in channel.NewMulti (makeslice: len out of range) and, for
// sizes it could not allocate, would have run the process out of memory.
func TestAdvWorldSizeBound(t *testing.T) {
	pd := verbstest.OpenPD(t, verbs.SoftDevice)
	for _, size := range []int{MaxWorldSize + 1, 1 << 32, 1 << 61, int(^uint(0) >> 1)} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Errorf("NewNode(%d) panicked: %v", size, p)
					}
				}()
				n, err := NewNode(pd, 0, size, NodeOptions{})
				if err == nil {
					n.Close()
					t.Errorf("NewNode(%d): no error", size)
				}
			}()
			if _, err := newExchange(ExchangeConfig{Rank: 0, Size: size, Mode: Rendezvous, Root: "127.0.0.1:1"}, nil); err == nil ||
				!strings.Contains(err.Error(), "world size") {
				t.Errorf("exchange of %d ranks: %v, want a world size error", size, err)
			}
			env := map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": fmt.Sprint(size), "GOVERBS_ROOT": "127.0.0.1:1"}
			_, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)})
			var ee *EnvError
			if !errors.Is(err, ErrEnvValue) || !errors.As(err, &ee) || ee.Var != "GOVERBS_WORLD_SIZE" {
				t.Errorf("GOVERBS_WORLD_SIZE=%d: %v, want ErrEnvValue naming the variable", size, err)
			}
		})
	}
	// The bound itself is a valid size for the checks that come before
	// any allocation.
	if _, err := ParseLaunch(EnvOptions{Lookup: advLookup(map[string]string{"GOVERBS_RANK": "0",
		"GOVERBS_WORLD_SIZE": fmt.Sprint(MaxWorldSize), "GOVERBS_ROOT": "127.0.0.1:1"})}); err != nil {
		t.Errorf("GOVERBS_WORLD_SIZE=MaxWorldSize: %v", err)
	}
}

func advLookup(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// TestAdvParseLaunchMalformed: values a launcher (or a user) may get
// wrong are refused by ParseLaunch with ErrEnvValue naming the variable,
// rather than accepted and then retried against an address that cannot
// exist until the context ends. Before, signed numbers ("+1") passed for
// ranks and ports, and hosts with spaces, colons or brackets (MASTER_ADDR
// holding host:port, a Kubernetes host pattern with a port) made roots
// such as "[h:5]:29500" that every dial failed to resolve.
func TestAdvParseLaunchMalformed(t *testing.T) {
	base := func(kv ...string) map[string]string {
		m := map[string]string{"GOVERBS_RANK": "1", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": "127.0.0.1:7000"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	torch := func(addr, port string) map[string]string {
		return map[string]string{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": addr, "MASTER_PORT": port}
	}
	for _, tc := range []struct {
		name    string
		env     map[string]string
		wantVar string
	}{
		{"signed rank", base("GOVERBS_RANK", "+1"), "GOVERBS_RANK"},
		{"signed size", base("GOVERBS_WORLD_SIZE", "+2"), "GOVERBS_WORLD_SIZE"},
		{"hex size", base("GOVERBS_WORLD_SIZE", "0x2"), "GOVERBS_WORLD_SIZE"},
		{"size with a unit", base("GOVERBS_WORLD_SIZE", "2k"), "GOVERBS_WORLD_SIZE"},
		{"size overflowing int", base("GOVERBS_WORLD_SIZE", "99999999999999999999"), "GOVERBS_WORLD_SIZE"},
		{"rank with inner space", base("GOVERBS_RANK", "1 0"), "GOVERBS_RANK"},
		{"signed local rank", base("GOVERBS_LOCAL_RANK", "+0"), "GOVERBS_LOCAL_RANK"},
		{"signed port", base("GOVERBS_PORT", "+7000"), "GOVERBS_PORT"},
		{"root with a signed port", base("GOVERBS_ROOT", "127.0.0.1:+7000"), "GOVERBS_ROOT"},
		{"root with a port name", base("GOVERBS_ROOT", "127.0.0.1:http"), "GOVERBS_ROOT"},
		{"root host with a space", base("GOVERBS_ROOT", "bad host:7000"), "GOVERBS_ROOT"},
		{"root host with a slash", base("GOVERBS_ROOT", "a/b:7000"), "GOVERBS_ROOT"},
		{"root without host", base("GOVERBS_ROOT", ":7000"), "GOVERBS_ROOT"},
		{"root with port 0", base("GOVERBS_ROOT", "127.0.0.1:0"), "GOVERBS_ROOT"},
		{"listen with a signed port", base("GOVERBS_LISTEN", ":+7000"), "GOVERBS_LISTEN"},
		{"listen with a bad host", base("GOVERBS_LISTEN", "a b:7000"), "GOVERBS_LISTEN"},
		{"listen without port", base("GOVERBS_LISTEN", "127.0.0.1"), "GOVERBS_LISTEN"},
		{"torchrun master with a port", torch("master:29500", "29500"), "MASTER_ADDR"},
		{"torchrun master in brackets", torch("[::1]", "29500"), "MASTER_ADDR"},
		{"torchrun signed master port", torch("master", "+29500"), "MASTER_PORT"},
		{"torchrun negative master port", torch("master", "-1"), "MASTER_PORT"},
		{"kubernetes pattern with a port", map[string]string{"JOB_COMPLETION_INDEX": "1", "GOVERBS_WORLD_SIZE": "2",
			"GOVERBS_HOST_PATTERN": "job-{index}:80"}, "GOVERBS_HOST_PATTERN"},
		{"kubernetes pattern with a space", map[string]string{"JOB_COMPLETION_INDEX": "1", "GOVERBS_WORLD_SIZE": "2",
			"GOVERBS_HOST_PATTERN": "job {index}"}, "GOVERBS_HOST_PATTERN"},
		{"slurm signed task count", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "+2", "SLURM_NODELIST": "n1"}, "SLURM_NTASKS"},
		{"open mpi size beyond MaxWorldSize", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1048577",
			"GOVERBS_ROOT": "h:1"}, "OMPI_COMM_WORLD_SIZE"},
		{"pmi size beyond MaxWorldSize", map[string]string{"PMI_RANK": "0", "PMI_SIZE": "4294967298", "PMI_KVSNAME": "k",
			"GOVERBS_ROOT": "h:1"}, "PMI_SIZE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := ParseLaunch(EnvOptions{Lookup: advLookup(tc.env)})
			var ee *EnvError
			if !errors.Is(err, ErrEnvValue) || !errors.As(err, &ee) {
				t.Fatalf("accepted (%+v, %v), want ErrEnvValue", l, err)
			}
			if ee.Var != tc.wantVar {
				t.Errorf("variable %q, want %q (%v)", ee.Var, tc.wantVar, err)
			}
		})
	}
	// What stays valid: IPv6 roots (with a zone too), host names with
	// dashes and dots, an explicit listen address on every interface.
	for _, env := range []map[string]string{
		base("GOVERBS_ROOT", "[::1]:7000"),
		base("GOVERBS_ROOT", "[fe80::1%lo]:7000"),
		base("GOVERBS_ROOT", "node-01.cluster.local:7000"),
		base("GOVERBS_LISTEN", ":7000"),
		base("GOVERBS_LISTEN", "[::]:7000"),
		torch("::1", "29500"),
		torch("master-0", "29500"),
	} {
		if _, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); err != nil {
			t.Errorf("%v: %v", env, err)
		}
	}
}

// advAttack is what a stranger does on a connection to a listening rank.
type advAttack struct {
	name string
	// run talks to the listener over c; it returns when it has done
	// what it came to do. The server's answer is read afterwards.
	run func(t *testing.T, c net.Conn, addr string)
	// reject: the server answers with a reject before it closes (else
	// it may answer with a hello, or nothing).
	reject bool
	// held: the server has nothing to refuse yet, and holds the
	// connection until HelloTimeout (or the stranger goes).
	held bool
	// gone: the stranger closes the connection itself.
	gone bool
}

// advHello is the hello a dialer of token, job and world sends to rank to.
func advHello(token, job string, mode Mode, items uint8, from, to, size uint32) []byte {
	mk := macKey([]byte(token))
	h := encodeHello(&hello{mode: mode, items: items, from: from, to: to, size: size, job: jobTag(mk, job), nonce: newNonce()}, mk, nil)
	return h[:]
}

// advAttacks against rank 0 of a world of 3 of job "job", token "token".
func advAttacks(mode Mode, items uint8) []advAttack {
	write := func(b []byte) func(*testing.T, net.Conn, string) {
		return func(_ *testing.T, c net.Conn, _ string) { c.Write(b) }
	}
	garbage := make([]byte, 64<<10)
	rand.Read(garbage)
	prefix := func(typ byte) []byte { return []byte{'G', 'V', 'C', 'X', frameVersion, typ, 0, 0} }
	good := advHello("token", "job", mode, items, 1, 0, 3)
	return []advAttack{
		{name: "silent", run: func(*testing.T, net.Conn, string) {}, held: true},
		{name: "garbage", run: write(garbage), reject: true},
		{name: "http", run: write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")), reject: true},
		{name: "tls client hello", run: write([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}), reject: true},
		{name: "another version", run: write([]byte{'G', 'V', 'C', 'X', 9, msgHello, 0, 0}), reject: true},
		{name: "unknown type", run: write(append(prefix(0xff), bytes.Repeat([]byte{0xff}, 1<<10)...)), reject: true},
		{name: "proof first", run: write(append(prefix(msgProof), make([]byte, proofLen-prefixLen)...)), reject: true},
		{name: "accept first", run: write(prefix(msgAccept)), reject: true},
		{name: "reject first", run: write(append(prefix(msgReject), make([]byte, rejectLen-prefixLen)...)), reject: true},
		{name: "record header of the largest length", run: write([]byte{recData, recFinal, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}), reject: true},
		{name: "truncated hello, then close", run: func(_ *testing.T, c net.Conn, _ string) {
			c.Write(good[:helloLen/2])
			c.(*net.TCPConn).CloseWrite()
		}},
		{name: "hello one byte at a time", run: func(_ *testing.T, c net.Conn, _ string) {
			for i := range helloLen - 1 {
				if _, err := c.Write(good[i : i+1]); err != nil {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}, held: true},
		{name: "hello of another token", run: write(advHello("other", "job", mode, items, 1, 0, 3)), reject: true},
		{name: "hello with a flipped MAC", run: func(_ *testing.T, c net.Conn, _ string) {
			h := bytes.Clone(good)
			h[helloLen-1] ^= 1
			c.Write(h)
		}, reject: true},
		{name: "hello of another job", run: write(advHello("token", "other", mode, items, 1, 0, 3)), reject: true},
		{name: "hello from an out-of-range rank", run: write(advHello("token", "job", mode, items, 7, 0, 3)), reject: true},
		{name: "hello from rank 0 itself", run: write(advHello("token", "job", mode, items, 0, 0, 3)), reject: true},
		{name: "hello to another rank", run: write(advHello("token", "job", mode, items, 2, 1, 3)), reject: true},
		{name: "replayed hello, no proof", run: write(good), held: true},
		{name: "replayed hello, garbage proof", run: func(_ *testing.T, c net.Conn, _ string) {
			c.Write(good)
			var b [helloLen]byte
			if _, err := io.ReadFull(c, b[:]); err == nil {
				c.Write(append(prefix(msgProof), make([]byte, macLen)...))
			}
		}, reject: true},
		{name: "reset", run: func(_ *testing.T, c net.Conn, _ string) {
			c.Write(good[:10])
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}, gone: true},
	}
}

// advDial connects to addr from the loopback address src ("": any).
func advDial(t *testing.T, addr, src string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: advGuard}
	if src != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("dial %s from %s: %v", addr, src, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// advStranger runs a on c, a connection to addr, and reads what the
// listener sends until it closes the connection: it returns those bytes
// and how the reading ended (nil: closed cleanly). The read deadline is
// a hang guard: a listener that never closes fails the test.
func advStranger(t *testing.T, c net.Conn, addr string, a advAttack) ([]byte, error) {
	defer c.Close()
	a.run(t, c, addr)
	if a.gone {
		return nil, nil
	}
	c.SetReadDeadline(time.Now().Add(advGuard))
	var got bytes.Buffer
	_, err := io.Copy(&got, io.LimitReader(c, 1<<20))
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("%s: the listener still holds the connection after %v", a.name, advGuard)
	}
	return got.Bytes(), err
}

// TestAdvStrangers: while rank 0 of a world of 3 runs its exchange (the
// all-to-all acceptor, the rendezvous root, and the root of a rendezvous
// of cards) strangers connect and send garbage, protocol messages out of
// order, truncated, forged, replayed or slow hellos, or nothing. Every
// one of them is answered with at most a reject or a hello (never more
// than the fixed-size handshake), and its connection is closed by the
// listener (those that send nothing or too slowly at HelloTimeout); the
// real ranks, which start while the strangers are there, complete the
// exchange with the right bytes, and nothing is left running.
func TestAdvStrangers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mode  Mode
		cards bool
	}{
		{"all-to-all", AllToAll, false},
		{"rendezvous", Rendezvous, false},
		{"rendezvous of cards", Rendezvous, true},
		{"all-to-all of cards", AllToAll, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			const n = 3
			var items uint8
			if tc.cards {
				items = 2
			}
			lns, addrs := xListeners(t, n)
			ctx := xContext(t, advGuard)
			cfg := func(r int) ExchangeConfig {
				return ExchangeConfig{Rank: r, Size: n, Mode: tc.mode, Addrs: addrs, Listener: lns[r], Job: "job",
					Token: []byte("token"), HelloTimeout: 200 * time.Millisecond}
			}
			type result struct {
				in  [][]byte
				col []byte
				err error
			}
			run := func(r int) <-chan result {
				done := make(chan result, 1)
				go func() {
					var res result
					if tc.cards {
						card := fmt.Appendf(nil, "card of %d", r)
						its := bytes.Repeat([]byte{byte(r)}, n*int(items))
						res.in, res.col, res.err = ExchangeCards(ctx, cfg(r), card, its)
					} else {
						res.in, res.err = Exchange(ctx, cfg(r), xOut(r, n))
					}
					done <- res
				}()
				return done
			}
			root := run(0)
			attacks := advAttacks(tc.mode, items)
			// Every stranger connects before the real ranks start; those
			// the listener can refuse at once are refused before they
			// do, the others are still there when they come.
			conns := make([]net.Conn, len(attacks))
			for i := range attacks {
				conns[i] = advDial(t, addrs[0], fmt.Sprintf("127.0.0.%d", 2+i%8))
			}
			var refused, held sync.WaitGroup
			for i, a := range attacks {
				wg := &refused
				if a.held {
					wg = &held
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					got, err := advStranger(t, conns[i], addrs[0], a)
					if errors.Is(err, syscall.ECONNRESET) {
						// The listener closed the connection with bytes
						// of the stranger unread: the reset may overtake
						// its answer.
						return
					}
					if err != nil {
						t.Errorf("%s: reading the answer: %v", a.name, err)
					}
					if len(got) > helloLen+rejectLen {
						t.Errorf("%s: the listener sent %d bytes to a stranger", a.name, len(got))
					}
					if a.reject {
						var buf [rejectLen]byte
						// The answer may begin with rank 0's hello.
						if len(got) >= helloLen && string(got[:4]) == frameMagic && got[5] == msgHello {
							got = got[helloLen:]
						}
						if b, err := readControl(bytes.NewReader(got), &buf, msgReject); err != nil {
							t.Errorf("%s: answer %q: %v, want a reject", a.name, got, err)
						} else if _, err := decodeReject(b); err != nil {
							t.Errorf("%s: %v", a.name, err)
						}
					}
				}()
			}
			refused.Wait()
			// The real ranks come while the held strangers are there.
			others := []<-chan result{run(1), run(2)}
			held.Wait()
			for r, done := range append([]<-chan result{root}, others...) {
				res := <-done
				if res.err != nil {
					t.Errorf("rank %d: %v", r, res.err)
					continue
				}
				for j := range n {
					var want []byte
					switch {
					case tc.cards:
						want = fmt.Appendf(nil, "card of %d", j)
						if wantCol := bytes.Repeat([]byte{byte(j)}, int(items)); !bytes.Equal(res.col[j*int(items):(j+1)*int(items)], wantCol) {
							t.Errorf("rank %d: item of %d is %x", r, j, res.col[j*int(items):(j+1)*int(items)])
						}
					default:
						want = xMessage(j, r)
					}
					if !bytes.Equal(res.in[j], want) {
						t.Errorf("rank %d: entry %d is %q, want %q", r, j, res.in[j], want)
					}
				}
			}
		})
	}
}

// TestAdvListenerClosed: the listener an exchange was handed
// (ExchangeConfig.Listener) is closed under it while ranks are still
// expected to connect (its owner closed it, or the launcher's socket
// went away). No rank can reach this one any more, so the exchange fails
// at once, saying so, instead of waiting for the context (here without a
// deadline: it hung before, until the hang guard).
func TestAdvListenerClosed(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, 3)
			// The accept loop must have started before the close, or
			// the exchange would fail to start rather than while it runs:
			// a stranger proves it (it is refused, so the loop runs).
			done := xGo(context.Background(), ExchangeConfig{Rank: 0, Size: 3, Mode: mode, Addrs: addrs, Listener: lns[0],
				Job: "job", Token: []byte("token")})
			c := advDial(t, addrs[0], "")
			c.Write([]byte("GET / HT"))
			io.Copy(io.Discard, c)
			lns[0].Close()
			var r xResult
			select {
			case r = <-done:
			case <-time.After(advGuard):
				t.Fatal("the exchange still waits for ranks that cannot reach it")
			}
			var xe *ExchangeError
			if !errors.As(r.err, &xe) || !errors.Is(r.err, net.ErrClosed) {
				t.Fatalf("%v: want an *ExchangeError wrapping net.ErrClosed", r.err)
			}
			t.Log(r.err)
		})
	}
}

// TestAdvCancel: cancelling the context ends every blocking call of an
// exchange at once, with an error wrapping context.Canceled (and
// ErrPeerMissing where a peer never came), leaving no goroutine behind:
// a root waiting for its ranks, a leaf and a dialer dialing a peer that
// is not there, a leaf waiting for the root's answer after its share was
// taken, an all-to-all acceptor holding one peer and waiting for
// another, and every role with a context cancelled before the call.
func TestAdvCancel(t *testing.T) {
	type setup struct {
		mode Mode
		rank int
		// before starts what the rank under test waits on (other ranks).
		before func(t *testing.T, ctx context.Context, addrs []string, lns []net.Listener)
	}
	peer := func(rank int) func(*testing.T, context.Context, []string, []net.Listener) {
		return func(t *testing.T, ctx context.Context, addrs []string, lns []net.Listener) {
			t.Helper()
			done := xGo(ctx, ExchangeConfig{Rank: rank, Size: 3, Addrs: addrs, Listener: lns[rank], Job: "job", Token: []byte("token"),
				Mode: map[bool]Mode{true: Rendezvous, false: AllToAll}[strings.Contains(t.Name(), "rendezvous")]})
			t.Cleanup(func() { <-done })
		}
	}
	for _, tc := range []struct {
		name string
		setup
		missing bool // ErrPeerMissing expected
	}{
		{"rendezvous root, no rank", setup{Rendezvous, 0, nil}, true},
		{"rendezvous root, one rank of two", setup{Rendezvous, 0, peer(1)}, true},
		{"rendezvous leaf, no root", setup{Rendezvous, 1, nil}, true},
		{"rendezvous leaf, waiting for the root's answer", setup{Rendezvous, 1, peer(0)}, true},
		{"all-to-all acceptor, no peer", setup{AllToAll, 0, nil}, true},
		{"all-to-all dialer, no peer", setup{AllToAll, 2, nil}, true},
		{"all-to-all middle, one peer of two", setup{AllToAll, 1, peer(2)}, true},
	} {
		for _, early := range []bool{false, true} {
			name := tc.name
			if early {
				name += ", cancelled before"
			}
			t.Run(name, func(t *testing.T) {
				xNoLeaks(t)
				lns, addrs := xListeners(t, 3)
				// The other ranks run until the end of the test.
				others, stop := context.WithCancel(context.Background())
				t.Cleanup(stop)
				if tc.before != nil {
					tc.before(t, others, addrs, lns)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if early {
					cancel()
				}
				done := xGo(ctx, ExchangeConfig{Rank: tc.rank, Size: 3, Mode: tc.mode, Addrs: addrs, Listener: lns[tc.rank],
					Job: "job", Token: []byte("token")})
				if !early {
					// Let the call block (a guess: early or late, the
					// result must be the same).
					time.Sleep(50 * time.Millisecond)
					cancel()
				}
				var r xResult
				select {
				case r = <-done:
				case <-time.After(advGuard):
					t.Fatal("cancelled, the exchange still runs")
				}
				if !errors.Is(r.err, context.Canceled) {
					t.Errorf("%v: want context.Canceled", r.err)
				}
				if tc.missing && !errors.Is(r.err, ErrPeerMissing) {
					t.Errorf("%v: want ErrPeerMissing", r.err)
				}
				var xe *ExchangeError
				if !errors.As(r.err, &xe) || xe.Rank != tc.rank {
					t.Errorf("%v: want an *ExchangeError of rank %d", r.err, tc.rank)
				}
				stop()
			})
		}
	}
}

// TestAdvSlowStrangersDropped: strangers that connect and then send
// nothing, a hello one byte at a time, or a replayed hello and no proof
// (slow-loris) are each dropped by the listener at HelloTimeout while the
// exchange goes on: their connections end without the exchange ending,
// the real rank that comes next completes it, and a root whose rank never
// comes counts them as dropped in its error.
func TestAdvSlowStrangersDropped(t *testing.T) {
	for _, mode := range xModes {
		for _, peerComes := range []bool{true, false} {
			t.Run(fmt.Sprintf("%v/peer comes %v", mode, peerComes), func(t *testing.T) {
				xNoLeaks(t)
				lns, addrs := xListeners(t, 2)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				done := xGo(ctx, ExchangeConfig{Rank: 0, Size: 2, Mode: mode, Addrs: addrs, Listener: lns[0],
					Job: "job", Token: []byte("token"), HelloTimeout: 100 * time.Millisecond})
				var slow []advAttack
				for _, a := range advAttacks(mode, 0) {
					if a.held {
						slow = append(slow, a)
					}
				}
				var wg sync.WaitGroup
				for i, a := range slow {
					c := advDial(t, addrs[0], fmt.Sprintf("127.0.0.%d", 2+i))
					wg.Add(1)
					go func() {
						defer wg.Done()
						if _, err := advStranger(t, c, addrs[0], a); err != nil && !errors.Is(err, syscall.ECONNRESET) {
							t.Errorf("%s: %v", a.name, err)
						}
					}()
				}
				wg.Wait() // every slow stranger's connection ended
				select {
				case r := <-done:
					t.Fatalf("the exchange ended with the strangers: %v", r.err)
				default:
				}
				if !peerComes {
					cancel()
					r := <-done
					var xe *ExchangeError
					if !errors.As(r.err, &xe) || xe.Dropped != len(slow) || !errors.Is(r.err, ErrPeerMissing) {
						t.Fatalf("%v: want ErrPeerMissing with %d dropped", r.err, len(slow))
					}
					return
				}
				in, err := Exchange(ctx, ExchangeConfig{Rank: 1, Size: 2, Mode: mode, Addrs: addrs, Job: "job", Token: []byte("token")}, xOut(1, 2))
				if err != nil || !bytes.Equal(in[0], xMessage(0, 1)) {
					t.Fatalf("rank 1: %q, %v", in, err)
				}
				if r := <-done; r.err != nil || !bytes.Equal(r.in[1], xMessage(1, 0)) {
					t.Fatalf("rank 0: %q, %v", r.in, r.err)
				}
			})
		}
	}
}

// advFDs counts this process' open descriptors.
func advFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return len(ents)
}

// TestAdvFlood: 300 connections at once from 8 loopback addresses, each
// sending nothing, against a root and an all-to-all acceptor that hold at
// most 16 strangers (4 per address) and would wait an hour for a hello.
// The real ranks, which come while the flood is queued, complete the
// exchange; every flooding connection is closed by the listener (the
// gate drops the oldest) or when the exchange ends; and when it is over,
// no descriptor and no goroutine is left.
func TestAdvFlood(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			xNoLeaks(t)
			fds := advFDs(t)
			lns, addrs := xListeners(t, 3)
			ctx := xContext(t, advGuard)
			cfg := func(r int) ExchangeConfig {
				return ExchangeConfig{Rank: r, Size: 3, Mode: mode, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token"),
					MaxStrangers: 16, MaxStrangersPerHost: 4, HelloTimeout: time.Hour}
			}
			root := xGo(ctx, cfg(0))
			const flood = 300
			conns := make([]net.Conn, flood)
			for i := range conns {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(2+i%8))}}
				c, err := d.DialContext(ctx, "tcp", addrs[0])
				if err != nil {
					t.Fatalf("flood connection %d: %v", i, err)
				}
				conns[i] = c
			}
			r1, r2 := xGo(ctx, cfg(1)), xGo(ctx, cfg(2))
			for r, done := range []<-chan xResult{root, r1, r2} {
				res := <-done
				if res.err != nil {
					t.Fatalf("rank %d: %v", r, res.err)
				}
				for j := range 3 {
					if !bytes.Equal(res.in[j], xMessage(j, r)) {
						t.Errorf("rank %d: entry %d is %q", r, j, res.in[j])
					}
				}
			}
			// The exchange is over: every flooding connection was closed
			// by the listener.
			for i, c := range conns {
				c.SetReadDeadline(time.Now().Add(advGuard))
				n, err := io.Copy(io.Discard, c)
				if errors.Is(err, os.ErrDeadlineExceeded) || n > 0 {
					t.Errorf("flood connection %d: %d bytes, %v", i, n, err)
				}
				c.Close()
			}
			for _, ln := range lns {
				ln.Close()
			}
			if got := advFDs(t); got > fds {
				t.Errorf("%d descriptors open after the exchange, %d before", got, fds)
			}
		})
	}
}

// TestAdvRankTwice: a rank started twice (two processes given the same
// rank). In a rendezvous the root takes the first twin and refuses the
// second (ErrBadFrame: the rank already connected), which fails at once
// while the world completes (a second twin that comes once the root is
// done finds no listener and fails when its context ends, here when
// ranks 0 and 1 have returned). All-to-all, each acceptor takes whichever
// twin came first: a twin is refused (ErrBadFrame) where the other came
// first, or finds the listeners gone once the world is done (it then
// fails when its context ends, here when ranks 0 and 1 have returned);
// ranks 0 and 1 complete, or fail with ErrPeerLost naming the twin's
// rank if the twin they took went away (or the rank that failed because
// of it), or when the job ends because a rank failed. No run hangs.
func TestAdvRankTwice(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			xNoLeaks(t)
			const n = 3
			twin := n - 1
			lns, addrs := xListeners(t, n)
			ctx := xContext(t, advGuard)
			twins, stopTwins := context.WithCancel(ctx)
			defer stopTwins()
			cfg := func(r int) ExchangeConfig {
				c := ExchangeConfig{Rank: r, Size: n, Mode: mode, Addrs: addrs, Job: "job", Token: []byte("token")}
				if r != twin {
					c.Listener = lns[r]
				}
				return c
			}
			// All-to-all, a rank that fails goes away, and a rank that
			// has still to dial it would wait for it until its context
			// ends: the job ends when a rank fails, as a launcher ends
			// it (that is the missing rank of TestExchangeMissingRank).
			world, endWorld := context.WithCancel(ctx)
			defer endWorld()
			if mode == Rendezvous {
				world = ctx
			}
			var runs []<-chan xResult
			for i, c := range []context.Context{world, world, twins, twins} {
				done := make(chan xResult, 1)
				go func() {
					r := <-xGo(c, cfg(min(i, twin)))
					if r.err != nil && mode == AllToAll {
						endWorld()
					}
					done <- r
				}()
				runs = append(runs, done)
			}
			res := make([]xResult, len(runs))
			res[0], res[1] = <-runs[0], <-runs[1]
			if mode == AllToAll {
				stopTwins() // a twin that found nobody gives up
				res[2], res[3] = <-runs[2], <-runs[3]
			} else {
				// The first twin to return is refused (the other one
				// is the root's and completes) or completed (the other
				// is refused, or finds nobody and gives up).
				select {
				case res[2] = <-runs[2]:
					if res[2].err == nil {
						stopTwins()
					}
					res[3] = <-runs[3]
				case res[3] = <-runs[3]:
					if res[3].err == nil {
						stopTwins()
					}
					res[2] = <-runs[2]
				}
			}
			refused, ok := 0, 0
			for i, r := range res {
				rank := min(i, twin)
				if r.err == nil {
					if rank == twin {
						ok++
					}
					for j := range n {
						if !bytes.Equal(r.in[j], xMessage(j, rank)) {
							t.Errorf("rank %d (run %d): entry %d is %q", rank, i, j, r.in[j])
						}
					}
					continue
				}
				t.Logf("run %d (rank %d): %v", i, rank, r.err)
				var xe *ExchangeError
				switch {
				case rank == twin && errors.Is(r.err, ErrBadFrame) && strings.Contains(r.err.Error(), "already did"):
					refused++
				case rank == twin && errors.Is(r.err, context.Canceled):
				case mode == AllToAll && errors.As(r.err, &xe) && xe.Peer >= 0 && errors.Is(r.err, ErrPeerLost):
					// The twin it took went away, or a rank that failed
					// because of it.
				case mode == AllToAll && errors.Is(r.err, context.Canceled):
					// The job ended as a rank failed.
				default:
					t.Errorf("run %d (rank %d): unexpected %v", i, rank, r.err)
				}
			}
			if mode == Rendezvous && (res[0].err != nil || res[1].err != nil || ok != 1) {
				t.Errorf("rendezvous: %d twins refused, %d succeeded; want the world complete with one twin", refused, ok)
			}
		})
	}
}

// advNodes builds n connected nodes in this process (shareWorld), with
// leak checks.
func advNodes(t *testing.T, n int) []*Node { return shareWorld(t, n, Dissemination) }

// TestAdvMalformedCards: a peer's card and item, as ConnectCards and
// Connect decode them, cut at every length, with every byte flipped, and
// mutated at random: decoding never panics, every cut and every change
// of the header (magic, version, rank, world size) is refused naming
// the rank, and what decodes is then checked by the barrier's setRemote
// without a panic either.
func TestAdvMalformedCards(t *testing.T) {
	verbsCheck := func(f func()) (p any) {
		defer func() { p = recover() }()
		f()
		return nil
	}
	const n = 2
	pd := verbstest.OpenPD(t, verbs.SoftDevice)
	nodes := make([]*Node, n)
	cards := make([][]byte, n)
	items := make([][]byte, n)
	var err error
	for i := range nodes {
		if nodes[i], err = NewNode(pd, i, n, NodeOptions{}); err != nil {
			t.Fatal(err)
		}
		defer nodes[i].Close()
		if cards[i], items[i], err = nodes[i].LocalCard([]byte("app")); err != nil {
			t.Fatal(err)
		}
	}
	card, item := cards[1], items[1][:ItemSize] // rank 1's for rank 0
	try := func(what string, c, it []byte) error {
		var err error
		if p := verbsCheck(func() {
			var pi peerInfo
			if pi, err = decodeCard(c, it, 1, 0, n); err != nil {
				if !strings.Contains(err.Error(), "rank 1's card") {
					t.Errorf("%s: %v does not name rank 1", what, err)
				}
				return
			}
			err = nodes[0].bar.setRemote([][]byte{nodes[0].bar.localInfo(), pi.info})
		}); p != nil {
			t.Fatalf("%s: panic: %v", what, p)
		}
		return err
	}
	if err := try("the card itself", card, item); err != nil {
		t.Fatal(err)
	}
	for l := range len(card) {
		if try(fmt.Sprintf("cut at %d", l), card[:l], item) == nil {
			t.Errorf("card cut at %d of %d bytes accepted", l, len(card))
		}
	}
	if try("one byte more", append(bytes.Clone(card), 0), item) == nil {
		t.Error("card with a trailing byte accepted")
	}
	for i := range card {
		c := bytes.Clone(card)
		c[i] ^= 0xff
		if err := try(fmt.Sprintf("byte %d flipped", i), c, item); err == nil && i < cardHdr {
			t.Errorf("card with header byte %d flipped accepted", i)
		}
	}
	for l := range ItemSize + 2 {
		it := make([]byte, l)
		copy(it, item)
		if err := try(fmt.Sprintf("item of %d bytes", l), card, it); err == nil && l != ItemSize {
			t.Errorf("item of %d bytes accepted", l)
		}
	}
	rng := mrand.New(mrand.NewPCG(1, 2))
	for i := range 5000 {
		c := bytes.Clone(card)
		for range 1 + rng.IntN(4) {
			c[rng.IntN(len(c))] = byte(rng.Uint32())
		}
		it := bytes.Clone(item)
		if i%2 == 0 {
			it[rng.IntN(len(it))] = byte(rng.Uint32())
		}
		try(fmt.Sprintf("mutation %d", i), c, it)
	}
	// The same through Connect's message wrapper.
	out, err := func() ([][]byte, error) {
		n2, err := NewNode(pd, 1, n, NodeOptions{})
		if err != nil {
			return nil, err
		}
		defer n2.Close()
		return n2.LocalEndpoints(nil)
	}()
	if err != nil {
		t.Fatal(err)
	}
	msg := out[0]
	for l := range len(msg) {
		if p := verbsCheck(func() { decodePeer(msg[:l], 1, 0, n) }); p != nil {
			t.Fatalf("message cut at %d: panic: %v", l, p)
		}
	}
}

// TestAdvNodeAfterClose: Close during a barrier and during a Share that
// wait for a rank that never comes ends them with an error, and every
// call after Close fails with ErrNodeState (Barrier, Share, Fail,
// LocalCard, LocalEndpoints, ConnectCards, Connect) without touching
// the closed channel; Close is idempotent, and nothing leaks (shareWorld
// checks verbs objects and goroutines).
func TestAdvNodeAfterClose(t *testing.T) {
	for _, op := range []string{"barrier", "share"} {
		t.Run(op, func(t *testing.T) {
			nodes := advNodes(t, 2)
			errc := make(chan error, 1)
			go func() {
				ctx := xContext(t, advGuard)
				var err error
				if op == "barrier" {
					err = nodes[0].Barrier(ctx, nil) // rank 1 never comes
				} else {
					_, err = nodes[0].Share(ctx, []byte("x"))
				}
				errc <- err
			}()
			time.Sleep(20 * time.Millisecond) // (a guess: the wait may not have started; either way it must end)
			if err := nodes[0].Close(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-errc:
				if err == nil {
					t.Fatalf("%s during Close: no error", op)
				}
				if !errors.Is(err, channel.ErrClosed) && !errors.Is(err, ErrNodeState) {
					t.Errorf("%s during Close: %v, want ErrClosed or ErrNodeState", op, err)
				}
			case <-time.After(advGuard):
				t.Fatalf("%s still waits after Close", op)
			}
			ctx := xContext(t, advGuard)
			nd := nodes[0]
			if err := nd.Barrier(ctx, nil); !errors.Is(err, ErrNodeState) {
				t.Errorf("Barrier after Close: %v", err)
			}
			if _, err := nd.Share(ctx, nil); !errors.Is(err, ErrNodeState) {
				t.Errorf("Share after Close: %v", err)
			}
			if err := nd.Fail(1, errors.New("x")); !errors.Is(err, ErrNodeState) {
				t.Errorf("Fail after Close: %v", err)
			}
			if _, _, err := nd.LocalCard(nil); !errors.Is(err, ErrNodeState) {
				t.Errorf("LocalCard after Close: %v", err)
			}
			if _, err := nd.LocalEndpoints(nil); !errors.Is(err, ErrNodeState) {
				t.Errorf("LocalEndpoints after Close: %v", err)
			}
			if err := nd.ConnectCards(make([][]byte, 2), make([]byte, 2*ItemSize)); !errors.Is(err, ErrNodeState) {
				t.Errorf("ConnectCards after Close: %v", err)
			}
			if err := nd.Connect(make([][]byte, 2)); !errors.Is(err, ErrNodeState) {
				t.Errorf("Connect after Close: %v", err)
			}
			if err := nd.Err(); err != nil {
				t.Errorf("Err after Close: %v", err)
			}
			if err := nd.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		})
	}
}

// TestAdvBarrierCancel: a barrier whose context is cancelled while a
// rank is missing fails with the context's error (and verbs.ErrTimeout),
// poisons the barrier of that rank (ErrPoisoned) until every rank calls
// ResetBarrier, after which the world's barriers and Shares work again.
// A context cancelled before the call fails the same way but signals
// nothing and poisons nothing: the world's next barrier works without a
// reset.
func TestAdvBarrierCancel(t *testing.T) {
	for _, early := range []bool{false, true} {
		t.Run(fmt.Sprintf("cancelled before %v", early), func(t *testing.T) {
			nodes := advNodes(t, 3)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if early {
				cancel()
			} else {
				time.AfterFunc(20*time.Millisecond, cancel)
			}
			err := nodes[0].Barrier(ctx, nil) // ranks 1 and 2 do not come
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%v: want context.Canceled", err)
			}
			guard := xContext(t, advGuard)
			if !early {
				// Signals went out: poisoned until every rank resets.
				if err := nodes[0].Barrier(guard, nil); !errors.Is(err, ErrPoisoned) {
					t.Errorf("barrier after the cancelled one: %v, want ErrPoisoned", err)
				}
				for _, nd := range nodes {
					if err := nd.ResetBarrier(); err != nil {
						t.Fatal(err)
					}
				}
			}
			errs := shareAll(nodes, func(nd *Node) error {
				if err := nd.Barrier(guard, nil); err != nil {
					return err
				}
				got, err := nd.Share(guard, []byte{byte(nd.Rank())})
				if err != nil {
					return err
				}
				for j, b := range got {
					if !bytes.Equal(b, []byte{byte(j)}) {
						return fmt.Errorf("rank %d: share of %d is %x", nd.Rank(), j, b)
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d after the reset: %v", r, err)
				}
			}
		})
	}
}

// TestAdvNodeListNameLength: a Slurm node list whose names are longer
// than a host name may be (253 characters) is refused, so that what a
// list expands to is bounded by MaxNodeList names of at most 253 bytes
// whatever the length of its text. Before, "<2000 x a>[0-65535]" expanded
// to 65536 names of 2005 bytes (131 MB; an environment variable of
// 128 KiB, Linux's bound, would have made 8 GiB), and ParseLaunch took
// the first as rank 0's host.
func TestAdvNodeListNameLength(t *testing.T) {
	long := strings.Repeat("a", 2000)
	name253 := strings.Repeat("n", 250)
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{long + "[0-65535]", false},
		{long, false},
		{"n[1-2]" + long, false},
		{"r[1-2]-" + strings.Repeat("b", 250) + "[1-2]", false},
		{strings.Repeat("c", 254), false},
		{strings.Repeat("c", 253), true},
		{name253 + "[1-999]", true}, // 253 characters at most
		{name253 + "[1-1000]", false},
	} {
		names, err := ExpandNodeList(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("%.20q... (%d bytes): %d names, %v; want ok %v", tc.in, len(tc.in), len(names), err, tc.ok)
		}
		for _, n := range names {
			if len(n) > 253 {
				t.Fatalf("%.20q...: name of %d bytes", tc.in, len(n))
			}
		}
	}
	env := map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": long + "[0-1]"}
	if _, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); !errors.Is(err, ErrEnvValue) {
		t.Errorf("Slurm node list of long names: %v, want ErrEnvValue", err)
	}
}

// TestAdvLeafDiesInGather: in a rendezvous, a rank that sent the root its
// share and then died (its connection closed) while the root still waits
// for another rank makes the root fail at once with ErrPeerLost naming
// it, and tell the ranks still connected (ErrAborted), as the package
// documentation says of a rank that dies after its handshake. Before,
// the root kept the dead rank's connection unwatched until the last rank
// came: with a context without deadline it waited for ever (here, until
// the hang guard), and once the last rank came it could report success
// to everyone, its one-record write to the dead rank landing in the
// socket's buffer.
func TestAdvLeafDiesInGather(t *testing.T) {
	for _, cards := range []bool{false, true} {
		t.Run(fmt.Sprintf("cards %v", cards), func(t *testing.T) {
			xNoLeaks(t)
			const n = 4
			lns, addrs := xListeners(t, n)
			cfg := func(r int) ExchangeConfig {
				return ExchangeConfig{Rank: r, Size: n, Mode: Rendezvous, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token")}
			}
			root := make(chan error, 1)
			go func() {
				var err error
				if cards {
					_, _, err = ExchangeCards(context.Background(), cfg(0), []byte("card"), make([]byte, n))
				} else {
					_, err = Exchange(context.Background(), cfg(0), xOut(0, n))
				}
				root <- err
			}()
			ctx := xContext(t, advGuard)
			// Ranks 1 and 2 (played by the test) connect and send their
			// shares; then rank 1 dies. Rank 3 never comes.
			leaf := func(r int) *conn {
				x, err := newExchange(cfg(r), xOut(r, n))
				if err != nil {
					t.Fatal(err)
				}
				share := encodeVector(x.out)
				if cards {
					if x, err = newCardExchange(cfg(r), []byte("card"), make([]byte, n)); err != nil {
						t.Fatal(err)
					}
					share = encodeCardShare(x.card, x.itemBuf)
				}
				k, err := x.dial(ctx, 0, addrs[0])
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { k.stopWatch(); k.c.Close() })
				if err := x.send(k, share); err != nil {
					t.Fatal(err)
				}
				return k
			}
			k2 := leaf(2)
			k1 := leaf(1)
			k1.stopWatch()
			k1.c.Close()
			leaf2 := awaitAnswer(k2)
			var rootErr, leafErr error
			select {
			case rootErr = <-root:
			case <-time.After(advGuard):
				t.Fatal("the root still waits after rank 1 died")
			}
			var xe *ExchangeError
			if !errors.As(rootErr, &xe) || xe.Peer != 1 || !errors.Is(rootErr, ErrPeerLost) {
				t.Errorf("root: %v, want ErrPeerLost naming rank 1", rootErr)
			}
			select {
			case leafErr = <-leaf2:
			case <-time.After(advGuard):
				t.Fatal("rank 2 still waits after the root failed")
			}
			// Whether or not the root had read rank 2's share yet
			// (TestAdvAbortReachesRankBeforeShare), rank 2 is told why.
			if !errors.Is(leafErr, ErrAborted) || !strings.Contains(leafErr.Error(), "peer 1") {
				t.Errorf("rank 2: %v, want ErrAborted with the root's reason (peer 1)", leafErr)
			}
			t.Log(rootErr)
			t.Log(leafErr)
		})
	}
}

// awaitAnswer reads the root's answer on a rank's connection k: an abort
// becomes ErrAborted with the root's reason; anything else is an error.
func awaitAnswer(k *conn) <-chan error {
	ch := make(chan error, 1)
	go func() {
		typ, msg, err := k.s.readMsg(k.c, DefaultMaxFrame)
		if err == nil && typ == recAbort {
			err = fmt.Errorf("%w: %s", ErrAborted, msg)
		} else if err == nil {
			err = fmt.Errorf("the root answered with a message of type %d (%d bytes)", typ, len(msg))
		}
		ch <- err
	}()
	return ch
}

// TestAdvAbortReachesRankBeforeShare: in a rendezvous, a rank past its
// handshake whose share the root has not read yet (here: it has sent
// none) when another rank dies is told why the root gives up (ErrAborted
// naming the dead rank), as the ranks whose shares were read are. Before,
// the root closed its connection without a word: the rank saw the
// connection end (or, with its share unread at the root, reset), and
// TestAdvLeafDiesInGather had to accept a reset now and then.
func TestAdvAbortReachesRankBeforeShare(t *testing.T) {
	xNoLeaks(t)
	const n = 3
	lns, addrs := xListeners(t, n)
	cfg := func(r int) ExchangeConfig {
		return ExchangeConfig{Rank: r, Size: n, Mode: Rendezvous, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token")}
	}
	root := make(chan error, 1)
	go func() {
		_, err := Exchange(context.Background(), cfg(0), xOut(0, n))
		root <- err
	}()
	ctx := xContext(t, advGuard)
	dial := func(r int) (*exchange, *conn) {
		x, err := newExchange(cfg(r), xOut(r, n))
		if err != nil {
			t.Fatal(err)
		}
		k, err := x.dial(ctx, 0, addrs[0])
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { k.stopWatch(); k.c.Close() })
		return x, k
	}
	_, k2 := dial(2) // past its handshake; its share never comes
	x1, k1 := dial(1)
	if err := x1.send(k1, encodeVector(x1.out)); err != nil {
		t.Fatal(err)
	}
	k1.stopWatch()
	k1.c.Close() // rank 1 dies after its share
	leaf2 := awaitAnswer(k2)
	select {
	case err := <-root:
		var xe *ExchangeError
		if !errors.As(err, &xe) || xe.Peer != 1 || !errors.Is(err, ErrPeerLost) {
			t.Errorf("root: %v, want ErrPeerLost naming rank 1", err)
		}
	case <-time.After(advGuard):
		t.Fatal("the root still waits after rank 1 died")
	}
	select {
	case err := <-leaf2:
		if !errors.Is(err, ErrAborted) || !strings.Contains(err.Error(), "peer 1") {
			t.Errorf("rank 2: %v, want ErrAborted with the root's reason (peer 1)", err)
		}
	case <-time.After(advGuard):
		t.Fatal("rank 2 still waits after the root failed")
	}
}

// TestAdvRankLeavesDuringBarrier: in a world of 3 (in this process), rank
// 1 closes its node (it leaves, as a process that exits does) while ranks
// 0 and 2 wait for it in a barrier and in a Share: both fail with a
// *RankError naming rank 1, wrapping ErrPeerLost, before their context
// (the hang guard) ends; Err then reports the same failure, and the next
// barrier fails at once with ErrPoisoned wrapping it.
func TestAdvRankLeavesDuringBarrier(t *testing.T) {
	for _, op := range []string{"barrier", "share"} {
		t.Run(op, func(t *testing.T) {
			nodes := advNodes(t, 3)
			ctx := xContext(t, advGuard)
			errs := make([]error, 3)
			var wg sync.WaitGroup
			for _, r := range []int{0, 2} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if op == "barrier" {
						errs[r] = nodes[r].Barrier(ctx, nil)
					} else {
						_, errs[r] = nodes[r].Share(ctx, []byte{byte(r)})
					}
				}()
			}
			time.Sleep(20 * time.Millisecond) // (a guess: they may not wait yet; either way they must fail)
			if err := nodes[1].Close(); err != nil {
				t.Fatal(err)
			}
			wg.Wait()
			for _, r := range []int{0, 2} {
				var re *RankError
				if !errors.As(errs[r], &re) || re.Rank != 1 || !errors.Is(errs[r], ErrPeerLost) || ctx.Err() != nil {
					t.Errorf("rank %d: %v, want a *RankError naming rank 1 (ErrPeerLost) before the guard", r, errs[r])
					continue
				}
				if err := nodes[r].Err(); !errors.As(err, &re) || re.Rank != 1 {
					t.Errorf("rank %d: Err() = %v", r, err)
				}
				if err := nodes[r].Barrier(ctx, nil); !errors.Is(err, ErrPoisoned) || !errors.As(err, &re) || re.Rank != 1 {
					t.Errorf("rank %d: next barrier: %v, want ErrPoisoned naming rank 1", r, err)
				}
			}
		})
	}
}

// TestAdvMalformedShares: a member of the job (it knows the token) sends
// the rendezvous root a share that is not one: a vector of the wrong
// count, truncated, with bytes after it, a card share with items of the
// wrong size or a card larger than the world allows, a message over
// MaxFrame, an empty message. The root fails at once, naming the rank,
// with ErrBadFrame or ErrFrameTooLarge (reading no more than MaxFrame of
// the message), and the other ranks waiting for it fail at once too.
func TestAdvMalformedShares(t *testing.T) {
	const n, w = 3, 2
	const maxFrame = 64 << 10
	card := []byte("card")
	for _, tc := range []struct {
		name  string
		cards bool
		share []byte
		want  error
	}{
		{"empty message", false, nil, ErrBadFrame},
		{"vector of 2 entries for 3 ranks", false, encodeVector([][]byte{{1}, {2}}), ErrBadFrame},
		{"vector of 4 entries for 3 ranks", false, encodeVector([][]byte{{1}, {2}, {3}, {4}}), ErrBadFrame},
		{"truncated vector", false, encodeVector(xOut(1, n))[:10], ErrBadFrame},
		{"bytes after the vector", false, append(encodeVector(xOut(1, n)), 0), ErrBadFrame},
		{"entry length beyond the message", false, []byte{0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff}, ErrBadFrame},
		{"message over MaxFrame", false, make([]byte, 4*maxFrame), ErrFrameTooLarge},
		{"card share of 3 entries", true, encodeVector([][]byte{card, make([]byte, n*w), nil}), ErrBadFrame},
		{"card share with short items", true, encodeCardShare(card, make([]byte, n*w-1)), ErrBadFrame},
		{"card share with long items", true, encodeCardShare(card, make([]byte, n*w+1)), ErrBadFrame},
		{"card too large for the world", true, encodeCardShare(make([]byte, maxFrame/n), make([]byte, n*w)), ErrFrameTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, n)
			cfg := func(r int) ExchangeConfig {
				return ExchangeConfig{Rank: r, Size: n, Mode: Rendezvous, Addrs: addrs, Listener: lns[r], Job: "job",
					Token: []byte("token"), MaxFrame: maxFrame}
			}
			ctx := xContext(t, advGuard)
			root := make(chan error, 1)
			go func() {
				var err error
				if tc.cards {
					_, _, err = ExchangeCards(ctx, cfg(0), card, make([]byte, n*w))
				} else {
					_, err = Exchange(ctx, cfg(0), xOut(0, n))
				}
				root <- err
			}()
			// Rank 2 (played by the test) connects and sends its share,
			// then rank 1, a member of the job, sends a bad one.
			dial := func(r int) (*exchange, *conn) {
				var x *exchange
				var err error
				if tc.cards {
					x, err = newCardExchange(cfg(r), card, make([]byte, n*w))
				} else {
					x, err = newExchange(cfg(r), xOut(r, n))
				}
				if err != nil {
					t.Fatal(err)
				}
				k, err := x.dial(ctx, 0, addrs[0])
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { k.stopWatch(); k.c.Close() })
				return x, k
			}
			x2, k2 := dial(2)
			share2 := encodeVector(x2.out)
			if tc.cards {
				share2 = encodeCardShare(x2.card, x2.itemBuf)
			}
			if err := x2.send(k2, share2); err != nil {
				t.Fatal(err)
			}
			x, k := dial(1)
			x.send(k, tc.share) // the root may stop reading before the end
			err := <-root
			var xe *ExchangeError
			if !errors.As(err, &xe) || xe.Peer != 1 || !errors.Is(err, tc.want) {
				t.Errorf("root: %v, want %v naming rank 1", err, tc.want)
			}
			// Rank 1 is told why, or sees its connection end.
			if _, err := x.recv(ctx, k); err == nil {
				t.Errorf("rank 1 got an answer")
			}
			// Rank 2 is told why (ErrAborted) if the root had taken its
			// share, or sees the root go (ErrPeerLost) if not yet.
			if _, err := x2.recv(ctx, k2); !errors.Is(err, ErrAborted) && !errors.Is(err, ErrPeerLost) {
				t.Errorf("rank 2: %v, want ErrAborted or ErrPeerLost", err)
			}
		})
	}
}

// TestAdvConfigAddressAliases: two ranks of a configuration at the same
// address written two ways (an IPv6 address compressed or not, or in
// capitals, an IPv4 address and its IPv4-mapped IPv6 form, a host name
// in two cases: DNS names are case-insensitive) are refused by Validate with
// ErrDuplicateAddress, as the same text twice is. Before, they passed
// Validate, and the configuration failed only at Join, when the second
// of the two ranks could not listen on the address the first held.
func TestAdvConfigAddressAliases(t *testing.T) {
	for _, tc := range [][2]string{
		{"::1", "0:0:0:0:0:0:0:1"},
		{"127.0.0.1", "::ffff:127.0.0.1"},
		{"fe80::1", "FE80:0::1"},
		{"node1.cluster", "NODE1.Cluster"},
	} {
		cfg := &Config{Hosts: []Host{{Hostname: tc[0], Port: 7000, Rank: 0}, {Hostname: tc[1], Port: 7000, Rank: 1}}}
		if err := cfg.Validate(); !errors.Is(err, ErrDuplicateAddress) {
			t.Errorf("%q and %q: %v, want ErrDuplicateAddress", tc[0], tc[1], err)
		}
	}
	// Not aliases: other hosts.
	for _, tc := range [][2]string{
		{"127.0.0.1", "127.0.0.2"},
		{"node1", "node10"},
	} {
		cfg := &Config{Hosts: []Host{{Hostname: tc[0], Port: 7000, Rank: 0}, {Hostname: tc[1], Port: 7000, Rank: 1}}}
		if err := cfg.Validate(); err != nil {
			t.Errorf("%q and %q: %v", tc[0], tc[1], err)
		}
	}
}

// TestAdvFailDuringClose: Node.Fail and Node.Err check that the node is
// connected and then read the barrier's poison word; Close may release
// the barrier's memory in between (it changes the phase, then closes the
// barrier). The state of that window, the barrier closed while the node
// still looks connected, is made here by closing the barrier first: Fail
// and Err return the failure recorded, or nil, without reading the
// released memory. Before, both died of a segmentation fault (unexpected
// fault address in barrier.worldErr). Then Fail, Err, Barrier and Share
// race a real Close from several goroutines (with -race).
func TestAdvFailDuringClose(t *testing.T) {
	t.Run("window", func(t *testing.T) {
		nodes := advNodes(t, 3)
		nd := nodes[0]
		if err := nd.bar.close(); err != nil {
			t.Fatal(err)
		}
		if err := nd.Err(); err != nil {
			t.Errorf("Err with the barrier closed: %v, want nil (nothing recorded)", err)
		}
		err := nd.Fail(1, errors.New("test"))
		var re *RankError
		if !errors.As(err, &re) || re.Rank != 1 || !errors.Is(err, ErrPeerLost) {
			t.Errorf("Fail with the barrier closed: %v, want the failure of rank 1 recorded", err)
		}
		if err := nd.Err(); !errors.As(err, &re) || re.Rank != 1 {
			t.Errorf("Err after Fail: %v", err)
		}
	})
	t.Run("race", func(t *testing.T) {
		rounds := 20
		if testing.Short() {
			rounds = 5
		}
		for range rounds {
			nodes := advNodes(t, 2)
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // nothing waits: the calls race Close only
			var wg sync.WaitGroup
			var closed atomic.Bool
			for g := range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for !closed.Load() {
						switch g % 4 {
						case 0:
							nodes[0].Fail(1, errors.New("test"))
						case 1:
							nodes[0].Err()
						case 2:
							nodes[0].Barrier(ctx, nil)
						case 3:
							nodes[0].Share(ctx, nil)
						}
					}
				}()
			}
			if err := nodes[0].Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			closed.Store(true)
			wg.Wait()
		}
	})
}

// TestAdvJoinCloseLeaks: worlds of 3 built by Join (all-to-all and
// rendezvous, over loopback) and closed, five times in a row, leave no
// descriptor and no goroutine behind: once collected (request batches are
// released by cleanups), the count after each world is back to the count
// after the first (which keeps what the soft provider opens once per
// process).
func TestAdvJoinCloseLeaks(t *testing.T) {
	xNoLeaks(t)
	var after []int
	for i := range 5 {
		mode := xModes[i%2]
		lns, addrs := xListeners(t, 3)
		cfg := &Config{}
		for r, a := range addrs {
			_, p, _ := net.SplitHostPort(a)
			port, _ := strconv.Atoi(p)
			cfg.Hosts = append(cfg.Hosts, Host{Hostname: "127.0.0.1", Port: port, Device: verbs.SoftDevice, Rank: r})
		}
		ctx := xContext(t, advGuard)
		nodes := make([]*Node, 3)
		errs := make([]error, 3)
		var wg sync.WaitGroup
		for r := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				nodes[r], errs[r] = Join(ctx, cfg, r, JoinOptions{Mode: mode, Listener: lns[r], Job: "job", Token: []byte("token")})
				if errs[r] == nil {
					errs[r] = nodes[r].Barrier(ctx, nil)
				}
			}()
		}
		wg.Wait()
		for r, err := range errs {
			if err != nil {
				t.Fatalf("world %d, rank %d: %v", i, r, err)
			}
		}
		for _, nd := range nodes {
			if err := nd.Close(); err != nil {
				t.Fatal(err)
			}
		}
		// Request batches (memfds) are released by their cleanups after
		// a collection: collect until the count is back to the first
		// world's (the number of rounds is a hang guard).
		fds := advFDs(t)
		for r := 0; i > 0 && fds > after[0] && r < 500; r++ {
			runtime.GC()
			time.Sleep(10 * time.Millisecond)
			fds = advFDs(t)
		}
		if i == 0 {
			runtime.GC()
			time.Sleep(50 * time.Millisecond)
			fds = advFDs(t)
		}
		after = append(after, fds)
	}
	if after[len(after)-1] > after[0] {
		t.Errorf("descriptors open after each world (collected): %v", after)
	}
}

// TestAdvJoinCancelled: Join of a world whose other ranks never come,
// cancelled while it waits in the exchange (and with a context cancelled
// before the call), fails with context.Canceled and ErrPeerMissing, and
// releases everything it built: the node, its protection domain and
// device (no verbs object leaks), its listener (the port can be listened
// on again), its goroutines.
func TestAdvJoinCancelled(t *testing.T) {
	for _, mode := range xModes {
		for _, early := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/cancelled before %v", mode, early), func(t *testing.T) {
				verbstest.CheckLeaks(t)
				xNoLeaks(t)
				lns, addrs := xListeners(t, 3)
				cfg := &Config{}
				for r, a := range addrs {
					_, p, _ := net.SplitHostPort(a)
					port, _ := strconv.Atoi(p)
					cfg.Hosts = append(cfg.Hosts, Host{Hostname: "127.0.0.1", Port: port, Device: verbs.SoftDevice, Rank: r})
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if early {
					cancel()
				} else {
					time.AfterFunc(50*time.Millisecond, cancel)
				}
				nd, err := Join(ctx, cfg, 0, JoinOptions{Mode: mode, Listener: lns[0], Job: "job", Token: []byte("token")})
				if nd != nil {
					nd.Close()
					t.Fatal("Join returned a node")
				}
				if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrPeerMissing) {
					t.Errorf("%v: want context.Canceled and ErrPeerMissing", err)
				}
				ln, err := net.Listen("tcp", addrs[0])
				if err != nil {
					t.Errorf("the exchange's listener is still open: %v", err)
				} else {
					ln.Close()
				}
			})
		}
	}
}
