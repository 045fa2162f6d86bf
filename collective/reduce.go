package collective

import (
	"context"
	"math/bits"
)

// ReduceSmallMax is the vector size (bytes) below which AlgAuto reduces
// along a binomial tree; from it on, by reduce-scatter and gather
// (Rabenseifner). See Reduce for how it was measured.
const ReduceSmallMax = 512 << 10

// Reduce combines the vectors send of every rank element by element with
// op and leaves the result in recv at rank root; recv is used at the
// root only (other ranks may pass nil). send has the same length at
// every rank, and recv at the root that length too. At the root, send
// may be nil or the same slice as recv (in place: the root's operand is
// in recv). Every rank names the same root and op.
//
// Order of reduction: the operands are combined in the order of the
// ranks, x0 ⊕ x1 ⊕ … ⊕ x(p−1), the lower ranks' partial result always
// the left operand, so Custom operations need not be commutative. The
// bracketing (which matters for floating-point numbers) is fixed by the
// algorithm and the communicator's size, never by the root: every root
// gets the same bits. The algorithms:
//
//   - binomial tree (AlgRecursiveDoubling; AlgAuto below ReduceSmallMax
//     bytes): the tree rooted at rank 0 in which rank r collects ranks
//     [r, r+lowbit(r)) (its children r+1, r+2, r+4, … in that order),
//     ⌈log2 p⌉ latencies. Its top combination, rank 0's ranks [0, h)
//     with rank h's [h, p) (h the largest power of two below p), takes
//     place at the root: rank 0 and rank h send their partial results
//     there, so a root other than 0 costs no extra round.
//   - reduce-scatter and gather (AlgRabenseifner; AlgAuto from
//     ReduceSmallMax on): with q the largest power of two ≤ p, ranks
//     2i and 2i+1 for i < p−q first combine their vectors at 2i+1
//     (x2i ⊕ x2i+1); the q remaining ranks then reduce-scatter by
//     recursive halving with distances 1, 2, 4, … (so that each partial
//     result stems from consecutive ranks), and the root gathers the q
//     blocks. About 2·n bytes moved per rank.
//   - pipelined chain (AlgRing): rank 0 → 1 → … → p−1, each rank
//     combining and forwarding every chunk as it arrives, ((x0 ⊕ x1) ⊕
//     x2) ⊕ …; rank p−1 forwards the result to the root. p + (chunks)
//     chunk latencies.
//
// Measured in this package's in-process worlds (soft0, 2 shared
// processors under heavy load, go test -run NONE -bench RootedReduce
// -benchtime=10x): the tree was ahead of both others at 16 and 256 KiB
// at p = 4 and 8 (p = 4, 256 KiB: 13 ms, Rabenseifner 72 ms, chain
// 19 ms); in one process every byte moved is processor time, and the
// tree moves the fewest. AlgAuto switches to Rabenseifner, which halves
// what each rank sends and receives, only from ReduceSmallMax (512 KiB,
// Allreduce's ring threshold) on; to be tuned across processes.
//
// Mismatched calls are detected like Broadcast's.
func Reduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op, root int) (err error) {
	atRoot := c.rank == root
	inPlace := atRoot && (send == nil || sameMem(send, recv))
	n := len(send)
	if inPlace {
		n = len(recv)
	}
	info := callInfo{kind: kindReduce, op: op.kind, opID: op.id, dtype: dtypeOf[T](), root: int32(root), count: uint64(n)}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	defer c.catchOp(t, &err)
	switch {
	case root < 0 || root >= c.size:
		return c.end(t, c.argErr(info.kind, "root %d out of range [0, %d)", root, c.size))
	case atRoot && len(recv) != n:
		return c.end(t, c.rootArgs(c.argErr(info.kind, "send has %d elements, recv %d", n, len(recv))))
	case atRoot && overlapPartly(send, recv):
		return c.end(t, c.rootArgs(c.argErr(info.kind, "send and recv overlap without being the same slice")))
	}
	red, err := reducerFor[T](op)
	if err != nil {
		return c.end(t, c.argErr(info.kind, "%w", err))
	}
	c.red = red
	sb, rb := bytesOf(send), bytesOf(recv)
	if inPlace {
		sb = nil
	}
	if !atRoot {
		rb = nil
	}
	return c.end(t, c.reduce(ctx, sb, rb, n, elemSize[T](), root))
}

// sameMem reports whether a and b are the same slice (same first
// element and length, or both empty).
func sameMem[T Number](a, b []T) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// reduce combines the vectors of n elements of esz bytes: send (nil at
// the root in place), the result into recv at the root.
func (c *Comm) reduce(ctx context.Context, send, recv []byte, n, esz, root int) error {
	if c.size == 1 {
		if send != nil {
			copy(recv, send)
		}
		return nil
	}
	alg := c.opts.Algorithm
	if alg == AlgAuto {
		alg = AlgRecursiveDoubling
		if n*esz >= ReduceSmallMax {
			alg = AlgRabenseifner
		}
	}
	switch {
	case alg == AlgRing:
		return c.chainReduce(ctx, send, recv, n*esz, root)
	case alg == AlgRabenseifner && n >= pof2(c.size):
		return c.rabenseifnerReduce(ctx, send, recv, n, esz, root)
	}
	return c.binomialReduce(ctx, send, recv, n*esz, root)
}

