package channel

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/goverbs/verbs"
)

// scope is the state of one Batch call: the operations it created, those
// queued but not yet posted, and a wake-up channel for WaitAny.
type scope struct {
	e      *engine
	ctx    context.Context
	hs     []Handle // every operation of the scope, in order
	queued []work   // created, not yet posted; sgl of each is in sges
	sges   []verbs.SGE
	offs   []int   // offs[i]: start of queued[i]'s SGEs in sges
	failed []error // operations that failed before they had a slot, not yet reported by WaitAll
	wake   chan struct{}
	peers  []Batch // per-peer views
	multi  MultiBatch
	ended  bool
}

func (e *engine) getScope(ctx context.Context) *scope {
	sc, _ := e.scopes.Get().(*scope)
	if sc == nil {
		sc = &scope{e: e, wake: make(chan struct{}, 1)}
		sc.peers = make([]Batch, len(e.peers))
		for i, p := range e.peers {
			sc.peers[i] = Batch{sc: sc, p: p, idx: i}
			if p == nil {
				sc.peers[i].err = fmt.Errorf("peer %d is this process: %w", i, ErrNoPeer)
			}
		}
		sc.multi.sc = sc
	}
	sc.ctx, sc.ended = ctx, false
	return sc
}

func (e *engine) putScope(sc *scope) {
	clear(sc.hs)
	clear(sc.queued)
	clear(sc.failed)
	sc.hs, sc.queued, sc.sges, sc.offs, sc.failed = sc.hs[:0], sc.queued[:0], sc.sges[:0], sc.offs[:0], sc.failed[:0]
	sc.ctx = nil
	select {
	case <-sc.wake:
	default:
	}
	e.scopes.Put(sc)
}

