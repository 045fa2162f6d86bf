package collective_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// testCtx bounds a test's calls (a hang guard, not a timing assertion).
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// nodes builds a connected world of n cluster nodes in this process, one
// soft0 device each.
func nodes(t testing.TB, n int) []*cluster.Node {
	t.Helper()
	return nodesWith(t, n, cluster.NodeOptions{})
}

// nodesWith is nodes with options.
func nodesWith(t testing.TB, n int, opts cluster.NodeOptions) []*cluster.Node {
	t.Helper()
	return nodesOn(t, n, opts, []string{verbs.SoftDevice})
}

// nodesOn builds n nodes, rank i on device devs[i mod len(devs)].
func nodesOn(t testing.TB, n int, opts cluster.NodeOptions, devs []string) []*cluster.Node {
	t.Helper()
	ns := make([]*cluster.Node, n)
	for i := range n {
		pd := verbstest.OpenPD(t, devs[i%len(devs)])
		var err error
		if ns[i], err = cluster.NewNode(pd, i, n, opts); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ns[i].Close() })
	}
	out := make([][][]byte, n)
	for i, nd := range ns {
		var err error
		if out[i], err = nd.LocalEndpoints(nil); err != nil {
			t.Fatal(err)
		}
	}
	for i, nd := range ns {
		in := make([][]byte, n)
		for j := range n {
			in[j] = out[j][i]
		}
		if err := nd.Connect(in); err != nil {
			t.Fatal(err)
		}
	}
	return ns
}

// world builds n nodes and a communicator on each.
func world(t testing.TB, n int, opts collective.Options) []*collective.Comm {
	t.Helper()
	return worldWith(t, n, opts, cluster.NodeOptions{})
}

// worldWith is world with node options.
func worldWith(t testing.TB, n int, opts collective.Options, nopts cluster.NodeOptions) []*collective.Comm {
	t.Helper()
	verbstest.CheckLeaks(t)
	return commsOn(t, nodesWith(t, n, nopts), opts)
}

// commsOn makes a communicator on each node, closed when the test ends.
func commsOn(t testing.TB, ns []*cluster.Node, opts collective.Options) []*collective.Comm {
	t.Helper()
	cs := newComms(t, testCtx(t), ns, opts)
	t.Cleanup(func() {
		closeAll(t, cs) // Close is collective: every rank at once
	})
	return cs
}

// newComms makes a communicator on each node (New under ctx, every rank
// at once); closing them is the caller's.
func newComms(t testing.TB, ctx context.Context, ns []*cluster.Node, opts collective.Options) []*collective.Comm {
	t.Helper()
	cs := make([]*collective.Comm, len(ns))
	errs := parallel(len(ns), func(i int) error {
		var err error
		cs[i], err = collective.New(ctx, ns[i], opts)
		return err
	})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: New: %v", i, err)
		}
	}
	return cs
}

// parallel runs f(0..n-1) in goroutines and returns their errors.
func parallel(n int, f func(i int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(i)
		}()
	}
	wg.Wait()
	return errs
}

func noErrors(t testing.TB, what string, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s: rank %d: %v", what, i, err)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

// closeAll closes the communicators (nil ones skipped) at once: Close is
// collective.
func closeAll(t testing.TB, cs []*collective.Comm) {
	t.Helper()
	for i, err := range parallel(len(cs), func(i int) error {
		if cs[i] == nil {
			return nil
		}
		return cs[i].Close()
	}) {
		if err != nil {
			t.Errorf("rank %d: Close: %v", i, err)
		}
	}
}
