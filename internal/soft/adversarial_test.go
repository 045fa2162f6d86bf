package soft

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// An authenticated peer that sends well-framed but hostile requests to a
// QP of this process (the raw peer of amplify_test.go, posing as the QP
// the target is connected to): every one is refused as verbs require,
// and no byte outside what the request may touch changes.

// one sends a request of op (no segments) with payload n bytes of pattern
// and the atomic operands; the PSN moves past it.
func (p *rawPeer) one(t *testing.T, op reqOp, raddr uint64, rkey uint32, n uint32, compare, swap uint64) uint64 {
	t.Helper()
	req, id := p.msg(op, raddr, rkey, int(n))
	req.compare, req.swap = compare, swap
	plen := 0
	if hasPayload(op) {
		plen = int(n)
	}
	b := make([]byte, hdrLen+reqBodyLen+plen)
	putHdr(b, frReq, uint32(reqBodyLen+plen), id)
	putReq(b[hdrLen:], &req, p.flags())
	for i := range plen {
		b[hdrLen+reqBodyLen+i] = pattern(i)
	}
	if _, err := p.nc.Write(b); err != nil {
		t.Fatalf("write request: %v", err)
	}
	return id
}

// advTarget is a hostile peer of a target QP, with regions the target
// may not reach: one in another PD, and regions of its PD without some
// remote access right. Every region is filled with a known pattern.
type advTarget struct {
	*hostile
	p       *rawPeer
	otherPD *buf // allAccess, in another PD of the same context
	roMR    *buf // remote read only
	woMR    *buf // remote write only
	noAtom  *buf // remote read and write, no atomics
}

func newAdvTarget(t *testing.T) *advTarget {
	t.Helper()
	h := newHostile(t)
	pd2 := must(h.e.ctx.AllocPD())
	t.Cleanup(func() {
		if err := pd2.Close(); err != nil {
			t.Errorf("close pd: %v", err)
		}
	})
	a := &advTarget{hostile: h, p: h.peer(),
		otherPD: allocIn(t, pd2, 4096, allAccess),
		roMR:    h.e.alloc(4096, prov.AccessLocalWrite|prov.AccessRemoteRead),
		woMR:    h.e.alloc(4096, prov.AccessLocalWrite|prov.AccessRemoteWrite),
		noAtom:  h.e.alloc(4096, prov.AccessLocalWrite|prov.AccessRemoteWrite|prov.AccessRemoteRead),
	}
	for i := range h.page {
		h.page[i] = byte(i*13 + 1)
	}
	for _, b := range a.bufs() {
		for i := range b.b {
			b.b[i] = byte(i*5 + 3)
		}
	}
	return a
}

func (a *advTarget) bufs() []*buf { return []*buf{a.otherPD, a.roMR, a.woMR, a.noAtom} }

// snapshot copies every byte the target's process holds for the test.
func (a *advTarget) snapshot() [][]byte {
	s := [][]byte{bytes.Clone(a.page)}
	for _, b := range a.bufs() {
		s = append(s, bytes.Clone(b.b))
	}
	return s
}

func (a *advTarget) changed(before [][]byte) bool {
	now := a.snapshot()
	for i := range now {
		if !bytes.Equal(now[i], before[i]) {
			return true
		}
	}
	return false
}

