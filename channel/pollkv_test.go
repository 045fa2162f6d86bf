package channel_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
)

// BenchmarkPollKV measures what the way a channel waits (Options.SpinPolls)
// costs a small key-value store across processes: clients in processes of
// their own GET 64-byte values from a server process's table with
// one-sided RDMA reads (as RDMA key-value stores do: the server's CPU is
// not involved, its provider answers), each read a blocking
// Channel.Read. The benchmark process is the server; every client is the
// test binary re-executed (testproc), connected to the server over the
// transport forced (shm, unix or tcp), its waits as wait= says:
//
//	spin      SpinAlways: never sleep
//	sleep     SpinNever: sleep on the completion channel at once
//	polls64   SpinPolls 64, the default before the adaptive policy
//	adaptive  the default (SpinAdaptive)
//
// b.N reads are shared among the clients. Besides ns/op (wall time per
// read, all clients together), it reports the median and 99th percentile
// of the reads' latencies over every client (p50-ns, p99-ns, from
// hdrhistogram), the clients' CPU time per read (cpu-ns/op: what
// spinning costs) and their allocations per read (client-allocs/op). clients=8 puts more spinning clients than the machine
// has cores.
//
//	go test -run '^$' -bench PollKV -benchtime 20000x ./channel/
//
// scripts/bench.sh poll runs it alternately, several times, and prints
// the medians.
func BenchmarkPollKV(b *testing.B) {
	for _, kind := range []string{"shm", "unix", "tcp"} {
		for _, clients := range []int{1, 8} {
			for _, m := range pollModes {
				b.Run(fmt.Sprintf("%s/clients=%d/wait=%s", kind, clients, m.name), func(b *testing.B) {
					benchPollKV(b, kind, clients, m.spin)
				})
			}
		}
	}
}

var pollModes = []struct {
	name string
	spin int
}{
	{"spin", channel.SpinAlways},
	{"sleep", channel.SpinNever},
	{"polls64", 64},
	{"adaptive", channel.SpinAdaptive},
}

// The key-value table: kvValues values of kvValueSize bytes.
const (
	kvValueSize = 64
	kvValues    = 1024
	kvWarmup    = 500 // reads per client before the measured ones
)

// envKVClient makes the test binary a client of BenchmarkPollKV; its
// value is Options.SpinPolls.
const envKVClient = "GOVERBS_CHANNEL_KV_CLIENT"

// kvStart is what the server sends a client.
type kvStart struct {
	EP    verbs.Endpoint
	Table verbs.RemoteRegion
	N     int // reads to measure
	Seed  int
}

func benchPollKV(b *testing.B, kind string, clients, spin int) {
	restore, err := soft.ForceTransport(kind)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(restore)
	srv := newSide(b, channel.Options{}) // its channel is unused; its PD serves every client
	table, err := srv.pd.Alloc(kvValues*kvValueSize, verbs.AccessRemoteRead|verbs.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { closeOrFail(b, "table", table.Close) })
	for i := range kvValues {
		copy(table.Bytes()[i*kvValueSize:], fmt.Sprintf("value %d", i))
	}
	procs := make([]*testproc.Proc, clients)
	for i := range procs {
		p := testproc.Start(b, envKVClient+"="+strconv.Itoa(spin), "GOVERBS_SOFT_TRANSPORT="+kind)
		procs[i] = p
		var ep verbs.Endpoint
		if err := json.Unmarshal([]byte(p.Line(b, "ep")[0]), &ep); err != nil {
			b.Fatal(err)
		}
		ch, err := channel.New(srv.pd, channel.Options{})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { closeOrFail(b, "server channel", ch.Close) })
		sep, err := ch.Endpoint()
		if err != nil {
			b.Fatal(err)
		}
		if err := ch.Connect(ep); err != nil {
			b.Fatal(err)
		}
		n := b.N / clients
		if i < b.N%clients {
			n++
		}
		start, err := json.Marshal(kvStart{EP: sep, Table: table.Remote(), N: n, Seed: i})
		if err != nil {
			b.Fatal(err)
		}
		p.Send(b, "go %s", start)
	}
	for _, p := range procs {
		p.Line(b, "ready")
	}
	b.ResetTimer()
	for _, p := range procs {
		p.Send(b, "start")
	}
	all := newKVHist()
	var cpu time.Duration
	var mallocs uint64
	for _, p := range procs {
		f := p.Line(b, "hist")
		h, err := hdrhistogram.Decode([]byte(f[0]))
		if err != nil {
			b.Fatal(err)
		}
		all.Merge(h)
		ns, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		cpu += time.Duration(ns)
		m, err := strconv.ParseUint(f[2], 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		mallocs += m
	}
	b.StopTimer()
	for _, p := range procs {
		p.Stop(b)
	}
	b.ReportMetric(float64(all.ValueAtQuantile(50)), "p50-ns")
	b.ReportMetric(float64(all.ValueAtQuantile(99)), "p99-ns")
	n := float64(max(all.TotalCount(), 1))
	b.ReportMetric(float64(cpu)/n, "cpu-ns/op")
	b.ReportMetric(float64(mallocs)/n, "client-allocs/op")
}

