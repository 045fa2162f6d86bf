// Package spinwait decides how long a wait for a peer's write spins
// before it sleeps, from how the recent waits of the same waiter ended.
//
// Spinning (polling, yielding to the process' goroutines in between)
// answers in microseconds while the peer has a processor of its own; it
// only delays the peer when ranks outnumber the processors, since a
// spinner keeps the processor the peer needs. Sleeping on the completion
// channel costs a wake-up (tens of microseconds on a virtual machine) but
// leaves the processor to the peer. A Policy spins (for at most MaxSpin)
// while waits mostly end within Short, and otherwise sleeps at once,
// spinning again every ProbeEvery waits to see whether that changed. When
// ranks outnumber the processors, waits take longer than Short, whether
// they spin (the peer is not running) or sleep (a wake-up), and the
// policy sleeps.
//
// A Policy is not safe for concurrent use: one per waiter whose waits
// are serialised (a communicator, a barrier).
package spinwait

import "time"

const (
	// MaxSpin is how long a wait spins before it sleeps, when spinning
	// pays: long enough to ride out the stalls of a peer that has a
	// processor (a socket's wake-up, a scheduling tick).
	MaxSpin = time.Millisecond
	// Short is the longest wait that says spinning pays: a peer with a
	// processor of its own answers within microseconds; a wait longer
	// than this (spinning or sleeping) counts against spinning.
	Short = 100 * time.Microsecond
	// ProbeEvery is how often a policy that sleeps at once spins again.
	ProbeEvery = 16
	scoreMax   = 8
	// sleepBelow: the policy sleeps at once while its score (hits minus
	// misses, within ±scoreMax) is below it, so that a few misses (a
	// peer starting late, a descheduled moment) do not stop spinning.
	sleepBelow = -4
)

// Policy is the spinning state of one waiter. The zero value spins, and
// keeps spinning through the first scoreMax−sleepBelow net long waits (a
// peer that starts late must not put two ranks that could spin to sleep:
// once both sleep, each answers the other after a wake-up, which on
// sockets takes longer than MaxSpin, and neither would learn that
// spinning pays).
type Policy struct {
	score int32 // hits minus misses, within ±scoreMax
	waits uint32
}

// Budget returns how long the wait that begins may spin (0: sleep at
// once).
func (p *Policy) Budget() time.Duration {
	if p.waits == 0 {
		p.score = scoreMax
	}
	p.waits++
	if p.score >= sleepBelow || p.waits%ProbeEvery == 0 {
		return MaxSpin
	}
	return 0
}

// Record notes how long a wait took (from its start to its end, whether
// it spun, slept or both).
func (p *Policy) Record(waited time.Duration) {
	if waited < Short {
		p.score = min(p.score+1, scoreMax)
	} else {
		p.score = max(p.score-1, -scoreMax)
	}
}

// Sleeping reports whether the policy currently sleeps at once.
func (p *Policy) Sleeping() bool { return p.score < sleepBelow }
