package soft

import (
	"bytes"
	"encoding/binary"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

func TestRCSendRecv(t *testing.T) {
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	src := e.alloc(4096, allAccess)
	dst := e.alloc(8192, allAccess)
	copy(src.b, "0123456789abcdefghijklmnopqrstuvwxyz")
	fill(dst.b, 0xee)

	// Two SGEs on each side, message spans both receive SGEs.
	postRecv(t, b.qp, 100, dst.sge(0, 10), dst.sge(100, 100))
	postRecv(t, b.qp, 101, dst.sge(1000, 64))
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 1, Opcode: prov.WRSend, Flags: prov.SendSignaled, SGEIndex: 0, NumSGE: 2},
		{WRID: 2, Opcode: prov.WRSendImm, Flags: prov.SendSignaled | prov.SendSolicited, Imm: 0xdeadbeef, SGEIndex: 2, NumSGE: 1},
	}, []prov.SGE{src.sge(0, 4), src.sge(10, 16), src.sge(0, 5)})

	sc := poll(t, a.scq, 2)
	for i, c := range sc {
		if c.WRID != uint64(i+1) || c.Status != prov.StatusSuccess || c.Opcode != prov.WCSend || c.QPN != a.qp.QPN() {
			t.Errorf("send completion %d: %+v", i, c)
		}
	}
	rc := poll(t, b.rcq, 2)
	if c := rc[0]; c.WRID != 100 || c.Status != prov.StatusSuccess || c.Opcode != prov.WCRecv || c.ByteLen != 20 ||
		c.QPN != b.qp.QPN() || c.SrcQP != 0 || c.Flags != 0 {
		t.Errorf("recv completion %+v", c)
	}
	if c := rc[1]; c.WRID != 101 || c.ByteLen != 5 || c.Flags != prov.WCWithImm || c.Imm != 0xdeadbeef || c.Opcode != prov.WCRecv {
		t.Errorf("recv imm completion %+v", c)
	}
	if got := string(dst.b[0:10]) + string(dst.b[100:110]); got != "0123abcdef"+"ghijklmnop" {
		t.Errorf("received %q", got)
	}
	if !allEq(dst.b[10:100], 0xee) || !allEq(dst.b[110:1000], 0xee) || string(dst.b[1000:1005]) != "01234" || !allEq(dst.b[1005:], 0xee) {
		t.Errorf("bytes outside the message were written")
	}
	expectEmpty(t, a.rcq)
	expectEmpty(t, b.scq)
}

func TestRCUnsignaledAndSignalAll(t *testing.T) {
	e := newEnv(t)
	scq, rcq := e.cq(64), e.cq(64)
	a := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: scq, RecvCQ: rcq, Cap: defaultCaps(), SignalAll: true}))
	defer a.Close()
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	c := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	connectOne(t, a, b.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, b.qp, a, prov.QPTypeRC, defaultConn())
	d := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	connectOne(t, c.qp, d.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, d.qp, c.qp, prov.QPTypeRC, defaultConn())
	m := e.alloc(64, allAccess)
	w := []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, RemoteAddr: m.addr(32), RKey: m.mr.RKey(), NumSGE: 1},
		{WRID: 2, Opcode: prov.WRWrite, RemoteAddr: m.addr(32), RKey: m.mr.RKey(), NumSGE: 1, Flags: prov.SendSignaled}}
	sg := []prov.SGE{m.sge(0, 8)}
	// SignalAll: both complete.
	postSend(t, a, w, sg)
	if cs := poll(t, scq, 2); cs[0].WRID != 1 || cs[1].WRID != 2 {
		t.Errorf("signal all: %+v", cs)
	}
	// Otherwise only the signaled one.
	postSend(t, c.qp, w, sg)
	if cs := poll(t, c.scq, 1); cs[0].WRID != 2 || cs[0].Opcode != prov.WCWrite || cs[0].ByteLen != 8 {
		t.Errorf("selective: %+v", cs)
	}
	expectEmpty(t, c.scq)
}

