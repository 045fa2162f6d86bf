package soft

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// Benchmarks of the inter-process transports, with their baselines in the
// same binary. Both QPs are in this process, but with the transport forced
// every request and response crosses a real socket and the service
// goroutines, as between two processes; the baselines are the same socket
// kinds driven directly.
//
//	go test -run '^$' -bench 'Xproc|Raw' ./internal/soft/

// forceTransport forces kind for the benchmark.
func forceTransport(tb testing.TB, kind string) {
	restore, err := ForceTransport(kind)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(restore)
}

// The transports, and the sockets of the baselines (shm compares with
// BenchmarkCopy and the unix socket).
var (
	xprocKinds = []string{"tcp", "unix", "shm"}
	rawKinds   = []string{"tcp", "unix"}
)

// BenchmarkXprocWriteBandwidth: RDMA writes of size bytes, 16 at a time,
// one completion per batch, 128 writes in flight (perftest's default
// ib_write_bw send queue depth, -t 128: the next batch is posted before
// the oldest one completes); the poster sleeps in the CQ's completion
// channel while it waits, as the baseline's reader sleeps in its reads.
// Baseline: BenchmarkRawStream. Kind tls is tcp encrypted (tls.go, as
// between hosts); its baseline is tcp in the same run.
func BenchmarkXprocWriteBandwidth(b *testing.B) {
	benchBandwidthWith(b, prov.WRWrite, append(xprocKinds, "tls"), false)
}

// BenchmarkXprocWriteBandwidthPolling is BenchmarkXprocWriteBandwidth
// with a poster that polls its CQ while it waits, never sleeping, as
// perftest's ib_write_bw does (and as copy(), the baseline of shared
// memory, never sleeps). A poll handles the connection itself
// (progress.go): over shared memory it makes the copies of direct
// writes, which a sleeping poster leaves to the connection's reader.
// Asleep, each wait of the poster costs the reader, which then copies,
// the wake-up of the poster's thread when the batch completes
// (compChannel.notify: a futex wake of an idle processor, 15 µs on a
// 2-vCPU VM), a gap of that length between two copies 1.25 times per
// batch of 16 (README).
func BenchmarkXprocWriteBandwidthPolling(b *testing.B) {
	benchBandwidthWith(b, prov.WRWrite, xprocKinds, true)
}

// BenchmarkXprocReadBandwidth is BenchmarkXprocWriteBandwidth with RDMA
// reads: the data comes back in the responses. Baseline:
// BenchmarkRawStream.
func BenchmarkXprocReadBandwidth(b *testing.B) {
	benchBandwidthWith(b, prov.WRRead, append(xprocKinds, "tls"), false)
}

// benchBandwidthWith runs bandwidthLoop of op over each transport kind
// ("tls": tcp encrypted), both sizes; the poster polls if poll is set,
// else it sleeps in its completion channel.
func benchBandwidthWith(b *testing.B, op prov.WROpcode, kinds []string, poll bool) {
	for _, kind := range kinds {
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/size=%dKiB", kind, size>>10), func(b *testing.B) {
				if kind == "tls" {
					forceTransport(b, "tcp")
					forceTLS(b, tlsOn)
				} else {
					forceTransport(b, kind)
					forceTLS(b, tlsOff)
				}
				e := newEnv(b)
				qa, cqa, cha := xprocSide(b, e)
				qb, _, _ := xprocSide(b, e)
				connectOne(b, qa, qb, prov.QPTypeRC, defaultConn())
				connectOne(b, qb, qa, prov.QPTypeRC, defaultConn())
				src, dst := e.alloc(size, allAccess), e.alloc(size, allAccess)
				side := rttSide{qp: qa, cq: cqa, ch: cha}
				if poll {
					side.ch = nil
				}
				bandwidthLoop(b, side, op, dst.addr(0), dst.mr.RKey(), src.sge(0, size))
			})
		}
	}
}

// bandwidthLoop measures q's RDMA operations op of sge against raddr and
// rkey: 16 per post, the last signaled, bwDepth in flight. It waits in
// q's completion channel, or polls if q has none.
func bandwidthLoop(b *testing.B, q rttSide, op prov.WROpcode, raddr uint64, rkey uint32, sge prov.SGE) {
	const batch = 16
	wrs := make([]prov.SendWR, batch)
	for i := range wrs {
		wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: op, NumSGE: 1, RemoteAddr: raddr, RKey: rkey}
	}
	wrs[batch-1].Flags = prov.SendSignaled
	sges := []prov.SGE{sge}
	var wcs [4]prov.Completion
	inflight := 0
	run := func() {
		if n, err := q.qp.PostSend(wrs, sges); err != nil || n != batch {
			b.Fatalf("post: %d %v", n, err)
		}
		if inflight++; inflight == bwDepth/batch {
			waitCQ(b, q.cq, q.ch, wcs[:], 1)
			inflight--
		}
	}
	// Warm up: a whole round trip, so that both ends of the connection
	// exist (the acceptor's end is made in the background) before the
	// timer and the allocation count start.
	run()
	waitCQ(b, q.cq, q.ch, wcs[:], inflight)
	inflight = 0
	b.SetBytes(int64(batch) * int64(sge.Length))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		run()
	}
	waitCQ(b, q.cq, q.ch, wcs[:], inflight)
}

