package soft

import (
	"bytes"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// TestShmMapNeedsQPInPD: over shared memory, a peer gets the memory of a
// region (MAP) only if it has a QP connected to a QP of the region's PD.
// Here the peer's QP is connected to a QP of PD A: a remote-readable
// region of PD B (whose only QP is not connected) is not shared (MAP
// answers "not shared", and a large read of it goes through the target's
// responder, which refuses it with REM_ACCESS_ERR, without a mapping);
// A's regions map, and direct reads and writes on them move the bytes.
func TestShmMapNeedsQPInPD(t *testing.T) {
	forceTransport(t, "shm")
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	pdB := must(e.ctx.AllocPD())
	t.Cleanup(func() {
		if err := pdB.Close(); err != nil {
			t.Errorf("close pd B: %v", err)
		}
	})
	// A QP of PD B that is not connected grants nothing.
	(&env{t: t, ctx: e.ctx, pd: pdB}).newQP(prov.QPTypeRC, defaultCaps(), nil)

	const size = 1 << 20
	readA := e.alloc(size, prov.AccessLocalWrite|prov.AccessRemoteRead)
	writeA := e.alloc(size, allAccess)
	inB := allocIn(t, pdB, size, allAccess)
	local := e.alloc(size, allAccess)
	for i := range readA.b {
		readA.b[i] = byte(i * 5)
		inB.b[i] = byte(i*11 + 1)
	}

	post := func(wr prov.SendWR) prov.Completion {
		t.Helper()
		wr.NumSGE, wr.Flags = 1, prov.SendSignaled
		if _, err := a.qp.PostSend([]prov.SendWR{wr}, []prov.SGE{local.sge(0, size)}); err != nil {
			t.Fatal(err)
		}
		return poll(t, a.scq, 1)[0]
	}
	// A's regions: direct read, then direct write.
	if c := post(prov.SendWR{Opcode: prov.WRRead, RemoteAddr: readA.addr(0), RKey: readA.mr.RKey()}); c.Status != prov.StatusSuccess {
		t.Fatalf("read of A's region: %+v", c)
	}
	if !bytes.Equal(local.b, readA.b) {
		t.Fatal("read of A's region: data differs")
	}
	// The connection is up (made by the first request).
	cn := a.qp.(*qp).route.(*peer).current()
	if cn == nil {
		t.Fatal("no connection")
	}
	mapped := func(rkey uint32) bool {
		cn.impMu.RLock()
		defer cn.impMu.RUnlock()
		imp := cn.imports[rkey]
		return imp != nil && imp.mem != nil
	}

	for i := range local.b {
		local.b[i] = byte(i*7 + 3)
	}
	if c := post(prov.SendWR{Opcode: prov.WRWrite, RemoteAddr: writeA.addr(0), RKey: writeA.mr.RKey()}); c.Status != prov.StatusSuccess {
		t.Fatalf("write to A's region: %+v", c)
	}
	if !bytes.Equal(local.b, writeA.b) {
		t.Fatal("write to A's region: data differs")
	}
	for _, b := range []*buf{readA, writeA} {
		if !mapped(b.mr.RKey()) {
			t.Errorf("region %#x of PD A was not mapped (no direct copy)", b.mr.RKey())
		}
	}

	// MAP itself, as the peer asks it.
	for _, tc := range []struct {
		name   string
		rkey   uint32
		status uint8
	}{
		{"PDA", readA.mr.RKey(), mapOK},
		{"PDB", inB.mr.RKey(), mapNotShare},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := cn.callMap(tc.rkey)
			if r.fd >= 0 {
				unix.Close(r.fd)
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.ack.status != tc.status {
				t.Fatalf("MAP of %#x: status %d, want %d", tc.rkey, r.ack.status, tc.status)
			}
			if (r.fd >= 0) != (tc.status == mapOK) {
				t.Fatalf("MAP of %#x: status %d with descriptor %d", tc.rkey, r.ack.status, r.fd)
			}
		})
	}

	// A large read of B's region: refused by the responder, nothing read,
	// and the requester holds no mapping of it.
	copy(local.b, writeA.b)
	if c := post(prov.SendWR{Opcode: prov.WRRead, RemoteAddr: inB.addr(0), RKey: inB.mr.RKey()}); c.Status != prov.StatusRemAccessErr {
		t.Fatalf("read of B's region: %+v, want REM_ACCESS_ERR", c)
	}
	if !bytes.Equal(local.b, writeA.b) {
		t.Error("the refused read of B's region changed the local buffer")
	}
	if mapped(inB.mr.RKey()) {
		t.Error("the peer mapped a region of PD B, where it has no connected QP")
	}
}
