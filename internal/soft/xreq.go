package soft

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// The requester of a RC QP whose destination is in another process. It
// pipelines: progressRemote writes the requests of the send queue to the
// connection one after the other without waiting for their responses (the
// first x.nfl requests of the send queue are in flight), and retire
// consumes the responses, which the connection's reader queues in x,
// strictly in order, completing the requests. Like a RC NIC:
//
//   - an RNR NAK or a target that is not ready rewinds the send queue to
//     the NAKed request (go-back-N: the responder drops what follows with
//     a sequence error, and those responses are ignored), which waits and
//     is sent again;
//   - any other NAK, a lost connection or a response that does not come
//     within the transport timeout fails the oldest request in flight and
//     moves the QP to ERR, which flushes the others. The timeout counts
//     periods of the response timer in which this process ran: a tick
//     that comes more than a period late (this process, its timer or
//     whoever runs the send queue was not running) is not charged
//     (rtStalled), since a requester that did not run cannot tell its
//     peer was silent; and it restarts while the peer shows signs of
//     life (conn.alive);
//   - a fenced request (prov.SendFence) is not written until every RDMA
//     read and atomic before it has completed (its data or result is in
//     local memory), so that it can send what they fetched. Other
//     requests never wait for reads (ordering rules of RC).
//
// The payload of sends and writes is written to the socket when the
// request is posted (in segments if it is large, wire.go). The data of a
// read is copied into its local memory by the connection's consumer as its
// segments arrive (deliver: the read is registered in x.reads while in
// flight); the local memory of atomics is looked up again when the
// response arrives. Whoever runs the send queue may be the
// application (PostSend), a connection's reader or a timer, none of which
// may wait for a peer: they write a request only if the socket takes it
// (or the rest fits the connection's queue), and otherwise leave it to the
// QP's own goroutine (workLoop), which may wait.

// maxStale bounds the go-backs of a request the target found copied
// into a stale mapping (respStale): a key is remapped once per reuse.
const maxStale = 4

// maxNBFrame is the largest request frame written without the QP's
// goroutine; larger ones are written by it, straight from the registered
// memory.
const maxNBFrame = 128 << 10

// xstate is the cross-process state of a requester QP.
type xstate struct {
	frame   [hdrLen + reqBodyLen]byte
	bufs    [maxSGE + 1][]byte
	ndirect int // direct writes in flight (progMu)
	stale   int // respStale go-backs since a request last completed (progMu)
	// wrOK: a write of this QP was acknowledged since it left RESET, so
	// its destination QP accepts remote writes (progMu): a write with
	// immediate is copied before it leaves only then (shm.go).
	wrOK bool
	// ackOK: a request of this QP was acknowledged since it left RESET,
	// so its destination QP is ready for this one (progMu): before, a
	// region the peer refuses to share may be refused only because its
	// QP is not connected yet (serveMap), and the refusal is not kept
	// (importRegion).
	ackOK bool

	pullBuf  [pullHead + maxSGE*pullDesc]byte // the pieces of a pulled request (cma.go)
	pullSpan [1]span

	nfl int // requests in flight (progMu)
	// userOf is the connection this QP is registered with (written with
	// progMu held): the one its requests go on, the only one whose
	// responses it takes (conn.handleResp).
	userOf  atomic.Pointer[conn]
	rtimer  *time.Timer
	rtArmed bool // progMu
	rtFired atomic.Bool
	rtMark  uint64 // the connection's rxSeen when the timer was armed (progMu; conn.alive)
	// rtTicks counts the response timer's ticks: its starts and the ends
	// of its periods (written with progMu held). A request, or a read's
	// segment of data, is stamped with the count when it leaves, or
	// arrives: its age is then known in whole periods (see retire), which
	// costs no clock read per request.
	rtTicks atomic.Uint64
	// rtDue is when the running period of the response timer ends
	// (progMu): a tick that comes more than a period after it found
	// this process stalled (retire). rtStalls counts such ticks in a
	// row that were not charged (progMu).
	rtDue    time.Time
	rtStalls int

	// rev is the connection the destination's own requests arrive on
	// (conn.handleReq): this QP's requests go there too, so that each
	// side's acknowledgements ride on its next request (progress.go).
	rev atomic.Pointer[conn]

	mu      sync.Mutex
	resps   []rresp // queued by readers
	spare   []rresp // the other buffer of resps, while retire holds none (progMu)
	hasResp atomic.Bool
	reads   []*sendWQE // RDMA reads in flight whose data is to come (mu)
}

