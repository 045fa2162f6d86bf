//go:build !race

package soft

import "sync/atomic"

// Without the race detector the provider's accesses on behalf of requests
// (see dma_race.go) are plain copies and the CPU's atomics.

func dmaCopy(dst, src []byte) int { return copy(dst, src) }

func dmaFetchAdd(p *uint64, add uint64) uint64 { return atomic.AddUint64(p, add) - add }

func dmaCompareSwap(p *uint64, compare, swap uint64) uint64 {
	for {
		old := atomic.LoadUint64(p)
		if old != compare || atomic.CompareAndSwapUint64(p, old, swap) {
			return old
		}
	}
}

// raceDetector: this build has the race detector.
const raceDetector = false
