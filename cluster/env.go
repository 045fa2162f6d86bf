package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
)

// DefaultPort is the rendezvous port used when neither the options, nor
// GOVERBS_PORT, nor the launcher name one (Slurm, Kubernetes).
const DefaultPort = 18515

// Launcher environment errors. An *EnvError wraps one of them.
var (
	// ErrNoLauncher: no supported launcher's variables are set.
	ErrNoLauncher = errors.New("cluster: env: no launcher detected (set the variables of Slurm, Open MPI, PMI, torchrun, a Kubernetes indexed Job, or GOVERBS_RANK and GOVERBS_WORLD_SIZE)")
	// ErrEnvValue: a variable is missing or has a bad value.
	ErrEnvValue = errors.New("cluster: env: bad or missing variable")
	// ErrNoRoot: the launcher does not say where rank 0 is: set
	// GOVERBS_ROOT=host:port (or EnvOptions.Root).
	ErrNoRoot = errors.New("cluster: env: rank 0's address is unknown (set GOVERBS_ROOT=host:port)")
)

// EnvError is an error of the launcher environment: the launcher, the
// variable concerned (if any) and the cause.
type EnvError struct {
	Launcher string
	Var      string
	Err      error
}

func (e *EnvError) Error() string {
	s := "cluster: env"
	if e.Launcher != "" {
		s += " (" + e.Launcher + ")"
	}
	if e.Var != "" {
		s += ": " + e.Var
	}
	return s + ": " + e.Err.Error()
}

func (e *EnvError) Unwrap() error { return e.Err }

// Launchers recognised by ParseLaunch, in the order of detection.
const (
	LauncherGoverbs    = "goverbs"    // GOVERBS_RANK, GOVERBS_WORLD_SIZE, GOVERBS_ROOT
	LauncherTorchrun   = "torchrun"   // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
	LauncherOpenMPI    = "openmpi"    // OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK
	LauncherPMI        = "pmi"        // PMI_RANK, PMI_SIZE (MPICH Hydra, Intel MPI, srun --mpi=pmi2)
	LauncherSlurm      = "slurm"      // SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_*NODELIST
	LauncherKubernetes = "kubernetes" // JOB_COMPLETION_INDEX of an indexed Job
)

// detectVars is the variable whose presence selects each launcher.
// torchrun's RANK is a common name, which a shell may keep from an
// earlier job: it selects torchrun ahead of the launchers after it only
// together with a variable only torchrun sets (torchVars); alone, only
// when no other launcher's variable is set.
var detectVars = []struct{ launcher, v string }{
	{LauncherGoverbs, "GOVERBS_RANK"},
	{LauncherTorchrun, "RANK"},
	{LauncherOpenMPI, "OMPI_COMM_WORLD_RANK"},
	{LauncherPMI, "PMI_RANK"},
	{LauncherSlurm, "SLURM_PROCID"},
	{LauncherKubernetes, "JOB_COMPLETION_INDEX"},
}

// Launch is this process' place in a job, as its launcher described it.
type Launch struct {
	Launcher  string
	Rank      int
	Size      int
	LocalRank int    // rank among the processes of this host, below Size; -1 if unknown
	Root      string // rank 0's rendezvous address, host:port
	Job       string // job id ("" if the launcher has none)
	// Hosts are the hosts of the job, when the launcher lists them
	// (Slurm: the step's node list, expanded).
	Hosts []string
	// Device is the RDMA device named by GOVERBS_DEVICE ("" if unset).
	Device string
	// Listen is the address rank 0 listens on: GOVERBS_LISTEN, or Root
	// when its host is an IP address, or every interface at Root's port.
	Listen string
}

