package collective

import "context"

// Barrier returns once every rank of the communicator has entered it:
// ⌈log2 p⌉ rounds of empty messages. With p a power of two it is a
// butterfly (in round k, rank r and r XOR 2^k signal each other, as in
// the recursive doubling of a small Allreduce): a pair's signals cross,
// and each carries the acknowledgement of the other's slot, so no round
// needs a separate acknowledgement write. Other sizes use a dissemination
// barrier (in round k, rank r signals r+2^k and waits for r−2^k), whose
// acknowledgements travel apart from the signals (a third more writes).
// It fails, naming the rank, when a rank of the world failed, like every
// collective.
func Barrier(ctx context.Context, c *Comm) error {
	t, err := c.begin(ctx, callInfo{kind: kindBarrier, root: -1})
	if err != nil {
		return err
	}
	p, r := c.size, c.rank
	for d := 1; d < p && err == nil; d <<= 1 {
		if p&(p-1) == 0 {
			err = c.step(ctx, r^d, nil, r^d, nil, false, false)
		} else {
			err = c.step(ctx, (r+d)%p, nil, (r-d+p)%p, nil, false, false)
		}
	}
	return c.end(t, err)
}

// BarrierAlgorithm names the algorithm of Barrier on a communicator of
// p ranks: "butterfly" or "dissemination".
func BarrierAlgorithm(p int) string {
	if p&(p-1) == 0 {
		return "butterfly"
	}
	return "dissemination"
}
