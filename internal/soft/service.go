package soft

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/netsrc"
	"github.com/goverbs/verbs/internal/pintls"
)

// The soft service of a process: what lets QPs of other processes reach this
// process' QPs. It listens on an abstract unix socket (same host) and on TCP
// (GOVERBS_SOFT_LISTEN, default 127.0.0.1:0; "off" disables it), and holds
// the process' connections to other processes (conn.go). It starts when a
// QP first needs it (its address is asked for, or it connects to another
// process) and stops, closing every connection and waiting for every
// goroutine it started, when the last device context of the process
// closes. A connection closes gracefully: what it holds for the peer
// (acknowledgements, queued frames) is written first, and the peer sees
// the end of the stream after it (conn.closeGracefully), within
// lingerTimeout.
//
// Handshake: see handshake.go (who may connect and how identities are
// proven) and tls.go (encryption off the host). Strangers: at most
// maxHandshakes connections, maxHandshakesPerSource of one source
// address and maxHandshakesPerNet of one IPv6 /64 (netsrc), may be in
// their handshake at once; past that the oldest is closed. A handshake holds a goroutine and a few hundred bytes (tens of
// KiB with TLS) for at most handshakeTimeout; nothing else is allocated
// or parsed for a peer before it has proven that it holds one of this
// process' endpoints. Processes of this user on this host (unix sockets,
// whose credentials the kernel gives) count apart, up to
// maxLocalHandshakes: the ranks of a large job on one host connect to
// each other all at once (hundreds per process), and a same-user process
// could do worse than fill a queue. Their handshakes may last up to
// handshakeMax while they run (peerlife.go).
//
// Accept errors: a temporary one (too many open files, out of buffers, a
// connection aborted before it was accepted) is logged (log/slog) and
// retried after a pause that doubles from 5 ms to 1 s, as net/http's
// Server does; only the listener's Close ends the loop.

// maxRemoteConns bounds the TCP connections a service accepted and
// holds, those of peers that proved the secret included: each holds a receive buffer
// (sockRxInit, up to sockRxSize) and goroutines, and a holder of one of
// this process' endpoints could otherwise open them without end. Past
// it a handshake is refused (ackTooMany). Connections of this user's
// processes on this host (unix sockets, shared memory) do not count: a
// rank of a large world on one host holds one per other rank, and such
// a process could do worse. A variable for tests.
var maxRemoteConns = 4096 // under service.mu

const envListen = "GOVERBS_SOFT_LISTEN"

// envAdvertise names the TCP addresses to advertise in endpoints
// (host or host:port, comma-separated; the port defaults to the
// listener's), for a listener on an unspecified address behind NAT or
// with interfaces peers cannot reach.
const envAdvertise = "GOVERBS_SOFT_ADVERTISE"

const (
	dialTimeout      = 5 * time.Second
	handshakeTimeout = 5 * time.Second

	// lingerTimeout bounds how long stopping the service waits for its
	// connections to hand over what they hold (conn.closeGracefully).
	lingerTimeout = time.Second

	maxHandshakes          = 64
	maxHandshakesPerSource = 16
	maxHandshakesPerNet    = maxHandshakes / 2
	maxLocalHandshakes     = 4096

	// maxLocalDials bounds the connections to processes of this host
	// (unix sockets, shared memory) that this process has in their
	// handshake at once; more wait for a slot, without a deadline
	// running. A rank of a large world on one host that writes to every
	// other connects to all of them at once: 192 ranks on 2 CPUs made
	// 36 000 handshakes at once, which starved each other past their
	// deadlines (handshakeMax) and failed the world.
	maxLocalDials = 8
)

// localSource is the source key of unix-socket connections from processes
// of this user (sourceKey).
const localSource = "local"

type service struct {
	f      *fabric
	secret [16]byte
	job    [16]byte
	host   [16]byte
	addr   []byte           // this process' provider address
	tlsID  *pintls.Identity // nil: no TCP listener

	tcpLn   net.Listener
	unixLn  net.Listener
	stopped chan struct{} // closed by stop
	dials   chan struct{} // a slot per local dial in its handshake (maxLocalDials)

	hsMu     sync.Mutex
	hs       []*handshaking // connections in their handshake, oldest first
	hsBySrc  map[string]int // how many per source address and IPv6 /64 (TCP)
	hsDrops  atomic.Uint64  // handshakes ended early: too many at once
	acceptEr atomic.Uint64  // temporary accept errors

	mu     sync.Mutex
	closed bool
	peers  map[peerKey]*peer
	conns  map[*conn]struct{}
	remote int            // of conns, over TCP (maxRemoteConns)
	pc     pollConns      // the same, for polls (progress.go)
	wg     sync.WaitGroup // every goroutine of the service
}

