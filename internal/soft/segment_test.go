package soft

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// The segments of large messages (wire.go, responder.go), sent by a raw
// peer to a QP of this process, or answered by one for a read of it.

// target returns the QP of h.
func (h *hostile) target() *qp { return getFabric().qps.load(h.qpn) }

// mrBytes is the MR of h.
func (h *hostile) mrBytes() []byte { return h.page[4096 : len(h.page)-4096] }

// waitMsg waits until q is receiving a message in segments (active) or
// not.
func waitMsg(t *testing.T, q *qp, active bool) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for {
		q.rmu.Lock()
		a := q.rmsg.active
		q.rmu.Unlock()
		if a == active {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the QP is not receiving a message (%v)", active)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// probe sends a write of no bytes and checks that the next response is
// its, with code want: no response came in between.
func probe(t *testing.T, p *rawPeer, want respCode) {
	t.Helper()
	req, id := p.msg(opWrite, 0, 0, 0)
	p.seg(t, &req, id, 0)
	if r := p.resp(t); r.code != want || p.lastID != id {
		t.Fatalf("probe: response %d to request %d, want %d to %d", r.code, p.lastID, want, id)
	}
}

func patternOK(b []byte, off int) bool {
	for i, x := range b {
		if x != pattern(off+i) {
			return false
		}
	}
	return true
}

func TestSegmentsFromRawPeer(t *testing.T) {
	const n = 3*segMax + 100
	t.Run("Write", func(t *testing.T) {
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		p := h.peer()
		p.write(t, h.mr.Addr()+8, h.mr.RKey(), n)
		if r := p.resp(t); r.code != respACK {
			t.Fatalf("response %d", r.code)
		}
		b := h.mrBytes()
		if !patternOK(b[8:8+n], 0) || !allEq(b[:8], 0) || !allEq(b[8+n:], 0) || !allEq(h.page[:4096], 0) {
			t.Fatal("the region does not hold exactly the message")
		}
		probe(t, p, respACK)
	})
	t.Run("RefusedRestDropped", func(t *testing.T) {
		// The first segment is refused (past the region): one NAK, the
		// other segments are dropped without an answer.
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		p := h.peer()
		req, id := p.msg(opWrite, h.mr.Addr()+segMax, h.mr.RKey(), n)
		for off := 0; off < n; off += segMax {
			p.seg(t, &req, id, off)
		}
		if r := p.resp(t); r.code != respAccess || p.lastID != id {
			t.Fatalf("response %d to %d, want a remote access NAK to %d", r.code, p.lastID, id)
		}
		probe(t, p, respDropped) // the QP is in ERR
		if !allEq(h.page, 0) {
			t.Fatal("memory changed")
		}
	})
	t.Run("SendRNRThenAgain", func(t *testing.T) {
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		p := h.peer()
		psn := p.psn
		req, id := p.msg(opSend, 0, 0, n)
		for off := 0; off < n; off += segMax {
			p.seg(t, &req, id, off)
		}
		if r := p.resp(t); r.code != respRNR || p.lastID != id {
			t.Fatalf("response %d to %d, want RNR to %d", r.code, p.lastID, id)
		}
		postRecv(t, h.q.qp, 9, prov.SGE{Addr: h.mr.Addr(), Length: 4 * segMax, LKey: h.mr.LKey()})
		p.psn = psn // the requester goes back to the message
		req, id = p.msg(opSend, 0, 0, n)
		for off := 0; off < n; off += segMax {
			p.seg(t, &req, id, off)
		}
		if r := p.resp(t); r.code != respACK || p.lastID != id {
			t.Fatalf("response %d to %d, want an ACK to %d", r.code, p.lastID, id)
		}
		if c := poll(t, h.q.rcq, 1)[0]; c.WRID != 9 || c.Status != prov.StatusSuccess || c.ByteLen != n {
			t.Fatalf("receive completion %+v", c)
		}
		if !patternOK(h.mrBytes()[:n], 0) {
			t.Fatal("received bytes differ")
		}
		probe(t, p, respACK)
	})
	t.Run("RegionClosedMidWrite", func(t *testing.T) {
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		p := h.peer()
		req, id := p.msg(opWrite, h.mr.Addr(), h.mr.RKey(), n)
		p.seg(t, &req, id, 0)
		waitMsg(t, h.target(), true)
		if err := h.mr.Close(); err != nil {
			t.Fatal(err)
		}
		for off := segMax; off < n; off += segMax {
			p.seg(t, &req, id, off)
		}
		if r := p.resp(t); r.code != respAccess || p.lastID != id {
			t.Fatalf("response %d to %d, want a remote access NAK to %d", r.code, p.lastID, id)
		}
		probe(t, p, respDropped)
		b := h.mrBytes()
		if !patternOK(b[:segMax], 0) || !allEq(b[segMax:], 0) {
			t.Fatal("not exactly the first segment written")
		}
	})
	t.Run("ReceiveBufferClosedMidSend", func(t *testing.T) {
		h := newHostileN(t, prov.QPTypeRC, 4096)
		p := h.peer()
		rb := h.e.alloc(4*segMax, allAccess)
		postRecv(t, h.q.qp, 5, rb.sge(0, 4*segMax))
		req, id := p.msg(opSend, 0, 0, n)
		p.seg(t, &req, id, 0)
		waitMsg(t, h.target(), true)
		if err := rb.mr.Close(); err != nil {
			t.Fatal(err)
		}
		for off := segMax; off < n; off += segMax {
			p.seg(t, &req, id, off)
		}
		if r := p.resp(t); r.code != respOpErr || p.lastID != id {
			t.Fatalf("response %d to %d, want a remote operational NAK to %d", r.code, p.lastID, id)
		}
		if c := poll(t, h.q.rcq, 1)[0]; c.WRID != 5 || c.Status != prov.StatusLocProtErr {
			t.Fatalf("receive completion %+v, want LOC_PROT_ERR", c)
		}
		probe(t, p, respDropped)
	})
	t.Run("MessageBeforeTheLastEnded", func(t *testing.T) {
		// Like an opcode out of sequence: invalid request; the receive
		// the unfinished send took is flushed with the others.
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		p := h.peer()
		postRecv(t, h.q.qp, 1, prov.SGE{Addr: h.mr.Addr(), Length: 4 * segMax, LKey: h.mr.LKey()})
		postRecv(t, h.q.qp, 2, prov.SGE{Addr: h.mr.Addr(), Length: 16, LKey: h.mr.LKey()})
		req, id := p.msg(opSend, 0, 0, n)
		p.seg(t, &req, id, 0)
		p.psn = req.psn + segMax/4096 // after the first segment
		probe(t, p, respInvReq)
		for i, c := range poll(t, h.q.rcq, 2) {
			if c.WRID != uint64(i+1) || c.Status != prov.StatusWRFlushErr {
				t.Fatalf("receive completion %d: %+v, want WR_FLUSH_ERR of %d", i, c, i+1)
			}
		}
	})
	t.Run("UCAbandoned", func(t *testing.T) {
		// UC: a message that never ended is dropped, and the next one
		// takes its receive (the oldest).
		h := newHostileN(t, prov.QPTypeUC, 4*segMax)
		p := h.peer()
		p.uc = true
		postRecv(t, h.q.qp, 1, prov.SGE{Addr: h.mr.Addr(), Length: 4 * segMax, LKey: h.mr.LKey()})
		postRecv(t, h.q.qp, 2, prov.SGE{Addr: h.mr.Addr(), Length: 4 * segMax, LKey: h.mr.LKey()})
		req, id := p.msg(opSend, 0, 0, n)
		p.seg(t, &req, id, 0)
		waitMsg(t, h.target(), true)
		// A write in segments between: it consumes no receive.
		p.write(t, h.mr.Addr()+segMax, h.mr.RKey(), 2*segMax+1)
		waitMsg(t, h.target(), false)
		for i, size := range []int{100, n} {
			req, id = p.msg(opSend, 0, 0, size)
			for off := 0; off < size; off += segMax {
				p.seg(t, &req, id, off)
			}
			if c := poll(t, h.q.rcq, 1)[0]; c.WRID != uint64(i+1) || c.Status != prov.StatusSuccess || int(c.ByteLen) != size {
				t.Fatalf("receive completion %+v, want %d bytes in %d", c, size, i+1)
			}
		}
		if !patternOK(h.mrBytes()[:n], 0) {
			t.Fatal("received bytes differ")
		}
	})
	t.Run("Read", func(t *testing.T) {
		h := newHostileN(t, prov.QPTypeRC, 4*segMax)
		b := h.mrBytes()
		for i := range b {
			b[i] = pattern(i)
		}
		p := h.peer()
		p.data = make([]byte, n)
		p.read(t, h.mr.Addr()+100, h.mr.RKey(), n)
		if got, r := p.readData(t); r.code != respACK || got != n || !patternOK(p.data, 100) {
			t.Fatalf("read: %d bytes, response %d", got, r.code)
		}
		probe(t, p, respACK)
	})
	t.Run("RegionClosedMidRead", func(t *testing.T) {
		// A read whose data the peer does not read at once: what the
		// socket does not take is queued; the region closes meanwhile.
		// Its data ends with a NAK.
		const size = 64 << 20
		h := newHostileN(t, prov.QPTypeRC, size)
		p := h.peer()
		p.read(t, h.mr.Addr(), h.mr.RKey(), size)
		c := connOf(t, h.target().destFabric)
		deadline := time.Now().Add(hangGuard)
		for c.queued() == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the read's response is not queued")
			}
			time.Sleep(time.Millisecond)
		}
		if err := h.mr.Close(); err != nil {
			t.Fatal(err)
		}
		got, r := p.readData(t)
		if r.code != respAccess || got >= size || got%segMax != 0 {
			t.Fatalf("read: %d bytes, response %d; want less than %d, then a remote access NAK", got, r.code, size)
		}
		t.Logf("%d MiB of %d, then the NAK", got>>20, size>>20)
	})
}

