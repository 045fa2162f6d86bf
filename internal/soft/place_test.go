package soft

import (
	"bytes"
	"context"
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// Direct placement of write payloads (place.go), driven by a raw peer on
// a unix socket that sends each segment in two parts: its header, body
// and first bytes, then, once the reader has taken those in, the rest.

// unread is how many bytes written to the unix socket nc its peer has not
// read yet (SIOCOUTQ: a unix stream socket's sender is charged for them
// until they are read).
func unread(t *testing.T, nc net.Conn) int {
	t.Helper()
	raw, err := nc.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	n, ierr := 0, error(nil)
	if err := raw.Control(func(fd uintptr) { n, ierr = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) }); err != nil {
		t.Fatal(err)
	}
	if ierr != nil {
		t.Fatal(ierr)
	}
	return n
}

// segSplit sends the segment of req at off as seg does, the header and
// body and the first `first` bytes of payload, then waits until the
// reader has read them, calls between (if not nil), and sends the rest.
func (p *rawPeer) segSplit(t *testing.T, req *request, id uint64, off, first int, between func()) {
	t.Helper()
	n := int(req.length)
	k := min(segMax, n-off)
	payload := make([]byte, k)
	for i := range payload {
		payload[i] = pattern(off + i)
	}
	s := *req
	s.off, s.more = uint32(off), off+k < n
	s.psn, s.npkts = (req.psn+uint32(off)/4096)&psnMask, max(1, uint32(k+4095)/4096)
	var h [hdrLen + reqBodyLen]byte
	putHdr(h[:], frReq, uint32(reqBodyLen+k), id)
	putReq(h[hdrLen:], &s, p.flags())
	if _, err := (&net.Buffers{h[:], payload[:first]}).WriteTo(p.nc); err != nil {
		t.Fatalf("write segment at %d: %v", off, err)
	}
	deadline := time.Now().Add(hangGuard)
	for unread(t, p.nc) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the reader does not read")
		}
		time.Sleep(100 * time.Microsecond)
	}
	if between != nil {
		between()
	}
	if _, err := p.nc.Write(payload[first:]); err != nil {
		t.Fatalf("write the rest of the segment at %d: %v", off, err)
	}
}

