package verbs_test

import (
	"context"
	"errors"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// advTimeout bounds every wait of these tests: a hang guard, not a timed
// assertion.
const advTimeout = 30 * time.Second

func advCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), advTimeout)
	t.Cleanup(cancel)
	return ctx
}

// TestAdversarialRequestOutlivesBatch keeps a *Request whose batch the
// program dropped, lets the garbage collector run the batch's cleanup, and
// then uses the request, as a careless program might: the modifier must
// not write into the batch's freed memory, which a new batch reuses (it
// would make that batch's unsignaled send signaled), nor fault.
func TestAdversarialRequestOutlivesBatch(t *testing.T) {
	verbstest.CheckLeaks(t)
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{})
	src := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
	stale := p.QA.NewBatch(1).Send(1, verbstest.SGE(t, src, 0, 8)) // the batch is dropped here
	for range 10 {
		runtime.GC()
		time.Sleep(time.Millisecond) // let the cleanup goroutine run
	}
	b := p.QA.NewBatch(1)
	b.Send(2, verbstest.SGE(t, src, 0, 8)) // unsignaled
	stale.Signaled().Fenced()              // must not touch b's request
	for i := range 2 {
		if err := p.QB.PostRecv(uint64(100+i), verbstest.SGE(t, dst, 0, 64)); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Submit(); err != nil {
		t.Fatal(err)
	}
	if err := p.QA.PostSend(3, verbs.Signaled, verbstest.SGE(t, src, 0, 8)); err != nil {
		t.Fatal(err)
	}
	wcs, err := verbstest.PollN(advCtx(t), p.A.CQ, 1)
	if err != nil {
		t.Fatal(err)
	}
	if wcs[0].WRID != 3 || wcs[0].Status != verbs.StatusSuccess {
		t.Errorf("first send completion %v, want wr_id 0x3 success: the unsignaled send 2 was made signaled through a stale Request", wcs[0])
	}
	if _, err := verbstest.PollN(advCtx(t), p.B.CQ, 2); err != nil {
		t.Fatal(err)
	}
}

var _ = errors.Is
var _ = syscall.EINVAL
