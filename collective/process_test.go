package collective_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// Cross-process tests: every rank of a world is an OS process (this test
// binary, re-executed with procChildEnv set), on soft0 over one
// inter-process transport (GOVERBS_SOFT_TRANSPORT). The ranks find each
// other as under a launcher, from GOVERBS_RANK, GOVERBS_WORLD_SIZE and
// GOVERBS_ROOT (cluster.FromEnv); rank 0 inherits the rendezvous listener
// as fd 3, so no port is guessed.

// procChildEnv makes the test binary a rank: "xproc" for the ranks of
// TestCollectivesCrossProcess (see xprocChild), "victim,..." for the rank
// a failure test kills or stops (see victimChild).
const procChildEnv = "GOVERBS_COLLECTIVE_TEST_CHILD"

// xDirEnv names the directory of a world's barrier log (xprocChild).
const xDirEnv = "GOVERBS_COLLECTIVE_TEST_DIR"

func TestMain(m *testing.M) {
	if spec := os.Getenv(procChildEnv); spec != "" {
		os.Exit(procChild(spec))
	}
	os.Exit(m.Run())
}

func procChild(spec string) int {
	switch {
	case spec == "xproc":
		return xprocChild()
	case spec == "reopen":
		return reopenChild()
	case spec == "land":
		return landChild()
	case strings.HasPrefix(spec, "victim,"):
		return victimChild(spec)
	}
	fmt.Println("error: bad spec", spec)
	return 2
}

// childEnv is the environment of a child rank: this process' (with
// launcher variables of an outer job removed) and the race detector told
// not to sleep a second at exit.
func childEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "GOVERBS_RANK"), strings.HasPrefix(k, "GOVERBS_WORLD_SIZE"), k == "GOVERBS_ROOT",
			k == "GOVERBS_SOFT_TRANSPORT", k == "RANK", k == "WORLD_SIZE", strings.HasPrefix(k, "OMPI_COMM_WORLD"),
			strings.HasPrefix(k, "PMI_"), strings.HasPrefix(k, "SLURM_"), k == "GORACE":
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	return append(env, extra...)
}

// The matrix every world of TestCollectivesCrossProcess runs: every
// allreduce algorithm, for the first two cases and one of the others (in
// turn: xWorldCases), for every count of the case: 0 and 1 (for the
// first case), a prime, and a prime number of elements spanning many
// chunks of xChunk bytes (dozens, several per step of the ring at p = 8,
// more than the Slots of the window).
var (
	xAlgorithms = []collective.Algorithm{collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing}
	xCounts     = []int{0, 1, 13, 4099}
	xCases      = []xCase{
		xAllreduce("int64-sum", collective.Sum, func(r, i int) int64 { return int64(r)<<40 + int64(i)*7919 - int64(r*i) },
			func(a, b int64) int64 { return a + b }, 0),
		{name: "others", run: xOthers},
		xAllreduce("float32-sum", collective.Sum, func(r, i int) float32 { return float32(math.Cos(float64(r*104729+i*3))) / 3 },
			func(a, b float32) float32 { return a + b }, 1e-5),
		xAllreduce("int32-min", collective.Min, func(r, i int) int32 { return int32((i*31+r*17)%101 - 50) },
			func(a, b int32) int32 { return min(a, b) }, 0),
		xAllreduce("uint8-xor", collective.Xor, func(r, i int) uint8 { return uint8(i*13 + r*101 + r*i) },
			func(a, b uint8) uint8 { return a ^ b }, 0),
		// Floating-point sums: inexact, so the reference is approximate;
		// that every rank gets the same bits is checked by the hashes.
		xAllreduce("float64-sum", collective.Sum, func(r, i int) float64 { return math.Sin(float64(r*7919+i)) * 1e3 },
			func(a, b float64) float64 { return a + b }, 1e-12),
		// Small integers: bfloat16 sums are exact.
		xAllreduce("bfloat16-sum", collective.Sum, func(r, i int) collective.BFloat16 { return collective.BFloat16From(float32((r + i) % 16)) },
			func(a, b collective.BFloat16) collective.BFloat16 {
				return collective.BFloat16From(a.Float32() + b.Float32())
			}, 0),
	}
)

// xChunk is the communicators' chunk size: the largest messages take
// more chunks than the window (the default 4 slots) holds.
const xChunk = 512