func TestRCOneSided(t *testing.T) {
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	loc := e.alloc(4096, allAccess)
	rem := e.alloc(4096, allAccess)
	for i := range loc.b {
		loc.b[i] = byte(i)
	}
	fill(rem.b, 0xee)

	// Write 100 bytes at offset 200, gathered from two SGEs.
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled, NumSGE: 2,
		RemoteAddr: rem.addr(200), RKey: rem.mr.RKey()}}, []prov.SGE{loc.sge(0, 60), loc.sge(1000, 40)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.Opcode != prov.WCWrite {
		t.Fatalf("write %+v", c)
	}
	if !bytes.Equal(rem.b[200:260], loc.b[0:60]) || !bytes.Equal(rem.b[260:300], loc.b[1000:1040]) ||
		!allEq(rem.b[:200], 0xee) || !allEq(rem.b[300:], 0xee) {
		t.Fatal("write data")
	}
	expectEmpty(t, b.rcq) // a plain write consumes no receive

	// Read it back into another place.
	postSend(t, a.qp, []prov.SendWR{{WRID: 2, Opcode: prov.WRRead, Flags: prov.SendSignaled, NumSGE: 1,
		RemoteAddr: rem.addr(200), RKey: rem.mr.RKey()}}, []prov.SGE{loc.sge(2000, 100)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.Opcode != prov.WCRead || c.ByteLen != 100 {
		t.Fatalf("read %+v", c)
	}
	if !bytes.Equal(loc.b[2000:2100], rem.b[200:300]) {
		t.Fatal("read data")
	}

	// Write with immediate: consumes a receive, whose buffer is not written.
	fill(loc.b[3000:3100], 0x5a)
	postRecv(t, b.qp, 77, rem.sge(3500, 16))
	postSend(t, a.qp, []prov.SendWR{{WRID: 3, Opcode: prov.WRWriteImm, Flags: prov.SendSignaled, NumSGE: 1, Imm: 42,
		RemoteAddr: rem.addr(1000), RKey: rem.mr.RKey()}}, []prov.SGE{loc.sge(3000, 32)})
	poll(t, a.scq, 1)
	if c := poll(t, b.rcq, 1)[0]; c.WRID != 77 || c.Opcode != prov.WCRecvRDMAImm || c.Flags != prov.WCWithImm ||
		c.Imm != 42 || c.ByteLen != 32 || c.SrcQP != 0 {
		t.Fatalf("write imm recv %+v", c)
	}
	if !allEq(rem.b[1000:1032], 0x5a) || !allEq(rem.b[3500:3516], 0xee) {
		t.Fatal("write imm data")
	}

	// Atomics.
	binary.NativeEndian.PutUint64(rem.b[64:], 10)
	sg := []prov.SGE{loc.sge(8, 8), loc.sge(16, 8), loc.sge(24, 8)}
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 4, Opcode: prov.WRAtomicFAA, Flags: prov.SendSignaled, NumSGE: 1, SGEIndex: 0, RemoteAddr: rem.addr(64), RKey: rem.mr.RKey(), CompareAdd: 5},
		{WRID: 5, Opcode: prov.WRAtomicCAS, Flags: prov.SendSignaled, NumSGE: 1, SGEIndex: 1, RemoteAddr: rem.addr(64), RKey: rem.mr.RKey(), CompareAdd: 15, Swap: 100},
		{WRID: 6, Opcode: prov.WRAtomicCAS, Flags: prov.SendSignaled, NumSGE: 1, SGEIndex: 2, RemoteAddr: rem.addr(64), RKey: rem.mr.RKey(), CompareAdd: 15, Swap: 7},
	}, sg)
	cs := poll(t, a.scq, 3)
	if cs[0].Opcode != prov.WCFetchAdd || cs[1].Opcode != prov.WCCompSwap || cs[2].Status != prov.StatusSuccess {
		t.Fatalf("atomic completions %+v", cs)
	}
	got := []uint64{binary.NativeEndian.Uint64(loc.b[8:]), binary.NativeEndian.Uint64(loc.b[16:]),
		binary.NativeEndian.Uint64(loc.b[24:]), binary.NativeEndian.Uint64(rem.b[64:])}
	if got[0] != 10 || got[1] != 15 || got[2] != 100 || got[3] != 100 {
		t.Fatalf("atomic values %v (prior FAA, prior CAS, prior failed CAS, final)", got)
	}

	// Zero-length write and read need no valid rkey.
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 7, Opcode: prov.WRWrite, Flags: prov.SendSignaled, RKey: 0x1234},
		{WRID: 8, Opcode: prov.WRRead, Flags: prov.SendSignaled, RKey: 0x1234},
	}, nil)
	for _, c := range poll(t, a.scq, 2) {
		if c.Status != prov.StatusSuccess {
			t.Fatalf("zero-length op %+v", c)
		}
	}
}

