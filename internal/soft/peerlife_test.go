package soft

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
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
	halted := func() bool {
		_, h, ok := peerStat(pid)
		return !ok || h
	}
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
	c.ran() // the first look, which reads the threads' time (TestPeerClockFirstLook)
	waitRan(true)
	if halted() {
		t.Fatal("a running process is halted")
	}
	if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(hangGuard); !halted(); {
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
	if !halted() || c.ran() {
		t.Error("an exited process is not halted, or ran")
	}
	var none peerClock
	if none.ran() {
		t.Error("a clock of no process ran")
	}
}

// TestPeerClockFirstLook: a clock reads its peer's threads' run time at
// its first look, not when it is made (a file per thread, for each of
// the thousands of connections of a large world), and that look gives a
// peer whose clock ticks did not move the benefit of the doubt; the next
// finds a peer that sleeps quiet. A stopped peer is never given it.
func TestPeerClockFirstLook(t *testing.T) {
	sleeper := startChild(t, "sleep", "1000")
	waitSlept(t, uint32(sleeper.Process.Pid))
	c := newPeerClock(uint32(sleeper.Process.Pid))
	if c.sched.Load() != schedUnread {
		t.Fatalf("a new clock read the threads' time: %d", c.sched.Load())
	}
	if !c.ran() {
		t.Error("the first look at a sleeping process: not given the benefit of the doubt")
	}
	if c.sched.Load() == schedUnread {
		t.Error("the first look did not read the threads' time")
	}
	if c.ran() {
		t.Error("the second look at a sleeping process: it ran")
	}

	stopped := startChild(t, "sleep", "1000")
	waitSlept(t, uint32(stopped.Process.Pid))
	if err := stopped.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(hangGuard); ; time.Sleep(time.Millisecond) {
		if _, h, _ := peerStat(uint32(stopped.Process.Pid)); h {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a stopped process is not halted")
		}
	}
	if newPeerClock(uint32(stopped.Process.Pid)).ran() {
		t.Error("the first look at a stopped process: it ran")
	}
}

// TestPeerClockBlockedInKernel: a peer with a thread in uninterruptible
// sleep (state D: here, frozen by the cgroup v1 freezer, which is how
// the state can be made at will) counts as running for up to
// localBlockedMax of looks in a row, then as quiet. Before, the looks
// found no sign of a peer whose threads were all blocked in the kernel
// for 2.4 s (the memory map's lock, the file table's growth) and a
// 256-rank all-to-all failed writes to it.
func TestPeerClockBlockedInKernel(t *testing.T) {
	const freezer = "/sys/fs/cgroup/freezer"
	dir := freezer + "/goverbs-test-" + strconv.Itoa(os.Getpid())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Skipf("no cgroup v1 freezer to put a process in state D: %v", err)
	}
	sleeper := startChild(t, "sleep", "1000")
	defer func() {
		// Thawed, killed and reaped, so that its group can go.
		os.WriteFile(dir+"/freezer.state", []byte("THAWED"), 0o644)
		sleeper.Process.Kill()
		sleeper.Wait()
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove the test's freezer group: %v", err)
		}
	}()
	pid := uint32(sleeper.Process.Pid)
	waitSlept(t, pid)
	c := newPeerClock(pid)
	c.ran() // the first look (TestPeerClockFirstLook)
	if c.ran() || threadBlocked(pid) {
		t.Fatal("a sleeping process ran, or is blocked in the kernel")
	}
	write := func(file, v string) {
		t.Helper()
		if err := os.WriteFile(dir+"/"+file, []byte(v), 0o644); err != nil {
			t.Skipf("cannot use the cgroup freezer: %v", err)
		}
	}
	write("cgroup.procs", strconv.Itoa(int(pid)))
	write("freezer.state", "FROZEN")
	for deadline := time.Now().Add(hangGuard); !threadBlocked(pid); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Skip("a frozen process is not in state D on this kernel")
		}
	}
	for i := range 3 {
		if !c.ran() {
			t.Fatalf("look %d: a process blocked in the kernel is quiet", i)
		}
	}
	// As if the looks had found it blocked for localBlockedMax.
	c.blocked.Store(time.Now().Add(-localBlockedMax).UnixNano())
	if c.ran() {
		t.Error("a process blocked in the kernel for localBlockedMax still runs")
	}
}

