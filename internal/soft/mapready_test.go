package soft

import (
	"bytes"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// TestShmMapRefusalNotKeptBeforeAck: a region is shared only with a peer
// connected to a QP of its PD (serveMap), so a requester that asks
// before its destination QP is connected is refused for now. The
// refusal is kept only once a request of the QP was acknowledged
// (xstate.ackOK): before, the region is asked for again, and mapped
// once a QP of its PD is connected; else a requester that posted its
// first large read or write before the target reached RTR never got the
// direct copy on that connection.
func TestShmMapRefusalNotKeptBeforeAck(t *testing.T) {
	forceTransport(t, "shm")
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	const size = 64 << 10
	local := e.alloc(size, allAccess)
	// A request in PD A makes the connection.
	src := e.alloc(size, allAccess)
	if _, err := a.qp.PostSend([]prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
		RemoteAddr: src.addr(0), RKey: src.mr.RKey()}}, []prov.SGE{local.sge(0, size)}); err != nil {
		t.Fatal(err)
	}
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("write: %+v", c)
	}
	cn := qpConn(t, a.qp)
	kept := func(rkey uint32) *mrImport {
		cn.impMu.RLock()
		defer cn.impMu.RUnlock()
		return cn.imports[rkey]
	}

	// PD B: a region, and QPs not connected yet.
	pdB := must(e.ctx.AllocPD())
	t.Cleanup(func() {
		if err := pdB.Close(); err != nil {
			t.Errorf("close pd B: %v", err)
		}
	})
	eB := &env{t: t, ctx: e.ctx, pd: pdB}
	inB := allocIn(t, pdB, size, allAccess)
	for i := range inB.b {
		inB.b[i] = byte(i*3 + 1)
	}
	x, y := eB.newQP(prov.QPTypeRC, defaultCaps(), nil), eB.newQP(prov.QPTypeRC, defaultCaps(), nil)

	// Asked for before PD B has a connected QP: refused, and the refusal
	// not kept.
	if imp := cn.importRegion(inB.mr.RKey(), true, false, 0); imp == nil || imp.mem != nil {
		t.Fatalf("import of PD B's region before its QPs are connected: %+v, want a refusal", imp)
	}
	if kept(inB.mr.RKey()) != nil {
		t.Fatal("the refusal was kept before a request was acknowledged")
	}
	// Kept once a request was acknowledged (an rkey that names nothing).
	const none = 0x5a5a5a
	if imp := cn.importRegion(none, true, true, 0); imp == nil || imp.mem != nil {
		t.Fatalf("import of rkey %#x: %+v, want a refusal", none, imp)
	}
	if kept(none) == nil {
		t.Fatal("the refusal was not kept after a request was acknowledged")
	}
	connectOne(t, x.qp, y.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, y.qp, x.qp, prov.QPTypeRC, defaultConn())

	// The first large read of x, now that they are: PD B's region is
	// mapped, a direct copy (were the refusal kept, it would go through
	// the service on this connection for ever).
	lx := eB.alloc(size, allAccess)
	if _, err := x.qp.PostSend([]prov.SendWR{{Opcode: prov.WRRead, NumSGE: 1, Flags: prov.SendSignaled,
		RemoteAddr: inB.addr(0), RKey: inB.mr.RKey()}}, []prov.SGE{lx.sge(0, size)}); err != nil {
		t.Fatal(err)
	}
	if c := poll(t, x.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("read of PD B's region: %+v", c)
	}
	if !bytes.Equal(lx.b, inB.b) {
		t.Fatal("read of PD B's region: data differs")
	}
	cx := x.qp.(*qp).route.(*peer).current()
	if cx != cn {
		t.Fatal("x's requests went over another connection than the one asked before")
	}
	cx.impMu.RLock()
	imp := cx.imports[inB.mr.RKey()]
	cx.impMu.RUnlock()
	if imp == nil || imp.mem == nil {
		t.Fatalf("PD B's region after its QPs were connected: %+v, want it mapped", imp)
	}
}
