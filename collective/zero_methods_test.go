package collective_test

import (
	"context"
	"errors"
	"testing"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/internal/zerocheck"
)

// TestZeroObjectMethods calls every exported method of the zero value of
// every object type with zero arguments (internal/zerocheck): none may
// panic, and those that return an error return one (wrapping ErrClosed:
// a zero Comm is as good as closed), except those of noError. Before,
// Close, Dup, Split and WorldRank of a zero Comm panicked, and so did
// every collective on it.
func TestZeroObjectMethods(t *testing.T) {
	zerocheck.Methods(t, []any{&collective.Comm{}, &collective.Request{}, &collective.Op{}}, map[string]bool{
		// As on a closed Comm: Close succeeds, Err says it is not
		// poisoned.
		"Comm.Close": true, "Comm.Err": true,
		// A zero Request was never issued: not done, no error.
		"Request.Test": true,
	})
}

// TestZeroCommCollectives: the collectives on a zero Comm fail with
// ErrClosed; none panics.
func TestZeroCommCollectives(t *testing.T) {
	ctx := context.Background()
	c := &collective.Comm{}
	buf := []float64{1, 2}
	for _, tc := range []struct {
		name string
		f    func() error
	}{
		{"Barrier", func() error { return collective.Barrier(ctx, c) }},
		{"Allreduce", func() error { return collective.Allreduce(ctx, c, buf, buf, collective.Sum) }},
		{"Broadcast", func() error { return collective.Broadcast(ctx, c, buf, 0) }},
		{"Reduce", func() error { return collective.Reduce(ctx, c, buf, buf, collective.Sum, 0) }},
		{"Allgather", func() error { return collective.Allgather(ctx, c, buf, buf) }},
		{"Alltoall", func() error { return collective.Alltoall(ctx, c, buf, buf) }},
		{"Gather", func() error { return collective.Gather(ctx, c, buf, buf, 0) }},
		{"Scatter", func() error { return collective.Scatter(ctx, c, buf, buf, 0) }},
		{"Scan", func() error { return collective.Scan(ctx, c, buf, buf, collective.Sum) }},
		{"ReduceScatter", func() error { return collective.ReduceScatter(ctx, c, buf, buf[:1], collective.Sum) }},
		{"Allgatherv", func() error { return collective.Allgatherv(ctx, c, buf, buf, []int{1}, []int{0}) }},
		{"Alltoallv", func() error {
			return collective.Alltoallv(ctx, c, buf, []int{1}, []int{0}, buf, []int{1}, []int{0})
		}},
		{"Gatherv", func() error { return collective.Gatherv(ctx, c, buf, buf, []int{1}, []int{0}, 0) }},
		{"Scatterv", func() error { return collective.Scatterv(ctx, c, buf, []int{1}, []int{0}, buf, 0) }},
		{"ReduceScatterV", func() error { return collective.ReduceScatterV(ctx, c, buf, buf, []int{1}, collective.Sum) }},
		{"ExScan", func() error { return collective.ExScan(ctx, c, buf, buf, collective.Sum) }},
		{"IAllreduce", func() error { return collective.IAllreduce(ctx, c, buf, buf, collective.Sum).Wait(ctx) }},
		{"IBroadcast", func() error { return collective.IBroadcast(ctx, c, buf, 0).Wait(ctx) }},
		{"IAlltoall", func() error { return collective.IAlltoall(ctx, c, buf, buf).Wait(ctx) }},
		{"Alloc", func() error { _, err := collective.Alloc[float64](c, 2); return err }},
		// In place and with nil counts: the lengths checked against the
		// zero Comm's size (0) and rank divided by zero or indexed nil
		// counts before the zero Comm was seen.
		{"Allreduce/in-place", func() error { return collective.Allreduce(ctx, c, nil, buf, collective.Sum) }},
		{"Broadcast/nil", func() error { return collective.Broadcast[float64](ctx, c, nil, 0) }},
		{"Reduce/in-place", func() error { return collective.Reduce(ctx, c, nil, buf, collective.Sum, 0) }},
		{"Allgather/in-place", func() error { return collective.Allgather(ctx, c, nil, buf) }},
		{"Allgatherv/in-place", func() error { return collective.Allgatherv(ctx, c, nil, buf, nil, nil) }},
		{"Alltoall/in-place", func() error { return collective.Alltoall(ctx, c, nil, buf) }},
		{"Alltoallv/in-place", func() error { return collective.Alltoallv[float64](ctx, c, nil, nil, nil, buf, nil, nil) }},
		{"Gather/nil", func() error { return collective.Gather(ctx, c, nil, buf, 0) }},
		{"Gatherv/nil", func() error { return collective.Gatherv(ctx, c, nil, buf, nil, nil, 0) }},
		{"Scatter/nil", func() error { return collective.Scatter(ctx, c, nil, buf, 0) }},
		{"Scatterv/nil", func() error { return collective.Scatterv(ctx, c, nil, nil, nil, buf, 0) }},
		{"Scan/in-place", func() error { return collective.Scan(ctx, c, nil, buf, collective.Sum) }},
		{"ExScan/in-place", func() error { return collective.ExScan(ctx, c, nil, buf, collective.Sum) }},
		{"ReduceScatter/in-place", func() error { return collective.ReduceScatter(ctx, c, nil, buf, collective.Sum) }},
		{"ReduceScatterV/nil-counts", func() error { return collective.ReduceScatterV(ctx, c, nil, buf, nil, collective.Sum) }},
		{"IAllgather/in-place", func() error { return collective.IAllgather(ctx, c, nil, buf).Wait(ctx) }},
		{"IReduceScatter/in-place", func() error { return collective.IReduceScatter(ctx, c, nil, buf, collective.Sum).Wait(ctx) }},
		{"IAlltoallv/in-place", func() error { return collective.IAlltoallv[float64](ctx, c, nil, nil, nil, buf, nil, nil).Wait(ctx) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("panic: %v", p)
					}
				}()
				err = tc.f()
			}()
			if !errors.Is(err, collective.ErrClosed) {
				t.Errorf("%v, want ErrClosed", err)
			}
		})
	}
}

// TestNewOfNoNode: New of a nil or zero cluster.Node fails with ErrArgs.
func TestNewOfNoNode(t *testing.T) {
	for _, node := range []*cluster.Node{nil, {}} {
		var err error
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("New(%v): panic: %v", node, p)
				}
			}()
			_, err = collective.New(context.Background(), node, collective.Options{})
		}()
		if !errors.Is(err, collective.ErrArgs) {
			t.Errorf("New(%v): %v, want ErrArgs", node, err)
		}
	}
}
