package soft

import (
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A socket outside the Go runtime's poller.
//
// The runtime watches the descriptors of net.Conns edge-triggered in its
// epoll instance, and a thread of the process sleeps in that instance
// whenever a P is idle and a timer or a network wait is pending. Every
// segment that arrives on such a socket then wakes that thread: the
// sending CPU pays for the wake-up (an inter-processor interrupt, a VM exit
// in a guest), the woken thread finds nobody to run. While the
// application polls its CQs, the polls read the socket (progress.go), and
// every message paid that wake-up for nothing.
//
// A quietSock takes the socket out of the runtime's instance. It is
// watched instead by two epoll instances of its own, one for reading and
// one for writing, which are in the runtime's poller themselves (an epoll
// descriptor is readable while one of its sockets is ready). A goroutine
// waits for the socket through them, as through a net.Conn. The reading
// instance can be silenced (quiet): while pollers read the socket, its
// segments wake nobody; the next wait arms it again. Errors and hang-ups
// are always watched.
//
// Methods are the net.Conn ones the connection uses (Read, Write,
// SetWriteDeadline, Close) and those of syscall.RawConn. Reads and the
// arming are for one goroutine at a time (the connection's consumer);
// writes for one at a time (wmu).
type quietSock struct {
	f      *os.File // the socket, not in the runtime's poller
	rc     syscall.RawConn
	in     quietWait // readable
	out    quietWait // writable
	laddr  net.Addr
	raddr  net.Addr
	rd     quietRead   // Read's (one reader at a time)
	wr     quietWrite  // writeAll's (one writer at a time)
	quiet  atomic.Bool // in does not watch EPOLLIN
	closed atomic.Bool
}

// quietWait is an epoll instance watching the socket for one direction,
// and the state of the one goroutine waiting through it.
type quietWait struct {
	ep *os.File // in the runtime's poller
	rc syscall.RawConn

	f     func(fd uintptr) bool // the caller's try
	done  bool
	cerr  error
	try   func(uintptr) bool // runs f on the socket (made once: no allocation per wait)
	inner func(uintptr)

	// ctl's, made once: the reader silences and arms in again with
	// every grace (progress.go).
	ctlEv    unix.EpollEvent
	ctlOp    int
	ctlEp    uintptr
	ctlErr   error
	ctlOuter func(ep uintptr)
	ctlInner func(s uintptr)
}

const quietIn = unix.EPOLLIN | unix.EPOLLRDHUP

// newQuietSock moves the socket of nc into a quietSock; nc is closed. On
// failure nc is left as it was.
func newQuietSock(nc net.Conn) (*quietSock, error) {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nil, errors.New("soft: not a socket")
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var derr error
	if err := raw.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, os.NewSyscallError("fcntl", derr)
	}
	q := &quietSock{laddr: nc.LocalAddr(), raddr: nc.RemoteAddr()}
	if err := q.init(fd); err != nil {
		q.Close()
		return nil, err
	}
	// The duplicate keeps the socket open; closing nc takes the original
	// descriptor out of the runtime's poller.
	nc.Close()
	return q, nil
}

// init takes over fd, a non-blocking socket.
func (q *quietSock) init(fd int) error {
	// A descriptor in blocking mode is not put in the runtime's poller
	// by os.NewFile; it is made non-blocking again behind its back: only
	// Control touches it.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return os.NewSyscallError("fcntl", err)
	}
	q.f = os.NewFile(uintptr(fd), "soft-socket")
	var err error
	if q.rc, err = q.f.SyscallConn(); err != nil {
		return err
	}
	var nerr error
	if err := q.rc.Control(func(s uintptr) { nerr = unix.SetNonblock(int(s), true) }); err != nil {
		return err
	}
	if nerr != nil {
		return os.NewSyscallError("fcntl", nerr)
	}
	q.rd.fn, q.wr.fn = q.rd.try, q.wr.try // made once: no allocation per call
	if err := q.in.init(q, quietIn); err != nil {
		return err
	}
	// Room is watched only while a write waits for it (Write): a unix
	// socket reports room after every read of its peer, and each such
	// event would wake the runtime's poller.
	return q.out.init(q, 0)
}

