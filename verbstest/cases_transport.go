package verbstest

import (
	"bytes"
	"testing"

	"github.com/goverbs/verbs"
)

// grhLen is the room a UD receive buffer keeps for the GRH.
const grhLen = 40

// udSetup returns a UD QP on each side and an address handle from A to B.
func udSetup(t *testing.T, c *tcase) (a, b *Node, qa, qb *verbs.UDQueuePair, ah *verbs.AddressHandle, eb verbs.Endpoint) {
	t.Helper()
	a, b = NewNodes(t, c.cfg)
	qa = a.NewUD(t, verbs.QPSpec{})
	qb = b.NewUD(t, verbs.QPSpec{})
	expectState(t, "new UD QP", qa, verbs.StateRTS)
	eb = Endpoint(t, qb)
	if eb.QKey != verbs.DefaultQKey {
		t.Errorf("UD endpoint Q_Key %#x, want the default %#x", eb.QKey, verbs.DefaultQKey)
	}
	ah = a.AddressHandle(t, qa, eb)
	return a, b, qa, qb, ah, eb
}

// testUDSend sends datagrams through an address handle: the receive
// completion counts the 40 GRH bytes, carries the sender's QPN, and the
// payload follows the GRH.
func testUDSend(t *testing.T, c *tcase) {
	a, b, qa, qb, ah, eb := udSetup(t, c)
	port, err := a.Ctx.QueryPort(c.cfg.Port)
	must(t, "query port", err)
	ea := Endpoint(t, qa)
	to := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}

	src := a.Alloc(t, 256, accessLocal)
	dst := b.Alloc(t, 2*(grhLen+256), accessLocal)
	Pattern(src.Bytes(), 0xE1)
	Pattern(dst.Bytes(), 0xEE)
	must(t, "post recv", qb.PostRecv(1, SGE(t, dst, 0, grhLen+256)))
	must(t, "post recv", qb.PostRecv(2, SGE(t, dst, grhLen+256, grhLen+256)))

	const n = 200
	must(t, "post UD send", qa.PostSend(10, verbs.Signaled, to, SGE(t, src, 0, n)))
	expectOK(t, "UD send completion", c.pollOne(t, a.CQ), 10, verbs.OpSend, qa.QPN())
	wc := c.pollOne(t, b.CQ)
	expectOK(t, "UD recv completion", wc, 1, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "UD recv completion (payload + 40 GRH bytes)", wc, n+grhLen)
	expectNoImm(t, "UD recv completion", wc)
	if wc.SrcQP != qa.QPN() {
		t.Errorf("UD recv completion: src_qp %d, want the sender's QPN %d", wc.SrcQP, qa.QPN())
	}
	checkBytes(t, "UD payload after the GRH", dst.Bytes()[grhLen:grhLen+n], src.Bytes()[:n])
	c.check(t, "GRH", func(t *testing.T) {
		if port.LinkLayer == verbs.LinkLayerInfiniBand {
			t.Skip("on InfiniBand a datagram has a GRH only when the sender adds one")
		}
		if wc.Flags&verbs.WithGRH == 0 {
			t.Fatalf("UD recv completion flags %#x lack WithGRH (link layer %s)", wc.Flags, port.LinkLayer)
		}
		grh := dst.Bytes()[:grhLen]
		if ea.GID.IsIPv4Mapped() {
			// RoCE v2 over IPv4: the last 20 bytes hold the IPv4 header,
			// whose addresses are at its offsets 12 and 16.
			if !bytes.Equal(grh[32:36], ea.GID[12:]) || !bytes.Equal(grh[36:40], eb.GID[12:]) {
				t.Errorf("IPv4 header in the GRH room has addresses %v / %v, want %s / %s", grh[32:36], grh[36:40], ea.GID, eb.GID)
			}
			return
		}
		if !bytes.Equal(grh[8:24], ea.GID[:]) || !bytes.Equal(grh[24:40], eb.GID[:]) {
			t.Errorf("GRH source/destination GIDs %x / %x, want %s / %s", grh[8:24], grh[24:40], ea.GID, eb.GID)
		}
	})

	const imm = 0x0BADCAFE
	must(t, "post UD send imm", qa.PostSendImm(11, verbs.Signaled, to, imm, SGE(t, src, 0, 17)))
	expectOK(t, "UD send-imm completion", c.pollOne(t, a.CQ), 11, verbs.OpSend, qa.QPN())
	wc = c.pollOne(t, b.CQ)
	expectOK(t, "UD recv completion", wc, 2, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "UD recv completion", wc, 17+grhLen)
	expectImm(t, "UD recv completion", wc, imm)
	if wc.SrcQP != qa.QPN() {
		t.Errorf("UD recv completion: src_qp %d, want %d", wc.SrcQP, qa.QPN())
	}
	off := grhLen + 256 + grhLen
	checkBytes(t, "UD payload after the GRH", dst.Bytes()[off:off+17], src.Bytes()[:17])
}

