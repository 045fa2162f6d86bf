package channel

import (
	"context"
	"errors"
	"fmt"

	"github.com/goverbs/verbs"
)

// Channel is a reliable connected channel to one peer: one RC queue pair
// and the completion queue that serves it. A Channel is safe for
// concurrent use: blocking calls, posts and Batch scopes may run in many
// goroutines at once, each waiting only for its own completions.
//
// A Channel is built in two phases, like its queue pair: New creates it
// (INIT), Endpoint describes it, the endpoints are exchanged out of band,
// and Connect connects it (RTR, RTS). Or, on the hardware provider, in
// one call per side through the RDMA CM: DialCM and AcceptCM.
type Channel struct {
	e   *engine
	p   *peer
	idx int   // peer number
	own bool  // Close closes the engine
	err error // an invalid peer view: every operation fails with it
}

// New creates a channel in the protection domain pd. Memory registered in
// pd serves every operation of the channel.
func New(pd *verbs.ProtectionDomain, opts Options) (*Channel, error) {
	e, err := newEngine(pd, 1, -1, opts, nil)
	if err != nil {
		return nil, err
	}
	return &Channel{e: e, p: e.peers[0], own: true}, nil
}

// errZero is what the operations of a zero Channel or MultiChannel (not
// made by New, NewMulti, DialCM or AcceptCM) fail with: it is as good as
// closed.
var errZero = fmt.Errorf("%w (a zero channel: make one with New or NewMulti)", ErrClosed)

// invalid returns why the channel cannot be used: an invalid peer view's
// error, errZero, or nil.
func (c *Channel) invalid() error {
	switch {
	case c.err != nil:
		return c.err
	case c.e == nil:
		return errZero
	}
	return nil
}

func (c *Channel) opErr(op string, err error) error {
	if err == nil {
		return nil
	}
	var oe *OpError
	if errors.As(err, &oe) && oe.Peer == c.idx {
		return err
	}
	return &OpError{Op: op, Peer: c.idx, Err: err}
}

// Endpoint returns what the peer needs to connect to this channel.
func (c *Channel) Endpoint() (verbs.Endpoint, error) {
	if err := c.invalid(); err != nil {
		return verbs.Endpoint{}, c.opErr("endpoint", err)
	}
	ep, err := c.p.qp.Endpoint()
	return ep, c.opErr("endpoint", err)
}

// Connect connects the channel to the peer's endpoint. It may be called
// once; a failed Connect leaves the channel unusable.
func (c *Channel) Connect(remote verbs.Endpoint) error {
	if err := c.invalid(); err != nil {
		return c.opErr("connect", err)
	}
	return c.p.connect(remote)
}

func (p *peer) connect(remote verbs.Endpoint) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.e.closed.Load() {
		return &OpError{Op: "connect", Peer: p.idx, Err: ErrClosed}
	}
	if st := p.state.Load(); st != peerInit {
		if st == peerBroken {
			return &OpError{Op: "connect", Peer: p.idx, Err: &brokenError{cause: p.cause()}}
		}
		return &OpError{Op: "connect", Peer: p.idx, Err: errors.New("already connected")}
	}
	if p.bells && p.rqUsed.Load() == 0 {
		// Before the queue pair is ready to receive: the peer's first
		// doorbell finds a receive.
		n := p.e.initialBells()
		if err := p.postBells(n); err != nil {
			p.breakQP(err) // flushes the receives posted before
			return &OpError{Op: "connect", Peer: p.idx, Err: err}
		}
		p.rqUsed.Store(int32(n))
	}
	if err := p.qp.ConnectWith(remote, p.e.opts.Connect); err != nil {
		// Broken: the queue pair goes to the error state, which
		// flushes the receives posted before Connect (they would
		// never complete otherwise).
		p.breakQP(err)
		return &OpError{Op: "connect", Peer: p.idx, Err: err}
	}
	p.state.CompareAndSwap(peerInit, peerConnected)
	return nil
}

// QueuePair returns the channel's queue pair, for inspection (Query,
// Cap). Posting to it directly bypasses the channel's completion routing:
// do not.
func (c *Channel) QueuePair() *verbs.RCQueuePair {
	if c.p == nil {
		return nil
	}
	return c.p.qp
}

