package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMain makes the test binary a rank of goverbs coll when goverbs coll
// (run by a test) starts it as one: the ranks are this binary, with the
// command line "coll ...".
func TestMain(m *testing.M) {
	if os.Getenv(envCollChild) != "" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// collSizes are the sizes of "-min 8 -max 64KiB" by powers of two.
func collSizes() []int {
	var s []int
	for n := 8; n <= 64<<10; n *= 2 {
		s = append(s, n)
	}
	return s
}

// TestColl runs goverbs coll with two ranks (OS processes) on soft0
// shared memory and checks the shape of its output and that every
// measured value is positive.
func TestColl(t *testing.T) {
	t.Setenv("GOVERBS_SOFT_TRANSPORT", "shm")
	base := []string{"coll", "-p", "2", "-max", "64KiB", "-iters", "3", "-warmup", "1", "-settle", "20ms", "-lat-iters", "50", "-timeout", "2m"}
	for _, tc := range []struct {
		name  string
		args  []string
		check func(t *testing.T, out string)
		procs string // GOMAXPROCS of the run
	}{
		{name: "table", check: checkCollTable},
		{name: "json", args: []string{"-json"}, check: func(t *testing.T, out string) {
			checkCollJSON(t, out)
			if res := decodeColl(t, out); res.SettleMS != 20 {
				t.Errorf("settle_ms %v, want 20 (-settle 20ms)", res.SettleMS)
			}
		}},
		// The ranks share out the processors (rankProcs), unless
		// GOMAXPROCS says otherwise.
		{name: "shared processors", args: []string{"-ops", "barrier", "-json"}, check: func(t *testing.T, out string) {
			if res := decodeColl(t, out); res.Procs != rankProcs(2) {
				t.Errorf("GOMAXPROCS of rank 0 is %d, want %d (%d processors, 2 ranks)", res.Procs, rankProcs(2), runtime.NumCPU())
			}
		}},
		{name: "GOMAXPROCS set", args: []string{"-ops", "barrier", "-json"}, procs: "3", check: func(t *testing.T, out string) {
			if res := decodeColl(t, out); res.Procs != 3 {
				t.Errorf("GOMAXPROCS of rank 0 is %d, want 3 (set)", res.Procs)
			}
		}},
		{name: "ring int64 in place", args: []string{"-alg", "ring", "-type", "int64", "-inplace", "-ops", "allreduce", "-json"}, check: func(t *testing.T, out string) {
			res := decodeColl(t, out)
			if len(res.Rows) != len(collSizes()) {
				t.Fatalf("%d rows, want %d (allreduce only)", len(res.Rows), len(collSizes()))
			}
			for _, r := range res.Rows {
				// Below one int64 per rank the library falls back to
				// recursive doubling.
				want := "ring"
				if r.Count < 2 {
					want = "recursive doubling"
				}
				if r.Algorithm != want || r.Type != "int64" {
					t.Errorf("row %+v: want algorithm %q, type int64", r, want)
				}
			}
			if !res.InPlace {
				t.Errorf("in_place is false")
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GOMAXPROCS", tc.procs)
			out := mustRun(t, append(append([]string{}, base...), tc.args...)...)
			tc.check(t, out)
		})
	}
}

func checkCollTable(t *testing.T, out string) {
	var rows [][]string
	header, p2p, bw, goals := false, false, false, 0
	for _, l := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		switch {
		case strings.HasPrefix(l, "# ") && strings.Contains(l, "size(B)"):
			want := "size(B) count type redop collective algorithm time(us) algbw(GB/s) busbw(GB/s) mean(us)"
			if got := strings.Join(strings.Fields(l[1:]), " "); got != want {
				t.Errorf("header %q, want %q", got, want)
			}
			header = true
		case strings.Contains(l, "one-way latency"):
			f := strings.Fields(l)
			if v, err := strconv.ParseFloat(f[len(f)-2], 64); err != nil || v <= 0 {
				t.Errorf("latency line %q: want a positive number of us", l)
			}
			p2p = true
		case strings.Contains(l, "write bandwidth (GB/s): 64 KiB "):
			f := strings.Fields(l)
			if v, err := strconv.ParseFloat(f[len(f)-1], 64); err != nil || v <= 0 {
				t.Errorf("bandwidth line %q: want a positive peak", l)
			}
			bw = true
		case strings.Contains(l, "/ (ceil(log2 p) x one-way)"):
			goals++
		case !strings.HasPrefix(l, "#"):
			rows = append(rows, strings.Fields(l))
		}
	}
	if !header || !p2p || !bw {
		t.Errorf("header %v, latency %v, bandwidth %v line; output:\n%s", header, p2p, bw, out)
	}
	if goals != 2 {
		t.Errorf("%d latency goal lines, want 2 (allreduce, barrier):\n%s", goals, out)
	}
	sizes := collSizes()
	if len(rows) != len(sizes)+1 {
		t.Fatalf("%d rows, want %d allreduce sizes and the barrier:\n%s", len(rows), len(sizes), out)
	}
	for i, f := range rows {
		last := i == len(rows)-1
		if last {
			// 0 0 - - barrier butterfly time - - mean
			if len(f) != 10 || f[4] != "barrier" || f[7] != "-" || f[8] != "-" {
				t.Errorf("barrier row %q", f)
				continue
			}
			positive(t, f, 6, 9)
			continue
		}
		// size count float32 sum allreduce <algorithm: 1 or 2 words> time algbw busbw mean
		if len(f) < 10 || f[2] != "float32" || f[3] != "sum" || f[4] != "allreduce" {
			t.Errorf("allreduce row %q", f)
			continue
		}
		if f[0] != strconv.Itoa(sizes[i]) || f[1] != strconv.Itoa(sizes[i]/4) {
			t.Errorf("row %d: size %s count %s, want %d and %d", i, f[0], f[1], sizes[i], sizes[i]/4)
		}
		n := len(f)
		positive(t, f, n-4, n-3, n-2, n-1)
		algbw, _ := strconv.ParseFloat(f[n-3], 64)
		busbw, _ := strconv.ParseFloat(f[n-2], 64)
		if d := busbw - algbw; d > 0.0011 || d < -0.0011 { // p = 2: factor 2(p−1)/p = 1
			t.Errorf("row %q: busbw %v != algbw %v at p = 2", f, busbw, algbw)
		}
	}
}

// positive checks that the fields at idx are positive numbers (printed
// with 3 decimals, a tiny bandwidth may print as 0.000: accepted as
// non-negative).
func positive(t *testing.T, f []string, idx ...int) {
	t.Helper()
	for _, i := range idx {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil || v < 0 || v == 0 && !strings.HasPrefix(f[i], "0.0") {
			t.Errorf("row %q: field %d (%q) is not a positive number", f, i, f[i])
		}
	}
}

func decodeColl(t *testing.T, out string) collResult {
	t.Helper()
	var res collResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("output is not one JSON object: %v\n%s", err, out)
	}
	return res
}

