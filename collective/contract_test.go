package collective_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs/collective"
)

// TestAllgathervCountsMismatch: ranks that pass Allgatherv different
// counts vectors are detected (ErrMismatch), also where every message's
// length agrees: rank 0 swaps the counts of ranks 2 and 3, which Bruck's
// algorithm (p = 5, 6) and recursive doubling (p = 4) send it bundled in
// one message whose length is the same either way. No rank may return
// success with blocks placed by counts other than their sender's.
func TestAllgathervCountsMismatch(t *testing.T) {
	cases := []struct {
		p   int
		alg collective.Algorithm
	}{
		{4, collective.AlgRecursiveDoubling},
		{5, collective.AlgRecursiveDoubling}, // Bruck
		{6, collective.AlgRecursiveDoubling}, // Bruck
		{6, collective.AlgAuto},              // Bruck (small)
		{5, collective.AlgRing},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("p=%d/%v", tc.p, tc.alg), func(t *testing.T) {
			p := tc.p
			counts := make([]int, p)
			for i := range counts {
				counts[i] = i + 1
			}
			views := make([][]int, p) // the counts each rank passes
			for r := range p {
				views[r] = slices.Clone(counts)
			}
			views[0][2], views[0][3] = views[0][3], views[0][2]
			cs := world(t, p, collective.Options{Algorithm: tc.alg, Timeout: mismatchTimeout})
			recvs := make([][]int32, p)
			errs := parallel(p, func(r int) error {
				cnt := views[r]
				displs := make([]int, p)
				total := 0
				for i, n := range cnt {
					displs[i] = total
					total += n
				}
				recvs[r] = make([]int32, total)
				send := make([]int32, cnt[r])
				for k := range send {
					send[k] = int32(1000*r + k)
				}
				return collective.Allgatherv(testCtx(t), cs[r], send, recvs[r], cnt, displs)
			})
			detected := false
			for r, err := range errs {
				switch {
				case errors.Is(err, collective.ErrMismatch):
					detected = true
					t.Logf("rank %d: %v", r, err)
				case err != nil:
					t.Errorf("rank %d: %v, want ErrMismatch", r, err)
				default:
					// A rank that succeeded must hold every block as sent.
					off := 0
					for i, n := range views[r] {
						for k := range n {
							if got, want := recvs[r][off+k], int32(1000*i+k); got != want {
								t.Errorf("rank %d: success, but element %d of rank %d's block is %d, want %d", r, k, i, got, want)
							}
						}
						off += n
					}
				}
			}
			if !detected {
				t.Errorf("no rank detected the disagreeing counts: %v", errs)
			}
		})
	}
}

// TestRootMismatchAtClose: ranks of a rooted call that disagree on the
// root each take themselves for the root, send, and receive nothing; with
// no later call on the communicator, Close reports it (ErrMismatch,
// naming the peer and its call) at every rank the stray message reached
// before it closed. A node barrier after the calls makes sure it has
// (queue pairs place writes in order).
func TestRootMismatchAtClose(t *testing.T) {
	const p = 2
	cases := []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"broadcast", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Broadcast(ctx, c, []int64{int64(r), 2, 3}, r)
		}},
		{"broadcast/large", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Broadcast(ctx, c, make([]float64, 4096), r)
		}},
		{"scatter", func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.Scatter(ctx, c, make([]int32, 2*p), nil, r)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ns := nodes(t, p)
			cs := newComms(t, testCtx(t), ns, collective.Options{Timeout: mismatchTimeout})
			noErrors(t, tc.name+" (disagreeing roots, not seen by the calls)", parallel(p, func(r int) error {
				return tc.call(testCtx(t), cs[r], r)
			}))
			noErrors(t, "node barrier", parallel(p, func(r int) error { return ns[r].Barrier(testCtx(t), nil) }))
			errs := parallel(p, func(r int) error { return cs[r].Close() })
			for r, err := range errs {
				var ce *collective.Error
				if !errors.Is(err, collective.ErrMismatch) || !errors.As(err, &ce) {
					t.Errorf("rank %d: Close: %v, want ErrMismatch", r, err)
					continue
				}
				if other := 1 - r; ce.Peer != other || !strings.Contains(err.Error(), fmt.Sprintf("root %d", other)) {
					t.Errorf("rank %d: Close: %v, want it to name rank %d and its call (root %d)", r, err, other, other)
				}
			}
		})
	}
}

// TestCloseAfterAgreement: Close after calls that agreed reports nothing
// (no false stray message).
func TestCloseAfterAgreement(t *testing.T) {
	const p = 3
	ns := nodes(t, p)
	cs := newComms(t, testCtx(t), ns, collective.Options{})
	noErrors(t, "calls", parallel(p, func(r int) error {
		ctx := testCtx(t)
		for root := range p {
			if err := collective.Broadcast(ctx, cs[r], make([]int32, 5), root); err != nil {
				return err
			}
			var recv []int32
			if r == root {
				recv = make([]int32, 2*p)
			}
			if err := collective.Gather(ctx, cs[r], make([]int32, 2), recv, root); err != nil {
				return err
			}
		}
		return collective.Allreduce(ctx, cs[r], nil, make([]float32, 1<<14), collective.Sum)
	}))
	noErrors(t, "node barrier", parallel(p, func(r int) error { return ns[r].Barrier(testCtx(t), nil) }))
	noErrors(t, "close", parallel(p, func(r int) error { return cs[r].Close() }))
}

