package verbstest

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs"
)

// inlineMsg returns n bytes of Go memory, in no memory region, filled
// with a pattern from seed.
func inlineMsg(seed byte, n int) []byte {
	b := make([]byte, n)
	Pattern(b, seed)
	return b
}

// testInlineData sends and writes bytes of Go memory that lie in no
// memory region with the inline-data API (SendInline, WriteInline and
// their kin; batched and single; RC, UC and UD): the peer gets them,
// although the sender overwrites its buffers as soon as the post returns.
// More than MaxInlineData bytes are refused before anything is posted.
func testInlineData(t *testing.T, c *tcase) {
	c.check(t, "RC", func(t *testing.T) { inlineDataRC(t, c, false) })
	c.check(t, "RCBatch", func(t *testing.T) { inlineDataRC(t, c, true) })
	c.check(t, "UC", func(t *testing.T) { inlineDataUC(t, c) })
	c.check(t, "UD", func(t *testing.T) { inlineDataUD(t, c) })
	c.check(t, "TooLong", func(t *testing.T) { inlineDataTooLong(t, c) })
}

// inlineDataRC posts an inline send, send with immediate, write and write
// with immediate of Go memory, one by one or in one batch.
func inlineDataRC(t *testing.T, c *tcase, batch bool) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	if p.QA.Cap().MaxInlineData < 48 {
		t.Fatalf("QP granted max_inline_data %d, want at least 48 (requested 64)", p.QA.Cap().MaxInlineData)
	}
	rbuf := p.B.Alloc(t, 3*64, accessLocal)
	dst := p.B.Alloc(t, 4096, accessAll)
	Pattern(rbuf.Bytes(), 0xEE)
	Pattern(dst.Bytes(), 0xEE)
	want := bytes.Clone(dst.Bytes())
	for i := range 3 {
		must(t, "post recv", p.QB.PostRecv(uint64(1+i), SGE(t, rbuf, 64*i, 64)))
	}
	const immSend, immWrite = 0x5E0D1111, 0x3D1E2222
	send, sendImm, write, writeImm := inlineMsg(0x31, 48), inlineMsg(0x32, 20), inlineMsg(0x33, 40), inlineMsg(0x34, 33)
	sent := [][]byte{bytes.Clone(send), bytes.Clone(sendImm), bytes.Clone(write), bytes.Clone(writeImm)}
	if batch {
		b := p.QA.NewBatch(4)
		b.SendInline(10, send).Signaled()
		b.SendImmInline(11, immSend, sendImm).Signaled()
		b.WriteInline(12, dst.Remote().At(100), write).Signaled()
		b.WriteImmInline(13, dst.Remote().At(2000), immWrite, writeImm).Signaled()
		must(t, "submit inline batch", b.Submit())
	} else {
		must(t, "post inline send", p.QA.PostSendInline(10, verbs.Signaled, send))
		must(t, "post inline send imm", p.QA.PostSendImmInline(11, verbs.Signaled, immSend, sendImm))
		must(t, "post inline write", p.QA.PostWriteInline(12, verbs.Signaled, dst.Remote().At(100), write))
		must(t, "post inline write imm", p.QA.PostWriteImmInline(13, verbs.Signaled, dst.Remote().At(2000), immWrite, writeImm))
	}
	// The bytes were copied at the post.
	for _, m := range [][]byte{send, sendImm, write, writeImm} {
		clear(m)
	}
	for i, wc := range c.poll(t, p.A.CQ, 4) {
		op := verbs.OpSend
		if i >= 2 {
			op = verbs.OpWrite
		}
		expectOK(t, "inline request completion", wc, uint64(10+i), op, p.QA.QPN())
	}
	wcs := c.poll(t, p.B.CQ, 3)
	expectOK(t, "receive of the inline send", wcs[0], 1, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "receive of the inline send", wcs[0], len(sent[0]))
	expectNoImm(t, "receive of the inline send", wcs[0])
	checkBytes(t, "inline send data", rbuf.Bytes()[:len(sent[0])], sent[0])
	expectOK(t, "receive of the inline send with immediate", wcs[1], 2, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "receive of the inline send with immediate", wcs[1], len(sent[1]))
	expectImm(t, "receive of the inline send with immediate", wcs[1], immSend)
	checkBytes(t, "inline send-imm data", rbuf.Bytes()[64:64+len(sent[1])], sent[1])
	expectOK(t, "target completion of the inline write with immediate", wcs[2], 3, verbs.OpRecvWriteImm, p.QB.QPN())
	expectByteLen(t, "target completion of the inline write with immediate", wcs[2], len(sent[3]))
	expectImm(t, "target completion of the inline write with immediate", wcs[2], immWrite)
	copy(want[100:], sent[2])
	copy(want[2000:], sent[3])
	checkBytes(t, "target MR after the inline writes", dst.Bytes(), want)
}