// PD returns the protection domain of the channel.
func (c *Channel) PD() *verbs.ProtectionDomain {
	if c.e == nil {
		return nil
	}
	return c.e.pd
}

// Peer returns the peer number of the channel: 0 for a Channel of its
// own, the peer's index for MultiChannel.Peer.
func (c *Channel) Peer() int { return c.idx }

// Posted returns the number of send-queue entries in use: requests
// posted whose completions have not been reaped yet, including
// unsignaled ones (WriteInline) that no later signaled request has
// retired. Zero means that nothing this process posted to the peer can
// still be in flight; a positive count may include requests that have
// in fact completed. Safe for concurrent use; 0 for an invalid peer view.
func (c *Channel) Posted() int {
	if c.p == nil {
		return 0
	}
	return int(c.p.sqUsed.Load())
}

// MaxInline returns the largest payload WriteInline accepts.
func (c *Channel) MaxInline() int {
	if c.p == nil {
		return 0
	}
	return c.p.inlineMax
}

// Err returns why the channel is broken (an error wrapping ErrBroken and
// the cause), or nil while it works.
func (c *Channel) Err() error {
	if err := c.invalid(); err != nil {
		return c.opErr("channel", err)
	}
	if c.p.state.Load() == peerBroken {
		return &brokenError{cause: c.p.cause()}
	}
	return nil
}

// Broken reports whether Err would return an error: cheaper than Err
// (one atomic load, no allocation), for conditions polled often, as
// Wait's.
func (c *Channel) Broken() bool {
	return c.err != nil || c.p == nil || c.p.state.Load() == peerBroken
}

// Break moves the queue pair to the error state: every operation in flight
// completes with a flush error, and the channel is broken for good. Use
// it to abandon operations whose buffers must be reclaimed.
func (c *Channel) Break() {
	if c.p != nil {
		c.p.breakQP(errors.New("broken by the caller"))
	}
}

// Drain waits until no operation of the channel that generates a
// completion is in flight (including detached handles and posted
// receives), or ctx ends.
func (c *Channel) Drain(ctx context.Context) error {
	if err := c.invalid(); err != nil {
		return c.opErr("drain", err)
	}
	return c.opErr("drain", c.e.drain(ctx, []*peer{c.p}))
}

// Wait blocks until ready reports true, ctx ends or the channel closes.
// While it waits it polls the completion queue (one goroutine at a time
// polls for everyone), spinning as Options.SpinPolls says and then
// sleeping on the completion channel, and calls ready again after every
// batch of completions it dispatches: the completions of this channel's
// operations, and the doorbells of Options.Doorbells, by which peers that
// write into this process' memory can wake it. ready must be cheap and
// must not block. It returns nil once ready is true, and otherwise an
// error wrapping verbs.ErrTimeout and the context's error, or ErrClosed.
func (c *Channel) Wait(ctx context.Context, ready func() bool) error {
	if err := c.invalid(); err != nil {
		return c.opErr("wait", err)
	}
	return c.e.waitCond(ctx, ready, c.e.opts.SpinPolls)
}

// Sleep is Wait without spinning, whatever Options.SpinPolls says: for
// callers that spun already (polling with Progress) and now want to sleep
// on the completion channel until ready holds.
func (c *Channel) Sleep(ctx context.Context, ready func() bool) error {
	if err := c.invalid(); err != nil {
		return c.opErr("sleep", err)
	}
	return c.e.waitCond(ctx, ready, SpinNever)
}

// Rung returns the number of doorbells received so far (see
// Options.Doorbells); a MultiChannel's peers share one count.
func (c *Channel) Rung() uint64 {
	if c.e == nil {
		return 0
	}
	return c.e.rung.Load()
}

// Progress polls the completion queue once, unless another goroutine is
// polling it, and routes the completions to their operations. It never
// blocks. Waiting calls poll by themselves; Progress serves callers that
// poll Handles or memory in a loop of their own.
func (c *Channel) Progress() error {
	if err := c.invalid(); err != nil {
		return c.opErr("progress", err)
	}
	return c.e.progress()
}

