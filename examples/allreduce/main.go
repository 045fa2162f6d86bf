// Command allreduce averages gradients across ranks the way data-parallel
// training does: every rank computes a gradient vector of its own (here a
// function of its rank and the step), the ranks sum the vectors with
// collective.Allreduce, every rank divides the sum by the number of ranks
// and applies the average to its copy of the parameters. All copies must
// stay identical, bit for bit: after the last step the ranks compare a
// hash of their parameters (with one more allreduce) and each checks
// samples of the average against a reference it computes itself.
//
// Run it locally: -np N starts N ranks of this program as processes on
// this machine, connected over soft0, and waits for them:
//
//	go run ./examples/allreduce -np 4
//
// Under a launcher every rank takes its rank, the world size and rank 0's
// address from the environment (cluster.FromEnv): Open MPI, MPICH's
// Hydra (which needs GOVERBS_JOB), Slurm, torchrun or a Kubernetes
// indexed Job:
//
//	go build -o allreduce ./examples/allreduce
//	GOVERBS_ROOT=127.0.0.1:18515 mpirun -np 4 ./allreduce
//	GOVERBS_ROOT=127.0.0.1:18515 GOVERBS_JOB=$(cat /proc/sys/kernel/random/uuid) mpiexec.hydra -np 4 ./allreduce
//	GOVERBS_PORT=29501 torchrun --nproc-per-node 4 --no-python ./allreduce  # torchrun's store holds MASTER_PORT
//
// Every rank prints one line; rank 0 adds a summary:
//
//	rank 2/4: ok: 10 steps, parameters 0xdb0d2fc4167be429
//	allreduce: 4 ranks (launcher goverbs, device soft0), 10 steps of 262144 float32 (1.0 MiB), algorithm auto
//	allreduce: all ranks agree: parameters 0xdb0d2fc4167be429
//	allreduce: per step 2.1ms, algorithm bandwidth 499.3 MB/s, bus bandwidth 748.9 MB/s (NCCL's definitions)
//
// Flags: -np to run locally; -steps; -n, the gradient's length; -algorithm
// auto|recursive-doubling|rabenseifner|ring; -timeout for the whole run;
// -token (or GOVERBS_TOKEN) and -job (or GOVERBS_JOB), which every rank
// must share; -listen-fd, an inherited listening socket for rank 0's
// rendezvous address (what -np hands rank 0).
//
// Exit status: 0 on success, 1 on failure, 2 for bad usage.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// Exit statuses.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

// config is what the flags say.
type config struct {
	np, steps, n, listenFD int
	alg                    collective.Algorithm
	timeout                time.Duration
	token, job             string
}

var algorithms = []collective.Algorithm{collective.AlgAuto, collective.AlgRecursiveDoubling, collective.AlgRabenseifner, collective.AlgRing}

func algName(a collective.Algorithm) string { return strings.ReplaceAll(a.String(), " ", "-") }

// run runs the program with args: as the launcher of -np local ranks, or
// as one rank.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("allreduce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg config
	var alg string
	fs.IntVar(&cfg.np, "np", 0, "start `N` ranks of this program on this machine (otherwise: be one rank of a launched job)")
	fs.IntVar(&cfg.steps, "steps", 10, "`number` of training steps")
	fs.IntVar(&cfg.n, "n", 1<<18, "gradient length, in float32 `elements`")
	fs.StringVar(&alg, "algorithm", "auto", "allreduce `algorithm`: auto, recursive-doubling, rabenseifner or ring")
	fs.DurationVar(&cfg.timeout, "timeout", 2*time.Minute, "deadline of the whole run")
	fs.StringVar(&cfg.token, "token", os.Getenv("GOVERBS_TOKEN"), "shared `secret` authenticating the endpoint exchange (default $GOVERBS_TOKEN)")
	fs.StringVar(&cfg.job, "job", "", "job `id`, the same for every rank (default $GOVERBS_JOB, or the launcher's job id)")
	fs.IntVar(&cfg.listenFD, "listen-fd", -1, "inherited listening socket `fd` for rank 0's rendezvous address")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "allreduce: "+format+"\n", a...)
		fs.Usage()
		return exitUsage
	}
	if fs.NArg() > 0 {
		return usage("unexpected arguments %q", fs.Args())
	}
	cfg.alg = -1
	for _, a := range algorithms {
		if algName(a) == alg {
			cfg.alg = a
		}
	}
	switch {
	case cfg.alg < 0:
		return usage("unknown algorithm %q", alg)
	case cfg.np < 0 || cfg.np > 1024:
		return usage("-np %d: want 1 to 1024", cfg.np)
	case cfg.steps < 1:
		return usage("-steps %d: want at least 1", cfg.steps)
	case cfg.n < 0 || cfg.n > 1<<28:
		return usage("-n %d: want 0 to %d", cfg.n, 1<<28)
	case cfg.np > 0 && cfg.listenFD >= 0:
		return usage("-np excludes -listen-fd")
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	if cfg.np > 0 {
		return launch(ctx, cfg, fs, stdout, stderr)
	}
	return rank(ctx, cfg, stdout, stderr)
}

