// Package spinwait decides how long a wait for a peer's write spins
// before it sleeps, from how the recent waits of the same waiter ended.
//
// Spinning (polling, yielding to the process' goroutines in between)
// answers in microseconds while the peer has a processor of its own; it
// only delays the peer when ranks outnumber the processors, since a
// spinner keeps the processor the peer needs. Sleeping on the completion
// channel costs a wake-up (tens of microseconds on a virtual machine) but
// leaves the processor to the peer. A Policy spins for MaxSpin while
// spinning waits mostly end during their spin, and otherwise sleeps at once,
// spinning again every ProbeEvery waits to see whether that changed.
//
// A Policy is not safe for concurrent use: one per waiter whose waits
// are serialised (a communicator, a barrier).
package spinwait

import "time"

const (
	// MaxSpin is how long a wait spins before it sleeps, when spinning
	// pays.
	MaxSpin = 200 * time.Microsecond
	// ProbeEvery is how often a policy that sleeps at once spins again.
	ProbeEvery = 16
	scoreMax   = 8
	// sleepBelow: the policy sleeps at once while its score (hits minus
	// misses, within ±scoreMax) is below it, so that a few misses (a
	// peer starting late, a descheduled moment) do not stop spinning.
	sleepBelow = -4
)

// Policy is the spinning state of one waiter. The zero value spins.
type Policy struct {
	score int32 // hits minus misses, within ±scoreMax
	waits uint32
}

// Budget returns how long the wait that begins may spin (0: sleep at
// once).
func (p *Policy) Budget() time.Duration {
	p.waits++
	if p.score >= sleepBelow || p.waits%ProbeEvery == 0 {
		return MaxSpin
	}
	return 0
}

// Record notes how a wait that had a spin budget ended: during its spin
// (hit) or after it slept.
func (p *Policy) Record(hit bool) {
	if hit {
		p.score = min(p.score+1, scoreMax)
	} else {
		p.score = max(p.score-1, -scoreMax)
	}
}

// Sleeping reports whether the policy currently sleeps at once.
func (p *Policy) Sleeping() bool { return p.score < sleepBelow }
