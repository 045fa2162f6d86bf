package soft

import (
	"crypto/tls"
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

	"github.com/goverbs/verbs/internal/pintls"
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
// minRespTimeout, restarted while the peer shows signs of life: alive;
// periods during which this process itself stalled are not counted,
// xreq.go retire):
// everything but the response makes the request fail with RETRY_EXC_ERR,
// as on a RC QP whose peer stopped answering. UC and UD requests get no
// response.
//
// Responses. One goroutine per connection reads frames, unless an
// application's CQ poll does it in its place (progress.go). It runs every
// request from the peer at the target QP (qp.respond, which does the rkey,
// bounds, access and PSN checks on a private copy of the header, so memory
// outside an MR is never touched; the payload is read in place from the
// connection's receive buffer, or on shared memory from the ring, where
// the peer can change its bytes but not its length; the reader reads the
// payload of a large RC write straight into its region once the checks
// pass, place.go), answers it, and
// hands responses and wake-ups to the waiting requesters, copying the data
// of RDMA reads into their local memory. It never waits for the peer: a
// frame it sends is written without blocking as far as the socket takes
// it, and the rest is queued for a flusher goroutine. So two processes
// never wait for each other.
//
// Memory. No frame is larger than maxFrame (a larger message travels in
// segments, wire.go), and the consumer handles each one in place: it
// allocates nothing for what a peer declares or sends. What it holds for
// the peer is the send queue: copies of frames the socket did not take
// (at most a segment of each RDMA read response: the rest of a read is
// queued as a reference to the region, and its data is copied out segment
// by segment as the socket takes it, see readJob), bounded by maxQueued,
// beyond which the peer counts as reading nothing and the connection
// fails. Pooled buffers are bounded in total (bufPoolMax).
//
// Acknowledgements. The response to a request that completes a receive
// leaves before the completion is visible (ackFirst): an application
// may exit as soon as it has polled it. Over TCP it is corked in the
// socket (send), for the answer that usually follows to push it along
// in one segment; over a unix socket or shared memory it is held, and
// the id of the request published in the connection's acknowledgement
// page or the header of the ring it came on, which outlive the process
// (ackpage.go); what the application does otherwise next pushes it:
// a poll that finds nothing, an arm of a CQ to sleep (pollersGone), or
// the end of the reader's wait for the answer (ackDelay). Other
// responses may be held for a while (progress.go) and leave at the
// latest when a QP or the
// service closes (closeGracefully).
//
// Failure. End of file, a read or write error, a write timeout (a wait
// of the QP's response timeout during which the socket took nothing:
// writeAllLocked), or a
// malformed frame takes the connection down, after the frames that
// arrived complete were handled: it is closed, waiting requesters fail,
// the QPs connected to the peer process move to ERR (failQPs), and the
// next request to the peer (of a new QP) connects again.
type conn struct {
	s    *service
	f    *fabric
	kind uint8 // kindTCP or kindUnix
	// accepted: the peer dialed (service.serveHandshake); set before
	// the connection is added, read-only after.
	accepted bool
	peerFab  uint64
	peerPID  uint32
	life     *peerClock // the peer's processor time, if it runs on this host (nil: TCP)
	nc       net.Conn
	raw      syscall.RawConn
	quiet    *quietSock // nc and raw, when they are one (nil: not a socket of our own)
	shm      *shmLink   // the rings (nil: frames go over nc)

	// Pulled payloads (cma.go: shared memory and unix sockets).
	pidfd      int         // the peer process (-1: none, nothing is pulled)
	pidfdOpen  atomic.Bool // pidfd >= 0, for readers without rmu (pullsReads)
	pullReady  atomic.Bool // the peer can read this process: large payloads are pulled
	pullServed atomic.Bool // this process can read the peer: it accepts pulled requests
	pull       pullSrc     // the pulled request being handled (rmu)
	pulled     atomic.Uint64
	pullsLost  atomic.Uint64
	link       io.Closer  // with TLS: the socket under the session (closeSocket); nil otherwise
	tlsw       *tlsWriter // with TLS: how frames are written
	auth       peerAuth   // what the peer proved of its identity (handshake.go)
	loops      sync.WaitGroup

	dead   atomic.Bool
	done   chan struct{}
	rxSeen atomic.Uint64 // frames handled (a sign of the peer's life: alive)
	// The responder's alive frames (showLife; rmu).
	lifeAt     time.Time
	aliveFrame [hdrLen + aliveLen]byte
	aliveBufs  [1][]byte
	errMu      sync.Mutex
	err        error

	nextID atomic.Uint64

	// wmu is the right to write to nc. Whoever holds it writes the queue
	// first: it may hold the rest of a partly written frame.
	wmu       sync.Mutex
	wbufs     net.Buffers
	wdeadline time.Time     // shm
	wspan     time.Duration // the timeout of the write deadline (setDeadline): sockets
	twBuf     [][]byte      // tryWrite's argument and results (wmu)
	twN       int
	twErr     error
	twFn      func(fd uintptr) bool
	twMore    bool // tryWriteFD sends with MSG_MORE (send's cork)
	corkedLen int  // bytes send corked in the socket since the last push
	iov       [maxSGE + 2]unix.Iovec
	segHdr    [segBatch][hdrLen + reqBodyLen]byte // writeSegsLocked's (wmu)
	segBufs   [segBatch + maxSGE + 1][]byte
	qbufs     [][]byte // flushQueueLocked's (wmu)
	one       [1][]byte

	qmu    sync.Mutex
	queue  []outItem
	qspare []outItem // the array of the last queue written, for the next
	qbytes int
	qlen   atomic.Int32 // len(queue), read without qmu
	// qtaken: a writer took the queue (flushQueueLocked) and has not
	// written all of it yet. Set with qlen's zero, under qmu.
	qtaken atomic.Bool
	qhigh  atomic.Bool // qbytes > sendHigh, read without qmu
	qwake  chan struct{}

	// Consumer state (whoever holds rmu).
	pollState
	driveState
	rhdr   [hdrLen + respBodyLen]byte
	rbufs  [2][]byte
	rxData [2]span

	// The request being handled (handleReq), for ackFirst (rmu).
	rxID     uint64
	rxQPN    uint32
	rxAnswer bool // it is to be answered
	rxAcked  bool // ackFirst answered it
	// heldOther says that the held responses include one that is not a
	// plain acknowledgement: ackFirst then sends at once. Set by the
	// consumer (respMu held), cleared by whoever sends the held
	// responses (respMu held) after they went to the connection's queue
	// or out, so the consumer may load it without respMu (publishWrite).
	heldOther atomic.Bool
	// acks holds the words in which held acknowledgements, of receives
	// (ackFirst) and of writes (publishWrite), are published (ackpage.go):
	// the acknowledgement page over unix, words of the rings over shared
	// memory; nil over TCP.
	acks *ackPage
	// peerAcked is the peer's word of acks when the
	// connection failed (set before done is closed).
	peerAcked uint64
	rxErr     error // ackFirst could not send
	// wakeOwed says that ackFirst put an acknowledgement in the ring of a
	// shared-memory connection whose consumer sleeps, without waking it
	// (rmu): drain does, once it has handled wakeBatch frames more or
	// when it returns (payWake).
	wakeOwed   bool
	wakeFrames int
	// rxPub says that publishWrite published the request being handled,
	// over rxPubPrev (rmu).
	rxPub     bool
	rxPubPrev uint64

	// Responses held back (progress.go): appended by the consumer,
	// taken by whoever writes to the connection next.
	respMu sync.Mutex
	resps  []byte
	held   atomic.Bool        // len(resps) > 0, read without respMu
	corked atomic.Bool        // an acknowledgement may wait in the socket (send's cork)
	pbufs  [maxSGE + 2][]byte // trySendFrame's (respMu)
	fbufs  [1][]byte          // flushResps' (respMu)

	wkMu   sync.Mutex
	wakers map[uint32]*remoteWaker
	wkLast *remoteWaker // the last one handleReq took (rmu)

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
	// goroutines (and this process' reader) can be descheduled on a
	// loaded host, where a NIC would answer in hardware: for a few
	// scheduler periods of an oversubscribed core (tens of
	// milliseconds, more under the race detector), a stop of the world
	// or a page fault storm. It also bounds each wait of a large
	// request's write for room in the socket during which the socket
	// takes nothing (writeReq, writeAllLocked). 100 ms was seen to fail
	// a 1 MiB write on two loaded cores with -race.
	minRespTimeout = 250 * time.Millisecond
	// writeTimeout bounds a write to a peer that reads nothing for QPs
	// without a transport timeout, and for the flusher.
	writeTimeout = 60 * time.Second
	// maxQueued is how much a peer may leave unread before the connection
	// is dropped: the bytes of frames in the send queue, and jobCost for
	// each RDMA read response queued.
	maxQueued = 16 << 20
	// sendHigh: above this much queued, requesters write with waiting.
	sendHigh = 4 << 20
	// segBatch is how many segments of a message a writer gathers into
	// one write.
	segBatch = 8
)

// Every frame fits in every receive buffer whole.
var (
	_ [sockRxSize - maxFrame]struct{}
	_ [ringCap - maxFrame]struct{}
	_ [hdrLen + reqBodyLen + segMax - maxNBFrame]struct{} // a frame written without waiting is one segment
)

var errConnDown = errors.New("soft: connection to the peer process lost")

func newConn(s *service, kind uint8, peerFab uint64, peerPID uint32, nc net.Conn, shm *shmLink) *conn {
	c := &conn{s: s, f: s.f, kind: kind, peerFab: peerFab, peerPID: peerPID, nc: nc, shm: shm,
		done: make(chan struct{}), qwake: make(chan struct{}, 1), wakers: map[uint32]*remoteWaker{}, pidfd: -1}
	c.kick = make(chan struct{}, 1)
	if shm != nil {
		c.acks = shmAckWords(shm)
	}
	if pullKind(kind) {
		c.pidfd = openPidfd(peerPID)
		c.pidfdOpen.Store(c.pidfd >= 0)
	}
	if kind != kindTCP && int(peerPID) != os.Getpid() {
		c.life = newPeerClock(peerPID) // the kernel vouched for the process id (SO_PEERCRED)
	}
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if shm == nil && kind == kindUnix {
		setSendBuffer(nc)
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
		if kind == kindTCP {
			c.sock.tail = placeTailTCP
		}
		c.rx = c.sock
	} else if tc, ok := nc.(*tls.Conn); ok {
		c.sock = newStreamRx(tc)
		c.rx = c.sock
		c.tlsw = newTLSWriter(tc)
		c.link = tc.NetConn()
	}
	return c
}

// unixSendBuf is the send buffer a unix socket connection asks for
// (SO_SNDBUF; the kernel doubles it, and caps the request at
// net.core.wmem_max). A unix stream socket holds at most that much of a
// sender's bytes, 208 KiB by default: the sender then waits for every
// 52 KiB the receiver takes, and a large write costs several waits and
// wake-ups on either side per MiB. With a larger buffer the writer of a
// large message mostly finds room, and the reader the whole next
// segment, whose payload it places in one read (place.go).
// It is a bound, not an allocation: the kernel holds what the peer has
// not read yet, as the send queue would (maxQueued).
const unixSendBuf = 1 << 20

// setSendBuffer sets the send buffer of nc, a unix socket, to
// unixSendBuf; on failure it keeps the default (only the speed differs).
func setSendBuffer(nc net.Conn) {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return
	}
	raw.Control(func(fd uintptr) {
		unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, unixSendBuf)
	})
}

