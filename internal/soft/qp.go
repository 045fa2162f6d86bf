package soft

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// qp is a queue pair.
//
// Locking. progMu is the right to run the send queue (one runner at a time
// keeps RC in order); PostSend and wake-ups take it with TryLock and never
// wait for it, Modify and Close take it first and wait. rmu guards the
// receive side (RQ, expected PSN, waiters) and is what a responder holds
// while it executes a request aimed at this QP. smu guards the send queue
// ring. Order: progMu → rmu → smu → srq.mu → cq.mu → channel/event locks.
// A runner holds only its own progMu while it calls into a target's
// respond (which takes the target's rmu), so two QPs sending to each other
// cannot deadlock. MR locks are only ever try-locked by operations.
type qp struct {
	f      *fabric
	pd     *pd
	ctx    *devContext
	typ    prov.QPType
	qpn    uint32
	scq    *cq
	rcq    *cq
	srq    *srq
	sigAll bool
	caps   prov.QPCap
	init   prov.QPInitAttr

	state  atomic.Uint32 // prov.QPState; changes with rmu held
	closed atomic.Bool

	progMu  sync.Mutex
	pending atomic.Bool // a kick found progMu busy

	rmu sync.Mutex
	smu sync.Mutex

	// Attributes, written by Modify with progMu, rmu and smu held.
	attr       prov.QPAttr
	route      link   // RC/UC: path to the destination (nil: unreachable)
	destFabric uint64 // RC/UC: fabric id of the destination
	mtu        uint32 // path MTU in bytes (UD: the port MTU)

	// Send queue (smu).
	sq     sendQueue
	sqFull error

	// Receive side (rmu).
	rq       recvQueue
	rqFull   error
	rqPSN    uint32
	rmsg     rmsg    // the message being received in segments (responder.go)
	tookHeld bool    // takeRecv's last receive was rmsg.recv (untakeRecv; rmu)
	waiters  []waker // requesters to wake when a receive is posted or the state changes

	// Requester state (progMu).
	sqPSN    uint32
	sqPSNPub atomic.Uint32 // sqPSN for Query
	req      request
	resp     response
	spans    *[maxSGE]span             // sendScratch, made with the send ring (post)
	locked   *[maxSGE]*mr              // sendScratch
	lcache   *mr                       // last local MR looked up
	cbuf     *[cbufLen]prov.Completion // sendScratch
	ncbuf    int
	retrying bool
	// sqdNotify: the QP went to SQD with AttrEnSQDAsyncNtfy and has not
	// reported SQ_DRAINED yet (sqdDrained; progMu).
	sqdNotify bool
	// peerLost: the QP went to ERR because its peer's process is gone
	// (conn.failQPs); errReported: a send request completed with an
	// error other than a flush since the QP left RESET (progMu). The
	// first request the QP then flushes fails with RETRY_EXC_ERR, as a
	// NIC's QP fails its oldest request when the peer stops answering.
	peerLost    atomic.Bool
	errReported bool
	notReady    time.Time // when the head request was first found its target not ready (progMu)
	rnrLeft     int
	retryLeft   int
	blocked     bool
	blockedSeq  uint64
	timer       *time.Timer
	timerArmed  bool
	timerFired  atomic.Bool
	wakeSeq     atomic.Uint64

	// Cross-process requests (conn.go). Once a request of this QP goes to
	// another process, xproc is set and the send queue runs in the QP's
	// own goroutine (workLoop), which may wait for the peer.
	x         *xstate
	xproc     atomic.Bool
	workStart sync.Once     // makes workCh and workDone and starts workLoop at the first needWorker; Close runs it empty
	workCh    chan struct{} // set by workStart
	workDone  chan struct{} // set by workStart
	closing   chan struct{} // closed when Close starts

	// Responder scratch (rmu). The arrays are a respScratch, made when
	// the first request reaches the QP (respondLocked).
	rspans  *[maxSGE]span
	rlocked *[maxSGE]*mr
	rcache  *mr // last MR looked up by the responder
	rsges   *[maxSGE]prov.SGE
	grh     [grhLen]byte
	rcomp   prov.Completion
}

