package soft

import (
	"errors"
	"syscall"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

const (
	maskInitRC = prov.AttrState | prov.AttrPKeyIndex | prov.AttrPort | prov.AttrAccessFlags
	maskInitUD = prov.AttrState | prov.AttrPKeyIndex | prov.AttrPort | prov.AttrQKey
	maskRTRRC  = prov.AttrState | prov.AttrAV | prov.AttrPathMTU | prov.AttrDestQPN | prov.AttrRQPSN |
		prov.AttrMaxDestRDAtom | prov.AttrMinRNRTimer
	maskRTRUC = prov.AttrState | prov.AttrAV | prov.AttrPathMTU | prov.AttrDestQPN | prov.AttrRQPSN
	maskRTSRC = prov.AttrState | prov.AttrSQPSN | prov.AttrTimeout | prov.AttrRetryCnt | prov.AttrRNRRetry |
		prov.AttrMaxQPRDAtomic
	maskRTSUC = prov.AttrState | prov.AttrSQPSN
)

func TestStateMachine(t *testing.T) {
	type step struct {
		state prov.QPState
		mask  prov.QPAttrMask
		ok    bool
	}
	const (
		reset = prov.QPStateReset
		ini   = prov.QPStateInit
		rtr   = prov.QPStateRTR
		rts   = prov.QPStateRTS
		sqd   = prov.QPStateSQD
		errS  = prov.QPStateErr
		st    = prov.AttrState
	)
	tests := []struct {
		name  string
		typ   prov.QPType
		steps []step
	}{
		{"rc full", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC, true}, {rts, maskRTSRC, true},
			{sqd, st, true}, {rts, st, true}, {rts, st | prov.AttrMinRNRTimer, true}, {errS, st, true}, {reset, st, true}}},
		{"rc init missing access", prov.QPTypeRC, []step{{ini, maskInitRC &^ prov.AttrAccessFlags, false}, {ini, maskInitRC, true}}},
		{"rc init with qkey", prov.QPTypeRC, []step{{ini, maskInitRC | prov.AttrQKey, false}}},
		{"rc reset to rtr", prov.QPTypeRC, []step{{rtr, maskRTRRC, false}}},
		{"rc reset to rts", prov.QPTypeRC, []step{{rts, maskRTSRC, false}}},
		{"rc rtr missing min rnr", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC &^ prov.AttrMinRNRTimer, false},
			{rtr, maskRTRRC &^ prov.AttrMaxDestRDAtom, false}, {rtr, maskRTRRC &^ prov.AttrAV, false}, {rtr, maskRTRRC, true}}},
		{"rc rts missing", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC, true},
			{rts, maskRTSRC &^ prov.AttrRNRRetry, false}, {rts, maskRTSRC &^ prov.AttrMaxQPRDAtomic, false}, {rts, maskRTSRC, true}}},
		{"rc init to init", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {ini, st | prov.AttrAccessFlags, true}, {ini, st, true}}},
		{"rc rtr to rtr", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC, true}, {rtr, st, false}}},
		{"rc init to rts", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rts, maskRTSRC, false}}},
		{"rc err to rts", prov.QPTypeRC, []step{{errS, st, true}, {rts, maskRTSRC, false}, {ini, maskInitRC, false}, {reset, st, true}, {ini, maskInitRC, true}}},
		{"rc rts to rtr", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC, true}, {rts, maskRTSRC, true}, {rtr, maskRTRRC, false}}},
		{"rc reset extra attr", prov.QPTypeRC, []step{{ini, maskInitRC, true}, {reset, st | prov.AttrQKey, false}}},
		{"rc cap", prov.QPTypeRC, []step{{ini, maskInitRC | prov.AttrCap, false}}},
		{"uc full", prov.QPTypeUC, []step{{ini, maskInitRC, true}, {rtr, maskRTRUC, true}, {rts, maskRTSUC, true}}},
		{"uc rtr with rc attrs", prov.QPTypeUC, []step{{ini, maskInitRC, true}, {rtr, maskRTRRC, false}}},
		{"uc rts with timeout", prov.QPTypeUC, []step{{ini, maskInitRC, true}, {rtr, maskRTRUC, true}, {rts, maskRTSRC, false}}},
		{"ud full", prov.QPTypeUD, []step{{ini, maskInitUD, true}, {rtr, st, true}, {rts, maskRTSUC, true}}},
		{"ud init with access", prov.QPTypeUD, []step{{ini, maskInitRC, false}, {ini, maskInitUD &^ prov.AttrQKey, false}}},
		{"ud rtr with av", prov.QPTypeUD, []step{{ini, maskInitUD, true}, {rtr, st | prov.AttrAV, false}}},
		{"ud rts without psn", prov.QPTypeUD, []step{{ini, maskInitUD, true}, {rtr, st, true}, {rts, st, false}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			peer := e.newQP(tc.typ, defaultCaps(), nil)
			q := e.newQP(tc.typ, defaultCaps(), nil)
			cur := prov.QPStateReset
			for i, s := range tc.steps {
				a := prov.QPAttr{State: s.state, PKeyIndex: 0, Port: 1, Access: allAccess, QKey: 0x11111111,
					PathMTU: prov.MTU1024, DestQPN: peer.qp.QPN(), RQPSN: 5, SQPSN: 7, MaxDestRDAtom: 4,
					MinRNRTimer: 12, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRDAtomic: 4, AH: avFor(peer.qp, false)}
				err := q.qp.Modify(&a, s.mask)
				if s.ok {
					if err != nil {
						t.Fatalf("step %d (%v, %s): %v", i, s.state, maskString(s.mask), err)
					}
					cur = s.state
				} else if !errors.Is(err, syscall.EINVAL) {
					t.Fatalf("step %d (%v, %s): got %v, want EINVAL", i, s.state, maskString(s.mask), err)
				}
				if got := state(t, q.qp); got != cur {
					t.Fatalf("step %d: state %v, want %v", i, got, cur)
				}
			}
		})
	}
}