// TestRootArgsAbort: a root that finds its own arguments bad after the
// call took its turn (arguments only it uses) gives the call up: the
// other ranks fail at once with ErrPeerAborted wrapping ErrArgs, naming
// the root, not after their contexts or Options.Timeout (none here: the
// test's context is a hang guard), and the communicator is poisoned.
func TestRootArgsAbort(t *testing.T) {
	const p = 3
	cases := []struct {
		name string
		call func(ctx context.Context, c *collective.Comm, r int) error
	}{
		{"scatter", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Scatter(ctx, c, make([]int64, 5), make([]int64, 2), 0) // send: 5 elements, not 3 × 2
			}
			return collective.Scatter(ctx, c, nil, make([]int64, 2), 0)
		}},
		{"scatterv", func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Scatterv(ctx, c, make([]int64, 4), []int{2, 2, 2}, []int{0, 2, 4}, nil, 0) // block 2 outside send
			}
			return collective.Scatterv(ctx, c, nil, nil, nil, make([]int64, 2), 0)
		}},
		{"gather/large", func(ctx context.Context, c *collective.Comm, r int) error {
			const m = 1 << 18 // more than the windows hold: the senders wait for the root
			if r == 0 {
				return collective.Gather(ctx, c, make([]byte, m), make([]byte, m), 0)
			}
			return collective.Gather(ctx, c, make([]byte, m), nil, 0)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, p, collective.Options{ChunkSize: 4096, Slots: 4})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a hang guard
			defer cancel()
			errs := parallel(p, func(r int) error { return tc.call(ctx, cs[r], r) })
			if !errors.Is(errs[0], collective.ErrArgs) {
				t.Errorf("root: %v, want ErrArgs", errs[0])
			}
			for r := 1; r < p; r++ {
				var ce *collective.Error
				if !errors.Is(errs[r], collective.ErrPeerAborted) || !errors.Is(errs[r], collective.ErrArgs) ||
					!errors.As(errs[r], &ce) || ce.Peer != 0 {
					t.Errorf("rank %d: %v, want ErrPeerAborted wrapping ErrArgs, naming rank 0", r, errs[r])
				}
			}
			for r, err := range parallel(p, func(r int) error { return collective.Barrier(testCtx(t), cs[r]) }) {
				if !errors.Is(err, collective.ErrPoisoned) {
					t.Errorf("rank %d: barrier after the aborted call: %v, want ErrPoisoned", r, err)
				}
			}
		})
	}
}

// TestCancelledQueuedRequestNamesItsCall: a non-blocking call whose
// context ends while it waits for its turn gives its turn up with an
// abort; the peers' error names its call's number (2: the second call on
// the communicator), not the number of the call before it.
func TestCancelledQueuedRequestNamesItsCall(t *testing.T) {
	const p = 2
	cs := world(t, p, collective.Options{})
	first := make(chan error, 1)
	go func() { first <- collective.Barrier(testCtx(t), cs[0]) }() // call 1: waits for rank 1
	for collective.Issued(cs[0]) == 0 {                            // until it took its place
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithCancel(testCtx(t))
	req := collective.IBarrier(ctx, cs[0]) // call 2: queued behind call 1
	cancel()
	if err := req.Wait(testCtx(t)); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled queued barrier: %v, want context.Canceled", err)
	}
	var errs []error
	for range 2 { // calls 1 and 2 at rank 1
		errs = append(errs, collective.Barrier(testCtx(t), cs[1]))
	}
	if err := <-first; err != nil {
		t.Fatalf("rank 0's first barrier: %v", err)
	}
	failed := errs[0]
	if failed == nil {
		failed = errs[1]
	}
	var ce *collective.Error
	if !errors.Is(failed, collective.ErrPeerAborted) || !errors.As(failed, &ce) || ce.Peer != 0 {
		t.Fatalf("rank 1's barriers: %v, want ErrPeerAborted naming rank 0", errs)
	}
	if !strings.Contains(failed.Error(), "gave up its call 2") {
		t.Errorf("rank 1: %v, want the abort to name rank 0's call 2", failed)
	}
}

// TestReduceScatterVCountsMismatch: ReduceScatterV's ranks that pass
// counts vectors of the same sum that differ (rank 0 swaps the counts of
// blocks 2 and 3) are detected (ErrMismatch); a rank that succeeds holds
// its block reduced from the blocks as every rank sent them.
func TestReduceScatterVCountsMismatch(t *testing.T) {
	cases := []struct {
		p   int
		alg collective.Algorithm
	}{
		{4, collective.AlgRabenseifner},
		{4, collective.AlgRing},
		{6, collective.AlgRabenseifner},
		{5, collective.AlgRing},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("p=%d/%v", tc.p, tc.alg), func(t *testing.T) {
			p := tc.p
			views := make([][]int, p)
			for r := range p {
				views[r] = make([]int, p)
				for i := range p {
					views[r][i] = i + 1
				}
			}
			views[0][2], views[0][3] = views[0][3], views[0][2]
			cs := world(t, p, collective.Options{Algorithm: tc.alg, Timeout: mismatchTimeout})
			recvs := make([][]int64, p)
			errs := parallel(p, func(r int) error {
				var send []int64
				for j, n := range views[r] {
					for i := range n {
						send = append(send, int64(1000*j+i+r))
					}
				}
				recvs[r] = make([]int64, views[r][r])
				return collective.ReduceScatterV(testCtx(t), cs[r], send, recvs[r], views[r], collective.Sum)
			})
			detected := false
			for r, err := range errs {
				switch {
				case errors.Is(err, collective.ErrMismatch):
					detected = true
				case err != nil:
					t.Errorf("rank %d: %v, want ErrMismatch", r, err)
				default:
					for i, got := range recvs[r] {
						if want := int64(p*(1000*r+i) + p*(p-1)/2); got != want {
							t.Errorf("rank %d: success, but element %d of its block is %d, want %d", r, i, got, want)
						}
					}
				}
			}
			if !detected {
				t.Errorf("no rank detected the disagreeing counts: %v", errs)
			}
		})
	}
}
