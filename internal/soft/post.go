package soft

import (
	"github.com/goverbs/verbs/internal/prov"
)

// PostSend queues wrs and runs the send queue in the caller's goroutine
// (unless another goroutine is running it). Like ibv_post_send it returns
// how many requests were accepted; on error wrs[n] is the failing one and
// nothing after it is queued. Errors wrap EINVAL (invalid request or QP
// state) or ErrQueueFull/ENOMEM (send queue full).
//
// Inline payloads are copied before PostSend returns; other requests read
// their SGEs when they execute, which can be after PostSend returns (for
// example while waiting after an RNR NAK).
func (q *qp) PostSend(wrs []prov.SendWR, sges []prov.SGE) (int, error) {
	if q.closed.Load() {
		return 0, errPostSendClosed
	}
	q.smu.Lock()
	switch prov.QPState(q.state.Load()) {
	case prov.QPStateRTS, prov.QPStateSQD, prov.QPStateSQE, prov.QPStateErr:
	default:
		q.smu.Unlock()
		return 0, errPostSendState
	}
	n := 0
	var err error
	for i := range wrs {
		if err = q.enqueue(&wrs[i], sges); err != nil {
			break
		}
		n++
	}
	q.smu.Unlock()
	if n > 0 {
		q.kick()
	}
	return n, err
}

// opcodeOp maps a send opcode to its request operation; ok is false for
// opcodes the device does not support on any QP type.
func opcodeOp(op prov.WROpcode) (reqOp, bool) {
	switch op {
	case prov.WRSend:
		return opSend, true
	case prov.WRSendImm:
		return opSendImm, true
	case prov.WRWrite:
		return opWrite, true
	case prov.WRWriteImm:
		return opWriteImm, true
	case prov.WRRead:
		return opRead, true
	case prov.WRAtomicCAS:
		return opCAS, true
	case prov.WRAtomicFAA:
		return opFAA, true
	}
	return 0, false
}

// validOps is, per QP type index, the set of supported operations.
var validOps = [3]uint8{
	1<<opSend | 1<<opSendImm | 1<<opWrite | 1<<opWriteImm | 1<<opRead | 1<<opCAS | 1<<opFAA, // RC
	1<<opSend | 1<<opSendImm | 1<<opWrite | 1<<opWriteImm,                                   // UC
	1<<opSend | 1<<opSendImm, // UD
}

// enqueue validates wr and appends it to the send queue. Called with smu held.
func (q *qp) enqueue(wr *prov.SendWR, sges []prov.SGE) error {
	op, ok := opcodeOp(wr.Opcode)
	if !ok || validOps[typeIndex(q.typ)]&(1<<op) == 0 {
		return errnof(einval, "post send: opcode %d is not valid on a %s QP", wr.Opcode, typeNames[q.typ])
	}
	if int(wr.NumSGE) > q.caps.MaxSendSGE {
		return errnof(einval, "post send: %d SGEs, the QP allows %d (max_send_sge)", wr.NumSGE, q.caps.MaxSendSGE)
	}
	if uint64(wr.SGEIndex)+uint64(wr.NumSGE) > uint64(len(sges)) {
		return errSGERange
	}
	sg := sges[wr.SGEIndex : wr.SGEIndex+wr.NumSGE]
	inline := wr.Flags&prov.SendInline != 0
	switch op {
	case opRead, opCAS, opFAA:
		if inline {
			return errnof(einval, "post send: inline is valid only for sends and writes")
		}
		if op != opRead {
			if wr.NumSGE != 1 || sg[0].Length != 8 {
				return errnof(einval, "post send: an atomic operation needs exactly one 8-byte SGE")
			}
			if wr.RemoteAddr&7 != 0 {
				return errnof(einval, "post send: atomic remote address %#x is not 8-byte aligned", wr.RemoteAddr)
			}
		}
	}
	var total uint64
	if inline {
		for i := range sg {
			total += uint64(sg[i].Length)
		}
		if total > uint64(q.caps.MaxInlineData) {
			return errnof(einval, "post send: %d bytes inline, the QP allows %d (max_inline_data)", total, q.caps.MaxInlineData)
		}
	}
	var ud *udDest
	if q.typ == prov.QPTypeUD {
		a := q.f.lookupAH(wr.AH)
		if a == nil || a.closed.Load() {
			return errnof(einval, "post send: unknown or destroyed address handle %#x", wr.AH)
		}
		if a.pd != q.pd {
			return errnof(einval, "post send: address handle %#x belongs to another protection domain", wr.AH)
		}
		if wr.RemoteQPN > maxQPN {
			return errnof(einval, "post send: remote QPN %#x exceeds 24 bits", wr.RemoteQPN)
		}
		ud = &a.dest
		if _, ok := ud.l.(*peer); ok {
			q.setRemote()
		}
	}
	if q.sq.count == q.sq.depth {
		return q.sqFull
	}
	q.allocSend()
	i := q.sq.head + q.sq.count
	if i >= q.sq.depth {
		i -= q.sq.depth
	}
	w := &q.sq.slots[i]
	w.wr = *wr
	w.op = op
	w.ud = ud
	w.isInline = inline
	if inline {
		if w.inline == nil {
			w.inline = make([]byte, 0, q.caps.MaxInlineData)
		}
		b := w.inline[:0]
		for j := range sg {
			if sg[j].Length > 0 {
				b = append(b, userBytes(sg[j].Addr, int(sg[j].Length))...)
			}
		}
		w.inline = b
		w.wr.NumSGE = 0
	} else {
		copy(w.sge, sg)
	}
	q.sq.count++
	return nil
}

// PostRecv posts receives to the QP's receive queue. In ERR they complete
// at once with WR_FLUSH_ERR.
func (q *qp) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	if q.closed.Load() {
		return 0, errPostRecvClosed
	}
	if q.srq != nil {
		return 0, errPostRecvSRQ
	}
	q.rmu.Lock()
	st := prov.QPState(q.state.Load())
	if st == prov.QPStateReset {
		q.rmu.Unlock()
		return 0, errPostRecvState
	}
	n := 0
	var err error
	for i := range wrs {
		wr := &wrs[i]
		if err = checkRecvWR(wr, sges, q.rq.maxSGE); err != nil {
			break
		}
		if st == prov.QPStateErr {
			q.rcomp = prov.Completion{WRID: wr.WRID, Status: prov.StatusWRFlushErr, Opcode: prov.WCRecv, QPN: q.qpn}
			q.rcq.push1(&q.rcomp, false)
			n++
			continue
		}
		if q.rq.full() {
			err = q.rqFull
			break
		}
		q.rq.push(wr, sges)
		n++
	}
	var ws []waker
	if n > 0 && len(q.waiters) > 0 {
		ws, q.waiters = q.waiters, nil
	}
	q.rmu.Unlock()
	for _, w := range ws {
		w.wake()
	}
	return n, err
}
