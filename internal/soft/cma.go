package soft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
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
// sends PULL_PROBE with the address of pullProbe in its memory, as the
// connection's first frame (addConn: before any other writer can hold
// it); the peer reads those 8 bytes and answers PULL_ACK over the socket
// (in its stream of frames, for a unix connection). Only after an
// answer that it could does a side pull its payloads, and only a side that
// answered so accepts pulled requests.
//
// A request is read when the target handles it, but once it completes,
// in error too, its buffers are the application's again and a NIC no
// longer reads them: a requester that gives a pulled request up before
// its response (the transport timeout of a stopped peer, its QP moved to
// ERR, reset or destroyed with requests in flight) completes it at once,
// and a target that handles it later (resumed, or merely behind) must not
// deliver what the application has put in the buffer since, or memory
// freed and reused. So each pulled request carries a claim: the address
// of a word of the requester's send queue slot (sendWQE.claim) and the
// value it holds while the request is in flight, a value no other request
// of the process has. The requester clears the word when the request
// completes, whatever the way (sendWQE.leave), before the application can
// see the completion; and so does Close of a region a pulled request in
// flight reads from (each region lists them: mr.pulls), as a NIC fails a
// request whose region was deregistered under it. The target reads the
// word after the payload, in the same system call (loads of one CPU are
// seen in order on amd64; elsewhere it reads it again after a barrier):
// if it still holds the value, the payload was read before the requester
// let go of it, and counts; if not (pullLost), nothing is delivered: the
// receive it took goes back to its queue, the target QP's sequence does
// not move, and the requester, if it still waits, fails the request with
// LOC_PROT_ERR (its region was closed). A write whose claim is lost may
// have changed its target region (as a failed write may on a NIC). The
// values come from a random base, so the memory of a slot freed and
// reused does not hold one by chance. (A word per region in the request
// instead of the lists cost a page more to pin per read: 5-10 % of a
// 64 KiB pull.)
//
// GOVERBS_SOFT_PULL=0 turns pulling off in a process (no probe is sent,
// and a side that sent none is never pulled from).
//
// The target reads the process it knows by the kernel's word (SO_PEERCRED).
// Its id could belong to another process once it exited: a claimed read
// counts only if the claim's word, read in the same system call (which
// reads one process), holds the value of the requester's random base;
// the probe, which has no claim, is checked after its read with a pidfd
// (the process has not exited).
// A read that fails while the claim holds (the requester unmapped the
// memory of a region it did not close) fails the request as a remote
// operation error (REM_OP_ERR at the requester, LOC_QP_OP_ERR for a
// receive it consumed) and moves the target QP to ERR.
//
// What a peer can do with it: make this process read its own memory, at
// addresses it chooses, into a region or receive buffer it may write
// anyway (keys, bounds and the receive are checked first); read 8 bytes
// of its own for the probe. Both ends of a shared-memory connection are
// processes of the same user (checkPeerCred), which the kernel lets
// signal and, unless Yama says otherwise, trace each other: a peer that
// made a read block (pages under its userfaultfd) could stop this process
// as well.

// A pulled request's payload: pullHead bytes (the address of the
// requester's claim word, its value), then a pullDesc for each piece
// (address, length); all little-endian uint64.
const (
	pullMin  = 64 << 10
	pullHead = 16
	pullDesc = 16
	envPull  = "GOVERBS_SOFT_PULL"
)

// claimBase makes the values of claim words (newClaim) unlike what freed
// memory holds.
var (
	claimBase = rand.Uint64()
	claimSeq  atomic.Uint64
)

// newClaim returns a value no other claim of this process has, never 0.
func newClaim() uint64 {
	for {
		if v := claimBase + claimSeq.Add(1); v != 0 {
			return v
		}
	}
}

// loadsInOrder reports whether the CPU shows a thread's loads in program
// order (the claims are then read in the payload's system call).
const loadsInOrder = runtime.GOARCH == "amd64" || runtime.GOARCH == "386" || runtime.GOARCH == "s390x"

// pullProbe is what PULL_PROBE asks the peer to read.
var pullProbe = [8]byte{'g', 'o', 'v', 'e', 'r', 'b', 's', 'P'}

// PULL_ACK results.
const (
	pullOK = 0
	pullNo = 1 // this process cannot read the peer: it sends the bytes
)

// pullOff reports whether pulling is off in this process.
func pullOff() bool { return os.Getenv(envPull) == "0" }

