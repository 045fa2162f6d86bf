package verbs_test

import (
	"context"
	"errors"
	"fmt"
	"math"
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

// TestAdversarialQPSpecRanges creates queue pairs from QPSpec values
// outside the ranges of the attributes they become. Each must be refused
// at creation with EINVAL, not truncated to 8 bits (RetryCount 256 meant
// no retries, MaxRDAtomic 256 a QP that refuses every RDMA read) nor
// found only by Connect after the QP moved to RTR; the extremes of each
// range are accepted and connect.
func TestAdversarialQPSpecRanges(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	dev, err := a.Ctx.QueryDevice()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		spec verbs.QPSpec
	}{
		{"Timeout32", verbs.QPSpec{Timeout: 32}},
		{"Timeout254", verbs.QPSpec{Timeout: 254}},
		{"RetryCount8", verbs.QPSpec{RetryCount: 8}},
		{"RetryCount256", verbs.QPSpec{RetryCount: 256}},
		{"RetryCount-2", verbs.QPSpec{RetryCount: -2}},
		{"RNRRetry8", verbs.QPSpec{RNRRetry: 8}},
		{"RNRRetry256", verbs.QPSpec{RNRRetry: 256}},
		{"MinRNRTimer32", verbs.QPSpec{MinRNRTimer: 32}},
		{"MaxRDAtomic256", verbs.QPSpec{MaxRDAtomic: 256}},
		{"MaxRDAtomic-1", verbs.QPSpec{MaxRDAtomic: -1}},
		{"MaxRDAtomicAboveDevice", verbs.QPSpec{MaxRDAtomic: dev.MaxQPRDAtom + 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, err := a.PD.NewRCQueuePair(a.QPSpec(tc.spec))
			if err == nil {
				q.Close()
				t.Fatalf("NewRCQueuePair(%+v) succeeded", tc.spec)
			}
			var oe *verbs.OpError
			if !errors.Is(err, syscall.EINVAL) || !errors.As(err, &oe) {
				t.Errorf("NewRCQueuePair: %v, want an *OpError wrapping EINVAL", err)
			}
		})
	}
	t.Run("Extremes", func(t *testing.T) {
		for _, spec := range []verbs.QPSpec{
			{Timeout: 31, RetryCount: 7, RNRRetry: 7, MinRNRTimer: 31, MaxRDAtomic: dev.MaxQPRDAtom},
			{Timeout: verbs.TimeoutInfinite, RetryCount: -1, RNRRetry: -1, MinRNRTimer: 1, MaxRDAtomic: 1},
		} {
			qa, qb := a.NewRC(t, spec), b.NewRC(t, verbs.QPSpec{})
			verbstest.ConnectRC(t, qa, qb)
			at, err := qa.Query()
			if err != nil {
				t.Fatal(err)
			}
			if int(at.MaxRDAtomic) != spec.MaxRDAtomic || at.MinRNRTimer != spec.MinRNRTimer {
				t.Errorf("spec %+v: QP has max_rd_atomic %d, min_rnr_timer %d", spec, at.MaxRDAtomic, at.MinRNRTimer)
			}
		}
	})
}

