package soft

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// Progress driven by polling.
//
// A process that polls a CQ wants its completions now, and a NIC would
// have produced them without waking anybody. So a Poll that finds its CQ
// empty first handles the complete frames waiting on the process'
// connections itself (pollConns.pollFor; the inbound ring of a
// shared-memory connection, or a non-blocking read of a socket; the
// connection that fed the CQ last first, and the others only when it
// brought nothing for this CQ, since each costs a read): requests
// run at their target QP and are answered, responses complete their
// requests, exactly as the connection's reader goroutine would do it, but
// without the two wake-ups (the reader's, then the poller's) that a
// message costs otherwise. Whoever holds the connection's rmu is its
// consumer: the reader, or one poller (which only tries the lock, so Poll
// never waits for another goroutine).
//
// The responses a poll produces are held while the reader is in its
// grace, and leave with the next request written on the connection
// (trySendFrame), with the next poll that finds nothing new, or when the
// grace ends. A RC QP writes its requests on the connection its
// destination's requests arrive on (qp.pickConn), so in a ping-pong each
// message carries the acknowledgement of the one before: one write per
// message, as on a socket of one's own.
//
// While applications poll, the reader stays out of their way: seeing the
// poll count move, it sleeps in a grace (until the polls stop) instead
// of on its eventfd or socket, so producers find no sleeper to wake and
// make no system call; a socket is silenced meanwhile (quiet.go), so that its
// segments do not wake the runtime's poller either.
// When the polling stops the reader takes over again within one or two
// pollerGrace (one watcher per process looks at the polls of every
// connection whose reader is in its grace, graceWatch: a reader wakes
// only when its grace ends, not every pollerGrace to look);
// an application that arms a CQ to sleep on its channel (cq.Arm) ends the
// grace at once (pollConns.pollersGone), and no grace starts for the polls
// before the arm, so a message for a sleeping application does not wait
// for the watcher. An application that sleeps on its completion channel
// reads the socket, or consumes the shared-memory ring, itself while it
// waits, and the reader steps aside (drive.go).

// pollerGrace is how long the reader leaves a ring to the pollers after
// it saw them poll.
const pollerGrace = 200 * time.Microsecond

// pollState is the polling part of a connection.
type pollState struct {
	rmu     sync.Mutex    // the right to consume the inbound ring
	polls   atomic.Uint64 // polls so far (a hint for the reader)
	polled  atomic.Uint64 // frames polls handled
	grace   atomic.Bool   // the reader sleeps in its grace (graceWatch)
	armedAt atomic.Uint64 // polls when a CQ was last armed: no grace for those
	kick    chan struct{} // ends the reader's grace
	rx      rxSource      // the inbound bytes (rmu)
	sock    *sockRx       // rx of a socket connection
	seen    uint64        // shared memory: the ring's tail drain last saw (rmu)

	rxHdr       [hdrLen]byte // drain's (rmu)
	rxBody      [reqBodyLen]byte
	rxReader    bool          // the consumer is the reader (rxLoop), which may wait
	rxMoved     uint64        // payload bytes of the requests handled (reset by pollDrain)
	rxPlaced    *mr           // the region the frame being handled was placed in (place.go)
	nPlaced     atomic.Uint64 // frames placed so far (place.go)
	nPlacedPoll atomic.Uint64 // of them, by a poll or a drive
	rxStop      *compChannel  // a driver's channel: drain returns once it has an event (driveShm)

	// efdSleeping says that the reader sleeps on the eventfd of a
	// shared-memory connection (or is about to): a driver must not
	// (driveShm).
	efdSleeping atomic.Bool
	// failing says that the connection is about to fail once its ring is
	// drained (failAfterDrain): a driver gives the ring up.
	failing atomic.Bool
	// wantDrive is the channel of a Wait that found the reader consuming
	// a shared-memory ring: the reader leaves the ring to it at the end
	// of the frame it handles, and pokes it (driveShm).
	wantDrive atomic.Pointer[compChannel]
}