// TestAdversarialOneSided: one-sided requests of an authenticated peer
// with keys of other protection domains, without the access right, at
// the edges of a region, misaligned or wrapping around. A refused one is
// NAKed with the code verbs gives (remote access error, invalid request)
// and moves the target to ERR; nothing changes in memory.
func TestAdversarialOneSided(t *testing.T) {
	end := func(a *advTarget) uint64 { return a.mr.Addr() + uint64(a.mr.Len()) }
	type reqSpec struct {
		op    reqOp
		raddr uint64
		rkey  uint32
		n     uint32
	}
	for _, tc := range []struct {
		name string
		req  func(a *advTarget) reqSpec
		want respCode
	}{
		{"WriteOtherPD", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, a.otherPD.addr(0), a.otherPD.mr.RKey(), 64}
		}, respAccess},
		{"ReadOtherPD", func(a *advTarget) reqSpec {
			return reqSpec{opRead, a.otherPD.addr(0), a.otherPD.mr.RKey(), 64}
		}, respAccess},
		{"AtomicOtherPD", func(a *advTarget) reqSpec {
			return reqSpec{opFAA, a.otherPD.addr(0), a.otherPD.mr.RKey(), 8}
		}, respAccess},
		{"WriteReadOnlyRegion", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, a.roMR.addr(0), a.roMR.mr.RKey(), 64}
		}, respAccess},
		{"WriteImmReadOnlyRegion", func(a *advTarget) reqSpec {
			return reqSpec{opWriteImm, a.roMR.addr(0), a.roMR.mr.RKey(), 64}
		}, respAccess},
		{"ReadWriteOnlyRegion", func(a *advTarget) reqSpec {
			return reqSpec{opRead, a.woMR.addr(0), a.woMR.mr.RKey(), 64}
		}, respAccess},
		{"AtomicWithoutAtomicAccess", func(a *advTarget) reqSpec {
			return reqSpec{opCAS, a.noAtom.addr(0), a.noAtom.mr.RKey(), 8}
		}, respAccess},
		{"WriteOneBytePastTheEnd", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, end(a) - 99, a.mr.RKey(), 100}
		}, respAccess},
		{"WriteAtTheEnd", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, end(a), a.mr.RKey(), 1}
		}, respAccess},
		{"ReadOneBytePastTheEnd", func(a *advTarget) reqSpec {
			return reqSpec{opRead, end(a) - 99, a.mr.RKey(), 100}
		}, respAccess},
		{"ReadWrapsAround", func(a *advTarget) reqSpec {
			return reqSpec{opRead, ^uint64(0) - 63, a.mr.RKey(), 4096}
		}, respAccess},
		{"WriteMessagePastTheEnd", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, a.mr.Addr() + 8, a.mr.RKey(), maxMsgSize}
		}, respAccess},
		{"WriteBadKey", func(a *advTarget) reqSpec {
			return reqSpec{opWrite, a.mr.Addr(), a.mr.RKey() ^ 0x5a5a5a5a, 64}
		}, respAccess},
		{"AtomicMisaligned", func(a *advTarget) reqSpec {
			return reqSpec{opFAA, a.mr.Addr() + 4, a.mr.RKey(), 8}
		}, respInvReq},
		{"AtomicAtTheEnd", func(a *advTarget) reqSpec {
			return reqSpec{opCAS, end(a), a.mr.RKey(), 8}
		}, respAccess},
		{"AtomicBeforeTheStart", func(a *advTarget) reqSpec {
			return reqSpec{opFAA, a.mr.Addr() - 8, a.mr.RKey(), 8}
		}, respAccess},
		{"AtomicHighAddress", func(a *advTarget) reqSpec {
			return reqSpec{opFAA, ^uint64(0) - 7, a.mr.RKey(), 8}
		}, respAccess},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAdvTarget(t)
			r := tc.req(a)
			if r.op == opWrite && r.n == maxMsgSize {
				// A message that would run past 2^64: its first segment.
				req, id := a.p.msg(r.op, r.raddr, r.rkey, int(r.n))
				a.p.seg(t, &req, id, 0)
			} else {
				a.p.one(t, r.op, r.raddr, r.rkey, r.n, 1, 2)
			}
			if n, resp := a.p.readData(t); resp.code != tc.want || n != 0 {
				t.Fatalf("response %d with %d bytes, want %d", resp.code, n, tc.want)
			}
			// The NAK moved the target to ERR: what follows is dropped.
			probe(t, a.p, respDropped)
			if st := state(t, a.q.qp); st != prov.QPStateErr {
				t.Fatalf("target in state %v, want ERR", st)
			}
			b := newAdvTargetBaseline(a)
			if a.changed(b) {
				t.Fatal("memory changed")
			}
		})
	}
}

// newAdvTargetBaseline is what a's memory held before any request.
func newAdvTargetBaseline(a *advTarget) [][]byte {
	page := make([]byte, len(a.page))
	for i := range page {
		page[i] = byte(i*13 + 1)
	}
	s := [][]byte{page}
	for _, b := range a.bufs() {
		c := make([]byte, len(b.b))
		for i := range c {
			c[i] = byte(i*5 + 3)
		}
		s = append(s, c)
	}
	return s
}

