package session

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs/internal/pintls"
)

// The bootstrap connection (ctrl) of a session: a TCP connection,
// encrypted with TLS 1.3 off-host, over which the two sides authenticate
// each other and then exchange framed control messages, with a keepalive.
//
// Handshake (wire version 1). Every message of it has a fixed size, and
// the acceptor reads nothing else, and allocates nothing, before the
// dialer proved the token:
//
//	dialer   → hello_d   "GVSS" | version u16 | flags u8 | 0 | nonce_d[32]
//	acceptor → hello_a   "GVSS" | version u16 | 0 u8     | 0 | nonce_a[32]
//	dialer   → proof_d   HMAC(K, "dialer" ‖ 0 ‖ hello_d ‖ hello_a ‖ B)
//	acceptor → verdict   status u8 | proof_a = HMAC(K, "acceptor" ‖ 0 ‖ hello_d ‖ hello_a ‖ B)
//
// K is SHA-256 of a label and the token (an empty token gives a key
// too: both sides must then have none), B the keying material exported
// from the TLS session (pintls.Binding), or nothing on plain TCP, so a
// relay between two TLS sessions cannot forward a proof; nonce_a makes
// every proof_d fresh, so a recorded hello and proof do not replay. The
// acceptor checks proof_d (in constant time) before it sends proof_a: a
// stranger learns nothing it could use, while a dialer that reached a
// server without the token fails with ErrAuth (mutual authentication).
// A failed proof_d is answered with a verdict of status 1 and no proof,
// so a misconfigured client gets ErrAuth rather than a bare EOF. Flag
// bit 0 of hello_d says the dialer has no token: it only makes the
// acceptor's reason for a refusal clearer.
//
// An acceptor answers a hello of another version with its own hello,
// then closes: each side names both versions (ErrProtocol).
//
// Frames after the handshake: type u8 | length u32 (big endian) |
// payload. Types 1..127 are the application's (send/recv); 128 and up
// are the connection's own: ping, pong, bye. A length over maxCtrlMsg is
// ErrProtocol before anything is allocated.

const (
	ctrlVersion  = 1
	helloLen     = 40
	proofLen     = sha256.Size
	verdictLen   = 1 + proofLen
	frameHdrLen  = 5
	maxCtrlMsg   = 64 << 10 // largest payload of one message
	ctrlQueueLen = 64       // application messages received and not yet read
	// ctrlLinger bounds how long close waits for the peer to see its
	// bye and close its end (so that the bye is not lost to a reset).
	ctrlLinger = 2 * time.Second

	flagNoToken = 1 << 0

	verdictOK     = 0
	verdictRefuse = 1

	tlsLabel = "EXPORTER-goverbs-session-v1"
	keyLabel = "goverbs session v1 token\x00"

	roleDialer   = "dialer"
	roleAcceptor = "acceptor"
)

var helloMagic = [4]byte{'G', 'V', 'S', 'S'}

// Message types of the connection itself.
const (
	msgPing = 128
	msgPong = 129
	msgBye  = 130
)

// tlsRecordHandshake is the first byte of a TLS ClientHello; a plain hello
// starts with 'G'.
const tlsRecordHandshake = 0x16

// TLS policies of Config.TLS.
const (
	tlsAuto = "auto"
	tlsOn   = "on"
	tlsOff  = "off"
)

func tlsPolicy(s string) (string, error) {
	switch p := strings.ToLower(strings.TrimSpace(s)); p {
	case "", tlsAuto:
		return tlsAuto, nil
	case tlsOn, tlsOff:
		return p, nil
	}
	return "", fmt.Errorf("session: Config.TLS %q: want auto, on or off", s)
}

// isLoopback reports whether a is a loopback IP address.
func isLoopback(a net.Addr) bool {
	t, ok := a.(*net.TCPAddr)
	return ok && t.IP.IsLoopback()
}

