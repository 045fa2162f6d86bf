package session

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs/internal/pintls"
)

// hangGuard bounds every wait of these tests: it only turns a hang into a
// failure, it asserts nothing about speed.
const hangGuard = 30 * time.Second

// noLeaks checks, when t ends (after every later cleanup), that no
// goroutine was left behind.
func noLeaks(t *testing.T) {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t) })
}

func guardCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

func testConfig(token, tlsPolicy string) *Config {
	c := Config{TLS: tlsPolicy}
	if token != "" {
		c.Token = []byte(token)
	}
	c = c.withDefaults()
	return &c
}

func listen(t *testing.T, cfg *Config) *ctrlListener {
	t.Helper()
	l, err := listenCtrl("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.close() })
	return l
}

// pair dials l with cfg and accepts the connection.
func ctrlPair(t *testing.T, l *ctrlListener, cfg *Config) (d, a *ctrl) {
	t.Helper()
	ctx := guardCtx(t)
	d, err := dialCtrl(ctx, l.Addr().String(), cfg)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { d.close() })
	a, err = l.accept(ctx)
	if err != nil {
		t.Fatalf("accept: %v", err)
	}
	t.Cleanup(func() { a.close() })
	return d, a
}

func wantMsg(t *testing.T, c *ctrl, typ uint8, payload []byte) {
	t.Helper()
	gt, gp, err := c.recv(guardCtx(t))
	if err != nil {
		t.Fatalf("recv: %v", err)
	}
	if gt != typ || !bytes.Equal(gp, payload) {
		t.Fatalf("recv: type %d, %d bytes; want type %d, %d bytes", gt, len(gp), typ, len(payload))
	}
}

// wantEnd waits for c to end and checks its error, from err and recv.
func wantEnd(t *testing.T, c *ctrl, want error) {
	t.Helper()
	select {
	case <-c.done():
	case <-time.After(hangGuard):
		t.Fatalf("the connection did not end (want %v)", want)
	}
	if err := c.err(); !errors.Is(err, want) {
		t.Fatalf("err() = %v, want %v", err, want)
	}
	if _, _, err := c.recv(guardCtx(t)); !errors.Is(err, want) {
		t.Fatalf("recv after the end: %v, want %v", err, want)
	}
}

func TestCtrlConnect(t *testing.T) {
	for _, tc := range []struct {
		name            string
		token           string
		dialTLS, lisTLS string
		encrypted       bool
	}{
		{"Plain", "secret", "", "", false},
		{"PlainNoToken", "", "off", "off", false},
		{"TLS", "secret", "on", "on", true},
		{"TLSNoToken", "", "on", "on", true},
		// An acceptor takes TLS whenever the dialer wants it.
		{"DialerTLS", "secret", "on", "auto", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			l := listen(t, testConfig(tc.token, tc.lisTLS))
			d, a := ctrlPair(t, l, testConfig(tc.token, tc.dialTLS))
			if d.encrypted() != tc.encrypted || a.encrypted() != tc.encrypted {
				t.Fatalf("encrypted: dialer %v, acceptor %v, want %v", d.encrypted(), a.encrypted(), tc.encrypted)
			}
			if d.remoteAddr().String() != a.localAddr().String() || a.remoteAddr().String() != d.localAddr().String() {
				t.Fatalf("addresses: dialer %v→%v, acceptor %v→%v", d.localAddr(), d.remoteAddr(), a.localAddr(), a.remoteAddr())
			}
			big := bytes.Repeat([]byte("0123456789abcdef"), maxCtrlMsg/16)
			for _, m := range []struct {
				typ     uint8
				payload []byte
			}{{1, []byte("hello")}, {127, nil}, {42, big}} {
				if err := d.send(m.typ, m.payload); err != nil {
					t.Fatal(err)
				}
				wantMsg(t, a, m.typ, m.payload)
				if err := a.send(m.typ, m.payload); err != nil {
					t.Fatal(err)
				}
				wantMsg(t, d, m.typ, m.payload)
			}
			// Messages sent before a close arrive before its bye.
			if err := d.send(7, []byte("last")); err != nil {
				t.Fatal(err)
			}
			if err := a.send(8, []byte("unread")); err != nil {
				t.Fatal(err)
			}
			d.close()
			d.close() // idempotent
			if _, _, err := d.recv(guardCtx(t)); !errors.Is(err, ErrClosed) {
				t.Fatalf("recv after close: %v, want ErrClosed", err)
			}
			wantMsg(t, a, 7, []byte("last"))
			wantEnd(t, a, ErrPeerClosed)
			if err := d.err(); !errors.Is(err, ErrClosed) {
				t.Fatalf("the closing side's err() = %v, want ErrClosed", err)
			}
			if err := d.send(1, nil); !errors.Is(err, ErrClosed) {
				t.Fatalf("send after close: %v, want ErrClosed", err)
			}
			if err := a.send(1, nil); !errors.Is(err, ErrPeerClosed) {
				t.Fatalf("send after the peer's close: %v, want ErrPeerClosed", err)
			}
			if refused := l.refused(); refused != 0 {
				t.Fatalf("refused %d (%v), want 0", refused, l.lastRefusal())
			}
		})
	}
}

