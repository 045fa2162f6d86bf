package verbs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// Completion is one work completion. Its layout matches the provider's, so
// Poll copies nothing twice.
//
// As in ibv_poll_cq(3), SrcQP, PKeyIndex, SLID, SL and DLIDPathBits are
// valid only in receive completions of UD queue pairs: there SrcQP is the
// sender's QPN. A connected (RC or UC) queue pair has one peer, whose QPN
// the application gave it when it connected; its receive completions
// carry 0 in SrcQP on soft0 and rdma_rxe; other hardware may report the
// peer's QPN there, so portable code does not read it.
type Completion struct {
	WRID         uint64
	Status       Status
	Opcode       Opcode // valid only when Status is StatusSuccess
	VendorErr    uint32
	ByteLen      uint32 // receive completions: bytes received (UD: plus 40 GRH bytes)
	Imm          uint32 // immediate data, host byte order, when Flags has WithImm
	QPN          uint32 // the local QP
	SrcQP        uint32 // UD receive completions: the sender's QPN (0 on RC and UC, see below)
	Flags        CompletionFlags
	PKeyIndex    uint16
	SLID         uint16
	SL           uint8
	DLIDPathBits uint8
	_            [2]byte
}

// Err returns nil for a successful completion and a *CompletionError
// otherwise.
func (c *Completion) Err() error {
	if c.Status == StatusSuccess {
		return nil
	}
	return &CompletionError{Status: c.Status, VendorErr: c.VendorErr, WRID: c.WRID, QPN: c.QPN, Opcode: c.Opcode}
}

func (c Completion) String() string {
	s := fmt.Sprintf("wr_id=%#x %s qpn=%d", c.WRID, c.Status, c.QPN)
	if c.Status == StatusSuccess {
		s += fmt.Sprintf(" %s len=%d", c.Opcode, c.ByteLen)
		if c.Flags&WithImm != 0 {
			s += fmt.Sprintf(" imm=%#x", c.Imm)
		}
	}
	return s
}

// Layout guard: Completion and prov.Completion must be interchangeable.
var _ = [1]struct{}{}[unsafe.Sizeof(Completion{})-unsafe.Sizeof(prov.Completion{})]

func provCompletions(dst []Completion) []prov.Completion {
	return unsafe.Slice((*prov.Completion)(unsafe.Pointer(unsafe.SliceData(dst))), len(dst))
}

// CompletionChannel delivers completion events of one or more CQs, so a
// program can sleep until a CQ has work. It is safe for concurrent use.
type CompletionChannel struct {
	res resource
	c   *Context
	ch  prov.CompChannel
	cqs sync.Map // prov.CQ -> *CompletionQueue
}

// NewCompletionChannel creates a completion channel to share among CQs.
func (c *Context) NewCompletionChannel() (*CompletionChannel, error) {
	if !c.res.enter() {
		return nil, c.res.errClosed("create completion channel")
	}
	defer c.res.exit()
	pch, err := c.ctx.CreateCompChannel()
	if err != nil {
		return nil, opErr("create completion channel", c.name, err)
	}
	ch := &CompletionChannel{c: c, ch: pch}
	if err := initResource(ch, &ch.res, "completion channel", "", &c.res); err != nil {
		pch.Close()
		return nil, err
	}
	return ch, nil
}

// Wait blocks until one of the channel's armed CQs has an event, or ctx
// ends, and returns that CQ. Each RequestNotify yields at most one event;
// re-arm the CQ, then poll it until empty, before waiting again.
func (ch *CompletionChannel) Wait(ctx context.Context) (*CompletionQueue, error) {
	if ch.res.isClosed() {
		return nil, ch.res.errClosed("wait for completion event")
	}
	for {
		pcq, err := ch.ch.Wait(ctx)
		if errors.Is(err, prov.ErrWoken) {
			continue // no Wake of a shared channel is public
		}
		if err != nil {
			if cerr := waitEnded(ctx, err); cerr != nil {
				return nil, opErr("wait for completion event", ch.c.name, fmt.Errorf("%w: %w", ErrTimeout, cerr))
			}
			return nil, opErr("wait for completion event", ch.c.name, err)
		}
		if v, ok := ch.cqs.Load(pcq); ok {
			return v.(*CompletionQueue), nil
		}
		// The event of a CQ closed since: not an error of the channel,
		// whose other CQs the caller waits for.
	}
}