// closeSocket closes what the connection runs on: its socket, or with TLS
// the socket under the session (the session has nothing else to release,
// and its Close would try to send an alert to a peer that may read
// nothing).
func (c *conn) closeSocket() {
	if c.link != nil {
		c.link.Close()
	} else {
		c.nc.Close()
	}
}

// abandon releases a connection that never ran (addConn refused it).
func (c *conn) abandon() {
	c.closeSocket()
	if c.shm != nil {
		c.shm.close()
		c.shm.unmap()
	}
	if c.acks != nil {
		c.acks.unmap()
	}
	c.closePidfd()
}

// fail takes the connection down (once).
func (c *conn) fail(err error) {
	if !c.dead.CompareAndSwap(false, true) {
		return
	}
	c.errMu.Lock()
	c.err = err
	c.errMu.Unlock()
	if c.acks != nil {
		// Before done: the page and the segment stay mapped until then
		// (addConn).
		c.peerAcked = c.acks.peerHeld()
	}
	close(c.done)
	c.closeSocket()
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
	c.failQPs()
}

// failQPs moves the QPs connected to the peer process to ERR: the RC and
// UC QPs whose destination is a QP of that process (its endpoint is one
// the peer proved it holds). The connection is gone: the peer exited,
// was killed, closed its last device context, or broke the protocol, and
// its QPs can never be reached again through it. A hardware QP reports
// nothing in this case until a request of its own times out, and a QP
// that only waits for receives waits forever; soft0 knows, and moves it
// to ERR as a hardware QP moves on a fatal transport error: everything
// that arrived before was delivered (the connection fails after its
// consumer has handled every complete frame; see failAfterDrain for
// shared memory), the posted receives complete with WR_FLUSH_ERR (so a
// poll or a wait for them returns), the send queue is flushed (its oldest
// request with RETRY_EXC_ERR unless one failed before: qp.peerLost), and the
// QP's context gets IBV_EVENT_QP_FATAL. Requests in flight on the
// connection have failed with RETRY_EXC_ERR before (the "down" records
// above are retired before the state is looked at). A QP of the peer
// that was merely closed (its process lives on) leaves the connection
// up: nothing is reported then, as on hardware.
func (c *conn) failQPs() {
	var hit []*qp
	c.f.qps.each(func(q *qp) {
		if q.typ == prov.QPTypeUD {
			return
		}
		q.rmu.Lock()
		if c.leadsTo(q) && q.toErrLocked(evQPFatal) {
			q.peerLost.Store(true)
			hit = append(hit, q)
		}
		q.rmu.Unlock()
	})
	for _, q := range hit {
		q.drainWaiters()
		q.kick() // flushes the send queue
	}
}

// leadsTo reports whether q's destination is the peer process of c, as
// that process proved (q.rmu held): c carries q's traffic.
func (c *conn) leadsTo(q *qp) bool {
	p, ok := q.route.(*peer)
	return ok && p != nil && p.key.fabric == c.peerFab && c.auth.proves(&p.addr)
}

// each calls fn for every object in the table.
func (t *table[T]) each(fn func(*T)) {
	for i := range t.chunks {
		c := t.chunks[i].Load()
		if c == nil {
			continue
		}
		for j := range c {
			if v := c[j].Load(); v != nil {
				fn(v)
			}
		}
	}
}