const cbufLen = 64

// sendScratch is what the requester of a QP works with (progMu): the
// completions it has not delivered yet, and the local memory of the
// request it runs. A QP gets it with its send ring, at the first post (a
// rank of a large world has a QP to every other rank and posts to a
// few; the arrays are 4 KiB).
type sendScratch struct {
	cbuf   [cbufLen]prov.Completion
	spans  [maxSGE]span
	locked [maxSGE]*mr
}

// allocSend makes the send ring and the requester's scratch if they were
// not made yet (smu held; the requester reads them after it saw a request
// posted, under smu).
func (q *qp) allocSend() {
	q.sq.alloc()
	if q.cbuf == nil {
		s := new(sendScratch)
		q.cbuf, q.spans, q.locked = &s.cbuf, &s.spans, &s.locked
	}
}

// respScratch is the responder's scratch (rmu): the memory of a receive or
// a target being written, and a receive's scatter list taken from an SRQ.
type respScratch struct {
	spans  [maxSGE]span
	locked [maxSGE]*mr
	sges   [maxSGE]prov.SGE
}

// allocResp makes the responder's scratch if it was not made yet (rmu
// held).
func (t *qp) allocResp() {
	if t.rspans == nil {
		s := new(respScratch)
		t.rspans, t.rlocked, t.rsges = &s.spans, &s.locked, &s.sges
	}
}

var _ prov.QP = (*qp)(nil)

// sendQueue is the ring of send work requests. Its slots are made by
// the first post (alloc), not with the QP: a QP may never post (a rank
// of a large world has a QP to every other rank and posts to a few), and
// a ring of the usual depth is tens of KiB. depth is the ring's length
// whether or not it was made; slots are indexed only for requests
// counted in count, which the post that made them published under smu.
type sendQueue struct {
	slots  []sendWQE
	sges   []prov.SGE
	depth  int
	maxSGE int
	head   int
	count  int
}

type sendWQE struct {
	wr       prov.SendWR
	sge      []prov.SGE // the slot's SGE storage; wr.NumSGE are used
	isInline bool
	inline   []byte  // inline payload (slot-owned buffer)
	ud       *udDest // UD: resolved address handle (immutable)
	op       reqOp

	// In flight to another process (xreq.go; progMu).
	fid    uint64
	fconn  *conn
	fpsn   uint32
	fnpkts uint32
	flen   uint32
	fseq   uint64
	ftick  uint64    // the response timer's tick when it left (xstate.rtTicks)
	fimp   *mrImport // a direct write's target mapping (nil: not direct)
	fcut   bool      // its frame was not written whole: the peer cannot have executed it
	fpre   *mrImport // a direct write with immediate's, copied before it left
	rd     readSink  // a read's data (xreq.go; xstate.mu)
	// A pulled request's claim (cma.go): set while it is in flight.
	claim  atomic.Uint64
	pulled bool
	pmrs   []*mr // its regions, which list it (mr.pulls)
}

func (s *sendQueue) init(depth, maxSGE int) {
	s.depth, s.maxSGE = depth, maxSGE
}

// alloc makes the ring's slots if they were not made yet (smu held).
func (s *sendQueue) alloc() {
	if s.slots != nil || s.depth == 0 {
		return
	}
	maxSGE := s.maxSGE
	s.slots = make([]sendWQE, s.depth)
	s.sges = make([]prov.SGE, s.depth*maxSGE)
	for i := range s.slots {
		b := i * maxSGE
		s.slots[i].sge = s.sges[b : b+maxSGE : b+maxSGE]
	}
}

func (s *sendQueue) reset() {
	for i := range s.slots {
		s.slots[i].ud = nil
		s.slots[i].leave()
	}
	s.head, s.count = 0, 0
}