// waitSlept waits until the process pid runs sleep and sleeps in it.
func waitSlept(t *testing.T, pid uint32) {
	t.Helper()
	for deadline := time.Now().Add(hangGuard); ; time.Sleep(5 * time.Millisecond) {
		comm, _ := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/comm")
		b, _ := readStat(pid)
		if f := statFields(b); string(comm) == "sleep\n" && f != nil && f[0][0] == 'S' {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the child did not go to sleep")
		}
	}
}

// TestPeerClockAfterTicks: a look that finds no clock tick compares the
// threads' run time with the look before, also when that look saw ticks.
// A peer that ran a little in between ran: before, that look found "no
// sign" (its predecessor left no sum to compare with), and a watch whose
// looks came late on a loaded machine ended a peer that ran all along
// (TestWatchLocal/running_briefly failed so under the race detector).
func TestPeerClockAfterTicks(t *testing.T) {
	// A shell that runs for a moment every 10 ms: its clock ticks (10 ms
	// of processor time) rarely move, its schedstat always does.
	cmd := startChild(t, "sh", "-c", "while :; do sleep 0.01; done")
	pid := uint32(cmd.Process.Pid)
	// The clock follows the shell, once it runs: not the process before
	// its exec, and not before the kernel accounted its first run time
	// (a sum of 0 reads as unknown).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/comm")
		if v, _ := peerSched(pid); string(b) == "sh\n" && v != 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the shell did not start for a minute")
		}
	}
	c := newPeerClock(pid)
	ticked := 0
	for round := range 20 {
		c.last.Store(^uint64(0)) // as if the clock ticked since the last look
		if !c.ran() {
			t.Fatalf("round %d: the ticks moved and the peer did not run", round)
		}
		// Wait until the shell ran since that look (its threads' run
		// and wait time moved): on a loaded machine its sleep of 10 ms
		// may take much longer.
		mark := c.sched.Load()
		for deadline := time.Now().Add(time.Minute); ; {
			time.Sleep(20 * time.Millisecond)
			if v, ok := peerSched(pid); ok && v != mark {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the shell did not run for a minute")
			}
		}
		before := c.last.Load()
		if !c.ran() {
			t.Fatalf("round %d: a peer that ran since a look that saw ticks did not run", round)
		}
		if v, _, _ := peerStat(pid); v != before {
			ticked++ // it ticked too: the look compared the ticks
		}
	}
	if ticked == 20 {
		t.Skip("the shell used a clock tick in every round: nothing compared its run time")
	}
}

