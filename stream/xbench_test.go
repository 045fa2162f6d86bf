package stream

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
)

// benchConn starts a child doing what and returns a connection to it:
// over a stream on soft0's transport kind, or over kernel TCP ("kernel",
// the baseline: what a net.Conn user has without goverbs).
func benchConn(b *testing.B, kind, what string) net.Conn {
	b.Helper()
	env := []string{envChild + "=" + what, envBench + "=1"}
	if kind == "kernel" {
		env = append(env, envNet+"=tcp")
	} else {
		restore, err := soft.ForceTransport(kind)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(restore)
		env = append(env, "GOVERBS_SOFT_TRANSPORT="+kind)
	}
	p := testproc.Start(b, env...)
	addr := p.Line(b, "addr")[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var c net.Conn
	var err error
	if kind == "kernel" {
		c, err = (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	} else {
		c, err = Dial(ctx, addr, benchCfg)
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close(); p.Stop(b) })
	return c
}

// benchKinds: soft0's transports, then the kernel TCP baseline.
var benchKinds = []string{"shm", "unix", "tcp", "kernel"}

// BenchmarkXprocStream measures a stream between two processes against
// kernel TCP between the same two (the "kernel" case), each with its own
// child: 64 KiB Writes to a child that reads and discards them, and 8-byte
// round trips to a child that echoes.
func BenchmarkXprocStream(b *testing.B) {
	for _, kind := range benchKinds {
		b.Run("write64k/"+kind, func(b *testing.B) {
			c := benchConn(b, kind, "sink")
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			// The child answers once it has read everything.
			closeWrite(b, c)
			if _, err := io.ReadFull(c, buf[:1]); err != nil {
				b.Fatal(err)
			}
		})
	}
	for _, kind := range benchKinds {
		b.Run("rtt8/"+kind, func(b *testing.B) {
			c := benchConn(b, kind, "echo")
			buf := make([]byte, 8)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func closeWrite(b *testing.B, c net.Conn) {
	b.Helper()
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		b.Fatalf("%T has no CloseWrite", c)
	}
	if err := cw.CloseWrite(); err != nil {
		b.Fatal(err)
	}
}
