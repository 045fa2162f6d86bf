package collective

import (
	"context"
	"errors"
	"fmt"
)

// AlltoallPairwiseMin is the block size (bytes) from which Alltoall
// exchanges with one peer at a time (pairwise, p−1 steps: in step s,
// send to rank r+s and receive from rank r−s) instead of with all peers
// at once (one step in which every message progresses, chunk by chunk,
// each peer's windows bounding what is in flight to it). All at once
// costs one latency instead of p−1; pairwise keeps the send and receive
// of one peer at a time busy, which suits large blocks. Not measured
// yet: a first guess, one default chunk.
const AlltoallPairwiseMin = 64 << 10

// Alltoall sends block j of send to rank j and receives rank j's block
// (its block r) into block j of recv: with p ranks, send and recv have
// p·m elements, block j being elements j·m to (j+1)·m, and m is the same
// at every rank. In place: send nil, recv's blocks are sent and replaced
// (through a copy in the communicator's scratch memory).
//
// Ranks exchange with all peers at once for blocks under
// AlltoallPairwiseMin bytes, pairwise above (see there).
func Alltoall[T Number](ctx context.Context, c *Comm, send, recv []T) error {
	p := c.size
	info := callInfo{kind: kindAlltoall, dtype: dtypeOf[T](), root: -1}
	if err := c.zeroErr(info.kind); err != nil {
		return err
	}
	inPlace := send == nil
	if inPlace {
		send = recv
	}
	switch {
	case len(recv)%p != 0:
		return c.argErr(info.kind, "recv has %d elements, not a multiple of the %d ranks", len(recv), p)
	case len(send) != len(recv):
		return c.argErr(info.kind, "send has %d elements, recv %d", len(send), len(recv))
	case !inPlace && overlap(send, recv):
		return c.argErr(info.kind, "send and recv overlap (pass send nil for in place)")
	}
	m := len(recv) / p
	info.count = uint64(m)
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	esz := elemSize[T]()
	sb, rb := bytesOf(send), bytesOf(recv)
	if inPlace {
		sb = c.scratchBytes(len(rb))
		copy(sb, rb)
	}
	mb := m * esz
	blk := func(b []byte, j int) []byte { return b[j*mb : (j+1)*mb] }
	copy(blk(rb, c.rank), blk(sb, c.rank))
	if p == 1 {
		return c.end(t, nil)
	}
	if mb < AlltoallPairwiseMin {
		c.sends, c.recvs = c.sends[:0], c.recvs[:0]
		for s := 1; s < p; s++ {
			to, from := (c.rank+s)%p, (c.rank-s+p)%p
			c.sends = append(c.sends, flow{peer: to, buf: blk(sb, to)})
			c.recvs = append(c.recvs, flow{peer: from, buf: blk(rb, from)})
		}
		return c.end(t, c.run(ctx, c.sends, c.recvs))
	}
	for s := 1; s < p && err == nil; s++ {
		to, from := (c.rank+s)%p, (c.rank-s+p)%p
		err = c.step(ctx, to, blk(sb, to), from, blk(rb, from), false, false)
	}
	return c.end(t, err)
}

