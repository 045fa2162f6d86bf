package verbs_test

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/leak"
	"github.com/goverbs/verbs/verbstest"
)

// leakObjects opens a context, a PD and an MR and drops all three without
// Close. It returns what the leak tracer should report about them.
func leakObjects(t *testing.T) []string {
	t.Helper()
	ctx, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	pd, err := ctx.AllocPD()
	if err != nil {
		ctx.Close()
		t.Fatal(err)
	}
	mr, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		pd.Close()
		ctx.Close()
		t.Fatal(err)
	}
	return []string{
		fmt.Sprintf("memory region (lkey %#x, 4096 bytes) was garbage-collected without Close", mr.LKey()),
		"protection domain was garbage-collected without Close",
		"device context (" + verbs.SoftDevice + ") was garbage-collected without Close",
	}
}

// collect runs the garbage collector until the leak tracer has recorded n
// more leaks than start, or gives up after a bounded number of cycles.
func collect(start, n int64) {
	for i := 0; i < 200 && leak.Count() < start+n; i++ {
		runtime.GC()
		time.Sleep(time.Millisecond) // let the cleanup goroutine run
	}
}

func TestLeakTracerReportsDroppedObjects(t *testing.T) {
	start := leak.Count()
	want := leakObjects(t)
	collect(start, int64(len(want)))
	got := leak.Since(start)
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("leak tracer did not report %q; it reported %q", w, got)
		}
	}
}

func TestLeakTracerIgnoresClosedObjects(t *testing.T) {
	start := leak.Count()
	func() {
		ctx, err := verbs.Open(verbs.SoftDevice)
		if err != nil {
			t.Fatal(err)
		}
		pd, err := ctx.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		if err := pd.Close(); err != nil {
			t.Error(err)
		}
		if err := ctx.Close(); err != nil {
			t.Error(err)
		}
	}()
	// A leaked object as a marker: once it is reported, the closed ones
	// were collected in the same or an earlier cycle.
	want := leakObjects(t)
	collect(start, int64(len(want)))
	for _, l := range leak.Since(start) {
		if !slices.Contains(want, l) {
			t.Errorf("leak tracer reported a closed object: %q", l)
		}
	}
}

// recorder is a testing.TB that keeps cleanups and errors to itself.
type recorder struct {
	testing.TB
	cleanups []func()
	errors   []string
}

func (r *recorder) Helper()          {}
func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recorder) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func TestCheckLeaksFailsTest(t *testing.T) {
	rec := &recorder{TB: t}
	start := leak.Count()
	verbstest.CheckLeaks(rec)
	want := leakObjects(t)
	collect(start, int64(len(want)))
	rec.runCleanups()
	if len(rec.errors) != 1 {
		t.Fatalf("CheckLeaks reported %d errors, want 1: %q", len(rec.errors), rec.errors)
	}
	for _, w := range want {
		if !strings.Contains(rec.errors[0], w) {
			t.Errorf("CheckLeaks error %q does not name %q", rec.errors[0], w)
		}
	}

	// Without leaks, CheckLeaks stays quiet.
	rec = &recorder{TB: t}
	verbstest.CheckLeaks(rec)
	rec.runCleanups()
	if len(rec.errors) != 0 {
		t.Errorf("CheckLeaks reported %q without leaks", rec.errors)
	}
}

func TestCloseParentNamesChildren(t *testing.T) {
	ctx, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	var closers []func() error // in closing order
	defer func() {
		for _, c := range closers {
			c()
		}
		ctx.Close()
	}()
	pd, err := ctx.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	cq, err := ctx.NewCompletionQueue(verbs.CQSpec{Entries: 64})
	if err != nil {
		t.Fatal(err)
	}
	mr, err := pd.Alloc(8192, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	closers = []func() error{qp.Close, mr.Close, cq.Close, pd.Close}

	mrName := fmt.Sprintf("memory region (lkey %#x, 8192 bytes)", mr.LKey())
	qpName := fmt.Sprintf("RC queue pair (qpn %d)", qp.QPN())
	cqName := fmt.Sprintf("completion queue (%d entries)", cq.Cap())
	for _, c := range []struct {
		what  string
		err   error
		names []string
	}{
		{"close pd", pd.Close(), []string{mrName, qpName, "still in use by 2 object(s)"}},
		{"close cq", cq.Close(), []string{qpName, "still in use by 1 object(s)"}},
		{"close context", ctx.Close(), []string{"protection domain", cqName, "still in use by 2 object(s)"}},
	} {
		if c.err == nil {
			t.Errorf("%s with live children succeeded", c.what)
			continue
		}
		for _, n := range c.names {
			if !strings.Contains(c.err.Error(), n) {
				t.Errorf("%s: %q does not name %q", c.what, c.err, n)
			}
		}
	}
	// In the right order, everything closes.
	for i, c := range closers {
		if err := c(); err != nil {
			t.Errorf("close %d: %v", i, err)
		}
	}
	if err := ctx.Close(); err != nil {
		t.Errorf("close context: %v", err)
	}
}