// needTLS: must a connection whose other end is at peer be encrypted?
func needTLS(policy string, peer net.Addr) bool {
	switch policy {
	case tlsOn:
		return true
	case tlsOff:
		return false
	}
	return !isLoopback(peer)
}

func macKey(token []byte) []byte {
	h := sha256.New()
	h.Write([]byte(keyLabel))
	h.Write(token)
	return h.Sum(nil)
}

func prove(key []byte, role string, dh, ah *[helloLen]byte, binding []byte) [proofLen]byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(role))
	m.Write([]byte{0})
	m.Write(dh[:])
	m.Write(ah[:])
	m.Write(binding)
	var p [proofLen]byte
	m.Sum(p[:0])
	return p
}

func makeHello(flags uint8) [helloLen]byte {
	var h [helloLen]byte
	copy(h[:4], helloMagic[:])
	binary.BigEndian.PutUint16(h[4:], ctrlVersion)
	h[6] = flags
	rand.Read(h[8:]) // never fails (crypto/rand)
	return h
}

// checkHello checks the magic and version of a hello from the peer
// (who: "dialer" or "acceptor").
func checkHello(h *[helloLen]byte, who string) error {
	if [4]byte(h[:4]) != helloMagic {
		return fmt.Errorf("%w: the %s's first bytes %q are not a goverbs session hello", ErrProtocol, who, h[:4])
	}
	if v := binary.BigEndian.Uint16(h[4:]); v != ctrlVersion {
		return fmt.Errorf("%w: the %s speaks version %d, this side version %d", ErrProtocol, who, v, ctrlVersion)
	}
	return nil
}

// handshakeErr describes an I/O failure of a handshake: the ctx's error
// when it ended, else the peer's silence or departure.
func handshakeErr(ctx context.Context, step string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w (%v)", step, ctx.Err(), err)
	}
	if errors.Is(err, ErrAuth) || errors.Is(err, ErrProtocol) {
		return err
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: %s: the peer closed the connection (it refused this side: "+
			"TLS policies that disagree, too many unauthenticated connections, or not a goverbs session listener)", ErrPeerLost, step)
	}
	return fmt.Errorf("%w: %s: %w", ErrPeerLost, step, err)
}

