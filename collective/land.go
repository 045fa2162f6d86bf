package collective

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs"
)

// Landing. A message whose destination at the receiver lies in a Buffer
// can be written there directly, instead of into the receiver's window
// and copied out by the receiver. The receiver announces its destination
// to the sender at the start of the call (announce): the buffer's remote
// address, rkey and length, tagged with the call's sequence number and
// description, or that it has none (the data then goes through the
// window). The sender of such a message waits for the announcement
// before its first chunk (landWait), checks it against its own call and
// then writes each chunk's data to the announced address plus the
// chunk's offset, followed by the data count as for any chunk; no header
// goes into the window (the announcement carried the checks). The
// receiver consumes a landed chunk by counting it: its data is in place.
//
// The announcement sits after the four counters of the peer's flags in
// the receiver's window (rx, peer j's flags at j·peerFlagBytes):
//
//	32 tag u64: call sequence << 32 | kind << 24 | op << 16 | dtype << 8 | landNone or landHere
//	40 remote address u64 | 48 rkey u32 | 52 0 u32 | 56 length u64
//
// written in two writes, the tag last (queue pairs place writes in
// order), with immediate data (it wakes a sleeping sender). The sender
// reads it once per call, before it sends; the receiver writes the next
// one only in its next call, which begins after the sender's data of
// this one arrived, so one source in tx (landSrc) serves every call.
//
// A Buffer that received data so stays writable by the communicator's
// peers: a peer's writes into it can only follow an announcement of the
// call in progress, and a failed call poisons the communicator, so after
// a failure a peer may still land the data of the failed call until it
// notices the failure itself (bounded by its context or Options.Timeout).

const (
	landBytes = 32 // the announcement (tag and body)
	landOff   = 32 // its offset in a peer's flags

	landNone = 1 // the announcement says: through the window
	landHere = 2 // the announcement says: into the buffer described
)

// Landing state of a send flow.
const (
	landWindow uint8 = iota // the send goes through the window
	landWait                // the send waits for the receiver's announcement
	landOnto                // the send lands in the receiver's buffer
)

// landTag is the tag of an announcement of the current call, without
// its low byte.
func (c *Comm) landTag() uint64 {
	return uint64(c.callSeq)<<32 | uint64(c.call.kind)<<24 | uint64(c.call.op)<<16 | uint64(c.call.dtype)<<8
}

// announce tells peer p where the message it sends to this rank in the
// current call goes: into dst if dst lies in a Buffer, which it then
// holds (users) until unuse; else through the
// window. It blocks only while the send queue is full.
func (c *Comm) announce(ctx context.Context, p int, dst []byte) (reg *registered, err error) {
	b := c.tx.Bytes()[c.landSrc : c.landSrc+landBytes]
	tag := c.landTag() | landNone
	var zero [landBytes - 8]byte
	copy(b[8:], zero[:])
	if len(dst) > 0 {
		var off int
		if reg, off = c.bufs.use(dst); reg != nil {
			r := reg.mr.Remote()
			binary.LittleEndian.PutUint64(b[8:], r.Addr+uint64(off))
			binary.LittleEndian.PutUint32(b[16:], r.RKey)
			binary.LittleEndian.PutUint64(b[24:], uint64(len(dst)))
			tag = c.landTag() | landHere
		}
	}
	binary.LittleEndian.PutUint64(b, tag)
	at := uint64(c.rank*peerFlagBytes + landOff)
	body, err := c.tx.SGE(c.landSrc+8, landBytes-8)
	if err == nil {
		err = c.postPatiently(ctx, p, c.remote[p].At(at+8), false, body)
	}
	if err == nil {
		var t verbs.SGE
		if t, err = c.tx.SGE(c.landSrc, 8); err == nil {
			err = c.postPatiently(ctx, p, c.remote[p].At(at), true, t)
		}
	}
	if err != nil && reg != nil {
		reg.users.Add(-1)
		reg = nil
	}
	return reg, err
}

// unuse ends a call's use of a Buffer it received into (announce).
func unuse(r *registered) {
	if r != nil {
		r.users.Add(-1)
	}
}

// postPatiently posts a write to p (unsignaled in effect: its handle is
// released at once), driving the progress while the send queue is full.
func (c *Comm) postPatiently(ctx context.Context, p int, dst verbs.RemoteAddr, bell bool, src verbs.SGE) error {
	for n := 0; ; n++ {
		h, err := c.post(p, dst, bell, src)
		if err == nil {
			h.Release()
			return nil
		}
		if !errors.Is(err, verbs.ErrQueueFull) {
			return c.stepErr(p, err)
		}
		if n%waitCheck == waitCheck-1 {
			if err := c.expired(ctx, time.Now()); err != nil {
				return c.fail(err, p)
			}
			if err := c.mc.Peer(c.ranks[p]).Err(); err != nil {
				return c.peerFailed(p, err)
			}
		}
		c.spin.Pause()
	}
}

// landLookup reads the announcement of f's receiver for the current
// call (f waits for it): it reports whether it has arrived, and sets f
// to land or to go through the window as it says.
func (c *Comm) landLookup(f *flow) (bool, error) {
	p := f.peer
	v := atomic.LoadUint64(word(c.rx, p*peerFlagBytes+landOff))
	if v>>32 != uint64(c.callSeq) {
		return false, nil // not yet: a tag of an earlier call, or none
	}
	if v&^0xff != c.landTag() {
		peer := callInfo{kind: uint8(v >> 24), op: opKind(v >> 16 & 0xff), dtype: uint8(v >> 8 & 0xff), root: c.call.root, count: c.call.count, opID: c.call.opID}
		return false, fmt.Errorf("%w: rank %d called %v, this rank %v", ErrMismatch, p, peer, c.call)
	}
	switch v & 0xff {
	case landNone:
		f.land = landWindow
		return true, nil
	case landHere:
	default:
		return false, fmt.Errorf("rank %d's landing announcement has kind %d (corrupted window)", p, v&0xff)
	}
	b := c.rx.Bytes()[p*peerFlagBytes+landOff:][:landBytes]
	r := verbs.RemoteRegion{Addr: binary.LittleEndian.Uint64(b[8:]), RKey: binary.LittleEndian.Uint32(b[16:]),
		Len: binary.LittleEndian.Uint64(b[24:])}
	if r.Len != uint64(f.landTotal) {
		return false, fmt.Errorf("%w: rank %d receives %d bytes, this rank sends a vector of %d", ErrMismatch, p, r.Len, f.landTotal)
	}
	f.landDst, f.land = r, landOnto
	return true, nil
}
