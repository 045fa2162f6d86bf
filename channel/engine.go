package channel

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/sched"
)

// opKind is the operation of a work request.
type opKind uint8

const (
	opSend opKind = iota
	opSendImm
	opWrite
	opWriteImm
	opRead
	opCAS
	opFAA
	opRecv
	opWriteInline
)

var opNames = [...]string{
	opSend:        "send",
	opSendImm:     "send with immediate",
	opWrite:       "write",
	opWriteImm:    "write with immediate",
	opRead:        "read",
	opCAS:         "compare-and-swap",
	opFAA:         "fetch-and-add",
	opRecv:        "receive",
	opWriteInline: "inline write",
}

func (k opKind) String() string { return opNames[k] }

// Work request ids. The top byte tags who owns the completion; a slot's id
// carries its index and a 24-bit generation, so a completion is routed to
// its waiter with one array index, and a completion that arrives for an
// earlier use of the slot is recognised and dropped.
const (
	tagSlot  = 0xC5 // bits 55..32 generation, 31..0 slot index
	tagUnsig = 0xC6 // unsignaled request: bits 31..0 peer number
	tagBell  = 0xC7 // doorbell receive: bits 31..0 peer number
	genMask  = 1<<24 - 1
)

func slotWRID(idx, gen uint32) uint64 {
	return uint64(tagSlot)<<56 | uint64(gen&genMask)<<32 | uint64(idx)
}

func unsigWRID(peer int) uint64 { return uint64(tagUnsig)<<56 | uint64(uint32(peer)) }

func bellWRID(peer int) uint64 { return uint64(tagBell)<<56 | uint64(uint32(peer)) }

// Slot states.
const (
	slotFree     uint32 = iota
	slotPosted          // owned by the device; an owner will collect it
	slotDone            // completed; the owner has not released it yet
	slotDetached        // owned by the device; nobody collects it: free it on completion
)

// slot is one operation in flight. Slots are allocated once, when the
// engine is built, and recycled: posting and completing an operation
// allocates nothing.
type slot struct {
	idx    uint32
	marker bool // a peer's periodic signaled request, never in the free list
	gen    atomic.Uint32
	state  atomic.Uint32
	kind   opKind
	p      *peer
	rel    int32            // send-queue entries this completion retires
	wc     verbs.Completion // written by the poller before state becomes slotDone
	val    uint64           // an atomic's prior value, copied by the poller too
	err    error            // failure before the device saw the request
	closed atomic.Bool      // Close ended the request before its completion came (endPosted)
	queued atomic.Bool      // queued in a Batch scope, not handed to the device yet (flush, drop)
	ch     chan struct{}    // capacity 1: the completion arrived
	wake   atomic.Pointer[chan struct{}]

	// Scope bookkeeping (owned by the scope's goroutine).
	seen bool // the scope's caller observed the result
}

func (s *slot) notify() {
	select {
	case s.ch <- struct{}{}:
	default:
	}
	if w := s.wake.Load(); w != nil {
		select {
		case *w <- struct{}{}:
		default:
		}
	}
}

// engine is the completion side shared by every queue pair of a Channel
// or MultiChannel: one CQ, a pool of slots, and the poller election.
type engine struct {
	opts    Options
	dev     string
	pd      *verbs.ProtectionDomain
	cq      *verbs.CompletionQueue
	scratch *verbs.MemoryRegion // 8 bytes of atomic result per slot, then each peer's inline staging area
	slots   []slot
	nslots  int // slots in the free pool (markers follow)
	peers   []*peer
	self    int

	freeMu sync.Mutex
	free   []uint32
	// The waiters for a free slot (take) wait with a context that the
	// next release (or close) ends: a release makes no completion, and
	// the waiter that polls may be asleep on the completion channel.
	// Made by the first waiter after a release; under freeMu.
	slotWait context.Context
	// heldWaiting counts the slots held by Batch scopes that wait for
	// one more (take with held > 0): if they are all of them, nothing
	// can release one. Under freeMu.
	heldWaiting int
	slotWake    context.CancelFunc

	pollMu sync.Mutex // the right to poll the CQ and sleep on it
	// late: close gave up waiting for a poller to leave the CQ; the
	// poller, when it leaves (unlockPoll), ends the requests in flight
	// and frees the scratch memory it may still read (finishLate, once:
	// lateDone).
	late, lateDone atomic.Bool
	waiters        atomic.Int32
	pollFree       chan struct{} // capacity 1: the poller left; someone else should poll
	wcs            []verbs.Completion
	spin           spinStats     // how long waits took (the adaptive spin policy)
	rung           atomic.Uint64 // doorbells received (Options.Doorbells)

	bcMu      sync.Mutex
	bc        chan struct{} // closed when completions were dispatched (condition waiters)
	bcWaiters atomic.Int32

	scopes sync.Pool // *scope

	closeMu sync.Mutex
	closed  atomic.Bool
	done    chan struct{}
}