// rresp is a response (or the loss of a connection) for the requester.
type rresp struct {
	c    *conn
	id   uint64
	resp response
	down bool // c failed
}

// addRead registers w, an RDMA read of n > 0 bytes about to be sent on c
// as request id, to receive its data (progMu held).
func (x *xstate) addRead(w *sendWQE, c *conn, id uint64, n uint32, pull bool) {
	x.mu.Lock()
	w.rd = readSink{c: c, id: id, n: n, st: prov.StatusSuccess, pull: pull}
	x.reads = append(x.reads, w)
	x.mu.Unlock()
}

// dropRead forgets w (its response came, or it was not sent); it returns
// the data it received (progMu held).
func (x *xstate) dropRead(w *sendWQE) readSink {
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, r := range x.reads {
		if r == w {
			n := len(x.reads)
			copy(x.reads[i:], x.reads[i+1:])
			x.reads[n-1] = nil
			x.reads = x.reads[:n-1]
			break
		}
	}
	rd := w.rd
	w.rd = readSink{}
	return rd
}

// dropReads forgets every read in flight: they are abandoned (their
// data, should it come, is dropped), and nothing writes to their memory
// once it returns (progMu held).
func (x *xstate) dropReads() {
	x.mu.Lock()
	for i, w := range x.reads {
		w.rd = readSink{}
		x.reads[i] = nil
	}
	x.reads = x.reads[:0]
	x.mu.Unlock()
}

// readSink is where the data of an RDMA read in flight goes (xstate.mu).
type readSink struct {
	c    *conn // the connection and request id of the read
	id   uint64
	n    uint32      // the length of the read
	got  uint32      // the bytes received so far
	st   prov.Status // LOC_PROT_ERR: the local memory went away
	done bool        // the last segment came
	pull bool        // the request offered to pull the data (cma.go)
	last uint64      // the response timer's tick when the last segment came (xstate.rtTicks)
}

var errReadOrder = fmt.Errorf("%w: RDMA read data out of order or too long", errBadResp)

// deliver copies data, a segment of the data of the read sent as request
// id on c (off bytes into it), into the read's local memory. Data for a
// read that is no longer in flight is dropped. Called by c's consumer.
func (q *qp) deliver(c *conn, id uint64, off uint64, data []span) error {
	x := q.x
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.readOf(c, id)
	if w == nil {
		return nil
	}
	rd := &w.rd
	n := spansLen(data)
	if off != uint64(rd.got) || uint64(n) > uint64(rd.n-rd.got) {
		return errReadOrder
	}
	if rd.st == prov.StatusSuccess {
		rd.st = q.scatterRead(w, int(off), data)
	}
	rd.got += uint32(n)
	rd.done = rd.got == rd.n
	rd.last = x.rtTicks.Load()
	return nil
}

// readOf returns the read in flight sent as request id on c whose data
// has not all come, or nil (x.mu held).
func (x *xstate) readOf(c *conn, id uint64) *sendWQE {
	for _, r := range x.reads {
		if r.rd.c == c && r.rd.id == id && !r.rd.done {
			return r
		}
	}
	return nil
}