// waitEnded returns the context error that ended a wait that failed with
// err, or nil if the wait failed for another reason. A provider may see the
// deadline (through the runtime poller) a moment before ctx.Err() is set.
func waitEnded(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	for _, cerr := range []error{context.DeadlineExceeded, context.Canceled} {
		if errors.Is(err, cerr) {
			return cerr
		}
	}
	return nil
}

// Close destroys the channel. It fails while CQs use it. Idempotent.
func (ch *CompletionChannel) Close() error {
	return ch.res.close(func() error { return opErr("destroy completion channel", ch.c.name, ch.ch.Close()) })
}

// CQSpec describes a completion queue. The zero value is a CQ of 1024
// entries with its own completion channel, so Wait works.
type CQSpec struct {
	// Entries is the minimum number of completions the CQ holds (default 1024).
	// A CQ that overflows enters an error state: its Polls fail with an
	// error wrapping EOVERFLOW, and the context reports EventCQError
	// (see Context.AsyncEvent). Size it for every completion that can be
	// outstanding: the send queues' signaled requests and the receives of
	// the QPs (and SRQs) it serves.
	Entries int
	// Channel, when set, delivers the CQ's events on a shared channel; then
	// use Channel.Wait instead of CompletionQueue.Wait.
	Channel *CompletionChannel
	// NoChannel creates the CQ without any completion channel (poll only).
	NoChannel bool
	// Vector is the completion vector (interrupt) to use; default 0.
	Vector int
}

// CompletionQueue collects completions of work requests. Poll and Wait are
// safe for concurrent use, though one poller per CQ is the usual design.
type CompletionQueue struct {
	res     resource
	c       *Context
	cq      prov.CQ
	cap     int                // cq.Cap(), which must not be asked after Close
	ch      *CompletionChannel // shared channel, or own
	ownCh   prov.CompChannel   // private channel for Wait
	stashed atomic.Bool
	mu      sync.Mutex // guards stash
	stash   prov.Completion
	waitSem chan struct{} // one waiter at a time on the private channel
}

// NewCompletionQueue creates a completion queue.
func (c *Context) NewCompletionQueue(spec CQSpec) (*CompletionQueue, error) {
	if !c.res.enter() {
		return nil, c.res.errClosed("create cq")
	}
	defer c.res.exit()
	if spec.Entries == 0 {
		spec.Entries = 1024
	}
	if spec.Entries < 0 {
		return nil, opErr("create cq", c.name, fmt.Errorf("invalid entries %d: %w", spec.Entries, syscall.EINVAL))
	}
	if spec.Channel != nil && spec.NoChannel {
		return nil, opErr("create cq", c.name, fmt.Errorf("both Channel and NoChannel set: %w", syscall.EINVAL))
	}
	cq := &CompletionQueue{c: c, ch: spec.Channel, waitSem: make(chan struct{}, 1)}
	var pch prov.CompChannel
	switch {
	case spec.Channel != nil:
		if spec.Channel.c == nil { // a zero CompletionChannel
			return nil, spec.Channel.res.errClosed("create cq")
		}
		if spec.Channel.c != c {
			return nil, opErr("create cq", c.name, fmt.Errorf("completion channel belongs to another device context (%s): %w", spec.Channel.c.name, syscall.EINVAL))
		}
		if !spec.Channel.res.enter() {
			return nil, spec.Channel.res.errClosed("create cq")
		}
		defer spec.Channel.res.exit()
		pch = spec.Channel.ch
	case !spec.NoChannel:
		var err error
		if pch, err = c.ctx.CreateCompChannel(); err != nil {
			return nil, opErr("create cq", c.name, err)
		}
		cq.ownCh = pch
	}
	pcq, err := c.ctx.CreateCQ(spec.Entries, pch, spec.Vector)
	if err != nil {
		if cq.ownCh != nil {
			cq.ownCh.Close()
		}
		return nil, opErr("create cq", c.name, fmt.Errorf("%d entries: %w", spec.Entries, err))
	}
	cq.cq, cq.cap = pcq, pcq.Cap()
	parents := []*resource{&c.res}
	if spec.Channel != nil {
		parents = append(parents, &spec.Channel.res)
	}
	if err := initResource(cq, &cq.res, "completion queue", fmt.Sprintf("%d entries", pcq.Cap()), parents...); err != nil {
		pcq.Close()
		if cq.ownCh != nil {
			cq.ownCh.Close()
		}
		return nil, err
	}
	if spec.Channel != nil {
		spec.Channel.cqs.Store(pcq, cq)
	}
	return cq, nil
}