// TestAdversarialSRQSpecLimit creates an SRQ with SRQSpec.Limit, which
// its doc says arms the low-watermark event: the limit must be armed (the
// provider's create ignores it, like ibv_create_srq) and the event must
// come once fewer receives remain; a limit that is negative or above the
// SRQ's depth is refused.
func TestAdversarialSRQSpecLimit(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	for _, spec := range []verbs.SRQSpec{{MaxWR: 16, Limit: -1}, {MaxWR: 16, Limit: 17}} {
		s, err := b.PD.NewSharedReceiveQueue(spec)
		if err == nil {
			s.Close()
			t.Errorf("NewSharedReceiveQueue(%+v) succeeded", spec)
		} else if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("NewSharedReceiveQueue(%+v): %v, want EINVAL", spec, err)
		}
	}
	srq := b.NewSRQ(t, verbs.SRQSpec{MaxWR: 16, Limit: 4})
	q, err := srq.Query()
	if err != nil {
		t.Fatal(err)
	}
	if q.Limit != 4 {
		t.Errorf("SRQ created with Limit 4 reports limit %d", q.Limit)
	}
	qa := a.NewRC(t, verbs.QPSpec{})
	qb := b.NewRC(t, verbs.QPSpec{SRQ: srq})
	verbstest.ConnectRC(t, qa, qb)
	bufs := b.Alloc(t, 8*64, verbs.AccessLocalWrite)
	for i := range 8 {
		if err := srq.PostRecv(uint64(i), verbstest.SGE(t, bufs, i*64, 64)); err != nil {
			t.Fatal(err)
		}
	}
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	for i := range 5 { // 3 < 4 receives left
		if err := qa.PostSend(uint64(i), verbs.Signaled, verbstest.SGE(t, src, 0, 16)); err != nil {
			t.Fatal(err)
		}
	}
	ctx := advCtx(t)
	if _, err := verbstest.PollN(ctx, a.CQ, 5); err != nil {
		t.Fatal(err)
	}
	if _, err := verbstest.PollN(ctx, b.CQ, 5); err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := b.Ctx.AsyncEvent(ctx)
		if err != nil {
			t.Fatalf("waiting for SRQ_LIMIT_REACHED of the limit set by SRQSpec.Limit: %v", err)
		}
		if ev.Type == verbs.EventSRQLimitReached {
			break
		}
	}
}

// TestAdversarialSRQOtherContext creates a queue pair whose QPSpec names
// an SRQ of another device context (its CQs are checked; the SRQ was
// not, and the provider accepted it): EINVAL.
func TestAdversarialSRQOtherContext(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true})
	srq := b.NewSRQ(t, verbs.SRQSpec{})
	for _, tr := range []string{"RC", "UD"} {
		var q interface{ Close() error }
		var err error
		if tr == "RC" {
			q, err = a.PD.NewRCQueuePair(a.QPSpec(verbs.QPSpec{SRQ: srq}))
		} else {
			q, err = a.PD.NewUDQueuePair(a.QPSpec(verbs.QPSpec{SRQ: srq}))
		}
		if err == nil {
			q.Close()
			t.Errorf("%s queue pair with an SRQ of another device context: created", tr)
		} else if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s queue pair with an SRQ of another device context: %v, want EINVAL", tr, err)
		}
	}
}

