package soft

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

// Bandwidth between two processes. BenchmarkXprocWriteBandwidth has both
// QPs in one process (the transport forced), where a large payload is
// never pulled (a process does not read itself with process_vm_readv:
// openPidfd) and crosses the socket instead. Between processes of one
// host soft0 pulls it (cma.go), so these benchmarks put the target QP in
// a child process (the test binary re-executed, peerChild), and the
// baseline's reader too.

func init() { childModes["sink"] = sinkChild }

// envSink is the address a "sink" child dials: network and address,
// separated by a space.
const envSink = "GOVERBS_SOFT_TEST_SINK"

// sinkChild dials envSink, reads until the end of the stream and prints
// "done BYTES".
func sinkChild(_ *bufio.Scanner, out io.Writer) int {
	var network, addr string
	if _, err := fmt.Sscan(os.Getenv(envSink), &network, &addr); err != nil {
		fmt.Fprintln(os.Stderr, "sink:", err)
		return 1
	}
	c, err := net.Dial(network, addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sink:", err)
		return 1
	}
	defer c.Close()
	buf := make([]byte, 1<<20)
	var n int64
	for {
		k, err := c.Read(buf)
		n += int64(k)
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "sink:", err)
			return 1
		}
	}
	fmt.Fprintf(out, "done %d\n", n)
	return 0
}

// BenchmarkChildWriteBandwidth is BenchmarkXprocWriteBandwidth with the
// target QP and its region in a child process: RDMA writes of 64 KiB and
// 1 MiB, 16 per post, bwDepth in flight, as between two processes of an
// application. Baseline: BenchmarkChildRawStream.
func BenchmarkChildWriteBandwidth(b *testing.B) {
	for _, kind := range xprocKinds {
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/size=%dKiB", kind, size>>10), func(b *testing.B) {
				forceTransport(b, kind)
				forceTLS(b, tlsOff)
				p := testproc.Start(b, lifeEnv(kind)...)
				defer p.Send(b, "exit")
				e := newEnv(b)
				qa, cqa, cha := xprocSide(b, e)
				p.Send(b, "open")
				f := p.Line(b, "addr")
				addr := must(hex.DecodeString(f[0]))
				qpn := must(strconv.Atoi(f[1]))
				if err := connectTo(qa, addr, uint32(qpn), ackTimeout, 7); err != nil {
					b.Fatal(err)
				}
				p.Send(b, "connect %s %d %d %d", hex.EncodeToString(qa.Address()), qa.QPN(), ackTimeout, 7)
				p.Line(b, "ok")
				p.Send(b, "region %d", size)
				f = p.Line(b, "region")
				raddr := must(strconv.ParseUint(f[0], 10, 64))
				rkey := must(strconv.ParseUint(f[1], 10, 32))
				src := e.alloc(size, allAccess)
				bandwidthLoop(b, rttSide{qp: qa, cq: cqa, ch: cha}, prov.WRWrite, raddr, uint32(rkey), src.sge(0, size))
			})
		}
	}
}

// BenchmarkChildRawStream is BenchmarkRawStream with the reader in a
// child process: Go's own socket writes of 64 KiB and 1 MiB from this
// process, read by another.
func BenchmarkChildRawStream(b *testing.B) {
	for _, kind := range rawKinds {
		for _, size := range []int{64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("%s/size=%dKiB", kind, size>>10), func(b *testing.B) {
				ln := benchListener(b, kind)
				defer ln.Close()
				p := testproc.Start(b, envTestChild+"=sink", envSink+"="+ln.Addr().Network()+" "+ln.Addr().String())
				c, err := ln.Accept()
				if err != nil {
					b.Fatal(err)
				}
				src := make([]byte, size)
				b.SetBytes(int64(16 * size))
				b.ReportAllocs()
				b.ResetTimer()
				var iters int64
				for b.Loop() {
					iters++
					for range 16 {
						if _, err := c.Write(src); err != nil {
							b.Fatal(err)
						}
					}
				}
				// The child has read all once it sees the end: the time
				// until then counts.
				c.Close()
				f := p.Line(b, "done")
				b.StopTimer()
				if got := must(strconv.ParseInt(f[0], 10, 64)); got != iters*16*int64(size) {
					b.Fatalf("the child read %d bytes, want %d", got, iters*16*int64(size))
				}
			})
		}
	}
}