// TestPlacedWrite: the payload of a large write lands in its region
// without passing through the connection's receive buffer, and a write
// the responder refuses writes nothing.
func TestPlacedWrite(t *testing.T) {
	const n = 3*segMax + 40000 // the last segment is placed too (placeMin)
	const first = 1024
	t.Run("InPlace", func(t *testing.T) {
		h := newHostileOn(t, prov.QPTypeRC, 4*segMax, "unix")
		p := h.peer()
		req, id := p.msg(opWrite, h.mr.Addr()+8, h.mr.RKey(), n)
		for off := 0; off < n; off += segMax {
			p.segSplit(t, &req, id, off, first, nil)
		}
		if r := p.resp(t); r.code != respACK || p.lastID != id {
			t.Fatalf("response %d to %d, want an ACK to %d", r.code, p.lastID, id)
		}
		b := h.mrBytes()
		if !patternOK(b[8:8+n], 0) || !allEq(b[:8], 0) || !allEq(b[8+n:], 0) || !allEq(h.page[:4096], 0) {
			t.Fatal("the region does not hold exactly the message")
		}
		probe(t, p, respACK)
		// The receive buffer never held the payload after the first
		// bytes of each segment. It is the reader's: looked at once the
		// connection is down (the peer hangs up).
		c := connOf(t, getFabric().qps.load(h.qpn).destFabric)
		h.nc.Close()
		deadline := time.Now().Add(hangGuard)
		for !c.dead.Load() {
			if time.Now().After(deadline) {
				t.Fatal("the connection is still up")
			}
			time.Sleep(time.Millisecond)
		}
		c.rmu.Lock()
		defer c.rmu.Unlock()
		for off := 0; off < n; off += segMax {
			window := make([]byte, 4096)
			for i := range window {
				window[i] = pattern(off + 8192 + i)
			}
			if bytes.Contains(c.sock.buf, window) {
				t.Fatalf("the payload of the segment at %d went through the receive buffer", off)
			}
		}
	})
	t.Run("BegunByPollEndedByReader", func(t *testing.T) {
		// A poll begins the placement with the first bytes and leaves;
		// the reader reads the rest into the region and handles the
		// frame before anything else.
		h := newHostileOn(t, prov.QPTypeRC, 4*segMax, "unix")
		p := h.peer()
		c := connOf(t, getFabric().qps.load(h.qpn).destFabric)
		deadline := time.Now().Add(hangGuard)
		takeSocket(t, c)
		placed, byPolls := c.nPlaced.Load(), c.nPlacedPoll.Load()
		left := make(chan bool, 1)
		go func() {
			defer c.rmu.Unlock()
			for time.Now().Before(deadline) {
				if _, err := c.drain(false); err != nil {
					left <- false
					return
				}
				if c.sock.pending() {
					left <- c.sock.place.rem == segMax-first
					return
				}
				runtime.Gosched()
			}
			left <- false
		}()
		req, id := p.msg(opWrite, h.mr.Addr()+8, h.mr.RKey(), segMax)
		p.segSplit(t, &req, id, 0, first, func() {
			if !<-left {
				t.Error("the poll did not begin the placement with the first bytes")
			}
		})
		if r := p.resp(t); r.code != respACK || p.lastID != id {
			t.Fatalf("response %d to %d, want an ACK to %d", r.code, p.lastID, id)
		}
		b := h.mrBytes()
		if !patternOK(b[8:8+segMax], 0) || !allEq(b[:8], 0) || !allEq(b[8+segMax:], 0) {
			t.Fatal("the region does not hold exactly the message")
		}
		if k, kp := c.nPlaced.Load()-placed, c.nPlacedPoll.Load()-byPolls; k != 1 || kp != 0 {
			t.Errorf("%d frames placed, %d of them ended by polls; want 1 ended by the reader", k, kp)
		}
		probe(t, p, respACK)
	})
	t.Run("RegionClosedWhilePlacing", func(t *testing.T) {
		// The reader waits for the rest of the first segment: the
		// region's Close does not wait for it, and the write fails with
		// a remote access error; nothing is written after Close. With
		// immediate data the write is refused when it would execute
		// (its region is gone), so it consumes no receive: the QP goes
		// to ERR and flushes the receive.
		for _, tc := range []struct {
			name string
			op   reqOp
		}{{"Write", opWrite}, {"WriteImm", opWriteImm}} {
			op := tc.op
			t.Run(tc.name, func(t *testing.T) {
				h := newHostileOn(t, prov.QPTypeRC, 4*segMax, "unix")
				if op == opWriteImm {
					if _, err := h.q.qp.PostRecv([]prov.RecvWR{{WRID: 0x5E}}, nil); err != nil {
						t.Fatal(err)
					}
				}
				p := h.peer()
				req, id := p.msg(op, h.mr.Addr(), h.mr.RKey(), n)
				p.segSplit(t, &req, id, 0, first, func() {
					done := make(chan error, 1)
					go func() { done <- h.mr.Close() }()
					awaitNil(t, done, "the region's Close waits for the peer")
				})
				for off := segMax; off < n; off += segMax {
					p.seg(t, &req, id, off)
				}
				if r := p.resp(t); r.code != respAccess || p.lastID != id {
					t.Fatalf("response %d to %d, want a remote access NAK to %d", r.code, p.lastID, id)
				}
				probe(t, p, respDropped) // the QP is in ERR
				if op == opWriteImm {
					var wc [2]prov.Completion
					k, err := h.q.rcq.Poll(wc[:])
					if err != nil || k != 1 || wc[0].WRID != 0x5E || wc[0].Status != prov.StatusWRFlushErr {
						t.Fatalf("receive completions %d %+v, %v; want the receive flushed", k, wc[:k], err)
					}
				}
				b := h.mrBytes()
				if !patternOK(b[:first], 0) && !allEq(b[:first], 0) || !allEq(b[first:], 0) {
					t.Fatal("bytes written after the region was closed")
				}
			})
		}
	})
	// Writes the responder refuses: the checks before the payload is
	// placed are its, and nothing is written.
	refused := []struct {
		name  string
		edit  func(h *hostile, req *request)
		want  respCode
		after respCode // the probe's answer
	}{
		{"PastRegion", func(h *hostile, req *request) { req.raddr += segMax }, respAccess, respDropped},
		{"WrongRKey", func(h *hostile, req *request) { req.rkey ^= 0x100 }, respAccess, respDropped},
		{"WrongPSN", func(h *hostile, req *request) { req.psn = (req.psn + 5) & psnMask }, respSeqErr, respACK},
		{"StrangerQP", func(h *hostile, req *request) { req.srcQPN++ }, respDropped, respACK},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileOn(t, prov.QPTypeRC, 4*segMax, "unix")
			p := h.peer()
			psn := p.psn
			req, id := p.msg(opWrite, h.mr.Addr(), h.mr.RKey(), n)
			tc.edit(h, &req)
			p.segSplit(t, &req, id, 0, first, nil)
			if r := p.resp(t); r.code != tc.want || p.lastID != id {
				t.Fatalf("response %d to %d, want %d to %d", r.code, p.lastID, tc.want, id)
			}
			p.psn = psn // the message never happened
			probe(t, p, tc.after)
			if !allEq(h.page, 0) {
				t.Fatal("memory changed")
			}
		})
	}
}

