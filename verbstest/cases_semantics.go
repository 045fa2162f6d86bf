package verbstest

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// testSrcQP checks the src_qp field of receive completions: a UD receive
// names the sender's QPN; the receives of connected (RC and UC) queue
// pairs carry 0, as on rdma_rxe (ibv_poll_cq(3) defines src_qp for UD
// only; see verbs.Completion).
func testSrcQP(t *testing.T, c *tcase) {
	c.check(t, "RC", func(t *testing.T) {
		p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
		src := p.A.Alloc(t, 64, accessLocal)
		dst := p.B.Alloc(t, 128, accessAll)
		must(t, "post recv", p.QB.PostRecv(1, SGE(t, dst, 0, 64)))
		must(t, "post recv", p.QB.PostRecv(2, SGE(t, dst, 64, 64)))
		must(t, "post send", p.QA.PostSend(3, 0, SGE(t, src, 0, 16)))
		must(t, "post write imm", p.QA.PostWriteImm(4, 0, dst.Remote().At(100), 7, SGE(t, src, 0, 8)))
		for i, wc := range c.poll(t, p.B.CQ, 2) {
			expectOK(t, "RC receive", wc, uint64(i+1), []verbs.Opcode{verbs.OpRecv, verbs.OpRecvWriteImm}[i], p.QB.QPN())
			if wc.SrcQP != 0 {
				t.Errorf("RC receive %d: src_qp %d, want 0 (the sender is QPN %d)", i+1, wc.SrcQP, p.QA.QPN())
			}
		}
	})
	c.check(t, "UC", func(t *testing.T) {
		p := NewLoopbackUC(t, c.cfg, verbs.QPSpec{})
		src := p.A.Alloc(t, 64, accessLocal)
		dst := p.B.Alloc(t, 64, accessLocal)
		must(t, "post recv", p.QB.PostRecv(1, dst.All()))
		must(t, "post send", p.QA.PostSend(2, verbs.Signaled, SGE(t, src, 0, 16)))
		expectOK(t, "UC send", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())
		wc := c.pollOne(t, p.B.CQ)
		expectOK(t, "UC receive", wc, 1, verbs.OpRecv, p.QB.QPN())
		if wc.SrcQP != 0 {
			t.Errorf("UC receive: src_qp %d, want 0 (the sender is QPN %d)", wc.SrcQP, p.QA.QPN())
		}
	})
	c.check(t, "UD", func(t *testing.T) {
		a, b, qa, qb, ah, eb := udSetup(t, c)
		src := a.Alloc(t, 64, accessLocal)
		dst := b.Alloc(t, grhLen+64, accessLocal)
		must(t, "post recv", qb.PostRecv(1, dst.All()))
		must(t, "post UD send", qa.PostSend(2, verbs.Signaled, verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}, SGE(t, src, 0, 16)))
		expectOK(t, "UD send", c.pollOne(t, a.CQ), 2, verbs.OpSend, qa.QPN())
		wc := c.pollOne(t, b.CQ)
		expectOK(t, "UD receive", wc, 1, verbs.OpRecv, qb.QPN())
		if wc.SrcQP != qa.QPN() {
			t.Errorf("UD receive: src_qp %d, want the sender's QPN %d", wc.SrcQP, qa.QPN())
		}
	})
}

