package verbstest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// Memory access used by most cases.
const (
	accessLocal = verbs.AccessLocalWrite
	accessAll   = verbs.AccessRemoteAll
)

// sendRecv sends size bytes from A to B over an RC pair with matching
// buffers and checks both completions and the bytes.
func sendRecv(t *testing.T, c *tcase, size int) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	const slack = 256 // receive buffer room beyond the message
	src := p.A.Alloc(t, size, accessLocal)
	dst := p.B.Alloc(t, size+slack, accessLocal)
	Pattern(src.Bytes(), 0x11)
	Pattern(dst.Bytes(), 0xEE)
	tail := bytes.Clone(dst.Bytes()[size:])

	must(t, "post recv", p.QB.PostRecv(0xB0, dst.All()))
	must(t, "post send", p.QA.PostSend(0xA0, verbs.Signaled, src.All()))

	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 0xA0, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 0xB0, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, size)
	expectNoImm(t, "recv completion", wc)
	checkBytes(t, "received data", dst.Bytes()[:size], src.Bytes())
	checkBytes(t, "receive buffer beyond the message", dst.Bytes()[size:], tail)
}

func testSendRecv(t *testing.T, c *tcase) { sendRecv(t, c, 64) }

// testSendRecvLarge sends 1 MiB: many MTU-sized packets.
func testSendRecvLarge(t *testing.T, c *tcase) { sendRecv(t, c, 1<<20) }

// testSendRecvMultiSGE gathers a message from three SGEs in two MRs and
// scatters it into four receive SGEs of different sizes.
func testSendRecvMultiSGE(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxSendSGE: 4, MaxRecvSGE: 4})
	s1 := p.A.Alloc(t, 8192, accessLocal)
	s2 := p.A.Alloc(t, 4096, accessLocal)
	Pattern(s1.Bytes(), 0x21)
	Pattern(s2.Bytes(), 0x42)
	gather := []verbs.SGE{SGE(t, s1, 100, 10), SGE(t, s2, 7, 3000), SGE(t, s1, 5000, 7)}
	var msg []byte
	msg = append(msg, s1.Bytes()[100:110]...)
	msg = append(msg, s2.Bytes()[7:3007]...)
	msg = append(msg, s1.Bytes()[5000:5007]...)

	r := p.B.Alloc(t, 16384, accessLocal)
	Pattern(r.Bytes(), 0xEE)
	before := bytes.Clone(r.Bytes())
	// Receive pieces of 5, 100, 4000 and 8 bytes at scattered offsets: the
	// 3017-byte message fills the first two and 2912 bytes of the third.
	scatter := []verbs.SGE{SGE(t, r, 0, 5), SGE(t, r, 1000, 100), SGE(t, r, 2000, 4000), SGE(t, r, 9000, 8)}

	must(t, "post recv", p.QB.PostRecv(7, scatter...))
	must(t, "post send", p.QA.PostSend(8, verbs.Signaled, gather...))
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 8, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 7, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, len(msg))

	want := bytes.Clone(before)
	copy(want[0:5], msg[0:5])
	copy(want[1000:1100], msg[5:105])
	copy(want[2000:2000+len(msg)-105], msg[105:])
	checkBytes(t, "receive MR after scatter", r.Bytes(), want)
}

// testSendImm sends with immediate data.
func testSendImm(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	src := p.A.Alloc(t, 100, accessLocal)
	dst := p.B.Alloc(t, 128, accessLocal)
	Pattern(src.Bytes(), 0x31)
	const imm = 0x12345678
	must(t, "post recv", p.QB.PostRecv(1, dst.All()))
	must(t, "post send imm", p.QA.PostSendImm(2, verbs.Signaled, imm, src.All()))
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 1, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, 100)
	expectImm(t, "recv completion", wc, imm)
	checkBytes(t, "received data", dst.Bytes()[:100], src.Bytes())

	// A zero-length send with immediate data carries only the immediate.
	must(t, "post recv", p.QB.PostRecv(3, dst.All()))
	must(t, "post zero-length send imm", p.QA.PostSendImm(4, verbs.Signaled, 0xCAFEF00D))
	expectOK(t, "zero-length send completion", c.pollOne(t, p.A.CQ), 4, verbs.OpSend, p.QA.QPN())
	wc = c.pollOne(t, p.B.CQ)
	expectOK(t, "zero-length recv completion", wc, 3, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "zero-length recv completion", wc, 0)
	expectImm(t, "zero-length recv completion", wc, 0xCAFEF00D)
}