type peerKey struct {
	fabric uint64
	kind   string
}

// openContext and closeContext count the open device contexts; the service
// stops when the count drops to zero.
func (f *fabric) openContext() {
	f.svcMu.Lock()
	f.nctx++
	f.svcMu.Unlock()
}

func (f *fabric) closeContext() {
	f.svcMu.Lock()
	f.nctx--
	var s *service
	if f.nctx == 0 {
		s = f.svc.Swap(nil)
	}
	f.svcMu.Unlock()
	if s != nil {
		s.stop()
	}
}

// service returns the running service, starting it if needed. It returns
// nil if no context is open.
func (f *fabric) service() *service {
	if s := f.svc.Load(); s != nil {
		return s
	}
	f.svcMu.Lock()
	defer f.svcMu.Unlock()
	if s := f.svc.Load(); s != nil {
		return s
	}
	if f.nctx == 0 {
		return nil
	}
	s := startService(f)
	f.svc.Store(s)
	return s
}

// address returns this process' provider address. Unless the transport is
// forced to "inproc", it starts the service so that the address names its
// listeners.
func (f *fabric) address() []byte {
	if k, err := transportChoice(); err == nil && k == transportDirect {
		return f.addr
	}
	if s := f.service(); s != nil {
		return s.addr
	}
	return f.addr
}

func startService(f *fabric) *service {
	s := &service{f: f, job: jobIdentity(), host: hostIdentity(), stopped: make(chan struct{}), dials: make(chan struct{}, maxLocalDials),
		hsBySrc: map[string]int{}, peers: map[peerKey]*peer{}, conns: map[*conn]struct{}{}}
	copy(s.secret[:], randomBytes(16))
	pa := peerAddr{fabric: f.id, pid: f.pid, host: s.host, hasHost: true, secret: s.secret, hasSecret: true}

	name := fmt.Sprintf("@goverbs-soft-%016x-%x", f.id, randomBytes(4))
	if ln, err := net.Listen("unix", name); err == nil {
		s.unixLn = ln
		pa.unix = name
	}
	la := strings.TrimSpace(os.Getenv(envListen))
	if la == "" {
		la = "127.0.0.1:0"
	}
	if la != "off" && la != "none" {
		id, err := pintls.NewIdentity()
		if err != nil {
			slog.Warn("soft: no TCP transport: cannot make a TLS identity", "err", err)
		} else if ln, err := net.Listen("tcp", la); err != nil {
			slog.Warn("soft: no TCP transport", "listen", la, "err", err)
		} else {
			s.tcpLn, s.tlsID = ln, id
			pa.tcp = advertisedTCP(ln.Addr().(*net.TCPAddr), os.Getenv(envAdvertise))
			pa.cert, pa.hasCert = id.Fingerprint(), true
		}
	}
	s.addr = encodePeerAddr(&pa)
	for _, ln := range []net.Listener{s.unixLn, s.tcpLn} {
		if ln != nil {
			s.wg.Add(1)
			go s.acceptLoop(ln)
		}
	}
	return s
}

func (s *service) stop() {
	s.mu.Lock()
	s.closed = true
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	close(s.stopped)
	if s.unixLn != nil {
		s.unixLn.Close()
	}
	if s.tcpLn != nil {
		s.tcpLn.Close()
	}
	// Every connection closes as Close does (conn.closeGracefully), all
	// at once.
	deadline := time.Now().Add(lingerTimeout)
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.closeGracefully(errors.New("soft: the service of this process stopped"), deadline)
		}()
	}
	wg.Wait()
	s.wg.Wait()
}

// flushHeld sends the responses held on every connection: a QP closes,
// and its application may exit next.
func (s *service) flushHeld() {
	if l := s.pc.list.Load(); l != nil {
		for _, c := range *l {
			c.flushResps()
		}
	}
}

// Pauses after a temporary accept error (see the package comment).
const (
	minAcceptPause = 5 * time.Millisecond
	maxAcceptPause = time.Second
)