func newQP(p *pd, attr prov.QPInitAttr) (*qp, error) {
	switch attr.Type {
	case prov.QPTypeRC, prov.QPTypeUC, prov.QPTypeUD:
	default:
		return nil, errnof(einval, "create qp: QP type %d is not supported (RC, UC, UD)", attr.Type)
	}
	scq, ok1 := attr.SendCQ.(*cq)
	rcq, ok2 := attr.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq == nil || rcq == nil {
		return nil, errnof(einval, "create qp: send and receive CQs of the soft provider are required")
	}
	var s *srq
	if attr.SRQ != nil {
		var ok bool
		if s, ok = attr.SRQ.(*srq); !ok || s == nil {
			return nil, errnof(einval, "create qp: SRQ of another provider (%T)", attr.SRQ)
		}
		if s.ctx != p.ctx {
			return nil, errnof(einval, "create qp: the SRQ belongs to another device context")
		}
	}
	c := attr.Cap
	if c.MaxSendWR < 0 || c.MaxSendWR > maxQPWR || c.MaxSendSGE < 0 || c.MaxSendSGE > maxSGE ||
		c.MaxInlineData < 0 || c.MaxInlineData > maxInline {
		return nil, errnof(einval, "create qp: send capabilities %d WRs, %d SGEs, %d inline bytes exceed the device limits (%d, %d, %d)",
			c.MaxSendWR, c.MaxSendSGE, c.MaxInlineData, maxQPWR, maxSGE, maxInline)
	}
	if s == nil && (c.MaxRecvWR < 0 || c.MaxRecvWR > maxQPWR || c.MaxRecvSGE < 0 || c.MaxRecvSGE > maxSGE) {
		return nil, errnof(einval, "create qp: receive capabilities %d WRs, %d SGEs exceed the device limits (%d, %d)",
			c.MaxRecvWR, c.MaxRecvSGE, maxQPWR, maxSGE)
	}
	// Grant what was asked; SGE counts at least 1.
	c.MaxSendSGE = max(c.MaxSendSGE, 1)
	if s != nil {
		c.MaxRecvWR, c.MaxRecvSGE = 0, 0
	} else {
		c.MaxRecvSGE = max(c.MaxRecvSGE, 1)
	}

	if err := p.hold(&p.nqp, "create qp"); err != nil {
		return nil, err
	}
	undo := []func(){func() { p.release(&p.nqp) }}
	fail := func(err error) (*qp, error) {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		return nil, err
	}
	if err := scq.use(); err != nil {
		return fail(err)
	}
	undo = append(undo, scq.unuse)
	if err := rcq.use(); err != nil {
		return fail(err)
	}
	undo = append(undo, rcq.unuse)
	if s != nil {
		if err := s.use(); err != nil {
			return fail(err)
		}
		undo = append(undo, s.unuse)
	}

	q := &qp{
		f:      p.ctx.f,
		pd:     p,
		ctx:    p.ctx,
		typ:    attr.Type,
		scq:    scq,
		rcq:    rcq,
		srq:    s,
		sigAll: attr.SignalAll,
		caps:   c,
	}
	q.init = attr
	q.init.Cap = c
	q.sq.init(c.MaxSendWR, c.MaxSendSGE)
	if s == nil {
		q.rq.init(c.MaxRecvWR, c.MaxRecvSGE)
	}
	if q.typ == prov.QPTypeUD {
		q.mtu = uint32(portMTU.Bytes())
	}
	if q.typ == prov.QPTypeRC {
		q.req.waker = q // only RC requesters wait for a receive or a ready target
	}
	q.req.owner = q
	q.x = &xstate{}
	q.closing = make(chan struct{})
	if err := q.f.addQP(q); err != nil {
		return fail(err)
	}
	q.req.srcQPN = q.qpn
	q.req.srcFabric = q.f.id
	q.req.qpType = uint8(q.typ)
	q.sqFull = queueFullErr(fmt.Sprintf("soft: post send: send queue of QP %d is full (max_send_wr %d)", q.qpn, c.MaxSendWR))
	q.rqFull = queueFullErr(fmt.Sprintf("soft: post recv: receive queue of QP %d is full (max_recv_wr %d)", q.qpn, c.MaxRecvWR))
	return q, nil
}

func (q *qp) QPN() uint32 { return q.qpn }

// Address returns this process' provider address (see encodeAddr).
func (q *qp) Address() []byte { return append([]byte(nil), q.f.address()...) }

var _ prov.Linker = (*qp)(nil)