// newEngine creates the CQ, one RC queue pair per peer (none for self),
// the slot pool and the scratch memory. With a non-nil cm (one peer, no
// self), the queue pair of peer 0 is the one cm connects through the RDMA
// CM with the engine's spec (its CQ included) instead of an unconnected one.
func newEngine(pd *verbs.ProtectionDomain, npeers, self int, opts Options, cm func(verbs.QPSpec) (*verbs.CMConn, error)) (e *engine, err error) {
	if pd == nil {
		return nil, errors.New("channel: nil protection domain")
	}
	opts, err = opts.withDefaults()
	if err != nil {
		return nil, err
	}
	dev := pd.Context()
	attr, err := dev.QueryDevice()
	if err != nil {
		return nil, fmt.Errorf("channel: %w", err)
	}
	nqp := npeers
	if self >= 0 && self < npeers {
		nqp--
	}
	total := nqp * (opts.QP.MaxSendWR + opts.QP.MaxRecvWR)
	if attr.MaxCQE > 0 {
		total = min(total, attr.MaxCQE)
	}
	total = max(total, 16)
	e = &engine{opts: opts, dev: dev.Name(), pd: pd, self: self,
		pollFree: make(chan struct{}, 1), done: make(chan struct{}),
		wcs: make([]verbs.Completion, 32), peers: make([]*peer, npeers)}
	var closers []func() error
	defer func() {
		if err != nil {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		}
	}()
	if e.cq, err = dev.NewCompletionQueue(verbs.CQSpec{Entries: total}); err != nil {
		return nil, fmt.Errorf("channel: %w", err)
	}
	closers = append(closers, e.cq.Close)
	e.nslots = opts.MaxOutstanding
	if e.nslots == 0 {
		e.nslots = min(e.cq.Cap(), defaultMaxOutstanding)
	}
	e.nslots = min(e.nslots, e.cq.Cap())
	spec := opts.QP
	spec.SendCQ = e.cq
	for i := range npeers {
		if i == self {
			continue
		}
		if cm != nil {
			conn, err := cm(spec)
			if err != nil {
				return nil, err
			}
			closers = append(closers, conn.Close) // and its QP
			e.peers[i] = newPeer(e, i, conn.QP())
			e.peers[i].cm = conn
			continue
		}
		q, err := pd.NewRCQueuePair(spec)
		if err != nil {
			return nil, fmt.Errorf("channel: queue pair for peer %d: %w", i, err)
		}
		closers = append(closers, q.Close)
		e.peers[i] = newPeer(e, i, q)
	}
	inline := 0
	for _, p := range e.peers {
		if p != nil {
			p.inlineOff = 8*e.nslots + inline
			inline += p.inlineMax
		}
	}
	if e.scratch, err = pd.Alloc(max(8*e.nslots+inline, 8), verbs.AccessLocalWrite); err != nil {
		return nil, fmt.Errorf("channel: scratch memory: %w", err)
	}
	closers = append(closers, e.scratch.Close)
	e.slots = make([]slot, e.nslots+nqp)
	e.free = make([]uint32, 0, e.nslots)
	for i := range e.slots {
		s := &e.slots[i]
		s.idx = uint32(i)
		s.ch = make(chan struct{}, 1)
		if i < e.nslots {
			e.free = append(e.free, uint32(e.nslots-1-i)) // pop order 0, 1, 2...
		}
	}
	m := e.nslots
	for _, p := range e.peers {
		if p != nil {
			p.marker = &e.slots[m]
			p.marker.marker = true
			p.marker.p = p
			m++
		}
	}
	return e, nil
}