// TestCtrlSendLimits: what send refuses, before anything is written.
func TestCtrlSendLimits(t *testing.T) {
	noLeaks(t)
	l := listen(t, testConfig("k", ""))
	d, a := ctrlPair(t, l, testConfig("k", ""))
	for _, tc := range []struct {
		typ  uint8
		size int
		want error
	}{
		{0, 1, nil},
		{msgPing, 0, nil},
		{msgBye, 0, nil},
		{255, 0, nil},
		{1, maxCtrlMsg + 1, ErrLimit},
		{1, 1 << 20, ErrLimit},
	} {
		err := d.send(tc.typ, make([]byte, tc.size))
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("send(type %d, %d bytes) = %v, want an error (%v)", tc.typ, tc.size, err, tc.want)
		}
	}
	// Nothing of it reached the peer; the connection works.
	if err := d.send(3, []byte("ok")); err != nil {
		t.Fatal(err)
	}
	wantMsg(t, a, 3, []byte("ok"))
}

// TestCtrlBadPolicy: an unknown TLS policy is an error of listen and
// dial, before any connection.
func TestCtrlBadPolicy(t *testing.T) {
	noLeaks(t)
	bad := testConfig("k", "maybe")
	if l, err := listenCtrl("127.0.0.1:0", bad); err == nil {
		l.close()
		t.Fatal("listen with TLS \"maybe\" succeeded")
	}
	l := listen(t, testConfig("k", ""))
	if err := dialFails(t, l.Addr().String(), bad); err == nil || !strings.Contains(err.Error(), "maybe") {
		t.Fatalf("dial with TLS \"maybe\": %v", err)
	}
}

