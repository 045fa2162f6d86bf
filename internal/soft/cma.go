package soft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// --- pulled payloads (cross-memory attach) ---
//
// Over shared memory the payload of a send, or of a write that cannot be
// direct (shm.go), travels through the ring: the requester copies it in,
// the target copies it out, two copies of every byte; over a unix socket
// the kernel makes the same two. A large one (at least pullMin bytes) of
// a RC QP is instead pulled: the request goes through the ring or the
// socket with the requester's addresses of its bytes (after
// gather checked them against their regions) in place of the bytes, and
// the target's responder, which makes every check as for any request,
// reads them with process_vm_readv straight into the receive buffer or
// the target region: one copy, in the order of the ring, so that nothing
// waits (MPI's single-copy transfers between processes of one host, as in
// Open MPI's and MPICH's shared-memory transports, do the same). Like a
// NIC, the target reads the requester's memory while the request is in
// flight: the requester's buffers are the device's until its completion.
//
// The kernel allows process_vm_readv only where ptrace would be allowed
// (same user, Yama's ptrace_scope, seccomp filters of containers). So
// each side asks once per connection whether its peer may read it: it
// sends PULL_PROBE with the address of pullProbe in its memory; the peer
// reads those 8 bytes and answers PULL_ACK over the socket (in its stream
// of frames, for a unix connection). Only after an
// answer that it could does a side pull its payloads, and only a side that
// answered so accepts pulled requests.
//
// Off by default: GOVERBS_SOFT_PULL=1 turns it on (in both processes;
// without it no probe is sent, and a side that sent none is never
// pulled from). What keeps it off: once a request completes, in error
// too, its buffers are the application's again, and a NIC no longer
// reads them; a pulled request is read when the target handles it. A
// requester that gives a pulled request up before its response (the
// transport timeout of a stopped peer, its QP moved to ERR or closed with
// requests in flight) completes it at once, and a target that handles it
// later (resumed, or merely behind) reads what the application has put in
// the buffer since, or memory freed and reused, and delivers that as the
// message. The fix is a claim per pulled request in memory both
// processes map (a word the target clears after its read and the
// requester clears when it gives the request up: whoever clears it
// decides whether the read counts), left for later; until then the
// default keeps the copies, whose bytes are taken when the request is
// posted.
//
// The target reads the process it knows by the kernel's word (SO_PEERCRED)
// and checks after each read, with a pidfd, that the process has not
// exited (its id could then belong to another). A read that fails (the
// requester freed the memory of a request in flight, or is gone) fails
// the request as a remote operation error (REM_OP_ERR at the requester,
// LOC_QP_OP_ERR for a receive it consumed) and moves the target QP to ERR.
//
// What a peer can do with it: make this process read its own memory, at
// addresses it chooses, into a region or receive buffer it may write
// anyway (keys, bounds and the receive are checked first); read 8 bytes
// of its own for the probe. Both ends of a shared-memory connection are
// processes of the same user (checkPeerCred), which the kernel lets
// signal and, unless Yama says otherwise, trace each other: a peer that
// made a read block (pages under its userfaultfd) could stop this process
// as well.

const (
	pullMin  = 64 << 10
	pullDesc = 16 // one piece of a pulled payload: address, length
	envPull  = "GOVERBS_SOFT_PULL"
)

// pullProbe is what PULL_PROBE asks the peer to read.
var pullProbe = [8]byte{'g', 'o', 'v', 'e', 'r', 'b', 's', 'P'}

// PULL_ACK results.
const (
	pullOK = 0
	pullNo = 1 // this process cannot read the peer: it sends the bytes
)

// pullOff reports whether pulling is off in this process (the default:
// see above).
func pullOff() bool { return os.Getenv(envPull) != "1" }

// pullSrc is the payload of a pulled request: the requester's pieces
// (the consumer's, rmu held).
type pullSrc struct {
	pid    int
	pidfd  int
	remote [maxSGE]unix.RemoteIovec
	n      int
	local  [maxSGE + 1]unix.Iovec
	count  *atomic.Uint64 // pulls that succeeded (LinkInfo.Pulled)
}

