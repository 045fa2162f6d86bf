package session

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// Message is a received message. Its payload lies in memory of the
// library (a slot of the receive ring, or for a large message the region
// it was read into), valid until Release, which gives it back (a ring
// slot returns a credit to the sender once the slots before it are back
// too), or until the session's Close, which releases every message (its
// bytes must not be used after: as for a region, detection is no license
// to race Close). A Message is a small value; Release is idempotent, and
// methods of a released Message return zero values (Imm and IsWrite
// excepted: they stay as received).
type Message struct {
	s     *Session
	slot  int32 // receive buffer, or -1
	gen   uint32
	mr    LocalMR // the region of a rendezvous, else zero
	n     int
	imm   uint32
	flags uint8
}

const (
	msgHasImm = 1 << iota
	msgWrite
)

// Len is the payload's length.
func (m Message) Len() int {
	if !m.valid() {
		return 0
	}
	return m.n
}

// Bytes is the payload, valid until Release.
func (m Message) Bytes() []byte {
	if !m.valid() {
		return nil
	}
	if m.slot >= 0 {
		off := int(m.slot)*m.s.slot + payOff
		return m.s.ring.Bytes()[off : off+m.n]
	}
	if m.mr.Valid() {
		return m.mr.Bytes()[:m.n]
	}
	return nil
}

// Imm returns the immediate data of a SendImm or a WriteImm.
func (m Message) Imm() (imm uint32, ok bool) { return m.imm, m.flags&msgHasImm != 0 }

// IsWrite reports whether the message is the notice of an RDMA write
// with immediate (WriteImm): its data went to the region the peer wrote,
// and Bytes is empty.
func (m Message) IsWrite() bool { return m.flags&msgWrite != 0 }

func (m Message) valid() bool {
	if m.s == nil {
		return false
	}
	if m.slot >= 0 {
		m.s.rmu.Lock()
		ok := m.s.rgen[m.slot] == m.gen
		m.s.rmu.Unlock()
		return ok
	}
	return m.mr.Valid() || m.flags&msgWrite != 0
}

// Release gives the message's buffer back.
func (m Message) Release() {
	if m.s == nil || m.s.enter(&m.s.calls, "release") != nil {
		return
	}
	defer m.s.calls.RUnlock()
	if m.slot >= 0 {
		m.s.freeSlot(int(m.slot), m.gen)
		return
	}
	if m.mr.Valid() {
		m.mr.Free()
	}
}

// Send sends data as one message (copied before it is posted: data may
// be reused when Send returns). A message larger than the peer's
// receive buffers goes by rendezvous: the peer reads it from a window
// of this side's memory, and Send returns when it has. If ctx ends
// first, Send returns its error and the message may still be delivered
// (the device has it); the session goes on. If the peer has no memory
// for a rendezvous message (its allocator's MaxMemory), it drops it and
// Send fails with an error wrapping ErrLimit; the session goes on.
func (s *Session) Send(ctx context.Context, data []byte) error {
	return s.sendBytes(ctx, data, 0, false)
}

// SendImm is Send with immediate data, which the peer's Message.Imm
// returns.
func (s *Session) SendImm(ctx context.Context, imm uint32, data []byte) error {
	return s.sendBytes(ctx, data, imm, true)
}

func (s *Session) sendBytes(ctx context.Context, data []byte, imm uint32, hasImm bool) error {
	if err := s.enter(&s.calls, "send"); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if err := s.live("send"); err != nil {
		return err
	}
	if len(data) > s.peer.MaxMessage {
		return fmt.Errorf("session: send: %w: a message of %d bytes, the peer takes at most %d", ErrLimit, len(data), s.peer.MaxMessage)
	}
	if len(data) <= s.peer.SlotSize-payOff {
		// The header at hdrAt, the payload at payOff, as in the slot.
		buf, err := s.mem.Alloc(payOff + len(data))
		if err != nil {
			return fmt.Errorf("session: send: %w", err)
		}
		copy(buf.Bytes()[payOff:], data)
		return s.sendEager(ctx, buf, hdrAt, len(data), LocalSlice{}, imm, hasImm)
	}
	buf, err := s.mem.Alloc(len(data))
	if err != nil {
		return fmt.Errorf("session: send: %w", err)
	}
	copy(buf.Bytes(), data)
	return s.sendRendezvous(ctx, buf.All(), buf, imm, hasImm)
}

