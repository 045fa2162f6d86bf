package soft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// conn is a connection (TCP or unix socket) to another process, or with a
// forced transport to this one. It carries the requests of this process'
// QPs to the peer's QPs and back their responses, and the other way round.
//
// Requests. A requester QP whose destination is in another process runs
// its send queue in a goroutine of its own (see qp.kick), which writes the
// request frame (with the payload of sends and writes taken directly from
// the registered memory) and, for RC, waits for the response. The wait
// ends with the response, the loss of the connection, the QP's Close, or
// the QP's transport timeout (timeout × (retry_cnt+1), at least
// minRespTimeout): everything but the response makes the request fail with
// RETRY_EXC_ERR, as on a RC QP whose peer stopped answering. UC and UD
// requests get no response.
//
// Responses. One goroutine per connection reads frames, unless an
// application's CQ poll does it in its place (progress.go). It runs every
// request from the peer at the target QP (qp.respond, which does the rkey,
// bounds, access and PSN checks on a private copy of the header, so memory
// outside an MR is never touched; the payload is in a buffer of this
// process, or on shared memory read in place from the ring, where the
// peer can change its bytes but not its length), answers it, and hands
// responses and wake-ups to the waiting requesters. It never waits for the
// peer: a frame it sends is written without blocking as far as the socket
// takes it, and the rest is queued for a flusher goroutine. So two
// processes never wait for each other.
//
// Failure. End of file, a read or write error, a write timeout, or a
// malformed frame takes the connection down: it is closed, waiting
// requesters fail, and the next request to the peer connects again.
type conn struct {
	s       *service
	f       *fabric
	kind    uint8 // kindTCP or kindUnix
	peerFab uint64
	peerPID uint32
	nc      net.Conn
	raw     syscall.RawConn
	quiet   *quietSock // nc and raw, when they are one (nil: not a socket of our own)
	shm     *shmLink   // the rings (nil: frames go over nc)
	link    io.Closer  // closed with nc: the TLS pipe nc is the inner end of (tls.go), or nil
	remote  net.Addr   // the peer's socket address (for Links)
	auth    peerAuth   // what the peer proved of its identity (handshake.go)
	loops   sync.WaitGroup

	dead  atomic.Bool
	done  chan struct{}
	errMu sync.Mutex
	err   error

	nextID atomic.Uint64

	// wmu is the right to write to nc. Whoever holds it writes the queue
	// first: it may hold the rest of a partly written frame.
	wmu       sync.Mutex
	wbufs     net.Buffers
	wdeadline time.Time // shm
	twBuf     [][]byte  // tryWrite's argument and results (wmu)
	twN       int
	twErr     error
	twFn      func(fd uintptr) bool
	iov       [maxSGE + 2]unix.Iovec

	qmu    sync.Mutex
	queue  [][]byte // pooled buffers
	qbytes int
	qwake  chan struct{}

	// Reader state (the reader goroutine, or on shared memory whoever
	// holds rmu).
	pollState
	rhdr  [hdrLen + respBodyLen]byte
	rbufs [2][]byte

	// Responses held back (progress.go): appended by the consumer,
	// taken by whoever writes to the connection next.
	respMu sync.Mutex
	resps  []byte
	pbufs  [maxSGE + 2][]byte // trySendFrame's (respMu)
	fbufs  [1][]byte          // flushResps' (respMu)

	wkMu   sync.Mutex
	wakers map[uint32]*remoteWaker

	usersMu sync.Mutex
	users   map[*qp]struct{} // requesters with requests in flight

	// Direct writes (shm.go).
	sockMu  sync.Mutex // writes to nc
	callMu  sync.Mutex
	calls   map[uint64]chan mapReply
	impMu   sync.RWMutex
	imports map[uint32]*mrImport // nil once unmapped
}

const (
	// minRespTimeout bounds the RC response timeout from below: the peer's
	// goroutines can be descheduled on a loaded host, where a NIC would
	// answer in hardware.
	minRespTimeout = 2 * time.Second
	// writeTimeout bounds a write to a peer that reads nothing for QPs
	// without a transport timeout, and for the flusher.
	writeTimeout = 60 * time.Second
	// maxQueued is how much a peer may leave unread before the connection
	// is dropped.
	maxQueued = 512 << 20
	// sendHigh: above this much queued, requesters write with waiting.
	sendHigh = 4 << 20
)