// acquire takes a slot from the pool, waiting (polling the CQ, so that
// completions free slots) until one is free or ctx ends.
func (e *engine) acquire(ctx context.Context, p *peer, kind opKind) (*slot, error) {
	return e.take(ctx, true, p, kind, 0)
}

// tryAcquire takes a slot from the pool, or fails at once with an error
// wrapping verbs.ErrQueueFull when none is free.
func (e *engine) tryAcquire(p *peer, kind opKind) (*slot, error) {
	return e.take(context.Background(), false, p, kind, 0)
}

// take takes a slot from the pool. With wait, it waits for one while
// none is free; held is the number of slots the caller (a Batch scope)
// holds meanwhile. A waiter holding slots fails at once, with an error
// wrapping verbs.ErrQueueFull, when the slots of the scopes already
// waiting and its own are all the slots: none could ever be released.
func (e *engine) take(ctx context.Context, wait bool, p *peer, kind opKind, held int) (*slot, error) {
	for {
		if e.closed.Load() {
			return nil, ErrClosed
		}
		e.freeMu.Lock()
		if n := len(e.free); n > 0 {
			idx := e.free[n-1]
			e.free = e.free[:n-1]
			e.freeMu.Unlock()
			s := &e.slots[idx]
			s.gen.Add(1)
			s.kind, s.p, s.rel, s.err, s.seen = kind, p, 0, nil, false
			s.closed.Store(false)
			s.queued.Store(false)
			s.wc, s.val = verbs.Completion{}, 0
			s.wake.Store(nil)
			select { // a token left by an earlier use
			case <-s.ch:
			default:
			}
			s.state.Store(slotPosted)
			return s, nil
		}
		if !wait {
			e.freeMu.Unlock()
			return nil, fmt.Errorf("%d operations in flight (Options.MaxOutstanding): %w", e.nslots, verbs.ErrQueueFull)
		}
		if held > 0 && e.heldWaiting+held >= e.nslots {
			e.freeMu.Unlock()
			return nil, fmt.Errorf("every one of the %d operation slots (Options.MaxOutstanding) is held by a Batch scope "+
				"that waits for one more, this one's %d included: none can come free; "+
				"Release handles whose results you have read, or let fewer scopes run at once: %w", e.nslots, held, verbs.ErrQueueFull)
		}
		if e.slotWait == nil {
			e.slotWait, e.slotWake = context.WithCancel(context.Background())
		}
		released := e.slotWait
		e.heldWaiting += held
		e.freeMu.Unlock()
		err := e.waitForSlot(ctx, released)
		if held > 0 {
			e.freeMu.Lock()
			e.heldWaiting -= held
			e.freeMu.Unlock()
		}
		if err != nil {
			return nil, err
		}
	}
}

// waitForSlot waits until a slot is free, ctx ends, or released (the
// next release) ends. Off the data path: it allocates.
func (e *engine) waitForSlot(ctx context.Context, released context.Context) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(released, cancel)
	defer stop()
	err := e.wait(wctx, e.hasFree, nil)
	if err != nil && ctx.Err() == nil && released.Err() != nil {
		return nil // a slot was released, and taken by another: look again
	}
	return err
}

func (e *engine) hasFree() bool {
	e.freeMu.Lock()
	n := len(e.free)
	e.freeMu.Unlock()
	return n > 0 || e.closed.Load()
}

// release returns a slot whose completion arrived (or that was never
// posted) to the pool.
func (e *engine) release(s *slot) {
	s.gen.Add(1) // handles to it are stale from now on
	s.err = nil
	s.state.Store(slotFree)
	if s.marker {
		return
	}
	e.freeMu.Lock()
	e.free = append(e.free, s.idx)
	wake := e.slotWake
	if wake != nil {
		e.slotWait, e.slotWake = nil, nil
	}
	e.freeMu.Unlock()
	if wake != nil {
		wake()
	}
}

// detach gives up ownership of a posted slot: the poller frees it when its
// completion arrives. If it already arrived, detach frees it now.
func (e *engine) detach(s *slot) {
	if s.state.CompareAndSwap(slotPosted, slotDetached) {
		// A goroutine in Handle.Wait for it: the handle is stale. It
		// may be the poller, asleep in the CQ.
		s.notify()
		e.wakePoller()
		return
	}
	e.release(s)
}

