package collective_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
	"github.com/goverbs/verbs/verbstest"
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

// Ranks as processes, killed or stopped in every kind of collective.
// One rank of a world is a child process (this test binary, re-executed
// with adv2ChildEnv set: see init), the others run here; every rank
// loops over one kind of call (adv2Step), checking its results, and the
// child is killed (SIGKILL) or stopped (SIGSTOP) once it completed one.
// Every survivor's call must then fail naming the child's rank (not by
// a timeout: no Options.Timeout is set, the contexts are hang guards),
// its next call too (ErrPoisoned), and Close must return.

// adv2ChildEnv makes the test binary a rank of TestAdv2KillInEveryKind:
// "KIND,NB,RANK,SIZE,ADDRS" (ADDRS separated by ';'), with its exchange
// listener as fd 3.
const adv2ChildEnv = "GOVERBS_COLLECTIVE_ADV2_CHILD"

func init() {
	// A child rank runs before TestMain (process_test.go) would look at
	// its own variable: this file's children are its own business.
	if spec := os.Getenv(adv2ChildEnv); spec != "" {
		os.Exit(adv2Child(spec))
	}
}

func adv2Child(spec string) int {
	s := testproc.ParseSpec(spec)
	if len(s) != 5 {
		fmt.Println("error: bad spec", spec)
		return 2
	}
	kind, nb, rank := s[0], s[1] == "1", s.Int(2)
	cfg, err := failConfig(s.List(4))
	if err != nil {
		fmt.Println("error:", err)
		return 2
	}
	ln, err := testproc.Listener()
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	ctx := context.Background()
	n, err := cluster.Join(ctx, cfg, rank, failJoinOptions(ln))
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	c, err := collective.New(ctx, n, collective.Options{ChunkSize: failChunk})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	return testproc.Loop(func(i int) error { return adv2Step(ctx, c, kind, i, nb) })
}

// adv2Kinds are the kinds of calls adv2Step makes.
var adv2Kinds = []string{"barrier", "broadcast", "reduce", "allgather", "allgatherv", "reduce-scatter",
	"reduce-scatterv", "alltoall", "alltoallv", "gather", "gatherv", "scatter", "scatterv", "scan", "exscan",
	"split", "inflight"}

// adv2Val is rank r's element k of call i: small integers, exact in
// float64 sums.
func adv2Val(r, i, k int) float64 { return float64(r*1000 + i%7 + k%13) }

