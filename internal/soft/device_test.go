package soft

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

func TestDevice(t *testing.T) {
	p := New()
	if p.Name() != "soft" {
		t.Errorf("name %q", p.Name())
	}
	devs := must(p.Devices())
	if len(devs) != 1 || devs[0].Name != DeviceName || devs[0].GUID == 0 {
		t.Fatalf("devices %+v", devs)
	}
	if _, err := p.Open("mlx5_0"); !errors.Is(err, prov.ErrNoDevice) {
		t.Fatalf("open mlx5_0: %v", err)
	}
	e := newEnv(t)
	da := must(e.ctx.QueryDevice())
	if da.MaxQPWR != 16384 || da.MaxSGE != 32 || da.MaxCQE != 65536 || da.MaxQPRDAtom != 16 ||
		da.MaxInlineData != 1024 || da.AtomicCap != 1 || da.PhysPortCnt != 1 || da.NodeGUID != devs[0].GUID ||
		da.FWVersion == "" || da.VendorID == 0 {
		t.Errorf("device attr %+v", da)
	}
	pa := must(e.ctx.QueryPort(1))
	if pa.State != prov.PortActive || pa.ActiveMTU != prov.MTU4096 || pa.MaxMTU != prov.MTU4096 ||
		pa.LinkLayer != prov.LinkLayerEthernet || pa.GIDTableLen != 2 {
		t.Errorf("port attr %+v", pa)
	}
	if _, err := e.ctx.QueryPort(2); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("query port 2: %v", err)
	}
	gids := must(e.ctx.QueryGIDTable(1))
	if len(gids) != 2 {
		t.Fatalf("gids %+v", gids)
	}
	if gids[0].GID[0] != 0xfe || gids[0].GID[1] != 0x80 || gids[0].Type != prov.GIDTypeRoCEv2 {
		t.Errorf("gid 0 %+v", gids[0])
	}
	want := [16]byte{10: 0xff, 11: 0xff, 12: 127, 15: 1}
	if gids[1].GID != want || gids[1].Index != 1 || gids[1].Type != prov.GIDTypeRoCEv2 {
		t.Errorf("gid 1 %+v", gids[1])
	}
}

// QPs of two contexts of the same process are on one fabric.
func TestTwoContexts(t *testing.T) {
	e1, e2 := newEnv(t), newEnv(t)
	a := e1.newQP(prov.QPTypeRC, defaultCaps(), nil)
	b := e2.newQP(prov.QPTypeRC, defaultCaps(), nil)
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, defaultConn())
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
	src := e1.alloc(64, allAccess)
	dst := e2.alloc(64, allAccess)
	copy(src.b, "hello across contexts")
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled,
		RemoteAddr: dst.addr(0), RKey: dst.mr.RKey(), NumSGE: 1}}, []prov.SGE{src.sge(0, 64)})
	c := poll(t, a.scq, 1)[0]
	if c.Status != prov.StatusSuccess || !bytes.Equal(dst.b, src.b) {
		t.Fatalf("completion %+v, dst %q", c, dst.b)
	}
}