// TestAdversarialUDDestination posts UD sends to address handles that are
// closed (before the post, or between a batch's Send and its Submit) or
// belong to another protection domain: each fails with a typed error
// (ErrClosed, EINVAL) and never reaches the provider, which would use a
// destroyed AH; the requests of a batch before the bad one are posted
// and complete.
func TestAdversarialUDDestination(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true})
	qa, qb := a.NewUD(t, verbs.QPSpec{}), b.NewUD(t, verbs.QPSpec{})
	eb := verbstest.Endpoint(t, qb)
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := b.Alloc(t, 4*256, verbs.AccessLocalWrite)
	for i := range 4 {
		if err := qb.PostRecv(uint64(100+i), verbstest.SGE(t, dst, i*256, 256)); err != nil {
			t.Fatal(err)
		}
	}
	good := a.AddressHandle(t, qa, eb)
	closed, err := qa.AddressHandleTo(eb)
	if err != nil {
		t.Fatal(err)
	}
	if err := closed.Close(); err != nil {
		t.Fatal(err)
	}
	// An AH of another PD (here of the peer's device context).
	foreign := b.AddressHandle(t, qb, eb)
	sge := verbstest.SGE(t, src, 0, 8)
	data := []byte("datagram")
	to := func(ah *verbs.AddressHandle) verbs.Destination {
		return verbs.Destination{AH: ah, QPN: qb.QPN(), QKey: verbs.DefaultQKey}
	}
	for _, bad := range []struct {
		name string
		ah   *verbs.AddressHandle
		want error
	}{{"Closed", closed, verbs.ErrClosed}, {"OtherPD", foreign, syscall.EINVAL}} {
		d := to(bad.ah)
		for _, c := range []struct {
			op  string
			err error
		}{
			{"PostSend", qa.PostSend(1, verbs.Signaled, d, sge)},
			{"PostSendImm", qa.PostSendImm(1, verbs.Signaled, d, 7, sge)},
			{"PostSendInline", qa.PostSendInline(1, verbs.Signaled, d, data)},
			{"PostSendImmInline", qa.PostSendImmInline(1, verbs.Signaled, d, 7, data)},
			{"Batch.Send", func() error { bt := qa.NewBatch(1); bt.Send(1, d, sge).Signaled(); return bt.Submit() }()},
			{"Batch.SendInline", func() error { bt := qa.NewBatch(1); bt.SendInline(1, d, data).Signaled(); return bt.Submit() }()},
		} {
			if !errors.Is(c.err, bad.want) {
				t.Errorf("%s to an address handle %s: %v, want an error wrapping %v", c.op, bad.name, c.err, bad.want)
			}
		}
	}

	// Closed between Send and Submit: the request before it is posted.
	late, err := qa.AddressHandleTo(eb)
	if err != nil {
		t.Fatal(err)
	}
	bt := qa.NewBatch(4)
	bt.Send(1, to(good), sge).Signaled()
	bt.Send(2, to(late), sge).Signaled()
	bt.Send(3, to(good), sge).Signaled()
	if err := late.Close(); err != nil {
		t.Fatal(err)
	}
	err = bt.Submit()
	var pe *verbs.PostError
	if !errors.As(err, &pe) || pe.Posted != 1 || !errors.Is(err, verbs.ErrClosed) {
		t.Fatalf("Submit with the second request's address handle closed: %v, want a *PostError (1 posted) wrapping ErrClosed", err)
	}
	// Nothing of the failed posts went out: the one send posted is the
	// first to arrive, and completes.
	ctx := advCtx(t)
	wcs, err := verbstest.PollN(ctx, a.CQ, 1)
	if err != nil || wcs[0].WRID != 1 || wcs[0].Status != verbs.StatusSuccess {
		t.Fatalf("send completion %v, %v; want wr_id 1 success", wcs, err)
	}
	if err := qa.PostSend(4, verbs.Signaled, to(good), sge); err != nil {
		t.Fatal(err)
	}
	rwcs, err := verbstest.PollN(ctx, b.CQ, 2)
	if err != nil {
		t.Fatal(err)
	}
	for i, wc := range rwcs {
		if wc.Status != verbs.StatusSuccess || wc.WRID != uint64(100+i) || wc.ByteLen != 40+8 {
			t.Errorf("receive %d: %v, want wr_id %#x success, 48 bytes", i, wc, 100+i)
		}
	}
	if wcs, err := verbstest.PollN(ctx, a.CQ, 1); err != nil || wcs[0].WRID != 4 {
		t.Errorf("send completion %v, %v; want wr_id 4", wcs, err)
	}
}

