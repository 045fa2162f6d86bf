package collective_test

import (
	"context"
	"errors"
	"testing"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// Adversarial tests, second pass: ranks as processes killed or stopped
// in every kind of collective, a world that failed under communicators
// that did not see it, mismatches of the V-variants, requests around
// Close and poisoning. Contexts are hang guards only: no test asserts on
// time.

// namesRank reports whether err wraps a *cluster.RankError naming rank.
func namesRank(err error, rank int) bool {
	var re *cluster.RankError
	return errors.As(err, &re) && re.Rank == rank && errors.Is(err, cluster.ErrPeerLost)
}

// TestAdv2WorldFailedFailsNextCall: once a rank's node knows that a rank
// of the world failed (another rank told it: cluster.Node.Fail), every
// later collective of every communicator of that rank fails naming the
// failed rank — also those that need no wait for a peer (a gather's
// non-root, a broadcast's root, a reduce's leaf, scan's rank 0, a
// communicator of one rank) and would otherwise complete as if the
// world were whole (package documentation: a world that lost a rank
// stays failed; DESIGN §9: a rank's next collective fails).
func TestAdv2WorldFailedFailsNextCall(t *testing.T) {
	const p = 3
	ns := nodes(t, p)
	cs := commsOn(t, ns, collective.Options{})
	// Rank 1's calls, each the first on a communicator made before the
	// failure: a duplicate of the world's, and one of rank 1 alone.
	root := func(c *collective.Comm) int { return 0 }
	recv := func(c *collective.Comm, n int) []int64 {
		if c.Rank() == 0 {
			return make([]int64, n)
		}
		return nil
	}
	calls := []struct {
		name string
		call func(ctx context.Context, c *collective.Comm) error
	}{
		{"gather, not root", func(ctx context.Context, c *collective.Comm) error {
			return collective.Gather(ctx, c, []int64{1}, recv(c, c.Size()), root(c))
		}},
		{"broadcast, root", func(ctx context.Context, c *collective.Comm) error {
			return collective.Broadcast(ctx, c, []int64{1, 2}, c.Rank())
		}},
		{"reduce, leaf", func(ctx context.Context, c *collective.Comm) error {
			return collective.Reduce(ctx, c, []int64{1}, recv(c, 1), collective.Sum, root(c))
		}},
		{"scan, rank 0", func(ctx context.Context, c *collective.Comm) error {
			if c.Rank() != 0 {
				return nil // rank 1 of the world's would wait for rank 0: not the case
			}
			return collective.Scan(ctx, c, nil, []int64{1}, collective.Sum)
		}},
		{"igather, not root", func(ctx context.Context, c *collective.Comm) error {
			return collective.IGather(ctx, c, []int64{1}, recv(c, c.Size()), root(c)).Wait(ctx)
		}},
		{"barrier", func(ctx context.Context, c *collective.Comm) error { return collective.Barrier(ctx, c) }},
	}
	dups := make([][]*collective.Comm, len(calls))
	solos := make([][]*collective.Comm, len(calls))
	for i := range calls {
		dups[i], solos[i] = make([]*collective.Comm, p), make([]*collective.Comm, p)
		noErrors(t, "dup and split", parallel(p, func(r int) error {
			var err error
			if dups[i][r], err = cs[r].Dup(guardCtx(t)); err != nil {
				return err
			}
			solos[i][r], err = cs[r].Split(guardCtx(t), r, 0)
			return err
		}))
		defer closeAll(t, dups[i])
		defer closeAll(t, solos[i])
	}
	ns[0].Fail(2, errors.New("declared failed by the test"))
	if !namesRank(ns[1].Err(), 2) {
		t.Fatalf("rank 1's node: %v, want the failure of rank 2", ns[1].Err())
	}
	for i, tc := range calls {
		for _, c := range []*collective.Comm{dups[i][1], solos[i][1]} {
			if tc.name == "scan, rank 0" && c.Size() > 1 {
				continue
			}
			err := tc.call(guardCtx(t), c)
			notByGuard(t, 1, tc.name, err)
			if !namesRank(err, 2) {
				t.Errorf("%s on a communicator of %d ranks at rank 1 after rank 2 failed: %v, want an error naming rank 2",
					tc.name, c.Size(), err)
			}
			if err := c.Err(); !namesRank(err, 2) {
				t.Errorf("%s on a communicator of %d ranks: Comm.Err after: %v, want the failure of rank 2", tc.name, c.Size(), err)
			}
		}
	}
}
