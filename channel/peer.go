package channel

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/goverbs/verbs"
)

// Peer states.
const (
	peerInit uint32 = iota
	peerConnected
	peerBroken
)

// peer is the queue pair to one peer and its posting state.
type peer struct {
	e         *engine
	idx       int
	qp        *verbs.RCQueuePair
	sqCap     int32
	rqCap     int32
	inlineMax int
	inlineOff int // of the staging area in e.scratch

	mu sync.Mutex // posting: sb, rb, unsig, marker use

	// Doorbell receives (Options.Doorbells > 0) are posted one by one
	// (postBells): a queue pair posts 4 when it connects and 1 or 2 at
	// each ring, and a batch would cost each queue pair a memfd and a
	// mapping (a rank of a large world has a queue pair to every rank).
	bellMu sync.Mutex // posting doorbell receives; never held while waiting
	bells  bool       // Options.Doorbells > 0
	// The batches of the requests and receives this process posts to
	// the peer (mu), made on first use (sendBatch, recvBatch): each holds
	// a queue depth of requests outside the Go heap, and a rank of a
	// large world posts to few of its peers (a barrier to O(log N)).
	sb     *verbs.RCBatch
	rb     *verbs.RecvBatch
	unsig  int32 // unsignaled requests posted since the last signaled one
	marker *slot // the signaled request that retires unsignaled ones

	sqUsed  atomic.Int32 // send-queue entries in use
	rqUsed  atomic.Int32 // receives posted
	pending atomic.Int32 // signaled requests in flight
	state   atomic.Uint32

	errMu sync.Mutex
	err   error // why the peer is broken

	// RDMA CM (DialCM, AcceptCM): the connection that owns qp, the
	// peer's private data, and the goroutine that breaks the peer when
	// the CM reports its disconnection.
	cm     *verbs.CMConn
	cmData []byte
	cmStop context.CancelFunc
	cmDone chan struct{}
}

func newPeer(e *engine, idx int, q *verbs.RCQueuePair) *peer {
	c := q.Cap()
	p := &peer{e: e, idx: idx, qp: q, sqCap: int32(c.MaxSendWR), rqCap: int32(c.MaxRecvWR),
		inlineMax: min(max(c.MaxInlineData, 0), 256)}
	p.bells = e.opts.Doorbells > 0
	return p
}

// sendBatch returns the batch of send-side requests, making it on first
// use. Called with p.mu.
func (p *peer) sendBatch() *verbs.RCBatch {
	if p.sb == nil {
		p.sb = p.qp.NewBatch(int(p.sqCap))
	}
	return p.sb
}

// recvBatch returns the batch of receives, making it on first use.
// Called with p.mu.
func (p *peer) recvBatch() *verbs.RecvBatch {
	if p.rb == nil {
		p.rb = p.qp.NewRecvBatch(int(p.rqCap))
	}
	return p.rb
}

// firstBells is how many doorbell receives a queue pair gets when it
// connects, when its peer's extra doorbells wait rather than fail (the
// receiver-not-ready retry is infinite, as by default): the queue pair
// grows them to Options.Doorbells as the peer rings (ringBell). A rank of
// a large world has a queue pair to every other rank and is rung by few
// (a barrier's partners): 512 ranks of one host each posted 64 × 511
// receives at start, half the time of their Connect.
const firstBells = 4

// initialBells is how many doorbell receives to post when the queue pair
// connects: all of Options.Doorbells if the peer's extra rings would
// fail (a finite receiver-not-ready retry), else at most firstBells.
func (e *engine) initialBells() int {
	if r := e.opts.QP.RNRRetry; r != 0 && r < 7 {
		return e.opts.Doorbells
	}
	return min(e.opts.Doorbells, firstBells)
}

// ringBell re-posts the doorbell receive a ring consumed and, while fewer
// than Options.Doorbells are posted, one more.
func (p *peer) ringBell() error {
	p.bellMu.Lock()
	defer p.bellMu.Unlock()
	n := 1
	if p.rqUsed.Load() < int32(p.e.opts.Doorbells) {
		n = 2
	}
	if err := p.postBellsLocked(n); err != nil {
		return err
	}
	p.rqUsed.Add(int32(n - 1))
	return nil
}

// postBells posts n zero-length doorbell receives. They are not counted
// as pending (Drain does not wait for them); a broken queue pair flushes
// them.
func (p *peer) postBells(n int) error {
	p.bellMu.Lock()
	defer p.bellMu.Unlock()
	return p.postBellsLocked(n)
}

// postBellsLocked is postBells with bellMu held.
func (p *peer) postBellsLocked(n int) error {
	for range n {
		if err := p.qp.PostRecv(bellWRID(p.idx)); err != nil {
			return fmt.Errorf("posting doorbell receives: %w", err)
		}
	}
	return nil
}