// Link names what carries the QP's requests (prov.Linker): "local" when
// they reach a QP of this process directly, else the connection to the
// destination's process: "shm", "unix", "tcp", or "tls" (TCP, encrypted).
// That is the connection the next request takes, or, while none is up
// (before the first request), the kind the first connection attempt
// will use. It is "" while the QP has no destination (RESET, INIT, or
// one that cannot be reached) and for UD, whose requests each find their
// own way. Safe for concurrent use.
func (q *qp) Link() string {
	if q.typ == prov.QPTypeUD || q.closed.Load() {
		return ""
	}
	q.rmu.Lock()
	route := q.route
	q.rmu.Unlock()
	switch r := route.(type) {
	case *localLink:
		return "local"
	case *peer:
		if r != nil {
			return r.linkName(q)
		}
	}
	return ""
}

// Query returns the current attributes and the creation attributes with
// the capabilities granted.
func (q *qp) Query() (prov.QPAttr, prov.QPInitAttr, error) {
	if q.closed.Load() {
		return prov.QPAttr{}, prov.QPInitAttr{}, closedErr("query qp")
	}
	q.rmu.Lock()
	a := q.attr
	st := prov.QPState(q.state.Load())
	a.State, a.CurState = st, st
	a.Cap = q.caps
	a.RQPSN = q.rqPSN
	a.SQPSN = q.sqPSNPub.Load()
	a.AH.ProviderAddr = append([]byte(nil), q.attr.AH.ProviderAddr...)
	q.rmu.Unlock()
	return a, q.init, nil
}

// Close destroys the QP. Outstanding work requests are discarded without
// completions (like ibv_destroy_qp); requests from peers find no QP.
func (q *qp) Close() error {
	if !q.closed.CompareAndSwap(false, true) {
		return nil
	}
	if s := q.f.svc.Load(); s != nil {
		s.flushHeld() // the application may exit next
	}
	close(q.closing) // ends a wait for a peer process
	q.progMu.Lock()
	q.rmu.Lock()
	q.smu.Lock()
	q.f.removeQP(q)
	q.sq.reset()
	q.rq.reset()
	q.rmsg = rmsg{}
	ws := q.waiters
	q.waiters = nil
	if q.timer != nil {
		q.timer.Stop()
	}
	remote := q.xproc.Load()
	q.smu.Unlock()
	q.rmu.Unlock()
	q.progMu.Unlock()
	if remote {
		q.workStart.Do(func() {}) // not started: it never will be
		if q.workDone != nil {
			<-q.workDone
		}
	}
	q.progMu.Lock()
	if q.x.rtimer != nil {
		q.x.rtimer.Stop()
	}
	if c := q.x.userOf.Load(); c != nil {
		c.removeUser(q)
		q.x.userOf.Store(nil)
	}
	q.x.nfl = 0
	q.x.dropReads()
	q.progMu.Unlock()
	for _, w := range ws {
		w.wake()
	}
	q.scq.unuse()
	q.rcq.unuse()
	if q.srq != nil {
		q.srq.unuse()
	}
	q.pd.release(&q.pd.nqp)
	return nil
}

// --- state machine ---

type qpTransition struct {
	valid    bool
	req, opt [3]prov.QPAttrMask // by typeIndex
}

func typeIndex(t prov.QPType) int {
	switch t {
	case prov.QPTypeRC:
		return 0
	case prov.QPTypeUC:
		return 1
	}
	return 2
}