// TestAdversarialHugeBatch asks for batches of absurd sizes: they must
// not exhaust memory (a batch of 2^40 requests was a fatal out-of-memory
// error), hold no more requests than any queue of the device, and work.
func TestAdversarialHugeBatch(t *testing.T) {
	verbstest.CheckLeaks(t)
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{})
	dev, err := p.A.Ctx.QueryDevice()
	if err != nil {
		t.Fatal(err)
	}
	src := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
	srq := p.B.NewSRQ(t, verbs.SRQSpec{})
	for _, n := range []int{1 << 40, 1<<63 - 1} {
		b := p.QA.NewBatch(n)
		if b.Cap() > dev.MaxQPWR {
			t.Errorf("NewBatch(%d): Cap %d, above the device's max_qp_wr %d", n, b.Cap(), dev.MaxQPWR)
		}
		rb := p.QB.NewRecvBatch(n)
		rb.Recv(uint64(n), verbstest.SGE(t, dst, 0, 64))
		if err := rb.Submit(); err != nil {
			t.Fatal(err)
		}
		b.Send(1, verbstest.SGE(t, src, 0, 8)).Signaled()
		if err := b.Submit(); err != nil {
			t.Fatal(err)
		}
		ctx := advCtx(t)
		if wcs, err := verbstest.PollN(ctx, p.A.CQ, 1); err != nil || wcs[0].Status != verbs.StatusSuccess {
			t.Fatalf("send of a huge batch: %v %v", wcs, err)
		}
		if wcs, err := verbstest.PollN(ctx, p.B.CQ, 1); err != nil || wcs[0].WRID != uint64(n) {
			t.Fatalf("receive of a huge batch: %v %v", wcs, err)
		}
		srb := srq.NewRecvBatch(n)
		srb.Recv(1, verbstest.SGE(t, dst, 0, 64))
		if err := srb.Submit(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAdversarialBytesAfterClose asks a closed MR from Alloc for its
// memory, as a careless program might: Close unmapped it, and the next
// Alloc may map other memory at the same address, so the slice must be
// empty rather than reach the unmapped (or another MR's) memory. The
// memory of an MR from Register is the caller's and stays available.
func TestAdversarialBytesAfterClose(t *testing.T) {
	verbstest.CheckLeaks(t)
	pd := verbstest.OpenPD(t, verbs.SoftDevice)
	mr, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := mr.Close(); err != nil {
		t.Fatal(err)
	}
	other, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if b := mr.Bytes(); len(b) != 0 {
		t.Errorf("Bytes of a closed MR from Alloc has %d bytes (aliasing the next MR's memory: %v), want none",
			len(b), &b[0] == &other.Bytes()[0])
	}
	buf := make([]byte, 4096)
	reg, err := pd.Register(buf, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := reg.Close(); err != nil {
		t.Fatal(err)
	}
	if b := reg.Bytes(); len(b) != len(buf) || &b[0] != &buf[0] {
		t.Errorf("Bytes of a closed MR from Register: %d bytes, want the caller's %d", len(b), len(buf))
	}
}

// TestAdversarialCloseUnderLoad closes a queue pair while goroutines post
// to it with every kind of call, then its CQ while goroutines poll and
// wait on it: every call fails with ErrClosed once the object is closed
// (never another error, a panic or a hang), and Close succeeds. Run it
// with -race.
func TestAdversarialCloseUnderLoad(t *testing.T) {
	closeUnderLoad(t, verbstest.Config{DeviceA: verbs.SoftDevice}, 1024, advTimeout)
}

// closeUnderLoad is TestAdversarialCloseUnderLoad on the nodes of cfg, with
// a send queue of maxSendWR, bounded by timeout (the hardware provider's
// test runs it too).
func closeUnderLoad(t *testing.T, cfg verbstest.Config, maxSendWR int, timeout time.Duration) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, cfg)
	cq := a.NewCQ(t, verbs.CQSpec{Entries: 4096})
	qa := a.NewRC(t, verbs.QPSpec{SendCQ: cq, MaxSendWR: maxSendWR})
	qb := b.NewRC(t, verbs.QPSpec{})
	verbstest.ConnectRC(t, qa, qb)
	src := a.Alloc(t, 4096, verbs.AccessLocalWrite)
	dst := b.Alloc(t, 4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	sge := verbstest.SGE(t, src, 0, 64)
	rem := dst.Remote().At(0)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()

	type result struct {
		who string
		err error
	}
	done := make(chan result, 16)
	// run calls f until it fails with something other than a full queue.
	run := func(who string, f func() error) {
		go func() {
			for {
				err := f()
				if err != nil && !errors.Is(err, verbs.ErrQueueFull) {
					done <- result{who, err}
					return
				}
				if ctx.Err() != nil {
					done <- result{who, ctx.Err()}
					return
				}
				runtime.Gosched()
			}
		}()
	}
	posters := map[string]func() error{
		"PostWrite":       func() error { return qa.PostWrite(1, 0, rem, sge) },
		"PostWriteInline": func() error { return qa.PostWriteInline(2, 0, rem, []byte("inline")) },
		"Inline SGE":      func() error { return qa.PostWrite(3, verbs.Inline, rem, verbstest.SGE(t, src, 0, 16)) },
		"PostRecv":        func() error { return qa.PostRecv(4, sge) },
		"Batch": func() error {
			bt := qa.NewBatch(4)
			bt.Write(5, rem, sge)
			bt.WriteInline(6, rem, []byte("x"))
			bt.Write(7, rem, sge).Signaled()
			return bt.Submit()
		},
		"RecvBatch": func() error { rb := qa.NewRecvBatch(2); rb.Recv(8, sge); return rb.Submit() },
		"Query":     func() error { _, err := qa.Query(); return err },
	}
	for who, f := range posters {
		run(who, f)
	}
	wcs := make([]verbs.Completion, 64)
	run("Poll", func() error { _, err := cq.Poll(wcs); return err })
	run("PollBusy", func() error { _, err := cq.PollBusy(make([]verbs.Completion, 8), 100); return err })
	run("Wait", func() error { return cq.Wait(ctx) })

	// Let every goroutine get going, then close the QP under them.
	if _, err := verbstest.PollN(ctx, cq, 1); err != nil {
		t.Fatal(err)
	}
	if err := qa.Close(); err != nil {
		t.Fatalf("close qp under load: %v", err)
	}
	for range len(posters) {
		r := <-done
		if !errors.Is(r.err, verbs.ErrClosed) {
			t.Errorf("%s on a queue pair closed under it: %v, want ErrClosed", r.who, r.err)
		}
	}
	if err := cq.Close(); err != nil {
		t.Fatalf("close cq under pollers: %v", err)
	}
	for range 3 {
		r := <-done
		if !errors.Is(r.err, verbs.ErrClosed) {
			t.Errorf("%s on a CQ closed under it: %v, want ErrClosed", r.who, r.err)
		}
	}
}

// TestAdversarialBadArguments passes arguments that the verbs layer
// refuses itself, before a provider sees them: each error must be an
// *OpError wrapping EINVAL, as the same argument refused by a provider
// (or by libibverbs) is, so that errors.Is tells a caller's mistake.
func TestAdversarialBadArguments(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true})
	chB := b.NewChannel(t)
	ch := a.NewChannel(t)
	ud := a.NewUD(t, verbs.QPSpec{})
	rc := a.NewRC(t, verbs.QPSpec{})
	udB := b.NewUD(t, verbs.QPSpec{})
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	bad := verbstest.Endpoint(t, udB)
	bad.QPN = 0 // malformed
	rcEnd := verbstest.Endpoint(t, b.NewRC(t, verbs.QPSpec{}))
	rcEnd.MTU = 0 // malformed
	keep := func(o interface{ Close() error }, err error) error {
		if err == nil {
			o.Close()
		}
		return err
	}
	for _, c := range []struct {
		name string
		err  error
	}{
		{"Alloc(0)", func() error { m, err := a.PD.Alloc(0, verbs.AccessLocalWrite); return keep(m, err) }()},
		{"Alloc(-1)", func() error { m, err := a.PD.Alloc(-1, verbs.AccessLocalWrite); return keep(m, err) }()},
		{"Register(nil)", func() error { m, err := a.PD.Register(nil, verbs.AccessLocalWrite); return keep(m, err) }()},
		{"CQ Entries -1", func() error { q, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{Entries: -1}); return keep(q, err) }()},
		{"CQ Channel and NoChannel", func() error {
			q, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{Channel: ch, NoChannel: true})
			return keep(q, err)
		}()},
		{"CQ Channel of another context", func() error {
			q, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{Channel: chB})
			return keep(q, err)
		}()},
		{"Connect malformed endpoint", rc.Connect(rcEnd)},
		{"AddressHandleTo malformed endpoint", func() error { ah, err := ud.AddressHandleTo(bad); return keep(ah, err) }()},
		{"UD PostSend without AH", ud.PostSend(1, verbs.Signaled, verbs.Destination{QPN: udB.QPN()}, verbstest.SGE(t, src, 0, 8))},
		{"UD Batch.Send without AH", func() error {
			bt := ud.NewBatch(1)
			bt.Send(1, verbs.Destination{QPN: udB.QPN()}, verbstest.SGE(t, src, 0, 8))
			return bt.Submit()
		}()},
	} {
		var oe *verbs.OpError
		if !errors.Is(c.err, syscall.EINVAL) || !errors.As(c.err, &oe) {
			t.Errorf("%s: %v, want an *OpError wrapping EINVAL", c.name, c.err)
		}
	}
	// The refused Connect left the QP usable.
	if st, err := rc.State(); err != nil || st != verbs.StateInit {
		t.Errorf("after a refused Connect the QP is %v (%v), want INIT", st, err)
	}
}

