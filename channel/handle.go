package channel

import (
	"context"
	"encoding/binary"
	"fmt"

	"github.com/goverbs/verbs"
)

// Handle names one operation in flight: a small value, copied freely, that
// allocates nothing. It comes from a Batch (valid until the Batch scope
// returns) or from a Post method (valid until Release).
//
// A Handle must be used by one goroutine at a time. Once its operation is
// released, every method fails with ErrStale (or returns zero values).
type Handle struct {
	s   *slot
	gen uint32
	err error // the operation failed before it had a slot
}

func handleOf(s *slot) Handle { return Handle{s: s, gen: s.gen.Load()} }

func errHandle(err error) Handle { return Handle{err: err} }

// live reports whether the handle's operation has not been released. A
// released operation that was still in flight keeps its generation until
// its completion comes (detach: the completion must still match it, to be
// counted and to free the slot), so the slot's state says it too: a
// detached slot, or a free one, belongs to no handle. The state is read
// before the generation: a slot recycled after the load of a detached or
// free state carries a later generation by then.
func (h Handle) live() bool {
	if h.s == nil {
		return false
	}
	st := h.s.state.Load()
	return st != slotDetached && st != slotFree && h.s.gen.Load() == h.gen
}

// Peer returns the peer number the operation addresses (0 on a Channel of
// its own), or -1 for a stale or failed handle.
func (h Handle) Peer() int {
	if !h.live() {
		return -1
	}
	return h.s.p.idx
}

// Done reports whether the operation has completed (successfully or not).
// It does not poll the completion queue: see Poll.
func (h Handle) Done() bool {
	if h.err != nil {
		return true
	}
	if !h.live() {
		return false
	}
	return h.s.state.Load() == slotDone
}

// Poll polls the completion queue once (unless another goroutine is
// polling it) and reports whether the operation has completed. It never
// blocks.
func (h Handle) Poll() (bool, error) {
	if h.err != nil {
		return true, nil
	}
	if !h.live() {
		return false, ErrStale
	}
	if h.s.state.Load() == slotDone {
		return true, nil
	}
	if h.s.queued.Load() {
		return false, &OpError{Op: h.s.kind.String(), Peer: h.s.p.idx, Err: errQueued}
	}
	if err := h.s.p.e.progress(); err != nil {
		return false, err
	}
	return h.s.state.Load() == slotDone, nil
}

// Wait blocks until the operation completes or ctx ends, and returns the
// operation's error. If ctx ends first, Wait returns an error wrapping
// verbs.ErrTimeout and ctx.Err(), and the operation stays in flight: the
// handle is still valid and Wait may be called again. (The blocking
// methods of Channel, by contrast, break the channel when their ctx ends.)
// The operation of a Batch that has not posted it yet (Flush, and the
// Batch's waits, post what is queued) cannot complete: Wait then fails at
// once with an error wrapping ErrNotPosted, and the handle stays valid.
func (h Handle) Wait(ctx context.Context) error {
	if h.err != nil {
		return h.err
	}
	if !h.live() {
		return ErrStale
	}
	s := h.s
	if s.queued.Load() {
		return &OpError{Op: s.kind.String(), Peer: s.p.idx, Err: errQueued}
	}
	if s.state.Load() != slotDone {
		if err := s.p.e.waitHandle(ctx, s, h.gen); err != nil {
			return &OpError{Op: s.kind.String(), Peer: s.p.idx, Err: err}
		}
		if !h.live() {
			return ErrStale
		}
	}
	s.seen = true
	return s.result()
}

// Err returns the operation's error once it has completed, and nil while
// it is in flight.
func (h Handle) Err() error {
	if h.err != nil {
		return h.err
	}
	if !h.live() {
		return ErrStale
	}
	if h.s.state.Load() != slotDone {
		return nil
	}
	h.s.seen = true
	return h.s.result()
}

// Completion returns the work completion of a completed operation; ok is
// false while it is in flight, or if it never reached the device.
func (h Handle) Completion() (wc verbs.Completion, ok bool) {
	if !h.live() || h.s.state.Load() != slotDone || h.s.failed() {
		return verbs.Completion{}, false
	}
	return h.s.wc, true
}

