package collective

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/goverbs/verbs"
)

// Small messages. A message of at most llMax bytes that goes through the
// window is sent as one RDMA write (with immediate data: the doorbell)
// instead of two (the chunk, then the data count): every write costs the
// receiver's side of the transport a frame to take in, and on soft0
// shared memory the second write made a two-rank barrier a third
// slower. The write carries 8-byte words, each holding 4 bytes of the
// message in its low half and a flag in its high half that is the
// chunk's sequence number (plus one, modulo 2³²−1: never 0), as the LL
// protocol of NCCL does. The receiver finds the message complete when
// every word of it carries the flag, whatever the order in which the
// write's bytes were placed: it relies only on each aligned 8-byte word
// being placed whole, which DMA to host memory does and soft0's copies
// do. The header words carry what a chunk's header carries (the call,
// its description and the message length, so a mismatched call is
// reported as with a chunk), and the sender's consumed count of the
// receiver's chunks (an ack, see below):
//
//	word 0 call | 1 kind, op << 8, dtype << 16 | 2 root | 3 count low |
//	4 count high | 5 message length | 6 ack | 7 Custom op id | 8… data,
//	4 bytes a word
//
// Both sides agree on the form of a chunk from the message's length (a
// message of at most llMax bytes, sent through the window, in one
// chunk); a receiver that expects one form and finds the other reports
// the mismatch of lengths. The receiver clears the words a chunk left in
// its slot (LL or not) before it acknowledges it, so the sender's next
// use of the slot is the only source of flagged words: a stale word of
// an earlier chunk, whatever its data, cannot pass for a new one.
//
// Acks ride along: a small message to a peer carries how many of that
// peer's chunks this rank consumed, which counts as a written ack count
// once the peer takes the message in (llAcked). A rank that would wait
// with consumed chunks whose count only rode on messages its peer has
// not taken in yet writes the ack count (writeRodeAcks), so a peer
// waiting for credit is never left waiting for a message it will only
// take in later.

const (
	llMax      = 1024 // bytes of the largest message sent in LL words
	llHdrWords = 8
	llRegion   = (llHdrWords + (llMax+3)/4) * 8 // the most of a slot LL words take
)

// llWords returns the words of a small message of n bytes.
func llWords(n int) int { return llHdrWords + (n+3)/4 }

// llFlag returns the flag (high half of each word) of chunk seq.
func llFlag(seq uint64) uint64 { return (seq%(1<<32-1) + 1) << 32 }

// small reports whether f, a send, is a small message: sent whole,
// through the window, in LL words. (A receive takes one in whenever one
// arrives: tryRecv.)
func (c *Comm) small(f *flow) bool {
	return len(f.buf) <= llMax && f.off == 0 && llWords(len(f.buf))*8 <= c.slotBytes && len(f.buf) <= c.chunk &&
		f.land == landWindow && f.zreg == nil
}

// llSlice returns the first words 8-byte words of b (64-byte aligned: a
// slot of a window or of the staging region), each loaded and stored
// whole.
func llSlice(b []byte, words int) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), words)
}

// sendSmall sends f (small, with the credit for chunk seq) as one write
// of LL words from its staging slot (at offset slot of c.tx) to dst.
func (c *Comm) sendSmall(f *flow, seq uint64, slot int, dst verbs.RemoteAddr) (bool, error) {
	p := f.peer
	n := len(f.buf)
	words := llWords(n)
	w := llSlice(c.tx.Bytes()[slot:], words)
	flag := llFlag(seq)
	ack := c.recvSeq[p]
	w[0] = flag | uint64(c.callSeq)
	w[1] = flag | uint64(c.call.kind) | uint64(c.call.op)<<8 | uint64(c.call.dtype)<<16
	w[2] = flag | uint64(uint32(c.call.root))
	w[3] = flag | c.call.count&(1<<32-1)
	w[4] = flag | c.call.count>>32
	w[5] = flag | uint64(n)
	w[6] = flag | uint64(uint32(ack))
	w[7] = flag | uint64(c.call.opID)
	d := w[llHdrWords:]
	i := 0
	for ; i+4 <= n; i += 4 {
		d[i/4] = flag | uint64(binary.LittleEndian.Uint32(f.buf[i:]))
	}
	if i < n {
		var b [4]byte
		copy(b[:], f.buf[i:])
		d[i/4] = flag | uint64(binary.LittleEndian.Uint32(b[:]))
	}
	src, err := c.tx.SGE(slot, words*8)
	if err != nil {
		return false, err
	}
	if err := c.signal(p, dst, src); err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			return false, nil
		}
		return false, err
	}
	c.sendSeq[p] = seq + 1
	f.off, f.started = n, true
	if ack > c.ackSent[p] {
		c.ackSent[p] = ack // in flight: the peer learns it when it takes this in
		c.acksRode = true
	}
	return true, nil
}