// Alltoallv is Alltoall with blocks of any length and place: this rank
// sends send[sdispls[j]:][:sendcounts[j]] to rank j and receives rank
// j's message into recv[rdispls[j]:][:recvcounts[j]]. sendcounts[j] at
// rank i must equal recvcounts[i] at rank j; a rank that receives a
// message of another length than it expects fails with ErrMismatch
// naming both lengths (the sender's call then fails by its context or
// Options.Timeout, or by the mismatch of its own receive). The receive
// blocks must not overlap one another. In place: send, sendcounts and
// sdispls nil, recv's blocks (recvcounts, rdispls) are sent and replaced
// by the blocks received (through a copy in scratch memory); the counts
// must then be symmetric (recvcounts[j] at rank i equals recvcounts[i]
// at rank j).
//
// Every message progresses at once, in one step (the ranks cannot agree
// on a choice by size without exchanging their counts).
func Alltoallv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, sdispls []int, recv []T, recvcounts, rdispls []int) error {
	p := c.size
	info := callInfo{kind: kindAlltoallv, dtype: dtypeOf[T](), root: -1, count: anyCount}
	if err := c.zeroErr(info.kind); err != nil {
		return err // before sendcounts[rank]: nil counts fit the size 0
	}
	inPlace := send == nil && sendcounts == nil && sdispls == nil
	if inPlace {
		send, sendcounts, sdispls = recv, recvcounts, rdispls
	}
	if err := checkSegments(c, info.kind, "send", len(send), sendcounts, sdispls); err != nil {
		return err
	}
	// Receive blocks must not overlap (the doc says so; which message
	// an overlap kept would depend on the order of arrival): as Gatherv
	// and Allgatherv check theirs. Send blocks may: they are only read.
	if err := c.checkBlocks(info.kind, "recv", recvcounts, rdispls, len(recv), true); err != nil {
		return err
	}
	if !inPlace && overlap(send, recv) {
		return c.argErr(info.kind, "send and recv overlap (pass send, sendcounts and sdispls nil for in place)")
	}
	if sendcounts[c.rank] != recvcounts[c.rank] {
		return c.argErr(info.kind, "sendcounts[%d] = %d but recvcounts[%d] = %d (this rank's block to itself)",
			c.rank, sendcounts[c.rank], c.rank, recvcounts[c.rank])
	}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	esz := elemSize[T]()
	sb, rb := bytesOf(send), bytesOf(recv)
	if inPlace {
		sb = c.scratchBytes(len(rb))
		copy(sb, rb)
	}
	seg := func(b []byte, counts, displs []int, j int) []byte {
		return b[displs[j]*esz:][:counts[j]*esz]
	}
	copy(seg(rb, recvcounts, rdispls, c.rank), seg(sb, sendcounts, sdispls, c.rank))
	if p == 1 {
		return c.end(t, nil)
	}
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	for s := 1; s < p; s++ {
		to, from := (c.rank+s)%p, (c.rank-s+p)%p
		c.sends = append(c.sends, flow{peer: to, buf: seg(sb, sendcounts, sdispls, to)})
		c.recvs = append(c.recvs, flow{peer: from, buf: seg(rb, recvcounts, rdispls, from)})
	}
	err = c.run(ctx, c.sends, c.recvs)
	if errors.Is(err, ErrMismatch) {
		withCounts(err, recvcounts, esz)
	}
	return c.end(t, err)
}

// withCounts adds the count this rank expected from the peer to a
// mismatch error (whose message gives the lengths in bytes).
func withCounts(err error, recvcounts []int, esz int) {
	var e *Error
	if errors.As(err, &e) && e.Peer >= 0 && e.Peer < len(recvcounts) {
		e.Err = fmt.Errorf("%w (recvcounts[%d] = %d elements of %d bytes at this rank)", e.Err, e.Peer, recvcounts[e.Peer], esz)
	}
}

// checkSegments checks the counts and displacements of a buffer of n
// elements.
func checkSegments(c *Comm, kind uint8, name string, n int, counts, displs []int) error {
	if len(counts) != c.size || len(displs) != c.size {
		return c.argErr(kind, "%d %scounts and %d %sdispls for %d ranks", len(counts), name, len(displs), name[:1], c.size)
	}
	for j := range c.size {
		k, d := counts[j], displs[j]
		if k < 0 || d < 0 || d > n || k > n-d {
			return c.argErr(kind, "%s block %d (%d elements at %d) is outside %s's %d elements", name, j, k, d, name, n)
		}
	}
	return nil
}

// AlltoallAlgorithm names the algorithm of an Alltoall on c of n bytes
// (the whole vector, p blocks): "all at once" below AlltoallPairwiseMin
// bytes a block, "pairwise" from there. Options.Algorithm does not
// change it.
func (c *Comm) AlltoallAlgorithm(n int) string {
	if c.size > 0 && n/c.size >= AlltoallPairwiseMin {
		return "pairwise"
	}
	return "all at once"
}