func TestModifyValues(t *testing.T) {
	e := newEnv(t)
	q := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	bad := []struct {
		name string
		a    prov.QPAttr
	}{
		{"port 2", prov.QPAttr{State: prov.QPStateInit, Port: 2}},
		{"pkey 1", prov.QPAttr{State: prov.QPStateInit, Port: 1, PKeyIndex: 1}},
		{"bad access", prov.QPAttr{State: prov.QPStateInit, Port: 1, Access: 1 << 12}},
	}
	for _, tc := range bad {
		if err := q.qp.Modify(&tc.a, maskInitRC); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	toInit(t, q.qp, prov.QPTypeRC, defaultConn())
	base := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: q.qp.QPN(), AH: avFor(q.qp, false)}
	for name, mod := range map[string]func(*prov.QPAttr){
		"mtu 0":        func(a *prov.QPAttr) { a.PathMTU = 0 },
		"mtu 6":        func(a *prov.QPAttr) { a.PathMTU = 6 },
		"no grh":       func(a *prov.QPAttr) { a.AH.IsGlobal = false },
		"sgid index 2": func(a *prov.QPAttr) { a.AH.SGIDIndex = 2 },
		"bad paddr":    func(a *prov.QPAttr) { a.AH.ProviderAddr = []byte{1, 2, 3} },
		"rnr timer 32": func(a *prov.QPAttr) { a.MinRNRTimer = 32 },
		"dest rd 17":   func(a *prov.QPAttr) { a.MaxDestRDAtom = 17 },
		"dqpn 1<<24":   func(a *prov.QPAttr) { a.DestQPN = 1 << 24 },
	} {
		a := base
		mod(&a)
		if err := q.qp.Modify(&a, maskRTRRC); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if s := state(t, q.qp); s != prov.QPStateInit {
		t.Fatalf("state %v after failed modifies", s)
	}
	// CUR_STATE must match.
	a := prov.QPAttr{State: prov.QPStateInit, CurState: prov.QPStateRTS}
	if err := q.qp.Modify(&a, prov.AttrState|prov.AttrCurState); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("wrong cur state: %v", err)
	}
}

func TestQueryAndCaps(t *testing.T) {
	e := newEnv(t)
	caps := prov.QPCap{MaxSendWR: 10, MaxRecvWR: 20, MaxSendSGE: 3, MaxRecvSGE: 5, MaxInlineData: 100}
	q := e.newQP(prov.QPTypeRC, caps, nil)
	peer := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	o := defaultConn()
	o.sqPSN, o.rqPSN, o.minRNR, o.timeout, o.mtu = 0x123, 0x456, 12, 17, prov.MTU2048
	connectOne(t, q.qp, peer.qp, prov.QPTypeRC, o)
	a, ia, err := q.qp.Query()
	if err != nil {
		t.Fatal(err)
	}
	if a.State != prov.QPStateRTS || a.SQPSN != 0x123 || a.RQPSN != 0x456 || a.MinRNRTimer != 12 || a.Timeout != 17 ||
		a.PathMTU != prov.MTU2048 || a.DestQPN != peer.qp.QPN() || a.Access != allAccess || a.Port != 1 ||
		a.MaxDestRDAtom != 16 || a.MaxRDAtomic != 16 || a.RNRRetry != 7 || a.RetryCnt != 7 || a.Cap != caps ||
		!a.AH.IsGlobal || len(a.AH.ProviderAddr) == 0 {
		t.Errorf("query attr %+v", a)
	}
	if ia.Type != prov.QPTypeRC || ia.Cap != caps || ia.SendCQ != q.scq || ia.RecvCQ != q.rcq || ia.SRQ != nil {
		t.Errorf("query init attr %+v", ia)
	}
	for _, c := range []prov.QPCap{
		{MaxSendWR: 16385}, {MaxRecvWR: 16385}, {MaxSendSGE: 33}, {MaxRecvSGE: 33}, {MaxInlineData: 1025}, {MaxSendWR: -1},
	} {
		if _, err := e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: q.scq, RecvCQ: q.rcq, Cap: c}); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("caps %+v: %v", c, err)
		}
	}
	if _, err := e.pd.CreateQP(prov.QPInitAttr{Type: 9, SendCQ: q.scq, RecvCQ: q.rcq}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("type 9: %v", err)
	}
	if _, err := e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("no CQs: %v", err)
	}
}