// qpTransitions is the table of ib_modify_qp_is_ok (IB spec 11.2.4.2):
// valid transitions with the attributes each QP type requires and allows.
var qpTransitions = func() (t [7][7]qpTransition) {
	const (
		cs  = prov.AttrCurState
		en  = prov.AttrEnSQDAsyncNtfy
		af  = prov.AttrAccessFlags
		pk  = prov.AttrPKeyIndex
		po  = prov.AttrPort
		qk  = prov.AttrQKey
		av  = prov.AttrAV
		mtu = prov.AttrPathMTU
		to  = prov.AttrTimeout
		rc  = prov.AttrRetryCnt
		rnr = prov.AttrRNRRetry
		rq  = prov.AttrRQPSN
		mra = prov.AttrMaxQPRDAtomic
		alt = prov.AttrAltPath
		mrt = prov.AttrMinRNRTimer
		sq  = prov.AttrSQPSN
		mda = prov.AttrMaxDestRDAtom
		pm  = prov.AttrPathMigState
		dq  = prov.AttrDestQPN
	)
	const (
		reset = prov.QPStateReset
		ini   = prov.QPStateInit
		rtr   = prov.QPStateRTR
		rts   = prov.QPStateRTS
		sqd   = prov.QPStateSQD
		sqe   = prov.QPStateSQE
		errS  = prov.QPStateErr
	)
	type m = [3]prov.QPAttrMask
	for s := reset; s <= errS; s++ {
		t[s][reset].valid = true
		t[s][errS].valid = true
	}
	t[reset][ini] = qpTransition{valid: true, req: m{pk | po | af, pk | po | af, pk | po | qk}}
	t[ini][ini] = qpTransition{valid: true, opt: m{pk | po | af, pk | po | af, pk | po | qk}}
	t[ini][rtr] = qpTransition{valid: true,
		req: m{av | mtu | dq | rq | mda | mrt, av | mtu | dq | rq, 0},
		opt: m{alt | af | pk, alt | af | pk, pk | qk}}
	t[rtr][rts] = qpTransition{valid: true,
		req: m{to | rc | rnr | sq | mra, sq, sq},
		opt: m{cs | alt | af | mrt | pm, cs | alt | af | pm, cs | qk}}
	t[rts][rts] = qpTransition{valid: true, opt: m{cs | af | alt | pm | mrt, cs | af | alt | pm, cs | qk}}
	t[rts][sqd] = qpTransition{valid: true, opt: m{en, en, en}}
	t[sqd][rts] = qpTransition{valid: true, opt: m{cs | alt | af | mrt | pm, cs | alt | af | pm, cs | qk}}
	t[sqd][sqd] = qpTransition{valid: true, opt: m{
		po | av | to | rc | rnr | mra | mda | alt | af | pk | mrt | pm,
		av | alt | af | pk | pm,
		pk | qk}}
	t[sqe][rts] = qpTransition{valid: true, opt: m{0, cs | af, cs | qk}}
	return t
}()

var stateNames = [...]string{"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"}

func stateName(s prov.QPState) string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", s)
}

var maskNames = [...]string{"STATE", "CUR_STATE", "EN_SQD_ASYNC_NOTIFY", "ACCESS_FLAGS", "PKEY_INDEX",
	"PORT", "QKEY", "AV", "PATH_MTU", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "RQ_PSN", "MAX_QP_RD_ATOMIC",
	"ALT_PATH", "MIN_RNR_TIMER", "SQ_PSN", "MAX_DEST_RD_ATOMIC", "PATH_MIG_STATE", "CAP", "DEST_QPN"}

func maskString(m prov.QPAttrMask) string {
	var parts []string
	for i, n := range maskNames {
		if m&(1<<i) != 0 {
			parts = append(parts, n)
		}
	}
	if rest := m &^ (1<<len(maskNames) - 1); rest != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint32(rest)))
	}
	return strings.Join(parts, "|")
}

var typeNames = map[prov.QPType]string{prov.QPTypeRC: "RC", prov.QPTypeUC: "UC", prov.QPTypeUD: "UD"}

const validQPAccess = prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead |
	prov.AccessRemoteAtomic | prov.AccessMWBind

// Modify changes the QP's state and attributes like ibv_modify_qp: the
// transition must be valid, its required attributes present and no other
// attributes given; otherwise nothing changes and the error wraps EINVAL.
func (q *qp) Modify(attr *prov.QPAttr, mask prov.QPAttrMask) error {
	if attr == nil {
		return errnof(einval, "modify qp: nil attributes")
	}
	if q.closed.Load() {
		return closedErr("modify qp")
	}
	q.progMu.Lock()
	q.rmu.Lock()
	q.smu.Lock()
	err := q.modifyLocked(attr, mask)
	q.smu.Unlock()
	q.rmu.Unlock()
	q.progMu.Unlock()
	if err != nil {
		return err
	}
	q.drainWaiters()
	q.kick()
	return nil
}

