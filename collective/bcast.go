package collective

import (
	"context"
	"math/bits"
)

// BcastSmallMax is the message size (bytes) below which AlgAuto
// broadcasts along a binomial tree; from it on, along a pipelined chain.
// See Broadcast for how it was measured.
const BcastSmallMax = 64 << 10

// Broadcast copies buf of rank root into buf of every other rank. buf
// has the same length at every rank, and every rank names the same root.
//
// Algorithms (Options.Algorithm forces one; AlgAuto chooses by size):
//
//   - binomial tree (AlgRecursiveDoubling; AlgAuto below BcastSmallMax
//     bytes): ⌈log2 p⌉ latencies. Each rank forwards every chunk to its
//     children as soon as it has arrived, so large messages pipeline too,
//     but the root sends the whole message ⌈log2 p⌉ times.
//   - pipelined chain (AlgRing; AlgAuto from BcastSmallMax on): root →
//     root+1 → … → root−1, each rank forwarding a chunk as soon as it has
//     it: p−1 + (chunks) chunk latencies, every rank sends the message at
//     most once.
//   - scatter and ring allgather (AlgRabenseifner; van de Geijn): the
//     root scatters p blocks along a binomial tree, then the ranks
//     allgather them around a ring (p−1 steps); about twice the message
//     per rank, but no rank sends more than that.
//
// Measured in this package's in-process worlds (soft0, ranks as
// goroutines on 2 shared processors under heavy load from other jobs,
// go test -run NONE -bench Broadcast -benchtime=10x -count=3): the
// scatter-allgather was the slowest at every size (it moves the most
// bytes, and in one process bytes are processor time); the tree and the
// chain were within the noise of each other from 256 KiB on (medians at
// p = 4: 4.5 vs 2.1 ms at 256 KiB, 53 vs 94 ms at 4 MiB; at p = 8: 19
// vs 25 ms, 165 vs 150 ms). AlgAuto takes the chain from BcastSmallMax
// on because it sends every byte once per rank, where the tree's root
// sends it ⌈log2 p⌉ times over its one link; the threshold is to be
// tuned across processes.
//
// A rank detects a disagreeing call (other root, length or element type)
// when it receives a chunk of it (ErrMismatch); a rank waiting for a
// message that a disagreeing rank never sends fails at its context's end
// or Options.Timeout. A rank that receives nothing from a disagreeing
// rank in the call (the root always) cannot know: the disagreement
// surfaces at the next call that receives from it, or else at Close
// (ErrMismatch: the disagreeing rank's message was never taken in; see
// Comm.Close).
func Broadcast[T Number](ctx context.Context, c *Comm, buf []T, root int) error {
	info := callInfo{kind: kindBroadcast, dtype: dtypeOf[T](), root: int32(root), count: uint64(len(buf))}
	t, err := c.begin(ctx, info, bytesOf(buf))
	if err != nil {
		return err
	}
	if root < 0 || root >= c.size {
		return c.end(t, c.argErr(info.kind, "root %d out of range [0, %d)", root, c.size))
	}
	return c.end(t, c.broadcast(ctx, bytesOf(buf), elemSize[T](), root))
}

// broadcast sends buf (whole elements of esz bytes) of root to every
// rank.
func (c *Comm) broadcast(ctx context.Context, buf []byte, esz, root int) error {
	if c.size == 1 {
		return nil
	}
	switch c.bcastAlg(len(buf), esz) {
	case AlgRing:
		return c.chainBcast(ctx, buf, root)
	case AlgRabenseifner:
		return c.scatterAllgatherBcast(ctx, buf, esz, root)
	}
	return c.binomialBcast(ctx, buf, root)
}

// bcastAlg is the algorithm of a broadcast of n bytes in elements of esz
// bytes: Options.Algorithm, or by size; Rabenseifner (scatter, then
// allgather) only with an element for each rank, else the binomial tree
// (AlgRecursiveDoubling).
func (c *Comm) bcastAlg(n, esz int) Algorithm {
	alg := c.opts.Algorithm
	if alg == AlgAuto {
		alg = AlgRecursiveDoubling
		if n >= BcastSmallMax {
			alg = AlgRing
		}
	}
	if alg == AlgRabenseifner && n/esz < c.size {
		alg = AlgRecursiveDoubling
	}
	return alg
}