// closeGracefully takes the connection down as this process' Close does
// (the service stops): what it holds for the peer is written first (the
// held responses and the send queue, until deadline), then a socket is
// shut down for writing and read to its end, which the peer's reader
// answers by closing its side. Closing a socket with unread bytes would
// reset it, which can discard what the peer has not received yet. (A
// shared-memory connection needs none of it: the peer reads the ring
// to its end when the socket closes, see failAfterDrain.)
func (c *conn) closeGracefully(err error, deadline time.Time) {
	c.flushResps()
	shut := false
	// A writer that waits for room (a peer that reads nothing) holds wmu
	// until its own deadline: not beyond this one.
	locked := c.wmu.TryLock()
	for !locked && time.Now().Before(deadline) && !c.dead.Load() {
		time.Sleep(time.Millisecond)
		locked = c.wmu.TryLock()
	}
	if locked {
		if !c.dead.Load() {
			c.setDeadline(deadline)
			werr := c.flushQueueLocked(time.Until(deadline))
			c.setDeadline(time.Time{})
			shut = werr == nil && c.shm == nil && c.closeWrite() == nil
		}
		c.wmu.Unlock()
	}
	if shut {
		t := time.NewTimer(time.Until(deadline))
		select {
		case <-c.done:
		case <-t.C:
		}
		t.Stop()
	}
	c.fail(err)
}

// tcpSocket is the socket under a connection's TLS session, or its
// socket.
func (c *conn) tcpSocket() net.Conn {
	if c.link == nil {
		return c.nc
	}
	nc := c.link.(net.Conn)
	for {
		switch w := nc.(type) {
		case *bufConn:
			nc = w.Conn
		case *pintls.PrefixConn:
			nc = w.Conn
		default:
			return nc
		}
	}
}

// sockControl runs fn on the file descriptor of the connection's socket
// (the one under its TLS session, if it has one).
func (c *conn) sockControl(fn func(fd uintptr)) error {
	raw := c.raw // the socket's (or its quiet copy's) unless c.nc wraps it
	if raw == nil {
		sc, ok := c.tcpSocket().(syscall.Conn)
		if !ok {
			return errors.ErrUnsupported
		}
		var err error
		if raw, err = sc.SyscallConn(); err != nil {
			return err
		}
	}
	return raw.Control(fn)
}

// closeWrite shuts the socket down for writing: the peer reads to the
// end of what was written, then its end of file.
func (c *conn) closeWrite() error {
	var serr error
	if err := c.sockControl(func(fd uintptr) { serr = unix.Shutdown(int(fd), unix.SHUT_WR) }); err != nil {
		return err
	}
	return serr
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
	plen := 0
	if hasPayload(req.op) {
		plen = int(req.length)
	}
	c.writeReq(req.owner.x, req, reqNoResp, c.nextID.Add(1), data, plen, writeTimeout)
	resp.code = respDropped
}

// writeReq writes the request req with its payload data (plen bytes):
// one frame, or segments if it is longer than segMax, waiting for room
// (at most timeout for each wait during which the socket takes nothing,
// writeAllLocked: then the connection fails, since a frame cannot be left
// half written). x is the requester's scratch.
func (c *conn) writeReq(x *xstate, req *request, flags uint8, id uint64, data []span, plen int, timeout time.Duration) error {
	if plen <= segMax {
		bufs := x.reqFrame(req, flags, id, data, plen)
		err := c.writeFrame(bufs, timeout)
		clear(bufs)
		return err
	}
	return c.writeWaiting(nil, timeout, func() error {
		return c.writeSegsLocked(req, flags, id, data, plen, timeout)
	})
}

// reqFrame encodes req, a message of plen <= segMax bytes, as one frame:
// the header in x.frame and the payload in place (x.bufs).
func (x *xstate) reqFrame(req *request, flags uint8, id uint64, data []span, plen int) [][]byte {
	putHdr(x.frame[:], frReq, uint32(reqBodyLen+plen), id)
	putReq(x.frame[hdrLen:], req, flags)
	bufs := append(x.bufs[:0], x.frame[:])
	if plen > 0 {
		for _, s := range data {
			if s.n > 0 {
				bufs = append(bufs, s.bytes())
			}
		}
	}
	return bufs
}

// writeSegsLocked writes req, a message of plen bytes, as segments of
// segMax bytes, a batch of them at a time (wmu held).
func (c *conn) writeSegsLocked(req *request, flags uint8, id uint64, data []span, plen int, timeout time.Duration) error {
	seg := *req
	mtu := max(req.mtu, 1)
	si, soff := 0, 0 // the next byte: data[si] at soff
	nb, nh := 0, 0
	flush := func() error {
		err := c.writeAllLocked(c.segBufs[:nb])
		clear(c.segBufs[:nb])
		nb, nh = 0, 0
		c.setDeadline(time.Now().Add(timeout))
		return err
	}
	for off := 0; off < plen; {
		n := min(segMax, plen-off)
		if nh == segBatch || nb+1+len(data)-si > len(c.segBufs) {
			if err := flush(); err != nil {
				return err
			}
		}
		seg.off, seg.more = uint32(off), off+n < plen
		seg.psn = (req.psn + uint32(off)/mtu) & psnMask
		seg.npkts = max(1, (uint32(n)+mtu-1)/mtu)
		h := c.segHdr[nh][:]
		nh++
		putHdr(h, frReq, uint32(reqBodyLen+n), id)
		putReq(h[hdrLen:], &seg, flags)
		c.segBufs[nb] = h
		nb++
		for rem := n; rem > 0; {
			s := data[si]
			k := min(rem, s.n-soff)
			if k > 0 {
				c.segBufs[nb] = unsafe.Slice((*byte)(unsafe.Add(s.p, soff)), k)
				nb++
			}
			rem -= k
			if soff += k; soff == s.n {
				si, soff = si+1, 0
			}
		}
		off += n
	}
	return flush()
}

// respTimeout is how long a RC request waits for its response: the QP's
// transport timeout × (retry_cnt+1), at least minRespTimeout; 0: forever.
// The timer ticks every quarter of it (rtPeriods), and a request fails
// between one and one and a quarter timeouts after it left, plus the
// periods this process itself was found stalled (a tick more than a
// period late is not charged, maxRTStalls in a row at most: at most four
// timeouts more), when the peer showed no sign of life meanwhile: no
// clock is read per request, one per period.
// (A NIC retransmits after each transport timeout; soft0's transports do
// not lose frames, so the retransmissions are the waits, without the
// packets.) The wait restarts while the peer shows signs of life
// (conn.alive).
func (q *qp) respTimeout() time.Duration {
	d := transportTimeout(q.attr.Timeout)
	if d == 0 {
		return 0
	}
	return max(d*time.Duration(q.attr.RetryCnt+1), minRespTimeout)
}

// alive reports whether the peer showed signs of life since *mark (its
// frames were handled, or bytes of it wait to be), which it then moves
// on. A RC request whose response is late fails only without them
// (xreq.go): the peer's goroutines, unlike a NIC, can be descheduled
// (an oversubscribed host, a stop of the world), and so can this
// process' reader, with the response waiting in its socket. A peer
// process on this host that used processor time counts as alive too
// (peerlife.go). A peer whose responder handles the segments of a long
// message sends alive frames while it does (showLife: at least every
// aliveEvery, well within a period of the shortest timeout): a slow peer
// that consumes a long message shows life before it answers, over TCP
// too, where nothing else can tell; a stopped or dead one sends none
// (its kernel taking the bytes into its socket is no sign).
func (c *conn) alive(mark *uint64) bool {
	n := c.rxSeen.Load()
	moved := n != *mark
	*mark = n
	return moved || c.inputWaiting() || c.life.ranWithin(localQuiet)
}