// poll moves completions from the CQ to their slots. Called with pollMu.
func (e *engine) poll() (int, error) {
	n, err := e.cq.Poll(e.wcs)
	for i := range e.wcs[:n] {
		e.dispatch(&e.wcs[i])
	}
	if n > 0 && e.bcWaiters.Load() > 0 {
		e.broadcast()
	}
	return n, err
}

// bcChan returns the channel the next broadcast closes.
func (e *engine) bcChan() chan struct{} {
	e.bcMu.Lock()
	defer e.bcMu.Unlock()
	if e.bc == nil {
		e.bc = make(chan struct{})
	}
	return e.bc
}

// broadcast wakes every goroutine that waits for a condition (queue room,
// drained peers, a free slot, a broken peer) rather than for a slot of
// its own.
func (e *engine) broadcast() {
	e.bcMu.Lock()
	if e.bc != nil {
		close(e.bc)
		e.bc = nil
	}
	e.bcMu.Unlock()
}

func (e *engine) dispatch(wc *verbs.Completion) {
	switch wc.WRID >> 56 {
	case tagUnsig:
		// Unsignaled requests complete only when they fail (or are flushed).
		if i := int(uint32(wc.WRID)); i < len(e.peers) && e.peers[i] != nil && wc.Status != verbs.StatusSuccess {
			e.peers[i].fail(&OpError{Op: opWriteInline.String(), Peer: i, Err: wc.Err()})
		}
	case tagBell:
		i := int(uint32(wc.WRID))
		if i >= len(e.peers) || e.peers[i] == nil {
			return
		}
		p := e.peers[i]
		if wc.Status != verbs.StatusSuccess {
			p.rqUsed.Add(-1)
			if wc.Status != verbs.StatusWRFlushErr {
				p.fail(&OpError{Op: "doorbell receive", Peer: i, Err: wc.Err()})
			}
			return
		}
		// Re-posted at once: the peer may ring again (and, until
		// Options.Doorbells are posted, one more: ringBell). Counted
		// after: a ring seen in Rung has its receives back.
		if err := p.ringBell(); err != nil {
			p.rqUsed.Add(-1)
			p.breakQP(&OpError{Op: "doorbell receive", Peer: i, Err: err})
		}
		e.rung.Add(1)
	case tagSlot:
		idx := uint32(wc.WRID)
		if int(idx) >= len(e.slots) {
			return
		}
		s := &e.slots[idx]
		if s.gen.Load()&genMask != uint32(wc.WRID>>32)&genMask {
			return // for an earlier use of the slot
		}
		st := s.state.Load()
		if st != slotPosted && st != slotDetached {
			return
		}
		p := s.p
		if s.kind == opRecv {
			p.rqUsed.Add(-1)
		} else {
			p.sqUsed.Add(-s.rel)
		}
		p.pending.Add(-1)
		if wc.Status != verbs.StatusSuccess {
			p.fail(&OpError{Op: s.kind.String(), Peer: p.idx, Err: wc.Err()})
		}
		s.wc = *wc
		if (s.kind == opCAS || s.kind == opFAA) && wc.Status == verbs.StatusSuccess {
			s.val = e.scratchResult(s)
		}
		if s.state.CompareAndSwap(slotPosted, slotDone) {
			s.notify()
			return
		}
		e.release(s) // detached
	}
}

// unlockPoll gives up the poller role and, if others wait, wakes one of
// them to take it over.
func (e *engine) unlockPoll() {
	if e.late.Load() {
		e.finishLate()
	}
	e.pollMu.Unlock()
	if e.waiters.Load() > 0 {
		select {
		case e.pollFree <- struct{}{}:
		default:
		}
	}
}

// nudge wakes waiters so that they look at their condition again: for
// changes that no completion announces (a peer broken, a post rolled
// back).
func (e *engine) nudge() {
	e.broadcast()
	select {
	case e.pollFree <- struct{}{}:
	default:
	}
	e.wakePoller()
}

// wakePoller ends the poller's sleep on the CQ, if it sleeps there (or
// its next one): its own condition may hold now, and no completion would
// tell it. The poller polls and looks again. After close, the CQ's Wake
// fails (closed), and the poller has left or is leaving.
func (e *engine) wakePoller() {
	e.cq.Wake()
}

