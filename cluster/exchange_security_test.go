package cluster

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// xCapture runs a world of 2 (all-to-all) through a recording proxy and
// returns both directions of its connection.
func xCapture(t *testing.T, token []byte) (toAcceptor, toDialer []byte) {
	t.Helper()
	_, errs, wires := runThroughWires(t, 2, AllToAll, "job", token, func(r int) [][]byte { return xOut(r, 2) },
		func(_ int, target string) *wire { return newWire(t, target, nil) })
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	w := wires[0]
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.conns) != 1 {
		t.Fatalf("%d connections through the proxy", len(w.conns))
	}
	return bytes.Clone(w.conns[0][0].Bytes()), bytes.Clone(w.conns[0][1].Bytes())
}

// TestExchangeReplay: what a sniffer recorded of one connection does not
// open another. A replayed dialer (its hello, which authenticates, and its
// proof) is refused with ErrAuth at the proof, before anything else is
// read, and does not take the rank it claims: the real rank then
// completes the exchange. A replayed acceptor's answer does not
// authenticate for the dialer's fresh hello.
func TestExchangeReplay(t *testing.T) {
	toA, toD := xCapture(t, []byte("token"))

	t.Run("dialer", func(t *testing.T) {
		xNoLeaks(t)
		lns, addrs := xListeners(t, 2)
		ctx := xContext(t, time.Minute)
		done := xGo(ctx, ExchangeConfig{Rank: 0, Size: 2, Addrs: addrs, Listener: lns[0], Job: "job", Token: []byte("token")})
		c, err := net.Dial("tcp", addrs[0])
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write(toA[:helloLen+proofLen])
		var buf [rejectLen]byte
		if _, err := readControl(c, &buf, msgHello); err != nil {
			t.Fatalf("the replayed hello got no hello: %v", err)
		}
		b, err := readControl(c, &buf, msgReject)
		if err != nil {
			t.Fatalf("the replayed proof got no reject: %v", err)
		}
		if r, err := decodeReject(b); err != nil || r.code != rejectAuth {
			t.Errorf("reject %+v, %v; want an authentication reject", r, err)
		}
		in, err := Exchange(ctx, ExchangeConfig{Rank: 1, Size: 2, Addrs: addrs, Listener: lns[1], Job: "job", Token: []byte("token")}, xOut(1, 2))
		if err != nil || !bytes.Equal(in[0], xMessage(0, 1)) {
			t.Fatalf("the real rank 1: %q, %v", in, err)
		}
		if r := <-done; r.err != nil || !bytes.Equal(r.in[1], xMessage(1, 0)) {
			t.Fatalf("rank 0: %q, %v", r.in, r.err)
		}
	})

	t.Run("acceptor", func(t *testing.T) {
		xNoLeaks(t)
		lns, addrs := xListeners(t, 2)
		done := xGo(xContext(t, time.Minute), ExchangeConfig{Rank: 1, Size: 2, Addrs: addrs, Listener: lns[1],
			Job: "job", Token: []byte("token")})
		c, err := lns[0].Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.ReadFull(c, make([]byte, helloLen)); err != nil {
			t.Fatal(err)
		}
		c.Write(toD)
		if err := (<-done).err; !errors.Is(err, ErrAuth) {
			t.Errorf("%v, want ErrAuth", err)
		}
	})
}

// xV1Frame encodes a frame of version 1 (see xV1Header).
func xV1Frame(typ byte, from, to, size uint32, job string, payload []byte, token []byte) []byte {
	b := make([]byte, 44)
	copy(b, "GVCX")
	b[4], b[5] = 1, typ
	binary.BigEndian.PutUint32(b[8:], from)
	binary.BigEndian.PutUint32(b[12:], to)
	binary.BigEndian.PutUint32(b[16:], size)
	binary.BigEndian.PutUint16(b[20:], uint16(len(job)))
	binary.BigEndian.PutUint32(b[24:], uint32(len(payload)))
	b = append(append(b, job...), payload...)
	if typ == 4 { // a reject: no MAC
		return append(b, make([]byte, 32)...)
	}
	m := hmac.New(sha256.New, token)
	m.Write(b)
	return m.Sum(b)
}