// fail records why the peer broke; the first cause wins.
func (p *peer) fail(cause error) {
	p.errMu.Lock()
	if p.err == nil {
		p.err = cause
	}
	p.errMu.Unlock()
	p.state.Store(peerBroken)
}

// cause returns the error that broke the peer, or nil.
func (p *peer) cause() error {
	p.errMu.Lock()
	defer p.errMu.Unlock()
	return p.err
}

// breakQP moves the queue pair to the error state, which flushes every
// outstanding request: the only way to take requests back from a device.
// It does not take p.mu: a poster waiting for queue room must not keep the
// queue pair from breaking (queue pairs are safe for concurrent use).
func (p *peer) breakQP(cause error) {
	p.fail(cause)
	if st, err := p.qp.State(); err == nil && st != verbs.StateError && st != verbs.StateReset {
		p.qp.Modify(verbs.QPAttr{State: verbs.StateError}, verbs.AttrState)
	}
	p.e.nudge()
}

// accepts reports why an operation of kind cannot be posted to the peer
// (a doorbell channel carries one-sided operations only; see usable), or
// nil.
func (p *peer) accepts(kind opKind) error {
	if p.e.opts.Doorbells > 0 {
		switch kind {
		case opSend, opSendImm, opRecv:
			return fmt.Errorf("a %s on a channel with doorbells (Options.Doorbells): its receive queues hold the doorbells: %w", kind, verbs.ErrNotSupported)
		}
	}
	return p.usable(kind == opRecv)
}

// usable reports why requests cannot be posted, or nil. Receives may be
// posted before the peer is connected.
func (p *peer) usable(recv bool) error {
	if p.e.closed.Load() {
		return ErrClosed
	}
	switch p.state.Load() {
	case peerBroken:
		return &brokenError{cause: p.cause()}
	case peerInit:
		if !recv {
			return ErrNotConnected
		}
	}
	return nil
}

// work is one operation to post.
type work struct {
	kind   opKind
	remote verbs.RemoteAddr
	imm    uint32
	a, b   uint64 // compare or add, swap
	sgl    []verbs.SGE
	s      *slot
}

// add puts a signaled send-side request into the batch. Called with p.mu.
func (p *peer) add(w *work) {
	s := w.s
	s.rel = p.unsig + 1
	p.unsig = 0
	wrid := slotWRID(s.idx, s.gen.Load())
	var r *verbs.Request
	sb := p.sendBatch()
	switch w.kind {
	case opSend:
		r = sb.Send(wrid, w.sgl...)
	case opSendImm:
		r = sb.SendImm(wrid, w.imm, w.sgl...)
	case opWrite:
		r = sb.Write(wrid, w.remote, w.sgl...)
	case opWriteImm:
		r = sb.WriteImm(wrid, w.remote, w.imm, w.sgl...)
	case opRead:
		r = sb.Read(wrid, w.remote, w.sgl...)
	case opCAS:
		r = sb.CompareSwap(wrid, w.remote, w.a, w.b, p.e.resultSGE(s))
	case opFAA:
		r = sb.FetchAdd(wrid, w.remote, w.a, p.e.resultSGE(s))
	}
	r.Signaled()
	p.sqUsed.Add(1)
	p.pending.Add(1)
}

// postedOf returns how many requests of a failed Submit were accepted.
func postedOf(err error) int {
	var pe *verbs.PostError
	if errors.As(err, &pe) {
		return pe.Posted
	}
	return 0
}

// post posts ws (all send-side, or all receives) with as few provider
// calls as the queue depth allows. When the queue is full it waits for
// room (until ctx ends) if wait is set and fails with verbs.ErrQueueFull
// otherwise. It
// returns how many of ws were posted; the slots of the others are
// untouched (the caller fails them).
func (p *peer) post(ctx context.Context, wait bool, ws []work) (int, error) {
	if len(ws) == 0 {
		return 0, nil
	}
	recv := ws[0].kind == opRecv
	p.mu.Lock()
	defer p.mu.Unlock()
	used, capacity := &p.sqUsed, p.sqCap
	if recv {
		used, capacity = &p.rqUsed, p.rqCap
	}
	n := 0
	for n < len(ws) {
		if err := p.usable(recv); err != nil {
			return n, err
		}
		k := 0
		for n+k < len(ws) && used.Load() < capacity {
			w := &ws[n+k]
			if recv {
				p.recvBatch().Recv(slotWRID(w.s.idx, w.s.gen.Load()), w.sgl...)
				p.rqUsed.Add(1)
				p.pending.Add(1)
			} else {
				p.add(w)
			}
			k++
		}
		if k > 0 {
			var err error
			if recv {
				err = p.recvBatch().Submit()
			} else {
				err = p.sendBatch().Submit()
			}
			if err != nil {
				ok := postedOf(err)
				for i := n + ok; i < n+k; i++ {
					p.pending.Add(-1)
					if recv {
						p.rqUsed.Add(-1)
					} else {
						p.sqUsed.Add(-1)
						p.unsig += ws[i].s.rel - 1
					}
				}
				if ok < k {
					p.e.nudge() // a Drain may have seen the rejected ones
				}
				return n + ok, err
			}
			n += k
			continue
		}
		if !wait {
			q := "send"
			if recv {
				q = "receive"
			}
			return n, fmt.Errorf("the %s queue is full (%d requests): %w", q, capacity, verbs.ErrQueueFull)
		}
		// Full: completions free entries (they are dispatched without
		// p.mu). Wait without p.mu, which the other posts to the peer
		// take, and only for a moment: a post that never blocks, or a
		// call whose context ends sooner, must not wait behind this one.
		if err := p.waitRoom(ctx, used, capacity); err != nil {
			return n, err
		}
	}
	return n, nil
}