func (w *quietWait) init(q *quietSock, events uint32) error {
	w.inner = func(s uintptr) { w.done = w.f(s) }
	w.ctlInner = func(s uintptr) {
		w.ctlEv.Fd = int32(s)
		w.ctlErr = unix.EpollCtl(int(w.ctlEp), w.ctlOp, int(s), &w.ctlEv)
	}
	w.ctlOuter = func(ep uintptr) {
		w.ctlEp = ep
		if err := q.rc.Control(w.ctlInner); err != nil {
			w.ctlErr = err
		}
	}
	w.try = func(uintptr) bool {
		w.cerr = q.rc.Control(w.inner)
		return w.done || w.cerr != nil
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return os.NewSyscallError("epoll_create1", err)
	}
	// Non-blocking: os.NewFile puts it in the runtime's poller.
	if err := unix.SetNonblock(ep, true); err != nil {
		unix.Close(ep)
		return os.NewSyscallError("fcntl", err)
	}
	w.ep = os.NewFile(uintptr(ep), "soft-socket-epoll")
	if w.rc, err = w.ep.SyscallConn(); err != nil {
		return err
	}
	return q.ctl(w, unix.EPOLL_CTL_ADD, events)
}

// ctl changes what w's instance watches on the socket (ERR and HUP
// always). One goroutine at a time per instance.
func (q *quietSock) ctl(w *quietWait, op int, events uint32) error {
	w.ctlEv, w.ctlOp, w.ctlErr = unix.EpollEvent{Events: events}, op, nil
	cerr := w.rc.Control(w.ctlOuter)
	err := w.ctlErr
	w.ctlErr = nil
	if cerr != nil {
		return q.mapClosed(cerr)
	}
	if err != nil {
		if errors.Is(err, os.ErrClosed) {
			return q.mapClosed(err)
		}
		return os.NewSyscallError("epoll_ctl", err)
	}
	return nil
}

// silence stops waking readers for data (the caller reads the socket
// without waiting for a while); the next read that waits watches again.
func (q *quietSock) silence() error {
	if q.quiet.Load() {
		return nil
	}
	q.quiet.Store(true)
	return q.ctl(&q.in, unix.EPOLL_CTL_MOD, 0)
}

func (q *quietSock) listen() error {
	if !q.quiet.Load() {
		return nil
	}
	q.quiet.Store(false)
	return q.ctl(&q.in, unix.EPOLL_CTL_MOD, quietIn)
}

// wait runs f on the socket until it reports done, waiting on w between
// tries. Every event of the socket after a try reaches w's instance, and
// through it the runtime's poller, so a wait cannot miss one. (The
// poller's Read tries first.)
func (q *quietSock) wait(w *quietWait, f func(fd uintptr) bool) error {
	w.f, w.done, w.cerr = f, false, nil
	err := w.rc.Read(w.try)
	cerr := w.cerr
	w.f, w.cerr = nil, nil
	if err == nil {
		err = cerr
	}
	return q.mapClosed(err)
}

// mapClosed reports an operation ended by Close as net.ErrClosed (the
// descriptors report their own "use of closed file").
func (q *quietSock) mapClosed(err error) error {
	if err != nil && q.closed.Load() {
		return net.ErrClosed
	}
	return err
}

// Control runs f on the socket (syscall.RawConn).
func (q *quietSock) Control(f func(fd uintptr)) error { return q.mapClosed(q.rc.Control(f)) }

// Read runs f until it reports done, waiting for the socket to be
// readable between tries (syscall.RawConn).
func (q *quietSock) Read(f func(fd uintptr) bool) error {
	if err := q.listen(); err != nil {
		return err
	}
	return q.wait(&q.in, f)
}

// Write runs f until it reports done, waiting for the socket to be
// writable between tries (syscall.RawConn). Most writes do not wait: the
// first try goes straight to the socket, and only a write that must wait
// has the out instance watch for room, until it is done.
func (q *quietSock) Write(f func(fd uintptr) bool) error {
	w := &q.out
	w.f, w.done, w.cerr = f, false, nil
	if w.try(0) {
		cerr := w.cerr
		w.f, w.cerr = nil, nil
		return q.mapClosed(cerr)
	}
	if err := q.ctl(w, unix.EPOLL_CTL_MOD, unix.EPOLLOUT); err != nil {
		w.f = nil
		return err
	}
	err := q.wait(w, f)
	if cerr := q.ctl(w, unix.EPOLL_CTL_MOD, 0); err == nil {
		err = cerr
	}
	return err
}

// conn is the net.Conn view of the socket, for io.ReadFull and the
// writes that wait.
func (q *quietSock) conn() net.Conn { return (*quietConn)(q) }

// quietConn is a quietSock as a net.Conn.
type quietConn quietSock

var _ net.Conn = (*quietConn)(nil)

func (c *quietConn) q() *quietSock { return (*quietSock)(c) }