// SendSlice sends the bytes of a region of the session's allocator
// without copying them: they must not change until SendSlice returns.
// If ctx ends first, the message may still be sent, or read by the peer
// (a rendezvous): the bytes must then not change, but the region may be
// freed: the library holds its memory back from the allocator until the
// device (or the peer's read) is done with it, or the session ends.
func (s *Session) SendSlice(ctx context.Context, data LocalSlice, imm uint32, hasImm bool) error {
	if err := s.enter(&s.calls, "send"); err != nil {
		return err
	}
	defer s.calls.RUnlock()
	if err := s.checkSlice(data); err != nil {
		return err
	}
	if data.Len() <= s.peer.SlotSize-payOff {
		hdr, err := s.mem.Alloc(dataHdr)
		if err != nil {
			return fmt.Errorf("session: send: %w", err)
		}
		return s.sendEager(ctx, hdr, 0, 0, data, imm, hasImm)
	}
	return s.sendRendezvous(ctx, data, LocalMR{}, imm, hasImm)
}

// PostSendSlice posts the bytes of a region of the session's allocator
// as one message, without copying them, and returns without waiting for
// the message's delivery: Wait for it (or Release it) later, so that one
// goroutine can keep many messages in flight, as a Channel's Post methods
// do. The bytes must not change until Wait returns. It may wait (until
// ctx ends) for a credit of the peer's receive buffers and for room in
// the session's queue (Config.QueueDepth posted messages and other
// requests at most). A message larger than the peer's receive buffers
// goes by rendezvous, synchronously: PostSendSlice returns once the peer
// has read it, with a Pending that is done (as is the zero Pending).
// Messages arrive in the order they were posted, with those of Send.
func (s *Session) PostSendSlice(ctx context.Context, data LocalSlice, imm uint32, hasImm bool) (Pending, error) {
	if err := s.enter(&s.calls, "send"); err != nil {
		return Pending{}, err
	}
	defer s.calls.RUnlock()
	if err := s.checkSlice(data); err != nil {
		return Pending{}, err
	}
	if data.Len() > s.peer.SlotSize-payOff {
		return Pending{}, s.sendRendezvous(ctx, data, LocalMR{}, imm, hasImm)
	}
	buf, err := s.mem.Alloc(dataHdr)
	if err != nil {
		return Pending{}, fmt.Errorf("session: send: %w", err)
	}
	h, held, err := s.postEager(ctx, buf, 0, 0, data, imm, hasImm)
	if err != nil {
		return Pending{}, err
	}
	// A record is free: there are no more records taken than op tokens
	// (a record goes back when its Pending is claimed, its token when the
	// device is done).
	r := <-s.pend
	if r.gen++; r.gen == 0 {
		r.gen = 1
	}
	r.h, r.buf, r.held = h, buf, held
	r.live.Store(r.gen)
	return Pending{r: r, gen: r.gen}, nil
}

// Pending is a message posted by PostSendSlice, on its way. Wait for it
// or Release it, once: a Pending used again (or a copy of it) reports an
// error wrapping ErrClosed. A Pending is a small value; the zero Pending
// is done.
type Pending struct {
	r   *pendSend
	gen uint32
}

// pendSend is the session's record of a posted message; the session
// keeps QueueDepth of them, so posting allocates nothing.
type pendSend struct {
	s    *Session
	live atomic.Uint32 // gen while its Pending is unclaimed, else 0
	gen  uint32
	h    channel.Handle
	buf  LocalMR // the header, freed when the device is done
	held LocalMR // the payload's region, held until then
}

// claim takes the record's request from p (once) and gives the record
// back.
func (p Pending) claim() (s *Session, h channel.Handle, o orphaned, ok bool) {
	r := p.r
	if r == nil || !r.live.CompareAndSwap(p.gen, 0) {
		return nil, channel.Handle{}, orphaned{}, false
	}
	s, h, o = r.s, r.h, orphaned{buf: r.buf, op: true, held: r.held}
	r.h, r.buf, r.held = channel.Handle{}, LocalMR{}, LocalMR{}
	s.pend <- r
	return s, h, o, true
}

