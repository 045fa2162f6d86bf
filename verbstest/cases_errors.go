package verbstest

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// badRKey returns an rkey that no MR in mrs has.
func badRKey(mrs ...*verbs.MemoryRegion) uint32 {
	k := mrs[0].RKey() ^ 0x5A5A5A5A
	for slices.ContainsFunc(mrs, func(m *verbs.MemoryRegion) bool { return m.RKey() == k }) {
		k += 0x10001
	}
	return k
}

// badLKey returns an lkey that no MR in mrs has.
func badLKey(mrs ...*verbs.MemoryRegion) uint32 {
	k := mrs[0].LKey() ^ 0x5A5A5A5A
	for slices.ContainsFunc(mrs, func(m *verbs.MemoryRegion) bool { return m.LKey() == k }) {
		k += 0x10001
	}
	return k
}

// expectFailure posts one request with post, waits for its completion on
// the requester's CQ and checks its status and that the requester QP moves
// to ERR.
func (c *tcase) expectFailure(t *testing.T, p *RCPair, what string, status verbs.Status, post func(wrid uint64) error) {
	t.Helper()
	const wrid = 0xE0
	must(t, "post "+what, post(wrid))
	wc := c.pollOne(t, p.A.CQ)
	expectStatus(t, what, wc, wrid, status, p.QA.QPN())
	if wc.Status == status {
		c.waitState(t, "requester after "+what, p.QA, verbs.StateError)
	}
}

// testErrBadRKey writes and reads with an rkey the target does not have.
func testErrBadRKey(t *testing.T, c *tcase) {
	for _, op := range []string{"write", "read", "atomic"} {
		c.check(t, strings.ToUpper(op[:1])+op[1:], func(t *testing.T) {
			p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
			remote := p.B.Alloc(t, 4096, accessAll)
			local := p.A.Alloc(t, 4096, accessLocal)
			Pattern(remote.Bytes(), 0xEE)
			before := bytes.Clone(remote.Bytes())
			dst := verbs.RemoteAddr{Addr: remote.Addr(), RKey: badRKey(remote, local)}
			c.expectFailure(t, p, op+" with a bad rkey", verbs.StatusRemAccessErr, func(wrid uint64) error {
				switch op {
				case "write":
					return p.QA.PostWrite(wrid, verbs.Signaled, dst, SGE(t, local, 0, 64))
				case "read":
					return p.QA.PostRead(wrid, verbs.Signaled, dst, SGE(t, local, 0, 64))
				}
				return p.QA.PostFetchAdd(wrid, verbs.Signaled, dst, 1, SGE(t, local, 0, 8))
			})
			checkBytes(t, "target MR", remote.Bytes(), before)
		})
	}
}

// testErrOutOfBounds accesses a registered sub-range of a larger buffer
// just past its end and just before its start: REM_ACCESS_ERR, and the
// memory around the MR (and in it) is untouched. The buffer is Go memory,
// and then ("Window...") the memory of an MR from Alloc, whose middle page
// is registered as an MR of its own.
func testErrOutOfBounds(t *testing.T, c *tcase) {
	const page = 4096
	type access struct {
		name string
		off  int64 // from the MR start
		n    int
		op   string
	}
	for _, window := range []bool{false, true} {
		for _, x := range []access{
			{"WriteAcrossEnd", page - 8, 16, "write"},
			{"WriteBeforeStart", -8, 8, "write"},
			{"WritePastEnd", page, 8, "write"},
			{"ReadAcrossEnd", page - 8, 16, "read"},
			{"AtomicPastEnd", page, 8, "atomic"},
		} {
			name := x.name
			if window {
				name = "Window" + name
			}
			c.check(t, name, func(t *testing.T) { outOfBounds(t, c, window, x.off, x.n, x.op) })
		}
	}
}

