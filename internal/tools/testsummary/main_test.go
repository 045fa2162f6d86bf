package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestFailureLines(t *testing.T) {
	for _, tc := range []struct {
		name   string
		events []event
		counts [3]int // passed, failed, skipped
		want   []string
	}{
		{
			name: "a failure keeps its last lines, a pass and a skip keep none",
			events: []event{
				{Action: "run", Package: "p", Test: "TestA"},
				{Action: "output", Package: "p", Test: "TestA", Output: "=== RUN   TestA\n"},
				{Action: "output", Package: "p", Test: "TestA", Output: "    a_test.go:9: got 2, want 1\n"},
				{Action: "output", Package: "p", Test: "TestA", Output: "--- FAIL: TestA (0.00s)\n"},
				{Action: "fail", Package: "p", Test: "TestA"},
				{Action: "run", Package: "p", Test: "TestB"},
				{Action: "output", Package: "p", Test: "TestB", Output: "    b_test.go:3: fine\n"},
				{Action: "pass", Package: "p", Test: "TestB"},
				{Action: "run", Package: "p", Test: "TestC"},
				{Action: "output", Package: "p", Test: "TestC", Output: "    c_test.go:3: no VM\n"},
				{Action: "skip", Package: "p", Test: "TestC"},
				{Action: "fail", Package: "p"},
			},
			counts: [3]int{1, 1, 1},
			want:   []string{"p TestA", "    | a_test.go:9: got 2, want 1"},
		},
		{
			name: "a test that never finished",
			events: []event{
				{Action: "start", Package: "p"},
				{Action: "run", Package: "p", Test: "TestHang"},
				{Action: "output", Package: "p", Test: "TestHang", Output: "    h_test.go:5: waiting\n"},
				{Action: "output", Package: "p", Output: "panic: test timed out after 20m0s\n"},
				{Action: "fail", Package: "p"},
			},
			counts: [3]int{0, 1, 0},
			want:   []string{"p TestHang (did not finish)", "    | h_test.go:5: waiting"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newResult()
			for _, e := range tc.events {
				r.handle(e)
			}
			r.finish()
			if got := [3]int{r.passed, r.failed, r.skipped}; got != tc.counts {
				t.Errorf("passed, failed, skipped = %v, want %v", got, tc.counts)
			}
			if diff := cmp.Diff(tc.want, r.failureLines(true)); diff != "" {
				t.Errorf("failureLines(true) (-want +got):\n%s", diff)
			}
			if got := r.failureLines(false); len(got) != 1 || got[0] != tc.want[0] {
				t.Errorf("failureLines(false) = %q, want [%q]", got, tc.want[0])
			}
		})
	}
}

// TestFailureLinesBounded: a test that printed much keeps its last
// tailLines lines, each at most maxLineLen bytes (plus a marker), and only
// the first maxDetailed failures are detailed.
func TestFailureLinesBounded(t *testing.T) {
	r := newResult()
	for i := range maxDetailed + 3 {
		name := fmt.Sprintf("Test%02d", i)
		r.handle(event{Action: "run", Package: "p", Test: name})
		for j := range 50 {
			r.handle(event{Action: "output", Package: "p", Test: name, Output: fmt.Sprintf("line %d %s\n", j, strings.Repeat("x", 1000))})
		}
		r.handle(event{Action: "fail", Package: "p", Test: name})
	}
	lines := r.failureLines(true)
	if want := maxDetailed + 3 + maxDetailed*tailLines; len(lines) != want {
		t.Fatalf("%d lines, want %d", len(lines), want)
	}
	if want := "    | line 38 x"; !strings.HasPrefix(lines[1], want) {
		t.Errorf("first detail %.20q, want the 38th line (the last %d of 50)", lines[1], tailLines)
	}
	for _, l := range lines {
		if len(l) > len("    | ")+maxLineLen+len(" [...]") {
			t.Fatalf("a line of %d bytes", len(l))
		}
	}
}