// Wait waits until the message is delivered (the peer's device has it).
// If ctx ends first, Wait returns its error, the message may still be
// delivered: its bytes must not change, but the region may be freed (the
// library holds its memory until the device is done with it, as for a
// cancelled SendSlice). An error of the session (the peer lost, the
// session closed) ends it as for Send.
func (p Pending) Wait(ctx context.Context) error {
	if p.r == nil {
		return nil
	}
	if p.r.live.Load() != p.gen {
		// Used already: that says so even once the session has ended.
		return errPendingUsed
	}
	if err := p.r.s.enter(&p.r.s.calls, "send"); err != nil {
		p.Release()
		return err
	}
	defer p.r.s.calls.RUnlock()
	s, h, o, ok := p.claim()
	if !ok {
		return errPendingUsed
	}
	return s.awaitFor(ctx, "send", h, o)
}

var errPendingUsed = fmt.Errorf("session: send: %w: the pending message was waited for or released already", ErrClosed)

// Release gives up the Pending without waiting: the bytes must not
// change until the message is delivered, but the region may be freed
// (as after a cancelled Wait). Releasing a Pending again, or after Wait,
// does nothing.
func (p Pending) Release() {
	s, h, o, ok := p.claim()
	if !ok {
		return
	}
	if h.Done() {
		h.Release()
		s.giveBack(o)
		return
	}
	s.goTask(func() { s.reap(h, o) })
}

// sendEager sends the header in buf (n bytes: the header, maybe the
// payload) and the payload in extra (if not empty) into the peer's next
// ring slot. buf is freed when the device is done with it.
func (s *Session) sendEager(ctx context.Context, buf LocalMR, at, n int, extra LocalSlice, imm uint32, hasImm bool) error {
	h, held, err := s.postEager(ctx, buf, at, n, extra, imm, hasImm)
	if err != nil {
		return err
	}
	return s.awaitFor(ctx, "send", h, orphaned{buf: buf, op: true, held: held})
}

// postEager is sendEager without the wait: it returns the write's
// handle, which owns an op token, buf and a hold on extra's region (held)
// from then on (on an error, all are given back). The header goes in buf
// at at, followed there by n bytes of payload or else by extra's.
func (s *Session) postEager(ctx context.Context, buf LocalMR, at, n int, extra LocalSlice, imm uint32, hasImm bool) (h channel.Handle, held LocalMR, err error) {
	hs, _ := buf.Slice(at, dataHdr+n)
	putDataHdr(hs.Bytes(), dataEager, 0, uint32(n+extra.Len()))
	setImm(hs.Bytes(), imm, hasImm)
	var payload verbs.SGE
	if extra.Len() > 0 {
		// Held until the device is done with it: freed meanwhile (after
		// a cancelled wait), it is not handed out again before.
		if !extra.MR().hold() {
			buf.Free()
			return channel.Handle{}, LocalMR{}, fmt.Errorf("session: send: %w: the region was freed", ErrClosed)
		}
		held, payload = extra.MR(), extra.SGE()
	}
	if err := s.acquireOp(ctx, "send"); err != nil {
		buf.Free()
		unhold(held)
		return channel.Handle{}, LocalMR{}, err
	}
	if h, err = s.postSlotH(ctx, "send", buf, hs, payload); err != nil {
		unhold(held)
		return channel.Handle{}, LocalMR{}, err
	}
	return h, held, nil
}

// unhold ends the hold on m, if m is a region (not the zero LocalMR).
func unhold(m LocalMR) {
	if m.ar != nil {
		m.unhold()
	}
}

// checkSlice checks a slice to send: the session is live, its region
// one of the session's allocator, not freed, its length within the
// peer's MaxMessage.
func (s *Session) checkSlice(data LocalSlice) error {
	if err := s.live("send"); err != nil {
		return err
	}
	mr := data.MR().MemoryRegion()
	if mr == nil {
		return fmt.Errorf("session: send: %w: the region was freed", ErrClosed)
	}
	if mr.PD() != s.pd {
		// Its key is not this session's: the send failed on the device
		// (a local protection error) and ended the session
		// (TestAdv2SendSliceOtherAllocator).
		return fmt.Errorf("session: send: %w: the region is of another session's allocator", ErrAccess)
	}
	if n := data.Len(); n > s.peer.MaxMessage {
		return fmt.Errorf("session: send: %w: a message of %d bytes, the peer takes at most %d", ErrLimit, n, s.peer.MaxMessage)
	}
	return nil
}

