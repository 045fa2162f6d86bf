package channel

import (
	"math"
	"runtime"
	"sync/atomic"
	"time"
)

// Values of Options.SpinPolls with a meaning of their own.
const (
	// SpinAdaptive (the zero value, the default) spins for a time derived
	// from how long recent waits took, and sleeps at once when waits are
	// long or when more goroutines spin than there are processors (see
	// the package documentation, Completions).
	SpinAdaptive = 0
	// SpinNever never spins: a waiting goroutine that finds nothing
	// sleeps on the completion channel at once.
	SpinNever = -1
	// SpinAlways never sleeps: a waiting goroutine polls until its
	// completion arrives or its context ends, whatever it costs.
	SpinAlways = math.MaxInt
)

// The adaptive policy (Options.SpinPolls == SpinAdaptive).
//
// A wait spins for a budget of time, then sleeps on the completion
// channel. The budget follows est, an exponentially weighted moving
// average (weight 1/8) of how long the engine's recent waits took:
// twice est, at least spinFloor, at most spinCap. spinCap is what a
// sleeping wait costs over a spinning one (the two wake-ups of the
// completion channel, measured across processes: see the package
// documentation); spinning longer than that for a completion that may
// never come is worse than sleeping, the rule of the ski rental. When est
// exceeds spinCap the waits are long and a wait sleeps at once, except
// every probeEvery-th, which spins for spinCap: when completions are fast
// again, that probe sees it and resets est to what it measured (a sleeping
// wait measures its wake-ups too, and would keep est high by itself).
//
// Spinning needs a processor: a wait spins only while fewer than
// max(1, GOMAXPROCS-1) goroutines of the process spin (every channel of
// the process counts), so that the goroutines that make the progress
// being waited for, and a peer on the same host, keep one.
const (
	spinFloor  = 5 * time.Microsecond
	spinCap    = 50 * time.Microsecond
	sampleMax  = 8 * spinCap // a longer wait counts as this long
	probeEvery = 16
	ewmaShift  = 3 // weight 1/8
)

// spinners counts the goroutines of the process that spin in an
// adaptive wait, over every channel: processors are a resource of the
// process, not of one channel.
var spinners atomic.Int32

// spinStats is an engine's record of its waits.
type spinStats struct {
	est   atomic.Int64  // EWMA of wait durations, ns
	waits atomic.Uint32 // adaptive waits that found est > spinCap
}

// waiter is the spinning state of one wait (on the waiting goroutine's
// stack).
type waiter struct {
	mode    int // Options.SpinPolls
	polls   int // SpinPolls > 0: empty polls left
	start   time.Time
	budget  time.Duration
	started bool // the budget was set
	counted bool // counted in spinners
	probe   bool // a probe: a successful spin resets est
	slept   bool // the wait slept (on the completion channel, or while another goroutine polled)
	over    bool // the spin phase is over
}

func newWaiter(mode int) waiter {
	return waiter{mode: mode, polls: mode, start: time.Now()}
}

// spin reports whether the poller should poll again (after yielding the
// processor) rather than sleep on the completion channel. Once it said
// no, it says no until the wait ends.
func (w *waiter) spin(s *spinStats) bool {
	if w.over {
		return false
	}
	switch {
	case w.mode == SpinAlways:
		return true
	case w.mode < 0:
		w.over = true
		return false
	case w.mode > 0:
		if w.polls > 0 {
			w.polls--
			return true
		}
		w.over = true
		return false
	}
	if !w.started {
		w.started = true
		w.budget, w.probe = s.budget()
	}
	if w.budget > 0 && time.Since(w.start) < w.budget {
		if w.counted {
			return true
		}
		if spinners.Add(1) <= spinLimit() {
			w.counted = true
			return true
		}
		spinners.Add(-1)
	}
	w.over = true
	w.pause()
	return false
}

// pause takes the waiter out of the spinners while it sleeps (another
// goroutine polls), or for good.
func (w *waiter) pause() {
	if w.counted {
		w.counted = false
		spinners.Add(-1)
	}
}

// sleep notes that the wait sleeps: on the completion channel, or while
// another goroutine polls.
func (w *waiter) sleep() {
	w.slept = true
	w.pause()
}

// done ends a wait that saw its condition (ok) or failed, and records its
// duration in s.
func (w *waiter) done(s *spinStats, ok bool) {
	w.pause()
	if w.mode != SpinAdaptive || !ok {
		return
	}
	s.record(time.Since(w.start), w.probe && !w.slept)
}

// spinLimit is how many goroutines of the process may spin at once.
func spinLimit() int32 { return int32(max(1, runtime.GOMAXPROCS(0)-1)) }

// budget returns how long the next wait may spin, and whether it is a
// probe.
func (s *spinStats) budget() (time.Duration, bool) {
	est := time.Duration(s.est.Load())
	if est > spinCap {
		if s.waits.Add(1)%probeEvery == 0 {
			return spinCap, true
		}
		return 0, false
	}
	return min(max(2*est, spinFloor), spinCap), false
}

// record adds the duration d of a wait to the average. A probe that
// found its completion while spinning replaces it: the waits are fast
// again.
func (s *spinStats) record(d time.Duration, reset bool) {
	d = min(d, sampleMax)
	if reset {
		s.est.Store(int64(d))
		return
	}
	est := s.est.Load()
	s.est.Store(est + (int64(d)-est)>>ewmaShift)
}
