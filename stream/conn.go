package stream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs/session"
)

const (
	// netName is the Net of the errors and addresses' network.
	netName = "goverbs"
	// inFlight is how many messages a Conn's writes keep posted before
	// they wait for the oldest one's delivery, at most (see depthOf).
	inFlight = 16
	// finImm is the immediate data of the empty message that ends a
	// direction of the stream (CloseWrite).
	finImm = 1
)

// ErrProtocol is wrapped by the error of a Read that met a message the
// stream did not send (immediate data other than the end's, or the
// notice of a WriteImm): the session's messages belong to the stream.
var ErrProtocol = errors.New("stream: a message that is not the stream's")

// errWriteClosed is the error of a Write after CloseWrite.
var errWriteClosed = errors.New("stream: write after CloseWrite")

// Conn is a net.Conn over a session. See the package documentation.
type Conn struct {
	s             *session.Session
	chunk         int
	local, remote net.Addr

	rmu  sync.Mutex
	cur  session.Message // the message being read (held)
	off  int             // bytes of cur read
	held bool
	eof  bool
	rerr error // the stream cannot be read further

	wmu   sync.Mutex
	ring  [inFlight]posted
	depth int // messages kept posted at most (depthOf)
	head  int // oldest posted message in ring
	n     int // messages posted and not yet waited for
	werr  error
	wshut bool // CloseWrite

	rd, wd deadline
	closed atomic.Bool
	// mem is held for reading while a Read or Write copies to or from
	// the session's memory (its ring, the allocator's arenas), and by
	// Close while it closes the session, which unmaps that memory.
	mem sync.RWMutex
}

// posted is a message a Write posted: its Pending and the registered
// copy of its bytes, freed once it is delivered.
type posted struct {
	p   session.Pending
	buf session.LocalMR
}

// New makes a Conn of s, which it owns from then on: the Conn's Close
// closes s, and s's messages are the stream's (its remote memory
// operations remain the caller's to use).
//
// Each message the Conn keeps in flight holds one of the session's
// request tokens (Session.QueueDepth) until the Conn waits for it: it
// keeps half of them at most (16 at most, one at least), so that the
// session's remote memory operations find some too.
func New(s *session.Session) *Conn {
	return &Conn{s: s, chunk: max(min(s.PeerMessageSize(), s.PeerMaxMessage()), 1), depth: depthOf(s.QueueDepth()), local: s.LocalAddr(), remote: s.RemoteAddr()}
}

// depthOf is how many messages a Conn keeps in flight on a session of
// QueueDepth queueDepth: half of them at most, inFlight at most, one at
// least.
func depthOf(queueDepth int) int {
	return max(min(queueDepth/2, inFlight), 1)
}

// Dial connects to a Listener at addr (host:port of its bootstrap) and
// returns the stream; cfg configures the session under it.
func Dial(ctx context.Context, addr string, cfg session.Config) (*Conn, error) {
	s, err := session.Dial(ctx, addr, cfg)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: netName, Err: err}
	}
	return New(s), nil
}

// isClosed reports whether the Conn is closed, or a zero Conn (as good as
// closed).
func (c *Conn) isClosed() bool { return c.s == nil || c.closed.Load() }

// Session returns the session under the stream, for its remote memory
// operations.
func (c *Conn) Session() *session.Session { return c.s }

// LocalAddr returns the session's local bootstrap address.
func (c *Conn) LocalAddr() net.Addr { return c.local }

// RemoteAddr returns the peer's bootstrap address.
func (c *Conn) RemoteAddr() net.Addr { return c.remote }

// SetDeadline sets the read and write deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	if c.isClosed() {
		return c.opErr("set deadline", net.ErrClosed)
	}
	c.rd.set(t)
	c.wd.set(t)
	return nil
}

// SetReadDeadline sets the deadline of Reads, pending ones included.
func (c *Conn) SetReadDeadline(t time.Time) error {
	if c.isClosed() {
		return c.opErr("set deadline", net.ErrClosed)
	}
	c.rd.set(t)
	return nil
}

// SetWriteDeadline sets the deadline of Writes, pending ones included.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	if c.isClosed() {
		return c.opErr("set deadline", net.ErrClosed)
	}
	c.wd.set(t)
	return nil
}