// inlineDataUC posts inline sends and writes of Go memory on UC.
func inlineDataUC(t *testing.T, c *tcase) {
	p := NewLoopbackUC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	rbuf := p.B.Alloc(t, 4*64, accessLocal)
	dst := p.B.Alloc(t, 4096, accessAll)
	Pattern(dst.Bytes(), 0xEE)
	want := bytes.Clone(dst.Bytes())
	for i := range 4 {
		must(t, "post recv", p.QB.PostRecv(uint64(1+i), SGE(t, rbuf, 64*i, 64)))
	}
	msgs := [][]byte{inlineMsg(0x41, 40), inlineMsg(0x42, 30), inlineMsg(0x43, 20), inlineMsg(0x44, 10), inlineMsg(0x45, 25), inlineMsg(0x46, 35)}
	sent := make([][]byte, len(msgs))
	for i, m := range msgs {
		sent[i] = bytes.Clone(m)
	}
	const imm1, imm2 = 0x0C0C0001, 0x0C0C0002
	must(t, "post UC inline send", p.QA.PostSendInline(10, verbs.Signaled, msgs[0]))
	must(t, "post UC inline write", p.QA.PostWriteInline(11, verbs.Signaled, dst.Remote().At(100), msgs[1]))
	b := p.QA.NewBatch(4)
	b.SendInline(12, msgs[2]).Signaled()
	b.SendImmInline(13, imm1, msgs[3]).Signaled()
	b.WriteInline(14, dst.Remote().At(1000), msgs[4]).Signaled()
	b.WriteImmInline(15, dst.Remote().At(2000), imm2, msgs[5]).Signaled()
	must(t, "submit UC inline batch", b.Submit())
	for _, m := range msgs {
		clear(m)
	}
	for i, wc := range c.poll(t, p.A.CQ, 6) {
		op := verbs.OpSend
		if i == 1 || i >= 4 {
			op = verbs.OpWrite
		}
		expectOK(t, "UC inline request completion", wc, uint64(10+i), op, p.QA.QPN())
	}
	wcs := c.poll(t, p.B.CQ, 4)
	for i, x := range []struct {
		op  verbs.Opcode
		msg int // index into sent
		imm uint32
	}{{verbs.OpRecv, 0, 0}, {verbs.OpRecv, 2, 0}, {verbs.OpRecv, 3, imm1}, {verbs.OpRecvWriteImm, 5, imm2}} {
		what := fmt.Sprintf("UC receive %d", i+1)
		expectOK(t, what, wcs[i], uint64(1+i), x.op, p.QB.QPN())
		expectByteLen(t, what, wcs[i], len(sent[x.msg]))
		if x.imm != 0 {
			expectImm(t, what, wcs[i], x.imm)
		}
		if x.op == verbs.OpRecv {
			checkBytes(t, what+" data", rbuf.Bytes()[64*i:64*i+len(sent[x.msg])], sent[x.msg])
		}
	}
	copy(want[100:], sent[1])
	copy(want[1000:], sent[4])
	copy(want[2000:], sent[5])
	checkBytes(t, "target MR after the UC inline writes", dst.Bytes(), want)
}

