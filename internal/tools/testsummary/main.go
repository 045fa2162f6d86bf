// Command testsummary reads the output of `go test -json` on standard input,
// echoes the human-readable test output to standard output as it arrives,
// and finishes with a summary of one test tier:
//
//	tier unit: 41 passed, 0 failed, 2 skipped
//	  skipped: github.com/goverbs/verbs/internal/ibv TestOpenDevice: ibv_test.go:20: no RDMA device
//
// It is used by scripts/test.sh; it is not part of the library.
//
// Counting rules:
//
//   - Only events that name a test (a non-empty Test field) are counted;
//     package-level pass/fail/skip events are not.
//   - Subtests count as tests in their own right: a TestA with subtests
//     TestA/x and TestA/y counts as three tests. A parent whose subtest fails
//     fails too, so one failing subtest counts as two failures.
//   - A test that started but never reported a result (a panic in another
//     test, a timeout, os.Exit, a killed test binary) counts as failed.
//   - The skip reason of a skipped test is the last line it printed before
//     its "--- SKIP" line (normally the t.Skip message, with file:line).
//
// The exit status is 1 if any test failed, any package failed (for example
// a build failure, a setup failure or a failure in TestMain outside any
// test), and 0 otherwise. A failure to read the input exits with 2.
//
// Input lines that are not JSON (for example go's own messages on stderr,
// when the caller merges it into stdin) are echoed unchanged.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of `go test -json` (see `go doc test2json`).
type event struct {
	Action      string
	Package     string
	Test        string
	Output      string
	ImportPath  string // build-output and build-fail events
	FailedBuild string // set on a package's fail event if its build failed
}

// testKey identifies one test (or subtest) in one package.
type testKey struct{ pkg, test string }

// result records what a tier run produced.
type result struct {
	passed, failed, skipped int

	running map[testKey]bool     // started, no result yet
	tail    map[testKey][]string // last tailLines meaningful output lines of each running or failed test
	order   []testKey            // order in which tests started

	skips    []skipped    // skipped tests and their reasons
	failures []testKey    // failed tests
	pkgFails []pkgFailure // failed packages or builds

	unfinished    map[testKey]bool // failed tests that never reported a result
	pkgStarted    map[string]bool  // packages that started but did not finish
	pkgTestFailed map[string]bool  // packages with at least one failed test
	buildFails    []string         // import paths from build-fail events
	failedBuilds  map[string]bool  // FailedBuild values of failed packages
}

type skipped struct {
	key    testKey
	reason string
}

type pkgFailure struct {
	pkg, reason string
}

func newResult() *result {
	return &result{
		running:       map[testKey]bool{},
		tail:          map[testKey][]string{},
		unfinished:    map[testKey]bool{},
		failedBuilds:  map[string]bool{},
		pkgStarted:    map[string]bool{},
		pkgTestFailed: map[string]bool{},
	}
}

// framingPrefixes are lines the testing package prints around each test;
// they are never a skip reason.
var framingPrefixes = []string{
	"=== RUN", "=== PAUSE", "=== CONT", "=== NAME",
	"--- PASS", "--- FAIL", "--- SKIP",
}

func isFraming(line string) bool {
	for _, p := range framingPrefixes {
		if strings.HasPrefix(line, p) {
			return true
		}
	}
	return false
}

// handle processes one event.
func (r *result) handle(e event) {
	k := testKey{e.Package, e.Test}
	switch e.Action {
	case "start":
		r.pkgStarted[e.Package] = true
	case "run":
		if e.Test != "" {
			if !r.running[k] {
				r.order = append(r.order, k)
			}
			r.running[k] = true
		}
	case "output":
		if e.Test != "" {
			for _, l := range strings.Split(e.Output, "\n") {
				l = strings.TrimSpace(l)
				if l != "" && !isFraming(l) {
					t := r.tail[k]
					if len(t) == tailLines {
						t = append(t[:0], t[1:]...)
					}
					r.tail[k] = append(t, l)
				}
			}
		}
	case "pass":
		if e.Test != "" {
			delete(r.running, k)
			delete(r.tail, k)
			r.passed++
		} else {
			r.packageDone(e.Package)
		}
	case "skip":
		if e.Test != "" {
			delete(r.running, k)
			r.skipped++
			reason := "(no reason given)"
			if t := r.tail[k]; len(t) > 0 {
				reason = t[len(t)-1]
			}
			r.skips = append(r.skips, skipped{k, reason})
			delete(r.tail, k)
		} else {
			// A package without tests ("no test files") or whose
			// tests were all filtered out: not counted.
			r.packageDone(e.Package)
		}
	case "fail":
		if e.Test != "" {
			delete(r.running, k)
			r.failTest(k)
			break
		}
		// The package failed. Say why, unless a failed test already does.
		r.packageDone(e.Package)
		switch {
		case e.FailedBuild != "":
			r.failedBuilds[e.FailedBuild] = true
			r.pkgFails = append(r.pkgFails, pkgFailure{e.Package, "build failed (" + e.FailedBuild + ")"})
		case !r.pkgTestFailed[e.Package]:
			r.pkgFails = append(r.pkgFails, pkgFailure{e.Package,
				"package failed outside any test (setup, TestMain, panic, timeout or exit; see output above)"})
		}
	case "build-fail":
		// Normally followed by a package fail event naming the same
		// build in FailedBuild; finish reports those that are not.
		r.buildFails = append(r.buildFails, e.ImportPath)
	}
}

func (r *result) failTest(k testKey) {
	r.failed++
	r.failures = append(r.failures, k)
	r.pkgTestFailed[k.pkg] = true
}

