package collective

import (
	"context"
	"math/bits"
	"unsafe"
)

// Thresholds of AlgAuto for Allreduce (bytes of the vector): recursive
// doubling up to SmallMax, Rabenseifner up to RingMin (exclusive), the
// ring from RingMin. See the package documentation for how they were
// measured.
const (
	SmallMax = 16 << 10
	RingMin  = 512 << 10
)

// Allreduce combines the vectors send of every rank element by element
// with op and leaves the result in recv at every rank. send and recv
// have the same length at every rank; they may be the same slice (in
// place), or send may be nil (in place in recv).
//
// Every rank gets the same bits: each element's result is computed
// once, by one rank, and copied to the others (ring, Rabenseifner), or
// computed by every rank in the same order, lower ranks' partial result
// on the left (recursive doubling).
func Allreduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) (err error) {
	if send == nil {
		send = recv
	}
	info := callInfo{kind: kindAllreduce, op: op.kind, opID: op.id, dtype: dtypeOf[T](), root: -1, count: uint64(len(recv))}
	if len(send) != len(recv) {
		return c.argErr(info.kind, "send has %d elements, recv %d", len(send), len(recv))
	}
	if overlapPartly(send, recv) {
		return c.argErr(info.kind, "send and recv overlap without being the same slice")
	}
	red, err := reducerFor[T](op)
	if err != nil {
		return c.argErr(info.kind, "%w", err)
	}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	defer c.catchOp(t, &err)
	c.red, c.comb = red, combinerFor[T](op)
	var in []byte // out of place: the input
	if len(send) > 0 && &send[0] != &recv[0] {
		in = bytesOf(send)
	}
	return c.end(t, c.allreduce(ctx, in, bytesOf(recv), elemSize[T]()))
}

func elemSize[T Number]() int {
	var z T
	return int(unsafe.Sizeof(z))
}

// overlapPartly reports whether a and b share memory without being the
// same slice.
func overlapPartly[T Number](a, b []T) bool { return overlap(a, b) && !sameMem(a, b) }

// allreduce reduces buf (whole elements of esz bytes) across the
// communicator with c.red; out of place, in (else nil) is the input,
// and buf receives the result.
func (c *Comm) allreduce(ctx context.Context, in, buf []byte, esz int) error {
	if c.size == 1 || c.chooseAlg(len(buf), esz, c.call.op == opCustom) != AlgRing {
		if in != nil {
			copy(buf, in)
		}
	}
	if c.size == 1 {
		return nil
	}
	switch c.chooseAlg(len(buf), esz, c.call.op == opCustom) {
	case AlgRing:
		return c.ringAllreduce(ctx, in, buf, esz)
	case AlgRabenseifner:
		return c.rabenseifner(ctx, buf, esz)
	}
	if c.gathersAllreduce(len(buf)) {
		return c.gatherDoubling(ctx, buf)
	}
	return c.recursiveDoubling(ctx, buf)
}

// GatherMax is the largest vector (bytes) that Allreduce gathers at rank
// 0 where some rank's machine has more ranks than processors (see
// gatherDoubling): every vector AlgAuto reduces by recursive doubling.
// Rank 0 holds p−1 of them at once (64 ranks: 1 MiB of scratch). 8
// ranks on 2 CPUs, soft0 shared memory, goverbs coll, three or four
// rounds alternating with recursive doubling: 8 B 55.6 → 27.6 µs, 2 KiB
// 87.5 → 42.7 µs, 8 KiB 113 → 57.9 µs.
const GatherMax = SmallMax

// gathersAllreduce reports whether an allreduce of n bytes by recursive
// doubling gathers at rank 0 instead (gatherDoubling): where the
// communicator's barrier gathers (some rank's machine has more ranks
// than processors, p > 2), the algorithm is AlgAuto's choice, and the
// vector is at most GatherMax.
func (c *Comm) gathersAllreduce(n int) bool {
	return c.gathers() && c.opts.Algorithm == AlgAuto && n <= GatherMax
}

