package verbs_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// pollBusyN calls PollBusy until it returns completions, failing when ctx
// ends first.
func pollBusyN(ctx context.Context, cq *verbs.CompletionQueue, wcs []verbs.Completion, spins int) (int, error) {
	for {
		n, err := cq.PollBusy(wcs, spins)
		if n > 0 || err != nil {
			return n, err
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
	}
}

func TestPollBusy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := newBenchPair(t, 4096)
	wcs := make([]verbs.Completion, 8)

	// An empty CQ: every spins value, including 0 and negative ones (one
	// poll), returns 0 and no error; so does an empty dst.
	for _, spins := range []int{-1, 0, 1, 100} {
		if n, err := p.cqA.PollBusy(wcs, spins); n != 0 || err != nil {
			t.Errorf("PollBusy(empty CQ, spins %d) = %d, %v; want 0, nil", spins, n, err)
		}
	}
	if n, err := p.cqA.PollBusy(nil, 10); n != 0 || err != nil {
		t.Errorf("PollBusy(nil dst) = %d, %v; want 0, nil", n, err)
	}

	// Three signaled writes: PollBusy returns them, never more than dst
	// holds, in order, and the data landed.
	remote := p.dst.Remote()
	batch := p.a.NewBatch(3)
	for i := range 3 {
		batch.Write(uint64(10+i), remote.At(uint64(i*64)), p.chunks[i]).Signaled()
	}
	if err := batch.Submit(); err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for len(got) < 3 {
		n, err := pollBusyN(ctx, p.cqA, wcs[:2], 1000)
		if err != nil {
			t.Fatal(err)
		}
		if n > 2 {
			t.Fatalf("PollBusy into 2 slots returned %d", n)
		}
		for _, c := range wcs[:n] {
			if err := c.Err(); err != nil {
				t.Fatal(err)
			}
			got = append(got, c.WRID)
		}
	}
	if len(got) != 3 || got[0] != 10 || got[1] != 11 || got[2] != 12 {
		t.Errorf("completions %v, want [10 11 12]", got)
	}
	if string(p.dst.Bytes()[:192]) != string(p.src.Bytes()[:192]) {
		t.Error("the writes did not land")
	}
	if n, err := p.cqA.PollBusy(wcs, 10); n != 0 || err != nil {
		t.Errorf("PollBusy after draining = %d, %v; want 0, nil", n, err)
	}

	// A closed CQ fails with ErrClosed instead of reaching the provider.
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	cq, err := dev.NewCompletionQueue(verbs.CQSpec{NoChannel: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := cq.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cq.PollBusy(wcs, 10); !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("PollBusy on a closed CQ: %v, want ErrClosed", err)
	}
}

// A completion that Wait found (and keeps for the next poll) is returned
// by PollBusy first.
func TestPollBusyAfterWait(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A QP whose CQ is waitable (verbstest's nodes use the default
	// CQSpec) writes to a peer QP.
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{MaxSendWR: 4, MaxRecvWR: 4})
	qp, cq := p.QA, p.A.CQ
	src := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := p.B.Alloc(t, 64, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	for i := range 2 {
		if err := qp.PostWrite(uint64(20+i), verbs.Signaled, dst.Remote().At(0), verbstest.SGE(t, src, 0, 64)); err != nil {
			t.Fatal(err)
		}
	}
	if err := cq.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	wcs := make([]verbs.Completion, 4)
	var got []uint64
	for len(got) < 2 {
		n, err := pollBusyN(ctx, cq, wcs, 100)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range wcs[:n] {
			if err := c.Err(); err != nil {
				t.Fatal(err)
			}
			got = append(got, c.WRID)
		}
	}
	if len(got) != 2 || got[0] != 20 || got[1] != 21 {
		t.Errorf("completions %v, want [20 21]", got)
	}
}

// A busy-polling loop (Submit, then PollBusy until the completion) does
// not allocate.
func TestPollBusyNoAlloc(t *testing.T) {
	p := newBenchPair(t, 16*64)
	batch := p.a.NewBatch(16)
	wcs := make([]verbs.Completion, 16)
	remote := p.dst.Remote()
	var err error
	allocs := testing.AllocsPerRun(200, func() {
		for i := range 16 {
			r := batch.Write(uint64(i), remote.At(uint64(i*64)), p.chunks[i])
			if i == 15 {
				r.Signaled()
			}
		}
		if e := batch.Submit(); e != nil {
			err = e
			return
		}
		for {
			n, e := p.cqA.PollBusy(wcs, 64)
			if e != nil {
				err = e
				return
			}
			if n > 0 {
				return
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if allocs != 0 {
		t.Errorf("a batch of 16 writes plus PollBusy allocates %v times per run, want 0", allocs)
	}
}
