package session

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// The agent: a goroutine per session that reads the control queue pair
// and serves the peer (memory requests, grants, hand-backs, revocations,
// the ends of rendezvous), and the state it keeps. Calls of the
// application that need the peer's agent (RequestRemoteMR, SendLocalMR,
// ...) send a control message with a request id and wait for the
// answer the agent routes back to them.

// agentState is guarded by mu.
type agentState struct {
	mu      sync.Mutex
	waiters map[uint64]waiter      // request id → the caller waiting for its answer
	fins    map[uint64]*finWait    // rendezvous id → what to free when the peer has read it
	grants  map[uint64]*grantState // grant id → memory of ours the peer may access
	remotes map[uint64]*RemoteMR   // grant id → memory of the peer's we may access
	granted int64                  // bytes in grants
	offers  []*RemoteMR            // regions the peer offered, for ReceiveRemoteMR
	returns []returned             // regions handed back to us, for ReceiveLocalMR
	changed chan struct{}          // closed (and replaced) when offers or returns grow
	err     error                  // why the session ended
	nextG   uint64
	sweepAt int       // the size of remotes at which newRemote sweeps it next
	sweptAt time.Time // when it last swept it
}

// waiter is a call waiting for its answer.
type waiter struct {
	ch chan ctrlMsg
	// at is when the call was made: the lease of a grant that answers
	// it counts from then, as the granter's does from a moment after
	// (before, from the grant's arrival, which a busy agent could take
	// in later than the granter's window lived:
	// TestAdv2GrantLeaseFromRequest).
	at time.Time
}

// returned is a region of ours the peer handed back, for ReceiveLocalMR.
type returned struct {
	mr LocalMR
	// n is what it still counts in granted: the bytes of a region
	// served for the peer's request, until ReceiveLocalMR takes it.
	n int64
}

// finWait is a rendezvous waiting for the peer's fin.
type finWait struct {
	done chan struct{} // closed by the fin, or by the session's end
	read bool          // the fin came (set before done is closed)
	// refused is why the peer did not read the message (a fin with an
	// error code: it had no memory for it), set before done is closed.
	refused error
	win     *verbs.MemoryRegion
	owned   LocalMR // the library's copy of the message (Send), freed then
	held    LocalMR // the application's region (SendSlice), held until then
}

// grantState is memory of ours the peer may access: a window of a region
// of our allocator, registered with the access granted.
type grantState struct {
	id     uint64
	mr     LocalMR
	win    *verbs.MemoryRegion
	n      int64
	served bool // allocated by the agent for the peer's request
	timer  *time.Timer
	closes time.Time       // when timer fires: the lease's end plus leaseGrace
	leases *sync.WaitGroup // the session's, which counts timer until it fired or was stopped
}

// maxQueued bounds the offers and hand-backs waiting for the application.
const maxQueued = 256

// leaseGrace is how long after a lease the granter closes the window:
// the grantee stops posting at the lease (its own clock, from when the
// grant reached it), and requests posted just before must finish.
const leaseGrace = 250 * time.Millisecond

func (a *agentState) init() {
	a.waiters = map[uint64]waiter{}
	a.fins = map[uint64]*finWait{}
	a.grants = map[uint64]*grantState{}
	a.remotes = map[uint64]*RemoteMR{}
	a.changed = make(chan struct{})
}

// wakeLocked wakes the callers waiting for offers or returns (mu held).
func (a *agentState) wakeLocked() {
	close(a.changed)
	a.changed = make(chan struct{})
}

// fail wakes every waiter: the session ended.
func (a *agentState) fail(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.err = err
	for id, w := range a.fins {
		close(w.done)
		delete(a.fins, id)
		w.free()
	}
	for _, r := range a.remotes {
		r.state.CompareAndSwap(remoteLive, remoteEnded)
	}
}

func (w *finWait) free() {
	w.win.Close()
	if w.owned.Valid() {
		w.owned.Free()
	}
	unhold(w.held)
}

