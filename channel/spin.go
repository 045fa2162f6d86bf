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
// A wait either spins, for at most spinCap, and then sleeps on the
// completion channel if its completion has not come; or sleeps at once.
// The engine keeps, for each of the two, an exponentially weighted moving
// average (weight 1/8) of how long its recent waits took, wake-ups
// included, and uses the one that costs less, trying the other now and
// then so that its average stays current: at the probeMin-th wait first,
// then at gaps that double up to probeMax. A probe replaces the average of
// the way it tries, which is old by then; if it was a lucky one, the
// waits that follow correct it. Before any sleeping wait, spinning is chosen. For a
// client that waits for one request at a time the average wait is the
// inverse of its throughput, so this keeps whichever serves it faster:
//
//   - Spinning is chosen only if it saves at least a quarter of a
//     sleeping wait: when waits are long both cost about the same, and
//     sleeping does not burn a processor for it.
//   - When the spinning waits average more than spinLong, the waits are
//     long, or spinning does not get the processor time that would
//     complete them (more spinners than cores, in this process or in
//     others): sleeping is chosen whatever its average.
//   - A spinning wait gives up after spinCap, about twice what a sleep
//     costs over a spin on an idle machine (the two wake-ups of the
//     completion channel, see the package documentation): spinning
//     longer for a completion that may be far away costs more than it
//     can save, the rule of the ski rental. Bounded spinning also bounds
//     what spinners take from the goroutines and processes that would
//     complete them: a spinner whose processor is wanted is descheduled
//     for a whole time slice, and pays for it again when it sleeps.
//   - Between polls a spinning wait offers its processor to the threads
//     ready to run on it (runtime.Gosched for goroutines, every
//     goschedSpins spins or goschedGap, or at every one when the process
//     has one processor: with more, runtime.Gosched wakes an idle processor's
//     thread at every call, for nothing most of the time; then
//     sched_yield, sched.Yield), and with nothing else ready goes on at
//     once. The thread that would complete the wait, the peer's or the
//     provider's, may be one of them: after waits that slept, the
//     scheduler often wakes the peer on the spinner's processor (it
//     suits threads that wake each other in turn), where it used to wait
//     for the spinner's time slice to end. The first spinning wait after
//     sleeping ones took 88 µs on average that way (soft0 across
//     processes, against 9 µs once spinning went on), so that probes of
//     spinning lost to sleeping (75 µs) where spinning is four times
//     faster; a spinning wait that hit spinCap slept, and made the next
//     one cold in turn.
//   - A wait spins only while fewer than max(1, GOMAXPROCS-1) goroutines
//     of the process spin (every channel of the process counts), so that
//     the goroutines that make the progress waited for, and a peer on
//     the same host, keep a processor.
const (
	spinCap    = 50 * time.Microsecond
	spinLong   = 4 * spinCap
	spinMargin = 4                     // spinning must save a quarter of a sleeping wait
	sampleMax  = 10 * time.Millisecond // a longer wait counts as this long
	probeMin   = 16                    // waits between probes, at first
	probeMax   = 512                   // waits between probes, after many that changed nothing
	ewmaShift  = 3                     // weight 1/8
	probeShift = 0                     // a probe replaces the average: it is old
)

// spinners counts the goroutines of the process that spin in an
// adaptive wait, over every channel: processors are a resource of the
// process, not of one channel.
var spinners atomic.Int32

// spinStats is an engine's record of its waits. Updates from concurrent
// waits may overwrite each other: they are estimates.
type spinStats struct {
	spin  atomic.Int64  // EWMA of the durations of waits that spun, ns
	sleep atomic.Int64  // EWMA of the durations of waits that slept at once, ns
	waits atomic.Uint32 // adaptive waits that chose
	next  atomic.Uint32 // the wait that probes next
	gap   atomic.Uint32 // waits between probes
}