// TestExchangeVersion: peers of version 1 and 2 refuse each other with
// ErrVersion, whichever dials. A version 1 peer reads a 44-byte header and
// checks the version byte after the magic: what version 2 answers must be
// that long, with version 2 there.
func TestExchangeVersion(t *testing.T) {
	t.Run("old dialer", func(t *testing.T) {
		xNoLeaks(t)
		lns, addrs := xListeners(t, 2)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := xGo(ctx, ExchangeConfig{Rank: 0, Size: 2, Addrs: addrs, Listener: lns[0], Job: "job", Token: []byte("token")})
		c, err := net.Dial("tcp", addrs[0])
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write(xV1Frame(1, 1, 0, 2, "job", nil, []byte("token")))
		// What version 1 reads of the answer: its header.
		h := make([]byte, 44)
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatalf("the answer is shorter than a version 1 header: %v", err)
		}
		if string(h[:4]) != "GVCX" || h[4] != frameVersion {
			t.Errorf("answer %q: a version 1 peer would not see version %d", h[:8], frameVersion)
		}
		var buf [rejectLen]byte
		b, err := readControl(io.MultiReader(bytes.NewReader(h), c), &buf, msgReject)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := decodeReject(b); err != nil || r.code != rejectVersion {
			t.Errorf("reject %+v, %v; want a version reject", r, err)
		}
		io.ReadAll(c) // closed once the refusal is on record
		cancel()
		err = (<-done).err
		var xe *ExchangeError
		if !errors.Is(err, ErrVersion) || !errors.As(err, &xe) || xe.Refused != 1 {
			t.Errorf("%v, want ErrVersion and one refused connection", err)
		}
		t.Log(err)
	})

	t.Run("old acceptor", func(t *testing.T) {
		xNoLeaks(t)
		lns, addrs := xListeners(t, 2)
		// No deadline: the refusal must end the exchange.
		done := xGo(context.Background(), ExchangeConfig{Rank: 1, Size: 2, Addrs: addrs, Listener: lns[1],
			Job: "job", Token: []byte("token")})
		c, err := lns[0].Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		h := make([]byte, 44)
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatalf("the hello is shorter than a version 1 header: %v", err)
		}
		if h[4] != frameVersion {
			t.Errorf("hello %q: a version 1 peer would not see version %d", h[:8], frameVersion)
		}
		c.Write(xV1Frame(4, 0, 1, 2, "job", append([]byte{3}, "cluster: exchange: unsupported protocol version: version 2 (this side speaks 1)"...), nil))
		select {
		case r := <-done:
			if err := r.err; !errors.Is(err, ErrVersion) || errors.Is(err, ErrPeerMissing) {
				t.Errorf("%v, want ErrVersion", err)
			}
			t.Log(err)
		case <-time.After(time.Minute):
			t.Fatal("the dialer did not give up on a version 1 acceptor")
		}
	})
}

// TestExchangeStrangersDropped: strangers over MaxStrangersPerHost are
// dropped, oldest first, and the exchange's error counts them.
func TestExchangeStrangersDropped(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, 2)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := xGo(ctx, ExchangeConfig{Rank: 0, Size: 2, Mode: mode, Addrs: addrs, Listener: lns[0], Job: "job",
				Token: []byte("token"), MaxStrangers: 4, MaxStrangersPerHost: 2, HelloTimeout: time.Hour})
			const n = 6
			conns := make([]net.Conn, n)
			for i := range conns {
				c, err := net.Dial("tcp", addrs[0])
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				c.Write([]byte{'G', 'V', 'C', 'X', frameVersion, msgHello, 0, 0}) // half a hello, and then nothing
				conns[i] = c
			}
			// The first n-2 are dropped: they read the end of their
			// connection (the hang guard is the test's timeout).
			for i, c := range conns[:n-2] {
				if b, err := io.ReadAll(c); len(b) != 0 {
					t.Errorf("stranger %d: read %q, %v", i, b, err)
				}
			}
			cancel()
			err := (<-done).err
			var xe *ExchangeError
			if !errors.As(err, &xe) || xe.Dropped < n-2 || !strings.Contains(err.Error(), fmt.Sprint(xe.Dropped, " dropped")) {
				t.Errorf("%v: want %d strangers dropped", err, n-2)
			}
			t.Log(err)
		})
	}
}

