package soft

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// TestQPSendRingOnFirstPost: a QP that never posts holds no send ring. A
// rank of a large world has a QP to every other rank and posts to a few
// of them (a barrier to O(log N)); a ring of 128 requests is about 32 KiB,
// which 512 ranks of one host each made for 511 QPs at start (8 GiB
// allocated and zeroed in all). The heap allocated per QP stays well below
// one ring, and the first post makes the ring and works.
func TestQPSendRingOnFirstPost(t *testing.T) {
	e := newEnv(t)
	cq := e.cq(4096)
	caps := prov.QPCap{MaxSendWR: 128, MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}
	const n = 64
	qps := make([]prov.QP, 0, n)
	t.Cleanup(func() {
		for _, q := range qps {
			q.Close()
		}
	})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		qps = append(qps, must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: caps})))
	}
	runtime.ReadMemStats(&after)
	ring := uint64(caps.MaxSendWR) * uint64(sizeofSendWQE())
	per := (after.TotalAlloc - before.TotalAlloc) / n
	t.Logf("%d bytes allocated per QP; a send ring of %d requests is %d bytes", per, caps.MaxSendWR, ring)
	if per >= ring/2 {
		t.Errorf("%d bytes allocated per QP that never posted, want less than half a send ring (%d bytes)", per, ring/2)
	}

	// The first post makes the ring: a loopback write completes.
	a, b := e.newQP(prov.QPTypeRC, defaultCaps(), nil), e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
	src, dst := e.alloc(8, allAccess), e.alloc(8, allAccess)
	fill(src.b, 0x5a)
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled, NumSGE: 1,
		RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}, []prov.SGE{src.sge(0, 8)})
	if c := poll(t, a.scq, 1); c[0].Status != prov.StatusSuccess {
		t.Fatalf("write: %v", c[0].Status)
	}
	if !allEq(dst.b, 0x5a) {
		t.Fatalf("write: target holds %x", dst.b)
	}
}

func sizeofSendWQE() uintptr { return unsafe.Sizeof(sendWQE{}) }