func checkCollJSON(t *testing.T, out string) {
	res := decodeColl(t, out)
	if res.Ranks != 2 || res.Device != "soft0" || res.Transport != "shm" || res.Type != "float32" || res.Iters != 3 {
		t.Errorf("run description %+v", res)
	}
	if res.P2P == nil || res.P2P.OneWayUS <= 0 || len(res.P2P.BW) != 1 || res.P2P.BW[0].Size != 64<<10 ||
		res.P2P.BW[0].GBps <= 0 || res.P2P.PeakGBps != res.P2P.BW[0].GBps {
		t.Errorf("p2p %+v", res.P2P)
	}
	sizes := collSizes()
	if len(res.Rows) != len(sizes)+1 {
		t.Fatalf("%d rows, want %d", len(res.Rows), len(sizes)+1)
	}
	for i, r := range res.Rows {
		if i == len(sizes) {
			if r.Collective != "barrier" || r.TimeUS <= 0 || r.MeanUS <= 0 || r.AlgBW != 0 {
				t.Errorf("barrier row %+v", r)
			}
			continue
		}
		if r.Collective != "allreduce" || r.Size != sizes[i] || r.Count != sizes[i]/4 || r.TimeUS <= 0 || r.MeanUS <= 0 || r.AlgBW <= 0 ||
			r.BusBW != r.AlgBW || r.Algorithm == "" {
			t.Errorf("row %d: %+v", i, r)
		}
	}
	if len(res.Goals) != 2 {
		t.Errorf("goals %+v, want the allreduce and barrier latency goals", res.Goals)
	}
	for _, g := range res.Goals {
		if g.Value <= 0 || !g.AtMost || !g.Applies || g.Goal != goalLatency {
			t.Errorf("goal %+v", g)
		}
	}
}

