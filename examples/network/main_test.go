package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/internal/launchertest"
)

// childEnv marks a re-executed test binary that runs one rank.
const childEnv = "GOVERBS_NETWORK_EXAMPLE_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, nil))
	}
	os.Exit(m.Run())
}

// world writes a loopback configuration of n ranks and returns its path
// and the listeners of the ranks' exchange addresses.
func world(t *testing.T, n int) (string, []*net.TCPListener) {
	t.Helper()
	cfg := cluster.Config{}
	lns := make([]*net.TCPListener, n)
	for i := range n {
		ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		lns[i] = ln
		cfg.Hosts = append(cfg.Hosts, cluster.Host{Hostname: "127.0.0.1", Port: ln.Addr().(*net.TCPAddr).Port, Device: "soft0", Rank: i})
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "net.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, lns
}

// checkOutput checks rank r's output in a world of n.
func checkOutput(t *testing.T, r, n int, out string) {
	t.Helper()
	prefix := fmt.Sprintf("rank %d/%d: ", r, n)
	for _, want := range []string{prefix + "connected", prefix + "10 barriers", prefix + "ok\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("rank %d: output lacks %q:\n%s", r, want, out)
		}
	}
	for i := range n {
		if i == r {
			continue
		}
		if want := fmt.Sprintf("%#016x from rank %d", word(i, r), i); !strings.Contains(out, want) {
			t.Errorf("rank %d: output lacks %q:\n%s", r, want, out)
		}
	}
}

// TestRanksInProcess runs the program's ranks as goroutines of this
// process (each with its own device context), over loopback TCP.
func TestRanksInProcess(t *testing.T) {
	for _, mode := range []string{"all-to-all", "rendezvous"} {
		for _, n := range []int{1, 2, 3, 4} {
			t.Run(fmt.Sprintf("%s/%d", mode, n), func(t *testing.T) {
				path, lns := world(t, n)
				outs := make([]bytes.Buffer, n)
				errs := make([]bytes.Buffer, n)
				codes := make([]int, n)
				var wg sync.WaitGroup
				for r := range n {
					wg.Add(1)
					go func() {
						defer wg.Done()
						codes[r] = run(context.Background(), []string{"-config", path, "-rank", strconv.Itoa(r), "-mode", mode,
							"-token", "s3cret"}, &outs[r], &errs[r], lns[r])
					}()
				}
				wg.Wait()
				for r := range n {
					if codes[r] != exitOK {
						t.Errorf("rank %d: exit %d: %s", r, codes[r], errs[r].String())
						continue
					}
					checkOutput(t, r, n, outs[r].String())
				}
				t.Logf("rank 0 printed:\n%s", outs[0].String())
			})
		}
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"-config", "x.json"},
		{"-rank", "0"},
		{"-config", "x", "-rank", "0", "-mode", "ring"},
		{"-config", "x", "-rank", "0", "-algorithm", "tournament"},
		{"-config", "x", "-rank", "0", "extra"},
		{"-launcher", "-rank", "0"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), args, &out, &errb, nil); code != exitUsage {
			t.Errorf("%q: exit %d, want %d (%s)", args, code, exitUsage, errb.String())
		}
	}
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"-config", filepath.Join(t.TempDir(), "missing.json"), "-rank", "0"}, &out, &errb, nil); code != exitFail {
		t.Errorf("missing config: exit %d, want %d", code, exitFail)
	}
}

// TestLauncherErrors: in launcher mode, an error names the rank the
// launcher gave (not the -rank flag's default, -1), or says that the
// launcher's environment is wrong.
func TestLauncherErrors(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String() // nobody listens there once closed
	ln.Close()
	for _, tc := range []struct {
		name string
		env  map[string]string
		want string
	}{
		{"bad rank", map[string]string{"GOVERBS_RANK": "one", "GOVERBS_WORLD_SIZE": "2"}, "network: launcher: "},
		{"rank 0 unreachable", map[string]string{"GOVERBS_RANK": "1", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": closed},
			"network: rank 1: join: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var out, errb bytes.Buffer
			if code := run(context.Background(), []string{"-launcher", "-timeout", "1s"}, &out, &errb, nil); code != exitFail {
				t.Errorf("exit %d, want %d", code, exitFail)
			}
			if !strings.Contains(errb.String(), tc.want) || strings.Contains(errb.String(), "rank -1") {
				t.Errorf("stderr %q, want %q and no rank -1", errb.String(), tc.want)
			}
			t.Log(strings.TrimSpace(errb.String()))
		})
	}
}

// TestRanksAsProcesses runs every rank in its own OS process (this test
// binary, re-executed), each inheriting its listening socket. soft0 needs
// its cross-process transport for this: where the device reports that it
// cannot reach the other processes, the test is skipped with that error.
func TestRanksAsProcesses(t *testing.T) {
	for _, mode := range []string{"all-to-all", "rendezvous"} {
		for _, n := range []int{1, 2, 3, 4, 7, 8} {
			t.Run(fmt.Sprintf("%s/%d", mode, n), func(t *testing.T) {
				runProcesses(t, mode, n)
			})
		}
	}
}

func runProcesses(t *testing.T, mode string, n int) {
	path, lns := world(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	type result struct {
		rank     int
		code     int
		out, err string
	}
	results := make(chan result, n)
	cmds := make([]*exec.Cmd, n)
	for r := range n {
		f, err := lns[r].File()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.CommandContext(ctx, os.Args[0], "-config", path, "-rank", strconv.Itoa(r), "-mode", mode,
			"-token", "s3cret", "-listen-fd", "3", "-timeout", "90s")
		cmd.Env = append(os.Environ(), childEnv+"=1", launchertest.RaceQuiet())
		cmd.ExtraFiles = []*os.File{f}
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		cmds[r] = cmd
		go func() {
			err := cmd.Wait()
			code := 0
			if err != nil {
				code = -1
				if ee, ok := err.(*exec.ExitError); ok {
					code = ee.ExitCode()
				}
			}
			results <- result{r, code, out.String(), errb.String()}
		}()
	}
	got := make([]result, n)
	for range n {
		res := <-results
		got[res.rank] = res
	}
	for _, res := range got {
		if res.code != exitOK {
			t.Errorf("rank %d: exit %d: %s", res.rank, res.code, res.err)
			continue
		}
		checkOutput(t, res.rank, n, res.out)
	}
}

// TestRealLaunchers starts the program's ranks through real launchers
// (see launchertest): Open MPI's mpirun and MPICH's Hydra. Each rank finds
// its place with cluster.FromEnv (-launcher) and meets rank 0 at
// GOVERBS_ROOT.
func TestRealLaunchers(t *testing.T) {
	for _, l := range launchertest.MPI {
		t.Run(l.Name, func(t *testing.T) {
			const n = 4
			out := launchertest.Run(t, l, n, 2*time.Minute, append(os.Environ(), childEnv+"=1"), "-launcher", "-timeout", "90s")
			for r := range n {
				checkOutput(t, r, n, string(out))
				if want := fmt.Sprintf("rank %d/%d: launched by %s (local rank %d,", r, n, l.Kind, r); !strings.Contains(string(out), want) {
					t.Errorf("output lacks %q", want)
				}
			}
			if !strings.Contains(string(out), "rendezvous exchange") {
				t.Errorf("the ranks did not use the rendezvous:\n%s", out)
			}
		})
	}
}