// EnvOptions configure ParseLaunch and FromEnv. The zero value reads the
// process environment and detects the launcher.
type EnvOptions struct {
	// Lookup reads a variable (default os.LookupEnv).
	Lookup func(string) (string, bool)
	// Launcher forces a launcher (one of the Launcher* names); empty:
	// detect it.
	Launcher string
	// Root overrides rank 0's address (else GOVERBS_ROOT, else what the
	// launcher says).
	Root string
	// Port is the rendezvous port where the launcher names only a host
	// (Slurm, Kubernetes), 1 to 65535 (0: GOVERBS_PORT, which must then
	// be a port too, else DefaultPort); with torchrun it replaces
	// MASTER_PORT.
	Port int
	// HostPattern names the pods of a Kubernetes indexed Job, with
	// "{index}" where the completion index goes, e.g.
	// "train-{index}.train-svc" (else GOVERBS_HOST_PATTERN).
	HostPattern string
	// Size is the world size of a Kubernetes indexed Job (else
	// GOVERBS_WORLD_SIZE).
	Size int
	// Join configures the node (FromEnv). Its Mode is ignored (FromEnv
	// uses Rendezvous); an empty Token is taken from GOVERBS_TOKEN, an
	// empty Job from GOVERBS_JOB or the launcher's job id.
	Join JoinOptions
}

type env struct {
	lookup   func(string) (string, bool)
	launcher string
}

func (e *env) str(name string) (string, bool) {
	v, ok := e.lookup(name)
	v = strings.TrimSpace(v)
	return v, ok && v != ""
}

func (e *env) errf(name string, format string, args ...any) error {
	return &EnvError{Launcher: e.launcher, Var: name, Err: fmt.Errorf("%w: "+format, append([]any{ErrEnvValue}, args...)...)}
}

// int reads a required non-negative integer (or one with a default when
// def >= 0 and the variable is unset).
func (e *env) int(name string, def int) (int, error) {
	v, ok := e.str(name)
	if !ok {
		if def >= 0 {
			return def, nil
		}
		return 0, e.errf(name, "not set")
	}
	n, ok := decimal(v)
	if !ok {
		return 0, e.errf(name, "%s is not a non-negative integer", clip(v))
	}
	return n, nil
}

// decimal parses a non-negative decimal integer made of digits only (no
// sign, no spaces) that fits in an int.
func decimal(v string) (int, bool) {
	if v == "" || strings.TrimLeft(v, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(v)
	return n, err == nil
}

// checkAddr checks a host:port address of the environment: the port is
// decimal, from 1 to 65535; the host is an IP address (IPv6 with a zone
// too), a host name (see checkHostname), or, when emptyHost, empty (every
// interface).
func checkAddr(addr string, emptyHost bool) error {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%s is not host:port", clip(addr))
	}
	if n, ok := decimal(p); !ok || n < 1 || n > 65535 {
		return fmt.Errorf("%s has a bad port", clip(addr))
	}
	if host == "" {
		if emptyHost {
			return nil
		}
		return fmt.Errorf("%s has no host", clip(addr))
	}
	if err := checkHostname(host); err != nil {
		return fmt.Errorf("%s has a bad host: %v", clip(addr), err)
	}
	return nil
}

// opt reads an optional non-negative integer: -1 when unset.
func (e *env) opt(name string) (int, error) {
	if _, ok := e.str(name); !ok {
		return -1, nil
	}
	return e.int(name, -1)
}

// first returns the first set variable of names.
func (e *env) first(names ...string) (string, string, bool) {
	for _, n := range names {
		if v, ok := e.str(n); ok {
			return n, v, true
		}
	}
	return names[0], "", false
}