func TestPostState(t *testing.T) {
	e := newEnv(t)
	q := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	peer := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	b := e.alloc(64, allAccess)
	wr := []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
	sg := []prov.SGE{b.sge(0, 8)}
	check := func(what string) {
		t.Helper()
		if n, err := q.qp.PostSend(wr, sg); n != 0 || !errors.Is(err, syscall.EINVAL) {
			t.Errorf("post send in %s: %d %v", what, n, err)
		}
	}
	check("RESET")
	if n, err := q.qp.PostRecv([]prov.RecvWR{{WRID: 1, NumSGE: 1}}, sg); n != 0 || !errors.Is(err, syscall.EINVAL) {
		t.Errorf("post recv in RESET: %d %v", n, err)
	}
	toInit(t, q.qp, prov.QPTypeRC, defaultConn())
	check("INIT")
	postRecv(t, q.qp, 7, b.sge(0, 8))
	o := defaultConn()
	o.skipRTS = true
	q2 := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	connectOne(t, q2.qp, peer.qp, prov.QPTypeRC, o)
	q = q2
	check("RTR")
	// ERR: accepted, flushed.
	if err := q.qp.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState); err != nil {
		t.Fatal(err)
	}
	wr[0].Flags = 0 // unsignaled requests are flushed too
	postSend(t, q.qp, wr, sg)
	postRecv(t, q.qp, 9, b.sge(0, 8))
	c := poll(t, q.scq, 1)[0]
	if c.WRID != 1 || c.Status != prov.StatusWRFlushErr || c.QPN != q.qp.QPN() {
		t.Errorf("send flush %+v", c)
	}
	c = poll(t, q.rcq, 1)[0]
	if c.WRID != 9 || c.Status != prov.StatusWRFlushErr || c.Opcode != prov.WCRecv {
		t.Errorf("recv flush %+v", c)
	}
}