// adv2Step runs call i of kind on c (the non-blocking twin, waited for,
// if nb) and checks its result: vectors of 3 elements per rank and block
// in even calls, 700 (several chunks of failChunk) in odd ones; roots
// and colors change from call to call.
func adv2Step(ctx context.Context, c *collective.Comm, kind string, i int, nb bool) error {
	p, r := c.Size(), c.Rank()
	m := 3
	if i%2 == 1 {
		m = 700
	}
	root := i % p
	vec := func(rank, n int) []float64 {
		v := make([]float64, n)
		for k := range v {
			v[k] = adv2Val(rank, i, k)
		}
		return v
	}
	wait := func(q *collective.Request) error { return q.Wait(ctx) }
	check := func(what string, got, want []float64) error {
		if len(got) != len(want) {
			return fmt.Errorf("%s: %d elements, want %d", what, len(got), len(want))
		}
		for k := range got {
			if got[k] != want[k] {
				return fmt.Errorf("%s: element %d is %v, want %v", what, k, got[k], want[k])
			}
		}
		return nil
	}
	sum := func(n int) []float64 {
		s := make([]float64, n)
		for q := range p {
			for k := range s {
				s[k] += adv2Val(q, i, k)
			}
		}
		return s
	}
	// counts of the V-variants: rank q's block has m+q elements.
	counts, displs := make([]int, p), make([]int, p)
	total := 0
	for q := range p {
		counts[q], displs[q] = m+q, total
		total += m + q
	}
	switch kind {
	case "barrier":
		if nb {
			return wait(collective.IBarrier(ctx, c))
		}
		return collective.Barrier(ctx, c)
	case "broadcast":
		v := make([]float64, m)
		if r == root {
			v = vec(root, m)
		}
		var err error
		if nb {
			err = wait(collective.IBroadcast(ctx, c, v, root))
		} else {
			err = collective.Broadcast(ctx, c, v, root)
		}
		if err != nil {
			return err
		}
		return check("broadcast", v, vec(root, m))
	case "reduce":
		var recv []float64
		if r == root {
			recv = make([]float64, m)
		}
		var err error
		if nb {
			err = wait(collective.IReduce(ctx, c, vec(r, m), recv, collective.Sum, root))
		} else {
			err = collective.Reduce(ctx, c, vec(r, m), recv, collective.Sum, root)
		}
		if err != nil || r != root {
			return err
		}
		return check("reduce", recv, sum(m))
	case "allgather", "allgatherv":
		var want []float64
		for q := range p {
			n := m
			if kind == "allgatherv" {
				n = counts[q]
			}
			want = append(want, vec(q, n)...)
		}
		recv := make([]float64, len(want))
		var err error
		switch {
		case kind == "allgather" && nb:
			err = wait(collective.IAllgather(ctx, c, vec(r, m), recv))
		case kind == "allgather":
			err = collective.Allgather(ctx, c, vec(r, m), recv)
		case nb:
			err = wait(collective.IAllgatherv(ctx, c, vec(r, counts[r]), recv, counts, displs))
		default:
			err = collective.Allgatherv(ctx, c, vec(r, counts[r]), recv, counts, displs)
		}
		if err != nil {
			return err
		}
		return check(kind, recv, want)
	case "reduce-scatter", "reduce-scatterv":
		n, lo := m, r*m
		all := p * m
		if kind == "reduce-scatterv" {
			n, lo, all = counts[r], displs[r], total
		}
		recv := make([]float64, n)
		var err error
		switch {
		case kind == "reduce-scatter" && nb:
			err = wait(collective.IReduceScatter(ctx, c, vec(r, all), recv, collective.Sum))
		case kind == "reduce-scatter":
			err = collective.ReduceScatter(ctx, c, vec(r, all), recv, collective.Sum)
		case nb:
			err = wait(collective.IReduceScatterV(ctx, c, vec(r, all), recv, counts, collective.Sum))
		default:
			err = collective.ReduceScatterV(ctx, c, vec(r, all), recv, counts, collective.Sum)
		}
		if err != nil {
			return err
		}
		return check(kind, recv, sum(all)[lo:lo+n])
	case "alltoall":
		recv := make([]float64, p*m)
		var err error
		if nb {
			err = wait(collective.IAlltoall(ctx, c, vec(r, p*m), recv))
		} else {
			err = collective.Alltoall(ctx, c, vec(r, p*m), recv)
		}
		if err != nil {
			return err
		}
		var want []float64
		for q := range p {
			want = append(want, vec(q, p*m)[r*m:(r+1)*m]...)
		}
		return check("alltoall", recv, want)
	case "alltoallv":
		// Rank r sends m+r elements to everyone (at 0), receives m+q from q.
		send := vec(r, m+r)
		sc, sd := make([]int, p), make([]int, p)
		for q := range p {
			sc[q] = m + r
		}
		recv := make([]float64, total)
		var err error
		if nb {
			err = wait(collective.IAlltoallv(ctx, c, send, sc, sd, recv, counts, displs))
		} else {
			err = collective.Alltoallv(ctx, c, send, sc, sd, recv, counts, displs)
		}
		if err != nil {
			return err
		}
		var want []float64
		for q := range p {
			want = append(want, vec(q, m+q)...)
		}
		return check("alltoallv", recv, want)
	case "gather", "gatherv":
		n, rc, rd := m, []int(nil), []int(nil)
		if kind == "gatherv" {
			n, rc, rd = counts[r], counts, displs
		}
		var recv, want []float64
		if r == root {
			for q := range p {
				k := m
				if kind == "gatherv" {
					k = counts[q]
				}
				want = append(want, vec(q, k)...)
			}
			recv = make([]float64, len(want))
		}
		var err error
		switch {
		case kind == "gather" && nb:
			err = wait(collective.IGather(ctx, c, vec(r, n), recv, root))
		case kind == "gather":
			err = collective.Gather(ctx, c, vec(r, n), recv, root)
		case nb:
			err = wait(collective.IGatherv(ctx, c, vec(r, n), recv, rc, rd, root))
		default:
			err = collective.Gatherv(ctx, c, vec(r, n), recv, rc, rd, root)
		}
		if err != nil || r != root {
			return err
		}
		return check(kind, recv, want)
	case "scatter", "scatterv":
		n, all := m, p*m
		lo := r * m
		if kind == "scatterv" {
			n, all, lo = counts[r], total, displs[r]
		}
		var send []float64
		if r == root {
			send = vec(root, all)
		}
		recv := make([]float64, n)
		var err error
		switch {
		case kind == "scatter" && nb:
			err = wait(collective.IScatter(ctx, c, send, recv, root))
		case kind == "scatter":
			err = collective.Scatter(ctx, c, send, recv, root)
		case nb:
			err = wait(collective.IScatterv(ctx, c, send, counts, displs, recv, root))
		default:
			err = collective.Scatterv(ctx, c, send, counts, displs, recv, root)
		}
		if err != nil {
			return err
		}
		return check(kind, recv, vec(root, all)[lo:lo+n])
	case "scan", "exscan":
		recv := make([]float64, m)
		var err error
		switch {
		case kind == "scan" && nb:
			err = wait(collective.IScan(ctx, c, vec(r, m), recv, collective.Sum))
		case kind == "scan":
			err = collective.Scan(ctx, c, vec(r, m), recv, collective.Sum)
		case nb:
			err = wait(collective.IExScan(ctx, c, vec(r, m), recv, collective.Sum))
		default:
			err = collective.ExScan(ctx, c, vec(r, m), recv, collective.Sum)
		}
		if err != nil {
			return err
		}
		want := make([]float64, m)
		last := r
		if kind == "exscan" {
			last = r - 1
		}
		for q := 0; q <= last; q++ {
			for k := range want {
				want[k] += adv2Val(q, i, k)
			}
		}
		return check(kind, recv, want)
	case "split":
		// Two parts, by parity or (odd calls) one of all, reversed.
		color := r % 2
		if i%2 == 1 {
			color = 5
		}
		sub, err := c.Split(ctx, color, -r)
		if err != nil {
			return err
		}
		defer sub.Close()
		v := []float64{float64(r), 1}
		if nb {
			err = wait(collective.IAllreduce(ctx, sub, nil, v, collective.Sum))
		} else {
			err = collective.Allreduce(ctx, sub, nil, v, collective.Sum)
		}
		if err != nil {
			return err
		}
		if v[1] != float64(sub.Size()) {
			return fmt.Errorf("split: allreduce on the part: %v, want %d ranks", v, sub.Size())
		}
		return nil
	case "inflight":
		// Many requests of different kinds in flight at once.
		ar := vec(r, m)
		bc := make([]float64, m)
		if r == root {
			bc = vec(root, m)
		}
		ag := make([]float64, p*m)
		qs := []*collective.Request{
			collective.IAllreduce(ctx, c, nil, ar, collective.Sum),
			collective.IBroadcast(ctx, c, bc, root),
			collective.IBarrier(ctx, c),
			collective.IAllgather(ctx, c, vec(r, m), ag),
		}
		var errs []error
		for _, q := range qs {
			errs = append(errs, q.Wait(ctx))
		}
		if err := errors.Join(errs...); err != nil {
			return err
		}
		return errors.Join(check("iallreduce", ar, sum(m)), check("ibroadcast", bc, vec(root, m)))
	}
	return fmt.Errorf("unknown kind %q", kind)
}

