package soft

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
)

// The soft service of a process: what lets QPs of other processes reach this
// process' QPs. It listens on an abstract unix socket (same host) and on TCP
// (GOVERBS_SOFT_LISTEN, default 127.0.0.1:0; "off" disables it), and holds
// the process' connections to other processes (conn.go). It starts when a
// QP first needs it (its address is asked for, or it connects to another
// process) and stops, closing every connection and waiting for every
// goroutine it started, when the last device context of the process
// closes.
//
// Handshake. The dialer sends HELLO: its fabric id, pid, job and host
// identity, and the target's fabric id and secret taken from the target's
// provider address (so only a holder of one of the target's endpoints can
// connect). The acceptor checks them, and on a unix socket also checks with
// SO_PEERCRED that the peer runs as the same user with the pid it claims;
// the dialer checks the acceptor's credentials against the address the
// same way. The acceptor answers HELLO_ACK with a status. Both sides then
// run the connection (conn.go).

const envListen = "GOVERBS_SOFT_LISTEN"

const (
	dialTimeout      = 5 * time.Second
	handshakeTimeout = 5 * time.Second
)

type service struct {
	f      *fabric
	secret [16]byte
	job    [16]byte
	host   [16]byte
	addr   []byte // this process' provider address

	tcpLn  net.Listener
	unixLn net.Listener

	mu     sync.Mutex
	closed bool
	peers  map[peerKey]*peer
	conns  map[*conn]struct{}
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
	s := &service{f: f, job: jobIdentity(), host: hostIdentity(),
		peers: map[peerKey]*peer{}, conns: map[*conn]struct{}{}}
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
		if ln, err := net.Listen("tcp", la); err == nil {
			s.tcpLn = ln
			pa.tcp = ln.Addr().String()
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
	if s.unixLn != nil {
		s.unixLn.Close()
	}
	if s.tcpLn != nil {
		s.tcpLn.Close()
	}
	for _, c := range conns {
		c.fail(errors.New("soft: the service of this process stopped"))
	}
	s.wg.Wait()
}

func (s *service) acceptLoop(ln net.Listener) {
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		if !s.track() {
			c.Close()
			return
		}
		go func() {
			defer s.wg.Done()
			s.serveHandshake(c)
		}()
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
	if c.shm != nil {
		// Unmap once the connection is down and nothing uses the
		// segment: the loops have ended, and writers hold wmu (and
		// check dead under it).
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			<-c.done
			c.loops.Wait()
			c.rmu.Lock() // pollers
			c.unmapImports()
			c.wmu.Lock()
			c.shm.unmap()
			c.wmu.Unlock()
			c.rmu.Unlock()
		}()
	}
	return true
}

func (s *service) removeConn(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.pc.set(s.conns)
	s.mu.Unlock()
}