// closeGrants closes every window (the session ended).
func (a *agentState) closeGrants() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, g := range a.grants {
		a.dropGrantLocked(id, g)
	}
	for id, w := range a.fins {
		delete(a.fins, id)
		w.free()
	}
	for _, r := range a.returns {
		r.mr.Free()
	}
	a.returns = nil
}

func (a *agentState) dropGrantLocked(id uint64, g *grantState) {
	delete(a.grants, id)
	if g.timer != nil && g.timer.Stop() {
		g.leases.Done() // its function will not run
	}
	g.win.Close()
	a.granted -= g.n
	if g.served && g.mr.Valid() {
		g.mr.Free()
	}
}

// extendGrant moves the end of grant g's window to d from now, if the
// grant lives and its timer has not fired.
func (a *agentState) extendGrant(g *grantState, d time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.grants[g.id] != g || g.timer == nil || !g.timer.Stop() {
		return
	}
	g.closes = time.Now().Add(d)
	g.timer.Reset(d)
}

func (a *agentState) expectFin(id uint64, win *verbs.MemoryRegion, owned, held LocalMR) *finWait {
	w := &finWait{done: make(chan struct{}), win: win, owned: owned, held: held}
	a.mu.Lock()
	if a.err != nil {
		a.mu.Unlock()
		close(w.done)
		w.free()
		return w
	}
	a.fins[id] = w
	a.mu.Unlock()
	return w
}

func (a *agentState) dropFin(id uint64) {
	a.mu.Lock()
	w := a.fins[id]
	delete(a.fins, id)
	a.mu.Unlock()
	if w != nil {
		w.free()
	}
}

// agentSpins reports whether an agent spins before it sleeps in its next
// wait, given when the two last control messages came: always with
// Config.AgentSpin (spin), else in a burst (they came less than
// agentBurst apart: a request, its answer, the release, the next
// request), so that a session whose control messages are far apart
// (keepalives, a request now and then) costs no processor between them.
func agentSpins(spin bool, prev, last time.Time) bool {
	return spin || !prev.IsZero() && last.Sub(prev) < agentBurst
}

// agentLoop reads the control queue pair until the session ends.
func (s *Session) agentLoop() {
	defer s.agentWG.Done()
	var b [ctrlBufSize]byte
	var prev, last time.Time // when the two last control messages came
	for {
		s.cmu.Lock()
		if len(s.cfifo) == 0 {
			s.cmu.Unlock()
			return
		}
		slot := s.cfifo[0]
		h := s.crh[slot]
		s.cmu.Unlock()
		var err error
		if agentSpins(s.cfg.AgentSpin, prev, last) {
			err = h.Wait(s.bg) // spins first (ctrlOptions)
		} else {
			err = s.agc.Sleep(s.bg, h.Done)
		}
		if err != nil && !h.Done() {
			return
		}
		prev, last = last, time.Now()
		s.cmu.Lock()
		s.cfifo = s.cfifo[1:]
		s.cmu.Unlock()
		if err := h.Err(); err != nil {
			h.Release()
			s.fail("agent", err)
			return
		}
		rc := h.Received()
		h.Release()
		s.crflow.consumed.Add(1)
		// The ring is the session's own region, closed only by its
		// release, after the agent ended (before, it was a region of the
		// application's allocator, whose Close left Bytes nil here:
		// TestAdv2ControlAfterAllocatorClose).
		off := int(slot) * ctrlBufSize
		n := copy(b[:], s.cring.Bytes()[off:off+min(rc.Len, ctrlBufSize)])
		s.repostCtrl(int(slot))
		m, err := parseCtrl(b[:n])
		if err != nil {
			s.protocol(err)
			return
		}
		s.cflow.learn(m.credits)
		s.handle(m)
	}
}