// bwDepth is how many writes BenchmarkXprocWriteBandwidth keeps in
// flight.
const bwDepth = 128

// xprocSide creates a RC QP whose send and receive CQ has a completion
// channel.
func xprocSide(b testing.TB, e *env) (prov.QP, prov.CQ, prov.CompChannel) {
	ch := must(e.ctx.CreateCompChannel())
	b.Cleanup(func() { ch.Close() })
	cq := must(e.ctx.CreateCQ(256, ch, 0))
	b.Cleanup(func() { cq.Close() })
	caps := defaultCaps()
	caps.MaxSendWR = 256
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: caps}))
	b.Cleanup(func() { q.Close() })
	return q, cq, ch
}

// waitCQ takes n successful completions from cq, sleeping in its channel
// when it is empty, or polling again if ch is nil.
func waitCQ(b testing.TB, cq prov.CQ, ch prov.CompChannel, dst []prov.Completion, n int) {
	for n > 0 {
		k, err := cq.Poll(dst[:min(n, len(dst))])
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range dst[:k] {
			if c.Status != prov.StatusSuccess {
				b.Fatalf("%+v", c)
			}
		}
		n -= k
		if n == 0 || k > 0 || ch == nil {
			continue
		}
		cq.Arm(false)
		if k, _ = cq.Poll(dst[:min(n, len(dst))]); k > 0 {
			n -= k
			continue
		}
		if _, err := ch.Wait(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}

// benchListener listens on a loopback address of kind: TCP on
// 127.0.0.1, or an abstract unix socket of this process.
func benchListener(tb testing.TB, kind string) net.Listener {
	network, addr := "tcp", "127.0.0.1:0"
	if kind == "unix" {
		network, addr = "unix", fmt.Sprintf("@goverbs-bench-%d-%d", os.Getpid(), benchListeners.Add(1))
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		tb.Fatal(err)
	}
	return ln
}

// benchListeners numbers benchListener's unix sockets.
var benchListeners atomic.Uint64

// socketPair returns the two ends of a loopback connection of kind.
func socketPair(tb testing.TB, kind string) (net.Conn, net.Conn) {
	ln := benchListener(tb, kind)
	defer ln.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			ch <- nil
			return
		}
		ch <- c
	}()
	c1, err := net.Dial(ln.Addr().Network(), ln.Addr().String())
	if err != nil {
		tb.Fatal(err)
	}
	c2 := <-ch
	if c2 == nil {
		tb.Fatal("accept failed")
	}
	if tc, ok := c1.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		c2.(*net.TCPConn).SetNoDelay(true)
	}
	tb.Cleanup(func() { c1.Close(); c2.Close() })
	return c1, c2
}

