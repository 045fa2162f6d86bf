package collective_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/collective"
)

// TestBarrier: no rank leaves a barrier before every rank entered it,
// for every world size from 1 to 9 (butterflies for the powers of two,
// dissemination barriers for the others) and every position of the rank
// that enters last; each barrier's entries are counted before the call,
// and every rank checks the count after it.
func TestBarrier(t *testing.T) {
	for p := 1; p <= 9; p++ {
		for _, gather := range []bool{false, true} {
			if gather && p <= 2 {
				continue // gathers only from 3 ranks on
			}
			alg := collective.BarrierAlgorithm(p)
			if gather {
				alg = "gather"
			}
			testBarrier(t, p, gather, alg)
		}
	}
}

// testBarrier is TestBarrier on p ranks with the gathering barrier or not.
func testBarrier(t *testing.T, p int, gather bool, alg string) {
	t.Run(fmt.Sprintf("p=%d/%s", p, alg), func(t *testing.T) {
		cs := world(t, p, collective.Options{})
		// As the descriptors left it: every rank chose alike.
		for _, c := range cs {
			if got, want := c.BarrierAlgorithm(), cs[0].BarrierAlgorithm(); got != want {
				t.Fatalf("rank %d chose %q, rank 0 %q", c.Rank(), got, want)
			}
		}
		for _, c := range cs {
			collective.SetBarrierGather(c, gather)
			if got := c.BarrierAlgorithm(); got != alg {
				t.Fatalf("rank %d: algorithm %q, want %q", c.Rank(), got, alg)
			}
		}
		var entered [16]atomic.Int32 // per barrier
		n := 0
		for late := range p {
			for range 2 {
				b := &entered[n%len(entered)]
				b.Store(0)
				noErrors(t, fmt.Sprintf("barrier %d (rank %d late)", n, late), parallel(p, func(r int) error {
					if r == late {
						// Late enough that a barrier that does not
						// wait for it lets the others out first.
						time.Sleep(2 * time.Millisecond)
					}
					b.Add(1)
					if err := collective.Barrier(testCtx(t), cs[r]); err != nil {
						return err
					}
					if k := b.Load(); k != int32(p) {
						return fmt.Errorf("rank %d left the barrier when %d of %d ranks had entered", r, k, p)
					}
					return nil
				}))
				n++
			}
		}
	})
}
