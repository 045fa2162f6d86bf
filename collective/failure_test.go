package collective_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
	"github.com/goverbs/verbs/verbstest"
)

// Failure tests: one rank of a world runs in a child process (this test
// binary, re-executed: see victimChild), the others in this process, all
// on soft0 over one inter-process transport. The child is killed
// (SIGKILL) or stopped (SIGSTOP) while every rank loops over allreduces;
// every surviving rank's allreduce must fail naming the child's rank (a
// *cluster.RankError), and its next call too (ErrPoisoned), before a
// generous hang guard: no context has a deadline short enough, and no
// Options.Timeout is set, so that a failure by timing out fails the test.

// failQP is the queue pairs' transport timeout of the failure tests: a
// stopped rank is declared dead once a request to it has gone unanswered
// for timeout × (retries+1) (soft0: at least 250 ms).
var failQP = verbs.QPSpec{Timeout: 12, RetryCount: 3}

const (
	failJob   = "collective-failure"
	failToken = "collective-failure-token"
	// failCount elements of float64 span several chunks of failChunk.
	failCount = 3000
	failChunk = 4096
)

// failConfig is the loopback configuration of addrs.
func failConfig(addrs []string) (*cluster.Config, error) {
	cfg := &cluster.Config{}
	for r, a := range addrs {
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			return nil, err
		}
		p, err := strconv.Atoi(port)
		if err != nil {
			return nil, err
		}
		cfg.Hosts = append(cfg.Hosts, cluster.Host{Hostname: host, Port: p, Device: "soft0", Rank: r})
	}
	return cfg, nil
}

func failJoinOptions(ln net.Listener) cluster.JoinOptions {
	return cluster.JoinOptions{Node: cluster.NodeOptions{Channel: channel.Options{QP: failQP}},
		Job: failJob, Token: []byte(failToken), Listener: ln}
}

// failVector fills v with rank r's operand of allreduce i.
func failVector(v []float64, r, i int) {
	for k := range v {
		v[k] = float64(r*1000 + i + k)
	}
}

// victimChild runs the child rank of a failure test: "victim,ALG,RANK,
// SIZE,ADDRS" (ADDRS separated by ';'), with the rank's exchange
// listener inherited as fd 3. It joins, builds a communicator and runs
// allreduces forever, printing "ready" after the first (the test kills or
// stops it).
func victimChild(spec string) int {
	s := testproc.ParseSpec(spec)
	if len(s) != 5 {
		fmt.Println("error: bad spec", spec)
		return 2
	}
	alg, rank := collective.Algorithm(s.Int(1)), s.Int(2)
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
	c, err := collective.New(ctx, n, collective.Options{Algorithm: alg, ChunkSize: failChunk})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	v := make([]float64, failCount)
	return testproc.Loop(func(i int) error {
		failVector(v, rank, i)
		return collective.Allreduce(ctx, c, nil, v, collective.Sum)
	})
}

// failResult is what a surviving rank saw.
type failResult struct {
	setup         error     // Join's or New's error (then nothing else)
	calls         int       // allreduces completed
	first, second error     // the allreduce that failed, and the next call
	barrier       error     // a barrier after that
	commErr       error     // Comm.Err afterwards
	closeComm     error     // Comm.Close's
	closeNode     error     // Node.Close's
	failed        time.Time // when the first allreduce failed
}

// failWorld runs a failure test: a world of n ranks of which victim runs
// in a child process (killed or stopped with sig once it completed an
// allreduce), the others here, every rank using alg. It returns what
// each surviving rank saw.
func failWorld(t *testing.T, transport string, alg collective.Algorithm, n, victim int, sig syscall.Signal) []failResult {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
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
	// The hang guard: far beyond the liveness bound, so that a rank that
	// fails by it (a timeout) fails the test.
	guard, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)

	// The child: the victim.
	spec := fmt.Sprintf("victim,%d,%d,%d,%s", alg, victim, n, strings.Join(addrs, ";"))
	cmd, lines := testproc.StartListening(t, lns[victim].(*net.TCPListener), childEnv(procChildEnv+"="+spec, "GOVERBS_SOFT_TRANSPORT="+transport))

	// The survivors.
	res := make([]failResult, n)
	testproc.Survive(t, guard, cmd, lines, sig, n, victim, func(r int) time.Time {
		s := &res[r]
		nd, err := cluster.Join(guard, cfg, r, failJoinOptions(lns[r]))
		if err != nil {
			s.setup = fmt.Errorf("join: %w", err)
			return time.Time{}
		}
		defer func() { s.closeNode = nd.Close() }()
		c, err := collective.New(guard, nd, collective.Options{Algorithm: alg, ChunkSize: failChunk})
		if err != nil {
			s.setup = fmt.Errorf("new: %w", err)
			return time.Time{}
		}
		v := make([]float64, failCount)
		for {
			failVector(v, r, s.calls)
			if err := collective.Allreduce(guard, c, nil, v, collective.Sum); err != nil {
				s.first, s.failed = err, time.Now()
				break
			}
			s.calls++
		}
		s.second = collective.Allreduce(guard, c, nil, v, collective.Sum)
		s.barrier = collective.Barrier(guard, c)
		s.commErr = c.Err()
		s.closeComm = c.Close()
		return s.failed
	})
	return res
}

