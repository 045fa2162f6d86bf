package soft

import (
	"context"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// pairOver is pair() with the transport forced ("direct": in-process).
func pairOver(t *testing.T, kind string, typ prov.QPType, oa, ob connOpts) (*env, *ep, *ep) {
	t.Helper()
	forceTransport(t, kind)
	forceTLS(t, tlsOff)
	return pair(t, typ, oa, ob)
}

// eventWithin returns the next async event of c if one comes within d.
func eventWithin(c prov.Context, d time.Duration) (prov.AsyncEvent, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	ev, err := c.AsyncEvent(ctx)
	return ev, err == nil
}

// waitRetrying waits until the head request of q waits to be sent again
// (an RNR NAK came for it).
func waitRetrying(t *testing.T, q prov.QP) {
	t.Helper()
	sq := q.(*qp)
	deadline := time.Now().Add(hangGuard)
	for {
		sq.progMu.Lock()
		r := sq.retrying
		sq.progMu.Unlock()
		if r {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the send is not waiting after an RNR NAK")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// writes returns n signaled RDMA writes of 1 KiB into dst, with WRIDs
// from wrid on.
func writes(n int, wrid uint64, dst *buf) []prov.SendWR {
	var wrs []prov.SendWR
	for i := range n {
		wrs = append(wrs, prov.SendWR{WRID: wrid + uint64(i), Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
			RemoteAddr: dst.addr(i * 1024), RKey: dst.mr.RKey()})
	}
	return wrs
}

// TestResetWithRequestsInFlight guards that a QP moved to RESET while its
// requests to a QP of another process are in flight works like a new QP
// once connected again (RTS -> RESET is valid and discards the send
// queue, ibv_modify_qp(3)). Before, resetLocked left the count of
// requests in flight (xstate.nfl) and the queued responses: the first
// requests posted after the reconnection were taken for ones in flight,
// never sent, and failed with RETRY_EXC_ERR after the transport timeout.
func TestResetWithRequestsInFlight(t *testing.T) {
	for _, kind := range []string{"shm", "unix", "tcp"} {
		t.Run(kind, func(t *testing.T) {
			e, a, b := pairOver(t, kind, prov.QPTypeRC, defaultConn(), defaultConn())
			src := e.alloc(4096, allAccess)
			dst := e.alloc(4096, allAccess)
			fill(src.b, 0xab)
			postSend(t, a.qp, writes(1, 100, dst), []prov.SGE{src.sge(0, 8)})
			poll(t, a.scq, 1)

			// The target cannot execute anything while its rmu is held:
			// the 4 writes stay in flight.
			tq := b.qp.(*qp)
			tq.rmu.Lock()
			postSend(t, a.qp, writes(4, 0, dst), []prov.SGE{src.sge(0, 1024)})
			err := a.qp.Modify(&prov.QPAttr{State: prov.QPStateReset}, prov.AttrState)
			tq.rmu.Unlock()
			must0(t, err)
			// Both sides start over, with other PSNs.
			must0(t, b.qp.Modify(&prov.QPAttr{State: prov.QPStateReset}, prov.AttrState))
			oa, ob := defaultConn(), defaultConn()
			oa.sqPSN, ob.rqPSN = 1000, 1000
			ob.sqPSN, oa.rqPSN = 2000, 2000
			connectOne(t, a.qp, b.qp, prov.QPTypeRC, oa)
			connectOne(t, b.qp, a.qp, prov.QPTypeRC, ob)

			fill(src.b, 0xcd)
			postSend(t, a.qp, writes(3, 7, dst), []prov.SGE{src.sge(0, 1024)})
			cs := pollWithin(t, a.scq, 3, 5*time.Second)
			for i, c := range cs {
				if c.WRID != 7+uint64(i) || c.Status != prov.StatusSuccess {
					t.Errorf("completion %d after reconnecting: %+v", i, c)
				}
			}
			if !allEq(dst.b[:3*1024], 0xcd) {
				t.Error("the writes after reconnecting did not land")
			}
			time.Sleep(10 * time.Millisecond)
			expectEmpty(t, a.scq) // the discarded writes complete never
		})
	}
}

// TestSQDrainedAfterInFlight guards that IBV_EVENT_SQ_DRAINED comes only
// once the messages in progress at the move to SQD completed
// (ibv_get_async_event(3): "Send Queue was drained of outstanding
// messages in progress"), after their completions. Before, Modify
// reported it at once, while requests to a QP of another process were
// still in flight (the target held, none executed).
func TestSQDrainedAfterInFlight(t *testing.T) {
	for _, kind := range []string{"shm", "unix", "tcp"} {
		t.Run(kind, func(t *testing.T) {
			oa := defaultConn()
			oa.timeout = 20 // 4.3 s: the held target does not time out
			e, a, b := pairOver(t, kind, prov.QPTypeRC, oa, defaultConn())
			src := e.alloc(4096, allAccess)
			dst := e.alloc(4096, allAccess)
			fill(src.b, 0xab)
			postSend(t, a.qp, writes(1, 100, dst), []prov.SGE{src.sge(0, 8)})
			poll(t, a.scq, 1)
			fill(dst.b, 0)

			tq := b.qp.(*qp)
			tq.rmu.Lock()
			locked := true
			defer func() {
				if locked {
					tq.rmu.Unlock()
				}
			}()
			postSend(t, a.qp, writes(4, 0, dst), []prov.SGE{src.sge(0, 1024)})
			must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateSQD}, prov.AttrState|prov.AttrEnSQDAsyncNtfy))
			if ev, ok := eventWithin(e.ctx, 300*time.Millisecond); ok {
				t.Fatalf("event %+v while the 4 writes before SQD were in flight (target executed any: %v)", ev, !allEq(dst.b, 0))
			}
			tq.rmu.Unlock()
			locked = false
			cs := poll(t, a.scq, 4)
			for i, c := range cs {
				if c.WRID != uint64(i) || c.Status != prov.StatusSuccess {
					t.Errorf("completion %d: %+v", i, c)
				}
			}
			if ev := nextEvent(t, e.ctx); ev.Type != evSQDrained || ev.QPN != a.qp.QPN() {
				t.Errorf("event %+v, want SQ_DRAINED of QP %d", ev, a.qp.QPN())
			}
			// Back to RTS, the QP sends again.
			must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS}, prov.AttrState))
			postSend(t, a.qp, writes(1, 9, dst), []prov.SGE{src.sge(0, 8)})
			if c := poll(t, a.scq, 1)[0]; c.WRID != 9 || c.Status != prov.StatusSuccess {
				t.Errorf("completion in RTS again: %+v", c)
			}
		})
	}
	t.Run("idle", func(t *testing.T) {
		// Nothing in progress: drained at once.
		e, a, _ := pairOver(t, "direct", prov.QPTypeRC, defaultConn(), defaultConn())
		must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateSQD}, prov.AttrState|prov.AttrEnSQDAsyncNtfy))
		if ev := nextEvent(t, e.ctx); ev.Type != evSQDrained || ev.QPN != a.qp.QPN() {
			t.Errorf("event %+v, want SQ_DRAINED of QP %d", ev, a.qp.QPN())
		}
	})
}