// serveHandshake runs the acceptor side of a handshake on a new connection.
func (s *service) serveHandshake(nc net.Conn) {
	nc.SetDeadline(time.Now().Add(handshakeTimeout))
	var buf [hdrLen + helloLen]byte
	uc, isUnix := nc.(*net.UnixConn)
	var fds []int
	var err error
	if isUnix {
		fds, err = readMsgFDs(uc, buf[:], shmFDs)
	} else {
		_, err = io.ReadFull(nc, buf[:])
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
	ack := helloAck{status: ackOK, pid: s.f.pid, fabric: s.f.id}
	switch {
	case hl.target != s.f.id:
		ack.status = ackBadTarget
	case subtle.ConstantTimeCompare(hl.secret[:], s.secret[:]) != 1:
		ack.status = ackBadSecret
	case hl.job != s.job:
		ack.status = ackBadJob
	case isUnix != (hl.kind == kindUnix || hl.kind == kindShm):
		ack.status = ackBadPeer
	case isUnix && checkPeerCred(uc, hl.pid) != nil:
		ack.status = ackBadPeer
	case hl.kind == kindShm && checkShmFDs(fds) != nil,
		hl.kind != kindShm && len(fds) > 0:
		ack.status = ackBadShm
	}
	var shm *shmLink
	if ack.status == ackOK && hl.kind == kindShm {
		if shm, err = newShmLink(fds[0], fds[1], fds[2], false); err != nil {
			ack.status = ackBadShm
		} else {
			unix.Close(fds[0])
			fds = nil // fds[1] and fds[2] belong to shm now
		}
	}
	var out [hdrLen + ackLen]byte
	putHdr(out[:], frHelloAck, ackLen, 0)
	putHelloAck(out[hdrLen:], &ack)
	if _, err := nc.Write(out[:]); err != nil || ack.status != ackOK {
		nc.Close()
		if shm != nil {
			shm.close()
			shm.unmap()
		}
		return
	}
	nc.SetDeadline(time.Time{})
	c := newConn(s, hl.kind, hl.fabric, hl.pid, nc, shm)
	if !s.addConn(c) {
		c.nc.Close()
		if shm != nil {
			shm.close()
			shm.unmap()
		}
	}
}

// decodeHello checks a HELLO frame (header and body).
func decodeHello(b []byte) (hello, error) {
	h, err := parseHdr(b)
	if err == nil && h.typ != frHello {
		err = fmt.Errorf("%w: frame type %d", errBadHello, h.typ)
	}
	if err != nil {
		return hello{}, err
	}
	return parseHello(b[hdrLen:])
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
	if p == nil || p.addr.secret != pa.secret || p.addr.unix != pa.unix || p.addr.tcp != pa.tcp {
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
		c, err := s.dialKind(pa, k)
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
	if pa.tcp == "" {
		errs = append(errs, fmt.Errorf("soft: process %d offers no TCP transport", pa.pid))
		return nil, errors.Join(errs...)
	}
	c, err := s.dialKind(pa, kindTCP)
	if err != nil {
		errs = append(errs, err)
		return nil, errors.Join(errs...)
	}
	return c, nil
}

func (s *service) dialKind(pa *peerAddr, kind uint8) (*conn, error) {
	d := net.Dialer{Timeout: dialTimeout}
	network, address := "tcp", pa.tcp
	if kind != kindTCP {
		network, address = "unix", pa.unix
	}
	nc, err := d.Dial(network, address)
	if err != nil {
		return nil, fmt.Errorf("soft: connect to process %d: %w", pa.pid, err)
	}
	if kind != kindTCP {
		if err := checkPeerCred(nc.(*net.UnixConn), pa.pid); err != nil {
			nc.Close()
			return nil, fmt.Errorf("soft: connect to process %d: %w", pa.pid, err)
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
	fail := func(err error) (*conn, error) {
		nc.Close()
		if shm != nil {
			shm.close()
			shm.unmap()
		}
		return nil, err
	}
	nc.SetDeadline(time.Now().Add(handshakeTimeout))
	b := make([]byte, hdrLen+helloLen)
	putHdr(b, frHello, helloLen, 0)
	putHello(b[hdrLen:], &hello{kind: kind, pid: s.f.pid, fabric: s.f.id, target: pa.fabric,
		secret: pa.secret, job: s.job, host: s.host})
	if kind == kindShm {
		_, _, err = nc.(*net.UnixConn).WriteMsgUnix(b, unix.UnixRights(fds[:]...), nil)
	} else {
		_, err = nc.Write(b)
	}
	if err != nil {
		return fail(fmt.Errorf("soft: connect to process %d: %w", pa.pid, err))
	}
	var ab [hdrLen + ackLen]byte
	if _, err := io.ReadFull(nc, ab[:]); err != nil {
		return fail(fmt.Errorf("soft: connect to process %d: handshake: %w", pa.pid, err))
	}
	if err := checkAck(ab[:], pa); err != nil {
		return fail(err)
	}
	nc.SetDeadline(time.Time{})
	c := newConn(s, kind, pa.fabric, pa.pid, nc, shm)
	if !s.addConn(c) {
		nc = c.nc // newConn may have moved the socket
		return fail(errors.New("soft: the service of this process is stopping"))
	}
	return c, nil
}

// checkAck checks a HELLO_ACK frame from the process at pa.
func checkAck(b []byte, pa *peerAddr) error {
	h, err := parseHdr(b)
	if err == nil && h.typ != frHelloAck {
		err = fmt.Errorf("%w: frame type %d", errBadHello, h.typ)
	}
	var a helloAck
	if err == nil {
		a, err = parseHelloAck(b[hdrLen:])
	}
	if err != nil {
		return fmt.Errorf("soft: handshake with process %d: %w", pa.pid, err)
	}
	if a.status != ackOK {
		return fmt.Errorf("soft: process %d refused the connection: %s", pa.pid, ackReason(a.status))
	}
	if a.fabric != pa.fabric {
		return fmt.Errorf("soft: handshake with process %d: it is another soft fabric", pa.pid)
	}
	return nil
}