// testUDQKeyMismatch sends a datagram with the wrong Q_Key, then one with
// the right Q_Key: the first is dropped (the sender still completes it),
// so the first receive gets the second.
func testUDQKeyMismatch(t *testing.T, c *tcase) {
	a, b, qa, qb, ah, eb := udSetup(t, c)
	src := a.Alloc(t, 128, accessLocal)
	dst := b.Alloc(t, 2*(grhLen+128), accessLocal)
	Pattern(src.Bytes()[:64], 0x0B)
	Pattern(src.Bytes()[64:], 0x60)
	must(t, "post recv", qb.PostRecv(1, SGE(t, dst, 0, grhLen+128)))
	must(t, "post recv", qb.PostRecv(2, SGE(t, dst, grhLen+128, grhLen+128)))

	wrong := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey ^ 0x1}
	right := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}
	must(t, "post send with wrong Q_Key", qa.PostSend(1, verbs.Signaled, wrong, SGE(t, src, 0, 30)))
	must(t, "post send with right Q_Key", qa.PostSend(2, verbs.Signaled, right, SGE(t, src, 64, 50)))
	for i, wc := range c.poll(t, a.CQ, 2) {
		expectOK(t, "UD send completion", wc, uint64(i+1), verbs.OpSend, qa.QPN())
	}
	wc := c.pollOne(t, b.CQ)
	expectOK(t, "first UD receive", wc, 1, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "first UD receive (must be the right-Q_Key datagram)", wc, 50+grhLen)
	checkBytes(t, "first UD receive payload", dst.Bytes()[grhLen:grhLen+50], src.Bytes()[64:114])
	// Datagrams between two QPs over one path arrive in order, so the
	// dropped one cannot still come.
	expectEmpty(t, "receiver cq after the right-Q_Key datagram", b.CQ)
}

// testUDOversize sends a datagram larger than the path MTU: it must not be
// delivered (the post may fail, or the send complete with or without an
// error: C10-93.1.1 lets the device drop it silently). A datagram sent
// afterwards from another QP is the first one received.
func testUDOversize(t *testing.T, c *tcase) {
	a, b, qa, qb, ah, eb := udSetup(t, c)
	qa2 := a.NewUD(t, verbs.QPSpec{})
	mtu := eb.MTU.Bytes()
	if mtu == 0 {
		t.Fatalf("UD endpoint has invalid MTU %v", eb.MTU)
	}
	src := a.Alloc(t, mtu+64, accessLocal)
	dst := b.Alloc(t, 2*(grhLen+2*mtu), accessLocal)
	Pattern(src.Bytes(), 0x0F)
	// Room for the oversized message, in case the provider delivers it.
	must(t, "post recv", qb.PostRecv(1, SGE(t, dst, 0, grhLen+2*mtu)))
	must(t, "post recv", qb.PostRecv(2, SGE(t, dst, grhLen+2*mtu, grhLen+2*mtu)))

	to := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}
	if err := qa.PostSend(1, verbs.Signaled, to, SGE(t, src, 0, mtu+1)); err != nil {
		t.Logf("oversized UD send refused at post: %v", err)
	} else {
		wc := c.pollOne(t, a.CQ)
		t.Logf("oversized UD send completed with %v", wc)
		if wc.WRID != 1 {
			t.Errorf("oversized UD send completion has wr_id %#x, want 1", wc.WRID)
		}
	}
	must(t, "post UD send from a second QP", qa2.PostSend(2, verbs.Signaled, to, SGE(t, src, 64, 33)))
	expectOK(t, "UD send completion", c.pollOne(t, a.CQ), 2, verbs.OpSend, qa2.QPN())
	wc := c.pollOne(t, b.CQ)
	expectOK(t, "first UD receive", wc, 1, verbs.OpRecv, qb.QPN())
	expectByteLen(t, "first UD receive (must not be the oversized datagram)", wc, 33+grhLen)
	if wc.SrcQP != qa2.QPN() {
		t.Errorf("first UD receive: src_qp %d, want the second sender %d", wc.SrcQP, qa2.QPN())
	}
}

