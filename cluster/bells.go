package cluster

import (
	"context"
	"encoding/binary"
	"errors"
	"sync/atomic"

	"github.com/goverbs/verbs"
)

// Doorbells on demand (internal/bells has the protocol and its books).
// A signal with immediate data costs the receiver a doorbell receive, its
// completion and its repost even when the receiver spins and would have
// seen the word anyway. Where waits spin before they sleep
// (spinwait.Policy.Spin, b.onDemand) signals are plain writes, and a rank
// rings a peer only when the peer said it sleeps, in its sleep word at
// this rank (sleepOff): before it sleeps a wait writes an odd number
// there at the peer it waits for (plain: a peer busy outside the barriers
// may have used up its doorbell receives), waits for that write's
// completion, looks once more, then sleeps; when it ends it writes an
// even number. A rank reads the sleep words of the peers it signalled as
// its waits spin, before they sleep and when its barrier ends, and rings
// (a write with immediate data of the probe word) when internal/bells
// says so. A signal placed after its barrier ended and after the
// sleeper's whole spin is found at the sleeper's alarm instead. Share's
// mailboxes keep their doorbells.

// sleepOff is the offset, in a rank's flag region, of rank j's sleep
// word there.
func (b *barrier) sleepOff(j int) int { return (b.n*wordsPerPeer + extraWords + j) * flagBytes }

// ringSleepers rings the peers signalled without a doorbell in this
// barrier that are owed it.
func (b *barrier) ringSleepers(ctx context.Context) error {
	for _, p := range b.book.WroteTo() {
		v := atomic.LoadUint64(b.word64(b.sleepOff(p)))
		if !b.book.Owes(p, v) {
			continue
		}
		src, err := b.aux.SGE(0, flagBytes)
		if err != nil {
			return err
		}
		if err := b.postWrite(ctx, p, b.mc.Peer(p), b.remote[p].At(b.probeOff()), src, true); err != nil {
			return &peerFault{peer: p, err: err}
		}
		b.book.Rang(p, v)
	}
	return nil
}

// peerFault is the failure of a write to peer made while a step involved
// another (a doorbell rung during a wait): run reports peer, not the
// step's, as the rank whose transport broke.
type peerFault struct {
	peer int
	err  error
}

func (e *peerFault) Error() string { return e.err.Error() }
func (e *peerFault) Unwrap() error { return e.err }

// endQuiet rings, once more, the peers signalled in the barrier that
// ends that sleep, and forgets which peers it signalled. Best effort: a
// peer it cannot ring wakes at its alarm.
func (b *barrier) endQuiet(ctx context.Context) {
	if len(b.book.WroteTo()) > 0 {
		_ = b.ringSleepers(ctx)
		b.book.Forget()
	}
}

// announce posts the write of a new sleep number at peer, unless an
// announcement is in flight, and reports whether one is (the wait then
// sleeps until it completes: woken). A full send queue posts nothing.
func (b *barrier) announce(peer int) (bool, error) {
	if b.annPending {
		return true, nil
	}
	off := 2 * b.n * flagBytes
	binary.NativeEndian.PutUint64(b.staging.Bytes()[off:], b.book.NextSleep())
	src, err := b.staging.SGE(off, flagBytes)
	if err != nil {
		return false, err
	}
	h, err := b.mc.Peer(peer).PostWrite(b.remote[peer].At(uint64(b.sleepOff(b.rank))), src)
	if err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			return false, nil
		}
		return false, err
	}
	b.ann, b.annPending, b.annPeer = h, true, peer
	b.book.Told(peer)
	return true, nil
}

// announced reports whether the announcement in flight completed (its
// error: the peer's channel broke, which the wait's checks report), and
// releases it then.
func (b *barrier) announced() (done bool, err error) {
	if !b.annPending || !b.ann.Done() {
		return false, nil
	}
	err = b.ann.Err()
	b.ann.Release()
	b.annPending = false
	return true, err
}

// awake tells the peers told that this rank sleeps that it no longer
// does (their sleep words become even): they then ring only for its next
// sleep. An announcement still in flight is placed before it (the queue
// pair keeps the order). Best effort.
func (b *barrier) awake(ctx context.Context) {
	v, to := b.book.Awake()
	if len(to) == 0 {
		return
	}
	off := (2*b.n + 1) * flagBytes
	binary.NativeEndian.PutUint64(b.staging.Bytes()[off:], v)
	src, err := b.staging.SGE(off, flagBytes)
	if err != nil {
		return
	}
	for _, p := range to {
		_ = b.postWrite(ctx, p, b.mc.Peer(p), b.remote[p].At(uint64(b.sleepOff(b.rank))), src, false)
	}
}
