package verbstest

import (
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// expectQueueFull checks that err reports a full queue.
func expectQueueFull(t testing.TB, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want an error matching verbs.ErrQueueFull", what)
	} else if !errors.Is(err, verbs.ErrQueueFull) {
		t.Errorf("%s: %v, want an error matching verbs.ErrQueueFull", what, err)
	}
}

// expectPartialPost checks that err is a *PostError that accepted posted
// requests and reports a full queue.
func expectPartialPost(t testing.TB, what string, err error, posted int) {
	t.Helper()
	expectQueueFull(t, what, err)
	var pe *verbs.PostError
	if err != nil && !errors.As(err, &pe) {
		t.Errorf("%s: %v is not a *verbs.PostError", what, err)
	} else if pe != nil && pe.Posted != posted {
		t.Errorf("%s: PostError.Posted = %d, want %d", what, pe.Posted, posted)
	}
}

// testSendQueueFull fills the send queue with sends that cannot complete
// (the peer has no receive posted and RNR retries are unlimited), checks
// that one more is refused with ErrQueueFull, then posts receives at the
// peer and checks that every send completes and frees its slot.
func testSendQueueFull(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxSendWR: 16, RNRRetry: 7, MinRNRTimer: 1})
	depth := p.QA.Cap().MaxSendWR
	if depth < 16 {
		t.Fatalf("QP granted max_send_wr %d, want at least the 16 requested", depth)
	}
	src := p.A.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0xA1)
	for i := range depth - 1 {
		must(t, fmt.Sprintf("post send %d of %d", i+1, depth), p.QA.PostSend(uint64(i), verbs.Signaled, SGE(t, src, 0, 8)))
	}
	// A batch of two with room for one: the first is accepted.
	b := p.QA.NewBatch(2)
	b.Send(uint64(depth-1), SGE(t, src, 0, 8)).Signaled()
	b.Send(uint64(depth), SGE(t, src, 0, 8)).Signaled()
	expectPartialPost(t, "batch of 2 with one free slot", b.Submit(), 1)
	expectQueueFull(t, "post send to a full queue", p.QA.PostSend(uint64(depth), verbs.Signaled, SGE(t, src, 0, 8)))

	// Let the sends complete.
	dst := p.B.Alloc(t, depth*8, accessLocal)
	rb := p.QB.NewRecvBatch(depth)
	for i := range depth {
		rb.Recv(uint64(1000+i), SGE(t, dst, i*8, 8))
	}
	must(t, "post receives", rb.Submit())
	for i, wc := range c.poll(t, p.A.CQ, depth) {
		expectOK(t, fmt.Sprintf("send completion %d", i), wc, uint64(i), verbs.OpSend, p.QA.QPN())
	}
	for i, wc := range c.poll(t, p.B.CQ, depth) {
		expectOK(t, fmt.Sprintf("recv completion %d", i), wc, uint64(1000+i), verbs.OpRecv, p.QB.QPN())
		expectByteLen(t, fmt.Sprintf("recv completion %d", i), wc, 8)
	}
	// Completed requests free their slots.
	must(t, "post recv", p.QB.PostRecv(2000, SGE(t, dst, 0, 8)))
	must(t, "post send after the queue drained", p.QA.PostSend(2001, verbs.Signaled, SGE(t, src, 0, 8)))
	expectOK(t, "send completion after drain", c.pollOne(t, p.A.CQ), 2001, verbs.OpSend, p.QA.QPN())
	expectOK(t, "recv completion after drain", c.pollOne(t, p.B.CQ), 2000, verbs.OpRecv, p.QB.QPN())
}