// pollMoveMax is how many payload bytes a poll of a shared-memory
// connection moves at most (the requests that brought them handled)
// before it returns, leaving what else arrived to the next poll. An
// application that polls for its next message then works on the
// messages that came while the peer sends more, instead of waiting for
// a whole window of them to be copied (soft0 pulls payloads of pullMin
// and more itself, 5.7 µs for 64 KiB here) and then letting the peer
// wait for buffers while it works on them all: 64 KiB messages of a
// session, 16 senders, went at 5.0-5.2 GB/s with polls that drained 32
// to 63 messages at once (counted), 6.7-7.2 with this bound (session's
// BenchmarkXprocBandwidth/shm/session). Over sockets a drain
// takes in what the socket holds and must handle it all: a drive waits
// on the socket once its buffer has no complete frame left (drive.go).
const pollMoveMax = 4 * pullMin

// poll handles the complete frames that have arrived unless another
// goroutine is at it. It reports whether it handled any.
func (c *conn) poll() bool {
	p := c.polls.Add(1)
	if c.sock != nil && !c.spinning(p) {
		// A read costs a system call: not for the poll or two around
		// an arm (the reader is awake for a sleeping application).
		return false
	}
	if !c.rmu.TryLock() {
		// The reader may hold it waiting on the socket: it looks at the
		// polls only when its wait ends, which a process whose
		// goroutines spin (yielding to each other) leaves to the
		// runtime's network poller, checked every 10 ms then. End the
		// wait; the reader then leaves the socket to the polls.
		c.askReaderAside()
		return false
	}
	// A shared-memory segment stays mapped while rmu is held and the
	// connection is up (see service.addConn).
	if c.dead.Load() {
		c.rmu.Unlock()
		return false
	}
	if c.quiet != nil && c.grace.Load() {
		// A reader that went into its grace while a poller held rmu
		// left the socket listening (waitRx): every segment then woke
		// the runtime's poller for nothing (quiet.go). Silence it for
		// the reader.
		if err := c.quiet.silence(); err != nil {
			c.rmu.Unlock()
			c.fail(err)
			return false
		}
	}
	n, err := c.pollDrain()
	if n > 0 {
		c.polled.Add(uint64(n))
	}
	// While the reader is in its grace (it sends them when the grace
	// ends), the responses of what this poll handled are held: the next
	// request on the connection takes them along (trySendFrame), or the
	// next poll that finds nothing new sends them.
	if n == 0 || err != nil || !c.grace.Load() {
		c.flushResps()
	}
	c.rmu.Unlock()
	if err != nil {
		c.fail(err)
	}
	return n > 0
}

// pollDrain is a poll's drain (rmu held): over shared memory it returns
// once the requests it handled brought pollMoveMax bytes.
func (c *conn) pollDrain() (int, error) {
	if c.shm == nil {
		return c.drain(false)
	}
	c.rxMoved = 0
	return c.drainUpTo(false, pollMoveMax)
}

// drain handles the complete frames that have arrived (rmu held) and
// returns how many. c.seen is left at the ring's tail it last saw.
// justFilled says the source was just filled (by the reader's wait): it is
// not read again unless that filled it up. Every frame fits in the source
// (maxFrame), and is handled in place.
func (c *conn) drain(justFilled bool) (n int, err error) { return c.drainUpTo(justFilled, 0) }

// drainUpTo is drain, returning once the requests it handled brought
// limit payload bytes (rxMoved; 0: no limit). It wakes the peer if an
// acknowledgement left it asleep (payWake).
func (c *conn) drainUpTo(justFilled bool, limit uint64) (n int, err error) {
	n, err = c.drainFrames(justFilled, limit)
	c.payWake()
	return n, err
}

