package collective

import (
	"context"
	"unsafe"
)

// Gather collects the vectors send of every rank, all of the same
// length m, into recv at rank root: rank i's vector lands in recv[i·m :
// (i+1)·m]. recv (p·m elements) is used at the root only (other ranks
// may pass nil). At the root, send may be nil (in place: the root's
// vector is already at its place in recv) or that very subslice of recv.
//
// Algorithm: the root receives from every other rank at once, in one
// step whose messages progress together chunk by chunk (no rank but the
// root forwards anything, every byte is copied once from the window to
// its place); p−1 messages at the root, one latency when the windows
// hold them.
//
// Mismatched calls (other root, count or element type) are detected by
// the ranks that receive a chunk of them (ErrMismatch); see Broadcast.
func Gather[T Number](ctx context.Context, c *Comm, send, recv []T, root int) error {
	m := len(send)
	if c.rank == root && send == nil {
		m = len(recv) / max(c.size, 1)
	}
	info := callInfo{kind: kindGather, dtype: dtypeOf[T](), root: int32(root), count: uint64(m)}
	return gather(ctx, c, info, send, recv, layout{m: m, esz: elemSize[T]()}, root)
}

// Gatherv collects the vectors send of every rank, of any lengths, into
// recv at rank root: rank i's vector (recvcounts[i] elements) lands at
// recv[displs[i]:]. recv, recvcounts and displs are used at the root
// only; there, recvcounts and displs have one entry per rank, the blocks
// lie inside recv and do not overlap each other, and send has
// recvcounts[root] elements, or is nil (in place: the root's vector is
// already at recv[displs[root]:]) or that very subslice of recv. A rank
// whose vector's length differs from the root's recvcounts entry makes
// the root fail with ErrMismatch.
//
// Algorithm: Gather's.
func Gatherv[T Number](ctx context.Context, c *Comm, send, recv []T, recvcounts, displs []int, root int) error {
	info := callInfo{kind: kindGatherv, dtype: dtypeOf[T](), root: int32(root), count: anyCount}
	return gather(ctx, c, info, send, recv, layout{counts: recvcounts, displs: displs, esz: elemSize[T]()}, root)
}

// gather is Gather (l: blocks of l.m elements) and Gatherv (info.count
// anyCount, l: recvcounts and displs): the root receives rank i's vector
// into block i of l in recv.
func gather[T Number](ctx context.Context, c *Comm, info callInfo, send, recv []T, l layout, root int) error {
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	if root < 0 || root >= c.size {
		return c.end(t, c.argErr(info.kind, "root %d out of range [0, %d)", root, c.size))
	}
	if c.rank != root {
		return c.end(t, c.step(ctx, root, bytesOf(send), -1, nil, false, false))
	}
	own, err := rootBlock(c, info, &l, recv, send, true)
	if err != nil {
		return c.end(t, c.rootArgs(err))
	}
	if send != nil {
		copy(own, send)
	}
	c.recvs = c.rootFlows(c.recvs[:0], bytesOf(recv), &l, root)
	return c.end(t, c.run(ctx, nil, c.recvs))
}

// Scatter hands block i of send at rank root, send[i·m : (i+1)·m], to
// rank i's recv (m elements at every rank). send (p·m elements) is used
// at the root only (other ranks may pass nil). At the root, recv may be
// nil (in place: the root's block stays in send) or that very subslice
// of send.
//
// Algorithm: the root sends to every other rank at once, in one step
// whose messages progress together chunk by chunk.
//
// Mismatched calls are detected by the receiving ranks (ErrMismatch);
// see Broadcast.
func Scatter[T Number](ctx context.Context, c *Comm, send, recv []T, root int) error {
	m := len(recv)
	if c.rank == root && recv == nil {
		m = len(send) / max(c.size, 1)
	}
	info := callInfo{kind: kindScatter, dtype: dtypeOf[T](), root: int32(root), count: uint64(m)}
	return scatter(ctx, c, info, send, layout{m: m, esz: elemSize[T]()}, recv, root)
}

// Scatterv hands rank i the block of sendcounts[i] elements at
// send[displs[i]:] of rank root, into its recv. send, sendcounts and
// displs are used at the root only; there, sendcounts and displs have
// one entry per rank and the blocks lie inside send (they may overlap:
// they are only read), and recv has sendcounts[root] elements, or is nil
// (in place) or that very block of send. A rank whose recv's length
// differs from the root's sendcounts entry fails with ErrMismatch.
//
// Algorithm: Scatter's.
func Scatterv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, displs []int, recv []T, root int) error {
	info := callInfo{kind: kindScatterv, dtype: dtypeOf[T](), root: int32(root), count: anyCount}
	return scatter(ctx, c, info, send, layout{counts: sendcounts, displs: displs, esz: elemSize[T]()}, recv, root)
}