// Cap returns the number of completions the CQ holds.
func (cq *CompletionQueue) Cap() int { return cq.cap }

// Poll moves up to len(dst) completions into dst and returns how many. It
// never blocks and does not allocate; it makes one provider call.
func (cq *CompletionQueue) Poll(dst []Completion) (int, error) {
	return cq.poll(dst, 0)
}

// PollBusy is Poll for busy-polling loops: it polls until the CQ yields at
// least one completion, or until spins polls in a row found it empty
// (spins below 1 count as 1), and moves up to len(dst) completions into
// dst. It returns at the first non-empty poll, so a completion is taken as
// soon as a poll sees it, and it returns 0 with a nil error when all spins
// polls found nothing.
//
// Like Poll, it is one provider call and does not allocate: the hardware
// provider repeats the poll in C, so a loop waiting for a completion
// crosses from Go into C once per spins empty polls instead of once per
// poll (for up to 65536 of them; more spins take more calls). The calling
// goroutine keeps its OS thread for the whole call; choose spins so that
// an empty call stays short (an empty poll of a hardware CQ takes tens to
// hundreds of nanoseconds) and check deadlines or contexts between calls.
// Close ends a PollBusy in progress (with ErrClosed).
func (cq *CompletionQueue) PollBusy(dst []Completion, spins int) (int, error) {
	// At most maxBusySpins polls per provider call, so that a Close
	// (which waits for the call) ends even an endless PollBusy.
	if len(dst) == 0 {
		return cq.poll(dst, 0) // at once: (0, nil), or closed
	}
	for spins = max(spins, 1); ; {
		k := min(spins, maxBusySpins)
		n, err := cq.poll(dst, k)
		if spins -= k; n > 0 || err != nil || spins <= 0 {
			return n, err
		}
	}
}

// maxBusySpins bounds the polls of one provider call of PollBusy.
const maxBusySpins = 1 << 16

// poll is Poll (spins 0) and PollBusy.
func (cq *CompletionQueue) poll(dst []Completion, spins int) (int, error) {
	if len(dst) == 0 {
		return 0, cq.check("poll cq") // nothing to poll, but closed is closed
	}
	if !cq.res.enter() {
		// Never hand a destroyed CQ to the provider (use after free in
		// C): Close waits for the polls that entered.
		return 0, cq.res.errClosed("poll cq")
	}
	defer cq.res.exit()
	n := 0
	if cq.stashed.Load() {
		cq.mu.Lock()
		if cq.stashed.Load() {
			dst[0] = *(*Completion)(unsafe.Pointer(&cq.stash))
			cq.stashed.Store(false)
			n = 1
		}
		cq.mu.Unlock()
		if n == len(dst) {
			return n, nil
		}
	}
	var m int
	var err error
	if spins > 0 && n == 0 {
		m, err = cq.cq.PollBusy(provCompletions(dst), spins)
	} else {
		// Poll; or PollBusy that already has the stashed completion.
		m, err = cq.cq.Poll(provCompletions(dst[n:]))
	}
	if err != nil {
		if cq.res.isClosed() {
			return n, cq.res.errClosed("poll cq")
		}
		return n + m, opErr("poll cq", cq.c.name, err)
	}
	return n + m, nil
}

// RequestNotify arms the CQ: its channel gets one event for the next
// completion (only solicited or failed ones, with solicitedOnly).
func (cq *CompletionQueue) RequestNotify(solicitedOnly bool) error {
	if !cq.res.enter() {
		return cq.res.errClosed("arm cq")
	}
	defer cq.res.exit()
	return opErr("arm cq", cq.c.name, cq.cq.Arm(solicitedOnly))
}

