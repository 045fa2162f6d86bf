package channel

import (
	"context"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// TestDoorbellsGrowWithRings: a queue pair starts with firstBells
// doorbell receives when its peer's extra rings wait (infinite
// receiver-not-ready retry, the default) and gains one at each ring up to
// Options.Doorbells; with a finite retry, under which a ring that finds
// no receive fails the pair, it gets all of them at once. Every ring
// arrives either way.
func TestDoorbellsGrowWithRings(t *testing.T) {
	pd := softPD(t)
	const bells = 16
	for _, tc := range []struct {
		name       string
		rnr        int
		first      int
		afterRings int // posted after 5 rings
	}{
		{"infinite retry", 0, firstBells, firstBells + 5},
		{"no retry", -1, bells, bells},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := Options{Doorbells: bells, SpinPolls: SpinNever}
			opts.QP.RNRRetry = tc.rnr
			var ms [2]*MultiChannel
			for i := range ms {
				var err error
				if ms[i], err = NewMulti(pd, 2, i, opts); err != nil {
					t.Fatal(err)
				}
				defer ms[i].Close()
			}
			e0, err := ms[0].Endpoints()
			if err != nil {
				t.Fatal(err)
			}
			e1, err := ms[1].Endpoints()
			if err != nil {
				t.Fatal(err)
			}
			// Peer j's entry for i is what i connects to.
			if err := ms[0].Connect([]verbs.Endpoint{{}, e1[0]}); err != nil {
				t.Fatal(err)
			}
			if err := ms[1].Connect([]verbs.Endpoint{e0[1], {}}); err != nil {
				t.Fatal(err)
			}
			p := ms[0].e.peers[1]
			if got := int(p.rqUsed.Load()); got != tc.first {
				t.Fatalf("%d doorbell receives posted at connect, want %d", got, tc.first)
			}
			mr, err := pd.Alloc(64, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
			if err != nil {
				t.Fatal(err)
			}
			defer mr.Close()
			src, err := mr.SGE(0, 8)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // hang guard
			defer cancel()
			for i := range 5 {
				if err := ms[1].Peer(0).WriteImm(ctx, mr.Remote().At(8), uint32(i), src); err != nil {
					t.Fatal(err)
				}
				if err := ms[0].Wait(ctx, func() bool { return ms[0].Rung() == uint64(i+1) }); err != nil {
					t.Fatalf("ring %d: %v", i, err)
				}
			}
			if got := int(p.rqUsed.Load()); got != tc.afterRings {
				t.Errorf("%d doorbell receives posted after 5 rings, want %d", got, tc.afterRings)
			}
		})
	}
}
