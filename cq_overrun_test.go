package verbs_test

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// TestAdversarialCQOverrunDevices overruns a send CQ: more signaled
// writes complete than it holds, none polled. On every device the CQ
// then says so: Poll fails with an error wrapping EOVERFLOW (CQSpec: a CQ
// that overflows enters an error state), and the context's async events
// report CQ_ERR naming it. Before, on rxe the kernel dropped the
// completions it had no room for and raised the event, which nobody
// read: Poll went on returning what the CQ held, as if no completion had
// been lost.
func TestAdversarialCQOverrunDevices(t *testing.T) {
	t.Run(verbs.SoftDevice, func(t *testing.T) {
		cqOverrun(t, verbstest.Config{DeviceA: verbs.SoftDevice, DeviceB: verbs.SoftDevice, SeparateContexts: true})
	})
	devs := vmtest.Devices()
	if len(devs) < 2 {
		return // the VM's rxe devices: see the VM tier
	}
	for _, m := range advModes {
		t.Run(devs[0]+"/"+m.name, func(t *testing.T) {
			m.set(t)
			cqOverrun(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
		})
	}
}

// advMode is a data path of the hardware provider, chosen when a device
// is opened: the classic calls (ibv_post_send, ibv_poll_cq) or the
// extended ones (ibv_wr_*, ibv_start_poll).
type advMode struct{ name, on string }

var advModes = []advMode{{"classic", "0"}, {"ex", "1"}}

// set makes the devices opened by t (until its end) use the data path.
func (m advMode) set(t *testing.T) {
	t.Setenv("GOVERBS_IBV_WR_API", m.on)
	t.Setenv("GOVERBS_IBV_CQ_EX", m.on)
}

func cqOverrun(t *testing.T, cfg verbstest.Config) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, cfg)
	cq := a.NewCQ(t, verbs.CQSpec{Entries: 4, NoChannel: true})
	qa := a.NewRC(t, verbs.QPSpec{SendCQ: cq, RecvCQ: a.CQ, MaxSendWR: 64})
	qb := b.NewRC(t, verbs.QPSpec{})
	verbstest.ConnectRC(t, qa, qb)
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := b.Alloc(t, 64, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	n := cq.Cap() + 8
	for i := range n {
		if err := qa.PostWrite(uint64(i), verbs.Signaled, dst.Remote().At(0), src.All()); err != nil {
			t.Fatalf("write %d of %d: %v", i, n, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ev, err := a.Ctx.AsyncEvent(ctx)
	if err != nil {
		t.Fatalf("async event: %v, want CQ_ERR", err)
	}
	if ev.Type != verbs.EventCQError {
		t.Errorf("async event %v, want CQ_ERR", ev.Type)
	}
	// Poll fails from now on; what it returned before the overrun
	// (the CQ's capacity at most) is all it ever returns.
	var wcs [64]verbs.Completion
	got := 0
	for {
		k, err := cq.Poll(wcs[:])
		if err != nil {
			if !errors.Is(err, syscall.EOVERFLOW) {
				t.Fatalf("poll after %d completions: %v, want EOVERFLOW", got, err)
			}
			t.Logf("poll after %d completions of %d writes (CQ of %d): %v", got, n, cq.Cap(), err)
			break
		}
		got += k
		if got > cq.Cap() {
			t.Fatalf("polled %d completions from a CQ of %d that overran: %v", got, cq.Cap(), wcs[:k])
		}
		if k == 0 && ctx.Err() != nil {
			t.Fatalf("poll still succeeds (%d completions of %d writes, CQ of %d) after the overrun", got, n, cq.Cap())
		}
	}
}