// gatherDoubling is recursive doubling computed at rank 0: every other
// rank sends it its vector; rank 0 combines them in the order in which
// recursive doubling does (fold-in pairs, even rank on the left, then
// the positions pairwise, lower group on the left, for ever larger
// groups) and sends the result back to every rank. The same bits as
// recursiveDoubling, in 2(p−1) messages and two turns of each rank
// rather than ⌈log2 p⌉ rounds of every rank: where ranks share
// processors, the turns are what costs (8 ranks on 2 CPUs: see the
// package documentation).
func (c *Comm) gatherDoubling(ctx context.Context, buf []byte) error {
	if c.rank != 0 {
		return c.viaRoot(ctx, buf)
	}
	p, n := c.size, len(buf)
	// v[r] is rank r's vector: buf for rank 0, a slice of scratch for
	// the others.
	all := c.scratchBytes((p - 1) * n)
	v := func(r int) []byte {
		if r == 0 {
			return buf
		}
		return all[(r-1)*n : r*n]
	}
	if err := c.gatherAt0(ctx, all, n); err != nil {
		return err
	}
	// Fold in: among the first 2·rem ranks, the odd rank combines its
	// even neighbour's vector on the left and goes on as position r/2;
	// the others go on as position r − rem.
	rem := p - pof2(p)
	for i := range rem {
		c.red(v(2*i+1), v(2*i), true)
	}
	pos := func(nr int) []byte { return v(c.realRank(nr)) }
	q := pof2(p)
	for mask := 1; mask < q; mask <<= 1 {
		for nr := 0; nr < q; nr += 2 * mask {
			c.red(pos(nr), pos(nr+mask), false)
		}
	}
	if rem > 0 {
		copy(buf, pos(0)) // position 0 is rank 1
	}
	return c.releaseFrom0(ctx, buf)
}

// chooseAlg returns the algorithm of an allreduce of n bytes in
// elements of esz bytes (custom: of a Custom op).
func (c *Comm) chooseAlg(n, esz int, custom bool) Algorithm {
	alg := c.opts.Algorithm
	if alg == AlgAuto {
		switch {
		case n < SmallMax || n/esz < c.size:
			alg = AlgRecursiveDoubling
		case n < RingMin:
			alg = AlgRabenseifner
		default:
			alg = AlgRing
		}
	}
	if n/esz < c.size && alg != AlgRecursiveDoubling {
		alg = AlgRecursiveDoubling // fewer elements than ranks: blocks would be empty
	}
	if alg == AlgRing && custom {
		alg = AlgRabenseifner // the ring combines in ring order, not rank order
	}
	return alg
}

// AllreduceAlgorithm names the algorithm of an Allreduce on c of a vector
// of n bytes in elements of esz bytes, with a built-in op: that of
// Algorithm ("recursive doubling", "rabenseifner", "ring"), or "gather"
// for recursive doubling computed at rank 0 (where some rank's machine
// has more ranks than processors and the vector is at most GatherMax
// bytes: the same bits, fewer turns).
func (c *Comm) AllreduceAlgorithm(n, esz int) string {
	if esz <= 0 {
		return "none"
	}
	alg := c.chooseAlg(n, esz, false)
	if alg == AlgRecursiveDoubling && c.gathersAllreduce(n) {
		return "gather"
	}
	return alg.String()
}

// scratchBytes returns n bytes of the communicator's scratch memory.
func (c *Comm) scratchBytes(n int) []byte {
	if cap(c.scratch) < n {
		c.scratch = make([]byte, n)
	}
	return c.scratch[:n]
}

// step runs one exchange: send to sp (unless -1) and receive from rp
// (unless -1) into dst, copying or reducing.
func (c *Comm) step(ctx context.Context, sp int, src []byte, rp int, dst []byte, reduce, srcLow bool) error {
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	if sp >= 0 {
		c.sends = append(c.sends, flow{peer: sp, buf: src})
	}
	if rp >= 0 {
		c.recvs = append(c.recvs, flow{peer: rp, buf: dst, reduce: reduce, srcLow: srcLow})
	}
	return c.run(ctx, c.sends, c.recvs)
}