func (s *service) acceptLoop(ln net.Listener) {
	defer s.wg.Done()
	var pause time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Every other error is taken for a temporary one: a
			// listener that stops accepting for good would leave
			// every later peer hanging in the backlog.
			pause = min(max(2*pause, minAcceptPause), maxAcceptPause)
			s.acceptEr.Add(1)
			slog.Warn("soft: accept failed; retrying", "listener", ln.Addr().String(), "err", err, "pause", pause)
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-s.stopped:
				t.Stop()
				return
			}
			continue
		}
		pause = 0
		if !s.track() {
			c.Close()
			return
		}
		src, net64, localPID := sourceKey(c)
		h := s.startHandshake(c, src, net64)
		go func() {
			defer s.wg.Done()
			defer s.endHandshake(h)
			s.serveHandshake(c, localPID)
		}()
	}
}

// sourceKey is what the per-source handshake limit counts: the remote IP
// of a TCP connection, localSource for a unix socket of a process of this
// user (localPID: its process id, as the kernel gives it), "" for other
// unix sockets (only the global limit bounds them); and the IPv6 /64 of
// a TCP connection's address, "" if it has none (netsrc.Net64).
func sourceKey(c net.Conn) (key, net64 string, localPID uint32) {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.IP.String(), netsrc.Net64(a.IP), 0
	}
	if uc, ok := c.(*net.UnixConn); ok {
		if cred, err := peerCred(uc); err == nil && cred.Uid == uint32(os.Getuid()) {
			return localSource, "", uint32(max(cred.Pid, 0))
		}
	}
	return "", "", 0
}

// handshaking is a connection in its handshake.
type handshaking struct {
	nc    net.Conn
	src   string
	net64 string // counted in hsBySrc too (a CIDR: no address collides)
}

// startHandshake counts a connection in its handshake. Over a limit (all
// of them, or those of its source) the oldest one is closed, which ends
// its handshake: a stranger that opens connections without finishing
// their handshakes makes the others wait at most as long as it keeps
// opening new ones, and holds at most maxHandshakes of them.
func (s *service) startHandshake(nc net.Conn, src, net64 string) *handshaking {
	h := &handshaking{nc: nc, src: src, net64: net64}
	s.hsMu.Lock()
	var drop *handshaking
	switch {
	case src == localSource:
		if s.hsBySrc[src] >= maxLocalHandshakes {
			drop = s.oldestLocked(src)
		}
	case src != "" && s.hsBySrc[src] >= maxHandshakesPerSource:
		drop = s.oldestLocked(src)
	case net64 != "" && s.hsBySrc[net64] >= maxHandshakesPerNet:
		drop = s.oldestLocked(net64)
	case len(s.hs)-s.hsBySrc[localSource] >= maxHandshakes:
		for _, o := range s.hs {
			if o.src != localSource {
				drop = o
				break
			}
		}
	}
	if drop != nil {
		s.removeHandshakeLocked(drop)
	}
	s.hs = append(s.hs, h)
	if src != "" {
		s.hsBySrc[src]++
	}
	if net64 != "" {
		s.hsBySrc[net64]++
	}
	s.hsMu.Unlock()
	if drop != nil {
		drop.nc.Close()
		if n := s.hsDrops.Add(1); n&(n-1) == 0 { // logged at 1, 2, 4, 8, ... drops
			slog.Warn("soft: too many connections in their handshake; closed the oldest", "source", drop.src, "dropped", n)
		}
	}
	return h
}

// oldestLocked returns the oldest handshake from src, a source address
// or an IPv6 /64 (hsMu held; the two never look alike).
func (s *service) oldestLocked(src string) *handshaking {
	for _, o := range s.hs {
		if o.src == src || o.net64 == src {
			return o
		}
	}
	return nil
}

// endHandshake uncounts h (the handshake ended, or h was dropped).
func (s *service) endHandshake(h *handshaking) {
	s.hsMu.Lock()
	s.removeHandshakeLocked(h)
	s.hsMu.Unlock()
}

func (s *service) removeHandshakeLocked(h *handshaking) {
	i := slices.Index(s.hs, h)
	if i < 0 {
		return
	}
	s.hs = slices.Delete(s.hs, i, i+1)
	for _, k := range [...]string{h.src, h.net64} {
		if k != "" {
			if s.hsBySrc[k]--; s.hsBySrc[k] <= 0 {
				delete(s.hsBySrc, k)
			}
		}
	}
}