// pullSrc is the payload of a pulled request: the requester's pieces
// and its claim (the consumer's, rmu held).
type pullSrc struct {
	pid     int
	pidfd   int
	remote  [maxSGE + 1]unix.RemoteIovec // n pieces, then the claim's word
	n       int
	claimed bool   // the probe has no claim
	want    uint64 // what the claim's word must hold
	got     uint64
	local   [maxSGE + 1]unix.Iovec
	count   *atomic.Uint64 // pulls that counted (LinkInfo.Pulled)
	lost    *atomic.Uint64 // pulls whose claim was lost (LinkInfo.PullsLost)
}

// pullResult is the outcome of pullSrc.read.
type pullResult uint8

const (
	pullRead   pullResult = iota // all of it, from the request in flight
	pullLost                     // the requester let the request go: nothing counts
	pullFailed                   // the requester's memory could not be read
)

// parsePull decodes the payload of a pulled request of length bytes from
// data (the frame's payload: pullHead, then pieces).
func (c *conn) parsePull(data []span, plen int, length uint32) (*pullSrc, error) {
	if c.pidfd < 0 || !c.pullServed.Load() {
		return nil, fmt.Errorf("%w: a pulled request on a connection that did not offer it", errBadReq)
	}
	var b [pullHead + maxSGE*pullDesc]byte
	if plen > len(b) || plen < pullHead+pullDesc || (plen-pullHead)%pullDesc != 0 ||
		copySpans([]span{{unsafe.Pointer(&b[0]), plen}}, 0, data) != plen {
		return nil, fmt.Errorf("%w: pulled request with %d bytes of pieces", errBadReq, plen)
	}
	le := binary.LittleEndian
	a, v := le.Uint64(b[0:]), le.Uint64(b[8:])
	ps := c.pullFrom((plen-pullHead)/pullDesc, a, v)
	if ps == nil {
		return nil, fmt.Errorf("%w: pulled request's claim %#x at %#x", errBadReq, v, a)
	}
	var total uint64
	for i := range ps.n {
		d := b[pullHead+i*pullDesc:]
		a, n := le.Uint64(d), le.Uint64(d[8:])
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

// pullFrom readies c.pull (the consumer's) to read n pieces from the
// peer (the caller sets them in remote[:n]) with the claim whose word is
// at a and holds v; nil if that cannot be a claim (its word unaligned or
// at 0, or the value 0).
func (c *conn) pullFrom(n int, a, v uint64) *pullSrc {
	if a == 0 || a%8 != 0 || a+8 < a || v == 0 {
		return nil
	}
	ps := &c.pull
	ps.pid, ps.pidfd, ps.count, ps.lost = int(c.peerPID), c.pidfd, &c.pulled, &c.pullsLost
	ps.n, ps.claimed, ps.want = n, true, v
	ps.remote[n] = unix.RemoteIovec{Base: uintptr(a), Len: 8}
	return ps
}

// read copies the payload into dst, from off bytes into dst on (dst
// must hold it), then checks the claim.
func (ps *pullSrc) read(dst []span, off int) pullResult {
	total := 0
	for _, r := range ps.remote[:ps.n] {
		total += r.Len
	}
	nl, need := 0, total
	for _, d := range dst {
		if need == 0 {
			break
		}
		if off >= d.n {
			off -= d.n
			continue
		}
		if nl == maxSGE {
			return pullFailed
		}
		take := min(d.n-off, need)
		ps.local[nl] = unix.Iovec{Base: (*byte)(unsafe.Add(d.p, off))}
		ps.local[nl].SetLen(take)
		need -= take
		nl++
		off = 0
	}
	if need > 0 {
		return pullFailed
	}
	nr := ps.n
	if ps.claimed {
		ps.got = 0
		ps.local[nl] = unix.Iovec{Base: (*byte)(unsafe.Pointer(&ps.got))}
		ps.local[nl].SetLen(8)
		nl, nr, total = nl+1, nr+1, total+8
	}
	if !readv(ps.pid, ps.local[:nl], ps.remote[:nr], total) {
		// The claim tells whether the requester let it go (it may have
		// freed the memory since) or this is a failure.
		if ps.claimed && !ps.claimHeld() {
			return ps.lose()
		}
		return pullFailed
	}
	if !ps.claimed && !peerLives(ps.pidfd) {
		// Its pid may now be another's: what came is not the request's.
		// (A claimed read needs no such look, a system call per message:
		// one process_vm_readv reads one process, whose pid it resolved
		// when the call began, and the claim's word, read last, holds a
		// value of the requester's random claimBase, which another
		// process that got its pid does not hold.)
		return ps.lose()
	}
	held := !ps.claimed || ps.got == ps.want
	if held && ps.claimed && !loadsInOrder {
		fence.Add(1) // the payload's loads before the claim's
		held = ps.claimHeld()
	}
	if !held {
		return ps.lose()
	}
	if ps.count != nil {
		ps.count.Add(1)
	}
	return pullRead
}

// fence is written by read as a barrier between loads.
var fence atomic.Uint32

// claimHeld reads the claim's word again, alone, and reports whether it
// still holds its value.
func (ps *pullSrc) claimHeld() bool {
	ps.got = 0
	ps.local[0] = unix.Iovec{Base: (*byte)(unsafe.Pointer(&ps.got))}
	ps.local[0].SetLen(8)
	return readv(ps.pid, ps.local[:1], ps.remote[ps.n:ps.n+1], 8) && peerLives(ps.pidfd) && ps.got == ps.want
}

func (ps *pullSrc) lose() pullResult {
	if ps.lost != nil {
		ps.lost.Add(1)
	}
	return pullLost
}

// readv reads total bytes of process pid at remote into local; local and
// remote are consumed.
func readv(pid int, local []unix.Iovec, remote []unix.RemoteIovec, total int) bool {
	for total > 0 {
		n, err := unix.ProcessVMReadv(pid, local, remote, 0)
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
		if probe.read([]span{{unsafe.Pointer(&got[0]), len(got)}}, 0) == pullRead && got == [8]byte(body[8:16]) {
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

// pullPieces encodes the payload of w, a pulled request: its claim (a
// new value in w.claim) and the addresses of data, the gathered payload,
// whose regions are mrs, held (into x.pullBuf). w is listed by its
// regions until it leaves.
func (x *xstate) pullPieces(w *sendWQE, data []span, mrs []*mr) []span {
	le := binary.LittleEndian
	v := newClaim()
	w.claim.Store(v) // before the request leaves
	w.pulled = true
	le.PutUint64(x.pullBuf[0:], uint64(uintptr(unsafe.Pointer(&w.claim))))
	le.PutUint64(x.pullBuf[8:], v)
	n := 0
	for i, s := range data {
		if s.n == 0 {
			continue
		}
		d := x.pullBuf[pullHead+n*pullDesc:]
		le.PutUint64(d, uint64(uintptr(s.p)))
		le.PutUint64(d[8:], uint64(s.n))
		n++
		if m := mrs[i]; !slices.Contains(w.pmrs, m) {
			// Held (acquire), so not closed yet: Close finds w.
			m.pullMu.Lock()
			m.pulls = append(m.pulls, w)
			m.pullMu.Unlock()
			w.pmrs = append(w.pmrs, m)
		}
	}
	x.pullSpan[0] = span{unsafe.Pointer(&x.pullBuf[0]), pullHead + n*pullDesc}
	return x.pullSpan[:]
}

// leave marks w as no longer in flight (its completion is about to be
// made): a target that has yet to read its pulled payload finds the
// claim gone.
func (w *sendWQE) leave() {
	w.fconn = nil
	if !w.pulled {
		return
	}
	w.pulled = false
	w.claim.Store(0)
	for i, m := range w.pmrs {
		m.pullMu.Lock()
		if k := slices.Index(m.pulls, w); k >= 0 {
			m.pulls = slices.Delete(m.pulls, k, k+1)
		}
		m.pullMu.Unlock()
		w.pmrs[i] = nil
	}
	w.pmrs = w.pmrs[:0]
}

// dropPulls clears the claims of the pulled requests in flight from m,
// which is closing: a target that has yet to read them drops them.
func (m *mr) dropPulls() {
	m.pullMu.Lock()
	for _, w := range m.pulls {
		w.claim.Store(0)
	}
	m.pullMu.Unlock()
}

// --- pulled reads ---
//
// An RDMA read of at least pullMin bytes the other way round: the
// requester offers to pull (reqPull on the read) where it can read the
// target (it answered the target's probe so), and the target, after
// every check of the read, answers with one ACK (respPulled) that gives
// the address of the data in its memory and its region's claim word
// (mr.live, which Close clears) instead of sending the data. The
// requester's consumer reads the data straight into the read's local
// memory, then the word, in the same system call: a region closed before
// the requester read it (its memory perhaps freed) fails the read with
// REM_ACCESS_ERR rather than deliver what the memory holds then. The
// target keeps nothing for it: as on a NIC, a read races the target's
// own writes to the region.

// pullsReads reports whether a read of n bytes on c offers to pull its
// data. It runs on the requester's path, without rmu: it reads pidfdOpen,
// not the pidfd closePidfd changes (the consumer that takes the answer
// looks at the pidfd again, rmu held).
func (c *conn) pullsReads(n uint64) bool {
	return c.pidfdOpen.Load() && c.pullServed.Load() && n >= pullMin && n <= maxMsgSize
}

// answerPulled answers the read id of n bytes at addr of m, which
// offered to pull, with where the data is (respPulled), if the peer can
// read this process; it reports whether it did (else the data is sent).
func (c *conn) answerPulled(id uint64, qpn uint32, m *mr, addr uint64, n uint32) bool {
	if !c.pullReady.Load() || n < pullMin {
		return false
	}
	// The responder checked addr and n against m (qp.remote).
	v := m.live.Load()
	if v == 0 {
		return false // closed: sendRead answers so
	}
	var b [hdrLen + respBodyLen + pulledReadLen]byte
	putHdr(b[:], frResp, respBodyLen+pulledReadLen, id)
	putResp(b[hdrLen:], qpn, &response{code: respACK, pulled: true})
	le := binary.LittleEndian
	d := b[hdrLen+respBodyLen:]
	le.PutUint64(d, uint64(uintptr(m.base))+(addr-m.addr))
	le.PutUint64(d[8:], uint64(uintptr(unsafe.Pointer(&m.live))))
	le.PutUint64(d[16:], v)
	c.respMu.Lock() // fbufs' (flushResps runs in other goroutines too)
	c.fbufs[0] = b[:]
	err := c.send(c.fbufs[:1], false)
	c.fbufs[0] = nil
	c.respMu.Unlock()
	if err != nil {
		c.fail(err)
	}
	return true
}

// deliverPulled reads the data of the read sent as request id on c from
// the peer's memory, as its answer (data, pulledReadLen bytes) says, into
// the read's local memory. Called by c's consumer (rmu held: c.pull).
func (q *qp) deliverPulled(c *conn, id uint64, data []span) error {
	var b [pulledReadLen]byte
	copySpans([]span{{unsafe.Pointer(&b[0]), len(b)}}, 0, data)
	le := binary.LittleEndian
	addr, wa, wv := le.Uint64(b[:]), le.Uint64(b[8:]), le.Uint64(b[16:])
	x := q.x
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.readOf(c, id)
	if w == nil {
		return nil // abandoned
	}
	rd := &w.rd
	var ps *pullSrc
	if rd.pull && c.pidfd >= 0 && rd.got == 0 && addr+uint64(rd.n) >= addr {
		ps = c.pullFrom(1, wa, wv)
	}
	if ps == nil {
		return fmt.Errorf("%w: a pulled read's answer (%d bytes at %#x, claim %#x at %#x) to a read that did not offer it", errBadResp, rd.n, addr, wv, wa)
	}
	ps.remote[0] = unix.RemoteIovec{Base: uintptr(addr), Len: int(rd.n)}
	var dst [maxSGE]span
	var held [maxSGE]*mr
	var cache *mr
	k, _, st := q.pinLocal(w.sge[:w.wr.NumSGE], prov.AccessLocalWrite, &cache, dst[:], held[:])
	if st == prov.StatusSuccess {
		switch ps.read(dst[:k], 0) {
		case pullLost:
			st = prov.StatusRemAccessErr // the region was closed first
		case pullFailed:
			st = prov.StatusRemOpErr
		}
	}
	releaseAll(held[:k])
	rd.st, rd.got, rd.done = st, rd.n, true
	rd.last = x.rtTicks.Load()
	return nil
}

// statusPullLost is what scatter returns when the claims of a pulled
// payload were lost (not a completion status).
const statusPullLost prov.Status = 1 << 16

// pullStatus is the status of a receive whose pulled payload could not
// be read.
const pullStatus = prov.StatusLocQPOpErr

// closePidfd closes the pidfd (rmu held, or the connection never ran).
func (c *conn) closePidfd() {
	if c.pidfd >= 0 {
		c.pidfdOpen.Store(false)
		unix.Close(c.pidfd)
		c.pidfd = -1
	}
}