// TestAdversarialEdgesAccepted: the requests at the very edges of a
// region that verbs executes: zero-length ones (whose key and address a
// responder does not check), the last byte, the last aligned word.
func TestAdversarialEdgesAccepted(t *testing.T) {
	a := newAdvTarget(t)
	want := newAdvTargetBaseline(a)
	end := a.mr.Addr() + uint64(a.mr.Len())
	mrOff := 4096 // of the region in a.page

	a.p.one(t, opWrite, end, a.mr.RKey(), 0, 0, 0)
	a.p.one(t, opWrite, 0xdead0000, 0x12345678, 0, 0, 0)
	a.p.one(t, opRead, end, a.mr.RKey(), 0, 0, 0)
	a.p.one(t, opWrite, end-1, a.mr.RKey(), 1, 0, 0)
	want[0][mrOff+a.mr.Len()-1] = pattern(0)
	for i := range 4 {
		if n, r := a.p.readData(t); r.code != respACK || n != 0 {
			t.Fatalf("request %d: response %d with %d bytes, want an ACK", i, r.code, n)
		}
	}
	a.p.data = make([]byte, 1)
	a.p.one(t, opRead, end-1, a.mr.RKey(), 1, 0, 0)
	if n, r := a.p.readData(t); r.code != respACK || n != 1 || a.p.data[0] != pattern(0) {
		t.Fatalf("read of the last byte: response %d with %d bytes (%#x)", r.code, n, a.p.data)
	}
	last := want[0][mrOff+a.mr.Len()-8:][:8]
	prior := binary.NativeEndian.Uint64(last)
	a.p.one(t, opFAA, end-8, a.mr.RKey(), 8, 5, 0)
	if r := a.p.resp(t); r.code != respACK || r.orig != prior {
		t.Fatalf("FAA on the last word: response %d, prior %#x, want an ACK with %#x", r.code, r.orig, prior)
	}
	binary.NativeEndian.PutUint64(last, prior+5)
	a.p.one(t, opCAS, a.mr.Addr(), a.mr.RKey(), 8, 0, 7) // compare fails
	first := binary.NativeEndian.Uint64(want[0][mrOff:])
	if r := a.p.resp(t); r.code != respACK || r.orig != first {
		t.Fatalf("CAS on the first word: response %d, prior %#x, want an ACK with %#x", r.code, r.orig, first)
	}
	probe(t, a.p, respACK)
	if a.changed(want) {
		t.Fatal("memory differs from the expectation")
	}
}

// TestAdversarialUDOverMTU: a UD message longer than the path MTU never
// reaches a receiver on hardware (the NIC drops a packet larger than its
// MTU; the requester refuses to post it, requester.go). A peer that sends
// one anyway over a connection must not get it delivered: it is dropped
// like a UD message whose Q_Key does not match, and the receive it would
// have consumed takes the next message.
func TestAdversarialUDOverMTU(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			restore, err := ForceTransport("auto")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(restore)
			e := newEnv(t)
			const qkey = 0x4242
			b := udQP(t, e, qkey, nil)
			mtu := int(portMTU.Bytes())
			rb := e.alloc(2*(grhLen+2*mtu), allAccess)
			postRecv(t, b.qp, 1, rb.sge(0, grhLen+2*mtu))
			postRecv(t, b.qp, 2, rb.sge(grhLen+2*mtu, grhLen+2*mtu))
			nc := rawDial(t, b.qp.Address(), network, 0xbad0bad)
			send := func(n int) {
				req := request{op: opSend, qpType: uint8(prov.QPTypeUD), srcQPN: 0x99, dstQPN: b.qp.QPN(), npkts: 1,
					mtu: uint32(mtu), length: uint32(n), qkey: qkey}
				f := make([]byte, hdrLen+reqBodyLen+n)
				putHdr(f, frReq, uint32(reqBodyLen+n), 1)
				putReq(f[hdrLen:], &req, reqNoResp)
				if _, err := nc.Write(f); err != nil {
					t.Fatal(err)
				}
			}
			send(mtu + 1)
			send(2 * mtu)
			send(100)
			if c := poll(t, b.rcq, 1)[0]; c.WRID != 1 || c.Status != prov.StatusSuccess || c.ByteLen != grhLen+100 {
				t.Fatalf("receive completion %+v, want the message of 100 bytes in receive 1", c)
			}
			expectEmpty(t, b.rcq)
		})
	}
}