// xWorldCases returns the cases world w of n ranks runs: the first two
// (only the first for the slow worlds of 8), and one of the others in
// turn, so that each meets several world sizes and every transport.
func xWorldCases(w, n int) []int {
	other := 2 + w%(len(xCases)-2)
	if n == 8 {
		return []int{0, other}
	}
	return []int{0, 1, other}
}

// xCasesEnv lists the cases (indexes in xCases, comma-separated) a rank
// of TestCollectivesCrossProcess runs.
const xCasesEnv = "GOVERBS_COLLECTIVE_TEST_CASES"

// xCountsOf returns the counts case k runs with: every count for the
// first case, the prime and the large one for the others.
func xCountsOf(k int) []int {
	if k == 0 {
		return xCounts
	}
	return xCounts[2:]
}

// xQP is the queue pairs' transport timeout of the cross-process worlds:
// 1.07 s × 8 (the default, 67 ms × 8, is shorter than a rank of a world
// of 8 race-enabled processes may go without a processor on a loaded
// 2-core machine; over TCP, soft0 then takes it for dead, see the
// report of TestCollectivesCrossProcess's failures).
var xQP = verbs.QPSpec{Timeout: 18}

// xBarriers is the number of barriers of the barrier loop.
const xBarriers = 20

// xGuard bounds a whole world (a hang guard, not a timing assertion).
const xGuard = 4 * time.Minute

// xCase is one allreduce of the matrix: run runs it on c with count
// elements (in place or not), checks the result against a reference and
// returns a hash of the result's bits.
type xCase struct {
	name string
	run  func(ctx context.Context, c *collective.Comm, count int, inPlace bool) (string, error)
}

// xAllreduce is the case of an allreduce with op over elements gen(rank,
// index); apply computes the reference in rank order. tol = 0 wants the
// exact reference; otherwise an error of at most tol × the sum of the
// operands' magnitudes.
func xAllreduce[T collective.Number](name string, op collective.Op, gen func(r, i int) T, apply func(a, b T) T, tol float64) xCase {
	return xCase{name: name, run: func(ctx context.Context, c *collective.Comm, count int, inPlace bool) (string, error) {
		r, p := c.Rank(), c.Size()
		recv := make([]T, count)
		send := recv
		if !inPlace {
			send = make([]T, count)
		}
		for i := range send {
			send[i] = gen(r, i)
		}
		if inPlace {
			send = nil
		}
		if err := collective.Allreduce(ctx, c, send, recv, op); err != nil {
			return "", err
		}
		for i, got := range recv {
			want, mag := gen(0, i), math.Abs(float64(gen(0, i)))
			for q := 1; q < p; q++ {
				want = apply(want, gen(q, i))
				mag += math.Abs(float64(gen(q, i)))
			}
			if tol == 0 && got != want || tol > 0 && math.Abs(float64(got)-float64(want)) > tol*mag {
				return "", fmt.Errorf("element %d is %v, want %v", i, got, want)
			}
		}
		return hashOf(recv), nil
	}}
}