// inlineDataUD sends inline datagrams of Go memory.
func inlineDataUD(t *testing.T, c *tcase) {
	a, b, qa, qb, ah, eb := udSetup(t, c)
	to := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}
	dst := b.Alloc(t, 2*(grhLen+64), accessLocal)
	must(t, "post recv", qb.PostRecv(1, SGE(t, dst, 0, grhLen+64)))
	must(t, "post recv", qb.PostRecv(2, SGE(t, dst, grhLen+64, grhLen+64)))
	m1, m2 := inlineMsg(0x51, 44), inlineMsg(0x52, 13)
	sent := [][]byte{bytes.Clone(m1), bytes.Clone(m2)}
	const imm = 0x0D0D0D0D
	must(t, "post UD inline send", qa.PostSendInline(10, verbs.Signaled, to, m1))
	bt := qa.NewBatch(1)
	bt.SendImmInline(11, to, imm, m2).Signaled()
	must(t, "submit UD inline send imm", bt.Submit())
	clear(m1)
	clear(m2)
	for i, wc := range c.poll(t, a.CQ, 2) {
		expectOK(t, "UD inline send completion", wc, uint64(10+i), verbs.OpSend, qa.QPN())
	}
	wcs := c.poll(t, b.CQ, 2)
	expectOK(t, "UD receive 1", wcs[0], 1, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "UD receive 1 (payload + GRH)", wcs[0], len(sent[0])+grhLen)
	checkBytes(t, "UD inline payload", dst.Bytes()[grhLen:grhLen+len(sent[0])], sent[0])
	expectOK(t, "UD receive 2", wcs[1], 2, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "UD receive 2 (payload + GRH)", wcs[1], len(sent[1])+grhLen)
	expectImm(t, "UD receive 2", wcs[1], imm)
	off := grhLen + 64 + grhLen
	checkBytes(t, "UD inline payload with immediate", dst.Bytes()[off:off+len(sent[1])], sent[1])
}

// inlineDataTooLong posts more inline bytes than the QP allows: refused
// with EINVAL before anything is posted, single or batched (the requests
// of the batch before it are not posted either), and the QP stays usable.
func inlineDataTooLong(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	limit := p.QA.Cap().MaxInlineData
	rbuf := p.B.Alloc(t, 4096, accessLocal)
	must(t, "post recv", p.QB.PostRecv(1, rbuf.All()))
	expectEINVAL(t, fmt.Sprintf("PostSendInline of %d bytes (max_inline_data %d)", limit+1, limit),
		p.QA.PostSendInline(2, verbs.Signaled, make([]byte, limit+1)))
	b := p.QA.NewBatch(2)
	b.SendInline(3, inlineMsg(0x61, 8)).Signaled()
	b.SendInline(4, make([]byte, limit+1)).Signaled()
	err := b.Submit()
	expectEINVAL(t, fmt.Sprintf("Submit of a batch with an inline send of %d bytes", limit+1), err)
	var pe *verbs.PostError
	if errors.As(err, &pe) {
		t.Errorf("Submit: %v is a *PostError; want nothing posted, not a partial post", err)
	}
	// Nothing was posted: the next send is the one received.
	last := inlineMsg(0x62, limit)
	must(t, "post inline send of max_inline_data bytes", p.QA.PostSendInline(5, verbs.Signaled, last))
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 5, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "receive", wc, 1, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "receive (must be the last send)", wc, limit)
	checkBytes(t, "received data", rbuf.Bytes()[:limit], last)
}

// badInline is an inline SGE that must be refused: it does not lie in a
// memory region of the requester's PD named by its lkey.
type badInline struct {
	name string
	sge  func(t *testing.T, p *RCPair, local *verbs.MemoryRegion) verbs.SGE
}

