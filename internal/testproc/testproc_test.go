package testproc

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"
)

const envChild = "GOVERBS_TESTPROC_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(envChild) != "" {
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