// clientHandshake runs the dialer's side of the handshake on raw and
// returns the connection to use from then on (raw, or a TLS session over
// it). It honours ctx and cfg.HandshakeTimeout; raw is left open on
// failure.
func clientHandshake(ctx context.Context, raw net.Conn, cfg *Config) (net.Conn, error) {
	policy, err := tlsPolicy(cfg.TLS)
	if err != nil {
		return nil, err
	}
	timeout := cfg.HandshakeTimeout
	if timeout <= 0 {
		timeout = defaultHandshake
	}
	raw.SetDeadline(time.Now().Add(timeout))
	stop := context.AfterFunc(ctx, func() { raw.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	nc, err := clientSteps(ctx, raw, cfg, policy, timeout)
	if err != nil {
		return nil, err
	}
	if !stop() {
		return nil, fmt.Errorf("handshake: %w", ctx.Err())
	}
	raw.SetDeadline(time.Time{})
	return nc, nil
}

func clientSteps(ctx context.Context, raw net.Conn, cfg *Config, policy string, timeout time.Duration) (net.Conn, error) {
	nc := raw
	var binding []byte
	if needTLS(policy, raw.RemoteAddr()) {
		tc := tls.Client(raw, pintls.UnpinnedClientConfig())
		if err := pintls.Handshake(ctx, tc, timeout); err != nil {
			return nil, handshakeErr(ctx, "TLS handshake", err)
		}
		b, err := pintls.Binding(tc, tlsLabel)
		if err != nil {
			return nil, fmt.Errorf("session: TLS binding: %w", err)
		}
		nc, binding = tc, b
	}
	var flags uint8
	if len(cfg.Token) == 0 {
		flags |= flagNoToken
	}
	dh := makeHello(flags)
	if _, err := nc.Write(dh[:]); err != nil {
		return nil, handshakeErr(ctx, "hello", err)
	}
	var ah [helloLen]byte
	if _, err := io.ReadFull(nc, ah[:]); err != nil {
		return nil, handshakeErr(ctx, "waiting for the acceptor's hello", err)
	}
	if err := checkHello(&ah, roleAcceptor); err != nil {
		return nil, err
	}
	key := macKey(cfg.Token)
	pd := prove(key, roleDialer, &dh, &ah, binding)
	if _, err := nc.Write(pd[:]); err != nil {
		return nil, handshakeErr(ctx, "proof", err)
	}
	var v [verdictLen]byte
	if _, err := io.ReadFull(nc, v[:]); err != nil {
		return nil, handshakeErr(ctx, "waiting for the acceptor's proof", err)
	}
	switch v[0] {
	case verdictOK:
	case verdictRefuse:
		return nil, fmt.Errorf("%w: the peer refused this side's proof (another token, or a token where it has none or the reverse)", ErrAuth)
	default:
		return nil, fmt.Errorf("%w: verdict %d", ErrProtocol, v[0])
	}
	pa := prove(key, roleAcceptor, &dh, &ah, binding)
	if subtle.ConstantTimeCompare(pa[:], v[1:]) != 1 {
		return nil, fmt.Errorf("%w: the peer did not prove the token (not the intended server, or another token)", ErrAuth)
	}
	return nc, nil
}

// dialCtrl connects to a listener at addr (host:port) and authenticates
// both ways. cfg has its defaults. A ctx that ends makes it return
// promptly with the ctx's error wrapped.
func dialCtrl(ctx context.Context, addr string, cfg *Config) (*ctrl, error) {
	if _, err := tlsPolicy(cfg.TLS); err != nil {
		return nil, err
	}
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return nil, err
	}
	nc, err := clientHandshake(ctx, raw, cfg)
	if err != nil {
		raw.Close()
		return nil, err
	}
	return newCtrl(raw, nc), nil
}

// ctrlListener accepts authenticated bootstrap connections. Each
// connection runs its handshake in a goroutine of its own, bounded by
// HandshakeTimeout; at most MaxStrangers connections are unauthenticated
// at once (over that the oldest is dropped), so a stranger costs a
// goroutine, a socket and a few hundred bytes, for a bounded time.
// Authenticated connections start their reader at once and wait for
// accept in a queue of MaxStrangers (past it, their handshake goroutines
// wait): only holders of the token can make it hold more. Its methods
// are safe for concurrent use.
type ctrlListener struct {
	ln     net.Listener
	cfg    Config
	policy string
	key    []byte
	id     *pintls.Identity // nil if TLS is off

	ready   chan *ctrl // authenticated, not yet accepted
	closing chan struct{}
	once    sync.Once
	wg      sync.WaitGroup

	mu        sync.Mutex
	strangers []*stranger // oldest first
	closed    bool
	nRefused  int
	lastErr   error // the last refusal's reason (diagnostics)
}

// stranger is an accepted connection that has not authenticated yet.
type stranger struct {
	c       net.Conn
	dropped bool
}

// warnedNoToken makes the warning of listenCtrl once per process.
var warnedNoToken sync.Once

// warnNoToken warns, once per process, of a listener without a token on
// an address that is not a loopback one.
func warnNoToken(token []byte, addr net.Addr) {
	if len(token) == 0 && !isLoopback(addr) {
		warnedNoToken.Do(func() {
			slog.Warn("session: listening without a token on a non-loopback address: any host that reaches it can connect (set Config.Token)",
				"addr", addr.String())
		})
	}
}

// listenCtrl listens on addr (TCP host:port; port 0 picks one). cfg has
// its defaults.
func listenCtrl(addr string, cfg *Config) (*ctrlListener, error) {
	policy, err := tlsPolicy(cfg.TLS)
	if err != nil {
		return nil, err
	}
	l := &ctrlListener{cfg: *cfg, policy: policy, key: macKey(cfg.Token), closing: make(chan struct{})}
	if l.cfg.MaxStrangers <= 0 {
		l.cfg.MaxStrangers = defaultMaxStrangers
	}
	if l.cfg.HandshakeTimeout <= 0 {
		l.cfg.HandshakeTimeout = defaultHandshake
	}
	l.ready = make(chan *ctrl, l.cfg.MaxStrangers)
	if policy != tlsOff {
		if l.id, err = pintls.NewIdentity(); err != nil {
			return nil, fmt.Errorf("session: listen: %w", err)
		}
	}
	if l.ln, err = net.Listen("tcp", addr); err != nil {
		return nil, fmt.Errorf("session: listen: %w", err)
	}
	warnNoToken(cfg.Token, l.ln.Addr())
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// Addr is the address the listener listens on.
func (l *ctrlListener) Addr() net.Addr { return l.ln.Addr() }

func (l *ctrlListener) acceptLoop() {
	defer l.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.closing:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, or an aborted connection: wait a
			// little, as net/http does.
			t := time.NewTimer(backoff)
			select {
			case <-l.closing:
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		st := l.admit(c)
		if st == nil {
			return
		}
		l.wg.Add(1)
		go l.serve(st)
	}
}

// admit registers c as a stranger, dropping the oldest over
// MaxStrangers. It returns nil (and closes c) if the listener closed.
func (l *ctrlListener) admit(c net.Conn) *stranger {
	st := &stranger{c: c}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		c.Close()
		return nil
	}
	if len(l.strangers) >= l.cfg.MaxStrangers {
		o := l.strangers[0]
		l.strangers = l.strangers[1:]
		o.dropped = true
		o.c.Close() // its handshake fails at once
	}
	l.strangers = append(l.strangers, st)
	return st
}

// promote takes st out of the strangers; false if it was dropped.
func (l *ctrlListener) promote(st *stranger) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if st.dropped {
		return false
	}
	l.remove(st)
	return true
}