// pof2 returns the largest power of two ≤ p.
func pof2(p int) int { return 1 << (bits.Len(uint(p)) - 1) }

// foldIn is the first step of the power-of-two algorithms on p ranks
// that are not a power of two: with rem = p − pof2(p), among the first
// 2·rem ranks each even rank hands its vector to the odd rank after it,
// which reduces it (the even rank's being the lower operand). It returns
// this rank's position among the pof2(p) ranks that go on, or -1 for a
// rank that sat out.
func (c *Comm) foldIn(ctx context.Context, buf []byte) (int, error) {
	r, rem := c.rank, c.size-pof2(c.size)
	if r >= 2*rem {
		return r - rem, nil
	}
	if r%2 == 0 {
		return -1, c.step(ctx, r+1, buf, -1, nil, false, false)
	}
	return r / 2, c.step(ctx, -1, nil, r-1, buf, true, true)
}

// foldOut hands the result back to the ranks that sat out.
func (c *Comm) foldOut(ctx context.Context, buf []byte) error {
	r, rem := c.rank, c.size-pof2(c.size)
	if r >= 2*rem {
		return nil
	}
	if r%2 == 0 {
		return c.step(ctx, -1, nil, r+1, buf, false, false)
	}
	return c.step(ctx, r-1, buf, -1, nil, false, false)
}

// realRank maps a position among the pof2 ranks back to a rank.
func (c *Comm) realRank(nr int) int {
	rem := c.size - pof2(c.size)
	if nr < rem {
		return 2*nr + 1
	}
	return nr + rem
}

// recursiveDoubling: fold in, then in round k exchange the whole vector
// with position nr XOR 2^k and combine (the lower positions' vector on
// the left), then fold out. ⌈log2 p⌉ (+2) latencies, the whole vector in
// every round.
func (c *Comm) recursiveDoubling(ctx context.Context, buf []byte) error {
	nr, err := c.foldIn(ctx, buf)
	if err != nil {
		return err
	}
	if nr >= 0 {
		tmp := c.scratchBytes(len(buf))
		for mask := 1; mask < pof2(c.size); mask <<= 1 {
			partner := c.realRank(nr ^ mask)
			if err := c.step(ctx, partner, buf, partner, tmp, false, false); err != nil {
				return err
			}
			c.red(buf, tmp, partner < c.rank)
		}
	}
	return c.foldOut(ctx, buf)
}

// blocks splits n elements of esz bytes into p blocks (the first n mod
// p blocks one element longer) and returns block i's byte range.
func blockRange(n, p, i, esz int) (int, int) {
	q, r := n/p, n%p
	lo := i*q + min(i, r)
	hi := lo + q
	if i < r {
		hi++
	}
	return lo * esz, hi * esz
}