// testWrite writes into the middle of a remote MR, single- and multi-SGE,
// and checks that the bytes around the target are untouched.
func testWrite(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	src := p.A.Alloc(t, 16384, accessLocal)
	dst := p.B.Alloc(t, 16384, accessAll)
	Pattern(src.Bytes(), 0x51)
	Pattern(dst.Bytes(), 0xEE)
	want := bytes.Clone(dst.Bytes())

	// 5000 bytes (more than one packet at any MTU) at offset 100.
	must(t, "post write", p.QA.PostWrite(10, verbs.Signaled, dst.Remote().At(100), SGE(t, src, 0, 5000)))
	expectOK(t, "write completion", c.pollOne(t, p.A.CQ), 10, verbs.OpWrite, p.QA.QPN())
	copy(want[100:5100], src.Bytes()[:5000])
	checkBytes(t, "remote MR after write", dst.Bytes(), want)

	// Gather three SGEs into one write at offset 8000.
	must(t, "post multi-SGE write", p.QA.PostWrite(11, verbs.Signaled, dst.Remote().At(8000),
		SGE(t, src, 6000, 33), SGE(t, src, 7000, 1000), SGE(t, src, 9000, 1)))
	expectOK(t, "multi-SGE write completion", c.pollOne(t, p.A.CQ), 11, verbs.OpWrite, p.QA.QPN())
	copy(want[8000:], src.Bytes()[6000:6033])
	copy(want[8033:], src.Bytes()[7000:8000])
	copy(want[9033:], src.Bytes()[9000:9001])
	checkBytes(t, "remote MR after multi-SGE write", dst.Bytes(), want)

	// The target posts no receive and gets no completion for a write.
	expectEmpty(t, "target cq after writes", p.B.CQ)
}

// testWriteImm writes with immediate data: the write consumes a receive at
// the target, whose completion is RECV_RDMA_WITH_IMM with the immediate
// and the length of the write, and whose buffer is not written.
func testWriteImm(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	src := p.A.Alloc(t, 4096, accessLocal)
	dst := p.B.Alloc(t, 4096, accessAll)
	rbuf := p.B.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0x61)
	Pattern(rbuf.Bytes(), 0xEE)
	rbefore := bytes.Clone(rbuf.Bytes())
	const imm = 0xDEADBEEF

	must(t, "post recv", p.QB.PostRecv(70, rbuf.All()))
	must(t, "post write imm", p.QA.PostWriteImm(71, verbs.Signaled, dst.Remote().At(512), imm, SGE(t, src, 0, 300)))
	expectOK(t, "write-imm completion", c.pollOne(t, p.A.CQ), 71, verbs.OpWrite, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "target completion", wc, 70, verbs.OpRecvWriteImm, p.QB.QPN())
	expectImm(t, "target completion", wc, imm)
	expectByteLen(t, "target completion", wc, 300)
	checkBytes(t, "written data", dst.Bytes()[512:812], src.Bytes()[:300])
	checkBytes(t, "receive buffer consumed by write-imm", rbuf.Bytes(), rbefore)
}

// testRead reads from a remote MR into one and into two local SGEs.
func testRead(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	remote := p.B.Alloc(t, 16384, accessAll)
	local := p.A.Alloc(t, 16384, accessLocal)
	Pattern(remote.Bytes(), 0x71)
	Pattern(local.Bytes(), 0xEE)
	want := bytes.Clone(local.Bytes())

	must(t, "post read", p.QA.PostRead(20, verbs.Signaled, remote.Remote().At(1000), SGE(t, local, 0, 4196)))
	expectOK(t, "read completion", c.pollOne(t, p.A.CQ), 20, verbs.OpRead, p.QA.QPN())
	copy(want, remote.Bytes()[1000:5196])
	checkBytes(t, "local MR after read", local.Bytes(), want)

	must(t, "post scatter read", p.QA.PostRead(21, verbs.Signaled, remote.Remote().At(7),
		SGE(t, local, 8000, 17), SGE(t, local, 12000, 3000)))
	expectOK(t, "scatter read completion", c.pollOne(t, p.A.CQ), 21, verbs.OpRead, p.QA.QPN())
	copy(want[8000:], remote.Bytes()[7:24])
	copy(want[12000:], remote.Bytes()[24:3024])
	checkBytes(t, "local MR after scatter read", local.Bytes(), want)
	expectEmpty(t, "target cq after reads", p.B.CQ)
}

// Atomic operands are 64-bit words in the host byte order (as on SoftRoCE
// and the soft provider).
func word(b []byte, off int) uint64 { return binary.NativeEndian.Uint64(b[off:]) }

func putWord(b []byte, off int, v uint64) { binary.NativeEndian.PutUint64(b[off:], v) }