func (q *qp) modifyLocked(attr *prov.QPAttr, mask prov.QPAttrMask) error {
	if q.closed.Load() {
		return closedErr("modify qp")
	}
	cur := prov.QPState(q.state.Load())
	if mask&prov.AttrCurState != 0 && attr.CurState != cur {
		return errnof(einval, "modify qp %d: current state given as %s, the QP is in %s", q.qpn, stateName(attr.CurState), stateName(cur))
	}
	next := cur
	if mask&prov.AttrState != 0 {
		if attr.State > prov.QPStateErr {
			return errnof(einval, "modify qp %d: invalid state %d", q.qpn, attr.State)
		}
		next = attr.State
	}
	tr := &qpTransitions[cur][next]
	if !tr.valid {
		return errnof(einval, "modify qp %d: invalid transition %s -> %s", q.qpn, stateName(cur), stateName(next))
	}
	ti := typeIndex(q.typ)
	req, opt := tr.req[ti], tr.opt[ti]
	if missing := req &^ mask; missing != 0 {
		return errnof(einval, "modify qp %d (%s): %s -> %s requires attributes %s", q.qpn, typeNames[q.typ], stateName(cur), stateName(next), maskString(missing))
	}
	if extra := mask &^ (req | opt | prov.AttrState); extra != 0 {
		return errnof(einval, "modify qp %d (%s): attributes %s are not allowed in %s -> %s", q.qpn, typeNames[q.typ], maskString(extra), stateName(cur), stateName(next))
	}
	if mask&(prov.AttrAltPath|prov.AttrPathMigState) != 0 {
		return errnof(einval, "modify qp %d: alternate paths (APM) are not supported by %s", q.qpn, DeviceName)
	}

	na := q.attr
	route, destFabric := q.route, q.destFabric
	if mask&prov.AttrPKeyIndex != 0 {
		if attr.PKeyIndex != 0 {
			return errnof(einval, "modify qp %d: P_Key index %d (the table has 1 entry)", q.qpn, attr.PKeyIndex)
		}
		na.PKeyIndex = 0
	}
	if mask&prov.AttrPort != 0 {
		if attr.Port != 1 {
			return errnof(einval, "modify qp %d: port %d (the device has port 1)", q.qpn, attr.Port)
		}
		na.Port = 1
	}
	if mask&prov.AttrAccessFlags != 0 {
		if attr.Access&^validQPAccess != 0 {
			return errnof(einval, "modify qp %d: invalid access flags %#x", q.qpn, uint32(attr.Access))
		}
		na.Access = attr.Access
	}
	if mask&prov.AttrQKey != 0 {
		na.QKey = attr.QKey
	}
	if mask&prov.AttrAV != 0 {
		if err := checkAV(&attr.AH, fmt.Sprintf("modify qp %d", q.qpn)); err != nil {
			return err
		}
		l, fab, err := q.f.resolve(attr.AH.DGID, attr.AH.IsGlobal, attr.AH.DLID, attr.AH.ProviderAddr)
		if err != nil {
			return fmt.Errorf("soft: modify qp %d: address vector: %w", q.qpn, err)
		}
		route, destFabric = l, fab
		na.AH = attr.AH
		na.AH.ProviderAddr = append([]byte(nil), attr.AH.ProviderAddr...)
		if na.AH.Port == 0 {
			na.AH.Port = 1
		}
	}
	if mask&prov.AttrPathMTU != 0 {
		if attr.PathMTU.Bytes() == 0 || attr.PathMTU > portMTU {
			return errnof(einval, "modify qp %d: path MTU %d (1..%d)", q.qpn, attr.PathMTU, portMTU)
		}
		na.PathMTU = attr.PathMTU
	}
	if mask&prov.AttrTimeout != 0 {
		if attr.Timeout > 31 {
			return errnof(einval, "modify qp %d: timeout %d (0..31)", q.qpn, attr.Timeout)
		}
		na.Timeout = attr.Timeout
	}
	if mask&prov.AttrRetryCnt != 0 {
		if attr.RetryCnt > 7 {
			return errnof(einval, "modify qp %d: retry count %d (0..7)", q.qpn, attr.RetryCnt)
		}
		na.RetryCnt = attr.RetryCnt
	}
	if mask&prov.AttrRNRRetry != 0 {
		if attr.RNRRetry > 7 {
			return errnof(einval, "modify qp %d: RNR retry %d (0..7)", q.qpn, attr.RNRRetry)
		}
		na.RNRRetry = attr.RNRRetry
	}
	if mask&prov.AttrRQPSN != 0 {
		na.RQPSN = attr.RQPSN & psnMask
	}
	if mask&prov.AttrSQPSN != 0 {
		na.SQPSN = attr.SQPSN & psnMask
	}
	if mask&prov.AttrMaxQPRDAtomic != 0 {
		if attr.MaxRDAtomic > maxRDAtomic {
			return errnof(einval, "modify qp %d: max_rd_atomic %d (0..%d)", q.qpn, attr.MaxRDAtomic, maxRDAtomic)
		}
		na.MaxRDAtomic = attr.MaxRDAtomic
	}
	if mask&prov.AttrMaxDestRDAtom != 0 {
		if attr.MaxDestRDAtom > maxRDAtomic {
			return errnof(einval, "modify qp %d: max_dest_rd_atomic %d (0..%d)", q.qpn, attr.MaxDestRDAtom, maxRDAtomic)
		}
		na.MaxDestRDAtom = attr.MaxDestRDAtom
	}
	if mask&prov.AttrMinRNRTimer != 0 {
		if attr.MinRNRTimer > 31 {
			return errnof(einval, "modify qp %d: min RNR timer %d (0..31)", q.qpn, attr.MinRNRTimer)
		}
		na.MinRNRTimer = attr.MinRNRTimer
	}
	if mask&prov.AttrDestQPN != 0 {
		if attr.DestQPN > maxQPN {
			return errnof(einval, "modify qp %d: destination QPN %#x exceeds 24 bits", q.qpn, attr.DestQPN)
		}
		na.DestQPN = attr.DestQPN
	}

	// Commit.
	if next == prov.QPStateReset {
		if cur != prov.QPStateReset {
			q.resetLocked()
		}
		return nil
	}
	q.attr = na
	q.route, q.destFabric = route, destFabric
	if p, ok := route.(*peer); ok && p != nil {
		q.setRemote()
	}
	if mask&prov.AttrPathMTU != 0 {
		q.mtu = uint32(na.PathMTU.Bytes())
	}
	if mask&prov.AttrRQPSN != 0 {
		q.rqPSN = na.RQPSN
	}
	if mask&prov.AttrSQPSN != 0 {
		q.sqPSN = na.SQPSN
		q.sqPSNPub.Store(na.SQPSN)
	}
	if mask&(prov.AttrRNRRetry|prov.AttrRetryCnt) != 0 {
		q.rnrLeft, q.retryLeft = int(na.RNRRetry), int(na.RetryCnt)
	}
	if next != cur {
		q.sqdNotify = false // a drain not reported yet ends with its SQD
	}
	switch {
	case next == prov.QPStateErr && cur == prov.QPStateReset:
		q.state.Store(uint32(prov.QPStateErr))
	case next == prov.QPStateErr:
		q.toErrLocked(-1)
	case next != cur:
		q.state.Store(uint32(next))
		// In SQD the send queue starts no new message; SQ_DRAINED comes
		// from the runner (Modify kicks it) once no message is in
		// progress any more (sqdDrained).
		q.sqdNotify = next == prov.QPStateSQD && mask&prov.AttrEnSQDAsyncNtfy != 0
	}
	return nil
}