// ringAllreduce: reduce-scatter around the ring in p−1 steps (in step s,
// send block r−s to the right and reduce block r−s−1 from the left into
// place), then allgather in p−1 steps. Each block's result is computed
// at one rank, in ring order starting at the block's index; chunks
// pipeline within each step. When buf lies in a Buffer, the left
// neighbour writes the allgather's blocks straight into it (land.go):
// each rank announces its buffer (or that it has none) to its left
// neighbour after its reduce-scatter, which the neighbour waits for
// before its allgather. Out of place (in not nil), the input is not
// copied into buf beforehand: the first step sends block r from in, and
// each chunk received in the reduce-scatter is combined with in's copied
// into buf just before (cache-hot); block r of buf is written only by
// the allgather.
func (c *Comm) ringAllreduce(ctx context.Context, in, buf []byte, esz int) error {
	p, r := c.size, c.rank
	n := len(buf) / esz
	left, right := (r-1+p)%p, (r+1)%p
	blkOf := func(b []byte, i int) []byte {
		lo, hi := blockRange(n, p, ((i%p)+p)%p, esz)
		return b[lo:hi]
	}
	blk := func(i int) []byte { return blkOf(buf, i) }
	for s := range p - 1 {
		src, init := blk(r-s), []byte(nil)
		if in != nil {
			init = blkOf(in, r-s-1) // every block but r is first combined here
			if s == 0 {
				src = blkOf(in, r)
			}
		}
		c.sends = append(c.sends[:0], flow{peer: right, buf: src})
		c.recvs = append(c.recvs[:0], flow{peer: left, buf: blk(r - s - 1), reduce: true, srcLow: true, init: init})
		if err := c.run(ctx, c.sends, c.recvs); err != nil {
			return err
		}
	}
	// Announced once this rank is done with its reduce-scatter, which
	// reads and writes the blocks the allgather lands in.
	reg, err := c.announce(ctx, left, buf)
	if err != nil {
		return err
	}
	defer unuse(reg)
	for s := range p - 1 {
		// The block sent lies at the same offset in the right
		// neighbour's vector.
		lo, _ := blockRange(n, p, ((r+1-s)%p+p)%p, esz)
		c.sends = append(c.sends[:0], flow{peer: right, buf: blk(r + 1 - s), land: landWait, landOff: lo, landTotal: len(buf)})
		c.recvs = append(c.recvs[:0], flow{peer: left, buf: blk(r - s), landed: reg != nil})
		if err := c.run(ctx, c.sends, c.recvs); err != nil {
			return err
		}
	}
	return nil
}

// rabenseifner: fold in; reduce-scatter by recursive halving (in round
// k, exchange half of the current range with position nr XOR 2^k,
// keeping the lower half at the lower position); allgather by recursive
// doubling in the reverse order; fold out. Halving with the nearest
// partner first combines partial results of ever larger groups of
// consecutive positions, lower group on the left: rank order, as Custom
// operations need (position nr ends up owning block bitreverse(nr)).
func (c *Comm) rabenseifner(ctx context.Context, buf []byte, esz int) error {
	nr, err := c.foldIn(ctx, buf)
	if err != nil {
		return err
	}
	if nr >= 0 {
		q := pof2(c.size)
		n := len(buf) / esz
		// Position nr ends up owning block nr of q blocks. Track the range
		// [lo, hi) of blocks this position is responsible for.
		lo, hi := 0, q
		tmp := c.scratchBytes(len(buf))
		for half := 1; half < q; half *= 2 {
			partner := nr ^ half
			mid := lo + (hi-lo)/2
			keepLo, keepHi, sendLo, sendHi := lo, mid, mid, hi
			if nr&half != 0 {
				keepLo, keepHi, sendLo, sendHi = mid, hi, lo, mid
			}
			kb, ke := blockStart(n, q, keepLo, esz), blockStart(n, q, keepHi, esz)
			sb, se := blockStart(n, q, sendLo, esz), blockStart(n, q, sendHi, esz)
			pr := c.realRank(partner)
			if err := c.step(ctx, pr, buf[sb:se], pr, tmp[kb:ke], false, false); err != nil {
				return err
			}
			c.red(buf[kb:ke], tmp[kb:ke], pr < c.rank)
			lo, hi = keepLo, keepHi
		}
		for half := q / 2; half >= 1; half /= 2 {
			partner := nr ^ half
			// The partner owns the sibling range of the same size.
			size := hi - lo
			plo := lo + size
			if nr&half != 0 {
				plo = lo - size
			}
			sb, se := blockStart(n, q, lo, esz), blockStart(n, q, hi, esz)
			rb, re := blockStart(n, q, plo, esz), blockStart(n, q, plo+size, esz)
			pr := c.realRank(partner)
			if err := c.step(ctx, pr, buf[sb:se], pr, buf[rb:re], false, false); err != nil {
				return err
			}
			lo, hi = min(lo, plo), max(hi, plo+size)
		}
	}
	return c.foldOut(ctx, buf)
}

// blockStart returns the first byte of block i of p (n·esz for i = p).
func blockStart(n, p, i, esz int) int {
	lo, _ := blockRange(n, p, i, esz)
	return lo
}