// failCheck checks that every survivor of res failed naming victim: in
// its allreduce (a *cluster.RankError wrapping cluster.ErrPeerLost, not
// a timeout), then in its next allreduce and barrier (ErrPoisoned
// wrapping the same), and that it closed cleanly.
func failCheck(t *testing.T, res []failResult, victim int) {
	t.Helper()
	names := func(err error) bool {
		var re *cluster.RankError
		return errors.As(err, &re) && re.Rank == victim && errors.Is(err, cluster.ErrPeerLost)
	}
	for r, s := range res {
		if r == victim {
			continue
		}
		if s.setup != nil {
			t.Errorf("rank %d: %v", r, s.setup)
			continue
		}
		var ce *collective.Error
		if !names(s.first) || errors.Is(s.first, verbs.ErrTimeout) || !errors.As(s.first, &ce) || ce.Call != "allreduce" {
			t.Errorf("rank %d: allreduce %d: %v, want a collective.Error of the allreduce wrapping a RankError naming rank %d", r, s.calls, s.first, victim)
		}
		for what, err := range map[string]error{"the next allreduce": s.second, "the barrier after it": s.barrier} {
			if !names(err) || !errors.Is(err, collective.ErrPoisoned) {
				t.Errorf("rank %d: %s: %v, want ErrPoisoned and a RankError naming rank %d", r, what, err, victim)
			}
		}
		if !names(s.commErr) {
			t.Errorf("rank %d: Comm.Err: %v, want a RankError naming rank %d", r, s.commErr, victim)
		}
		if s.closeComm != nil || s.closeNode != nil {
			t.Errorf("rank %d: Comm.Close: %v, Node.Close: %v", r, s.closeComm, s.closeNode)
		}
		t.Logf("rank %d: after %d allreduces: %v", r, s.calls, s.first)
	}
}

// TestFailureReachesEveryRankCrossProcess: a rank killed (SIGKILL) or
// stopped (SIGSTOP, past the liveness bound) while the world loops over
// allreduces makes every other rank's current allreduce and its next
// calls fail, naming it, whatever the other ranks wait for. Every
// position (rank 0, a middle rank, the last rank) is tested for worlds
// of 3, 4 and 8, with both signals; each case takes an algorithm and a
// transport in turn, so that every algorithm and every transport meets
// every position, signal and world size (the worlds of 8 on shared
// memory only, the cheapest transport).
func TestFailureReachesEveryRankCrossProcess(t *testing.T) {
	sigs := []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP}
	sigName := map[syscall.Signal]string{syscall.SIGKILL: "SIGKILL", syscall.SIGSTOP: "SIGSTOP"}
	transports := []string{"shm", "unix", "tcp"}
	for i, n := range []int{3, 4, 8} {
		for j, pos := range []string{"root", "middle", "last"} {
			victim := map[string]int{"root": 0, "middle": 1, "last": n - 1}[pos]
			for k, sig := range sigs {
				alg := xAlgorithms[(i+j+k)%3]
				tr := transports[(i+2*j+k)%3]
				if n == 8 {
					tr = "shm"
				}
				name := fmt.Sprintf("%d/%s/%s/%s/%s", n, pos, sigName[sig], strings.ReplaceAll(alg.String(), " ", "-"), tr)
				t.Run(name, func(t *testing.T) {
					failCheck(t, failWorld(t, tr, alg, n, victim, sig), victim)
				})
			}
		}
	}
}