// torchVars are variables torchrun sets besides RANK and WORLD_SIZE,
// and torch's env:// initialisation requires (MASTER_ADDR).
var torchVars = []string{"MASTER_ADDR", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK"}

// detect returns the launcher the environment names, "" if none (see
// detectVars).
func (e *env) detect() string {
	bare := false // RANK without a variable of torchVars
	for _, d := range detectVars {
		if _, ok := e.str(d.v); !ok {
			continue
		}
		if d.launcher == LauncherTorchrun && !slices.ContainsFunc(torchVars, func(v string) bool { _, ok := e.str(v); return ok }) {
			bare = true
			continue
		}
		return d.launcher
	}
	if bare {
		return LauncherTorchrun // whose errors say what is missing
	}
	return ""
}

// ParseLaunch reads the launcher's environment: which launcher started
// the process, its rank, the world size, its local rank, rank 0's
// rendezvous address and the job id. The launcher is the first of the
// Launcher* constants whose variable is set, except that torchrun's
// RANK counts ahead of Open MPI, PMI and Slurm only together with
// MASTER_ADDR, TORCHELASTIC_RUN_ID, LOCAL_WORLD_SIZE or GROUP_RANK (a
// RANK left in the shell does not hide mpirun or srun; torchrun under
// srun is torchrun). Variables common to every launcher
// override what the launcher says: GOVERBS_ROOT (host:port of rank 0),
// GOVERBS_PORT, GOVERBS_JOB, GOVERBS_DEVICE, GOVERBS_LISTEN. Under PMI
// without a job id (MPICH's Hydra sets none), GOVERBS_JOB is required.
func ParseLaunch(opts EnvOptions) (Launch, error) {
	e := &env{lookup: opts.Lookup}
	if e.lookup == nil {
		e.lookup = os.LookupEnv
	}
	e.launcher = opts.Launcher
	if e.launcher != "" && !slices.ContainsFunc(detectVars, func(d struct{ launcher, v string }) bool { return d.launcher == e.launcher }) {
		// Not named as the launcher of the errors: it is no launcher.
		return Launch{}, &EnvError{Err: fmt.Errorf("%w: unknown launcher %s", ErrNoLauncher, clip(e.launcher))}
	}
	if e.launcher == "" {
		e.launcher = e.detect()
		if e.launcher == "" {
			return Launch{}, &EnvError{Err: ErrNoLauncher}
		}
	}
	l := Launch{Launcher: e.launcher, LocalRank: -1}
	var err error
	var sizeVar string  // the variable that gave the world size
	var localVar string // the variable that gave the local rank
	port := opts.Port
	if port < 0 || port > 65535 {
		return l, &EnvError{Launcher: e.launcher, Err: fmt.Errorf("%w: EnvOptions.Port %d (want 1 to 65535, or 0 for the environment's)", ErrEnvValue, port)}
	}
	if _, set := e.str("GOVERBS_PORT"); set && port == 0 {
		// Set, it names a port: 0 is none (it was taken for unset, and
		// DefaultPort used instead).
		if port, err = e.int("GOVERBS_PORT", -1); err != nil {
			return l, err
		}
		if port < 1 || port > 65535 {
			return l, e.errf("GOVERBS_PORT", "port %d (want 1 to 65535)", port)
		}
	}
	root := opts.Root
	rootVar := "GOVERBS_ROOT" // what named rank 0's address, for errors
	if root == "" {
		root, _ = e.str("GOVERBS_ROOT")
	}
	var rootHost string // a host of the launcher, when it names rank 0's
	switch e.launcher {
	case LauncherGoverbs:
		if l.Rank, err = e.int("GOVERBS_RANK", -1); err != nil {
			return l, err
		}
		sizeVar = "GOVERBS_WORLD_SIZE"
		if l.Size, err = e.int(sizeVar, -1); err != nil {
			return l, err
		}
		localVar = "GOVERBS_LOCAL_RANK"
		if l.LocalRank, err = e.int(localVar, l.Rank); err != nil {
			return l, err
		}
	case LauncherTorchrun:
		if l.Rank, err = e.int("RANK", -1); err != nil {
			return l, err
		}
		sizeVar = "WORLD_SIZE"
		if l.Size, err = e.int(sizeVar, -1); err != nil {
			return l, err
		}
		localVar = "LOCAL_RANK"
		if l.LocalRank, err = e.opt(localVar); err != nil {
			return l, err
		}
		if root == "" {
			addr, ok := e.str("MASTER_ADDR")
			if !ok {
				return l, e.errf("MASTER_ADDR", "not set")
			}
			if port == 0 {
				if port, err = e.int("MASTER_PORT", -1); err != nil {
					return l, err
				}
				if port < 1 || port > 65535 {
					return l, e.errf("MASTER_PORT", "port %d (want 1 to 65535)", port)
				}
			}
			root, rootVar = net.JoinHostPort(addr, strconv.Itoa(port)), "MASTER_ADDR"
		}
		l.Job, _ = e.str("TORCHELASTIC_RUN_ID")
	case LauncherOpenMPI:
		if l.Rank, err = e.int("OMPI_COMM_WORLD_RANK", -1); err != nil {
			return l, err
		}
		sizeVar = "OMPI_COMM_WORLD_SIZE"
		if l.Size, err = e.int(sizeVar, -1); err != nil {
			return l, err
		}
		localVar = "OMPI_COMM_WORLD_LOCAL_RANK"
		if l.LocalRank, err = e.opt(localVar); err != nil {
			return l, err
		}
		_, l.Job, _ = e.first("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
	case LauncherPMI:
		if l.Rank, err = e.int("PMI_RANK", -1); err != nil {
			return l, err
		}
		sizeVar = "PMI_SIZE"
		if l.Size, err = e.int(sizeVar, -1); err != nil {
			return l, err
		}
		localVar, _, _ = e.first("MPI_LOCALRANKID", "PMI_LOCAL_RANK")
		if l.LocalRank, err = e.opt(localVar); err != nil {
			return l, err
		}
		_, l.Job, _ = e.first("PMI_KVSNAME", "PMI_JOBID")
	case LauncherSlurm:
		if l.Rank, err = e.int("SLURM_PROCID", -1); err != nil {
			return l, err
		}
		sizeVar, _, _ = e.first("SLURM_NTASKS", "SLURM_NPROCS")
		if l.Size, err = e.int(sizeVar, -1); err != nil {
			return l, err
		}
		localVar = "SLURM_LOCALID"
		if l.LocalRank, err = e.opt(localVar); err != nil {
			return l, err
		}
		if name, list, ok := e.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"); ok {
			if l.Hosts, err = ExpandNodeList(list); err != nil {
				return l, &EnvError{Launcher: e.launcher, Var: name, Err: fmt.Errorf("%w: %w", ErrEnvValue, err)}
			}
			rootHost = l.Hosts[0] // task 0 runs on the step's first node
			if root == "" {
				rootVar = name
			}
		}
		if id, ok := e.str("SLURM_JOB_ID"); ok {
			l.Job = "slurm-" + id
			if step, ok := e.str("SLURM_STEP_ID"); ok {
				l.Job += "." + step
			}
		}
	case LauncherKubernetes:
		if l.Rank, err = e.int("JOB_COMPLETION_INDEX", -1); err != nil {
			return l, err
		}
		l.Size = opts.Size
		if l.Size == 0 {
			sizeVar = "GOVERBS_WORLD_SIZE"
			if l.Size, err = e.int(sizeVar, -1); err != nil {
				return l, err
			}
		}
		pattern := opts.HostPattern
		if pattern == "" {
			pattern, _ = e.str("GOVERBS_HOST_PATTERN")
		}
		if root == "" {
			if !strings.Contains(pattern, "{index}") {
				return l, e.errf("GOVERBS_HOST_PATTERN", "%s has no {index} (for example \"myjob-{index}.myjob-svc\")", clip(pattern))
			}
			rootHost, rootVar = strings.ReplaceAll(pattern, "{index}", "0"), "GOVERBS_HOST_PATTERN"
		}
	default:
		return l, &EnvError{Launcher: e.launcher, Err: fmt.Errorf("%w: unknown launcher %s", ErrNoLauncher, clip(e.launcher))}
	}
	if l.Size < 1 || l.Size > MaxWorldSize {
		return l, &EnvError{Launcher: e.launcher, Var: sizeVar, Err: fmt.Errorf("%w: world size %d (want 1 to %d)", ErrEnvValue, l.Size, MaxWorldSize)}
	}
	if l.Rank >= l.Size {
		return l, &EnvError{Launcher: e.launcher, Err: fmt.Errorf("%w: rank %d outside a world of %d", ErrEnvValue, l.Rank, l.Size)}
	}
	if l.LocalRank >= l.Size {
		// A rank among this host's ranks of the world: fewer than its size.
		return l, e.errf(localVar, "local rank %d outside a world of %d", l.LocalRank, l.Size)
	}
	if root == "" && rootHost != "" {
		if port == 0 {
			port = DefaultPort
		}
		root = net.JoinHostPort(rootHost, strconv.Itoa(port))
	}
	if root == "" && l.Size > 1 {
		return l, &EnvError{Launcher: e.launcher, Var: "GOVERBS_ROOT", Err: ErrNoRoot}
	}
	if root != "" {
		if err := checkAddr(root, false); err != nil {
			return l, &EnvError{Launcher: e.launcher, Var: rootVar, Err: fmt.Errorf("%w: root address %v", ErrEnvValue, err)}
		}
		host, p, _ := net.SplitHostPort(root)
		l.Listen = root
		if !isIP(host) { // an IPv6 address with a zone is one too
			l.Listen = net.JoinHostPort("", p)
		}
	}
	l.Root = root
	if v, ok := e.str("GOVERBS_LISTEN"); ok {
		if err := checkAddr(v, true); err != nil {
			return l, e.errf("GOVERBS_LISTEN", "listen address %v", err)
		}
		l.Listen = v
	}
	if v, ok := e.str("GOVERBS_JOB"); ok {
		l.Job = v
	}
	if l.Launcher == LauncherPMI && l.Job == "" {
		// MPICH's Hydra sets PMI_RANK and PMI_SIZE and nothing that
		// tells one job from the next (its PMI_FD and HYDI_CONTROL_FD
		// are descriptors): without a job id, a rank of another job at
		// the same rendezvous address would be taken for a peer.
		return l, e.errf("GOVERBS_JOB", "not set, and the launcher sets no job id (MPICH's Hydra sets neither PMI_KVSNAME nor PMI_JOBID): "+
			"set GOVERBS_JOB to a value unique to this job and the same for every rank (for example GOVERBS_JOB=$(cat /proc/sys/kernel/random/uuid) mpiexec ...)")
	}
	l.Device, _ = e.str("GOVERBS_DEVICE")
	return l, nil
}

// FromEnv builds a connected node from the environment of whatever
// launcher started the process (see ParseLaunch): it opens the device,
// builds the node and exchanges endpoints through a rendezvous at rank 0.
// Every rank of the job must call it. Like Join, it fails by ctx's
// deadline when a rank is missing.
func FromEnv(ctx context.Context, opts EnvOptions) (*Node, error) {
	l, err := ParseLaunch(opts)
	if err != nil {
		if opts.Join.Listener != nil {
			opts.Join.Listener.Close() // as join does when it fails
		}
		return nil, err
	}
	jo := opts.Join
	lookup := opts.Lookup
	if lookup == nil {
		lookup = os.LookupEnv
	}
	if len(jo.Token) == 0 {
		if v, ok := lookup("GOVERBS_TOKEN"); ok {
			jo.Token = []byte(v)
		}
	}
	if jo.Job == "" {
		jo.Job = l.Job
	}
	dev := jo.Device
	if dev == "" {
		dev = l.Device
	}
	xc := ExchangeConfig{Rank: l.Rank, Size: l.Size, Mode: Rendezvous, Root: l.Root, Listen: l.Listen}
	return join(ctx, dev, xc, jo)
}