// TestCollUsage: bad command lines exit with status 2 and say why,
// before starting anything.
func TestCollUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-p", "1"}, "-p must be between 2"},
		{[]string{"-step", "3"}, "-step must be 2 or 4"},
		{[]string{"-min", "1M", "-max", "1K"}, "is below -min"},
		{[]string{"-max", "2G"}, "exceeds"},
		{[]string{"-ops", "allreduce,nope"}, `unknown collective "nope"`},
		{[]string{"-alg", "tree"}, `unknown algorithm "tree"`},
		{[]string{"-type", "uint8"}, `-type "uint8"`},
		{[]string{"-iters", "0"}, "-iters must be at least 1"},
		{[]string{"-settle", "-1s"}, "-settle must not be negative"},
		{[]string{"-launch", "mpi"}, `-launch "mpi"`},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			st, _, errs := runCmd(t, append([]string{"coll"}, tc.args...)...)
			if st != exitUsage || !strings.Contains(errs, tc.want) {
				t.Errorf("status %d, stderr %q; want %d and %q", st, errs, exitUsage, tc.want)
			}
		})
	}
}

// TestCollGoals: the latency goal is issue 15's 1.5 × ⌈log2 p⌉ × one-way,
// and issue 14's 10 × when the spawned ranks outnumber the processors
// (not for ranks a launcher started, which may be on other hosts).
func TestCollGoals(t *testing.T) {
	cpus := runtime.NumCPU()
	for _, tc := range []struct {
		p      int
		launch string
		goal   float64
		note   string
	}{
		{p: max(cpus, 2), launch: "spawned", goal: goalLatency},
		{p: cpus + 1, launch: "spawned", goal: goalOversub, note: "ranks outnumber the processors"},
		{p: cpus + 1, launch: "launcher", goal: goalLatency},
	} {
		if tc.p > cpus && tc.launch == "spawned" {
			tc.goal, tc.note = goalOversub, "ranks outnumber the processors"
		}
		res := collResult{Launch: tc.launch, P2P: &P2PResult{OneWayUS: 1},
			Rows: []collRow{{Collective: "barrier", TimeUS: 5 * float64(ceilLog2(tc.p))}}}
		g := collGoals(collConfig{p: tc.p}, res)
		if len(g) != 1 || g[0].Goal != tc.goal || g[0].Note != tc.note || g[0].Value != 5 || g[0].Met != (5 <= tc.goal) {
			t.Errorf("p=%d %s: goals %+v, want one of %v (%q), value 5", tc.p, tc.launch, g, tc.goal, tc.note)
		}
	}
}

// TestCollBlockSizes: the rows of allgather, reducescatter and alltoall,
// whose vector is p blocks of equal size, give the size they move: a
// multiple of p elements, the asked size rounded down, and a size below
// p elements makes no row (as nccl-tests). Before, with 3 ranks the rows
// of 4, 8 and 16 bytes each timed a vector of 12 (the block clamped to
// one element) and reported the size asked for.
func TestCollBlockSizes(t *testing.T) {
	t.Setenv("GOVERBS_SOFT_TRANSPORT", "shm")
	st, out, errs := runCmd(t, "coll", "-p", "3", "-ops", "allgather,reducescatter,alltoall", "-min", "4", "-max", "64", "-iters", "2", "-warmup", "0",
		"-settle", "0s", "-lat-iters", "10", "-timeout", "2m", "-json")
	if st != exitOK {
		t.Fatalf("status %d\n%s\n%s", st, out, errs)
	}
	res := decodeColl(t, out)
	rows := map[string][]int{}
	for _, r := range res.Rows {
		rows[r.Collective] = append(rows[r.Collective], r.Size)
		if r.Size%(3*4) != 0 || r.Count*4 != r.Size {
			t.Errorf("%s row of %d bytes, count %d: not 3 blocks of float32", r.Collective, r.Size, r.Count)
		}
	}
	// Sizes 4, 8, 16, 32, 64 bytes: 1, 2, 4, 8, 16 elements, rounded down
	// to 0, 0, 3, 6, 15.
	want := []int{12, 24, 60}
	for _, name := range []string{"allgather", "reducescatter", "alltoall"} {
		if !slices.Equal(rows[name], want) {
			t.Errorf("%s rows of %v bytes, want %v", name, rows[name], want)
		}
	}
}

