package soft

import (
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// Remote (target-side) checks of one-sided operations: the requester gets
// the status, both QPs end in ERR, memory outside the MR is untouched.
func TestRemoteAccessErrors(t *testing.T) {
	type setup struct {
		e        *env
		a, b     *ep
		loc, rem *buf
		other    *buf // MR of another PD
		ro       *buf // MR without remote write/atomic
		wo       *buf // MR with remote write only
	}
	tests := []struct {
		name     string
		targetQP prov.Access // target QP access flags
		destRD   uint8
		wr       func(s *setup) prov.SendWR
		status   prov.Status
		event    uint32
	}{
		{"write bad rkey", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.rem.addr(0), RKey: s.rem.mr.RKey() ^ 0x5a5a}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"write past end", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.rem.addr(4096 - 8), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"write before start", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.rem.addr(0) - 8, RKey: s.rem.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"write to read-only MR", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.ro.addr(0), RKey: s.ro.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"write to MR of another PD", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.other.addr(0), RKey: s.other.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"write imm bad rkey", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWriteImm, RemoteAddr: s.rem.addr(0), RKey: 7}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"read from write-only MR", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRRead, RemoteAddr: s.wo.addr(0), RKey: s.wo.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"atomic on write-only MR", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRAtomicFAA, RemoteAddr: s.wo.addr(0), RKey: s.wo.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		{"atomic past end", allAccess, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRAtomicCAS, RemoteAddr: s.rem.addr(4096), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemAccessErr, evQPAccessErr},
		// QP access flags and responder resources: invalid request (rxe, hfi1).
		{"write to QP without remote write", prov.AccessLocalWrite | prov.AccessRemoteRead, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: s.rem.addr(0), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemInvReqErr, evQPReqErr},
		{"read from QP without remote read", prov.AccessLocalWrite | prov.AccessRemoteWrite, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRRead, RemoteAddr: s.rem.addr(0), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemInvReqErr, evQPReqErr},
		{"atomic on QP without remote atomic", prov.AccessLocalWrite | prov.AccessRemoteWrite, 16, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRAtomicFAA, RemoteAddr: s.rem.addr(0), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemInvReqErr, evQPReqErr},
		{"read with max_dest_rd_atomic 0", allAccess, 0, func(s *setup) prov.SendWR {
			return prov.SendWR{Opcode: prov.WRRead, RemoteAddr: s.rem.addr(0), RKey: s.rem.mr.RKey()}
		}, prov.StatusRemInvReqErr, evQPReqErr},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ob := defaultConn()
			ob.access, ob.destRDAtom = tc.targetQP, tc.destRD
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), ob)
			pd2 := must(e.ctx.AllocPD())
			t.Cleanup(func() { pd2.Close() })
			s := &setup{e: e, a: a, b: b,
				loc:   e.alloc(4096, allAccess),
				rem:   e.alloc(4096, allAccess),
				other: allocIn(t, pd2, 4096, allAccess),
				ro:    e.alloc(4096, prov.AccessLocalWrite|prov.AccessRemoteRead),
				wo:    e.alloc(4096, prov.AccessLocalWrite|prov.AccessRemoteWrite),
			}
			fill(s.loc.b, 0x11)
			for _, x := range []*buf{s.rem, s.other, s.ro, s.wo} {
				fill(x.b, 0xee)
			}
			postRecv(t, b.qp, 500, s.rem.sge(0, 16)) // flushed when b enters ERR
			wr := tc.wr(s)
			wr.WRID, wr.NumSGE, wr.Flags = 1, 1, 0 // unsignaled: errors complete anyway
			n := 16
			if wr.Opcode == prov.WRAtomicCAS || wr.Opcode == prov.WRAtomicFAA {
				n = 8
			}
			postSend(t, a.qp, []prov.SendWR{wr, {WRID: 2, Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{s.loc.sge(0, n)})
			cs := poll(t, a.scq, 2)
			if cs[0].WRID != 1 || cs[0].Status != tc.status || cs[1].WRID != 2 || cs[1].Status != prov.StatusWRFlushErr {
				t.Fatalf("completions %+v, want status %d then flush", cs, tc.status)
			}
			if st := state(t, a.qp); st != prov.QPStateErr {
				t.Errorf("requester state %v", st)
			}
			if st := state(t, b.qp); st != prov.QPStateErr {
				t.Errorf("responder state %v", st)
			}
			if c := poll(t, b.rcq, 1)[0]; c.WRID != 500 || c.Status != prov.StatusWRFlushErr {
				t.Errorf("responder receive %+v", c)
			}
			for _, x := range []*buf{s.rem, s.other, s.ro, s.wo} {
				if !allEq(x.b, 0xee) {
					t.Errorf("target memory was modified")
				}
			}
			// The responder reports the async event; the requester a fatal one.
			seen := map[uint32]uint32{}
			for range 2 {
				ev := nextEvent(t, e.ctx)
				seen[ev.QPN] = ev.Type
			}
			if seen[b.qp.QPN()] != tc.event || seen[a.qp.QPN()] != evQPFatal {
				t.Errorf("events %v", seen)
			}
		})
	}
}

