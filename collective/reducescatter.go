package collective

import (
	"context"
	"math/bits"
	"unsafe"
)

// ReduceScatter combines the vectors send of every rank element by
// element with op and scatters the result in blocks: with p ranks and n
// = len(recv), send has p·n elements at every rank, and rank r receives
// block r of the result (elements r·n to (r+1)·n) in recv. n is the
// same at every rank. In place: send nil, recv holds the p·n elements
// of the input and block r of the result is left in recv[:n] (as MPI's
// MPI_IN_PLACE); recv[n:] is left unchanged.
//
// Algorithms: recursive halving (Options.Algorithm AlgRecursiveDoubling
// or AlgRabenseifner, and AlgAuto when p is a power of two, when the
// vector (p·n elements) is smaller than RingMin bytes, or for Custom
// operations): ⌈log2 p⌉ rounds exchanging half, a quarter... of the
// vector, combining groups of consecutive ranks in rank order (lower
// ranks' partial result on the left); when p is not a power of two, the
// first 2·(p − 2^⌊log2 p⌋) ranks first fold in pairs (rank 2i hands its
// vector to 2i+1, which combines x_2i ⊕ x_2i+1) and the odd ones hand
// the even ones their block at the end. The ring (AlgRing, and AlgAuto
// otherwise; never for Custom operations): p−1 steps of one block,
// pipelined in chunks; block b is combined in ring order, starting after
// it: x_b+1 ⊕ x_b+2 ⊕ … ⊕ x_p−1 ⊕ x_0 ⊕ … ⊕ x_b, left to right. Either
// way each element's result is computed once, at the rank that receives
// it, in an order that depends on p, the algorithm and the block only.
//
// Arguments that do not fit (lengths, overlapping send and recv, an op
// not defined on T) fail with ErrArgs before anything is sent; ranks
// that disagree on n fail with ErrMismatch.
func ReduceScatter[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) error {
	info := callInfo{kind: kindReduceScatter, op: op.kind, opID: op.id, dtype: dtypeOf[T](), root: -1, count: uint64(len(recv))}
	if err := c.zeroErr(info.kind); err != nil {
		return err // before the division by the size
	}
	in, inPlace := send, send == nil
	n := len(recv)
	if inPlace {
		if len(recv)%c.size != 0 {
			return c.argErr(info.kind, "in place, recv has %d elements, not a multiple of the %d ranks", len(recv), c.size)
		}
		in, n = recv, len(recv)/c.size
		info.count = uint64(n)
	} else if len(send) != c.size*len(recv) {
		return c.argErr(info.kind, "send has %d elements, want %d ranks × %d (len(recv))", len(send), c.size, len(recv))
	}
	return reduceScatter(ctx, c, info, in, recv[:n], inPlace, nil, n, op)
}

// ReduceScatterV is ReduceScatter with blocks of different lengths:
// block j of the vector has counts[j] elements (every rank passes the
// same counts), send has their sum, and rank r receives block r in recv,
// of counts[r] elements. In place: send nil, recv holds the sum of counts
// elements of the input, block r of the result is left in
// recv[:counts[r]] and the rest of recv unchanged. Algorithms and order
// of reduction as ReduceScatter's (the ring when the vector is at least
// RingMin bytes and p is not a power of two). Ranks that disagree on
// counts fail with ErrMismatch (the call's description includes a hash
// of them), also where their sums agree.
func ReduceScatterV[T Number](ctx context.Context, c *Comm, send, recv []T, counts []int, op Op) error {
	info := callInfo{kind: kindReduceScatter, op: op.kind, opID: op.id, dtype: dtypeOf[T](), root: -1}
	if err := c.zeroErr(info.kind); err != nil {
		return err // before counts[rank]: nil counts fit the size 0
	}
	if len(counts) != c.size {
		return c.argErr(info.kind, "%d counts for %d ranks", len(counts), c.size)
	}
	total := 0
	for j, k := range counts {
		if k < 0 || k > maxElems[T]()-total {
			return c.argErr(info.kind, "counts[%d] = %d (negative, or the sum overflows)", j, k)
		}
		total += k
	}
	// Every rank passes the same counts: the description carries their
	// hash, so that ranks that disagree fail with ErrMismatch also where
	// the messages' lengths agree (recursive halving sends several
	// blocks in one message), instead of reducing blocks out of place.
	info.count = countsHash(counts)
	in, inPlace, n := send, send == nil, counts[c.rank]
	if inPlace {
		if len(recv) != total {
			return c.argErr(info.kind, "in place, recv has %d elements, want the sum of counts, %d", len(recv), total)
		}
		in = recv
	} else {
		if len(send) != total {
			return c.argErr(info.kind, "send has %d elements, want the sum of counts, %d", len(send), total)
		}
		if len(recv) != n {
			return c.argErr(info.kind, "recv has %d elements, want counts[%d] = %d", len(recv), c.rank, n)
		}
	}
	return reduceScatter(ctx, c, info, in, recv[:n], inPlace, counts, 0, op)
}

