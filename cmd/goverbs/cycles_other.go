//go:build !amd64

package main

import "time"

var cyclesBase = time.Now()

// cycles returns nanoseconds of the monotonic clock where there is no
// time-stamp counter to read.
func cycles() uint64 { return uint64(time.Since(cyclesBase)) }