// testUCHelpers checks the single-request helpers of UC queue pairs that
// carry immediate data or inline payloads (the same as RC's): each
// delivers its bytes and immediate, and a write with immediate consumes
// a receive whose buffer it does not touch.
func testUCHelpers(t *testing.T, c *tcase) {
	p := NewLoopbackUC(t, c.cfg, verbs.QPSpec{MaxInlineData: 64})
	src := p.A.Alloc(t, 256, accessLocal)
	dst := p.B.Alloc(t, 256, accessAll)
	rbuf := p.B.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0x3C)
	inline := []byte("inline payload of a UC helper")
	at := dst.Remote().At
	tests := []struct {
		name string
		post func(wrid uint64) error
		// The expected receive completion: opcode and immediate (0: none).
		op  verbs.Opcode
		imm uint32
		// Where the payload lands (recv: the receive buffer, else dst at
		// off) and what it is.
		recv bool
		off  int
		want []byte
	}{
		{"PostSendImm", func(id uint64) error { return p.QA.PostSendImm(id, verbs.Signaled, 0x5E4D0001, SGE(t, src, 0, 40)) },
			verbs.OpRecv, 0x5E4D0001, true, 0, src.Bytes()[:40]},
		{"PostSendImmInline", func(id uint64) error { return p.QA.PostSendImmInline(id, verbs.Signaled, 0x5E4D0002, inline) },
			verbs.OpRecv, 0x5E4D0002, true, 0, inline},
		{"PostWriteImm", func(id uint64) error {
			return p.QA.PostWriteImm(id, verbs.Signaled, at(16), 0x5E4D0003, SGE(t, src, 100, 50))
		}, verbs.OpRecvWriteImm, 0x5E4D0003, false, 16, src.Bytes()[100:150]},
		{"PostWriteImmInline", func(id uint64) error {
			return p.QA.PostWriteImmInline(id, verbs.Signaled, at(128), 0x5E4D0004, inline)
		}, verbs.OpRecvWriteImm, 0x5E4D0004, false, 128, inline},
		{"PostWriteInline+PostSendInline", func(id uint64) error {
			// An inline write has no completion at the target: a send
			// after it (ordered on the QP) tells that it was placed.
			if err := p.QA.PostWriteInline(id+100, 0, at(200), inline[:20]); err != nil {
				return err
			}
			return p.QA.PostSendInline(id, verbs.Signaled, inline[20:])
		}, verbs.OpRecv, 0, true, 0, inline[20:]},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id := uint64(10 + i)
			Pattern(rbuf.Bytes(), 0xEE)
			rbefore := bytes.Clone(rbuf.Bytes())
			must(t, "post recv", p.QB.PostRecv(id, rbuf.All()))
			must(t, tt.name, tt.post(id))
			sop := verbs.OpWrite
			if tt.recv {
				sop = verbs.OpSend
			}
			expectOK(t, tt.name+" completion", c.pollOne(t, p.A.CQ), id, sop, p.QA.QPN())
			wc := c.pollOne(t, p.B.CQ)
			expectOK(t, "receive completion", wc, id, tt.op, p.QB.QPN())
			expectByteLen(t, "receive completion", wc, len(tt.want))
			if tt.imm != 0 {
				expectImm(t, "receive completion", wc, tt.imm)
			} else {
				expectNoImm(t, "receive completion", wc)
			}
			if tt.recv {
				checkBytes(t, "received data", rbuf.Bytes()[:len(tt.want)], tt.want)
			} else {
				checkBytes(t, "written data", dst.Bytes()[tt.off:tt.off+len(tt.want)], tt.want)
				checkBytes(t, "receive buffer of a write with immediate (must be untouched)", rbuf.Bytes(), rbefore)
			}
			if tt.name == "PostWriteInline+PostSendInline" {
				checkBytes(t, "inline write", dst.Bytes()[200:220], inline[:20])
			}
		})
	}
}