// TestAdversarialCloseUnderFire: a peer streams RDMA writes (small ones,
// and large ones that the reader places straight into the region,
// place.go) into a region while the target deregisters it, then
// destroys the QP. Once the region's Close returns, not a byte of its
// memory changes, whatever the peer still sends; frames for the QP after
// its Close are answered as for no QP; nothing panics or hangs.
func TestAdversarialCloseUnderFire(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			const size = 4 * segMax
			h := newHostileOn(t, prov.QPTypeRC, size, network)
			p := h.peer()
			// The responses are read as they come, so that the
			// service never stops for a full socket.
			resps := make(chan response, 1<<16)
			rp := &rawPeer{nc: p.nc}
			go func() {
				defer close(resps)
				for {
					var hb [hdrLen + respBodyLen]byte
					if _, err := io.ReadFull(rp.nc, hb[:hdrLen]); err != nil {
						return
					}
					fh, err := parseHdr(hb[:hdrLen])
					if err != nil {
						return
					}
					if fh.typ != frResp {
						if _, err := io.CopyN(io.Discard, rp.nc, int64(fh.length)); err != nil {
							return
						}
						continue
					}
					if _, err := io.ReadFull(rp.nc, hb[hdrLen:]); err != nil {
						return
					}
					var rr response
					if _, err := parseResp(hb[hdrLen:], 0, &rr); err != nil {
						return
					}
					resps <- rr
				}
			}()
			stop := make(chan struct{})
			sent := make(chan int, 1)
			go func() {
				n := 0
				defer func() { sent <- n }()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					k := 64 << 10
					if i%3 == 0 {
						k = 100
					}
					req, id := p.msg(opWrite, h.mr.Addr()+uint64(i*4096%(size-k)), h.mr.RKey(), k)
					for off := 0; off < k; off += segMax {
						s := req
						s.off = uint32(off)
						if p.trySeg(&s, id, off) != nil {
							return
						}
					}
					n++
				}
			}()
			// Some writes land first.
			for range 8 {
				if rr, ok := <-resps; !ok || rr.code != respACK {
					t.Fatalf("response %+v (%v) before the region closed", rr, ok)
				}
			}
			closed := make(chan error, 1)
			go func() { closed <- h.mr.Close() }()
			select {
			case err := <-closed:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(hangGuard):
				t.Fatal("the region's Close hangs")
			}
			after := bytes.Clone(h.page)
			// The next write is refused (remote access error), which
			// moves the QP to ERR; the rest is dropped.
			for rr := range resps {
				if rr.code == respACK {
					continue
				}
				if rr.code != respAccess {
					t.Fatalf("response %d after the region closed, want a remote access NAK", rr.code)
				}
				break
			}
			waitState(t, h.q.qp, prov.QPStateErr)
			if err := h.q.qp.Close(); err != nil {
				t.Fatal(err)
			}
			close(stop)
			if n := <-sent; n < 8 {
				t.Fatalf("%d writes sent", n)
			}
			if !bytes.Equal(h.page, after) {
				t.Fatal("the region's memory changed after its Close returned")
			}
		})
	}
}

// trySeg is seg that returns a failed write's error instead of failing
// the test (for other goroutines than the test's).
func (p *rawPeer) trySeg(req *request, id uint64, off int) error {
	if p.buf == nil {
		p.buf = make([]byte, segMax)
	}
	n := int(req.length)
	k := min(segMax, n-off)
	for i := range p.buf[:k] {
		p.buf[i] = pattern(off + i)
	}
	s := *req
	s.off, s.more = uint32(off), off+k < n
	s.psn, s.npkts = (req.psn+uint32(off)/4096)&psnMask, max(1, uint32(k+4095)/4096)
	var h [hdrLen + reqBodyLen]byte
	putHdr(h[:], frReq, uint32(reqBodyLen+k), id)
	putReq(h[hdrLen:], &s, p.flags())
	_, err := (&net.Buffers{h[:], p.buf[:k]}).WriteTo(p.nc)
	return err
}