// waiter is the spinning state of one wait (on the waiting goroutine's
// stack).
type waiter struct {
	mode    int // Options.SpinPolls
	polls   int // SpinPolls > 0: empty polls left
	start   time.Time
	budget  time.Duration // adaptive: 0 sleeps at once
	chose   bool          // adaptive: the budget was chosen
	probe   bool          // adaptive: the choice was a probe
	counted bool          // counted in spinners
	spun    bool          // the wait spun
	limited bool          // too many spinners: it slept without choosing to
	other   bool          // it slept while another goroutine polled
	over    bool          // the spin phase is over
}

func newWaiter(mode int) waiter {
	return waiter{mode: mode, polls: mode, start: time.Now()}
}

// spin reports whether the poller should poll again (after yielding the
// processor) rather than sleep on the completion channel; now is the
// time (the caller's clock read, which it uses for its yields too). Once
// it said no, it says no until the wait ends.
func (w *waiter) spin(s *spinStats, now time.Time) bool {
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
	if !w.chose {
		w.chose = true
		w.budget, w.probe = s.budget()
	}
	if w.budget > 0 && now.Sub(w.start) < w.budget {
		if w.counted {
			return true
		}
		if spinners.Add(1) <= spinLimit() {
			w.counted, w.spun = true, true
			return true
		}
		spinners.Add(-1)
		w.limited = !w.spun
	}
	w.over = true
	w.pause()
	return false
}

// pause takes the waiter out of the spinners.
func (w *waiter) pause() {
	if w.counted {
		w.counted = false
		spinners.Add(-1)
	}
}

// yield notes that the wait sleeps while another goroutine polls.
func (w *waiter) yield() {
	w.other = true
	w.pause()
}

// done ends a wait that saw its condition (ok) or failed, and records
// its duration in s.
func (w *waiter) done(s *spinStats, ok bool) {
	w.pause()
	if w.mode != SpinAdaptive || !ok || !w.chose || w.limited || w.other {
		return // not a choice of this wait's own, or nothing learnt
	}
	d := min(time.Since(w.start), sampleMax)
	shift := ewmaShift
	if w.probe {
		shift = probeShift // the average of the way not chosen is old
	}
	if w.budget > 0 {
		record(&s.spin, d, shift)
	} else {
		record(&s.sleep, d, shift)
	}
	if w.probe {
		s.probed()
	}
}

// spinLimit is how many goroutines of the process may spin at once.
func spinLimit() int32 { return int32(max(1, runtime.GOMAXPROCS(0)-1)) }

// budget returns how long the next wait may spin, spinCap or 0 (sleep at
// once), and whether that is a probe of the way not chosen.
func (s *spinStats) budget() (time.Duration, bool) {
	useSpin := s.spinWins()
	n := s.waits.Add(1)
	next := s.next.Load()
	if next == 0 { // the first wait
		s.next.CompareAndSwap(0, n+probeMin)
	}
	probe := next != 0 && int32(n-next) >= 0
	if probe {
		s.next.Store(n + max(s.gap.Load(), probeMin))
		useSpin = !useSpin
	}
	if useSpin {
		return spinCap, probe
	}
	return 0, probe
}

// spinWins reports whether spinning is the way that costs less.
func (s *spinStats) spinWins() bool {
	spin, sleep := s.spin.Load(), s.sleep.Load()
	return spin <= int64(spinLong) && (sleep == 0 || spin <= sleep-sleep/spinMargin)
}

// probed doubles the gap between probes, up to probeMax. A probe that
// changes the choice does not bring them back: the waits of the new
// choice keep its average current, and switch back by themselves if it
// was a lucky probe, while frequent probes would keep switching to the
// worse way for a few waits at a time.
func (s *spinStats) probed() {
	s.gap.Store(min(2*max(s.gap.Load(), probeMin), probeMax))
}

// record adds d to the average a with weight 2^-shift (its first sample
// replaces it).
func record(a *atomic.Int64, d time.Duration, shift int) {
	v := a.Load()
	if v == 0 {
		a.Store(int64(d))
		return
	}
	a.Store(v + (int64(d)-v)>>shift)
}