func (l *ctrlListener) remove(st *stranger) {
	for i, o := range l.strangers {
		if o == st {
			l.strangers = append(l.strangers[:i], l.strangers[i+1:]...)
			return
		}
	}
}

var errDropped = errors.New("session: unauthenticated connection dropped (over MaxStrangers, or the listener closed)")

// serve runs the handshake of st and queues the connection for accept.
func (l *ctrlListener) serve(st *stranger) {
	defer l.wg.Done()
	nc, err := l.serverHandshake(st)
	if err != nil {
		st.c.Close()
		l.mu.Lock()
		l.remove(st)
		if !l.closed {
			l.nRefused++
			l.lastErr = fmt.Errorf("session: connection from %s refused: %w", st.c.RemoteAddr(), err)
		}
		l.mu.Unlock()
		return
	}
	c := newCtrl(st.c, nc)
	select {
	case l.ready <- c:
	case <-l.closing:
		c.close()
	}
}

// serverHandshake runs the acceptor's side of the handshake on st and
// returns the connection to use (st.c, or a TLS session over it).
func (l *ctrlListener) serverHandshake(st *stranger) (net.Conn, error) {
	raw := st.c
	deadline := time.Now().Add(l.cfg.HandshakeTimeout)
	raw.SetDeadline(deadline)
	var dh [helloLen]byte
	if _, err := io.ReadFull(raw, dh[:1]); err != nil {
		return nil, err
	}
	nc := raw
	var binding []byte
	if dh[0] == tlsRecordHandshake && l.id != nil {
		tc := tls.Server(&pintls.PrefixConn{Conn: raw, Pre: dh[:1:1]}, l.id.ServerConfig())
		if err := pintls.Handshake(context.Background(), tc, time.Until(deadline)); err != nil {
			return nil, fmt.Errorf("TLS handshake: %w", err)
		}
		b, err := pintls.Binding(tc, tlsLabel)
		if err != nil {
			return nil, fmt.Errorf("TLS binding: %w", err)
		}
		nc, binding = tc, b
		if _, err := io.ReadFull(nc, dh[:]); err != nil {
			return nil, err
		}
	} else {
		if dh[0] == tlsRecordHandshake {
			return nil, fmt.Errorf("%w: a TLS connection, and TLS is off here", ErrProtocol)
		}
		if needTLS(l.policy, raw.RemoteAddr()) {
			return nil, fmt.Errorf("%w: plain TCP from %s, and TLS is %s here", ErrProtocol, raw.RemoteAddr(), l.policy)
		}
		if _, err := io.ReadFull(raw, dh[1:]); err != nil {
			return nil, err
		}
	}
	if [4]byte(dh[:4]) != helloMagic {
		return nil, checkHello(&dh, roleDialer)
	}
	ah := makeHello(0)
	if _, err := nc.Write(ah[:]); err != nil {
		return nil, err
	}
	if err := checkHello(&dh, roleDialer); err != nil {
		return nil, err // another version: it has our hello, and says why
	}
	var pd [proofLen]byte
	if _, err := io.ReadFull(nc, pd[:]); err != nil {
		return nil, err
	}
	want := prove(l.key, roleDialer, &dh, &ah, binding)
	if subtle.ConstantTimeCompare(want[:], pd[:]) != 1 {
		v := [verdictLen]byte{verdictRefuse}
		nc.Write(v[:])
		why := "another token"
		switch {
		case dh[6]&flagNoToken != 0 && len(l.cfg.Token) != 0:
			why = "the dialer has no token, this side has one"
		case dh[6]&flagNoToken == 0 && len(l.cfg.Token) == 0:
			why = "the dialer has a token, this side has none"
		}
		return nil, fmt.Errorf("%w: the dialer's proof is wrong (%s)", ErrAuth, why)
	}
	if !l.promote(st) {
		return nil, errDropped
	}
	v := [verdictLen]byte{verdictOK}
	pa := prove(l.key, roleAcceptor, &dh, &ah, binding)
	copy(v[1:], pa[:])
	if _, err := nc.Write(v[:]); err != nil {
		return nil, err
	}
	raw.SetDeadline(time.Time{})
	return nc, nil
}

