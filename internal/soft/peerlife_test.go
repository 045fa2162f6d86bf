package soft

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestPeerClock: the processor time of a process that runs moves, that of
// a stopped one does not, and a stopped or exited process is halted.
func TestPeerClock(t *testing.T) {
	cmd := exec.Command("sh", "-c", "while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Skipf("no shell to run a busy child: %v", err)
	}
	pid := uint32(cmd.Process.Pid)
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()
	c := newPeerClock(pid)
	waitRan := func(want bool) {
		t.Helper()
		// The child gets a processor within the hang guard; a stopped
		// one must stay still over several looks.
		deadline := time.Now().Add(hangGuard)
		for looks := 0; ; looks++ {
			time.Sleep(20 * time.Millisecond)
			ran := c.ran()
			if want && ran {
				return
			}
			if !want && ran {
				t.Fatalf("look %d: a stopped process ran", looks)
			}
			if !want && looks >= 5 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("a busy process did not run within %v", hangGuard)
			}
		}
	}
	waitRan(true)
	if peerHalted(pid) {
		t.Fatal("a running process is halted")
	}
	if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(hangGuard); !peerHalted(pid); {
		if time.Now().After(deadline) {
			t.Fatal("a stopped process is not halted")
		}
		time.Sleep(time.Millisecond)
	}
	c.ran() // what it ran before it stopped
	waitRan(false)
	syscall.Kill(int(pid), syscall.SIGCONT)
	waitRan(true)
	cmd.Process.Kill()
	cmd.Wait()
	if !peerHalted(pid) || c.ran() {
		t.Error("an exited process is not halted, or ran")
	}
	var none peerClock
	if none.ran() {
		t.Error("a clock of no process ran")
	}
}

// TestExtendWhileRunning: a handshake's deadline moves on while its peer
// runs (here this process, which does), up to the bound, and not while
// the peer is stopped.
func TestExtendWhileRunning(t *testing.T) {
	const period = 100 * time.Millisecond
	read := func(t *testing.T, pid uint32, max, answerAfter time.Duration) error {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		start := time.Now()
		a.SetDeadline(start.Add(period))
		stop := extendWhileRunning(a, pid, start, period, max)
		defer stop()
		quit, wrote := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(wrote)
			select {
			case <-time.After(answerAfter):
				b.Write([]byte{1})
			case <-quit:
			}
		}()
		var buf [1]byte
		_, err := a.Read(buf[:])
		close(quit)
		b.Close() // a Write that nobody reads fails
		<-wrote
		return err
	}
	self := uint32(os.Getpid())
	t.Run("running", func(t *testing.T) {
		// 6 periods: the first deadline, and more, passed.
		if err := read(t, self, time.Minute, 6*period); err != nil {
			t.Fatalf("a running peer answering after 6 periods: %v", err)
		}
	})
	t.Run("bounded", func(t *testing.T) {
		if err := read(t, self, 3*period, 20*period); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("answer after the bound: %v, want a deadline error", err)
		}
	})
	t.Run("stopped", func(t *testing.T) {
		cmd := exec.Command("sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Skipf("no sleep command: %v", err)
		}
		defer func() {
			cmd.Process.Kill()
			cmd.Wait()
		}()
		syscall.Kill(cmd.Process.Pid, syscall.SIGSTOP)
		if err := read(t, uint32(cmd.Process.Pid), time.Minute, 20*period); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a stopped peer: %v, want a deadline error", err)
		}
	})
}
