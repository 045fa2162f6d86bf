// Package spinwait decides how a wait for a peer's write spins before it
// sleeps.
//
// Spinning (polling, with a pause in between) answers in microseconds
// while the peer runs; sleeping on the completion channel costs a
// wake-up (tens of microseconds on a virtual machine, where an idle
// processor must be woken too). What the pause offers decides whether
// spinning helps when the ranks of a machine outnumber its processors:
//
//   - runtime.Gosched offers the processor to the process' own
//     goroutines only: the spinner keeps it until the scheduler preempts
//     it, and the peer waits for that (measured with 200 µs spins, soft0
//     shared memory, 4 ranks on 2 vCPUs: 2.3 ms per 8-byte allreduce,
//     against 1.0 ms when waits sleep at once).
//   - sched_yield (internal/sched) offers it to the other threads ready
//     to run on it, the peer's among them, as MPI libraries do when
//     oversubscribed: the peer runs at once, and the spinner sees its
//     write after a context switch or two instead of a wake-up.
//     Measured with every other task of the machine moved to the other
//     processor (a cpuset), soft0 shared memory, medians of goverbs coll
//     (collective) and BenchmarkBarrierXproc (cluster), old → new:
//     collective barrier, 2 ranks on 1 CPU 96–130 → 41 µs, 4 ranks
//     883–918 → 505–531 µs; 8-byte allreduce, 4 ranks 824–864 →
//     459–492 µs; cluster dissemination barrier, 4 ranks 574–654 →
//     383–490 µs, 2 ranks unchanged (52–68 against 60–90 µs).
//
// So a wait spins with Gosched when every local rank has a processor,
// with sched_yield when they outnumber the processors by at most
// MaxYieldRanks per processor, and sleeps at once beyond that: with
// hundreds of ranks per processor, a rank the others wait for would
// queue behind every yielding spinner of its processor (each wait a lap
// of context switches), and a sleeping wait leaves it alone. The bound
// was 4 until the waits looked at what their poll placed before they
// paused (package collective, cluster): since, a yielding wait costs
// about a context switch per message, less than a sleeping one's
// wake-up up to 64 ranks per processor at least. goverbs coll, soft0
// shared memory, 2 vCPUs (1: taskset), three rounds alternating bound 4
// and 32, barrier medians: 8 ranks on 1 CPU 529 → 167 µs, 16 on 1 CPU
// 2145 → 774 µs, 16 on 2 CPUs 1055 → 374 µs, 32 on 2 CPUs 5.0 → 1.8 ms,
// 64 on 2 CPUs 20.0 → 8.5 ms; one run each at 128 ranks on 2 CPUs (64
// per processor), sleeping against yielding: 111 and 75 ms. The waits
// that cannot sleep (for room in a send queue, or for the execution of a
// write) yield whenever the ranks outnumber the processors.
//
// Deciding from the machine rather than from how recent waits went keeps
// two ranks that could spin from settling into both sleeping, where each
// answers the other only after a wake-up and every wait looks long
// (measured over unix sockets with an adaptive rule: 230 µs per
// allreduce against 15 µs).
package spinwait

import (
	"runtime"
	"time"

	"github.com/goverbs/verbs/internal/sched"
)

// MaxSpin is how long a wait spins before it sleeps: long enough to ride
// out the stalls of a peer (a socket's wake-up, a scheduling tick, a
// peer that yields in turn).
const MaxSpin = time.Millisecond

// MaxYieldRanks is the most local ranks per processor for which a wait
// spins, yielding, before it sleeps (see the package documentation for
// the measurements behind it).
const MaxYieldRanks = 32

// Policy is how a wait spins before it sleeps, and how often its sleep
// is interrupted.
type Policy struct {
	// Spin is how long the wait spins; 0 sleeps at once.
	Spin time.Duration
	// Yield makes Pause offer the processor to every thread of the
	// machine (sched_yield), not only to the process' goroutines.
	Yield bool
	// Every is the interval of the alarms of a sleeping wait and of the
	// probes of the peer it waits for (see interval).
	Every time.Duration
}

// For returns the policy of one of localRanks ranks of a machine with cpus
// processors (see the package documentation).
func For(localRanks, cpus int) Policy {
	cpus = max(cpus, 1)
	// Yield also beyond MaxYieldRanks per processor: the waits that
	// cannot sleep (for room in a send queue, for the execution of a
	// write that reads a Buffer) still spin.
	p := Policy{Every: interval(localRanks, cpus), Yield: localRanks > cpus}
	if localRanks <= MaxYieldRanks*cpus {
		p.Spin = MaxSpin
	}
	return p
}

// Procs is the GOMAXPROCS of one of localRanks ranks of a machine with
// cpus processors when the ranks share the processors out, at least one
// each: with the runtime's default every rank runs as many threads as
// the machine has processors, and ranks that outnumber the processors
// wait behind each other's extra threads (package collective, Waiting,
// has the measurements).
func Procs(localRanks, cpus int) int { return max(1, cpus/max(localRanks, 1)) }

// Pause is the pause between two polls of a spinning wait.
func (p Policy) Pause() {
	runtime.Gosched()
	if p.Yield {
		sched.Yield()
	}
}

// PauseEvery is how many polls of a spinning wait pass between pauses
// when every local rank has a processor: a trip through the Go scheduler
// at every poll was 16 % of a 2-rank barrier (package collective) and
// made cluster's 2-rank barriers 15-20 % slower.
const PauseEvery = 4

// PauseAt pauses after the round-th poll of a spinning wait: after every
// poll when the ranks outnumber the processors (the peers may need this
// one), after every PauseEvery-th otherwise.
func (p Policy) PauseAt(round int) {
	if p.Yield || round%PauseEvery == 0 {
		p.Pause()
	}
}

// The alarms and probes of a sleeping wait.
const (
	// ProbeEvery spaces the alarms of a sleeping wait and the probes of
	// the peer it waits for on a machine with a processor for every
	// local rank.
	ProbeEvery = 10 * time.Millisecond
	// MaxProbeEvery bounds the interval that interval stretches: a failure
	// nobody sends to is seen within the liveness bound (verbs.QPSpec.Timeout:
	// about 0.54 s by default, soft0 at least 250 ms) plus this. It is
	// reached at 100 ranks per processor, where a barrier takes seconds
	// (512 ranks on 2 CPUs with alarms every 100 ms: 5 000 a second kept
	// the machine's load above 700, and starved ranks of the start-up
	// for more than 10 s).
	MaxProbeEvery = time.Second
)

// interval is the interval of the alarms and probes of a sleeping wait,
// for one of localRanks ranks of a world on a machine with cpus
// processors: ProbeEvery, times the ranks per processor when they
// outnumber the processors, at most MaxProbeEvery. Every sleeping rank's
// alarm wakes it and, with its probe, the peer it waits for: with a
// fixed interval their cost grows with the ranks while the processors do
// not (256 ranks on 2 CPUs: 25 600 alarms a second kept the processors
// busy waking Go runtimes, 1.5 s per barrier). Stretched, the alarms of
// all the local ranks cost about as much as those of one rank per
// processor, up to 100 ranks per processor.
func interval(localRanks, cpus int) time.Duration {
	cpus = max(cpus, 1)
	if localRanks <= cpus {
		return ProbeEvery
	}
	per := (localRanks + cpus - 1) / cpus
	return min(time.Duration(per)*ProbeEvery, MaxProbeEvery)
}
