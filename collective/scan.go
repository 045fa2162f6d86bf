package collective

import "context"

// Scan computes the inclusive prefix reduction of the vectors send in
// rank order: rank r receives x_0 ⊕ x_1 ⊕ … ⊕ x_r in recv, element by
// element (x_i being rank i's send). send and recv have the same length
// at every rank; send may be nil or the same slice as recv (in place).
//
// Algorithm: recursive doubling (Hillis and Steele), ⌈log2 p⌉ rounds;
// in round k, rank r sends its partial result (of ranks r−2^k+1 to r) to
// rank r+2^k and combines the one of rank r−2^k on the left of its own.
// Partial results are always of consecutive ranks and combined lower on
// the left, so Custom operations may be non-commutative; the grouping
// follows the rounds (rank 5 of 6 gets (x_0 ⊕ x_1) ⊕ ((x_2 ⊕ x_3) ⊕
// (x_4 ⊕ x_5))), so floating-point results may differ in their last bits
// from a sequential left-to-right sum.
func Scan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) error {
	return scan(ctx, c, kindScan, send, recv, op)
}

// ExScan computes the exclusive prefix reduction of the vectors send in
// rank order: rank r > 0 receives x_0 ⊕ … ⊕ x_r−1 in recv; rank 0's recv
// is left untouched (in place: it keeps rank 0's input). Arguments,
// algorithm (one more reduction per round: the exclusive result and the
// partial result to send are kept apart) and order as Scan's.
func ExScan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) error {
	return scan(ctx, c, kindExScan, send, recv, op)
}

func scan[T Number](ctx context.Context, c *Comm, kind uint8, send, recv []T, op Op) (err error) {
	if send == nil {
		send = recv
	}
	info := callInfo{kind: kind, op: op.kind, opID: op.id, dtype: dtypeOf[T](), root: -1, count: uint64(len(recv))}
	if len(send) != len(recv) {
		return c.argErr(kind, "send has %d elements, recv %d", len(send), len(recv))
	}
	if overlapPartly(send, recv) {
		return c.argErr(kind, "send and recv overlap without being the same slice")
	}
	red, err := reducerFor[T](op)
	if err != nil {
		return c.argErr(kind, "%w", err)
	}
	t, err := c.begin(ctx, info, bytesOf(send), bytesOf(recv))
	if err != nil {
		return err
	}
	defer c.catchOp(t, &err)
	c.red = red
	sb, rb := bytesOf(send), bytesOf(recv)
	p, r := c.size, c.rank
	if kind == kindScan {
		// The partial result is recv itself.
		if len(sb) > 0 && &sb[0] != &rb[0] {
			copy(rb, sb)
		}
		tmp := c.scratchBytes(len(rb))
		for d := 1; d < p && err == nil; d <<= 1 {
			sp, rp := peerAt(r+d, p), peerAt(r-d, p)
			if err = c.step(ctx, sp, rb, rp, tmp, false, false); err == nil && rp >= 0 {
				c.red(rb, tmp, true)
			}
		}
		return c.end(t, err)
	}
	// ExScan: the partial result acc (of ranks r−2^k+1 to r) apart from
	// the exclusive result in recv (of ranks r−2^k+1 to r−1).
	buf := c.scratchBytes(2 * len(rb))
	acc, tmp := buf[:len(rb)], buf[len(rb):]
	copy(acc, sb)
	have := false
	for d := 1; d < p && err == nil; d <<= 1 {
		sp, rp := peerAt(r+d, p), peerAt(r-d, p)
		if err = c.step(ctx, sp, acc, rp, tmp, false, false); err != nil || rp < 0 {
			continue
		}
		if r+2*d < p { // acc is sent again
			c.red(acc, tmp, true)
		}
		if have {
			c.red(rb, tmp, true)
		} else {
			copy(rb, tmp)
			have = true
		}
	}
	return c.end(t, err)
}

// peerAt returns i if it is a rank of a communicator of p, else -1.
func peerAt(i, p int) int {
	if i < 0 || i >= p {
		return -1
	}
	return i
}