func (c *conn) drainFrames(justFilled bool, limit uint64) (n int, err error) {
	src := c.rx
	hb, body := &c.rxHdr, &c.rxBody
	filled := justFilled && !src.more()
	// Large write payloads are placed in their regions (place.go), by
	// whoever consumes the socket; only the reader waits for the rest of
	// one, pollers and drives read what arrived and leave the rest to the
	// next consumer.
	place := c.sock != nil && c.sock.src == nil
	for !c.dead.Load() {
		if limit > 0 && c.rxMoved >= limit {
			return n, nil // a poll's share (pollMoveMax)
		}
		if place && c.sock.pending() {
			done, err := c.placeRun(c.rxReader)
			if err != nil || !done {
				return n, err
			}
			err = c.placeFinish()
			n++
			c.nPlaced.Add(1)
			if !c.rxReader {
				c.nPlacedPoll.Add(1)
			}
			c.rxSeen.Add(1)
			if err != nil {
				return n, fmt.Errorf("soft: bad frame from process %d: %w", c.peerPID, err)
			}
			filled = true // the placement read what followed
			continue
		}
		a, err := src.avail()
		if err != nil {
			return n, fmt.Errorf("soft: connection to process %d: %w", c.peerPID, err)
		}
		if c.shm != nil {
			c.seen = c.shm.in.pos + a
		}
		complete := false
		var h frameHdr
		if a >= hdrLen {
			src.peek(0, hb[:])
			h, err = parseHdr(hb[:])
			if err == nil {
				err = c.checkType(h)
			}
			if err != nil {
				return n, fmt.Errorf("soft: malformed frame from process %d: %w", c.peerPID, err)
			}
			need := uint64(hdrLen) + uint64(h.length)
			complete = a >= need
			if need > src.room() { // not with parseHdr's limits
				return n, fmt.Errorf("soft: frame of %d bytes from process %d", need, c.peerPID)
			}
		}
		if !complete && place && h.typ == frReq && a >= hdrLen+reqBodyLen && uint64(hdrLen)+uint64(h.length)-a >= placeMin {
			if c.placeStart(h, a) {
				filled = false // the rest is in the socket
				continue
			}
		}
		if !complete {
			if filled {
				return n, nil
			}
			if err := src.fill(); err != nil {
				return n, readErr(c, err)
			}
			filled = true
			continue
		}
		// One read per drain unless it filled the buffer: the next poll
		// takes what came since.
		filled = filled && !src.more()
		bl := bodyLen(h)
		src.peek(hdrLen, body[:bl])
		if place {
			// A large RDMA write read whole (the consumer was behind,
			// or a full read took it in) is a stream of them: the
			// next reads stop at the tail, so that the next payloads
			// are placed (place.go). Another frame read whole ends
			// that: back to full reads.
			c.sock.placing = h.typ == frReq && h.length >= placeMin && reqOp(body[0]).isWrite()
		}
		// The payload is used in place: the responder copies it into the
		// target, the requester into a read's memory, before the space is
		// released.
		var data []span
		plen := uint64(h.length) - uint64(bl)
		if plen > 0 {
			p0, p1 := src.payload(uint64(hdrLen+bl), plen)
			c.rxData[0] = span{unsafe.Pointer(unsafe.SliceData(p0)), len(p0)}
			data = c.rxData[:1]
			if len(p1) > 0 {
				c.rxData[1] = span{unsafe.Pointer(unsafe.SliceData(p1)), len(p1)}
				data = c.rxData[:2]
			}
		}
		err = c.handle(h, body[:bl], data, int(plen))
		c.rxData = [2]span{}
		src.skip(uint64(hdrLen) + uint64(h.length))
		n++
		c.rxSeen.Add(1)
		if c.wakeOwed {
			if c.wakeFrames++; c.wakeFrames > wakeBatch {
				c.payWake()
			}
		}
		if err != nil {
			return n, fmt.Errorf("soft: bad frame from process %d: %w", c.peerPID, err)
		}
		if c.rxStop != nil && c.rxStop.queued.Load() > 0 {
			return n, nil // the driver's event (driveShm)
		}
		if c.rxReader && c.shm != nil && c.wantDrive.Load() != nil {
			return n, nil // a Wait would drive the ring (rxLoop)
		}
	}
	return n, nil
}

