package session

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

var (
	errShortBuffer = io.ErrShortBuffer
	// ErrMisaligned: an atomic operation's target is not one 8-byte
	// aligned word. Nothing was posted.
	ErrMisaligned = errors.New("session: atomic target is not an aligned 8-byte word")
)

// remoteAccess is the access a grant may give.
const remoteAccess = verbs.AccessRemoteRead | verbs.AccessRemoteWrite | verbs.AccessRemoteAtomic

// grantable reports whether a grant may give access: some of the remote
// rights, nothing else.
func grantable(access verbs.Access) bool {
	return access != 0 && access&^remoteAccess == 0
}

func isLimit(err error) bool { return errors.Is(err, ErrLimit) }

// grant registers a window of mr with access for the peer, for lease
// (0: the default), within MaxGranted.
func (s *Session) grant(mr LocalMR, access verbs.Access, lease time.Duration, served bool) (*grantState, error) {
	return s.grantBytes(mr.Bytes(), mr, access, lease, served)
}

// grantBytes registers a window of mem (of mr, if valid) for the peer.
func (s *Session) grantBytes(mem []byte, mr LocalMR, access verbs.Access, lease time.Duration, served bool) (*grantState, error) {
	lease = s.leaseOf(lease)
	n := int64(len(mem))
	a := &s.agent
	a.mu.Lock()
	if a.err != nil {
		a.mu.Unlock()
		return nil, s.fail("grant", nil)
	}
	if a.granted+n > s.cfg.MaxGranted {
		g := a.granted
		a.mu.Unlock()
		return nil, fmt.Errorf("%w: %d bytes granted to the peer already, %d more would pass the cap of %d", ErrLimit, g, n, s.cfg.MaxGranted)
	}
	a.granted += n // reserved
	a.mu.Unlock()
	win, err := s.pd.Register(mem, access|verbs.AccessLocalWrite)
	if err != nil {
		a.mu.Lock()
		a.granted -= n
		a.mu.Unlock()
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err != nil {
		// The session ended meanwhile: its grants are closed, or being.
		a.granted -= n
		win.Close()
		return nil, s.fail("grant", nil)
	}
	a.nextG++
	g := &grantState{id: a.nextG, mr: mr, win: win, n: n, served: served}
	a.grants[g.id] = g
	// Close waits for the timer's function if it fires (a stop that
	// comes first says Done in its place: dropGrantLocked); the session
	// lives (a.err is nil), so Close has not begun to wait.
	s.leases.Add(1)
	g.leases = &s.leases
	g.closes = time.Now().Add(lease + leaseGrace)
	g.timer = time.AfterFunc(lease+leaseGrace, func() { // runs after the unlock
		defer s.leases.Done()
		a.mu.Lock()
		if a.grants[g.id] == g {
			a.dropGrantLocked(g.id, g)
		}
		a.mu.Unlock()
	})
	return g, nil
}

// leaseOf is the lease a grant or request of lease gets: Config.Lease for
// 0 (or less), at most maxLease, which is what the wire carries. Before,
// a longer lease (math.MaxInt64 for "no end") went out as is and the
// peer ended the session for a protocol error, and the granter's timer
// (lease plus leaseGrace) overflowed and closed the window at once
// (TestAdv2LeaseBounds).
func (s *Session) leaseOf(lease time.Duration) time.Duration {
	if lease <= 0 {
		lease = s.cfg.Lease
	}
	return min(lease, maxLease)
}

// RemoteMR is memory of the peer this side may access: granted by the
// peer's agent (RequestRemoteMR), or offered by the peer's application
// (ReceiveRemoteMR). It is valid until its lease ends (by this side's
// clock, from the request for a requested region, from when the offer
// arrived for an offered one), the peer revokes it, or it is
// released or handed back; then operations on it fail with
// ErrLeaseExpired before anything is posted. A RemoteMR is safe for
// concurrent use.
type RemoteMR struct {
	s        *Session
	grant    uint64
	region   verbs.RemoteRegion
	access   verbs.Access
	deadline time.Time
	state    atomic.Int32
	inflight atomic.Int32
	// unclaimed: a grant its requester has not taken yet (claimRemote);
	// the sweep spares it (agent's mu).
	unclaimed bool
}

const (
	remoteLive = iota
	remoteReleased
	remoteRevoked
	remoteEnded // the session ended
)

// newRemote records the region of a grant or an offer, whose lease counts
// from since (zero: now). A grant (unclaimed) stays in the table, whatever
// its lease, until its requester takes it (claimRemote) or gives up.
func (s *Session) newRemote(m ctrlMsg, since time.Time, unclaimed bool) *RemoteMR {
	if since.IsZero() {
		since = time.Now()
	}
	r := &RemoteMR{s: s, grant: m.grant, region: verbs.RemoteRegion{Addr: m.addr, Len: m.len, RKey: m.rkey},
		access: m.access, deadline: since.Add(m.lease), unclaimed: unclaimed}
	a := &s.agent
	a.mu.Lock()
	a.remotes[m.grant] = r
	if n := len(a.remotes); n >= remoteSweepMin {
		if now := time.Now(); n >= a.sweepAt || now.Sub(a.sweptAt) > leaseGrace {
			a.sweepRemotesLocked(now)
		}
	}
	a.mu.Unlock()
	return r
}

// remoteSweepMin is the size of the table of remote regions at which
// newRemote first looks for regions whose leases ended; then it looks
// when the table has grown to twice what it kept, or when the last look
// is more than leaseGrace old (regions that were still in their lease or
// its grace then may have ended since: without it, up to half of a table
// that stopped doubling could be regions long expired).
const remoteSweepMin = 64

// sweepRemotesLocked forgets the remote regions whose leases ended more
// than leaseGrace ago (the granter has closed their windows) and that
// have no operation in flight: a revocation could not reach them any
// more, and only the application refers to them. Before, the table kept
// every region left to expire (never released) for the session's life:
// TestAdvExpiredRemotesForgotten. It spares the grants their requesters
// have not taken yet: RequestRemoteMR finds its region in the table
// (before, a grant that came more than leaseGrace after its request,
// under load, was swept by its own newRemote or another's, and
// RequestRemoteMR failed with ErrLeaseExpired instead of returning the
// region, expired, as it does otherwise). mu held.
func (a *agentState) sweepRemotesLocked(now time.Time) {
	for id, r := range a.remotes {
		if now.After(r.deadline.Add(leaseGrace)) && r.inflight.Load() == 0 && !r.unclaimed {
			delete(a.remotes, id)
		}
	}
	a.sweepAt, a.sweptAt = 2*len(a.remotes), now
}

func (s *Session) lookupRemote(grant uint64) *RemoteMR {
	a := &s.agent
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.remotes[grant]
}

// claimRemote is lookupRemote for the requester of grant, which takes
// it: from then on the sweep may forget it.
func (s *Session) claimRemote(grant uint64) *RemoteMR {
	a := &s.agent
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.remotes[grant]
	if r != nil {
		r.unclaimed = false
	}
	return r
}

func (s *Session) forgetRemote(grant uint64) {
	a := &s.agent
	a.mu.Lock()
	delete(a.remotes, grant)
	a.mu.Unlock()
}

// Len is the region's length.
func (r *RemoteMR) Len() int { return int(r.region.Len) }

// Access is the access the peer granted.
func (r *RemoteMR) Access() verbs.Access { return r.access }

// Deadline is when the lease ends.
func (r *RemoteMR) Deadline() time.Time { return r.deadline }

// Region is the raw region (address, length, rkey), for use with the
// verbs package directly. Nothing then checks bounds, access or lease
// on this side: a violation is a remote access error that breaks the
// queue pair it was posted on.
func (r *RemoteMR) Region() verbs.RemoteRegion { return r.region }

// Slice returns n bytes at off of the region, or ErrOutOfBounds.
func (r *RemoteMR) Slice(off, n int) (RemoteSlice, error) {
	if off < 0 || n < 0 || uint64(off)+uint64(n) > r.region.Len {
		return RemoteSlice{}, fmt.Errorf("session: %w: %d bytes at %d of a remote region of %d", ErrOutOfBounds, n, off, r.region.Len)
	}
	return RemoteSlice{r: r, off: uint64(off), n: uint64(n)}, nil
}

// All is the whole region.
func (r *RemoteMR) All() RemoteSlice { return RemoteSlice{r: r, n: r.region.Len} }

// valid returns why r cannot be used now, if it cannot.
func (r *RemoteMR) valid() error {
	switch r.state.Load() {
	case remoteReleased:
		return fmt.Errorf("%w: the region was released or handed back", ErrLeaseExpired)
	case remoteRevoked:
		return fmt.Errorf("%w: the peer revoked the region", ErrLeaseExpired)
	case remoteEnded:
		return fmt.Errorf("%w: the session ended", ErrLeaseExpired)
	}
	if !time.Now().Before(r.deadline) {
		return fmt.Errorf("%w: the lease ended at %s", ErrLeaseExpired, r.deadline.Format(time.RFC3339Nano))
	}
	return nil
}

// quiesce waits until no operation of this side on r is in flight, or
// the session ends (done), or ctx ends: then it returns ctx's error.
func (r *RemoteMR) quiesce(ctx context.Context, done <-chan struct{}) error {
	for d := 10 * time.Microsecond; r.inflight.Load() > 0; d = min(2*d, 10*time.Millisecond) {
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
	}
	return nil
}

// Release gives the region up: the peer's agent closes its window (and
// frees it, if it allocated it for RequestRemoteMR). It waits for this
// side's operations on it to finish first. If ctx ends first, Release
// returns its error, and the region is given up all the same.
func (r *RemoteMR) Release(ctx context.Context) error {
	if r.s == nil {
		return fmt.Errorf("session: release remote region: %w (a zero RemoteMR)", ErrClosed)
	}
	if err := r.s.enter(&r.s.calls, "release remote region"); err != nil {
		return err
	}
	defer r.s.calls.RUnlock()
	return r.giveUp(ctx, ctrlRelease, "release remote region")
}

func (r *RemoteMR) giveUp(ctx context.Context, typ uint8, op string) error {
	if err := r.valid(); err != nil && typ == ctrlHandBack {
		return fmt.Errorf("session: %s: %w", op, err)
	}
	if !r.state.CompareAndSwap(remoteLive, remoteReleased) {
		return fmt.Errorf("session: %s: %w", op, r.validOr())
	}
	if err := r.quiesce(ctx, r.s.done); err != nil {
		// ctx ended while operations of this side on the region were
		// in flight (a WriteImm whose notice waits for a credit): the
		// peer learns it once they are done. Before, Release and
		// SendRemoteMR waited for them whatever ctx said
		// (TestReleaseHonoursCtx).
		r.s.goTask(func() {
			r.quiesce(context.Background(), r.s.done)
			r.s.forgetRemote(r.grant)
			if r.s.Err() == nil {
				r.s.sendAsyncCtrl(ctrlMsg{typ: typ, grant: r.grant})
			}
		})
		return fmt.Errorf("session: %s: %w", op, err)
	}
	r.s.forgetRemote(r.grant)
	_, err := r.s.call(ctx, op, ctrlMsg{typ: typ, grant: r.grant})
	if err != nil && ctx.Err() != nil && r.s.Err() == nil {
		// This side gave the region up: the peer must learn it, or it
		// keeps the memory (and counts it in MaxGranted) until the
		// lease ends (TestAdv2ReleaseCancelled). If the message went
		// out already, the peer refuses the second one.
		r.s.sendAsyncCtrl(ctrlMsg{typ: typ, grant: r.grant})
	}
	return err
}

func (r *RemoteMR) validOr() error {
	if err := r.valid(); err != nil {
		return err
	}
	return ErrLeaseExpired
}

// RemoteSlice is part of a RemoteMR.
type RemoteSlice struct {
	r      *RemoteMR
	off, n uint64
}

// Len is the slice's length.
func (s RemoteSlice) Len() int { return int(s.n) }

// MR is the region the slice is part of.
func (s RemoteSlice) MR() *RemoteMR { return s.r }

// Slice returns n bytes at off of the slice, or ErrOutOfBounds.
func (s RemoteSlice) Slice(off, n int) (RemoteSlice, error) {
	if s.r == nil || off < 0 || n < 0 || uint64(off)+uint64(n) > s.n {
		return RemoteSlice{}, fmt.Errorf("session: %w: %d bytes at %d of a remote slice of %d", ErrOutOfBounds, n, off, s.n)
	}
	return RemoteSlice{r: s.r, off: s.off + uint64(off), n: uint64(n)}, nil
}

func (s RemoteSlice) addr() verbs.RemoteAddr {
	return verbs.RemoteAddr{Addr: s.r.region.Addr + s.off, RKey: s.r.region.RKey}
}

// check returns why an operation needing access cannot use dst.
func (s *Session) checkRemote(op string, dst RemoteSlice, access verbs.Access) error {
	if err := s.live(op); err != nil {
		return err
	}
	if dst.r == nil {
		return fmt.Errorf("session: %s: %w: the zero RemoteSlice", op, ErrOutOfBounds)
	}
	if dst.r.s != s {
		return fmt.Errorf("session: %s: %w: the region was granted on another session", op, ErrAccess)
	}
	if err := dst.r.valid(); err != nil {
		return fmt.Errorf("session: %s: %w", op, err)
	}
	if dst.r.access&access != access {
		return fmt.Errorf("session: %s: %w: the region grants %v, the operation needs %v", op, ErrAccess, dst.r.access, access)
	}
	return nil
}

func (s *Session) checkLocal(op string, l LocalSlice, n int) error {
	if n > maxMessage {
		return fmt.Errorf("session: %s: %w: %d bytes, one RDMA operation moves at most %d", op, ErrLimit, n, maxMessage)
	}
	if !l.MR().Valid() {
		return fmt.Errorf("session: %s: %w: the local region was freed", op, ErrClosed)
	}
	if l.MR().MemoryRegion().PD() != s.pd {
		return fmt.Errorf("session: %s: %w: the local region is of another session's allocator", op, ErrAccess)
	}
	if l.Len() != n {
		return fmt.Errorf("session: %s: %w: local %d bytes, remote %d", op, ErrOutOfBounds, l.Len(), n)
	}
	return nil
}

// remoteOp posts an operation on dst and waits for it. local is the
// region of the application's it reads or writes (the zero LocalMR for
// none): it is held until the device is done with it, so that a region
// freed after a cancelled call is not handed out again while the
// operation may still write into it or send its bytes (before, a Read
// whose ctx ended wrote into the next region allocated there:
// TestCrossProcessCancelledReadHoldsRegion).
func (s *Session) remoteOp(ctx context.Context, op string, dst RemoteSlice, local LocalMR, post func() (channel.Handle, error)) (uint64, error) {
	r := dst.r
	held, err := s.holdLocal(op, local)
	if err != nil {
		return 0, err
	}
	if err := s.acquireOp(ctx, op); err != nil {
		unhold(held)
		return 0, err
	}
	r.inflight.Add(1)
	// A revocation that came between the check and the increment waits
	// for us; one that was already quiet is seen here.
	o := orphaned{op: true, r: r, held: held}
	if err := r.valid(); err != nil {
		s.giveBack(o)
		return 0, fmt.Errorf("session: %s: %w", op, err)
	}
	h, err, werr := s.postRoom(ctx, s.data, post)
	if werr != nil {
		s.giveBack(o)
		return 0, s.ctxErr(op, werr)
	}
	if err != nil {
		s.giveBack(o)
		return 0, s.fail(op, err)
	}
	if err := h.Wait(ctx); err != nil && !h.Done() {
		s.goTask(func() { s.reap(h, o) })
		return 0, s.ctxErr(op, err)
	}
	err = h.Err()
	v := h.Value()
	h.Release()
	s.giveBack(o)
	if err != nil {
		return 0, s.fail(op, err)
	}
	return v, nil
}

// Read reads src into dst (same length, at most 2 GiB: a longer one
// fails with ErrLimit).
func (s *Session) Read(ctx context.Context, dst LocalSlice, src RemoteSlice) error {
	if err := s.enter(&s.calls, "read"); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if err := s.checkRemote("read", src, verbs.AccessRemoteRead); err != nil {
		return err
	}
	if err := s.checkLocal("read", dst, src.Len()); err != nil {
		return err
	}
	_, err := s.remoteOp(ctx, "read", src, dst.MR(), func() (channel.Handle, error) { return s.data.PostRead(src.addr(), dst.SGE()) })
	return err
}

// Write writes src into dst (same length, at most 2 GiB: a longer one
// fails with ErrLimit).
func (s *Session) Write(ctx context.Context, dst RemoteSlice, src LocalSlice) error {
	if err := s.enter(&s.calls, "write"); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if err := s.checkRemote("write", dst, verbs.AccessRemoteWrite); err != nil {
		return err
	}
	if err := s.checkLocal("write", src, dst.Len()); err != nil {
		return err
	}
	_, err := s.remoteOp(ctx, "write", dst, src.MR(), func() (channel.Handle, error) { return s.data.PostWrite(dst.addr(), src.SGE()) })
	return err
}

// WriteImm writes src into dst and gives the peer a Message with imm
// whose IsWrite is true (and no bytes: the data is where it was
// written). The notice takes a slot of the peer's ring, like a message,
// and follows the write on the same queue pair: the data is in place
// when the peer sees it. WriteImm returns when both are done; if ctx
// ends first, it returns ctx's error and the write, and its notice if it
// was posted, may still take place (the library reclaims their buffers
// and tokens when the device is done with them).
func (s *Session) WriteImm(ctx context.Context, dst RemoteSlice, imm uint32, src LocalSlice) error {
	const op = "write with immediate"
	if err := s.enter(&s.calls, op); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if err := s.checkRemote(op, dst, verbs.AccessRemoteWrite); err != nil {
		return err
	}
	if err := s.checkLocal(op, src, dst.Len()); err != nil {
		return err
	}
	note, err := s.mem.Alloc(dataHdr)
	if err != nil {
		return fmt.Errorf("session: %s: %w", op, err)
	}
	putDataHdr(note.Bytes(), dataWrite, 0, uint32(dst.Len()))
	setImm(note.Bytes(), imm, true)
	if cap(s.ops) < 2 {
		// One request in flight at most (QueueDepth 1): one after the
		// other.
		if _, err := s.remoteOp(ctx, op, dst, src.MR(), func() (channel.Handle, error) { return s.data.PostWrite(dst.addr(), src.SGE()) }); err != nil {
			note.Free()
			return err
		}
		_, err = s.sendSlot(ctx, op, note, note.All(), verbs.SGE{})
		return err
	}
	// Both requests at once: the write, then the notice (a write with
	// immediate data into the peer's ring), posted back to back on the
	// data queue pair without waiting in between. On one RC queue pair
	// the responder executes requests in the order they were posted,
	// and a receive completion (the notice's) is not given before the
	// data of the requests before it is placed in memory (InfiniBand
	// spec., the ordering rules of a reliable connection; soft0 keeps
	// them): the peer that sees the notice sees the bytes. One wait, for
	// the notice, whose completion also comes after the write's (send
	// completions of one queue pair are in order).
	held, err := s.holdLocal(op, src.MR())
	if err != nil {
		note.Free()
		return err
	}
	if err := s.acquireOps2(ctx, op); err != nil {
		unhold(held)
		note.Free()
		return err
	}
	r := dst.r
	r.inflight.Add(1)
	o := orphaned{op: true, r: r, held: held}
	if err := r.valid(); err != nil {
		s.giveBack(o)
		s.releaseOp()
		note.Free()
		return fmt.Errorf("session: %s: %w", op, err)
	}
	hw, err, roomErr := s.postRoom(ctx, s.data, func() (channel.Handle, error) { return s.data.PostWrite(dst.addr(), src.SGE()) })
	if roomErr != nil {
		s.giveBack(o)
		s.releaseOp()
		note.Free()
		return s.ctxErr(op, roomErr)
	}
	if err != nil {
		s.giveBack(o)
		s.releaseOp()
		note.Free()
		return s.fail(op, err)
	}
	_, nerr := s.postSlot(ctx, op, note, note.All(), verbs.SGE{})
	// The write completed before the notice did, if it did; if the
	// notice was not posted (ctx ended while it waited for a credit),
	// or its wait ended with ctx, the write may still be in flight.
	if err := hw.Wait(ctx); err != nil && !hw.Done() {
		s.goTask(func() { s.reap(hw, o) })
		if nerr != nil {
			return nerr
		}
		return s.ctxErr(op, err)
	}
	werr := hw.Err()
	hw.Release()
	s.giveBack(o)
	if werr != nil {
		return s.fail(op, werr)
	}
	return nerr
}

// holdLocal holds m (if it is a region, not the zero LocalMR) until
// the device is done with the request that reads or writes it (giveBack
// ends the hold): freed meanwhile, it is not handed out again before.
func (s *Session) holdLocal(op string, m LocalMR) (LocalMR, error) {
	if m.ar == nil {
		return LocalMR{}, nil
	}
	if !m.hold() {
		return LocalMR{}, fmt.Errorf("session: %s: %w: the local region was freed", op, ErrClosed)
	}
	return m, nil
}

// acquireOps2 takes two op tokens (a request and the notice that
// follows it). One caller at a time may hold one of two, so callers
// that each wait for a second never hold them all.
func (s *Session) acquireOps2(ctx context.Context, op string) error {
	select {
	case s.pairs <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("session: %s: %w", op, ctx.Err())
	case <-s.done:
		return s.fail(op, nil)
	}
	defer func() { <-s.pairs }()
	if err := s.acquireOp(ctx, op); err != nil {
		return err
	}
	if err := s.acquireOp(ctx, op); err != nil {
		s.releaseOp()
		return err
	}
	return nil
}

func (s *Session) checkAtomic(op string, dst RemoteSlice) error {
	if err := s.checkRemote(op, dst, verbs.AccessRemoteAtomic); err != nil {
		return err
	}
	if dst.n < 8 {
		return fmt.Errorf("session: %s: %w: %d bytes, an atomic operation needs 8", op, ErrOutOfBounds, dst.n)
	}
	if dst.n != 8 || dst.addr().Addr%8 != 0 {
		return fmt.Errorf("session: %s: %w: %d bytes at remote address %#x", op, ErrMisaligned, dst.n, dst.addr().Addr)
	}
	return nil
}

// CompareSwap swaps the 8-byte word dst for swap if it holds compare and
// returns what it held.
func (s *Session) CompareSwap(ctx context.Context, dst RemoteSlice, compare, swap uint64) (uint64, error) {
	if err := s.enter(&s.calls, "compare and swap"); err != nil {
		return 0, err
	}
	defer s.calls.RUnlock()
	if err := s.checkAtomic("compare and swap", dst); err != nil {
		return 0, err
	}
	return s.remoteOp(ctx, "compare and swap", dst, LocalMR{}, func() (channel.Handle, error) {
		return s.data.PostCompareSwap(dst.addr(), compare, swap)
	})
}

// FetchAdd adds add to the 8-byte word dst and returns what it held.
func (s *Session) FetchAdd(ctx context.Context, dst RemoteSlice, add uint64) (uint64, error) {
	if err := s.enter(&s.calls, "fetch and add"); err != nil {
		return 0, err
	}
	defer s.calls.RUnlock()
	if err := s.checkAtomic("fetch and add", dst); err != nil {
		return 0, err
	}
	return s.remoteOp(ctx, "fetch and add", dst, LocalMR{}, func() (channel.Handle, error) {
		return s.data.PostFetchAdd(dst.addr(), add)
	})
}

// RequestRemoteMR asks the peer's agent for n bytes of its memory with
// access (remote read, write, atomic), for lease (0: Config.Lease; a
// lease is at most a year: a longer one is a year). The
// memory is zeroed. It fails if the peer's caps refuse (ErrLimit).
func (s *Session) RequestRemoteMR(ctx context.Context, n int, access verbs.Access, lease time.Duration) (*RemoteMR, error) {
	if err := s.enter(&s.calls, "request remote region"); err != nil {
		return nil, err
	}
	defer s.calls.RUnlock()
	if n <= 0 {
		return nil, fmt.Errorf("session: request remote region: %w: %d bytes", ErrOutOfBounds, n)
	}
	lease = s.leaseOf(lease)
	r, err := s.call(ctx, "request remote region", ctrlMsg{typ: ctrlRequest, len: uint64(n), access: access, lease: lease})
	if err != nil {
		return nil, err
	}
	if r.typ != ctrlGrant || r.len != uint64(n) || r.access != access {
		// Not what was asked for: before, the caller got a region of
		// another size or access than it asked for, or for an answer
		// that was no grant, whatever region of the peer's its grant
		// id named (TestAdv2ForgedGrant).
		err := fmt.Errorf("%w: the peer answered a request for %d bytes with access %v with a message of type %d for %d bytes with access %v",
			ErrProtocol, n, access, r.typ, r.len, r.access)
		s.end(err)
		s.ctl.close()
		return nil, fmt.Errorf("session: request remote region: %w", err)
	}
	rm := s.claimRemote(r.grant)
	if rm == nil {
		return nil, fmt.Errorf("session: request remote region: %w", ErrLeaseExpired)
	}
	return rm, nil
}

// Grant is memory of this side granted to the peer (SendLocalMR).
type Grant struct {
	s  *Session
	g  *grantState
	mr LocalMR
}

// MR is the granted region.
func (g *Grant) MR() LocalMR { return g.mr }

// Revoke ends the grant before its lease: the peer stops using the
// region (its operations in flight finish first), then its window is
// closed. The region stays this side's. If ctx ends before the peer
// acknowledged, Revoke returns its error and the grant stays (the peer
// may still use the region): Revoke again, or wait for the lease.
func (g *Grant) Revoke(ctx context.Context) error {
	if g.s == nil {
		return fmt.Errorf("session: revoke: %w (a zero Grant)", ErrClosed)
	}
	if err := g.s.enter(&g.s.calls, "revoke"); err != nil {
		return err
	}
	defer g.s.calls.RUnlock()
	s := g.s
	a := &s.agent
	a.mu.Lock()
	live := a.grants[g.g.id] == g.g
	a.mu.Unlock()
	if !live {
		return nil
	}
	_, err := s.call(ctx, "revoke", ctrlMsg{typ: ctrlRevoke, grant: g.g.id})
	if err != nil && ctx.Err() != nil && s.Err() == nil {
		// The peer may not know (or not have stopped using the region
		// yet): the window stays, for a later Revoke or the lease.
		// Before, it was closed, and the peer's next access failed on
		// the device and ended the session (TestAdv2RevokeCancelled).
		return err
	}
	a.mu.Lock()
	if a.grants[g.g.id] == g.g {
		a.dropGrantLocked(g.g.id, g.g)
	}
	a.mu.Unlock()
	return err
}

// SendLocalMR grants the peer access to mr (at most what a window of
// the region may allow: remote read, write, atomic) for lease (0:
// Config.Lease; at most a year, as for RequestRemoteMR); the peer's
// ReceiveRemoteMR returns it. mr stays this
// side's: it must not be freed while granted (Revoke, or wait for the
// lease or a hand-back). If ctx ends before the peer's agent answered,
// the offer may have reached it: SendLocalMR then returns the Grant
// with the context's error, and the grant lasts until it is revoked or
// its lease ends.
func (s *Session) SendLocalMR(ctx context.Context, mr LocalMR, access verbs.Access, lease time.Duration) (*Grant, error) {
	if err := s.enter(&s.calls, "send local region"); err != nil {
		return nil, err
	}
	defer s.calls.RUnlock()
	if !mr.Valid() {
		return nil, fmt.Errorf("session: send local region: %w", ErrClosed)
	}
	if mr.MemoryRegion().PD() != s.pd {
		return nil, fmt.Errorf("session: send local region: %w: the region is of another session's allocator", ErrAccess)
	}
	if !grantable(access) {
		return nil, fmt.Errorf("session: send local region: %w: access %v (grant remote read, write or atomic)", ErrAccess, access)
	}
	return s.offer(ctx, "send local region", mr.Bytes(), mr, access, lease)
}

// offer grants mem (of mr, if valid) and offers it to the peer.
func (s *Session) offer(ctx context.Context, op string, mem []byte, mr LocalMR, access verbs.Access, lease time.Duration) (*Grant, error) {
	lease = s.leaseOf(lease)
	g, err := s.grantBytes(mem, mr, access, lease, false)
	if err != nil {
		return nil, fmt.Errorf("session: %s: %w", op, err)
	}
	_, err = s.call(ctx, op, ctrlMsg{typ: ctrlOffer, grant: g.id, addr: g.win.Addr(), len: uint64(g.n), rkey: g.win.RKey(), access: access, lease: lease})
	if err == nil || ctx.Err() != nil {
		// The peer's lease counts from when the offer reached it: before
		// its answer, so before now (if ctx ended first, the offer may
		// still be on its way: Revoke ends such a grant). The window
		// stays open for the lease and leaseGrace from now, not from
		// before the offer left, however long the offer took.
		s.agent.extendGrant(g, lease+leaseGrace)
	}
	if err != nil && ctx.Err() != nil && s.Err() == nil {
		// The offer may have reached the peer, which may use the
		// region: the grant stays, for the caller to revoke (or for
		// its lease to end).
		return &Grant{s: s, g: g, mr: mr}, err
	}
	if err != nil {
		a := &s.agent
		a.mu.Lock()
		if a.grants[g.id] == g {
			a.dropGrantLocked(g.id, g)
		}
		a.mu.Unlock()
		return nil, err
	}
	return &Grant{s: s, g: g, mr: mr}, nil
}

// SendRegion grants the peer access to n bytes at off of mr, memory the
// caller registered itself (on the session's device or another: a table
// that every session of a server shares, for example), as SendLocalMR
// does for regions of the session's allocator. mr's memory must stay
// registered while the grant lasts. A hand-back of such a grant ends it
// (ReceiveLocalMR returns nothing for it).
func (s *Session) SendRegion(ctx context.Context, mr *verbs.MemoryRegion, off, n int, access verbs.Access, lease time.Duration) (*Grant, error) {
	if err := s.enter(&s.calls, "send region"); err != nil {
		return nil, err
	}
	defer s.calls.RUnlock()
	const op = "send region"
	if mr == nil || mr.Bytes() == nil {
		return nil, fmt.Errorf("session: %s: %w: no memory (a dma-buf or closed region?)", op, ErrAccess)
	}
	if off < 0 || n <= 0 || off > len(mr.Bytes()) || n > len(mr.Bytes())-off { // off+n may overflow
		return nil, fmt.Errorf("session: %s: %w: %d bytes at %d of a region of %d", op, ErrOutOfBounds, n, off, len(mr.Bytes()))
	}
	if !grantable(access) {
		return nil, fmt.Errorf("session: %s: %w: access %v (grant remote read, write or atomic)", op, ErrAccess, access)
	}
	return s.offer(ctx, op, mr.Bytes()[off:off+n], LocalMR{}, access, lease)
}

// ReceiveRemoteMR returns the next region the peer offered
// (SendLocalMR).
func (s *Session) ReceiveRemoteMR(ctx context.Context) (*RemoteMR, error) {
	if err := s.enter(&s.calls, "receive remote region"); err != nil {
		return nil, err
	}
	defer s.calls.RUnlock()
	return nextQueued(ctx, s, "receive remote region", &s.agent.offers)
}

// nextQueued takes the first of the agent's queue q (offers or
// returns), waiting for one until ctx or the session ends.
func nextQueued[T any](ctx context.Context, s *Session, op string, q *[]T) (T, error) {
	a := &s.agent
	for {
		a.mu.Lock()
		if len(*q) > 0 {
			v := (*q)[0]
			*q = (*q)[1:]
			a.mu.Unlock()
			return v, nil
		}
		ch := a.changed
		a.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			var zero T
			return zero, fmt.Errorf("session: %s: %w", op, ctx.Err())
		case <-s.done:
			var zero T
			return zero, s.fail(op, nil)
		}
	}
}