// accept returns the next authenticated connection. It fails with
// ErrClosed once the listener is closed, or with ctx's error.
func (l *ctrlListener) accept(ctx context.Context) (*ctrl, error) {
	select {
	case c := <-l.ready:
		return c, nil
	default:
	}
	select {
	case c := <-l.ready:
		return c, nil
	case <-l.closing:
		return nil, fmt.Errorf("session: accept: %w", ErrClosed)
	case <-ctx.Done():
		return nil, fmt.Errorf("session: accept: %w", ctx.Err())
	}
}

// refused counts the connections that failed their handshake (wrong
// token, protocol, timeout) or were dropped over MaxStrangers; not those
// cut by close. A connection is counted after it was closed.
func (l *ctrlListener) refused() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.nRefused
}

// lastRefusal is the reason of the last refusal (nil if none).
func (l *ctrlListener) lastRefusal() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lastErr
}

// close stops listening, drops the strangers, closes the authenticated
// connections not accepted yet (their peers see ErrPeerClosed), and
// waits for its goroutines. Idempotent.
func (l *ctrlListener) close() error {
	var err error
	l.once.Do(func() {
		l.mu.Lock()
		l.closed = true
		for _, st := range l.strangers {
			st.dropped = true
			st.c.Close()
		}
		l.strangers = nil
		l.mu.Unlock()
		close(l.closing)
		err = l.ln.Close()
		l.wg.Wait()
		var wg sync.WaitGroup
		for {
			select {
			case c := <-l.ready:
				wg.Add(1)
				go func() { defer wg.Done(); c.close() }()
				continue
			default:
			}
			break
		}
		wg.Wait()
	})
	return err
}