// scatterRead copies data into the local SGEs of the read w from off on,
// checking each against its region as gather does (x.mu held: the QP's
// runner, which owns the SGEs, only reads them meanwhile).
func (q *qp) scatterRead(w *sendWQE, off int, data []span) prov.Status {
	rest := spansLen(data)
	di, doff := 0, 0 // the next byte of data
	for _, s := range w.sge[:w.wr.NumSGE] {
		if rest == 0 {
			break
		}
		if off >= int(s.Length) {
			off -= int(s.Length)
			continue
		}
		k := min(int(s.Length)-off, rest)
		m := q.f.lookupMR(s.LKey)
		if m == nil || m.pd != q.pd || m.access&prov.AccessLocalWrite == 0 {
			return prov.StatusLocProtErr
		}
		p, ok := m.acquire(s.Addr+uint64(off), uint64(k))
		if !ok {
			return prov.StatusLocProtErr
		}
		dst := unsafe.Slice((*byte)(p), k)
		for o := 0; o < k; {
			src := data[di]
			c := dmaCopy(dst[o:], unsafe.Slice((*byte)(unsafe.Add(src.p, doff)), src.n-doff))
			o += c
			if doff += c; doff == src.n {
				di, doff = di+1, 0
			}
		}
		m.release()
		rest -= k
		off = 0
	}
	return prov.StatusSuccess
}

// push queues a response; it fails if the QP has far more than it could
// have asked for (a hostile peer).
func (x *xstate) push(r rresp, limit int) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if !r.down && len(x.resps) >= limit {
		return false
	}
	x.resps = append(x.resps, r)
	if !x.hasResp.Load() { // written with mu held: a store only if it changes
		x.hasResp.Store(true)
	}
	return true
}

// needWorker hands the send queue to the QP's goroutine, starting it the
// first time (once Close began, Close stands for it: it does not start).
func (q *qp) needWorker() {
	if !q.xproc.Load() {
		return // no goroutine of its own (setRemote)
	}
	q.workStart.Do(func() {
		q.workCh = make(chan struct{}, 1)
		q.workDone = make(chan struct{})
		go q.workLoop()
	})
	select {
	case q.workCh <- struct{}{}:
	default:
	}
}

type postResult uint8

const (
	postSent   postResult = iota // in flight
	postLater                    // try again later (someone will kick)
	postFailed                   // complete the request with the status
)

// progressRemote is progress for a RC QP whose destination is the peer p.
// Called with progMu held.
func (q *qp) progressRemote(p *peer, mayBlock bool) bool {
	x := q.x
	size := q.sq.depth
	budget := 4*size + 256
	for {
		q.retire()
		q.smu.Lock()
		n, head := q.sq.count, q.sq.head
		q.smu.Unlock()
		st := prov.QPState(q.state.Load())
		if st == prov.QPStateErr {
			if n == 0 {
				return false
			}
			x.nfl, x.ndirect = 0, 0
			x.dropReads()
			q.flushSQ(n, head)
			continue
		}
		if st == prov.QPStateSQD && q.sqdNotify {
			q.sqdDrained() // after retire: once the last in flight completed
		}
		if n == 0 || x.nfl >= n || st != prov.QPStateRTS {
			return false
		}
		if budget <= 0 {
			return true
		}
		budget--
		if q.blocked {
			if x.nfl > 0 || q.wakeSeq.Load() == q.blockedSeq && !q.timerFired.Load() {
				return false
			}
			q.blocked = false
		}
		j := head + x.nfl
		if j >= size {
			j -= size
		}
		w := &q.sq.slots[j]
		if w.wr.Flags&prov.SendFence != 0 && q.readsInFlight(head) {
			// Fenced: it starts once the reads and atomics before it
			// have completed (retire kicks the queue again).
			return false
		}
		res, status := q.postRemote(p, w, mayBlock)
		switch res {
		case postSent:
			if x.nfl++; x.nfl >= n {
				// All sent that was queued when it looked: what was
				// posted or answered since kicks the queue again
				// (runQueue's pending), so not another look now.
				return false
			}
		case postLater:
			return false
		case postFailed:
			// Only the head fails this way (nothing in flight).
			q.errReported = true
			q.cbuf[q.ncbuf] = prov.Completion{WRID: w.wr.WRID, Status: status, Opcode: wcOpcodes[w.op], QPN: q.qpn}
			q.ncbuf++
			q.commit(1)
			q.fail(evQPFatal)
		}
	}
}