// outOfBounds is one check of testErrOutOfBounds: an op of n bytes at
// off from the start of a one-page MR in the middle of a three-page buffer
// of side B (Go memory, or the memory of an MR from Alloc when window is
// set): REM_ACCESS_ERR, and not one byte of the buffer changes.
func outOfBounds(t *testing.T, c *tcase, window bool, off int64, n int, op string) {
	const page = 4096
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	var buf []byte
	if window {
		buf = p.B.Alloc(t, 3*page, accessAll).Bytes()
	} else {
		buf = make([]byte, 3*page)
	}
	Pattern(buf, 0xEE)
	before := bytes.Clone(buf)
	remote := p.B.Register(t, buf[page:2*page], accessAll)
	local := p.A.Alloc(t, 64, accessLocal)
	Pattern(local.Bytes(), 0x11)
	dst := verbs.RemoteAddr{Addr: uint64(int64(remote.Addr()) + off), RKey: remote.RKey()}
	c.expectFailure(t, p, fmt.Sprintf("%s of %d bytes at MR offset %d", op, n, off), verbs.StatusRemAccessErr,
		func(wrid uint64) error {
			switch op {
			case "write":
				return p.QA.PostWrite(wrid, verbs.Signaled, dst, SGE(t, local, 0, n))
			case "read":
				return p.QA.PostRead(wrid, verbs.Signaled, dst, SGE(t, local, 0, n))
			}
			return p.QA.PostFetchAdd(wrid, verbs.Signaled, dst, 1, SGE(t, local, 0, 8))
		})
	checkBytes(t, "memory before the MR", buf[:page], before[:page])
	checkBytes(t, "memory after the MR", buf[2*page:], before[2*page:])
	checkBytes(t, "the MR itself", buf[page:2*page], before[page:2*page])
}

// testErrNoRemotePermission accesses MRs registered without the remote
// permission the operation needs.
func testErrNoRemotePermission(t *testing.T, c *tcase) {
	type access struct {
		name   string
		access verbs.Access
		op     string
	}
	for _, x := range []access{
		{"WriteWithoutRemoteWrite", verbs.AccessLocalWrite | verbs.AccessRemoteRead | verbs.AccessRemoteAtomic, "write"},
		{"ReadWithoutRemoteRead", verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteAtomic, "read"},
		{"AtomicWithoutRemoteAtomic", verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead, "atomic"},
		{"WriteToLocalOnlyMR", verbs.AccessLocalWrite, "write"},
	} {
		c.check(t, x.name, func(t *testing.T) {
			p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
			remote := p.B.Alloc(t, 4096, x.access)
			local := p.A.Alloc(t, 4096, accessLocal)
			Pattern(remote.Bytes(), 0xEE)
			Pattern(local.Bytes(), 0x11)
			before := bytes.Clone(remote.Bytes())
			dst := remote.Remote().At(64)
			c.expectFailure(t, p, fmt.Sprintf("%s to an MR with access %v", x.op, x.access), verbs.StatusRemAccessErr,
				func(wrid uint64) error {
					switch x.op {
					case "write":
						return p.QA.PostWrite(wrid, verbs.Signaled, dst, SGE(t, local, 0, 64))
					case "read":
						return p.QA.PostRead(wrid, verbs.Signaled, dst, SGE(t, local, 0, 64))
					}
					return p.QA.PostCompareSwap(wrid, verbs.Signaled, dst, word(before, 64), 1, SGE(t, local, 0, 8))
				})
			checkBytes(t, "target MR", remote.Bytes(), before)
		})
	}
}

// testErrLocalProtection uses local buffers the requester may not use:
// LOC_PROT_ERR.
func testErrLocalProtection(t *testing.T, c *tcase) {
	type access struct {
		name string
		post func(p *RCPair, local, readOnly, remote *verbs.MemoryRegion, wrid uint64) error
	}
	for _, x := range []access{
		{"SendBadLKey", func(p *RCPair, local, _, remote *verbs.MemoryRegion, wrid uint64) error {
			return p.QA.PostSend(wrid, verbs.Signaled, verbs.SGE{Addr: local.Addr(), Length: 64, LKey: badLKey(local, remote)})
		}},
		{"SendPastMREnd", func(p *RCPair, local, _, _ *verbs.MemoryRegion, wrid uint64) error {
			return p.QA.PostSend(wrid, verbs.Signaled, rawSGE(local, local.Len()-32, 64))
		}},
		{"WritePastMREnd", func(p *RCPair, local, _, remote *verbs.MemoryRegion, wrid uint64) error {
			return p.QA.PostWrite(wrid, verbs.Signaled, remote.Remote().At(0), rawSGE(local, local.Len()-32, 64))
		}},
		{"ReadIntoMRWithoutLocalWrite", func(p *RCPair, _, readOnly, remote *verbs.MemoryRegion, wrid uint64) error {
			return p.QA.PostRead(wrid, verbs.Signaled, remote.Remote().At(0), SGE(t, readOnly, 0, 64))
		}},
		{"SendFromOtherPD", func(p *RCPair, _, _, remote *verbs.MemoryRegion, wrid uint64) error {
			// remote belongs to side B's PD (and maybe another device).
			return p.QA.PostSend(wrid, verbs.Signaled, SGE(t, remote, 0, 64))
		}},
	} {
		c.check(t, x.name, func(t *testing.T) {
			p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
			local := p.A.Alloc(t, 4096, accessLocal)
			readOnly := p.A.Alloc(t, 4096, 0)
			remote := p.B.Alloc(t, 4096, accessAll)
			rbuf := p.B.Alloc(t, 4096, accessLocal)
			Pattern(remote.Bytes(), 0xEE)
			before := bytes.Clone(remote.Bytes())
			// A receive, so that a provider that sends anyway is not
			// stuck in RNR retries.
			must(t, "post recv", p.QB.PostRecv(1, rbuf.All()))
			c.expectFailure(t, p, x.name, verbs.StatusLocProtErr, func(wrid uint64) error {
				return x.post(p, local, readOnly, remote, wrid)
			})
			checkBytes(t, "target MR", remote.Bytes(), before)
		})
	}
}