func TestRCInline(t *testing.T) {
	o := defaultConn()
	o.minRNR = 0 // long RNR wait: the send waits for the receive posted below
	e, a, b := pair(t, prov.QPTypeRC, o, o)
	src := heapBytes(64) // Go memory, not registered: inline needs no lkey
	copy(src, "inline payload")
	dst := e.alloc(64, allAccess)
	addr := uint64(uintptrOf(src))
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, Flags: prov.SendInline | prov.SendSignaled, NumSGE: 1}},
		[]prov.SGE{{Addr: addr, Length: 14, LKey: 0xbad}})
	copy(src, "CHANGED AFTER POST") // the payload was copied at post time
	postRecv(t, b.qp, 1, dst.sge(0, 64))
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("inline send %+v", c)
	}
	if c := poll(t, b.rcq, 1)[0]; c.ByteLen != 14 || string(dst.b[:14]) != "inline payload" {
		t.Fatalf("inline recv %+v %q", c, dst.b[:14])
	}
}

func TestRCRNR(t *testing.T) {
	t.Run("finite", func(t *testing.T) {
		for _, retry := range []uint8{0, 1, 2} {
			o := defaultConn()
			o.rnrRetry = retry
			e, a, b := pair(t, prov.QPTypeRC, o, o)
			m := e.alloc(64, allAccess)
			postRecv(t, a.qp, 50, m.sge(0, 8))
			postSend(t, a.qp, []prov.SendWR{
				{WRID: 1, Opcode: prov.WRSend, NumSGE: 1},
				{WRID: 2, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(0), RKey: m.mr.RKey()},
			}, []prov.SGE{m.sge(0, 8)})
			cs := poll(t, a.scq, 2)
			if cs[0].WRID != 1 || cs[0].Status != prov.StatusRNRRetryExcErr || cs[1].WRID != 2 || cs[1].Status != prov.StatusWRFlushErr {
				t.Fatalf("rnr_retry %d: %+v", retry, cs)
			}
			if c := poll(t, a.rcq, 1)[0]; c.WRID != 50 || c.Status != prov.StatusWRFlushErr {
				t.Fatalf("recv flush %+v", c)
			}
			if s := state(t, a.qp); s != prov.QPStateErr {
				t.Fatalf("requester state %v", s)
			}
			if s := state(t, b.qp); s != prov.QPStateRTS {
				t.Fatalf("responder state %v", s)
			}
			if ev := nextEvent(t, e.ctx); ev.Type != evQPFatal || ev.QPN != a.qp.QPN() {
				t.Fatalf("event %+v", ev)
			}
		}
	})
	t.Run("infinite", func(t *testing.T) {
		o := defaultConn()
		o.rnrRetry = 7
		o.minRNR = 1 // 10 µs: many retries happen before the receive is posted
		e, a, b := pair(t, prov.QPTypeRC, o, o)
		m := e.alloc(64, allAccess)
		copy(m.b, "late")
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 4)})
		time.Sleep(20 * time.Millisecond)
		expectEmpty(t, a.scq)
		postRecv(t, b.qp, 9, m.sge(32, 8))
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
			t.Fatalf("send %+v", c)
		}
		if c := poll(t, b.rcq, 1)[0]; c.WRID != 9 || string(m.b[32:36]) != "late" {
			t.Fatalf("recv %+v", c)
		}
	})
	t.Run("wake", func(t *testing.T) {
		o := defaultConn()
		o.rnrRetry = 1
		o.minRNR = 0 // 655 ms: only a wake-up makes this quick; the wait uses no retry
		e, a, b := pair(t, prov.QPTypeRC, o, o)
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 4)})
		postRecv(t, b.qp, 9, m.sge(32, 8))
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
			t.Fatalf("send %+v", c)
		}
		poll(t, b.rcq, 1)
	})
}

