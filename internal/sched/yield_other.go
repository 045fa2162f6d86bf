//go:build !linux

package sched

import "runtime"

// Yield offers the processor to other goroutines (other threads on Linux
// only).
func Yield() { runtime.Gosched() }