// testErrRecvTooSmall sends a message larger than the receive buffer:
// LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at the sender.
func testErrRecvTooSmall(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	src := p.A.Alloc(t, 64, accessLocal)
	dst := p.B.Alloc(t, 64, accessLocal)
	must(t, "post recv", p.QB.PostRecv(1, SGE(t, dst, 0, 16)))
	must(t, "post send", p.QA.PostSend(2, verbs.Signaled, SGE(t, src, 0, 64)))
	sender := c.pollOne(t, p.A.CQ)
	receiver := c.pollOne(t, p.B.CQ)
	c.check(t, "SenderStatus", func(t *testing.T) {
		expectStatus(t, "sender completion", sender, 2, verbs.StatusRemInvReqErr, p.QA.QPN())
		c.waitState(t, "sender", p.QA, verbs.StateError)
	})
	c.check(t, "ReceiverStatus", func(t *testing.T) {
		expectStatus(t, "receiver completion", receiver, 1, verbs.StatusLocLenErr, p.QB.QPN())
		c.waitState(t, "receiver", p.QB, verbs.StateError)
	})
}

// testErrRNRRetryExceeded sends to a peer with no receive posted, with one
// RNR retry: RNR_RETRY_EXC_ERR.
func testErrRNRRetryExceeded(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{RNRRetry: 1, MinRNRTimer: 1})
	src := p.A.Alloc(t, 64, accessLocal)
	c.expectFailure(t, p, "send without a receive", verbs.StatusRNRRetryExcErr, func(wrid uint64) error {
		return p.QA.PostSend(wrid, verbs.Signaled, SGE(t, src, 0, 32))
	})
	expectEmpty(t, "receiver cq", p.B.CQ)
}

// expectEINVAL checks that err wraps syscall.EINVAL.
func expectEINVAL(t testing.TB, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want EINVAL", what)
	} else if !errors.Is(err, syscall.EINVAL) {
		t.Errorf("%s: %v, want an error wrapping EINVAL", what, err)
	}
}

// testErrPostWrongState posts in states that do not allow it: sends before
// RTS, receives in RESET.
func testErrPostWrongState(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	qa := a.NewRC(t, verbs.QPSpec{})
	qb := b.NewRC(t, verbs.QPSpec{})
	src := a.Alloc(t, 64, accessLocal)
	rbuf := a.Alloc(t, 64, accessLocal)
	expectState(t, "new RC QP", qa, verbs.StateInit)

	c.check(t, "SendInInit", func(t *testing.T) {
		expectEINVAL(t, "post send in INIT", qa.PostSend(1, verbs.Signaled, SGE(t, src, 0, 8)))
		bt := qa.NewBatch(2)
		bt.Send(2, SGE(t, src, 0, 8)).Signaled()
		err := bt.Submit()
		expectEINVAL(t, "submit a send batch in INIT", err)
		var pe *verbs.PostError
		if errors.As(err, &pe) && pe.Posted != 0 {
			t.Errorf("submit a send batch in INIT: PostError.Posted = %d, want 0", pe.Posted)
		}
	})
	must(t, "post recv in INIT (allowed)", qa.PostRecv(3, SGE(t, rbuf, 0, 32)))

	must(t, "modify to RTR", qa.Modify(rtrAttr(t, a, qa, Endpoint(t, qb))))
	expectState(t, "after the move to RTR", qa, verbs.StateRTR)
	c.check(t, "SendInRTR", func(t *testing.T) {
		expectEINVAL(t, "post send in RTR", qa.PostSend(4, verbs.Signaled, SGE(t, src, 0, 8)))
	})
	must(t, "post recv in RTR (allowed)", qa.PostRecv(5, SGE(t, rbuf, 32, 32)))

	must(t, "modify to RESET", qa.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState))
	expectState(t, "after the move to RESET", qa, verbs.StateReset)
	c.check(t, "RecvInReset", func(t *testing.T) {
		expectEINVAL(t, "post recv in RESET", qa.PostRecv(6, SGE(t, rbuf, 0, 32)))
	})
	c.check(t, "SendInReset", func(t *testing.T) {
		expectEINVAL(t, "post send in RESET", qa.PostSend(7, verbs.Signaled, SGE(t, src, 0, 8)))
	})
	// Moving to RESET discards outstanding requests without completions.
	expectEmpty(t, "cq after RESET", a.CQ)
}