// track registers a goroutine of the service unless it is stopping.
func (s *service) track() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// addConn registers a live connection and starts its goroutines; it fails
// if the service is stopping.
func (s *service) addConn(c *conn) bool {
	if pullKind(c.kind) {
		// The first frame, before any other writer can hold the
		// connection: a probe written while a consumer sends an
		// acknowledgement would make it wait in the queue, and a peer
		// that exits right after its receive would take it along.
		c.offerPull()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	s.pc.set(s.conns)
	loops := []func(){c.readLoop, c.flushLoop}
	if c.shm != nil {
		loops = append(loops, c.watchSocket)
	}
	s.wg.Add(len(loops))
	c.loops.Add(len(loops))
	for _, f := range loops {
		go func() {
			defer s.wg.Done()
			defer c.loops.Done()
			f()
		}()
	}
	if c.shm != nil || c.acks != nil {
		// Unmap once the connection is down and nothing uses the
		// shared memory: the loops have ended, pollers and consumers
		// (which write this side's acknowledgement word) hold rmu,
		// writers hold wmu (and check dead under it), and fail read the
		// peer's acknowledgement word before done.
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			<-c.done
			c.loops.Wait()
			c.rmu.Lock()
			if c.acks != nil {
				c.acks.unmap()
			}
			if c.shm != nil {
				c.unmapImports()
				c.wmu.Lock()
				c.shm.unmap()
				c.wmu.Unlock()
			}
			c.closePidfd() // consumers, which pull, hold rmu
			c.rmu.Unlock()
		}()
	}
	return true
}

// reserveRemote takes a place for a TCP connection being accepted, if
// the service holds fewer than maxRemoteConns: before the handshake's
// answer, so that a dialer told yes has one. removeConn gives it back
// (or releaseRemote, if the connection is not added).
func (s *service) reserveRemote() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.remote >= maxRemoteConns {
		return false
	}
	s.remote++
	return true
}

func (s *service) releaseRemote() {
	s.mu.Lock()
	s.remote--
	s.mu.Unlock()
}

func (s *service) removeConn(c *conn) {
	s.mu.Lock()
	if _, ok := s.conns[c]; ok && c.inboundTCP() {
		s.remote--
	}
	delete(s.conns, c)
	s.pc.set(s.conns)
	s.mu.Unlock()
}