// TestAdversarialStatusClassString formats status classes outside the
// enum (a StatusClass is a plain int): String must name the value, not
// panic with an index out of range.
func TestAdversarialStatusClassString(t *testing.T) {
	for _, c := range []verbs.StatusClass{-1, verbs.ClassFatal + 1, 99} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("StatusClass(%d).String() panics: %v", int(c), r)
				}
			}()
			if s := c.String(); s != fmt.Sprintf("StatusClass(%d)", int(c)) {
				t.Errorf("StatusClass(%d).String() = %q", int(c), s)
			}
		}()
	}
	if s := verbs.ClassFlush.String(); s != "flushed" {
		t.Errorf("ClassFlush.String() = %q", s)
	}
}

// TestAdversarialCloseEndsPollBusy closes a CQ while another goroutine
// busy-polls it with a practically endless spin count: Close, which
// waits for the calls using the CQ, must end the PollBusy (ErrClosed)
// rather than wait for it forever.
func TestAdversarialCloseEndsPollBusy(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	cq, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{NoChannel: true})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		close(started)
		_, err := cq.PollBusy(make([]verbs.Completion, 4), math.MaxInt)
		done <- err
	}()
	<-started
	closed := make(chan error, 1)
	go func() { closed <- cq.Close() }()
	ctx := advCtx(t)
	for _, ch := range []chan error{closed, done} {
		select {
		case err := <-ch:
			if ch == closed && err != nil {
				t.Fatalf("close: %v", err)
			}
			if ch == done && !errors.Is(err, verbs.ErrClosed) {
				t.Errorf("PollBusy ended by Close: %v, want ErrClosed", err)
			}
		case <-ctx.Done():
			t.Fatal("Close of a CQ under an endless PollBusy hangs")
		}
	}
	// An empty slice returns at once (no endless spin); the CQ is
	// closed by now, which it says (TestPollEmptyAfterClose).
	if n, err := cq.PollBusy(nil, math.MaxInt); n != 0 || !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("PollBusy with an empty slice on a closed CQ: %d, %v, want 0, ErrClosed", n, err)
	}
}