var errConnDown = errors.New("soft: connection to the peer process lost")

func newConn(s *service, kind uint8, peerFab uint64, peerPID uint32, nc net.Conn, shm *shmLink) *conn {
	c := &conn{s: s, f: s.f, kind: kind, peerFab: peerFab, peerPID: peerPID, nc: nc, shm: shm,
		done: make(chan struct{}), qwake: make(chan struct{}, 1), wakers: map[uint32]*remoteWaker{}}
	c.kick = make(chan struct{}, 1)
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if shm == nil {
		// Frames go over the socket: out of the runtime's poller with it
		// (quiet.go). Should that fail, the socket works as it is, with
		// the wake-ups.
		if q, err := newQuietSock(nc); err == nil {
			c.nc, c.raw, c.quiet = q.conn(), q, q
		}
	}
	if sc, ok := c.nc.(syscall.Conn); ok && c.raw == nil {
		c.raw, _ = sc.SyscallConn()
	}
	c.twFn = c.tryWriteFD
	c.resps = make([]byte, 0, 64*(hdrLen+respBodyLen))
	if shm != nil {
		c.imports = map[uint32]*mrImport{}
		c.rx = shm
	} else if c.raw != nil {
		c.sock = newSockRx(c.nc, c.raw)
		c.rx = c.sock
	}
	return c
}

// fail takes the connection down (once).
func (c *conn) fail(err error) {
	if !c.dead.CompareAndSwap(false, true) {
		return
	}
	c.errMu.Lock()
	c.err = err
	c.errMu.Unlock()
	close(c.done)
	c.nc.Close()
	if c.link != nil {
		c.link.Close()
	}
	if c.shm != nil {
		c.shm.close()
	}
	c.s.removeConn(c)
	c.usersMu.Lock()
	users := c.users
	c.users = nil
	c.usersMu.Unlock()
	for q := range users {
		q.x.push(rresp{c: c, down: true}, 0)
		q.runQueue(false)
	}
}

// addUser registers q, which has requests in flight on c, to learn of
// the connection's failure. It fails if the connection is down.
func (c *conn) addUser(q *qp) bool {
	c.usersMu.Lock()
	defer c.usersMu.Unlock()
	if c.dead.Load() {
		return false
	}
	if c.users == nil {
		c.users = map[*qp]struct{}{}
	}
	c.users[q] = struct{}{}
	return true
}

func (c *conn) removeUser(q *qp) {
	c.usersMu.Lock()
	delete(c.users, q)
	c.usersMu.Unlock()
}

// --- requester side ---

// exec carries a UC or UD request to the peer (RC requests are pipelined
// by progressRemote). The requester learns nothing of its outcome. Called
// by the QP's goroutine, which may wait.
func (c *conn) exec(req *request, data []span, resp *response) {
	q := req.owner
	plen := 0
	if hasPayload(req.op) {
		plen = int(req.length)
	}
	x := q.x
	putHdr(x.frame[:], frReq, uint32(reqBodyLen+plen), c.nextID.Add(1))
	putReq(x.frame[hdrLen:], req, reqNoResp)
	bufs := append(x.bufs[:0], x.frame[:])
	if plen > 0 {
		for _, s := range data {
			if s.n > 0 {
				bufs = append(bufs, s.bytes())
			}
		}
	}
	c.writeFrame(bufs, writeTimeout)
	clear(x.bufs[:len(bufs)])
	resp.code = respDropped
}

// respTimeout is how long a RC request waits for its response: the QP's
// transport timeout × (retry_cnt+1), at least minRespTimeout; 0: forever.
func (q *qp) respTimeout() time.Duration {
	d := transportTimeout(q.attr.Timeout)
	if d == 0 {
		return 0
	}
	return max(d*time.Duration(q.attr.RetryCnt+1), minRespTimeout)
}

