package provproxy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/provhook"
	"github.com/goverbs/verbs/internal/provproxy"

	"github.com/goverbs/verbs/internal/testproc"
)

const timeout = 30 * time.Second

// peer is a peer process serving soft0.
type peer struct {
	t      testing.TB
	c      *provproxy.Client
	cmd    *exec.Cmd
	stderr *testproc.SyncBuffer
	killed bool
	once   sync.Once
}

// startPeer re-executes the test binary as a peer process and stops it
// when the test ends: a peer that does not exit cleanly fails the test.
func startPeer(t testing.TB) *peer {
	t.Helper()
	cmd, err := testproc.Command(nil)
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{t: t, cmd: cmd, stderr: &testproc.SyncBuffer{}}
	cmd.Stderr = p.stderr
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if p.c, err = provproxy.Start(ctx, cmd); err != nil {
		t.Fatalf("%v; stderr:\n%s", err, p.stderr)
	}
	t.Cleanup(p.stop)
	return p
}

// kill kills the peer with SIGKILL and waits for it.
func (p *peer) kill() {
	p.killed = true
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
}

// stop closes the client and waits for the peer to exit.
func (p *peer) stop() {
	p.once.Do(func() {
		p.c.Close()
		if p.killed {
			return
		}
		done := make(chan error, 1)
		go func() { done <- p.cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				p.t.Errorf("peer process: %v; stderr:\n%s", err, p.stderr)
			}
		case <-time.After(timeout):
			p.cmd.Process.Kill()
			<-done
			p.t.Errorf("the peer process did not exit within %v; stderr:\n%s", timeout, p.stderr)
		}
	})
}

// open opens soft0 in the peer as a *verbs.Context, closed when the test
// ends.
func (p *peer) open(t testing.TB) *verbs.Context {
	t.Helper()
	devs, _ := p.c.Devices()
	if len(devs) == 0 {
		t.Fatal("the peer lists no device")
	}
	pc, err := p.c.Open(devs[0].Name)
	if err != nil {
		t.Fatal(err)
	}
	v, err := provhook.NewContext(pc, devs[0], p.c.Name())
	if err != nil {
		pc.Close()
		t.Fatal(err)
	}
	return v.(*verbs.Context)
}

// TestPeerStopped stops the peer process (SIGSTOP): a call that cannot
// block in the provider gets no answer, and once the call guard has passed
// it fails with ErrConnLost, as does every later call, instead of waiting
// for ever; so does a wait whose ctx ended, whose cancellation gets no
// answer either. Objects closed afterwards are released.
func TestPeerStopped(t *testing.T) {
	t.Run("Poll", func(t *testing.T) {
		p := startPeer(t)
		ctx := p.open(t)
		cq, err := ctx.NewCompletionQueue(verbs.CQSpec{})
		if err != nil {
			t.Fatal(err)
		}
		p.c.SetCallGuard(200 * time.Millisecond)
		p.stopProcess(t)
		var wc [4]verbs.Completion
		_, err = cq.Poll(wc[:])
		expectUnresponsive(t, "Poll on a stopped peer", err)
		if _, err := ctx.QueryDevice(); !errors.Is(err, provproxy.ErrConnLost) {
			t.Errorf("a later call: %v, want an error wrapping ErrConnLost", err)
		}
		// The objects went with the connection: closing them releases
		// them here.
		if err := cq.Close(); err != nil {
			t.Errorf("close the CQ after the connection ended: %v", err)
		}
		if err := ctx.Close(); err != nil {
			t.Errorf("close the context after the connection ended: %v", err)
		}
	})
	t.Run("CancelledWait", func(t *testing.T) {
		p := startPeer(t)
		c, err := p.c.Open(verbs.SoftDevice)
		must(t, err)
		ch, err := c.CreateCompChannel()
		must(t, err)
		p.c.SetCallGuard(200 * time.Millisecond)
		p.stopProcess(t)
		wctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := waitResult(t, func() error { _, err := ch.Wait(wctx); return err })
		for provproxy.Outstanding(p.c) < 1 {
			if guard(t).Err() != nil {
				t.Fatal("the wait was not sent within the hang guard")
			}
			runtime.Gosched()
		}
		cancel()
		expectUnresponsive(t, "a cancelled wait on a stopped peer", expectReturn(t, "channel Wait", done))
		must(t, ch.Close())
		must(t, c.Close())
	})
}

// expectUnresponsive checks that err says the connection ended because
// the peer did not answer.
func expectUnresponsive(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, provproxy.ErrConnLost) || !strings.Contains(err.Error(), "stopped or hung") {
		t.Fatalf("%s: %v, want an error wrapping ErrConnLost that says the peer is stopped or hung", what, err)
	}
}

// stopProcess stops the peer (SIGSTOP), waits until it is stopped, and
// kills it when the test ends.
func (p *peer) stopProcess(t *testing.T) {
	t.Helper()
	pid := p.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Skipf("cannot read the state of the peer process: %v", err)
		}
		// pid (comm) state ...: the state follows the last ')'.
		if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && b[i+2] == 'T' {
			return
		}
		if guard(t).Err() != nil {
			t.Fatalf("the peer process did not stop within the hang guard")
		}
		time.Sleep(time.Millisecond)
	}
}