// TestAdversarialFixedGIDIndex creates queue pairs whose QPSpec fixes a
// source GID index that is not in the port's GID table: creation must
// fail with EINVAL (it succeeded, and only Endpoint or Connect failed,
// with an error errors.Is could not tell); a valid index works.
func TestAdversarialFixedGIDIndex(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	table, err := a.Ctx.GIDTable(1)
	if err != nil || len(table) == 0 {
		t.Fatalf("gid table: %v, %d entries", err, len(table))
	}
	for _, idx := range []int{-1, 99, table[len(table)-1].Index + 1} {
		for _, tr := range []string{"RC", "UC", "UD"} {
			spec := verbs.QPSpec{SendCQ: a.CQ, FixedGID: true, GIDIndex: idx}
			var q interface{ Close() error }
			var err error
			switch tr {
			case "RC":
				q, err = a.PD.NewRCQueuePair(spec)
			case "UC":
				q, err = a.PD.NewUCQueuePair(spec)
			default:
				q, err = a.PD.NewUDQueuePair(spec)
			}
			if err == nil {
				q.Close()
				t.Errorf("%s queue pair with fixed GID index %d: created", tr, idx)
			} else if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("%s queue pair with fixed GID index %d: %v, want EINVAL", tr, idx, err)
			}
		}
	}
	qa := a.NewRC(t, verbs.QPSpec{FixedGID: true, GIDIndex: table[0].Index})
	qb := b.NewRC(t, verbs.QPSpec{})
	verbstest.ConnectRC(t, qa, qb)
	if e := verbstest.Endpoint(t, qa); e.GID != table[0].GID {
		t.Errorf("endpoint GID %v, want the fixed entry's %v", e.GID, table[0].GID)
	}
}