// sendSlot writes a message, its header (hdr, in buf) and payload (if
// its Length is not 0), into the peer's next ring slot with one RDMA
// write with immediate data naming the slot: it takes a credit (waiting
// for one), then, in credit order, fills in the piggybacked credits and
// posts. buf is freed when the device is done with it.
//
// (Sending large payloads as a plain write before a header-only write
// with immediate data was tried: soft0's shared memory then copies the
// payload once instead of twice, but holds every later request until
// the peer acknowledges the write, which serialises the messages:
// 0.5 GB/s against 3 GB/s.)
func (s *Session) sendSlot(ctx context.Context, op string, buf LocalMR, hdr LocalSlice, payload verbs.SGE) (posted bool, err error) {
	if err := s.acquireOp(ctx, op); err != nil {
		buf.Free()
		return false, err
	}
	return s.postSlot(ctx, op, buf, hdr, payload)
}

// postSlot is sendSlot with the op token taken: it gives it back with
// buf.
func (s *Session) postSlot(ctx context.Context, op string, buf LocalMR, hdr LocalSlice, payload verbs.SGE) (posted bool, err error) {
	h, err := s.postSlotH(ctx, op, buf, hdr, payload)
	if err != nil {
		return false, err
	}
	return true, s.await(ctx, op, h, buf)
}

// postSlotH is postSlot without the wait: it returns the write's handle,
// which owns the op token and buf from then on (on an error, both are
// given back).
func (s *Session) postSlotH(ctx context.Context, op string, buf LocalMR, hdr LocalSlice, payload verbs.SGE) (h channel.Handle, err error) {
	for {
		if err := s.dflow.wait(ctx, s.done); err != nil {
			s.releaseOp()
			buf.Free()
			return channel.Handle{}, s.ctxErr(op, err)
		}
		s.smu.Lock()
		if s.dflow.tryTake() {
			break
		}
		s.smu.Unlock() // another sender took it
	}
	k := s.dflow.sent.Load() - 1
	slot := k % s.dflow.r
	rep := s.drflow.reposted.Load()
	binary.LittleEndian.PutUint32(hdr.Bytes()[4:], rep)
	dst := verbs.RemoteAddr{Addr: s.peer.Ring.Addr + uint64(slot)*uint64(s.peer.SlotSize) + hdrAt, RKey: s.peer.Ring.RKey}
	sgl := [2]verbs.SGE{hdr.SGE(), payload}
	nsge := 1
	if payload.Length > 0 {
		nsge = 2
	}
	h, err, werr := s.postRoom(ctx, s.data, func() (channel.Handle, error) { return s.data.PostWriteImm(dst, slot, sgl[:nsge]...) })
	if werr != nil {
		// The credit taken goes back (only this function takes
		// credits of dflow, with smu held): the next message takes
		// this slot.
		s.dflow.sent.Add(^uint32(0))
		s.smu.Unlock()
		s.releaseOp()
		buf.Free()
		return channel.Handle{}, s.ctxErr(op, werr)
	}
	s.smu.Unlock()
	if err != nil {
		s.releaseOp()
		buf.Free()
		return channel.Handle{}, s.fail(op, err)
	}
	s.drflow.told(rep)
	return h, nil
}

// queueFull reports whether a post failed for want of room in the send
// queue (or of the channel's slots): waitRoom, then post again.
func queueFull(err error) bool { return err != nil && errors.Is(err, verbs.ErrQueueFull) }

// postRoom calls post, a post to c, until it does not fail for want of
// room in c's send queue, waiting for room between tries (waitRoom), and
// returns its last result; if the wait ended first (ctx or the session),
// werr says why, and nothing was posted.
func (s *Session) postRoom(ctx context.Context, c *channel.Channel, post func() (channel.Handle, error)) (h channel.Handle, err, werr error) {
	h, err = post()
	for w := 0; queueFull(err); {
		if werr = s.waitRoom(ctx, c, &w); werr != nil {
			return channel.Handle{}, err, werr
		}
		h, err = post()
	}
	return h, err, nil
}

