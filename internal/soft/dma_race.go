//go:build race

package soft

import (
	"sync"
	"unsafe"
)

// The provider's own accesses to registered memory on behalf of a request
// (a peer's write, read or atomic, a receive's scatter) stand for a NIC's
// DMA, which the race detector does not see. Applications synchronize
// with them as RDMA requires, through completions and the messages of
// their peers, and the detector can follow neither across processes nor
// through a peer's service goroutine; so in race builds these accesses are
// kept out of its sight, for Go memory (Register) as they are for memory
// outside the Go heap (Alloc), which it never watches.

// dmaCopy is copy(dst, src) unseen by the race detector.
//
//go:norace
func dmaCopy(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n == 0 {
		return 0
	}
	d, s := unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0])
	if uintptr(d) > uintptr(s) && uintptr(d) < uintptr(s)+uintptr(n) {
		// Overlapping, destination after the source: backwards.
		for i := n - 1; i >= 0; i-- {
			*(*byte)(unsafe.Add(d, i)) = *(*byte)(unsafe.Add(s, i))
		}
		return n
	}
	i := 0
	for ; i+8 <= n; i += 8 {
		*(*uint64)(unsafe.Add(d, i)) = *(*uint64)(unsafe.Add(s, i))
	}
	for ; i < n; i++ {
		*(*byte)(unsafe.Add(d, i)) = *(*byte)(unsafe.Add(s, i))
	}
	return n
}

// dmaMu makes the provider's atomics on Go memory atomic among themselves
// (verbs promises no more: IBV_ATOMIC_HCA).
var dmaMu sync.Mutex

// dmaFetchAdd adds to the word at p and returns its old value.
func dmaFetchAdd(p *uint64, add uint64) uint64 {
	dmaMu.Lock()
	old := dmaLoad(p)
	dmaStore(p, old+add)
	dmaMu.Unlock()
	return old
}

// dmaCompareSwap stores swap at p if it holds compare, and returns the
// old value.
func dmaCompareSwap(p *uint64, compare, swap uint64) uint64 {
	dmaMu.Lock()
	old := dmaLoad(p)
	if old == compare {
		dmaStore(p, swap)
	}
	dmaMu.Unlock()
	return old
}

//go:norace
func dmaLoad(p *uint64) uint64 { return *p }

//go:norace
func dmaStore(p *uint64, v uint64) { *p = v }

// raceDetector: this build has the race detector.
const raceDetector = true