// progress polls the CQ once if no other goroutine is polling it. It
// never blocks.
func (e *engine) progress() error {
	if e.closed.Load() {
		return ErrClosed
	}
	if !e.pollMu.TryLock() {
		return nil
	}
	_, err := e.poll()
	e.unlockPoll()
	if err != nil {
		return fmt.Errorf("channel: %w", err)
	}
	return nil
}

// wait blocks until ready reports true, ctx ends or the engine closes.
// One waiting goroutine at a time polls the CQ and dispatches completions
// for everyone (spinning as Options.SpinPolls says, then sleeping on the
// CQ's completion channel); the others sleep until their completion
// arrives (ch), the poller leaves, or, with a nil ch, any completion is
// dispatched (or a peer breaks). A wait for a condition that completions
// change (room in a queue, drained peers, a free slot) passes a nil ch:
// every goroutine whose condition the completions of one poll made true
// must wake, and the poller hands its role to one sleeper only. ready
// must be cheap and must not block.
func (e *engine) wait(ctx context.Context, ready func() bool, ch chan struct{}) error {
	return e.waitWith(ctx, ready, ch, e.opts.SpinPolls)
}

// waitWith is wait with the spinning policy mode (an Options.SpinPolls).
func (e *engine) waitWith(ctx context.Context, ready func() bool, ch chan struct{}, mode int) (err error) {
	if ready() {
		return nil
	}
	w := newWaiter(mode)
	defer func() { w.done(&e.spin, err == nil) }()
	var yielded time.Time // the last runtime.Gosched of this wait's spins
	spins := 0            // since then
	for {
		if ready() {
			return nil
		}
		if e.closed.Load() {
			return ErrClosed
		}
		if !e.pollMu.TryLock() {
			w.yield() // not polling: not spinning either
			if polling, err := e.sleep(ctx, ready, ch); err != nil {
				return err
			} else if !polling {
				continue
			}
		}
		// This goroutine is the poller.
		n, err := e.poll()
		if err == nil && n == 0 && !e.readyLocked(ready) {
			now := time.Now()
			if w.spin(&e.spin, now) {
				e.unlockPoll()
				select {
				case <-ctx.Done():
					if ready() {
						return nil
					}
					return waitErr(ctx.Err())
				default:
				}
				// The process' goroutines get this processor at the
				// first spin after goschedGap (and at every one with
				// GOMAXPROCS 1): see goschedGap.
				spins++
				if yielded.IsZero() {
					yielded = now // the gap counts from the first spin
				}
				if spins >= goschedSpins || now.Sub(yielded) >= goschedGap {
					yielded, spins = now, 0
					runtime.Gosched()
				} else {
					sched.Gosched()
				}
				if w.mode == SpinAdaptive {
					sched.Yield() // see spin.go
				}
				continue
			}
			err = e.cq.Wait(ctx)
		}
		e.unlockPoll()
		if err != nil {
			if ready() {
				return nil
			}
			if ctx.Err() != nil {
				return waitErr(ctx.Err())
			}
			if e.closed.Load() {
				return ErrClosed
			}
			return fmt.Errorf("channel: %w", err)
		}
	}
}

// readyLocked calls ready, a condition of the caller's, as the poller
// (pollMu held): if ready panics, the role goes with the panic to nobody,
// and the channel's every later wait would sleep for completions that
// nobody polls any more.
func (e *engine) readyLocked(ready func() bool) bool {
	returned := false
	defer func() {
		if !returned {
			e.unlockPoll()
		}
	}()
	ok := ready()
	returned = true
	return ok
}

// goschedSpins and goschedGap: a spinning wait offers its processor to
// the process' other goroutines (runtime.Gosched) once goschedSpins spins
// or goschedGap went by since it last did, whichever comes first; in the
// spins between, only with GOMAXPROCS 1 (sched.Gosched). With more than
// one processor, runtime.Gosched wakes an idle processor's thread at
// every call, which finds nothing to do and sleeps again. Measured with
// session's BenchmarkXprocRTT and BenchmarkXprocRequest between two
// processes, three alternating runs: yielding at every spin (before),
// round trips over shared memory 13.0-16.6 µs (session and bare channel),
// over unix sockets 33-51, remote memory requests 9-20 and 27-42 µs;
// never yielding, round trips 4-7 µs, but a goroutine the spinner had
// readied on its processor (an agent's answer for its requester) waited
// for the end of the spin: requests 250 µs; every 16th spin, round trips
// 3.6-7.6 and 15-20 µs, requests 11-16 and 54-69 µs (a spin over a unix
// socket reads it, and takes longer); with this rule, round trips 4.1-6.1
// µs over shared memory and 25-37 over unix sockets, requests 14-16 and
// 32-38 µs.
const (
	goschedSpins = 16
	goschedGap   = 2 * time.Microsecond
)