// rxLoop is the reader of a connection: it handles frames whenever no
// poller does, until the connection fails.
func (c *conn) rxLoop() {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var lastPolls uint64
	justFilled := false
	for !c.dead.Load() {
		if c.shm != nil && c.driveOn.Load() != driveNone {
			// A Wait drives the ring (driveShm).
			c.stepAside(timer)
			continue
		}
		c.rmu.Lock()
		if c.dead.Load() {
			c.rmu.Unlock()
			return
		}
		wakes := c.f.wakes.Load()
		c.rxReader = true
		_, err := c.drain(justFilled)
		c.rxReader = false
		justFilled = false
		if err == nil && c.sock != nil && !c.graceDue(&lastPolls) {
			// A socket is waited on with rmu held (the wait reads the
			// bytes in): pollers leave it to the reader meanwhile. The
			// wait must read: with the readiness of the socket alone, a
			// poller's read in between can leave the reader waiting
			// for an edge that went to the poller.
			woke := c.f.wakes.Load() != wakes
			if !c.readerWaits() {
				// A Wait reads the socket (drive.go). Responses that
				// woke it are held for its answer.
				if !woke {
					c.flushResps()
				}
				c.rmu.Unlock()
				c.stepAside(timer)
				continue
			}
			if woke {
				// Let the woken application run before this reader's
				// own wait: its answer leaves a system call or two
				// sooner, with the acknowledgements.
				runtime.Gosched()
			}
			err = c.waitSock(woke)
			c.readerWaited()
			justFilled = err == nil
			c.rmu.Unlock()
			if err != nil {
				c.fail(err)
				return
			}
			continue
		}
		c.flushResps()
		seen := c.seen
		if w := c.wantDrive.Swap(nil); w != nil && err == nil {
			// A Wait would drive the ring: leave it to the Wait.
			c.driveOn.CompareAndSwap(driveNone, driveRecent)
			c.rmu.Unlock()
			w.poke()
			c.stepAside(timer)
			continue
		}
		c.rmu.Unlock()
		if err != nil {
			c.fail(err)
			return
		}
		if err := c.waitRx(seen, &lastPolls); err != nil {
			c.fail(readErr(c, err))
			return
		}
	}
}

// ackDelay is how long a sleeping reader holds the responses to requests
// that woke an application, for the answer it is likely to send.
const ackDelay = 50 * time.Microsecond

// waitSock waits for the socket to bring more bytes and reads them in
// (rmu held). The responses of the last drain are sent first, unless it
// woke an application (woke) that sleeps on a completion channel: that
// one probably answers within microseconds, and its request takes the
// responses along (trySendFrame), one write and one wake-up of the peer
// instead of two, as TCP delays its acknowledgements. They are held
// for ackDelay at most, as is an acknowledgement corked in the socket
// (send's cork); an application that goes back to sleep instead pushes
// them when it arms its CQ (pollersGone). The read deadline that ends
// the hold fires after a millisecond when the process idles (the
// runtime's network poller sleeps in whole milliseconds): the arm is
// what keeps a peer waiting for an acknowledgement from waiting that
// long.
func (c *conn) waitSock(woke bool) error {
	hold := woke && c.quiet != nil && (c.holdsResps() || c.corked.Load())
	if !hold {
		c.flushResps()
		err := c.sock.fillWait()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = nil // a Wait asked for the socket (drive.go)
		}
		return readErr0(c, err)
	}
	nc := c.quiet.conn()
	nc.SetReadDeadline(time.Now().Add(ackDelay))
	err := c.sock.fillWait()
	nc.SetReadDeadline(time.Time{})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = nil // nothing came: the loop drains nothing and waits again
	}
	c.flushResps()
	return readErr0(c, err)
}

// readErr0 is readErr of a non-nil error.
func readErr0(c *conn, err error) error {
	if err != nil {
		return readErr(c, err)
	}
	return nil
}

// waitRx waits until more bytes arrive in the ring (its tail moves past
// seen), spinning a little, then in a grace while pollers are active
// (until graceWatch or an arm ends it), else on the eventfd. For a
// socket it is one grace (rxLoop waits on the socket itself).
func (c *conn) waitRx(seen uint64, lastPolls *uint64) error {
	for spins := 0; ; spins++ {
		if c.dead.Load() || c.shm != nil && atomic.LoadUint64(c.shm.in.tail) != seen {
			return nil
		}
		if c.shm != nil && spins < 64 {
			continue
		}
		if c.sock != nil || c.graceDue(lastPolls) {
			if c.quiet != nil && c.rmu.TryLock() {
				// The pollers read the socket: its segments need
				// not wake anybody (quiet.go). The next fillWait
				// listens again. Under rmu: a Wait that drives
				// the socket (drive.go) listens meanwhile. A
				// poller that holds rmu now silences it when it
				// sees the grace (poll).
				err := c.quiet.silence()
				c.rmu.Unlock()
				if err != nil {
					return err
				}
			}
			c.grace.Store(true)
			c.f.graces.add(c)
			select {
			case <-c.kick: // pollers gone (graceWatch), or an arm (endGrace)
			case <-c.done:
			}
			c.f.graces.remove(c)
			c.grace.Store(false)
			*lastPolls = c.polls.Load()
			return nil // the reader sends what pollers held, looks again
		}
		// Dekker's handshake with a driver (driveShm): each side stores
		// its flag, then loads the other's (swaps: full barriers), so
		// that one of them leaves the eventfd to the other.
		c.efdSleeping.Swap(true)
		if c.driveOn.Load() != driveNone {
			c.efdSleeping.Store(false)
			return nil // rxLoop steps aside
		}
		err := c.shm.sleep(seen)
		c.efdSleeping.Store(false)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// A deadline meant for a driver's wait (never set while
			// this one waits: a safeguard): look again.
			err = nil
		}
		if err != nil {
			return err
		}
	}
}