// testRecvQueueFull fills the receive queue, checks ErrQueueFull on one
// more, and that a consumed receive frees its slot (receives are consumed
// in the order they were posted).
func testRecvQueueFull(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxRecvWR: 16})
	depth := p.QB.Cap().MaxRecvWR
	if depth < 16 {
		t.Fatalf("QP granted max_recv_wr %d, want at least the 16 requested", depth)
	}
	dst := p.B.Alloc(t, (depth+1)*64, accessLocal)
	for i := range depth - 1 {
		must(t, fmt.Sprintf("post recv %d of %d", i+1, depth), p.QB.PostRecv(uint64(i), SGE(t, dst, i*64, 64)))
	}
	rb := p.QB.NewRecvBatch(2)
	rb.Recv(uint64(depth-1), SGE(t, dst, (depth-1)*64, 64))
	rb.Recv(uint64(depth), SGE(t, dst, depth*64, 64))
	expectPartialPost(t, "receive batch of 2 with one free slot", rb.Submit(), 1)
	expectQueueFull(t, "post recv to a full queue", p.QB.PostRecv(uint64(depth), SGE(t, dst, depth*64, 64)))

	src := p.A.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0xA2)
	must(t, "post send", p.QA.PostSend(500, verbs.Signaled, SGE(t, src, 0, 10)))
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 500, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion (the first receive posted)", wc, 0, verbs.OpRecv, p.QB.QPN())
	checkBytes(t, "received data", dst.Bytes()[:10], src.Bytes()[:10])
	must(t, "post recv after one was consumed", p.QB.PostRecv(uint64(depth), SGE(t, dst, 0, 64)))
	expectQueueFull(t, "post recv to the full queue again", p.QB.PostRecv(uint64(depth+1), SGE(t, dst, 0, 64)))
}

// testSelectiveSignaling posts writes of which only some are signaled:
// exactly those complete, in order.
func testSelectiveSignaling(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	const n = 10
	src := p.A.Alloc(t, 2*n*64, accessLocal)
	dst := p.B.Alloc(t, 2*n*64, accessAll)
	Pattern(src.Bytes(), 0xB1)
	signaled := map[int]bool{2: true, 5: true, 9: true}
	for i := range n {
		var f verbs.SendFlags
		if signaled[i] {
			f = verbs.Signaled
		}
		must(t, "post write", p.QA.PostWrite(uint64(i), f, dst.Remote().At(uint64(i*64)), SGE(t, src, i*64, 64)))
	}
	for i, wc := range c.poll(t, p.A.CQ, 3) {
		expectOK(t, fmt.Sprintf("completion %d", i), wc, []uint64{2, 5, 9}[i], verbs.OpWrite, p.QA.QPN())
	}
	// Send completions are delivered in order: after that of the last
	// request, no completion of an earlier one can follow.
	expectEmpty(t, "cq after the last signaled write", p.A.CQ)
	checkBytes(t, "remote MR after single writes", dst.Bytes()[:n*64], src.Bytes()[:n*64])

	// The same with one batch: only the requests marked Signaled complete.
	b := p.QA.NewBatch(n)
	for i := range n {
		r := b.Write(uint64(100+i), dst.Remote().At(uint64((n+i)*64)), SGE(t, src, (n+i)*64, 64))
		if i == 3 || i == n-1 {
			r.Signaled()
		}
	}
	must(t, "submit batch", b.Submit())
	for i, wc := range c.poll(t, p.A.CQ, 2) {
		expectOK(t, fmt.Sprintf("batch completion %d", i), wc, []uint64{103, 100 + n - 1}[i], verbs.OpWrite, p.QA.QPN())
	}
	expectEmpty(t, "cq after the batch", p.A.CQ)
	checkBytes(t, "remote MR after batched writes", dst.Bytes(), src.Bytes())
}

// testSignalAll checks that a QP created with SignalAll completes every
// request without the Signaled flag.
func testSignalAll(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{SignalAll: true})
	src := p.A.Alloc(t, 256, accessLocal)
	dst := p.B.Alloc(t, 256, accessAll)
	Pattern(src.Bytes(), 0xC1)
	for i := range 3 {
		must(t, "post write", p.QA.PostWrite(uint64(i), 0, dst.Remote().At(uint64(i*64)), SGE(t, src, i*64, 64)))
	}
	b := p.QA.NewBatch(1)
	b.Write(3, dst.Remote().At(192), SGE(t, src, 192, 64))
	must(t, "submit batch", b.Submit())
	for i, wc := range c.poll(t, p.A.CQ, 4) {
		expectOK(t, fmt.Sprintf("completion %d", i), wc, uint64(i), verbs.OpWrite, p.QA.QPN())
	}
	expectEmpty(t, "cq after four writes", p.A.CQ)
	checkBytes(t, "remote MR", dst.Bytes(), src.Bytes())
}