// A flush on ERR completes every outstanding request, signaled or not.
func TestRCFlushOnErr(t *testing.T) {
	o := defaultConn()
	o.minRNR = 0
	e, a, b := pair(t, prov.QPTypeRC, o, o)
	m := e.alloc(64, allAccess)
	wrs := []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1}, {WRID: 2, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled},
		{WRID: 3, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(0), RKey: m.mr.RKey()}}
	postSend(t, a.qp, wrs, []prov.SGE{m.sge(0, 4)})
	postRecv(t, a.qp, 10, m.sge(0, 4))
	postRecv(t, a.qp, 11, m.sge(0, 4))
	must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState))
	cs := poll(t, a.scq, 3)
	for i, c := range cs {
		if c.WRID != uint64(i+1) || c.Status != prov.StatusWRFlushErr || c.QPN != a.qp.QPN() {
			t.Errorf("send flush %d: %+v", i, c)
		}
	}
	if cs[2].Opcode != prov.WCWrite {
		t.Errorf("flush opcode %v", cs[2].Opcode)
	}
	rs := poll(t, a.rcq, 2)
	if rs[0].WRID != 10 || rs[1].WRID != 11 || rs[0].Status != prov.StatusWRFlushErr {
		t.Errorf("recv flush %+v", rs)
	}
	expectEmpty(t, b.rcq)
	// RESET clears without completions; the QP can be reused.
	postRecv(t, a.qp, 12, m.sge(0, 4))
	poll(t, a.rcq, 1)
	must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateReset}, prov.AttrState))
	expectEmpty(t, a.rcq)
	expectEmpty(t, a.scq)
}

func TestRCResetDiscards(t *testing.T) {
	o := defaultConn()
	o.minRNR = 0
	e, a, b := pair(t, prov.QPTypeRC, o, o)
	m := e.alloc(64, allAccess)
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 4)})
	postRecv(t, a.qp, 2, m.sge(0, 4))
	must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateReset}, prov.AttrState))
	expectEmpty(t, a.scq)
	expectEmpty(t, a.rcq)
	// Reconnect and use it again.
	must0(t, b.qp.Modify(&prov.QPAttr{State: prov.QPStateReset}, prov.AttrState))
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
	postRecv(t, b.qp, 3, m.sge(32, 8))
	postSend(t, a.qp, []prov.SendWR{{WRID: 4, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 4)})
	if c := poll(t, a.scq, 1)[0]; c.WRID != 4 || c.Status != prov.StatusSuccess {
		t.Fatalf("after reset %+v", c)
	}
}