// resetLocked returns the QP to RESET: queues emptied without completions,
// attributes cleared. Called with progMu, rmu and smu held.
func (q *qp) resetLocked() {
	q.sq.reset()
	q.rq.reset()
	q.rmsg = rmsg{}
	q.attr = prov.QPAttr{}
	q.route, q.destFabric = nil, 0
	if q.typ != prov.QPTypeUD {
		q.mtu = 0
	}
	q.rqPSN, q.sqPSN = 0, 0
	q.sqPSNPub.Store(0)
	q.stopRetry()
	q.rnrLeft, q.retryLeft = 0, 0
	q.ncbuf = 0
	q.peerLost.Store(false)
	q.x.wrOK = false  // the next destination may refuse remote writes
	q.x.ackOK = false // nor may it be ready (importRegion)
	q.errReported = false
	q.sqdNotify = false
	q.resetRemote()
	q.state.Store(uint32(prov.QPStateReset))
}

// resetRemote forgets the requests the QP has in flight to another
// process, as flushSQ and Close do: the QP starts over like a new one.
// Their responses, should they still come, match none of its new
// requests (those carry new request ids, conn.nextID) and are dropped:
// by handleResp once the QP is no longer the connection's user, else
// by retireOne. Called with progMu, rmu and smu held.
func (q *qp) resetRemote() {
	x := q.x
	x.nfl, x.ndirect, x.stale = 0, 0, 0
	x.dropReads()
	if x.rtimer != nil {
		x.rtimer.Stop()
	}
	x.rtArmed = false
	x.rtFired.Store(false)
	x.rtStalls = 0
	if c := x.userOf.Load(); c != nil {
		c.removeUser(q)
		x.userOf.Store(nil)
	}
	x.mu.Lock()
	clear(x.resps)
	x.resps = x.resps[:0]
	x.hasResp.Store(false)
	x.mu.Unlock()
}