// parsePull decodes the pieces of a pulled request of length bytes from
// data (the frame's payload, k × pullDesc bytes).
func (c *conn) parsePull(data []span, plen int, length uint32) (*pullSrc, error) {
	if c.pidfd < 0 || !c.pullServed.Load() {
		return nil, fmt.Errorf("%w: a pulled request on a connection that did not offer it", errBadReq)
	}
	var b [maxSGE * pullDesc]byte
	if plen > len(b) || copySpans([]span{{unsafe.Pointer(&b[0]), plen}}, 0, data) != plen {
		return nil, fmt.Errorf("%w: pulled request with %d bytes of pieces", errBadReq, plen)
	}
	ps := &c.pull
	ps.pid, ps.pidfd, ps.n, ps.count = int(c.peerPID), c.pidfd, plen/pullDesc, &c.pulled
	var total uint64
	for i := range ps.n {
		a := binary.LittleEndian.Uint64(b[i*pullDesc:])
		n := binary.LittleEndian.Uint64(b[i*pullDesc+8:])
		if n == 0 || n > maxMsgSize || a+n < a {
			return nil, fmt.Errorf("%w: pulled piece of %d bytes at %#x", errBadReq, n, a)
		}
		total += n
		ps.remote[i] = unix.RemoteIovec{Base: uintptr(a), Len: int(n)}
	}
	if total != uint64(length) {
		return nil, fmt.Errorf("%w: pulled pieces of %d bytes for a message of %d", errBadReq, total, length)
	}
	return ps, nil
}

// read copies the payload into dst, from off bytes into dst on; it
// reports whether all of it came from the live requester.
func (ps *pullSrc) read(dst []span, off int) bool {
	nl := 0
	want := 0
	for _, d := range dst {
		if off >= d.n {
			off -= d.n
			continue
		}
		if nl == len(ps.local) {
			return false
		}
		ps.local[nl] = unix.Iovec{Base: (*byte)(unsafe.Add(d.p, off))}
		ps.local[nl].SetLen(d.n - off)
		want += d.n - off
		nl++
		off = 0
	}
	var total int
	for _, r := range ps.remote[:ps.n] {
		total += r.Len
	}
	if want < total {
		return false
	}
	local, remote := ps.local[:nl], ps.remote[:ps.n]
	for total > 0 {
		n, err := unix.ProcessVMReadv(ps.pid, local, remote, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			return false
		}
		// A partial read (a page it could not read): go on past what
		// came, which fails at that page.
		total -= n
		local, remote = advanceIov(local, n), advanceRemote(remote, n)
	}
	if !peerLives(ps.pidfd) {
		return false
	}
	if ps.count != nil {
		ps.count.Add(1)
	}
	return true
}

func advanceIov(v []unix.Iovec, n int) []unix.Iovec {
	for n > 0 && len(v) > 0 {
		if l := int(v[0].Len); n < l {
			v[0].Base = (*byte)(unsafe.Add(unsafe.Pointer(v[0].Base), n))
			v[0].SetLen(l - n)
			return v
		} else {
			n -= l
			v = v[1:]
		}
	}
	return v
}

func advanceRemote(v []unix.RemoteIovec, n int) []unix.RemoteIovec {
	for n > 0 && len(v) > 0 {
		if n < v[0].Len {
			v[0].Base += uintptr(n)
			v[0].Len -= n
			return v
		}
		n -= v[0].Len
		v = v[1:]
	}
	return v
}

// peerLives reports whether the process of pidfd has not exited.
func peerLives(pidfd int) bool {
	fds := [1]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds[:], 0)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n == 0
	}
}

