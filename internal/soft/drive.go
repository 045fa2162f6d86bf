package soft

import (
	"context"
	"errors"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// A waiter that reads the socket itself.
//
// An application that sleeps in its completion channel is woken, message
// after message, by the connection's reader: the runtime's poller wakes
// the reader, which handles the frame and wakes the application. Two
// goroutines run per message, and handing the processor from one to the
// other readies a thread more often than not (a futex call and a context
// switch on another CPU, for nothing: the application runs on the
// reader's processor). A raw socket ping-pong wakes one goroutine per
// message.
//
// So a Wait on a completion channel reads the socket itself (drive): the
// connection that fed the CQ armed last (cq.hot) is handled by the waiter,
// which sleeps in the runtime's poller as the reader would, handles what
// arrives (requests answered, responses completing requests) and returns
// as soon as an event is queued on its channel. The reader stays aside
// meanwhile (stepAside): it sleeps on a timer and takes the socket back
// when no Wait drove it for a whole pollerGrace, so requests of the peer
// are handled within that bound while the application computes between
// waits (as with pollers, progress.go).
//
// The socket belongs to whoever holds rmu. A waiter that finds the reader
// waiting on the socket asks it to step aside (want), ending its wait with
// a read deadline in the past, and waits in the channel as before; the
// reader pokes the channel when it has stepped aside, and the waiter takes
// the socket. An event queued on the channel by another connection ends
// the driver's wait the same way (interrupt). A drive whose ctx can end
// lasts driveMax at most, so a cancelled ctx or a closed channel is seen
// within that bound; the reader then takes the socket back at once. A
// drive whose ctx cannot end (context.Background) waits without a
// deadline, and closing the channel interrupts it: setting a deadline
// before each wait and clearing it after was a tenth of the processor
// time of a sleeping round trip over a unix socket
// (BenchmarkXprocSendRTT/wait=sleep/unix: 0.6 of 5.5 s, in the runtime's
// timers).
//
// Responses the driver's handling produces are held when the channel got
// its event (the application's answer takes them along, as the reader
// holds them in waitSock); the next drive sends them first, and the reader
// within a grace if the application neither answers nor waits again.
//
// Only sockets of the connection's own (quietSock, not TLS) are driven,
// and shared-memory rings (driveShm).

// driveMax bounds one drive whose ctx can end: a cancelled ctx or a
// closed channel ends the Wait within it.
var driveMax = time.Millisecond

// aLongTimeAgo is a read deadline that ends a wait at once.
var aLongTimeAgo = time.Unix(1, 0)

const (
	driveNone   = iota // the reader reads the socket
	driveNow           // a waiter drives it
	driveRecent        // a waiter drove it and will again: the reader stays aside
)

// driveState is the part of a connection about its driver.
type driveState struct {
	driveOn atomic.Int32  // driveNone, driveNow or driveRecent
	drives  atomic.Uint64 // drives begun

	dlMu     sync.Mutex   // the following, and read deadlines set by others
	sockWait bool         // the reader waits on the socket
	want     *compChannel // a waiter wants the socket
	dlPast   bool         // a wait on the socket was ended by a past deadline
	driver   *compChannel // whose Wait drives the socket

	drvSlept bool          // the last drive waited for its bytes (rmu)
	drvEnd   time.Time     // when the last drive of a ring ended (rmu)
	drvGap   time.Duration // the time between the last two drives of a ring (rmu)
	looked   atomic.Uint64 // drives that found their bytes without listening
}

// drivable reports whether a Wait can read c's socket, or consume its
// shared-memory ring, itself.
func (c *conn) drivable() bool {
	if c.shm != nil {
		return !c.dead.Load()
	}
	return c.quiet != nil && c.sock != nil && c.sock.src == nil && !c.dead.Load()
}

// driveConn is the connection a Wait on ch drives, or nil: only in a
// process that talks to one peer process (one connection, or the two
// ends of a connection to itself). With several peers, the event a Wait
// waits for may come from any of them, and a reader that stepped aside
// for a drive would leave it unread while the wait drives another
// connection (a dissemination barrier of 4 ranks over unix sockets,
// every wait sleeping, took 2.5 ms instead of 0.2 ms that way).
func (ch *compChannel) driveConn() *conn {
	q := ch.armed.Load()
	if q == nil {
		return nil
	}
	c := q.hot.Load()
	if c == nil || !c.drivable() {
		return nil
	}
	l := c.s.pc.list.Load()
	if l == nil || len(*l) > 2 {
		return nil
	}
	for _, o := range *l {
		if o.peerFab != c.peerFab {
			return nil
		}
	}
	return c
}

// drive reads c's socket until an event is queued on ch, the drive's time
// is up, or ctx ends. It returns the event's CQ, or nil.
func (ch *compChannel) drive(ctx context.Context, c *conn) prov.CQ {
	if !c.rmu.TryLock() {
		c.askSocket(ch)
		return nil
	}
	return ch.driveLocked(ctx, c)
}

// driveLocked is drive with c.rmu held; it releases it.
func (ch *compChannel) driveLocked(ctx context.Context, c *conn) prov.CQ {
	if c.dead.Load() || !ch.drv.CompareAndSwap(nil, c) {
		c.rmu.Unlock()
		return nil
	}
	c.dlMu.Lock()
	c.driver = ch
	c.dlMu.Unlock()
	c.drives.Add(1)
	c.driveOn.Store(driveNow)
	// The application sleeps: nothing it holds rides with an answer.
	c.flushResps()
	nc := c.quiet.conn()
	var ev prov.CQ
	var err error
	var end time.Time // the deadline of the waits, once one waits
	look := !c.drvSlept
	// Frames the last consumer read in but left (the reader hands the
	// socket over between its read and its drain when a Wait takes rmu
	// first) are handled before any wait: waiting on the socket with
	// them in the buffer left a request unanswered until its sender's
	// retries ran out (RETRY_EXC_ERR, and a peer waiting for a message
	// that never came; a loaded machine, one ping-pong in thousands).
	buffered := c.sock.w != c.sock.r || c.sock.pending()
	dl := false // the socket's read deadline is end
	// A Close of the channel after wait's check and before the drive
	// set itself as the driver interrupted nobody: seen here, or by the
	// check after the deadline (without one, the drive waited on a
	// silent socket for ever).
	for ctx.Err() == nil && !c.dead.Load() && !ch.woken.Load() && !ch.isClosed() {
		if ev = ch.takeEvent(); ev != nil {
			break
		}
		if buffered {
			buffered = false
			goto drain
		}
		if look {
			// The last drive found its bytes waiting: look without
			// listening (a socket that listens wakes the runtime's
			// poller with every segment, for nobody, while the
			// application is ahead of its peer; quiet.go).
			look = false
			a := c.sock.mark()
			if err = c.sock.fill(); err != nil {
				break
			}
			if c.sock.mark() != a {
				c.looked.Add(1)
				if err = c.quiet.silence(); err != nil {
					break
				}
				c.drvSlept = false
				goto drain
			}
		}
		c.drvSlept = true
		if !dl && ctx.Done() != nil {
			if end.IsZero() {
				end = driveDeadline(ctx)
			}
			dl = true
			nc.SetReadDeadline(end)
			// After the deadline: an event queued (or a Wake) from
			// now on ends the wait (interrupt), one queued before is
			// taken here.
			if ev = ch.takeEvent(); ev != nil || ch.woken.Load() || ch.isClosed() {
				break
			}
		}
		err = c.sock.fillWait()
		if err == nil && c.sock.tries == 1 {
			// Its bytes were there at the first read: it did not
			// wait, and the next drive looks first. Left set, every
			// later drive listened (no look ever cleared it) and
			// every segment of the peer woke the runtime's poller:
			// the sleeping round trip over a unix socket took 5.9-7.1
			// µs, 5.8-5.9 without (BenchmarkXprocSendRTT/wait=sleep).
			c.drvSlept = false
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = nil
			if !dl {
				// Interrupted, without a deadline of the drive's
				// own: the past one stays until the drive ends.
				ev = ch.takeEvent()
				break
			}
			if time.Now().Before(end) {
				dl = false // interrupted: look again
				continue
			}
			break
		}
		if err != nil {
			break
		}
	drain:
		ch.inDrain.Store(true)
		_, err = c.drain(true)
		ch.inDrain.Store(false)
		if err != nil {
			break
		}
		if ev = ch.takeEvent(); ev != nil {
			break // its responses are held for the answer
		}
		c.flushResps()
	}
	c.dlMu.Lock()
	c.driver = nil
	if dl || c.dlPast {
		c.dlPast = false
		nc.SetReadDeadline(time.Time{})
	}
	c.dlMu.Unlock()
	ch.drv.Store(nil)
	if ev != nil { // taken only while err is nil
		c.driveOn.Store(driveRecent)
		c.rmu.Unlock()
		return ev
	}
	c.flushResps()
	c.driveOn.Store(driveNone)
	c.rmu.Unlock()
	// The reader takes the socket back now.
	select {
	case c.kick <- struct{}{}:
	default:
	}
	if err != nil {
		c.fail(readErr(c, err))
	}
	return nil
}

// driveShm is drive for a shared-memory connection: the waiter consumes
// the ring as the reader would (drain), until an event is queued on ch
// (a drain returns as soon as one is: rxStop), ctx ends, or the
// connection fails; an empty ring it waits for on the eventfd, as the
// reader does (spinning a little first, as waitRx). The reader steps
// aside meanwhile (rxLoop), and takes the ring back when no Wait drove
// it for a pollerGrace. Measured, with a poster that sleeps in its
// channel between batches of 1 MiB RDMA writes (the copies of direct
// writes are made by whoever drains the ring): each completion the
// reader made woke the sleeping poster, a futex wake of an idle
// processor that stalled the copies for 15 µs (README).
//
// The eventfd has one sleeper at most: the driver wakes a reader that
// sleeps on it (efdSleeping), which then steps aside, and sleeps there
// only once it has left (their flags, driveOn and efdSleeping, are a
// Dekker handshake); a reader that does not leave within a thousand
// yields keeps the ring. A wait on the eventfd ends with a signal of the
// peer, with an event of another connection (notify: interrupt), with
// Close of the channel, with the connection's failure (failAfterDrain
// ends it before it takes rmu), or after driveMax if ctx can end.
func (ch *compChannel) driveShm(ctx context.Context, c *conn) prov.CQ {
	if !c.rmu.TryLock() {
		// Its consumer is at work, and notifies ch. If it is the
		// reader, it leaves the ring to this Wait after the frame it
		// handles, and pokes ch (rxLoop).
		c.wantDrive.Store(ch)
		return nil
	}
	if c.dead.Load() || c.failing.Load() || !ch.drv.CompareAndSwap(nil, c) {
		c.rmu.Unlock()
		return nil
	}
	c.drives.Add(1)
	c.driveOn.Swap(driveNow) // before the load of efdSleeping (a full barrier)
	c.rxStop = ch
	start := time.Now()
	if c.drvEnd != (time.Time{}) {
		c.drvGap = start.Sub(c.drvEnd)
	}
	var ev prov.CQ
	var err error
	var end time.Time // the deadline of the waits, once one waits
	for ctx.Err() == nil && !c.dead.Load() && !c.failing.Load() && !ch.isClosed() && !ch.woken.Load() {
		if ev = ch.takeEvent(); ev != nil {
			break
		}
		ch.inDrain.Store(true)
		_, err = c.drain(false)
		ch.inDrain.Store(false)
		if err != nil {
			break
		}
		if ev = ch.takeEvent(); ev != nil {
			break // its responses leave now: a ring write costs no system call
		}
		c.flushResps()
		seen := c.seen
		spins := 0
		for spins < 64 && atomic.LoadUint64(c.shm.in.tail) == seen {
			spins++
		}
		if spins < 64 {
			continue
		}
		if c.efdSleeping.Load() {
			// The reader sleeps on the eventfd: wake it, and it
			// steps aside (rxLoop); give it a little time, else
			// leave the ring to it.
			c.shm.wakeReader()
			for i := 0; i < 1000 && c.efdSleeping.Load(); i++ {
				runtime.Gosched()
			}
			if c.efdSleeping.Load() {
				break
			}
			continue // look again before sleeping
		}
		if ctx.Done() != nil {
			if end.IsZero() {
				end = driveDeadline(ctx)
			}
			if !time.Now().Before(end) {
				break
			}
		}
		c.dlMu.Lock()
		if c.failing.Load() {
			c.dlMu.Unlock()
			break
		}
		c.driver = ch
		if !end.IsZero() {
			c.setWaitDeadline(end)
		}
		c.dlMu.Unlock()
		// An event queued (or a Wake, or the channel's Close) before
		// the driver was set did not interrupt.
		if ev = ch.takeEvent(); ev == nil && !ch.woken.Load() && !ch.isClosed() {
			err = c.shm.sleep(seen)
		}
		c.dlMu.Lock()
		c.driver = nil
		if !end.IsZero() || c.dlPast {
			c.dlPast = false
			c.setWaitDeadline(time.Time{})
		}
		c.dlMu.Unlock()
		if ev != nil {
			break
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = nil
			if end.IsZero() {
				// Interrupted (an event of another connection,
				// the channel closed, the connection failing):
				// the Wait looks at the channel.
				ev = ch.takeEvent()
				break
			}
			continue // interrupted, or the drive's time is up: look again
		}
		if err != nil {
			break
		}
	}
	c.rxStop = nil
	c.flushResps()
	ch.drv.Store(nil)
	c.drvEnd = time.Now()
	if ev != nil && err == nil && c.drvGap < shmAsideMax {
		c.driveOn.Store(driveRecent)
		c.rmu.Unlock()
		return ev
	}
	c.driveOn.Store(driveNone)
	c.rmu.Unlock()
	// The reader takes the ring back now.
	select {
	case c.kick <- struct{}{}:
	default:
	}
	if err != nil && !c.dead.Load() {
		c.fail(readErr(c, err))
	}
	return ev // taken only while err is nil
}

// askSocket asks the reader, which holds the socket, to step aside for
// ch's next drive, ending its wait on the socket.
func (c *conn) askSocket(ch *compChannel) {
	c.dlMu.Lock()
	c.want = ch
	c.endReaderWaitLocked()
	c.dlMu.Unlock()
}

// unwant takes back ch's askSocket, if the reader has not stepped aside
// for it yet: a Wait that ends does not want the socket any more.
func (c *conn) unwant(ch *compChannel) {
	c.dlMu.Lock()
	if c.want == ch {
		c.want = nil
	}
	c.dlMu.Unlock()
}

// askReaderAside ends the reader's wait on the socket, if it waits: it
// then sees the polls and leaves the socket to them (progress.go).
func (c *conn) askReaderAside() {
	if c.quiet == nil {
		return
	}
	c.dlMu.Lock()
	c.endReaderWaitLocked()
	c.dlMu.Unlock()
}

// endReaderWaitLocked ends the reader's wait on the socket, if it waits
// and it was not ended already (dlMu held).
func (c *conn) endReaderWaitLocked() {
	if c.sockWait && !c.dlPast {
		c.endWaitLocked()
	}
}

// endWaitLocked ends the wait on the socket in progress, the reader's or a
// drive's, with a read deadline in the past (dlMu held; whoever waits
// resets it under dlMu when its wait is over).
func (c *conn) endWaitLocked() {
	c.dlPast = true
	c.setWaitDeadline(aLongTimeAgo)
}

// setWaitDeadline sets the read deadline of what a drive waits on: the
// socket, or the eventfd of a shared-memory connection (dlMu held).
func (c *conn) setWaitDeadline(t time.Time) {
	if c.shm != nil {
		c.shm.efdIn.SetReadDeadline(t)
		return
	}
	c.quiet.conn().SetReadDeadline(t)
}

// interrupt ends the wait of ch's drive of c: an event is queued on ch.
func (c *conn) interrupt(ch *compChannel) {
	c.dlMu.Lock()
	if c.driver == ch {
		c.endWaitLocked()
	}
	c.dlMu.Unlock()
}

// readerWaits is called by the reader before it waits on the socket (rmu
// held). It reports false if a waiter drives the socket or wants it: the
// reader steps aside instead (the channel that asked is poked).
func (c *conn) readerWaits() bool {
	if c.quiet == nil {
		return true
	}
	c.dlMu.Lock()
	if ch := c.want; ch != nil || c.driveOn.Load() != driveNone {
		c.want = nil
		c.dlMu.Unlock()
		if ch != nil {
			c.driveOn.CompareAndSwap(driveNone, driveRecent)
			ch.poke()
		}
		return false
	}
	c.sockWait = true
	c.dlMu.Unlock()
	return true
}

// readerWaited is called by the reader after its wait on the socket.
func (c *conn) readerWaited() {
	if c.quiet == nil {
		return
	}
	c.dlMu.Lock()
	c.sockWait = false
	if c.dlPast {
		c.dlPast = false
		c.quiet.conn().SetReadDeadline(time.Time{})
	}
	c.dlMu.Unlock()
}

// stepAside is the reader's sleep while waiters drive the socket: it
// returns when the last driver gave the socket back, or no Wait drove it
// for a whole pollerGrace. Responses held that long are sent.
func (c *conn) stepAside(timer *time.Timer) {
	seen := c.drives.Load() - 1 // the first grace is the driver's
	for !c.dead.Load() {
		c.graceSleep(timer)
		switch c.driveOn.Load() {
		case driveNone:
			return
		case driveNow:
			continue
		}
		if d := c.drives.Load(); d != seen {
			seen = d
			if c.held.Load() && c.rmu.TryLock() {
				c.flushResps()
				c.rmu.Unlock()
			}
			continue
		}
		if c.driveOn.CompareAndSwap(driveRecent, driveNone) {
			return
		}
	}
}

// graceSleep sleeps for pollerGrace on timer, or until the reader is
// kicked (it reports that) or the connection is down.
func (c *conn) graceSleep(timer *time.Timer) (kicked bool) {
	timer.Reset(pollerGrace)
	select {
	case <-timer.C:
	case <-c.kick:
		kicked = true
		timer.Stop()
	case <-c.done:
		timer.Stop()
	}
	return kicked
}

// shmAsideMax bounds the time an application spent between its last two
// drives of a shared-memory ring (drvGap) for the reader to stay aside
// after a drive (driveRecent): an application that works longer between
// its waits has the reader consume the ring meanwhile, as before drives
// (a 16 MiB allreduce of two ranks, which reduce between waits while
// their readers take in the next chunks, lost 8-10 % of its bandwidth
// with the reader always aside).
const shmAsideMax = 50 * time.Microsecond

// driveDeadline is the end of a drive whose ctx can end: driveMax from
// now, or ctx's deadline if sooner.
func driveDeadline(ctx context.Context) time.Time {
	end := time.Now().Add(driveMax)
	if d, ok := ctx.Deadline(); ok && d.Before(end) {
		end = d
	}
	return end
}

// isClosed reports whether ch was closed.
func (ch *compChannel) isClosed() bool {
	select {
	case <-ch.done:
		return true
	default:
		return false
	}
}

// takeEvent takes the next event queued on ch, or returns nil.
func (ch *compChannel) takeEvent() prov.CQ {
	ch.mu.Lock()
	if ch.closed || len(ch.queue) == 0 {
		ch.mu.Unlock()
		return nil
	}
	c := ch.popLocked()
	ch.mu.Unlock()
	return c
}

// poke wakes a Wait on ch to look again.
func (ch *compChannel) poke() {
	select {
	case ch.sig <- struct{}{}:
	default:
	}
}
