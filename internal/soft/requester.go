package soft

import (
	"encoding/binary"
	"time"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// kick runs the send queue unless another goroutine is running it, in which
// case that goroutine is told to look again before it stops. The send queue
// of a QP that sends to another process runs in the QP's own goroutine,
// since a request may wait there for the peer: kick only signals it.
func (q *qp) kick() {
	if q.xproc.Load() && q.typ != prov.QPTypeRC {
		q.needWorker()
		return
	}
	q.runQueue(false)
}

// setRemote gives the QP its own goroutine, which runs the send queue
// when that may mean waiting for another process (UC and UD QPs: always;
// RC: see xreq.go). The goroutine starts when it is first needed
// (needWorker): a rank of a large world connects a QP to every other
// rank and sends on a few. Called with progMu or smu held (so not
// concurrently with Close's check).
func (q *qp) setRemote() {
	q.xproc.Store(true)
}

func (q *qp) workLoop() {
	defer close(q.workDone)
	for {
		select {
		case <-q.closing:
			return
		case <-q.workCh:
			q.runQueue(true)
		}
	}
}

// runQueue runs the send queue unless another goroutine does. mayBlock
// says whether the caller may wait for another process.
func (q *qp) runQueue(mayBlock bool) {
	for {
		if !q.progMu.TryLock() {
			q.pending.Store(true)
			// The runner may have finished between the TryLock and the
			// Store; if so, take over.
			if !q.progMu.TryLock() {
				return
			}
		}
		if q.pending.Load() {
			q.pending.Store(false)
		}
		more := q.progress(mayBlock)
		q.progMu.Unlock()
		if more {
			// Other goroutines keep the queue busy: hand the work to a
			// new goroutine so that this caller's PostSend returns.
			go q.kick()
			return
		}
		if !q.pending.Load() {
			return
		}
	}
}

// wake is called when a condition this QP waits for may have cleared (a
// receive was posted at the target, the target reached RTR).
func (q *qp) wake() {
	q.wakeSeq.Add(1)
	q.kick()
}

func (q *qp) onTimer() {
	q.timerFired.Store(true)
	q.kick()
}

// progress executes queued send work requests in order until the queue is
// empty, the head must wait (RNR, target not ready) or the QP leaves RTS.
// In ERR it flushes them. It returns true if it stopped because it did its
// share of work while others kept posting. Called with progMu held.
// Each request completes (its read data or atomic result is in local
// memory) before the next starts, so a fenced request (SendFence) waits
// for the reads and atomics before it by construction.
func (q *qp) progress(mayBlock bool) bool {
	if q.closed.Load() {
		return false
	}
	if p, ok := q.route.(*peer); ok && q.typ == prov.QPTypeRC {
		return q.progressRemote(p, mayBlock)
	}
	budget := 4*q.sq.depth + 256
	for {
		q.smu.Lock()
		n, head := q.sq.count, q.sq.head
		q.smu.Unlock()
		if n == 0 {
			if q.sqdNotify {
				q.sqdDrained()
			}
			return false
		}
		if budget <= 0 {
			return true
		}
		budget -= n
		size := q.sq.depth
		done := 0 // executed, not yet retired
		for i := 0; i < n; i++ {
			j := head + i
			if j >= size {
				j -= size
			}
			w := &q.sq.slots[j]
			var status prov.Status
			var length uint32
			switch prov.QPState(q.state.Load()) {
			case prov.QPStateErr:
				status = prov.StatusWRFlushErr
			case prov.QPStateRTS:
				if q.blocked {
					if q.wakeSeq.Load() == q.blockedSeq && !q.timerFired.Load() {
						q.commit(done)
						return false
					}
					q.blocked = false
				}
				var blocked bool
				status, length, blocked = q.execute(w)
				if blocked {
					q.commit(done)
					return false
				}
			default:
				// SQD (or SQE): no new message starts, nor one that
				// waited for its retry (rxe rewinds it: it starts
				// again in RTS).
				q.commit(done)
				if q.sqdNotify {
					q.sqdDrained()
				}
				return false
			}
			if q.retrying {
				q.stopRetry()
			}
			if status != prov.StatusSuccess || q.sigAll || w.wr.Flags&prov.SendSignaled != 0 {
				q.cbuf[q.ncbuf] = prov.Completion{WRID: w.wr.WRID, Status: status,
					Opcode: wcOpcodes[w.op], ByteLen: length, QPN: q.qpn}
				q.ncbuf++
			}
			w.ud = nil
			done++
			if status != prov.StatusSuccess && status != prov.StatusWRFlushErr {
				q.commit(done)
				done = 0
				q.fail(evQPFatal)
			} else if q.ncbuf == cbufLen {
				q.commit(done)
				done = 0
			}
		}
		q.commit(done)
	}
}

// sqdDrained reports IBV_EVENT_SQ_DRAINED (asked for by the move to SQD:
// q.sqdNotify) once the send queue has no message in progress: none in
// flight to another process (xstate.nfl), and the head not waiting to be
// sent again after an RNR NAK or a target that was not ready. As in rxe,
// such a wait counts as in progress until it ends (its timer expires or
// the target wakes the QP); the message is then not sent again before
// the QP returns to RTS. Called by the runner (progMu held) in SQD.
func (q *qp) sqdDrained() {
	if prov.QPState(q.state.Load()) != prov.QPStateSQD || q.x.nfl > 0 ||
		q.blocked && q.wakeSeq.Load() == q.blockedSeq && !q.timerFired.Load() {
		return
	}
	q.sqdNotify = false
	q.ctx.events.Push(prov.AsyncEvent{Type: evSQDrained, QPN: q.qpn, Element: prov.QP(q)})
}

var wcOpcodes = [...]prov.WCOpcode{
	opSend:     prov.WCSend,
	opSendImm:  prov.WCSend,
	opWrite:    prov.WCWrite,
	opWriteImm: prov.WCWrite,
	opRead:     prov.WCRead,
	opCAS:      prov.WCCompSwap,
	opFAA:      prov.WCFetchAdd,
}

// commit retires n executed requests from the send queue, then delivers
// their completions (so that a slot is free before its completion can be
// polled).
func (q *qp) commit(n int) {
	if n > 0 {
		q.smu.Lock()
		q.sq.head += n
		if q.sq.head >= q.sq.depth {
			q.sq.head -= q.sq.depth
		}
		q.sq.count -= n
		q.smu.Unlock()
	}
	if q.ncbuf > 0 {
		q.scq.push(q.cbuf[:q.ncbuf], false)
		q.ncbuf = 0
	}
}

// execute runs one send work request: gathers local memory, sends the
// request over the link and interprets the response. blocked means the
// request must be retried later (RNR or target not ready); otherwise
// status is its completion status and length its byte count.
func (q *qp) execute(w *sendWQE) (status prov.Status, length uint32, blocked bool) {
	op := w.op

	// Local memory.
	data, total, nlocked, st := q.gather(w)
	if st != prov.StatusSuccess {
		return st, 0, false
	}
	if total > maxMsgSize || (q.typ == prov.QPTypeUD && total > uint64(q.mtu)) {
		q.releaseLocal(nlocked)
		return prov.StatusLocLenErr, 0, false
	}
	length = uint32(total)

	// Destination.
	l, req := q.buildReq(w, length)
	if l == nil {
		// Unreachable destination: RC times out, UC/UD packets vanish.
		q.releaseLocal(nlocked)
		if q.typ == prov.QPTypeRC {
			return prov.StatusRetryExcErr, length, false
		}
		return prov.StatusSuccess, length, false
	}
	seq := q.wakeSeq.Load()
	q.resp = response{}
	l.exec(req, data, &q.resp)

	status = prov.StatusSuccess
	rc := q.typ == prov.QPTypeRC
	switch q.resp.code {
	case respACK:
		if op == opCAS || op == opFAA {
			binary.NativeEndian.PutUint64(data[0].bytes(), q.resp.orig)
		}
		if q.typ != prov.QPTypeUD {
			q.sqPSN = (q.sqPSN + req.npkts) & psnMask
			q.sqPSNPub.Store(q.sqPSN)
		}
	case respDropped, respNoQP, respSeqErr:
		if rc {
			status = prov.StatusRetryExcErr
		}
	case respNotReady:
		if rc {
			d := transportTimeout(q.attr.Timeout)
			if q.backoff(d, &q.retryLeft, d == 0, seq) {
				blocked = true
			} else {
				status = prov.StatusRetryExcErr
			}
		}
	case respRNR:
		if q.backoff(rnrDelay(q.resp.rnrTimer), &q.rnrLeft, q.attr.RNRRetry == 7, seq) {
			blocked = true
		} else {
			status = prov.StatusRNRRetryExcErr
		}
	case respInvReq:
		status = prov.StatusRemInvReqErr
	case respAccess:
		status = prov.StatusRemAccessErr
	case respOpErr:
		status = prov.StatusRemOpErr
	}
	q.releaseLocal(nlocked)
	return status, length, blocked
}

// buildReq fills q.req for w (a message of length bytes) and returns the
// link to its destination.
func (q *qp) buildReq(w *sendWQE, length uint32) (link, *request) {
	wr := &w.wr
	var l link
	req := &q.req
	if q.typ == prov.QPTypeUD {
		d := w.ud
		l = d.l
		req.dstQPN = wr.RemoteQPN
		req.qkey = wr.RemoteQKey
		if req.qkey&0x80000000 != 0 {
			req.qkey = q.attr.QKey // high bit: use the QP's own Q_Key
		}
		req.sgid, req.dgid = d.sgid, d.dgid
		req.tclass, req.hopLimit, req.flow = d.tclass, d.hopLimit, d.flow
		req.npkts = 1
	} else {
		l = q.route
		req.dstQPN = q.attr.DestQPN
		npkts := uint32(1)
		if w.op <= opRead && length > q.mtu {
			npkts = (length + q.mtu - 1) / q.mtu
		}
		req.npkts = npkts
	}
	req.op = w.op
	req.solicited = wr.Flags&prov.SendSolicited != 0
	req.psn = q.sqPSN
	req.mtu = q.mtu
	req.length = length
	req.raddr = wr.RemoteAddr
	req.rkey = wr.RKey
	req.imm = wr.Imm
	req.compare = wr.CompareAdd
	req.swap = wr.Swap
	return l, req
}

// gather resolves the local memory of w: its inline data, or its SGEs
// (checked against their MRs; the MRs are held until releaseLocal(n)).
func (q *qp) gather(w *sendWQE) (data []span, total uint64, n int, st prov.Status) {
	if w.isInline {
		if len(w.inline) > 0 {
			q.spans[0] = span{unsafe.Pointer(unsafe.SliceData(w.inline)), len(w.inline)}
			data = q.spans[:1]
		}
		return data, uint64(len(w.inline)), 0, prov.StatusSuccess
	}
	var need prov.Access
	if w.op >= opRead {
		need = prov.AccessLocalWrite // read and atomic results land here
	}
	n, total, st = q.pinLocal(w.sge[:w.wr.NumSGE], need, &q.lcache, q.spans[:], q.locked[:])
	if st != prov.StatusSuccess {
		return nil, 0, 0, st
	}
	return q.spans[:n], total, n, prov.StatusSuccess
}

// pinLocal checks the SGEs (but empty ones) against their regions, of
// this QP's PD and with the access need, and holds the regions (acquire)
// into locked and their memory into spans; it returns how many, and
// their bytes. On LOC_PROT_ERR nothing stays held. cache is the caller's
// (lookupMRCached).
func (q *qp) pinLocal(sges []prov.SGE, need prov.Access, cache **mr, spans []span, locked []*mr) (n int, total uint64, st prov.Status) {
	for _, s := range sges {
		if s.Length == 0 {
			continue
		}
		m := q.f.lookupMRCached(s.LKey, cache)
		var p unsafe.Pointer
		ok := m != nil && m.pd == q.pd && m.access&need == need
		if ok {
			p, ok = m.acquire(s.Addr, uint64(s.Length))
		}
		if !ok {
			releaseAll(locked[:n])
			return 0, 0, prov.StatusLocProtErr
		}
		locked[n] = m
		spans[n] = span{p, int(s.Length)}
		n++
		total += uint64(s.Length)
	}
	return n, total, prov.StatusSuccess
}

func (q *qp) releaseLocal(n int) { releaseAll(q.locked[:n]) }

// releaseAll releases the regions of ms (acquire) and forgets them.
func releaseAll(ms []*mr) {
	for i, m := range ms {
		m.release()
		ms[i] = nil
	}
}

// backoff makes the head request wait after an RNR NAK or a silent target.
// A wake-up (receive posted, target ready) retries at once without using a
// retry; each expiry of the timer d uses one of *left (unless infinite).
// It returns false when the retries are exhausted.
func (q *qp) backoff(d time.Duration, left *int, infinite bool, seq uint64) bool {
	q.retrying = true
	if !q.timerArmed || q.timerFired.Load() {
		q.timerArmed = false
		if !infinite {
			if *left <= 0 {
				return false
			}
			*left--
		}
		if d > 0 {
			q.timerFired.Store(false)
			q.timerArmed = true
			if q.timer == nil {
				q.timer = time.AfterFunc(d, q.onTimer)
			} else {
				q.timer.Reset(d)
			}
		}
	}
	q.blocked = true
	q.blockedSeq = seq
	return true
}

// stopRetry ends the waiting of the head request and restores the retry
// budgets for the next one.
func (q *qp) stopRetry() {
	q.notReady = time.Time{}
	if q.timerArmed {
		q.timer.Stop()
		q.timerArmed = false
	}
	q.timerFired.Store(false)
	q.blocked = false
	q.retrying = false
	q.rnrLeft, q.retryLeft = int(q.attr.RNRRetry), int(q.attr.RetryCnt)
}

// rnrTimerMicros is the IB encoding of the RNR NAK timer.
var rnrTimerMicros = [32]uint32{655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960,
	1280, 1920, 2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
	163840, 245760, 327680, 491520}

func rnrDelay(code uint8) time.Duration {
	return time.Duration(rnrTimerMicros[code&31]) * time.Microsecond
}

// transportTimeout is the local ACK timeout 4.096µs * 2^t; 0 means
// infinite (returned as 0).
func transportTimeout(t uint8) time.Duration {
	if t == 0 {
		return 0
	}
	return time.Duration(4096<<min(t, 31)) * time.Nanosecond
}
