package cluster_test

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/verbstest"
)

func lookupIn(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := m[k]
		return v, ok
	}
}

func TestParseLaunch(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		opts cluster.EnvOptions
		want cluster.Launch
	}{
		{
			name: "slurm",
			env: map[string]string{"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
				"SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"},
			want: cluster.Launch{Launcher: "slurm", Rank: 5, Size: 8, LocalRank: 1, Root: "node01:18515", Listen: ":18515",
				Job: "slurm-4242.0", Hosts: []string{"node01", "node02", "node03", "node04", "node07"}},
		},
		{
			name: "slurm step node list and port",
			env: map[string]string{"SLURM_PROCID": "0", "SLURM_NPROCS": "2", "SLURM_LOCALID": "0",
				"SLURM_JOB_NODELIST": "a[1-9]", "SLURM_STEP_NODELIST": "gpu[10-11]", "GOVERBS_PORT": "7000"},
			want: cluster.Launch{Launcher: "slurm", Rank: 0, Size: 2, LocalRank: 0, Root: "gpu10:7000", Listen: ":7000",
				Hosts: []string{"gpu10", "gpu11"}},
		},
		{
			name: "open mpi",
			env: map[string]string{"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
				"GOVERBS_ROOT": "10.1.2.3:9999", "OMPI_MCA_ess_base_jobid": "77"},
			want: cluster.Launch{Launcher: "openmpi", Rank: 3, Size: 4, LocalRank: 1, Root: "10.1.2.3:9999", Listen: "10.1.2.3:9999", Job: "77"},
		},
		{
			name: "open mpi inside slurm",
			env: map[string]string{"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0",
				"SLURM_NTASKS": "1", "GOVERBS_ROOT": "h:1"},
			want: cluster.Launch{Launcher: "openmpi", Rank: 1, Size: 2, LocalRank: -1, Root: "h:1", Listen: ":1"},
		},
		{
			name: "pmi",
			env:  map[string]string{"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "PMI_KVSNAME": "kvs_1", "GOVERBS_ROOT": "[::1]:5000"},
			want: cluster.Launch{Launcher: "pmi", Rank: 2, Size: 3, LocalRank: 0, Root: "[::1]:5000", Listen: "[::1]:5000", Job: "kvs_1"},
		},
		{
			name: "torchrun",
			env: map[string]string{"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
				"MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "run-9"},
			want: cluster.Launch{Launcher: "torchrun", Rank: 1, Size: 2, LocalRank: 1, Root: "127.0.0.1:29500", Listen: "127.0.0.1:29500", Job: "run-9"},
		},
		{
			name: "torchrun with GOVERBS_PORT and job override",
			env: map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "master", "MASTER_PORT": "29500",
				"GOVERBS_PORT": "29600", "GOVERBS_JOB": "mine"},
			want: cluster.Launch{Launcher: "torchrun", Rank: 0, Size: 2, LocalRank: -1, Root: "master:29600", Listen: ":29600", Job: "mine"},
		},
		{
			name: "kubernetes",
			env: map[string]string{"JOB_COMPLETION_INDEX": "3", "GOVERBS_WORLD_SIZE": "4",
				"GOVERBS_HOST_PATTERN": "train-{index}.train-svc", "GOVERBS_DEVICE": "soft0"},
			want: cluster.Launch{Launcher: "kubernetes", Rank: 3, Size: 4, LocalRank: -1, Root: "train-0.train-svc:18515",
				Listen: ":18515", Device: "soft0"},
		},
		{
			name: "kubernetes with options",
			env:  map[string]string{"JOB_COMPLETION_INDEX": "0"},
			opts: cluster.EnvOptions{Size: 2, HostPattern: "w-{index}.svc", Port: 4000},
			want: cluster.Launch{Launcher: "kubernetes", Rank: 0, Size: 2, LocalRank: -1, Root: "w-0.svc:4000", Listen: ":4000"},
		},
		{
			name: "goverbs",
			env:  map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "1"},
			want: cluster.Launch{Launcher: "goverbs", Rank: 0, Size: 1, LocalRank: 0},
		},
		{
			// A RANK and WORLD_SIZE left in the shell, without a
			// variable only torchrun sets, do not hide the launcher.
			name: "open mpi with a stale RANK",
			env: map[string]string{"RANK": "7", "WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
				"GOVERBS_ROOT": "h:1"},
			want: cluster.Launch{Launcher: "openmpi", Rank: 1, Size: 2, LocalRank: -1, Root: "h:1", Listen: ":1"},
		},
		{
			name: "slurm with a stale RANK",
			env:  map[string]string{"RANK": "7", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"},
			want: cluster.Launch{Launcher: "slurm", Rank: 1, Size: 2, LocalRank: -1, Root: "n1:18515", Listen: ":18515", Hosts: []string{"n1", "n2"}},
		},
		{
			// torchrun under Slurm (srun torchrun ...): torchrun's
			// global RANK, not the task's SLURM_PROCID.
			name: "torchrun inside slurm",
			env: map[string]string{"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
				"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"},
			want: cluster.Launch{Launcher: "torchrun", Rank: 5, Size: 8, LocalRank: -1, Root: "n1:29500", Listen: ":29500"},
		},
		{
			name: "forced launcher and listen override",
			env: map[string]string{"RANK": "9", "WORLD_SIZE": "10", "PMI_RANK": "1", "PMI_SIZE": "2",
				"GOVERBS_ROOT": "r:1", "GOVERBS_LISTEN": "127.0.0.1:1", "GOVERBS_JOB": "j"},
			opts: cluster.EnvOptions{Launcher: "pmi"},
			want: cluster.Launch{Launcher: "pmi", Rank: 1, Size: 2, LocalRank: -1, Root: "r:1", Listen: "127.0.0.1:1", Job: "j"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := tc.opts
			o.Lookup = lookupIn(tc.env)
			got, err := cluster.ParseLaunch(o)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseLaunchErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		want    error
		wantVar string
	}{
		{"nothing", map[string]string{"HOME": "/root"}, cluster.ErrNoLauncher, ""},
		{"blank", map[string]string{"SLURM_PROCID": " "}, cluster.ErrNoLauncher, ""},
		{"slurm no size", map[string]string{"SLURM_PROCID": "0"}, cluster.ErrEnvValue, "SLURM_NTASKS"},
		{"slurm bad rank", map[string]string{"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, cluster.ErrEnvValue, "SLURM_PROCID"},
		{"slurm negative rank", map[string]string{"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}, cluster.ErrEnvValue, "SLURM_PROCID"},
		{"slurm rank too large", map[string]string{"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a"}, cluster.ErrEnvValue, ""},
		{"slurm size 0", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, cluster.ErrEnvValue, "SLURM_NTASKS"},
		{"slurm bad node list", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-"}, cluster.ErrEnvValue, "SLURM_JOB_NODELIST"},
		{"slurm no node list", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, cluster.ErrNoRoot, "GOVERBS_ROOT"},
		{"open mpi no root", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, cluster.ErrNoRoot, "GOVERBS_ROOT"},
		{"open mpi bad local rank", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "z", "GOVERBS_ROOT": "h:1"}, cluster.ErrEnvValue, "OMPI_COMM_WORLD_LOCAL_RANK"},
		{"pmi no size", map[string]string{"PMI_RANK": "0"}, cluster.ErrEnvValue, "PMI_SIZE"},
		{"hydra no job", map[string]string{"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "6", "MPI_LOCALRANKID": "0", "GOVERBS_ROOT": "h:1"}, cluster.ErrEnvValue, "GOVERBS_JOB"},
		{"torchrun no master", map[string]string{"RANK": "0", "WORLD_SIZE": "2"}, cluster.ErrEnvValue, "MASTER_ADDR"},
		{"torchrun no port", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m"}, cluster.ErrEnvValue, "MASTER_PORT"},
		{"torchrun bad port", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "70000"}, cluster.ErrEnvValue, "MASTER_PORT"},
		{"torchrun port 0", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "0"}, cluster.ErrEnvValue, "MASTER_PORT"},
		{"torchrun bad master", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a b", "MASTER_PORT": "1"}, cluster.ErrEnvValue, "MASTER_ADDR"},
		{"torchrun bad root", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1", "GOVERBS_ROOT": "a b:1"}, cluster.ErrEnvValue, "GOVERBS_ROOT"},
		{"slurm bad node", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "a..b"}, cluster.ErrEnvValue, "SLURM_STEP_NODELIST"},
		{"slurm bad root", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1", "GOVERBS_ROOT": "a b:1"}, cluster.ErrEnvValue, "GOVERBS_ROOT"},
		{"kubernetes bad pattern", map[string]string{"JOB_COMPLETION_INDEX": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_HOST_PATTERN": "a b-{index}"}, cluster.ErrEnvValue, "GOVERBS_HOST_PATTERN"},
		{"kubernetes no size", map[string]string{"JOB_COMPLETION_INDEX": "0", "GOVERBS_HOST_PATTERN": "a-{index}"}, cluster.ErrEnvValue, "GOVERBS_WORLD_SIZE"},
		{"kubernetes no pattern", map[string]string{"JOB_COMPLETION_INDEX": "0", "GOVERBS_WORLD_SIZE": "2"}, cluster.ErrEnvValue, "GOVERBS_HOST_PATTERN"},
		{"bad root", map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": "nocolon"}, cluster.ErrEnvValue, "GOVERBS_ROOT"},
		{"bad port", map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": "h:1", "GOVERBS_PORT": "99999"}, cluster.ErrEnvValue, "GOVERBS_PORT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := cluster.ParseLaunch(cluster.EnvOptions{Lookup: lookupIn(tc.env)})
			if !errors.Is(err, tc.want) {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			var ee *cluster.EnvError
			if !errors.As(err, &ee) {
				t.Fatalf("%T is not an *EnvError", err)
			}
			if ee.Var != tc.wantVar {
				t.Errorf("variable %q, want %q (%v)", ee.Var, tc.wantVar, err)
			}
			// The text says what is wrong where: the launcher, the
			// variable, the cause.
			msg := err.Error()
			if !strings.HasPrefix(msg, "cluster: env") || !strings.Contains(msg, tc.wantVar) || !strings.Contains(msg, ee.Launcher) || !strings.HasSuffix(msg, ee.Err.Error()) {
				t.Errorf("message %q (launcher %q, variable %q)", msg, ee.Launcher, tc.wantVar)
			}
		})
	}
	if _, err := cluster.ParseLaunch(cluster.EnvOptions{Lookup: lookupIn(nil), Launcher: "lsf"}); !errors.Is(err, cluster.ErrNoLauncher) {
		t.Errorf("unknown forced launcher: %v", err)
	}
}

func TestExpandNodeList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"node1", []string{"node1"}},
		{"node[01-04,07]", []string{"node01", "node02", "node03", "node04", "node07"}},
		{"a,b,c", []string{"a", "b", "c"}},
		{"n[8-10]", []string{"n8", "n9", "n10"}},
		{"n[098-101]", []string{"n098", "n099", "n100", "n101"}},
		{"gpu[1-2]-ib,login", []string{"gpu1-ib", "gpu2-ib", "login"}},
		{"rack[1-2]-n[1-2]", []string{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}},
		{"x[3],y[5-5]", []string{"x3", "y5"}},
		{"[1-2]", []string{"1", "2"}},
	} {
		got, err := cluster.ExpandNodeList(tc.in)
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if !cmp.Equal(got, tc.want) {
			t.Errorf("%q: %q, want %q", tc.in, got, tc.want)
		}
	}
	for _, bad := range []string{"", " ", "a,,b", "n[1-", "n[1-2", "n]1[", "n[2-1]", "n[a-b]", "n[1-2-3]", "n[]", "n[-1]", "n[1,]",
		"n[0-99999999]", "a[0-999]b[0-999]", "n[[1]]", "a b"} {
		if got, err := cluster.ExpandNodeList(bad); err == nil {
			t.Errorf("%q: %q, want an error", bad, got)
		}
	}
}

// FuzzExpandNodeList: no input panics or expands beyond the bound.
func FuzzExpandNodeList(f *testing.F) {
	for _, s := range []string{"node[01-04,07]", "a[1-2]b[3-4],c", "n[0-65535]", "x[1-"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		names, err := cluster.ExpandNodeList(s)
		if err != nil {
			return
		}
		if len(names) == 0 || len(names) > cluster.MaxNodeList {
			t.Fatalf("%q: %d names", s, len(names))
		}
		for _, n := range names {
			if n == "" || strings.ContainsAny(n, "[],") {
				t.Fatalf("%q: bad name %q", s, n)
			}
		}
	})
}

// TestFromEnv builds worlds of 1, 3 and 4 ranks from launcher
// environments (injected, one map per rank), over a loopback rendezvous,
// and synchronises them with a barrier.
func TestFromEnv(t *testing.T) {
	for _, tc := range []struct {
		launcher string
		n        int
		env      func(rank, n int, root string) map[string]string
	}{
		{"goverbs", 1, func(r, n int, root string) map[string]string {
			return map[string]string{"GOVERBS_RANK": fmt.Sprint(r), "GOVERBS_WORLD_SIZE": fmt.Sprint(n)}
		}},
		{"torchrun", 3, func(r, n int, root string) map[string]string {
			host, port, _ := net.SplitHostPort(root)
			return map[string]string{"RANK": fmt.Sprint(r), "WORLD_SIZE": fmt.Sprint(n), "LOCAL_RANK": fmt.Sprint(r),
				"MASTER_ADDR": host, "MASTER_PORT": port, "GOVERBS_TOKEN": "t0ken", "TORCHELASTIC_RUN_ID": "r1"}
		}},
		{"slurm", 4, func(r, n int, root string) map[string]string {
			_, port, _ := net.SplitHostPort(root)
			return map[string]string{"SLURM_PROCID": fmt.Sprint(r), "SLURM_NTASKS": fmt.Sprint(n), "SLURM_LOCALID": fmt.Sprint(r),
				"SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "99", "GOVERBS_PORT": port, "GOVERBS_LISTEN": root,
				"GOVERBS_DEVICE": "soft0"}
		}},
		{"openmpi", 3, func(r, n int, root string) map[string]string {
			return map[string]string{"OMPI_COMM_WORLD_RANK": fmt.Sprint(r), "OMPI_COMM_WORLD_SIZE": fmt.Sprint(n), "GOVERBS_ROOT": root}
		}},
		{"pmi", 2, func(r, n int, root string) map[string]string {
			return map[string]string{"PMI_RANK": fmt.Sprint(r), "PMI_SIZE": fmt.Sprint(n), "GOVERBS_ROOT": root, "GOVERBS_JOB": "j1"}
		}},
		{"kubernetes", 3, func(r, n int, root string) map[string]string {
			// The pattern names hosts that do not exist here: GOVERBS_ROOT
			// points at the loopback listener instead (TestParseLaunch
			// checks the pattern).
			return map[string]string{"JOB_COMPLETION_INDEX": fmt.Sprint(r), "GOVERBS_WORLD_SIZE": fmt.Sprint(n),
				"GOVERBS_HOST_PATTERN": "train-{index}.svc", "GOVERBS_ROOT": root}
		}},
	} {
		t.Run(tc.launcher, func(t *testing.T) {
			verbstest.CheckLeaks(t)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
			root := ln.Addr().String()
			ctx := testContext(t)
			nodes := make([]*cluster.Node, tc.n)
			errs := make([]error, tc.n)
			var wg sync.WaitGroup
			for r := range tc.n {
				opts := cluster.EnvOptions{Lookup: lookupIn(tc.env(r, tc.n, root))}
				if r == 0 {
					opts.Join.Listener = ln
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					nodes[r], errs[r] = cluster.FromEnv(ctx, opts)
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if err != nil {
					t.Fatalf("rank %d: %v", r, err)
				}
				t.Cleanup(func() {
					if err := nodes[r].Close(); err != nil {
						t.Errorf("rank %d: close: %v", r, err)
					}
				})
			}
			var arrived atomic.Int64
			wg = sync.WaitGroup{}
			for r, nd := range nodes {
				if nd.Rank() != r || nd.Size() != tc.n {
					t.Errorf("rank %d: node is rank %d of %d", r, nd.Rank(), nd.Size())
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					arrived.Add(1)
					if err := nd.Barrier(ctx, nil); err != nil {
						t.Errorf("rank %d: %v", r, err)
					} else if got := arrived.Load(); got != int64(tc.n) {
						t.Errorf("rank %d left the barrier after %d of %d arrivals", r, got, tc.n)
					}
				}()
			}
			wg.Wait()
		})
	}
}

// TestFromEnvTokenMismatch: a rank whose GOVERBS_TOKEN differs is refused
// with ErrAuth.
func TestFromEnvTokenMismatch(t *testing.T) {
	verbstest.CheckLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	root := ln.Addr().String()
	ctx := testContext(t)
	short, cancel := contextWithTimeoutOf(ctx, 1)
	defer cancel()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		env := map[string]string{"GOVERBS_RANK": fmt.Sprint(r), "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": root,
			"GOVERBS_TOKEN": fmt.Sprintf("token-%d", r)}
		opts := cluster.EnvOptions{Lookup: lookupIn(env)}
		c := ctx
		if r == 0 {
			opts.Join.Listener, c = ln, short
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var n *cluster.Node
			if n, errs[r] = cluster.FromEnv(c, opts); n != nil {
				n.Close()
			}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if !errors.Is(err, cluster.ErrAuth) {
			t.Errorf("rank %d: %v, want ErrAuth", r, err)
		}
	}
}
