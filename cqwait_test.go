package verbs_test

import (
	"context"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// TestCQWaitAllocatesNothing: Wait on a CQ's own channel, then Poll,
// allocate nothing, nor do Wake and the Wait it ends (channel's sleeping waits go through it once per
// operation).
func TestCQWaitAllocatesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, err := dev.NewCompletionQueue(verbs.CQSpec{Entries: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	a, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	verbstest.ConnectRC(t, a, b)
	mr, err := pd.Alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	sge, err := mr.SGE(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	batch := a.NewBatch(1)
	wcs := make([]verbs.Completion, 1)
	var failed error
	allocs := testing.AllocsPerRun(200, func() {
		batch.Write(1, mr.Remote().At(1024), sge).Signaled()
		if err := batch.Submit(); err != nil && failed == nil {
			failed = err
		}
		if err := cq.Wait(ctx); err != nil && failed == nil {
			failed = err
		}
		if n, err := cq.Poll(wcs); (n != 1 || err != nil) && failed == nil {
			failed = err
			if failed == nil {
				failed = context.DeadlineExceeded
			}
		}
	})
	if failed != nil {
		t.Fatal(failed)
	}
	if allocs != 0 {
		t.Errorf("a write, Wait and Poll allocate %v times, want 0", allocs)
	}
	// A Wake and the Wait it ends (channel wakes its sleeping poller so).
	allocs = testing.AllocsPerRun(200, func() {
		if err := cq.Wake(); err != nil && failed == nil {
			failed = err
		}
		if err := cq.Wait(ctx); err != nil && failed == nil {
			failed = err
		}
	})
	if failed != nil {
		t.Fatal(failed)
	}
	if allocs != 0 {
		t.Errorf("Wake and Wait allocate %v times, want 0", allocs)
	}
}
