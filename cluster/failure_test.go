package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
)

// Failure tests: one rank of a world runs in a child process (this test
// binary, re-executed: see procChild), the others in this process, all
// on soft0 over one inter-process transport. The child is killed
// (SIGKILL) or stopped (SIGSTOP) while every rank loops over barriers,
// or kills itself right after the endpoint exchange; every surviving
// rank's barrier must fail, and its next one too, naming the child's
// rank, before a generous hang guard (no rank's context has a deadline
// short enough to produce the failure by timing out).

// failQP is the queue pairs' transport timeout of the failure tests: a
// stopped rank is declared dead once a request to it has gone
// unanswered for timeout × (retries+1) (soft0: at least 250 ms).
var failQP = verbs.QPSpec{Timeout: 12, RetryCount: 3}

// failJob and failToken are the exchange's job and token in these tests.
const (
	failJob   = "failure"
	failToken = "failure-token"
)

// failChild runs the child rank of a failure test: "rank,ALG,MODE,RANK,
// SIZE,WHEN,ADDRS" (ADDRS separated by ';'), with the rank's exchange
// listener inherited as fd 3. WHEN "loop": join, then run barriers
// forever, printing "ready" after the first (the test kills or stops
// it); "share": the same with Shares (checking what they return, see
// shareData); "shares:K": K Shares and the barriers of shareSteps, then
// print "done", close and exit; "exchange": exchange endpoints and kill
// itself before connecting.
func failChild(parts []string) int {
	if len(parts) != 7 {
		fmt.Println("error: bad spec", parts)
		return 2
	}
	s := testproc.Spec(parts)
	alg, mode, rank, size, when := BarrierAlgorithm(s.Int(1)), Mode(s.Int(2)), s.Int(3), s.Int(4), s[5]
	addrs := s.List(6)
	ln, err := testproc.Listener()
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	ctx := context.Background()
	xc := ExchangeConfig{Rank: rank, Size: size, Mode: mode, Addrs: addrs, Listener: ln, Job: failJob, Token: []byte(failToken)}
	jo := JoinOptions{Job: failJob, Token: []byte(failToken), Listener: ln}
	opts := NodeOptions{Barrier: alg, Channel: channel.Options{QP: failQP}}
	if when == "exchange" {
		vc, err := verbs.Open("soft0")
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		pd, err := vc.AllocPD()
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		n, err := NewNode(pd, rank, size, opts)
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		card, items, err := n.LocalCard(nil)
		if err == nil {
			_, _, err = ExchangeCards(ctx, xc, card, items)
		}
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	jo.Node = opts
	n, err := join(ctx, "soft0", xc, jo)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	if k, ok := strings.CutPrefix(when, "shares:"); ok {
		steps, _ := strconv.Atoi(k)
		if err := shareSteps(ctx, n, steps); err != nil {
			fmt.Println("error:", err)
			return 1
		}
		fmt.Println("done")
		if err := n.Close(); err != nil {
			fmt.Println("error: close:", err)
			return 1
		}
		return 0
	}
	return testproc.Loop(func(i int) error { return failStep(ctx, n, when == "share", i) })
}

// failStep is step i of a rank's loop: a barrier, or a Share whose
// result it checks.
func failStep(ctx context.Context, n *Node, share bool, i int) error {
	if !share {
		return n.Barrier(ctx, nil)
	}
	got, err := n.Share(ctx, shareData(n.Rank(), i))
	if err != nil {
		return err
	}
	return shareCheck(got, n.Size(), i)
}

// failResult is what a surviving rank saw.
type failResult struct {
	join          error     // Join's error (then nothing else)
	barriers      int       // barriers passed
	first, second error     // the barrier that failed, and the next one
	err           error     // Node.Err afterwards
	close         error     // Node.Close's
	failed        time.Time // when the first barrier failed
}

// failWorld runs a failure test: a world of n ranks of which victim runs
// in a child process (killed or stopped with sig once it passed a
// barrier, or killing itself after the exchange when sig is 0), the
// others here. It returns what each surviving rank saw.
func failWorld(t *testing.T, transport string, alg BarrierAlgorithm, mode Mode, n, victim int, sig syscall.Signal) []failResult {
	t.Helper()
	return failWorldOf(t, transport, alg, mode, n, victim, sig, false)
}

// failWorldOf is failWorld with every rank looping over Shares instead of
// barriers if share is set.
func failWorldOf(t *testing.T, transport string, alg BarrierAlgorithm, mode Mode, n, victim int, sig syscall.Signal, share bool) []failResult {
	t.Helper()
	xNoLeaks(t)
	restore, err := soft.ForceTransport(transport)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	lns, addrs := xListeners(t, n)
	// The hang guard: far beyond the liveness bound, so that a rank
	// that fails by it (a timeout) fails the test.
	guard := xContext(t, 2*time.Minute)

	// The child: the victim.
	when := "loop"
	switch {
	case sig == 0:
		when = "exchange"
	case share:
		when = "share"
	}
	cmd, lines := failStart(t, transport, lns[victim], fmt.Sprintf("rank,%d,%d,%d,%d,%s,%s", alg, mode, victim, n, when, strings.Join(addrs, ";")))

	// The survivors.
	res := make([]failResult, n)
	testproc.Survive(t, guard, cmd, lines, sig, n, victim, func(r int) time.Time {
		xc := ExchangeConfig{Rank: r, Size: n, Mode: mode, Addrs: addrs}
		nd, err := join(guard, "soft0", xc, JoinOptions{Node: NodeOptions{Barrier: alg, Channel: channel.Options{QP: failQP}},
			Job: failJob, Token: []byte(failToken), Listener: lns[r]})
		if err != nil {
			res[r].join = err
			return time.Time{}
		}
		for {
			if err := failStep(guard, nd, share, res[r].barriers); err != nil {
				res[r].first, res[r].failed = err, time.Now()
				break
			}
			res[r].barriers++
		}
		res[r].second = failStep(guard, nd, share, res[r].barriers)
		res[r].err = nd.Err()
		res[r].close = nd.Close()
		return res[r].failed
	})
	return res
}

// failStart starts the child rank of spec (see failChild), handing it
// ln, its exchange listener (closed here), and returns it and its lines
// of output. The child is killed when t ends.
func failStart(t *testing.T, transport string, ln net.Listener, spec string) (*exec.Cmd, <-chan string) {
	t.Helper()
	return testproc.StartListening(t, ln.(*net.TCPListener), append(os.Environ(), procChildEnv+"="+spec, "GOVERBS_SOFT_TRANSPORT="+transport))
}

// failCheck checks that every survivor of res failed naming victim: in
// its barrier and the next, and in Node.Err, or (when the victim died
// during the exchange) already in Join.
func failCheck(t *testing.T, res []failResult, victim int) {
	t.Helper()
	names := func(err error) bool {
		var re *RankError
		if errors.As(err, &re) {
			return re.Rank == victim && errors.Is(err, ErrPeerLost)
		}
		var xe *ExchangeError
		return errors.As(err, &xe) && xe.Peer == victim && errors.Is(err, ErrPeerLost)
	}
	for r, s := range res {
		if r == victim {
			continue
		}
		if s.join != nil {
			if !names(s.join) {
				t.Errorf("rank %d: join: %v, want ErrPeerLost naming rank %d", r, s.join, victim)
			}
			t.Logf("rank %d: join: %v", r, s.join)
			continue
		}
		if !names(s.first) || errors.Is(s.first, verbs.ErrTimeout) {
			t.Errorf("rank %d: barrier %d: %v, want a RankError naming rank %d", r, s.barriers, s.first, victim)
		}
		if !names(s.second) || !errors.Is(s.second, ErrPoisoned) {
			t.Errorf("rank %d: the next barrier: %v, want ErrPoisoned and a RankError naming rank %d", r, s.second, victim)
		}
		if !names(s.err) {
			t.Errorf("rank %d: Node.Err: %v, want a RankError naming rank %d", r, s.err, victim)
		}
		if s.close != nil {
			t.Errorf("rank %d: Close: %v", r, s.close)
		}
		t.Logf("rank %d: after %d barriers: %v", r, s.barriers, s.first)
	}
}

var failTransports = []string{"shm", "unix", "tcp"}

// TestFailureReachesEveryRank: a rank killed (SIGKILL) or stopped
// (SIGSTOP, past the liveness bound) while the world loops over barriers
// makes every other rank's current barrier and the next fail, naming it,
// whatever the other ranks wait for. Every position (root, a middle rank,
// the last rank: a leaf of the binary tree) is tested for worlds of 3, 4
// and 8, with both signals; rather than the full cross product with the
// 3 algorithms and 3 transports (162 worlds), each of these 18 cases
// takes an algorithm and a transport such that every (algorithm,
// transport) pair occurs twice, and every algorithm and every transport
// meets every size, position and signal.
func TestFailureReachesEveryRank(t *testing.T) {
	sigs := []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP}
	sigName := map[syscall.Signal]string{syscall.SIGKILL: "SIGKILL", syscall.SIGSTOP: "SIGSTOP"}
	for i, n := range []int{3, 4, 8} {
		for j, pos := range []string{"root", "middle", "last"} {
			victim := map[string]int{"root": 0, "middle": 1, "last": n - 1}[pos]
			for k, sig := range sigs {
				alg := barAlgorithms[(i+j+k)%3]
				tr := failTransports[(i+2*j+k)%3]
				name := fmt.Sprintf("%d/%s/%s/%s/%s", n, pos, sigName[sig], strings.ReplaceAll(alg.String(), " ", "-"), tr)
				t.Run(name, func(t *testing.T) {
					failCheck(t, failWorld(t, tr, alg, Mode((i+j)%2), n, victim, sig), victim)
				})
			}
		}
	}
}