// Read reads the next bytes of the stream into p: at most the rest of
// one message. It returns io.EOF once the peer closed the stream or its
// direction (CloseWrite) and every byte before was read.
func (c *Conn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if c.isClosed() {
		return 0, c.opErr("read", net.ErrClosed)
	}
	if len(p) == 0 {
		return 0, nil
	}
	// Past the deadline a Read fails even with bytes at hand (the rest
	// of a message partly read), as a socket's does: it is how a
	// program stops its reader.
	ctx := c.rd.context()
	if ctx.Err() != nil {
		return 0, c.expired("read")
	}
	for !c.held {
		if c.eof {
			return 0, io.EOF
		}
		if c.rerr != nil {
			return 0, c.rerr
		}
		if ctx.Err() != nil {
			return 0, c.expired("read")
		}
		m, err := c.s.Receive(ctx)
		if err != nil {
			return 0, c.readErr(ctx, err)
		}
		imm, hasImm := m.Imm()
		n, isWrite := m.Len(), m.IsWrite()
		switch {
		case hasImm || isWrite:
			m.Release()
			if hasImm && imm == finImm && n == 0 && !isWrite {
				c.eof = true
				continue
			}
			c.rerr = c.opErr("read", fmt.Errorf("%w (immediate data %d, %d bytes, write notice %v)", ErrProtocol, imm, n, isWrite))
		case n == 0:
			m.Release()
		default:
			c.cur, c.off, c.held = m, 0, true
		}
	}
	if !c.lockMem() {
		return 0, c.opErr("read", net.ErrClosed)
	}
	b := c.cur.Bytes()
	n := copy(p, b[c.off:])
	c.mem.RUnlock()
	c.off += n
	if c.off == len(b) {
		c.cur.Release()
		c.cur, c.held = session.Message{}, false
	}
	return n, nil
}

// lockMem takes mem for reading, unless the Conn is closed.
func (c *Conn) lockMem() bool {
	c.mem.RLock()
	if c.isClosed() {
		c.mem.RUnlock()
		return false
	}
	return true
}

// readErr is the error of a Read whose Receive (with ctx) failed with
// err. A deadline that passed is a timeout even if the session has ended
// meanwhile: the peer's last messages may still be on their way (it
// wrote, then closed), and the next Read takes them before io.EOF
// (before, such a Read set eof and lost them:
// TestDeadlineRacesPeerClose).
func (c *Conn) readErr(ctx context.Context, err error) error {
	if c.isClosed() {
		return c.opErr("read", net.ErrClosed)
	}
	if ctx.Err() != nil {
		return c.expired("read")
	}
	if e := c.s.Err(); e != nil {
		if errors.Is(e, session.ErrPeerClosed) {
			c.eof = true
			return io.EOF
		}
		c.rerr = c.opErr("read", e)
		return c.rerr
	}
	c.rerr = c.opErr("read", err)
	return c.rerr
}

// Write writes p to the stream: it returns once its bytes are posted
// (copied into registered memory the library holds until the peer's
// device has them). With the write deadline past, it returns how many
// bytes it posted and a timeout; those are in the stream, the rest is
// not.
func (c *Conn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.writable(); err != nil {
		return 0, err
	}
	ctx := c.wd.context()
	if len(p) == 0 && ctx.Err() != nil {
		return 0, c.writeErr(ctx, ctx.Err())
	}
	n := 0
	for n < len(p) {
		if ctx.Err() != nil {
			return n, c.writeErr(ctx, ctx.Err())
		}
		k := min(len(p)-n, c.chunk)
		err := c.post(ctx, p[n:n+k], 0, false)
		if err != nil && errors.Is(err, session.ErrLimit) && k > 1 && c.s.Err() == nil {
			// Nothing of the message was posted: the session's
			// allocator had no room for it, which post could not
			// make by waiting for the messages in flight (the
			// peer's MaxMessage is in chunk from the start).
			// Smaller messages from now on.
			c.chunk = k / 2
			continue
		}
		if err != nil {
			return n, c.writeErr(ctx, err)
		}
		n += k
	}
	return n, nil
}

// writable reports why this side cannot write, if it cannot (wmu held).
func (c *Conn) writable() error {
	switch {
	case c.isClosed():
		return c.opErr("write", net.ErrClosed)
	case c.wshut:
		return c.opErr("write", errWriteClosed)
	}
	return c.werr
}

