// Package spinwait decides how long a wait for a peer's write spins
// before it sleeps.
//
// Spinning (polling, yielding to the process' goroutines in between)
// answers in microseconds while the peer has a processor of its own.
// When the ranks of a machine outnumber its processors it only delays the
// peer: a spinner keeps the processor the peer needs, until the
// scheduler preempts it (measured with 200 µs spins, soft0 shared memory,
// 4 ranks on 2 vCPUs: 2.3 ms per 8-byte allreduce, against 1.0 ms when
// waits sleep at once on the completion channel). Sleeping costs a
// wake-up (tens of microseconds on a virtual machine) but leaves the
// processor to the peer.
//
// Deciding from the machine rather than from how recent waits went keeps
// two ranks that could spin from settling into both sleeping, where each
// answers the other only after a wake-up and every wait looks long
// (measured over unix sockets with an adaptive rule: 230 µs per
// allreduce against 15 µs).
package spinwait

import "time"

// MaxSpin is how long a wait spins before it sleeps when the machine has
// a processor for every local rank: long enough to ride out the stalls of
// a peer that has one (a socket's wake-up, a scheduling tick).
const MaxSpin = time.Millisecond

// Budget returns how long a wait spins before it sleeps, for one of
// localRanks ranks of a machine with cpus processors: MaxSpin, or 0
// (sleep at once) when the ranks outnumber the processors.
func Budget(localRanks, cpus int) time.Duration {
	if localRanks > cpus {
		return 0
	}
	return MaxSpin
}
