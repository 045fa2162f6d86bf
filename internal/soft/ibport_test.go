package soft

// Tests of the InfiniBand port soft0 presents under ForceInfiniBand
// (ibport.go), found by a review of soft0's UD paths.

import (
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// TestInfiniBandUDSourceLID: with the port presented as InfiniBand
// (ForceInfiniBand), a UD receive completion carries the sender's LID in
// slid (ibv_poll_cq(3): "slid: Source LID"; valid for UD receive
// completions), which ibv_init_ah_from_wc/ibv_create_ah_from_wc use to
// answer the sender. soft0 reported 0, an invalid LID.
func TestInfiniBandUDSourceLID(t *testing.T) {
	defer ForceInfiniBand()()
	lid := portLID(getFabric().id)
	a, b := ibDatagram(t, func(b *ep) prov.AHAttr {
		return prov.AHAttr{DLID: lid, SL: 3, Port: 1, ProviderAddr: b.qp.Address()}
	})
	c := poll(t, b.rcq, 1)[0]
	if c.Status != prov.StatusSuccess || c.SrcQP != a.qp.QPN() {
		t.Fatalf("receive completion %+v", c)
	}
	if c.SLID != lid {
		t.Errorf("UD receive completion on an InfiniBand port: slid %d, want the sender's LID %d (%+v)", c.SLID, lid, c)
	}
}

// ibDatagram sends a datagram of 100 bytes between two UD QPs of this
// process (Q_Keys 0x1111 and 0x2222), addressed by the address handle
// av makes for b, and waits for the send's successful completion; b has
// one receive posted.
func ibDatagram(t *testing.T, av func(b *ep) prov.AHAttr) (a, b *ep) {
	t.Helper()
	e := newEnv(t)
	a = udQP(t, e, 0x1111, nil)
	b = udQP(t, e, 0x2222, nil)
	m := e.alloc(8192, allAccess)
	ah := must(e.pd.CreateAH(av(b)))
	t.Cleanup(func() { ah.Close() })
	postRecv(t, b.qp, 1, m.sge(4096, grhLen+100))
	postSend(t, a.qp, []prov.SendWR{{WRID: 5, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1,
		AH: ah.Handle(), RemoteQPN: b.qp.QPN(), RemoteQKey: 0x2222}}, []prov.SGE{m.sge(0, 100)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("send completion %+v", c)
	}
	return a, b
}

// TestInfiniBandLIDRoutesLocally: on a port presented as InfiniBand, an
// address handle without a GRH and without a provider address whose DLID
// is this port's own LID must reach this port, as a GID of this port
// does on RoCE (TestUDSameQKeyHighBit) and as fabric.resolve's doc says
// ("Without a GRH ... the DLID routes instead"). soft0 ignored the DLID
// and dropped the datagram as unreachable.
func TestInfiniBandLIDRoutesLocally(t *testing.T) {
	defer ForceInfiniBand()()
	_, b := ibDatagram(t, func(*ep) prov.AHAttr { return prov.AHAttr{DLID: portLID(getFabric().id), Port: 1} })
	// In one process the datagram is delivered (or dropped) before the
	// sender's completion is visible: no waiting needed.
	var cs [1]prov.Completion
	if n, _ := b.rcq.Poll(cs[:]); n != 1 || cs[0].Status != prov.StatusSuccess || cs[0].WRID != 1 {
		t.Fatalf("a datagram addressed by this port's DLID (no GRH, no provider address) was not delivered: %d completions %+v", n, cs[:n])
	}
}

// TestInfiniBandSourceGIDIndex: on a port presented as InfiniBand the GID
// table has one entry (QueryGIDTable: index 0). An address handle with
// source GID index 1 names no GID of the port and must be refused
// (EINVAL, as the kernel refuses an AH whose sgid_index has no valid GID
// entry); soft0 accepted it, and its datagrams then carried the RoCE GID
// ::ffff:127.0.0.1 in the receiver's GRH.
func TestInfiniBandSourceGIDIndex(t *testing.T) {
	defer ForceInfiniBand()()
	e := newEnv(t)
	b := udQP(t, e, 0x2222, nil)
	gids := must(e.ctx.QueryGIDTable(1))
	av := avFor(b.qp, false)
	av.DGID = getFabric().gids[0]
	av.SGIDIndex = 1
	if ah, err := e.pd.CreateAH(av); err == nil {
		ah.Close()
		t.Errorf("CreateAH with source GID index 1 on a port whose GID table has %d entry: accepted", len(gids))
	}
}