// TestCollEmptyTableRefused: a command line whose every size is skipped
// (below one element, or below one element per rank for the block
// collectives) is a usage error. It ran the ranks and printed a table
// without a row, exit status 0: the check compared -max, not the sizes
// the steps produce, and ignored the blocks' rounding. (Found by a review
// of the command.)
func TestCollEmptyTableRefused(t *testing.T) {
	t.Setenv("GOVERBS_SOFT_TRANSPORT", "shm")
	base := []string{"coll", "-p", "2", "-iters", "1", "-warmup", "0", "-settle", "0s", "-lat-iters", "1", "-timeout", "2m", "-json"}
	for _, tc := range [][]string{
		// sizes: 3 only (3 > 5/2), below one float32; -max 5 >= 4 passes the check
		{"-min", "3", "-max", "5", "-ops", "allreduce"},
		// one float32: below one element per rank at p = 2
		{"-min", "4", "-max", "4", "-ops", "allgather"},
	} {
		t.Run(strings.Join(tc, " "), func(t *testing.T) {
			if st, out, errs := runCmd(t, append(append([]string{}, base...), tc...)...); st != exitUsage {
				t.Fatalf("status %d, want a usage error (%d): every size is skipped\n%s\n%s", st, exitUsage, out, errs)
			}
		})
	}
}

// TestCollRanksDisagree: ranks started by a launcher with different flags
// (here -lat-iters) fail at once, naming the flag. They waited for one
// another in the point-to-point test until -timeout (10 minutes by
// default) and then said only "context deadline exceeded". (Found by a
// review of the command.)
func TestCollRanksDisagree(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	var secret [8]byte
	rand.Read(secret[:])
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second) // a hang guard, below -timeout
	defer cancel()
	type result struct {
		err    error
		stderr string
	}
	results := make(chan result, 2)
	for rank, latIters := range []string{"10", "20"} {
		cmd := exec.CommandContext(ctx, exe, "coll", "-p", "2", "-lat-iters", latIters, "-iters", "1", "-warmup", "0",
			"-settle", "0s", "-min", "8", "-max", "8", "-ops", "allreduce", "-timeout", "2m")
		cmd.Env = append(os.Environ(), envCollChild+"=1", "GOVERBS_RANK="+strconv.Itoa(rank), "GOVERBS_WORLD_SIZE=2",
			"GOVERBS_ROOT=127.0.0.1:"+port, "GOVERBS_TOKEN="+hex.EncodeToString(secret[:]), "GOVERBS_JOB=disagree",
			"GOVERBS_SOFT_TRANSPORT=shm")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() {
			err := cmd.Wait()
			results <- result{err, stderr.String()}
		}()
	}
	for range 2 {
		r := <-results
		if ctx.Err() != nil {
			t.Fatalf("the ranks still ran after %v (a hang guard)", 50*time.Second)
		}
		t.Logf("rank: %v: %s", r.err, r.stderr)
		if r.err == nil || !strings.Contains(r.stderr, "-lat-iters") {
			t.Errorf("a rank: %v, stderr %q; want a failure naming -lat-iters", r.err, r.stderr)
		}
	}
}

// TestCollAlgColumn: the algorithm column names what each collective ran.
// It said the -alg asked for where the collective does not run it:
// Alltoall ignores Options.Algorithm, Allgather has no Rabenseifner (p =
// 2: recursive doubling), and a Broadcast of fewer elements than ranks
// falls back to the binomial tree ("recursive doubling"). (Found by a
// review of the command.)
func TestCollAlgColumn(t *testing.T) {
	t.Setenv("GOVERBS_SOFT_TRANSPORT", "shm")
	st, out, errs := runCmd(t, "coll", "-p", "2", "-alg", "rabenseifner", "-ops", "broadcast,allgather,alltoall", "-min", "4", "-max", "64",
		"-iters", "1", "-warmup", "0", "-settle", "0s", "-lat-iters", "1", "-timeout", "2m", "-json")
	if st != exitOK {
		t.Fatalf("status %d\n%s\n%s", st, out, errs)
	}
	res := decodeColl(t, out)
	if len(res.Rows) == 0 {
		t.Fatalf("no rows:\n%s", out)
	}
	for _, r := range res.Rows {
		want := "rabenseifner"
		switch {
		case r.Collective == "alltoall":
			want = "all at once"
		case r.Collective == "allgather", r.Collective == "broadcast" && r.Count < res.Ranks:
			want = "recursive doubling"
		}
		if r.Algorithm != want {
			t.Errorf("%s row of %d bytes (%d elements, %d ranks): algorithm %q, want %q", r.Collective, r.Size, r.Count, res.Ranks, r.Algorithm, want)
		}
	}
}