// inputWaiting reports whether bytes from the peer wait to be read: in
// the inbound ring, or in the socket.
func (c *conn) inputWaiting() bool {
	if c.shm != nil {
		// The ring stays mapped while rmu is held and the connection
		// is up (service.addConn). Held: a consumer is at it (maybe
		// the caller's, which may hold it: retire runs in
		// handleResp), which counts as life.
		if !c.rmu.TryLock() {
			return true
		}
		defer c.rmu.Unlock()
		if c.dead.Load() {
			return false
		}
		in := &c.shm.in
		return atomic.LoadUint64(in.tail) != atomic.LoadUint64(in.head)
	}
	if c.dead.Load() {
		return false
	}
	n := 0
	c.sockControl(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n > 0
}

// writeFrame writes one frame, waiting for room (at most timeout: then the
// connection fails, since a frame cannot be left half written).
func (c *conn) writeFrame(bufs [][]byte, timeout time.Duration) error {
	return c.writeWaiting(bufs, timeout, nil)
}

// writeWaiting takes wmu and writes, waiting for room (at most timeout
// each write): the queue, then the frame bufs, or what write (if not
// nil) writes with wmu held. A failed write fails the connection.
func (c *conn) writeWaiting(bufs [][]byte, timeout time.Duration, write func() error) error {
	c.wmu.Lock()
	if c.dead.Load() {
		c.wmu.Unlock()
		return errConnDown
	}
	c.setDeadline(time.Now().Add(timeout))
	err := c.flushQueueLocked(timeout)
	if err == nil {
		if write != nil {
			err = write()
		} else {
			err = c.writeAllLocked(bufs)
		}
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
	if c.qhigh.Load() {
		return false, nil
	}
	// Held responses go first, in the same write (progress.go).
	c.respMu.Lock()
	if len(c.resps) > 0 && len(bufs) < len(c.pbufs) {
		c.pbufs[0] = c.resps
		n := copy(c.pbufs[1:], bufs)
		err = c.sendNow(c.pbufs[:n+1])
		clear(c.pbufs[:n+1])
		c.setResps(c.resps[:0])
	} else {
		err = c.sendNow(bufs)
	}
	c.respMu.Unlock()
	if err != nil {
		// Not under respMu: failing the connection fails its QPs, whose
		// posters may be waiting for respMu here while holding their
		// QP (a deadlock seen in TestFailureReachesEveryRank).
		c.fail(err)
	}
	if c.dead.Load() {
		return false, errConnDown
	}
	return true, nil
}

// setResps sets the held responses (respMu held).
func (c *conn) setResps(b []byte) {
	c.resps = b
	if len(b) == 0 {
		if c.heldOther.Load() {
			c.heldOther.Store(false)
		}
	}
	if h := len(b) > 0; c.held.Load() != h { // a store only if it changes (respMu)
		c.held.Store(h)
	}
}

// setDeadline sets the deadline of writeAllLocked (wmu held).
func (c *conn) setDeadline(t time.Time) {
	if c.shm != nil {
		c.wdeadline = t
		return
	}
	c.wspan = deadlineSpan(t)
	c.nc.SetWriteDeadline(t)
}

// writeAllLocked writes bufs, waiting for room (wmu held).
//
// The deadline of a write (setDeadline) bounds a wait during which the
// socket takes nothing, not the whole write: a write that times out
// after the socket took some of it waits again, as long (patientWrite;
// with TLS the socket under the session does, bufConn). A peer that reads
// a long message slowly (a process that gets a processor now and then)
// is slow, not dead; one that reads nothing (stopped, gone) fills the
// socket's buffers and then fails the write one deadline later.
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
		rest := c.wbufs // c.wbufs keeps its capacity
		for {
			var n int
			n, err = c.quiet.writeAll(rest)
			if !c.patientWrite(n, err) {
				break
			}
			skipBytes(&rest, n)
		}
	} else if c.tlsw != nil {
		err = c.tlsw.writeAll(c.wbufs)
	} else {
		for {
			var n int64
			n, err = c.wbufs.WriteTo(c.nc) // consumes what it wrote
			if !c.patientWrite(int(n), err) {
				break
			}
		}
	}
	clear(c.wbufs[:cap(c.wbufs)])
	if err == nil && c.corked.Load() {
		c.uncorked() // pushed along
	}
	return err
}

// patientWrite reports whether a write to the socket that wrote n bytes
// and failed with err is to go on (wmu held): it timed out, but the
// socket took bytes during the wait (writeAllLocked). The deadline is
// then set as far ahead again.
func (c *conn) patientWrite(n int, err error) bool {
	if !writeGoesOn(n, err, c.wspan) {
		return false
	}
	c.nc.SetWriteDeadline(time.Now().Add(c.wspan))
	return true
}

// writeGoesOn reports whether a write to a socket that wrote n bytes and
// failed with err, its deadline set span ahead, is to go on with the
// deadline as far ahead again: it timed out, but the socket took bytes
// meanwhile (conn.patientWrite, bufConn.patientWrite).
func writeGoesOn(n int, err error, span time.Duration) bool {
	return err != nil && n > 0 && span > 0 && errors.Is(err, os.ErrDeadlineExceeded)
}

// deadlineSpan is how far ahead of now the deadline t is (0: none).
func deadlineSpan(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return time.Until(t)
}

// skipBytes drops the first n bytes of *bufs.
func skipBytes(bufs *net.Buffers, n int) {
	b := *bufs
	for len(b) > 0 && n >= len(b[0]) {
		n -= len(b[0])
		b[0] = nil
		b = b[1:]
	}
	if len(b) > 0 {
		b[0] = b[0][n:]
	}
	*bufs = b
}

// outItem is an entry of the send queue: the bytes of frames (a pooled
// buffer), or the rest of an RDMA read response (rd, when b is nil).
type outItem struct {
	b  []byte
	rd readJob
}

// readJob is what remains to send of the response to an RDMA read: its
// data, from the region m (checked by the responder when it accepted the
// read), in segments. The data is copied out when the segment is written
// (RDMA reads are not ordered before later writes at the responder either,
// without a fence). A region closed meanwhile ends it with a NAK.
type readJob struct {
	m      *mr
	addr   uint64 // the region's address of the byte at off
	id     uint64
	qpn    uint32 // the requester's
	off, n uint32 // the next byte, the length of the data
}

// jobCost is what a queued read response counts for maxQueued: about
// the memory it takes in the queue.
const jobCost = 4 * int(unsafe.Sizeof(outItem{}))

// frame puts the next frame of j's response in b (at least
// hdrLen+respBodyLen+segMax bytes) and returns its length and whether it
// is the last; the region is pinned only while its bytes are copied.
func (j *readJob) frame(b []byte) (int, bool) {
	k := min(segMax, j.n-j.off)
	r := response{orig: uint64(j.off), more: j.off+k < j.n}
	p, ok := j.m.acquire(j.addr, uint64(k))
	if !ok {
		r = response{code: respAccess}
		k = 0
	} else {
		dmaCopy(b[hdrLen+respBodyLen:], unsafe.Slice((*byte)(p), k))
		j.m.release()
		j.off += k
		j.addr += uint64(k)
	}
	putHdr(b, frResp, uint32(respBodyLen+k), j.id)
	putResp(b[hdrLen:], j.qpn, &r)
	return hdrLen + respBodyLen + int(k), !r.more
}

// flushQueueLocked writes the queued frames (wmu held), waiting at most
// timeout for each write.
func (c *conn) flushQueueLocked(timeout time.Duration) error {
	for {
		c.qmu.Lock()
		q := c.queue
		if len(q) == 0 {
			c.qmu.Unlock()
			return nil
		}
		c.queue, c.qspare = c.qspare[:0], nil
		c.qtaken.Store(true)
		c.qlen.Store(0)
		c.qmu.Unlock()
		err := c.writeItemsLocked(q, timeout)
		c.qtaken.Store(false)
		for i := range q {
			putBuf(q[i].b)
		}
		clear(q)
		c.qmu.Lock()
		if c.qspare == nil && cap(q) <= 1024 {
			c.qspare = q[:0] // a small array is kept; a large one goes
		}
		c.qmu.Unlock()
		if err != nil {
			return err
		}
	}
}