// post copies b into memory of the session's allocator and posts it as
// one message, after waiting for the oldest message in flight if depth
// are (wmu held).
func (c *Conn) post(ctx context.Context, b []byte, imm uint32, hasImm bool) error {
	if c.n == c.depth {
		if err := c.reap(); err != nil {
			return err
		}
	}
	var buf session.LocalMR
	for {
		if !c.lockMem() {
			return net.ErrClosed
		}
		var err error
		if buf, err = c.s.Alloc(max(len(b), 1)); err == nil {
			copy(buf.Bytes(), b)
			c.mem.RUnlock()
			break
		}
		c.mem.RUnlock()
		if !errors.Is(err, session.ErrLimit) || c.n == 0 {
			return err
		}
		// The allocator is full (its MaxMemory), maybe of the copies
		// of the messages in flight: the oldest one's delivery frees
		// its copy.
		if err := c.reap(); err != nil {
			return err
		}
	}
	sl, _ := buf.Slice(0, len(b))
	p, err := c.s.PostSendSlice(ctx, sl, imm, hasImm)
	if err != nil {
		buf.Free()
		if errors.Is(err, session.ErrLimit) && c.n > 0 && c.s.Err() == nil {
			// No room for the message's header (its MaxMemory): it
			// may come once the messages in flight are delivered.
			// Nothing was posted; the caller tries again.
			for c.n > 0 {
				if err := c.reap(); err != nil {
					return err
				}
			}
			return c.post(ctx, b, imm, hasImm)
		}
		return err
	}
	c.ring[(c.head+c.n)%inFlight] = posted{p: p, buf: buf}
	c.n++
	return nil
}

// reap waits for the oldest message in flight to be delivered and frees
// its copy (wmu held). It waits while the session lives: the peer's
// device acknowledges a message without the peer reading it.
func (c *Conn) reap() error {
	e := &c.ring[c.head]
	err := e.p.Wait(context.Background())
	if err == nil {
		e.buf.Free() // after a failure, the session's end frees it
	}
	*e = posted{}
	c.head = (c.head + 1) % inFlight
	c.n--
	return err
}

// writeErr is the error of a Write whose post (with ctx) failed with
// err, or that found ctx ended (err is then ctx's); it sticks unless it
// is the deadline's or Close's (which ends ctx too).
func (c *Conn) writeErr(ctx context.Context, err error) error {
	if c.isClosed() {
		return c.opErr("write", net.ErrClosed)
	}
	if e := c.s.Err(); e != nil {
		c.werr = c.opErr("write", e)
		return c.werr
	}
	if ctx.Err() != nil {
		return c.opErr("write", os.ErrDeadlineExceeded)
	}
	c.werr = c.opErr("write", err)
	return c.werr
}

// CloseWrite ends this side's direction of the stream: the peer reads
// the bytes written before, then io.EOF. Reads go on; later Writes fail.
// It waits for credit to post the end (until the write deadline).
func (c *Conn) CloseWrite() error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.wshut && !c.closed.Load() {
		return nil
	}
	if err := c.writable(); err != nil {
		return err
	}
	ctx := c.wd.context()
	if err := ctx.Err(); err != nil {
		// Past the write deadline, as Write says; else the result
		// depended on whether a credit was free.
		return c.writeErr(ctx, err)
	}
	if err := c.post(ctx, nil, finImm, true); err != nil {
		return c.writeErr(ctx, err)
	}
	c.wshut = true
	return nil
}

// Close closes the stream and its session: it stops a Write (or
// CloseWrite) under way, which returns an error wrapping net.ErrClosed
// and how many bytes it posted, and waits for the messages posted to be
// delivered, so that the peer reads every byte written before Close,
// then io.EOF (of a peer that stopped answering, until the session's
// keepalive or its queue pair's transport timeout gives up on them: a few
// seconds). It unblocks every Read at once, before that wait: the Read
// returns an error wrapping net.ErrClosed.
func (c *Conn) Close() error {
	if c.s == nil || !c.closed.CompareAndSwap(false, true) { // closed, or a zero Conn
		return c.opErr("close", net.ErrClosed)
	}
	// Reads end at once: they must not wait for the wait below (for a
	// peer that stopped answering: seconds).
	c.rd.end()
	// A Write waiting for credits (or for room in the session's queue)
	// waits with the write deadline's context: ending it stops the
	// Write, whose messages posted are then delivered like the
	// others. (Closing the session under it instead flushed the
	// messages in flight: the peer lost bytes of Writes that had
	// returned before Close.)
	c.wd.end()
	c.wmu.Lock()
	for c.n > 0 {
		if c.reap() != nil {
			break
		}
	}
	c.wmu.Unlock()
	c.mem.Lock()
	defer c.mem.Unlock()
	if err := c.s.Close(); err != nil {
		return c.opErr("close", err)
	}
	return nil
}

// expired is the error of an op whose deadline's context ended: Close
// ends them too.
func (c *Conn) expired(op string) error {
	if c.isClosed() {
		return c.opErr(op, net.ErrClosed)
	}
	return c.opErr(op, os.ErrDeadlineExceeded)
}

func (c *Conn) opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: netName, Source: c.local, Addr: c.remote, Err: err}
}