func newKVHist() *hdrhistogram.Histogram { return hdrhistogram.New(1, int64(time.Minute), 3) }

// kvClientIfRequested runs a BenchmarkPollKV client and exits, if the
// process was started as one.
func kvClientIfRequested() {
	v, ok := os.LookupEnv(envKVClient)
	if !ok {
		return
	}
	if err := kvClient(v); err != nil {
		fmt.Fprintln(os.Stderr, "kv client:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// kvClient is a client of BenchmarkPollKV: it prints its endpoint, reads
// the server's, warms up, says it is ready, and on "start" reads N values
// at pseudo-random keys, timing each; it prints the histogram and its CPU
// time, then closes everything when its stdin closes.
func kvClient(spin string) error {
	spinPolls, err := strconv.Atoi(spin)
	if err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 1<<20)
	next := func(word string) (string, error) {
		for in.Scan() {
			if rest, ok := strings.CutPrefix(in.Text(), word); ok {
				return strings.TrimSpace(rest), nil
			}
		}
		return "", fmt.Errorf("no %q line: %v", word, in.Err())
	}
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		return err
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	buf, err := pd.Alloc(kvValueSize, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer buf.Close()
	ch, err := channel.New(pd, channel.Options{SpinPolls: spinPolls})
	if err != nil {
		return err
	}
	defer ch.Close()
	ep, err := ch.Endpoint()
	if err != nil {
		return err
	}
	j, err := json.Marshal(ep)
	if err != nil {
		return err
	}
	fmt.Printf("ep %s\n", j)
	line, err := next("go ")
	if err != nil {
		return err
	}
	var st kvStart
	if err := json.Unmarshal([]byte(line), &st); err != nil {
		return err
	}
	if err := ch.Connect(st.EP); err != nil {
		return err
	}
	ctx := context.Background()
	sge, err := buf.SGE(0, kvValueSize)
	if err != nil {
		return err
	}
	key := uint64(st.Seed)*7919 + 1
	get := func() error {
		key = key*6364136223846793005 + 1442695040888963407
		return ch.Read(ctx, st.Table.At((key>>33)%kvValues*kvValueSize), sge)
	}
	for range kvWarmup {
		if err := get(); err != nil {
			return err
		}
	}
	fmt.Println("ready")
	if _, err := next("start"); err != nil {
		return err
	}
	h := newKVHist()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	mallocs := ms.Mallocs
	cpu0 := cpuTime()
	for range st.N {
		t0 := time.Now()
		if err := get(); err != nil {
			return err
		}
		h.RecordValue(int64(time.Since(t0)))
	}
	cpu := cpuTime() - cpu0
	runtime.ReadMemStats(&ms)
	mallocs = ms.Mallocs - mallocs
	enc, err := h.Encode(hdrhistogram.V2CompressedEncodingCookieBase)
	if err != nil {
		return err
	}
	fmt.Printf("hist %s %d %d\n", enc, cpu, mallocs)
	for in.Scan() { // until stdin closes
	}
	return nil
}

// cpuTime is the CPU time (user and system) the process used so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
