package channel

import (
	"context"
	"errors"
	"fmt"

	"github.com/goverbs/verbs"
)

// MultiChannel is a set of reliable connected channels to n peers,
// numbered 0 to n-1: one RC queue pair per peer, all in one protection
// domain (so one memory registration serves every peer) and all served
// by one completion queue. One peer number may be this process itself
// (self), which has no queue pair; operations addressed to it fail with
// ErrNoPeer.
//
// Like a Channel, a MultiChannel is built in two phases (NewMulti,
// Endpoints, exchange, Connect) and is safe for concurrent use.
type MultiChannel struct {
	e     *engine
	n     int
	self  int
	chans []Channel // peer views, sharing e
}

// MaxPeers bounds the peers of a MultiChannel (n of NewMulti): the
// channel's tables are allocated for every peer up front.
const MaxPeers = 1 << 20

// NewMulti creates queue pairs to n peers in pd (at most MaxPeers). self is the peer number
// of this process (no queue pair is created for it), or -1.
func NewMulti(pd *verbs.ProtectionDomain, n, self int, opts Options) (*MultiChannel, error) {
	if n <= 0 || n > MaxPeers {
		return nil, fmt.Errorf("channel: NewMulti: %d peers (want 1 to MaxPeers, %d)", n, MaxPeers)
	}
	if self < -1 || self >= n {
		return nil, fmt.Errorf("channel: NewMulti: self %d is not -1 or a peer number below %d", self, n)
	}
	e, err := newEngine(pd, n, self, opts, nil)
	if err != nil {
		return nil, err
	}
	m := &MultiChannel{e: e, n: n, self: self, chans: make([]Channel, n)}
	for i := range n {
		m.chans[i] = Channel{e: e, p: e.peers[i], idx: i}
		if i == self {
			m.chans[i].err = fmt.Errorf("peer %d is this process: %w", i, ErrNoPeer)
		}
	}
	return m, nil
}

// Len returns the number of peers, self included.
func (m *MultiChannel) Len() int { return m.n }

// Self returns the peer number of this process, or -1.
func (m *MultiChannel) Self() int { return m.self }

// Peers returns the peer numbers other than self, in ascending order.
func (m *MultiChannel) Peers() []int {
	ps := make([]int, 0, m.n)
	for i := range m.n {
		if i != m.self {
			ps = append(ps, i)
		}
	}
	return ps
}

// PD returns the protection domain shared by every peer.
func (m *MultiChannel) PD() *verbs.ProtectionDomain {
	if m.e == nil {
		return nil
	}
	return m.e.pd
}

// Peer returns the channel to peer i: every Channel operation, for that
// peer. For self or an out-of-range i it returns a channel whose every
// operation fails with ErrNoPeer. The view needs no Close.
func (m *MultiChannel) Peer(i int) *Channel {
	if i < 0 || i >= m.n {
		return &Channel{e: m.e, idx: i, err: fmt.Errorf("peer %d out of range [0, %d): %w", i, m.n, ErrNoPeer)}
	}
	return &m.chans[i]
}

// Endpoints returns the endpoint of the queue pair to each peer, indexed
// by peer number; the entry of self is the zero Endpoint. Hand entry j to
// peer j.
func (m *MultiChannel) Endpoints() ([]verbs.Endpoint, error) {
	if m.e == nil {
		return nil, fmt.Errorf("channel: endpoints: %w", errZero)
	}
	eps := make([]verbs.Endpoint, m.n)
	for i := range m.n {
		if i == m.self {
			continue
		}
		ep, err := m.chans[i].Endpoint()
		if err != nil {
			return nil, err
		}
		eps[i] = ep
	}
	return eps, nil
}

// Connect connects the queue pair to each peer j to remotes[j], the
// endpoint peer j created for this process; the entry of self is
// ignored. It stops at the first failure.
func (m *MultiChannel) Connect(remotes []verbs.Endpoint) error {
	if m.e == nil {
		// A zero MultiChannel is as good as closed: before, Connect of
		// no endpoints matched its 0 peers and returned nil
		// (TestZeroMultiConnect).
		return fmt.Errorf("channel: connect: %w", errZero)
	}
	if len(remotes) != m.n {
		return fmt.Errorf("channel: connect: %d endpoints for %d peers", len(remotes), m.n)
	}
	for i := range m.n {
		if i == m.self {
			continue
		}
		if err := m.chans[i].Connect(remotes[i]); err != nil {
			return err
		}
	}
	return nil
}

