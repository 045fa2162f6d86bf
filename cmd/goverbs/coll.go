package main

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/bits"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/internal/spinwait"
)

// collConfig is the parsed command line of goverbs coll.
type collConfig struct {
	p            int
	sizes        []int
	iters        int
	warmup       int
	settle       time.Duration // each collective runs unmeasured this long before its first size (collSettle)
	latIters     int
	ops          []string
	alg          collective.Algorithm
	dtype        string
	inPlace      bool
	registered   bool // the buffers are collective.Buffers (zero-copy sends)
	dev          string
	transport    string // GOVERBS_SOFT_TRANSPORT of the ranks
	launch       string // auto, spawn, env
	chunk, slots int
	json         bool
	timeout      time.Duration
	cpuProfile   string // each rank writes its CPU profile to cpuProfile.rankN
}

// Environment of the ranks a spawning goverbs coll starts.
const (
	// envCollChild marks a rank started by goverbs coll: it joins the
	// world described by the GOVERBS_* launcher variables.
	envCollChild = "GOVERBS_COLL_CHILD"
	// envCollListener is set for rank 0: its rendezvous listener is
	// inherited as file descriptor 3.
	envCollListener = "GOVERBS_COLL_LISTENER"
)

const (
	collMinDefault   = 8
	collMaxDefault   = 64 << 20
	collMaxSize      = 1 << 30
	p2pBatchBytes    = 8 << 20  // bytes written per bandwidth iteration
	p2pDepth         = 16       // writes in flight in the bandwidth test, at most
	p2pInFlight      = 32 << 20 // bytes in flight in the bandwidth test, at most (2 writes at least)
	collMaxRanks     = 256
	collMaxIters     = 1 << 24 // -iters, -lat-iters: 128 MiB of samples
	defaultCollIters = 20
	defaultSettle    = 500 * time.Millisecond
)

// p2pBWSizes are the sizes of the point-to-point bandwidth test (those up
// to -max; the largest is the reference of the bandwidth goal).
var p2pBWSizes = []int{64 << 10, 1 << 20, 4 << 20, 16 << 20}

