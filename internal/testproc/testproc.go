package testproc

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// Timeout bounds every wait for the child (a hang guard, not a
// performance bound).
const Timeout = 2 * time.Minute

// Proc is a child process.
type Proc struct {
	Cmd    *exec.Cmd
	in     io.WriteCloser
	lines  chan string
	stderr SyncBuffer
	waited bool
}

// Command is the command that re-executes the test binary, running no
// test, with env added to this process' environment, under the command
// wrap if not empty (e.g. ip netns exec NAME). Under the race detector a
// program that exits cleanly waits a second for late reports (GORACE
// atexit_sleep_ms): not the child, which has closed everything by then.
func Command(wrap []string, env ...string) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := append(append(wrap[:len(wrap):len(wrap)], exe), "-test.run=^$")
	cmd := exec.Command(args[0], args[1:]...)
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	cmd.Env = append(append(os.Environ(), "GORACE="+gorace), env...)
	return cmd, nil
}

// Start starts the test binary as a child (Command) with env added to
// this process' environment.
func Start(t testing.TB, env ...string) *Proc {
	t.Helper()
	cmd, err := Command(nil, env...)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proc{Cmd: cmd, lines: make(chan string, 64)}
	cmd.Stderr = &p.stderr
	if p.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.lines)
		s := bufio.NewScanner(out)
		for s.Scan() {
			p.lines <- s.Text()
		}
	}()
	t.Cleanup(func() {
		if !p.waited {
			p.in.Close()
			p.Cmd.Process.Kill()
			p.Cmd.Wait()
		}
	})
	return p
}

// StartListening starts the test binary as a child running no test,
// with exactly env as its environment, and hands it ln's socket as file
// descriptor 3 (ln itself is closed here: the child accepts on it). The
// child's stderr is this process' stderr; the lines of its stdout come on
// the returned channel, closed when the child closes its stdout. The
// child is killed and reaped when t ends.
func StartListening(t testing.TB, ln interface {
	File() (*os.File, error)
	Close() error
}, env []string) (*exec.Cmd, <-chan string) {
	t.Helper()
	f, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	cmd, err := Command(nil)
	if err != nil {
		f.Close()
		t.Fatal(err)
	}
	cmd.Env = env
	cmd.ExtraFiles = []*os.File{f}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		f.Close()
		t.Fatal(err)
	}
	err = cmd.Start()
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	lines := make(chan string, 8)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	return cmd, lines
}

// Send writes a line to the child's stdin.
func (p *Proc) Send(t testing.TB, format string, args ...any) {
	t.Helper()
	if _, err := fmt.Fprintf(p.in, format+"\n", args...); err != nil {
		t.Fatalf("child: %v; stderr:\n%s", err, p.Stderr())
	}
}

// Line returns the fields after word of the child's next line that
// starts with word; other lines are skipped. It fails the test if the
// child ends, or says nothing of the kind within Timeout.
func (p *Proc) Line(t testing.TB, word string) []string {
	t.Helper()
	for {
		if f := strings.Fields(p.Next(t, word)); len(f) > 0 && f[0] == word {
			return f[1:]
		}
	}
}

// Next returns the child's next line. It fails the test, saying that it
// waited for what (a word of the caller's), if the child ends or says
// nothing within Timeout.
func (p *Proc) Next(t testing.TB, what string) string {
	t.Helper()
	timer := time.NewTimer(Timeout)
	defer timer.Stop()
	select {
	case l, ok := <-p.lines:
		if !ok {
			t.Fatalf("child ended before a %q line; stderr:\n%s", what, p.Stderr())
		}
		return l
	case <-timer.C:
		t.Fatalf("child: no %q line within %v; stderr:\n%s", what, Timeout, p.Stderr())
	}
	return ""
}

// Stop closes the child's stdin and waits for it to exit, at most
// Timeout (then it is killed); it fails the test unless the child exited
// cleanly.
func (p *Proc) Stop(t testing.TB) {
	t.Helper()
	p.in.Close()
	kill := time.AfterFunc(Timeout, func() { p.Cmd.Process.Kill() })
	err := p.Cmd.Wait()
	kill.Stop()
	p.waited = true
	if err != nil {
		t.Errorf("child: %v; stderr:\n%s", err, p.Stderr())
	}
}

// Stderr is what the child wrote to its stderr so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// SyncBuffer is a bytes.Buffer for one writer and concurrent readers.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(b)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
