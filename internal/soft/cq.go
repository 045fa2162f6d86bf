package soft

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// cq is a completion queue: a ring of completions filled by requesters and
// responders and drained by Poll.
type cq struct {
	ctx *devContext
	ch  *compChannel

	mu sync.Mutex
	// The ring grows as completions queue up, to size entries (grow): a
	// CQ sized for every queue pair of a large world (65536 entries are
	// 3 MiB) holds a few completions most of the time.
	ring     []prov.Completion
	size     int
	head     int
	n        int
	overflow bool
	armed    uint8 // armNone, armNext or armSolicited
	users    int   // QPs using the CQ
	closed   bool

	hot atomic.Pointer[conn] // the connection that last fed the CQ (progress.go)

	// ready is n, or -1 once closed or overflowed (mu held to store):
	// an empty CQ is polled without mu.
	ready atomic.Int32
}

const (
	armNone = iota
	armNext
	armSolicited
)

var _ prov.CQ = (*cq)(nil)

// push appends completions. solicited marks them as solicited for the
// purpose of a solicited-only arm (an error completion always is).
func (c *cq) push(cs []prov.Completion, solicited bool) {
	c.mu.Lock()
	if c.closed || c.overflow {
		c.mu.Unlock()
		return
	}
	fire := false
	for i := range cs {
		if c.n == len(c.ring) {
			if len(c.ring) == c.size {
				c.overflowLocked()
				return
			}
			c.grow()
		}
		c.ring[(c.head+c.n)%len(c.ring)] = cs[i]
		c.n++
		if c.armed == armNext || (c.armed == armSolicited && (solicited || cs[i].Status != prov.StatusSuccess)) {
			fire = true
		}
	}
	c.ready.Store(int32(c.n))
	if fire {
		c.armed = armNone
		if c.ch != nil {
			c.ch.notify(c)
			c.ctx.f.wakes.Add(1)
		}
	}
	c.mu.Unlock()
}

// fedBy records c as the connection that fed the CQ last (hot): polls
// drive it first (progress.go), a Wait drives it (drive.go). A store only
// if it changes: the consumer calls it for every frame.
func (c *cq) fedBy(from *conn) {
	if c.hot.Load() != from {
		c.hot.Store(from)
	}
}

// cqRingMin is the length of a completion ring when it is first made.
const cqRingMin = 64

// grow doubles the ring, up to size entries, keeping the completions in
// order. Called with c.mu held.
func (c *cq) grow() {
	ring := make([]prov.Completion, min(c.size, max(cqRingMin, 2*len(c.ring))))
	k := copy(ring[:c.n], c.ring[c.head:])
	copy(ring[k:c.n], c.ring)
	c.ring, c.head = ring, 0
}

// push1 appends one completion.
func (c *cq) push1(comp *prov.Completion, solicited bool) {
	c.push(unsafeSlice1(comp), solicited)
}

func unsafeSlice1(c *prov.Completion) []prov.Completion {
	return unsafe.Slice(c, 1)
}

// overflowLocked moves the CQ to the error state; called with c.mu held,
// returns with it released.
func (c *cq) overflowLocked() {
	c.overflow = true
	c.ready.Store(-1)
	// An armed CQ's sleeper learns of it (an error wakes even a
	// solicited-only arm): a batch whose first completion was queued
	// while the CQ was armed, and a later one overflowed, left the arm
	// cleared without an event, and the sleeper slept on.
	if c.armed != armNone && c.ch != nil {
		c.ch.notify(c)
		c.ctx.f.wakes.Add(1)
	}
	c.armed = armNone
	c.mu.Unlock()
	c.ctx.events.Push(prov.AsyncEvent{Type: evCQErr, Element: prov.CQ(c)})
}

// Poll fills dst with up to len(dst) completions. After an overflow it
// fails with an error wrapping EOVERFLOW.
func (c *cq) Poll(dst []prov.Completion) (int, error) {
	n, err := c.poll(dst)
	if n == 0 && err == nil {
		// Empty: handle what waits on the connections (progress.go).
		if s := c.ctx.f.svc.Load(); s != nil {
			n, err = s.pc.pollFor(c, dst)
		}
	}
	return n, err
}