// launch starts cfg.np ranks of this program on this machine, as a
// launcher would (GOVERBS_RANK, GOVERBS_WORLD_SIZE, GOVERBS_ROOT; rank 0
// inherits its rendezvous listener), with a fresh token and job id, and
// waits for all of them. Their output goes to stdout and stderr. fs holds
// our parsed flags, which the ranks get (but -np).
func launch(ctx context.Context, cfg config, fs *flag.FlagSet, stdout, stderr io.Writer) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitFail
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitFail
	}
	root := ln.Addr().String()
	f, err := ln.(*net.TCPListener).File()
	ln.Close()
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: %v\n", err)
		return exitFail
	}
	defer f.Close()
	secret := make([]byte, 16)
	rand.Read(secret)
	token, job := hex.EncodeToString(secret), "allreduce-"+hex.EncodeToString(secret[:4])
	// The ranks' flags: the ones given to us, as parsed, without -np. In
	// the -flag=value form a value starting with '-' stays a value.
	// Before, they were our arguments without any reading "np" (values
	// too) and the one after it: "-job np -steps 2" lost its value and
	// -steps (TestLaunchPassesFlagValues).
	var rankArgs []string
	fs.Visit(func(f *flag.Flag) {
		if f.Name != "np" {
			rankArgs = append(rankArgs, "-"+f.Name+"="+f.Value.String())
		}
	})
	var out sync.Mutex // one line at a time
	lw := &lineWriter{mu: &out, w: stdout}
	lwErr := &lineWriter{mu: &out, w: stderr}
	cmds := make([]*exec.Cmd, cfg.np)
	for r := range cfg.np {
		a := append([]string{}, rankArgs...)
		if r == 0 {
			a = append(a, "-listen-fd", "3")
		}
		cmd := exec.CommandContext(ctx, exe, a...)
		cmd.Env = append(launcherFreeEnv(), "GOVERBS_RANK="+strconv.Itoa(r), "GOVERBS_WORLD_SIZE="+strconv.Itoa(cfg.np),
			"GOVERBS_LOCAL_RANK="+strconv.Itoa(r), "GOVERBS_ROOT="+root, "GOVERBS_TOKEN="+token, "GOVERBS_JOB="+job)
		if r == 0 {
			cmd.ExtraFiles = []*os.File{f}
		}
		cmd.Stdout, cmd.Stderr = lw, lwErr
		if err := cmd.Start(); err != nil {
			fmt.Fprintf(stderr, "allreduce: starting rank %d: %v\n", r, err)
			for _, c := range cmds[:r] {
				c.Process.Kill()
				c.Wait()
			}
			return exitFail
		}
		cmds[r] = cmd
	}
	code := exitOK
	for r, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			fmt.Fprintf(stderr, "allreduce: rank %d: %v\n", r, err)
			code = exitFail
		}
	}
	lw.flush()
	lwErr.flush()
	return code
}

// launcherFreeEnv returns this process' environment without the
// variables of launchers (so that a rank started by -np does not take
// itself for a rank of an outer job).
func launcherFreeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "GOVERBS_RANK"), strings.HasPrefix(k, "GOVERBS_WORLD_SIZE"), k == "GOVERBS_LOCAL_RANK",
			k == "GOVERBS_ROOT", k == "GOVERBS_TOKEN", k == "GOVERBS_JOB", k == "GOVERBS_LISTEN",
			k == "RANK", k == "WORLD_SIZE", k == "LOCAL_RANK", k == "MASTER_ADDR", k == "MASTER_PORT",
			strings.HasPrefix(k, "OMPI_"), strings.HasPrefix(k, "PMI_"), strings.HasPrefix(k, "PMIX_"),
			strings.HasPrefix(k, "SLURM_"), k == "JOB_COMPLETION_INDEX":
			continue
		}
		env = append(env, kv)
	}
	return env
}

// lineWriter writes whole lines to w, one writer at a time.
type lineWriter struct {
	mu  *sync.Mutex
	w   io.Writer
	buf []byte
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	if i := strings.LastIndexByte(string(l.buf), '\n'); i >= 0 {
		l.w.Write(l.buf[:i+1])
		l.buf = append(l.buf[:0], l.buf[i+1:]...)
	}
	return len(p), nil
}

func (l *lineWriter) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.buf) > 0 {
		l.w.Write(append(l.buf, '\n'))
		l.buf = nil
	}
}