// scatter is Scatter (l: blocks of l.m elements) and Scatterv
// (info.count anyCount, l: sendcounts and displs): the root sends block
// i of l in send to rank i's recv.
func scatter[T Number](ctx context.Context, c *Comm, info callInfo, send []T, l layout, recv []T, root int) error {
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	if root < 0 || root >= c.size {
		return c.end(t, c.argErr(info.kind, "root %d out of range [0, %d)", root, c.size))
	}
	if c.rank != root {
		return c.end(t, c.step(ctx, -1, nil, root, bytesOf(recv), false, false))
	}
	own, err := rootBlock(c, info, &l, send, recv, false)
	if err != nil {
		return c.end(t, c.rootArgs(err))
	}
	c.sends = c.rootFlows(c.sends[:0], bytesOf(send), &l, root)
	if recv != nil {
		copy(recv, own)
	}
	return c.end(t, c.run(ctx, c.sends, nil))
}

// rootBlock checks, at the root of a gather (buf is recv, vec send) or
// a scatter (buf is send, vec recv), the layout l of buf and the root's
// own vector vec (nil in place), and returns the root's block of buf. An
// error is the call's argument error.
func rootBlock[T Number](c *Comm, info callInfo, l *layout, buf, vec []T, gather bool) ([]T, error) {
	bufName, vecName := "send", "recv"
	if gather {
		bufName, vecName = vecName, bufName
	}
	if err := c.checkLayout(info, bufName, l, len(buf), gather); err != nil {
		return nil, err
	}
	lo, hi := l.span(c.rank)
	own := buf[lo:hi]
	switch {
	case vec == nil:
	case len(vec) != len(own): // v-variants only: else l.m is len(vec)
		return nil, c.argErr(info.kind, "%s has %d elements, %scounts[%d] is %d", vecName, len(vec), bufName, c.rank, len(own))
	case !sameMem(vec, own) && overlap(vec, buf):
		return nil, c.argErr(info.kind, "%s overlaps %s other than at the root's block", vecName, bufName)
	}
	return own, nil
}

// rootFlows appends to fs one flow for every rank i but root: block i of
// l in the root's buffer buf.
func (c *Comm) rootFlows(fs []flow, buf []byte, l *layout, root int) []flow {
	for i := range c.size {
		if i != root {
			lo, hi := l.block(i)
			fs = append(fs, flow{peer: i, buf: buf[lo:hi]})
		}
	}
	return fs
}

// overlap reports whether a and b share memory.
func overlap[T Number](a, b []T) bool {
	if len(a) == 0 || len(b) == 0 {
		return false
	}
	sz := uintptr(elemSize[T]())
	a0, b0 := uintptr(unsafe.Pointer(&a[0])), uintptr(unsafe.Pointer(&b[0]))
	return a0 < b0+uintptr(len(b))*sz && b0 < a0+uintptr(len(a))*sz
}

// checkLayout validates the layout l of the root's buffer (named buf, n
// elements) of a rooted call: for a v-variant (info.count anyCount), its
// counts and displacements (see checkBlocks); else p blocks of l.m
// elements. It returns the call's argument error, or nil.
func (c *Comm) checkLayout(info callInfo, buf string, l *layout, n int, disjoint bool) error {
	if info.count == anyCount {
		return c.checkBlocks(info.kind, buf, l.counts, l.displs, n, disjoint)
	}
	if n != c.size*l.m {
		return c.argErr(info.kind, "%s has %d elements, want %d ranks × %d", buf, n, c.size, l.m)
	}
	return nil
}

// checkBlocks validates the counts and displacements of a v-variant
// against a buffer of n elements: one entry per rank, counts and
// displacements ≥ 0, every block inside the buffer, and (if disjoint)
// no two non-empty blocks overlapping. It returns the argument error of
// a call of kind k, or nil.
func (c *Comm) checkBlocks(k uint8, buf string, counts, displs []int, n int, disjoint bool) error {
	if len(counts) != c.size || len(displs) != c.size {
		return c.argErr(k, "%d counts and %d displacements for %d ranks", len(counts), len(displs), c.size)
	}
	sorted := true
	for i := range c.size {
		if counts[i] < 0 || displs[i] < 0 || displs[i] > n || counts[i] > n-displs[i] {
			return c.argErr(k, "block %d (%d elements at %d) is outside %s (%d elements)", i, counts[i], displs[i], buf, n)
		}
		if i > 0 && displs[i] < displs[i-1] {
			sorted = false
		}
	}
	if !disjoint {
		return nil
	}
	if i, j := overlappingBlocks(counts, displs, sorted); i >= 0 {
		return c.argErr(k, "blocks %d and %d of %s overlap", i, j, buf)
	}
	return nil
}

// overlappingBlocks returns two overlapping non-empty blocks, or -1, -1.
// With displacements in rank order, neighbours are enough (O(p)); else
// every pair is compared (O(p²), no allocation).
func overlappingBlocks(counts, displs []int, sorted bool) (int, int) {
	if sorted {
		prev := -1 // last non-empty block
		for i := range counts {
			if counts[i] == 0 {
				continue
			}
			if prev >= 0 && displs[prev]+counts[prev] > displs[i] {
				return prev, i
			}
			prev = i
		}
		return -1, -1
	}
	for i := range counts {
		for j := i + 1; j < len(counts); j++ {
			if counts[i] > 0 && counts[j] > 0 && displs[i] < displs[j]+counts[j] && displs[j] < displs[i]+counts[i] {
				return i, j
			}
		}
	}
	return -1, -1
}