// adv2Result is what a surviving rank saw.
type adv2Result struct {
	setup         error
	calls         int
	first, second error
	closeComm     error
	closeNode     error
}

// adv2World runs a world of n ranks looping over kind, rank victim a
// child process signalled with sig once it completed a call.
func adv2World(t *testing.T, transport, kind string, nb bool, n, victim int, sig syscall.Signal) []adv2Result {
	t.Helper()
	verbstest.CheckLeaks(t)
	restore, err := soft.ForceTransport(transport)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	lns := make([]net.Listener, n)
	addrs := make([]string, n)
	for r := range n {
		if lns[r], err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lns[r].Close() })
		addrs[r] = lns[r].Addr().String()
	}
	cfg, err := failConfig(addrs)
	if err != nil {
		t.Fatal(err)
	}
	guard, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	nbs := "0"
	if nb {
		nbs = "1"
	}
	spec := fmt.Sprintf("%s,%s,%d,%d,%s", kind, nbs, victim, n, strings.Join(addrs, ";"))
	cmd, lines := testproc.StartListening(t, lns[victim].(*net.TCPListener), childEnv(adv2ChildEnv+"="+spec, "GOVERBS_SOFT_TRANSPORT="+transport))
	res := make([]adv2Result, n)
	testproc.Survive(t, guard, cmd, lines, sig, n, victim, func(r int) time.Time {
		s := &res[r]
		nd, err := cluster.Join(guard, cfg, r, failJoinOptions(lns[r]))
		if err != nil {
			s.setup = fmt.Errorf("join: %w", err)
			return time.Time{}
		}
		defer func() { s.closeNode = nd.Close() }()
		c, err := collective.New(guard, nd, collective.Options{ChunkSize: failChunk})
		if err != nil {
			s.setup = fmt.Errorf("new: %w", err)
			return time.Time{}
		}
		var failed time.Time
		for {
			if err := adv2Step(guard, c, kind, s.calls, nb); err != nil {
				s.first, failed = err, time.Now()
				break
			}
			s.calls++
		}
		s.second = adv2Step(guard, c, kind, s.calls, nb)
		s.closeComm = c.Close()
		return failed
	})
	return res
}

