package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/goverbs/verbs"
)

// benchConfig is the parsed command line of goverbs bench.
type benchConfig struct {
	op         string // "write", "read" or "send"
	lat        bool
	sizes      []int
	iters      int
	dev        string
	dev2       string
	batch      int
	cqMod      int // signal every cqMod-th request (bandwidth)
	txDepth    int
	rxDepth    int
	mtu        verbs.MTU
	timeoutExp int // QP ACK timeout exponent (perftest -u); 0: the QPSpec default
	inline     int // max inline data (perftest -I); -1: 64 for latency, none for bandwidth
	json       bool

	// Two-process mode (perftest's topology): the server listens on
	// bind:port for one client; the client connects to host:port.
	server  bool
	host    string
	port    int
	bind    string
	token   string        // shared secret of server and client (oob.go); "": none
	timeout time.Duration // connecting and exchanging the parameters

	badRKey bool // tests: use a wrong rkey, so that completions fail
}

// envBenchToken is the default of --token.
const envBenchToken = "GOVERBS_BENCH_TOKEN"

const (
	defaultBWSize   = 65536
	defaultLatSize  = 2
	defaultBWIters  = 5000
	defaultLatIters = 1000
	maxSweepShift   = 23 // --all: 2 .. 8 MiB
	maxMessageSize  = 1 << 30
	maxLatIters     = 1 << 26 // 512 MiB of latency samples
	defaultBatch    = 16      // --batch, unless --tx-depth is too small for it
)