// waitRoom waits, with p.mu held by the caller but released meanwhile,
// until the queue counted by used has room or the peer broke.
func (p *peer) waitRoom(ctx context.Context, used *atomic.Int32, capacity int32) error {
	p.mu.Unlock()
	defer p.mu.Lock()
	return p.e.wait(ctx, func() bool { return used.Load() < capacity || p.state.Load() == peerBroken }, nil)
}

// writeInline posts an unsignaled inline RDMA write of data (copied at
// post), waiting for room in the send queue. A failure surfaces as a
// broken peer.
func (p *peer) writeInline(ctx context.Context, dst verbs.RemoteAddr, data []byte) error {
	if len(data) > p.inlineMax {
		return fmt.Errorf("%d bytes exceed the inline limit of %d: %w", len(data), p.inlineMax, verbs.ErrNotSupported)
	}
	return p.postUnsig(ctx, true, unsigReq{kind: opWriteInline, remote: dst, inline: data})
}

// unsigReq is an unsignaled RDMA write: of inline (copied at post) if
// kind is opWriteInline, else of sgl, with immediate data if kind is
// opWriteImm.
type unsigReq struct {
	kind   opKind
	remote verbs.RemoteAddr
	imm    uint32
	inline []byte
	sgl    []verbs.SGE
}

// postUnsig posts r unsignaled. Every so often the request is signaled
// instead, with the peer's marker slot, so that the send queue entries of
// unsignaled requests are retired. When the send queue is full it waits
// for room (until ctx ends) if wait is set and fails with
// verbs.ErrQueueFull otherwise.
func (p *peer) postUnsig(ctx context.Context, wait bool, r unsigReq) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if err := p.usable(false); err != nil {
			return err
		}
		if p.sqUsed.Load() < p.sqCap {
			break
		}
		if !wait {
			return fmt.Errorf("the send queue is full (%d requests): %w", p.sqCap, verbs.ErrQueueFull)
		}
		if err := ctx.Err(); err != nil {
			return waitErr(err)
		}
		if err := p.waitRoom(ctx, &p.sqUsed, p.sqCap); err != nil {
			return err
		}
	}
	var sge verbs.SGE
	if r.kind == opWriteInline {
		buf := p.e.scratch.Bytes()[p.inlineOff : p.inlineOff+len(r.inline)]
		copy(buf, r.inline)
		var err error
		if sge, err = p.e.scratch.SGE(p.inlineOff, len(r.inline)); err != nil {
			return err
		}
	}
	m := p.marker
	signal := m.state.Load() == slotFree &&
		(p.unsig+1 >= max(p.sqCap/2, 1) || p.sqUsed.Load()+1 >= p.sqCap)
	var wrid uint64
	if signal {
		m.gen.Add(1)
		m.kind = r.kind
		m.rel = p.unsig + 1
		m.state.Store(slotDetached)
		wrid = slotWRID(m.idx, m.gen.Load())
	} else {
		wrid = unsigWRID(p.idx)
	}
	sb := p.sendBatch()
	var req *verbs.Request
	switch r.kind {
	case opWriteInline:
		req = sb.Write(wrid, r.remote, sge).Inline()
	case opWriteImm:
		req = sb.WriteImm(wrid, r.remote, r.imm, r.sgl...)
	default:
		req = sb.Write(wrid, r.remote, r.sgl...)
	}
	if signal {
		req.Signaled()
		p.pending.Add(1)
	}
	p.sqUsed.Add(1)
	if err := sb.Submit(); err != nil {
		p.sqUsed.Add(-1)
		if signal {
			p.pending.Add(-1)
			m.state.Store(slotFree)
		}
		p.e.nudge() // a Drain, or a wait for room, may have seen it
		return err
	}
	if signal {
		p.unsig = 0
	} else {
		p.unsig++
	}
	return nil
}