// postCtrl posts control receive buffer slot (cmu held, or before the
// session runs).
func (s *Session) postCtrl(slot int) error {
	sge := verbs.SGE{Addr: s.cring.Addr() + uint64(slot*ctrlBufSize), Length: ctrlBufSize, LKey: s.cring.LKey()}
	h, err := s.agc.PostReceive(sge)
	if err != nil {
		return err
	}
	s.crh[slot] = h
	s.cfifo = append(s.cfifo, int32(slot))
	return nil
}

func (s *Session) repostCtrl(slot int) {
	s.cmu.Lock()
	err := s.postCtrl(slot)
	s.cmu.Unlock()
	if err != nil {
		s.fail("agent", err)
		return
	}
	s.crflow.reposted.Add(1)
	s.writeCredits(&s.crflow, &s.ccred, s.agc, 4)
}

// sendCtrl sends a control message, waiting for a credit and for its
// completion (at most until ctx or the session ends). posted reports
// whether the message left (then it may reach the peer even if err is
// not nil).
func (s *Session) sendCtrl(ctx context.Context, m ctrlMsg) (posted bool, err error) {
	buf, err := s.cmem.Alloc(ctrlBufSize)
	if err != nil {
		return false, fmt.Errorf("session: agent: %w", err)
	}
	if err := s.cflow.take(ctx, s.done); err != nil {
		buf.Free()
		return false, s.ctxErr("agent", err)
	}
	h, err := s.postCtrlMsg(ctx, buf, m)
	if err != nil {
		return false, err
	}
	return true, s.awaitFor(ctx, "agent", h, orphaned{buf: buf})
}

// postCtrlMsg posts m from buf (a credit taken), waiting while the send
// queue is full (waitRoom: sends whose completions were not polled yet
// and credit writes fill it; before, the post failed and the message was
// lost, a rendezvous fin or a request's answer with it, and its caller
// waited for ever: TestAdvControlBurst, TestAdvBothWaysPosted with
// -race). If ctx or the session ends first, the credit goes back
// (nothing was sent). On an error buf is freed.
func (s *Session) postCtrlMsg(ctx context.Context, buf LocalMR, m ctrlMsg) (channel.Handle, error) {
	m.credits = s.crflow.reposted.Load()
	n := m.put(buf.Bytes())
	sl, _ := buf.Slice(0, n)
	h, err, werr := s.postRoom(ctx, s.agc, func() (channel.Handle, error) { return s.agc.PostSend(sl.SGE()) })
	if werr != nil {
		s.cflow.sent.Add(^uint32(0))
		buf.Free()
		return channel.Handle{}, s.ctxErr("agent", werr)
	}
	if err != nil {
		buf.Free()
		return channel.Handle{}, s.fail("agent", err)
	}
	s.crflow.told(m.credits)
	return h, nil
}

// sendAsyncCtrl sends m without waiting (answers of the agent, fins):
// posted at once if a credit is free (its completion is awaited in the
// background), else queued (owed) for a task that posts the queue in
// order as credits come. An answer posted by the agent itself leaves
// before the agent reads on; one left to a new goroutine waited for that
// goroutine to run: RequestRemoteMR in a loop (BenchmarkXprocRequest,
// five alternating runs, medians) took 23.8 µs that way over shared
// memory and 59.0 over unix sockets, 17.4 and 40.0 posted at once.
func (s *Session) sendAsyncCtrl(m ctrlMsg) {
	o := &s.owed
	o.mu.Lock()
	if len(o.q) == 0 && !o.running { // nothing owed goes before m
		o.mu.Unlock()
		if s.trySendCtrl(m) {
			return
		}
		o.mu.Lock()
	}
	if len(o.q) >= maxOwed {
		o.mu.Unlock()
		err := fmt.Errorf("%w: the peer took none of this side's last %d control messages (it sends and gives no credit back)", ErrProtocol, maxOwed)
		s.end(err)
		s.ctl.close()
		return
	}
	o.q = append(o.q, m)
	if !o.running {
		o.running = true
		s.goTask(s.sendOwed)
	}
	o.mu.Unlock()
}