// waitRoom waits a little for room in the send queue of c, a queue pair
// of the session (w counts the waits of one post), or returns ctx's
// error, or errSessionEnded. On the data queue pair the op tokens keep
// the session's requests within QueueDepth, the queue's size, but the
// credit writes of releases (writeCredits: unsignaled inline writes) take
// entries of it too, each until a later signalled request completes; a
// post that found the queue full then failed (verbs.ErrQueueFull), and a
// message's, after it had taken its credit, left a hole in the ring's
// sequence that the peer took for a protocol violation: the session ended
// (TestAdvBothWaysPosted, TestAdvCloseDuringTraffic). Completions retire
// entries: it polls for them, yields, then sleeps for intervals that grow
// to a millisecond.
func (s *Session) waitRoom(ctx context.Context, c *channel.Channel, w *int) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-s.done:
		return errSessionEnded
	default:
	}
	_ = c.Progress()
	if *w++; *w <= 64 {
		runtime.Gosched()
		return nil
	}
	t := time.NewTimer(min(time.Duration(*w-64)*10*time.Microsecond, time.Millisecond))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-s.done:
		return errSessionEnded
	case <-t.C:
		return nil
	}
}

func setImm(b []byte, imm uint32, hasImm bool) {
	if hasImm {
		b[1] |= hdrHasImm
		binary.LittleEndian.PutUint32(b[12:], imm)
	}
}

// await waits for h, a request of the data queue pair (holding an op
// token); if ctx ends first, the request is left to a reaper that frees
// buf and the token when the device is done with it.
func (s *Session) await(ctx context.Context, op string, h channel.Handle, buf LocalMR) error {
	return s.awaitFor(ctx, op, h, orphaned{buf: buf, op: true})
}

// orphaned is what to give back when the device is done with a request:
// a buffer, an op token, an operation in flight on a remote region.
// (A value, not a closure: nothing is allocated unless a call is
// cancelled.)
type orphaned struct {
	buf  LocalMR
	op   bool
	r    *RemoteMR
	held LocalMR // a region of the application's the request reads (hold)
}

func (s *Session) giveBack(o orphaned) {
	unhold(o.held)
	if o.buf.Valid() {
		o.buf.Free()
	}
	if o.r != nil {
		o.r.inflight.Add(-1)
	}
	if o.op {
		s.releaseOp()
	}
}

// awaitFor waits for h; then, or when the device is done with it if ctx
// ends first, o is given back.
func (s *Session) awaitFor(ctx context.Context, op string, h channel.Handle, o orphaned) error {
	if err := h.Wait(ctx); err != nil && !h.Done() {
		s.goTask(func() { s.reap(h, o) })
		return s.ctxErr(op, err)
	}
	err := h.Err()
	h.Release()
	s.giveBack(o)
	if err != nil {
		return s.fail(op, err)
	}
	return nil
}

// reap waits for a request a cancelled call left in flight (or for the
// session's end, which flushes it), then gives o back.
func (s *Session) reap(h channel.Handle, o orphaned) {
	h.Wait(s.bg)
	h.Release()
	s.giveBack(o)
}

// ctxErr is the error of a call whose wait ended with err: the session's
// end if it ended, else err (the context's).
func (s *Session) ctxErr(op string, err error) error {
	if errors.Is(err, errSessionEnded) || s.Err() != nil {
		return s.fail(op, nil)
	}
	return fmt.Errorf("session: %s: %w", op, err)
}

// sendRendezvous sends data (in owned, freed when done, if valid) by
// rendezvous: a window of it the peer may read, announced in the data
// stream; it waits for the peer's agent to say it read it.
func (s *Session) sendRendezvous(ctx context.Context, data LocalSlice, owned LocalMR, imm uint32, hasImm bool) error {
	win, err := s.pd.Register(data.Bytes(), verbs.AccessRemoteRead)
	if err != nil {
		if owned.Valid() {
			owned.Free()
		}
		return s.fail("send", err)
	}
	id := s.ids.Add(1)
	var held LocalMR
	if !owned.Valid() {
		// The application's region: held until the peer read it (or the
		// session ends), even if freed after a cancelled Send.
		if !data.MR().hold() {
			win.Close()
			return fmt.Errorf("session: send: %w: the region was freed", ErrClosed)
		}
		held = data.MR()
	}
	w := s.agent.expectFin(id, win, owned, held)
	hdr, err := s.mem.Alloc(rtsHdr)
	if err != nil {
		s.agent.dropFin(id)
		return fmt.Errorf("session: send: %w", err)
	}
	putRTS(hdr.Bytes(), 0, uint32(data.Len()), win.Addr(), win.RKey(), id)
	setImm(hdr.Bytes(), imm, hasImm)
	if posted, err := s.sendSlot(ctx, "send", hdr, hdr.All(), verbs.SGE{}); err != nil {
		if !posted {
			s.agent.dropFin(id)
		}
		return err // the fin of one posted (or the session's end) frees the window
	}
	return s.awaitFin(ctx, w)
}