// graceDue reports whether the reader should leave the connection to
// the pollers for a while: they polled since it last looked, spinning.
func (c *conn) graceDue(lastPolls *uint64) bool {
	if c.sock != nil && c.sock.src != nil {
		return false // pollers cannot read it
	}
	p := c.polls.Load()
	if p == *lastPolls || !c.spinning(p) {
		return false
	}
	*lastPolls = p
	return true
}

// spinning reports whether the application polls rather than sleeps: p,
// the poll count, is past the poll that follows an arm (the usual arm,
// poll again, wait).
func (c *conn) spinning(p uint64) bool { return p-c.armedAt.Load() > 2 }

// endGrace wakes the reader from its grace: the pollers stopped.
func (c *conn) endGrace() {
	c.armedAt.Store(c.polls.Load())
	c.kickReader()
}

func (c *conn) kickReader() {
	if c.grace.Load() {
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
}

// pollConns is the set of connections that polls drive.
type pollConns struct {
	list atomic.Pointer[[]*conn]
}

// set publishes the connections (service.mu held).
func (p *pollConns) set(conns map[*conn]struct{}) {
	l := make([]*conn, 0, len(conns))
	for c := range conns {
		if c.rx != nil {
			l = append(l, c)
		}
	}
	p.list.Store(&l)
}

// pollFor drives the connections for an empty CQ until one of them
// produced completions on it, which it polls into dst. The connection that
// fed the CQ last goes first: in a conversation with one peer it is the
// one the next message comes on, and the others, which would cost a
// read each, are not polled when it has one.
func (p *pollConns) pollFor(q *cq, dst []prov.Completion) (int, error) {
	l := p.list.Load()
	if l == nil {
		return 0, nil
	}
	hot := q.hot.Load()
	if hot != nil && hot.dead.Load() {
		q.hot.CompareAndSwap(hot, nil) // not to keep it from the collector
		hot = nil
	}
	if hot != nil && hot.poll() {
		if n, err := q.poll(dst); n > 0 || err != nil {
			return n, err
		}
	}
	for _, c := range *l {
		if c == hot || !c.poll() {
			continue
		}
		if n, err := q.poll(dst); n > 0 || err != nil {
			q.fedBy(c)
			return n, err
		}
	}
	return 0, nil
}

// pollersGone ends the readers' grace and sends the acknowledgements
// corked in their sockets or held (a unix socket's, ackpage.go): an
// application is about to sleep, and will send no answer to take them
// along.
func (p *pollConns) pollersGone() {
	if l := p.list.Load(); l != nil {
		for _, c := range *l {
			c.endGrace()
			c.flushResps()
		}
	}
}

// rxSource is the consumer's view of a connection's inbound bytes: the
// ring of a shared-memory connection, or the receive buffer of a socket.
// It holds at least maxFrame bytes.
type rxSource interface {
	fill() error                         // takes in what arrived, without waiting
	avail() (uint64, error)              // bytes available
	peek(off uint64, p []byte)           // copies available bytes without consuming them
	payload(off, n uint64) (a, b []byte) // available bytes in place (b: after a wrap-around), valid until skip
	skip(n uint64)                       // consumes available bytes
	room() uint64                        // the most it can hold
	more() bool                          // the last fill may have left bytes behind
}

func (l *shmLink) fill() error                         { return nil }
func (l *shmLink) avail() (uint64, error)              { return l.in.avail() }
func (l *shmLink) peek(off uint64, p []byte)           { l.in.peek(off, p) }
func (l *shmLink) payload(off, n uint64) (a, b []byte) { return l.in.pieces(off, n) }
func (l *shmLink) skip(n uint64)                       { l.in.skip(n) }
func (l *shmLink) room() uint64                        { return ringCap }
func (l *shmLink) more() bool                          { return true }

// sockRx is the receive buffer of a socket connection: bytes [r:w) of buf
// are unconsumed. It reads the socket's descriptor, or a stream that can
// only be read waiting (src: a TLS session), which only fillWait reads.
type sockRx struct {
	nc   net.Conn
	raw  syscall.RawConn
	src  io.Reader
	buf  []byte
	r, w int

	fillFn func(fd uintptr)
	fillN  int
	fillE  error
	full   bool // the last fill filled buf
	waitFn func(fd uintptr) bool
	tries  int // reads of the last fillWait: 1 if it did not wait

	place    sockPlace // the payload being placed, if any (place.go)
	placing  bool      // the last large frame was placed: reads stop at tail
	tail     int       // placeTail, or placeTailTCP over TCP
	capped   bool      // the last read stopped there
	placeFn  func(fd uintptr) bool
	placeTry func(fd uintptr)
}

// A connection's receive buffer starts at sockRxInit bytes and grows to
// sockRxSize once a read fills it or a frame needs more: a connection
// that carries little (or a peer's idle connections, as many as it
// opens) holds sockRxInit.
const (
	sockRxInit = 64 << 10
	sockRxSize = 1 << 20
)

func newSockRx(nc net.Conn, raw syscall.RawConn) *sockRx {
	x := &sockRx{nc: nc, raw: raw, buf: make([]byte, sockRxInit), tail: placeTail}
	x.fillFn = x.readFD
	x.waitFn = func(fd uintptr) bool {
		x.tries++
		x.readFD(fd)
		return x.fillE != unix.EAGAIN
	}
	x.placeFn = x.placeRead
	x.placeTry = func(fd uintptr) { x.placeRead(fd) }
	return x
}

// newStreamRx is the receive buffer of a stream read waiting.
func newStreamRx(src io.Reader) *sockRx {
	return &sockRx{src: src, buf: make([]byte, sockRxInit), tail: placeTail}
}

// grow takes the full-size buffer, the unconsumed bytes moved to its
// start.
func (x *sockRx) grow() {
	b := make([]byte, sockRxSize)
	x.w = copy(b, x.buf[x.r:x.w])
	x.r = 0
	x.buf = b
}

// readFD reads what the (non-blocking) socket holds into the free end of
// buf, once. fill runs it under raw.Control, not raw.Read: the reader
// holds the descriptor's read lock while it waits in fillWait.
func (x *sockRx) readFD(fd uintptr) {
	for {
		b := x.buf[x.w:]
		x.capped = x.placing && len(b) > x.tail
		if x.capped {
			// Large writes come: the next header, whose payload is
			// placed (place.go).
			b = b[:x.tail]
		}
		n, err := rawRead(fd, b)
		if err == unix.EINTR {
			continue
		}
		x.fillN, x.fillE = n, err
		return
	}
}

// fill takes in what the socket holds, without waiting.
func (x *sockRx) fill() error { return x.fillMode(false) }

// fillWait takes in what the socket holds, waiting until it holds some.
func (x *sockRx) fillWait() error { return x.fillMode(true) }

func (x *sockRx) fillMode(wait bool) error {
	if x.pending() {
		return x.fillPlace(wait)
	}
	if x.r == x.w {
		x.r, x.w = 0, 0
	} else if x.w == len(x.buf) && x.r > 0 {
		x.w = copy(x.buf, x.buf[x.r:x.w])
		x.r = 0
	}
	if len(x.buf) < sockRxSize && (x.full || x.w == len(x.buf)) {
		// The last read filled the buffer (the peer sends much), or
		// what is in it does not make a frame yet.
		x.grow()
	}
	if x.w == len(x.buf) {
		return nil
	}
	if x.src != nil {
		if !wait {
			return nil // only the reader's wait reads it
		}
		n, err := x.src.Read(x.buf[x.w:])
		x.w += n
		x.full = x.w == len(x.buf)
		return err
	}
	x.fillN, x.fillE = 0, nil
	var err error
	if wait {
		x.tries = 0
		err = x.raw.Read(x.waitFn)
	} else {
		err = x.raw.Control(x.fillFn)
	}
	if err != nil {
		return err
	}
	switch {
	case x.fillE == unix.EAGAIN:
	case x.fillE != nil:
		return x.fillE
	case x.fillN == 0:
		return io.EOF
	default:
		x.w += x.fillN
	}
	x.full = x.w == len(x.buf) || x.capped && x.fillN == x.tail
	return nil
}

// pending reports whether a payload is being placed: the header and body
// of its frame are at buf[r:], the rest of the payload is to come from
// the socket into its region (place.go).
func (x *sockRx) pending() bool { return x.place.m != nil }

// fillPlace is fillMode while a payload is placed (pending): the socket's
// next bytes are the payload's, read into its region (and what follows
// them, up to the tail, into buf). Once the payload is all there it
// reads nothing and does not wait: the frame waits to be handled
// (drainFrames, placeFinish). An error of the placement's own reads is
// left in place.err for placeRun.
func (x *sockRx) fillPlace(wait bool) error {
	x.full = false
	pl := &x.place
	if pl.rem == 0 || pl.err != nil {
		return nil
	}
	if !wait {
		return x.raw.Control(x.placeTry)
	}
	x.tries = 2 // a wait that may have waited (drive.go)
	return x.raw.Read(x.placeFn)
}

// mark is what a fill changes when the socket brought bytes (drive.go).
func (x *sockRx) mark() [2]int { return [2]int{x.w - x.r, x.place.rem} }

func (x *sockRx) avail() (uint64, error)    { return uint64(x.w - x.r), nil }
func (x *sockRx) peek(off uint64, p []byte) { copy(p, x.buf[x.r+int(off):]) }
func (x *sockRx) payload(off, n uint64) (a, b []byte) {
	o := x.r + int(off)
	return x.buf[o : o+int(n) : o+int(n)], nil
}
func (x *sockRx) skip(n uint64) { x.r += int(n) }
func (x *sockRx) room() uint64  { return sockRxSize } // it grows to that
func (x *sockRx) more() bool    { return x.full }

// graceWatch ends the graces of the readers whose pollers stopped: every
// pollerGrace it looks at the poll count of each connection whose reader
// is in its grace, and kicks the reader of one whose count did not move
// since the last look. One timer for the process: with a reader per
// connection and a timer each, a rank of 8 polling its 7 connections
// woke 7 readers every pollerGrace, a fifth of its processor when ranks
// outnumber the processors (each wake-up a trip through the Go
// scheduler's timers and a context switch's cold caches).
//
// The timer is made once and reset (time.AfterFunc: its function runs
// without an allocation): a watcher started anew (a goroutine, a timer
// and its channel) each time the readers' graces began after none was
// in one allocated on the data path, every time a poller lost its
// processor for a pollerGrace (a loaded host), up to two allocations a
// message in TestXprocNoAllocs.
type graceWatch struct {
	mu    sync.Mutex
	conns map[*conn]uint64 // in grace: their polls at the last look
	on    bool             // the timer runs
	t     *time.Timer      // calls tick (made at the first add)
}

// add puts c, whose reader begins its grace, under watch.
func (w *graceWatch) add(c *conn) {
	w.mu.Lock()
	if w.conns == nil {
		w.conns = make(map[*conn]uint64)
	}
	w.conns[c] = c.polls.Load()
	if !w.on {
		w.on = true
		if w.t == nil {
			w.t = time.AfterFunc(pollerGrace, w.tick)
		} else {
			w.t.Reset(pollerGrace)
		}
	}
	w.mu.Unlock()
}

// remove takes c, whose reader's grace ended, from the watch.
func (w *graceWatch) remove(c *conn) {
	w.mu.Lock()
	delete(w.conns, c)
	w.mu.Unlock()
}

// tick looks, and again a pollerGrace later while readers are left in
// their grace. Only look ends that (on false), so nobody else resets the
// timer meanwhile.
func (w *graceWatch) tick() {
	if w.look() {
		w.mu.Lock() // w.t was set under it
		w.t.Reset(pollerGrace)
		w.mu.Unlock()
	}
}

// look kicks the readers whose pollers stopped (or whose connection is
// down) since the last look, and reports whether readers are left in
// their grace; if none, the timer stops until the next add.
func (w *graceWatch) look() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for c, last := range w.conns {
		if p := c.polls.Load(); p != last && !c.dead.Load() {
			w.conns[c] = p
			continue
		}
		delete(w.conns, c)
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
	w.on = len(w.conns) > 0
	return w.on
}