// testCompareSwap checks a compare-and-swap that matches and one that does
// not: both return the prior value; only the first changes memory.
func testCompareSwap(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	remote := p.B.Alloc(t, 64, accessAll)
	res := p.A.Alloc(t, 64, accessLocal)
	const (
		initial = uint64(0x1122334455667788)
		swap1   = uint64(0xA0A1A2A3A4A5A6A7)
		swap2   = uint64(0xB0B1B2B3B4B5B6B7)
	)
	Pattern(remote.Bytes(), 0xEE)
	putWord(remote.Bytes(), 8, initial)
	want := bytes.Clone(remote.Bytes())

	must(t, "post compare-swap", p.QA.PostCompareSwap(30, verbs.Signaled, remote.Remote().At(8), initial, swap1, SGE(t, res, 0, 8)))
	expectOK(t, "matching compare-swap", c.pollOne(t, p.A.CQ), 30, verbs.OpCompareSwap, p.QA.QPN())
	if got := word(res.Bytes(), 0); got != initial {
		t.Errorf("matching compare-swap returned %#x, want the prior value %#x", got, initial)
	}
	putWord(want, 8, swap1)
	checkBytes(t, "remote MR after matching compare-swap", remote.Bytes(), want)

	must(t, "post compare-swap", p.QA.PostCompareSwap(31, verbs.Signaled, remote.Remote().At(8), initial, swap2, SGE(t, res, 8, 8)))
	expectOK(t, "failing compare-swap", c.pollOne(t, p.A.CQ), 31, verbs.OpCompareSwap, p.QA.QPN())
	if got := word(res.Bytes(), 8); got != swap1 {
		t.Errorf("failing compare-swap returned %#x, want the current value %#x", got, swap1)
	}
	checkBytes(t, "remote MR after failing compare-swap (must be unchanged)", remote.Bytes(), want)
}

// testFetchAdd checks two fetch-and-adds, one wrapping around.
func testFetchAdd(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	remote := p.B.Alloc(t, 64, accessAll)
	res := p.A.Alloc(t, 64, accessLocal)
	Pattern(remote.Bytes(), 0xEE)
	putWord(remote.Bytes(), 16, 100)
	want := bytes.Clone(remote.Bytes())

	must(t, "post fetch-add", p.QA.PostFetchAdd(40, verbs.Signaled, remote.Remote().At(16), 5, SGE(t, res, 0, 8)))
	expectOK(t, "fetch-add", c.pollOne(t, p.A.CQ), 40, verbs.OpFetchAdd, p.QA.QPN())
	if got := word(res.Bytes(), 0); got != 100 {
		t.Errorf("fetch-add returned %d, want the prior value 100", got)
	}
	putWord(want, 16, 105)
	checkBytes(t, "remote MR after fetch-add", remote.Bytes(), want)

	// Adding 2^64-1 subtracts one.
	must(t, "post fetch-add", p.QA.PostFetchAdd(41, verbs.Signaled, remote.Remote().At(16), ^uint64(0), SGE(t, res, 8, 8)))
	expectOK(t, "wrapping fetch-add", c.pollOne(t, p.A.CQ), 41, verbs.OpFetchAdd, p.QA.QPN())
	if got := word(res.Bytes(), 8); got != 105 {
		t.Errorf("wrapping fetch-add returned %d, want the prior value 105", got)
	}
	putWord(want, 16, 104)
	checkBytes(t, "remote MR after wrapping fetch-add", remote.Bytes(), want)
}

// testAtomicMisaligned checks that an atomic on an address that is not
// 8-byte aligned, or with a result SGE that is not 8 bytes, is refused at
// post by the verbs layer on every device (EINVAL, saying why), as a single
// request and in a batch, and changes no memory.
func testAtomicMisaligned(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	remote := p.B.Alloc(t, 64, accessAll)
	res := p.A.Alloc(t, 64, accessLocal)
	Pattern(remote.Bytes(), 0xEE)
	want := bytes.Clone(remote.Bytes())

	check := func(what string, err error, why string) {
		t.Helper()
		if err == nil {
			t.Errorf("%s: posted, want EINVAL at post", what)
			wc := c.pollOne(t, p.A.CQ)
			t.Errorf("%s: completed %v", what, wc)
			return
		}
		if !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), why) {
			t.Errorf("%s: %v\nwant EINVAL saying %q", what, err, why)
		}
	}
	const misaligned = "is not 8-byte aligned (it is 4 bytes past"
	check("fetch-add at +4", p.QA.PostFetchAdd(50, verbs.Signaled, remote.Remote().At(4), 1, SGE(t, res, 0, 8)), misaligned)
	check("compare-swap at +4", p.QA.PostCompareSwap(51, verbs.Signaled, remote.Remote().At(4), 0, 1, SGE(t, res, 0, 8)), misaligned)
	check("fetch-add with a 16-byte result", p.QA.PostFetchAdd(52, verbs.Signaled, remote.Remote().At(8), 1, SGE(t, res, 0, 16)),
		"must be exactly 8 bytes")
	b := p.QA.NewBatch(4)
	b.FetchAdd(53, remote.Remote().At(16), 1, SGE(t, res, 0, 8)).Signaled()
	b.CompareSwap(54, remote.Remote().At(20), 0, 1, SGE(t, res, 8, 8)).Signaled()
	err := b.Submit()
	check("batch with a compare-swap at +20", err, "request 1: atomic target address")
	var pe *verbs.PostError
	if errors.As(err, &pe) {
		t.Errorf("batch: %v is a *PostError; want nothing posted", err)
	}
	checkBytes(t, "remote MR after misaligned atomics", remote.Bytes(), want)
}