// testSolicitedEvents checks a CQ armed for solicited completions only
// (RequestNotify(true)): an unsolicited receive does not wake its
// channel, a solicited one does.
//
// "Did not wake" is not checked with a wait that must time out: B's
// receive CQ and B's send CQ share one completion channel, whose events
// come out in the order they were raised. After the unsolicited receive
// has been polled from the receive CQ, B sends a message, whose
// completion raises an event on the send CQ (armed for any completion).
// Had the unsolicited receive raised an event, it would have been raised
// before (when its completion was written, before it could be polled), so
// the first event on the channel must be the send CQ's. Then a solicited
// send must wake the receive CQ. Last, with the receive CQ armed again,
// an unsolicited and a solicited send posted together give one event,
// after which the receive CQ holds both completions.
func testSolicitedEvents(t *testing.T, c *tcase) {
	a, b, ch, scq, rcq, qa, qb := channelPair(t, c)
	ma := a.Alloc(t, 64, accessLocal)
	mb := b.Alloc(t, 256, accessLocal)
	guard := c.guard(t)
	for i := range 4 {
		must(t, "post recv at B", qb.PostRecv(uint64(i+1), SGE(t, mb, 64*i, 64)))
	}
	// sentinel raises an event on the send CQ (a send from B) and checks
	// that it is the next event on the channel: the receive CQ raised
	// none before it (why says what such an event would mean).
	sentinel := func(wrid uint64, why string) {
		t.Helper()
		must(t, "post recv at A", qa.PostRecv(wrid, SGE(t, ma, 32, 32)))
		must(t, "arm the send CQ", scq.RequestNotify(false))
		must(t, "post send from B", qb.PostSend(wrid, verbs.Signaled, SGE(t, mb, 0, 8)))
		expectEvent(t, guard, ch, scq, scq, rcq, why)
		expectOK(t, "send from B", c.pollOne(t, scq), wrid, verbs.OpSend, qb.QPN())
		expectOK(t, "receive at A", c.pollOne(t, a.CQ), wrid, verbs.OpRecv, qa.QPN())
	}
	must(t, "arm the receive CQ for solicited completions", rcq.RequestNotify(true))

	// An unsolicited send: its receive completion raises no event.
	must(t, "post unsolicited send", qa.PostSend(10, verbs.Signaled, SGE(t, ma, 0, 8)))
	expectOK(t, "unsolicited send", c.pollOne(t, a.CQ), 10, verbs.OpSend, qa.QPN())
	expectOK(t, "unsolicited receive (polled, not waited for)", c.pollOne(t, rcq), 1, verbs.OpRecv, qb.QPN())
	sentinel(11, "an event before it means that the unsolicited receive woke a CQ armed for solicited completions only")

	// A solicited send wakes it.
	must(t, "post solicited send", qa.PostSend(12, verbs.Signaled|verbs.Solicited, SGE(t, ma, 0, 8)))
	expectEvent(t, guard, ch, rcq, scq, rcq, "a solicited receive")
	expectOK(t, "solicited receive", c.pollOne(t, rcq), 2, verbs.OpRecv, qb.QPN())
	expectOK(t, "solicited send", c.pollOne(t, a.CQ), 12, verbs.OpSend, qa.QPN())

	// Unsolicited then solicited, in one batch: one event, two completions.
	must(t, "arm the receive CQ for solicited completions", rcq.RequestNotify(true))
	bt := qa.NewBatch(2)
	bt.Send(13, SGE(t, ma, 0, 8))
	bt.SendImm(14, 0x50C, SGE(t, ma, 0, 8)).Solicited().Signaled()
	must(t, "submit unsolicited and solicited sends", bt.Submit())
	expectEvent(t, guard, ch, rcq, scq, rcq, "a solicited receive after an unsolicited one")
	wcs := c.poll(t, rcq, 2)
	expectOK(t, "unsolicited receive before the solicited one", wcs[0], 3, verbs.OpRecv, qb.QPN())
	expectNoImm(t, "unsolicited receive", wcs[0])
	expectOK(t, "solicited receive", wcs[1], 4, verbs.OpRecv, qb.QPN())
	expectImm(t, "solicited receive", wcs[1], 0x50C)
	expectOK(t, "solicited send", c.pollOne(t, a.CQ), 14, verbs.OpSend, qa.QPN())

	// No other event is queued.
	sentinel(15, "an event before it means that the receive CQ raised more than one event for one arm")
}