// readsInFlight reports whether an RDMA read or atomic is among the
// requests in flight, the x.nfl from head on (progMu held).
func (q *qp) readsInFlight(head int) bool {
	size := q.sq.depth
	for i := 0; i < q.x.nfl; i++ {
		j := head + i
		if j >= size {
			j -= size
		}
		if q.sq.slots[j].op >= opRead {
			return true
		}
	}
	return false
}

// flushSQ completes the n requests from head with WR_FLUSH_ERR; the
// first with RETRY_EXC_ERR if the QP went to ERR because its peer's
// process is gone and no request failed before (qp.peerLost).
func (q *qp) flushSQ(n, head int) {
	size := q.sq.depth
	done := 0
	first := prov.StatusWRFlushErr
	if q.peerLost.Swap(false) && !q.errReported && n > 0 {
		first = prov.StatusRetryExcErr
		q.errReported = true
	}
	for i := 0; i < n; i++ {
		j := head + i
		if j >= size {
			j -= size
		}
		w := &q.sq.slots[j]
		st := prov.StatusWRFlushErr
		if i == 0 {
			st = first
		}
		q.cbuf[q.ncbuf] = prov.Completion{WRID: w.wr.WRID, Status: st, Opcode: wcOpcodes[w.op], QPN: q.qpn}
		q.ncbuf++
		w.leave()
		done++
		if q.ncbuf == cbufLen {
			q.commit(done)
			done = 0
		}
	}
	q.commit(done)
}

// pickConn returns the connection for the next request to p: the one
// the requests in flight went on (they stay in order), else the one the
// destination's requests arrive on (x.rev), else p's own. nil: none is up.
func (q *qp) pickConn(p *peer) *conn {
	x := q.x
	if c := x.userOf.Load(); x.nfl > 0 && c != nil && !c.dead.Load() {
		return c
	}
	if c := q.revConn(p); c != nil {
		return c
	}
	return p.current()
}

// revConn returns the connection the destination's requests arrive on
// (x.rev) if it is up and may carry requests to p; nil otherwise. Safe
// without progMu.
func (q *qp) revConn(p *peer) *conn {
	if c := q.x.rev.Load(); c != nil && !c.dead.Load() && c.peerFab == p.key.fabric && kindAllowed(p.key.kind, c.kind) && c.auth.proves(&p.addr) {
		return c
	}
	return nil
}

// kindAllowed reports whether a connection of kind suits the transport
// choice tr.
func kindAllowed(tr string, kind uint8) bool {
	switch tr {
	case transportTCP:
		return kind == kindTCP
	case transportUnix:
		return kind == kindUnix
	case transportShm:
		return kind == kindShm
	}
	return true
}

