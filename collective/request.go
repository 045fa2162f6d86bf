package collective

import (
	"context"
	"fmt"

	"github.com/goverbs/verbs"
)

// Request is a collective in progress, started by a non-blocking twin
// (IAllreduce, IBarrier, ...). Calls of a communicator run one at a
// time in the order they were issued, blocking and non-blocking alike:
// a non-blocking call takes its place in that order when it is issued
// and runs, driven by the library, once the calls issued before it have
// finished; a blocking call issued after it waits for it. Until the
// request completes, the call's buffers belong to the library: do not
// touch them (a Buffer they lie in cannot be closed: ErrBufferBusy).
//
// A Request is safe for concurrent use.
type Request struct {
	done chan struct{}
	err  error
}

// Wait waits until the collective completes and returns its error, or
// until ctx ends (then it returns ctx's error wrapped in verbs.ErrTimeout
// and the collective goes on: the context given when the call was issued
// bounds the collective itself).
func (r *Request) Wait(ctx context.Context) error {
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("collective: waiting for a request: %w: %w", verbs.ErrTimeout, ctx.Err())
	}
}

// Test reports whether the collective has completed, and its error if it
// has.
func (r *Request) Test() (bool, error) {
	select {
	case <-r.done:
		return true, r.err
	default:
		return false, nil
	}
}

// Done returns a channel closed when the collective completes.
func (r *Request) Done() <-chan struct{} { return r.done }

type ticketKey struct{}

// heldTicket is the place in the order of calls a non-blocking call took
// when it was issued; begin uses it instead of taking a new one.
type heldTicket struct {
	t     uint64
	used  bool
	ended bool // the call ended and left its turn to the request (handOn)
}

// start issues f (a blocking collective of c) as a non-blocking call: it
// takes f's place in the order now, and runs f in a goroutine. The
// Buffers that data (the call's slices) lie in count the request as a
// user until it completes (Buffer.Close fails with ErrBufferBusy): a
// request waiting for its turn would otherwise run on freed memory.
func (c *Comm) start(ctx context.Context, f func(ctx context.Context) error, data ...[]byte) *Request {
	r := &Request{done: make(chan struct{})}
	if c.ranks == nil {
		r.err = f(ctx) // fails at once (zeroErr): a zero Comm has no order
		close(r.done)
		return r
	}
	var hold callHold
	c.bufs.holdCall(&hold, data...)
	held := &heldTicket{t: c.ticket()}
	ctx = context.WithValue(ctx, ticketKey{}, held)
	go func() {
		handOn := false
		defer func() {
			// Last: the request is complete (r.done closed) before the
			// calls issued after it may run and return.
			if handOn || held.ended {
				c.done(held.t)
			}
		}()
		defer close(r.done)
		defer hold.release()
		returned := false
		defer func() {
			if !returned && r.err == nil {
				// A Custom operation ended the goroutine (runtime.Goexit):
				// the call ended with the communicator poisoned (catchOp).
				r.err = fmt.Errorf("%w: the operation called runtime.Goexit", ErrOpPanicked)
			}
		}()
		r.err = f(ctx)
		returned = true
		if !held.used {
			// f failed before it took its turn (bad arguments): give the
			// turn up in order, so the calls issued after it run.
			handOn = c.await(context.Background(), held.t) == nil
		}
	}()
	return r
}

// IAllreduce is the non-blocking twin of Allreduce.
func IAllreduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allreduce(ctx, c, send, recv, op) }, bytesOf(send), bytesOf(recv))
}

// IBarrier is the non-blocking twin of Barrier.
func IBarrier(ctx context.Context, c *Comm) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Barrier(ctx, c) })
}

// IBroadcast is the non-blocking twin of Broadcast.
func IBroadcast[T Number](ctx context.Context, c *Comm, buf []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Broadcast(ctx, c, buf, root) }, bytesOf(buf))
}

// IReduce is the non-blocking twin of Reduce.
func IReduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Reduce(ctx, c, send, recv, op, root) }, bytesOf(send), bytesOf(recv))
}

// IAllgather is the non-blocking twin of Allgather.
func IAllgather[T Number](ctx context.Context, c *Comm, send, recv []T) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allgather(ctx, c, send, recv) }, bytesOf(send), bytesOf(recv))
}

// IAllgatherv is the non-blocking twin of Allgatherv.
func IAllgatherv[T Number](ctx context.Context, c *Comm, send, recv []T, counts, displs []int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allgatherv(ctx, c, send, recv, counts, displs) }, bytesOf(send), bytesOf(recv))
}

// IReduceScatter is the non-blocking twin of ReduceScatter.
func IReduceScatter[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ReduceScatter(ctx, c, send, recv, op) }, bytesOf(send), bytesOf(recv))
}

// IReduceScatterV is the non-blocking twin of ReduceScatterV.
func IReduceScatterV[T Number](ctx context.Context, c *Comm, send, recv []T, counts []int, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ReduceScatterV(ctx, c, send, recv, counts, op) }, bytesOf(send), bytesOf(recv))
}

// IAlltoall is the non-blocking twin of Alltoall.
func IAlltoall[T Number](ctx context.Context, c *Comm, send, recv []T) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Alltoall(ctx, c, send, recv) }, bytesOf(send), bytesOf(recv))
}

// IAlltoallv is the non-blocking twin of Alltoallv.
func IAlltoallv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, sdispls []int, recv []T, recvcounts, rdispls []int) *Request {
	return c.start(ctx, func(ctx context.Context) error {
		return Alltoallv(ctx, c, send, sendcounts, sdispls, recv, recvcounts, rdispls)
	}, bytesOf(send), bytesOf(recv))
}

// IGather is the non-blocking twin of Gather.
func IGather[T Number](ctx context.Context, c *Comm, send, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Gather(ctx, c, send, recv, root) }, bytesOf(send), bytesOf(recv))
}

// IGatherv is the non-blocking twin of Gatherv.
func IGatherv[T Number](ctx context.Context, c *Comm, send, recv []T, recvcounts, displs []int, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Gatherv(ctx, c, send, recv, recvcounts, displs, root) }, bytesOf(send), bytesOf(recv))
}

// IScatter is the non-blocking twin of Scatter.
func IScatter[T Number](ctx context.Context, c *Comm, send, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scatter(ctx, c, send, recv, root) }, bytesOf(send), bytesOf(recv))
}

// IScatterv is the non-blocking twin of Scatterv.
func IScatterv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, displs []int, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scatterv(ctx, c, send, sendcounts, displs, recv, root) }, bytesOf(send), bytesOf(recv))
}

// IScan is the non-blocking twin of Scan.
func IScan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scan(ctx, c, send, recv, op) }, bytesOf(send), bytesOf(recv))
}

// IExScan is the non-blocking twin of ExScan.
func IExScan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ExScan(ctx, c, send, recv, op) }, bytesOf(send), bytesOf(recv))
}
