package cluster

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// MaxShare is the most bytes a rank may contribute to one Share.
const MaxShare = 256

// ErrShareCorrupt: a peer's mailbox at this rank holds a header no
// correct peer writes (a length over MaxShare, or a call number other
// than this call's or the previous one): the memory was overwritten, or
// a peer runs other code. The error names the rank whose box it is.
var ErrShareCorrupt = errors.New("cluster: share: corrupt mailbox")

// Mailboxes. After the flag words of the flag region (barrier.go), every
// rank registers one box per rank of the world; box j is written only by
// rank j:
//
//	header u64 | data, MaxShare bytes
//
// The header, written after the data (a separate RDMA write; a queue
// pair places writes in order), is
//
//	bits 63..48 generation (the barrier's, bumped by reset)
//	bits 47..16 call number (Shares since reset, from 1; low 32 bits)
//	bits 15..0  length of the data
//
// A reader waits until the header of a box holds its generation and its
// call number. A header of another generation is stale (written before a
// reset) or early (the writer reset first): the reader keeps waiting. In
// its generation, a box holds the previous call's header or this one's;
// anything else, or a length over MaxShare, is ErrShareCorrupt. Boxes
// are reused by the next Share only after the world barrier that ends
// each Share (a barrier of the world, counted as one: its epoch moves),
// which no rank passes before every rank has copied its boxes out.
const (
	boxBytes = flagBytes + MaxShare
	// auxShare is the offset in aux of Share's source: a header, then
	// the data.
	auxShare = 2 * flagBytes
	auxBytes = auxShare + boxBytes
)

// boxOff is the byte offset, in the flag region, of rank j's box.
func (b *barrier) boxOff(j int) int { return flagWords(b.n)*flagBytes + j*boxBytes }

// share is Node.Share.
func (b *barrier) share(ctx context.Context, data []byte) ([][]byte, error) {
	if len(data) > MaxShare {
		return nil, fmt.Errorf("cluster: share (rank %d): %d bytes, at most MaxShare (%d): nothing was written", b.rank, len(data), MaxShare)
	}
	if err := b.takeTurn(ctx); err != nil {
		return nil, fmt.Errorf("cluster: share (rank %d): %w", b.rank, err)
	}
	defer b.giveTurn()
	b.mu.Lock()
	defer b.mu.Unlock()
	call := b.calls + 1
	if err := b.ready(ctx, b.n > 1); err != nil {
		return nil, b.shareErr(call, -1, err)
	}
	out, peer, err := b.exchange(ctx, call, data)
	if err == nil {
		peer, err = b.run(ctx, b.world)
	}
	if err != nil {
		err, poison := b.settle(peer, err)
		err = b.shareErr(call, peer, err)
		if poison {
			b.poison = err
		}
		return nil, err
	}
	return out, nil
}

// shareErr builds the error of a Share.
func (b *barrier) shareErr(call uint32, peer int, err error) error {
	if peer >= 0 {
		return fmt.Errorf("cluster: share (rank %d, call %d, peer %d): %w", b.rank, call, peer, err)
	}
	return fmt.Errorf("cluster: share (rank %d, call %d): %w", b.rank, call, err)
}