// serveHandshake runs the acceptor side of a handshake on a new
// connection (handshake.go). localPID is the process id of a dialer of
// this user on this host (sourceKey), 0 otherwise.
func (s *service) serveHandshake(nc net.Conn, localPID uint32) {
	deadline := time.Now().Add(handshakeTimeout)
	nc.SetDeadline(deadline)
	var buf [hdrLen + helloLen]byte
	uc, isUnix := nc.(*net.UnixConn)
	stopWatch := func() {}
	if localPID > 0 {
		// A process of this user on this host that is slow to speak, not
		// gone (peerlife.go); it proves who it is below.
		ctx, stop := watchLocal(localPID, localHandshakeQuiet, handshakeMax)
		stopConn := watchConn(ctx, nc)
		stopWatch = func() { stopConn(); stop() }
		defer stopWatch()
		deadline = time.Now().Add(handshakeMax)
		nc.SetDeadline(deadline)
	}
	var rw io.ReadWriter = nc
	var tc *tls.Conn
	var binding []byte
	var fds []int
	var err error
	if isUnix {
		fds, err = readMsgFDs(uc, buf[:], shmFDs)
	} else if _, err = io.ReadFull(nc, buf[:1]); err == nil {
		// TCP: a TLS ClientHello (a handshake record) or a plain HELLO.
		if buf[0] == tlsRecordHandshake && s.tlsID != nil {
			tc = tls.Server(newBufConn(&pintls.PrefixConn{Conn: nc, Pre: buf[:1:1]}), s.tlsID.ServerConfig())
			rw = tc
			if err = tlsHandshake(tc, time.Until(deadline)); err == nil {
				binding, err = tlsBinding(tc)
			}
			if err == nil {
				_, err = io.ReadFull(tc, buf[:])
			}
		} else {
			_, err = io.ReadFull(nc, buf[1:])
		}
	}
	defer func() { fdpass.Close(fds) }()
	if err != nil {
		nc.Close()
		return
	}
	hl, err := decodeHello(buf[:])
	if err != nil {
		nc.Close()
		return
	}
	ch := challenge{status: ackOK, pid: s.f.pid, fabric: s.f.id}
	policy, perr := tlsPolicy()
	switch {
	case hl.target != s.f.id:
		ch.status = ackBadTarget
	case hl.job != s.job:
		ch.status = ackBadJob
	case isUnix != (hl.kind == kindUnix || hl.kind == kindShm):
		ch.status = ackBadPeer
	case isUnix && checkPeerCred(uc, hl.pid) != nil:
		ch.status = ackBadPeer
	case hl.kind == kindShm && checkShmFDs(fds) != nil,
		hl.kind == kindUnix && (len(fds) > 1 || len(fds) == 1 && checkAckPageFD(fds[0]) != nil),
		hl.kind == kindTCP && len(fds) > 0:
		ch.status = ackBadShm
	case !isUnix && tc == nil && (perr != nil || needTLS(policy, nc.RemoteAddr())):
		ch.status = ackNeedTLS
	}
	var t [32]byte
	if ch.status == ackOK {
		copy(ch.nonce[:], randomBytes(hsNonceLen))
		t = transcript(buf[hdrLen:], ch.pid, ch.fabric, &ch.nonce, binding)
		ch.proof = handshakeMAC(&s.secret, labelAcceptor, &t)
	}
	var out [hdrLen + challengeLen]byte
	putHdr(out[:], frChallenge, challengeLen, 0)
	putChallenge(out[hdrLen:], &ch)
	if _, err := rw.Write(out[:]); err != nil || ch.status != ackOK {
		nc.Close()
		return
	}
	var ab [hdrLen + authLen]byte
	body, err := readHandshake(rw, ab[:], frAuth)
	var a auth
	if err == nil {
		a, err = parseAuth(body)
	}
	if err != nil {
		nc.Close()
		return
	}
	status := uint8(ackOK)
	if want := handshakeMAC(&s.secret, labelDialer, &t); !macEqual(&want, &a.proof) {
		status = ackBadSecret
	}
	reserved := false
	if status == ackOK && hl.kind == kindTCP {
		if reserved = s.reserveRemote(); !reserved {
			status = ackTooMany
		}
	}
	var acks *ackPage
	if status == ackOK && hl.kind == kindUnix && len(fds) == 1 {
		if acks, err = mapAckPage(fds[0], false); err != nil {
			status = ackBadShm
		}
	}
	var shm *shmLink
	if status == ackOK && hl.kind == kindShm {
		if shm, err = newShmLink(fds[0], fds[1], fds[2], false); err != nil {
			status = ackBadShm
		} else {
			unix.Close(fds[0])
			fds = nil // fds[1] and fds[2] belong to shm now
		}
	}
	var aa [hdrLen + authAckLen]byte
	putHdr(aa[:], frAuthAck, authAckLen, 0)
	putAuthAck(aa[hdrLen:], status)
	if _, err := rw.Write(aa[:]); err != nil || status != ackOK {
		if reserved {
			s.releaseRemote()
		}
		nc.Close()
		if shm != nil {
			shm.close()
			shm.unmap()
		}
		if acks != nil {
			acks.unmap()
		}
		return
	}
	stopWatch()
	nc.SetDeadline(time.Time{})
	c := newConn(s, hl.kind, hl.fabric, hl.pid, dataConn(nc, tc), shm)
	c.useAckPage(acks)
	c.auth.ident, c.auth.t = a.ident, t
	c.accepted = true
	if !s.addConn(c) {
		if reserved {
			s.releaseRemote()
		}
		c.abandon()
	}
}

// tlsRecordHandshake is the first byte of a TLS ClientHello.
const tlsRecordHandshake = 0x16

// dataConn is what a connection runs on once its handshake is done: the
// TLS session if there is one, else the socket.
func dataConn(nc net.Conn, tc *tls.Conn) net.Conn {
	if tc != nil {
		return tc
	}
	return nc
}

// --- peers ---

// peer is the route to the QPs of another process (or, when a transport is
// forced, of this one): it holds the current connection and connects on
// demand. It is the link of the QPs connected to that process.
type peer struct {
	s    *service
	key  peerKey
	addr peerAddr

	mu       sync.Mutex // held while dialing
	cur      atomic.Pointer[conn]
	lastErr  error
	lastFail time.Time
}

// peerFor returns the route for a decoded address and transport choice.
func (s *service) peerFor(pa *peerAddr, kind string) *peer {
	k := peerKey{pa.fabric, kind}
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.peers[k]
	if p == nil || p.addr != *pa {
		p = &peer{s: s, key: k, addr: *pa}
		s.peers[k] = p
	}
	return p
}