// waitCond is wait for a condition of the caller's (Channel.Wait, and
// Channel.Sleep with mode SpinNever).
func (e *engine) waitCond(ctx context.Context, ready func() bool, mode int) error {
	if err := e.waitWith(ctx, ready, nil, mode); err != nil {
		if errors.Is(err, ErrClosed) {
			return err
		}
		return fmt.Errorf("channel: wait: %w", err)
	}
	return nil
}

// sleep waits, while another goroutine polls, for ch (or any dispatch,
// with a nil ch), for the poller to leave, or for ctx to end. If the
// poller left before this goroutine went to sleep, or handed it the role
// while it slept, it returns polling=true with pollMu held.
func (e *engine) sleep(ctx context.Context, ready func() bool, ch chan struct{}) (polling bool, err error) {
	e.waiters.Add(1)
	defer e.waiters.Add(-1)
	wake := ch
	if ch == nil {
		e.bcWaiters.Add(1)
		defer e.bcWaiters.Add(-1)
		wake = e.bcChan()
	}
	// Registered as a waiter: a poller that leaves from now on wakes us.
	if ready() {
		return false, nil
	}
	if e.pollMu.TryLock() {
		return true, nil
	}
	select {
	case <-wake:
	case <-e.pollFree:
		// The poller left and handed its role to this goroutine: take
		// it, whether or not this goroutine's own condition holds by
		// now (the memory a doorbell wrote lands before its
		// completion): the others sleep until someone polls, and
		// waitWith polls once and hands the role on when it leaves.
		if e.pollMu.TryLock() {
			return true, nil
		}
		// Another goroutine polls: it hands the role on in turn.
	case <-ctx.Done():
		err = ctx.Err()
	case <-e.done:
		err = ErrClosed
	}
	if err != nil && ready() {
		err = nil
	}
	if err != nil && err != ErrClosed {
		err = waitErr(err)
	}
	return false, err
}

// waitErr wraps the error that ended a wait: a context error also matches
// verbs.ErrTimeout.
func waitErr(err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return fmt.Errorf("%w: %w", verbs.ErrTimeout, err)
	}
	return err
}

// waitSlot waits for one slot's completion.
func (e *engine) waitSlot(ctx context.Context, s *slot) error {
	return e.wait(ctx, func() bool { return s.state.Load() == slotDone }, s.ch)
}

// waitHandle waits for the completion of the slot's use gen, or until
// that use is released (by another goroutine, in spite of Handle's
// contract: its waiter must not sleep on for a slot that completes no
// more, or that serves another operation by then).
func (e *engine) waitHandle(ctx context.Context, s *slot, gen uint32) error {
	return e.wait(ctx, func() bool {
		st := s.state.Load()
		return st == slotDone || st == slotDetached || st == slotFree || s.gen.Load() != gen
	}, s.ch)
}

// drain waits until no signaled request of the peers is in flight.
func (e *engine) drain(ctx context.Context, peers []*peer) error {
	return e.wait(ctx, func() bool {
		for _, p := range peers {
			if p != nil && p.pending.Load() > 0 {
				return false
			}
		}
		return true
	}, nil)
}

// endPosted completes every slot still owned by the device with
// ErrClosed, and frees detached ones. Called by close (or finishLate),
// with pollMu, after the queue pairs are destroyed.
func (e *engine) endPosted() {
	for i := range e.slots {
		s := &e.slots[i]
		if s.marker {
			continue
		}
		switch s.state.Load() {
		case slotPosted:
			// Possibly a slot taken by a post that will fail (closed)
			// and release it: only atomics are written here.
			s.closed.Store(true)
			if s.state.CompareAndSwap(slotPosted, slotDone) {
				s.notify()
			} else if s.state.Load() == slotDetached {
				e.release(s) // released by its owner meanwhile
			}
		case slotDetached:
			e.release(s)
		}
	}
}