// postRemote writes w to the peer.
func (q *qp) postRemote(p *peer, w *sendWQE, mayBlock bool) (postResult, prov.Status) {
	x := q.x
	c := q.pickConn(p)
	if c == nil {
		if !mayBlock {
			q.needWorker()
			return postLater, 0
		}
		if c = p.conn(); c == nil {
			if x.nfl > 0 {
				return postLater, 0
			}
			return postFailed, prov.StatusRetryExcErr
		}
	}
	// A large write or read on a region the peer shares becomes a direct
	// copy (shm.go). Other requests wait until the direct writes before them
	// are copied. A large write with immediate is copied now (pre), before
	// its request leaves, and waits like those others; only once a write
	// of the QP was acknowledged (wrOK: the target may refuse remote
	// writes, which it checks first).
	var imp *mrImport
	if c.shm != nil && (w.op == opWrite || w.op == opRead || w.op == opWriteImm && x.wrOK) && !w.isInline && w.wr.NumSGE > 0 {
		var n uint64
		for _, s := range w.sge[:w.wr.NumSGE] {
			n += uint64(s.Length)
		}
		if n >= directMin {
			if imp = c.importRegion(w.wr.RKey, false, x.ackOK, 0); imp == nil {
				if !mayBlock {
					q.needWorker()
					return postLater, 0
				}
				imp = c.importRegion(w.wr.RKey, true, x.ackOK, q.respTimeout())
			}
			raddr := w.wr.RemoteAddr
			if imp != nil && (imp.mem == nil || w.op != opRead && !imp.writable ||
				raddr < imp.addr || n > imp.length || raddr-imp.addr > imp.length-n) {
				imp = nil
			}
			if imp != nil && w.op == opWriteImm && !mayBlock && n > maxNBFrame {
				// PostSend copies at most what it would write.
				q.needWorker()
				return postLater, 0
			}
		}
	}
	pre := imp != nil && w.op == opWriteImm
	if (imp == nil || pre) && x.ndirect > 0 {
		return postLater, 0
	}
	data, total, nlocked, st := q.gather(w)
	if st == prov.StatusSuccess && total > maxMsgSize {
		q.releaseLocal(nlocked)
		st = prov.StatusLocLenErr
	}
	if st != prov.StatusSuccess {
		if x.nfl > 0 {
			return postLater, 0 // fail it once the requests before it are done
		}
		return postFailed, st
	}
	if pre && !c.copyDirect(imp, w.wr.RemoteAddr, data, true) {
		imp, pre = nil, false // unmapped meanwhile: through the peer
	}
	length := uint32(total)
	_, req := q.buildReq(w, length)
	plen := 0
	var flags uint8
	switch {
	case imp != nil:
		flags = reqDirect
		if pre {
			req.compare = imp.serial // the target checks it names the region
		}
	case c.pullable(w, total):
		// The peer reads the bytes from here (cma.go).
		flags = reqPull
		data = x.pullPieces(w, data, q.locked[:nlocked])
		plen = data[0].n
	case req.op == opRead && c.pullsReads(total):
		flags = reqPull // this side may read the data there
	case hasPayload(req.op):
		plen = int(length)
	}
	if !mayBlock && hdrLen+reqBodyLen+plen > maxNBFrame {
		q.releaseLocal(nlocked)
		q.needWorker()
		return postLater, 0
	}
	if u := x.userOf.Load(); u != c {
		if u != nil {
			u.removeUser(q)
		}
		x.userOf.Store(nil)
		if !c.addUser(q) {
			q.releaseLocal(nlocked)
			if x.nfl > 0 {
				return postLater, 0
			}
			return postFailed, prov.StatusRetryExcErr
		}
		x.userOf.Store(c)
	}
	id := c.nextID.Add(1)
	isRead := req.op == opRead && imp == nil && length > 0
	if isRead {
		// Before the request: its data may come before the write returns.
		x.addRead(w, c, id, length, flags&reqPull != 0)
	}
	ok := true
	var err error
	timeout := q.respTimeout()
	if mayBlock {
		wt := timeout
		if wt == 0 {
			wt = writeTimeout
		}
		err = c.writeReq(x, req, flags, id, data, plen, wt)
	} else {
		bufs := x.reqFrame(req, flags, id, data, plen)
		ok, err = c.trySendFrame(bufs)
		clear(bufs)
	}
	q.releaseLocal(nlocked)
	if err == nil && !ok {
		if isRead {
			x.dropRead(w)
		}
		q.needWorker()
		return postLater, 0
	}
	// On a write error the connection has failed and queued a "down"
	// record for this QP, which fails the request like a lost response.
	w.fid, w.fconn, w.fpsn, w.fnpkts, w.flen = id, c, q.sqPSN, req.npkts, length
	w.fseq = q.wakeSeq.Load()
	w.fcut = err != nil
	w.fimp, w.fpre = imp, nil
	if pre {
		w.fimp, w.fpre = nil, imp // copied: nothing to do on its ACK
	}
	if w.fimp != nil {
		x.ndirect++
	}
	q.sqPSN = (q.sqPSN + req.npkts) & psnMask
	q.sqPSNPub.Store(q.sqPSN)
	if x.nfl == 0 {
		x.rtMark = c.rxSeen.Load() // signs of life count from here (conn.alive)
	}
	if timeout > 0 && !x.rtArmed {
		q.armRespTimer(timeout, true)
	}
	w.ftick = x.rtTicks.Load() // after the arm: it left after that tick
	return postSent, 0
}