// TestPlacedStream: a stream of 64 KiB RDMA writes over TCP is placed
// write after write (placeTailTCP): after a placed payload the reader
// reads only the next header and the start of its payload, and places
// the rest; a large write it read whole keeps it at that too. With a
// 64 KiB tail it read the next frame nearly whole and the responder
// copied its payload from the receive buffer: 1 to 7 of the 64 were
// placed (ten runs), and without the second rule none at all in about
// one run of thirty (a reader that fell behind took in whole frames
// with full reads from then on); now 61 to 63. The poster sleeps in
// its completion channel, so the target's socket is the reader's
// (polls place too: TestPlacedByPolls).
func TestPlacedStream(t *testing.T) {
	const n, size = 64, 64 << 10
	p := newDrivePair(t, "tcp")
	e, qa, cqa, cha := p.e, p.qa, p.cqa, p.cha
	src := e.alloc(size, allAccess)
	for i := range src.b {
		src.b[i] = byte(i % 251)
	}
	dst := e.alloc(size, allAccess)
	var cs [4]prov.Completion
	// A first write sets the connection up and names it.
	one := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
	if _, err := qa.PostSend(one, []prov.SGE{src.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	waitCQ(t, cqa, cha, cs[:], 1)
	before := placedBy()
	wrs := make([]prov.SendWR, n)
	sges := make([]prov.SGE, n)
	for i := range wrs {
		wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}
		sges[i] = src.sge(0, size)
	}
	wrs[n-1].Flags = prov.SendSignaled
	if k, err := qa.PostSend(wrs, sges); err != nil || k != n {
		t.Fatalf("post: %d, %v", k, err)
	}
	waitCQ(t, cqa, cha, cs[:], 1)
	if !bytes.Equal(dst.b, src.b) {
		t.Fatal("the region does not hold the writes' bytes")
	}
	placed := placedBy() - before
	t.Logf("%d of %d writes placed", placed, n)
	if placed < 3*n/4 {
		t.Errorf("%d of %d 64 KiB writes placed, want at least %d", placed, n, 3*n/4)
	}
}

// TestPlacementWriteImm: the reader places the first segment of a RC
// write with immediate only when the message is more than one packet
// long and a receive waits for it on the QP (not an SRQ's): a NIC writes
// the first packets of such a message before its last takes the
// receive; one that would be refused (RNR) is read whole and leaves
// memory untouched.
func TestPlacementWriteImm(t *testing.T) {
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	dst := e.alloc(128<<10, allAccess)
	tq := b.qp.(*qp)
	req := func(op reqOp, n uint32) *request {
		return &request{op: op, qpType: uint8(prov.QPTypeRC), srcQPN: a.qp.QPN(), dstQPN: tq.qpn, srcFabric: tq.destFabric,
			psn: tq.rqPSN, npkts: (n + tq.mtu - 1) / tq.mtu, mtu: tq.mtu, length: n, rkey: dst.mr.RKey(), raddr: dst.addr(0)}
	}
	placed := func(r *request) bool {
		m, _ := tq.placement(r, int(r.length))
		if m != nil {
			m.release()
		}
		return m != nil
	}
	const n = 64 << 10
	if !placed(req(opWrite, n)) {
		t.Fatal("a write is not placed")
	}
	if placed(req(opWriteImm, n)) {
		t.Error("a write with immediate is placed with no receive posted")
	}
	postRecv(t, b.qp, 1)
	if !placed(req(opWriteImm, n)) {
		t.Error("a write with immediate of 16 packets is not placed with a receive posted")
	}
	if placed(req(opWriteImm, tq.mtu)) {
		t.Error("a write with immediate of one packet is placed")
	}
}

// TestPlacedWriteImmStream: RDMA writes with immediate of 64 KiB over TCP,
// each with a receive waiting, are placed like writes (before, none was:
// the reader read every payload into its buffer and the responder copied
// it); the receives complete in order with their immediates and lengths,
// and the region holds the bytes.
func TestPlacedWriteImmStream(t *testing.T) {
	const n, size = 16, 64 << 10
	p, src, dst := newStreamPair(t, n*size, 253)
	qa, cqa, cha, qb := p.qa, p.cqa, p.cha, p.qb
	before := placedBy()
	postRecvs(t, qb, n)
	wrs, sges := writeImmStream(src, dst, n, size, 7000)
	if k, err := qa.PostSend(wrs, sges); err != nil || k != n {
		t.Fatalf("post: %d, %v", k, err)
	}
	var cs [4]prov.Completion
	waitCQ(t, cqa, cha, cs[:], 1)
	for i := range n {
		waitCQ(t, p.cqb, p.chb, cs[:1], 1)
		if c := cs[0]; c.Status != prov.StatusSuccess || c.WRID != uint64(100+i) || c.Imm != uint32(7000+i) || c.ByteLen != size {
			t.Fatalf("receive %d: %+v", i, c)
		}
	}
	if !bytes.Equal(dst.b, src.b) {
		t.Fatal("the region does not hold the writes' bytes")
	}
	placed := placedBy() - before
	t.Logf("%d of %d writes with immediate placed", placed, n)
	if placed < 3*n/4 {
		t.Errorf("%d of %d 64 KiB writes with immediate placed, want at least %d", placed, n, 3*n/4)
	}
}

// TestPlacedByPolls: a poll (or a drive) that consumes the socket places
// write payloads as the reader does: it places what arrived of a payload
// and leaves the rest in the socket, and the next consumer reads it into
// the region and handles the frame. Before, polls never placed: the
// payloads of a session's 64 KiB messages over TCP, whose Receive polls,
// were read into the receive buffer and copied from there
// (runtime.memmove, 6.5 µs of the receiving process per message, perf).
// The test takes the socket as a poll does (the reader asked aside) and
// holds it, draining as a poll, until every write was handled: all are
// placed, since reads stop at placeTailTCP once large writes come (set
// from the start); the receives complete in order, with their
// immediates and bytes.
func TestPlacedByPolls(t *testing.T) {
	const n, size = 16, 64 << 10
	p, src, dst := newStreamPair(t, n*size, 249)
	qa, cqa, cha, qb := p.qa, p.cqa, p.cha, p.qb
	postRecvs(t, qb, n)
	deadline := time.Now().Add(hangGuard)
	held := takeSockets(t) // both ends of the connection are in this process
	conns := held.conns
	for _, c := range conns {
		// As after a large write: reads stop at the tail, so that the
		// first write is not taken in whole (a full read may take
		// several), and the test does not depend on how much the
		// socket holds when the drains begin.
		c.sock.placing = true
	}
	placed, byPolls := placedBy(), placedByPolls()
	wrs, sges := writeImmStream(src, dst, n, size, 9000)
	if k, err := qa.PostSend(wrs, sges); err != nil || k != n {
		t.Fatalf("post: %d, %v", k, err)
	}
	// Drain as a poll does, until every receive completed (the CQ's own
	// poll finds the connections taken and only looks at the CQ).
	var cs [4]prov.Completion
	for got := 0; got < n; {
		for _, c := range conns {
			if _, err := c.drain(false); err != nil {
				t.Fatal(err)
			}
			c.flushResps()
		}
		k, err := p.cqb.Poll(cs[:])
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs[:k] {
			if c.Status != prov.StatusSuccess || c.WRID != uint64(100+got) || c.Imm != uint32(9000+got) || c.ByteLen != size {
				t.Fatalf("receive %d: %+v", got, c)
			}
			got++
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d receives after %v", got, n, hangGuard)
		}
	}
	placed, byPolls = placedBy()-placed, placedByPolls()-byPolls
	held.releaseAll()
	t.Logf("%d of %d writes with immediate placed, %d of them by the polls", placed, n, byPolls)
	if byPolls != n || placed != n {
		t.Errorf("%d of %d 64 KiB writes with immediate placed by the polls (%d in all), want all", byPolls, n, placed)
	}
	waitCQ(t, cqa, cha, cs[:], 1)
	if !bytes.Equal(dst.b, src.b) {
		t.Fatal("the region does not hold the writes' bytes")
	}
}

// newStreamPair is a drive pair over TCP, its connection set up, with a
// source of size bytes (byte i is i mod mod) and a destination as large.
func newStreamPair(t *testing.T, size, mod int) (p *drivePair, src, dst *buf) {
	p = newDrivePair(t, "tcp")
	src, dst = p.e.alloc(size, allAccess), p.e.alloc(size, allAccess)
	for i := range src.b {
		src.b[i] = byte(i % mod)
	}
	p.sendOne(t) // sets the connection up
	return p, src, dst
}

// writeImmStream is n RDMA writes with immediate (immBase + i) of size
// bytes each, from src to dst, the i-th at i*size in both, the last
// signaled: their work requests and SGEs.
func writeImmStream(src, dst *buf, n, size int, immBase uint32) ([]prov.SendWR, []prov.SGE) {
	wrs := make([]prov.SendWR, n)
	sges := make([]prov.SGE, n)
	for i := range wrs {
		wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRWriteImm, SGEIndex: uint32(i), NumSGE: 1, Imm: immBase + uint32(i),
			RemoteAddr: dst.addr(i * size), RKey: dst.mr.RKey()}
		sges[i] = src.sge(i*size, size)
	}
	wrs[n-1].Flags = prov.SendSignaled
	return wrs, sges
}