// xOthers runs the other collectives on count elements per block
// (broadcast from the last rank, reduce and gather to rank 1 mod p,
// scatter from it, allgather, alltoall, reduce-scatter, scan, exscan),
// checks every result against its reference, and returns a hash of the
// results every rank shares (broadcast, allgather). inPlace is ignored.
func xOthers(ctx context.Context, c *collective.Comm, count int, _ bool) (string, error) {
	r, p := c.Rank(), c.Size()
	root := 1 % p
	gen := func(q, i int) int64 { return int64(q)<<32 + int64(i)*31 - int64(q*i) }
	check := func(what string, got []int64, want func(i int) int64) error {
		for i, v := range got {
			if w := want(i); v != w {
				return fmt.Errorf("%s: element %d is %d, want %d", what, i, v, w)
			}
		}
		return nil
	}
	mine := make([]int64, count)
	for i := range mine {
		mine[i] = gen(r, i)
	}
	bc := make([]int64, count)
	if r == p-1 {
		copy(bc, mine)
	}
	if err := collective.Broadcast(ctx, c, bc, p-1); err != nil {
		return "", err
	}
	if err := check("broadcast", bc, func(i int) int64 { return gen(p-1, i) }); err != nil {
		return "", err
	}
	sum := func(i int, upto int) int64 {
		var t int64
		for q := 0; q < upto; q++ {
			t += gen(q, i)
		}
		return t
	}
	red := make([]int64, count)
	if err := collective.Reduce(ctx, c, mine, red, collective.Sum, root); err != nil {
		return "", err
	}
	if r == root {
		if err := check("reduce", red, func(i int) int64 { return sum(i, p) }); err != nil {
			return "", err
		}
	}
	all := make([]int64, p*count)
	if err := collective.Allgather(ctx, c, mine, all); err != nil {
		return "", err
	}
	if err := check("allgather", all, func(i int) int64 { return gen(i/count, i%count) }); err != nil {
		return "", err
	}
	gat := make([]int64, p*count)
	if err := collective.Gather(ctx, c, mine, gat, root); err != nil {
		return "", err
	}
	if r == root {
		if err := check("gather", gat, func(i int) int64 { return gen(i/count, i%count) }); err != nil {
			return "", err
		}
	}
	sc := make([]int64, count)
	if err := collective.Scatter(ctx, c, all, sc, root); err != nil {
		return "", err
	}
	if err := check("scatter", sc, func(i int) int64 { return gen(r, i) }); err != nil {
		return "", err
	}
	// Alltoall: block j of rank q's send is gen(q, j·count+i); rank r
	// receives block r of every rank.
	a2aSend := make([]int64, p*count)
	for i := range a2aSend {
		a2aSend[i] = gen(r, i)
	}
	a2a := make([]int64, p*count)
	if err := collective.Alltoall(ctx, c, a2aSend, a2a); err != nil {
		return "", err
	}
	if err := check("alltoall", a2a, func(i int) int64 { return gen(i/count, r*count+i%count) }); err != nil {
		return "", err
	}
	rs := make([]int64, count)
	if err := collective.ReduceScatter(ctx, c, all, rs, collective.Sum); err != nil {
		return "", err
	}
	if err := check("reduce-scatter", rs, func(i int) int64 { return int64(p) * gen(r, i) }); err != nil {
		return "", err
	}
	scan := make([]int64, count)
	if err := collective.Scan(ctx, c, mine, scan, collective.Sum); err != nil {
		return "", err
	}
	if err := check("scan", scan, func(i int) int64 { return sum(i, r+1) }); err != nil {
		return "", err
	}
	exs := make([]int64, count)
	if err := collective.ExScan(ctx, c, mine, exs, collective.Sum); err != nil {
		return "", err
	}
	if r > 0 {
		if err := check("exscan", exs, func(i int) int64 { return sum(i, r) }); err != nil {
			return "", err
		}
	}
	return hashOf(append(bc, all...)), nil
}

// hashOf returns a hash of v's bits.
func hashOf[T collective.Number](v []T) string {
	var z T
	b := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v)*int(unsafe.Sizeof(z)))
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:8])
}

func caseKey(alg collective.Algorithm, name string, count int) string {
	return fmt.Sprintf("%s/%s/%d", strings.ReplaceAll(alg.String(), " ", "-"), name, count)
}

// xJoin joins the world of a child rank from the launcher variables
// (rank 0 inheriting the rendezvous listener as fd 3).
func xJoin(ctx context.Context) (*cluster.Node, error) {
	jo := cluster.JoinOptions{Node: cluster.NodeOptions{Channel: channel.Options{QP: xQP}}}
	if os.Getenv("GOVERBS_RANK") == "0" {
		f := os.NewFile(3, "listener")
		ln, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("listener: %w", err)
		}
		jo.Listener = ln
	}
	return cluster.FromEnv(ctx, cluster.EnvOptions{Join: jo})
}

// xprocChild is a rank of TestCollectivesCrossProcess. It joins the world
// from the launcher variables, runs the allreduce matrix with a
// communicator per algorithm, printing "result KEY HASH" for each, then
// the barrier loop, then prints "done". A failure prints "error: ..."
// and exits with status 1.
func xprocChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), xGuard)
	defer cancel()
	fail := func(format string, args ...any) int {
		fmt.Printf("error: "+format+"\n", args...)
		return 1
	}
	node, err := xJoin(ctx)
	if err != nil {
		return fail("join: %v", err)
	}
	defer node.Close()
	for _, alg := range xAlgorithms {
		c, err := collective.New(ctx, node, collective.Options{Algorithm: alg, ChunkSize: xChunk})
		if err != nil {
			return fail("new (%v): %v", alg, err)
		}
		for _, f := range strings.Split(os.Getenv(xCasesEnv), ",") {
			j, err := strconv.Atoi(f)
			if err != nil || j < 0 || j >= len(xCases) {
				return fail("bad %s %q", xCasesEnv, os.Getenv(xCasesEnv))
			}
			tc := xCases[j]
			for k, count := range xCountsOf(j) {
				key := caseKey(alg, tc.name, count)
				h, err := tc.run(ctx, c, count, k%2 == 1)
				if err != nil {
					c.Close()
					return fail("%s: %v", key, err)
				}
				fmt.Printf("result %s %s\n", key, h)
			}
		}
		if err := c.Close(); err != nil {
			return fail("close (%v): %v", alg, err)
		}
	}
	if err := barrierLoop(ctx, node); err != nil {
		return fail("barrier loop: %v", err)
	}
	fmt.Println("done")
	return 0
}