// TestAdversarialZeroBatch uses batches declared as zero values instead
// of made by NewBatch, as a careless program might: they hold nothing,
// so Submit must fail with ErrQueueFull, not panic.
func TestAdversarialZeroBatch(t *testing.T) {
	var sge verbs.SGE
	for _, c := range []struct {
		name string
		f    func() error
	}{
		{"RCBatch", func() error { var b verbs.RCBatch; b.Send(1, sge).Signaled(); return b.Submit() }},
		{"RCBatch inline", func() error { var b verbs.RCBatch; b.SendInline(1, []byte("x")).Signaled(); return b.Submit() }},
		{"UCBatch", func() error { var b verbs.UCBatch; b.Write(1, verbs.RemoteAddr{}, sge); return b.Submit() }},
		{"UDBatch", func() error { var b verbs.UDBatch; b.Send(1, verbs.Destination{}, sge).Signaled(); return b.Submit() }},
		{"RecvBatch", func() error { var b verbs.RecvBatch; b.Recv(1, sge); return b.Submit() }},
	} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s: panic: %v", c.name, r)
				}
			}()
			if err := c.f(); !errors.Is(err, verbs.ErrQueueFull) {
				t.Errorf("%s: Submit of a zero batch: %v, want ErrQueueFull", c.name, err)
			}
		}()
	}
}

// TestAdversarialCloseAHAndSRQUnderLoad closes an address handle while
// goroutines send datagrams to it (one at a time and in batches), and an
// SRQ while goroutines post receives to it: every call returns nil,
// ErrQueueFull or ErrClosed (never another error, a panic, or a
// destroyed AH reaching the provider), and once closed, ErrClosed.
func TestAdversarialCloseAHAndSRQUnderLoad(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	cq := a.NewCQ(t, verbs.CQSpec{Entries: 8192})
	qa := a.NewUD(t, verbs.QPSpec{SendCQ: cq, SignalAll: true, MaxSendWR: 1024})
	qb := b.NewUD(t, verbs.QPSpec{})
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	dst := b.Alloc(t, 4096, verbs.AccessLocalWrite)
	ah, err := qa.AddressHandleTo(verbstest.Endpoint(t, qb))
	if err != nil {
		t.Fatal(err)
	}
	srq, err := b.PD.NewSharedReceiveQueue(verbs.SRQSpec{MaxWR: 64})
	if err != nil {
		t.Fatal(err)
	}
	to := verbs.Destination{AH: ah, QPN: qb.QPN(), QKey: verbs.DefaultQKey}
	sge := verbstest.SGE(t, src, 0, 8)
	ctx := advCtx(t)
	type result struct {
		who string
		err error
	}
	done := make(chan result, 8)
	run := func(who string, f func() error) {
		go func() {
			for ctx.Err() == nil {
				if err := f(); err != nil && !errors.Is(err, verbs.ErrQueueFull) {
					done <- result{who, err}
					return
				}
				runtime.Gosched()
			}
			done <- result{who, ctx.Err()}
		}()
	}
	run("PostSend", func() error { return qa.PostSend(1, 0, to, sge) })
	run("PostSendInline", func() error { return qa.PostSendInline(2, 0, to, []byte("dgram")) })
	run("Batch", func() error {
		bt := qa.NewBatch(4)
		bt.Send(3, to, sge)
		bt.SendInline(4, to, []byte("x"))
		return bt.Submit()
	})
	run("SRQ PostRecv", func() error { return srq.PostRecv(5, verbstest.SGE(t, dst, 0, 64)) })
	run("SRQ RecvBatch", func() error { rb := srq.NewRecvBatch(2); rb.Recv(6, verbstest.SGE(t, dst, 64, 64)); return rb.Submit() })
	go func() { // drain the CQ so that posts keep going
		wcs := make([]verbs.Completion, 64)
		for ctx.Err() == nil {
			if _, err := cq.Poll(wcs); err != nil {
				return
			}
			runtime.Gosched()
		}
	}()
	if _, err := verbstest.PollN(ctx, cq, 1); err != nil { // the senders are going
		t.Fatal(err)
	}
	if err := ah.Close(); err != nil {
		t.Fatalf("close ah under senders: %v", err)
	}
	if err := srq.Close(); err != nil {
		t.Fatalf("close srq under posters: %v", err)
	}
	for range 5 {
		r := <-done
		if !errors.Is(r.err, verbs.ErrClosed) {
			t.Errorf("%s racing with Close: %v, want ErrClosed", r.who, r.err)
		}
	}
}

