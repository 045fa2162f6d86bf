package cluster

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/spinwait"
)

// xbenchEnv makes the test binary a rank of BenchmarkBarrierXproc:
// "RANK,SIZE,ALG,ITERS,ROOT" (ALG -1: the one-way ping-pong of ranks 0
// and 1).
const xbenchEnv = "GOVERBS_CLUSTER_XBENCH"

// xbenchSizesEnv overrides BenchmarkBarrierXproc's world sizes: a
// comma-separated list ("16,32,64").
const xbenchSizesEnv = "GOVERBS_XBENCH_SIZES"

// xbenchAlgorithms are the barriers BenchmarkBarrierXproc measures: the
// default first, then each algorithm.
var xbenchAlgorithms = append([]BarrierAlgorithm{Auto}, barAlgorithms...)

func init() {
	// Before TestMain: a benchmark rank only runs its part and exits. It
	// runs on a goroutine of its own: the goroutine of package
	// initialisation is locked to the main thread, and every yield or
	// park of a locked goroutine hands its processor to another thread
	// and back (measured: 6 futex calls and 4 context switches per round
	// trip of the one-way benchmark, 10–16 µs per one-way write).
	if spec := os.Getenv(xbenchEnv); spec != "" {
		done := make(chan error)
		go func() { done <- xbenchRank(spec) }()
		if err := <-done; err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
}

// xbenchJoin joins the world of size ranks whose root listens at root (or
// on ln, for rank 0).
func xbenchJoin(ctx context.Context, rank, size int, alg BarrierAlgorithm, root string, ln net.Listener) (*Node, error) {
	xc := ExchangeConfig{Rank: rank, Size: size, Mode: Rendezvous, Root: root}
	return join(ctx, "soft0", xc, JoinOptions{Node: NodeOptions{Barrier: alg}, Job: "xbench", Token: []byte("xbench"), Listener: ln})
}

// xbenchSettle is how long the ranks run barriers, unmeasured, before a
// barrier benchmark: processes just started run slower for a while
// (goverbs coll -settle has the measurements).
const xbenchSettle = 500 * time.Millisecond

// xbenchRun runs a rank's part: a warm-up barrier, xbenchSettle of
// barriers, iters one-way round trips (alg < 0; ranks 0 and 1) or iters
// barriers, then a last barrier. It returns how long the
// iterations took.
func xbenchRun(ctx context.Context, n *Node, alg, iters int) (time.Duration, error) {
	if err := n.Barrier(ctx, nil); err != nil {
		return 0, err
	}
	// Until rank 0 says the time is up (every 64 barriers, through
	// Share, so that every rank runs as many).
	for start := time.Now(); ; {
		for range 64 {
			if err := n.Barrier(ctx, nil); err != nil {
				return 0, err
			}
		}
		up := []byte{0}
		if time.Since(start) >= xbenchSettle {
			up[0] = 1
		}
		all, err := n.Share(ctx, up)
		if err != nil {
			return 0, err
		}
		if all[0][0] == 1 {
			break
		}
	}
	b := n.bar
	start := time.Now()
	for range iters {
		var err error
		switch {
		case alg >= 0:
			err = n.Barrier(ctx, nil)
		case n.Rank() == 0:
			if err = b.signal(ctx, b.world, 1); err == nil {
				err = b.await(ctx, b.world, 1)
			}
		case n.Rank() == 1:
			if err = b.await(ctx, b.world, 0); err == nil {
				err = b.signal(ctx, b.world, 0)
			}
		}
		if err != nil {
			return 0, err
		}
	}
	d := time.Since(start)
	return d, n.Barrier(ctx, nil)
}

func xbenchRank(spec string) error {
	f := strings.Split(spec, ",")
	if len(f) != 5 {
		return fmt.Errorf("bad spec %q", spec)
	}
	atoi := func(s string) int { v, _ := strconv.Atoi(s); return v }
	rank, size, alg, iters := atoi(f[0]), atoi(f[1]), atoi(f[2]), atoi(f[3])
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	a := BinaryTree
	if alg >= 0 {
		a = xbenchAlgorithms[alg]
	}
	n, err := xbenchJoin(ctx, rank, size, a, f[4], nil)
	if err != nil {
		return err
	}
	defer n.Close()
	_, err = xbenchRun(ctx, n, alg, iters)
	return err
}

// BenchmarkBarrierXproc is BenchmarkBarrier with every rank in its own
// process (soft0; GOVERBS_SOFT_TRANSPORT picks the transport), for p up to
// 4 × the CPUs: ranks outnumber cores. Its baseline, measured first in the
// same run, is the one-way latency L of the barrier's flag write between
// two processes (half a ping-pong of signal and await). Each barrier
// sub-benchmark reports ⌈log2 p⌉ × L as ns-log2p-oneway and the ratio as
// x-log2p-oneway. The ranks run barriers unmeasured for xbenchSettle
// before the measured round trips or barriers. The benchmark process is rank 0; the others are child
// processes started for each run of the function. Each rank runs with
// GOMAXPROCS = max(1, processors ÷ ranks) unless GOMAXPROCS is set. For
// example:
//
//	go test -run '^$' -bench BarrierXproc -benchtime 200x ./cluster/
//
// GOVERBS_XBENCH_SIZES replaces the world sizes (2, CPUs+1, 2 × CPUs,
// 4 × CPUs) with its comma-separated list.
func BenchmarkBarrierXproc(b *testing.B) {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	world := func(b *testing.B, size, alg int, run func(n *Node) (time.Duration, error)) time.Duration {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		// The ranks share out the processors, as goverbs coll's do
		// (package collective, Waiting), unless GOMAXPROCS is set.
		var procs []string
		if os.Getenv("GOMAXPROCS") == "" {
			share := spinwait.Procs(size, runtime.NumCPU())
			procs = []string{"GOMAXPROCS=" + strconv.Itoa(share)}
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(share))
		}
		var kids []*exec.Cmd
		for r := 1; r < size; r++ {
			c := exec.Command(exe)
			c.Env = append(os.Environ(), fmt.Sprintf("%s=%d,%d,%d,%d,%s", xbenchEnv, r, size, alg, b.N, ln.Addr()))
			c.Env = append(c.Env, procs...)
			out, _ := c.StdoutPipe()
			c.Stderr = os.Stderr
			if err := c.Start(); err != nil {
				b.Fatal(err)
			}
			go func() {
				s := bufio.NewScanner(out)
				for s.Scan() {
					b.Errorf("rank %d: %s", r, s.Text())
				}
			}()
			kids = append(kids, c)
		}
		a := BinaryTree
		if alg >= 0 {
			a = xbenchAlgorithms[alg]
		}
		n, err := xbenchJoin(ctx, 0, size, a, ln.Addr().String(), ln)
		if err != nil {
			b.Fatal(err)
		}
		d, err := run(n)
		n.Close()
		for _, c := range kids {
			if werr := c.Wait(); werr != nil && err == nil {
				err = werr
			}
		}
		if err != nil {
			b.Fatal(err)
		}
		return d
	}
	var oneWay float64
	b.Run("one-way-write", func(b *testing.B) {
		d := world(b, 2, -1, func(n *Node) (time.Duration, error) { return xbenchRun(context.Background(), n, -1, b.N) })
		oneWay = float64(d.Nanoseconds()) / float64(b.N) / 2
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(oneWay, "ns/one-way")
	})
	cpus := runtime.NumCPU()
	sizes := []int{2, cpus + 1, 2 * cpus, 4 * cpus}
	if s := os.Getenv(xbenchSizesEnv); s != "" {
		sizes = sizes[:0]
		for _, f := range strings.Split(s, ",") {
			p, err := strconv.Atoi(f)
			if err != nil || p < 2 {
				b.Fatalf("%s=%q: want a comma-separated list of world sizes of at least 2", xbenchSizesEnv, s)
			}
			sizes = append(sizes, p)
		}
	}
	for ai, alg := range xbenchAlgorithms {
		for _, p := range sizes {
			b.Run(fmt.Sprintf("%s/p=%d", strings.ReplaceAll(alg.String(), " ", "-"), p), func(b *testing.B) {
				d := world(b, p, ai, func(n *Node) (time.Duration, error) { return xbenchRun(context.Background(), n, ai, b.N) })
				per := float64(d.Nanoseconds()) / float64(b.N)
				b.ReportMetric(per, "ns/op")
				if oneWay > 0 {
					base := float64(barLog2(p)) * oneWay
					b.ReportMetric(base, "ns-log2p-oneway")
					b.ReportMetric(per/base, "x-log2p-oneway")
				}
			})
		}
	}
}