// TestGate: the gate drops the oldest stranger of a source address over
// its limit per host, and the oldest of all over its limit; dropped
// strangers are not promoted. Connections come from several loopback
// addresses.
func TestGate(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g := newGate(4, 2)
	var wg sync.WaitGroup
	defer wg.Wait()
	sources := []string{"127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.4"}
	want := []bool{true, true, false, false, false, false} // dropped
	sts := make([]*stranger, len(sources))
	for i, src := range sources {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Skipf("cannot dial from %s: %v", src, err)
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		st, err := g.admit(context.Background(), s)
		if err != nil {
			t.Fatal(err)
		}
		sts[i] = st
		// As serve's handler: read until the connection fails, leave.
		wg.Add(1)
		go func() {
			defer wg.Done()
			io.Copy(io.Discard, s)
			g.leave(st)
		}()
	}
	for i, st := range sts {
		if got := g.dropped(st); got != want[i] {
			t.Errorf("stranger %d from %s: dropped %v, want %v", i, sources[i], got, want[i])
		}
		if got := g.promote(st); got == want[i] {
			t.Errorf("stranger %d: promote %v", i, got)
		}
	}
	if g.droppedCount() != 2 {
		t.Errorf("%d dropped, want 2", g.droppedCount())
	}
}

// fromConn is a connection that says it comes from addr.
type fromConn struct {
	net.Conn
	addr net.Addr
}

func (c fromConn) RemoteAddr() net.Addr { return c.addr }

// TestGateIPv6Networks: strangers from many addresses of one IPv6 /64
// (one host's usual allocation) hold at most half of the gate; the
// oldest of that network goes first, strangers of other networks and
// link-local or loopback ones count apart, and another network's are
// not dropped for them.
func TestGateIPv6Networks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		sources []string
		dropped []bool
	}{
		{
			// max 8, per host 2, per /64 4: the fifth of the /64
			// drops the first.
			name:    "one /64",
			sources: []string{"2001:db8::1", "2001:db8::2", "2001:db8::3", "2001:db8::4", "2001:db8::5", "2001:db8::ffff:1"},
			dropped: []bool{true, true, false, false, false, false},
		},
		{
			name:    "two /64s",
			sources: []string{"2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:1::3", "2001:db8:0:2::1", "2001:db8:0:1::4", "2001:db8:0:1::5"},
			dropped: []bool{true, false, false, false, false, false},
		},
		{
			name:    "link-local and loopback count per address",
			sources: []string{"fe80::1", "fe80::2", "fe80::3", "fe80::4", "fe80::5", "::1"},
			dropped: []bool{false, false, false, false, false, false},
		},
		{
			name:    "IPv4-mapped counts per address",
			sources: []string{"::ffff:10.0.0.1", "::ffff:10.0.0.2", "::ffff:10.0.0.3", "::ffff:10.0.0.4", "::ffff:10.0.0.5"},
			dropped: []bool{false, false, false, false, false},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGate(8, 2)
			sts := make([]*stranger, len(tc.sources))
			for i, src := range tc.sources {
				a, b := net.Pipe()
				defer a.Close()
				defer b.Close()
				st, err := g.admit(context.Background(), fromConn{b, &net.TCPAddr{IP: net.ParseIP(src), Port: 1000 + i}})
				if err != nil {
					t.Fatal(err)
				}
				sts[i] = st
			}
			n := 0
			for i, st := range sts {
				got := g.dropped(st)
				if got != tc.dropped[i] {
					t.Errorf("stranger %d from %s: dropped %v, want %v", i, tc.sources[i], got, tc.dropped[i])
				}
				if got {
					n++
				}
			}
			if g.droppedCount() != n {
				t.Errorf("%d dropped, counted %d", n, g.droppedCount())
			}
			for _, st := range sts {
				g.leave(st)
			}
			if len(g.hosts) != 0 || len(g.nets) != 0 || len(g.slots) != 0 {
				t.Errorf("after all left: %d hosts, %d networks, %d slots", len(g.hosts), len(g.nets), len(g.slots))
			}
		})
	}
}