func runBench(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("bench", "write|read|send [--lat] [-s size] [-n iters] [-d dev] [--dev2 dev] [--batch N] [--tx-depth N] [--all] [--json] [--server | HOST] [-p port]", stderr)
	var cfg benchConfig
	var size string
	fs.BoolVar(&cfg.lat, "lat", false, "measure latency instead of bandwidth")
	fs.StringVar(&size, "s", "", "message `size` in bytes (K, M, G suffixes; default 65536 for bandwidth, 2 for latency)")
	fs.StringVar(&size, "size", "", "same as -s")
	fs.IntVar(&cfg.iters, "n", 0, "`iterations` per size (default 5000 for bandwidth, 1000 for latency)")
	fs.IntVar(&cfg.iters, "iters", 0, "same as -n")
	fs.StringVar(&cfg.dev, "d", "", "`device` of both queue pairs (default: the default device, see goverbs devices)")
	fs.StringVar(&cfg.dev, "ib-dev", "", "same as -d")
	fs.StringVar(&cfg.dev2, "dev2", "", "`device` of the second queue pair (default: the first's)")
	fs.IntVar(&cfg.batch, "batch", defaultBatch, "bandwidth: requests per doorbell batch; the last of each batch is signaled (unless given, fewer than the default to fit a small --tx-depth)")
	fs.IntVar(&cfg.cqMod, "cq-mod", 0, "bandwidth: signal every `N`th request (perftest -Q; default --batch)")
	fs.IntVar(&cfg.txDepth, "tx-depth", 128, "send requests kept outstanding")
	fs.IntVar(&cfg.txDepth, "t", 128, "same as --tx-depth")
	fs.IntVar(&cfg.rxDepth, "rx-depth", 512, "receives kept posted (send test)")
	cfg.inline = -1
	fs.Var((*inlineFlag)(&cfg.inline), "I", "max inline data in `bytes` (perftest -I; auto: 64 for latency, 0 for bandwidth)")
	fs.Var((*inlineFlag)(&cfg.inline), "inline-size", "same as -I, in `bytes`")
	fs.IntVar(&cfg.timeoutExp, "u", 0, "QP ACK timeout `exponent`: 4.096 us * 2^N (perftest -u; default 14)")
	fs.IntVar(&cfg.timeoutExp, "qp-timeout", 0, "same as -u")
	mtu := fs.Int("mtu", 0, "path MTU in `bytes` (256..4096; default: the port's active MTU)")
	all := fs.Bool("all", false, "sweep message sizes 2 .. 8M in powers of two")
	fs.BoolVar(&cfg.json, "json", false, "print one JSON object per result row instead of the table")
	fs.BoolVar(&cfg.server, "server", false, "run the server side of a two-process test: wait for one client (goverbs bench ... HOST)")
	fs.IntVar(&cfg.port, "p", 18515, "TCP `port` of the server's out-of-band exchange (two-process mode)")
	fs.IntVar(&cfg.port, "port", 18515, "same as -p")
	fs.StringVar(&cfg.bind, "bind", "", "`address` the server listens on (default: all)")
	fs.DurationVar(&cfg.timeout, "timeout", time.Minute, "how long to wait for the peer to connect, exchange parameters, or say anything (the server, while the client measures)")
	fs.StringVar(&cfg.token, "token", os.Getenv(envBenchToken), "shared `secret` of server and client: the exchange is encrypted and only a client that proves it is served (default $"+envBenchToken+", which keeps it out of the process list)")
	pos, st := parseFlags(fs, args)
	if st >= 0 {
		return st
	}
	switch {
	case len(pos) == 0:
		return usageErr(stderr, "bench", "missing test: write, read or send")
	case len(pos) > 2:
		return usageErr(stderr, "bench", "unexpected argument %q", pos[2])
	case len(pos) == 2 && cfg.server:
		return usageErr(stderr, "bench", "--server takes no HOST (%q): the server waits for the client", pos[1])
	case len(pos) == 2:
		cfg.host = unbracket(pos[1])
		if hasPort(cfg.host) {
			return usageErr(stderr, "bench", "HOST %q has a port: give the port with -p", cfg.host)
		}
	}
	remote := cfg.server || cfg.host != ""
	switch {
	case remote && cfg.dev2 != "":
		return usageErr(stderr, "bench", "--dev2 is for the one-process loopback; with --server or HOST each process uses its own -d")
	case cfg.port < 1 || cfg.port > 65535:
		return usageErr(stderr, "bench", "-p must be a TCP port (1..65535), not %d", cfg.port)
	case cfg.timeout <= 0:
		return usageErr(stderr, "bench", "--timeout must be positive, not %v", cfg.timeout)
	case cfg.bind != "" && !cfg.server:
		return usageErr(stderr, "bench", "--bind is for --server")
	case hasPort(cfg.bind):
		return usageErr(stderr, "bench", "--bind %q has a port: give the port with -p", cfg.bind)
	case cfg.token != "" && !remote:
		return usageErr(stderr, "bench", "--token is for the two-process mode (--server or HOST)")
	}
	cfg.bind = unbracket(cfg.bind)
	cfg.op = pos[0]
	switch cfg.op {
	case "write", "read", "send":
	default:
		return usageErr(stderr, "bench", "unknown test %q (want write, read or send)", cfg.op)
	}
	if cfg.iters == 0 {
		cfg.iters = defaultBWIters
		if cfg.lat {
			cfg.iters = defaultLatIters
		}
	}
	if cfg.iters < 1 {
		return usageErr(stderr, "bench", "-n must be at least 1, not %d", cfg.iters)
	}
	if cfg.lat && cfg.iters > maxLatIters {
		return usageErr(stderr, "bench", "-n must be at most %d with --lat (every sample is kept), not %d", maxLatIters, cfg.iters)
	}
	if cfg.inline < -1 || cfg.inline > 1024 {
		return usageErr(stderr, "bench", "-I must be between 0 and 1024 bytes, not %d", cfg.inline)
	}
	if cfg.timeoutExp < 0 || cfg.timeoutExp > 31 {
		return usageErr(stderr, "bench", "-u must be between 1 and 31 (0: the default, 14), not %d", cfg.timeoutExp)
	}
	if cfg.txDepth < 1 {
		return usageErr(stderr, "bench", "--tx-depth must be at least 1, not %d", cfg.txDepth)
	}
	if cfg.rxDepth < 1 {
		return usageErr(stderr, "bench", "--rx-depth must be at least 1, not %d", cfg.rxDepth)
	}
	// --batch and --cq-mod are bandwidth flags: a latency test posts one
	// request at a time (perftest's ib_*_lat take neither, and default to
	// -t 1). Before, their checks ran in every mode, so the default
	// --batch of 16 refused "bench write --lat -t 8", and -t 1, perftest's
	// default (TestBatchFlagsWithSmallTxDepth).
	if !cfg.lat {
		if st := checkBatch(&cfg, fs, stderr); st >= 0 {
			return st
		}
	}
	if *mtu != 0 {
		m, err := verbs.MTUFromBytes(*mtu)
		if err != nil {
			return usageErr(stderr, "bench", "--mtu: %v", strings.TrimPrefix(err.Error(), "verbs: "))
		}
		cfg.mtu = m
	}
	switch {
	case *all && size != "":
		return usageErr(stderr, "bench", "--all and -s exclude each other")
	case *all:
		for s := 1; s <= maxSweepShift; s++ {
			cfg.sizes = append(cfg.sizes, 1<<s)
		}
	case size != "":
		n, err := parseSize(size)
		if err != nil {
			return usageErr(stderr, "bench", "-s: %v", err)
		}
		cfg.sizes = []int{n}
	case cfg.lat:
		cfg.sizes = []int{defaultLatSize}
	default:
		cfg.sizes = []int{defaultBWSize}
	}
	if remote {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if err := benchRemote(ctx, cfg, stdout, stderr); err != nil {
			return fail(stderr, "bench", err)
		}
		return exitOK
	}
	if err := bench(cfg, stdout); err != nil {
		return fail(stderr, "bench", err)
	}
	return exitOK
}