// packageDone marks a package finished: its tests that never reported a
// result count as failed.
func (r *result) packageDone(pkg string) {
	delete(r.pkgStarted, pkg)
	for _, k := range r.order {
		if k.pkg == pkg && r.running[k] {
			delete(r.running, k)
			r.failTest(k)
			r.unfinished[k] = true
		}
	}
}

// finish handles the end of the input: whatever is still running failed.
func (r *result) finish() {
	pkgs := make([]string, 0, len(r.pkgStarted))
	for p := range r.pkgStarted {
		pkgs = append(pkgs, p)
	}
	sort.Strings(pkgs)
	for _, p := range pkgs {
		r.packageDone(p)
		r.pkgFails = append(r.pkgFails, pkgFailure{p, "no result: the input ended before the package finished"})
	}
	for _, k := range r.order { // tests of packages that never sent "start"
		if r.running[k] {
			r.packageDone(k.pkg)
		}
	}
	for _, b := range r.buildFails {
		if !r.failedBuilds[b] {
			r.pkgFails = append(r.pkgFails, pkgFailure{b, "build failed"})
		}
	}
}

func (r *result) ok() bool { return r.failed == 0 && len(r.pkgFails) == 0 }

// report prints the tier summary.
func (r *result) report(w io.Writer, tier string) {
	fmt.Fprintf(w, "\n==== summary of tier %s\n", tier)
	sort.SliceStable(r.skips, func(i, j int) bool { return less(r.skips[i].key, r.skips[j].key) })
	for _, s := range r.skips {
		fmt.Fprintf(w, "  skipped: %s %s: %s\n", s.key.pkg, s.key.test, s.reason)
	}
	for _, l := range r.failureLines(false) {
		fmt.Fprintf(w, "  FAILED:  %s\n", l)
	}
	fmt.Fprintf(w, "tier %s: %d passed, %d failed, %d skipped\n", tier, r.passed, r.failed, r.skipped)
}

// Bounds of the failure details (see failureLines).
const (
	tailLines   = 12  // output lines kept per test
	maxLineLen  = 300 // bytes shown per line
	maxDetailed = 20  // failed tests whose lines are shown
)

func truncate(l string, n int) string {
	if len(l) <= n {
		return l
	}
	return l[:n] + " [...]"
}

// failureLines names every failed test and package, a line each, sorted;
// with details, the first maxDetailed failed tests' lines are followed by
// the last lines they printed, indented by "    | ".
func (r *result) failureLines(details bool) []string {
	sort.SliceStable(r.failures, func(i, j int) bool { return less(r.failures[i], r.failures[j]) })
	var lines []string
	detailed := 0
	for _, k := range r.failures {
		suffix := ""
		if r.unfinished[k] {
			suffix = " (did not finish)"
		}
		lines = append(lines, k.pkg+" "+k.test+suffix)
		if t := r.tail[k]; details && len(t) > 0 {
			if detailed == maxDetailed {
				continue
			}
			detailed++
			for _, l := range t {
				lines = append(lines, "    | "+truncate(l, maxLineLen))
			}
		}
	}
	for _, p := range r.pkgFails {
		lines = append(lines, "package "+p.pkg+": "+p.reason)
	}
	return lines
}

func less(a, b testKey) bool {
	if a.pkg != b.pkg {
		return a.pkg < b.pkg
	}
	return a.test < b.test
}

func main() {
	tier := flag.String("tier", "unit", "name of the tier, for the summary")
	countsFile := flag.String("counts", "", "if set, append a line `TIER PASSED FAILED SKIPPED PKGFAILS` to this file")
	failedFile := flag.String("failed", "", "if set, append a line `TIER: PACKAGE TEST` per failed test or package to this file")
	flag.Parse()

	r := newResult()
	out := bufio.NewWriter(os.Stdout)
	in := bufio.NewReader(os.Stdin)
	for {
		line, err := in.ReadString('\n')
		if len(line) > 0 {
			var e event
			trimmed := strings.TrimSpace(line)
			if strings.HasPrefix(trimmed, "{") && json.Unmarshal([]byte(trimmed), &e) == nil && e.Action != "" {
				switch e.Action {
				case "output", "build-output":
					out.WriteString(e.Output)
				}
				r.handle(e)
			} else {
				out.WriteString(line) // not a test event: pass through
				if !strings.HasSuffix(line, "\n") {
					out.WriteString("\n")
				}
			}
			// Flush per line so that output of a long test shows up live.
			out.Flush()
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "testsummary: reading input: %v\n", err)
			os.Exit(2)
		}
	}

	r.finish()
	r.report(out, *tier)
	out.Flush()

	if *failedFile != "" {
		var b strings.Builder
		for _, l := range r.failureLines(true) {
			if strings.HasPrefix(l, "    | ") {
				b.WriteString("  " + l + "\n") // a detail: no tier prefix
				continue
			}
			b.WriteString(*tier + ": " + l + "\n")
		}
		if err := appendFile(*failedFile, b.String()); err != nil {
			fmt.Fprintf(os.Stderr, "testsummary: writing failures: %v\n", err)
			os.Exit(2)
		}
	}
	if *countsFile != "" {
		line := fmt.Sprintf("%s %d %d %d %d\n", *tier, r.passed, r.failed, r.skipped, len(r.pkgFails))
		if err := appendFile(*countsFile, line); err != nil {
			fmt.Fprintf(os.Stderr, "testsummary: writing counts: %v\n", err)
			os.Exit(2)
		}
	}
	if !r.ok() {
		os.Exit(1)
	}
}

// appendFile appends text to the file at path, creating it if needed.
func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, err = f.WriteString(text)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