func TestCloseBusy(t *testing.T) {
	ctx := must(New().Open(DeviceName))
	pd := must(ctx.AllocPD())
	cq := must(ctx.CreateCQ(4, nil, 0))
	qp := must(pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()}))
	if err := ctx.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("close context with children: %v", err)
	}
	if err := pd.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("close pd with a QP: %v", err)
	}
	if err := cq.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("close cq with a QP: %v", err)
	}
	for range 2 {
		if err := qp.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := qp.PostSend([]prov.SendWR{{}}, nil); !errors.Is(err, prov.ErrClosed) {
		t.Errorf("post on closed QP: %v", err)
	}
	for _, c := range []interface{ Close() error }{cq, pd, ctx, cq, pd, ctx} {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ctx.AllocPD(); !errors.Is(err, prov.ErrClosed) {
		t.Errorf("alloc pd on closed context: %v", err)
	}
	if _, err := ctx.AsyncEvent(context.Background()); !errors.Is(err, prov.ErrClosed) {
		t.Errorf("async event on closed context: %v", err)
	}
}

func TestRegMR(t *testing.T) {
	e := newEnv(t)
	b := e.alloc(4096, prov.AccessLocalWrite)
	for _, tc := range []struct {
		access prov.Access
		ok     bool
	}{
		{0, true},
		{prov.AccessLocalWrite, true},
		{prov.AccessRemoteRead, true},
		{prov.AccessRemoteWrite, false},
		{prov.AccessRemoteAtomic, false},
		{prov.AccessRemoteWrite | prov.AccessLocalWrite, true},
		{allAccess, true},
	} {
		m, err := e.pd.RegMR(prov.Mem{Ptr: b.mr.(*mr).base, Len: 4096, FD: -1}, tc.access)
		if tc.ok != (err == nil) {
			t.Errorf("access %#x: %v", tc.access, err)
		}
		if err == nil {
			if m.Addr() != b.mr.Addr() || m.Len() != 4096 || m.LKey() == b.mr.LKey() {
				t.Errorf("mr addr %#x len %d key %#x", m.Addr(), m.Len(), m.LKey())
			}
			m.Close()
		} else if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("access %#x: %v does not wrap EINVAL", tc.access, err)
		}
	}
	if _, err := e.pd.RegDMABuf(0, 4096, 0, 3, prov.AccessLocalWrite); !errors.Is(err, prov.ErrNotSupported) {
		t.Errorf("dmabuf: %v", err)
	}
	// Keys are unique among live regions.
	seen := map[uint32]bool{}
	var mrs []prov.MR
	for range 1000 {
		m := must(e.pd.RegMR(prov.Mem{Ptr: b.mr.(*mr).base, Len: 16, FD: -1}, 0))
		if seen[m.LKey()] {
			t.Fatalf("key %#x reused", m.LKey())
		}
		seen[m.LKey()] = true
		mrs = append(mrs, m)
	}
	for _, m := range mrs {
		m.Close()
	}
}

func TestKeyPermutation(t *testing.T) {
	p := getFabric().keyPerm
	for _, v := range []uint32{0, 1, 2, 0xfffff, 0x100000, 0xdeadbeef, 0xffffffff} {
		if got := p.decrypt(p.encrypt(v)); got != v {
			t.Errorf("decrypt(encrypt(%#x)) = %#x", v, got)
		}
	}
}

func TestAddress(t *testing.T) {
	e := newEnv(t)
	a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	addr := a.qp.Address()
	if len(addr) < addrMinLen || addr[0] != addrVersion || addr[1] != addrKindProcess {
		t.Fatalf("address % x", addr)
	}
	f := getFabric()
	for _, g := range f.gids {
		if l, fab, err := f.resolve(g, true, 0, addr); err != nil || l != &f.local || fab != f.id {
			t.Errorf("resolve own address, GID %x: %v %x %v", g, l, fab, err)
		}
	}
	pa, err := parseAddr(addr)
	if err != nil {
		t.Fatalf("parse own address: %v", err)
	}
	pa.fabric ^= 1
	other := portGIDs(pa.fabric)
	if l, fab, err := f.resolve(other[0], true, 0, encodePeerAddr(&pa)); err != nil || fab != pa.fabric {
		t.Errorf("resolve other fabric: %v %x %v", l, fab, err)
	} else if _, ok := l.(*peer); !ok {
		t.Errorf("resolve other fabric: link %T, want a *peer", l)
	}
	// The GID routes: one that is not a GID of the port the address
	// names is unreachable, whatever the address.
	for _, g := range [][16]byte{{}, f.gids[0], {0xfe, 0x80, 12: 0xde, 13: 0xad, 14: 0xbe, 15: 0xef}} {
		if l, _, err := f.resolve(g, true, 0, encodePeerAddr(&pa)); !errors.Is(err, syscall.EHOSTUNREACH) || l != nil {
			t.Errorf("resolve GID %x with the address of another port: %v, %v; want an error matching EHOSTUNREACH", g, l, err)
		}
	}
	if _, _, err := f.resolve(f.gids[1], true, 0, []byte{1, 2}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("resolve malformed: %v", err)
	}
	if l, _, _ := f.resolve(f.gids[0], true, 0, nil); l == nil {
		t.Errorf("resolve by local GID failed")
	}
}