// testUCSendWrite checks send/receive, RDMA write and write with
// immediate on UC queue pairs.
func testUCSendWrite(t *testing.T, c *tcase) {
	p := NewLoopbackUC(t, c.cfg, verbs.QPSpec{})
	src := p.A.Alloc(t, 8192, accessLocal)
	dst := p.B.Alloc(t, 8192, accessAll)
	rbuf := p.B.Alloc(t, 4096, accessLocal)
	Pattern(src.Bytes(), 0x0C)
	Pattern(dst.Bytes(), 0xEE)
	want := bytes.Clone(dst.Bytes())

	must(t, "post recv", p.QB.PostRecv(1, rbuf.All()))
	must(t, "post UC send", p.QA.PostSend(2, verbs.Signaled, SGE(t, src, 0, 3000)))
	expectOK(t, "UC send completion", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())
	wc := c.pollOne(t, p.B.CQ)
	expectOK(t, "UC recv completion", wc, 1, verbs.OpRecv, p.QB.QPN())
	expectByteLen(t, "UC recv completion", wc, 3000)
	checkBytes(t, "UC received data", rbuf.Bytes()[:3000], src.Bytes()[:3000])

	// A UC write completes at the sender when sent, not when placed: the
	// write with immediate that follows it on the same QP completes at the
	// target only after both were placed.
	must(t, "post recv", p.QB.PostRecv(3, SGE(t, rbuf, 0, 16)))
	b := p.QA.NewBatch(2)
	b.Write(4, dst.Remote().At(10), SGE(t, src, 100, 5000)).Signaled()
	b.WriteImm(5, dst.Remote().At(6000), 0x00C0FFEE, SGE(t, src, 6000, 100)).Signaled()
	must(t, "submit UC writes", b.Submit())
	expectOK(t, "UC write completion", c.pollOne(t, p.A.CQ), 4, verbs.OpWrite, p.QA.QPN())
	expectOK(t, "UC write-imm completion", c.pollOne(t, p.A.CQ), 5, verbs.OpWrite, p.QA.QPN())
	wc = c.pollOne(t, p.B.CQ)
	expectOK(t, "UC write-imm target completion", wc, 3, verbs.OpRecvWriteImm, p.QB.QPN())
	expectImm(t, "UC write-imm target completion", wc, 0x00C0FFEE)
	expectByteLen(t, "UC write-imm target completion", wc, 100)
	copy(want[10:], src.Bytes()[100:5100])
	copy(want[6000:], src.Bytes()[6000:6100])
	checkBytes(t, "remote MR after UC writes", dst.Bytes(), want)
}

// testUDBatch posts datagrams in one batch (send, with immediate data,
// inline, inline with immediate data): they arrive in order, each after
// its GRH. Reset drops what a batch collected, nothing posted; a
// destination without an address handle makes Submit fail before
// anything is posted.
func testUDBatch(t *testing.T, c *tcase) {
	a, b, qa, qb, ah, eb := udSetup(t, c)
	to := verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}
	src := a.Alloc(t, 64, accessLocal)
	const slot = grhLen + 64
	dst := b.Alloc(t, 4*slot, accessLocal)
	Pattern(src.Bytes(), 0x3C)
	for i := range 4 {
		must(t, "post recv", qb.PostRecv(uint64(i), SGE(t, dst, i*slot, slot)))
	}

	bt := qa.NewBatch(4)
	if bt.Cap() != 4 {
		t.Fatalf("batch cap %d, want 4", bt.Cap())
	}
	bt.Send(1, to, SGE(t, src, 0, 8))
	bt.Reset()
	if bt.Len() != 0 {
		t.Fatalf("batch holds %d after Reset", bt.Len())
	}
	must(t, "submit an empty batch", bt.Submit())
	expectEmpty(t, "receiver cq after a Reset batch", b.CQ)

	inline := []byte("inline datagram")
	bt.Send(10, to, SGE(t, src, 0, 20))
	bt.SendImm(11, to, 0xA11, SGE(t, src, 20, 7))
	bt.SendInline(12, to, inline)
	bt.SendImmInline(13, to, 0xB22, inline[:6]).WithFlags(verbs.Signaled)
	if bt.Len() != 4 {
		t.Fatalf("batch holds %d, want 4", bt.Len())
	}
	must(t, "submit", bt.Submit())
	expectOK(t, "signaled last datagram", c.pollOne(t, a.CQ), 13, verbs.OpSend, qa.QPN())
	want := []struct {
		data []byte
		imm  uint32
	}{{src.Bytes()[:20], 0}, {src.Bytes()[20:27], 0xA11}, {inline, 0}, {inline[:6], 0xB22}}
	for i, wc := range c.poll(t, b.CQ, 4) {
		expectOK(t, "UD batch receive", wc, uint64(i), verbs.OpRecv, qb.QPN())
		expectByteLen(t, "UD batch receive", wc, grhLen+len(want[i].data))
		if want[i].imm != 0 {
			expectImm(t, "UD batch receive", wc, want[i].imm)
		} else {
			expectNoImm(t, "UD batch receive", wc)
		}
		off := i*slot + grhLen
		checkBytes(t, "UD batch payload", dst.Bytes()[off:off+len(want[i].data)], want[i].data)
	}

	bt.Send(20, to, SGE(t, src, 0, 8))
	bt.Send(21, verbs.Destination{QPN: eb.QPN, QKey: eb.QKey}, SGE(t, src, 0, 8))
	if err := bt.Submit(); err == nil {
		t.Fatal("a batch with a destination without an address handle was submitted")
	}
	expectEmpty(t, "sender cq after a refused batch", a.CQ)
	expectEmpty(t, "receiver cq after a refused batch", b.CQ)
}
