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
// touch them.
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
	t    uint64
	used bool
}

// start issues f (a blocking collective of c) as a non-blocking call: it
// takes f's place in the order now, and runs f in a goroutine.
func (c *Comm) start(ctx context.Context, f func(ctx context.Context) error) *Request {
	r := &Request{done: make(chan struct{})}
	held := &heldTicket{t: c.ticket()}
	ctx = context.WithValue(ctx, ticketKey{}, held)
	go func() {
		defer close(r.done)
		r.err = f(ctx)
		if !held.used {
			// f failed before it took its turn (bad arguments): give the
			// turn up in order, so the calls issued after it run.
			if c.await(context.Background(), held.t) == nil {
				c.done(held.t)
			}
		}
	}()
	return r
}

// IAllreduce is the non-blocking twin of Allreduce.
func IAllreduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allreduce(ctx, c, send, recv, op) })
}

// IBarrier is the non-blocking twin of Barrier.
func IBarrier(ctx context.Context, c *Comm) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Barrier(ctx, c) })
}

// IBroadcast is the non-blocking twin of Broadcast.
func IBroadcast[T Number](ctx context.Context, c *Comm, buf []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Broadcast(ctx, c, buf, root) })
}

// IReduce is the non-blocking twin of Reduce.
func IReduce[T Number](ctx context.Context, c *Comm, send, recv []T, op Op, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Reduce(ctx, c, send, recv, op, root) })
}

// IAllgather is the non-blocking twin of Allgather.
func IAllgather[T Number](ctx context.Context, c *Comm, send, recv []T) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allgather(ctx, c, send, recv) })
}

// IAllgatherv is the non-blocking twin of Allgatherv.
func IAllgatherv[T Number](ctx context.Context, c *Comm, send, recv []T, counts, displs []int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Allgatherv(ctx, c, send, recv, counts, displs) })
}

// IReduceScatter is the non-blocking twin of ReduceScatter.
func IReduceScatter[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ReduceScatter(ctx, c, send, recv, op) })
}

// IReduceScatterV is the non-blocking twin of ReduceScatterV.
func IReduceScatterV[T Number](ctx context.Context, c *Comm, send, recv []T, counts []int, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ReduceScatterV(ctx, c, send, recv, counts, op) })
}

// IAlltoall is the non-blocking twin of Alltoall.
func IAlltoall[T Number](ctx context.Context, c *Comm, send, recv []T) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Alltoall(ctx, c, send, recv) })
}

// IAlltoallv is the non-blocking twin of Alltoallv.
func IAlltoallv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, sdispls []int, recv []T, recvcounts, rdispls []int) *Request {
	return c.start(ctx, func(ctx context.Context) error {
		return Alltoallv(ctx, c, send, sendcounts, sdispls, recv, recvcounts, rdispls)
	})
}

// IGather is the non-blocking twin of Gather.
func IGather[T Number](ctx context.Context, c *Comm, send, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Gather(ctx, c, send, recv, root) })
}

// IGatherv is the non-blocking twin of Gatherv.
func IGatherv[T Number](ctx context.Context, c *Comm, send, recv []T, recvcounts, displs []int, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Gatherv(ctx, c, send, recv, recvcounts, displs, root) })
}

// IScatter is the non-blocking twin of Scatter.
func IScatter[T Number](ctx context.Context, c *Comm, send, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scatter(ctx, c, send, recv, root) })
}

// IScatterv is the non-blocking twin of Scatterv.
func IScatterv[T Number](ctx context.Context, c *Comm, send []T, sendcounts, displs []int, recv []T, root int) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scatterv(ctx, c, send, sendcounts, displs, recv, root) })
}

// IScan is the non-blocking twin of Scan.
func IScan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return Scan(ctx, c, send, recv, op) })
}

// IExScan is the non-blocking twin of ExScan.
func IExScan[T Number](ctx context.Context, c *Comm, send, recv []T, op Op) *Request {
	return c.start(ctx, func(ctx context.Context) error { return ExScan(ctx, c, send, recv, op) })
}