// TestAdversarialUCAbandonedWriteImm: on UC, a write with immediate whose
// first segment took a receive and that never ended (the peer abandons
// it) leaves that receive to the next message that consumes one, the
// oldest (responder.go). A send that takes it is scattered into that
// receive's buffer, as if the receive had just been posted.
func TestAdversarialUCAbandonedWriteImm(t *testing.T) {
	const n = 3*segMax + 100
	h := newHostileN(t, prov.QPTypeUC, 4*segMax)
	p := h.peer()
	p.uc = true
	rb := h.e.alloc(4096, allAccess)
	postRecv(t, h.q.qp, 1, rb.sge(0, 2048))
	postRecv(t, h.q.qp, 2, rb.sge(2048, 2048))
	req, id := p.msg(opWriteImm, h.mr.Addr(), h.mr.RKey(), n)
	p.seg(t, &req, id, 0)
	waitMsg(t, h.target(), true)
	// Abandoned: a send of 100 bytes begins.
	req, id = p.msg(opSend, 0, 0, 100)
	p.seg(t, &req, id, 0)
	c := poll(t, h.q.rcq, 1)[0]
	if c.WRID != 1 || c.Status != prov.StatusSuccess || c.ByteLen != 100 || c.Opcode != prov.WCRecv {
		t.Fatalf("receive completion %+v, want the send of 100 bytes in receive 1", c)
	}
	if !patternOK(rb.b[:100], 0) {
		t.Fatal("the send's bytes are not in receive 1's buffer")
	}
}

// TestAdversarialNotReadyWaiters: a QP in INIT (before RTR, when it does
// not know its destination yet) answers a RC request "not ready" and
// remembers the requester, to wake it at RTR. A peer that sends such
// requests from ever new QP numbers must not make it remember each: what
// it holds for them is bounded (and so are the wake-ups it sends at RTR).
func TestAdversarialNotReadyWaiters(t *testing.T) {
	restore, err := ForceTransport("auto")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	toInit(t, b.qp, prov.QPTypeRC, defaultConn())
	p := &rawPeer{nc: rawDial(t, b.qp.Address(), "tcp", 0x5eed), qpn: b.qp.QPN()}
	const n = 3000
	for i := range n {
		p.srcQPN = uint32(i + 1)
		p.psn = 0
		p.one(t, opWrite, 0, 0, 0, 0, 0)
	}
	for i := range n {
		if r := p.resp(t); r.code != respNotReady {
			t.Fatalf("response %d: code %d, want not ready", i, r.code)
		}
	}
	q := getFabric().qps.load(b.qp.QPN())
	q.rmu.Lock()
	held := len(q.waiters)
	q.rmu.Unlock()
	if held > 64 {
		t.Fatalf("the QP holds %d requesters to wake for %d requests of strangers", held, n)
	}
}