// TestAdversarialAddressHandleFromClosedQP asks a closed UD queue pair
// for an address handle: ErrClosed, not a new AH addressed from the
// closed QP's port and GID.
func TestAdversarialAddressHandleFromClosedQP(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	qb := b.NewUD(t, verbs.QPSpec{})
	q, err := a.PD.NewUDQueuePair(a.QPSpec(verbs.QPSpec{}))
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	ah, err := q.AddressHandleTo(verbstest.Endpoint(t, qb))
	if err == nil {
		ah.Close()
	}
	if !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("AddressHandleTo of a closed UD queue pair: %v, want ErrClosed", err)
	}
}

// TestZeroUDPostRealDestination: a zero UDQueuePair (never made by its
// constructor) is as good as closed with a real destination too: its
// sends and its batch's fail with ErrClosed. Before, they failed with
// EINVAL, "the destination's address handle belongs to another
// protection domain": the check of the destination took the zero pair's
// nil protection domain for another one.
func TestZeroUDPostRealDestination(t *testing.T) {
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	qa := a.NewUD(t, verbs.QPSpec{})
	qb := b.NewUD(t, verbs.QPSpec{})
	ah := a.AddressHandle(t, qa, verbstest.Endpoint(t, qb))
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	to := verbs.Destination{AH: ah, QPN: qb.QPN(), QKey: verbs.DefaultQKey}
	var z verbs.UDQueuePair
	for _, c := range []struct {
		what string
		f    func() error
	}{
		{"PostSend", func() error { return z.PostSend(1, verbs.Signaled, to, verbstest.SGE(t, src, 0, 8)) }},
		{"PostSendImm", func() error { return z.PostSendImm(1, verbs.Signaled, to, 7, verbstest.SGE(t, src, 0, 8)) }},
		{"PostSendInline", func() error { return z.PostSendInline(1, verbs.Signaled, to, []byte("abc")) }},
		{"PostSendImmInline", func() error { return z.PostSendImmInline(1, verbs.Signaled, to, 7, []byte("abc")) }},
		{"NewBatch.Send+Submit", func() error {
			bt := z.NewBatch(4)
			bt.Send(1, to, verbstest.SGE(t, src, 0, 8))
			return bt.Submit()
		}},
	} {
		if err := c.f(); !errors.Is(err, verbs.ErrClosed) {
			t.Errorf("%s of a zero UDQueuePair to an open address handle: %v, want ErrClosed", c.what, err)
		}
	}
}

// TestSRQGrantedSGEs: PostRecv of a shared receive queue takes as many
// SGEs as the queue was granted (Query's MaxSGE), as its RecvBatch does,
// and refuses one more. Before, it took as many as were asked: with
// MaxSGE -1 (none asked; soft0 grants one) it refused a 1-SGE receive
// that the queue's RecvBatch posted.
func TestSRQGrantedSGEs(t *testing.T) {
	a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	m := a.Alloc(t, 4096, verbs.AccessLocalWrite)
	for _, asked := range []int{-1, 1, 3} {
		t.Run(fmt.Sprintf("MaxSGE=%d", asked), func(t *testing.T) {
			s := a.NewSRQ(t, verbs.SRQSpec{MaxWR: 8, MaxSGE: asked})
			got, err := s.Query()
			if err != nil {
				t.Fatal(err)
			}
			if got.MaxSGE < 1 || got.MaxSGE > 8 {
				t.Fatalf("granted MaxSGE %d", got.MaxSGE)
			}
			sgl := make([]verbs.SGE, got.MaxSGE+1)
			for i := range sgl {
				sgl[i] = verbstest.SGE(t, m, 64*i, 64)
			}
			if err := s.PostRecv(1, sgl[:got.MaxSGE]...); err != nil {
				t.Errorf("PostRecv of %d SGEs, as granted: %v", got.MaxSGE, err)
			}
			rb := s.NewRecvBatch(1)
			rb.Recv(2, sgl[:got.MaxSGE]...)
			if err := rb.Submit(); err != nil {
				t.Errorf("a RecvBatch of %d SGEs, as granted: %v", got.MaxSGE, err)
			}
			if err := s.PostRecv(3, sgl...); !errors.Is(err, syscall.EINVAL) {
				t.Errorf("PostRecv of %d SGEs, one more than granted: %v, want EINVAL", len(sgl), err)
			}
		})
	}
}
