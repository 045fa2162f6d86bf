package soft

import (
	"encoding/binary"
	"sync/atomic"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// respond executes req at this (target) QP and fills resp. It is the
// responder of every transport: the checks a NIC does on the receive side
// happen here, at the target. Class C errors (invalid request, remote
// access) move this QP to ERR like a real responder.
func (t *qp) respond(req *request, data []span, resp *response) {
	resp.code = respACK
	t.rmu.Lock()
	toErr := t.respondLocked(req, data, resp)
	t.rmu.Unlock()
	if toErr {
		t.drainWaiters()
		t.kick() // flush the send queue
	}
}

func (t *qp) respondLocked(req *request, data []span, resp *response) bool {
	if t.closed.Load() {
		resp.code = silentOr(req, respNoQP)
		return false
	}
	switch prov.QPState(t.state.Load()) {
	case prov.QPStateRTR, prov.QPStateRTS, prov.QPStateSQD:
		t.allocResp()
	case prov.QPStateErr:
		resp.code = silentOr(req, respDropped)
		return false
	default: // RESET, INIT: packets are dropped; wake the requester at RTR
		resp.code = silentOr(req, respNotReady)
		if req.waker != nil && req.off == 0 && len(t.waiters) < maxNotReadyWaiters {
			t.waiters = addWaiter(t.waiters, req.waker)
		}
		return false
	}
	if uint8(t.typ) != req.qpType {
		resp.code = silentOr(req, respDropped)
		return false
	}
	switch t.typ {
	case prov.QPTypeRC:
		return t.respondRC(req, data, resp)
	case prov.QPTypeUC:
		return t.respondUC(req, data, resp)
	default:
		return t.respondUD(req, data, resp)
	}
}

// maxNotReadyWaiters bounds the requesters a QP in RESET or INIT
// remembers to wake at RTR. It does not know its destination yet, so any
// peer's QP may ask: one that asks from ever new QP numbers would
// otherwise make it hold (and scan, and wake) one for each. A requester
// past the bound is not woken: it tries again at its transport timeout,
// as it would on a NIC.
const maxNotReadyWaiters = 16

// silentOr is code for the first segment of a message, and no answer for
// the others (see respSilent).
func silentOr(req *request, code respCode) respCode {
	if req.off > 0 {
		return respSilent
	}
	return code
}

// Messages in segments. A message of more than segMax bytes from another
// process arrives in segments (wire.go), each written to its place in the
// target as it arrives, so the process never holds a message. The first
// segment is checked as a whole message would be (PSN, access, rkey and
// bounds of the whole message, the receive and its length) and answered
// only if refused; the QP then remembers the message (rmsg) until its last
// segment, which completes it and is answered. The segments in between
// are checked again (the region or the receive buffer may have gone
// meanwhile: the message then fails there) and answered only if refused.
// RC PSNs advance segment by segment, like packets, so a segment that
// does not continue the message (one whose first was refused: the rest
// of a NAKed message) is dropped without an answer. A RC message that
// begins before the last one ended is an invalid request (like an
// out-of-sequence opcode); a UC one drops the unfinished message.

// rmsg is the message a QP receives in segments, from its first segment
// to its last (rmu).
type rmsg struct {
	active bool
	op     reqOp
	length uint32
	next   uint32 // the offset of the next segment
	rkey   uint32 // write: the target of the whole message
	raddr  uint64
	// recv is the receive that a send or write with immediate consumes,
	// taken by its first segment (owned). A receive that a message left
	// here without ending (UC) is the oldest: the next message that
	// consumes one takes it.
	recv  takenRecv
	owned bool
}

// takenRecv is a receive work request taken from its queue.
type takenRecv struct {
	ok   bool
	wrid uint64
	pd   *pd
	n    int
	sges [maxSGE]prov.SGE
}

// begin starts receiving req (its first segment, of n bytes, was
// written), which consumed the receive wrid (if recv).
func (m *rmsg) begin(req *request, n int, recv bool, wrid uint64, sges []prov.SGE, rpd *pd) {
	m.active, m.op, m.length, m.next = true, req.op, req.length, uint32(n)
	m.rkey, m.raddr, m.owned = req.rkey, req.raddr, recv
	if recv {
		r := &m.recv
		r.ok, r.wrid, r.pd = true, wrid, rpd
		r.n = copy(r.sges[:], sges)
	}
}

// continueMsg receives a segment after the first of the message in
// progress. A segment that does not continue it is dropped silently.
func (t *qp) continueMsg(req *request, data []span, resp *response) bool {
	m := &t.rmsg
	rc := t.typ == prov.QPTypeRC
	n := spansLen(data)
	if !m.active || req.op != m.op || req.off != m.next || req.length != m.length || rc && req.psn != t.rqPSN {
		resp.code = respSilent
		return false
	}
	r := &m.recv
	switch req.op {
	case opSend, opSendImm:
		if st := t.scatter(r.sges[:r.n], r.pd, data, int(req.off), req.length, false, nil); st != prov.StatusSuccess {
			// The receive buffer went away (LOC_LEN_ERR was ruled out by
			// the first segment).
			m.active, m.owned, r.ok = false, false, false
			t.completeRecv(r.wrid, st, req, 0)
			if !rc {
				resp.code = respSilent
				return t.toErrLocked(evQPFatal)
			}
			return t.classC(resp, respOpErr, evQPFatal)
		}
	case opWrite, opWriteImm:
		p, mr := t.remote(m.rkey, m.raddr, uint64(m.length), prov.AccessRemoteWrite)
		if mr == nil || t.attr.Access&prov.AccessRemoteWrite == 0 {
			// The region went away. A write with immediate leaves its
			// receive to the next message (UC) or to the flush (RC).
			if mr != nil {
				mr.release()
			}
			m.active, m.owned = false, false
			if !rc {
				resp.code = respSilent
				return false
			}
			return t.classC(resp, respAccess, evQPAccessErr)
		}
		switch {
		case req.placed == nil:
			if rc {
				req.publishWrite() // its last bytes land now
			}
			t.rspans[0] = span{p, int(m.length)}
			copySpans(t.rspans[:1], int(req.off), data)
		case !placed(req, mr, unsafe.Add(p, req.off), data):
			mr.release()
			m.active, m.owned = false, false
			return t.classC(resp, respAccess, evQPAccessErr)
		}
		mr.release()
	}
	m.next += uint32(n)
	if rc {
		t.rqPSN = (t.rqPSN + req.npkts) & psnMask
	}
	resp.code = respACK
	if req.more {
		return false
	}
	m.active = false
	if m.owned {
		m.owned, r.ok = false, false
		t.completeRecv(r.wrid, prov.StatusSuccess, req, req.length)
	}
	return false
}

func spansLen(data []span) int {
	n := 0
	for _, s := range data {
		n += s.n
	}
	return n
}

// fromPeer reports whether req comes from the QP this connected QP is
// connected to. A responder sends its ACKs to its own destination, so a
// stranger's requests never get an answer. A request from another process
// claims its fabric id: the claim holds only if the connection's peer has
// proven that it holds the connection secret of the destination's
// endpoint (peerAuth.proves), so a process that claims another's identity
// cannot act for its QPs.
func (t *qp) fromPeer(req *request) bool {
	if req.srcQPN != t.attr.DestQPN || req.srcFabric != t.destFabric {
		return false
	}
	if req.srcConn == nil {
		return true // this process
	}
	p, ok := t.route.(*peer)
	return ok && p != nil && req.srcConn.auth.proves(&p.addr)
}

// publishWrite publishes that the acknowledgement of the write being
// handled is held, before its payload lands (conn.publishWrite;
// ackpage.go, Writes): for the last segment of a message from another
// process that is to be answered.
func (req *request) publishWrite() {
	if c := req.srcConn; c != nil && !req.more && c.rxAnswer {
		c.publishWrite(c.rxID)
	}
}

func (t *qp) respondRC(req *request, data []span, resp *response) bool {
	if !t.fromPeer(req) {
		resp.code = silentOr(req, respDropped)
		return false
	}
	if req.off > 0 {
		return t.continueMsg(req, data, resp)
	}
	if req.psn != t.rqPSN {
		resp.code = respSeqErr
		return false
	}
	if t.rmsg.active {
		// A message begins before the last one ended.
		return t.classC(resp, respInvReq, evQPReqErr)
	}
	op := req.op
	if op <= opWriteImm && req.mtu != t.mtu && req.length > min(req.mtu, t.mtu) {
		// The requester's packets do not fit this QP's path MTU.
		return t.classC(resp, respInvReq, evQPReqErr)
	}
	switch op {
	case opSend, opSendImm:
		wrid, sges, rpd, ok := t.takeRecv(req.waker)
		if !ok {
			resp.code = respRNR
			resp.rnrTimer = t.attr.MinRNRTimer
			return false
		}
		switch st := t.scatter(sges, rpd, data, 0, req.length, false, req.pull); st {
		case prov.StatusSuccess:
			if req.more {
				t.rmsg.begin(req, spansLen(data), true, wrid, sges, rpd)
			} else {
				t.completeRecv(wrid, st, req, req.length)
			}
		case prov.StatusLocLenErr:
			t.completeRecv(wrid, st, req, 0)
			return t.classC(resp, respInvReq, evQPReqErr)
		case statusPullLost:
			// Not delivered (cma.go): as if it never came.
			t.untakeRecv(wrid, sges, rpd)
			resp.code = respPullLost
			return false
		default:
			t.completeRecv(wrid, st, req, 0)
			return t.classC(resp, respOpErr, evQPFatal)
		}
	case opWrite, opWriteImm:
		if t.attr.Access&prov.AccessRemoteWrite == 0 {
			return t.classC(resp, respInvReq, evQPReqErr)
		}
		var m *mr
		if req.length > 0 {
			var p unsafe.Pointer
			if p, m = t.remote(req.rkey, req.raddr, uint64(req.length), prov.AccessRemoteWrite); m == nil {
				return t.classC(resp, respAccess, evQPAccessErr)
			}
			if req.direct && op == opWriteImm && m.serial != req.compare {
				// The requester copied the payload into a mapping of
				// another region the key once named (shm.go): not
				// executed, it goes back and maps the key again.
				m.release()
				resp.code = respStale
				return false
			}
			t.rspans[0] = span{p, int(req.length)}
		}
		var wrid uint64
		var wsges []prov.SGE
		var wpd *pd
		if op == opWriteImm {
			var ok bool
			if wrid, wsges, wpd, ok = t.takeRecv(req.waker); !ok {
				if m != nil {
					m.release()
				}
				resp.code = respRNR
				resp.rnrTimer = t.attr.MinRNRTimer
				return false
			}
		}
		if req.placed != nil && !placed(req, m, t.rspans[0].p, data) {
			if m != nil {
				m.release()
			}
			if op == opWriteImm {
				t.untakeRecv(wrid, wsges, wpd) // for the flush
			}
			return t.classC(resp, respAccess, evQPAccessErr)
		}
		if m != nil {
			// A write that is executed once its payload lands: its
			// acknowledgement is published first (ackpage.go, Writes;
			// placeStart did for a placed one).
			if !req.direct && req.placed == nil {
				req.publishWrite()
			}
			switch {
			case req.direct && op == opWriteImm: // the requester copied it (shm.go)
			case req.direct: // the requester copies (shm.go)
				resp.orig = m.serial
			case req.pull != nil: // this side reads it from the requester (cma.go)
				if r := req.pull.read(t.rspans[:1], 0); r != pullRead {
					req.srcConn.unpublish() // before anything else
					m.release()
					if op == opWriteImm {
						t.untakeRecv(wrid, wsges, wpd) // for the next message, or the flush
					}
					if r == pullLost {
						resp.code = respPullLost // not executed
						return false
					}
					return t.classC(resp, respOpErr, evQPFatal)
				}
			case req.placed == nil:
				copySpans(t.rspans[:1], 0, data)
			}
			m.release()
		}
		if req.more {
			t.rmsg.begin(req, spansLen(data), op == opWriteImm, wrid, wsges, wpd)
		} else if op == opWriteImm {
			t.completeRecv(wrid, prov.StatusSuccess, req, req.length)
		}
	case opRead:
		if t.attr.MaxDestRDAtom == 0 || t.attr.Access&prov.AccessRemoteRead == 0 {
			return t.classC(resp, respInvReq, evQPReqErr)
		}
		if req.length > 0 {
			p, m := t.remote(req.rkey, req.raddr, uint64(req.length), prov.AccessRemoteRead)
			if m == nil {
				return t.classC(resp, respAccess, evQPAccessErr)
			}
			switch {
			case req.direct: // the requester copies (shm.go)
				resp.orig = m.serial
			case req.deferRead: // the connection sends the data
				resp.src = m
			default:
				t.rspans[0] = span{p, int(req.length)}
				copySpans(data, 0, t.rspans[:1])
			}
			m.release()
		}
	case opCAS, opFAA:
		if t.attr.MaxDestRDAtom == 0 || t.attr.Access&prov.AccessRemoteAtomic == 0 {
			return t.classC(resp, respInvReq, evQPReqErr)
		}
		p, m := t.remote(req.rkey, req.raddr, 8, prov.AccessRemoteAtomic)
		if m == nil {
			return t.classC(resp, respAccess, evQPAccessErr)
		}
		if req.raddr&7 != 0 {
			m.release()
			return t.classC(resp, respInvReq, evQPReqErr) // like rxe: misaligned atomic
		}
		w := (*uint64)(p)
		switch {
		case m.fd >= 0 && op == opFAA:
			// Shared memory (Alloc): the CPU's atomics, like every
			// process mapping it.
			resp.orig = atomic.AddUint64(w, req.compare) - req.compare
		case m.fd >= 0:
			for {
				old := atomic.LoadUint64(w)
				if old != req.compare || atomic.CompareAndSwapUint64(w, old, req.swap) {
					resp.orig = old
					break
				}
			}
		case op == opFAA:
			resp.orig = dmaFetchAdd(w, req.compare) // Go memory (dma_race.go)
		default:
			resp.orig = dmaCompareSwap(w, req.compare, req.swap)
		}
		m.release()
	default:
		return t.classC(resp, respInvReq, evQPReqErr)
	}
	t.rqPSN = (t.rqPSN + req.npkts) & psnMask
	resp.code = respACK
	return false
}

// classC answers with a NAK and moves the responder QP to ERR.
func (t *qp) classC(resp *response, code respCode, ev int) bool {
	resp.code = code
	return t.toErrLocked(ev)
}

func (t *qp) respondUC(req *request, data []span, resp *response) bool {
	resp.code = respDropped // the requester does not learn the outcome
	if !t.fromPeer(req) {
		return false
	}
	if req.off > 0 {
		toErr := t.continueMsg(req, data, resp)
		resp.code = respDropped
		return toErr
	}
	// A message that never ended is dropped (its receive, if any, is
	// the next one's).
	t.rmsg.active, t.rmsg.owned = false, false
	switch req.op {
	case opSend, opSendImm:
		wrid, sges, rpd, ok := t.takeRecv(nil)
		if !ok {
			return false
		}
		st := t.scatter(sges, rpd, data, 0, req.length, false, nil)
		if st == prov.StatusSuccess {
			if req.more {
				t.rmsg.begin(req, spansLen(data), true, wrid, sges, rpd)
			} else {
				t.completeRecv(wrid, st, req, req.length)
			}
			return false
		}
		t.completeRecv(wrid, st, req, 0)
		if st == prov.StatusLocProtErr {
			return t.toErrLocked(evQPFatal)
		}
	case opWrite, opWriteImm:
		if t.attr.Access&prov.AccessRemoteWrite == 0 {
			return false
		}
		var m *mr
		if req.length > 0 {
			var p unsafe.Pointer
			if p, m = t.remote(req.rkey, req.raddr, uint64(req.length), prov.AccessRemoteWrite); m == nil {
				return false
			}
			t.rspans[0] = span{p, int(req.length)}
		}
		var wrid uint64
		var wsges []prov.SGE
		var wpd *pd
		if req.op == opWriteImm {
			var ok bool
			if wrid, wsges, wpd, ok = t.takeRecv(nil); !ok {
				if m != nil {
					m.release()
				}
				return false
			}
		}
		if m != nil {
			copySpans(t.rspans[:1], 0, data)
			m.release()
		}
		if req.more {
			// A receive it took keeps its buffer: a message that never
			// ends leaves it to the next one, which may be a send.
			t.rmsg.begin(req, spansLen(data), req.op == opWriteImm, wrid, wsges, wpd)
		} else if req.op == opWriteImm {
			t.completeRecv(wrid, prov.StatusSuccess, req, req.length)
		}
	}
	return false
}

func (t *qp) respondUD(req *request, data []span, resp *response) bool {
	resp.code = respDropped
	// A message longer than the path MTU is a packet no NIC takes: a
	// requester never sends one (execute), a hostile peer may.
	if req.qkey != t.attr.QKey || (req.op != opSend && req.op != opSendImm) || req.length > t.mtu {
		return false
	}
	wrid, sges, rpd, ok := t.takeRecv(nil)
	if !ok {
		return false
	}
	t.buildGRH(req)
	st := t.scatter(sges, rpd, data, 0, req.length, true, nil)
	if st == prov.StatusSuccess {
		t.completeRecv(wrid, st, req, req.length+grhLen)
		return false
	}
	t.completeRecv(wrid, st, req, 0)
	if st == prov.StatusLocProtErr {
		return t.toErrLocked(evQPFatal)
	}
	return false
}

// remote looks up rkey for an access of n > 0 bytes at addr needing the
// access right need. On success the MR is pinned (release it).
func (t *qp) remote(rkey uint32, addr, n uint64, need prov.Access) (unsafe.Pointer, *mr) {
	m := t.f.lookupMRCached(rkey, &t.rcache)
	if m == nil || m.pd != t.pd || m.access&need == 0 {
		return nil, nil
	}
	p, ok := m.acquire(addr, n)
	if !ok {
		return nil, nil
	}
	return p, m
}

// takeRecv consumes the next receive (from the SRQ, if any). When there is
// none, w (if not nil) is registered to be woken by the next post.
func (t *qp) takeRecv(w waker) (wrid uint64, sges []prov.SGE, rpd *pd, ok bool) {
	t.tookHeld = false
	if r := &t.rmsg.recv; r.ok {
		// Taken by a message that did not end: the oldest. (The SGEs
		// stay intact until rmu is released.)
		r.ok = false
		t.tookHeld = true
		return r.wrid, r.sges[:r.n], r.pd, true
	}
	if t.srq != nil {
		wrid, sges, ok = t.srq.take(t.rsges[:], w)
		return wrid, sges, t.srq.pd, ok
	}
	if t.rq.count == 0 {
		if w != nil {
			t.waiters = addWaiter(t.waiters, w)
		}
		return 0, nil, nil, false
	}
	// The slot stays intact until rmu is released: posts need rmu.
	wrid, sges = t.rq.front()
	t.rq.pop()
	return wrid, sges, t.pd, true
}

// untakeRecv gives back the receive wrid that takeRecv returned, for a
// message that did not consume it: the next one takes it first (rmu
// held). One from the SRQ goes back to the SRQ's front, for any of its
// QPs, if it has room.
func (t *qp) untakeRecv(wrid uint64, sges []prov.SGE, rpd *pd) {
	if t.srq != nil && !t.tookHeld && t.srq.giveBack(wrid, sges) {
		return
	}
	r := &t.rmsg.recv
	r.ok, r.wrid, r.pd = true, wrid, rpd
	r.n = copy(r.sges[:], sges)
}

// scatter writes data, the bytes of a message of length bytes from off on,
// into the receive buffer sges (after the GRH, if grh). The buffer is
// checked like hardware does: too small for the message gives
// LOC_LEN_ERR, an SGE with a bad lkey, outside its MR or without local
// write access gives LOC_PROT_ERR; in both cases nothing is written.
func (t *qp) scatter(sges []prov.SGE, rpd *pd, data []span, off int, length uint32, grh bool, pull *pullSrc) prov.Status {
	need := uint64(length)
	if grh {
		need += grhLen
	}
	var total uint64
	for i := range sges {
		total += uint64(sges[i].Length)
	}
	if total < need {
		return prov.StatusLocLenErr
	}
	n := 0
	for i := range sges {
		if need == 0 {
			break
		}
		s := &sges[i]
		if s.Length == 0 {
			continue
		}
		take := min(uint64(s.Length), need)
		m := t.f.lookupMRCached(s.LKey, &t.rcache)
		var p unsafe.Pointer
		ok := m != nil && m.pd == rpd && m.access&prov.AccessLocalWrite != 0
		if ok {
			p, ok = m.acquire(s.Addr, take)
		}
		if !ok {
			t.releaseRemote(n)
			return prov.StatusLocProtErr
		}
		t.rlocked[n] = m
		t.rspans[n] = span{p, int(take)}
		n++
		need -= take
	}
	if grh {
		g := [1]span{{unsafe.Pointer(&t.grh), grhLen}}
		copySpans(t.rspans[:n], 0, g[:])
		off += grhLen
	}
	st := prov.StatusSuccess
	if pull != nil {
		switch pull.read(t.rspans[:n], off) {
		case pullLost:
			st = statusPullLost
		case pullFailed:
			st = pullStatus
		}
	} else {
		copySpans(t.rspans[:n], off, data)
	}
	t.releaseRemote(n)
	return st
}

func (t *qp) releaseRemote(n int) {
	for i := 0; i < n; i++ {
		t.rlocked[i].release()
		t.rlocked[i] = nil
	}
}

// completeRecv delivers a receive completion to the receive CQ.
func (t *qp) completeRecv(wrid uint64, st prov.Status, req *request, byteLen uint32) {
	c := &t.rcomp
	*c = prov.Completion{WRID: wrid, Status: st, Opcode: prov.WCRecv, ByteLen: byteLen, QPN: t.qpn}
	switch req.op {
	case opSendImm:
		c.Flags |= prov.WCWithImm
		c.Imm = req.imm
	case opWriteImm:
		c.Opcode = prov.WCRecvRDMAImm
		c.Flags |= prov.WCWithImm
		c.Imm = req.imm
	}
	if t.typ == prov.QPTypeUD {
		// src_qp is defined for UD only; connected QPs report 0, as
		// rdma_rxe does.
		c.SrcQP = req.srcQPN
		c.Flags |= prov.WCWithGRH
		if infiniBand() {
			// The source LID, which ibv_create_ah_from_wc answers by.
			c.SLID = portLID(req.srcFabric)
		}
	}
	if req.srcConn != nil && st == prov.StatusSuccess && t.typ == prov.QPTypeRC {
		// The acknowledgement leaves first: the application may exit
		// as soon as it sees the completion.
		req.srcConn.ackFirst()
	}
	t.rcq.push1(c, req.solicited)
}

const grhLen = 40

// buildGRH fills t.grh with the header a RoCE v2 receiver finds in the
// first 40 bytes of a UD receive buffer: an IPv6 header, or for IPv4-mapped
// GIDs 20 unused bytes followed by the IPv4 header.
func (t *qp) buildGRH(req *request) {
	g := &t.grh
	*g = [grhLen]byte{}
	// BTH + DETH + payload (+ immediate) + ICRC, after the UDP header.
	ib := 12 + 8 + req.length + 4
	if req.op == opSendImm {
		ib += 4
	}
	if isV4Mapped(&req.sgid) && isV4Mapped(&req.dgid) {
		h := g[20:]
		h[0] = 0x45
		h[1] = req.tclass
		binary.BigEndian.PutUint16(h[2:], uint16(20+8+ib))
		binary.BigEndian.PutUint16(h[6:], 0x4000) // DF
		h[8] = req.hopLimit
		h[9] = 17 // UDP
		copy(h[12:16], req.sgid[12:])
		copy(h[16:20], req.dgid[12:])
		binary.BigEndian.PutUint16(h[10:], ipv4Checksum(h[:20]))
		return
	}
	binary.BigEndian.PutUint32(g[0:], 6<<28|uint32(req.tclass)<<20|req.flow&0xfffff)
	binary.BigEndian.PutUint16(g[4:], uint16(8+ib))
	g[6] = 17 // next header: UDP (RoCE v2)
	g[7] = req.hopLimit
	copy(g[8:24], req.sgid[:])
	copy(g[24:40], req.dgid[:])
}

func isV4Mapped(g *[16]byte) bool {
	for _, b := range g[:10] {
		if b != 0 {
			return false
		}
	}
	return g[10] == 0xff && g[11] == 0xff
}

func ipv4Checksum(h []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(h); i += 2 {
		s += uint32(h[i])<<8 | uint32(h[i+1])
	}
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}
