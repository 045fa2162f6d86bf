package session

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// Message is a received message. Its payload lies in a buffer of the
// library (a receive buffer, or for a large message the region it was
// read into), valid until Release, which gives the buffer back (a
// receive buffer is posted again, which returns a credit to the
// sender). A Message is a small value; Release is idempotent, and
// methods of a released Message return zero values.
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
		off := int(m.slot)*m.s.slot + dataHdr
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
	if m.s == nil {
		return
	}
	if m.slot >= 0 {
		m.s.repostIf(int(m.slot), m.gen)
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
// (the device has it); the session goes on.
func (s *Session) Send(ctx context.Context, data []byte) error {
	return s.sendBytes(ctx, data, 0, false)
}

// SendImm is Send with immediate data, which the peer's Message.Imm
// returns.
func (s *Session) SendImm(ctx context.Context, imm uint32, data []byte) error {
	return s.sendBytes(ctx, data, imm, true)
}

func (s *Session) sendBytes(ctx context.Context, data []byte, imm uint32, hasImm bool) error {
	if err := s.live("send"); err != nil {
		return err
	}
	if len(data) > s.peer.MaxMessage {
		return fmt.Errorf("session: send: %w: a message of %d bytes, the peer takes at most %d", ErrLimit, len(data), s.peer.MaxMessage)
	}
	if len(data) <= s.peer.SlotSize-dataHdr {
		buf, err := s.mem.Alloc(dataHdr + len(data))
		if err != nil {
			return fmt.Errorf("session: send: %w", err)
		}
		copy(buf.Bytes()[dataHdr:], data)
		return s.sendEager(ctx, buf, dataHdr+len(data), LocalSlice{}, imm, hasImm)
	}
	buf, err := s.mem.Alloc(len(data))
	if err != nil {
		return fmt.Errorf("session: send: %w", err)
	}
	copy(buf.Bytes(), data)
	return s.sendRendezvous(ctx, buf.All(), buf, imm, hasImm)
}

// SendSlice sends the bytes of a region of the session's allocator
// without copying them: they must not change until SendSlice returns
// (and, if ctx ended first, until the region is freed: freeing it is
// then deferred by the library until the device is done with it... the
// caller must not Free it before SendSlice returns).
func (s *Session) SendSlice(ctx context.Context, data LocalSlice, imm uint32, hasImm bool) error {
	if err := s.live("send"); err != nil {
		return err
	}
	if !data.MR().Valid() {
		return fmt.Errorf("session: send: %w: the region was freed", ErrClosed)
	}
	n := data.Len()
	if n > s.peer.MaxMessage {
		return fmt.Errorf("session: send: %w: a message of %d bytes, the peer takes at most %d", ErrLimit, n, s.peer.MaxMessage)
	}
	if n <= s.peer.SlotSize-dataHdr {
		hdr, err := s.mem.Alloc(dataHdr)
		if err != nil {
			return fmt.Errorf("session: send: %w", err)
		}
		return s.sendEager(ctx, hdr, dataHdr, data, imm, hasImm)
	}
	return s.sendRendezvous(ctx, data, LocalMR{}, imm, hasImm)
}

// sendEager sends the header in buf (n bytes: the header, maybe the
// payload) and the payload in extra (if not empty). buf is freed when the
// device is done with it.
func (s *Session) sendEager(ctx context.Context, buf LocalMR, n int, extra LocalSlice, imm uint32, hasImm bool) error {
	if err := s.acquireOp(ctx, "send"); err != nil {
		buf.Free()
		return err
	}
	if err := s.dflow.take(ctx, s.done); err != nil {
		s.releaseOp()
		buf.Free()
		return s.ctxErr("send", err)
	}
	plen := n - dataHdr + extra.Len()
	rep := s.drflow.reposted.Load()
	putDataHdr(buf.Bytes(), dataEager, rep, uint32(plen))
	hs, _ := buf.Slice(0, n)
	sgl := [2]verbs.SGE{hs.SGE()}
	k := 1
	if extra.Len() > 0 {
		sgl[1], k = extra.SGE(), 2
	}
	var h channel.Handle
	var err error
	if hasImm {
		h, err = s.data.PostSendImm(imm, sgl[:k]...)
	} else {
		h, err = s.data.PostSend(sgl[:k]...)
	}
	if err != nil {
		s.releaseOp()
		buf.Free()
		return s.fail("send", err)
	}
	s.drflow.told(rep)
	return s.await(ctx, "send", h, buf)
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
	buf LocalMR
	op  bool
	r   *RemoteMR
}

func (s *Session) giveBack(o orphaned) {
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
		go s.reap(h, o)
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
	w := s.agent.expectFin(id, win, owned)
	hdr, err := s.mem.Alloc(rtsHdr)
	if err != nil {
		s.agent.dropFin(id)
		return fmt.Errorf("session: send: %w", err)
	}
	if err := s.acquireOp(ctx, "send"); err != nil {
		hdr.Free()
		s.agent.dropFin(id)
		return err
	}
	if err := s.dflow.take(ctx, s.done); err != nil {
		s.releaseOp()
		hdr.Free()
		s.agent.dropFin(id)
		return s.ctxErr("send", err)
	}
	rep := s.drflow.reposted.Load()
	putRTS(hdr.Bytes(), rep, uint32(data.Len()), win.Addr(), win.RKey(), id)
	var h channel.Handle
	if hasImm {
		h, err = s.data.PostSendImm(imm, hdr.All().SGE())
	} else {
		h, err = s.data.PostSend(hdr.All().SGE())
	}
	if err != nil {
		s.releaseOp()
		hdr.Free()
		s.agent.dropFin(id)
		return s.fail("send", err)
	}
	s.drflow.told(rep)
	if err := s.await(ctx, "send", h, hdr); err != nil {
		return err // the fin (or the session's end) frees the window
	}
	select {
	case <-w:
		return nil
	case <-s.done:
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
// the message.
func (s *Session) Receive(ctx context.Context) (Message, error) {
	select {
	case <-s.turn:
	case <-ctx.Done():
		return Message{}, fmt.Errorf("session: receive: %w", ctx.Err())
	case <-s.done:
		return Message{}, s.fail("receive", nil)
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
	select {
	case <-s.turn:
	case <-ctx.Done():
		return 0, 0, false, fmt.Errorf("session: receive: %w", ctx.Err())
	case <-s.done:
		return 0, 0, false, s.fail("receive", nil)
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

// receive takes the next message (turn held).
func (s *Session) receive(ctx context.Context) (Message, error) {
	if p := s.pending; p != nil {
		return s.finishRead(ctx, p)
	}
	s.rmu.Lock()
	if len(s.fifo) == 0 {
		s.rmu.Unlock()
		return Message{}, fmt.Errorf("session: receive: %w: no receive buffer posted (every message is still held: Release some)", ErrLimit)
	}
	slot := s.fifo[0]
	h := s.rh[slot]
	s.rmu.Unlock()
	if err := h.Wait(ctx); err != nil && !h.Done() {
		return Message{}, s.ctxErr("receive", err)
	}
	s.rmu.Lock()
	s.fifo = s.fifo[1:]
	gen := s.rgen[slot]
	s.rmu.Unlock()
	if err := h.Err(); err != nil {
		h.Release()
		return Message{}, s.fail("receive", err)
	}
	rc := h.Received()
	h.Release()
	s.drflow.consumed.Add(1)
	m := Message{s: s, slot: slot, gen: gen}
	if rc.HasImm {
		m.imm, m.flags = rc.Imm, msgHasImm
	}
	if rc.Write {
		m.flags |= msgWrite
		m.slot = -1
		s.repost(int(slot))
		return m, nil
	}
	b := s.ring.Bytes()[int(slot)*s.slot : int(slot+1)*s.slot]
	if rc.Len < dataHdr {
		return Message{}, s.protocol(fmt.Errorf("%w: a message of %d bytes (header %d)", ErrProtocol, rc.Len, dataHdr))
	}
	s.dflow.learn(binary.LittleEndian.Uint32(b[4:]))
	n := int(binary.LittleEndian.Uint32(b[8:]))
	switch b[0] {
	case dataEager:
		if n != rc.Len-dataHdr {
			return Message{}, s.protocol(fmt.Errorf("%w: a message of %d bytes says %d", ErrProtocol, rc.Len-dataHdr, n))
		}
		m.n = n
		return m, nil
	case dataRTS:
		if rc.Len != rtsHdr {
			return Message{}, s.protocol(fmt.Errorf("%w: a rendezvous of %d bytes", ErrProtocol, rc.Len))
		}
		if n > s.cfg.MaxMessage {
			return Message{}, s.protocol(fmt.Errorf("%w: a message of %d bytes (at most %d)", ErrLimit, n, s.cfg.MaxMessage))
		}
		src := verbs.RemoteAddr{Addr: binary.LittleEndian.Uint64(b[16:]), RKey: binary.LittleEndian.Uint32(b[24:])}
		id := binary.LittleEndian.Uint64(b[32:])
		s.repost(int(slot))
		m.slot = -1
		mr, err := s.mem.Alloc(max(n, 1))
		if err != nil {
			// The sender waits for the fin; without memory for the
			// message the session cannot go on in order.
			return Message{}, s.protocol(fmt.Errorf("session: receive: a message of %d bytes: %w", n, err))
		}
		p := &pendingRead{src: src, mr: mr, id: id, msg: m}
		p.msg.mr, p.msg.n = mr, n
		return s.finishRead(ctx, p)
	}
	return Message{}, s.protocol(fmt.Errorf("%w: message kind %d", ErrProtocol, b[0]))
}

// finishRead waits for a rendezvous read, tells the sender, and returns
// the message (turn held).
func (s *Session) finishRead(ctx context.Context, p *pendingRead) (Message, error) {
	if p.msg.n > 0 {
		if !p.posted {
			if err := s.acquireOp(ctx, "receive"); err != nil {
				s.pending = p
				return Message{}, err
			}
			sl, _ := p.mr.Slice(0, p.msg.n)
			h, err := s.data.PostRead(p.src, sl.SGE())
			if err != nil {
				s.releaseOp()
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
		s.releaseOp()
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

// postData posts receive buffer slot (rmu held or before the session
// runs).
func (s *Session) postData(slot int) error {
	sl, err := s.ring.Slice(slot*s.slot, s.slot)
	if err != nil {
		return err
	}
	h, err := s.data.PostReceive(sl.SGE())
	if err != nil {
		return err
	}
	s.rh[slot] = h
	if s.rgen[slot]++; s.rgen[slot] == 0 { // 0 is never a message's
		s.rgen[slot] = 1
	}
	s.fifo = append(s.fifo, int32(slot))
	return nil
}

// repost posts receive buffer slot again and returns its credit to the
// sender (by a write when it may be low: flow.go).
func (s *Session) repost(slot int) {
	s.repostIf(slot, 0)
}

// repostIf is repost if the slot's generation is gen (0: any): a
// message released twice, even at once, is posted once.
func (s *Session) repostIf(slot int, gen uint32) {
	s.rmu.Lock()
	if gen != 0 && s.rgen[slot] != gen {
		s.rmu.Unlock()
		return
	}
	err := s.postData(slot)
	s.rmu.Unlock()
	if err != nil {
		s.fail("receive", err)
		return
	}
	s.drflow.reposted.Add(1)
	s.writeCredits(&s.drflow, &s.credMu, s.data, 0)
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