// testRecvMRClosed closes the memory region a posted receive points into,
// then sends to it: as on hardware, Close succeeds, and the receive
// completes with a local protection error (rdma_rxe: local QP operation
// error) without writing anywhere, the receiving QP moves to ERR and a
// RC sender's request fails (a UC sender's completes: the message is
// lost). A region registered meanwhile, which may reuse
// the closed one's key, is not written either. Checked on a RC and a UC
// queue pair and on a RC queue pair with a shared receive queue, with a
// message of many packets.
func testRecvMRClosed(t *testing.T, c *tcase) {
	const size = 1 << 20 // many packets (and segments of soft0's transports)
	for _, kind := range []string{"RC", "UC", "SRQ"} {
		c.check(t, kind, func(t *testing.T) {
			a, b := NewNodes(t, c.cfg)
			var srq *verbs.SharedReceiveQueue
			if kind == "SRQ" {
				srq = b.NewSRQ(t, verbs.SRQSpec{MaxWR: 4})
			}
			type poster interface {
				PostSend(uint64, verbs.SendFlags, ...verbs.SGE) error
				PostRecv(uint64, ...verbs.SGE) error
				stateQuerier
			}
			var qa, qb poster
			if kind == "UC" {
				ua, ub := a.NewUC(t, verbs.QPSpec{}), b.NewUC(t, verbs.QPSpec{})
				ConnectUC(t, ua, ub)
				qa, qb = ua, ub
			} else {
				ra, rb := a.NewRC(t, verbs.QPSpec{RNRRetry: 1}), b.NewRC(t, verbs.QPSpec{SRQ: srq})
				ConnectRC(t, ra, rb)
				qa, qb = ra, rb
			}
			src := a.Alloc(t, size, accessLocal)
			Pattern(src.Bytes(), 0x4D)
			// The region is closed by hand below (the tracker's Close
			// later does nothing).
			gone := b.Alloc(t, size, accessLocal)
			sge := gone.All()
			if srq != nil {
				must(t, "post srq recv", srq.PostRecv(1, sge))
			} else {
				must(t, "post recv", qb.PostRecv(1, sge))
			}
			must(t, "close the region the receive points into", gone.Close())
			fresh := b.Alloc(t, size, accessLocal)
			Pattern(fresh.Bytes(), 0xEE)
			before := bytes.Clone(fresh.Bytes())

			must(t, "post send", qa.PostSend(2, verbs.Signaled, src.All()))
			wc := c.pollOne(t, b.CQ)
			if wc.WRID != 1 || (wc.Status != verbs.StatusLocProtErr && wc.Status != verbs.StatusLocQPOpErr) {
				t.Errorf("receive into a closed region: %v, want wr_id 0x1 with %s (or %s)", wc, verbs.StatusLocProtErr, verbs.StatusLocQPOpErr)
			}
			c.waitState(t, "receiving QP after the local error", qb, verbs.StateError)
			checkBytes(t, "region registered after the close", fresh.Bytes(), before)
			swc := c.pollOne(t, a.CQ)
			if kind == "UC" {
				// UC: the message is lost; the sender completes it.
				expectOK(t, "UC send", swc, 2, verbs.OpSend, qa.(*verbs.UCQueuePair).QPN())
				return
			}
			if swc.WRID != 2 || swc.Status == verbs.StatusSuccess {
				t.Errorf("send to a receive whose region was closed: %v, want a failure", swc)
			}
		})
	}
}

// corruptGID is a link-local GID that no port of the tests owns.
var corruptGID = verbs.GID{0xfe, 0x80, 12: 0xde, 13: 0xad, 14: 0xbe, 15: 0xef}

// routeErrnos are the errors of a destination GID that cannot be
// resolved: soft0 says EHOSTUNREACH, the kernel's RoCE address resolution
// (rdma_rxe at RTR) times out or finds no neighbour.
var routeErrnos = []syscall.Errno{syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.ETIMEDOUT, syscall.ENODATA}

