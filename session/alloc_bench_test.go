package session_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/goverbs/verbs/session"
)

// BenchmarkAllocFree measures the hot path: Alloc and Free of a size
// whose class has a free slot (the bound: ≤ 100 ns, 0 allocs/op).
// The Parallel variants run the pair from every P at once.
func BenchmarkAllocFree(b *testing.B) {
	for _, size := range []int{64, 4 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("size=%s", sizeName(size)), func(b *testing.B) {
			a := newAllocator(b, session.AllocatorConfig{})
			warm(b, a, size)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				m, err := a.Alloc(size)
				if err != nil {
					b.Fatal(err)
				}
				if err := m.Free(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	// A baseline for ratios in the same run (the machine is shared):
	// Get and Put of a sync.Pool, the cheapest reuse Go offers.
	b.Run("baseline=sync.Pool", func(b *testing.B) {
		p := sync.Pool{New: func() any { return new([64]byte) }}
		p.Put(p.Get())
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			p.Put(p.Get())
		}
	})
	for _, size := range []int{64, 4 << 10} {
		b.Run(fmt.Sprintf("size=%s/parallel", sizeName(size)), func(b *testing.B) {
			a := newAllocator(b, session.AllocatorConfig{})
			warm(b, a, size)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					m, err := a.Alloc(size)
					if err != nil {
						b.Error(err)
						return
					}
					if err := m.Free(); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}