func TestRCTargetGone(t *testing.T) {
	t.Run("closed", func(t *testing.T) {
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		scq := e.cq(4)
		b := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: scq, RecvCQ: scq, Cap: defaultCaps()}))
		connectOne(t, a.qp, b, prov.QPTypeRC, defaultConn())
		connectOne(t, b, a.qp, prov.QPTypeRC, defaultConn())
		must0(t, b.Close())
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: 0x1000, RKey: 1}}, []prov.SGE{m.sge(0, 4)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRetryExcErr {
			t.Fatalf("%+v", c)
		}
	})
	t.Run("unreachable", func(t *testing.T) {
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		o := defaultConn()
		o.noProvAddr = true
		toInit(t, a.qp, prov.QPTypeRC, o)
		av := avFor(a.qp, true)
		av.DGID[15] = 99 // not a GID of this process
		must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU1024, DestQPN: 5, AH: av, MinRNRTimer: 1,
			MaxDestRDAtom: 1}, maskRTRRC))
		must0(t, a.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS, RetryCnt: 1, Timeout: 1}, maskRTSRC))
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{m.sge(0, 4)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRetryExcErr {
			t.Fatalf("%+v", c)
		}
	})
	t.Run("not ready then ready", func(t *testing.T) {
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		o := defaultConn()
		o.timeout = 20 // 4.3 s per retry: only the wake-up at RTR makes it quick
		connectOne(t, a.qp, b.qp, prov.QPTypeRC, o)
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled, NumSGE: 1,
			RemoteAddr: m.addr(8), RKey: m.mr.RKey()}}, []prov.SGE{m.sge(0, 4)})
		expectEmpty(t, a.scq)
		connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
			t.Fatalf("%+v", c)
		}
	})
	t.Run("not ready timeout", func(t *testing.T) {
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		o := defaultConn()
		o.timeout, o.retryCnt = 1, 2
		connectOne(t, a.qp, b.qp, prov.QPTypeRC, o)
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{m.sge(0, 4)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRetryExcErr {
			t.Fatalf("%+v", c)
		}
	})
	t.Run("psn mismatch", func(t *testing.T) {
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		oa, ob := defaultConn(), defaultConn()
		oa.sqPSN, ob.rqPSN = 10, 11
		connectOne(t, a.qp, b.qp, prov.QPTypeRC, oa)
		connectOne(t, b.qp, a.qp, prov.QPTypeRC, ob)
		m := e.alloc(64, allAccess)
		postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(8), RKey: m.mr.RKey()}}, []prov.SGE{m.sge(0, 4)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRetryExcErr {
			t.Fatalf("%+v", c)
		}
	})
	t.Run("stranger", func(t *testing.T) {
		// c is connected to b, but b is connected to a: c gets no answer.
		e := newEnv(t)
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		c := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
		connectOne(t, c.qp, b.qp, prov.QPTypeRC, defaultConn())
		m := e.alloc(64, allAccess)
		postSend(t, c.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(8), RKey: m.mr.RKey()}}, []prov.SGE{m.sge(0, 4)})
		if c := poll(t, c.scq, 1)[0]; c.Status != prov.StatusRetryExcErr {
			t.Fatalf("%+v", c)
		}
	})
}

// A multi-packet message advances the PSN by its packet count on both sides.
func TestRCPSN(t *testing.T) {
	o := defaultConn()
	o.mtu = prov.MTU1024
	e, a, b := pair(t, prov.QPTypeRC, o, o)
	m := e.alloc(8192, allAccess)
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(4096), RKey: m.mr.RKey(), Flags: prov.SendSignaled},
		{WRID: 2, Opcode: prov.WRRead, NumSGE: 1, RemoteAddr: m.addr(4096), RKey: m.mr.RKey(), Flags: prov.SendSignaled},
	}, []prov.SGE{m.sge(0, 3000)})
	for _, c := range poll(t, a.scq, 2) {
		if c.Status != prov.StatusSuccess {
			t.Fatalf("%+v", c)
		}
	}
	qa, _, _ := a.qp.Query()
	qb, _, _ := b.qp.Query()
	if qa.SQPSN != 100+6 || qb.RQPSN != 100+6 {
		t.Fatalf("PSNs: requester %d, responder %d, want 106", qa.SQPSN, qb.RQPSN)
	}
}
