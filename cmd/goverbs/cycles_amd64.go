package main

// cycles returns the CPU's time-stamp counter (RDTSC), as perftest's
// get_cycles does: a timestamp that costs a few nanoseconds even where
// reading the clock does not (a VM whose clock source is the HPET).
//
//go:noescape
func cycles() uint64