// maxElems is the largest number of elements of T a slice may hold.
func maxElems[T Number]() int { return int(^uint(0)>>1) / elemSize[T]() }

// reduceScatter runs a reduce-scatter of in (the input vector: blocks
// of counts[j] elements, or of n each if counts is nil) into dst.
func reduceScatter[T Number](ctx context.Context, c *Comm, info callInfo, in, dst []T, inPlace bool, counts []int, n int, op Op) (err error) {
	if !inPlace && c.size > 1 && overlap(in, dst) {
		return c.argErr(info.kind, "send and recv overlap")
	}
	red, err := reducerFor[T](op)
	if err != nil {
		return c.argErr(info.kind, "%w", err)
	}
	t, err := c.begin(ctx, info, bytesOf(in), bytesOf(dst))
	if err != nil {
		return err
	}
	defer c.catchOp(t, &err)
	c.red = red
	esz := elemSize[T]()
	p := c.size
	if p == 1 {
		if !inPlace {
			copy(dst, in)
		}
		return c.end(t, nil)
	}
	alg := c.rsAlg(len(in) * esz)
	if op.kind == opCustom {
		alg = AlgRabenseifner // rank order
	}
	nints, maxb := p+1, 0
	if alg != AlgRing {
		nints += pof2(p) + 1
	}
	for j := range p {
		if counts != nil {
			n = counts[j]
		}
		maxb = max(maxb, n*esz)
	}
	ib, db := bytesOf(in), bytesOf(dst)
	dataLen := len(ib)
	if alg == AlgRing {
		dataLen = 2 * maxb
	}
	// Block offsets (bytes) and the halving's offsets in the scratch's
	// int table, then the data.
	ints, data := c.scratchInts(nints, dataLen)
	off := ints[:p+1]
	off[0] = 0
	for j := range p {
		if counts != nil {
			n = counts[j]
		}
		off[j+1] = off[j] + n*esz
	}
	if alg == AlgRing {
		err = c.ringReduceScatter(ctx, ib, off, db, inPlace, data)
	} else {
		err = c.halvingReduceScatter(ctx, ib, off, ints[p+1:], db, data)
	}
	return c.end(t, err)
}

// scratchInts returns k ints and n bytes (8-byte aligned, after the
// ints) of the communicator's scratch memory (k > 0).
func (c *Comm) scratchInts(k, n int) ([]int, []byte) {
	sz := int(unsafe.Sizeof(int(0)))
	b := c.scratchBytes(k*sz + n)
	return unsafe.Slice((*int)(unsafe.Pointer(&b[0])), k), b[k*sz:]
}

// ringReduceScatter: in step s (0 ≤ s < p−1), rank r sends its partial
// result of block r−1−s to the right (its own block r−1 at step 0) and
// receives the partial result of block r−2−s from the left, combined on
// arrival with its own block (the incoming partial on the left): block b
// starts at rank b+1 and ends complete at rank b after p−1 steps. Two
// blocks of scratch alternate as the partial sent and the one received;
// the last step combines into dst directly (into scratch, then copied,
// in place, where dst may overlap the block sent).
func (c *Comm) ringReduceScatter(ctx context.Context, in []byte, off []int, dst []byte, inPlace bool, tmp []byte) error {
	p, r := c.size, c.rank
	left, right := (r-1+p)%p, (r+1)%p
	blk := func(i int) []byte {
		i = (i%p + p) % p
		return in[off[i]:off[i+1]]
	}
	half := len(tmp) / 2
	a, b := tmp[:half], tmp[half:]
	src := blk(r - 1)
	for s := range p - 1 {
		own := blk(r - s - 2)
		acc := a[:len(own)]
		if s == p-2 && !inPlace {
			acc = dst
		}
		copy(acc, own)
		if err := c.step(ctx, right, src, left, acc, true, true); err != nil {
			return err
		}
		src = acc
		a, b = b, a
	}
	if inPlace {
		copy(dst, src)
	}
	return nil
}