func runColl(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("coll", "[-p ranks] [-min size] [-max size] [-step 2|4] [-iters N] [-warmup N] [-ops allreduce,barrier] [-alg auto|rd|rabenseifner|ring] [-json]", stderr)
	var cfg collConfig
	var minS, maxS, ops, alg string
	var step int
	fs.IntVar(&cfg.p, "p", 2, "number of `ranks` (processes) to start; under a launcher, its world size")
	fs.StringVar(&minS, "min", "8", "smallest message `size` in bytes (K, M, G suffixes)")
	fs.StringVar(&maxS, "max", "64M", "largest message `size` in bytes (K, M, G suffixes)")
	fs.IntVar(&step, "step", 2, "size `factor` between rows (2 or 4)")
	fs.IntVar(&cfg.iters, "iters", defaultCollIters, "measured `iterations` per size (the time is their median)")
	fs.IntVar(&cfg.warmup, "warmup", 5, "unmeasured `iterations` before each size")
	fs.DurationVar(&cfg.settle, "settle", defaultSettle, "before its first size, each collective runs unmeasured for this `duration` (processes just started run slower for a while: see collSettle)")
	fs.IntVar(&cfg.latIters, "lat-iters", 1000, "ping-pongs of the point-to-point latency test")
	fs.StringVar(&ops, "ops", "allreduce,barrier", "comma-separated `collectives` to measure ("+strings.Join(collNames(), ", ")+")")
	fs.StringVar(&alg, "alg", "auto", "allreduce `algorithm`: auto, rd (recursive doubling), rabenseifner, ring")
	fs.StringVar(&cfg.dtype, "type", "float32", "element `type`: float32, float64, int32, int64")
	fs.BoolVar(&cfg.inPlace, "inplace", false, "run the collectives in place (recv is send) instead of out of place")
	fs.BoolVar(&cfg.registered, "registered", false, "put the buffers in collective.Buffers (registered: large messages are sent from them, without the staging copy)")
	fs.StringVar(&cfg.dev, "d", os.Getenv("GOVERBS_DEVICE"), "`device` of every rank (default $GOVERBS_DEVICE, else soft0)")
	fs.StringVar(&cfg.transport, "transport", os.Getenv("GOVERBS_SOFT_TRANSPORT"), "soft0 `transport` between the ranks: shm, unix, tcp (default $GOVERBS_SOFT_TRANSPORT, else shm)")
	fs.StringVar(&cfg.launch, "launch", "auto", "`mode`: spawn (start -p ranks here), env (this process is a rank of a launcher: mpirun, torchrun, GOVERBS_RANK...), auto (env when a launcher's variables are set)")
	fs.IntVar(&cfg.chunk, "chunk", 0, "collective.Options.ChunkSize in `bytes` (0: the default)")
	fs.IntVar(&cfg.slots, "slots", 0, "collective.Options.Slots (0: the default)")
	fs.BoolVar(&cfg.json, "json", false, "print one JSON object instead of the table")
	fs.DurationVar(&cfg.timeout, "timeout", 10*time.Minute, "bound of the whole run (a hang guard)")
	fs.StringVar(&cfg.cpuProfile, "cpuprofile", "", "write each rank's CPU profile of the collectives to `prefix`.rankN")
	pos, st := parseFlags(fs, args)
	if st >= 0 {
		return st
	}
	if len(pos) > 0 {
		return usageErr(stderr, "coll", "unexpected argument %q", pos[0])
	}
	lo, err := parseSize(minS)
	if err != nil {
		return usageErr(stderr, "coll", "-min: %v", err)
	}
	hi, err := parseSize(maxS)
	if err != nil {
		return usageErr(stderr, "coll", "-max: %v", err)
	}
	switch {
	case hi < lo:
		return usageErr(stderr, "coll", "-max (%d) is below -min (%d)", hi, lo)
	case hi > collMaxSize:
		return usageErr(stderr, "coll", "-max %d exceeds %d bytes", hi, collMaxSize)
	case step != 2 && step != 4:
		return usageErr(stderr, "coll", "-step must be 2 or 4, not %d", step)
	case cfg.p < 2 || cfg.p > collMaxRanks:
		return usageErr(stderr, "coll", "-p must be between 2 and %d, not %d", collMaxRanks, cfg.p)
	case cfg.iters < 1:
		return usageErr(stderr, "coll", "-iters must be at least 1, not %d", cfg.iters)
	case cfg.iters > collMaxIters:
		return usageErr(stderr, "coll", "-iters must be at most %d (every sample is kept), not %d", collMaxIters, cfg.iters)
	case cfg.warmup < 0:
		return usageErr(stderr, "coll", "-warmup must not be negative")
	case cfg.settle < 0:
		return usageErr(stderr, "coll", "-settle must not be negative")
	case cfg.latIters < 1:
		return usageErr(stderr, "coll", "-lat-iters must be at least 1, not %d", cfg.latIters)
	case cfg.latIters > collMaxIters:
		return usageErr(stderr, "coll", "-lat-iters must be at most %d (every sample is kept), not %d", collMaxIters, cfg.latIters)
	case cfg.timeout <= 0:
		return usageErr(stderr, "coll", "-timeout must be positive")
	case cfg.chunk < 0 || cfg.slots < 0:
		return usageErr(stderr, "coll", "-chunk and -slots must not be negative")
	}
	for s := lo; s <= hi; s *= step {
		cfg.sizes = append(cfg.sizes, s)
		if s > hi/step {
			break
		}
	}
	for _, o := range strings.Split(ops, ",") {
		o = strings.TrimSpace(o)
		if collByName(o) == nil {
			return usageErr(stderr, "coll", "-ops: unknown collective %q (want %s)", o, strings.Join(collNames(), ", "))
		}
		if !slices.Contains(cfg.ops, o) {
			cfg.ops = append(cfg.ops, o)
		}
	}
	if cfg.alg, err = parseAlg(alg); err != nil {
		return usageErr(stderr, "coll", "-alg: %v", err)
	}
	switch cfg.dtype {
	case "float32", "float64", "int32", "int64":
	default:
		return usageErr(stderr, "coll", "-type %q: want float32, float64, int32 or int64", cfg.dtype)
	}
	// A collective whose every size would be skipped (below one element,
	// or below one element of each rank for the collectives of p blocks,
	// as the ranks count: collRank) would have no row. The largest size
	// the steps make decides, not -max (-min 3 -max 5 makes 3 only).
	// Under a launcher whose world is larger than -p, rows of the block
	// collectives may still be missing.
	e, top := elemBytes(cfg.dtype), cfg.sizes[len(cfg.sizes)-1]
	for _, o := range cfg.ops {
		b := collByName(o)
		n := top / e
		if b.blocks {
			n -= n % cfg.p
		}
		if b.busFactor != nil && n == 0 {
			if b.blocks && top >= e {
				return usageErr(stderr, "coll", "%s: every size (at most %d bytes) is below one %s element of each of the %d ranks", o, top, cfg.dtype, cfg.p)
			}
			return usageErr(stderr, "coll", "%s: every size (at most %d bytes) is below one %s element (%d bytes)", o, top, cfg.dtype, e)
		}
	}
	if cfg.transport == "" {
		cfg.transport = "shm"
	}
	if cfg.dev == "" {
		cfg.dev = verbs.SoftDevice
	}
	launched := os.Getenv(envCollChild) != ""
	switch cfg.launch {
	case "spawn":
	case "env":
		launched = true
	case "auto":
		if !launched {
			_, err := cluster.ParseLaunch(cluster.EnvOptions{})
			launched = !errors.Is(err, cluster.ErrNoLauncher)
		}
	default:
		return usageErr(stderr, "coll", "-launch %q: want auto, spawn or env", cfg.launch)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	if launched {
		explicitP := false
		fs.Visit(func(f *flag.Flag) { explicitP = explicitP || f.Name == "p" })
		err = collRank(ctx, cfg, explicitP, stdout)
	} else {
		err = collSpawn(ctx, cfg, args, stdout, stderr)
	}
	if err != nil {
		return fail(stderr, "coll", err)
	}
	return exitOK
}

func parseAlg(s string) (collective.Algorithm, error) {
	switch strings.ToLower(s) {
	case "auto", "":
		return collective.AlgAuto, nil
	case "rd", "recursive-doubling", "recursive doubling":
		return collective.AlgRecursiveDoubling, nil
	case "rabenseifner", "rab":
		return collective.AlgRabenseifner, nil
	case "ring":
		return collective.AlgRing, nil
	}
	return 0, fmt.Errorf("unknown algorithm %q (want auto, rd, rabenseifner or ring)", s)
}

// --- the collectives of the table ---

// collBench is one collective of the table: its name, NCCL's bus
// bandwidth factor, and how to run one iteration of it on a rank.
type collBench struct {
	name string
	// busFactor is NCCL's busbw/algbw for p ranks; nil: a collective
	// without payload (one row, no bandwidth).
	busFactor func(p int) float64
	// blocks: the vector is p blocks of equal size, so the sizes are
	// rounded down to a multiple of p elements (as nccl-tests do), a
	// size below p elements skipped. Before, a row said the size asked
	// for and timed a vector of p × ⌊size/p⌋ (TestCollBlockSizes).
	blocks bool
	// alg names the algorithm c uses for bytes of elements of esz bytes.
	alg func(c *collective.Comm, cfg collConfig, bytes, esz int) string
	// run runs one iteration on count elements of the rank's buffers.
	run func(ctx context.Context, r *collBufs, count int) error
}

// collBufs are a rank's buffers, sized for the largest message, in one
// element type.
type collBufs struct {
	c   *collective.Comm
	esz int
	// The collectives on the rank's typed buffers (the entries' run
	// call them).
	allreduce func(ctx context.Context, count int) error
	others    func(ctx context.Context, kind string, count int) error
	release   func() // frees the collective.Buffers (-registered)
}

// collBenches is the table's list of collectives. A collective joins
// the table with one entry here (and a typed call in newCollBufs).
var collBenches = []collBench{
	{
		name:      "allreduce",
		busFactor: func(p int) float64 { return 2 * float64(p-1) / float64(p) },
		alg:       func(c *collective.Comm, _ collConfig, bytes, esz int) string { return c.AllreduceAlgorithm(bytes, esz) },
		run:       func(ctx context.Context, r *collBufs, n int) error { return r.allreduce(ctx, n) },
	},
	{
		name: "barrier",
		alg:  func(c *collective.Comm, _ collConfig, _, _ int) string { return c.BarrierAlgorithm() },
		run:  func(ctx context.Context, r *collBufs, _ int) error { return collective.Barrier(ctx, r.c) },
	},
	// NCCL's bus bandwidth factors: broadcast 1; allgather,
	// reduce-scatter and alltoall (p−1)/p. Their size is the whole
	// vector (p blocks of size/p).
	{
		name:      "broadcast",
		busFactor: func(int) float64 { return 1 },
		alg:       func(c *collective.Comm, _ collConfig, bytes, esz int) string { return c.BroadcastAlgorithm(bytes, esz) },
		run:       func(ctx context.Context, r *collBufs, n int) error { return r.others(ctx, "broadcast", n) },
	},
	{
		name:      "allgather",
		busFactor: func(p int) float64 { return float64(p-1) / float64(p) },
		blocks:    true,
		alg:       func(c *collective.Comm, _ collConfig, bytes, _ int) string { return c.AllgatherAlgorithm(bytes) },
		run:       func(ctx context.Context, r *collBufs, n int) error { return r.others(ctx, "allgather", n) },
	},
	{
		name:      "reducescatter",
		busFactor: func(p int) float64 { return float64(p-1) / float64(p) },
		blocks:    true,
		alg:       func(c *collective.Comm, _ collConfig, bytes, _ int) string { return c.ReduceScatterAlgorithm(bytes) },
		run:       func(ctx context.Context, r *collBufs, n int) error { return r.others(ctx, "reducescatter", n) },
	},
	{
		name:      "alltoall",
		busFactor: func(p int) float64 { return float64(p-1) / float64(p) },
		blocks:    true,
		alg:       func(c *collective.Comm, _ collConfig, bytes, _ int) string { return c.AlltoallAlgorithm(bytes) },
		run:       func(ctx context.Context, r *collBufs, n int) error { return r.others(ctx, "alltoall", n) },
	},
}

func collByName(name string) *collBench {
	for i := range collBenches {
		if collBenches[i].name == name {
			return &collBenches[i]
		}
	}
	return nil
}

func collNames() []string {
	var s []string
	for _, b := range collBenches {
		s = append(s, b.name)
	}
	return s
}

// newCollBufs allocates the buffers of count elements of type dtype, in
// collective.Buffers if registered (release frees them).
func newCollBufs(c *collective.Comm, dtype string, count int, inPlace, registered bool) (*collBufs, error) {
	switch dtype {
	case "float64":
		return typedBufs[float64](c, count, inPlace, registered)
	case "int32":
		return typedBufs[int32](c, count, inPlace, registered)
	case "int64":
		return typedBufs[int64](c, count, inPlace, registered)
	}
	return typedBufs[float32](c, count, inPlace, registered)
}

func typedBufs[T collective.Number](c *collective.Comm, count int, inPlace, registered bool) (*collBufs, error) {
	var bs []*collective.Buffer[T]
	alloc := func() ([]T, error) {
		if !registered {
			return make([]T, count), nil
		}
		b, err := collective.Alloc[T](c, count)
		if err != nil {
			return nil, err
		}
		bs = append(bs, b)
		return b.Slice(), nil
	}
	var send, recv, src []T
	var err error
	for _, p := range []*[]T{&send, &recv, &src} {
		if *p, err = alloc(); err != nil {
			for _, b := range bs {
				b.Close()
			}
			return nil, err
		}
	}
	if inPlace {
		send = nil // zeros: a sum in place stays finite
	} else {
		for i := range send {
			send[i] = 1
		}
	}
	var z T
	r := &collBufs{c: c, esz: int(unsafe.Sizeof(z))}
	r.release = func() {
		for _, b := range bs {
			b.Close()
		}
	}
	r.allreduce = func(ctx context.Context, n int) error {
		var s []T
		if send != nil {
			s = send[:n]
		}
		return collective.Allreduce(ctx, c, s, recv[:n], collective.Sum)
	}
	for i := range src {
		src[i] = 1
	}
	p := c.Size()
	r.others = func(ctx context.Context, kind string, n int) error {
		b := max(1, n/p) // block: the vector is p blocks
		if b*p > count {
			b = count / p
		}
		switch kind {
		case "broadcast":
			return collective.Broadcast(ctx, c, recv[:n], 0)
		case "allgather":
			return collective.Allgather(ctx, c, src[:b], recv[:b*p])
		case "reducescatter":
			return collective.ReduceScatter(ctx, c, src[:b*p], recv[:b], collective.Sum)
		case "alltoall":
			return collective.Alltoall(ctx, c, src[:b*p], recv[:b*p])
		}
		return fmt.Errorf("unknown collective %q", kind)
	}
	return r, nil
}

// --- launching the ranks ---

// collSpawn starts cfg.p ranks of this program (goverbs coll with the
// same flags), connected by a rendezvous at rank 0 on a loopback
// listener this process opens and hands down, and copies rank 0's
// output (the table) to stdout.
func collSpawn(ctx context.Context, cfg collConfig, args []string, stdout, stderr io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding this program to start the ranks: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	lf, err := ln.(*net.TCPListener).File()
	addr := ln.Addr().String()
	ln.Close()
	if err != nil {
		return err
	}
	defer lf.Close()
	var secret [24]byte
	rand.Read(secret[:])
	token, job := hex.EncodeToString(secret[:16]), "goverbs-coll-"+hex.EncodeToString(secret[16:])
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errw := &lockedWriter{w: stderr}
	cmds := make([]*exec.Cmd, cfg.p)
	for i := range cfg.p {
		cmd := exec.CommandContext(ctx, exe, append([]string{"coll"}, args...)...)
		cmd.Env = append(os.Environ(),
			envCollChild+"=1",
			"GOVERBS_RANK="+strconv.Itoa(i),
			"GOVERBS_WORLD_SIZE="+strconv.Itoa(cfg.p),
			"GOVERBS_ROOT="+addr,
			"GOVERBS_TOKEN="+token,
			"GOVERBS_JOB="+job,
			"GOVERBS_SOFT_TRANSPORT="+cfg.transport,
		)
		if os.Getenv("GOMAXPROCS") == "" {
			// The processors shared out among the ranks, at least one
			// each (see rankProcs).
			cmd.Env = append(cmd.Env, "GOMAXPROCS="+strconv.Itoa(rankProcs(cfg.p)))
		}
		cmd.Stderr = &prefixWriter{w: errw, prefix: fmt.Sprintf("rank %d: ", i)}
		if i == 0 {
			cmd.Env = append(cmd.Env, envCollListener+"=3")
			cmd.ExtraFiles = []*os.File{lf}
			cmd.Stdout = stdout
		}
		cmd.WaitDelay = 5 * time.Second
		if err := cmd.Start(); err != nil {
			cancel()
			for _, c := range cmds[:i] {
				c.Wait()
			}
			return fmt.Errorf("starting rank %d: %w", i, err)
		}
		cmds[i] = cmd
	}
	lf.Close()
	// The first rank to fail ends the run: the others would fail on
	// their own, but not before their timeouts if the world never formed.
	errs := make([]error, cfg.p)
	var wg sync.WaitGroup
	var first atomic.Int32
	first.Store(-1)
	for i, cmd := range cmds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[i] = cmd.Wait(); errs[i] != nil {
				first.CompareAndSwap(-1, int32(i))
				cancel()
			}
		}()
	}
	wg.Wait()
	if i := first.Load(); i >= 0 {
		return fmt.Errorf("rank %d: %w", i, errs[i])
	}
	return nil
}