// queued is what c's send queue holds (qbytes).
func (c *conn) queued() int {
	c.qmu.Lock()
	defer c.qmu.Unlock()
	return c.qbytes
}

// connOf returns the connection of this process' service to the process
// of fabric id fabric.
func connOf(t *testing.T, fabric uint64) *conn {
	t.Helper()
	s := getFabric().svc.Load()
	deadline := time.Now().Add(hangGuard)
	for s != nil {
		s.mu.Lock()
		for c := range s.conns {
			if c.peerFab == fabric {
				s.mu.Unlock()
				return c
			}
		}
		s.mu.Unlock()
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("no connection to fabric %#x", fabric)
	return nil
}

// TestReadDataFromRawPeer: a QP of this process reads from a raw peer,
// which answers with segments of data: they land in the read's local
// SGEs; data out of order or longer than the read drops the connection
// and fails the read, and data for no read in flight is ignored.
// (The QP's response timeout is minRespTimeout.)
func TestReadDataFromRawPeer(t *testing.T) {
	const n = 2*segMax + 10
	for _, tc := range []struct {
		name string
		// answer writes the response frames to the read id.
		answer func(t *testing.T, nc net.Conn, qpn uint32, id uint64)
		want   prov.Status
	}{
		{"InOrder", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			for off := 0; off < n; off += segMax {
				readSeg(t, nc, qpn, id, off, min(segMax, n-off), off+segMax < n)
			}
		}, prov.StatusSuccess},
		{"SlowerThanTheTimeout", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			// The whole takes longer than the response timeout, each
			// segment comes well within it: the timer counts from the
			// last segment, as a NIC's from the last response packet.
			for off := 0; off < n; off += segMax {
				time.Sleep(minRespTimeout * 6 / 10)
				readSeg(t, nc, qpn, id, off, min(segMax, n-off), off+segMax < n)
			}
		}, prov.StatusSuccess},
		{"ForNoRead", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			readSeg(t, nc, qpn, id+100, 0, segMax, true)
			readSeg(t, nc, qpn, id+100, segMax, 10, false)
			for off := 0; off < n; off += segMax {
				readSeg(t, nc, qpn, id, off, min(segMax, n-off), off+segMax < n)
			}
		}, prov.StatusSuccess},
		{"OutOfOrder", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			readSeg(t, nc, qpn, id, 0, segMax, true)
			readSeg(t, nc, qpn, id, 0, segMax, true)
		}, prov.StatusRetryExcErr},
		{"TooLong", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			readSeg(t, nc, qpn, id, 0, segMax, true)
			readSeg(t, nc, qpn, id, segMax, segMax, true)
			readSeg(t, nc, qpn, id, 2*segMax, 20, false)
		}, prov.StatusRetryExcErr},
		{"TooShort", func(t *testing.T, nc net.Conn, qpn uint32, id uint64) {
			readSeg(t, nc, qpn, id, 0, segMax, true)
			readSeg(t, nc, qpn, id, segMax, 10, false)
		}, prov.StatusRetryExcErr},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileN(t, prov.QPTypeRC, 4*segMax)
			p := h.peer()
			// An acknowledged request makes the raw connection the way to
			// the peer (x.rev): the read goes there.
			probe(t, p, respACK)
			rts := prov.QPAttr{State: prov.QPStateRTS, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRDAtomic: 16}
			if err := h.q.qp.Modify(&rts, prov.AttrState|prov.AttrSQPSN|prov.AttrTimeout|prov.AttrRetryCnt|
				prov.AttrRNRRetry|prov.AttrMaxQPRDAtomic); err != nil {
				t.Fatal(err)
			}
			sges := []prov.SGE{{Addr: h.mr.Addr(), Length: 1000, LKey: h.mr.LKey()},
				{Addr: h.mr.Addr() + 2000, Length: segMax, LKey: h.mr.LKey()},
				{Addr: h.mr.Addr() + 2000 + segMax + 500, Length: n - 1000 - segMax, LKey: h.mr.LKey()}}
			wr := []prov.SendWR{{WRID: 3, Opcode: prov.WRRead, NumSGE: 3, Flags: prov.SendSignaled,
				RemoteAddr: 0x10000, RKey: 42}}
			postSend(t, h.q.qp, wr, sges)
			id := readReq(t, h.nc, n)
			tc.answer(t, h.nc, h.qpn, id)
			c := poll(t, h.q.scq, 1)[0]
			if c.WRID != 3 || c.Status != tc.want {
				t.Fatalf("read completion %+v, want status %v", c, tc.want)
			}
			if tc.want != prov.StatusSuccess {
				expectDropped(t, h.nc)
				return
			}
			b := h.mrBytes()
			got := append(append(bytes.Clone(b[:1000]), b[2000:2000+segMax]...), b[2000+segMax+500:2000+segMax+500+n-1000-segMax]...)
			if !patternOK(got, 0) {
				t.Fatal("the read's local memory does not hold its data")
			}
		})
	}
}