// llHeader returns the header words of a small message in slot (loaded
// atomically: the sender may be writing them) and whether every one of
// them carries flag.
func llHeader(slot []byte, flag uint64) (h [llHdrWords]uint32, ok bool) {
	ws := llSlice(slot, llHdrWords)
	for i := range ws {
		v := atomic.LoadUint64(&ws[i])
		if v&^(1<<32-1) != flag {
			return h, false
		}
		h[i] = uint32(v)
	}
	return h, true
}

// llCall returns the call's sequence number and description in the
// header words h of a small message (chunkCall's twin).
func llCall(h [llHdrWords]uint32) (uint32, callInfo) {
	return h[0], callInfo{kind: uint8(h[1]), op: opKind(h[1] >> 8), dtype: uint8(h[1] >> 16), root: int32(h[2]),
		count: uint64(h[3]) | uint64(h[4])<<32, opID: h[7]}
}

// recvSmall takes in the small message of chunk seq from p in slot, if
// it has arrived, into c.llData; it reports whether it had. expect is the
// length this rank expects (for the error of a mismatch).
func (c *Comm) recvSmall(slot []byte, p int, seq uint64, expect int) (bool, error) {
	flag := llFlag(seq)
	h, ok := llHeader(slot, flag)
	if !ok {
		return false, nil
	}
	n := int(h[5])
	if n > llMax || llWords(n)*8 > len(slot) {
		return false, fmt.Errorf("rank %d's small message has %d bytes (corrupted window)", p, n)
	}
	words := llWords(n)
	ws := llSlice(slot, words)[llHdrWords:]
	dst := c.llData[:len(ws)*4]
	for i := range ws {
		v := atomic.LoadUint64(&ws[i])
		if v&^(1<<32-1) != flag {
			return false, nil
		}
		binary.LittleEndian.PutUint32(dst[i*4:], uint32(v))
	}
	call, peer := llCall(h)
	if err := c.checkCall(p, call, peer, uint64(n), expect); err != nil {
		return false, err
	}
	// The ack, the low half of the peer's count of this rank's chunks it
	// consumed, which lies between the credit known and what was sent.
	sent := c.sendSeq[p]
	if acked := sent - uint64(uint32(sent)-h[6]); acked > c.llAcked[p] && acked <= sent {
		c.llAcked[p] = acked
	}
	clear(slot[:words*8])
	return true, nil
}

// llArrived reports whether the small message of chunk seq from p has
// arrived in its slot (without taking it in).
func (c *Comm) llArrived(p int, seq uint64) bool {
	_, ok := llHeader(c.rxSlot(p, seq), llFlag(seq))
	return ok
}

// rxSlot returns the slot of p's chunk seq in this rank's window.
func (c *Comm) rxSlot(p int, seq uint64) []byte {
	k := int(seq % uint64(c.slots))
	return c.rx.Bytes()[c.slotBase+(p*c.slots+k)*c.slotBytes:][:c.slotBytes]
}

// credit returns the count of this rank's chunks p consumed, as far as
// this rank knows: its written ack count, or the ack that rode on its
// last small message.
func (c *Comm) credit(p int) uint64 {
	return max(atomic.LoadUint64(word(c.rx, p*peerFlagBytes+8)), c.llAcked[p])
}

// writeRodeAcks writes the ack counts that only rode on small messages,
// before this rank waits long or sleeps: a peer waiting for credit may
// take those messages in only after it got the credit.
func (c *Comm) writeRodeAcks() error {
	if !c.acksRode {
		return nil
	}
	c.acksRode = false
	for p := range c.size {
		if c.ackSent[p] > c.ackWritten[p] && !c.ackOwed[p] {
			c.ackOwed[p] = true
			if err := c.postAck(p); err != nil {
				return c.stepErr(p, err)
			}
		}
	}
	return nil
}
