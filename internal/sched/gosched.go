package sched

import (
	"runtime"
	"sync/atomic"
)

// Gosched offers the processor to the process' other goroutines between
// two polls of a spinning wait, when that is needed: it is
// runtime.Gosched when the process runs goroutines on one processor
// (GOMAXPROCS 1), and nothing otherwise. With more processors a
// goroutine that becomes ready makes the runtime wake a thread for an
// idle processor, which runs it; and runtime.Gosched wakes such a thread
// itself every time it is called (the yielded goroutine goes to the
// global queue, for any processor to take), which finds nothing to do
// and sleeps again: a futex wake and two context switches per call. A
// session read between two processes over shared memory made 1.7-2.8
// futex calls and 4.7-6.3 context switches per read that way; without
// them 0.02-0.04 and 0.2-1.5, and the read's median went from 11-18 to
// 4-10 µs (examples/kv, reads only, three alternating runs).
//
// Only for spins that leave a processor to the rest of the process, and
// that let the process' goroutines run now and then all the same:
// channel's waits let fewer goroutines spin than there are processors,
// and call runtime.Gosched every few spins (a goroutine the
// spinner readied on its own processor otherwise waits for the end of
// the spin). Where the spinners may
// outnumber the processors (the ranks of a collective in one process)
// runtime.Gosched is what lets the others run before the runtime
// preempts the spinner, 10 ms later: the collective tests took 88 s
// instead of 37 with Gosched in their waits. Safe for concurrent use.
func Gosched() {
	if procs() == 1 {
		runtime.Gosched()
	}
}

// procsEvery is how many calls of procs use the GOMAXPROCS they cached
// before they read it again (runtime.GOMAXPROCS takes the scheduler's
// lock).
const procsEvery = 1024

var (
	procsCached atomic.Int32
	procsCalls  atomic.Uint32
)

// procs is GOMAXPROCS, read again every procsEvery calls.
func procs() int {
	if procsCalls.Add(1)%procsEvery == 1 || procsCached.Load() == 0 {
		procsCached.Store(int32(runtime.GOMAXPROCS(0)))
	}
	return int(procsCached.Load())
}