// rtPeriods is how many periods of the response timer make a response
// timeout d: the timer ticks every d/rtPeriods while requests are in
// flight, and a request is late once rtPeriods whole periods passed
// since it left, which is between d and d×(rtPeriods+1)/rtPeriods after
// it left (as a NIC's timer, whose granularity is coarse too).
const rtPeriods = 4

// maxRTStalls bounds how many ticks in a row of the response timer may
// be found stalled and not charged (retire): a requester that is late
// for every tick (a host so loaded that this process waits more than a
// period for each turn) still finds a silent peer dead, after at most
// maxRTStalls/rtPeriods more timeouts.
const maxRTStalls = 4 * rtPeriods

// armRespTimer starts the response timer (progMu held): a tick now
// unless charge is false (the period that ended is not counted), the
// next one a period of the timeout d later.
func (q *qp) armRespTimer(d time.Duration, charge bool) {
	x := q.x
	x.rtArmed = true
	x.rtFired.Store(false)
	if charge {
		x.rtTicks.Add(1)
	}
	p := d / rtPeriods
	x.rtDue = time.Now().Add(p)
	if x.rtimer == nil {
		x.rtimer = time.AfterFunc(p, func() {
			if late := q.f.testTickLate.Load(); late > 0 {
				time.Sleep(time.Duration(late)) // a late timer (tests)
			}
			x.rtFired.Store(true)
			q.kick()
		})
	} else {
		x.rtimer.Reset(p)
	}
}

// rtStalled reports whether the tick of the response timer being
// handled (progMu held) comes more than a period of the timeout d late:
// this process (its timer, or whoever runs the send queue) did not run
// for that long, and cannot tell whether its peer was silent meanwhile.
// Such a tick is not charged (maxRTStalls in a row at most).
func (q *qp) rtStalled(d time.Duration) bool {
	x := q.x
	if time.Since(x.rtDue) <= d/rtPeriods || x.rtStalls >= maxRTStalls {
		x.rtStalls = 0
		return false
	}
	x.rtStalls++
	return true
}

// retire consumes the queued responses. Called with progMu held.
func (q *qp) retire() {
	x := q.x
	if !x.hasResp.Load() && !x.rtFired.Load() {
		return
	}
	x.mu.Lock()
	rs := x.resps
	x.resps, x.spare = x.spare[:0], nil
	x.hasResp.Store(false)
	x.mu.Unlock()
	retired := 0
	failed := false
	for i := range rs {
		r := &rs[i]
		if !failed {
			failed = q.retireOne(r, &retired)
		}
		rs[i] = rresp{}
	}
	x.spare = rs[:0] // only retire uses it (progMu)
	if x.rtFired.Load() && !failed {
		x.rtFired.Store(false)
		x.rtArmed = false
		if x.nfl > 0 {
			w := q.flight(retired)
			d := q.respTimeout()
			sent := w.ftick
			if w.op == opRead {
				// As a NIC's timer restarts with each response packet:
				// from the last segment of data.
				x.mu.Lock()
				sent = max(sent, w.rd.last)
				x.mu.Unlock()
			}
			// The ticks after sent are a period apart (or more, when
			// the timer runs late): after this one (now), at least
			// now-sent-1 whole periods passed since the request left.
			now := x.rtTicks.Load() + 1
			switch {
			case d <= 0:
			case q.rtStalled(d):
				// This process stalled: the period that ended does
				// not count (it merges with the next one), so that
				// the stall is not taken for the peer's silence.
				q.armRespTimer(d, false)
			case now-sent-1 < rtPeriods:
				q.armRespTimer(d, true)
			case w.fconn != nil && w.fconn.alive(&x.rtMark):
				// The peer is alive but slow, or this process was
				// (conn.alive): a timer restarted by its signs of life.
				q.armRespTimer(d, true)
				w.ftick = x.rtTicks.Load()
			default:
				q.failFlight(w, prov.StatusRetryExcErr, &retired)
				failed = true
			}
		}
	}
	// With nothing in flight the timer is left to run out (it finds
	// nothing to fail): stopping it here and starting it again for the
	// next request would cost two timer operations per request in a
	// ping-pong.
	q.commit(retired)
	if failed {
		q.fail(evQPFatal)
	}
}