// TestCtrlWarnNoToken: a listener without a token on an address that is
// not a loopback one logs a warning, once per process. (Tests listen on
// loopback only: the addresses here are not listened on.)
func TestCtrlWarnNoToken(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, nil)))
	defer slog.SetDefault(old)
	public := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 9}
	loop := &net.TCPAddr{IP: net.IPv6loopback, Port: 9}
	warnedNoToken = sync.Once{} // as in a new process (-count > 1)
	warnNoToken(nil, loop)
	warnNoToken([]byte("k"), public)
	mu.Lock()
	if buf.Len() != 0 {
		t.Fatalf("a warning for a loopback address or with a token: %s", buf.String())
	}
	mu.Unlock()
	warnNoToken(nil, public)
	warnNoToken(nil, public)
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(buf.String(), "without a token"); n != 1 {
		t.Fatalf("%d warnings, want 1: %s", n, buf.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(p)
}

// TestCtrlAuth: a dialer and a listener with different tokens refuse each
// other (ErrAuth at the dialer), and the listener goes on accepting
// others.
func TestCtrlAuth(t *testing.T) {
	for _, tc := range []struct {
		name       string
		lis, dial  string
		policy     string
		refusedWhy string
	}{
		{"OtherToken", "right", "wrong", "", "another token"},
		{"DialerNoToken", "right", "", "", "the dialer has no token"},
		{"ListenerNoToken", "", "right", "", "the dialer has a token, this side has none"},
		{"OtherTokenTLS", "right", "wrong", "on", "another token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			l := listen(t, testConfig(tc.lis, tc.policy))
			for i := range 3 {
				err := dialFails(t, l.Addr().String(), testConfig(tc.dial, tc.policy))
				if !errors.Is(err, ErrAuth) {
					t.Fatalf("dial with another token: %v, want ErrAuth", err)
				}
				waitRefused(t, l, i+1)
				if err := l.lastRefusal(); !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), tc.refusedWhy) {
					t.Fatalf("the listener's reason: %v, want ErrAuth saying %q", err, tc.refusedWhy)
				}
			}
			d, a := ctrlPair(t, l, testConfig(tc.lis, tc.policy))
			if err := d.send(1, []byte("in")); err != nil {
				t.Fatal(err)
			}
			wantMsg(t, a, 1, []byte("in"))
		})
	}
}

// fakeAcceptor serves one connection on a listener of its own with the
// acceptor's side of the handshake as a server without the right token
// would: it answers the hello and then accepts any proof, sending a proof
// made with its own token. version is the version its hello claims.
func fakeAcceptor(t *testing.T, token string, version uint16) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(hangGuard))
		var dh, ah [helloLen]byte
		var pd [proofLen]byte
		if _, err := io.ReadFull(c, dh[:]); err != nil {
			return
		}
		ah = makeHello(0)
		binary.BigEndian.PutUint16(ah[4:], version)
		c.Write(ah[:])
		if _, err := io.ReadFull(c, pd[:]); err != nil {
			return
		}
		v := [verdictLen]byte{verdictOK}
		p := prove(macKey([]byte(token)), roleAcceptor, &dh, &ah, nil)
		copy(v[1:], p[:])
		c.Write(v[:])
		io.Copy(io.Discard, c)
	}()
	return ln.Addr().String()
}

// TestCtrlMutualAuth: a server that does not hold the dialer's token, but
// accepts its proof anyway, fails the dialer's check of its own proof.
func TestCtrlMutualAuth(t *testing.T) {
	noLeaks(t)
	for _, tc := range []struct {
		name, server string
	}{{"OtherToken", "impostor"}, {"NoToken", ""}} {
		t.Run(tc.name, func(t *testing.T) {
			addr := fakeAcceptor(t, tc.server, ctrlVersion)
			err := dialFails(t, addr, testConfig("right", ""))
			if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "did not prove") {
				t.Fatalf("dial to a server without the token: %v, want ErrAuth", err)
			}
		})
	}
}

// TestCtrlVersion: each side of a version mismatch names both versions.
func TestCtrlVersion(t *testing.T) {
	noLeaks(t)
	addr := fakeAcceptor(t, "k", 2)
	err := dialFails(t, addr, testConfig("k", ""))
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "version 2, this side version 1") {
		t.Fatalf("dial to a version 2 server: %v, want ErrProtocol naming both versions", err)
	}

	l := listen(t, testConfig("k", ""))
	c := rawConn(t, l)
	h := makeHello(0)
	binary.BigEndian.PutUint16(h[4:], 2)
	if _, err := c.Write(h[:]); err != nil {
		t.Fatal(err)
	}
	var ah [helloLen]byte
	if _, err := io.ReadFull(c, ah[:]); err != nil {
		t.Fatalf("no hello back for a version 2 hello: %v", err)
	}
	if v := binary.BigEndian.Uint16(ah[4:]); v != ctrlVersion {
		t.Fatalf("the listener's hello says version %d", v)
	}
	wantClosed(t, c)
	waitRefused(t, l, 1)
	if err := l.lastRefusal(); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "version 2, this side version 1") {
		t.Fatalf("the listener's reason: %v, want ErrProtocol naming both versions", err)
	}
}