// BenchmarkRawStream is the baseline of BenchmarkXprocWriteBandwidth: a
// goroutine writes chunks of size bytes to a loopback socket, another reads
// them into a buffer.
func BenchmarkRawStream(b *testing.B) {
	for _, kind := range rawKinds {
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/size=%dKiB", kind, size>>10), func(b *testing.B) {
				c1, c2 := socketPair(b, kind)
				src, dst := make([]byte, size), make([]byte, size)
				done := make(chan error, 1)
				b.SetBytes(int64(16 * size))
				b.ReportAllocs()
				b.ResetTimer()
				go func() {
					for range b.N * 16 {
						if _, err := io.ReadFull(c2, dst); err != nil {
							done <- err
							return
						}
					}
					done <- nil
				}()
				for range b.N * 16 {
					if _, err := c1.Write(src); err != nil {
						b.Fatal(err)
					}
				}
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

// BenchmarkXprocSendRTT: an 8-byte send from A to B answered by an 8-byte
// send from B to A. One goroutine drives both sides. As in perftest's
// ib_send_lat, every 16th send is signaled and send completions are
// reaped as they come (waiting for them only when the send queue would
// fill); an iteration waits for its two receives. With
// wait=sleep the goroutine sleeps in the completion channels while it
// waits, as the baseline's goroutines sleep in their reads; with
// wait=spin it polls the CQs, as an RDMA application on its latency path
// does, which lets the polls carry the messages (progress.go). Baselines:
// BenchmarkRawPingPong (sleeping) and BenchmarkRawSpinPingPong (spinning).
func BenchmarkXprocSendRTT(b *testing.B) {
	for _, mode := range []string{"sleep", "spin"} {
		for _, kind := range xprocKinds {
			b.Run(fmt.Sprintf("wait=%s/%s", mode, kind), func(b *testing.B) { benchSendRTT(b, kind, mode == "spin") })
		}
	}
}

// rttSide is one side of BenchmarkXprocSendRTT.
type rttSide struct {
	qp      prov.QP
	cq      prov.CQ
	ch      prov.CompChannel
	pending int // signaled sends not completed yet
	recvs   int // receives completed, not consumed
}

// rttSignal is how often a send of BenchmarkXprocSendRTT is signaled; at
// most rttSignal*rttMaxPending sends are outstanding (the send queue
// holds 256).
const rttSignal, rttMaxPending = 16, 8

func benchSendRTT(b *testing.B, kind string, spin bool) {
	forceTransport(b, kind)
	e := newEnv(b)
	var a, z rttSide
	a.qp, a.cq, a.ch = xprocSide(b, e)
	z.qp, z.cq, z.ch = xprocSide(b, e)
	connectOne(b, a.qp, z.qp, prov.QPTypeRC, defaultConn())
	connectOne(b, z.qp, a.qp, prov.QPTypeRC, defaultConn())
	m := e.alloc(4096, allAccess)
	swr := []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1}}
	rwr := []prov.RecvWR{{NumSGE: 1}}
	sg := []prov.SGE{m.sge(0, 8)}
	rsg := []prov.SGE{m.sge(1024, 8)}
	var dst [8]prov.Completion
	reap := func(s *rttSide) int {
		k, err := s.cq.Poll(dst[:])
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range dst[:k] {
			if c.Status != prov.StatusSuccess {
				b.Fatalf("%+v", c)
			}
			if c.Opcode == prov.WCRecv {
				s.recvs++
			} else {
				s.pending--
			}
		}
		return k
	}
	// waitFor reaps s's completions until done.
	waitFor := func(s *rttSide, done func() bool) {
		for !done() {
			if reap(s) > 0 || spin {
				continue
			}
			s.cq.Arm(false)
			if reap(s) == 0 {
				if _, err := s.ch.Wait(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	// wait waits for a receive of s.
	wait := func(s *rttSide) {
		waitFor(s, func() bool { return s.recvs > 0 })
		s.recvs--
	}
	send := func(s *rttSide, i int) {
		swr[0].Flags = 0
		if i%rttSignal == rttSignal-1 {
			// As perftest, wait for the send queue to have room: the
			// acknowledgements may lag behind the answers.
			waitFor(s, func() bool { return s.pending < rttMaxPending })
			swr[0].Flags = prov.SendSignaled
			s.pending++
		}
		if n, err := s.qp.PostSend(swr, sg); err != nil || n != 1 {
			b.Fatalf("post send: %d %v", n, err)
		}
	}
	i := 0
	rtt := func() {
		z.qp.PostRecv(rwr, rsg)
		a.qp.PostRecv(rwr, rsg)
		send(&a, i)
		wait(&z)
		send(&z, i)
		wait(&a)
		i++
	}
	rtt()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		rtt()
	}
	b.StopTimer()
	for _, s := range []*rttSide{&a, &z} {
		for s.pending > 0 {
			reap(s)
		}
	}
}

// BenchmarkRawSpinPingPong is the spinning baseline of
// BenchmarkXprocSendRTT: 8 bytes over a loopback socket and back, both
// ends reading without blocking in a loop (one goroutine drives both, as
// in BenchmarkXprocSendRTT/wait=spin).
func BenchmarkRawSpinPingPong(b *testing.B) {
	for _, kind := range rawKinds {
		b.Run(kind, func(b *testing.B) {
			c1, c2 := socketPair(b, kind)
			r1, r2 := rawOf(b, c1), rawOf(b, c2)
			var p [8]byte
			// The read is made once, as a program on its latency path
			// would: a closure per read allocates.
			var n, k int
			var err error
			read := func(fd uintptr) { k, err = unix.Read(int(fd), p[n:]) }
			spinRead := func(rc syscall.RawConn) {
				for n = 0; n < len(p); {
					rc.Control(read)
					if err == unix.EAGAIN {
						continue
					}
					if err != nil || k == 0 {
						b.Fatal("read:", err)
					}
					n += k
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				c1.Write(p[:])
				spinRead(r2)
				c2.Write(p[:])
				spinRead(r1)
			}
		})
	}
}

func rawOf(tb testing.TB, c net.Conn) syscall.RawConn {
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		tb.Fatal(err)
	}
	return rc
}

// BenchmarkRawPingPong is the baseline of BenchmarkXprocSendRTT: 8 bytes
// over a loopback socket to an echoing goroutine and back.
func BenchmarkRawPingPong(b *testing.B) {
	for _, kind := range rawKinds {
		b.Run(kind, func(b *testing.B) {
			c1, c2 := socketPair(b, kind)
			go func() {
				var p [8]byte
				for {
					if _, err := io.ReadFull(c2, p[:]); err != nil {
						return
					}
					if _, err := c2.Write(p[:]); err != nil {
						return
					}
				}
			}()
			var p [8]byte
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				c1.Write(p[:])
				io.ReadFull(c1, p[:])
			}
		})
	}
}