// flight returns the k-th request in flight after the retired ones.
func (q *qp) flight(retired int) *sendWQE {
	j := q.sq.head + retired
	if j >= q.sq.depth {
		j -= q.sq.depth
	}
	return &q.sq.slots[j]
}

// goBack makes w, the oldest request in flight, the next to go again;
// the requests in flight after it are dropped (the target did not move
// on: they come again after it). progMu held.
func (q *qp) goBack(w *sendWQE) {
	q.sqPSN = w.fpsn
	q.sqPSNPub.Store(q.sqPSN)
	q.x.nfl, q.x.ndirect = 0, 0
	q.x.dropReads()
}

// failFlight completes the oldest request in flight with status and
// abandons the others (the QP is about to go to ERR).
func (q *qp) failFlight(w *sendWQE, status prov.Status, retired *int) {
	q.errReported = true
	q.cbuf[q.ncbuf] = prov.Completion{WRID: w.wr.WRID, Status: status, Opcode: wcOpcodes[w.op], QPN: q.qpn}
	q.ncbuf++
	w.leave()
	*retired++
	q.x.nfl, q.x.ndirect = 0, 0
	q.x.dropReads()
	if q.ncbuf == cbufLen {
		q.commit(*retired)
		*retired = 0
	}
}

// patientNotReady reports whether a target that is not ready yet (its QP
// still in RESET or INIT) may be waited for without using up the retry
// count: its process runs on this host (peerlife.go), and has been
// waited for less than handshakeMax. The peer answered, so it is alive;
// on a host with many more busy processes than processors it may take
// longer than retry_cnt transport timeouts to move its QPs to RTR after
// telling its endpoints (a job's hundreds of ranks connecting at once). A
// NIC would drop the packets and retry; soft0 knows the peer is there.
func (q *qp) patientNotReady(c *conn) bool {
	now := time.Now()
	if !q.retrying || q.notReady.IsZero() {
		q.notReady = now
	}
	return now.Sub(q.notReady) < handshakeMax && c.life.ranWithin(localQuiet)
}