// testFlushAfterError fails one request and checks that every other
// outstanding request, signaled or not, and every posted receive completes
// with WR_FLUSH_ERR, that the QP is in ERR, and that requests posted in ERR
// are flushed too.
func testFlushAfterError(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	local := p.A.Alloc(t, 4096, accessLocal)
	remote := p.B.Alloc(t, 4096, accessAll)
	rbuf := p.B.Alloc(t, 4096, accessLocal)
	must(t, "post recv at B", p.QB.PostRecv(0xB1, rbuf.All()))
	must(t, "post recv at A", p.QA.PostRecv(50, SGE(t, local, 2048, 64)))
	must(t, "post recv at A", p.QA.PostRecv(51, SGE(t, local, 3072, 64)))

	b := p.QA.NewBatch(4)
	b.Write(1, verbs.RemoteAddr{Addr: remote.Addr(), RKey: badRKey(remote, local)}, SGE(t, local, 0, 64)).Signaled()
	b.Write(2, remote.Remote().At(0), SGE(t, local, 0, 64)).Signaled()
	b.Write(3, remote.Remote().At(64), SGE(t, local, 0, 64)) // unsignaled
	b.Send(4, SGE(t, local, 0, 64)).Signaled()
	must(t, "submit batch", b.Submit())

	wcs := c.poll(t, p.A.CQ, 6)
	var sendOrder []uint64
	recvs := map[uint64]bool{}
	for _, wc := range wcs {
		switch wc.WRID {
		case 1:
			expectStatus(t, "failing write", wc, 1, verbs.StatusRemAccessErr, p.QA.QPN())
			sendOrder = append(sendOrder, wc.WRID)
		case 2, 3, 4:
			expectStatus(t, fmt.Sprintf("request %d after the failure", wc.WRID), wc, wc.WRID, verbs.StatusWRFlushErr, p.QA.QPN())
			sendOrder = append(sendOrder, wc.WRID)
		case 50, 51:
			expectStatus(t, fmt.Sprintf("receive %d", wc.WRID), wc, wc.WRID, verbs.StatusWRFlushErr, p.QA.QPN())
			recvs[wc.WRID] = true
		default:
			t.Errorf("unexpected completion %v", wc)
		}
	}
	if !slices.Equal(sendOrder, []uint64{1, 2, 3, 4}) {
		t.Errorf("send queue completions in order %v, want [1 2 3 4] (every request, signaled or not, in posting order)", sendOrder)
	}
	if len(recvs) != 2 {
		t.Errorf("flushed receives %v, want 50 and 51", recvs)
	}
	expectState(t, "requester after the flush", p.QA, verbs.StateError)

	// Requests posted in ERR are accepted and flushed, even unsignaled ones.
	c.check(t, "PostedInErr", func(t *testing.T) {
		must(t, "post send in ERR", p.QA.PostSend(5, 0, SGE(t, local, 0, 8)))
		must(t, "post recv in ERR", p.QA.PostRecv(52, SGE(t, local, 2048, 64)))
		got := map[uint64]verbs.Completion{}
		for _, wc := range c.poll(t, p.A.CQ, 2) {
			got[wc.WRID] = wc
		}
		for _, id := range []uint64{5, 52} {
			wc, ok := got[id]
			if !ok {
				t.Errorf("no completion for request %d posted in ERR (got %v)", id, got)
				continue
			}
			expectStatus(t, fmt.Sprintf("request %d posted in ERR", id), wc, id, verbs.StatusWRFlushErr, p.QA.QPN())
		}
	})
}