// owedCtrl is the control messages of this side waiting for a credit of
// the peer's (sendAsyncCtrl), at most maxOwed of them: a peer that sends
// requests (or releases of nothing) in a loop and gives no credit back
// for the answers is a protocol violation. Before, each answer waited in
// a goroutine of its own, with its buffer, without bound: 3000 releases
// of such a peer left 2944 goroutines (TestAdv2WithheldCredits).
type owedCtrl struct {
	mu      sync.Mutex
	q       []ctrlMsg
	running bool // a task (sendOwed) posts q
}

// maxOwed bounds the control messages waiting for a credit. A peer that
// follows the protocol is owed at most one answer per call of its own
// in progress (and a fin per rendezvous it sends).
const maxOwed = 1 << 14

// trySendCtrl posts m if a buffer and a credit are free, and reports
// whether it took it (posted, or lost with the session's end).
func (s *Session) trySendCtrl(m ctrlMsg) bool {
	buf, err := s.cmem.Alloc(ctrlBufSize)
	if err != nil {
		return false
	}
	if !s.cflow.tryTake() {
		buf.Free()
		return false
	}
	h, err := s.postCtrlMsg(s.bg, buf, m)
	if err == nil {
		s.goTask(func() { s.awaitFor(s.bg, "agent", h, orphaned{buf: buf}) })
	}
	return true
}

// sendOwed posts the owed control messages in order, each when a credit
// is free, until none is left or the session ends (a task).
func (s *Session) sendOwed() {
	o := &s.owed
	for {
		o.mu.Lock()
		if len(o.q) == 0 {
			o.q, o.running = nil, false
			o.mu.Unlock()
			return
		}
		m := o.q[0]
		o.q = o.q[1:]
		o.mu.Unlock()
		buf, err := s.cmem.Alloc(ctrlBufSize)
		if err != nil {
			continue // lost, as by a failed post
		}
		if err := s.cflow.take(s.bg, s.done); err != nil {
			buf.Free()
			return // the session ended
		}
		h, err := s.postCtrlMsg(s.bg, buf, m)
		if err != nil {
			return // the session ends
		}
		s.goTask(func() { s.awaitFor(s.bg, "agent", h, orphaned{buf: buf}) })
	}
}

// call sends a request and waits for its answer.
func (s *Session) call(ctx context.Context, op string, m ctrlMsg) (ctrlMsg, error) {
	m.id = s.ids.Add(1)
	ch := make(chan ctrlMsg, 1)
	a := &s.agent
	a.mu.Lock()
	if a.err != nil {
		a.mu.Unlock()
		return ctrlMsg{}, s.fail(op, nil)
	}
	a.waiters[m.id] = waiter{ch: ch, at: time.Now()}
	a.mu.Unlock()
	forget := func() {
		a.mu.Lock()
		_, waiting := a.waiters[m.id]
		// An answer that comes is then nobody's, and undone (handle).
		// (Before, the entry stayed, nil, for the session's life if no
		// answer came: TestAdv2UnansweredCallsForgotten.)
		delete(a.waiters, m.id)
		a.mu.Unlock()
		if !waiting {
			// The answer was routed to ch already (or is being): undo it.
			if r := <-ch; r.typ == ctrlGrant {
				if rm := s.lookupRemote(r.grant); rm != nil {
					rm.state.Store(remoteReleased)
					s.forgetRemote(r.grant)
				}
				s.sendAsyncCtrl(ctrlMsg{typ: ctrlRelease, grant: r.grant})
			}
		}
	}
	if posted, err := s.sendCtrl(ctx, m); err != nil {
		if !posted {
			// The request never left: no answer will come to undo.
			// (Before, its entry stayed, nil, for the session's life:
			// one per call whose context ended while it waited for a
			// control credit; TestAdvCancelRequestRemoteMR.)
			a.mu.Lock()
			delete(a.waiters, m.id)
			a.mu.Unlock()
			return ctrlMsg{}, err
		}
		forget()
		return ctrlMsg{}, err
	}
	select {
	case r := <-ch:
		if r.typ == ctrlErr {
			return r, fmt.Errorf("session: %s: the peer refused: %w", op, codeErr(r))
		}
		return r, nil
	case <-ctx.Done():
		forget()
		return ctrlMsg{}, fmt.Errorf("session: %s: %w", op, ctx.Err())
	case <-s.done:
		return ctrlMsg{}, s.fail(op, nil)
	}
}