// writeFrame writes one frame, waiting for room (at most timeout: then the
// connection fails, since a frame cannot be left half written).
func (c *conn) writeFrame(bufs [][]byte, timeout time.Duration) error {
	c.wmu.Lock()
	if c.dead.Load() {
		c.wmu.Unlock()
		return errConnDown
	}
	c.setDeadline(time.Now().Add(timeout))
	err := c.flushQueueLocked()
	if err == nil {
		err = c.writeAllLocked(bufs)
	}
	// A deadline left behind would fail the next write that must not
	// wait (tryWrite).
	c.setDeadline(time.Time{})
	c.wmu.Unlock()
	if err != nil {
		c.fail(fmt.Errorf("soft: write to process %d: %w", c.peerPID, err))
	}
	return err
}

// trySendFrame sends a frame without waiting (see sendAsync) unless the
// connection is congested; ok false means the caller must use writeFrame.
func (c *conn) trySendFrame(bufs [][]byte) (ok bool, err error) {
	if c.dead.Load() {
		return false, errConnDown
	}
	c.qmu.Lock()
	congested := c.qbytes > sendHigh
	c.qmu.Unlock()
	if congested {
		return false, nil
	}
	// Held responses go first, in the same write (progress.go).
	c.respMu.Lock()
	if len(c.resps) > 0 && len(bufs) < len(c.pbufs) {
		c.pbufs[0] = c.resps
		n := copy(c.pbufs[1:], bufs)
		c.sendAsync(c.pbufs[:n+1])
		clear(c.pbufs[:n+1])
		c.resps = c.resps[:0]
	} else {
		c.sendAsync(bufs)
	}
	c.respMu.Unlock()
	if c.dead.Load() {
		return false, errConnDown
	}
	return true, nil
}

// setDeadline sets the deadline of writeAllLocked (wmu held).
func (c *conn) setDeadline(t time.Time) {
	if c.shm != nil {
		c.wdeadline = t
		return
	}
	c.nc.SetWriteDeadline(t)
}

// writeAllLocked writes bufs, waiting for room (wmu held).
func (c *conn) writeAllLocked(bufs [][]byte) error {
	c.wbufs = append(c.wbufs[:0], bufs...)
	var err error
	if c.shm != nil {
		d := c.wdeadline
		if d.IsZero() {
			d = time.Now().Add(writeTimeout)
		}
		err = c.shm.writeAll(c.wbufs, d, &c.dead)
	} else if c.quiet != nil {
		_, err = c.quiet.writeAll(c.wbufs)
	} else {
		_, err = c.wbufs.WriteTo(c.nc)
	}
	clear(c.wbufs[:cap(c.wbufs)])
	return err
}

// flushQueueLocked writes the queued frames (wmu held).
func (c *conn) flushQueueLocked() error {
	for {
		c.qmu.Lock()
		q := c.queue
		c.queue = nil
		c.qmu.Unlock()
		if len(q) == 0 {
			return nil
		}
		n := 0
		for _, b := range q {
			n += len(b)
		}
		err := c.writeAllLocked(q)
		for _, b := range q {
			putBuf(b)
		}
		c.qmu.Lock()
		c.qbytes -= n
		c.qmu.Unlock()
		if err != nil {
			return err
		}
	}
}

// flushLoop writes what the reader queued until the connection fails.
func (c *conn) flushLoop() {
	for {
		select {
		case <-c.done:
			c.qmu.Lock()
			for _, b := range c.queue {
				putBuf(b)
			}
			c.queue, c.qbytes = nil, 0
			c.qmu.Unlock()
			return
		case <-c.qwake:
		}
		var err error
		c.wmu.Lock()
		if !c.dead.Load() {
			c.setDeadline(time.Now().Add(writeTimeout))
			err = c.flushQueueLocked()
			c.setDeadline(time.Time{})
		}
		c.wmu.Unlock()
		if err != nil {
			c.fail(fmt.Errorf("soft: write to process %d: %w", c.peerPID, err))
		}
	}
}