// finishLate is close's end of a poller that was still inside the CQ
// when close gave up waiting for it: it completes the requests left with
// ErrClosed and frees the scratch memory. Called with pollMu, once.
func (e *engine) finishLate() {
	if e.lateDone.CompareAndSwap(false, true) {
		e.endPosted()
		e.scratch.Close()
	}
}

// close breaks every queue pair, waits (at most the flush grace) for the
// flushes, and destroys everything.
func (e *engine) close() error {
	e.closeMu.Lock()
	defer e.closeMu.Unlock()
	if e.closed.Load() {
		return nil
	}
	for _, p := range e.peers {
		if p != nil {
			if p.cm != nil {
				// Stop watching for the peer's disconnection, then
				// tell the peer (this also moves the QP to the error
				// state).
				p.stopWatch()
				p.cm.Disconnect()
			}
			p.breakQP(ErrClosed)
		}
	}
	// A post that saw the peer usable before it broke holds p.mu until
	// its requests are counted in pending: once the lock was taken here,
	// every request posted is counted (and drained below), and later
	// posts see the peer broken.
	for _, p := range e.peers {
		if p != nil {
			p.mu.Lock()
			//lint:ignore SA2001 an empty critical section: a barrier
			p.mu.Unlock()
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.opts.FlushGrace)
	e.drain(ctx, e.peers)
	cancel()
	for _, p := range e.peers {
		if p != nil && p.cm != nil {
			p.awaitDisconnect()
		}
	}
	e.closed.Store(true)
	close(e.done)
	// A poller that went back to sleep in the CQ after the breaks above
	// woke it (nothing more to flush) sees closed now, instead of holding
	// the role until its own ctx ends (lockPoll below waits for it).
	e.wakePoller()
	e.freeMu.Lock()
	if e.slotWake != nil {
		e.slotWake() // a waiter for a slot may sleep on the completion channel
	}
	e.freeMu.Unlock()
	// Wait for a poller that is inside the CQ to leave it: with every queue
	// pair in the error state, whatever it waits for has been flushed.
	// (Closing the CQ wakes it in any case.)
	polling := e.lockPoll(e.opts.FlushGrace)
	var errs []error
	for _, p := range e.peers {
		if p != nil {
			// Under the posting lock: a post in progress may have passed
			// its check of closed; it ends before the queue pair, and the
			// scratch memory (the inline staging area) after it, go.
			// Later posts see closed. (Those waiting for room in a queue
			// have been woken: the peer is broken.)
			p.mu.Lock()
			err := p.closeQP()
			p.mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
		}
	}
	if polling {
		// No poller is left, and none comes: a request whose completion
		// did not come within the flush grace would leave its handle
		// undone forever. With its queue pair destroyed the device no
		// longer uses its buffers: it completes with ErrClosed.
		e.endPosted()
		if err := e.scratch.Close(); err != nil {
			errs = append(errs, err)
		}
	} else {
		// A poller is still inside the CQ (descheduled, or a provider
		// slow to return): it may yet dispatch completions it polled,
		// reading atomic results from the scratch memory. It ends the
		// requests left and frees that memory when it leaves (closing
		// the CQ below makes it leave); if it left meanwhile, this does.
		e.late.Store(true)
		if e.pollMu.TryLock() {
			e.finishLate()
			e.pollMu.Unlock()
		}
	}
	if err := e.cq.Close(); err != nil {
		errs = append(errs, err)
	}
	if !polling {
		// The CQ is closed: a poller inside it returns at once. Wait for
		// it to leave (lateWait at most, or the flush grace if longer:
		// it may be descheduled, or in a caller's ready condition), so
		// that the scratch memory is freed before Close returns, as
		// closing the protection domain next requires.
		if !e.lateDone.Load() && e.lockPoll(max(e.opts.FlushGrace, lateWait)) {
			e.finishLate()
			e.pollMu.Unlock()
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("channel: close: %w", err)
	}
	return nil
}

// lockPoll takes pollMu for close, trying for d at most; false if a
// poller kept it that long.
func (e *engine) lockPoll(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !e.pollMu.TryLock() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Microsecond)
	}
	return true
}

// lateWait is how long close waits, after it closed the CQ, for a
// poller that was still inside it to leave (unless the flush grace is
// longer): past it, the poller frees the scratch memory when it leaves,
// after Close returned.
const lateWait = time.Second