// xReopens is the number of communicators reopenChild opens and closes.
const xReopens = 20

// reopenChild is a rank of TestCommReopenCrossProcess: it builds and
// closes xReopens communicators in turn on one node, each running a few
// barriers and allreduces (whose last chunks' acknowledgements and the
// peers' probes are what a closing rank must not receive after it
// released its windows), then prints "done".
func reopenChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), xGuard)
	defer cancel()
	fail := func(format string, args ...any) int {
		fmt.Printf("error: "+format+"\n", args...)
		return 1
	}
	node, err := xJoin(ctx)
	if err != nil {
		return fail("join: %v", err)
	}
	defer node.Close()
	p := node.Size()
	for i := range xReopens {
		c, err := collective.New(ctx, node, collective.Options{ChunkSize: 256, Slots: 2})
		if err != nil {
			return fail("communicator %d: new: %v", i, err)
		}
		for k := range 3 {
			if err := collective.Barrier(ctx, c); err != nil {
				c.Close()
				return fail("communicator %d: barrier %d: %v", i, k, err)
			}
			v := make([]int32, 100+k)
			for j := range v {
				v[j] = int32(c.Rank() + j)
			}
			if err := collective.Allreduce(ctx, c, nil, v, collective.Sum); err != nil {
				c.Close()
				return fail("communicator %d: allreduce %d: %v", i, k, err)
			}
			for j, x := range v {
				if want := int32(p*(p-1)/2 + p*j); x != want {
					c.Close()
					return fail("communicator %d: allreduce %d: element %d is %d, want %d", i, k, j, x, want)
				}
			}
		}
		if err := c.Close(); err != nil {
			return fail("communicator %d: close: %v", i, err)
		}
	}
	fmt.Println("done")
	return 0
}

// barrierLoop runs xBarriers barriers and checks what they promise
// through a file every rank of the world appends to: before barrier k,
// rank r appends the line "k r"; no rank may have appended a line of
// barrier k+1 before this rank entered barrier k, and after barrier k
// every rank's line of barrier k is there. Every fifth barrier is
// followed by an allreduce of the ranks, which must sum to p(p−1)/2.
func barrierLoop(ctx context.Context, node *cluster.Node) error {
	path := filepath.Join(os.Getenv(xDirEnv), "barriers.log")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	c, err := collective.New(ctx, node, collective.Options{})
	if err != nil {
		return err
	}
	defer c.Close()
	r, p := c.Rank(), c.Size()
	count := func(k int) (int, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return 0, err
		}
		n := 0
		prefix := fmt.Sprintf("%04d ", k)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, prefix) {
				n++
			}
		}
		return n, nil
	}
	for k := range xBarriers {
		if _, err := fmt.Fprintf(f, "%04d %03d\n", k, r); err != nil { // one write: appended whole
			return err
		}
		if n, err := count(k + 1); err != nil || n != 0 {
			return fmt.Errorf("before barrier %d: %d lines of barrier %d already (%v)", k, n, k+1, err)
		}
		if err := collective.Barrier(ctx, c); err != nil {
			return fmt.Errorf("barrier %d: %w", k, err)
		}
		if n, err := count(k); err != nil || n != p {
			return fmt.Errorf("after barrier %d: %d lines of it, want %d (%v)", k, n, p, err)
		}
		if k%5 == 0 {
			v := []int64{int64(r)}
			if err := collective.Allreduce(ctx, c, nil, v, collective.Sum); err != nil {
				return fmt.Errorf("allreduce after barrier %d: %w", k, err)
			}
			if want := int64(p * (p - 1) / 2); v[0] != want {
				return fmt.Errorf("allreduce after barrier %d: %d, want %d", k, v[0], want)
			}
		}
	}
	return nil
}

// rankResult is what a child rank printed and how it exited.
type rankResult struct {
	results map[string]string
	done    bool
	out     string
	err     error
}