func codeErr(r ctrlMsg) error {
	var e error
	switch r.code {
	case errCodeLimit, errCodeBusy, errCodeNoMemory:
		// Busy: the peer's queue of offers is full (maxQueued), a cap
		// as much as its MaxGranted is; no memory: its own limits
		// (memory, the locked-memory limit) refused the allocation or
		// registration.
		e = ErrLimit
	case errCodeAccess:
		e = ErrAccess
	case errCodeUnknown:
		e = ErrLeaseExpired
	case errCodeProtocol:
		e = ErrProtocol
	default:
		e = fmt.Errorf("%w: refusal code %d", ErrProtocol, r.code)
	}
	if r.text != "" {
		return fmt.Errorf("%w: %s", e, r.text)
	}
	return e
}

// answered routes an answer to its caller; it reports false if nobody
// waits (any more).
func (s *Session) answered(m ctrlMsg) bool {
	a := &s.agent
	a.mu.Lock()
	w, ok := a.waiters[m.id]
	delete(a.waiters, m.id)
	a.mu.Unlock()
	if !ok {
		return false
	}
	w.ch <- m
	return true
}

// handle serves one control message (agent goroutine; nothing here
// waits for long: answers go in the background).
func (s *Session) handle(m ctrlMsg) {
	reply := func(r ctrlMsg) {
		r.id = m.id
		s.sendAsyncCtrl(r)
	}
	refuse := func(code uint8, format string, args ...any) {
		reply(ctrlMsg{typ: ctrlErr, code: code, text: fmt.Sprintf(format, args...)})
	}
	switch m.typ {
	case ctrlRequest:
		g, code, err := s.serveRequest(m)
		if err != nil {
			refuse(code, "%v", err)
			return
		}
		reply(ctrlMsg{typ: ctrlGrant, grant: g.id, addr: g.win.Addr(), len: uint64(g.n), rkey: g.win.RKey(), access: m.access, lease: m.lease})
	case ctrlGrant:
		a := &s.agent
		a.mu.Lock()
		at := a.waiters[m.id].at // zero if nobody waits: then now
		a.mu.Unlock()
		r := s.newRemote(m, at, true)
		if !s.answered(m) {
			// The caller gave up: give the memory back.
			r.state.Store(remoteReleased)
			s.forgetRemote(r.grant)
			s.sendAsyncCtrl(ctrlMsg{typ: ctrlRelease, grant: m.grant})
		}
	case ctrlOffer:
		if m.len > math.MaxInt || m.addr+m.len < m.addr {
			// RemoteMR.Len is an int: a longer region read as negative.
			refuse(errCodeProtocol, "an offer of %d bytes at %#x", m.len, m.addr)
			return
		}
		a := &s.agent
		a.mu.Lock()
		if len(a.offers) >= maxQueued {
			a.mu.Unlock()
			refuse(errCodeBusy, "%d offered regions wait for ReceiveRemoteMR", maxQueued)
			return
		}
		a.mu.Unlock()
		r := s.newRemote(m, time.Time{}, false)
		a.mu.Lock()
		a.offers = append(a.offers, r)
		a.wakeLocked()
		a.mu.Unlock()
		reply(ctrlMsg{typ: ctrlAck})
	case ctrlHandBack, ctrlRelease:
		a := &s.agent
		a.mu.Lock()
		g := a.grants[m.grant]
		if g == nil {
			a.mu.Unlock()
			refuse(errCodeUnknown, "no grant %d (its lease ended?)", m.grant)
			return
		}
		mr, served := g.mr, g.served
		g.served = false // the region is not freed with the grant
		a.dropGrantLocked(m.grant, g)
		if m.typ == ctrlHandBack && mr.Valid() {
			r := returned{mr: mr}
			if served {
				// Memory allocated for the peer and handed back
				// counts against MaxGranted until the application
				// takes it: a peer that requests and hands back in
				// a loop holds no more of it than it may be granted
				// (before, without bound: TestAdvHandBacksBounded).
				r.n = g.n
				a.granted += g.n
			}
			a.returns = append(a.returns, r)
			a.wakeLocked()
		} else if served {
			mr.Free()
		}
		a.mu.Unlock()
		reply(ctrlMsg{typ: ctrlAck})
	case ctrlRevoke:
		r := s.lookupRemote(m.grant)
		s.goTask(func() {
			if r != nil {
				r.state.CompareAndSwap(remoteLive, remoteRevoked)
				r.quiesce(context.Background(), s.done)
				s.forgetRemote(m.grant)
			}
			reply(ctrlMsg{typ: ctrlAck})
		})
	case ctrlAck, ctrlErr:
		s.answered(m)
	case ctrlFin:
		a := &s.agent
		a.mu.Lock()
		w := a.fins[m.id]
		delete(a.fins, m.id)
		a.mu.Unlock()
		if w != nil {
			w.free()
			if m.code != 0 {
				w.refused = codeErr(m)
			} else {
				w.read = true
			}
			close(w.done)
		}
	}
}