// TestFailureAfterExchange: a rank that dies right after the endpoint
// exchange (before it connects its queue pairs) does not leave a world
// with a hole: every other rank fails in Join or in its first barrier,
// naming it, in both exchange modes.
func TestFailureAfterExchange(t *testing.T) {
	for _, mode := range xModes {
		for _, pos := range []string{"root", "last"} {
			const n = 3
			victim := map[string]int{"root": 0, "last": n - 1}[pos]
			t.Run(fmt.Sprintf("%v/%s", mode, pos), func(t *testing.T) {
				tr := failTransports[victim%len(failTransports)]
				failCheck(t, failWorld(t, tr, BinaryTree, mode, n, victim, 0), victim)
			})
		}
	}
}

// TestFailureLazyWorld: in a world of 16 ranks, where each rank has
// posted only to its barrier partners (soft0 makes a queue pair's send
// ring, the channel a peer's batches, and soft0 a connection between
// processes, at the first request), a rank that fails is still named by
// every survivor: the rank that sees it fail writes the news to every
// other rank, most of them for the first time.
func TestFailureLazyWorld(t *testing.T) {
	const n = 16
	for _, c := range []struct {
		alg    BarrierAlgorithm
		victim int
		sig    syscall.Signal
		tr     string
	}{
		{BinaryTree, 13, syscall.SIGKILL, "shm"},
		{Dissemination, 6, syscall.SIGSTOP, "unix"},
	} {
		t.Run(fmt.Sprintf("%s/%d/%v/%s", strings.ReplaceAll(c.alg.String(), " ", "-"), c.victim, c.sig, c.tr), func(t *testing.T) {
			failCheck(t, failWorld(t, c.tr, c.alg, Rendezvous, n, c.victim, c.sig), c.victim)
		})
	}
}