// writeItemsLocked writes the queue q (wmu held): runs of frames in one
// write, read responses segment by segment. Each write gives back its
// bytes to qbytes.
func (c *conn) writeItemsLocked(q []outItem, timeout time.Duration) error {
	var jbuf []byte
	defer func() { putBuf(jbuf) }()
	for i := 0; i < len(q); {
		if q[i].b == nil {
			if jbuf == nil {
				jbuf = getBuf(hdrLen + respBodyLen + segMax)
			}
			j := &q[i].rd
			for {
				c.setDeadline(time.Now().Add(timeout))
				n, last := j.frame(jbuf)
				c.one[0] = jbuf[:n]
				err := c.writeAllLocked(c.one[:])
				c.one[0] = nil
				if err != nil {
					return err
				}
				if last {
					break
				}
			}
			c.unqueue(jobCost)
			i++
			continue
		}
		n := 0
		bufs := c.qbufs[:0]
		for ; i < len(q) && q[i].b != nil && len(bufs) < 64; i++ {
			bufs = append(bufs, q[i].b)
			n += len(q[i].b)
		}
		c.qbufs = bufs[:0]
		c.setDeadline(time.Now().Add(timeout))
		err := c.writeAllLocked(bufs)
		clear(bufs)
		if err != nil {
			return err
		}
		c.unqueue(n)
	}
	return nil
}

func (c *conn) unqueue(n int) {
	c.qmu.Lock()
	c.qbytes -= n
	c.qhigh.Store(c.qbytes > sendHigh)
	c.qmu.Unlock()
}