// redialDelay is how long a failed connection attempt is remembered: the
// requests in the meantime fail at once.
const redialDelay = 50 * time.Millisecond

// conn returns a live connection to the peer, connecting if there is none
// (this may wait for up to dialTimeout). It returns nil if the peer cannot
// be reached now.
func (p *peer) conn() *conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c := p.current(); c != nil {
		return c
	}
	p.cur.Store(nil)
	if !p.lastFail.IsZero() && time.Since(p.lastFail) < redialDelay {
		return nil
	}
	c, err := p.s.dial(&p.addr, p.key.kind)
	if err != nil {
		if p.lastErr == nil || p.lastErr.Error() != err.Error() {
			// Requests to the peer fail with RETRY_EXC_ERR, which
			// cannot say why: the log does, once per new reason. A
			// process of this host that has exited is how a job ends
			// (the ranks that finish last read from those that left, as
			// cluster's Close does): said at debug level.
			if p.s.exited(&p.addr) {
				slog.Debug("soft: a peer process has exited", "pid", p.addr.pid, "err", err)
			} else {
				slog.Warn("soft: cannot connect to a peer process", "pid", p.addr.pid, "err", err)
			}
		}
		p.lastErr, p.lastFail = err, time.Now()
		return nil
	}
	p.cur.Store(c)
	p.lastErr, p.lastFail = nil, time.Time{}
	return c
}

// current returns the live connection to the peer, or nil (without
// connecting).
func (p *peer) current() *conn {
	if c := p.cur.Load(); c != nil && !c.dead.Load() {
		return c
	}
	return nil
}

// linkName names what carries q's requests to p (qp.Link): the
// connection the next one takes unless requests are in flight on another
// (pickConn), or while none is up, the kind that dial tries first.
func (p *peer) linkName(q *qp) string {
	c := q.revConn(p)
	if c == nil {
		c = p.current()
	}
	if c != nil {
		if c.tlsw != nil {
			return "tls"
		}
		return kindNames[c.kind]
	}
	return p.s.firstKind(&p.addr, p.key.kind)
}

// firstKind names the kind of the first connection dial(pa, kind) tries:
// "shm", "unix", "tcp" or "tls"; "" if it would try none.
func (s *service) firstKind(pa *peerAddr, kind string) string {
	sameHost := pa.hasHost && pa.host == s.host
	if (kind == transportShm || kind == transportUnix || kind == transportAuto && sameHost) && pa.unix != "" {
		if kind == transportUnix {
			return kindNames[kindUnix]
		}
		return kindNames[kindShm]
	}
	if kind == transportShm || kind == transportUnix {
		return ""
	}
	cands := tcpCandidates(pa.tcp, sameHost)
	policy, err := tlsPolicy()
	if len(cands) == 0 || err != nil {
		return ""
	}
	host, _, _ := net.SplitHostPort(cands[0])
	if needTLS(policy, &net.TCPAddr{IP: net.ParseIP(host)}) {
		return "tls"
	}
	return kindNames[kindTCP]
}

// exec carries req over the current connection (see conn.exec). A peer
// that cannot be reached does not answer.
func (p *peer) exec(req *request, data []span, resp *response) {
	c := p.conn()
	if c == nil {
		resp.code = respNoQP
		return
	}
	c.exec(req, data, resp)
}

// dial connects to the process at pa with the transport kind (auto: unix
// socket on the same host, falling back to TCP).
func (s *service) dial(pa *peerAddr, kind string) (*conn, error) {
	sameHost := pa.hasHost && pa.host == s.host
	var errs []error
	if (kind == transportShm || kind == transportUnix || kind == transportAuto && sameHost) && pa.unix != "" {
		k := uint8(kindShm)
		if kind == transportUnix {
			k = kindUnix
		}
		c, err := s.dialKind(pa, k, pa.unix)
		if err == nil {
			return c, nil
		}
		if kind != transportAuto {
			return nil, err
		}
		errs = append(errs, err)
	}
	if kind == transportShm || kind == transportUnix {
		return nil, fmt.Errorf("soft: process %d offers no unix socket transport", pa.pid)
	}
	cands := tcpCandidates(pa.tcp, sameHost)
	if len(cands) == 0 {
		errs = append(errs, fmt.Errorf("soft: process %d offers no TCP transport this host can use", pa.pid))
		return nil, errors.Join(errs...)
	}
	for _, addr := range cands {
		c, err := s.dialKind(pa, kindTCP, addr)
		if err == nil {
			return c, nil
		}
		errs = append(errs, err)
		var re *refusedError
		if errors.As(err, &re) && re.status != ackBadTarget {
			break // the process answered: another address reaches the same one
		}
	}
	return nil, errors.Join(errs...)
}