// Received describes a completed receive.
type Received struct {
	Len    int    // bytes received
	Imm    uint32 // immediate data (host byte order), when HasImm
	HasImm bool   // the message was a send or an RDMA write with immediate
	Write  bool   // the message was an RDMA write with immediate (its data went to the peer's target address, not to the receive buffer)
}

func receivedOf(wc *verbs.Completion) Received {
	return Received{Len: int(wc.ByteLen), Imm: wc.Imm, HasImm: wc.Flags&verbs.WithImm != 0,
		Write: wc.Opcode == verbs.OpRecvWriteImm}
}

// Received returns what a completed, successful receive got; zero
// otherwise.
func (h Handle) Received() Received {
	if !h.live() || h.s.state.Load() != slotDone || h.s.kind != opRecv || h.s.failed() || h.s.wc.Status != verbs.StatusSuccess {
		return Received{}
	}
	return receivedOf(&h.s.wc)
}

// Value returns the prior value of the remote word for a completed,
// successful compare-and-swap or fetch-and-add; zero otherwise.
func (h Handle) Value() uint64 {
	if !h.live() || h.s.state.Load() != slotDone || h.s.failed() || h.s.wc.Status != verbs.StatusSuccess {
		return 0
	}
	if h.s.kind != opCAS && h.s.kind != opFAA {
		return 0
	}
	return h.s.p.e.atomicResult(h.s)
}

// Release gives the operation's resources back. Releasing a completed
// operation is immediate. Releasing one still in flight detaches it: its
// completion is discarded when it arrives, and until then the device
// still owns its buffers (Channel.Drain waits for that). Release is
// idempotent; Handles of a Batch are released when the scope ends.
func (h Handle) Release() {
	if !h.live() {
		return
	}
	h.s.p.e.detach(h.s)
}

// result is the error of a completed slot.
func (s *slot) result() error {
	if s.err != nil {
		return &OpError{Op: s.kind.String(), Peer: s.p.idx, Err: s.err}
	}
	if s.closed.Load() {
		return &OpError{Op: s.kind.String(), Peer: s.p.idx, Err: errClosedInFlight}
	}
	if s.wc.Status == verbs.StatusSuccess {
		return nil
	}
	err := s.wc.Err()
	if s.wc.Status == verbs.StatusWRFlushErr {
		if c := s.p.cause(); c != nil {
			err = fmt.Errorf("%w (flushed after the queue pair broke: %w)", err, &brokenError{cause: c})
		}
	}
	return &OpError{Op: s.kind.String(), Peer: s.p.idx, Err: err}
}

// errQueued: the operation of a Handle waited for is queued in its Batch
// scope, which has not posted it yet: nothing would ever complete it.
var errQueued = fmt.Errorf("the operation is queued in its Batch and not posted yet: "+
	"wait for it with that Batch's Wait, WaitAny or WaitAll, which post it, or Flush the Batch first: %w", ErrNotPosted)

// failed reports whether the slot's request failed without a completion
// of its own (before the device saw it, or ended by Close).
func (s *slot) failed() bool { return s.err != nil || s.closed.Load() }

// errClosedInFlight is the result of a request whose completion had not
// come when Close destroyed its queue pair.
var errClosedInFlight = fmt.Errorf("the channel was closed before the request completed (its queue pair is destroyed): %w", ErrClosed)

// resultSGE is the 8 bytes of scratch memory where the atomic operation
// of slot s returns the prior value (slot indexes are below e.nslots, so
// it lies inside the scratch MR).
func (e *engine) resultSGE(s *slot) verbs.SGE {
	return verbs.SGE{Addr: e.scratch.Addr() + 8*uint64(s.idx), Length: 8, LKey: e.scratch.LKey()}
}

// atomicResult is the prior value a completed atomic operation of slot s
// returned: copied out of the scratch memory by the poller that
// dispatched its completion (scratchResult), so that reading it never
// touches that memory, which Close unmaps (a check of closed before the
// read would leave a window for Close between the two).
func (e *engine) atomicResult(s *slot) uint64 { return s.val }

// scratchResult reads the prior value the atomic operation of slot s
// returned into the scratch memory. Called by the poller, with pollMu,
// which Close takes before it frees the scratch memory (or, if it gave up
// waiting for it, leaves to the poller: finishLate).
func (e *engine) scratchResult(s *slot) uint64 {
	off := 8 * int(s.idx)
	return binary.NativeEndian.Uint64(e.scratch.Bytes()[off : off+8])
}