// flushLoop writes what the reader queued until the connection fails.
func (c *conn) flushLoop() {
	for {
		select {
		case <-c.done:
			c.qmu.Lock()
			for _, it := range c.queue {
				putBuf(it.b)
			}
			c.queue, c.qspare, c.qbytes = nil, nil, 0
			c.qlen.Store(0)
			c.qhigh.Store(false)
			c.qmu.Unlock()
			return
		case <-c.qwake:
		}
		var err error
		c.wmu.Lock()
		if !c.dead.Load() {
			c.setDeadline(time.Now().Add(writeTimeout))
			err = c.flushQueueLocked(writeTimeout)
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
	if err := c.sendNow(bufs); err != nil {
		c.fail(err)
	}
}

// sendNow is sendAsync, but a failure is returned rather than taking the
// connection down (the caller must, without the locks it holds).
func (c *conn) sendNow(bufs [][]byte) error { return c.send(bufs, false) }

// send is sendNow; with later, bufs are one acknowledgement frame,
// ackFirst's, which what the consumer does next pushes: written straight
// into a TCP socket it is written with MSG_MORE (below); put straight into
// a shared-memory ring, a peer found asleep is woken by the drain (the
// frame is in the ring before the completion it precedes is visible, and
// a peer that finds this process gone handles what its ring holds first:
// failAfterDrain), after the frames that follow, not for each: the
// receiver of a stream of sends woke the sleeping sender once per
// message, an eventfd write that was a tenth of the receiving process'
// time (session's BenchmarkXprocBandwidth/shm/session, perf).
//
// Over TCP the frame is then in the kernel, which sends it when the process
// exits or closes the socket, as ackFirst requires, but it need not be
// pushed onto the network now: on loopback a push is most of a write's
// cost (the whole receive path of the peer's stack runs in it). The next
// write on the connection pushes it, in the same segment as the request
// that follows (an answer, in a ping-pong); flushResps pushes it when
// none follows (pushAck), at the latest when the responses held with it
// would leave (progress.go). At most as many bytes as responses are held
// (handleReq) wait corked. A process that exits with bytes of the peer's
// it has not read makes its kernel reset the connection instead, and a
// frame still corked is lost with it: the peer sees the request fail, as
// it does when the process exits before the acknowledgement.
func (c *conn) send(bufs [][]byte, later bool) error {
	if c.dead.Load() {
		return nil
	}
	over := false
	if c.wmu.TryLock() {
		written := 0
		if c.queueEmpty() {
			var n int
			var err error
			if later && c.shm != nil {
				n, err = c.putLater(bufs)
			} else {
				c.twMore = later && c.corkedLen+total(bufs) <= cap(c.resps)
				n, err = c.tryWrite(bufs)
			}
			if c.twMore && n > 0 {
				c.corked.Store(true)
				c.corkedLen += n
			}
			c.twMore = false
			if err != nil {
				c.wmu.Unlock()
				return fmt.Errorf("soft: write to process %d: %w", c.peerPID, err)
			}
			written = n
		}
		all := written == total(bufs)
		if !all {
			// The rest of a frame partly written goes before what was
			// queued meanwhile (by those who found wmu held).
			over = c.enqueue(bufs, written, nil, written > 0)
		}
		c.wmu.Unlock()
		if all {
			return nil
		}
	} else {
		over = c.enqueue(bufs, 0, nil, false)
	}
	if over {
		return c.overflowErr()
	}
	c.wakeFlusher()
	return nil
}

// writeTLSNow writes the frame bufs into the TLS session now if that
// cannot wait: nobody else writes, nothing is queued, and the socket has
// room for it to spare. It reports whether it wrote (err: the write
// failed; the caller takes the connection down). Otherwise the frame is
// the flusher's, as every frame of a TLS connection (sendNow).
func (c *conn) writeTLSNow(bufs [][]byte, err *error) bool {
	if c.dead.Load() || !c.wmu.TryLock() {
		return false
	}
	defer c.wmu.Unlock()
	if !c.queueEmpty() || !c.socketRoom(total(bufs)+tlsOverhead) {
		return false
	}
	if werr := c.tlsw.writeAll(bufs); werr != nil {
		*err = fmt.Errorf("soft: write to process %d: %w", c.peerPID, werr)
	}
	return true
}

// tlsOverhead bounds what TLS adds to a record.
const tlsOverhead = 64

// socketRoom reports whether the connection's socket can take n more
// bytes without waiting: what it holds unsent or unacknowledged leaves n
// and half its send buffer free.
func (c *conn) socketRoom(n int) bool {
	room := false
	c.sockControl(func(fd uintptr) {
		queued, err := unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		if err != nil {
			return
		}
		size, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF)
		room = err == nil && queued+n <= size/2
	})
	return room
}

// queueEmpty reports whether every frame queued so far is written: none
// waits in the queue, and none that a writer took from it (publishWrite
// and ackFirst publish an acknowledgement for everything before it).
func (c *conn) queueEmpty() bool { return c.qlen.Load() == 0 && !c.qtaken.Load() }

func (c *conn) wakeFlusher() {
	select {
	case c.qwake <- struct{}{}:
	default:
	}
}

// sendRead sends the response to an RDMA read that the responder
// accepted: its data, n > 0 bytes at addr in m, in segments. Like
// sendAsync it does not wait: it writes segments straight from the region
// while the socket takes them whole, and queues the rest of the response
// as a readJob (with a copy of the part of a segment that was written).
// Called by the consumer.
func (c *conn) sendRead(id uint64, qpn uint32, m *mr, addr uint64, n uint32) {
	if c.dead.Load() {
		return
	}
	j := readJob{m: m, addr: addr, id: id, qpn: qpn, n: n}
	over := false
	if !c.wmu.TryLock() {
		over = c.enqueue(nil, 0, &j, false)
	} else {
		if !c.queueEmpty() {
			over = c.enqueue(nil, 0, &j, false)
		} else {
			for {
				k := min(segMax, j.n-j.off)
				r := response{orig: uint64(j.off), more: j.off+k < j.n}
				bufs := c.rbufs[:1]
				p, ok := j.m.acquire(j.addr, uint64(k))
				if ok {
					c.rbufs[1] = unsafe.Slice((*byte)(p), k)
					bufs = c.rbufs[:2]
					j.off += k
					j.addr += uint64(k)
				} else {
					r, k = response{code: respAccess}, 0
				}
				putHdr(c.rhdr[:], frResp, uint32(respBodyLen+k), id)
				putResp(c.rhdr[hdrLen:], qpn, &r)
				c.rbufs[0] = c.rhdr[:]
				w, err := c.tryWrite(bufs)
				last := !r.more
				var rest *readJob
				if !last {
					rest = &j
				}
				queued := false
				if err == nil && w < total(bufs) {
					over = c.enqueue(bufs, w, rest, w > 0)
					queued = true
				}
				if ok {
					j.m.release()
				}
				clear(c.rbufs[:])
				if err != nil {
					c.wmu.Unlock()
					c.fail(fmt.Errorf("soft: write to process %d: %w", c.peerPID, err))
					return
				}
				if last && !queued {
					c.wmu.Unlock()
					return
				}
				if queued {
					break
				}
			}
		}
		c.wmu.Unlock()
	}
	if over {
		c.failOverflow()
		return
	}
	c.wakeFlusher()
}

// enqueue queues a copy of bufs after their first skip bytes (if any
// remain), then the read response rd (if not nil): at the end of the
// queue, or at its front (the rest of a frame partly written, wmu held).
// It reports whether the queue is over its limit (the caller must fail
// the connection, without wmu).
func (c *conn) enqueue(bufs [][]byte, skip int, rd *readJob, front bool) bool {
	// The bytes go in chunks of at most queueChunk: the pool then holds
	// about what is queued, not twice as much for sizes just above a
	// power of two.
	var arr [4]outItem
	items := arr[:0]
	n := 0
	bi := 0 // the next byte: bufs[bi][skip]
	for rest := total(bufs) - skip; rest > 0; {
		b := getBuf(min(rest, queueChunk))
		for o := 0; o < len(b); {
			for skip >= len(bufs[bi]) {
				skip -= len(bufs[bi])
				bi++
			}
			k := dmaCopy(b[o:], bufs[bi][skip:])
			o += k
			skip += k
		}
		items = append(items, outItem{b: b})
		rest -= len(b)
		n += len(b)
	}
	if rd != nil {
		items = append(items, outItem{rd: *rd})
		n += jobCost
	}
	k := len(items)
	c.qmu.Lock()
	if front && len(c.queue) > 0 {
		c.queue = append(c.queue, items...)
		copy(c.queue[k:], c.queue[:len(c.queue)-k])
		copy(c.queue, items)
	} else {
		c.queue = append(c.queue, items...)
	}
	c.qbytes += n
	c.qlen.Store(int32(len(c.queue)))
	c.qhigh.Store(c.qbytes > sendHigh)
	over := c.qbytes > maxQueued
	c.qmu.Unlock()
	clear(items)
	return over
}

// queueChunk is the largest buffer of the send queue.
const queueChunk = 64 << 10

func (c *conn) failOverflow() { c.fail(c.overflowErr()) }

func (c *conn) overflowErr() error {
	return fmt.Errorf("soft: process %d reads nothing: more than %d MiB queued for it", c.peerPID, maxQueued>>20)
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
		var r uintptr
		var errno syscall.Errno
		if c.twMore && n == 1 {
			r, _, errno = unix.RawSyscall6(unix.SYS_SENDTO, fd, uintptr(unsafe.Pointer(c.iov[0].Base)), uintptr(c.iov[0].Len), unix.MSG_MORE, 0, 0)
		} else {
			r, _, errno = unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&c.iov[0])), uintptr(n))
			if errno == 0 && c.corked.Load() {
				c.uncorked() // pushed along
			}
		}
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
	case frReq, frResp, frWake, frAlive:
		return nil
	case frMap:
		if c.shm != nil {
			return nil
		}
	case frPullProbe:
		if pullKind(c.kind) {
			return nil
		}
	case frPullAck: // over shared memory it comes by the socket (watchSocket)
		if c.kind == kindUnix {
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

// handle processes one frame; data is its payload (plen bytes in place,
// in one or two pieces), valid until it returns.
func (c *conn) handle(h frameHdr, body []byte, data []span, plen int) error {
	switch h.typ {
	case frReq:
		return c.handleReq(h.id, body, data, plen)
	case frResp:
		return c.handleResp(h.id, body, data, plen)
	case frWake:
		// From the destination's process, on the connection the QP's
		// requests go on (its responder's waker answers there): any
		// other peer could make it retry at will.
		if q := c.f.qps.load(binary.LittleEndian.Uint32(body) & maxQPN); q != nil && q.x.userOf.Load() == c {
			q.wake()
		}
		return nil
	case frAlive:
		// Its arrival is the point: the peer's responder handles the
		// segments of a long message (rxSeen, alive).
		return nil
	case frMap:
		return c.serveMap(h.id, body)
	case frPullProbe:
		return c.servePullProbe(body) // between processes of one host (checkType)
	case frPullAck:
		return c.handlePullAck(body) // unix sockets (checkType)
	}
	return fmt.Errorf("%w: type %d", errBadType, h.typ)
}

// handleReq runs a request (or a segment of one) from the peer at the
// target QP (which does every check) and answers it.
func (c *conn) handleReq(id uint64, body []byte, data []span, plen int) error {
	var req request
	flags, err := parseReq(body, uint32(plen), &req)
	if err != nil {
		return err
	}
	req.srcFabric = c.peerFab // who the peer claims to be: fromPeer checks the claim
	req.srcConn = c
	req.placed = c.rxPlaced
	if req.qpType == uint8(prov.QPTypeRC) {
		req.waker = c.waker(req.srcQPN)
	}
	if req.direct && c.shm == nil {
		return fmt.Errorf("%w: a direct write on a connection without shared memory", errBadReq)
	}
	if flags&reqPull != 0 && req.op != opRead {
		if req.pull, err = c.parsePull(data, plen, req.length); err != nil {
			return err
		}
		data = nil
	}
	if req.op >= opRead {
		data = nil
		req.deferRead = req.op == opRead && !req.direct // sendRead sends the data
	}
	if req.more {
		if d := c.f.testSegDelay.Load(); d > 0 {
			time.Sleep(time.Duration(d)) // a slow responder (tests)
		}
	}
	var resp response
	c.rxID, c.rxQPN, c.rxAnswer, c.rxAcked = id, req.srcQPN, flags&reqNoResp == 0, false
	if t := c.f.qps.load(req.dstQPN); t == nil {
		resp.code = silentOr(&req, respNoQP)
	} else {
		// Before the completion is visible: an application that polls
		// it and then waits drives c (drive.go) only if it finds c here.
		t.rcq.fedBy(c)
		t.respond(&req, data, &resp)
		// An acknowledged request comes from t's destination (fromPeer).
		if resp.code == respACK && t.typ == prov.QPTypeRC && t.x.rev.Load() != c {
			t.x.rev.Store(c)
		}
	}
	if resp.code != respACK {
		c.unpublish() // not executed (publishWrite)
	}
	c.rxPub = false
	big := req.length >= ackNowMin && c.shm != nil // its responses leave now
	if req.op < opRead {
		c.rxMoved += uint64(req.length) // its payload came (pollMoveMax)
	}
	if c.rxAcked {
		// Answered before its receive completion (ackFirst).
		err := c.rxErr
		c.rxAcked, c.rxErr = false, nil
		if big && err == nil {
			c.flushResps()
		}
		return err
	}
	if req.more && resp.code == respACK && flags&reqNoResp == 0 {
		c.showLife(id, req.off)
	}
	if flags&reqNoResp != 0 || resp.code == respSilent || resp.code == respACK && req.more {
		return nil
	}
	if resp.code == respACK && resp.src != nil {
		c.flushResps() // the responses before it go first
		if flags&reqPull != 0 && c.answerPulled(id, req.srcQPN, resp.src, req.raddr, req.length) {
			return nil
		}
		c.sendRead(id, req.srcQPN, resp.src, req.raddr, req.length)
		return nil
	}
	// Held (progress.go), up to a limit. A NAK that moved the responder
	// to ERR is not: its application may have polled the error
	// completions that go with it.
	c.respMu.Lock()
	c.appendRespLocked(id, req.srcQPN, &resp)
	if resp.code != respACK || req.op == opCAS || req.op == opFAA {
		c.heldOther.Store(true)
	}
	// An atomic's answer leaves at once too: it changed the memory
	// already, and unlike a write's acknowledgement it cannot be
	// published in the acknowledgement page (ackpage.go), so a process
	// that exits as soon as it sees the change would take it along.
	if big || resp.code >= respInvReq || req.op == opCAS || req.op == opFAA || len(c.resps)+hdrLen+respBodyLen > cap(c.resps) {
		c.flushRespsLocked()
	}
	c.respMu.Unlock()
	return nil
}

// aliveEvery is how often a responder that handles the segments of a
// long RC message tells the requester it is alive (showLife): an eighth
// of minRespTimeout, the shortest response timeout, whose timer checks
// for signs of life every quarter of it at the earliest.
const aliveEvery = minRespTimeout / 8

// showLife is called by the consumer (rmu held) when the responder has
// accepted a segment of a RC message other than its last: off is the
// segment's offset in the message of request id. Only the last segment
// is answered, and a long message into a slow process (one that gets a
// processor now and then on a loaded host) can take longer than the
// requester's response timeout to arrive: over TCP the requester has no
// other sign of this process' life (conn.alive), and the kernel having
// taken the bytes proves nothing (a stopped process' kernel takes them
// too). So a responder that has been handling a message's segments for
// aliveEvery since its first segment or its last alive frame sends one
// (frAlive): it comes while this process consumes the message, and
// never from a process that does not run. A message that arrives
// quickly sends none: a clock read per segment is its cost.
func (c *conn) showLife(id uint64, off uint32) {
	now := time.Now()
	if off == 0 {
		c.lifeAt = now
		return
	}
	if now.Sub(c.lifeAt) < aliveEvery {
		return
	}
	c.lifeAt = now
	b := c.aliveFrame[:]
	putHdr(b, frAlive, aliveLen, id)
	binary.LittleEndian.PutUint64(b[hdrLen:], uint64(off))
	c.aliveBufs[0] = b
	c.sendAsync(c.aliveBufs[:])
	c.aliveBufs[0] = nil
}

// ackNowMin is the least message length whose responses are not held
// over shared memory: they leave when the request has been handled, not
// when the consumer is done with the frames after it (drain's caller) or
// the application answers. Moving that many bytes takes far longer than
// putting an acknowledgement in the ring, and the requester may be
// waiting for it to send more (a window of messages): 64 KiB RDMA writes
// into a process, 16 in flight, went at 5.6 GB/s with their
// acknowledgements held, 11 GB/s without (session's
// BenchmarkXprocBandwidth/shm/channel). Over sockets an acknowledgement
// written alone is a system call, which a window of held ones shares:
// 64 KiB writes over a unix socket into another process fell from 10.5
// to 6.8 GB/s without the hold (BenchmarkChildWriteBandwidth), so they
// keep it.
const ackNowMin = 32 << 10

// appendRespLocked holds the response r to the request id of the peer's
// QP qpn (respMu held).
func (c *conn) appendRespLocked(id uint64, qpn uint32, r *response) {
	k := len(c.resps)
	c.setResps(c.resps[:k+hdrLen+respBodyLen])
	putHdr(c.resps[k:], frResp, respBodyLen, id)
	putResp(c.resps[k+hdrLen:], qpn, r)
}

// ackHoldMax is how many acknowledgements of received messages ackFirst
// holds over a unix socket before it writes them all. A consumer that
// finds message after message waiting (a stream of sends) flushes only
// when it finds none; holding up to the buffer's 64 let a sender with 16
// messages in flight run out of them and wait for the consumer to go
// idle, both processes then idle between bursts (a bare channel's 64 KiB
// writes with immediate data over unix sockets, a third of the two
// processors idle: 0.81 of plain writes, 1.00 with 4; the session's
// one-poster 64 KiB messages 0.72 of the channel's writes, 0.87 with 4;
// medians of fifteen alternating runs). A round trip holds one, which
// its answer takes along, as before. Over shared memory an
// acknowledgement costs no system call and wakes nobody (send's later):
// there they are held up to the buffer's size, as before.
const ackHoldMax = 4

// ackHoldBytes is how many bytes of acknowledgements ackFirst holds.
func (c *conn) ackHoldBytes() int {
	if c.shm != nil {
		return cap(c.resps)
	}
	return ackHoldMax * (hdrLen + respBodyLen)
}

// ackFirst answers the request being handled with an ACK, after the
// responses held before it, ahead of the receive completion the request
// produces: the responder calls it just before it delivers the
// completion (qp.completeRecv). An application may exit as soon as it
// has polled a completion, without closing anything: its
// acknowledgement must have left by then, or the requester would see
// RETRY_EXC_ERR for a message that was delivered. It leaves in the
// socket or the ring unless the connection is congested (the socket
// full, or another goroutine writing: then the flusher writes it, in
// microseconds) or encrypted (TLS: always the flusher).
//
// Called by the consumer in handleReq, within the responder (the target
// QP's rmu held): it does not take the connection down itself (that runs
// requesters, which take their rmu), handleReq does.
func (c *conn) ackFirst() {
	if !c.rxAnswer || c.rxAcked {
		return
	}
	c.rxAcked = true
	c.respMu.Lock()
	c.appendRespLocked(c.rxID, c.rxQPN, &response{code: respACK})
	if c.acks != nil && !c.heldOther.Load() && c.queueEmpty() && len(c.resps)+hdrLen+respBodyLen <= c.ackHoldBytes() {
		// Held, and published in the acknowledgement page: the answer
		// or the next flush takes it along (ackpage.go). Past
		// ackHoldBytes they all go now.
		c.acks.held(c.rxID)
		c.respMu.Unlock()
		return
	}
	c.fbufs[0] = c.resps
	var err error
	if c.tlsw == nil || !c.writeTLSNow(c.fbufs[:1], &err) {
		// Over TCP the acknowledgement is corked, over shared memory
		// a sleeping peer is woken later (send): the answer, or what
		// else the consumer does next, pushes it (see
		// Acknowledgements).
		err = c.send(c.fbufs[:1], c.shm != nil || c.kind == kindTCP && c.tlsw == nil)
	}
	c.fbufs[0] = nil
	c.setResps(c.resps[:0])
	c.respMu.Unlock()
	if err != nil && c.rxErr == nil {
		c.rxErr = err
	}
}

// putLater is tryWrite of send's later over shared memory (wmu held):
// a peer found asleep is woken by the drain (payWake).
func (c *conn) putLater(bufs [][]byte) (int, error) {
	if c.dead.Load() {
		return 0, errConnDown
	}
	n, wake, err := c.shm.out.put(bufs)
	if wake && !c.wakeOwed {
		c.wakeOwed, c.wakeFrames = true, 0
	}
	return n, err
}

// wakeBatch is how many frames drain handles after an acknowledgement
// whose wake-up it owes (putLater) before it wakes the peer.
const wakeBatch = 4

// payWake wakes the peer's consumer if ackFirst left it asleep (rmu).
func (c *conn) payWake() {
	if c.wakeOwed {
		c.wakeOwed = false
		c.shm.signal()
	}
}

// useAckPage gives a unix connection its acknowledgement page.
func (c *conn) useAckPage(p *ackPage) {
	if p != nil {
		c.acks = p
	}
}

// publishWrite publishes, before the payload of the RDMA write id
// lands in its region, that this side holds its acknowledgement
// (ackpage.go, Writes), if it can say so exactly: every response held
// before it is a plain acknowledgement and nothing waits in the
// connection's queue (consumer: the responder, or placeStart).
func (c *conn) publishWrite(id uint64) {
	if c.acks == nil {
		return
	}
	// Without respMu (heldOther): a response that is not a plain
	// acknowledgement held by this consumer, or sent meanwhile into the
	// queue, shows in one of the two loads.
	if !c.heldOther.Load() && c.queueEmpty() {
		c.rxPubPrev, c.rxPub = atomic.LoadUint64(c.acks.mine), true
		c.acks.held(id)
	}
}

// unpublish takes the last publishWrite back, if it published: the
// write was not executed after all (consumer).
func (c *conn) unpublish() {
	if c.rxPub {
		c.acks.held(c.rxPubPrev)
		c.rxPub = false
	}
}

// uncorked records that what send corked was pushed (wmu held).
func (c *conn) uncorked() {
	c.corked.Store(false)
	c.corkedLen = 0
}

// pushAck sends what send corked in the socket, if nothing else did.
func (c *conn) pushAck() {
	if !c.corked.Load() || !c.wmu.TryLock() {
		return // a writer pushes it (tryWriteFD, writeAllLocked)
	}
	if c.corked.Load() {
		c.uncorked()
		c.sockControl(func(fd uintptr) {
			// Turning TCP_NODELAY on (it is on) pushes what is queued.
			unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		})
	}
	c.wmu.Unlock()
}

// flushResps sends the held responses, and what send corked in the
// socket.
func (c *conn) flushResps() {
	c.pushAck()
	if !c.held.Load() {
		return // the consumer sees its own: it holds them
	}
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
	c.setResps(c.resps[:0])
}

// holdsResps reports whether responses are held.
func (c *conn) holdsResps() bool { return c.held.Load() }

// handleResp hands a response to its requester. The data of an RDMA read
// goes straight into the read's local memory, segment by segment
// (qp.deliver); the last segment is the response.
func (c *conn) handleResp(id uint64, body []byte, data []span, plen int) error {
	var r response
	qpn, err := parseResp(body, uint32(plen), &r)
	if err != nil {
		return err
	}
	q := c.f.qps.load(qpn)
	if q == nil || q.x.userOf.Load() != c {
		// The requester is gone, or sent nothing on c: a stray
		// response (a peer's QP may name any), which nothing would
		// ever take from its queue.
		return nil
	}
	q.scq.fedBy(c)
	if r.pulled {
		if err := q.deliverPulled(c, id, data); err != nil {
			return err
		}
	} else if plen > 0 {
		if err := q.deliver(c, id, r.orig, data); err != nil {
			return err
		}
		if r.more {
			return nil
		}
	}
	if !q.x.push(rresp{c: c, id: id, resp: r}, 2*q.sq.depth+64) {
		return fmt.Errorf("%w: more responses than requests", errBadResp)
	}
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

// waker returns the waker of the peer's QP qpn (the consumer: rmu held).
func (c *conn) waker(qpn uint32) waker {
	// The consumer's last one first: a conversation has one peer QP.
	if w := c.wkLast; w != nil && w.qpn == qpn {
		return w
	}
	w := c.wakerOf(qpn)
	c.wkLast = w
	return w
}

func (c *conn) wakerOf(qpn uint32) *remoteWaker {
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

// Buffers of the send queue come from size-classed free lists (powers of
// two from 4 KiB to 256 KiB; larger ones are allocated), which keep at
// most bufPoolMax bytes in all: what a burst took beyond that goes back to
// the runtime once it is over. A buffer given back to a full pool takes
// the place of buffers of the class that holds the most (putBuf): the
// pool serves what the process does now, not what filled it first (a
// pool full of 4 KiB chunks from a burst of queued writes made every
// RDMA read response segment, 256 KiB, an allocation).
var bufPool bufFree

type bufFree struct {
	mu    sync.Mutex
	bytes int
	free  [maxBufShift - minBufShift + 1][][]byte
}

const (
	minBufShift = 12
	maxBufShift = 18
	bufPoolMax  = 8 << 20
)

func getBuf(n int) []byte {
	if n > 1<<maxBufShift {
		return make([]byte, n)
	}
	c := 0
	if n > 1<<minBufShift {
		c = bits.Len(uint(n-1)) - minBufShift
	}
	p := &bufPool
	p.mu.Lock()
	l := p.free[c]
	if k := len(l); k > 0 {
		b := l[k-1]
		l[k-1] = nil
		p.free[c] = l[:k-1]
		p.bytes -= cap(b)
		p.mu.Unlock()
		return b[:n]
	}
	p.mu.Unlock()
	return make([]byte, n, 1<<(c+minBufShift))
}

func putBuf(b []byte) {
	c := cap(b)
	if c < 1<<minBufShift || c > 1<<maxBufShift || c&(c-1) != 0 {
		return
	}
	p := &bufPool
	i := bits.Len(uint(c)) - 1 - minBufShift
	p.mu.Lock()
	for p.bytes+c > bufPoolMax && p.evict(i) {
	}
	if p.bytes+c <= bufPoolMax {
		p.free[i] = append(p.free[i], b[:0])
		p.bytes += c
	}
	p.mu.Unlock()
}

// evict drops a free buffer of the class, other than keep, that holds the
// most bytes (mu held). It reports false if there is none.
func (p *bufFree) evict(keep int) bool {
	best, most := -1, 0
	for j, l := range p.free {
		if n := len(l) << (j + minBufShift); j != keep && n > most {
			best, most = j, n
		}
	}
	if best < 0 {
		return false
	}
	l := p.free[best]
	k := len(l) - 1
	p.bytes -= cap(l[k])
	l[k] = nil
	p.free[best] = l[:k]
	return true
}

// checkPeerCred checks that the process at the other end of c has the given
// pid and this process' uid.
func checkPeerCred(c *net.UnixConn, pid uint32) error {
	cred, err := peerCred(c)
	if err != nil {
		return err
	}
	if uint32(cred.Pid) != pid {
		return fmt.Errorf("the peer is process %d, not %d", cred.Pid, pid)
	}
	if cred.Uid != uint32(os.Getuid()) {
		return fmt.Errorf("the peer runs as uid %d, not %d", cred.Uid, os.Getuid())
	}
	return nil
}

// peerCred returns the credentials of the process at the other end of c
// (SO_PEERCRED: what it was when it connected).
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// inboundTCP reports whether c is a TCP connection the peer dialed (what
// maxRemoteConns counts).
func (c *conn) inboundTCP() bool { return c.accepted && c.kind == kindTCP }
