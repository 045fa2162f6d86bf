package session

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
)

// Benchmarks between two processes: this one and a child (the test
// binary again, benchChildIfRequested), over soft0's transport kind.
//
//	BenchmarkXprocRTT        8-byte message round trip: Send, the child's
//	                         Receive and Send back, Receive; baseline: the
//	                         same exchange on bare channels (a receive
//	                         posted ahead, Send, wait)
//	BenchmarkXprocBandwidth  64 KiB messages (Send, the child releases
//	                         them); baseline: 64 KiB RDMA writes of a
//	                         bare channel, 16 in flight (channel-imm:
//	                         writes with immediate data, each completing
//	                         a receive of the child's, as a message does)
//	BenchmarkXprocRequest    RequestRemoteMR of 4 KiB and its Release
//	                         (request-ns/op: the request alone)
//	BenchmarkXprocRequestSpin  the same with Config.AgentSpin on both
//	                         sides
//	BenchmarkXprocWriteImm   WriteImm of 64 bytes into a requested region
//	                         (the child releases the notices)
//
//	go test -run '^$' -bench Xproc ./session/
//
// scripts/bench.sh session runs them alternately and prints medians and
// ratios.

const envBenchChild = "GOVERBS_SESSION_BENCH_CHILD"

// envBenchBuffers is the Config.ReceiveBuffers of a session child (0: the
// default).
const envBenchBuffers = "GOVERBS_SESSION_BENCH_BUFFERS"

var benchKinds = []string{"shm", "unix", "tcp"}

func BenchmarkXprocRTT(b *testing.B) {
	for _, kind := range benchKinds {
		b.Run(kind+"/session", func(b *testing.B) {
			s := benchSession(b, kind)
			ctx := context.Background()
			msg := make([]byte, 8)
			rtt := func() {
				if err := s.Send(ctx, msg); err != nil {
					b.Fatal(err)
				}
				m, err := s.Receive(ctx)
				if err != nil {
					b.Fatal(err)
				}
				m.Release()
			}
			warmThenTime(b, 1000, rtt)
		})
		b.Run(kind+"/channel", func(b *testing.B) {
			ch, buf := benchChannel(b, kind, "echo")
			ctx := context.Background()
			sge := buf.All()
			rtt := func() {
				h, err := ch.PostReceive(sge)
				if err != nil {
					b.Fatal(err)
				}
				if err := ch.Send(ctx, sge); err != nil {
					b.Fatal(err)
				}
				if err := h.Wait(ctx); err != nil || h.Err() != nil {
					b.Fatal(err, h.Err())
				}
				h.Release()
			}
			warmThenTime(b, 1000, rtt)
		})
	}
}

const bwSize = 64 << 10

func BenchmarkXprocBandwidth(b *testing.B) {
	for _, kind := range benchKinds {
		b.Run(kind+"/session", func(b *testing.B) {
			// Messages go out with up to 16 senders at once, as the
			// baseline keeps 16 writes in flight.
			benchMessages(b, kind, func(ctx context.Context, s *Session, msg LocalMR, n int) {
				errc := make(chan error, 16)
				for w := range 16 {
					go func() {
						for i := w; i < n; i += 16 {
							if err := s.SendSlice(ctx, msg.All(), 0, false); err != nil {
								errc <- err
								return
							}
						}
						errc <- nil
					}()
				}
				for range 16 {
					if err := <-errc; err != nil {
						b.Fatal(err)
					}
				}
			})
		})
		// One goroutine keeps 16 messages in flight with PostSendSlice,
		// as the baseline keeps 16 writes; with 16 receive buffers, as
		// many as messages in flight, it also waits for credits all the
		// time (recvFlow.shouldWrite).
		for _, buffers := range []int{0, 16} {
			name := kind + "/session-posted"
			if buffers > 0 {
				name += fmt.Sprintf("-buffers=%d", buffers)
			}
			b.Run(name, func(b *testing.B) { benchPosted(b, kind, buffers) })
		}
		b.Run(kind+"/channel", func(b *testing.B) { benchChannelWrites(b, kind, false) })
		b.Run(kind+"/channel-imm", func(b *testing.B) { benchChannelWrites(b, kind, true) })
	}
}