// secretInGoMemory is Go memory in no memory region, which an inline SGE
// must not be able to send.
var secretInGoMemory = []byte("goverbs: a secret in Go memory, in no memory region")

func goMemorySGE(b []byte, lkey uint32) verbs.SGE {
	return verbs.SGE{Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))), Length: uint32(len(b)), LKey: lkey}
}

var badInlines = []badInline{
	// Unmapped memory: before the check, the process died of SIGSEGV.
	{"OutsideAnyMR", func(*testing.T, *RCPair, *verbs.MemoryRegion) verbs.SGE {
		return verbs.SGE{Addr: 0x10000, Length: 16}
	}},
	// Before the check, the peer received the secret.
	{"GoMemoryLKey0", func(*testing.T, *RCPair, *verbs.MemoryRegion) verbs.SGE {
		return goMemorySGE(secretInGoMemory[:32], 0)
	}},
	{"GoMemoryValidLKey", func(_ *testing.T, _ *RCPair, local *verbs.MemoryRegion) verbs.SGE {
		return goMemorySGE(secretInGoMemory[:32], local.LKey())
	}},
	{"AcrossMREnd", func(_ *testing.T, _ *RCPair, local *verbs.MemoryRegion) verbs.SGE {
		return rawSGE(local, local.Len()-8, 16)
	}},
	{"PastMREnd", func(_ *testing.T, _ *RCPair, local *verbs.MemoryRegion) verbs.SGE {
		return rawSGE(local, local.Len(), 16)
	}},
	{"BeforeMRStart", func(_ *testing.T, _ *RCPair, local *verbs.MemoryRegion) verbs.SGE {
		return rawSGE(local, -8, 16)
	}},
	{"AddressWrapsAround", func(_ *testing.T, _ *RCPair, local *verbs.MemoryRegion) verbs.SGE {
		return verbs.SGE{Addr: math.MaxUint64 - 7, Length: 16, LKey: local.LKey()}
	}},
	// An MR of another PD of the same device context.
	{"OtherPD", func(t *testing.T, p *RCPair, _ *verbs.MemoryRegion) verbs.SGE {
		pd, err := p.A.Ctx.AllocPD()
		must(t, "allocate a second pd on side A", err)
		p.A.tr.add(levelPD, "second pd of side A", pd)
		mr, err := pd.Alloc(4096, accessLocal)
		must(t, "allocate an mr in the second pd", err)
		p.A.tr.add(levelMR, "mr of the second pd of side A", mr)
		Pattern(mr.Bytes(), 0x5C)
		return SGE(t, mr, 0, 32)
	}},
	// An MR of the peer (another PD, maybe another device or process).
	{"PeerMR", func(t *testing.T, p *RCPair, _ *verbs.MemoryRegion) verbs.SGE {
		mr := p.B.Alloc(t, 4096, accessLocal)
		Pattern(mr.Bytes(), 0x5D)
		return SGE(t, mr, 0, 32)
	}},
	{"ClosedMR", func(t *testing.T, p *RCPair, _ *verbs.MemoryRegion) verbs.SGE {
		mr, err := p.A.PD.Alloc(4096, accessLocal)
		must(t, "allocate mr", err)
		s := SGE(t, mr, 0, 32)
		must(t, "close mr", mr.Close())
		return s
	}},
}