func isRouteErr(err error) bool {
	for _, e := range routeErrnos {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// testGIDRouting checks that the GID of an endpoint is what routes: with
// the GID replaced by one that no port owns (and everything else, the
// provider address of soft0 included, intact), a RC queue pair either
// fails to connect, with an error (soft0: EHOSTUNREACH at RTR), or
// connects and its first request fails with a retry-exceeded error (a
// link-local GID on RoCE v1, whose MAC is derived from the GID); the
// receiver gets nothing. A UD address handle to that GID either cannot
// be created or sends datagrams that arrive nowhere: B's first receive
// gets the datagram sent after it to B's real GID.
func testGIDRouting(t *testing.T, c *tcase) {
	c.check(t, "RC", func(t *testing.T) {
		a, b := NewNodes(t, c.cfg)
		qa := a.NewRC(t, verbs.QPSpec{RetryCount: 1, Timeout: 8})
		qb := b.NewRC(t, verbs.QPSpec{})
		ea, eb := Endpoint(t, qa), Endpoint(t, qb)
		must(t, "connect B", qb.Connect(ea))
		src := a.Alloc(t, 64, accessLocal)
		dst := b.Alloc(t, 64, accessAll)
		Pattern(dst.Bytes(), 0xEE)
		before := bytes.Clone(dst.Bytes())
		must(t, "post recv", qb.PostRecv(1, dst.All()))
		bad := eb
		bad.GID = corruptGID
		if err := qa.Connect(bad); err != nil {
			t.Logf("connect to a corrupted GID: %v", err)
			if !isRouteErr(err) {
				t.Errorf("connect to GID %s: %v, want an error matching one of %v", bad.GID, err, routeErrnos)
			}
			if !strings.Contains(err.Error(), bad.GID.String()) && !strings.Contains(err.Error(), "modify") {
				t.Errorf("connect to GID %s: error %q names neither the GID nor the failed step", bad.GID, err)
			}
			expectState(t, "QP that failed to connect", qa, verbs.StateInit)
		} else {
			must(t, "post send", qa.PostSend(2, verbs.Signaled, SGE(t, src, 0, 8)))
			expectStatus(t, "send to a corrupted GID", c.pollOne(t, a.CQ), 2, verbs.StatusRetryExcErr, qa.QPN())
		}
		// Nothing reached B (the request failed, or was never sent).
		expectEmpty(t, "B after the requests to a corrupted GID", b.CQ)
		checkBytes(t, "B's receive buffer", dst.Bytes(), before)
	})
	c.check(t, "UD", func(t *testing.T) {
		a, b, qa, qb, ah, eb := udSetup(t, c)
		src := a.Alloc(t, 64, accessLocal)
		dst := b.Alloc(t, grhLen+64, accessLocal)
		Pattern(src.Bytes()[:32], 0x0B)
		Pattern(src.Bytes()[32:], 0x60)
		must(t, "post recv", qb.PostRecv(1, dst.All()))
		bad := eb
		bad.GID = corruptGID
		badAH, err := qa.AddressHandleTo(bad)
		if err != nil {
			t.Logf("address handle to a corrupted GID: %v", err)
			if !isRouteErr(err) {
				t.Errorf("address handle to GID %s: %v, want an error matching one of %v", bad.GID, err, routeErrnos)
			}
		} else {
			defer badAH.Close()
			must(t, "post UD send to a corrupted GID", qa.PostSend(2, verbs.Signaled, verbs.Destination{AH: badAH, QPN: eb.QPN, QKey: eb.QKey}, SGE(t, src, 0, 32)))
			expectOK(t, "UD send to a corrupted GID", c.pollOne(t, a.CQ), 2, verbs.OpSend, qa.QPN())
		}
		must(t, "post UD send", qa.PostSend(3, verbs.Signaled, verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}, SGE(t, src, 32, 32)))
		expectOK(t, "UD send", c.pollOne(t, a.CQ), 3, verbs.OpSend, qa.QPN())
		wc := c.pollOne(t, b.CQ)
		expectOK(t, "UD receive", wc, 1, verbs.OpRecv, qb.QPN())
		expectByteLen(t, "UD receive (must be the datagram sent to B's real GID)", wc, grhLen+32)
		checkBytes(t, "UD payload", dst.Bytes()[grhLen:grhLen+32], src.Bytes()[32:64])
	})
}

// expectEvent waits for the next event on ch, which must be for want (one
// of the channel's CQs send and recv); why says what the event is for.
func expectEvent(t *testing.T, ctx context.Context, ch *verbs.CompletionChannel, want, send, recv *verbs.CompletionQueue, why string) {
	t.Helper()
	got, err := ch.Wait(ctx)
	must(t, "wait on the channel", err)
	if got != want {
		t.Fatalf("event for the %s, want the %s's: %s", cqName(got, send, recv), cqName(want, send, recv), why)
	}
}