// run runs fn in a scope and, whatever happens in fn (a returned error or
// a panic), polls every operation of the scope that is still in flight
// before it returns or re-panics.
func (e *engine) run(ctx context.Context, fn func(sc *scope) error) (err error) {
	if ctx == nil {
		return errors.New("channel: Batch: nil context")
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("channel: batch: %w", waitErr(err))
	}
	sc := e.getScope(ctx)
	returned := false // fn returned: neither a panic nor runtime.Goexit (t.FailNow) ended it
	defer func() {
		r := recover()
		ferr := sc.finish(returned && r == nil && err == nil)
		e.putScope(sc)
		if r != nil {
			panic(r)
		}
		if err == nil {
			err = ferr
		} else if ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()
	err = fn(sc)
	returned = true
	return err
}

// add creates one operation of the scope: it takes a slot and queues the
// request; Flush (or any wait) posts it.
func (sc *scope) add(b *Batch, w work) Handle {
	if sc == nil {
		return errHandle(&OpError{Op: w.kind.String(), Peer: b.idx, Err: errNoScope})
	}
	if sc.ended {
		return errHandle(&OpError{Op: w.kind.String(), Peer: b.idx, Err: errEnded})
	}
	if b.err != nil {
		return sc.fail(b, w.kind, b.err)
	}
	if err := b.p.accepts(w.kind); err != nil {
		return sc.fail(b, w.kind, err)
	}
	s, err := sc.e.tryAcquire(b.p, w.kind)
	if err != nil {
		// Post what is queued, so that completions can free slots, and
		// wait for one unless this scope holds them all.
		sc.flush()
		if sc.held() >= sc.e.nslots {
			return sc.fail(b, w.kind, fmt.Errorf("the batch holds all %d operation slots (Options.MaxOutstanding); Release handles whose results you have read: %w", sc.e.nslots, verbs.ErrQueueFull))
		}
		if s, err = sc.e.take(sc.ctx, true, b.p, w.kind, sc.held()); err != nil {
			return sc.fail(b, w.kind, err)
		}
	}
	w.s = s
	s.queued.Store(true)
	sc.offs = append(sc.offs, len(sc.sges))
	sc.sges = append(sc.sges, w.sgl...)
	w.sgl = nil
	sc.queued = append(sc.queued, w)
	h := handleOf(s)
	sc.hs = append(sc.hs, h)
	return h
}

// held counts the slots the scope holds: its operations' handles that
// were not released.
func (sc *scope) held() int {
	n := 0
	for _, h := range sc.hs {
		if h.live() {
			n++
		}
	}
	return n
}

// fail returns the handle of an operation that failed before it had a
// slot, and remembers the failure for WaitAll and the end of the scope.
func (sc *scope) fail(b *Batch, kind opKind, err error) Handle {
	err = &OpError{Op: kind.String(), Peer: b.idx, Err: err}
	sc.failed = append(sc.failed, err)
	return errHandle(err)
}

// flush posts the queued operations, one provider call per run of
// operations for the same peer and queue (as few as the queue depth
// allows). Operations that could not be posted complete at once with the
// error.
func (sc *scope) flush() error {
	q := sc.queued
	if len(q) == 0 {
		return nil
	}
	for i := range q {
		q[i].s.queued.Store(false)
		end := len(sc.sges)
		if i+1 < len(q) {
			end = sc.offs[i+1]
		}
		q[i].sgl = sc.sges[sc.offs[i]:end:end]
	}
	var first error
	for i := 0; i < len(q); {
		j := i + 1
		recv := q[i].kind == opRecv
		for j < len(q) && q[j].s.p == q[i].s.p && (q[j].kind == opRecv) == recv {
			j++
		}
		run := q[i:j]
		n, err := run[0].s.p.post(sc.ctx, true, run)
		for k := n; k < len(run); k++ {
			s := run[k].s
			if k == n && err != nil {
				s.err = err
			} else {
				s.err = fmt.Errorf("an earlier request of the same post failed: %w", ErrNotPosted)
			}
			s.state.Store(slotDone)
			s.notify()
		}
		if err != nil && first == nil {
			first = &OpError{Op: run[n].kind.String(), Peer: run[n].s.p.idx, Err: err}
		}
		i = j
	}
	clear(sc.queued)
	sc.queued, sc.sges, sc.offs = sc.queued[:0], sc.sges[:0], sc.offs[:0]
	return first
}

// drop completes the queued operations without posting them.
func (sc *scope) drop() {
	for i := range sc.queued {
		s := sc.queued[i].s
		s.queued.Store(false)
		s.err = fmt.Errorf("the batch scope ended first: %w", ErrNotPosted)
		s.state.Store(slotDone)
	}
	clear(sc.queued)
	sc.queued, sc.sges, sc.offs = sc.queued[:0], sc.sges[:0], sc.offs[:0]
}

// finish ends the scope: it posts what is queued (after a normal return)
// or drops it (after an error or a panic), waits for every operation in
// flight, and releases them all. If ctx ends before they complete, the
// peers that still have operations in flight are broken, their flushes
// are awaited (Options.FlushGrace), and what still has not completed is
// detached. It returns the first failure among the operations whose
// results the caller did not look at, and why waiting stopped.
func (sc *scope) finish(normal bool) error {
	var errs []error
	if normal {
		if err := sc.flush(); err != nil {
			errs = append(errs, err)
		}
	} else {
		sc.drop()
	}
	sc.ended = true
	waitErr := sc.waitAll(sc.hs)
	if waitErr != nil {
		var broken []*peer
		for _, h := range sc.hs {
			if h.live() && h.s.state.Load() != slotDone && !contains(broken, h.s.p) {
				broken = append(broken, h.s.p)
				h.s.p.breakQP(fmt.Errorf("a batch was abandoned: %w", waitErr))
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), sc.e.opts.FlushGrace)
		sc.ctx = ctx
		sc.waitAll(sc.hs)
		cancel()
		errs = append(errs, fmt.Errorf("channel: batch: waiting for its operations: %w (the queue pairs with operations in flight were broken to flush them)", waitErr))
	}
	unseen := 0
	var firstUnseen error
	for _, h := range sc.hs {
		if !h.live() {
			continue
		}
		s := h.s
		if s.state.Load() == slotDone {
			if !s.seen {
				if err := s.result(); err != nil {
					if firstUnseen == nil {
						firstUnseen = err
					}
					unseen++
				}
			}
			sc.e.release(s)
		} else {
			sc.e.detach(s)
		}
	}
	if len(sc.failed) > 0 {
		if firstUnseen == nil {
			firstUnseen = sc.failed[0]
			unseen--
		}
		unseen += len(sc.failed)
	}
	if firstUnseen != nil && normal && waitErr == nil {
		if unseen > 1 {
			firstUnseen = fmt.Errorf("%w (and %d more failed operations)", firstUnseen, unseen-1)
		}
		errs = append(errs, firstUnseen)
	}
	return errors.Join(errs...)
}

func contains(ps []*peer, p *peer) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// waitAll waits for the handles' completions (not their success).
func (sc *scope) waitAll(hs []Handle) error {
	for _, h := range hs {
		if !h.live() || h.s.state.Load() == slotDone {
			continue
		}
		if h.s.queued.Load() {
			return errQueued // of another scope, which has not flushed it
		}
		// A handle of another channel (a Post of it) completes only
		// when its own completion queue is polled.
		if err := h.s.p.e.waitSlot(sc.ctx, h.s); err != nil {
			return err
		}
	}
	return nil
}

// Batch collects operations for one peer inside a scope (Channel.Batch,
// MultiBatch.Peer). Each operation takes a slot and is queued, and returns
// a Handle valid until the scope ends; queued operations are posted with
// one provider call per run (a doorbell batch) by Flush, by any Wait, or
// when the scope ends. A Batch is not safe for concurrent use, and must
// not be used after its scope returns.
type Batch struct {
	sc  *scope
	p   *peer
	idx int
	err error
}

// Send queues a send of sgl.
func (b *Batch) Send(sgl ...verbs.SGE) Handle { return b.sc.add(b, work{kind: opSend, sgl: sgl}) }

// SendImm queues a send with immediate data.
func (b *Batch) SendImm(imm uint32, sgl ...verbs.SGE) Handle {
	return b.sc.add(b, work{kind: opSendImm, imm: imm, sgl: sgl})
}

// Receive queues a receive buffer; Handle.Received describes the message.
func (b *Batch) Receive(sgl ...verbs.SGE) Handle {
	return b.sc.add(b, work{kind: opRecv, sgl: sgl})
}

// Write queues an RDMA write of sgl to dst.
func (b *Batch) Write(dst verbs.RemoteAddr, sgl ...verbs.SGE) Handle {
	return b.sc.add(b, work{kind: opWrite, remote: dst, sgl: sgl})
}

// WriteImm queues an RDMA write with immediate data.
func (b *Batch) WriteImm(dst verbs.RemoteAddr, imm uint32, sgl ...verbs.SGE) Handle {
	return b.sc.add(b, work{kind: opWriteImm, remote: dst, imm: imm, sgl: sgl})
}

// Read queues an RDMA read from src into sgl.
func (b *Batch) Read(src verbs.RemoteAddr, sgl ...verbs.SGE) Handle {
	return b.sc.add(b, work{kind: opRead, remote: src, sgl: sgl})
}

// CompareSwap queues an atomic compare-and-swap; Handle.Value returns the
// prior value.
func (b *Batch) CompareSwap(dst verbs.RemoteAddr, compare, swap uint64) Handle {
	return b.sc.add(b, work{kind: opCAS, remote: dst, a: compare, b: swap})
}

// FetchAdd queues an atomic fetch-and-add; Handle.Value returns the prior
// value.
func (b *Batch) FetchAdd(dst verbs.RemoteAddr, add uint64) Handle {
	return b.sc.add(b, work{kind: opFAA, remote: dst, a: add})
}

// Flush posts the operations queued so far.
func (b *Batch) Flush() error { return b.sc.flushOp() }

// Wait posts what is queued and waits for h, returning its error.
func (b *Batch) Wait(h Handle) error { return b.sc.wait(h) }

// WaitAny posts what is queued and waits until one of hs completes,
// returning its index and error. Completed handles count: pass only those
// still of interest. The handles in flight must belong to one channel (a
// MultiChannel's peers are one); of several, WaitAny fails with an error
// wrapping verbs.ErrNotSupported.
func (b *Batch) WaitAny(hs ...Handle) (int, error) { return b.sc.waitAny(hs) }

// WaitAll posts what is queued and waits for hs (every operation of the
// scope if hs is empty), returning the failures joined.
func (b *Batch) WaitAll(hs ...Handle) error { return b.sc.waitAllOp(hs) }

// Context returns the context of the scope.
func (b *Batch) Context() context.Context { return b.sc.context() }

var errEnded = errors.New("channel: batch used after its scope ended")

// errNoScope: a zero Batch or MultiBatch, which no scope made.
var errNoScope = fmt.Errorf("%w (a zero batch: use the one Batch hands its function)", errEnded)

// context returns the scope's context; a cancelled one for a zero batch
// (no scope).
func (sc *scope) context() context.Context {
	if sc == nil {
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(errNoScope)
		return ctx
	}
	return sc.ctx
}

func (sc *scope) flushOp() error {
	if sc == nil {
		return errNoScope
	}
	if sc.ended {
		return errEnded
	}
	return sc.flush()
}

// Operations that a flush failed to post are complete, with the error:
// the waits below report them through their handles.

func (sc *scope) wait(h Handle) error {
	if sc == nil {
		return errNoScope
	}
	if sc.ended {
		return errEnded
	}
	sc.flush()
	return h.Wait(sc.ctx)
}

func (sc *scope) waitAny(hs []Handle) (int, error) {
	if sc == nil {
		return -1, errNoScope
	}
	if sc.ended {
		return -1, errEnded
	}
	if len(hs) == 0 {
		return -1, errors.New("channel: WaitAny: no handles")
	}
	sc.flush()
	found := -1
	check := func() bool {
		for i, h := range hs {
			if h.Done() || (h.err == nil && !h.live()) {
				found = i
				return true
			}
		}
		return false
	}
	if !check() {
		// The handles' completions come on their channel's completion
		// queue: one, polled here, whichever channel it is.
		var e *engine
		for _, h := range hs {
			if h.live() && !h.s.queued.Load() {
				if e != nil && h.s.p.e != e {
					return -1, fmt.Errorf("channel: wait for any of %d operations: they belong to different channels (completion queues), "+
						"which one wait cannot poll at once: %w", len(hs), verbs.ErrNotSupported)
				}
				e = h.s.p.e
			}
		}
		if e == nil {
			// Each is queued in another scope, which has not flushed it.
			return -1, fmt.Errorf("channel: wait for any of %d operations: %w", len(hs), errQueued)
		}
		w := &sc.wake
		for _, h := range hs {
			if h.live() {
				h.s.wake.Store(w)
			}
		}
		err := e.wait(sc.ctx, check, sc.wake)
		for _, h := range hs {
			if h.live() {
				h.s.wake.CompareAndSwap(w, nil)
			}
		}
		if err != nil {
			return -1, fmt.Errorf("channel: wait for any of %d operations: %w", len(hs), err)
		}
	}
	h := hs[found]
	if h.err == nil && !h.live() {
		return found, ErrStale
	}
	return found, h.Err()
}

func (sc *scope) waitAllOp(hs []Handle) error {
	if sc == nil {
		return errNoScope
	}
	if sc.ended {
		return errEnded
	}
	sc.flush()
	var errs []error
	all := len(hs) == 0
	if all {
		hs = sc.hs
		errs = append(errs, sc.failed...)
		clear(sc.failed)
		sc.failed = sc.failed[:0]
	}
	if err := sc.waitAll(hs); err != nil {
		return fmt.Errorf("channel: wait for all of %d operations: %w", len(hs), err)
	}
	for _, h := range hs {
		if all && h.err == nil && !h.live() {
			continue // released in the scope: nothing to report
		}
		if err := h.Err(); err != nil {
			errs = append(errs, err)
		}
		if h.err != nil {
			// Reported here: not again at the end of the scope.
			sc.failed = slices.DeleteFunc(sc.failed, func(e error) bool { return e == h.err })
		}
	}
	return errors.Join(errs...)
}

// Batch runs fn in a scope in which operations are queued with the
// Batch's methods, posted in doorbell batches, and waited for with
// Wait, WaitAny and WaitAll. When fn returns, or panics, every operation
// of the scope still in flight is polled before Batch returns (or
// re-panics): no buffer named by the scope is in use by the device
// afterwards. Operations still queued (never flushed) are posted after a
// normal return and dropped after an error, a panic or a
// runtime.Goexit (t.FailNow in a test).
//
// Batch returns fn's error, joined with the first failure of an operation
// whose result fn never looked at (through Wait, WaitAny, WaitAll or
// Handle.Err), or of an operation that failed before it was posted (for
// want of a slot, say) and that no WaitAll reported. ctx bounds every
// wait of the scope; if it ends while operations are still in flight at
// the end, the queue pairs concerned are broken to flush them (like a
// cancelled blocking call). If ctx has ended
// before the call, Batch does not run fn and returns an error wrapping
// verbs.ErrTimeout and ctx.Err().
//
// An operation waits for one of the channel's slots (Options.MaxOutstanding)
// while none is free. When the scopes waiting for a slot hold all of them
// between them, none could come free: the request of the scope that would
// wait last fails at once with an error wrapping verbs.ErrQueueFull, and
// when that scope ends the others go on.
func (c *Channel) Batch(ctx context.Context, fn func(b *Batch) error) error {
	if err := c.invalid(); err != nil {
		return c.opErr("batch", err)
	}
	return c.e.run(ctx, func(sc *scope) error {
		b := &sc.peers[c.idx]
		return fn(b)
	})
}