// postRecvs posts n receives without buffers on q, WRIDs 100 on.
func postRecvs(t *testing.T, q prov.QP, n int) {
	t.Helper()
	for i := range n {
		if _, err := q.PostRecv([]prov.RecvWR{{WRID: uint64(100 + i)}}, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// takeSocket takes c's socket as a poll does (its rmu), asking the
// reader aside while it holds it.
func takeSocket(t *testing.T, c *conn) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for {
		c.polls.Add(1)
		if c.rmu.TryLock() {
			return
		}
		c.askReaderAside()
		if time.Now().After(deadline) {
			t.Fatal("the reader kept the socket")
		}
		runtime.Gosched()
	}
}

// heldSockets are sockets a test took as polls do (takeSockets).
type heldSockets struct {
	conns []*conn
	held  map[*conn]bool
}

// takeSockets takes the socket of every connection of the process'
// fabric (takeSocket): both ends of a drive pair's connection are in
// this process. The test's end gives back those still held.
func takeSockets(t *testing.T) *heldSockets {
	t.Helper()
	h := &heldSockets{held: map[*conn]bool{}}
	s := getFabric().svc.Load()
	s.mu.Lock()
	for c := range s.conns {
		h.conns = append(h.conns, c)
	}
	s.mu.Unlock()
	t.Cleanup(h.releaseAll)
	for _, c := range h.conns {
		takeSocket(t, c)
		h.held[c] = true
	}
	return h
}

// release gives c's socket back, if it is still held.
func (h *heldSockets) release(c *conn) {
	if h.held[c] {
		h.held[c] = false
		c.rmu.Unlock()
	}
}

// handOver forgets c's socket: the callee it is handed to releases it.
func (h *heldSockets) handOver(c *conn) { h.held[c] = false }

// releaseAll gives back every socket still held.
func (h *heldSockets) releaseAll() {
	for _, c := range h.conns {
		h.release(c)
	}
}

// placedByPolls is placedBy, counting the frames placed by polls and
// drives only.
func placedByPolls() uint64 {
	return sumConns(func(c *conn) uint64 { return c.nPlacedPoll.Load() })
}

// placedBy is how many frames the connections of the process' fabric
// have placed (whichever connection carries them: both ends of a drive
// pair are in this process).
func placedBy() uint64 {
	return sumConns(func(c *conn) uint64 { return c.nPlaced.Load() })
}

// TestDrivePlacesAcrossWaits: a write with immediate data larger than
// the socket's buffers arrives in pieces while the target sleeps in its
// completion channel: one drive places it all, the pieces that come after
// the first read into the region as they arrive (its waits on the socket
// go through sockRx.fillPlace), then completes the receive. The payload
// is exact and nothing else of the region is touched. (Whether those
// waits sleep or spin is not visible here: a fillPlace that read nothing
// left the drive looping on placeRun's reads, with the same result.)
func TestDrivePlacesAcrossWaits(t *testing.T) {
	for _, kind := range []string{"unix", "tcp"} {
		t.Run(kind, func(t *testing.T) {
			const size = 4 << 20 // several socket buffers
			p := newDrivePair(t, kind)
			src, dst := p.e.alloc(size, allAccess), p.e.alloc(size+8192, allAccess)
			for i := range src.b {
				src.b[i] = byte(i % 247)
			}
			var wcs [4]prov.Completion
			// Once, so that the target's CQ was fed by the connection
			// its waits drive (cq.hot), then sleeping for the write, with
			// a ctx that cannot end: the drive waits on the socket
			// without a deadline (a drive with one would end after
			// driveMax and leave the rest to the reader).
			woke, before := p.drivenWait(t, context.Background())
			if _, err := p.qb.PostRecv([]prov.RecvWR{{WRID: 7}}, nil); err != nil {
				t.Fatal(err)
			}
			placed := placedBy()
			wr := []prov.SendWR{{WRID: 9, Opcode: prov.WRWriteImm, Imm: 0xD21, NumSGE: 1, Flags: prov.SendSignaled,
				RemoteAddr: dst.addr(4096), RKey: dst.mr.RKey()}}
			if _, err := p.qa.PostSend(wr, []prov.SGE{src.sge(0, size)}); err != nil {
				t.Fatal(err)
			}
			awaitNil(t, woke, "the sleeping target never woke")
			// One drive did it all, the pieces that came after the
			// first read in its waits.
			if d := drivesNow() - before; d != 1 {
				t.Errorf("%d drives, want 1", d)
			}
			waitCQ(t, p.cqb, p.chb, wcs[:], 1)
			if c := wcs[0]; c.Status != prov.StatusSuccess || c.WRID != 7 || c.Imm != 0xD21 || c.ByteLen != size {
				t.Fatalf("receive completion %+v", c)
			}
			waitCQ(t, p.cqa, p.cha, wcs[:], 1)
			if !bytes.Equal(dst.b[4096:4096+size], src.b) || !allEq(dst.b[:4096], 0) || !allEq(dst.b[4096+size:], 0) {
				t.Fatal("the region does not hold exactly the payload")
			}
			if placedBy() == placed {
				t.Error("the payload was not placed")
			}
		})
	}
}