// lockedWriter serialises the writes of the ranks' output copiers.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// prefixWriter prefixes every line with prefix.
type prefixWriter struct {
	w      io.Writer
	prefix string
	mid    bool // within a line
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	var out []byte
	for _, c := range b {
		if !p.mid {
			out = append(out, p.prefix...)
			p.mid = true
		}
		out = append(out, c)
		if c == '\n' {
			p.mid = false
		}
	}
	if _, err := p.w.Write(out); err != nil {
		return 0, err
	}
	return len(b), nil
}

// --- one rank ---

// p2p region layout: the ping word (written by the peer), the ack word
// (written by the peer), two source words, then the data.
const (
	p2pPing  = 0
	p2pAck   = 8
	p2pSrc   = 16
	p2pData  = 64
	remoteSz = 20 // addr u64 | len u64 | rkey u32
)

// agreed is the flags every rank must share, as "name=value" fields
// separated by spaces: the ranks compare them before they measure
// anything (ranks that disagreed, on -lat-iters for example, waited for
// one another in the point-to-point test until -timeout).
func (cfg *collConfig) agreed() string {
	return fmt.Sprintf("-iters=%d -warmup=%d -settle=%v -lat-iters=%d sizes=%v -ops=%s -alg=%v -type=%s -inplace=%v -registered=%v -chunk=%d -slots=%d",
		cfg.iters, cfg.warmup, cfg.settle, cfg.latIters, strings.ReplaceAll(fmt.Sprint(cfg.sizes), " ", ","),
		strings.Join(cfg.ops, ","), cfg.alg, cfg.dtype, cfg.inPlace, cfg.registered, cfg.chunk, cfg.slots)
}