// Local SGE checks at the requester give LOC_PROT_ERR.
func TestLocalProtErrors(t *testing.T) {
	tests := []struct {
		name string
		op   prov.WROpcode
		sge  func(loc, other, ro *buf) prov.SGE
	}{
		{"bad lkey", prov.WRWrite, func(loc, _, _ *buf) prov.SGE { s := loc.sge(0, 8); s.LKey ^= 0x77; return s }},
		{"past end", prov.WRSend, func(loc, _, _ *buf) prov.SGE { return loc.sge(4090, 8) }},
		{"lkey of another PD", prov.WRWrite, func(_, other, _ *buf) prov.SGE { return other.sge(0, 8) }},
		{"read into MR without local write", prov.WRRead, func(_, _, ro *buf) prov.SGE { return ro.sge(0, 8) }},
		{"atomic into MR without local write", prov.WRAtomicFAA, func(_, _, ro *buf) prov.SGE { return ro.sge(0, 8) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
			pd2 := must(e.ctx.AllocPD())
			t.Cleanup(func() { pd2.Close() })
			loc, rem := e.alloc(4096, allAccess), e.alloc(4096, allAccess)
			other := allocIn(t, pd2, 4096, allAccess)
			ro := e.alloc(4096, prov.AccessRemoteRead)
			fill(rem.b, 0xee)
			fill(ro.b, 0xee)
			postRecv(t, b.qp, 1, rem.sge(0, 64))
			postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: tc.op, NumSGE: 1, RemoteAddr: rem.addr(0), RKey: rem.mr.RKey()}},
				[]prov.SGE{tc.sge(loc, other, ro)})
			if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusLocProtErr {
				t.Fatalf("%+v", c)
			}
			if st := state(t, a.qp); st != prov.QPStateErr {
				t.Errorf("requester state %v", st)
			}
			if st := state(t, b.qp); st != prov.QPStateRTS {
				t.Errorf("responder state %v", st)
			}
			if !allEq(rem.b, 0xee) || !allEq(ro.b, 0xee) {
				t.Error("memory modified")
			}
			expectEmpty(t, b.rcq)
		})
	}
}

// Receive-buffer errors: the receiver's completion has the local status,
// the sender's the remote one; both QPs go to ERR.
func TestRecvBufferErrors(t *testing.T) {
	tests := []struct {
		name       string
		recv       func(dst, ro *buf) []prov.SGE
		recvStatus prov.Status
		sendStatus prov.Status
	}{
		{"too small", func(dst, _ *buf) []prov.SGE { return []prov.SGE{dst.sge(0, 10), dst.sge(100, 10)} },
			prov.StatusLocLenErr, prov.StatusRemInvReqErr},
		{"bad lkey", func(dst, _ *buf) []prov.SGE { s := dst.sge(0, 64); s.LKey++; return []prov.SGE{s} },
			prov.StatusLocProtErr, prov.StatusRemOpErr},
		{"outside MR", func(dst, _ *buf) []prov.SGE { return []prov.SGE{dst.sge(4096-16, 64)} },
			prov.StatusLocProtErr, prov.StatusRemOpErr},
		{"no local write", func(_, ro *buf) []prov.SGE { return []prov.SGE{ro.sge(0, 64)} },
			prov.StatusLocProtErr, prov.StatusRemOpErr},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
			src, dst := e.alloc(4096, allAccess), e.alloc(4096, allAccess)
			ro := e.alloc(4096, prov.AccessRemoteRead)
			fill(dst.b, 0xee)
			fill(ro.b, 0xee)
			sg := tc.recv(dst, ro)
			n, err := b.qp.PostRecv([]prov.RecvWR{{WRID: 1, NumSGE: uint32(len(sg))}, {WRID: 2, NumSGE: 1}}, append(sg, dst.sge(0, 64)))
			if n != 2 || err != nil {
				t.Fatal(n, err)
			}
			postSend(t, a.qp, []prov.SendWR{{WRID: 9, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{src.sge(0, 32)})
			if c := poll(t, a.scq, 1)[0]; c.Status != tc.sendStatus {
				t.Errorf("sender %+v", c)
			}
			rc := poll(t, b.rcq, 2)
			if rc[0].WRID != 1 || rc[0].Status != tc.recvStatus || rc[1].WRID != 2 || rc[1].Status != prov.StatusWRFlushErr {
				t.Errorf("receiver %+v", rc)
			}
			if !allEq(dst.b, 0xee) || !allEq(ro.b, 0xee) {
				t.Error("receive memory modified")
			}
			waitState(t, a.qp, prov.QPStateErr)
			waitState(t, b.qp, prov.QPStateErr)
		})
	}
}

// Closing an MR makes later remote accesses fail.
func TestMRClosedRemote(t *testing.T) {
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	loc := e.alloc(64, allAccess)
	r := e.alloc(4096, allAccess)
	m2 := must(e.pd.RegMR(prov.Mem{Ptr: r.mr.(*mr).base, Len: 4096, FD: -1}, allAccess))
	rkey, addr := m2.RKey(), m2.Addr()
	must0(t, m2.Close())
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: addr, RKey: rkey}}, []prov.SGE{loc.sge(0, 8)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusRemAccessErr {
		t.Fatalf("%+v", c)
	}
}