// TestWatchLocal: the watch of a handshake with a local process goes on
// while the process runs (here this one, which does), ends at its bound,
// ends soon for a stopped process, and its end aborts the connection's
// I/O (watchConn).
func TestWatchLocal(t *testing.T) {
	const quiet = 300 * time.Millisecond // many clock ticks (10 ms) of a busy process
	// read reads from a pipe watched for pid; the other end answers
	// after answerAfter.
	read := func(t *testing.T, pid uint32, max, answerAfter time.Duration) error {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		ctx, stop := watchLocal(pid, quiet, max)
		defer stop()
		stopConn := watchConn(ctx, a)
		defer stopConn()
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
	busy := startChild(t, "sh", "-c", "while :; do :; done")
	running := uint32(busy.Process.Pid)
	t.Run("running", func(t *testing.T) {
		if err := read(t, running, time.Minute, 6*quiet); err != nil {
			t.Fatalf("a running peer answering after 6 quiet periods: %v", err)
		}
	})
	t.Run("running briefly", func(t *testing.T) {
		// A peer that gets a processor for a moment every 50 ms (a
		// shell that waits for sleep(1) in a loop) crosses a clock tick
		// (10 ms of processor time) only every few seconds, like a
		// rank among hundreds on two CPUs: alive by schedstat.
		cmd := startChild(t, "sh", "-c", "while :; do sleep 0.05; done")
		if err := read(t, uint32(cmd.Process.Pid), time.Minute, 6*quiet); err != nil {
			t.Fatalf("a peer that runs briefly and often, answering after 6 quiet periods: %v", err)
		}
	})
	t.Run("bounded", func(t *testing.T) {
		if err := read(t, running, 3*quiet, time.Minute); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("answer after the bound: %v, want a deadline error", err)
		}
	})
	t.Run("stopped", func(t *testing.T) {
		cmd := startChild(t, "sleep", "60")
		syscall.Kill(cmd.Process.Pid, syscall.SIGSTOP)
		if err := read(t, uint32(cmd.Process.Pid), time.Minute, time.Minute); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a stopped peer: %v, want a deadline error", err)
		}
	})
	t.Run("sleeping", func(t *testing.T) {
		// Alive but using no processor time: quiet, given up.
		cmd := startChild(t, "sleep", "60")
		if err := read(t, uint32(cmd.Process.Pid), time.Minute, time.Minute); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a peer that does not run: %v, want a deadline error", err)
		}
	})
}

// startChild starts a command, killed when the test ends (skipped if it
// cannot start).
func startChild(t *testing.T, name string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(name, args...)
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot run %s: %v", name, err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}

// TestExited: a process of this host that exited (reaped, or a zombie
// not yet reaped) has exited; this process, a stopped one and any
// process of another host have not. soft0 logs a connection refused by
// an exited process (how a job ends) at debug level only.
func TestExited(t *testing.T) {
	s := &service{host: [16]byte{1, 2, 3}} // exited reads only the host
	start := func(t *testing.T) *exec.Cmd {
		cmd := exec.Command("sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Skipf("no sleep to run: %v", err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	reaped := func(t *testing.T) int { // a child that exited and was waited for
		cmd := start(t)
		cmd.Process.Kill()
		cmd.Wait()
		return cmd.Process.Pid
	}
	here := func(pid int) *peerAddr { return &peerAddr{pid: uint32(pid), host: s.host, hasHost: true} }
	elsewhere := func(pid int) *peerAddr {
		pa := here(pid)
		pa.host[0] ^= 1
		return pa
	}
	for _, tc := range []struct {
		name string
		addr func(t *testing.T) *peerAddr
		want bool
	}{
		{"this process", func(t *testing.T) *peerAddr { return here(os.Getpid()) }, false},
		{"running", func(t *testing.T) *peerAddr { return here(start(t).Process.Pid) }, false},
		{"stopped", func(t *testing.T) *peerAddr {
			cmd := start(t)
			if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			return here(cmd.Process.Pid)
		}, false},
		{"zombie", func(t *testing.T) *peerAddr {
			cmd := start(t)
			pid := cmd.Process.Pid
			if err := cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			// Not reaped: wait until the kernel says it is a zombie.
			for deadline := time.Now().Add(hangGuard); ; time.Sleep(time.Millisecond) {
				if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil && strings.Contains(string(b), ") Z") {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("a killed child did not become a zombie")
				}
			}
			return here(pid)
		}, true},
		{"reaped", func(t *testing.T) *peerAddr { return here(reaped(t)) }, true},
		{"reaped, of another host", func(t *testing.T) *peerAddr { return elsewhere(reaped(t)) }, false},
		{"no host", func(t *testing.T) *peerAddr { return &peerAddr{pid: 1 << 30} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := s.exited(tc.addr(t)); got != tc.want {
				t.Errorf("exited = %v, want %v", got, tc.want)
			}
		})
	}
}