// retireOne applies one response to the oldest request in flight. It
// reports whether the request failed (the QP must go to ERR).
func (q *qp) retireOne(r *rresp, retired *int) bool {
	x := q.x
	if x.nfl == 0 {
		return false
	}
	w := q.flight(*retired)
	if r.down {
		if w.fconn != r.c {
			return false
		}
		// The peer held the acknowledgements of the requests up to
		// peerAcked when the connection went (ackpage.go): those were
		// executed. The first one after them failed. Not so a request
		// whose frame this side did not write whole (its write failed:
		// the connection failed on this side, and a write whose
		// placement began was published), nor an atomic, whose result
		// the word does not carry: those fail (a write that never left
		// whole completed as a success, a compare-and-swap with a prior
		// value of 0 made up: TestPeerAckedNotSent, TestPeerAckedAtomic).
		for r.c.acks != nil && w.fid <= r.c.peerAcked && !w.fcut && w.op != opCAS && w.op != opFAA {
			ack := rresp{c: r.c, id: w.fid}
			if q.retireOne(&ack, retired) {
				return true
			}
			if x.nfl == 0 {
				return false
			}
			if w = q.flight(*retired); w.fconn != r.c {
				return false
			}
		}
		q.failFlight(w, prov.StatusRetryExcErr, retired)
		return true
	}
	if r.id != w.fid || r.c != w.fconn {
		return false // a response to a request that was abandoned
	}
	status := prov.StatusSuccess
	switch r.resp.code {
	case respACK:
		w.fpre = nil
		x.ackOK = true
		if w.op.isWrite() {
			x.wrOK = true
		}
		if w.fimp != nil {
			data, _, n, st := q.gather(w)
			if st != prov.StatusSuccess {
				status = st
			} else if r.resp.orig != w.fimp.serial {
				r.c.dropImport(w.wr.RKey, w.fimp)
				status = prov.StatusRetryExcErr
			} else if !r.c.copyDirect(w.fimp, w.wr.RemoteAddr, data, w.op == opWrite) {
				status = prov.StatusRetryExcErr
			}
			q.releaseLocal(n)
			w.fimp = nil
			x.ndirect--
		} else if w.op == opRead {
			// The data came before (deliver).
			rd := x.dropRead(w)
			switch {
			case rd.got != w.flen:
				r.c.fail(errBadReadResp)
				status = prov.StatusRetryExcErr
			case w.flen > 0 && rd.st != prov.StatusSuccess:
				status = rd.st
			}
		} else if w.op > opRead {
			data, _, n, st := q.gather(w)
			if st != prov.StatusSuccess {
				status = st
			} else {
				binary.NativeEndian.PutUint64(data[0].bytes(), r.resp.orig)
				q.releaseLocal(n)
			}
		}
	case respRNR, respNotReady:
		var ok bool
		if r.resp.code == respRNR {
			ok = q.backoff(rnrDelay(r.resp.rnrTimer), &q.rnrLeft, q.attr.RNRRetry == 7, w.fseq)
		} else {
			d := transportTimeout(q.attr.Timeout)
			ok = q.backoff(d, &q.retryLeft, d == 0 || q.patientNotReady(r.c), w.fseq)
		}
		if ok {
			q.goBack(w)
			return false
		}
		status = prov.StatusRNRRetryExcErr
		if r.resp.code == respNotReady {
			status = prov.StatusRetryExcErr
		}
	case respDropped, respNoQP, respSeqErr:
		status = prov.StatusRetryExcErr
	case respInvReq:
		status = prov.StatusRemInvReqErr
	case respAccess:
		status = prov.StatusRemAccessErr
	case respPullLost:
		// The request is in flight, so its claim was its region's,
		// closed under it (cma.go).
		status = prov.StatusLocProtErr
	case respStale:
		// A write with immediate was copied into a mapping of a region
		// the target's key no longer names (its key was reused, shm.go):
		// not executed. The mapping goes, and so does the request, again
		// at once (maxStale times in a row at most), with what followed
		// it: the target did not move on.
		if w.fpre != nil {
			r.c.dropImport(w.wr.RKey, w.fpre)
			w.fpre = nil
		}
		if x.stale < maxStale {
			x.stale++
			q.goBack(w)
			return false
		}
		status = prov.StatusRetryExcErr
	default:
		status = prov.StatusRemOpErr
	}
	if status != prov.StatusSuccess {
		q.failFlight(w, status, retired)
		return true
	}
	x.stale = 0
	if q.retrying {
		q.stopRetry()
	}
	if q.sigAll || w.wr.Flags&prov.SendSignaled != 0 {
		q.cbuf[q.ncbuf] = prov.Completion{WRID: w.wr.WRID, Status: status, Opcode: wcOpcodes[w.op], ByteLen: w.flen, QPN: q.qpn}
		q.ncbuf++
	}
	w.leave()
	x.nfl--
	*retired++
	if q.ncbuf == cbufLen {
		q.commit(*retired)
		*retired = 0
	}
	return false
}