// Close breaks the channel (flushing what is in flight, waiting at most
// Options.FlushGrace for the flushes) and destroys its queue pair,
// completion queue and scratch memory; a channel from DialCM or AcceptCM
// also disconnects its peer (see DialCM). A goroutine still polling the
// completion queue (a wait, Progress) is waited for once the queue is
// closed, at most a second (or FlushGrace if longer): one that stays
// longer (in a Wait's ready condition) frees the scratch memory when it
// leaves, and closing the protection domain fails until then. Close is
// idempotent. Closing a peer view of a MultiChannel does nothing: close
// the MultiChannel.
func (c *Channel) Close() error {
	if !c.own {
		return nil
	}
	return c.e.close()
}

// --- blocking operations ---

// run posts one operation and waits for its completion. If ctx ends
// first, the channel is broken, which flushes the request: when run
// returns, the device no longer uses its buffers (unless even the flush
// did not come within the flush grace, which the error then says). A
// request that completed successfully before its flush returns its
// result all the same (abandon).
func (c *Channel) run(ctx context.Context, w work) (*slot, error) {
	if err := c.invalid(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, waitErr(err)
	}
	if err := c.p.accepts(w.kind); err != nil {
		return nil, err
	}
	s, err := c.e.acquire(ctx, c.p, w.kind)
	if err != nil {
		return nil, err
	}
	w.s = s
	ws := [1]work{w}
	if n, err := c.p.post(ctx, true, ws[:]); n == 0 {
		c.e.release(s)
		return nil, err
	}
	if err := c.e.waitSlot(ctx, s); err != nil {
		return c.abandon(s, err)
	}
	return s, nil
}

// abandon breaks the peer of a slot whose wait ended, waits for the flush
// and releases (or, failing that, detaches) the slot. A request whose
// completion was already on its way, a success, is not undone by the
// break: abandon returns its slot, for its result (a compare-and-swap
// that took a lock must say so).
func (c *Channel) abandon(s *slot, cause error) (*slot, error) {
	c.p.breakQP(fmt.Errorf("a blocking %s was cancelled: %w", s.kind, cause))
	ctx, cancel := context.WithTimeout(context.Background(), c.e.opts.FlushGrace)
	defer cancel()
	if c.e.waitSlot(ctx, s) == nil {
		if !s.failed() && s.wc.Status == verbs.StatusSuccess {
			return s, nil
		}
		c.e.release(s)
		return nil, fmt.Errorf("%w (the channel is now broken: the request was flushed: %w)", cause, ErrBroken)
	}
	c.e.detach(s)
	return nil, fmt.Errorf("%w (the channel is now broken, and the request was not flushed within %v: the device may still use its buffers: %w)",
		cause, c.e.opts.FlushGrace, ErrBroken)
}

// finish returns the result of a completed slot and releases it.
func (c *Channel) finish(s *slot) error {
	err := s.result()
	c.e.release(s)
	return err
}

// Send sends the data of sgl as one message and waits for its completion
// (the peer has received it). The peer must have a receive posted; until
// it does, the queue pair retries (Options.QP.RNRRetry, forever by
// default).
//
// Like every blocking method: the memory of sgl belongs to the device
// until the call returns. If ctx ends first, the call fails with an error
// wrapping verbs.ErrTimeout and ctx.Err(), and the channel is broken
// (the only way to take a request back from an RDMA device); use
// PostSend and Handle.Wait for a wait that can time out and be resumed.
// (A request that completed successfully before the break took effect
// returns its result: the channel is broken all the same.)
func (c *Channel) Send(ctx context.Context, sgl ...verbs.SGE) error {
	s, err := c.run(ctx, work{kind: opSend, sgl: sgl})
	if err != nil {
		return c.opErr(opSend.String(), err)
	}
	return c.finish(s)
}

// SendImm sends a message with 32 bits of immediate data.
func (c *Channel) SendImm(ctx context.Context, imm uint32, sgl ...verbs.SGE) error {
	s, err := c.run(ctx, work{kind: opSendImm, imm: imm, sgl: sgl})
	if err != nil {
		return c.opErr(opSendImm.String(), err)
	}
	return c.finish(s)
}

