//go:build ibverbs && linux && cgo

package ibv_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/ibv"
)

// BenchmarkCgoCrossing measures one cgo crossing (ibv.CgoNop: into C and
// back, nothing done there), the unit of the hardware provider's data-path
// cost, in two situations:
//
//   - hot: crossing after crossing, as in a loop that polls an empty CQ;
//   - after-syscall: the first crossing after a system call that did real
//     kernel work (a 64 KiB pipe round trip), as a Submit or Poll right
//     after rxe's doorbell, which runs the protocol in the kernel. The
//     benchmark reports the crossing alone (ns/crossing): the same loop
//     without it is measured too and subtracted.
//
// On hardware and in a KVM guest both cost tens of nanoseconds; under
// QEMU's TCG emulation (the VM tier) the second costs microseconds,
// because the kernel's work evicts the emulator's translation caches and
// the runtime's path into C has to be looked up again. scripts/vm/compare.sh
// runs this in the same boot as the goverbs/perftest comparison.
func BenchmarkCgoCrossing(b *testing.B) {
	b.Run("hot", func(b *testing.B) {
		for b.Loop() {
			ibv.CgoNop()
		}
	})
	b.Run("after-syscall", func(b *testing.B) {
		var p [2]int
		if err := syscall.Pipe(p[:]); err != nil {
			b.Fatal(err)
		}
		defer syscall.Close(p[0])
		defer syscall.Close(p[1])
		buf := make([]byte, 16<<10)
		kernelWork := func() {
			for range 4 {
				if _, err := syscall.Write(p[1], buf); err != nil {
					b.Fatal(err)
				}
				for n := 0; n < len(buf); {
					m, err := syscall.Read(p[0], buf[n:])
					if err != nil {
						b.Fatal(err)
					}
					n += m
				}
			}
		}
		var with, without time.Duration
		n := 0
		for b.Loop() {
			kernelWork()
			t0 := time.Now()
			ibv.CgoNop()
			with += time.Since(t0)
			kernelWork()
			t0 = time.Now()
			without += time.Since(t0)
			n++
		}
		b.ReportMetric(float64(with-without)/float64(n), "ns/crossing")
	})
}