// TestAdv2KillInEveryKind: a rank killed (SIGKILL) or stopped (SIGSTOP)
// while the world loops over any kind of collective — rooted ones with
// the root moving, the V-variants, scans, Split (and a collective on the
// part), requests in flight — makes every other rank's call fail naming
// it (a *cluster.RankError wrapping cluster.ErrPeerLost, not a timeout,
// not a wrong result), its next call too (ErrPoisoned), and Close
// returns. Each kind takes a signal, a victim's position, a world size,
// a transport and blocking or non-blocking calls in turn.
func TestAdv2KillInEveryKind(t *testing.T) {
	sigs := []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP}
	transports := []string{"shm", "unix", "tcp"}
	for i, kind := range adv2Kinds {
		n := 3 + i%2
		victim := []int{0, 1, n - 1}[i%3]
		sig := sigs[(i/2)%2]
		tr := transports[i%3]
		nb := (i/3)%2 == 1 || kind == "inflight"
		name := fmt.Sprintf("%s/p=%d/victim=%d/%v/%s/nb=%v", kind, n, victim, sig, tr, nb)
		t.Run(name, func(t *testing.T) {
			res := adv2World(t, tr, kind, nb, n, victim, sig)
			for r, s := range res {
				if r == victim {
					continue
				}
				if s.setup != nil {
					t.Errorf("rank %d: %v", r, s.setup)
					continue
				}
				t.Logf("rank %d: after %d calls: %.300v", r, s.calls, s.first)
				if !namesRank(s.first, victim) || errors.Is(s.first, verbs.ErrTimeout) {
					t.Errorf("rank %d: call %d: %v, want an error naming rank %d (not a timeout)", r, s.calls, s.first, victim)
				}
				// A split's failure may come from the call on the part, which
				// does not poison the parent: its next call fails for the
				// world's failure (a RankError), without ErrPoisoned.
				if !namesRank(s.second, victim) || kind != "split" && !errors.Is(s.second, collective.ErrPoisoned) {
					t.Errorf("rank %d: the next call: %v, want ErrPoisoned naming rank %d", r, s.second, victim)
				}
				if s.closeComm != nil || s.closeNode != nil {
					t.Errorf("rank %d: Comm.Close: %v, Node.Close: %v", r, s.closeComm, s.closeNode)
				}
			}
		})
	}
}

