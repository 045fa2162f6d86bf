package collective

import "context"

// AllgatherSmallMax is the size (bytes of recv) below which AlgAuto
// allgathers by recursive doubling (p a power of two) or Bruck's
// algorithm (other p); from it on, around a ring. See Allgather for how
// it was measured.
const AllgatherSmallMax = 16 << 10

// Allgather collects the vectors send of every rank, all of the same
// length m, into recv at every rank: rank i's vector lands in recv[i·m :
// (i+1)·m]. recv has p·m elements. send may be nil (in place: this
// rank's vector is already at its place in recv) or that very subslice
// of recv; it may not overlap recv otherwise.
//
// Algorithms (Options.Algorithm forces one; AlgAuto chooses by the size
// of recv):
//
//   - recursive doubling (AlgRecursiveDoubling or AlgRabenseifner, p a
//     power of two; AlgAuto below AllgatherSmallMax bytes): in round k,
//     exchange the 2^k blocks gathered so far with rank r XOR 2^k, in
//     place in recv; log2 p latencies.
//   - Bruck (the same, p not a power of two): in round k, send the
//     2^k blocks gathered so far (in the order r, r+1, …) to rank r−2^k
//     and receive as many from r+2^k, in scratch memory, then put the
//     blocks in their places; ⌈log2 p⌉ latencies and one more copy of
//     recv.
//   - ring (AlgRing; AlgAuto from AllgatherSmallMax on): p−1 steps; in
//     step s, send block r−s to r+1 and receive block r−s−1 from r−1,
//     chunks pipelined within each step; every rank sends and receives
//     (p−1)·m elements, the least possible.
//
// Measured in this package's in-process worlds (soft0, 2 shared
// processors under heavy load, go test -run NONE -bench Allgather
// -benchtime=10x): the ring was ahead from 16 KiB of recv on at p = 4
// and 8 (p = 8, 16 KiB: 7.3 ms, recursive doubling 16 ms; 256 KiB:
// 35 vs 81 ms), so AlgAuto keeps the logarithmic algorithms, whose gain
// is latency, below AllgatherSmallMax (16 KiB).
//
// A rank detects a disagreeing call (other count or element type) when
// it receives a chunk of it (ErrMismatch).
func Allgather[T Number](ctx context.Context, c *Comm, send, recv []T) error {
	if err := c.zeroErr(kindAllgather); err != nil {
		return err // before the division by the size
	}
	m := len(send)
	if send == nil {
		m = len(recv) / c.size
	}
	info := callInfo{kind: kindAllgather, dtype: dtypeOf[T](), root: -1, count: uint64(m)}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	if len(recv) != c.size*m {
		if send == nil {
			return c.end(t, c.argErr(info.kind, "recv has %d elements, not a multiple of %d ranks", len(recv), c.size))
		}
		return c.end(t, c.argErr(info.kind, "recv has %d elements, want %d ranks × %d", len(recv), c.size, m))
	}
	own := recv[c.rank*m : (c.rank+1)*m]
	if send != nil && !sameMem(send, own) {
		if overlap(send, recv) {
			return c.end(t, c.argErr(info.kind, "send overlaps recv other than at this rank's block"))
		}
		copy(own, send)
	}
	l := layout{m: m, esz: elemSize[T](), contiguous: true}
	return c.end(t, c.allgather(ctx, bytesOf(recv), l))
}

// Allgatherv collects the vectors send of every rank, of any lengths,
// into recv at every rank: rank i's vector (counts[i] elements) lands at
// recv[displs[i]:]. counts and displs have one entry per rank, the same
// at every rank; the blocks lie inside recv and do not overlap each
// other. send has counts[r] elements at rank r, or is nil (in place:
// this rank's vector is already at recv[displs[r]:]) or that very
// subslice of recv.
//
// Algorithms: Allgather's, recursive doubling only when the blocks
// follow each other in rank order without gaps (else Bruck), chosen by
// the size of the blocks' total.
//
// Ranks that disagree on the counts are detected by the ranks that
// receive a message of theirs (ErrMismatch): the call's description,
// which every message carries, includes a hash of counts (not of displs,
// which only place the blocks in this rank's recv). So blocks are never
// placed by counts that differ from their sender's, also where a
// message bundles several blocks whose counts add up alike.
func Allgatherv[T Number](ctx context.Context, c *Comm, send, recv []T, counts, displs []int) error {
	info := callInfo{kind: kindAllgatherv, dtype: dtypeOf[T](), root: -1, count: countsHash(counts)}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	if err := c.checkBlocks(info.kind, "recv", counts, displs, len(recv), true); err != nil {
		return c.end(t, err)
	}
	r := c.rank
	own := recv[displs[r] : displs[r]+counts[r]]
	if send != nil && !sameMem(send, own) {
		switch {
		case len(send) != counts[r]:
			return c.end(t, c.argErr(info.kind, "send has %d elements, counts[%d] is %d", len(send), r, counts[r]))
		case overlap(send, recv):
			return c.end(t, c.argErr(info.kind, "send overlaps recv other than at this rank's block"))
		}
		copy(own, send)
	}
	l := layout{counts: counts, displs: displs, esz: elemSize[T](), contiguous: true}
	for i := 1; i < c.size; i++ {
		if displs[i] != displs[i-1]+counts[i-1] {
			l.contiguous = false
			break
		}
	}
	return c.end(t, c.allgather(ctx, bytesOf(recv), l))
}