// operand returns the buffer this rank's partial result accumulates in,
// holding its operand: recv at the root, else the scratch memory.
func (c *Comm) operand(send, recv []byte, nb, root int) []byte {
	if c.rank == root {
		if send != nil {
			copy(recv, send)
		}
		return recv
	}
	acc := c.scratchBytes(nb)
	copy(acc, send)
	return acc
}

// binomialReduce: see Reduce.
func (c *Comm) binomialReduce(ctx context.Context, send, recv []byte, nb, root int) error {
	p, r := c.size, c.rank
	h := pof2(p - 1) // rank 0's last child
	lb := lowbit(r, p)
	// Rank 0 leaves its child h to the root unless it is the root.
	top := r == 0 && root != 0
	last := lb // children r+d for d < last
	if top {
		last = h
	}
	leaf := last == 1 || r+1 >= p
	var acc []byte
	switch {
	case r == root:
		acc = c.operand(send, recv, nb, root)
	case leaf:
		acc = send // only sent, never written
	default:
		acc = c.operand(send, nil, nb, root)
	}
	for d := 1; d < last && r+d < p; d <<= 1 {
		if err := c.step(ctx, -1, nil, r+d, acc, true, false); err != nil {
			return err
		}
	}
	switch {
	case r == 0:
		if root != 0 {
			return c.step(ctx, root, acc, -1, nil, false, false)
		}
		return nil
	case r == h && root != 0:
		if root == h {
			return c.step(ctx, -1, nil, 0, acc, true, true)
		}
		return c.step(ctx, root, acc, -1, nil, false, false)
	}
	if err := c.step(ctx, r-lb, acc, -1, nil, false, false); err != nil {
		return err
	}
	if r != root {
		return nil
	}
	// The root (neither 0 nor h) combines [0, h) and [h, p).
	if err := c.step(ctx, -1, nil, 0, recv, false, false); err != nil {
		return err
	}
	return c.step(ctx, -1, nil, h, recv, true, false)
}

// rabenseifnerReduce: see Reduce.
func (c *Comm) rabenseifnerReduce(ctx context.Context, send, recv []byte, n, esz, root int) error {
	q := pof2(c.size)
	work := c.operand(send, recv, n*esz, root)
	nr, err := c.foldIn(ctx, work)
	if err != nil {
		return err
	}
	var lo int // the block this position owns in the end
	if nr >= 0 {
		hi := q
		for d := 1; d < q; d <<= 1 {
			partner := nr ^ d
			mid := lo + (hi-lo)/2
			keepLo, keepHi, sendLo, sendHi := lo, mid, mid, hi
			if nr&d != 0 {
				keepLo, keepHi, sendLo, sendHi = mid, hi, lo, mid
			}
			pr := c.realRank(partner)
			keep := work[blockStart(n, q, keepLo, esz):blockStart(n, q, keepHi, esz)]
			if err := c.step(ctx, pr, work[blockStart(n, q, sendLo, esz):blockStart(n, q, sendHi, esz)],
				pr, keep, true, partner < nr); err != nil {
				return err
			}
			lo, hi = keepLo, keepHi
		}
	}
	// Position nr owns block bitrev(nr): the root gathers them.
	k := bits.Len(uint(q)) - 1
	owner := func(b int) int { return c.realRank(int(bits.Reverse(uint(b)) >> (bits.UintSize - k))) }
	if c.rank != root {
		if nr < 0 {
			return nil
		}
		return c.step(ctx, root, work[blockStart(n, q, lo, esz):blockStart(n, q, lo+1, esz)], -1, nil, false, false)
	}
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	for b := range q {
		if o := owner(b); o != root {
			c.recvs = append(c.recvs, flow{peer: o, buf: recv[blockStart(n, q, b, esz):blockStart(n, q, b+1, esz)]})
		}
	}
	return c.run(ctx, nil, c.recvs)
}

// chainReduce: see Reduce.
func (c *Comm) chainReduce(ctx context.Context, send, recv []byte, nb, root int) error {
	p, r := c.size, c.rank
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	var acc []byte
	switch {
	case r == 0:
		// Only sent. At the root in place, the result arrives into recv
		// chunk by chunk, each after that chunk of recv was sent.
		acc = send
		if send == nil {
			acc = recv
		}
	case r == root && r == p-1:
		acc = c.operand(send, recv, nb, root)
	default:
		src := send
		if src == nil {
			src = recv // the root, in place
		}
		acc = c.operand(src, nil, nb, -1)
	}
	if r > 0 {
		c.recvs = append(c.recvs, flow{peer: r - 1, buf: acc, reduce: true, srcLow: true})
	}
	if r == root && r != p-1 {
		c.recvs = append(c.recvs, flow{peer: p - 1, buf: recv})
	}
	var after *flow
	if r > 0 {
		after = &c.recvs[0]
	}
	switch {
	case r < p-1:
		c.sends = append(c.sends, flow{peer: r + 1, buf: acc, after: after})
	case root != r:
		c.sends = append(c.sends, flow{peer: root, buf: acc, after: after})
	}
	return c.run(ctx, c.sends, c.recvs)
}
