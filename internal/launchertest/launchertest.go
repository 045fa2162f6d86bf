// Package launchertest runs the test binary as the ranks of a job that a
// real MPI launcher starts (Open MPI's mpirun, MPICH's Hydra), for the
// tests of the example programs: every rank is this test binary,
// re-executed with the program's arguments (its TestMain runs the
// program when the environment the test gives says so), finds its place
// with cluster.FromEnv and meets rank 0 at GOVERBS_ROOT.
//
// A launcher that is not installed skips its test (Debian: openmpi-bin,
// mpich; scripts/deps.sh installs them). Run is for the goroutine of
// its test.
package launchertest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs/cluster"
)

// Launcher is an MPI launcher.
type Launcher struct {
	Name string   // the name of its subtest
	Bin  string   // its executable, looked up in PATH
	Args []string // its options, before -np
	Kind string   // the launcher as cluster.ParseLaunch names it
}

// MPI lists the real launchers: Open MPI's mpirun (OMPI_COMM_WORLD_*
// variables) and MPICH's Hydra (PMI_RANK, PMI_SIZE; GOVERBS_JOB names the
// job, which Hydra does not).
var MPI = []Launcher{
	{"openmpi", "mpirun.openmpi", []string{"--allow-run-as-root", "--oversubscribe", "--bind-to", "none"}, cluster.LauncherOpenMPI},
	{"mpich-hydra", "mpiexec.hydra", nil, cluster.LauncherPMI},
}

// RaceQuiet is the environment entry that keeps a race-enabled rank from
// sleeping a second at exit (GORACE atexit_sleep_ms=0, added to this
// process' GORACE).
func RaceQuiet() string {
	return "GORACE=" + strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")
}

// Run runs n ranks of this test binary with args under l, with env as
// their environment plus RaceQuiet, GOVERBS_ROOT (a loopback port that
// was free a moment ago: the launchers cannot hand a listening socket to
// their ranks), GOVERBS_TOKEN and GOVERBS_JOB (t's name), and returns
// their combined output, which it also logs. It skips t if l is not
// installed and fails it if the job fails; timeout bounds the job (a
// hang guard).
func Run(t *testing.T, l Launcher, n int, timeout time.Duration, env []string, args ...string) []byte {
	t.Helper()
	bin, err := exec.LookPath(l.Bin)
	if err != nil {
		t.Skipf("%s is not installed (apt-get install openmpi-bin mpich, or scripts/deps.sh): %v", l.Bin, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	root := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cmd := exec.CommandContext(ctx, bin, append(append(l.Args[:len(l.Args):len(l.Args)], "-np", strconv.Itoa(n), os.Args[0]), args...)...)
	cmd.Env = append(env[:len(env):len(env)], RaceQuiet(), "GOVERBS_ROOT="+root, "GOVERBS_TOKEN=launcher-secret", "GOVERBS_JOB="+t.Name())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", l.Bin, err, out)
	}
	t.Logf("%s printed:\n%s", l.Bin, out)
	return out
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