// BroadcastAlgorithm names the algorithm of a Broadcast on c of n bytes
// in elements of esz bytes: "recursive doubling" (the binomial tree),
// "rabenseifner" (scatter, then allgather) or "ring" (the pipelined
// chain).
func (c *Comm) BroadcastAlgorithm(n, esz int) string {
	if esz <= 0 {
		return "none"
	}
	return c.bcastAlg(n, esz).String()
}

// lowbit returns the lowest set bit of v > 0; for v = 0, the smallest
// power of two ≥ p (the span of the root of a binomial tree of p ranks).
func lowbit(v, p int) int {
	if v == 0 {
		return 1 << bits.Len(uint(p-1))
	}
	return v & -v
}

// binomialBcast: relative rank v = rank − root; v receives from v −
// lowbit(v) and sends to v + d for every power of two d < lowbit(v)
// (largest subtree first), all in one run, each send forwarding what the
// receive has filled in.
func (c *Comm) binomialBcast(ctx context.Context, buf []byte, root int) error {
	p := c.size
	v := (c.rank - root + p) % p
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	var after *flow
	if v != 0 {
		c.recvs = append(c.recvs, flow{peer: (v - lowbit(v, p) + root) % p, buf: buf})
		after = &c.recvs[0]
	}
	for d := lowbit(v, p) / 2; d >= 1; d /= 2 {
		if v+d < p {
			c.sends = append(c.sends, flow{peer: (v + d + root) % p, buf: buf, after: after})
		}
	}
	return c.run(ctx, c.sends, c.recvs)
}

// chainBcast: relative rank v receives from v−1 and forwards each chunk
// to v+1 as it arrives.
func (c *Comm) chainBcast(ctx context.Context, buf []byte, root int) error {
	p := c.size
	v := (c.rank - root + p) % p
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	var after *flow
	if v != 0 {
		c.recvs = append(c.recvs, flow{peer: (c.rank - 1 + p) % p, buf: buf})
		after = &c.recvs[0]
	}
	if v != p-1 {
		c.sends = append(c.sends, flow{peer: (c.rank + 1) % p, buf: buf, after: after})
	}
	return c.run(ctx, c.sends, c.recvs)
}

// scatterAllgatherBcast: block j (of p, blockRange) belongs to relative
// rank j. The root scatters the blocks along the binomial tree (relative
// rank v receives the blocks of its subtree [v, v+lowbit(v)) from its
// parent, then hands each child its subtree's blocks), then the ranks
// allgather the blocks around the ring of relative ranks: in step s,
// send block v−s to v+1 and receive block v−s−1 from v−1.
func (c *Comm) scatterAllgatherBcast(ctx context.Context, buf []byte, esz, root int) error {
	p := c.size
	n := len(buf) / esz
	v := (c.rank - root + p) % p
	span := func(lo, hi int) []byte { // blocks [lo, hi) of relative ranks
		return buf[blockStart(n, p, lo, esz):blockStart(n, p, min(hi, p), esz)]
	}
	lb := lowbit(v, p)
	if v != 0 {
		parent := (v - lb + root) % p
		if err := c.step(ctx, -1, nil, parent, span(v, v+lb), false, false); err != nil {
			return err
		}
	}
	c.sends, c.recvs = c.sends[:0], c.recvs[:0]
	for d := lb / 2; d >= 1; d /= 2 {
		if v+d < p {
			c.sends = append(c.sends, flow{peer: (v + d + root) % p, buf: span(v+d, v+2*d)})
		}
	}
	if len(c.sends) > 0 {
		if err := c.run(ctx, c.sends, nil); err != nil {
			return err
		}
	}
	left, right := (c.rank-1+p)%p, (c.rank+1)%p
	for s := range p - 1 {
		si, ri := (v-s+p)%p, (v-s-1+p)%p
		if err := c.step(ctx, right, span(si, si+1), left, span(ri, ri+1), false, false); err != nil {
			return err
		}
	}
	return nil
}