// readReq reads the request frame of a read of n bytes and returns its id.
func readReq(t *testing.T, nc net.Conn, n int) uint64 {
	t.Helper()
	var b [hdrLen + reqBodyLen]byte
	if _, err := io.ReadFull(nc, b[:]); err != nil {
		t.Fatal(err)
	}
	h, err := parseHdr(b[:])
	var req request
	if err == nil {
		_, err = parseReq(b[hdrLen:], 0, &req)
	}
	if err != nil || h.typ != frReq || req.op != opRead || req.length != uint32(n) {
		t.Fatalf("request %+v %+v: %v", h, req, err)
	}
	return h.id
}

// readSeg writes a segment of read data for the requester QP qpn: n
// bytes of pattern at off.
func readSeg(t *testing.T, nc net.Conn, qpn uint32, id uint64, off, n int, more bool) {
	t.Helper()
	b := make([]byte, hdrLen+respBodyLen+n)
	putHdr(b, frResp, uint32(respBodyLen+n), id)
	putResp(b[hdrLen:], qpn, &response{orig: uint64(off), more: more})
	for i := range n {
		b[hdrLen+respBodyLen+i] = pattern(off + i)
	}
	if _, err := nc.Write(b); err != nil {
		t.Fatal(err)
	}
}

// TestSegmentedMessages: messages around and above the segment size, with
// several SGEs on either side, between two QPs over every transport: the
// bytes arrive intact and in place, completions say what happened.
func TestSegmentedMessages(t *testing.T) {
	sizes := []int{segMax - 1, segMax, segMax + 1, 5*segMax + 7}
	const room = 6 * segMax
	// split cuts n bytes at off in b into three SGEs with gaps between.
	split := func(b *buf, off, n int) []prov.SGE {
		a, c := n/3, n/5
		return []prov.SGE{b.sge(off, a), b.sge(off+a+100, n-a-c), b.sge(off+n+200-c, c)}
	}
	// joined is what split's SGEs hold.
	joined := func(b *buf, off, n int) []byte {
		a, c := n/3, n/5
		return append(append(bytes.Clone(b.b[off:off+a]), b.b[off+a+100:off+n+100-c]...), b.b[off+n+200-c:off+n+200]...)
	}
	for _, kind := range xprocKinds {
		t.Run(kind, func(t *testing.T) {
			forceTransport(t, kind)
			tk := t
			for _, typ := range []prov.QPType{prov.QPTypeRC, prov.QPTypeUC} {
				e, a, b := pair(t, typ, defaultConn(), defaultConn())
				src, dst := privMem(t, e, room+4096), privMem(t, e, room+4096)
				for i := range src.b {
					src.b[i] = pattern(i)
				}
				for _, size := range sizes {
					name := fmt.Sprintf("%v/%d", typ, size)
					t.Run(name+"/write", func(t *testing.T) {
						clear(dst.b)
						postRecv(t, b.qp, 2) // first: UC drops what finds no receive
						postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWriteImm, NumSGE: 3, Flags: prov.SendSignaled,
							Imm: 77, RemoteAddr: dst.addr(10), RKey: dst.mr.RKey()}}, split(src, 0, size))
						if c := poll(t, b.rcq, 1)[0]; c.Status != prov.StatusSuccess || c.Imm != 77 || int(c.ByteLen) != size {
							t.Fatalf("receive completion %+v", c)
						}
						if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
							t.Fatalf("completion %+v", c)
						}
						if !bytes.Equal(dst.b[10:10+size], joined(src, 0, size)) || !allEq(dst.b[:10], 0) || !allEq(dst.b[10+size:], 0) {
							t.Fatal("the destination does not hold exactly the message")
						}
					})
					t.Run(name+"/send", func(t *testing.T) {
						clear(dst.b)
						if _, err := b.qp.PostRecv([]prov.RecvWR{{WRID: 3, NumSGE: 3}}, split(dst, 0, size+50)); err != nil {
							t.Fatal(err)
						}
						postSend(t, a.qp, []prov.SendWR{{WRID: 4, Opcode: prov.WRSend, NumSGE: 3, Flags: prov.SendSignaled}},
							split(src, 0, size))
						if c := poll(t, b.rcq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != 3 || int(c.ByteLen) != size {
							t.Fatalf("receive completion %+v", c)
						}
						if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
							t.Fatalf("completion %+v", c)
						}
						if got := joined(dst, 0, size+50); !bytes.Equal(got[:size], joined(src, 0, size)) || !allEq(got[size:], 0) {
							t.Fatal("received bytes differ")
						}
					})
					if typ != prov.QPTypeRC {
						continue
					}
					t.Run(name+"/read", func(t *testing.T) {
						clear(dst.b)
						postSend(t, a.qp, []prov.SendWR{{WRID: 5, Opcode: prov.WRRead, NumSGE: 3, Flags: prov.SendSignaled,
							RemoteAddr: src.addr(30), RKey: src.mr.RKey()}}, split(dst, 0, size))
						if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != 5 {
							t.Fatalf("completion %+v", c)
						}
						if !bytes.Equal(joined(dst, 0, size), src.b[30:30+size]) {
							t.Fatal("read bytes differ")
						}
					})
					t.Run(name+"/send-too-long", func(t *testing.T) {
						// LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at
						// the sender, nothing written.
						clear(dst.b)
						postRecv(t, b.qp, 6, dst.sge(0, size-1))
						postSend(t, a.qp, []prov.SendWR{{WRID: 7, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}},
							[]prov.SGE{src.sge(0, size)})
						if c := poll(t, b.rcq, 1)[0]; c.Status != prov.StatusLocLenErr {
							t.Fatalf("receive completion %+v, want LOC_LEN_ERR", c)
						}
						if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRemInvReqErr {
							t.Fatalf("completion %+v, want REM_INV_REQ_ERR", c)
						}
						if !allEq(dst.b, 0) {
							t.Fatal("bytes written")
						}
						// Both QPs are in ERR now: a new pair for the next.
						e, a, b = pair(tk, typ, defaultConn(), defaultConn())
						src2, dst2 := privMem(tk, e, room+4096), privMem(tk, e, room+4096)
						copy(src2.b, src.b)
						src, dst = src2, dst2
					})
				}
			}
		})
	}
}

