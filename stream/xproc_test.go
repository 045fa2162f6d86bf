package stream

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
	"github.com/goverbs/verbs/session"
)

// envChild names what a child process of the cross-process tests does:
// "echo" (writes back what it reads until io.EOF, then closes), "sink"
// (reads until io.EOF, then writes one byte and closes), "burst N"
// (writes N bytes of pattern, closes and exits at once), "flood"
// (writes pattern(1 MiB) over and over until killed), "closer" (writes
// prefixes of pattern(1 MiB) over and over while it closes the stream
// at a random moment, then prints "before N": the bytes of the Writes
// that had returned) or "stall" (reads nothing until its stdin closes). With envNet
// "tcp" it serves a kernel TCP connection instead of a stream (the
// benchmarks' baseline).
const (
	envChild = "GOVERBS_STREAM_CHILD"
	envNet   = "GOVERBS_STREAM_NET"
)

// childCfg is the session configuration of both sides: small buffers,
// so that flow control and many messages are exercised.
// The benchmarks' children use benchCfg (the defaults) instead, when
// envBench is set.
var (
	childCfg = session.Config{ReceiveBuffers: 8, MessageSize: 4096}
	benchCfg = session.Config{}
)

const envBench = "GOVERBS_STREAM_BENCH"

func childIfRequested() {
	what := os.Getenv(envChild)
	if what == "" {
		return
	}
	os.Exit(runChild(what))
}

func runChild(what string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var l net.Listener
	var err error
	if os.Getenv(envNet) == "tcp" {
		l, err = net.Listen("tcp", "127.0.0.1:0")
	} else {
		cfg := childCfg
		if os.Getenv(envBench) != "" {
			cfg = benchCfg
		}
		l, err = Listen(ctx, "127.0.0.1:0", cfg)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	fmt.Println("addr", l.Addr())
	c, err := l.Accept()
	l.Close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: accept:", err)
		return 1
	}
	defer c.Close()
	switch {
	case what == "sink":
		if _, err := io.Copy(io.Discard, c); err != nil {
			fmt.Fprintln(os.Stderr, "child: sink:", err)
			return 1
		}
		if _, err := c.Write([]byte{1}); err != nil {
			fmt.Fprintln(os.Stderr, "child: sink:", err)
			return 1
		}
	case what == "echo":
		if _, err := io.Copy(c, c); err != nil {
			fmt.Fprintln(os.Stderr, "child: echo:", err)
			return 1
		}
	case what == "flood":
		// Writes pattern(1 MiB) again and again until the test kills
		// this process.
		for b := pattern(1 << 20); ; {
			if _, err := c.Write(b); err != nil {
				fmt.Fprintln(os.Stderr, "child: flood:", err)
				return 1
			}
		}
	case what == "closer":
		// Writes pattern(1 MiB) again and again from one goroutine
		// while this one closes the stream after a moment, and says
		// how many bytes the Writes that returned before had written.
		var wrote atomic.Int64
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			// pattern is periodic (1 MiB): byte i of the stream is
			// pattern's byte i.
			b := pattern(2 << 20)
			for off := 0; ; {
				at := off % (1 << 20)
				n, err := c.Write(b[at : at+1+rand.N(64<<10)])
				off += n
				wrote.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
		time.Sleep(time.Duration(5+rand.N(30)) * time.Millisecond)
		before := wrote.Load()
		c.Close()
		<-stopped
		fmt.Println("before", before)
		return 0
	case what == "stall":
		// Reads nothing until the test closes stdin (or kills it).
		fmt.Println("ready")
		io.Copy(io.Discard, os.Stdin)
	case len(what) > 6 && what[:6] == "burst ":
		n, _ := strconv.Atoi(what[6:])
		if _, err := c.Write(pattern(n)); err != nil {
			fmt.Fprintln(os.Stderr, "child: burst:", err)
			return 1
		}
	default:
		fmt.Fprintf(os.Stderr, "child: %s=%q\n", envChild, what)
		return 2
	}
	if err := c.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "child: close:", err)
		return 1
	}
	return 0
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i>>8)
	}
	return b
}

var kinds = []string{"shm", "unix", "tcp"}

// dialChild starts a child doing what over soft0's transport kind and
// returns a stream to it.
func dialChild(t *testing.T, kind, what string) (*Conn, *testproc.Proc) {
	t.Helper()
	restore, err := soft.ForceTransport(kind)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	p := testproc.Start(t, envChild+"="+what, "GOVERBS_SOFT_TRANSPORT="+kind)
	addr := p.Line(t, "addr")[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := Dial(ctx, addr, childCfg)
	if err != nil {
		t.Fatal(err)
	}
	return c, p
}

// TestCrossProcessEcho: 3 MiB written in Writes of random sizes (1 byte
// to 3 messages) to an echoing child process and read back in Reads of
// random sizes come back whole and in order; CloseWrite ends the echo,
// and the child's Close its stream: io.EOF.
func TestCrossProcessEcho(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			c, p := dialChild(t, kind, "echo")
			defer c.Close()
			want := pattern(3 << 20)
			go func() {
				for b := want; len(b) > 0; {
					n := min(len(b), 1+rand.N(3*4096))
					if _, err := c.Write(b[:n]); err != nil {
						t.Error(err)
						return
					}
					b = b[n:]
				}
				if err := c.CloseWrite(); err != nil {
					t.Error(err)
				}
			}()
			var got bytes.Buffer
			buf := make([]byte, 3*4096)
			for {
				n, err := c.Read(buf[:1+rand.N(len(buf))])
				got.Write(buf[:n])
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got.Bytes(), want) {
				t.Fatalf("read back %d bytes, not the %d written", got.Len(), len(want))
			}
			p.Stop(t)
		})
	}
}

// TestCrossProcessCloseDelivers: a child that writes 1 MiB and closes its
// stream at once (then exits) loses none of it: every byte is read, then
// io.EOF.
func TestCrossProcessCloseDelivers(t *testing.T) {
	const n = 1 << 20
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			c, p := dialChild(t, kind, fmt.Sprintf("burst %d", n))
			defer c.Close()
			got, err := io.ReadAll(c)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, pattern(n)) {
				t.Fatalf("read %d bytes, want %d", len(got), n)
			}
			p.Stop(t)
		})
	}
}