// refusedError: the peer process answered the handshake and refused.
type refusedError struct {
	pid    uint32
	status uint8
}

func (e *refusedError) Error() string {
	return fmt.Sprintf("soft: process %d refused the connection: %s", e.pid, ackReason(e.status))
}

// dialKind connects to the process at pa over one link kind, at address
// (a unix socket name or a TCP host:port), and runs the dialer's side of
// the handshake (handshake.go).
func (s *service) dialKind(pa *peerAddr, kind uint8, address string) (*conn, error) {
	if !pa.hasSecret {
		return nil, fmt.Errorf("soft: connect to process %d: its endpoint carries no connection secret", pa.pid)
	}
	d := net.Dialer{Timeout: dialTimeout}
	network := "tcp"
	ctx := context.Background()
	stopWatch := func() {}
	if kind != kindTCP {
		network = "unix"
		select {
		case s.dials <- struct{}{}:
			defer func() { <-s.dials }()
		case <-s.stopped:
			return nil, fmt.Errorf("soft: connect to process %d: %w", pa.pid, net.ErrClosed)
		}
		// A peer of this host that is slow to answer, not gone
		// (peerlife.go): the connection waits while it runs.
		var stop func()
		ctx, stop = watchLocal(pa.pid, localHandshakeQuiet, handshakeMax)
		defer stop()
		d.Timeout = 0
		stopWatch = stop
	}
	nc, err := d.DialContext(ctx, network, address)
	if err != nil {
		return nil, fmt.Errorf("soft: connect to process %d: %w", pa.pid, err)
	}
	if kind != kindTCP {
		if err := checkPeerCred(nc.(*net.UnixConn), pa.pid); err != nil {
			nc.Close()
			return nil, fmt.Errorf("soft: connect to process %d: %w", pa.pid, err)
		}
	}
	deadline := time.Now().Add(handshakeTimeout)
	if kind != kindTCP {
		deadline = time.Now().Add(handshakeMax) // or sooner: the watch
		stop, stopConn := stopWatch, watchConn(ctx, nc)
		stopWatch = func() { stopConn(); stop() }
	}
	nc.SetDeadline(deadline)
	var rw io.ReadWriter = nc
	var tc *tls.Conn
	var binding []byte
	if kind == kindTCP {
		policy, err := tlsPolicy()
		if err != nil {
			nc.Close()
			return nil, err
		}
		if needTLS(policy, nc.RemoteAddr()) {
			if !pa.hasCert {
				nc.Close()
				return nil, fmt.Errorf("soft: connect to process %d at %s: the connection must be encrypted (%s=%s) and its endpoint carries no certificate fingerprint", pa.pid, address, envTLS, policy)
			}
			tc = tls.Client(newBufConn(nc), pintls.ClientConfig(pa.cert))
			rw = tc
			if err = tlsHandshake(tc, time.Until(deadline)); err == nil {
				binding, err = tlsBinding(tc)
			}
			if err != nil {
				nc.Close()
				return nil, fmt.Errorf("soft: connect to process %d at %s: TLS: %w", pa.pid, address, err)
			}
		}
	}
	var shm *shmLink
	var fds [shmFDs]int
	if kind == kindShm {
		if fds, err = newShmFDs(); err != nil {
			nc.Close()
			return nil, err
		}
		defer fdpass.Close(fds[:1]) // the mapping keeps the segment
		if shm, err = newShmLink(fds[0], fds[2], fds[1], true); err != nil {
			fdpass.Close(fds[1:])
			nc.Close()
			return nil, err
		}
	}
	var acks *ackPage
	ackFD := -1
	if kind == kindUnix {
		if acks, ackFD = newDialerAckPage(); acks != nil {
			defer unix.Close(ackFD) // the mapping keeps the page
		}
	}
	fail := func(err error) (*conn, error) {
		nc.Close()
		if shm != nil {
			shm.close()
			shm.unmap()
		}
		if acks != nil {
			acks.unmap()
		}
		return nil, err
	}
	hsErr := func(err error) (*conn, error) {
		return fail(fmt.Errorf("soft: connect to process %d: handshake: %w", pa.pid, err))
	}

	b := make([]byte, hdrLen+helloLen)
	putHdr(b, frHello, helloLen, 0)
	hl := hello{kind: kind, pid: s.f.pid, fabric: s.f.id, target: pa.fabric, job: s.job, host: s.host}
	copy(hl.nonce[:], randomBytes(hsNonceLen))
	putHello(b[hdrLen:], &hl)
	if kind == kindShm {
		_, _, err = nc.(*net.UnixConn).WriteMsgUnix(b, unix.UnixRights(fds[:]...), nil)
	} else if ackFD >= 0 {
		_, _, err = nc.(*net.UnixConn).WriteMsgUnix(b, unix.UnixRights(ackFD), nil)
	} else {
		_, err = rw.Write(b)
	}
	if err != nil {
		return hsErr(err)
	}
	var cb [hdrLen + challengeLen]byte
	body, err := readHandshake(rw, cb[:], frChallenge)
	var ch challenge
	if err == nil {
		ch, err = parseChallenge(body)
	}
	if err != nil {
		return hsErr(err)
	}
	if ch.status != ackOK {
		return fail(&refusedError{pa.pid, ch.status})
	}
	if ch.fabric != pa.fabric {
		return hsErr(errors.New("it is another soft fabric"))
	}
	t := transcript(b[hdrLen:], ch.pid, ch.fabric, &ch.nonce, binding)
	if want := handshakeMAC(&pa.secret, labelAcceptor, &t); !macEqual(&want, &ch.proof) {
		return hsErr(errors.New("the process that answered does not hold the endpoint's connection secret"))
	}
	var a auth
	a.proof = handshakeMAC(&pa.secret, labelDialer, &t)
	a.ident = handshakeMAC(&s.secret, labelIdentity, &t)
	ab := make([]byte, hdrLen+authLen)
	putHdr(ab, frAuth, authLen, 0)
	putAuth(ab[hdrLen:], &a)
	if _, err := rw.Write(ab); err != nil {
		return hsErr(err)
	}
	var aa [hdrLen + authAckLen]byte
	body, err = readHandshake(rw, aa[:], frAuthAck)
	var status uint8
	if err == nil {
		status, err = parseAuthAck(body)
	}
	if err != nil {
		return hsErr(err)
	}
	if status != ackOK {
		return fail(&refusedError{pa.pid, status})
	}
	stopWatch()
	nc.SetDeadline(time.Time{})
	c := newConn(s, kind, pa.fabric, pa.pid, dataConn(nc, tc), shm)
	c.useAckPage(acks)
	secret := pa.secret
	c.auth.proven.Store(&secret)
	if !s.addConn(c) {
		c.abandon()
		return nil, errors.New("soft: the service of this process is stopping")
	}
	return c, nil
}