// dialFails dials addr, expecting an error, which it returns; a
// connection made nonetheless is closed (nil is then returned).
func dialFails(t *testing.T, addr string, cfg *Config) error {
	t.Helper()
	c, err := dialCtrl(guardCtx(t), addr, cfg)
	if err == nil {
		c.close()
	}
	return err
}

// rawConn connects to l with a bare TCP connection, closed when t ends.
func rawConn(t *testing.T, l *ctrlListener) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// wantClosed waits until the listener closed c: its reads see the end of
// the stream (or a reset), not a timeout.
func wantClosed(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(hangGuard))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the listener did not close a stranger's connection: %v", err)
	}
}

// waitRefused waits until l counted n refusals (the count is updated
// after the connection is closed).
func waitRefused(t *testing.T, l *ctrlListener, n int) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for l.refused() < n {
		if time.Now().After(deadline) {
			t.Fatalf("refused() = %d, want %d", l.refused(), n)
		}
		time.Sleep(time.Millisecond)
	}
	if got := l.refused(); got != n {
		t.Fatalf("refused() = %d, want %d", got, n)
	}
}

// TestCtrlStrangers: connections that do not complete the handshake are
// dropped (after HandshakeTimeout at the latest), counted, and never
// reach accept; the listener accepts real peers meanwhile.
func TestCtrlStrangers(t *testing.T) {
	hello := makeHello(0)
	for _, tc := range []struct {
		name    string
		send    []byte
		why     error // the listener's reason, if known
		timeout bool  // dropped at HandshakeTimeout
	}{
		{"Silent", nil, nil, true},
		{"HalfHello", hello[:10], nil, true},
		{"HelloNoProof", hello[:], nil, true},
		{"Garbage", bytes.Repeat([]byte{0xa5}, 200), ErrProtocol, false},
		{"HTTP", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + strings.Repeat(" ", 40)), ErrProtocol, false},
		{"BadTLS", append([]byte{tlsRecordHandshake}, bytes.Repeat([]byte{0xff}, 100)...), nil, false},
		{"BadProof", append(hello[:], make([]byte, proofLen)...), ErrAuth, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			cfg := testConfig("k", "")
			cfg.HandshakeTimeout = 200 * time.Millisecond
			l := listen(t, cfg)
			c := rawConn(t, l)
			if _, err := c.Write(tc.send); err != nil {
				t.Fatal(err)
			}
			wantClosed(t, c)
			waitRefused(t, l, 1)
			err := l.lastRefusal()
			if tc.why != nil && !errors.Is(err, tc.why) {
				t.Fatalf("the listener's reason: %v, want %v", err, tc.why)
			}
			if tc.timeout {
				var ne net.Error
				if !errors.As(err, &ne) || !ne.Timeout() {
					t.Fatalf("the listener's reason: %v, want a timeout", err)
				}
			}
			// A real peer still gets through.
			d, a := ctrlPair(t, l, cfg)
			if err := d.send(1, nil); err != nil {
				t.Fatal(err)
			}
			wantMsg(t, a, 1, nil)
		})
	}
}

// TestCtrlStrangersCap: while 2×MaxStrangers strangers hang in their
// handshakes (with a HandshakeTimeout far away), the oldest are dropped,
// and a real client gets through at once.
func TestCtrlStrangersCap(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "")
	cfg.MaxStrangers = 4
	cfg.HandshakeTimeout = time.Hour
	l := listen(t, cfg)
	var cs []net.Conn
	for range 2 * cfg.MaxStrangers {
		c := rawConn(t, l)
		h := makeHello(0)
		c.Write(h[:7]) // half a hello, then nothing
		cs = append(cs, c)
	}
	waitRefused(t, l, cfg.MaxStrangers)
	for _, c := range cs[:cfg.MaxStrangers] {
		wantClosed(t, c)
	}
	d, a := ctrlPair(t, l, cfg)
	if err := d.send(9, []byte("through")); err != nil {
		t.Fatal(err)
	}
	wantMsg(t, a, 9, []byte("through"))
	// The client took the place of the oldest stranger left.
	waitRefused(t, l, cfg.MaxStrangers+1)
	wantClosed(t, cs[cfg.MaxStrangers])
}

