package collective

import "context"

// Barrier returns once every rank of the communicator has entered it:
// a dissemination barrier of ⌈log2 p⌉ rounds of empty messages (in round
// k, rank r signals r+2^k and waits for r−2^k), on the communicator's
// windows. It fails, naming the rank, when a rank of the world failed,
// like every collective.
func Barrier(ctx context.Context, c *Comm) error {
	t, err := c.begin(ctx, callInfo{kind: kindBarrier, root: -1})
	if err != nil {
		return err
	}
	p, r := c.size, c.rank
	for d := 1; d < p && err == nil; d <<= 1 {
		err = c.step(ctx, (r+d)%p, nil, (r-d+p)%p, nil, false, false)
	}
	return c.end(t, err)
}