// Wait blocks until the CQ holds at least one completion, Wake is called,
// or ctx ends. It sleeps on the CQ's private completion channel (the
// default), without spinning and without holding an OS thread. It fails
// for CQs created with a shared Channel or NoChannel.
func (cq *CompletionQueue) Wait(ctx context.Context) error {
	if cq.c == nil { // a zero CompletionQueue, not from NewCompletionQueue
		return cq.res.errClosed("wait on cq")
	}
	if cq.ownCh == nil {
		return opErr("wait on cq", cq.c.name, fmt.Errorf("cq has no private completion channel (use Channel.Wait or Poll): %w", ErrNotSupported))
	}
	// One waiter at a time; the others wait their turn as long as their
	// ctx allows (a mutex made a second Wait ignore its ctx until the
	// first ended).
	select {
	case cq.waitSem <- struct{}{}:
	default:
		select {
		case cq.waitSem <- struct{}{}:
		case <-ctx.Done():
			return opErr("wait on cq", cq.c.name, fmt.Errorf("%w: %w", ErrTimeout, ctx.Err()))
		}
	}
	defer func() { <-cq.waitSem }()
	for {
		if ready, err := cq.armOrStash(); ready || err != nil {
			return err
		}
		if _, err := cq.ownCh.Wait(ctx); err != nil {
			if errors.Is(err, prov.ErrWoken) {
				return nil
			}
			if cerr := waitEnded(ctx, err); cerr != nil {
				return opErr("wait on cq", cq.c.name, fmt.Errorf("%w: %w", ErrTimeout, cerr))
			}
			return opErr("wait on cq", cq.c.name, err)
		}
	}
}

// Wake makes a Wait of the CQ in progress return nil at once, or, if
// none is in progress, the next one to begin: as if a completion had
// arrived, so the waiter polls (finding none, perhaps) and looks at what
// it waits for again. It is for a goroutine that sleeps on the CQ on
// behalf of others, whose conditions can change without a completion (a
// request withdrawn, a queue pair broken while idle). Several Wakes before
// a Wait wake it once. It never blocks and, on the soft provider,
// allocates nothing. Like Wait, it fails for CQs created with a shared
// Channel or NoChannel.
func (cq *CompletionQueue) Wake() error {
	if cq.c == nil {
		return cq.res.errClosed("wake cq")
	}
	if cq.ownCh == nil {
		return opErr("wake cq", cq.c.name, fmt.Errorf("cq has no private completion channel: %w", ErrNotSupported))
	}
	if !cq.res.enter() {
		return cq.res.errClosed("wake cq")
	}
	defer cq.res.exit()
	cq.ownCh.Wake()
	return nil
}

// armOrStash is a round of Wait: it reports whether a completion is in
// the stash, polling for one after arming the CQ.
func (cq *CompletionQueue) armOrStash() (ready bool, err error) {
	if !cq.res.enter() {
		return false, cq.res.errClosed("wait on cq")
	}
	defer cq.res.exit()
	if cq.stashed.Load() {
		return true, nil
	}
	if err := cq.cq.Arm(false); err != nil {
		return false, opErr("wait on cq", cq.c.name, err)
	}
	// A completion may have arrived before the arm: look for one.
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if !cq.stashed.Load() {
		// Polled straight into the stash (guarded by mu): a local
		// array would escape to the heap through the interface.
		n, err := cq.cq.Poll(unsafe.Slice(&cq.stash, 1))
		if err != nil {
			return false, opErr("wait on cq", cq.c.name, err)
		}
		if n == 1 {
			cq.stashed.Store(true)
		}
	}
	return cq.stashed.Load(), nil
}

// Close destroys the CQ. It fails while QPs or SRQs use it. Idempotent.
func (cq *CompletionQueue) Close() error {
	return cq.res.close(func() error {
		if err := cq.cq.Close(); err != nil {
			return opErr("destroy cq", cq.c.name, err)
		}
		if cq.ch != nil {
			cq.ch.cqs.Delete(cq.cq)
		}
		if cq.ownCh != nil {
			return opErr("destroy completion channel", cq.c.name, cq.ownCh.Close())
		}
		return nil
	})
}

func (cq *CompletionQueue) check(op string) error {
	if cq.res.isClosed() {
		return cq.res.errClosed(op)
	}
	return nil
}