func TestPostValidation(t *testing.T) {
	for _, typ := range []prov.QPType{prov.QPTypeRC, prov.QPTypeUC, prov.QPTypeUD} {
		t.Run(typeNames[typ], func(t *testing.T) {
			e := newEnv(t)
			caps := prov.QPCap{MaxSendWR: 64, MaxRecvWR: 4, MaxSendSGE: 2, MaxRecvSGE: 2, MaxInlineData: 16}
			q := e.newQP(typ, caps, nil)
			peer := e.newQP(typ, caps, nil)
			o := defaultConn()
			o.qkey = 0x1234
			if typ == prov.QPTypeUD {
				toInit(t, q.qp, typ, o)
				must0(t, q.qp.Modify(&prov.QPAttr{State: prov.QPStateRTR}, prov.AttrState))
				must0(t, q.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS}, prov.AttrState|prov.AttrSQPSN))
			} else {
				connectOne(t, q.qp, peer.qp, typ, o)
			}
			ah := must(e.pd.CreateAH(avFor(peer.qp, false)))
			defer ah.Close()
			b := e.alloc(4096, allAccess)
			sg := []prov.SGE{b.sge(0, 8), b.sge(8, 8), b.sge(16, 8)}
			base := prov.SendWR{Opcode: prov.WRSend, NumSGE: 1, AH: ah.Handle(), RemoteQPN: peer.qp.QPN(), RemoteQKey: 0x1234,
				RemoteAddr: b.addr(0), RKey: b.mr.RKey()}
			type tc struct {
				name string
				mod  func(*prov.SendWR)
				ok   bool
			}
			cases := []tc{
				{"3 sges", func(w *prov.SendWR) { w.NumSGE = 3 }, false},
				{"sge range", func(w *prov.SendWR) { w.SGEIndex = 2; w.NumSGE = 2 }, false},
				{"inline 17", func(w *prov.SendWR) { w.Flags = prov.SendInline; w.NumSGE = 2; sg[1].Length = 9 }, false},
				{"inline 16", func(w *prov.SendWR) { w.Flags = prov.SendInline; w.NumSGE = 2; sg[1].Length = 8 }, true},
				{"bind mw", func(w *prov.SendWR) { w.Opcode = prov.WRBindMW }, false},
				{"write", func(w *prov.SendWR) { w.Opcode = prov.WRWrite }, typ != prov.QPTypeUD},
				{"write imm", func(w *prov.SendWR) { w.Opcode = prov.WRWriteImm }, typ != prov.QPTypeUD},
				{"read", func(w *prov.SendWR) { w.Opcode = prov.WRRead }, typ == prov.QPTypeRC},
				{"cas", func(w *prov.SendWR) { w.Opcode = prov.WRAtomicCAS }, typ == prov.QPTypeRC},
				{"faa", func(w *prov.SendWR) { w.Opcode = prov.WRAtomicFAA }, typ == prov.QPTypeRC},
			}
			if typ == prov.QPTypeRC {
				cases = append(cases,
					tc{"faa misaligned", func(w *prov.SendWR) { w.Opcode = prov.WRAtomicFAA; w.RemoteAddr += 4 }, false},
					tc{"faa 4 bytes", func(w *prov.SendWR) { w.Opcode = prov.WRAtomicFAA; sg[0].Length = 4 }, false},
					tc{"read inline", func(w *prov.SendWR) { w.Opcode = prov.WRRead; w.Flags = prov.SendInline }, false})
			}
			if typ == prov.QPTypeUD {
				cases = append(cases, tc{"bad ah", func(w *prov.SendWR) { w.AH ^= 1 << 40 }, false})
			}
			for _, c := range cases {
				sg[0].Length, sg[1].Length = 8, 8
				wr := base
				c.mod(&wr)
				n, err := q.qp.PostSend([]prov.SendWR{wr}, sg)
				if c.ok != (err == nil) || (err != nil && (!errors.Is(err, syscall.EINVAL) || n != 0)) {
					t.Errorf("%s: n=%d err=%v", c.name, n, err)
				}
			}
			// bad_wr semantics: the count accepted before the failing request.
			wrs := []prov.SendWR{base, base, {Opcode: prov.WRBindMW}, base}
			if n, err := q.qp.PostSend(wrs, sg); n != 2 || !errors.Is(err, syscall.EINVAL) {
				t.Errorf("batch with a bad request: %d %v", n, err)
			}
			// Recv validation.
			if n, err := q.qp.PostRecv([]prov.RecvWR{{NumSGE: 3}}, sg); n != 0 || !errors.Is(err, syscall.EINVAL) {
				t.Errorf("recv 3 sges: %d %v", n, err)
			}
			rwrs := make([]prov.RecvWR, 6)
			for i := range rwrs {
				rwrs[i] = prov.RecvWR{WRID: uint64(i), NumSGE: 1}
			}
			n, err := q.qp.PostRecv(rwrs, sg)
			if n != 4 || !errors.Is(err, prov.ErrQueueFull) || !errors.Is(err, syscall.ENOMEM) {
				t.Errorf("recv overflow: %d %v", n, err)
			}
		})
	}
}

func must0(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// The send queue holds max_send_wr outstanding requests; the fifth of four
// fails with ENOMEM/ErrQueueFull while the head waits for a receive.
func TestSendQueueFull(t *testing.T) {
	o := defaultConn()
	o.minRNR = 0 // 655 ms: the requests stay queued
	e := newEnv(t)
	caps := prov.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}
	a := e.newQP(prov.QPTypeRC, caps, nil)
	b := e.newQP(prov.QPTypeRC, caps, nil)
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, o)
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, o)
	buf := e.alloc(64, allAccess)
	wrs := make([]prov.SendWR, 6)
	for i := range wrs {
		wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRSend, NumSGE: 1}
	}
	n, err := a.qp.PostSend(wrs, []prov.SGE{buf.sge(0, 8)})
	if n != 4 || !errors.Is(err, prov.ErrQueueFull) || !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("post 6 into 4: %d %v", n, err)
	}
	// Receives let them through; the slots free up.
	for i := range 4 {
		postRecv(t, b.qp, uint64(i), buf.sge(8, 8))
	}
	poll(t, b.rcq, 4)
	for i := range wrs {
		wrs[i].Flags = prov.SendSignaled
	}
	for i := range 4 {
		postRecv(t, b.qp, uint64(i), buf.sge(8, 8))
	}
	postSend(t, a.qp, wrs[:4], []prov.SGE{buf.sge(0, 8)})
	poll(t, a.scq, 4)
}