// Receive posts sgl as a receive buffer and waits for a message: a send,
// a send with immediate, or an RDMA write with immediate (whose data went
// to the target address of the write; only the immediate arrives here).
// The buffer's MR needs verbs.AccessLocalWrite.
func (c *Channel) Receive(ctx context.Context, sgl ...verbs.SGE) (Received, error) {
	s, err := c.run(ctx, work{kind: opRecv, sgl: sgl})
	if err != nil {
		return Received{}, c.opErr(opRecv.String(), err)
	}
	r := receivedOf(&s.wc)
	if err := c.finish(s); err != nil {
		return Received{}, err
	}
	return r, nil
}

// Write writes the data of sgl to dst, in the peer's memory, and waits for
// its completion. The peer is not notified.
func (c *Channel) Write(ctx context.Context, dst verbs.RemoteAddr, sgl ...verbs.SGE) error {
	s, err := c.run(ctx, work{kind: opWrite, remote: dst, sgl: sgl})
	if err != nil {
		return c.opErr(opWrite.String(), err)
	}
	return c.finish(s)
}

// WriteImm writes the data of sgl to dst and delivers imm to the peer,
// consuming one of its receives.
func (c *Channel) WriteImm(ctx context.Context, dst verbs.RemoteAddr, imm uint32, sgl ...verbs.SGE) error {
	s, err := c.run(ctx, work{kind: opWriteImm, remote: dst, imm: imm, sgl: sgl})
	if err != nil {
		return c.opErr(opWriteImm.String(), err)
	}
	return c.finish(s)
}

// Read reads len(sgl) bytes from src, in the peer's memory, into sgl (its
// MR needs verbs.AccessLocalWrite).
func (c *Channel) Read(ctx context.Context, src verbs.RemoteAddr, sgl ...verbs.SGE) error {
	s, err := c.run(ctx, work{kind: opRead, remote: src, sgl: sgl})
	if err != nil {
		return c.opErr(opRead.String(), err)
	}
	return c.finish(s)
}

// CompareSwap atomically replaces the 8-byte word at dst (8-byte aligned,
// in an MR with verbs.AccessRemoteAtomic) with swap if it equals compare,
// and returns its prior value: the swap happened if prior == compare.
func (c *Channel) CompareSwap(ctx context.Context, dst verbs.RemoteAddr, compare, swap uint64) (prior uint64, err error) {
	s, err := c.run(ctx, work{kind: opCAS, remote: dst, a: compare, b: swap})
	if err != nil {
		return 0, c.opErr(opCAS.String(), err)
	}
	v := c.e.atomicResult(s)
	if err := c.finish(s); err != nil {
		return 0, err
	}
	return v, nil
}

// FetchAdd atomically adds add to the 8-byte word at dst and returns its
// prior value.
func (c *Channel) FetchAdd(ctx context.Context, dst verbs.RemoteAddr, add uint64) (prior uint64, err error) {
	s, err := c.run(ctx, work{kind: opFAA, remote: dst, a: add})
	if err != nil {
		return 0, c.opErr(opFAA.String(), err)
	}
	v := c.e.atomicResult(s)
	if err := c.finish(s); err != nil {
		return 0, err
	}
	return v, nil
}

// WriteInline writes data (at most MaxInline bytes, copied before the call
// returns) to dst without waiting for, or even generating, a completion:
// the cheapest RDMA write, made for flags and doorbells. Writes on a
// channel arrive in order. If one fails, the channel breaks, and Err and
// every later call report the cause. ctx bounds only the wait for room in
// the send queue.
func (c *Channel) WriteInline(ctx context.Context, dst verbs.RemoteAddr, data []byte) error {
	if err := c.invalid(); err != nil {
		return c.opErr(opWriteInline.String(), err)
	}
	return c.opErr(opWriteInline.String(), c.p.writeInline(ctx, dst, data))
}

// PostWriteUnsignaled posts an RDMA write of sgl to dst that generates no
// completion for the caller: the cheapest write of flags and data whose
// reuse the caller orders by other means (the peer's answer, or the
// completion of a later request of the channel: its queue pair executes
// requests in order). The memory of sgl belongs to the device until then.
// Every so often the channel signals one itself, to retire the send queue
// entries of the others. It never blocks: with no room in the send queue
// it fails with an error wrapping verbs.ErrQueueFull. If the write fails,
// the channel breaks, and Err and every later call report the cause.
func (c *Channel) PostWriteUnsignaled(dst verbs.RemoteAddr, sgl ...verbs.SGE) error {
	return c.postUnsig(unsigReq{kind: opWrite, remote: dst, sgl: sgl})
}

