package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/internal/launchertest"
)

// childEnv marks a re-executed test binary that runs the program (a
// rank, or the launcher of -np).
const childEnv = "GOVERBS_ALLREDUCE_EXAMPLE_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

var rankLine = regexp.MustCompile(`(?m)^rank (\d+)/(\d+): ok: (\d+) steps, parameters (0x[0-9a-f]{16})$`)

// checkOutput checks the output of a job of n ranks: every rank's line,
// all with the same parameters, and rank 0's summary naming launcher.
func checkOutput(t *testing.T, out string, n, steps int, launcher string) {
	t.Helper()
	hashes := map[int]string{}
	for _, m := range rankLine.FindAllStringSubmatch(out, -1) {
		r, _ := strconv.Atoi(m[1])
		if m[2] != strconv.Itoa(n) || m[3] != strconv.Itoa(steps) {
			t.Errorf("rank %d printed %q, want a world of %d and %d steps", r, m[0], n, steps)
		}
		hashes[r] = m[4]
	}
	if len(hashes) != n {
		t.Errorf("%d ranks reported success, want %d:\n%s", len(hashes), n, out)
		return
	}
	for r := range n {
		if hashes[r] != hashes[0] {
			t.Errorf("rank %d's parameters hash to %s, rank 0's to %s", r, hashes[r], hashes[0])
		}
	}
	for _, want := range []string{
		fmt.Sprintf("allreduce: %d ranks (launcher %s, device soft0)", n, launcher),
		"allreduce: all ranks agree: parameters " + hashes[0] + "\n",
		"allreduce: per step ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestLocalRun runs the program with -np: it starts the ranks itself, as
// processes (this test binary, re-executed).
func TestLocalRun(t *testing.T) {
	t.Setenv(childEnv, "1")
	t.Setenv("GORACE", strings.TrimPrefix(launchertest.RaceQuiet(), "GORACE="))
	for _, tc := range []struct {
		np  int
		alg string
		n   int
	}{
		{1, "auto", 1000},
		{2, "ring", 30011},
		{3, "auto", 5000},
		{4, "rabenseifner", 4099},
		{5, "recursive-doubling", 17},
	} {
		t.Run(fmt.Sprintf("np=%d/%s/n=%d", tc.np, tc.alg, tc.n), func(t *testing.T) {
			var out, errb bytes.Buffer
			const steps = 3
			code := run(context.Background(), []string{"-np", strconv.Itoa(tc.np), "-algorithm", tc.alg, "-n", strconv.Itoa(tc.n),
				"-steps", strconv.Itoa(steps), "-timeout", "3m"}, &out, &errb)
			if code != exitOK {
				t.Fatalf("exit %d:\n%s\n%s", code, out.String(), errb.String())
			}
			checkOutput(t, out.String(), tc.np, steps, cluster.LauncherGoverbs)
			t.Logf("output:\n%s", out.String())
		})
	}
}

// TestLaunchPassesFlagValues: -np N passes the ranks the flags it was
// given, as parsed, without -np. Before, it dropped every argument
// reading "np" after its dashes, flag values included, and the argument
// after it: with "-job np" the ranks lost the job id and the flag after
// it (-steps 2 became the job id "2", and the ranks ran 10 steps).
func TestLaunchPassesFlagValues(t *testing.T) {
	t.Setenv(childEnv, "1")
	t.Setenv("GORACE", strings.TrimPrefix(launchertest.RaceQuiet(), "GORACE="))
	for _, tc := range []struct {
		args  []string
		steps int
	}{
		{[]string{"-np", "2", "-job", "np", "-steps", "2"}, 2},
		{[]string{"-job", "np", "--np=2", "-steps", "3"}, 3},
		{[]string{"-job", "-np", "-steps", "2", "-np", "2"}, 2},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), append(tc.args, "-n", "100", "-timeout", "90s"), &out, &errb)
			if code != exitOK {
				t.Fatalf("exit %d:\n%s\n%s", code, out.String(), errb.String())
			}
			checkOutput(t, out.String(), 2, tc.steps, cluster.LauncherGoverbs)
		})
	}
}

// TestUsage: bad flags are refused with the usage status.
func TestUsage(t *testing.T) {
	for _, args := range [][]string{
		{"extra"},
		{"-algorithm", "tree"},
		{"-np", "-1"},
		{"-steps", "0"},
		{"-n", "-5"},
		{"-np", "2", "-listen-fd", "3"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), args, &out, &errb); code != exitUsage {
			t.Errorf("%q: exit %d, want %d (%s)", args, code, exitUsage, errb.String())
		}
	}
}

// TestNoLauncher: without -np and outside a launcher, a rank says so.
func TestNoLauncher(t *testing.T) {
	for _, k := range []string{"GOVERBS_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX"} {
		if _, ok := os.LookupEnv(k); ok {
			t.Skipf("running under a launcher (%s is set)", k)
		}
	}
	var out, errb bytes.Buffer
	if code := run(context.Background(), nil, &out, &errb); code != exitFail {
		t.Errorf("exit %d, want %d", code, exitFail)
	}
	if !strings.Contains(errb.String(), "no launcher detected") || !strings.Contains(errb.String(), "-np") {
		t.Errorf("stderr %q, want the launcher error and a hint at -np", errb.String())
	}
}

// TestTorchrunEnv starts the ranks with the environment torchrun gives
// its workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RUN_ID): every rank finds its place with cluster.FromEnv
// and meets rank 0 at MASTER_ADDR:MASTER_PORT (rank 0 inherits the
// listener, so that no port is guessed).
func TestTorchrunEnv(t *testing.T) {
	const n, steps = 4, 3
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	f, err := ln.(*net.TCPListener).File()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var mu sync.Mutex
	var out bytes.Buffer
	var wg sync.WaitGroup
	errs := make([]error, n)
	for r := range n {
		args := []string{"-n", "10007", "-steps", strconv.Itoa(steps), "-timeout", "150s"}
		if r == 0 {
			args = append(args, "-listen-fd", "3")
		}
		cmd := exec.CommandContext(ctx, os.Args[0], args...)
		cmd.Env = append(launcherFreeEnv(), childEnv+"=1", launchertest.RaceQuiet(), "RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(n),
			"LOCAL_RANK="+strconv.Itoa(r), "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port),
			"TORCHELASTIC_RUN_ID="+t.Name(), "GOVERBS_TOKEN=torchrun-secret")
		if r == 0 {
			cmd.ExtraFiles = []*os.File{f}
		}
		var b bytes.Buffer
		cmd.Stdout, cmd.Stderr = &b, &b
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = cmd.Wait()
			mu.Lock()
			out.Write(b.Bytes())
			mu.Unlock()
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	checkOutput(t, out.String(), n, steps, cluster.LauncherTorchrun)
	t.Logf("output:\n%s", out.String())
}

// TestRealLaunchers starts the ranks through real launchers (see
// launchertest): Open MPI's mpirun and MPICH's Hydra. Each rank finds its
// place with cluster.FromEnv and meets rank 0 at GOVERBS_ROOT.
func TestRealLaunchers(t *testing.T) {
	for _, l := range launchertest.MPI {
		t.Run(l.Name, func(t *testing.T) {
			const n, steps = 4, 3
			out := launchertest.Run(t, l, n, 3*time.Minute, append(launcherFreeEnv(), childEnv+"=1"),
				"-n", "10007", "-steps", strconv.Itoa(steps), "-timeout", "150s")
			checkOutput(t, string(out), n, steps, l.Kind)
		})
	}
}