// awaitFin waits for the peer's fin of a rendezvous (w), until the
// session ends or ctx does. The session's end closes w.done too (the
// window is freed): only w.read says the peer read the message.
func (s *Session) awaitFin(ctx context.Context, w *finWait) error {
	select {
	case <-w.done:
		if w.read {
			return nil
		}
		if w.refused != nil {
			// The session goes on: only this message is lost.
			return fmt.Errorf("session: send: the peer dropped the message, it had no memory for it: %w", w.refused)
		}
		return s.fail("send", nil)
	case <-ctx.Done():
		return fmt.Errorf("session: send: %w", ctx.Err())
	}
}

// pendingRead is a rendezvous read that a cancelled Receive left in
// flight; the next Receive resumes it.
type pendingRead struct {
	src    verbs.RemoteAddr
	h      channel.Handle
	posted bool
	mr     LocalMR
	id     uint64
	msg    Message
}

// Receive returns the next message. Messages arrive in the order the
// peer sent them; concurrent Receives take turns. If ctx ends first,
// Receive returns its error and nothing is lost: the next Receive gets
// the message. A rendezvous message this side has no memory for (the
// allocator's MaxMemory) is dropped: Receive fails with an error wrapping
// ErrLimit (or the allocator's error), the sender's Send fails too, and
// the next Receive gets the next message.
func (s *Session) Receive(ctx context.Context) (Message, error) {
	if err := s.enter(&s.rcalls, "receive"); err != nil {
		return Message{}, err
	}
	defer s.rcalls.RUnlock()
	if err := s.takeTurn(ctx); err != nil {
		return Message{}, err
	}
	defer func() { s.turn <- struct{}{} }()
	if m := s.held; m != nil {
		s.held = nil
		return *m, nil
	}
	return s.receive(ctx)
}

// ReceiveInto copies the next message into dst and releases its buffer.
// A dst too small is an error (io.ErrShortBuffer, wrapped, saying the
// size) and the message stays for the next Receive.
func (s *Session) ReceiveInto(ctx context.Context, dst []byte) (n int, imm uint32, hasImm bool, err error) {
	if err := s.enter(&s.rcalls, "receive"); err != nil {
		return 0, 0, false, err
	}
	defer s.rcalls.RUnlock()
	if err := s.takeTurn(ctx); err != nil {
		return 0, 0, false, err
	}
	defer func() { s.turn <- struct{}{} }()
	var m Message
	if s.held != nil {
		m, s.held = *s.held, nil
	} else if m, err = s.receive(ctx); err != nil {
		return 0, 0, false, err
	}
	if m.Len() > len(dst) {
		s.held = &m
		return 0, 0, false, fmt.Errorf("session: receive: %w: a message of %d bytes into %d", errShortBuffer, m.Len(), len(dst))
	}
	n = copy(dst, m.Bytes())
	imm, hasImm = m.Imm()
	m.Release()
	return n, imm, hasImm, nil
}

// takeTurn waits for the receivers' turn (give it back to s.turn), until
// ctx or the session ends.
func (s *Session) takeTurn(ctx context.Context) error {
	select {
	case <-s.turn: // free: one channel operation, not a select of three
		return nil
	default:
	}
	select {
	case <-s.turn:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("session: receive: %w", ctx.Err())
	case <-s.done:
		return s.fail("receive", nil)
	}
}