// TestExchangeDialerDropped: a dialer dropped after it proved itself but
// before it was accepted (a stranger over the limits, or late) dials
// again, and the exchange completes.
func TestExchangeDialerDropped(t *testing.T) {
	xNoLeaks(t)
	lns, addrs := xListeners(t, 2)
	done := xGo(xContext(t, time.Minute), ExchangeConfig{Rank: 1, Size: 2, Addrs: addrs, Listener: lns[1],
		Job: "job", Token: []byte("token")})
	x := xFakeRank(t, AllToAll, 0, 2, "token")
	// The first connection: answered, its proof read, and dropped.
	c, err := lns[0].Accept()
	if err != nil {
		t.Fatal(err)
	}
	var buf [rejectLen]byte
	b, err := readControl(c, &buf, msgHello)
	if err != nil {
		t.Fatal(err)
	}
	ah := encodeHello(&hello{from: 0, to: 1, size: 2, job: x.job, nonce: newNonce()}, x.mk, b)
	c.Write(ah[:])
	if _, err := readControl(c, &buf, msgProof); err != nil {
		t.Fatal(err)
	}
	c.Close()
	// The second: accepted.
	if c, err = lns[0].Accept(); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := xContext(t, time.Minute)
	k, err := x.accept(ctx, c, nil, nil, func(int) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	data, err := x.recv(ctx, k)
	if err != nil || !bytes.Equal(data, xMessage(1, 0)) {
		t.Fatalf("rank 0 got %q, %v", data, err)
	}
	if err := x.send(k, xMessage(0, 1)); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || !bytes.Equal(r.in[0], xMessage(0, 1)) {
		t.Fatalf("rank 1: %q, %v", r.in, r.err)
	}
}

// TestExchangeEmptyTokenReadable documents what an empty token leaves:
// the keys derive from values on the wire, so a sniffer reads the
// entries. With a token it cannot.
func TestExchangeEmptyTokenReadable(t *testing.T) {
	for _, tc := range []struct {
		name     string
		token    []byte
		readable bool
	}{{"empty token", nil, true}, {"token", []byte("token"), false}} {
		t.Run(tc.name, func(t *testing.T) {
			toA, toD := xCapture(t, tc.token)
			// The sniffer derives the keys as if the token were empty.
			d2a, a2d := sessionKeys(nil, toA[:helloLen], toD[:helloLen])
			s := newSession(a2d, d2a)
			_, msg, err := s.readMsg(bytes.NewReader(toA[helloLen+proofLen:]), DefaultMaxFrame)
			if tc.readable {
				if err != nil || !bytes.Equal(msg, xMessage(1, 0)) {
					t.Errorf("the sniffer read %q, %v", msg, err)
				}
			} else if !errors.Is(err, ErrAuth) {
				t.Errorf("the sniffer read %q, %v", msg, err)
			}
		})
	}
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:1": true, "127.5.5.5:1": true, "[::1]:1": true, "localhost:1": true,
		"0.0.0.0:1": false, ":1": false, "[::]:1": false, "10.0.0.1:1": false, "node7:1": false,
		"[fe80::1%eth0]:1": false, "garbage": false,
	} {
		if got := isLoopback(addr); got != want {
			t.Errorf("%q: %v, want %v", addr, got, want)
		}
	}
}