// toErrLocked moves the QP to ERR (unless it is there or in RESET),
// flushing its receive queue; ev >= 0 is the async event to report. It
// reports whether the state changed; the caller must then kick the QP
// (to flush the send queue) and wake its waiters once rmu is released.
// Called with rmu held.
func (q *qp) toErrLocked(ev int) bool {
	for {
		st := q.state.Load()
		if st == uint32(prov.QPStateErr) || st == uint32(prov.QPStateReset) {
			return false
		}
		if q.state.CompareAndSwap(st, uint32(prov.QPStateErr)) {
			break
		}
	}
	q.flushRecvLocked()
	if ev >= 0 {
		q.ctx.events.Push(prov.AsyncEvent{Type: uint32(ev), QPN: q.qpn, Element: prov.QP(q)})
	}
	if q.srq != nil {
		q.ctx.events.Push(prov.AsyncEvent{Type: evQPLastWQE, QPN: q.qpn, Element: prov.QP(q)})
	}
	return true
}

// flushRecvLocked completes every posted receive with WR_FLUSH_ERR.
func (q *qp) flushRecvLocked() {
	var buf [32]prov.Completion
	n := 0
	// First the receive of a message that did not end: the oldest.
	q.rmsg.active, q.rmsg.owned = false, false
	if r := &q.rmsg.recv; r.ok {
		r.ok = false
		buf[n] = prov.Completion{WRID: r.wrid, Status: prov.StatusWRFlushErr, Opcode: prov.WCRecv, QPN: q.qpn}
		n++
	}
	for q.rq.count > 0 {
		wrid, _ := q.rq.front()
		q.rq.pop()
		buf[n] = prov.Completion{WRID: wrid, Status: prov.StatusWRFlushErr, Opcode: prov.WCRecv, QPN: q.qpn}
		n++
		if n == len(buf) {
			q.rcq.push(buf[:n], false)
			n = 0
		}
	}
	if n > 0 {
		q.rcq.push(buf[:n], false)
	}
}

// fail moves the QP to ERR after a requester-side error. Called by the
// runner (progMu held, no other lock).
func (q *qp) fail(ev int) {
	q.rmu.Lock()
	changed := q.toErrLocked(ev)
	q.rmu.Unlock()
	if changed {
		q.drainWaiters()
	}
}

// drainWaiters wakes every requester waiting on this QP's receive queue or
// state. Called without locks.
func (q *qp) drainWaiters() {
	q.rmu.Lock()
	ws := q.waiters
	q.waiters = nil
	q.rmu.Unlock()
	for _, w := range ws {
		w.wake()
	}
}

const psnMask = 1<<24 - 1
