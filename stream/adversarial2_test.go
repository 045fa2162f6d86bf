package stream

// A second adversarial pass over the stream: as a demanding user of a
// net.Conn would use it, and as a hostile peer would treat it. The
// helpers (advPipe, await, wait, readN, readAll, isTimeout, pattern,
// hangGuard) are adversarial_test.go's and xproc_test.go's.

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
)

// TestAdv2CloseEndsReadsFirst: Close unblocks a Read at once, also while
// it waits for the delivery of the messages posted to a peer that does
// not acknowledge them (a stopped process): the Read returns
// net.ErrClosed while Close still waits. Before, Close ended the Reads
// only after that wait (seconds: until the peer answered, the keepalive
// or the queue pair's transport timeout).
func TestAdv2CloseEndsReadsFirst(t *testing.T) {
	restore, err := soft.ForceTransport("unix")
	if err != nil {
		t.Fatal(err)
	}
	defer restore()
	p := testproc.Start(t, envChild+"=stall", "GOVERBS_SOFT_TRANSPORT=unix")
	addr := p.Line(t, "addr")[0]
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
