package soft

import (
	"errors"
	"io"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// Direct placement of RDMA write payloads.
//
// A frame is normally handled once it lies whole in the connection's
// receive buffer: the kernel copies the payload out of the socket into
// the buffer, the responder copies it from there into the target region.
// For a large RDMA write that is a third copy of every byte (the sender's
// kernel made the first), as expensive as each of the other two: a raw
// socket stream makes two. So whoever consumes the socket (the reader, a
// poll, a drive: progress.go, drive.go) does what a NIC does with the
// packets of a write: once the header and body of a RC write have
// arrived and the target QP would accept the segment (placement: the
// checks of the responder, without its effects), it reads the rest of
// the payload from the socket straight into the target region, and only
// the bytes after it into the buffer. The placement is a state of the
// socket (sockRx.place), kept across consumers: the reader waits for the
// rest of a payload (until a read deadline asks it aside); a poll or a
// drive reads what arrived and returns, and the next consumer goes on
// (placeRun; sockRx.fillPlace for the waits of drives and the reader),
// before any other frame. Polls placed nothing before: a session's 64
// KiB messages over TCP, which its Receive polls for, were read into the
// buffer and copied from there (6.5 µs of the receiving process per
// message, runtime.memmove).
// The responder then runs the frame as usual (it checks again and makes
// the effects), except that the payload is already where it goes: it
// does not copy it, and refuses the write (remote access error) if the
// region it resolves is not the one the bytes went to.
//
// The region is pinned (mr.acquire) only for each non-blocking read,
// never while the reader waits for the socket, so its Close never waits
// for a peer. A region closed in between ends the placement: the rest of
// the payload is read and dropped, and the responder refuses the write.
// A write that the checks accept but the responder then refuses (the QP
// changed state, or the region went away, in between, locally) has
// written part or all of its bytes into the region it was allowed to
// write, as a NIC may have DMA'd the first packets of a message that
// fails: RDMA leaves the contents of a target undefined until the write
// completes.

// placeMin is the least payload still to come that makes the reader place
// a write directly: below it the copy (of bytes just read, still in the
// cache) costs less than the system call and the wait.
const placeMin = 32 << 10

// placeTail is the most the reader reads into the receive buffer after a
// placed payload, in the same system call, and in each read while writes
// are being placed: the next frames' headers and small frames, and the
// start of the next payload, whose rest is placed if it is at least
// placeMin. Over unix sockets, reads of that size keep what the
// responder copies in the cache (measured, BenchmarkXprocWriteBandwidth
// on 2 cores: 64 KiB writes 0.85 of the raw stream with 4 KiB, 1.0 with
// 64 KiB; 1 MiB writes 0.8 and 0.75; again on 2026-11-27, five
// alternating runs: 64 KiB writes 5.39 GB/s with 64 KiB, 4.95 with 4
// KiB, medians). Over TCP the smaller tail wins (placeTailTCP).
const placeTail = 64 << 10

// placeTailTCP is placeTail over TCP: after a placed 64 KiB write, a
// 64 KiB tail read the next frame nearly whole into the buffer, whose
// payload the responder then copied (a user-space copy of about half the
// bytes, 5 % of the process's time: runtime.memmove under respondRC,
// perf); with 4 KiB the next payload is placed too (TestPlacedStream:
// 61-63 of 64 writes placed, against 1-7). Measured with the reader
// also keeping to the tail after a large write it read whole (progress.go,
// drainFrames), five alternating runs of BenchmarkXprocWriteBandwidth,
// medians: over TCP 64 KiB writes 1.70 → 1.90 GB/s, 1 MiB 3.42 → 4.18;
// over unix sockets 64 KiB 3.76 → 4.23, 1 MiB 5.70 → 5.41 (noise: the
// same build gave 5.0-6.2).
const placeTailTCP = 4 << 10

// sockPlace is the payload being placed (rmu); its zero value: none
// (sockRx.pending).
type sockPlace struct {
	m    *mr            // the region, pinned only for each read
	at   unsafe.Pointer // the payload's first byte in the region
	off  uint64         // the next byte's offset in the region
	rem  int            // bytes still in the socket
	fail bool           // the region went away: the rest is dropped
	err  error
	iov  [2]unix.Iovec
}

// placement reports where the payload of req, a segment of plen > 0
// bytes of a RC RDMA write from another process (srcConn and srcFabric
// set), goes if this QP accepts it: the pinned region and the address of
// the payload's first byte in memory. It makes the responder's checks
// (respondLocked, respondRC, continueMsg) without their effects; nil if
// any fails (the responder will refuse the frame, or it is not worth
// placing). A write with immediate is placed from its first segment on
// only if it is more than one packet long and a receive waits for it
// (not one of an SRQ, which other QPs take from): a NIC writes the first
// packets of such a message before its last one takes the receive, and
// an RNR NAK of the last leaves them in memory; a message of one packet
// is checked whole (no receive: memory untouched). The second segment of
// a longer one is placed in any case: the first took the receive.
func (t *qp) placement(req *request, plen int) (*mr, unsafe.Pointer) {
	t.rmu.Lock()
	defer t.rmu.Unlock()
	if t.closed.Load() || t.typ != prov.QPTypeRC || req.qpType != uint8(prov.QPTypeRC) {
		return nil, nil
	}
	switch prov.QPState(t.state.Load()) {
	case prov.QPStateRTR, prov.QPStateRTS, prov.QPStateSQD:
	default:
		return nil, nil
	}
	if !t.fromPeer(req) || req.psn != t.rqPSN || t.attr.Access&prov.AccessRemoteWrite == 0 {
		return nil, nil
	}
	rkey, raddr, length := req.rkey, req.raddr, req.length
	if req.off == 0 {
		if t.rmsg.active || !req.op.isWrite() || req.mtu != t.mtu && req.length > min(req.mtu, t.mtu) {
			return nil, nil
		}
		if req.op == opWriteImm && (req.length <= t.mtu || !t.rmsg.recv.ok && (t.srq != nil || t.rq.count == 0)) {
			return nil, nil
		}
	} else {
		m := &t.rmsg
		if !m.active || req.op != m.op || !m.op.isWrite() || req.off != m.next || req.length != m.length {
			return nil, nil
		}
		rkey, raddr, length = m.rkey, m.raddr, m.length
	}
	if uint64(req.off)+uint64(plen) > uint64(length) {
		return nil, nil
	}
	p, m := t.remote(rkey, raddr, uint64(length), prov.AccessRemoteWrite)
	if m == nil {
		return nil, nil
	}
	return m, unsafe.Add(p, req.off)
}

// placed reports whether the payload data of req, a write segment whose
// bytes the reader placed (req.placed), lies at p, where the responder
// would copy it, in the region m it resolved. Otherwise the responder
// refuses the write (the region went away meanwhile).
func placed(req *request, m *mr, p unsafe.Pointer, data []span) bool {
	return m == req.placed && len(data) == 1 && data[0].p == p
}

// placeStart begins to place the payload of the frame h at the head of
// the receive buffer (a bytes of it there, the header and body whole) if
// it is a RC write the target accepts (rmu held): what arrived of the
// payload goes into the region, the header and body move to the front of
// the buffer, and the rest of the payload, still in the socket, is read
// into the region by placeRun. It reports whether it began.
func (c *conn) placeStart(h frameHdr, a uint64) bool {
	x := c.sock
	body := c.rxBody[:reqBodyLen]
	x.peek(hdrLen, body)
	plen := int(h.length) - reqBodyLen
	var req request
	flags, err := parseReq(body, uint32(plen), &req)
	if err != nil || plen <= 0 || req.direct || flags&reqPull != 0 {
		return false // the frame is handled (and refused) once whole
	}
	if !req.op.isWrite() || req.qpType != uint8(prov.QPTypeRC) {
		return false
	}
	t := c.f.qps.load(req.dstQPN)
	if t == nil {
		return false
	}
	req.srcFabric, req.srcConn = c.peerFab, c
	m, p := t.placement(&req, plen)
	if m == nil {
		return false
	}
	if flags&reqNoResp == 0 && !req.more {
		// It lands now: its acknowledgement is published first
		// (ackpage.go, Writes); handleReq takes it back unless the
		// responder acknowledges it.
		c.publishWrite(h.id)
	}
	have := int(a) - placeHead
	dmaCopy(unsafe.Slice((*byte)(p), have), x.buf[x.r+placeHead:x.w])
	m.release()
	copy(x.buf, x.buf[x.r:x.r+placeHead])
	x.r, x.w = 0, placeHead
	x.place = sockPlace{m: m, at: p, off: uint64(uintptr(p)-uintptr(m.base)) + uint64(have), rem: plen - have}
	return true
}

// placeHead is the bytes of a placed frame before its payload.
const placeHead = hdrLen + reqBodyLen

// placeRun reads the rest of the payload being placed (x.place) into its
// region, and what follows it (up to x.tail bytes) into the receive
// buffer (rmu held). Without wait it reads what the socket holds; with
// it (the reader) it waits for the rest, sending the responses held
// first, until a read deadline ends the wait (a Wait wants the socket:
// the placement goes on with whoever takes it). done: the payload is all
// there. An error ends the placement and fails the connection.
func (c *conn) placeRun(wait bool) (done bool, err error) {
	x := c.sock
	pl := &x.place
	if pl.rem > 0 && pl.err == nil {
		err = x.raw.Control(x.placeTry)
		if err == nil && pl.rem > 0 && pl.err == nil && wait {
			c.flushResps()
			err = x.raw.Read(x.placeFn)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return false, nil
			}
		}
	}
	if err == nil {
		err = pl.err
	}
	if err != nil {
		c.unpublish()
		*pl = sockPlace{}
		return false, readErr(c, err)
	}
	return pl.rem == 0, nil
}