// testErrInlineSGE posts inline sends and writes whose SGE does not lie
// in a memory region of the QP's PD named by its lkey (unmapped memory,
// Go memory, outside the MR, another PD's MR, a closed MR). libibverbs
// does not check the lkey of inline data; goverbs does: the post fails
// with EINVAL (single posts) or a *PostError naming the request (batches,
// whose requests before it are posted), nothing of the refused request
// reaches the peer (its receive gets the next good send; the target
// memory of a refused write is unchanged) and the QP stays usable.
func testErrInlineSGE(t *testing.T, c *tcase) {
	for _, x := range badInlines {
		c.check(t, x.name, func(t *testing.T) { errInlineSGE(t, c, x) })
	}
	c.check(t, "InlineRead", func(t *testing.T) {
		p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
		local := p.A.Alloc(t, 4096, accessLocal)
		remote := p.B.Alloc(t, 4096, accessAll)
		expectEINVAL(t, "RDMA read with Inline",
			p.QA.PostRead(1, verbs.Signaled|verbs.Inline, remote.Remote().At(0), SGE(t, local, 0, 16)))
		expectEINVAL(t, "fetch-and-add with Inline",
			p.QA.PostFetchAdd(2, verbs.Signaled|verbs.Inline, remote.Remote().At(0), 1, SGE(t, local, 0, 8)))
		// Nothing was posted.
		must(t, "post write", p.QA.PostWrite(3, verbs.Signaled, remote.Remote().At(0), SGE(t, local, 0, 16)))
		expectOK(t, "write completion", c.pollOne(t, p.A.CQ), 3, verbs.OpWrite, p.QA.QPN())
	})
}

// errInlineSGE is one check of testErrInlineSGE: the bad SGE of x in a
// single inline send, a single inline write, and the middle request of a
// batch of three inline sends.
func errInlineSGE(t *testing.T, c *tcase, x badInline) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	if p.QA.Cap().MaxInlineData < 32 {
		t.Fatalf("QP granted max_inline_data %d, want at least 32 (requested 64)", p.QA.Cap().MaxInlineData)
	}
	local := p.A.Alloc(t, 4096, accessLocal)
	Pattern(local.Bytes(), 0x71)
	rbuf := p.B.Alloc(t, 4*64, accessLocal)
	dst := p.B.Alloc(t, 4096, accessAll)
	Pattern(rbuf.Bytes(), 0xEE)
	Pattern(dst.Bytes(), 0xEE)
	dstBefore := bytes.Clone(dst.Bytes())
	bad := x.sge(t, p, local)
	for i := range 4 {
		must(t, "post recv", p.QB.PostRecv(uint64(1+i), SGE(t, rbuf, 64*i, 64)))
	}
	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "inline") {
			t.Errorf("%s of %+v: %v, want an error about the inline SGE wrapping EINVAL", what, bad, err)
		}
	}
	// received checks that receive wrid got exactly the 24 bytes of local
	// at off: the good send posted after the refused one.
	received := func(what string, wrid uint64, off int) {
		t.Helper()
		wc := c.pollOne(t, p.B.CQ)
		expectOK(t, what, wc, wrid, verbs.OpRecv, p.QB.QPN())
		expectByteLen(t, what+" (must be the good send)", wc, 24)
		slot := rbuf.Bytes()[64*(wrid-1) : 64*wrid]
		checkBytes(t, what+" data", slot[:24], local.Bytes()[off:off+24])
		if bytes.Contains(slot, secretInGoMemory[:8]) {
			t.Errorf("%s: the receive buffer holds bytes of the secret in Go memory", what)
		}
	}

	// A single inline send: refused; the next good send is received.
	refused("inline send", p.QA.PostSend(10, verbs.Signaled|verbs.Inline, bad))
	must(t, "post good inline send", p.QA.PostSend(11, verbs.Signaled|verbs.Inline, SGE(t, local, 0, 24)))
	expectOK(t, "good inline send", c.pollOne(t, p.A.CQ), 11, verbs.OpSend, p.QA.QPN())
	received("receive after the refused send", 1, 0)

	// A single inline write: refused; the target memory is unchanged once
	// the good write after it has completed.
	refused("inline write", p.QA.PostWrite(12, verbs.Signaled|verbs.Inline, dst.Remote().At(0), bad))
	must(t, "post good inline write", p.QA.PostWrite(13, verbs.Signaled|verbs.Inline, dst.Remote().At(1024), SGE(t, local, 100, 24)))
	expectOK(t, "good inline write", c.pollOne(t, p.A.CQ), 13, verbs.OpWrite, p.QA.QPN())
	copy(dstBefore[1024:], local.Bytes()[100:124])
	checkBytes(t, "target MR after a refused and a good inline write", dst.Bytes(), dstBefore)

	// A batch: the request before the bad one is posted, the bad one and
	// the one after it are not.
	b := p.QA.NewBatch(3)
	b.Send(20, SGE(t, local, 200, 24)).Inline().Signaled()
	b.Send(21, bad).Inline().Signaled()
	b.Send(22, SGE(t, local, 300, 24)).Inline().Signaled()
	err := b.Submit()
	refused("batch with an inline send", err)
	var pe *verbs.PostError
	if !errors.As(err, &pe) || pe.Posted != 1 {
		t.Errorf("Submit: %v, want a *PostError with Posted 1", err)
	}
	expectOK(t, "first request of the batch", c.pollOne(t, p.A.CQ), 20, verbs.OpSend, p.QA.QPN())
	received("receive of the first request of the batch", 2, 200)
	must(t, "post good inline send", p.QA.PostSend(23, verbs.Signaled|verbs.Inline, SGE(t, local, 400, 24)))
	expectOK(t, "good inline send after the batch", c.pollOne(t, p.A.CQ), 23, verbs.OpSend, p.QA.QPN())
	received("receive after the batch", 3, 400)
	expectState(t, "requester", p.QA, verbs.StateRTS)
}

