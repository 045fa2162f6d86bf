package soft

import (
	"errors"
	"syscall"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// The provider checks the objects it is handed itself, below the verbs
// package that checks them first (defence in depth).

// TestCreateQPSRQOtherContext: a QP takes an SRQ of its own device
// context (of any PD there); an SRQ of another context is refused with
// EINVAL and no QP is created.
func TestCreateQPSRQOtherContext(t *testing.T) {
	e := newEnv(t)
	other := newEnv(t)
	samePD := must(e.pd.CreateSRQ(prov.SRQAttr{MaxWR: 8, MaxSGE: 2}))
	t.Cleanup(func() { samePD.Close() })
	pd2 := must(e.ctx.AllocPD())
	t.Cleanup(func() { pd2.Close() })
	otherPD := must(pd2.CreateSRQ(prov.SRQAttr{MaxWR: 8, MaxSGE: 2}))
	t.Cleanup(func() { otherPD.Close() })
	otherCtx := must(other.pd.CreateSRQ(prov.SRQAttr{MaxWR: 8, MaxSGE: 2}))
	t.Cleanup(func() { otherCtx.Close() })
	for _, tc := range []struct {
		name string
		srq  prov.SRQ
		err  error
	}{
		{"SamePD", samePD, nil},
		{"OtherPDSameContext", otherPD, nil},
		{"OtherContext", otherCtx, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scq, rcq := e.cq(16), e.cq(16)
			q, err := e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: scq, RecvCQ: rcq, SRQ: tc.srq, Cap: defaultCaps()})
			if err == nil {
				defer q.Close()
			}
			if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("create qp: %v, want %v", err, tc.err)
			}
			if err != nil && q != nil {
				t.Errorf("create qp failed (%v) and returned %#v, not nil", err, q)
			}
		})
	}
}

// TestUDPostSendAHOtherPD: a UD send names an address handle of its QP's
// PD; one of another PD (of the same context or another) is refused with
// EINVAL at PostSend, and nothing is sent or completed.
func TestUDPostSendAHOtherPD(t *testing.T) {
	e := newEnv(t)
	other := newEnv(t)
	a := udQP(t, e, 0x1111, nil)
	b := udQP(t, e, 0x2222, nil)
	m := e.alloc(4096, allAccess)
	pd2 := must(e.ctx.AllocPD())
	t.Cleanup(func() { pd2.Close() })
	ahs := map[string]prov.AH{}
	for name, pd := range map[string]prov.PD{"SamePD": e.pd, "OtherPDSameContext": pd2, "OtherContext": other.pd} {
		ah := must(pd.CreateAH(avFor(b.qp, false)))
		t.Cleanup(func() { ah.Close() })
		ahs[name] = ah
	}
	postRecv(t, b.qp, 1, m.sge(1024, 40+100))
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"OtherPDSameContext", syscall.EINVAL},
		{"OtherContext", syscall.EINVAL},
		{"SamePD", nil}, // last: it takes the receive
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := a.qp.PostSend([]prov.SendWR{{WRID: 7, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1,
				AH: ahs[tc.name].Handle(), RemoteQPN: b.qp.QPN(), RemoteQKey: 0x2222}}, []prov.SGE{m.sge(0, 100)})
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("post send: %v, want %v", err, tc.err)
				}
				expectEmpty(t, a.scq)
				expectEmpty(t, b.rcq)
				return
			}
			if err != nil {
				t.Fatalf("post send: %v", err)
			}
			if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != 7 {
				t.Fatalf("send: %+v", c)
			}
			if c := poll(t, b.rcq, 1)[0]; c.Status != prov.StatusSuccess || c.ByteLen != 140 || c.SrcQP != a.qp.QPN() {
				t.Fatalf("recv: %+v", c)
			}
		})
	}
}