// TestSQDrainedAfterRNRWait guards SQD with a send that was NAKed with
// RNR and waits to be sent again (rnr_retry 7). As in rdma_rxe, the
// message is in progress while it waits for its RNR timer (or for the
// receiver, which wakes it): SQ_DRAINED comes only once that wait ended,
// and then the message is not sent again in SQD (rxe rewinds it to not
// started, req_retry) but once the QP is back in RTS. Before, Modify
// reported SQ_DRAINED at once, while the wait was still on.
func TestSQDrainedAfterRNRWait(t *testing.T) {
	run := func(t *testing.T, kind string, byTimer bool) {
		ob := defaultConn()
		ob.minRNR = 0 // 655 ms
		if byTimer {
			ob.minRNR = 25 // 61 ms
		}
		e, a, b := pairOver(t, kind, prov.QPTypeRC, defaultConn(), ob)
		m := e.alloc(4096, allAccess)
		fill(m.b[:8], 0x5a)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 8)})
		waitRetrying(t, a.qp)
		must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateSQD}, prov.AttrState|prov.AttrEnSQDAsyncNtfy))
		if !byTimer {
			if ev, ok := eventWithin(e.ctx, 50*time.Millisecond); ok {
				t.Fatalf("event %+v while the send NAKed with RNR waits for its RNR timer", ev)
			}
			// The receive it waits for comes: the wait ends.
			postRecv(t, b.qp, 5, m.sge(100, 8))
		}
		if ev := nextEvent(t, e.ctx); ev.Type != evSQDrained || ev.QPN != a.qp.QPN() {
			t.Errorf("event %+v, want SQ_DRAINED of QP %d", ev, a.qp.QPN())
		}
		if byTimer {
			postRecv(t, b.qp, 5, m.sge(100, 8))
		}
		// Not sent again in SQD.
		time.Sleep(20 * time.Millisecond)
		expectEmpty(t, a.scq)
		expectEmpty(t, b.rcq)
		// Back in RTS it is.
		must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS}, prov.AttrState))
		if c := poll(t, a.scq, 1)[0]; c.WRID != 1 || c.Status != prov.StatusSuccess {
			t.Errorf("send %+v", c)
		}
		if c := poll(t, b.rcq, 1)[0]; c.WRID != 5 || c.Status != prov.StatusSuccess || !allEq(m.b[100:108], 0x5a) {
			t.Errorf("receive %+v", c)
		}
	}
	for _, kind := range []string{"direct", "shm"} {
		t.Run(kind, func(t *testing.T) { run(t, kind, false) })
		t.Run(kind+"/timer", func(t *testing.T) { run(t, kind, true) })
	}
}