// Progress polls the shared completion queue once (see Channel.Progress).
func (m *MultiChannel) Progress() error {
	if m.e == nil {
		return fmt.Errorf("channel: progress: %w", errZero)
	}
	return m.e.progress()
}

// Wait blocks until ready reports true, ctx ends or the channel closes
// (see Channel.Wait).
func (m *MultiChannel) Wait(ctx context.Context, ready func() bool) error {
	if m.e == nil {
		return fmt.Errorf("channel: wait: %w", errZero)
	}
	return m.e.waitCond(ctx, ready, m.e.opts.SpinPolls)
}

// Sleep is Wait without spinning (see Channel.Sleep).
func (m *MultiChannel) Sleep(ctx context.Context, ready func() bool) error {
	if m.e == nil {
		return fmt.Errorf("channel: sleep: %w", errZero)
	}
	return m.e.waitCond(ctx, ready, SpinNever)
}

// Doorbells returns the number of doorbell receives per peer
// (Options.Doorbells), 0 if the channel has none.
func (m *MultiChannel) Doorbells() int {
	if m.e == nil {
		return 0
	}
	return m.e.opts.Doorbells
}

// Rung returns the number of doorbells received so far from every peer
// (see Options.Doorbells).
func (m *MultiChannel) Rung() uint64 {
	if m.e == nil {
		return 0
	}
	return m.e.rung.Load()
}

// Drain waits until no operation that generates a completion is in
// flight to any peer, or ctx ends.
func (m *MultiChannel) Drain(ctx context.Context) error {
	if m.e == nil {
		return fmt.Errorf("channel: drain: %w", errZero)
	}
	if err := m.e.drain(ctx, m.e.peers); err != nil {
		return fmt.Errorf("channel: drain: %w", err)
	}
	return nil
}

// Err returns the errors of the broken peers, joined, or nil.
func (m *MultiChannel) Err() error {
	if m.e == nil {
		return fmt.Errorf("channel: %w", errZero)
	}
	var errs []error
	for i := range m.n {
		if i != m.self {
			if err := m.chans[i].Err(); err != nil {
				errs = append(errs, &OpError{Op: "channel", Peer: i, Err: err})
			}
		}
	}
	return errors.Join(errs...)
}

// Close breaks and destroys every queue pair, the completion queue and
// the scratch memory (see Channel.Close). Idempotent.
func (m *MultiChannel) Close() error {
	if m.e == nil {
		return nil // a zero MultiChannel, as good as closed
	}
	return m.e.close()
}

// MultiBatch is the scope of MultiChannel.Batch: Peer(i) queues operations
// for peer i; the waits cover operations of every peer. It is not safe for
// concurrent use.
type MultiBatch struct{ sc *scope }

// Peer returns the batch of operations to peer i. For self or an
// out-of-range i, every operation of the returned batch fails (its Handle
// reports ErrNoPeer).
func (b *MultiBatch) Peer(i int) *Batch {
	if b.sc == nil {
		return &Batch{idx: i, err: errNoScope}
	}
	if i < 0 || i >= len(b.sc.peers) {
		return &Batch{sc: b.sc, idx: i, err: fmt.Errorf("peer %d out of range [0, %d): %w", i, len(b.sc.peers), ErrNoPeer)}
	}
	return &b.sc.peers[i]
}

// Flush posts the operations queued so far.
func (b *MultiBatch) Flush() error { return b.sc.flushOp() }

// Wait posts what is queued and waits for h.
func (b *MultiBatch) Wait(h Handle) error { return b.sc.wait(h) }

// WaitAny posts what is queued and waits until one of hs completes.
func (b *MultiBatch) WaitAny(hs ...Handle) (int, error) { return b.sc.waitAny(hs) }

// WaitAll posts what is queued and waits for hs (every operation of the
// scope if hs is empty), returning the failures joined.
func (b *MultiBatch) WaitAll(hs ...Handle) error { return b.sc.waitAllOp(hs) }

// Context returns the context of the scope.
func (b *MultiBatch) Context() context.Context { return b.sc.context() }

// Batch runs fn in a scope for operations to any peer; see Channel.Batch
// for the contract.
func (m *MultiChannel) Batch(ctx context.Context, fn func(b *MultiBatch) error) error {
	if m.e == nil {
		return fmt.Errorf("channel: batch: %w", errZero)
	}
	return m.e.run(ctx, func(sc *scope) error { return fn(&sc.multi) })
}