// layout places the blocks of an allgather in recv, of a gather or a
// scatter in the root's recv or send: m elements each at
// i·m (counts nil), or counts[i] elements at displs[i]. contiguous: the
// blocks follow each other in rank order without gaps.
type layout struct {
	m              int
	counts, displs []int
	esz            int
	contiguous     bool
}

// span returns the element range of rank i's block.
func (l *layout) span(i int) (int, int) {
	if l.counts == nil {
		return i * l.m, (i + 1) * l.m
	}
	return l.displs[i], l.displs[i] + l.counts[i]
}

// block returns the byte range of rank i's block.
func (l *layout) block(i int) (int, int) {
	lo, hi := l.span(i)
	return lo * l.esz, hi * l.esz
}

// size returns the bytes of rank i's block.
func (l *layout) size(i int) int {
	lo, hi := l.block(i)
	return hi - lo
}

// allgather gathers the blocks of l in buf at every rank.
func (c *Comm) allgather(ctx context.Context, buf []byte, l layout) error {
	p := c.size
	if p == 1 {
		return nil
	}
	total := 0
	for i := range p {
		total += l.size(i)
	}
	switch c.allgatherAlg(total, l.contiguous) {
	case agRing:
		return c.ringAllgather(ctx, buf, &l)
	case agDoubling:
		return c.doublingAllgather(ctx, buf, &l)
	}
	return c.bruckAllgather(ctx, buf, &l, total)
}

// The algorithms of an allgather (allgatherAlg).
const (
	agRing     = iota // the ring
	agDoubling        // recursive doubling: p a power of two, blocks contiguous
	agBruck           // Bruck's, for any p
)

// allgatherAlg chooses the algorithm of an allgather of total bytes:
// Options.Algorithm's family (AlgRabenseifner has none of its own: the
// doubling family's), or by size.
func (c *Comm) allgatherAlg(total int, contiguous bool) int {
	alg := c.opts.Algorithm
	if alg == AlgAuto {
		alg = AlgRecursiveDoubling
		if total >= AllgatherSmallMax {
			alg = AlgRing
		}
	}
	switch p := c.size; {
	case alg == AlgRing:
		return agRing
	case p&(p-1) == 0 && contiguous:
		return agDoubling
	}
	return agBruck
}

// AllgatherAlgorithm names the algorithm of an Allgather on c of n bytes
// (the whole vector, blocks in rank order): "ring", "recursive doubling"
// or "bruck".
func (c *Comm) AllgatherAlgorithm(n int) string {
	return [...]string{agRing: "ring", agDoubling: "recursive doubling", agBruck: "bruck"}[c.allgatherAlg(n, true)]
}

// doublingAllgather: see Allgather (p a power of two, blocks contiguous).
func (c *Comm) doublingAllgather(ctx context.Context, buf []byte, l *layout) error {
	r := c.rank
	for d := 1; d < c.size; d <<= 1 {
		partner := r ^ d
		mine, theirs := r&^(d-1), partner&^(d-1) // first ranks of the two groups
		sLo, _ := l.block(mine)
		_, sHi := l.block(mine + d - 1)
		rLo, _ := l.block(theirs)
		_, rHi := l.block(theirs + d - 1)
		if err := c.step(ctx, partner, buf[sLo:sHi], partner, buf[rLo:rHi], false, false); err != nil {
			return err
		}
	}
	return nil
}

// bruckAllgather: see Allgather. tmp holds the blocks of ranks r, r+1,
// … back to back; pre(j) is where the block of rank r+j starts.
func (c *Comm) bruckAllgather(ctx context.Context, buf []byte, l *layout, total int) error {
	p, r := c.size, c.rank
	tmp := c.scratchBytes(total)
	pre := func(j int) int {
		if l.counts == nil {
			return j * l.m * l.esz
		}
		off := 0
		for i := range j {
			off += l.size((r + i) % p)
		}
		return off
	}
	lo, hi := l.block(r)
	copy(tmp, buf[lo:hi])
	for d := 1; d < p; d <<= 1 {
		cnt := min(d, p-d)
		if err := c.step(ctx, (r-d+p)%p, tmp[:pre(cnt)], (r+d)%p, tmp[pre(d):pre(d+cnt)], false, false); err != nil {
			return err
		}
	}
	off := 0
	for j := range p {
		i := (r + j) % p
		lo, hi := l.block(i)
		if j > 0 {
			copy(buf[lo:hi], tmp[off:off+hi-lo])
		}
		off += hi - lo
	}
	return nil
}

// ringAllgather: see Allgather.
func (c *Comm) ringAllgather(ctx context.Context, buf []byte, l *layout) error {
	p, r := c.size, c.rank
	left, right := (r-1+p)%p, (r+1)%p
	for s := range p - 1 {
		sLo, sHi := l.block((r - s + p) % p)
		rLo, rHi := l.block((r - s - 1 + p) % p)
		if err := c.step(ctx, right, buf[sLo:sHi], left, buf[rLo:rHi], false, false); err != nil {
			return err
		}
	}
	return nil
}
