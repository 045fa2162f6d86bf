package verbs_test

import (
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// TestAtomicNoAlloc checks that the verbs layer's check of atomics keeps
// their data path free of allocations: a batch of a fetch-add and a
// compare-swap, Submit and Poll on soft0, and the single-request helper.
func TestAtomicNoAlloc(t *testing.T) {
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{})
	remote := p.B.Alloc(t, 64, verbs.AccessLocalWrite|verbs.AccessRemoteAtomic)
	res := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
	r0, r1 := verbstest.SGE(t, res, 0, 8), verbstest.SGE(t, res, 8, 8)
	batch := p.QA.NewBatch(2)
	wcs := make([]verbs.Completion, 2)
	var bad error
	wait := func(n int) {
		for got := 0; got < n && bad == nil; {
			k, err := p.A.CQ.Poll(wcs)
			if err != nil {
				bad = err
			}
			for _, wc := range wcs[:k] {
				if wc.Status != verbs.StatusSuccess && bad == nil {
					bad = &verbs.CompletionError{Status: wc.Status, WRID: wc.WRID}
				}
			}
			got += k
		}
	}
	allocs := testing.AllocsPerRun(200, func() {
		batch.FetchAdd(1, remote.Remote().At(0), 1, r0).Signaled()
		batch.CompareSwap(2, remote.Remote().At(8), 0, 0, r1).Signaled()
		if err := batch.Submit(); err != nil && bad == nil {
			bad = err
		}
		wait(2)
	})
	if bad != nil {
		t.Fatal(bad)
	}
	if allocs != 0 {
		t.Errorf("a batch of two atomics plus Poll allocates %v times per run, want 0", allocs)
	}
	allocs = testing.AllocsPerRun(200, func() {
		if err := p.QA.PostFetchAdd(3, verbs.Signaled, remote.Remote().At(16), 1, r0); err != nil && bad == nil {
			bad = err
		}
		wait(1)
	})
	if bad != nil {
		t.Fatal(bad)
	}
	if allocs != 0 {
		t.Errorf("PostFetchAdd plus Poll allocates %v times per run, want 0", allocs)
	}
}