func (c *cq) poll(dst []prov.Completion) (int, error) {
	if c.ready.Load() == 0 {
		return 0, nil
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, errPollClosed
	}
	if c.overflow {
		c.mu.Unlock()
		return 0, errCQOverflow
	}
	n := min(len(dst), c.n)
	if n > 0 {
		k := copy(dst[:n], c.ring[c.head:])
		if k < n {
			copy(dst[k:n], c.ring)
		}
		c.head = (c.head + n) % len(c.ring)
		c.n -= n
		c.ready.Store(int32(c.n))
	}
	c.mu.Unlock()
	return n, nil
}

// PollBusy polls until it finds completions (or fails) or spins polls
// found the CQ empty, yielding the processor between polls so that the
// goroutines that complete requests run.
func (c *cq) PollBusy(dst []prov.Completion, spins int) (int, error) {
	for i := 1; ; i++ {
		n, err := c.Poll(dst)
		if n > 0 || err != nil || len(dst) == 0 || i >= spins {
			return n, err
		}
		runtime.Gosched()
	}
}

// Arm requests one event on the CQ's channel for the next completion (any,
// or with solicitedOnly a solicited or error completion).
func (c *cq) Arm(solicitedOnly bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return closedErr("arm cq")
	}
	if c.ch == nil {
		return errnof(einval, "arm cq: the CQ has no completion channel")
	}
	if s := c.ctx.f.svc.Load(); s != nil {
		s.pc.pollersGone() // the application is about to sleep
	}
	c.ch.armed.Store(c)
	if solicitedOnly {
		if c.armed != armNext {
			c.armed = armSolicited
		}
	} else {
		c.armed = armNext
	}
	return nil
}

func (c *cq) Cap() int { return c.size }

// Close destroys the CQ; it fails with EBUSY while QPs use it.
func (c *cq) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	if c.users > 0 {
		err := busyErr("destroy cq", c.users, "queue pairs")
		c.mu.Unlock()
		return err
	}
	c.closed = true
	c.ready.Store(-1)
	c.mu.Unlock()
	if c.ch != nil {
		c.ch.armed.CompareAndSwap(c, nil)
		c.ch.detach(c)
	}
	c.ctx.release(&c.ctx.ncq)
	return nil
}

func (c *cq) use() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return closedErr("create qp: completion queue")
	}
	c.users++
	return nil
}

func (c *cq) unuse() {
	c.mu.Lock()
	c.users--
	c.mu.Unlock()
}

// compChannel delivers CQ events to Wait. Events are queued in order; Wait
// blocks on Go channels only.
type compChannel struct {
	ctx *devContext

	mu     sync.Mutex
	queue  []*cq
	ncq    int
	closed bool
	sig    chan struct{} // token: events may be queued
	done   chan struct{} // closed by Close

	queued  atomic.Int32         // len(queue), for a driver's drain (drive.go)
	armed   atomic.Pointer[cq]   // the CQ armed last (drive.go)
	drv     atomic.Pointer[conn] // the connection a Wait drives
	inDrain atomic.Bool          // the driver handles frames: notify need not interrupt it
	woken   atomic.Bool          // Wake: the next Wait returns ErrWoken
}

var _ prov.CompChannel = (*compChannel)(nil)

func (ch *compChannel) attach() error {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed {
		return closedErr("create cq: completion channel")
	}
	ch.ncq++
	return nil
}

// detach forgets c (its pending events are dropped).
func (ch *compChannel) detach(c *cq) {
	ch.mu.Lock()
	ch.ncq--
	if c != nil {
		q := ch.queue[:0]
		for _, x := range ch.queue {
			if x != c {
				q = append(q, x)
			}
		}
		clear(ch.queue[len(q):])
		ch.queue = q
		ch.queued.Store(int32(len(q)))
	}
	ch.mu.Unlock()
}