// SendRemoteMR hands a region the peer granted back to it: this side's
// operations on it finish, then the peer's ReceiveLocalMR returns it (to
// read what was written, for example). If ctx ends first, SendRemoteMR
// returns its error, and the region is handed back all the same.
func (s *Session) SendRemoteMR(ctx context.Context, r *RemoteMR) error {
	if err := s.enter(&s.calls, "send remote region"); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if r == nil || r.s != s {
		return fmt.Errorf("session: send remote region: %w: not a region of this session's peer", ErrAccess)
	}
	return r.giveUp(ctx, ctrlHandBack, "send remote region")
}

// ReceiveLocalMR returns the next region of this side that the peer
// handed back (SendRemoteMR): one it was offered, or one it requested
// (then the caller owns it and must Free it; until it is taken here, it
// counts against Config.MaxGranted).
func (s *Session) ReceiveLocalMR(ctx context.Context) (LocalMR, error) {
	if err := s.enter(&s.calls, "receive local region"); err != nil {
		return LocalMR{}, err
	}
	defer s.calls.RUnlock()
	r, err := nextQueued(ctx, s, "receive local region", &s.agent.returns)
	if err != nil {
		return LocalMR{}, err
	}
	if r.n > 0 {
		a := &s.agent
		a.mu.Lock()
		a.granted -= r.n
		a.mu.Unlock()
	}
	return r.mr, nil
}
