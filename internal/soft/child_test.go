package soft

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// Tests that need a soft0 process of their own (its resource limits, its
// memory, its death) re-execute the test binary with envTestChild set to
// a mode; TestMain runs the mode instead of the tests.
const envTestChild = "GOVERBS_SOFT_TEST_CHILD"

// childModes are the child processes' programs. Each talks to its parent
// on stdin and stdout, a line at a time, and returns the exit status.
var childModes = map[string]func(in *bufio.Scanner, out io.Writer) int{
	"listener": childListener,
}

func runChild(mode string) int {
	f := childModes[mode]
	if f == nil {
		fmt.Fprintf(os.Stderr, "unknown child mode %q\n", mode)
		return 2
	}
	return f(bufio.NewScanner(os.Stdin), os.Stdout)
}

// childListener starts the soft service (with a RC QP), prints its QP's
// provider address ("addr HEX"), and exits when told ("exit") or when
// its stdin closes.
func childListener(in *bufio.Scanner, out io.Writer) int {
	ctx, err := New().Open(DeviceName)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer ctx.Close()
	pd, err := ctx.AllocPD()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pd.Close()
	cq, err := ctx.CreateCQ(16, nil, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cq.Close()
	q, err := pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer q.Close()
	fmt.Fprintf(out, "addr %s\n", hex.EncodeToString(q.Address()))
	for in.Scan() {
		if strings.TrimSpace(in.Text()) == "exit" {
			break
		}
	}
	return 0
}

// child is a running child process.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *bufio.Scanner
	stderr *syncBuffer
}

// syncBuffer is a bytes.Buffer for one writer and concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startChild starts the test binary in mode, with extra environment.
func startChild(t *testing.T, mode string, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), envTestChild+"="+mode, "GORACE=atexit_sleep_ms=0"), env...)
	stderr := new(syncBuffer)
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout), stderr: stderr}
	t.Cleanup(func() {
		c.stdin.Close()
		c.cmd.Process.Kill()
		c.cmd.Wait()
	})
	return c
}

// line reads the child's next line that starts with prefix and returns
// the rest.
func (c *child) line(t *testing.T, prefix string) string {
	t.Helper()
	for c.out.Scan() {
		if s, ok := strings.CutPrefix(c.out.Text(), prefix+" "); ok {
			return s
		}
	}
	t.Fatalf("child ended before %q (stderr: %s)", prefix, c.stderr.String())
	return ""
}

// stop tells the child to exit and waits for it; it must exit cleanly.
func (c *child) stop(t *testing.T) {
	t.Helper()
	fmt.Fprintln(c.stdin, "exit")
	c.stdin.Close()
	if err := c.cmd.Wait(); err != nil {
		t.Errorf("child: %v (stderr: %s)", err, c.stderr.String())
	}
}