// recorder is a TCP relay that records what the dialer sent.
type recorder struct {
	ln  net.Listener
	wg  sync.WaitGroup
	mu  sync.Mutex
	rec bytes.Buffer
}

func newRecorder(t *testing.T, target string) *recorder {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &recorder{ln: ln}
	t.Cleanup(func() { ln.Close(); r.wg.Wait() })
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		u, err := net.Dial("tcp", target)
		if err != nil {
			return
		}
		defer u.Close()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			io.Copy(c, u)
			c.Close()
		}()
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			r.mu.Lock()
			r.rec.Write(buf[:n])
			r.mu.Unlock()
			if _, werr := u.Write(buf[:n]); err != nil || werr != nil {
				u.Close()
				return
			}
		}
	}()
	return r
}

// TestCtrlReplay: a dialer's hello and proof, recorded from a successful
// connection, do not authenticate another one.
func TestCtrlReplay(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "")
	l := listen(t, cfg)
	r := newRecorder(t, l.Addr().String())
	d, err := dialCtrl(guardCtx(t), r.ln.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, err := l.accept(guardCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	d.close()
	a.close()
	r.mu.Lock()
	rec := append([]byte(nil), r.rec.Bytes()[:helloLen+proofLen]...)
	r.mu.Unlock()

	c := rawConn(t, l)
	if _, err := c.Write(rec); err != nil {
		t.Fatal(err)
	}
	var ah [helloLen]byte
	var v [verdictLen]byte
	if _, err := io.ReadFull(c, ah[:]); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, v[:]); err != nil {
		t.Fatal(err)
	}
	if v[0] != verdictRefuse || !bytes.Equal(v[1:], make([]byte, proofLen)) {
		t.Fatalf("verdict %d, proof %x: a replayed proof was accepted", v[0], v[1:])
	}
	wantClosed(t, c)
	waitRefused(t, l, 1)
	if err := l.lastRefusal(); !errors.Is(err, ErrAuth) {
		t.Fatalf("the listener's reason: %v, want ErrAuth", err)
	}
}

// TestCtrlTLSRelay: a relay that terminates the dialer's TLS session and
// opens its own to the listener, forwarding every byte between them,
// cannot make the proofs pass: each is bound to its TLS session.
func TestCtrlTLSRelay(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "on")
	l := listen(t, cfg)
	id, err := pintls.NewIdentity()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		down := tls.Server(c, id.ServerConfig())
		u, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			return
		}
		defer u.Close()
		up := tls.Client(u, pintls.UnpinnedClientConfig())
		wg.Add(1)
		go func() {
			defer wg.Done()
			io.Copy(down, up)
			c.Close()
		}()
		io.Copy(up, down)
		u.Close()
	}()
	err = dialFails(t, ln.Addr().String(), cfg)
	if !errors.Is(err, ErrAuth) {
		t.Fatalf("dial through a TLS relay: %v, want ErrAuth", err)
	}
	waitRefused(t, l, 1)
	if err := l.lastRefusal(); !errors.Is(err, ErrAuth) {
		t.Fatalf("the listener's reason: %v, want ErrAuth", err)
	}
}

// TestCtrlPlainRefused: a listener whose policy is "on" refuses plain
// TCP, even from loopback.
func TestCtrlPlainRefused(t *testing.T) {
	noLeaks(t)
	l := listen(t, testConfig("k", "on"))
	err := dialFails(t, l.Addr().String(), testConfig("k", "off"))
	if !errors.Is(err, ErrPeerLost) {
		t.Fatalf("plain dial to a TLS-only listener: %v, want ErrPeerLost (refused)", err)
	}
	waitRefused(t, l, 1)
	if err := l.lastRefusal(); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "plain TCP") {
		t.Fatalf("the listener's reason: %v", err)
	}
}