// testLimitsEnforced checks max_send_sge, max_recv_sge and max_inline_data:
// a request beyond them is refused at post, and the QP stays usable.
func testLimitsEnforced(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxSendSGE: 2, MaxRecvSGE: 2, MaxInlineData: 32})
	capA, capB := p.QA.Cap(), p.QB.Cap()
	big := max(capA.MaxInlineData+1, 64)
	src := p.A.Alloc(t, big, accessLocal)
	dst := p.B.Alloc(t, 4096, accessLocal)
	Pattern(src.Bytes(), 0xD1)

	sgl := make([]verbs.SGE, capA.MaxSendSGE+1)
	for i := range sgl {
		sgl[i] = SGE(t, src, i, 1)
	}
	if err := p.QA.PostSend(1, verbs.Signaled, sgl...); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("send with %d SGEs (max_send_sge %d): %v, want EINVAL", len(sgl), capA.MaxSendSGE, err)
	}
	rsgl := make([]verbs.SGE, capB.MaxRecvSGE+1)
	for i := range rsgl {
		rsgl[i] = SGE(t, dst, i*16, 16)
	}
	if err := p.QB.PostRecv(2, rsgl...); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("receive with %d SGEs (max_recv_sge %d): %v, want EINVAL", len(rsgl), capB.MaxRecvSGE, err)
	}
	if err := p.QA.PostSend(3, verbs.Signaled|verbs.Inline, SGE(t, src, 0, capA.MaxInlineData+1)); err == nil {
		t.Errorf("inline send of %d bytes (max_inline_data %d) was accepted", capA.MaxInlineData+1, capA.MaxInlineData)
	}

	// Nothing was posted, and the QPs still work.
	must(t, "post recv", p.QB.PostRecv(4, SGE(t, dst, 0, 64)))
	must(t, "post send", p.QA.PostSend(5, verbs.Signaled, SGE(t, src, 0, 20)))
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 5, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 4, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, 20)
	checkBytes(t, "received data", dst.Bytes()[:20], src.Bytes()[:20])
	expectEmpty(t, "sender cq", p.A.CQ)
}