// openPidfd returns a pidfd of the peer process, or -1.
func openPidfd(pid uint32) int {
	if pid == 0 || int(pid) == os.Getpid() || pullOff() {
		return -1
	}
	fd, err := unix.PidfdOpen(int(pid), 0)
	if err != nil {
		return -1
	}
	unix.CloseOnExec(fd)
	return fd
}

// offerPull asks the peer whether it can read this process (PULL_PROBE;
// the answer comes over the socket: to watchSocket over shared memory, as
// a frame over a unix socket).
func (c *conn) offerPull() {
	if pullOff() {
		return
	}
	var b [hdrLen + pullProbeLen]byte
	putHdr(b[:], frPullProbe, pullProbeLen, 0)
	binary.LittleEndian.PutUint64(b[hdrLen:], uint64(uintptr(unsafe.Pointer(&pullProbe))))
	copy(b[hdrLen+8:], pullProbe[:])
	c.writeFrame([][]byte{b[:]}, handshakeTimeout)
}

// servePullProbe answers PULL_PROBE: whether this process read the
// expected bytes at the address the peer gave (consumer, rmu held).
func (c *conn) servePullProbe(body []byte) error {
	status := byte(pullNo)
	if c.pidfd >= 0 {
		// As a pulled payload is read: one piece, 8 bytes.
		var got [8]byte
		probe := pullSrc{pid: int(c.peerPID), pidfd: c.pidfd, n: 1}
		probe.remote[0] = unix.RemoteIovec{Base: uintptr(binary.LittleEndian.Uint64(body)), Len: len(got)}
		if probe.read([]span{{unsafe.Pointer(&got[0]), len(got)}}, 0) && got == [8]byte(body[8:16]) {
			status = pullOK
			c.pullServed.Store(true) // before the answer: the peer pulls once it has it
		}
	}
	var b [hdrLen + pullAckLen]byte
	putHdr(b[:], frPullAck, pullAckLen, 0)
	b[hdrLen] = status
	if c.shm == nil {
		// A unix socket: in the stream of frames, as responses go.
		c.sendAsync([][]byte{b[:]})
		return nil
	}
	if err := c.writeSocket(b[:], nil); err != nil && !errors.Is(err, syscall.EPIPE) {
		return err
	}
	return nil
}

// handlePullAck takes the peer's answer to PULL_PROBE.
func (c *conn) handlePullAck(body []byte) error {
	switch body[0] {
	case pullOK:
		c.pullReady.Store(true)
	case pullNo:
	default:
		return fmt.Errorf("%w: PULL_ACK status %d", errBadResp, body[0])
	}
	return nil
}

// pullable reports whether w, a request of total bytes (gathered), goes
// as a pulled request on c.
func (c *conn) pullable(w *sendWQE, total uint64) bool {
	return c.pullReady.Load() && hasPayload(w.op) && !w.isInline && total >= pullMin && total <= maxMsgSize
}

// pullKind reports whether connections of kind pull: those between
// processes of one host.
func pullKind(kind uint8) bool { return kind == kindShm || kind == kindUnix }

// pullPieces encodes the addresses of data, the gathered payload, as the
// pieces of a pulled request (into x.pullBuf).
func (x *xstate) pullPieces(data []span) []span {
	n := 0
	for _, s := range data {
		if s.n == 0 {
			continue
		}
		binary.LittleEndian.PutUint64(x.pullBuf[n*pullDesc:], uint64(uintptr(s.p)))
		binary.LittleEndian.PutUint64(x.pullBuf[n*pullDesc+8:], uint64(s.n))
		n++
	}
	x.pullSpan[0] = span{unsafe.Pointer(&x.pullBuf[0]), n * pullDesc}
	return x.pullSpan[:]
}

// pullStatus is the status of a receive whose pulled payload could not
// be read.
const pullStatus = prov.StatusLocQPOpErr

// closePidfd closes the pidfd (rmu held, or the connection never ran).
func (c *conn) closePidfd() {
	if c.pidfd >= 0 {
		unix.Close(c.pidfd)
		c.pidfd = -1
	}
}
