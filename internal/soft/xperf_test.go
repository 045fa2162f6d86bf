package soft

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

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
// one completion per batch; the poster sleeps in the CQ's completion
// channel while it waits, as the baseline's reader sleeps in its reads.
// Baseline: BenchmarkRawStream.
func BenchmarkXprocWriteBandwidth(b *testing.B) {
	for _, kind := range xprocKinds {
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/size=%dKiB", kind, size>>10), func(b *testing.B) {
				forceTransport(b, kind)
				const batch = 16
				e := newEnv(b)
				qa, cqa, cha := xprocSide(b, e)
				qb, _, _ := xprocSide(b, e)
				connectOne(b, qa, qb, prov.QPTypeRC, defaultConn())
				connectOne(b, qb, qa, prov.QPTypeRC, defaultConn())
				src, dst := e.alloc(size, allAccess), e.alloc(size, allAccess)
				wrs := make([]prov.SendWR, batch)
				for i := range wrs {
					wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1,
						RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}
				}
				wrs[batch-1].Flags = prov.SendSignaled
				sges := []prov.SGE{src.sge(0, size)}
				var wcs [4]prov.Completion
				run := func() {
					if n, err := qa.PostSend(wrs, sges); err != nil || n != batch {
						b.Fatalf("post: %d %v", n, err)
					}
					waitCQ(b, cqa, cha, wcs[:], 1)
				}
				run()
				b.SetBytes(int64(batch * size))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					run()
				}
			})
		}
	}
}

// xprocSide creates a RC QP whose send and receive CQ has a completion
// channel.
func xprocSide(b *testing.B, e *env) (prov.QP, prov.CQ, prov.CompChannel) {
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
// when it is empty.
func waitCQ(b *testing.B, cq prov.CQ, ch prov.CompChannel, dst []prov.Completion, n int) {
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
		if n == 0 || k > 0 {
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

// socketPair returns the two ends of a loopback connection of kind.
func socketPair(tb testing.TB, kind string) (net.Conn, net.Conn) {
	network, addr := "tcp", "127.0.0.1:0"
	if kind == "unix" {
		network, addr = "unix", fmt.Sprintf("@goverbs-bench-%d", os.Getpid())
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		tb.Fatal(err)
	}
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
	c1, err := net.Dial(network, ln.Addr().String())
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
// send from B to A. One goroutine drives both sides and sleeps in the
// completion channels while it waits, as the baseline's goroutines sleep
// in their reads (spinning would measure the host's scheduler). Baseline:
// BenchmarkRawPingPong.
func BenchmarkXprocSendRTT(b *testing.B) {
	for _, kind := range xprocKinds {
		b.Run(kind, func(b *testing.B) {
			forceTransport(b, kind)
			e := newEnv(b)
			qa, cqa, cha := xprocSide(b, e)
			qb, cqb, chb := xprocSide(b, e)
			connectOne(b, qa, qb, prov.QPTypeRC, defaultConn())
			connectOne(b, qb, qa, prov.QPTypeRC, defaultConn())
			m := e.alloc(4096, allAccess)
			swr := []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
			rwr := []prov.RecvWR{{NumSGE: 1}}
			sg := []prov.SGE{m.sge(0, 8)}
			rsg := []prov.SGE{m.sge(1024, 8)}
			var dst [4]prov.Completion
			wait := func(cq prov.CQ, ch prov.CompChannel, n int) { waitCQ(b, cq, ch, dst[:], n) }
			rtt := func() {
				qb.PostRecv(rwr, rsg)
				qa.PostRecv(rwr, rsg)
				qa.PostSend(swr, sg)
				wait(cqb, chb, 1) // B's receive
				qb.PostSend(swr, sg)
				wait(cqa, cha, 2) // A's send and receive
				wait(cqb, chb, 1) // B's send
			}
			rtt()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				rtt()
			}
		})
	}
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
			b.ResetTimer()
			for b.Loop() {
				c1.Write(p[:])
				io.ReadFull(c1, p[:])
			}
		})
	}
}
