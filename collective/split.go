package collective

import (
	"cmp"
	"context"
	"encoding/binary"
	"slices"
)

// Undefined as the color of Split: this rank joins no communicator.
const Undefined = -1

// Split partitions the communicator: the ranks that pass the same color
// form a new communicator, ordered by key (ties by rank in c). Every rank
// of c calls it; a rank that passes Undefined (any negative color) gets
// nil. The new communicator has its own windows, its own order of calls
// and its own poison, and shares the node's queue pairs; its options are
// c's. Close it before the node.
//
// Split costs two allgathers of a few bytes over c (the colors and keys,
// then the new windows' descriptions).
func (c *Comm) Split(ctx context.Context, color, key int) (*Comm, error) {
	t, err := c.begin(ctx, callInfo{kind: kindSplit, root: -1})
	if err != nil {
		return nil, err
	}
	sub, err := c.split(ctx, color, key)
	return sub, c.end(t, err)
}

// Dup returns a new communicator of the same ranks in the same order
// (Split with one color, keys the ranks): collectives on it are ordered
// independently of c's.
func (c *Comm) Dup(ctx context.Context) (*Comm, error) { return c.Split(ctx, 0, c.rank) }

func (c *Comm) split(ctx context.Context, color, key int) (*Comm, error) {
	const rec = 16
	if color < 0 {
		color = Undefined
	}
	all := make([]byte, c.size*rec)
	binary.LittleEndian.PutUint64(all[c.rank*rec:], uint64(int64(color)))
	binary.LittleEndian.PutUint64(all[c.rank*rec+8:], uint64(int64(key)))
	if err := c.allgatherRecords(ctx, all, rec); err != nil {
		return nil, err
	}
	type member struct{ key, rank int }
	var ms []member
	for r := range c.size {
		if int(int64(binary.LittleEndian.Uint64(all[r*rec:]))) == color {
			ms = append(ms, member{int(int64(binary.LittleEndian.Uint64(all[r*rec+8:]))), r})
		}
	}
	slices.SortFunc(ms, func(a, b member) int {
		if d := cmp.Compare(a.key, b.key); d != 0 {
			return d
		}
		return cmp.Compare(a.rank, b.rank)
	})
	var sub *Comm
	if color != Undefined {
		ranks := make([]int, len(ms))
		me := -1
		for i, m := range ms {
			ranks[i] = c.ranks[m.rank]
			if m.rank == c.rank {
				me = i
			}
		}
		var err error
		if sub, err = newComm(c.node, ranks, me, c.opts, c.bufs); err != nil {
			// Take part in the second allgather anyway, so that the others
			// fail cleanly (their descriptor from this rank is empty).
			sub = nil
			_ = err
		}
	}
	descs := make([]byte, c.size*descBytes)
	if sub != nil {
		sub.descriptor(descs[c.rank*descBytes:])
	}
	if err := c.allgatherRecords(ctx, descs, descBytes); err != nil {
		if sub != nil {
			sub.release()
		}
		return nil, err
	}
	if color == Undefined {
		return nil, nil
	}
	if sub == nil {
		return nil, c.fail(errSplitAlloc, -1)
	}
	for i, m := range ms {
		if i == sub.rank {
			continue
		}
		if err := sub.setRemote(i, descs[m.rank*descBytes:][:descBytes]); err != nil {
			sub.release()
			return nil, err
		}
	}
	return sub, nil
}

// allgatherRecords gathers every rank's record of rec bytes (at
// all[rank·rec:]) into all, at every rank: one message to and from
// every peer, all at once.
func (c *Comm) allgatherRecords(ctx context.Context, all []byte, rec int) error {
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	mine := all[c.rank*rec:][:rec]
	for j := range c.size {
		if j == c.rank {
			continue
		}
		c.sends = append(c.sends, flow{peer: j, buf: mine})
		c.recvs = append(c.recvs, flow{peer: j, buf: all[j*rec:][:rec]})
	}
	return c.run(ctx, c.sends, c.recvs)
}