// receive takes the next message (turn held): the completion of the
// next receive (a write with immediate data into the next ring slot),
// whose receive is posted again at once (it has no buffer: the data is
// in the ring).
func (s *Session) receive(ctx context.Context) (Message, error) {
	if p := s.pending; p != nil {
		return s.finishRead(ctx, p)
	}
	s.rmu.Lock()
	if len(s.fifo) == 0 {
		// Every receive taken and none posted again: the queue pair
		// broke, and the session is ending.
		s.rmu.Unlock()
		select {
		case <-s.done:
		case <-ctx.Done():
			return Message{}, s.ctxErr("receive", ctx.Err())
		}
		return Message{}, s.fail("receive", nil)
	}
	idx := s.fifo[0]
	h := s.rh[idx]
	s.rmu.Unlock()
	if err := h.Wait(ctx); err != nil && !h.Done() {
		if ctx.Err() != nil {
			// ctx's error even if the session ended meanwhile: a
			// message the peer sent before it closed may still
			// complete this receive, and is the next Receive's.
			// Before, such a Receive reported the session's end
			// (TestReceiveDeadlineRacesPeerClose), and a caller that
			// took it for the last word lost the message.
			return Message{}, fmt.Errorf("session: receive: %w", err)
		}
		return Message{}, s.ctxErr("receive", err)
	}
	err := h.Err()
	rc := h.Received()
	h.Release()
	n := s.drflow.consumed.Load()
	slot := n % s.drflow.r
	ok := rc.Write && rc.HasImm && rc.Imm == slot && rc.Len >= dataHdr && rc.Len <= s.slot-hdrAt
	// One critical section: the receive leaves the queue and is posted
	// again; a message's slot is busy until it is released.
	s.rmu.Lock()
	s.fifo = s.fifo[1:]
	// A write into a slot whose message is still held: the peer sent
	// beyond its credits. Before, the message came out as a second
	// Message of the slot, of the same generation as the held one, whose
	// bytes the write had changed (TestAdv2RingOverrun).
	overrun := ok && s.busy[slot]
	if err == nil {
		// A message that arrived is the application's even if the
		// queue pair broke since (the peer sent it, then closed: the
		// next credit write failed), so that posting its receive again
		// fails: the session is ending (watch), and the receives after
		// it report the end once the messages that arrived are taken.
		_ = s.postRecv(int(idx))
		if ok {
			s.busy[slot] = true
		}
	}
	gen := s.rgen[slot]
	s.rmu.Unlock()
	if err != nil {
		return Message{}, s.fail("receive", err)
	}
	if !ok {
		return Message{}, s.protocol(fmt.Errorf("%w: message %d: a write of %d bytes with immediate %d (%v), for ring slot %d of %d bytes", ErrProtocol, n, rc.Len, rc.Imm, rc.HasImm, slot, s.slot))
	}
	if overrun {
		return Message{}, s.protocol(fmt.Errorf("%w: message %d went to ring slot %d, whose message is not released: the peer sent beyond its credits", ErrProtocol, n, slot))
	}
	s.drflow.consumed.Add(1)
	b := s.ring.Bytes()[int(slot)*s.slot+hdrAt : int(slot+1)*s.slot]
	s.dflow.learn(binary.LittleEndian.Uint32(b[4:]))
	m := Message{s: s, slot: int32(slot), gen: gen}
	if b[1]&hdrHasImm != 0 {
		m.imm, m.flags = binary.LittleEndian.Uint32(b[12:]), msgHasImm
	}
	ln := int(binary.LittleEndian.Uint32(b[8:]))
	switch b[0] {
	case dataEager:
		if ln != rc.Len-dataHdr {
			return Message{}, s.protocol(fmt.Errorf("%w: a message of %d bytes says %d", ErrProtocol, rc.Len-dataHdr, ln))
		}
		m.n = ln
		return m, nil
	case dataWrite:
		// The notice of a WriteImm: its data went to the peer's target.
		s.freeSlot(int(slot), gen)
		m.slot = -1
		m.flags |= msgWrite
		return m, nil
	case dataRTS:
		if rc.Len != rtsHdr {
			return Message{}, s.protocol(fmt.Errorf("%w: a rendezvous of %d bytes", ErrProtocol, rc.Len))
		}
		if ln > s.cfg.MaxMessage {
			return Message{}, s.protocol(fmt.Errorf("%w: a message of %d bytes (at most %d)", ErrLimit, ln, s.cfg.MaxMessage))
		}
		src := verbs.RemoteAddr{Addr: binary.LittleEndian.Uint64(b[16:]), RKey: binary.LittleEndian.Uint32(b[24:])}
		id := binary.LittleEndian.Uint64(b[32:])
		s.freeSlot(int(slot), gen)
		m.slot = -1
		mr, err := s.mem.Alloc(max(ln, 1))
		if err != nil {
			// No memory for it here: the message is dropped, the
			// sender told (a fin with an error: its Send fails), and
			// the session goes on with the next.
			s.sendAsyncCtrl(ctrlMsg{typ: ctrlFin, id: id, code: memErrCode(err),
				text: fmt.Sprintf("the receiver had no memory for a message of %d bytes: %v", ln, err)})
			return Message{}, fmt.Errorf("session: receive: a message of %d bytes was dropped, this side has no memory for it (the sender's Send fails): %w", ln, err)
		}
		p := &pendingRead{src: src, mr: mr, id: id, msg: m}
		p.msg.mr, p.msg.n = mr, ln
		return s.finishRead(ctx, p)
	}
	return Message{}, s.protocol(fmt.Errorf("%w: message kind %d", ErrProtocol, b[0]))
}

