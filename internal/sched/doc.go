// Package sched offers the processor to other threads while a goroutine
// spins: Yield is sched_yield on Linux. runtime.Gosched only lets the
// process' own goroutines run; when processes outnumber processors, the
// thread that would end the spin (a peer process, or a reader of the same
// process on another thread) waits for the spinner's time slice unless it
// yields. Gosched is runtime.Gosched for spinning waits: only when the
// process has one processor (see Gosched for why not otherwise). Safe
// for concurrent use.
package sched