// testSRQShared connects two QPs of side B that share one SRQ to two QPs
// of side A; messages to either QP land in the SRQ's buffers and complete
// with the receiving QP's number.
func testSRQShared(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	srq := b.NewSRQ(t, verbs.SRQSpec{MaxWR: 16})
	qa1, qa2 := a.NewRC(t, verbs.QPSpec{}), a.NewRC(t, verbs.QPSpec{})
	qb1, qb2 := b.NewRC(t, verbs.QPSpec{SRQ: srq}), b.NewRC(t, verbs.QPSpec{SRQ: srq})
	ConnectRC(t, qa1, qb1)
	ConnectRC(t, qa2, qb2)

	const slot = 128
	bufs := b.Alloc(t, 4*slot, accessLocal)
	// Posted in one batch of the SRQ (PostRecv: testSRQLimitEvent).
	rb := srq.NewRecvBatch(4)
	for i := range 4 {
		rb.Recv(uint64(100+i), SGE(t, bufs, i*slot, slot))
	}
	if rb.Len() != 4 {
		t.Fatalf("srq batch holds %d receives, want 4", rb.Len())
	}
	must(t, "submit srq recv batch", rb.Submit())
	if rb.Len() != 0 {
		t.Errorf("srq batch holds %d receives after Submit", rb.Len())
	}
	src := a.Alloc(t, 256, accessLocal)
	Pattern(src.Bytes()[:128], 0x01)
	Pattern(src.Bytes()[128:], 0x02)
	must(t, "post send on qp 1", qa1.PostSend(1, verbs.Signaled, SGE(t, src, 0, 40)))
	must(t, "post send on qp 2", qa2.PostSend(2, verbs.Signaled, SGE(t, src, 128, 90)))

	sends := c.poll(t, a.CQ, 2)
	for _, wc := range sends {
		switch wc.WRID {
		case 1:
			expectOK(t, "send on qp 1", wc, 1, verbs.OpSend, qa1.QPN())
		case 2:
			expectOK(t, "send on qp 2", wc, 2, verbs.OpSend, qa2.QPN())
		default:
			t.Errorf("unexpected send completion %v", wc)
		}
	}
	seen := map[uint32]bool{}
	used := map[uint64]bool{}
	for _, wc := range c.poll(t, b.CQ, 2) {
		if wc.Status != verbs.StatusSuccess || wc.WRID < 100 || wc.WRID >= 104 || used[wc.WRID] {
			t.Errorf("unexpected receive completion %v", wc)
			continue
		}
		used[wc.WRID] = true
		got := bufs.Bytes()[int(wc.WRID-100)*slot:]
		switch wc.QPN {
		case qb1.QPN():
			expectOK(t, "receive on qp 1", wc, wc.WRID, verbs.OpRecv, qb1.QPN())
			expectByteLen(t, "receive on qp 1", wc, 40)
			checkBytes(t, "data received on qp 1", got[:40], src.Bytes()[:40])
		case qb2.QPN():
			expectOK(t, "receive on qp 2", wc, wc.WRID, verbs.OpRecv, qb2.QPN())
			expectByteLen(t, "receive on qp 2", wc, 90)
			checkBytes(t, "data received on qp 2", got[:90], src.Bytes()[128:218])
		default:
			t.Errorf("receive completion %v names neither qp %d nor qp %d", wc, qb1.QPN(), qb2.QPN())
		}
		seen[wc.QPN] = true
	}
	if len(seen) != 2 {
		t.Errorf("receives completed on %d distinct QPs, want 2", len(seen))
	}
	q, err := srq.Query()
	must(t, "query srq", err)
	if q.MaxWR < 16 {
		t.Errorf("srq max_wr %d, want at least 16", q.MaxWR)
	}
}

// testSRQLimitEvent arms the SRQ limit and checks that the device raises
// SRQ_LIMIT_REACHED once fewer receives than the limit remain.
func testSRQLimitEvent(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	srq := b.NewSRQ(t, verbs.SRQSpec{MaxWR: 16})
	qa := a.NewRC(t, verbs.QPSpec{})
	qb := b.NewRC(t, verbs.QPSpec{SRQ: srq})
	ConnectRC(t, qa, qb)
	bufs := b.Alloc(t, 8*64, accessLocal)
	for i := range 8 {
		must(t, "post srq recv", srq.PostRecv(uint64(i), SGE(t, bufs, i*64, 64)))
	}
	must(t, "arm srq limit", srq.ArmLimit(4))
	q, err := srq.Query()
	must(t, "query srq", err)
	if q.Limit != 4 {
		t.Errorf("srq limit after ArmLimit(4): %d", q.Limit)
	}

	// Consuming 5 of 8 leaves 3 < 4.
	src := a.Alloc(t, 64, accessLocal)
	for i := range 5 {
		must(t, "post send", qa.PostSend(uint64(i), verbs.Signaled, SGE(t, src, 0, 16)))
	}
	for i, wc := range c.poll(t, a.CQ, 5) {
		expectOK(t, "send completion", wc, uint64(i), verbs.OpSend, qa.QPN())
	}
	for i, wc := range c.poll(t, b.CQ, 5) {
		expectOK(t, "receive completion", wc, uint64(i), verbs.OpRecv, qb.QPN())
	}
	ctx := c.guard(t)
	for {
		ev, err := b.Ctx.AsyncEvent(ctx)
		if err != nil {
			t.Fatalf("waiting for SRQ_LIMIT_REACHED: %v", err)
		}
		if ev.Type == verbs.EventSRQLimitReached {
			break
		}
		t.Logf("ignoring async event %s while waiting for SRQ_LIMIT_REACHED", ev.Type)
	}
}