// sendAsync sends a frame without waiting: what the socket does not take
// now is queued for the flusher. bufs may be reused when it returns.
func (c *conn) sendAsync(bufs [][]byte) {
	if c.dead.Load() {
		return
	}
	written := 0
	if c.wmu.TryLock() {
		c.qmu.Lock()
		empty := len(c.queue) == 0
		c.qmu.Unlock()
		if empty {
			n, err := c.tryWrite(bufs)
			if err != nil {
				c.wmu.Unlock()
				c.fail(fmt.Errorf("soft: write to process %d: %w", c.peerPID, err))
				return
			}
			written = n
		}
		over := false
		if written < total(bufs) {
			over = c.enqueue(bufs, written)
		}
		c.wmu.Unlock()
		if over {
			c.failOverflow()
			return
		}
		if written == total(bufs) {
			return
		}
	} else if c.enqueue(bufs, 0) {
		c.failOverflow()
		return
	}
	select {
	case c.qwake <- struct{}{}:
	default:
	}
}

// enqueue queues a copy of bufs after their first skip bytes. It reports
// whether the queue is over its limit (the caller must fail the
// connection, without wmu).
func (c *conn) enqueue(bufs [][]byte, skip int) bool {
	n := total(bufs) - skip
	b := getBuf(n)[:0]
	for _, p := range bufs {
		if skip >= len(p) {
			skip -= len(p)
			continue
		}
		b = append(b, p[skip:]...)
		skip = 0
	}
	c.qmu.Lock()
	c.queue = append(c.queue, b)
	c.qbytes += n
	over := c.qbytes > maxQueued
	c.qmu.Unlock()
	return over
}

func (c *conn) failOverflow() {
	c.fail(fmt.Errorf("soft: process %d reads nothing: more than %d MiB queued", c.peerPID, maxQueued>>20))
}

func total(bufs [][]byte) int {
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	return n
}

// tryWrite writes a prefix of bufs without waiting and returns its length
// (wmu held).
func (c *conn) tryWrite(bufs [][]byte) (int, error) {
	if c.dead.Load() {
		return 0, errConnDown
	}
	if c.shm != nil {
		return c.shm.tryWrite(bufs)
	}
	if c.raw == nil {
		return 0, nil
	}
	c.twBuf, c.twN, c.twErr = bufs, 0, nil
	err := c.raw.Write(c.twFn)
	n, werr := c.twN, c.twErr
	c.twBuf, c.twErr = nil, nil
	if werr == unix.EAGAIN {
		return 0, nil
	}
	if werr != nil {
		return 0, werr
	}
	if err != nil {
		return 0, err
	}
	return max(n, 0), nil
}

func (c *conn) tryWriteFD(fd uintptr) bool {
	n := 0
	for _, b := range c.twBuf {
		if len(b) == 0 || n == len(c.iov) {
			continue
		}
		c.iov[n].Base = &b[0]
		c.iov[n].SetLen(len(b))
		n++
	}
	for {
		r, _, errno := unix.Syscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&c.iov[0])), uintptr(n))
		c.twN, c.twErr = int(r), nil
		if errno != 0 {
			c.twN, c.twErr = 0, errno
		}
		if errno != unix.EINTR {
			break
		}
	}
	clear(c.iov[:n])
	return true
}

// --- reader side ---

// readLoop reads and handles frames until the connection fails (rxLoop,
// progress.go). Every connection has a receive source: a shared-memory
// ring, or the buffer of a socket read through its descriptor.
func (c *conn) readLoop() {
	if c.rx == nil {
		c.fail(fmt.Errorf("soft: connection to process %d has no descriptor to read", c.peerPID))
		return
	}
	c.rxLoop()
}

func readErr(c *conn, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("soft: process %d closed the connection: %w", c.peerPID, errConnDown)
	}
	return fmt.Errorf("soft: read from process %d: %w", c.peerPID, err)
}

// checkType refuses frames that have no place on a running connection.
func (c *conn) checkType(h frameHdr) error {
	switch h.typ {
	case frReq, frResp, frWake:
		return nil
	case frMap:
		if c.shm != nil {
			return nil
		}
	}
	return fmt.Errorf("%w: type %d on a running connection", errBadType, h.typ)
}

// bodyLen is the fixed body length of a frame (the rest is payload).
func bodyLen(h frameHdr) int {
	switch h.typ {
	case frReq:
		return reqBodyLen
	case frResp:
		return respBodyLen
	}
	return int(min(h.length, reqBodyLen))
}