// Read reads into p, waiting until the socket holds something.
func (c *quietConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	q := c.q()
	r := &q.rd
	r.p, r.n, r.err = p, 0, nil
	werr := q.Read(r.fn)
	n, err := r.n, r.err
	r.p, r.err = nil, nil
	if werr != nil {
		return 0, werr
	}
	if err != nil {
		return 0, os.NewSyscallError("read", err)
	}
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

// Write writes all of p, waiting for room (until the write deadline).
func (c *quietConn) Write(p []byte) (int, error) {
	q := c.q()
	q.wr.one[0] = p
	n, err := q.writeAll(q.wr.one[:])
	q.wr.one[0] = nil
	return n, err
}

// writeAll writes all of bufs, waiting for room (until the write
// deadline), with as few writev calls as the socket allows.
func (q *quietSock) writeAll(bufs [][]byte) (int, error) {
	w := &q.wr
	w.bufs, w.n, w.err = bufs, 0, nil
	werr := q.Write(w.fn)
	n, err := w.n, w.err
	w.bufs, w.err = nil, nil
	if werr != nil {
		return n, werr
	}
	if err != nil {
		return n, os.NewSyscallError("writev", err)
	}
	return n, nil
}

// quietRead is the state of the reader's Read (one at a time).
type quietRead struct {
	p   []byte
	n   int
	err error
	fn  func(fd uintptr) bool
}

func (r *quietRead) try(fd uintptr) bool {
	for {
		r.n, r.err = rawRead(fd, r.p)
		if r.err != unix.EINTR {
			return r.err != unix.EAGAIN
		}
	}
}

// quietWrite is the state of the writer's writeAll (one at a time).
type quietWrite struct {
	one  [1][]byte
	bufs [][]byte
	n    int // bytes of bufs written
	err  error
	iov  [64]unix.Iovec
	fn   func(fd uintptr) bool
}

// try writes what remains of bufs until it is all written (done), the
// socket is full (not done: wait) or fails (done, with err).
func (w *quietWrite) try(fd uintptr) bool {
	for {
		skip, k := w.n, 0
		for _, b := range w.bufs {
			if skip >= len(b) {
				skip -= len(b)
				continue
			}
			if k == len(w.iov) {
				break
			}
			w.iov[k].Base = &b[skip]
			w.iov[k].SetLen(len(b) - skip)
			skip = 0
			k++
		}
		if k == 0 {
			return true
		}
		r, _, errno := unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&w.iov[0])), uintptr(k))
		clear(w.iov[:k])
		switch errno {
		case 0:
			w.n += int(r)
		case unix.EINTR:
		case unix.EAGAIN:
			return false
		default:
			w.err = errno
			return true
		}
	}
}

// Close closes the socket; waiting reads and writes fail with
// net.ErrClosed.
func (c *quietConn) Close() error { return c.q().Close() }

// Close closes the socket and its epoll instances.
func (q *quietSock) Close() error {
	q.closed.Store(true)
	var err error
	for _, f := range []*os.File{q.in.ep, q.out.ep, q.f} {
		if f != nil {
			if e := f.Close(); e != nil && err == nil && !errors.Is(e, os.ErrClosed) {
				err = e
			}
		}
	}
	return err
}

func (c *quietConn) LocalAddr() net.Addr  { return c.laddr }
func (c *quietConn) RemoteAddr() net.Addr { return c.raddr }

func (c *quietConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

// SetReadDeadline bounds the reads that wait.
func (c *quietConn) SetReadDeadline(t time.Time) error { return c.in.ep.SetReadDeadline(t) }

// SetWriteDeadline bounds the writes that wait.
func (c *quietConn) SetWriteDeadline(t time.Time) error { return c.out.ep.SetReadDeadline(t) }

// System calls on a connection's socket, which never wait (the socket is
// non-blocking: EAGAIN), go in as raw system calls (RawSyscall), which
// keep the goroutine's processor: a read or write of a large payload
// takes tens of microseconds, and one entered as a blocking call (Syscall)
// made the runtime's monitor take its processor away from it and wake a
// thread to run it meanwhile (handoffp, startm), and keep itself awake at
// 20 µs intervals while that went on. BenchmarkXprocWriteBandwidth/tcp
// 64 KiB: wake-ups per run 5.8k → 4.1k, context switches 10.0k → 6.9k,
// processor time 1.06-1.21 → 0.92-0.97 s (perf stat, two runs each);
// five alternating runs of the two builds, medians: TCP 64 KiB writes
// 2.07 → 2.31 GB/s, 1 MiB 3.86 → 4.16, unix 64 KiB 4.69 → 5.08, TCP
// round trips polling 19.9 → 18.3 µs and sleeping 20.6 → 18.4 µs (unix
// sleeping unchanged, 11.9 and 12.1).
// A call that waits (for the socket, through its epoll descriptors) still
// goes through the runtime.

// rawRead is unix.Read as a raw system call (fd never blocks).
func rawRead(fd uintptr, b []byte) (int, error) {
	var p unsafe.Pointer
	if len(b) > 0 {
		p = unsafe.Pointer(&b[0])
	}
	r, _, e := unix.RawSyscall(unix.SYS_READ, fd, uintptr(p), uintptr(len(b)))
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}