// PostWriteImmUnsignaled is PostWriteUnsignaled with immediate data: the
// write consumes a receive of the peer, whose completion carries imm (a
// doorbell, with Options.Doorbells).
func (c *Channel) PostWriteImmUnsignaled(dst verbs.RemoteAddr, imm uint32, sgl ...verbs.SGE) error {
	return c.postUnsig(unsigReq{kind: opWriteImm, remote: dst, imm: imm, sgl: sgl})
}

func (c *Channel) postUnsig(r unsigReq) error {
	if err := c.invalid(); err != nil {
		return c.opErr(r.kind.String(), err)
	}
	if err := c.p.accepts(r.kind); err != nil {
		return c.opErr(r.kind.String(), err)
	}
	return c.opErr(r.kind.String(), c.p.postUnsig(context.Background(), false, r))
}

// --- unpolled operations ---

// post posts one operation and returns its handle without waiting. It
// never blocks: with no free slot or no room in the queue it fails with an
// error wrapping verbs.ErrQueueFull.
func (c *Channel) post(w work) (Handle, error) {
	if err := c.invalid(); err != nil {
		return Handle{}, c.opErr(w.kind.String(), err)
	}
	if err := c.p.accepts(w.kind); err != nil {
		return Handle{}, c.opErr(w.kind.String(), err)
	}
	s, err := c.e.tryAcquire(c.p, w.kind)
	if err != nil {
		return Handle{}, c.opErr(w.kind.String(), err)
	}
	w.s = s
	ws := [1]work{w}
	if n, err := c.p.post(context.Background(), false, ws[:]); n == 0 {
		c.e.release(s)
		return Handle{}, c.opErr(w.kind.String(), err)
	}
	return handleOf(s), nil
}

// PostSend posts a send and returns at once with its Handle.
//
// The Post methods are for callers that manage completions themselves.
// Their contract: the memory of sgl belongs to the device until the
// handle reports completion (Wait, Poll, Done); every handle must be
// released with Release once its result has been read, or it holds one of
// the channel's MaxOutstanding slots forever; releasing a handle still in
// flight detaches it (see Handle.Release). A Post method never blocks: with
// no free slot or no room in the queue it fails with an error wrapping
// verbs.ErrQueueFull.
func (c *Channel) PostSend(sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opSend, sgl: sgl})
}

// PostSendImm posts a send with immediate data (see PostSend).
func (c *Channel) PostSendImm(imm uint32, sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opSendImm, imm: imm, sgl: sgl})
}

// PostReceive posts a receive buffer (see PostSend). Receives may be
// posted before Connect, so that the peer's first message finds one.
func (c *Channel) PostReceive(sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opRecv, sgl: sgl})
}

// PostWrite posts an RDMA write (see PostSend).
func (c *Channel) PostWrite(dst verbs.RemoteAddr, sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opWrite, remote: dst, sgl: sgl})
}

// PostWriteImm posts an RDMA write with immediate data (see PostSend).
func (c *Channel) PostWriteImm(dst verbs.RemoteAddr, imm uint32, sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opWriteImm, remote: dst, imm: imm, sgl: sgl})
}

// PostRead posts an RDMA read (see PostSend).
func (c *Channel) PostRead(src verbs.RemoteAddr, sgl ...verbs.SGE) (Handle, error) {
	return c.post(work{kind: opRead, remote: src, sgl: sgl})
}

// PostCompareSwap posts an atomic compare-and-swap; Handle.Value returns
// the prior value (see PostSend).
func (c *Channel) PostCompareSwap(dst verbs.RemoteAddr, compare, swap uint64) (Handle, error) {
	return c.post(work{kind: opCAS, remote: dst, a: compare, b: swap})
}

// PostFetchAdd posts an atomic fetch-and-add; Handle.Value returns the
// prior value (see PostSend).
func (c *Channel) PostFetchAdd(dst verbs.RemoteAddr, add uint64) (Handle, error) {
	return c.post(work{kind: opFAA, remote: dst, a: add})
}