// ctrl is an authenticated, framed bootstrap connection to the peer of a
// session. A reader goroutine reads its frames from the end of the
// handshake on: it queues application messages for recv (at most
// ctrlQueueLen; while the queue is full it stops reading the socket, so
// a peer that sends faster than the application reads is held back by
// TCP, not by memory), answers pings, and records the end. send, recv,
// done, err and close are safe for concurrent use.
//
// Keepalive (startKeepalive) counts any frame from the peer as a sign of
// life. While the reader waits for room in a full queue, the silence is
// this side's doing, not the peer's: the peer is not judged then (its
// pings wait in the socket), and the peer keeps hearing this side's own
// pings, which are sent by another goroutine.
type ctrl struct {
	raw net.Conn // the TCP connection
	nc  net.Conn // raw, or the TLS session over it
	enc bool
	br  *bufio.Reader

	q       chan bootMsg
	pingReq chan struct{}
	pongReq chan struct{}

	wmu     sync.Mutex
	wbuf    []byte
	wbroken bool // a write failed: the stream may hold part of a frame

	t0      time.Time
	lastRx  atomic.Int64 // time.Since(t0) of the last frame from the peer
	stalled atomic.Bool  // the reader waits for room in q

	mu       sync.Mutex
	endErr   error
	doneCh   chan struct{}
	closing  atomic.Bool // close was called: the reader drains, discarding
	readDone chan struct{}

	closeOnce sync.Once
	kaOnce    sync.Once
	wg        sync.WaitGroup
}

type bootMsg struct {
	typ     uint8
	payload []byte
}

// newCtrl starts the connection's goroutines on nc, the handshake done.
func newCtrl(raw, nc net.Conn) *ctrl {
	_, enc := nc.(*tls.Conn)
	c := &ctrl{
		raw: raw, nc: nc, enc: enc,
		br:       bufio.NewReaderSize(nc, 16<<10),
		q:        make(chan bootMsg, ctrlQueueLen),
		pingReq:  make(chan struct{}, 1),
		pongReq:  make(chan struct{}, 1),
		t0:       time.Now(),
		doneCh:   make(chan struct{}),
		readDone: make(chan struct{}),
	}
	c.wg.Add(2)
	go c.readLoop()
	go c.pinger()
	return c
}

func (c *ctrl) encrypted() bool      { return c.enc }
func (c *ctrl) localAddr() net.Addr  { return c.raw.LocalAddr() }
func (c *ctrl) remoteAddr() net.Addr { return c.raw.RemoteAddr() }

// done is closed when the connection ended; err then says why.
func (c *ctrl) done() <-chan struct{} { return c.doneCh }

// err is why the connection ended: ErrPeerClosed (the peer's bye),
// ErrPeerLost (EOF or reset without a bye, or a failed write),
// ErrPeerUnresponsive (silence past the keepalive), ErrProtocol (the
// peer sent something malformed), ErrClosed (closed here); nil before.
func (c *ctrl) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.endErr
}

// end records why the connection ended; the first reason wins. It
// reports whether this call ended it.
func (c *ctrl) end(err error) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.endErr != nil {
		return false
	}
	c.endErr = err
	close(c.doneCh)
	return true
}

// fail ends the connection for err and closes the socket (the peer
// broke, went silent, or broke the protocol).
func (c *ctrl) fail(err error) {
	if c.end(err) {
		c.nc.Close()
	}
}

func (c *ctrl) since() int64 { return int64(time.Since(c.t0)) }