// halvingReduceScatter: the q = 2^⌊log2 p⌋ positions of the power-of-two
// algorithms (after the fold of the first 2·(p−q) ranks, see foldIn)
// each stand for one or two consecutive ranks, whose blocks make up the
// position's superblock. The vector is copied into w with the
// superblocks in bit-reversed order of positions, so that halving with
// the nearest partner first (round k: position nr exchanges with nr XOR
// 2^k, keeps the lower half of its range at the lower position and
// combines the partner's half into it, lower positions on the left)
// works on contiguous ranges and leaves position nr with superblock nr:
// rank order, and each half sent is one message.
func (c *Comm) halvingReduceScatter(ctx context.Context, in []byte, off, woff []int, dst, w []byte) error {
	p, r := c.size, c.rank
	q := pof2(p)
	rem := p - q
	lg := bits.Len(uint(q)) - 1
	rev := func(j int) int { return int(bits.Reverse(uint(j)) >> (bits.UintSize - lg)) }
	// Superblock i: blocks [sb(i), sb(i+1)).
	sb := func(i int) int {
		if i < rem {
			return 2 * i
		}
		return i + rem
	}
	woff[0] = 0
	for j := range q {
		i := rev(j)
		woff[j+1] = woff[j] + off[sb(i+1)] - off[sb(i)]
	}
	for j := range q {
		i := rev(j)
		copy(w[woff[j]:woff[j+1]], in[off[sb(i)]:off[sb(i+1)]])
	}
	var nr int
	switch {
	case r >= 2*rem:
		nr = r - rem
	case r%2 == 0: // folds into r+1, gets its block back at the end
		if err := c.step(ctx, r+1, w, -1, nil, false, false); err != nil {
			return err
		}
		return c.step(ctx, -1, nil, r+1, dst, false, false)
	default:
		nr = r / 2
		if err := c.step(ctx, -1, nil, r-1, w, true, true); err != nil {
			return err
		}
	}
	lo, hi := 0, q
	for half := 1; half < q; half <<= 1 {
		pr := c.realRank(nr ^ half)
		mid := lo + (hi-lo)/2
		klo, khi, slo, shi := lo, mid, mid, hi
		if nr&half != 0 {
			klo, khi, slo, shi = mid, hi, lo, mid
		}
		if err := c.step(ctx, pr, w[woff[slo]:woff[shi]], pr, w[woff[klo]:woff[khi]], true, pr < r); err != nil {
			return err
		}
		lo, hi = klo, khi
	}
	res := w[woff[lo]:woff[hi]] // superblock nr: blocks sb(nr) to sb(nr+1)
	if nr < rem {
		// Blocks r−1 and r: hand r−1 its own.
		n0 := off[r] - off[r-1]
		copy(dst, res[n0:])
		return c.step(ctx, r-1, res[:n0], -1, nil, false, false)
	}
	copy(dst, res)
	return nil
}

// rsAlg is the algorithm of a reduce-scatter of n bytes with a built-in
// op: Options.Algorithm, or Rabenseifner (recursive halving) for p a
// power of two or a vector below RingMin, else the ring.
func (c *Comm) rsAlg(n int) Algorithm {
	alg := c.opts.Algorithm
	if alg == AlgAuto {
		alg = AlgRing
		if p := c.size; p&(p-1) == 0 || n < RingMin {
			alg = AlgRabenseifner
		}
	}
	return alg
}

// ReduceScatterAlgorithm names the algorithm of a ReduceScatter on c of
// n bytes (the whole input vector) with a built-in op.
func (c *Comm) ReduceScatterAlgorithm(n int) string { return c.rsAlg(n).String() }