// xprocWorld runs a world of n child ranks (mode "xproc" or "reopen")
// over transport and returns what each printed.
func xprocWorld(t *testing.T, mode, transport string, n int, env ...string) []rankResult {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	root := ln.Addr().String()
	f, err := ln.(*net.TCPListener).File()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), xGuard+30*time.Second)
	defer cancel()
	res := make([]rankResult, n)
	var wg sync.WaitGroup
	for r := range n {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = childEnv(procChildEnv+"="+mode, "GOVERBS_SOFT_TRANSPORT="+transport,
			"GOVERBS_RANK="+strconv.Itoa(r), "GOVERBS_WORLD_SIZE="+strconv.Itoa(n), "GOVERBS_ROOT="+root,
			"GOVERBS_TOKEN=xproc-token", "GOVERBS_JOB="+t.Name(), xDirEnv+"="+dir)
		cmd.Env = append(cmd.Env, env...)
		if r == 0 {
			cmd.ExtraFiles = []*os.File{f}
		}
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[r].err = cmd.Wait()
			res[r].out = out.String()
			res[r].results = map[string]string{}
			sc := bufio.NewScanner(strings.NewReader(res[r].out))
			for sc.Scan() {
				switch fs := strings.Fields(sc.Text()); {
				case len(fs) == 3 && fs[0] == "result":
					res[r].results[fs[1]] = fs[2]
				case len(fs) == 1 && fs[0] == "done":
					res[r].done = true
				}
			}
		}()
	}
	wg.Wait()
	return res
}

// TestCollectivesCrossProcess: worlds of 2, 3, 4 and 8 processes over
// every inter-process transport of soft0 run Allreduce with every
// algorithm, on several element types and operations (three per world,
// every one in three worlds), for 0, 1, 13 and 4099 elements (the last
// in many chunks), each result checked against
// a reference at every rank, and every rank's result hashed: all ranks
// must get the same bits. Then a loop of barriers checked through a file
// the ranks append to.
func TestCollectivesCrossProcess(t *testing.T) {
	for i, tr := range []string{"shm", "unix", "tcp"} {
		for j, n := range []int{2, 3, 4, 8} {
			cases := xWorldCases(i+j, n)
			var names, idx []string
			for _, k := range cases {
				names = append(names, xCases[k].name)
				idx = append(idx, strconv.Itoa(k))
			}
			t.Run(fmt.Sprintf("%s/%d/%s", tr, n, strings.Join(names, ",")), func(t *testing.T) {
				res := xprocWorld(t, "xproc", tr, n, xCasesEnv+"="+strings.Join(idx, ","))
				for r, rr := range res {
					if rr.err != nil || !rr.done {
						t.Errorf("rank %d: exit %v, done %v:\n%s", r, rr.err, rr.done, rr.out)
					}
				}
				if t.Failed() {
					return
				}
				want := 0
				for _, k := range cases {
					want += len(xAlgorithms) * len(xCountsOf(k))
				}
				var keys []string
				for k := range res[0].results {
					keys = append(keys, k)
				}
				sort.Strings(keys)
				if len(keys) != want {
					t.Errorf("rank 0 reported %d results, want %d", len(keys), want)
				}
				for _, k := range keys {
					for r := 1; r < n; r++ {
						if got := res[r].results[k]; got != res[0].results[k] {
							t.Errorf("%s: rank %d's result hashes to %s, rank 0's to %s", k, r, got, res[0].results[k])
						}
					}
				}
				for r := 1; r < n; r++ {
					if len(res[r].results) != len(keys) {
						t.Errorf("rank %d reported %d results, rank 0 %d", r, len(res[r].results), len(keys))
					}
				}
			})
		}
	}
}

// TestCommReopenCrossProcess: communicators built and closed in turn on
// the same nodes, across processes, over every transport. Closing one
// must not break the world: a peer's last writes into this rank's
// windows (the acknowledgement of the last chunks it consumed, a probe)
// could otherwise reach them after they were released, failing the
// peer's queue pair with a remote access error and the world with it.
func TestCommReopenCrossProcess(t *testing.T) {
	for _, tr := range []string{"shm", "unix", "tcp"} {
		for _, n := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/%d", tr, n), func(t *testing.T) {
				for r, rr := range xprocWorld(t, "reopen", tr, n) {
					if rr.err != nil || !rr.done {
						t.Errorf("rank %d: exit %v, done %v:\n%s", r, rr.err, rr.done, rr.out)
					}
				}
			})
		}
	}
}