func (c *ctrl) readLoop() {
	defer c.wg.Done()
	defer close(c.readDone)
	var hdr [frameHdrLen]byte
	for {
		if _, err := io.ReadFull(c.br, hdr[:]); err != nil {
			c.readFailed(err)
			return
		}
		typ, n := hdr[0], binary.BigEndian.Uint32(hdr[1:])
		if n > maxCtrlMsg {
			c.fail(fmt.Errorf("%w: the peer declared a message of %d bytes (at most %d)", ErrProtocol, n, maxCtrlMsg))
			return
		}
		if typ >= msgPing && n != 0 || typ == 0 || typ > msgBye {
			c.fail(fmt.Errorf("%w: message of type %d and %d bytes", ErrProtocol, typ, n))
			return
		}
		var payload []byte
		if n > 0 {
			payload = make([]byte, n)
			if _, err := io.ReadFull(c.br, payload); err != nil {
				c.readFailed(err)
				return
			}
		}
		c.lastRx.Store(c.since())
		switch typ {
		case msgPing:
			select {
			case c.pongReq <- struct{}{}:
			default: // a pong is due already
			}
			continue
		case msgPong:
			continue
		case msgBye:
			if c.end(fmt.Errorf("%w (%s)", ErrPeerClosed, c.raw.RemoteAddr())) {
				c.nc.Close()
			}
			return
		}
		if !c.push(bootMsg{typ, payload}) {
			return
		}
	}
}

// push queues m for recv, waiting for room (see ctrl). It reports
// whether the reader goes on.
func (c *ctrl) push(m bootMsg) bool {
	select {
	case c.q <- m:
		return true
	default:
	}
	c.stalled.Store(true)
	defer func() {
		c.lastRx.Store(c.since()) // before stalled is cleared: see watch
		c.stalled.Store(false)
	}()
	select {
	case c.q <- m:
		return true
	case <-c.doneCh:
		// Closed here: read on (discarding) until the peer closes its
		// end or close stops waiting. Ended otherwise: stop.
		return c.closing.Load()
	}
}

func (c *ctrl) readFailed(err error) {
	if c.closing.Load() {
		return
	}
	c.fail(fmt.Errorf("%w: connection to %s broke without a bye: %w", ErrPeerLost, c.raw.RemoteAddr(), err))
}

// pinger writes the pings and pongs, so that neither the reader nor the
// watchdog ever blocks in a write.
func (c *ctrl) pinger() {
	defer c.wg.Done()
	for {
		var typ uint8
		select {
		case <-c.doneCh:
			return
		case <-c.pingReq:
			typ = msgPing
		case <-c.pongReq:
			typ = msgPong
		}
		c.writeFrame(typ, nil)
	}
}

// startKeepalive starts the keepalive: a ping every keepalive/3, and a
// peer from which nothing arrived for keepalive ends the connection with
// ErrPeerUnresponsive (detected within 4/3 keepalive). Zero means the
// default (5 s); negative: no keepalive (pings of the peer are still
// answered). Only the first call counts.
func (c *ctrl) startKeepalive(keepalive time.Duration) {
	if keepalive < 0 {
		return
	}
	if keepalive == 0 {
		keepalive = defaultKeepalive
	}
	c.kaOnce.Do(func() {
		c.wg.Add(1)
		go c.watch(keepalive)
	})
}

func (c *ctrl) watch(d time.Duration) {
	defer c.wg.Done()
	c.lastRx.Store(c.since()) // the peer has a full period from now
	t := time.NewTicker(max(d/3, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-c.doneCh:
			return
		case <-t.C:
		}
		// stalled first: a reader that stops waiting stores lastRx
		// before it clears stalled.
		if !c.stalled.Load() {
			if silent := time.Duration(c.since() - c.lastRx.Load()); silent > d {
				c.fail(fmt.Errorf("%w: nothing from %s for %v (keepalive %v)", ErrPeerUnresponsive, c.raw.RemoteAddr(), silent.Round(time.Millisecond), d))
				return
			}
		}
		select {
		case c.pingReq <- struct{}{}:
		default: // the last one is still being written
		}
	}
}