// benchChannelWrites is the baseline of BenchmarkXprocBandwidth: 64 KiB
// RDMA writes of a bare channel into a "sink" child, 16 in flight; with
// imm, writes with immediate data, each completing a receive the child
// posted ("sink-imm": a message's delivery on the verbs level, what a
// session message is made of).
func benchChannelWrites(b *testing.B, kind string, imm bool) {
	what := "sink"
	if imm {
		what = "sink-imm"
	}
	ch, buf := benchChannel(b, kind, what)
	ctx := context.Background()
	write := func(n int) {
		var ring [16]channel.Handle
		for i := range n + 16 {
			h := &ring[i%16]
			if i >= 16 {
				if err := h.Wait(ctx); err != nil || h.Err() != nil {
					b.Fatal(err, h.Err())
				}
				h.Release()
			}
			if i < n {
				dst := benchRemote.At(uint64(i%4) * bwSize)
				var err error
				if imm {
					*h, err = ch.PostWriteImm(dst, uint32(i), buf.All())
				} else {
					*h, err = ch.PostWrite(dst, buf.All())
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	write(64)
	b.SetBytes(bwSize)
	b.ReportAllocs()
	b.ResetTimer()
	write(b.N)
}

// benchPosted: one goroutine keeps 16 messages of BenchmarkXprocBandwidth
// in flight with PostSendSlice, to a child with buffers receive buffers
// (0: the default).
func benchPosted(b *testing.B, kind string, buffers int) {
	benchMessagesTo(b, benchSessionWith(b, kind, false, buffers), func(ctx context.Context, s *Session, msg LocalMR, n int) {
		var ring [16]Pending
		for i := range n + 16 {
			p := &ring[i%16]
			if i >= 16 {
				if err := p.Wait(ctx); err != nil {
					b.Fatal(err)
				}
			}
			if i < n {
				var err error
				if *p, err = s.PostSendSlice(ctx, msg.All(), 0, false); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}

func BenchmarkXprocRequest(b *testing.B) { benchRequest(b, false) }

// BenchmarkXprocRequestSpin is BenchmarkXprocRequest with Config.AgentSpin
// on both sides.
func BenchmarkXprocRequestSpin(b *testing.B) { benchRequest(b, true) }

func benchRequest(b *testing.B, agentSpin bool) {
	for _, kind := range benchKinds {
		b.Run(kind, func(b *testing.B) {
			s := benchSessionWith(b, kind, agentSpin, 0)
			ctx := context.Background()
			var reqTime time.Duration
			req := func() {
				t0 := time.Now()
				r, err := s.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteWrite, time.Minute)
				reqTime += time.Since(t0)
				if err != nil {
					b.Fatal(err)
				}
				if err := r.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
			for range 100 {
				req()
			}
			reqTime = 0
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				req()
			}
			// ns/op is a request and its release; request-ns/op the
			// request alone.
			b.ReportMetric(float64(reqTime.Nanoseconds())/float64(b.N), "request-ns/op")
		})
	}
}

func BenchmarkXprocWriteImm(b *testing.B) {
	for _, kind := range benchKinds {
		b.Run(kind, func(b *testing.B) {
			s := benchSession(b, kind)
			ctx := context.Background()
			r, err := s.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteWrite, time.Hour)
			if err != nil {
				b.Fatal(err)
			}
			src, err := s.Alloc(wimmBenchSize)
			if err != nil {
				b.Fatal(err)
			}
			defer src.Free()
			dst, err := r.Slice(0, wimmBenchSize)
			if err != nil {
				b.Fatal(err)
			}
			for i := range 1000 {
				if err := s.WriteImm(ctx, dst, uint32(i), src.All()); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if err := s.WriteImm(ctx, dst, uint32(i), src.All()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// wimmBenchSize is the size of BenchmarkXprocWriteImm's writes.
const wimmBenchSize = 64

// benchMessages measures bwSize messages over a session with a child:
// send sends n of them from msg; the child answers once it has them all.
func benchMessages(b *testing.B, kind string, send func(ctx context.Context, s *Session, msg LocalMR, n int)) {
	benchMessagesTo(b, benchSession(b, kind), send)
}

// benchMessagesTo is benchMessages on the session s.
func benchMessagesTo(b *testing.B, s *Session, send func(ctx context.Context, s *Session, msg LocalMR, n int)) {
	ctx := context.Background()
	msg, err := s.Alloc(bwSize)
	if err != nil {
		b.Fatal(err)
	}
	defer msg.Free()
	round := func(n int) {
		send(ctx, s, msg, n)
		if err := s.Send(ctx, []byte("d")); err != nil { // the child answers when it has them all
			b.Fatal(err)
		}
		m, err := s.Receive(ctx)
		if err != nil {
			b.Fatal(err)
		}
		m.Release()
	}
	round(64)
	b.SetBytes(bwSize)
	b.ReportAllocs()
	b.ResetTimer()
	round(b.N)
}

// warmThenTime runs f warm times, then b.N times with the timer and the
// allocation count on.
func warmThenTime(b *testing.B, warm int, f func()) {
	for range warm {
		f()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		f()
	}
}

// benchSession starts a child serving sessions over kind and returns a
// session to it.
func benchSession(b *testing.B, kind string) *Session { return benchSessionWith(b, kind, false, 0) }

// benchSessionWith is benchSession, with Config.AgentSpin set as
// agentSpin and Config.ReceiveBuffers as buffers on both sides.
func benchSessionWith(b *testing.B, kind string, agentSpin bool, buffers int) *Session {
	restore, err := soft.ForceTransport(kind)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(restore)
	child := envBenchChild + "=session"
	if agentSpin {
		child = envBenchChild + "=session-agentspin"
	}
	p := testproc.Start(b, child, "GOVERBS_SOFT_TRANSPORT="+kind, fmt.Sprintf("%s=%d", envBenchBuffers, buffers))
	addr := p.Line(b, "addr")[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := Dial(ctx, addr, Config{AgentSpin: agentSpin, ReceiveBuffers: buffers})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close(); p.Stop(b) })
	return s
}

// benchRemote is the region of a "sink" or "sink-imm" child (4 × bwSize
// bytes).
var benchRemote verbs.RemoteRegion

// isSink reports whether a channel child of kind what offers a region
// for writes ("sink", "sink-imm").
func isSink(what string) bool { return what == "sink" || what == "sink-imm" }

// benchChannel starts a child with a channel over kind doing what
// ("echo": sends back every 8-byte message; "sink": a region for
// writes; "sink-imm": the same, and receives for writes with immediate
// data) and returns this side's connected channel and an 8-byte or
// bwSize buffer.
func benchChannel(b *testing.B, kind, what string) (*channel.Channel, *verbs.MemoryRegion) {
	restore, err := soft.ForceTransport(kind)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(restore)
	p := testproc.Start(b, envBenchChild+"="+what, "GOVERBS_SOFT_TRANSPORT="+kind)
	sink := isSink(what)
	var ep verbs.Endpoint
	if err := json.Unmarshal([]byte(p.Line(b, "ep")[0]), &ep); err != nil {
		b.Fatal(err)
	}
	if sink {
		if err := json.Unmarshal([]byte(p.Line(b, "region")[0]), &benchRemote); err != nil {
			b.Fatal(err)
		}
	}
	dev, err := verbs.Open("soft0")
	if err != nil {
		b.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		b.Fatal(err)
	}
	ch, err := channel.New(pd, channel.Options{})
	if err != nil {
		b.Fatal(err)
	}
	mine, err := ch.Endpoint()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Connect(ep); err != nil {
		b.Fatal(err)
	}
	js, _ := json.Marshal(mine)
	p.Send(b, "ep %s", js)
	p.Line(b, "ready")
	n := 8
	if sink {
		n = bwSize
	}
	buf, err := pd.Alloc(n, verbs.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ch.Close()
		buf.Close()
		pd.Close()
		dev.Close()
		p.Stop(b)
	})
	return ch, buf
}

// benchChildIfRequested runs the child of a benchmark if this process is
// one (TestMain).
func benchChildIfRequested() {
	what, ok := os.LookupEnv(envBenchChild)
	if !ok {
		return
	}
	var err error
	switch what {
	case "session", "session-agentspin":
		err = benchSessionChild(what == "session-agentspin")
	default:
		err = benchChannelChild(what)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// benchSessionChild serves one session: 8-byte messages come back, a
// "d" is answered when every message before it was received, others are
// released. It ends when its stdin closes. agentSpin sets
// Config.AgentSpin.
func benchSessionChild(agentSpin bool) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	buffers, _ := strconv.Atoi(os.Getenv(envBenchBuffers))
	l, err := Listen(ctx, "127.0.0.1:0", Config{AgentSpin: agentSpin, ReceiveBuffers: buffers})
	if err != nil {
		return err
	}
	fmt.Printf("addr %s\n", l.Addr())
	s, err := l.Accept(ctx)
	l.Close()
	if err != nil {
		return err
	}
	defer s.Close()
	go func() {
		for {
			m, err := s.Receive(ctx)
			if err != nil {
				return
			}
			switch m.Len() {
			case 8:
				var b [8]byte
				copy(b[:], m.Bytes())
				m.Release()
				if s.Send(ctx, b[:]) != nil {
					return
				}
			case 1:
				m.Release()
				if s.Send(ctx, []byte("ok")) != nil {
					return
				}
			default:
				m.Release()
			}
		}
	}()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
	}
	return nil
}

// benchChannelChild is the channel side of a baseline.
func benchChannelChild(what string) error {
	dev, err := verbs.Open("soft0")
	if err != nil {
		return err
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	ch, err := channel.New(pd, channel.Options{})
	if err != nil {
		return err
	}
	defer ch.Close()
	ep, err := ch.Endpoint()
	if err != nil {
		return err
	}
	js, _ := json.Marshal(ep)
	fmt.Printf("ep %s\n", js)
	sink := isSink(what)
	size := 16
	if sink {
		size = 4 * bwSize
	}
	buf, err := pd.Alloc(size, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		return err
	}
	defer buf.Close()
	if sink {
		js, _ := json.Marshal(buf.Remote())
		fmt.Printf("region %s\n", js)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 1<<20)
	var peer verbs.Endpoint
	for in.Scan() {
		if rest, ok := strings.CutPrefix(in.Text(), "ep "); ok {
			if err := json.Unmarshal([]byte(rest), &peer); err != nil {
				return err
			}
			break
		}
	}
	if err := ch.Connect(peer); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if what == "echo" {
		// Two receive buffers: the receive for the next message is
		// posted before the echo of this one leaves, as an RDMA
		// program keeps its receive queue ahead of its peer's sends
		// (reposting after the Send completes races the peer's next
		// message, and loses to it whenever the acknowledgement of the
		// echo wakes this side later than the echo wakes the peer:
		// receiver not ready, a NAK and a retry per round trip).
		go func() {
			var bufs [2]verbs.SGE
			bufs[0], _ = buf.SGE(0, 8)
			bufs[1], _ = buf.SGE(8, 8)
			h, err := ch.PostReceive(bufs[0])
			if err != nil {
				return
			}
			for i := 1; ; i++ {
				if h.Wait(ctx) != nil || h.Err() != nil {
					return
				}
				h.Release()
				if h, err = ch.PostReceive(bufs[i%2]); err != nil {
					return
				}
				if ch.Send(ctx, bufs[(i+1)%2]) != nil {
					return
				}
			}
		}()
	}
	if what == "sink-imm" {
		// 64 receives posted, each posted again as soon as its write
		// with immediate data completed it, as a session's are.
		go func() {
			var ring [64]channel.Handle
			for i := range ring {
				var err error
				if ring[i], err = ch.PostReceive(); err != nil {
					return
				}
			}
			for i := 0; ; i++ {
				h := &ring[i%len(ring)]
				if h.Wait(ctx) != nil || h.Err() != nil {
					return
				}
				h.Release()
				var err error
				if *h, err = ch.PostReceive(); err != nil {
					return
				}
			}
		}()
	}
	fmt.Println("ready")
	for in.Scan() {
	}
	cancel()
	return nil
}

// BenchmarkServeRequest is what a peer's agent does for a
// RequestRemoteMR of 4 KiB, the "allocation" of the request's goal (2
// round trips + allocation): allocate the memory, zero it, register its
// window for the peer, start its lease; then, as a release does, close
// the window and free the memory. Both sessions live in this process.
func BenchmarkServeRequest(b *testing.B) {
	s, _ := pair(b, Config{})
	m := ctrlMsg{len: 4096, access: verbs.AccessRemoteWrite, lease: time.Minute}
	serve := func() {
		g, _, err := s.serveRequest(m)
		if err != nil {
			b.Fatal(err)
		}
		a := &s.agent
		a.mu.Lock()
		a.dropGrantLocked(g.id, g)
		a.mu.Unlock()
	}
	warmThenTime(b, 100, serve)
}