// checkAgreed compares this rank's flags with those rank r published.
func checkAgreed(mine string, r int, theirs []byte) error {
	if string(theirs) == mine {
		return nil
	}
	a, b := strings.Fields(mine), strings.Fields(string(theirs))
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Errorf("rank %d runs with %s, this rank with %s: every rank needs the same flags", r, printable(b[i]), a[i])
		}
	}
	return fmt.Errorf("rank %d runs with other flags (%q), this rank with %q", r, printable(string(theirs)), mine)
}

// collRank runs this process as one rank of the world its launcher (or
// collSpawn) described; rank 0 prints the results.
func collRank(ctx context.Context, cfg collConfig, explicitP bool, stdout io.Writer) error {
	var ln net.Listener
	if os.Getenv(envCollListener) == "3" {
		f := os.NewFile(3, "rendezvous listener")
		l, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("inherited rendezvous listener: %w", err)
		}
		ln = l
	}
	agreed := cfg.agreed()
	bwMax := 0
	for _, s := range p2pSizes(cfg) {
		bwMax = max(bwMax, s)
	}
	var region *verbs.MemoryRegion
	node, err := cluster.FromEnv(ctx, cluster.EnvOptions{Join: cluster.JoinOptions{
		Device:   cfg.dev,
		Listener: ln,
		Prepare: func(n *cluster.Node) ([]byte, error) {
			size := p2pData + 8
			if n.Rank() < 2 {
				size = p2pData + bwMax
			}
			mr, err := n.PD().Alloc(size, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
			if err != nil {
				return nil, err
			}
			n.OnClose(mr.Close)
			region = mr
			r := mr.Remote()
			b := make([]byte, remoteSz, remoteSz+len(agreed))
			binary.LittleEndian.PutUint64(b, r.Addr)
			binary.LittleEndian.PutUint64(b[8:], r.Len)
			binary.LittleEndian.PutUint32(b[16:], r.RKey)
			return append(b, agreed...), nil
		},
	}})
	if err != nil {
		return err
	}
	defer node.Close()
	if explicitP && node.Size() != cfg.p {
		return fmt.Errorf("-p %d, but the launcher started %d ranks", cfg.p, node.Size())
	}
	cfg.p = node.Size()
	if cfg.p < 2 {
		return errors.New("the world has 1 rank: a collective benchmark needs at least 2")
	}
	for r := range cfg.p {
		if b := node.PeerData(r); r != node.Rank() && len(b) >= remoteSz {
			if err := checkAgreed(agreed, r, b[remoteSz:]); err != nil {
				return err
			}
		}
	}
	res := collResult{Ranks: cfg.p, Device: cfg.dev, Transport: cfg.transport, Type: cfg.dtype, Iters: cfg.iters, Warmup: cfg.warmup,
		SettleMS: float64(cfg.settle) / 1e6,
		InPlace:  cfg.inPlace, Registered: cfg.registered, Launch: "spawned", Procs: runtime.GOMAXPROCS(0)}
	if os.Getenv(envCollChild) == "" {
		res.Launch = "launcher"
	}
	if !strings.HasPrefix(cfg.dev, "soft") {
		res.Transport = ""
	}

	// Point-to-point baselines between ranks 0 and 1, the others waiting.
	if err := node.Barrier(ctx, nil); err != nil {
		return err
	}
	if node.Rank() < 2 {
		peer := 1 - node.Rank()
		b := node.PeerData(peer)
		if len(b) < remoteSz {
			return fmt.Errorf("rank %d published %d bytes of region description, want %d", peer, len(b), remoteSz)
		}
		pp := &p2p{ch: node.Channel().Peer(peer), mr: region, first: node.Rank() == 0, remote: verbs.RemoteRegion{
			Addr: binary.LittleEndian.Uint64(b), Len: binary.LittleEndian.Uint64(b[8:]), RKey: binary.LittleEndian.Uint32(b[16:])},
			// The ranks but 0 and 1 sleep in the barrier meanwhile.
			wait: spinwait.For(2, runtime.NumCPU())}
		if res.P2P, err = pp.measure(ctx, cfg); err != nil {
			return fmt.Errorf("point-to-point test: %w", err)
		}
	}
	if err := node.Barrier(ctx, nil); err != nil {
		return err
	}

	comm, err := collective.New(ctx, node, collective.Options{ChunkSize: cfg.chunk, Slots: cfg.slots, Algorithm: cfg.alg,
		Timeout: 2 * time.Minute})
	if err != nil {
		return err
	}
	defer comm.Close()
	bufs, err := newCollBufs(comm, cfg.dtype, max(1, cfg.sizes[len(cfg.sizes)-1]/elemBytes(cfg.dtype)), cfg.inPlace, cfg.registered)
	if err != nil {
		return err
	}
	defer bufs.release()
	// The iterations' times, and the whole loop's (the last element).
	samples, peak := make([]float64, cfg.iters+1), make([]float64, cfg.iters+1)
	if cfg.cpuProfile != "" {
		f, err := os.Create(fmt.Sprintf("%s.rank%d", cfg.cpuProfile, node.Rank()))
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	for _, name := range cfg.ops {
		b := collByName(name)
		sizes := cfg.sizes
		if b.busFactor == nil {
			sizes = []int{0}
		}
		settled := cfg.settle == 0
		for _, size := range sizes {
			count := size / bufs.esz
			if b.blocks {
				count -= count % cfg.p
			}
			if b.busFactor != nil && count == 0 {
				continue // below one element, or one block of each rank
			}
			bytes := count * bufs.esz
			if !settled {
				if err := collSettle(ctx, comm, cfg.settle, func() error { return b.run(ctx, bufs, count) }); err != nil {
					return fmt.Errorf("%s of %d bytes, settling: %w", name, bytes, err)
				}
				settled = true
			}
			if err := collective.Barrier(ctx, comm); err != nil {
				return err
			}
			var loop0 time.Time
			for i := -cfg.warmup; i < cfg.iters; i++ {
				t0 := time.Now()
				if i == 0 {
					loop0 = t0
				}
				if err := b.run(ctx, bufs, count); err != nil {
					return fmt.Errorf("%s of %d bytes: %w", name, bytes, err)
				}
				if i >= 0 {
					samples[i] = time.Since(t0).Seconds()
				}
			}
			samples[cfg.iters] = time.Since(loop0).Seconds()
			// An iteration takes as long as its slowest rank.
			if err := collective.Allreduce(ctx, comm, samples, peak, collective.Max); err != nil {
				return err
			}
			loop, iter := peak[cfg.iters], peak[:cfg.iters]
			slices.Sort(iter)
			alg := b.alg(bufs.c, cfg, bytes, bufs.esz) // as the ranks chose it
			row := collRow{Collective: name, Size: bytes, Count: count, Type: cfg.dtype, Algorithm: alg,
				TimeUS: median(iter) * 1e6, MinUS: iter[0] * 1e6, MaxUS: iter[len(iter)-1] * 1e6,
				MeanUS: loop / float64(cfg.iters) * 1e6}
			if b.busFactor == nil {
				row.Type, row.Count, row.Op = "", 0, ""
			} else {
				row.Op = "sum"
				row.AlgBW = float64(bytes) / (row.TimeUS * 1e-6) / 1e9
				row.BusBW = row.AlgBW * b.busFactor(cfg.p)
			}
			res.Rows = append(res.Rows, row)
		}
	}
	if node.Rank() != 0 {
		return nil
	}
	res.Goals = collGoals(cfg, res)
	if cfg.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	res.print(stdout)
	return nil
}

// collSettle runs run on every rank, unmeasured, until d has passed on
// some rank (the ranks agree every 16 runs, with an Allreduce of Max, so
// that they run it alike). Processes just started, and a pattern of
// load just begun, run slower for a while, whatever they run: on a
// 2-vCPU machine with 8 ranks the floor of a barrier between processes
// (internal/spinwait, BenchmarkFloorBarrier) took 12–17.5 µs over its
// first 3000 rounds against 8.9–9.4 µs over 40 000, and goverbs coll's
// 3000 barriers 37–59 µs (median 41) right after the start against
// 27–28 µs (one run of six 38) after 20 000 unmeasured ones. A
// collective's steady state is what a job that runs it over and over
// gets.
func collSettle(ctx context.Context, c *collective.Comm, d time.Duration, run func() error) error {
	start := time.Now()
	in, out := []float64{0}, []float64{0}
	for {
		for range 16 {
			if err := run(); err != nil {
				return err
			}
		}
		in[0] = 0
		if time.Since(start) >= d {
			in[0] = 1
		}
		if err := collective.Allreduce(ctx, c, in, out, collective.Max); err != nil {
			return err
		}
		if out[0] > 0 {
			return nil
		}
	}
}

func elemBytes(dtype string) int {
	if strings.HasSuffix(dtype, "64") {
		return 8
	}
	return 4
}

func median(sorted []float64) float64 {
	n := len(sorted)
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

// p2pSizes are the sizes of the bandwidth test: p2pBWSizes up to the
// largest collective size (the smallest of them at least).
func p2pSizes(cfg collConfig) []int {
	hi := cfg.sizes[len(cfg.sizes)-1]
	s := p2pBWSizes[:1]
	for _, n := range p2pBWSizes[1:] {
		if n <= hi {
			s = append(s, n)
		}
	}
	return s
}

// p2pBWIters is the number of measured iterations of each size of the
// bandwidth test (each writes p2pBatchBytes).
func p2pBWIters(cfg collConfig) int { return min(cfg.iters, 10) }

// --- point-to-point baselines ---

// p2p is one side of the point-to-point tests: this rank's region and
// the peer's.
type p2p struct {
	ch     *channel.Channel
	mr     *verbs.MemoryRegion
	remote verbs.RemoteRegion
	first  bool // rank 0: measures
	// wait is how the waits pause between polls: with Yield they offer
	// the processor to every thread of the machine (spinwait.Policy.Pause),
	// as the two ranks then share one processor, and a wait that only
	// spins would hold it until the kernel's tick lets the peer write
	// (milliseconds).
	wait spinwait.Policy
}

// P2PResult is the point-to-point baseline of the same transport.
type P2PResult struct {
	// OneWayUS is the median one-way latency of an 8-byte RDMA write:
	// half the round trip of a ping-pong of writes, each side polling
	// the word the other writes.
	OneWayUS float64 `json:"one_way_latency_us"`
	// BW is the write bandwidth by size: writes of the size back to back,
	// p2pDepth in flight, from the first post to the last completion.
	BW []P2PBW `json:"bandwidth"`
	// PeakGBps is the best of BW.
	PeakGBps float64 `json:"peak_gbps"`
}

// P2PBW is the point-to-point write bandwidth of one size (median of the
// iterations, GB/s = 1e9 bytes/s).
type P2PBW struct {
	Size int     `json:"size"`
	GBps float64 `json:"gbps"`
}

func (pp *p2p) word(off int) *uint64 { return (*uint64)(unsafe.Pointer(&pp.mr.Bytes()[off])) }

// post posts a write of the local bytes [off, off+n) to the peer's
// offset dst, retrying while the send queue is full.
func (pp *p2p) post(ctx context.Context, off, n, dst int) (channel.Handle, error) {
	src, err := pp.mr.SGE(off, n)
	if err != nil {
		return channel.Handle{}, err
	}
	for {
		h, err := pp.ch.PostWrite(pp.remote.At(uint64(dst)), src)
		if !errors.Is(err, verbs.ErrQueueFull) {
			return h, err
		}
		if err := pp.ch.Progress(); err != nil {
			return h, err
		}
		if pp.wait.Yield {
			pp.wait.Pause()
		}
		if err := ctx.Err(); err != nil {
			return h, err
		}
	}
}

// signal writes v into the peer's word at dst (8 bytes, from a source
// word of ours).
func (pp *p2p) signal(ctx context.Context, dst int, v uint64) error {
	src := p2pSrc
	if dst == p2pAck {
		src += 8
	}
	atomic.StoreUint64(pp.word(src), v)
	h, err := pp.post(ctx, src, 8, dst)
	if err != nil {
		return err
	}
	h.Release()
	return nil
}

// await spins until our word at off is v, polling the channel (soft0
// places a peer's writes when the process polls).
func (pp *p2p) await(ctx context.Context, off int, v uint64) error {
	w := pp.word(off)
	for spins := 0; atomic.LoadUint64(w) != v; spins++ {
		if err := pp.ch.Progress(); err != nil {
			return err
		}
		if pp.wait.Yield && atomic.LoadUint64(w) != v {
			// Paused only if the poll did not place it: a pause lets
			// the peer run, which takes a context switch or two.
			pp.wait.Pause()
		}
		if spins&1023 == 1023 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := pp.ch.Err(); err != nil {
				return err
			}
		}
	}
	return nil
}

func (pp *p2p) measure(ctx context.Context, cfg collConfig) (*P2PResult, error) {
	res := &P2PResult{}
	// Latency: ping-pong of 8-byte writes of the iteration number.
	rtts := make([]float64, 0, cfg.latIters)
	for i := 1; i <= latWarmup+cfg.latIters; i++ {
		v := uint64(i)
		t0 := time.Now()
		if pp.first {
			if err := pp.signal(ctx, p2pPing, v); err != nil {
				return nil, err
			}
			if err := pp.await(ctx, p2pPing, v); err != nil {
				return nil, err
			}
			if i > latWarmup {
				rtts = append(rtts, time.Since(t0).Seconds())
			}
		} else {
			if err := pp.await(ctx, p2pPing, v); err != nil {
				return nil, err
			}
			if err := pp.signal(ctx, p2pPing, v); err != nil {
				return nil, err
			}
		}
	}
	if pp.first {
		slices.Sort(rtts)
		res.OneWayUS = median(rtts) / 2 * 1e6
	}
	// Bandwidth: rank 0 writes, then signals the end; rank 1 acks.
	seq := uint64(0)
	for _, size := range p2pSizes(cfg) {
		k := max(1, p2pBatchBytes/size)
		var gbps []float64
		for i := -1; i < p2pBWIters(cfg); i++ { // one warm-up iteration
			seq++
			if !pp.first {
				if err := pp.await(ctx, p2pPing, seq); err != nil {
					return nil, err
				}
				if err := pp.signal(ctx, p2pAck, seq); err != nil {
					return nil, err
				}
				continue
			}
			t0 := time.Now()
			if err := pp.burst(ctx, size, k); err != nil {
				return nil, err
			}
			if err := pp.signal(ctx, p2pPing, seq); err != nil {
				return nil, err
			}
			if err := pp.await(ctx, p2pAck, seq); err != nil {
				return nil, err
			}
			if i >= 0 {
				gbps = append(gbps, float64(k*size)/time.Since(t0).Seconds()/1e9)
			}
		}
		if pp.first {
			slices.Sort(gbps)
			bw := P2PBW{Size: size, GBps: median(gbps)}
			res.BW = append(res.BW, bw)
			res.PeakGBps = max(res.PeakGBps, bw.GBps)
		}
	}
	return res, nil
}

// burst writes k messages of size bytes to the peer's data area, at most
// p2pDepth (and p2pInFlight bytes) in flight, and waits for their
// completions.
func (pp *p2p) burst(ctx context.Context, size, k int) error {
	var ring [p2pDepth]channel.Handle
	defer func() {
		for _, h := range ring {
			h.Release()
		}
	}()
	depth := max(2, min(p2pDepth, p2pInFlight/size))
	for i := range k + depth {
		slot := &ring[i%depth]
		if i >= depth {
			if err := slot.Wait(ctx); err != nil {
				return err
			}
			slot.Release()
			*slot = channel.Handle{}
		}
		if i < k {
			h, err := pp.post(ctx, p2pData, size, p2pData)
			if err != nil {
				return err
			}
			*slot = h
		}
	}
	return nil
}

// --- results ---

// collResult is the output of a run (the -json object).
type collResult struct {
	Ranks      int        `json:"ranks"`
	Launch     string     `json:"launch"` // spawned or launcher
	Device     string     `json:"device"`
	Transport  string     `json:"transport,omitempty"`
	Type       string     `json:"type"`
	InPlace    bool       `json:"in_place"`
	Registered bool       `json:"registered"` // buffers in collective.Buffers
	Iters      int        `json:"iters"`
	Warmup     int        `json:"warmup"`
	SettleMS   float64    `json:"settle_ms"`  // each collective ran unmeasured this long before its first size
	Procs      int        `json:"gomaxprocs"` // of each rank (of rank 0)
	P2P        *P2PResult `json:"p2p"`
	Rows       []collRow  `json:"rows"`
	Goals      []collGoal `json:"goals"`
}

// collRow is one row of the table: the median over the iterations of the
// slowest rank's time, NCCL's algorithm bandwidth (bytes / time) and bus
// bandwidth (algbw × the collective's factor), in GB/s (1e9 bytes/s).
type collRow struct {
	Collective string  `json:"collective"`
	Size       int     `json:"size"`
	Count      int     `json:"count"`
	Type       string  `json:"type,omitempty"`
	Op         string  `json:"op,omitempty"`
	Algorithm  string  `json:"algorithm"`
	TimeUS     float64 `json:"time_us"`
	MinUS      float64 `json:"min_us"` // the fastest iteration (of the slowest rank)
	MaxUS      float64 `json:"max_us"` // the slowest
	// MeanUS is the slowest rank's loop of iterations divided by their
	// number, as OSU's osu_barrier and nccl-tests time their loops: the
	// rate at which calls follow each other, where TimeUS also counts
	// the wait of a rank that entered before the others.
	MeanUS float64 `json:"mean_us"`
	AlgBW  float64 `json:"algbw_gbps"`
	BusBW  float64 `json:"busbw_gbps"`
}

// collGoal is one of issue 15's goals, measured.
type collGoal struct {
	Name    string  `json:"name"`
	Size    int     `json:"size,omitempty"`
	Value   float64 `json:"value"`
	Goal    float64 `json:"goal"`
	AtMost  bool    `json:"at_most"` // the goal is value <= Goal (else >=)
	Applies bool    `json:"applies"` // the goal is stated for this p
	Met     bool    `json:"met"`
	Note    string  `json:"note,omitempty"` // which goal: "ranks outnumber the processors" (issue 14's)
}

// Goals of issue 15 on soft0 shared memory, and issue 14's for ranks
// that outnumber the processors.
const (
	goalBusBW   = 0.8 // allreduce busbw at >= 16 MiB / p2p write bandwidth, p = 2, 4
	goalLatency = 1.5 // 8-byte allreduce or barrier latency / (⌈log2 p⌉ × one-way), p = 2, 4, 8
	goalBWSize  = 16 << 20
	// goalOversub is goalLatency when the spawned ranks outnumber the
	// processors (issue 14: at most 10 × with four ranks per processor).
	goalOversub = 10
)

func ceilLog2(p int) int { return bits.Len(uint(p - 1)) }

func collGoals(cfg collConfig, res collResult) []collGoal {
	var goals []collGoal
	if res.P2P == nil {
		return nil
	}
	lat := float64(ceilLog2(cfg.p)) * res.P2P.OneWayUS
	latGoal, latNote := goalLatency, ""
	if res.Launch == "spawned" && cfg.p > runtime.NumCPU() {
		latGoal, latNote = goalOversub, "ranks outnumber the processors"
	}
	for _, r := range res.Rows {
		switch {
		case r.Collective == "allreduce" && r.Size >= goalBWSize && res.P2P.PeakGBps > 0:
			v := r.BusBW / res.P2P.PeakGBps
			goals = append(goals, collGoal{Name: "allreduce busbw / p2p write bw", Size: r.Size, Value: v, Goal: goalBusBW,
				Applies: cfg.p == 2 || cfg.p == 4, Met: v >= goalBusBW})
		case (r.Collective == "allreduce" && r.Size == 8 || r.Collective == "barrier") && lat > 0:
			v := r.TimeUS / lat
			name := "allreduce latency / (ceil(log2 p) x one-way)"
			if r.Collective == "barrier" {
				name = "barrier latency / (ceil(log2 p) x one-way)"
			}
			goals = append(goals, collGoal{Name: name, Size: r.Size, Value: v, Goal: latGoal, AtMost: true,
				Applies: cfg.p == 2 || cfg.p == 4 || cfg.p == 8, Met: v <= latGoal, Note: latNote})
		}
	}
	return goals
}

func (res *collResult) print(w io.Writer) {
	tr := ""
	if res.Transport != "" {
		tr = ", transport " + res.Transport
	}
	place := "out of place"
	if res.InPlace {
		place = "in place"
	}
	if res.Registered {
		place += ", registered buffers"
	}
	fmt.Fprintf(w, "# goverbs coll: %d ranks (%s, GOMAXPROCS %d), device %s%s, %s, %d iterations (median of the slowest rank's), %d warm-up, each collective settled %v first\n",
		res.Ranks, res.Launch, res.Procs, res.Device, tr, place, res.Iters, res.Warmup, time.Duration(res.SettleMS*1e6))
	if p := res.P2P; p != nil {
		fmt.Fprintf(w, "# point to point, rank 0 -> 1, RDMA write: one-way latency (8 B, half a ping-pong) %.3g us\n", p.OneWayUS)
		var bw []string
		for _, b := range p.BW {
			bw = append(bw, fmt.Sprintf("%s %.3g", sizeName(b.Size), b.GBps))
		}
		fmt.Fprintf(w, "#   write bandwidth (GB/s): %s; peak %.3g\n", strings.Join(bw, ", "), p.PeakGBps)
	}
	fmt.Fprintf(w, "#\n# %10s %10s %8s %5s  %-12s %-20s %11s %11s %11s %11s\n",
		"size(B)", "count", "type", "redop", "collective", "algorithm", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "mean(us)")
	for _, r := range res.Rows {
		if r.Type == "" {
			fmt.Fprintf(w, "  %10d %10d %8s %5s  %-12s %-20s %11.2f %11s %11s %11.2f\n",
				r.Size, r.Count, "-", "-", r.Collective, r.Algorithm, r.TimeUS, "-", "-", r.MeanUS)
			continue
		}
		fmt.Fprintf(w, "  %10d %10d %8s %5s  %-12s %-20s %11.2f %11.3f %11.3f %11.2f\n",
			r.Size, r.Count, r.Type, r.Op, r.Collective, r.Algorithm, r.TimeUS, r.AlgBW, r.BusBW, r.MeanUS)
	}
	if len(res.Rows) > 0 {
		fmt.Fprintf(w, "# time: median over the iterations of the slowest rank's; mean: the slowest rank's loop / iterations (as OSU and nccl-tests)\n")
	}
	if len(res.Goals) > 0 {
		fmt.Fprintf(w, "#\n# goals (issue 15; issue 14 where the ranks outnumber the processors):\n")
	}
	for _, g := range res.Goals {
		cmp, ok := ">=", "met"
		if g.AtMost {
			cmp = "<="
		}
		if !g.Met {
			ok = "NOT met"
		}
		if !g.Applies {
			ok += ", goal not stated for this p"
		}
		size := ""
		if g.Size > 0 {
			size = " at " + sizeName(g.Size)
		}
		if g.Note != "" {
			size += ", " + g.Note
		}
		fmt.Fprintf(w, "#   %s%s: %.2f (goal %s %.1f: %s)\n", g.Name, size, g.Value, cmp, g.Goal, ok)
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.Itoa(n>>20) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.Itoa(n>>10) + " KiB"
	}
	return strconv.Itoa(n) + " B"
}

// rankProcs is the GOMAXPROCS of each of p ranks a spawning goverbs coll
// starts (unless GOMAXPROCS is set): the processors shared out, at least
// one each (spinwait.Procs), as torchrun sets OMP_NUM_THREADS=1 for its
// workers. On 2 processors, an 8-byte allreduce took 0.3–0.6 ms with 4
// ranks and 1.8–2.4 ms with 8 with the runtime's default, 0.09–0.24 and
// 0.67–0.82 ms with one each (3 rounds alternating, under a load average
// of 27–52 from other work).
func rankProcs(p int) int { return spinwait.Procs(p, runtime.NumCPU()) }
