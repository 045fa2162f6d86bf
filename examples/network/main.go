// Command network runs one rank of a goverbs cluster from a network
// configuration file: it builds a cluster.Node (opening the rank's
// device, exchanging endpoints with every other rank over TCP, connecting
// a queue pair to each), runs a few barriers, RDMA-writes one word to
// every other rank (all-to-all), checks what the others wrote to it, and
// prints the results.
//
// A configuration for three ranks on one machine (net.json):
//
//	{"hosts": [
//	  {"hostname": "127.0.0.1", "port": 18515, "device": "soft0", "rank": 0},
//	  {"hostname": "127.0.0.1", "port": 18516, "device": "soft0", "rank": 1},
//	  {"hostname": "127.0.0.1", "port": 18517, "device": "soft0", "rank": 2}
//	]}
//
// Run every rank, each in its own process (or on its own host):
//
//	go build -o network ./examples/network
//	for r in 0 1 2; do ./network -config net.json -rank $r & done; wait
//
// run.sh in this directory does that for N ranks. Rank r prints
//
//	rank 1/3: connected in 12ms (device soft0, all-to-all exchange)
//	rank 1/3: 10 barriers (centralized) done in 1.2ms
//	rank 1/3: all-to-all write in 350µs: received 0x0000000000000001 from rank 0, 0x0000000200000001 from rank 2
//	rank 1/3: ok
//
// Under a launcher, every rank takes its rank, the world size and rank 0's
// address from the environment instead (cluster.FromEnv), and prints
// which launcher it found first:
//
//	GOVERBS_ROOT=127.0.0.1:18515 mpirun -np 4 ./network -launcher
//	GOVERBS_ROOT=127.0.0.1:18515 GOVERBS_JOB=$(cat /proc/sys/kernel/random/uuid) mpiexec.hydra -np 4 ./network -launcher
//	srun -n 8 ./network -launcher        # rank 0 on the step's first node
//	torchrun --nproc-per-node 4 --no-python ./network -launcher
//
// Flags: -config and -rank (required without -launcher); -mode all-to-all|rendezvous; -job
// and -token (or GOVERBS_TOKEN) which every rank must share; -barriers;
// -write=false to skip the all-to-all write;
// -algorithm auto|binary-tree|dissemination|centralized (auto, the
// default, picks from where the ranks run; the output names the one in
// use); -timeout for the
// whole run; -listen-fd to use an inherited listening socket for the
// rank's exchange address; -launcher to take rank, size and rank 0's
// address from the launcher's environment (cluster.FromEnv) instead of a
// configuration file.
//
// Exit status: 0 on success, 1 on failure (a device that cannot reach
// the other ranks included), 2 for bad usage.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, nil))
}

// Exit statuses.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

// run runs the program with args; ln, if not nil, is the listener of the
// rank's exchange address (like -listen-fd, for tests running ranks in
// one process).
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ln net.Listener) int {
	fs := flag.NewFlagSet("network", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		configPath = fs.String("config", "", "network configuration `file` (JSON)")
		rank       = fs.Int("rank", -1, "this process' `rank`")
		mode       = fs.String("mode", "all-to-all", "endpoint exchange `mode`: all-to-all or rendezvous")
		job        = fs.String("job", "network-example", "job `id` (every rank must use the same)")
		token      = fs.String("token", os.Getenv("GOVERBS_TOKEN"), "shared `secret` authenticating the exchange (default $GOVERBS_TOKEN)")
		barriers   = fs.Int("barriers", 10, "`number` of barriers to run")
		write      = fs.Bool("write", true, "after the barriers, RDMA-write one word to every other rank (all-to-all)")
		algorithm  = fs.String("algorithm", "auto", "barrier `algorithm`: auto, binary-tree, dissemination or centralized")
		timeout    = fs.Duration("timeout", time.Minute, "deadline of the whole run")
		listenFD   = fs.Int("listen-fd", -1, "inherited listening socket `fd` for this rank's exchange address")
		launcher   = fs.Bool("launcher", false, "take rank, world size and rank 0's address from the launcher's environment instead of -config and -rank")
	)
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "network: "+format+"\n", a...)
		fs.Usage()
		return exitUsage
	}
	if fs.NArg() > 0 {
		return usage("unexpected arguments %q", fs.Args())
	}
	m, err := cluster.ParseMode(*mode)
	if err != nil {
		return usage("%v", err)
	}
	alg, err := parseAlgorithm(*algorithm)
	if err != nil {
		return usage("%v", err)
	}
	if *barriers < 0 {
		return usage("-barriers %d is negative", *barriers)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	start := time.Now()

	ex := &example{}
	opts := cluster.JoinOptions{Node: cluster.NodeOptions{Barrier: alg}, Mode: m, Job: *job, Token: []byte(*token), Prepare: ex.prepare}
	opts.Listener = ln
	if *listenFD >= 0 {
		f := os.NewFile(uintptr(*listenFD), "listener")
		ln, err := net.FileListener(f)
		f.Close()
		if err != nil {
			fmt.Fprintf(stderr, "network: -listen-fd %d: %v\n", *listenFD, err)
			return exitFail
		}
		opts.Listener = ln
	}
	var node *cluster.Node
	who := *rank // this process' rank, as far as it is known
	switch {
	case *launcher:
		if *configPath != "" || *rank >= 0 {
			return usage("-launcher excludes -config and -rank")
		}
		m = cluster.Rendezvous // FromEnv's mode
		l, perr := cluster.ParseLaunch(cluster.EnvOptions{})
		if perr != nil {
			fmt.Fprintf(stderr, "network: launcher: %v\n", perr)
			return exitFail
		}
		who = l.Rank
		fmt.Fprintf(stdout, "rank %d/%d: launched by %s (local rank %d, job %q, rank 0 at %s)\n", l.Rank, l.Size, l.Launcher, l.LocalRank, l.Job, l.Root)
		node, err = cluster.FromEnv(ctx, cluster.EnvOptions{Join: opts})
	default:
		if *configPath == "" || *rank < 0 {
			return usage("-config and -rank are required")
		}
		var cfg *cluster.Config
		if cfg, err = cluster.LoadConfig(*configPath); err != nil {
			fmt.Fprintf(stderr, "network: %v\n", err)
			return exitFail
		}
		node, err = cluster.Join(ctx, cfg, *rank, opts)
	}
	if err != nil {
		return fail(stderr, who, fmt.Errorf("join: %w", err))
	}
	ex.node = node
	defer ex.close()
	prefix := fmt.Sprintf("rank %d/%d: ", node.Rank(), node.Size())
	dev := node.PD().Context().Name()
	fmt.Fprintf(stdout, "%sconnected in %v (device %s, %v exchange)\n", prefix, time.Since(start).Round(time.Microsecond), dev, m)
	if err := ex.exercise(ctx, *barriers, *write, stdout, prefix); err != nil {
		return fail(stderr, node.Rank(), err)
	}
	fmt.Fprintf(stdout, "%sok\n", prefix)
	return exitOK
}