// checkBatch checks (and, when not given, chooses) --batch and --cq-mod
// of a bandwidth test. It returns a usage error's exit status, or -1.
func checkBatch(cfg *benchConfig, fs *flag.FlagSet, stderr io.Writer) int {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if !given["batch"] {
		// The default, 16, shrinks to fit a small --tx-depth, with the
		// default --cq-mod (--batch): --cq-mod + --batch - 1 requests must
		// fit (see below). Before, "bench write -t 8" was refused
		// (TestBatchFlagsWithSmallTxDepth); an explicit --batch above
		// --tx-depth still is.
		cfg.batch = min(defaultBatch, cfg.txDepth)
		if !given["cq-mod"] {
			cfg.batch = min(cfg.batch, (cfg.txDepth+1)/2)
		}
	}
	if cfg.batch < 1 || cfg.batch > cfg.txDepth {
		return usageErr(stderr, "bench", "--batch must be between 1 and --tx-depth (%d), not %d", cfg.txDepth, cfg.batch)
	}
	if cfg.cqMod == 0 {
		cfg.cqMod = cfg.batch
	}
	if cfg.cqMod < 1 || cfg.cqMod > cfg.txDepth {
		return usageErr(stderr, "bench", "--cq-mod must be between 1 and --tx-depth (%d), not %d", cfg.txDepth, cfg.cqMod)
	}
	// Batches are posted while the requests since the last completion
	// (a signaled one) fit the send queue: the next signaled request must
	// fit too. Before, --cq-mod 127 with the defaults (batches of 16, a
	// send queue of 128) stalled until the watchdog blamed the peer
	// (TestBenchFlagsThatStall).
	if cfg.cqMod+cfg.batch-1 > cfg.txDepth {
		return usageErr(stderr, "bench", "--cq-mod (%d) + --batch (%d) - 1 must be at most --tx-depth (%d): requests are posted a batch at a time while those since the last signaled one fit the send queue",
			cfg.cqMod, cfg.batch, cfg.txDepth)
	}
	// In one process, sends are posted a batch at a time while the
	// receiving queue pair has a receive for each: a batch larger than
	// --rx-depth never fit, and the test stalled
	// (TestBenchFlagsThatStall). (Between two processes the sender does
	// not wait for the receives: a short receiver retries, RNR.)
	if cfg.op == "send" && !cfg.server && cfg.host == "" && cfg.rxDepth < cfg.batch {
		return usageErr(stderr, "bench", "--rx-depth (%d) must be at least --batch (%d) for send: sends are posted a batch at a time, each with a receive posted for it", cfg.rxDepth, cfg.batch)
	}
	return -1
}

// unbracket returns an IPv6 address written in brackets ([::1], as in a
// URL) without them: the port is joined to it later.
func unbracket(host string) string {
	if len(host) > 2 && host[0] == '[' && host[len(host)-1] == ']' {
		return host[1 : len(host)-1]
	}
	return host
}

// hasPort reports whether a HOST or --bind address has a port, which
// goes with -p.
func hasPort(host string) bool {
	_, _, err := net.SplitHostPort(host)
	return err == nil
}

// parseSize parses a byte count with an optional binary suffix (K, M, G,
// optionally followed by B or iB).
func parseSize(s string) (int, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I")
	mult := 1
	if t != "" {
		switch t[len(t)-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		}
		if mult != 1 {
			t = t[:len(t)-1]
		}
	}
	n, err := strconv.Atoi(t)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("invalid size %q (want a positive number of bytes, e.g. 4096 or 64K)", s)
	}
	if n > maxMessageSize/mult {
		return 0, fmt.Errorf("size %q exceeds the largest message of %d bytes", s, maxMessageSize)
	}
	return n * mult, nil
}

// bench runs the configured test for every size and prints the results.
func bench(cfg benchConfig, w io.Writer) (err error) {
	maxSize := 0
	for _, s := range cfg.sizes {
		maxSize = max(maxSize, s)
	}
	lb, err := newLoopback(cfg, maxSize)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := lb.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	out := newReporter(w, cfg, lb.info())
	out.header()
	for _, size := range cfg.sizes {
		if cfg.lat {
			res, err := lb.latency(cfg, size)
			if err != nil {
				return err
			}
			out.latRow(res)
		} else {
			res, err := lb.bandwidth(cfg, size)
			if err != nil {
				return err
			}
			out.bwRow(res)
		}
	}
	out.footer()
	return nil
}

// testName is perftest's name of the test.
func testName(op string) string {
	switch op {
	case "write":
		return "RDMA_Write"
	case "read":
		return "RDMA_Read"
	}
	return "Send"
}

// errNoProgress is returned when the loopback stops making progress.
var errNoProgress = errors.New("no progress")

// inlineFlag is the value of -I: a number of bytes, or -1 (auto) when not
// given, which the usage prints as "(default auto)", not -1.
type inlineFlag int

func (f *inlineFlag) String() string {
	if f == nil || *f < 0 {
		return "auto"
	}
	return strconv.Itoa(int(*f))
}

func (f *inlineFlag) Set(s string) error {
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("not a number of bytes")
	}
	*f = inlineFlag(n)
	return nil
}