// testInlineSend sends inline data and overwrites the source buffer as soon
// as the post returns: the receiver must get the original bytes.
func testInlineSend(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	if p.QA.Cap().MaxInlineData < 48 {
		t.Fatalf("QP granted max_inline_data %d, want at least 48 (requested 64)", p.QA.Cap().MaxInlineData)
	}
	src := p.A.Alloc(t, 64, accessLocal)
	dst := p.B.Alloc(t, 128, accessLocal)
	Pattern(src.Bytes(), 0x81)
	orig := bytes.Clone(src.Bytes()[:48])

	must(t, "post recv", p.QB.PostRecv(1, SGE(t, dst, 0, 64)))
	must(t, "post inline send", p.QA.PostSend(2, verbs.Signaled|verbs.Inline, SGE(t, src, 0, 48)))
	for i := range src.Bytes() {
		src.Bytes()[i] = 0xFF
	}
	expectOK(t, "inline send completion", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 1, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, 48)
	checkBytes(t, "received inline data", dst.Bytes()[:48], orig)

	// The same through a batch, with the Inline modifier.
	Pattern(src.Bytes(), 0x82)
	orig = bytes.Clone(src.Bytes()[:32])
	must(t, "post recv", p.QB.PostRecv(3, SGE(t, dst, 64, 64)))
	b := p.QA.NewBatch(4)
	b.Send(4, SGE(t, src, 0, 32)).Inline().Signaled()
	must(t, "submit inline batch", b.Submit())
	for i := range src.Bytes() {
		src.Bytes()[i] = 0xFF
	}
	expectOK(t, "batched inline send completion", c.pollOne(t, p.A.CQ), 4, verbs.OpSend, p.QA.QPN())
	wc = c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 3, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "recv completion", wc, 32)
	checkBytes(t, "received batched inline data", dst.Bytes()[64:96], orig)
}

// testBatchWrites submits 64 unsignaled writes and a signaled send in one
// batch: exactly one completion, and every write has landed by then.
func testBatchWrites(t *testing.T, c *tcase) {
	const n = 64
	const size = 256
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxSendWR: 128})
	src := p.A.Alloc(t, n*size, accessLocal)
	dst := p.B.Alloc(t, n*size, accessAll)
	rbuf := p.B.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0x91)

	must(t, "post recv", p.QB.PostRecv(0xFEED, rbuf.All()))
	b := p.QA.NewBatch(n + 1)
	for i := range n {
		// Reverse order of offsets, so a provider that reorders is caught.
		off := (n - 1 - i) * size
		b.Write(uint64(i), dst.Remote().At(uint64(off)), SGE(t, src, off, size))
	}
	b.SendImm(n, 0x600D, SGE(t, src, 0, 16)).Signaled()
	if b.Len() != n+1 {
		t.Fatalf("batch holds %d requests, want %d", b.Len(), n+1)
	}
	must(t, "submit batch", b.Submit())
	if b.Len() != 0 {
		t.Errorf("batch holds %d requests after Submit, want 0", b.Len())
	}
	expectOK(t, "signaled last request", c.pollOne(t, p.A.CQ), n, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "recv completion", wc, 0xFEED, verbs.OpRecv, p.QB.QPN())
	expectImm(t, "recv completion", wc, 0x600D)
	// The send was delivered after every write (RC is ordered).
	checkBytes(t, "remote MR after 64 batched writes", dst.Bytes(), src.Bytes())
	expectEmpty(t, "sender cq (unsignaled writes must not complete)", p.A.CQ)
}