// authedRaw runs the dialer's handshake on a bare connection to l, and
// returns the connection (no reader: it reads and answers nothing) and
// the acceptor's side.
func authedRaw(t *testing.T, l *ctrlListener, cfg *Config) (net.Conn, *ctrl) {
	t.Helper()
	raw := rawConn(t, l)
	nc, err := clientHandshake(guardCtx(t), raw, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, err := l.accept(guardCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.close() })
	return nc, a
}

// TestCtrlHugeLength: a declared length over maxCtrlMsg is a protocol
// error, found before anything is allocated for it.
func TestCtrlHugeLength(t *testing.T) {
	for _, n := range []uint32{maxCtrlMsg + 1, 1 << 31, 1<<32 - 1} {
		for _, typ := range []uint8{1, msgPing} {
			t.Run(fmt.Sprintf("type%d/%d", typ, n), func(t *testing.T) {
				noLeaks(t)
				cfg := testConfig("k", "")
				l := listen(t, cfg)
				nc, a := authedRaw(t, l, cfg)
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				hdr := [frameHdrLen]byte{typ}
				binary.BigEndian.PutUint32(hdr[1:], n)
				if _, err := nc.Write(hdr[:]); err != nil {
					t.Fatal(err)
				}
				wantEnd(t, a, ErrProtocol)
				runtime.ReadMemStats(&after)
				if grew := after.TotalAlloc - before.TotalAlloc; grew > 1<<20 {
					t.Fatalf("%d bytes allocated after a header declaring %d", grew, n)
				}
				wantClosed(t, nc)
			})
		}
	}
}

// TestCtrlEnd: how a connection ends, as its side sees it.
func TestCtrlEnd(t *testing.T) {
	for _, tc := range []struct {
		name string
		// end ends the connection from the dialer's side (d, or its
		// bare connection nc if d is nil); a is the acceptor's side,
		// whose keepalive is short.
		raw  bool
		end  func(d *ctrl, nc net.Conn)
		want error
	}{
		{"Close", false, func(d *ctrl, _ net.Conn) { d.close() }, ErrPeerClosed},
		{"SocketClosed", false, func(d *ctrl, _ net.Conn) { d.raw.Close() }, ErrPeerLost},
		{"Reset", true, func(_ *ctrl, nc net.Conn) {
			nc.(*net.TCPConn).SetLinger(0)
			nc.Close()
		}, ErrPeerLost},
		{"Silent", true, func(*ctrl, net.Conn) {}, ErrPeerUnresponsive},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			cfg := testConfig("k", "")
			l := listen(t, cfg)
			var d *ctrl
			var nc net.Conn
			var a *ctrl
			if tc.raw {
				nc, a = authedRaw(t, l, cfg)
			} else {
				d, a = ctrlPair(t, l, cfg)
			}
			// A short keepalive where the test waits for it; elsewhere
			// one that cannot fire before the end under test.
			ka := hangGuard
			if tc.want == ErrPeerUnresponsive {
				ka = 150 * time.Millisecond
			}
			a.startKeepalive(ka)
			tc.end(d, nc)
			wantEnd(t, a, tc.want)
			if err := a.send(1, nil); !errors.Is(err, tc.want) {
				t.Fatalf("send after the end: %v, want %v", err, tc.want)
			}
			a.close()
			a.close()
			if err := a.err(); !errors.Is(err, tc.want) {
				t.Fatalf("close changed err() to %v", err)
			}
		})
	}
}

