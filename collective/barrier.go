package collective

import "context"

// Barrier returns once every rank of the communicator has entered it.
// Where every rank has a processor it takes ⌈log2 p⌉ rounds of empty
// messages: with p a power of two a butterfly (in round k, rank r and r
// XOR 2^k signal each other, as in the recursive doubling of a small
// Allreduce): a pair's signals cross, and each carries the
// acknowledgement of the other's slot, so no round needs a separate
// acknowledgement write; other sizes use a dissemination barrier (in
// round k, rank r signals r+2^k and waits for r−2^k), whose
// acknowledgements travel apart from the signals (a third more writes).
// Where some rank's machine has more ranks than processors (its waits
// yield: every rank learns it from the window descriptors, so all choose
// alike) and p > 2, every rank signals rank 0, which releases them all
// once it heard from every one: 2(p−1) messages instead of p⌈log2 p⌉,
// and fewer turns of the ranks that share a processor (8 ranks on 2
// CPUs, soft0 shared memory: 28-44 µs against 49-77 µs for the
// butterfly, median of the slowest rank, three alternating runs). It
// fails, naming the rank, when a rank of the world failed, like every
// collective.
func Barrier(ctx context.Context, c *Comm) error {
	t, err := c.begin(ctx, callInfo{kind: kindBarrier, root: -1})
	if err != nil {
		return err
	}
	p, r := c.size, c.rank
	if c.gathers() {
		return c.end(t, c.gatherBarrier(ctx))
	}
	for d := 1; d < p && err == nil; d <<= 1 {
		if p&(p-1) == 0 {
			err = c.step(ctx, r^d, nil, r^d, nil, false, false)
		} else {
			err = c.step(ctx, (r+d)%p, nil, (r-d+p)%p, nil, false, false)
		}
	}
	return c.end(t, err)
}

// gatherBarrier is Barrier through rank 0: every other rank signals it
// and waits for its release.
func (c *Comm) gatherBarrier(ctx context.Context) error {
	if c.rank != 0 {
		return c.viaRoot(ctx, nil)
	}
	if err := c.gatherAt0(ctx, nil, 0); err != nil {
		return err
	}
	return c.releaseFrom0(ctx, nil)
}

// viaRoot, at a rank other than 0, sends buf to rank 0, then receives
// rank 0's answer into it (buf nil: empty messages).
func (c *Comm) viaRoot(ctx context.Context, buf []byte) error {
	if err := c.step(ctx, 0, buf, -1, nil, false, false); err != nil {
		return err
	}
	return c.step(ctx, -1, nil, 0, buf, false, false)
}

// gatherAt0, at rank 0, receives rank q's n bytes into
// all[(q−1)n : qn] from every other rank q (n = 0, all nil: empty
// messages, arrivals).
func (c *Comm) gatherAt0(ctx context.Context, all []byte, n int) error {
	c.recvs = c.recvs[:0]
	for q := 1; q < c.size; q++ {
		c.recvs = append(c.recvs, flow{peer: q, buf: all[(q-1)*n : q*n]})
	}
	return c.run(ctx, nil, c.recvs)
}

// releaseFrom0, at rank 0, sends buf to every other rank.
func (c *Comm) releaseFrom0(ctx context.Context, buf []byte) error {
	c.sends = c.sends[:0]
	for q := 1; q < c.size; q++ {
		c.sends = append(c.sends, flow{peer: q, buf: buf})
	}
	return c.run(ctx, c.sends, nil)
}

// BarrierAlgorithm names the algorithm of Barrier on a communicator of
// p ranks that each have a processor: "butterfly" or "dissemination".
// See Comm.BarrierAlgorithm.
func BarrierAlgorithm(p int) string {
	if p&(p-1) == 0 {
		return "butterfly"
	}
	return "dissemination"
}

// BarrierAlgorithm names the algorithm of Barrier on c: "butterfly",
// "dissemination", or "gather" (through rank 0, where some rank's
// machine has more ranks than processors).
func (c *Comm) BarrierAlgorithm() string {
	if c.gathers() {
		return "gather"
	}
	return BarrierAlgorithm(c.size)
}

// gathers reports whether Barrier on c gathers at rank 0.
func (c *Comm) gathers() bool { return c.gather && c.size > 2 }