// TestAdversarialStrayResponses: a peer sends responses to QPs of this
// process that never sent it a request: UD and UC QPs (which get no
// responses at all), a RC QP still in INIT, and a RC QP connected within
// this process. They are dropped: nothing is queued for those QPs, whose
// requesters never look (a queued response holds its connection, and
// with it the connection's buffers, for as long as the QP lives).
func TestAdversarialStrayResponses(t *testing.T) {
	h := newHostile(t)
	ud := udQP(t, h.e, 0x77, nil)
	uc := h.e.newQP(prov.QPTypeUC, defaultCaps(), nil)
	toInit(t, uc.qp, prov.QPTypeUC, defaultConn())
	rcInit := h.e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	toInit(t, rcInit.qp, prov.QPTypeRC, defaultConn())
	_, la, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	targets := []prov.QP{ud.qp, uc.qp, rcInit.qp, la.qp}
	p := h.peer()
	for _, q := range targets {
		for i := range 8 {
			var b [hdrLen + respBodyLen]byte
			putHdr(b[:], frResp, respBodyLen, uint64(i+1))
			putResp(b[hdrLen:], q.QPN(), &response{code: respACK})
			if _, err := p.nc.Write(b[:]); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Frames are handled in order: once this is answered, they were.
	probe(t, p, respACK)
	for i, q := range targets {
		x := getFabric().qps.load(q.QPN()).x
		x.mu.Lock()
		n := len(x.resps)
		x.mu.Unlock()
		if n != 0 {
			t.Errorf("QP %d (%d): %d stray responses queued", i, q.QPN(), n)
		}
	}
}

// TestAdversarialStrangerWake: a WAKE frame tells a requester that its
// destination posted a receive or reached RTR: it retries its request at
// once, without using up a retry. Only the connection its requests go on
// may say so; another peer of the process that sends WAKE for its QP
// number (any QP's) does not make it retry (and resend its request to
// its destination) at the stranger's pace.
func TestAdversarialStrangerWake(t *testing.T) {
	h := newHostile(t)
	victim := h.e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	toInit(t, victim.qp, prov.QPTypeRC, defaultConn())
	q := getFabric().qps.load(victim.qp.QPN())
	seq := q.wakeSeq.Load()
	var w [hdrLen + wakeLen]byte
	putHdr(w[:], frWake, wakeLen, 0)
	binary.LittleEndian.PutUint32(w[hdrLen:], victim.qp.QPN())
	for range 4 {
		if _, err := h.nc.Write(w[:]); err != nil {
			t.Fatal(err)
		}
	}
	// A NAK leaves at once: the WAKE frames before it were handled.
	p := h.peer()
	p.one(t, opWrite, h.mr.Addr()+uint64(h.mr.Len()), h.mr.RKey(), 8, 0, 0)
	if r := p.resp(t); r.code != respAccess {
		t.Fatalf("response %d, want a remote access NAK", r.code)
	}
	if got := q.wakeSeq.Load(); got != seq {
		t.Fatalf("a stranger's WAKE frames woke the QP %d times", got-seq)
	}
}

// TestAdversarialWakeFromPeer is the other side of
// TestAdversarialStrangerWake: a WAKE from the connection the QP's
// requests go on wakes it. The QP waits for its destination, which
// answered "not ready", without a transport timeout: only the wake-up
// makes it send the request again.
func TestAdversarialWakeFromPeer(t *testing.T) {
	h := newHostile(t)
	rts := prov.QPAttr{State: prov.QPStateRTS, Timeout: 0, RetryCnt: 7, RNRRetry: 7, MaxRDAtomic: 16}
	must0(t, h.q.qp.Modify(&rts, prov.AttrState|prov.AttrTimeout|prov.AttrRetryCnt|prov.AttrRNRRetry|
		prov.AttrSQPSN|prov.AttrMaxQPRDAtomic))
	// The peer's write is acknowledged: the QP's requests now go on the
	// peer's connection (x.rev).
	p := h.peer()
	p.one(t, opWrite, h.mr.Addr(), h.mr.RKey(), 8, 0, 0)
	if r := p.resp(t); r.code != respACK {
		t.Fatalf("response %d, want an ACK", r.code)
	}
	postSend(t, h.q.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1}},
		[]prov.SGE{{Addr: h.mr.Addr(), Length: 8, LKey: h.mr.LKey()}})
	request := func() uint64 {
		t.Helper()
		for {
			fh, _ := readFrame(t, h.nc)
			if fh.typ == frReq {
				return fh.id
			}
		}
	}
	id := request()
	var b [hdrLen + respBodyLen]byte
	putHdr(b[:], frResp, respBodyLen, id)
	putResp(b[hdrLen:], h.qpn, &response{code: respNotReady})
	var w [hdrLen + wakeLen]byte
	putHdr(w[:], frWake, wakeLen, 0)
	binary.LittleEndian.PutUint32(w[hdrLen:], h.qpn)
	if _, err := (&net.Buffers{b[:], w[:]}).WriteTo(h.nc); err != nil {
		t.Fatal(err)
	}
	// Sent again (or the read of the frame times out: hangGuard).
	id = request()
	putHdr(b[:], frResp, respBodyLen, id)
	putResp(b[hdrLen:], h.qpn, &response{code: respACK})
	if _, err := h.nc.Write(b[:]); err != nil {
		t.Fatal(err)
	}
	if c := poll(t, h.q.scq, 1)[0]; c.WRID != 1 || c.Status != prov.StatusSuccess {
		t.Fatalf("send completion %+v", c)
	}
}