// exchange writes data into this rank's box at every peer, then waits
// for every peer's box here and copies them out, indexed by rank. On
// failure it returns the peer involved (-1 if none) and the raw error,
// for settle. Call with mu held.
func (b *barrier) exchange(ctx context.Context, call uint32, data []byte) ([][]byte, int, error) {
	src := b.aux.Bytes()[auxShare : auxShare+boxBytes]
	hdr := b.gen<<48 | uint64(call)<<16 | uint64(len(data))
	binary.NativeEndian.PutUint64(src, hdr)
	copy(src[flagBytes:], data)
	// The writes: in the order rank+1, rank+2...; so that the first box
	// each rank finds is the one it waits for first (rank−1's).
	for k := 1; k < b.n; k++ {
		p := (b.rank + k) % b.n
		if err := b.post(ctx, p, len(data)); err != nil {
			return nil, p, err
		}
	}
	b.calls = call
	// The boxes here, rank−1 first.
	lens := make([]int, b.n)
	lens[b.rank] = len(data)
	total := len(data)
	for k := 1; k < b.n; k++ {
		p := (b.rank - k + b.n) % b.n
		var hdr uint64
		err := b.awaitWord(ctx, p, b.word64(b.boxOff(p)), func(v uint64) (bool, error) {
			if v>>48 != b.gen {
				return false, nil // stale or early: not this generation's
			}
			got := uint32(v >> 16)
			switch d := int32(got - call); {
			case d == -1:
				return false, nil // the previous call's
			case d != 0:
				when := "a later"
				if d < 0 {
					when = "an earlier"
				}
				return false, fmt.Errorf("%w: rank %d's box at this rank holds call %d, %s call than this one (%d)",
					ErrShareCorrupt, p, got, when, call)
			}
			if n := int(v & 0xffff); n > MaxShare {
				return false, fmt.Errorf("%w: rank %d's box at this rank holds %d bytes, more than MaxShare (%d)",
					ErrShareCorrupt, p, n, MaxShare)
			}
			hdr = v
			return true, nil
		})
		if err != nil {
			return nil, p, err
		}
		lens[p] = int(hdr & 0xffff)
		total += lens[p]
	}
	// A write that failed broke its channel (and the header after it
	// never left): the peer it was for failed.
	for _, p := range b.mc.Peers() {
		if err := b.mc.Peer(p).Err(); err != nil {
			return nil, p, err
		}
	}
	buf := make([]byte, total)
	out := make([][]byte, b.n)
	off := 0
	for j, n := range lens {
		box := data
		if j != b.rank {
			box = b.flags.Bytes()[b.boxOff(j)+flagBytes:][:n]
		}
		out[j] = buf[off : off+n : off+n]
		copy(out[j], box)
		off += n
	}
	return out, -1, nil
}

// post writes this rank's box (the data, n bytes, then the header, from
// aux) into peer's mailboxes, without waiting for the writes to complete:
// a write that fails breaks the channel, and the peer, which then never
// sees the header, fails its wait. The source is not rewritten before
// the world barrier that ends the Share, which the peer passes only once
// it has read the header, hence once both writes were placed.
func (b *barrier) post(ctx context.Context, peer, n int) error {
	ch := b.mc.Peer(peer)
	off := uint64(b.boxOff(b.rank))
	box := b.remote[peer].At(off)
	if n > 0 {
		src, err := b.aux.SGE(auxShare+flagBytes, n)
		if err != nil {
			return err
		}
		if err := b.postWrite(ctx, peer, ch, b.remote[peer].At(off+flagBytes), src, false); err != nil {
			return err
		}
	}
	src, err := b.aux.SGE(auxShare, flagBytes)
	if err != nil {
		return err
	}
	return b.postWrite(ctx, peer, ch, box, src, true) // the doorbell: see awaitWord
}

// postWrite posts a write (with immediate data, the peer's doorbell, if
// bell is set) without a completion (channel.PostWriteUnsignaled: the
// flag protocol orders the reuse of its source), retrying while the
// channel has no room, until ctx ends.
func (b *barrier) postWrite(ctx context.Context, peer int, ch *channel.Channel, dst verbs.RemoteAddr, src verbs.SGE, bell bool) error {
	b.partner(peer)
	for {
		var err error
		if bell {
			err = ch.PostWriteImmUnsignaled(dst, 0, src)
		} else {
			err = ch.PostWriteUnsignaled(dst, src)
		}
		if err == nil {
			return nil
		}
		if !errors.Is(err, verbs.ErrQueueFull) {
			return err
		}
		if err := b.mc.Progress(); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("writing to rank %d: %w: %w", peer, verbs.ErrTimeout, err)
		}
		runtime.Gosched()
	}
}
