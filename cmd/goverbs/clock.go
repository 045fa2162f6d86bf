package main

import "time"

// tickClock converts cycles() ticks to time, calibrated against the
// monotonic clock over a whole measurement: the loop itself reads only
// the counter (perftest reads the TSC too, but takes its rate from
// /proc/cpuinfo, which a VM may not report truly).
type tickClock struct {
	c0   uint64
	w0   time.Time
	nsPT float64 // nanoseconds per tick, set by stop
}

func startTicks() tickClock { return tickClock{w0: time.Now(), c0: cycles()} }

// stop calibrates the clock over the time since startTicks.
func (t *tickClock) stop() {
	c1 := cycles()
	w := time.Since(t.w0)
	if c1 > t.c0 && w > 0 {
		t.nsPT = float64(w) / float64(c1-t.c0)
	} else {
		t.nsPT = 1 // no counter progress: assume nanoseconds
	}
}

// dur converts a number of ticks (after stop).
func (t *tickClock) dur(ticks uint64) time.Duration { return time.Duration(float64(ticks) * t.nsPT) }