// TestCtrlKeepaliveLive: live peers stay connected over several
// keepalive periods: both with a keepalive and idle, and a peer without a
// keepalive of its own (it still answers pings, so the side with one
// does not end the connection).
func TestCtrlKeepaliveLive(t *testing.T) {
	for _, tc := range []struct {
		name   string
		dk, ak time.Duration // the dialer's and the acceptor's keepalive
		idle   time.Duration
	}{
		{"Idle", time.Second, time.Second, 4 * time.Second},
		{"OneSided", -1, time.Second, 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			cfg := testConfig("k", "")
			l := listen(t, cfg)
			d, a := ctrlPair(t, l, cfg)
			d.startKeepalive(tc.dk)
			a.startKeepalive(tc.ak)
			time.Sleep(tc.idle)
			for _, c := range []*ctrl{d, a} {
				if err := c.err(); err != nil {
					t.Fatalf("a live connection ended: %v", err)
				}
			}
			if err := d.send(5, []byte("x")); err != nil {
				t.Fatal(err)
			}
			wantMsg(t, a, 5, []byte("x"))
		})
	}
}

// TestCtrlBackpressure: an acceptor whose application does not read
// stops reading the socket (the sender blocks) instead of growing its
// queue, and neither keepalive ends the connection meanwhile; every
// message then arrives, in order.
func TestCtrlBackpressure(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "")
	l := listen(t, cfg)
	d, a := ctrlPair(t, l, cfg)
	const ka = time.Second
	d.startKeepalive(ka)
	a.startKeepalive(ka)
	const n = 8 * ctrlQueueLen
	payload := make([]byte, maxCtrlMsg)
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			binary.BigEndian.PutUint32(payload, uint32(i))
			if err := d.send(1, payload); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	// The reader fills the queue, then waits.
	deadline := time.Now().Add(hangGuard)
	for len(a.q) < ctrlQueueLen || !a.stalled.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the queue did not fill")
		}
		time.Sleep(time.Millisecond)
	}
	// Several keepalive periods with the application not reading.
	time.Sleep(3 * ka)
	select {
	case err := <-sent:
		t.Fatalf("the sender finished (%v) while the receiver read nothing", err)
	default:
	}
	for _, c := range []*ctrl{d, a} {
		if err := c.err(); err != nil {
			t.Fatalf("the connection ended while the application did not read: %v", err)
		}
	}
	for i := range n {
		typ, p, err := a.recv(guardCtx(t))
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if typ != 1 || len(p) != maxCtrlMsg || binary.BigEndian.Uint32(p) != uint32(i) {
			t.Fatalf("message %d: type %d, %d bytes, number %d", i, typ, len(p), binary.BigEndian.Uint32(p))
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}

// TestCtrlCancel: a ctx that ends makes dial, accept and recv return its
// error; a cancelled recv leaves the connection working.
func TestCtrlCancel(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "")
	cfg.HandshakeTimeout = time.Hour

	t.Run("Dial", func(t *testing.T) {
		// A listener that accepts and never answers.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		for _, policy := range []string{"off", "on"} {
			cfg := *cfg
			cfg.TLS = policy
			ctx, cancel := context.WithCancel(context.Background())
			errc := make(chan error, 1)
			go func() {
				_, err := dialCtrl(ctx, ln.Addr().String(), &cfg)
				errc <- err
			}()
			c, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			// The dialer is in its handshake (the kernel has its hello
			// or its ClientHello); cancel it.
			buf := make([]byte, 1)
			c.SetReadDeadline(time.Now().Add(hangGuard))
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			cancel()
			select {
			case err := <-errc:
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("TLS %s: cancelled dial: %v, want context.Canceled", policy, err)
				}
			case <-time.After(hangGuard):
				t.Fatalf("TLS %s: a cancelled dial did not return", policy)
			}
			c.Close()
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		defer cancel()
		<-ctx.Done()
		if _, err := dialCtrl(ctx, ln.Addr().String(), cfg); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("dial with an expired ctx: %v, want context.DeadlineExceeded", err)
		}
	})

	l := listen(t, cfg)
	t.Run("Accept", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(10*time.Millisecond, cancel)
		if _, err := l.accept(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled accept: %v, want context.Canceled", err)
		}
	})
	t.Run("Recv", func(t *testing.T) {
		d, a := ctrlPair(t, l, cfg)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(10*time.Millisecond, cancel)
		if _, _, err := a.recv(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled recv: %v, want context.Canceled", err)
		}
		if err := d.send(2, []byte("after")); err != nil {
			t.Fatal(err)
		}
		wantMsg(t, a, 2, []byte("after"))
	})
}