// notify queues one event for c. Called with c.mu held.
func (ch *compChannel) notify(c *cq) {
	ch.mu.Lock()
	if !ch.closed {
		ch.queue = append(ch.queue, c)
		ch.queued.Store(int32(len(ch.queue)))
	}
	ch.mu.Unlock()
	ch.poke()
	if d := ch.drv.Load(); d != nil && !ch.inDrain.Load() {
		d.interrupt(ch) // a drive of another connection waits
	}
}

// Wake makes a Wait in progress, or the next one, return prov.ErrWoken,
// ending a drive it is in (drive.go).
func (ch *compChannel) Wake() {
	ch.woken.Store(true)
	ch.poke()
	if d := ch.drv.Load(); d != nil {
		d.interrupt(ch)
	}
}

// Wait returns the CQ of the next event, blocking until there is one or
// ctx ends. The event is acknowledged. While it waits it may handle the
// connection that feeds the CQ armed last itself (drive.go).
func (ch *compChannel) Wait(ctx context.Context) (prov.CQ, error) {
	var asked *conn // the connection whose reader this Wait asked for its ring or socket
	q, err := ch.wait(ctx, &asked)
	if asked != nil {
		// Not wanted any more: the reader would step aside for nobody
		// (rxLoop, readerWaits), and its ring or socket wait until the
		// next Wait or poll.
		if asked.shm != nil {
			asked.wantDrive.CompareAndSwap(ch, nil)
		} else {
			asked.unwant(ch)
		}
	}
	return q, err
}

func (ch *compChannel) wait(ctx context.Context, asked **conn) (prov.CQ, error) {
	drive := true
	for {
		ch.mu.Lock()
		if ch.closed {
			ch.mu.Unlock()
			return nil, closedErr("wait for completion event")
		}
		if len(ch.queue) > 0 {
			c := ch.popLocked()
			ch.mu.Unlock()
			return c, nil
		}
		ch.mu.Unlock()
		if ch.woken.Swap(false) {
			return nil, prov.ErrWoken // not wrapped: allocates nothing
		}
		if drive {
			drive = false
			if c := ch.driveConn(); c != nil {
				drive := ch.drive
				if c.shm != nil {
					drive = ch.driveShm
				}
				if q := drive(ctx, c); q != nil {
					return q, nil
				}
				if c.shm == nil || c.wantDrive.Load() == ch {
					*asked = c // (a socket's drive may have asked: askSocket)
				}
				continue
			}
		}
		select {
		case <-ch.sig:
			drive = true // a poke: the socket may be free
		case <-ch.done:
		case <-ctx.Done():
			return nil, fmt.Errorf("soft: wait for completion event: %w", ctx.Err())
		}
	}
}

// popLocked takes the first event queued (ch.mu held, the queue not
// empty); the token goes on if more wait.
func (ch *compChannel) popLocked() *cq {
	c := ch.queue[0]
	copy(ch.queue, ch.queue[1:])
	ch.queue[len(ch.queue)-1] = nil
	ch.queue = ch.queue[:len(ch.queue)-1]
	ch.queued.Store(int32(len(ch.queue)))
	if len(ch.queue) > 0 {
		ch.poke()
	}
	return c
}

// Close destroys the channel; it fails with EBUSY while CQs use it.
func (ch *compChannel) Close() error {
	ch.mu.Lock()
	if ch.closed {
		ch.mu.Unlock()
		return nil
	}
	if ch.ncq > 0 {
		err := busyErr("destroy completion channel", ch.ncq, "completion queues")
		ch.mu.Unlock()
		return err
	}
	ch.closed = true
	ch.queue = nil
	ch.queued.Store(0)
	close(ch.done)
	ch.mu.Unlock()
	if d := ch.drv.Load(); d != nil {
		d.interrupt(ch) // a drive without a deadline (drive.go)
	}
	ch.ctx.release(&ch.ctx.nch)
	return nil
}