// TestAdv2MismatchedVariants: ranks that disagree on the V-variants'
// counts (also with the same total), on a scan's operation or count, on
// ReduceScatter against ReduceScatterV, on the element type of the same
// size, or on Gather against Gatherv, Alltoall against Alltoallv, never
// complete silently: at least one rank names the mismatch, every rank fails the
// call or its next one, nobody waits for the hang guard, and a failed
// call poisons.
func TestAdv2MismatchedVariants(t *testing.T) {
	i64 := func(n int) []int64 { return make([]int64, n) }
	cases := []struct {
		name string
		p    int
		call advCall
	}{
		{"allgatherv counts, same total", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			counts, displs := []int{1, 3, 2}, []int{0, 1, 4}
			if r == 2 {
				counts, displs = []int{1, 2, 3}, []int{0, 1, 3}
			}
			return collective.Allgatherv(ctx, c, i64(counts[r]), i64(6), counts, displs)
		}},
		{"allgatherv a zero count", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			counts, displs := []int{2, 0, 2}, []int{0, 2, 2}
			if r == 1 {
				counts, displs = []int{2, 1, 2}, []int{0, 2, 3}
			}
			return collective.Allgatherv(ctx, c, i64(counts[r]), i64(5), counts, displs)
		}},
		{"alltoallv lengths", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			sc, sd := []int{2, 2, 2}, []int{0, 2, 4}
			if r == 1 {
				sc = []int{3, 2, 1}
			}
			return collective.Alltoallv(ctx, c, i64(6), sc, sd, i64(6), []int{2, 2, 2}, []int{0, 2, 4})
		}},
		{"alltoallv a zero block", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			sc := []int{1, 1}
			if r == 0 {
				sc = []int{1, 0}
			}
			return collective.Alltoallv(ctx, c, i64(2), sc, []int{0, 1}, i64(2), []int{1, 1}, []int{0, 1})
		}},
		{"gatherv length", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			n := 2
			if r == 2 {
				n = 3
			}
			return collective.Gatherv(ctx, c, i64(n), i64(6), []int{2, 2, 2}, []int{0, 2, 4}, 0)
		}},
		{"gatherv a zero count at the root", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			n := 2
			if r == 1 {
				n = 0
			}
			return collective.Gatherv(ctx, c, i64(n), i64(6), []int{2, 2, 2}, []int{0, 2, 4}, 0)
		}},
		{"scatterv length", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			n := 2
			if r == 1 {
				n = 1
			}
			return collective.Scatterv(ctx, c, i64(6), []int{2, 2, 2}, []int{0, 2, 4}, i64(n), 2)
		}},
		{"scatterv a zero count at the root", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			n := 2
			if r == 2 {
				n = 3
			}
			return collective.Scatterv(ctx, c, i64(6), []int{2, 2, 0}, []int{0, 2, 4}, i64(n), 0)
		}},
		{"reduce-scatterv totals", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			counts := []int{2, 2, 2}
			if r == 0 {
				counts = []int{2, 2, 3}
			}
			sum := counts[0] + counts[1] + counts[2]
			return collective.ReduceScatterV(ctx, c, i64(sum), i64(counts[r]), counts, collective.Sum)
		}},
		{"reduce-scatterv same total", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			counts := []int{1, 2}
			if r == 1 {
				counts = []int{2, 1}
			}
			return collective.ReduceScatterV(ctx, c, i64(3), i64(counts[r]), counts, collective.Sum)
		}},
		{"reduce-scatter/reduce-scatterv", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.ReduceScatter(ctx, c, i64(4), i64(2), collective.Sum)
			}
			return collective.ReduceScatterV(ctx, c, i64(2), i64(1), []int{1, 1}, collective.Sum)
		}},
		{"scan sum/max", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			op := collective.Sum
			if r == 0 {
				op = collective.Max
			}
			return collective.Scan(ctx, c, nil, i64(2), op)
		}},
		{"exscan counts", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			return collective.ExScan(ctx, c, nil, i64(2+r/2), collective.Sum)
		}},
		{"broadcast float32/int32", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.Broadcast(ctx, c, make([]float32, 3), 0)
			}
			return collective.Broadcast(ctx, c, make([]int32, 3), 0)
		}},
		{"gather/gatherv", 3, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 1 {
				return collective.Gatherv(ctx, c, i64(2), i64(6), []int{2, 2, 2}, []int{0, 2, 4}, 0)
			}
			return collective.Gather(ctx, c, i64(2), i64(6), 0)
		}},
		{"alltoall/alltoallv", 2, func(ctx context.Context, c *collective.Comm, r int) error {
			if r == 0 {
				return collective.Alltoallv(ctx, c, i64(4), []int{2, 2}, []int{0, 2}, i64(4), []int{2, 2}, []int{0, 2})
			}
			return collective.Alltoall(ctx, c, i64(4), i64(4))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cs := world(t, tc.p, collective.Options{ChunkSize: 4096})
			first, next := make([]error, tc.p), make([]error, tc.p)
			parallel(tc.p, func(r int) error {
				first[r] = tc.call(guardCtx(t), cs[r], r)
				next[r] = collective.Barrier(guardCtx(t), cs[r])
				return nil
			})
			mismatch := false
			for r := range tc.p {
				t.Logf("rank %d: %.300v; then %.300v", r, first[r], next[r])
				notByGuard(t, r, "mismatched call", first[r])
				notByGuard(t, r, "barrier after", next[r])
				mismatch = mismatch || errors.Is(first[r], collective.ErrMismatch) || errors.Is(next[r], collective.ErrMismatch)
				if first[r] == nil && next[r] == nil {
					t.Errorf("rank %d: the mismatched call and the next both succeeded", r)
				}
				if first[r] != nil && !errors.Is(first[r], collective.ErrArgs) && !errors.Is(next[r], collective.ErrPoisoned) {
					t.Errorf("rank %d: barrier after a failed call: %v, want ErrPoisoned", r, next[r])
				}
			}
			if !mismatch {
				t.Errorf("no rank reported ErrMismatch")
			}
		})
	}
}