// rank runs one rank of the job the launcher started.
func rank(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	who := "?"
	l, err := cluster.ParseLaunch(cluster.EnvOptions{})
	if err != nil {
		fmt.Fprintf(stderr, "allreduce: launcher: %v (run under a launcher, or with -np N)\n", err)
		return exitFail
	}
	who = strconv.Itoa(l.Rank)
	fail := func(err error) int {
		fmt.Fprintf(stderr, "allreduce: rank %s: %v\n", who, err)
		return exitFail
	}
	jo := cluster.JoinOptions{Token: []byte(cfg.token), Job: cfg.job}
	if cfg.listenFD >= 0 {
		f := os.NewFile(uintptr(cfg.listenFD), "listener")
		ln, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return fail(fmt.Errorf("-listen-fd %d: %w", cfg.listenFD, err))
		}
		jo.Listener = ln
	}
	node, err := cluster.FromEnv(ctx, cluster.EnvOptions{Join: jo})
	if err != nil {
		return fail(fmt.Errorf("join: %w", err))
	}
	defer node.Close()
	c, err := collective.New(ctx, node, collective.Options{Algorithm: cfg.alg})
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	res, err := train(ctx, c, cfg)
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(stdout, "rank %d/%d: ok: %d steps, parameters %#016x\n", c.Rank(), c.Size(), cfg.steps, res.hash)
	if c.Rank() == 0 {
		bytes := 4 * float64(cfg.n)
		per := res.elapsed / time.Duration(cfg.steps)
		algbw := bytes / per.Seconds()
		busbw := algbw * 2 * float64(c.Size()-1) / float64(c.Size())
		fmt.Fprintf(stdout, "allreduce: %d ranks (launcher %s, device %s), %d steps of %d float32 (%s), algorithm %s\n",
			c.Size(), l.Launcher, node.PD().Context().Name(), cfg.steps, cfg.n, size(4*cfg.n), algName(cfg.alg))
		fmt.Fprintf(stdout, "allreduce: all ranks agree: parameters %#016x\n", res.hash)
		fmt.Fprintf(stdout, "allreduce: per step %v, algorithm bandwidth %s, bus bandwidth %s (NCCL's definitions)\n",
			per.Round(time.Microsecond), rate(algbw), rate(busbw))
	}
	return exitOK
}

// rate formats a bandwidth in bytes per second.
func rate(r float64) string {
	if r >= 1e9 {
		return fmt.Sprintf("%.2f GB/s", r/1e9)
	}
	return fmt.Sprintf("%.1f MB/s", r/1e6)
}

func size(b int) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}

// gradient fills g with rank r's gradient at step s: what a rank would
// compute from its share of a batch.
func gradient(g []float32, r, s int) {
	for i := range g {
		g[i] = gradElem(i, r, s)
	}
}

// gradElem is element i of rank r's gradient at step s.
func gradElem(i, r, s int) float32 {
	return float32(math.Sin(float64(i)*0.001+float64(s))) * float32(r+1) / 8
}

// The learning rate of the update.
const lr = 0.1

// result is what a rank's training produced.
type result struct {
	hash    uint64        // FNV-1a of the parameters' bits
	elapsed time.Duration // in Allreduce
}

// train runs cfg.steps steps of data-parallel training: compute the
// gradient, average it across the ranks (Allreduce Sum, divided by the
// size), check samples of the average against a reference, apply it to
// the parameters; then compares the parameters of every rank.
func train(ctx context.Context, c *collective.Comm, cfg config) (result, error) {
	var res result
	params := make([]float32, cfg.n)
	grad := make([]float32, cfg.n)
	p := float32(c.Size())
	for s := range cfg.steps {
		gradient(grad, c.Rank(), s)
		// Time the allreduce alone, not the wait for the slowest rank's
		// gradient.
		if err := collective.Barrier(ctx, c); err != nil {
			return res, fmt.Errorf("step %d: %w", s, err)
		}
		start := time.Now()
		if err := collective.Allreduce(ctx, c, nil, grad, collective.Sum); err != nil {
			return res, fmt.Errorf("step %d: %w", s, err)
		}
		res.elapsed += time.Since(start)
		for i := range grad {
			grad[i] /= p
		}
		// Spot checks: the sum of every rank's gradient, here.
		for i := 0; i < cfg.n; i += max(1, cfg.n/97) {
			var want float64
			for r := range c.Size() {
				want += float64(gradElem(i, r, s))
			}
			want /= float64(p)
			if d := math.Abs(float64(grad[i]) - want); d > 1e-5*math.Max(1, math.Abs(want)) {
				return res, fmt.Errorf("step %d: averaged gradient[%d] = %v, want %v", s, i, grad[i], want)
			}
		}
		for i := range params {
			params[i] -= lr * grad[i]
		}
	}
	h := fnv.New64a()
	h.Write(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(params))), 4*len(params)))
	res.hash = h.Sum64()
	// Every rank's hash: the maximum of h and of ^h (^ the minimum) are
	// this rank's only if every rank has the same.
	hs := []uint64{res.hash, ^res.hash}
	if err := collective.Allreduce(ctx, c, nil, hs, collective.Max); err != nil {
		return res, fmt.Errorf("comparing the parameters: %w", err)
	}
	if hs[0] != res.hash || ^hs[1] != res.hash {
		return res, fmt.Errorf("the ranks' parameters differ: hashes from %#016x to %#016x, this rank's %#016x", ^hs[1], hs[0], res.hash)
	}
	return res, nil
}