// testSGEBounds checks MemoryRegion.SGE: an element inside the MR is
// returned as asked; a negative offset or length, or one that ends past
// the MR, is an error wrapping EINVAL that names the offset, the length
// and the MR's length, with the zero SGE (it used to be an SGE of length
// 4294967294 for n = -2).
func testSGEBounds(t *testing.T, c *tcase) {
	a, _ := NewNodes(t, c.cfg)
	mr := a.Alloc(t, 4096, accessLocal)
	l := mr.Len()
	for _, x := range [][2]int{{0, 0}, {0, l}, {l, 0}, {l - 1, 1}, {100, 200}} {
		s, err := mr.SGE(x[0], x[1])
		want := verbs.SGE{Addr: mr.Addr() + uint64(x[0]), Length: uint32(x[1]), LKey: mr.LKey()}
		if err != nil || s != want {
			t.Errorf("SGE(%d, %d) = %+v, %v; want %+v", x[0], x[1], s, err, want)
		}
	}
	for _, x := range [][2]int{
		{-1, 8}, {0, -1}, {0, -2}, {-8, 16}, {l, 1}, {l - 8, 16}, {0, l + 1}, {l + 1, 0},
		{math.MaxInt, 1}, {1, math.MaxInt}, {math.MinInt, 8}, {8, math.MinInt},
	} {
		s, err := mr.SGE(x[0], x[1])
		switch {
		case err == nil:
			t.Errorf("SGE(%d, %d) = %+v, want an error", x[0], x[1], s)
		case !errors.Is(err, syscall.EINVAL):
			t.Errorf("SGE(%d, %d): %v, want an error wrapping EINVAL", x[0], x[1], err)
		case s != verbs.SGE{}:
			t.Errorf("SGE(%d, %d) returned %+v with its error, want the zero SGE", x[0], x[1], s)
		}
		if err != nil {
			for _, n := range []int{x[0], x[1], l} {
				if !strings.Contains(err.Error(), fmt.Sprint(n)) {
					t.Errorf("SGE(%d, %d): %q does not name %d", x[0], x[1], err, n)
				}
			}
		}
	}
	if all := mr.All(); all != (verbs.SGE{Addr: mr.Addr(), Length: uint32(l), LKey: mr.LKey()}) {
		t.Errorf("All() = %+v, want the whole MR", all)
	}
}