func fail(stderr io.Writer, rank int, err error) int {
	fmt.Fprintf(stderr, "network: rank %d: %v\n", rank, err)
	return exitFail
}

func parseAlgorithm(s string) (cluster.BarrierAlgorithm, error) {
	for _, a := range []cluster.BarrierAlgorithm{cluster.Auto, cluster.BinaryTree, cluster.Dissemination, cluster.Centralized} {
		if strings.ReplaceAll(a.String(), " ", "-") == s {
			return a, nil
		}
	}
	return 0, fmt.Errorf("unknown barrier algorithm %q", s)
}

// example is the state of one rank: its node and a region in which
// rank i's word lives at offset 8i.
type example struct {
	node *cluster.Node
	mr   *verbs.MemoryRegion
}

// prepare registers the region before the exchange and publishes its
// address and key to every rank.
func (e *example) prepare(n *cluster.Node) ([]byte, error) {
	mr, err := n.PD().Alloc(8*n.Size(), verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		return nil, err
	}
	e.mr = mr
	n.OnClose(mr.Close)
	return mr.Remote().MarshalBinary()
}

func (e *example) close() {
	if e.node != nil {
		e.node.Close() // and the region (OnClose)
	}
}

// word is what rank i writes to rank j.
func word(i, j int) uint64 { return uint64(i)<<32 | uint64(j) }

// exercise runs the barriers and the all-to-all write.
func (e *example) exercise(ctx context.Context, barriers int, write bool, out io.Writer, prefix string) error {
	n := e.node
	start := time.Now()
	for i := range barriers {
		if err := n.Barrier(ctx, nil); err != nil {
			return fmt.Errorf("barrier %d: %w", i, err)
		}
	}
	fmt.Fprintf(out, "%s%d barriers (%v) done in %v\n", prefix, barriers, n.BarrierAlgorithm(), time.Since(start).Round(time.Microsecond))
	if !write {
		return nil
	}
	start = time.Now()

	// All-to-all: write word(me, j) into slot me of every rank j.
	me, size := n.Rank(), n.Size()
	src, err := n.PD().Alloc(8*size, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer src.Close()
	binary.LittleEndian.PutUint64(e.mr.Bytes()[8*me:], word(me, me))
	var peers []int
	var dsts []verbs.RemoteAddr
	var sges []verbs.SGE
	for j := range size {
		if j == me {
			continue
		}
		var r verbs.RemoteRegion
		if err := r.UnmarshalBinary(n.PeerData(j)); err != nil {
			return fmt.Errorf("rank %d's region: %w", j, err)
		}
		binary.LittleEndian.PutUint64(src.Bytes()[8*j:], word(me, j))
		sge, err := src.SGE(8*j, 8)
		if err != nil {
			return err
		}
		peers = append(peers, j)
		dsts = append(dsts, r.At(uint64(8*me)))
		sges = append(sges, sge)
	}
	if len(peers) > 0 {
		if err := n.Channel().ScatterWrite(ctx, peers, dsts, sges); err != nil {
			return fmt.Errorf("all-to-all write: %w", err)
		}
	}
	// After this barrier every rank's writes to this one have completed.
	if err := n.Barrier(ctx, nil); err != nil {
		return fmt.Errorf("barrier after the writes: %w", err)
	}
	var got []string
	var bad []string
	for i := range size {
		if i == me {
			continue
		}
		v := binary.LittleEndian.Uint64(e.mr.Bytes()[8*i:])
		got = append(got, fmt.Sprintf("%#016x from rank %d", v, i))
		if v != word(i, me) {
			bad = append(bad, fmt.Sprintf("rank %d wrote %#x, want %#x", i, v, word(i, me)))
		}
	}
	if len(got) == 0 {
		got = []string{"nothing (a world of one)"}
	}
	fmt.Fprintf(out, "%sall-to-all write in %v: received %s\n", prefix, time.Since(start).Round(time.Microsecond), strings.Join(got, ", "))
	if len(bad) > 0 {
		return fmt.Errorf("all-to-all write: %s", strings.Join(bad, "; "))
	}
	return nil
}
