package stream

// A second adversarial pass over the stream: as a demanding user of a
// net.Conn would use it, and as a hostile peer would treat it. The
// helpers (advPipe, await, wait, readN, readAll, isTimeout, pattern,
// hangGuard) are adversarial_test.go's and xproc_test.go's.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/session"
)

// TestAdv2SmallQueueDepth: a session whose Config.QueueDepth is below
// the messages a stream keeps in flight (16) carries the stream all the
// same, and leaves the session's remote memory operations room beside
// it. Each message in flight holds one of the session's QueueDepth
// request tokens until the stream waits for it: before, a Write posting
// more messages than QueueDepth waited for a token that only its own
// later wait would give back (forever, without a deadline), and a
// stream that had written 16 messages held every token of a QueueDepth
// of 16, so the session's Write (RDMA) waited until its context ended.
func TestAdv2SmallQueueDepth(t *testing.T) {
	for _, qd := range []int{1, 2, 5, 16, 17} {
		t.Run(fmt.Sprint(qd), func(t *testing.T) {
			cfg := session.Config{QueueDepth: qd, ReceiveBuffers: 64, MessageSize: 1024}
			c1, c2 := advPipe(t, cfg, cfg)
			want := pattern(200_000)
			wrote := await(func() error {
				// A guard against the hang only: the Write must
				// finish long before.
				c1.SetWriteDeadline(time.Now().Add(hangGuard / 2))
				_, err := c1.Write(want)
				return err
			})
			got := readN(t, c2, len(want))
			if err := wait(t, wrote, "Write"); err != nil {
				t.Fatalf("Write of %d bytes over a session of QueueDepth %d: %v", len(want), qd, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("the bytes read are not those written")
			}
			if qd < 2 {
				// Its one token is the stream's message's until
				// the next Write or Close.
				return
			}
			// The session's own RDMA write, beside the stream.
			ctx, cancel := context.WithTimeout(context.Background(), hangGuard/2)
			defer cancel()
			s := c1.Session()
			r, err := s.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteWrite, 0)
			if err != nil {
				t.Fatal(err)
			}
			src, err := s.Alloc(4096)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Free()
			dst, _ := r.Slice(0, 4096)
			sl, _ := src.Slice(0, 4096)
			if err := s.Write(ctx, dst, sl); err != nil {
				t.Fatalf("the session's Write after the stream's: %v", err)
			}
			r.Release(ctx)
		})
	}
}

// TestAdv2CloseEndsReadsFirst: Close unblocks a Read at once, also while
// it waits for the delivery of the messages posted to a peer that does
// not acknowledge them (a stopped process): the Read returns
// net.ErrClosed while Close still waits. Before, Close ended the Reads
// only after that wait (seconds: until the peer answered, the keepalive
// or the queue pair's transport timeout).
func TestAdv2CloseEndsReadsFirst(t *testing.T) {
	p, addr := startStall(t)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	cfg := childCfg
	cfg.Keepalive = -1 // the stopped peer is found only by the transport timeout
	c, err := Dial(ctx, addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	p.Line(t, "ready")
	if err := p.Cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := true
	cont := func() {
		if stopped {
			p.Cmd.Process.Signal(syscall.SIGCONT)
			stopped = false
		}
	}
	defer cont()
	// Messages in flight to the stopped peer (as many as its credits;
	// the rest of the Write times out).
	c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := c.Write(pattern(1 << 20)); n == 0 || !isTimeout(err) {
		t.Fatalf("Write to a stopped peer: %d, %v; want some bytes posted, then a timeout", n, err)
	}
	rch := await(func() error { _, err := c.Read(make([]byte, 8)); return err })
	settle()
	cch := await(c.Close)
	if err := wait(t, rch, "Read during Close"); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Read during Close: %v, want net.ErrClosed", err)
	}
	// The peer is stopped: Close still waits for it to acknowledge the
	// messages, with the session alive.
	if err := c.Session().Err(); err != nil {
		t.Fatalf("the Read returned only once Close's wait for the stopped peer had ended (the session ended: %v)", err)
	}
	select {
	case err := <-cch:
		t.Fatalf("Close returned (%v) while the peer was stopped", err)
	default:
	}
	cont()
	if err := wait(t, cch, "Close"); err != nil {
		t.Logf("Close: %v", err)
	}
	if _, err := c.Read(make([]byte, 8)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Read after Close: %v", err)
	}
}

// TestNewSmallQueueDepth: New, on a session the caller configured, keeps
// at most half the session's QueueDepth messages in flight, as Dial and
// Listener do. Before, New kept 16 whatever the session: over a session
// of QueueDepth 4 a Write waited for a token only its own later wait
// would give back, until its deadline.
func TestNewSmallQueueDepth(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	cfg := session.Config{QueueDepth: 4, ReceiveBuffers: 64, MessageSize: 1024}
	l, err := session.Listen(ctx, "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	acc := make(chan *session.Session, 1)
	go func() {
		s, err := l.Accept(ctx)
		if err != nil {
			t.Error(err)
		}
		acc <- s
	}()
	d, err := session.Dial(ctx, l.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := <-acc
	if s == nil {
		d.Close()
		t.FailNow()
	}
	c1, c2 := New(d), New(s)
	defer c1.Close()
	defer c2.Close()
	want := pattern(200_000)
	wrote := await(func() error {
		c1.SetWriteDeadline(time.Now().Add(hangGuard / 2)) // a guard against the hang only
		_, err := c1.Write(want)
		return err
	})
	got := readN(t, c2, len(want))
	if err := wait(t, wrote, "Write"); err != nil {
		t.Fatalf("Write of %d bytes over a session of QueueDepth 4: %v", len(want), err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the bytes read are not those written")
	}
}