// handle processes one frame.
func (c *conn) handle(h frameHdr, body []byte, payload *[]byte) error {
	switch h.typ {
	case frReq:
		return c.handleReq(h.id, body, *payload)
	case frResp:
		return c.handleResp(h.id, body, payload)
	case frWake:
		if q := c.f.qps.load(binary.LittleEndian.Uint32(body) & maxQPN); q != nil {
			q.wake()
		}
		return nil
	case frMap:
		return c.serveMap(h.id, body)
	}
	return fmt.Errorf("%w: type %d", errBadType, h.typ)
}

// handleReq runs a request from the peer at the target QP (which does
// every check) and answers it.
func (c *conn) handleReq(id uint64, body, payload []byte) error {
	var req request
	flags, err := parseReq(body, uint32(len(payload)), &req)
	if err != nil {
		return err
	}
	req.srcFabric = c.peerFab // who the peer claims to be: fromPeer checks the claim
	req.srcConn = c
	if req.qpType == uint8(prov.QPTypeRC) {
		req.waker = c.waker(req.srcQPN)
	}
	var one [1]span
	var data []span
	var rbuf []byte
	switch req.op {
	case opRead:
		// Allocate the reply only for a read the region could serve; the
		// responder decides.
		if m := c.f.lookupMR(req.rkey); !req.direct && req.length > 0 && m != nil && uint64(req.length) <= m.length {
			rbuf = getBuf(int(req.length))
			one[0] = span{unsafe.Pointer(unsafe.SliceData(rbuf)), len(rbuf)}
			data = one[:]
		}
	case opCAS, opFAA:
	default:
		if len(payload) > 0 {
			one[0] = span{unsafe.Pointer(unsafe.SliceData(payload)), len(payload)}
			data = one[:]
		}
	}
	var resp response
	if req.direct && c.shm == nil {
		return fmt.Errorf("%w: a direct write on a connection without shared memory", errBadReq)
	}
	if t := c.f.qps.load(req.dstQPN); t == nil {
		resp.code = respNoQP
	} else {
		t.respond(&req, data, &resp)
		// An acknowledged request comes from t's destination (fromPeer).
		if resp.code == respACK && t.typ == prov.QPTypeRC && t.x.rev.Load() != c {
			t.x.rev.Store(c)
		}
	}

	if flags&reqNoResp == 0 {
		var out []byte
		if resp.code == respACK && req.op == opRead {
			out = rbuf
		}
		if len(out) == 0 {
			// Held (progress.go), up to a limit.
			c.respMu.Lock()
			k := len(c.resps)
			c.resps = c.resps[:k+hdrLen+respBodyLen]
			putHdr(c.resps[k:], frResp, respBodyLen, id)
			putResp(c.resps[k+hdrLen:], req.srcQPN, &resp)
			if len(c.resps)+hdrLen+respBodyLen > cap(c.resps) {
				c.flushRespsLocked()
			}
			c.respMu.Unlock()
		} else {
			c.flushResps()
			putHdr(c.rhdr[:], frResp, uint32(respBodyLen+len(out)), id)
			putResp(c.rhdr[hdrLen:], req.srcQPN, &resp)
			c.rbufs[0], c.rbufs[1] = c.rhdr[:], out
			c.sendAsync(c.rbufs[:2])
			c.rbufs[1] = nil
		}
	}
	putBuf(rbuf)
	return nil
}

// flushResps sends the held responses.
func (c *conn) flushResps() {
	c.respMu.Lock()
	c.flushRespsLocked()
	c.respMu.Unlock()
}

func (c *conn) flushRespsLocked() {
	if len(c.resps) == 0 {
		return
	}
	c.fbufs[0] = c.resps
	c.sendAsync(c.fbufs[:1])
	c.fbufs[0] = nil
	c.resps = c.resps[:0]
}

// holdsResps reports whether responses are held.
func (c *conn) holdsResps() bool {
	c.respMu.Lock()
	defer c.respMu.Unlock()
	return len(c.resps) > 0
}

