package testproc

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The two sides of a failure test, in which one rank of a world is a
// child that the test kills or stops (or that dies by itself) while it
// loops: the child takes the listener StartListening handed it
// (Listener) and runs its steps (Loop); the test runs the other ranks,
// the survivors, and signals the child once it is ready (Survive).

// Spec is the fields of a child's spec: the comma-separated words (its
// kind first) that a test hands its child in the environment; a field
// may be a list separated by ';'.
type Spec []string

// ParseSpec splits spec into its fields.
func ParseSpec(spec string) Spec { return strings.Split(spec, ",") }

// Int returns field i as a number (0 if it is not one).
func (s Spec) Int(i int) int {
	n, _ := strconv.Atoi(s[i])
	return n
}

// List returns the elements of field i, a list separated by ';'.
func (s Spec) List(i int) []string { return strings.Split(s[i], ";") }

// Listener returns, in a child that StartListening started, the
// listener it was handed as file descriptor 3.
func Listener() (net.Listener, error) {
	f := os.NewFile(3, "listener")
	ln, err := net.FileListener(f)
	f.Close()
	return ln, err
}

// Loop runs step(0), step(1), … in a child until a step fails: it
// prints "ready" once step 0 has succeeded and "error: ERR" when a step
// fails, and then returns 1 (the child's exit status).
func Loop(step func(i int) error) int {
	for i := 0; ; i++ {
		if err := step(i); err != nil {
			fmt.Println("error:", err)
			return 1
		}
		if i == 0 {
			fmt.Println("ready")
		}
	}
}

// Survive runs survive(r) for every rank r of a world of n but victim,
// each in a goroutine of its own, and meanwhile waits for the victim, the
// child cmd whose output is lines (see StartListening), to print "ready"
// and sends it sig (0: none, the child dies by itself). survive returns
// when its rank failed (zero: it did not). Once every survive has
// returned, Survive logs how long after the signal each rank failed: a
// measurement, not a bound. A line other than "ready", the end of the
// child's output, ctx's end (the hang guard) or a failure to signal
// fails t.
func Survive(t testing.TB, ctx context.Context, cmd *exec.Cmd, lines <-chan string, sig syscall.Signal, n, victim int, survive func(r int) time.Time) {
	t.Helper()
	failed := make([]time.Time, n)
	var wg sync.WaitGroup
	for r := range n {
		if r == victim {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			failed[r] = survive(r)
		}()
	}
	signalled := time.Now()
	if sig != 0 {
		signalled = signalReady(t, ctx, cmd, lines, sig, victim)
	}
	wg.Wait()
	for r, f := range failed {
		if !f.IsZero() {
			t.Logf("rank %d failed %v after the signal (not a bound: a measurement)", r, f.Sub(signalled).Round(time.Millisecond))
		}
	}
}

// signalReady waits for the line "ready" of the child cmd, rank victim,
// then sends it sig and returns when (see Survive).
func signalReady(t testing.TB, ctx context.Context, cmd *exec.Cmd, lines <-chan string, sig syscall.Signal, victim int) time.Time {
	t.Helper()
	select {
	case line, ok := <-lines:
		if line != "ready" {
			t.Fatalf("child rank %d: %q (%v)", victim, line, ok)
		}
	case <-ctx.Done():
		t.Fatal("the child rank did not get ready")
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}
