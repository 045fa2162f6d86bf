package testproc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

const envChild = "GOVERBS_TESTPROC_CHILD"

func TestMain(m *testing.M) {
	switch spec := ParseSpec(os.Getenv(envChild)); spec[0] {
	case "":
	case "victim":
		os.Exit(victim(spec))
	default:
		// The child: greets, echoes each line upper-cased, says bye.
		fmt.Println("noise")
		fmt.Println("hello", os.Getpid())
		fmt.Fprintln(os.Stderr, "on stderr")
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			fmt.Println("echo", strings.ToUpper(in.Text()))
		}
		fmt.Println("bye")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestProc(t *testing.T) {
	p := Start(t, envChild+"=1")
	f := p.Line(t, "hello")
	if len(f) != 1 || f[0] != fmt.Sprint(p.Cmd.Process.Pid) {
		t.Fatalf("hello line %q, want the child's pid %d", f, p.Cmd.Process.Pid)
	}
	p.Send(t, "abc %d", 42)
	if f := p.Line(t, "echo"); strings.Join(f, " ") != "ABC 42" {
		t.Fatalf("echo %q", f)
	}
	p.Stop(t)
	if !strings.Contains(p.Stderr(), "on stderr") {
		t.Errorf("stderr %q", p.Stderr())
	}
}

// victim is the child of TestSurvive: "victim,FAILAT,A;B": it accepts
// one connection on the listener handed to it and writes "A B" to it,
// then loops (Loop) until step FAILAT fails, forever if FAILAT < 0.
func victim(spec Spec) int {
	if len(spec) != 3 {
		fmt.Println("error: bad spec", spec)
		return 2
	}
	ln, err := Listener()
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	c, err := ln.Accept()
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Fprintln(c, strings.Join(spec.List(2), " "))
	c.Close()
	failAt := spec.Int(1)
	return Loop(func(i int) error {
		if i == failAt {
			return fmt.Errorf("step %d fails", i)
		}
		time.Sleep(time.Millisecond)
		return nil
	})
}

// TestSurvive: a child that got its listener (Listener), parsed its spec
// (Spec) and looped (Loop) is killed once ready while the survivors run,
// and each survivor's failure time is returned; a child whose step
// fails prints the error after "ready" and exits with status 1.
func TestSurvive(t *testing.T) {
	start := func(t *testing.T, failAt int) (*exec.Cmd, <-chan string) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		cmd, lines := StartListening(t, ln.(*net.TCPListener), append(os.Environ(), fmt.Sprintf("%s=victim,%d,x;y", envChild, failAt)))
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		b, err := io.ReadAll(c)
		if err != nil || string(b) != "x y\n" {
			t.Fatalf("the child wrote %q (%v), want \"x y\\n\"", b, err)
		}
		return cmd, lines
	}
	t.Run("killed", func(t *testing.T) {
		cmd, lines := start(t, -1)
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		defer cancel()
		const n, victim = 4, 2
		var ran [n]atomic.Bool
		Survive(t, ctx, cmd, lines, syscall.SIGKILL, n, victim, func(r int) time.Time {
			ran[r].Store(true)
			if r == 1 {
				return time.Time{}
			}
			return time.Now()
		})
		for r := range n {
			if ran[r].Load() != (r != victim) {
				t.Errorf("survive(%d) ran: %v", r, ran[r].Load())
			}
		}
		for range lines { // until the killed child's stdout ends
		}
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Errorf("the child ended with %v, want SIGKILL", err)
		}
	})
	t.Run("step fails", func(t *testing.T) {
		cmd, lines := start(t, 3)
		var got []string
		for line := range lines {
			got = append(got, line)
		}
		if want := []string{"ready", "error: step 3 fails"}; strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("the child printed %q, want %q", got, want)
		}
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("the child ended with %v, want exit status 1", err)
		}
	})
}