// handleResp hands a response to its requester, with the payload (which
// it takes over).
func (c *conn) handleResp(id uint64, body []byte, payload *[]byte) error {
	var r response
	qpn, err := parseResp(body, &r)
	if err != nil {
		return err
	}
	if len(*payload) > 0 && r.code != respACK {
		return fmt.Errorf("%w: data on a negative response", errBadResp)
	}
	q := c.f.qps.load(qpn)
	if q == nil {
		return nil // the requester is gone
	}
	if !q.x.push(rresp{c: c, id: id, resp: r, data: *payload}, 2*len(q.sq.slots)+64) {
		return fmt.Errorf("%w: more responses than requests", errBadResp)
	}
	*payload = nil
	q.runQueue(false)
	return nil
}

var errBadReadResp = fmt.Errorf("%w: RDMA read data of the wrong length", errBadResp)

// --- wake-ups of the peer's requesters ---

// remoteWaker is the waker of a requester in the peer process: waking it
// sends a WAKE frame.
type remoteWaker struct {
	c   *conn
	qpn uint32
}

func (c *conn) waker(qpn uint32) waker {
	c.wkMu.Lock()
	defer c.wkMu.Unlock()
	w := c.wakers[qpn]
	if w == nil {
		if len(c.wakers) >= 1<<16 {
			clear(c.wakers)
		}
		w = &remoteWaker{c: c, qpn: qpn}
		c.wakers[qpn] = w
	}
	return w
}

func (w *remoteWaker) wake() {
	var b [hdrLen + wakeLen]byte
	putHdr(b[:], frWake, wakeLen, 0)
	binary.LittleEndian.PutUint32(b[hdrLen:], w.qpn)
	w.c.sendAsync([][]byte{b[:]})
}

// --- buffers ---

// Payload buffers come from size-classed free lists (powers of two from
// 4 KiB to 4 MiB, at most bufListMax each); larger ones are allocated.
var bufLists [maxBufShift - minBufShift + 1]struct {
	mu   sync.Mutex
	free [][]byte
}

const (
	minBufShift = 12
	maxBufShift = 22
	bufListMax  = 128
)

func getBuf(n int) []byte {
	if n > 1<<maxBufShift {
		return make([]byte, n)
	}
	c := 0
	if n > 1<<minBufShift {
		c = bits.Len(uint(n-1)) - minBufShift
	}
	l := &bufLists[c]
	l.mu.Lock()
	if k := len(l.free); k > 0 {
		b := l.free[k-1]
		l.free[k-1] = nil
		l.free = l.free[:k-1]
		l.mu.Unlock()
		return b[:n]
	}
	l.mu.Unlock()
	return make([]byte, n, 1<<(c+minBufShift))
}

func putBuf(b []byte) {
	c := cap(b)
	if c < 1<<minBufShift || c > 1<<maxBufShift || c&(c-1) != 0 {
		return
	}
	l := &bufLists[bits.Len(uint(c))-1-minBufShift]
	l.mu.Lock()
	if len(l.free) < bufListMax {
		l.free = append(l.free, b[:0])
	}
	l.mu.Unlock()
}

// readPayload reads n bytes, growing the buffer as data arrives so that a
// length in a hostile frame cannot make the reader allocate more than the
// peer sends.
func readPayload(r io.Reader, n int) ([]byte, error) {
	if n <= 1<<maxBufShift {
		b := getBuf(n)
		if _, err := io.ReadFull(r, b); err != nil {
			putBuf(b)
			return nil, err
		}
		return b, nil
	}
	b := make([]byte, 0, 1<<maxBufShift)
	for len(b) < n {
		k := min(n-len(b), max(len(b), 1<<maxBufShift))
		if cap(b)-len(b) < k {
			nb := make([]byte, len(b), len(b)+k)
			copy(nb, b)
			b = nb
		}
		m, err := io.ReadFull(r, b[len(b):len(b)+k])
		b = b[:len(b)+m]
		if err != nil {
			return nil, err
		}
	}
	return b, nil
}

// checkPeerCred checks that the process at the other end of c has the given
// pid and this process' uid.
func checkPeerCred(c *net.UnixConn, pid uint32) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if uint32(cred.Pid) != pid {
		return fmt.Errorf("the peer is process %d, not %d", cred.Pid, pid)
	}
	if cred.Uid != uint32(os.Getuid()) {
		return fmt.Errorf("the peer runs as uid %d, not %d", cred.Uid, os.Getuid())
	}
	return nil
}