// TestCtrlListenerClose: close ends a waiting accept with ErrClosed,
// drops the strangers and the connections not accepted yet (their
// dialers see ErrPeerClosed), and leaves no goroutine.
func TestCtrlListenerClose(t *testing.T) {
	noLeaks(t)
	cfg := testConfig("k", "")
	l, err := listenCtrl("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	stranger := rawConn(t, l)
	stranger.Write([]byte("GV"))
	d, err := dialCtrl(guardCtx(t), l.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.close()
	if err := l.close(); err != nil {
		t.Fatal(err)
	}
	l.close()
	if _, err := l.accept(guardCtx(t)); !errors.Is(err, ErrClosed) {
		t.Fatalf("accept after close: %v, want ErrClosed", err)
	}
	wantEnd(t, d, ErrPeerClosed)
	wantClosed(t, stranger)
	if err := dialFails(t, l.Addr().String(), cfg); err == nil {
		t.Fatal("dial to a closed listener succeeded")
	}
	if n := l.refused(); n != 0 {
		t.Fatalf("refused() = %d: connections cut by close counted as refused", n)
	}

	// An accept waiting when the listener closes.
	l, err = listenCtrl("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := l.accept(guardCtx(t))
		errc <- err
	}()
	l.close()
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("accept across close: %v, want ErrClosed", err)
	}
}

// TestAcceptStalledSetup: a peer with the token that
// authenticates and then sends no setup message keeps Listener.Accept
// waiting in establish; Listener.Close must end that Accept ("it returns
// an error only when ctx ends or the Listener is closed"). It waited
// until its ctx ended (Listener.establish). (Found by a review.)
func TestAcceptStalledSetup(t *testing.T) {
	cfg := Config{Token: []byte("k"), Keepalive: time.Second}
	l, err := Listen(context.Background(), "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	dcfg := cfg.withDefaults()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := dialCtrl(ctx, l.Addr().String(), &dcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	// Wait for the authenticated connection to be queued for Accept.
	for len(l.l.ready) == 0 {
		time.Sleep(time.Millisecond)
	}
	errc := make(chan error, 1)
	go func() {
		s, err := l.Accept(context.Background())
		if s != nil {
			s.Close()
		}
		errc <- err
	}()
	// Accept takes it and waits for its hello.
	for len(l.l.ready) != 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	l.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Accept across Close: %v, want ErrClosed", err)
		}
	case <-time.After(15 * time.Second):
		c.close() // let the Accept go (goleak)
		<-errc
		t.Fatal("Accept still waiting 15 s after Listener.Close: a peer that authenticated and stalled in setup holds it")
	}
}

// TestAcceptHeadOfLine: one peer with the token that stalls after
// authenticating (a stopped process, a partition) held Accept for ever:
// no setup timeout, no keepalive yet, so a well-behaved dialer that came
// next was never accepted. The setup is bounded by HandshakeTimeout now.
func TestAcceptHeadOfLine(t *testing.T) {
	cfg := Config{Token: []byte("k"), Keepalive: time.Second, HandshakeTimeout: time.Second}
	l, err := Listen(context.Background(), "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dcfg := cfg.withDefaults()
	c, err := dialCtrl(context.Background(), l.Addr().String(), &dcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.close()
	for len(l.l.ready) == 0 {
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	type res struct {
		s   *Session
		err error
	}
	acc := make(chan res, 1)
	go func() {
		s, err := l.Accept(ctx)
		acc <- res{s, err}
	}()
	good, derr := Dial(ctx, l.Addr().String(), cfg)
	r := <-acc
	if good != nil {
		good.Close()
	}
	if r.s != nil {
		r.s.Close()
	}
	if derr != nil || r.err != nil {
		t.Fatalf("a good dialer behind a stalled one: Dial %v, Accept %v (want both to succeed: the stalled setup should time out)", derr, r.err)
	}
}