// memErrCode is the ctrlErr (or refusing ctrlFin) code of a failure to
// allocate or register memory for the peer: over a cap of this side
// (ErrLimit) or not.
func memErrCode(err error) uint8 {
	if isLimit(err) {
		return errCodeLimit
	}
	return errCodeNoMemory
}

// serveRequest allocates and grants memory the peer asked for.
func (s *Session) serveRequest(m ctrlMsg) (*grantState, uint8, error) {
	switch {
	case m.len == 0:
		return nil, errCodeProtocol, fmt.Errorf("a request of 0 bytes")
	case m.len > uint64(s.cfg.MaxRequest):
		return nil, errCodeLimit, fmt.Errorf("a request of %d bytes: this side grants at most %d per request", m.len, s.cfg.MaxRequest)
	case !grantable(m.access):
		return nil, errCodeAccess, fmt.Errorf("access %v: ask for remote read, write or atomic", m.access)
	}
	// Refused before anything is allocated (grant checks again): a
	// request past MaxGranted cost an allocation of its size, zeroed,
	// before (TestAdv2RefusedRequestsCostNothing).
	a := &s.agent
	a.mu.Lock()
	held := a.granted
	a.mu.Unlock()
	if held+int64(m.len) > s.cfg.MaxGranted { // m.len ≤ MaxRequest
		return nil, errCodeLimit, fmt.Errorf("%d bytes granted to the peer already, %d more would pass the cap of %d", held, m.len, s.cfg.MaxGranted)
	}
	mr, err := s.mem.Alloc(int(m.len))
	if err != nil {
		// The allocator's MaxMemory is a cap too: the requester sees
		// ErrLimit (before, an unexported refusal:
		// TestAdv2PeerAllocatorLimit).
		return nil, memErrCode(err), err
	}
	clear(mr.Bytes()) // what it held before is not the peer's to see
	g, err := s.grant(mr, m.access, m.lease, true)
	if err != nil {
		mr.Free()
		return nil, memErrCode(err), err
	}
	return g, 0, nil
}