// placeFinish handles the frame whose payload was placed (rmu held): the
// responder finds the payload in place (or, if the region went away, a
// pointer it refuses).
func (c *conn) placeFinish() error {
	x := c.sock
	pl := &x.place
	h, err := parseHdr(x.buf[x.r : x.r+hdrLen])
	if err != nil {
		return err // it parsed when the placement began
	}
	body := c.rxBody[:reqBodyLen]
	x.peek(hdrLen, body)
	plen := int(h.length) - reqBodyLen
	c.rxPlaced = pl.m
	c.rxData[0] = span{pl.at, plen}
	if pl.fail {
		c.rxData[0].p = nil
	}
	*pl = sockPlace{}
	x.placing = true
	err = c.handle(h, body, c.rxData[:1], plen)
	c.rxData = [2]span{}
	c.rxPlaced = nil
	x.skip(placeHead)
	return err
}

// placeRead reads the socket (non-blocking) into the region being placed
// and the free end of the buffer, until the payload is all there or the
// socket is empty (then it reports false: wait) or fails.
func (x *sockRx) placeRead(fd uintptr) bool {
	pl := &x.place
	for pl.rem > 0 {
		k := 1
		var p unsafe.Pointer
		if !pl.fail {
			var ok bool
			if p, ok = pl.m.acquire(pl.m.addr+pl.off, uint64(pl.rem)); !ok {
				pl.fail = true
			}
		}
		if pl.fail {
			// Dropped: read into the free end of the buffer, which holds
			// at least a frame.
			n := min(pl.rem, len(x.buf)-x.w)
			pl.iov[0].Base = &x.buf[x.w]
			pl.iov[0].SetLen(n)
		} else {
			pl.iov[0].Base = (*byte)(p)
			pl.iov[0].SetLen(pl.rem)
			if n := min(x.tail, len(x.buf)-x.w); n > 0 {
				pl.iov[1].Base = &x.buf[x.w]
				pl.iov[1].SetLen(n)
				k = 2
			}
		}
		r, _, errno := unix.RawSyscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(&pl.iov[0])), uintptr(k))
		if !pl.fail {
			pl.m.release()
		}
		pl.iov = [2]unix.Iovec{}
		switch {
		case errno == unix.EINTR:
			continue
		case errno == unix.EAGAIN:
			return false
		case errno != 0:
			pl.err = errno
			return true
		case r == 0:
			pl.err = io.ErrUnexpectedEOF
			return true
		}
		n := int(r)
		if n > pl.rem {
			x.w += n - pl.rem
			n = pl.rem
		}
		pl.rem -= n
		pl.off += uint64(n)
	}
	return true
}