// targets resolves a peer list: nil means every peer but self, with
// per-peer arguments indexed by peer number (n entries); otherwise the
// arguments are indexed like peers.
func (m *MultiChannel) targets(peers []int, nargs int, what string) (list []int, byPeer bool, err error) {
	if peers == nil {
		if nargs >= 0 && nargs != m.n {
			return nil, false, fmt.Errorf("channel: %s: %d entries for %d peers (with peers == nil, entries are indexed by peer number)", what, nargs, m.n)
		}
		return m.Peers(), true, nil
	}
	if nargs >= 0 && nargs != len(peers) {
		return nil, false, fmt.Errorf("channel: %s: %d entries for %d peers", what, nargs, len(peers))
	}
	for _, p := range peers {
		if p < 0 || p >= m.n || p == m.self {
			return nil, false, fmt.Errorf("channel: %s: peer %d: %w", what, p, ErrNoPeer)
		}
	}
	return peers, false, nil
}

// collective runs one operation per target peer in a scope and waits for
// all of them; failures are joined (each an *OpError naming its peer).
func (m *MultiChannel) collective(ctx context.Context, peers []int, nargs int, what string,
	op func(b *Batch, peer, k int)) error {
	list, byPeer, err := m.targets(peers, nargs, what)
	if err != nil {
		return err
	}
	return m.Batch(ctx, func(b *MultiBatch) error {
		for k, p := range list {
			arg := k
			if byPeer {
				arg = p
			}
			op(b.Peer(p), p, arg)
		}
		return b.WaitAll()
	})
}

// ScatterSend sends bufs[k] to peers[k], all at once, and waits for every
// send. With peers == nil it sends to every peer but self, and bufs is
// indexed by peer number (the entry of self is ignored).
func (m *MultiChannel) ScatterSend(ctx context.Context, peers []int, bufs []verbs.SGE) error {
	return m.collective(ctx, peers, len(bufs), "scatter send", func(b *Batch, _, k int) { b.Send(bufs[k]) })
}

// GatherReceive posts bufs[k] as a receive for peers[k] and waits until a
// message from each has arrived; got[k] (if got is not nil) describes
// it. With peers == nil it receives from every peer but self, bufs and got
// indexed by peer number.
func (m *MultiChannel) GatherReceive(ctx context.Context, peers []int, bufs []verbs.SGE, got []Received) error {
	if got != nil && len(got) != len(bufs) {
		return fmt.Errorf("channel: gather receive: %d results for %d buffers", len(got), len(bufs))
	}
	list, byPeer, err := m.targets(peers, len(bufs), "gather receive")
	if err != nil {
		return err
	}
	return m.Batch(ctx, func(b *MultiBatch) error {
		hs := make([]Handle, len(list))
		for k, p := range list {
			arg := k
			if byPeer {
				arg = p
			}
			hs[k] = b.Peer(p).Receive(bufs[arg])
		}
		err := b.WaitAll(hs...)
		if got != nil {
			for k, p := range list {
				arg := k
				if byPeer {
					arg = p
				}
				got[arg] = hs[k].Received()
			}
		}
		return err
	})
}

// ScatterWrite writes bufs[k] to dsts[k] in the memory of peers[k], all at
// once, and waits for every write. With peers == nil it writes to every
// peer but self, dsts and bufs indexed by peer number.
func (m *MultiChannel) ScatterWrite(ctx context.Context, peers []int, dsts []verbs.RemoteAddr, bufs []verbs.SGE) error {
	if len(dsts) != len(bufs) {
		return fmt.Errorf("channel: scatter write: %d destinations for %d buffers", len(dsts), len(bufs))
	}
	return m.collective(ctx, peers, len(bufs), "scatter write", func(b *Batch, _, k int) { b.Write(dsts[k], bufs[k]) })
}

// GatherRead reads srcs[k], in the memory of peers[k], into bufs[k], all
// at once, and waits for every read. With peers == nil it reads from every
// peer but self, srcs and bufs indexed by peer number.
func (m *MultiChannel) GatherRead(ctx context.Context, peers []int, srcs []verbs.RemoteAddr, bufs []verbs.SGE) error {
	if len(srcs) != len(bufs) {
		return fmt.Errorf("channel: gather read: %d sources for %d buffers", len(srcs), len(bufs))
	}
	return m.collective(ctx, peers, len(bufs), "gather read", func(b *Batch, _, k int) { b.Read(srcs[k], bufs[k]) })
}

// MulticastSend sends the same message, sgl, to each of peers (every peer
// but self when peers is nil) and waits for every send.
func (m *MultiChannel) MulticastSend(ctx context.Context, peers []int, sgl ...verbs.SGE) error {
	return m.collective(ctx, peers, -1, "multicast send", func(b *Batch, _, _ int) { b.Send(sgl...) })
}