// TestWarnNoToken: an exchange without a token on an address that is not
// loopback logs a warning, once per process; on loopback, or with a
// token, it does not.
func TestWarnNoToken(t *testing.T) {
	var buf bytes.Buffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, nil)))
	defer slog.SetDefault(old)
	defer func() { warnedNoToken = sync.Once{} }()
	loop := []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
	wide := []string{"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}
	for _, tc := range []struct {
		name string
		cfg  ExchangeConfig
		warn bool
	}{
		{"loopback", ExchangeConfig{Rank: 1, Size: 3, Addrs: loop}, false},
		{"token", ExchangeConfig{Rank: 1, Size: 3, Addrs: wide, Token: []byte("t")}, false},
		{"dials a remote rank", ExchangeConfig{Rank: 2, Size: 3, Addrs: append(wide[:2:2], "127.0.0.1:3")}, true},
		{"listens on a remote address", ExchangeConfig{Rank: 0, Size: 3, Addrs: append([]string{"10.0.0.1:1"}, loop[1:]...)}, true},
		{"listens on every address", ExchangeConfig{Rank: 0, Size: 3, Addrs: loop, Listen: ":1"}, true},
		{"leaf of a remote root", ExchangeConfig{Rank: 2, Size: 3, Mode: Rendezvous, Root: "10.0.0.1:1"}, true},
		{"leaf of a local root", ExchangeConfig{Rank: 2, Size: 3, Mode: Rendezvous, Root: "localhost:1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			warnedNoToken = sync.Once{}
			buf.Reset()
			x, err := newExchange(tc.cfg, make([][]byte, tc.cfg.Size))
			if err != nil {
				t.Fatal(err)
			}
			x.warnNoToken()
			x.warnNoToken()
			if n := strings.Count(buf.String(), "without a token"); n != map[bool]int{true: 1, false: 0}[tc.warn] {
				t.Errorf("%d warnings: %q", n, buf.String())
			}
		})
	}
}

// TestExchangeSlowAccept: an acceptor that takes longer than the dialer's
// handshake deadline to accept (a loaded host) after the dialer proved
// itself: the dialer waits for the verdict (its context bounds it), so
// the accepted connection carries the exchange. A dialer that gave up
// and dialed again would leave the acceptor with a claimed connection
// closed under it, which it must take for a dead peer (ErrPeerLost).
func TestExchangeSlowAccept(t *testing.T) {
	xNoLeaks(t)
	lns, addrs := xListeners(t, 2)
	ctx := xContext(t, time.Minute)
	done := xGo(ctx, ExchangeConfig{Rank: 1, Size: 2, Addrs: addrs, Listener: lns[1], Job: "job", Token: []byte("token"),
		HelloTimeout: 50 * time.Millisecond})
	x := xFakeRank(t, AllToAll, 0, 2, "token")
	c, err := lns[0].Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Accept after 10 of the dialer's handshake deadlines (2 × 50 ms).
	k, err := x.accept(ctx, c, nil, nil, func(int) error { time.Sleep(time.Second); return nil })
	if err != nil {
		t.Fatal(err)
	}
	lns[0].Close() // a dialer that gave up finds nobody
	got, err := x.recv(ctx, k)
	if err != nil {
		t.Fatalf("the dialer abandoned the connection its acceptor accepted: %v", err)
	}
	if !bytes.Equal(got, xMessage(1, 0)) {
		t.Errorf("rank 0 got %q", got)
	}
	if err := x.send(k, xMessage(0, 1)); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !bytes.Equal(r.in[0], xMessage(0, 1)) {
		t.Errorf("rank 1 got %q", r.in[0])
	}
}