// TestBufPoolBound: the buffer pool keeps at most bufPoolMax bytes, of
// buffers of its size classes only, whatever a burst put back.
func TestBufPoolBound(t *testing.T) {
	var bufs [][]byte
	for _, n := range []int{100, 5000, 70000, 1 << 18, 1<<18 + 1} {
		for range 200 {
			bufs = append(bufs, getBuf(n))
		}
	}
	for _, b := range bufs {
		putBuf(b)
	}
	p := &bufPool
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for i, l := range p.free {
		for _, b := range l {
			if cap(b) != 1<<(i+minBufShift) {
				t.Errorf("a buffer of %d bytes in the class of %d", cap(b), 1<<(i+minBufShift))
			}
			n += cap(b)
		}
	}
	if n != p.bytes || n > bufPoolMax {
		t.Errorf("the pool keeps %d bytes (counted %d), at most %d allowed", n, p.bytes, bufPoolMax)
	}
}

// TestBufPoolServesNow: a pool filled with buffers of one class keeps a
// buffer of another class given back, in their place: the next take of
// that size reuses it (once, a full pool of 4 KiB chunks made every
// 256 KiB read response segment an allocation).
func TestBufPoolServesNow(t *testing.T) {
	var small [][]byte
	for range bufPoolMax >> minBufShift {
		small = append(small, getBuf(1<<minBufShift))
	}
	for _, b := range small {
		putBuf(b)
	}
	big := getBuf(1 << maxBufShift)
	putBuf(big)
	if b := getBuf(1 << maxBufShift); &b[0] != &big[0] {
		t.Error("a full pool did not keep the 256 KiB buffer given back")
	}
	p := &bufPool
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bytes > bufPoolMax {
		t.Errorf("the pool keeps %d bytes, at most %d allowed", p.bytes, bufPoolMax)
	}
}