// writeFrame writes one frame under wmu. A failed write ends the
// connection (ErrPeerLost) unless it ended already.
func (c *ctrl) writeFrame(typ uint8, payload []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.err(); err != nil {
		return err
	}
	if c.wbroken {
		return fmt.Errorf("%w: an earlier write failed", ErrPeerLost)
	}
	c.wbuf = append(c.wbuf[:0], typ, 0, 0, 0, 0)
	binary.BigEndian.PutUint32(c.wbuf[1:], uint32(len(payload)))
	c.wbuf = append(c.wbuf, payload...)
	if _, err := c.nc.Write(c.wbuf); err != nil {
		c.wbroken = true
		c.fail(fmt.Errorf("%w: write to %s: %w", ErrPeerLost, c.raw.RemoteAddr(), err))
		return c.err()
	}
	return nil
}

// send sends one application message: typ in 1..127, at most maxCtrlMsg
// bytes. It blocks while the peer does not read (TCP flow control) until
// the connection ends (the keepalive ends it if the peer is gone). Safe
// for concurrent use; messages of one goroutine arrive in order.
func (c *ctrl) send(typ uint8, payload []byte) error {
	if typ == 0 || typ >= msgPing {
		return fmt.Errorf("session: control message type %d outside 1..127", typ)
	}
	if len(payload) > maxCtrlMsg {
		return fmt.Errorf("session: control message of %d bytes: %w (at most %d)", len(payload), ErrLimit, maxCtrlMsg)
	}
	return c.writeFrame(typ, payload)
}

// recv returns the next application message; its payload is the
// caller's (a fresh buffer, nil if empty). Messages that arrived
// before the peer's bye are returned before its ErrPeerClosed; once
// closed here it returns ErrClosed. A ctx that ends makes it return its
// error, wrapped; the connection goes on.
func (c *ctrl) recv(ctx context.Context) (uint8, []byte, error) {
	if c.closing.Load() {
		return 0, nil, c.err()
	}
	select {
	case m := <-c.q:
		return m.typ, m.payload, nil
	default:
	}
	select {
	case m := <-c.q:
		return m.typ, m.payload, nil
	case <-c.doneCh:
		if !c.closing.Load() {
			select {
			case m := <-c.q:
				return m.typ, m.payload, nil
			default:
			}
		}
		return 0, nil, c.err()
	case <-ctx.Done():
		return 0, nil, fmt.Errorf("session: recv: %w", ctx.Err())
	}
}

// close says bye to the peer (best effort, bounded by ctrlLinger), then
// closes the connection and waits for its goroutines. The peer's err
// becomes ErrPeerClosed. Idempotent; err becomes ErrClosed unless the
// connection had ended already.
func (c *ctrl) close() error {
	c.closeOnce.Do(func() {
		c.closing.Store(true)
		if c.end(ErrClosed) {
			deadline := time.Now().Add(ctrlLinger)
			// A writer blocked on a peer that does not read gives up by
			// the deadline, and releases wmu.
			c.raw.SetWriteDeadline(deadline)
			c.wmu.Lock()
			if !c.wbroken {
				hdr := [frameHdrLen]byte{msgBye}
				if _, err := c.nc.Write(hdr[:]); err == nil {
					if tc, ok := c.nc.(*tls.Conn); ok {
						tc.CloseWrite()
					}
					if tc, ok := c.raw.(*net.TCPConn); ok {
						tc.CloseWrite()
					}
				}
			}
			c.wbroken = true
			c.wmu.Unlock()
			// Read (and discard) until the peer closes its end: closing
			// with unread data would reset the connection, and could
			// lose the bye.
			c.raw.SetReadDeadline(deadline)
			<-c.readDone
		}
		c.nc.Close()
		c.wg.Wait()
	})
	return nil
}