// finishRead waits for a rendezvous read, tells the sender, and returns
// the message (turn held). The read takes no op token: the data queue
// pair has a send request more than the tokens for it (dataOptions),
// and one read at most is in flight (s.pending).
func (s *Session) finishRead(ctx context.Context, p *pendingRead) (Message, error) {
	if p.msg.n > 0 {
		if !p.posted {
			sl, _ := p.mr.Slice(0, p.msg.n)
			h, err, werr := s.postRoom(ctx, s.data, func() (channel.Handle, error) { return s.data.PostRead(p.src, sl.SGE()) })
			if werr != nil {
				s.pending = p // not posted: the next Receive posts it
				return Message{}, s.ctxErr("receive", werr)
			}
			if err != nil {
				s.pending = nil
				p.mr.Free()
				return Message{}, s.fail("receive", err)
			}
			p.h, p.posted = h, true
		}
		if err := p.h.Wait(ctx); err != nil && !p.h.Done() {
			s.pending = p
			return Message{}, s.ctxErr("receive", err)
		}
		s.pending = nil
		err := p.h.Err()
		p.h.Release()
		if err != nil {
			p.mr.Free()
			return Message{}, s.fail("receive", err)
		}
	}
	s.pending = nil
	s.sendAsyncCtrl(ctrlMsg{typ: ctrlFin, id: p.id})
	return p.msg, nil
}

// protocol ends the session: the peer broke the protocol.
func (s *Session) protocol(err error) error {
	s.end(err)
	s.ctl.close()
	return fmt.Errorf("session: receive: %w", err)
}

// postRecv posts receive idx (rmu held, or before the session runs): it
// has no buffer, only the completion of the peer's next write with
// immediate data into the ring matters.
func (s *Session) postRecv(idx int) error {
	h, err := s.data.PostReceive()
	if err != nil {
		return err
	}
	s.rh[idx] = h
	s.fifo = append(s.fifo, int32(idx))
	return nil
}

// freeSlot gives ring slot back if its generation is gen (a message
// released twice, even at once, is freed once). Slots return to the
// sender in order: the credit count (reposted) moves over every slot
// given back, up to the first still held.
func (s *Session) freeSlot(slot int, gen uint32) {
	s.rmu.Lock()
	if s.rgen[slot] != gen || !s.busy[slot] {
		s.rmu.Unlock()
		return
	}
	s.busy[slot] = false
	if s.rgen[slot]++; s.rgen[slot] == 0 { // 0 is never a message's
		s.rgen[slot] = 1
	}
	r := s.drflow.r
	moved := false
	for consumed := s.drflow.consumed.Load(); s.freed != consumed && !s.busy[s.freed%r]; s.freed++ {
		moved = true
	}
	if moved {
		s.drflow.reposted.Store(s.freed)
	}
	s.rmu.Unlock()
	if moved {
		s.writeCredits(&s.drflow, &s.credMu, s.data, 0)
	}
}

// writeCredits tells the peer our reposted count of f by an RDMA write
// into its control block at off, if it may be running low.
func (s *Session) writeCredits(f *recvFlow, mu interface {
	Lock()
	Unlock()
}, ch *channel.Channel, off uint64) {
	if _, ok := f.shouldWrite(); !ok {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	rep, ok := f.shouldWrite()
	if !ok {
		return
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], rep)
	if err := ch.WriteInline(s.bg, s.peerBlock.At(off), b[:]); err != nil {
		return // the channel broke: the session ends (watch)
	}
	f.told(rep)
}