// LinkInfo describes one live connection of the soft service to another
// process (or, with a forced transport, to this one), for tests and
// diagnostics.
type LinkInfo struct {
	Kind      string `json:"kind"`      // "tcp", "unix" or "shm"
	Encrypted bool   `json:"encrypted"` // TLS (tls.go)
	PeerPID   uint32 `json:"peer_pid"`  // the process id the peer claimed
	Remote    string `json:"remote"`    // the peer's socket address, if any
	// Pulling says that the peer reads this process' large payloads
	// itself (shared memory and unix sockets, cma.go); Pulled counts the
	// payloads this process read from the peer; PullsLost the ones it
	// read after the peer had let them go (completed in error, or their
	// region closed), which it dropped.
	Pulling   bool   `json:"pulling"`
	Pulled    uint64 `json:"pulled"`
	PullsLost uint64 `json:"pulls_lost"`
}

// Links returns the live connections of this process' soft service.
func Links() []LinkInfo {
	s := getFabric().svc.Load()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []LinkInfo
	for c := range s.conns {
		if c.dead.Load() {
			continue
		}
		li := LinkInfo{Kind: kindNames[c.kind], Encrypted: c.tlsw != nil, PeerPID: c.peerPID,
			Pulling: c.pullReady.Load(), Pulled: c.pulled.Load(), PullsLost: c.pullsLost.Load()}
		if a := c.nc.RemoteAddr(); a != nil {
			li.Remote = a.String()
		}
		out = append(out, li)
	}
	return out
}

var kindNames = [...]string{kindTCP: "tcp", kindUnix: "unix", kindShm: "shm"}
