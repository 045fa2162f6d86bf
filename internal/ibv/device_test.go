//go:build ibverbs && linux && cgo

package ibv

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// The device tests need two RDMA devices on one Ethernet segment, by
// default rxe0 and rxe1 (the VM harness: scripts/vm/run.sh), overridable
// with GOVERBS_IBV_TEST_DEVICES=devA,devB. Without them they skip.

func testDevices(t testing.TB) (string, string) {
	t.Helper()
	names := []string{"rxe0", "rxe1"}
	if v := os.Getenv("GOVERBS_IBV_TEST_DEVICES"); v != "" {
		names = strings.Split(v, ",")
	}
	devs, err := New().Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	have := map[string]bool{}
	for _, d := range devs {
		have[d.Name] = true
	}
	for _, n := range names[:2] {
		if !have[n] {
			t.Skipf("no RDMA device: need %s and %s, found %d device(s) (run in the VM: scripts/vm/run.sh; or set GOVERBS_IBV_TEST_DEVICES)", names[0], names[1], len(devs))
		}
	}
	return names[0], names[1]
}

// mode selects the classic or the extended-verbs data path.
type mode struct {
	name      string
	wrAPI, ex bool
}

var modes = []mode{{name: "classic"}, {name: "ex", wrAPI: true, ex: true}}

func forModes(t *testing.T, f func(t *testing.T, m mode)) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) { f(t, m) })
	}
}

func openCtx(t testing.TB, name string, m mode) *devContext {
	t.Helper()
	c, err := New().Open(name)
	if err != nil {
		t.Fatalf("Open(%s): %v", name, err)
	}
	dc := c.(*devContext)
	dc.wrAPI, dc.cqEx = m.wrAPI, m.ex
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close %s: %v", name, err)
		}
	})
	return dc
}

func closeLater(t testing.TB, what string, c interface{ Close() error }) {
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close %s: %v", what, err)
		}
	})
}

const bufSize = 1 << 16

// side is one end of a test connection.
type side struct {
	ctx  *devContext
	pd   prov.PD
	ch   prov.CompChannel
	cq   prov.CQ
	qp   prov.QP
	mr   prov.MR
	buf  []byte
	gid  [16]byte
	port prov.PortAttr
}

type sideOpts struct {
	typ     prov.QPType
	channel bool
	srq     bool
	cap     prov.QPCap
}

func newSide(t testing.TB, name string, m mode, o sideOpts) *side {
	t.Helper()
	s := &side{ctx: openCtx(t, name, m)}
	var err error
	if s.port, err = s.ctx.QueryPort(1); err != nil {
		t.Fatal(err)
	}
	gids, err := s.ctx.QueryGIDTable(1)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, g := range gids {
		if g.Index == 0 {
			s.gid, found = g.GID, true
		}
	}
	if !found {
		t.Fatalf("%s: no GID at index 0 (table %v)", name, gids)
	}
	if s.pd, err = s.ctx.AllocPD(); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "pd", s.pd)
	buf, err := unix.Mmap(-1, 0, bufSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(buf) })
	s.buf = buf
	acc := prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead | prov.AccessRemoteAtomic
	if s.mr, err = s.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: len(buf), FD: -1}, acc); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "mr", s.mr)
	if o.channel {
		if s.ch, err = s.ctx.CreateCompChannel(); err != nil {
			t.Fatal(err)
		}
		closeLater(t, "channel", s.ch)
	}
	if s.cq, err = s.ctx.CreateCQ(256, s.ch, 0); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "cq", s.cq)
	if o.typ == 0 {
		o.typ = prov.QPTypeRC
	}
	if o.cap == (prov.QPCap{}) {
		o.cap = prov.QPCap{MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInlineData: 64}
	}
	ia := prov.QPInitAttr{Type: o.typ, SendCQ: s.cq, RecvCQ: s.cq, Cap: o.cap}
	if o.srq {
		srq, err := s.pd.CreateSRQ(prov.SRQAttr{MaxWR: 64, MaxSGE: 2})
		if err != nil {
			t.Fatal(err)
		}
		closeLater(t, "srq", srq)
		ia.SRQ = srq
	}
	if s.qp, err = s.pd.CreateQP(ia); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "qp", s.qp)
	return s
}

func (s *side) sge(off, n int) prov.SGE {
	return prov.SGE{Addr: s.mr.Addr() + uint64(off), Length: uint32(n), LKey: s.mr.LKey()}
}

func modify(t testing.TB, qp prov.QP, a prov.QPAttr, mask prov.QPAttrMask) {
	t.Helper()
	if err := qp.Modify(&a, mask); err != nil {
		t.Fatalf("modify to %d: %v", a.State, err)
	}
}

func minMTU(a, b prov.MTU) prov.MTU {
	if a < b {
		return a
	}
	return b
}

// connectRC brings a and b (RC or UC) to RTS, addressed by GID index 0.
func connectRC(t testing.TB, a, b *side) {
	t.Helper()
	mtu := minMTU(a.port.ActiveMTU, b.port.ActiveMTU)
	for _, p := range [][2]*side{{a, b}, {b, a}} {
		l, r := p[0], p[1]
		modify(t, l.qp, prov.QPAttr{State: prov.QPStateInit, Port: 1,
			Access: prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead | prov.AccessRemoteAtomic},
			prov.AttrState|prov.AttrPKeyIndex|prov.AttrPort|prov.AttrAccessFlags)
		modify(t, l.qp, prov.QPAttr{State: prov.QPStateRTR, PathMTU: mtu, DestQPN: r.qp.QPN(), RQPSN: 100,
			MaxDestRDAtom: 4, MinRNRTimer: 12,
			AH: prov.AHAttr{IsGlobal: true, DGID: r.gid, SGIDIndex: 0, HopLimit: 64, Port: 1}},
			prov.AttrState|prov.AttrAV|prov.AttrPathMTU|prov.AttrDestQPN|prov.AttrRQPSN|prov.AttrMaxDestRDAtom|prov.AttrMinRNRTimer)
		modify(t, l.qp, prov.QPAttr{State: prov.QPStateRTS, SQPSN: 100, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRDAtomic: 4},
			prov.AttrState|prov.AttrSQPSN|prov.AttrTimeout|prov.AttrRetryCnt|prov.AttrRNRRetry|prov.AttrMaxQPRDAtomic)
	}
}

func rcPair(t testing.TB, m mode, o sideOpts) (*side, *side) {
	t.Helper()
	n0, n1 := testDevices(t)
	a := newSide(t, n0, m, o)
	b := newSide(t, n1, m, o)
	connectRC(t, a, b)
	return a, b
}

// pollN polls cq until n completions arrived (or 10 s passed).
func pollN(t testing.TB, cq prov.CQ, n int) []prov.Completion {
	t.Helper()
	out := make([]prov.Completion, 0, n)
	buf := make([]prov.Completion, 16)
	deadline := time.Now().Add(10 * time.Second)
	for len(out) < n {
		k, err := cq.Poll(buf[:min(len(buf), n-len(out))])
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		out = append(out, buf[:k]...)
		if k == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("timed out with %d of %d completions: %+v", len(out), n, out)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	return out
}

func wantOK(t testing.TB, c prov.Completion, op prov.WCOpcode, wrid uint64) {
	t.Helper()
	if c.Status != prov.StatusSuccess || c.Opcode != op || c.WRID != wrid {
		t.Fatalf("completion %+v: want status 0, opcode %d, wrid %d", c, op, wrid)
	}
}

func postSend(t testing.TB, qp prov.QP, wrs []prov.SendWR, sges []prov.SGE) {
	t.Helper()
	if n, err := qp.PostSend(wrs, sges); err != nil || n != len(wrs) {
		t.Fatalf("PostSend: %d of %d, %v", n, len(wrs), err)
	}
}

func postRecv(t testing.TB, qp prov.QP, wrs []prov.RecvWR, sges []prov.SGE) {
	t.Helper()
	if n, err := qp.PostRecv(wrs, sges); err != nil || n != len(wrs) {
		t.Fatalf("PostRecv: %d of %d, %v", n, len(wrs), err)
	}
}

func TestOpenMissing(t *testing.T) {
	_, err := New().Open("no-such-device-0")
	if !errors.Is(err, prov.ErrNoDevice) {
		t.Fatalf("Open(missing) = %v, want ErrNoDevice", err)
	}
}

func TestQuery(t *testing.T) {
	n0, _ := testDevices(t)
	devs, _ := New().Devices()
	for _, d := range devs {
		t.Logf("device %+v", d)
	}
	c := openCtx(t, n0, modes[0])
	da, err := c.QueryDevice()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("device attr %+v", da)
	if da.PhysPortCnt < 1 || da.MaxQP <= 0 || da.MaxCQE <= 0 {
		t.Errorf("implausible device attr %+v", da)
	}
	pa, err := c.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("port 1 %+v", pa)
	if pa.State != prov.PortActive {
		t.Errorf("port state %d, want active", pa.State)
	}
	if pa.ActiveMTU.Bytes() == 0 || pa.GIDTableLen <= 0 {
		t.Errorf("implausible port attr %+v", pa)
	}
	gids, err := c.QueryGIDTable(1)
	if err != nil {
		t.Fatal(err)
	}
	if len(gids) == 0 {
		t.Fatal("empty GID table")
	}
	for _, g := range gids {
		t.Logf("gid %d: %x type %d netdev %q ifindex %d", g.Index, g.GID, g.Type, g.Netdev, g.IfIndex)
		if g.GID == ([16]byte{}) {
			t.Errorf("zero GID %d reported", g.Index)
		}
	}
	if pa.LinkLayer == prov.LinkLayerEthernet {
		if gids[0].Index != 0 || gids[0].Type != prov.GIDTypeRoCEv2 || gids[0].GID[0] != 0xfe || gids[0].Netdev == "" {
			t.Errorf("GID 0 = %+v, want a link-local RoCE v2 GID with a netdev", gids[0])
		}
		// the sysfs fallback must agree
		sys, err := c.queryGIDTableSysfs(1, pa)
		if err != nil {
			t.Fatal(err)
		}
		if len(sys) != len(gids) || sys[0].GID != gids[0].GID || sys[0].Type != gids[0].Type || sys[0].Netdev != gids[0].Netdev {
			t.Errorf("sysfs GID table %+v differs from %+v", sys, gids)
		}
	}
	// A port the device does not have: EINVAL, saying which it has.
	missing := uint8(da.PhysPortCnt + 8)
	_, err = c.QueryPort(missing)
	if want := queryPortOp(n0, missing, da.PhysPortCnt) + ": invalid argument"; !errors.Is(err, syscall.EINVAL) || err.Error() != want {
		t.Errorf("QueryPort(%d) = %v, want EINVAL: %q", missing, err, want)
	}
	// dma-buf: the rxe provider of libibverbs does not implement it
	// (EOPNOTSUPP, whatever the fd); a device that does refuses fd -1.
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	_, err = pd.RegDMABuf(0, 4096, 0, -1, prov.AccessLocalWrite)
	t.Logf("RegDMABuf(fd -1): %v", err)
	if da.VendorID == rxeVendorID {
		if !errors.Is(err, prov.ErrNotSupported) || !errors.Is(err, syscall.EOPNOTSUPP) {
			t.Errorf("RegDMABuf(fd -1) on rxe = %v, want ErrNotSupported (EOPNOTSUPP)", err)
		}
	} else if !errors.Is(err, prov.ErrNotSupported) && !errors.Is(err, syscall.EBADF) {
		t.Errorf("RegDMABuf(fd -1) = %v, want ErrNotSupported or EBADF", err)
	}
}

func TestRC(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{})
		t.Logf("wr api: %v/%v, extended cq: %v/%v, granted caps %+v",
			a.qp.(*queuePair).WRAPI(), b.qp.(*queuePair).WRAPI(),
			a.cq.(*compQueue).Extended(), b.cq.(*compQueue).Extended(), a.qp.(*queuePair).init.Cap)

		qa, ia, err := a.qp.Query()
		if err != nil {
			t.Fatal(err)
		}
		if qa.State != prov.QPStateRTS || qa.DestQPN != b.qp.QPN() || qa.SQPSN != 100 || !qa.AH.IsGlobal || qa.AH.DGID != b.gid {
			t.Errorf("Query: %+v", qa)
		}
		if ia.Type != prov.QPTypeRC || ia.SendCQ != a.cq || ia.Cap.MaxSendWR < 64 {
			t.Errorf("Query init: %+v", ia)
		}

		t.Run("write", func(t *testing.T) {
			copy(a.buf[0:], "hello, rdma write")
			postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled,
				RemoteAddr: b.mr.Addr() + 1024, RKey: b.mr.RKey(), NumSGE: 1}}, []prov.SGE{a.sge(0, 17)})
			wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, 1)
			if got := string(b.buf[1024 : 1024+17]); got != "hello, rdma write" {
				t.Fatalf("remote memory %q", got)
			}
		})

		t.Run("send-recv-imm", func(t *testing.T) {
			postRecv(t, b.qp, []prov.RecvWR{{WRID: 10, NumSGE: 1}, {WRID: 11, SGEIndex: 1, NumSGE: 1}},
				[]prov.SGE{b.sge(2048, 256), b.sge(2304, 256)})
			copy(a.buf[4096:], "first message")
			copy(a.buf[4200:], "second")
			postSend(t, a.qp, []prov.SendWR{
				{WRID: 20, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1},
				{WRID: 21, Opcode: prov.WRSendImm, Flags: prov.SendSignaled | prov.SendSolicited, Imm: 0x12345678, SGEIndex: 1, NumSGE: 1},
			}, []prov.SGE{a.sge(4096, 13), a.sge(4200, 6)})
			sc := pollN(t, a.cq, 2)
			wantOK(t, sc[0], prov.WCSend, 20)
			wantOK(t, sc[1], prov.WCSend, 21)
			rc := pollN(t, b.cq, 2)
			wantOK(t, rc[0], prov.WCRecv, 10)
			wantOK(t, rc[1], prov.WCRecv, 11)
			if rc[0].ByteLen != 13 || string(b.buf[2048:2048+13]) != "first message" || rc[0].Flags&prov.WCWithImm != 0 {
				t.Errorf("recv 0: %+v %q", rc[0], b.buf[2048:2048+13])
			}
			if rc[1].ByteLen != 6 || rc[1].Imm != 0x12345678 || rc[1].Flags&prov.WCWithImm == 0 || rc[1].QPN != b.qp.QPN() {
				t.Errorf("recv 1: %+v", rc[1])
			}
		})

		t.Run("write-imm", func(t *testing.T) {
			postRecv(t, b.qp, []prov.RecvWR{{WRID: 30}}, nil)
			copy(a.buf[8192:], "with immediate")
			postSend(t, a.qp, []prov.SendWR{{WRID: 31, Opcode: prov.WRWriteImm, Flags: prov.SendSignaled, Imm: 0xcafef00d,
				RemoteAddr: b.mr.Addr() + 8192, RKey: b.mr.RKey(), NumSGE: 1}}, []prov.SGE{a.sge(8192, 14)})
			wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, 31)
			c := pollN(t, b.cq, 1)[0]
			wantOK(t, c, prov.WCRecvRDMAImm, 30)
			if c.Imm != 0xcafef00d || c.ByteLen != 14 || string(b.buf[8192:8192+14]) != "with immediate" {
				t.Errorf("write-imm: %+v %q", c, b.buf[8192:8192+14])
			}
		})

		t.Run("read", func(t *testing.T) {
			copy(b.buf[12288:], "remote data to read")
			postSend(t, a.qp, []prov.SendWR{{WRID: 40, Opcode: prov.WRRead, Flags: prov.SendSignaled,
				RemoteAddr: b.mr.Addr() + 12288, RKey: b.mr.RKey(), NumSGE: 2}},
				[]prov.SGE{a.sge(12288, 7), a.sge(13000, 12)})
			c := pollN(t, a.cq, 1)[0]
			wantOK(t, c, prov.WCRead, 40)
			if got := string(a.buf[12288:12288+7]) + string(a.buf[13000:13000+12]); got != "remote data to read" {
				t.Errorf("read %q", got)
			}
		})

		t.Run("atomic", func(t *testing.T) {
			da, _ := a.ctx.QueryDevice()
			if da.AtomicCap == 0 {
				t.Skip("device reports no atomics")
			}
			binary.LittleEndian.PutUint64(b.buf[16384:], 40)
			postSend(t, a.qp, []prov.SendWR{
				{WRID: 50, Opcode: prov.WRAtomicFAA, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr() + 16384, RKey: b.mr.RKey(), CompareAdd: 2, NumSGE: 1},
				{WRID: 51, Opcode: prov.WRAtomicCAS, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr() + 16384, RKey: b.mr.RKey(), CompareAdd: 42, Swap: 7, SGEIndex: 1, NumSGE: 1},
				{WRID: 52, Opcode: prov.WRAtomicCAS, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr() + 16384, RKey: b.mr.RKey(), CompareAdd: 42, Swap: 9, SGEIndex: 2, NumSGE: 1},
			}, []prov.SGE{a.sge(16384, 8), a.sge(16392, 8), a.sge(16400, 8)})
			c := pollN(t, a.cq, 3)
			wantOK(t, c[0], prov.WCFetchAdd, 50)
			wantOK(t, c[1], prov.WCCompSwap, 51)
			wantOK(t, c[2], prov.WCCompSwap, 52)
			le := binary.LittleEndian
			if p0, p1, p2, r := le.Uint64(a.buf[16384:]), le.Uint64(a.buf[16392:]), le.Uint64(a.buf[16400:]), le.Uint64(b.buf[16384:]); p0 != 40 || p1 != 42 || p2 != 7 || r != 7 {
				t.Errorf("atomics: prior values %d %d %d, remote %d; want 40 42 7, 7", p0, p1, p2, r)
			}
		})

		t.Run("batch", func(t *testing.T) {
			// 100 writes in one PostSend: more than one C chunk (32), one signaled.
			const n = 100
			wrs := make([]prov.SendWR, n)
			sges := make([]prov.SGE, n)
			for i := range wrs {
				a.buf[20000+i] = byte(i)
				sges[i] = a.sge(20000+i, 1)
				wrs[i] = prov.SendWR{WRID: uint64(1000 + i), Opcode: prov.WRWrite, RemoteAddr: b.mr.Addr() + 30000 + uint64(i), RKey: b.mr.RKey(), SGEIndex: uint32(i), NumSGE: 1}
			}
			wrs[n-1].Flags = prov.SendSignaled
			// the send queue holds 64: post in two calls
			postSend(t, a.qp, wrs[:50], sges)
			postSend(t, a.qp, wrs[50:], sges)
			wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, 1000+n-1)
			for i := 0; i < n; i++ {
				if b.buf[30000+i] != byte(i) {
					t.Fatalf("byte %d = %d", i, b.buf[30000+i])
				}
			}
		})

		t.Run("inline", func(t *testing.T) {
			if a.qp.(*queuePair).init.Cap.MaxInlineData < 16 {
				t.Skipf("granted max inline %d", a.qp.(*queuePair).init.Cap.MaxInlineData)
			}
			postRecv(t, b.qp, []prov.RecvWR{{WRID: 60, NumSGE: 1}}, []prov.SGE{b.sge(40000, 64)})
			copy(a.buf[40000:], "inline-data-abcd")
			postSend(t, a.qp, []prov.SendWR{{WRID: 61, Opcode: prov.WRSend, Flags: prov.SendSignaled | prov.SendInline, NumSGE: 2}},
				[]prov.SGE{a.sge(40000, 7), a.sge(40007, 9)})
			wantOK(t, pollN(t, a.cq, 1)[0], prov.WCSend, 61)
			c := pollN(t, b.cq, 1)[0]
			wantOK(t, c, prov.WCRecv, 60)
			if string(b.buf[40000:40016]) != "inline-data-abcd" {
				t.Errorf("inline payload %q", b.buf[40000:40016])
			}
		})

		t.Run("post-errors", func(t *testing.T) {
			// SGL out of range: the first request is posted, the second rejected.
			wrs := []prov.SendWR{
				{WRID: 70, Opcode: prov.WRWrite, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), NumSGE: 1},
				{WRID: 71, Opcode: prov.WRWrite, RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), SGEIndex: 1, NumSGE: 1},
			}
			n, err := a.qp.PostSend(wrs, []prov.SGE{a.sge(0, 8)})
			if !errors.Is(err, syscall.EINVAL) {
				t.Fatalf("PostSend(bad SGL) = %d, %v; want EINVAL", n, err)
			}
			t.Logf("bad SGL: %d accepted, %v", n, err)
			if n == 1 {
				wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, 70)
			}
			if a.qp.(*queuePair).WRAPI() {
				// An opcode outside send_ops_flags is refused in the shim.
				n, err = a.qp.PostSend([]prov.SendWR{{WRID: 72, Opcode: prov.WRTSO, Flags: prov.SendSignaled}}, nil)
				if n != 0 || !errors.Is(err, prov.ErrNotSupported) {
					t.Errorf("TSO on RC (wr api): %d accepted, %v; want ErrNotSupported", n, err)
				}
			}
		})

		t.Run("remote-access-error", func(t *testing.T) {
			// A bad rkey fails with REM_ACCESS_ERR and moves the QP to ERR; do it last.
			postSend(t, a.qp, []prov.SendWR{{WRID: 80, Opcode: prov.WRWrite, Flags: prov.SendSignaled,
				RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey() ^ 0x5a5a00, NumSGE: 1}}, []prov.SGE{a.sge(0, 8)})
			c := pollN(t, a.cq, 1)[0]
			if c.WRID != 80 || c.Status != prov.StatusRemAccessErr {
				t.Fatalf("completion %+v, want REM_ACCESS_ERR", c)
			}
			t.Logf("error completion %+v", c)
			attr, _, err := a.qp.Query()
			if err != nil || attr.State != prov.QPStateErr {
				t.Errorf("state after error %d, %v", attr.State, err)
			}
			// Posting to an ERR QP completes with a flush error.
			postSend(t, a.qp, []prov.SendWR{{WRID: 81, Opcode: prov.WRSend, Flags: prov.SendSignaled}}, nil)
			if c := pollN(t, a.cq, 1)[0]; c.WRID != 81 || c.Status != prov.StatusWRFlushErr {
				t.Errorf("completion %+v, want WR_FLUSH_ERR", c)
			}
		})
	})
}

func TestQueueFull(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{cap: prov.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
		granted := a.qp.(*queuePair).init.Cap.MaxSendWR
		n := granted + 8
		wrs := make([]prov.SendWR, n)
		for i := range wrs {
			wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), NumSGE: 1}
		}
		got, err := a.qp.PostSend(wrs, []prov.SGE{a.sge(0, 8)})
		t.Logf("granted max_send_wr %d: posted %d of %d: %v", granted, got, n, err)
		if !errors.Is(err, prov.ErrQueueFull) || !errors.Is(err, syscall.ENOMEM) {
			t.Fatalf("want ErrQueueFull/ENOMEM, got %v", err)
		}
		if got < 0 || got >= n {
			t.Fatalf("accepted %d of %d", got, n)
		}
		if got > 0 {
			pollN(t, a.cq, got)
		}
		// Receive side likewise.
		rwrs := make([]prov.RecvWR, b.qp.(*queuePair).init.Cap.MaxRecvWR+8)
		rgot, err := b.qp.PostRecv(rwrs, nil)
		t.Logf("recv: posted %d of %d: %v", rgot, len(rwrs), err)
		if !errors.Is(err, prov.ErrQueueFull) {
			t.Fatalf("recv overflow: %v", err)
		}
		// A full queue is flow control, met in posting loops: reporting
		// it allocates nothing.
		var again error
		allocs := testing.AllocsPerRun(50, func() { _, again = b.qp.PostRecv(rwrs[:1], nil) })
		if !errors.Is(again, prov.ErrQueueFull) {
			t.Fatalf("recv on a full queue: %v", again)
		}
		if allocs != 0 {
			t.Errorf("a post to a full queue allocates %v", allocs)
		}
	})
}

func TestModifyErrors(t *testing.T) {
	n0, _ := testDevices(t)
	s := newSide(t, n0, modes[0], sideOpts{})
	// RESET -> RTS is not a valid transition.
	err := s.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS}, prov.AttrState)
	if !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("RESET->RTS: %v, want EINVAL", err)
	}
	t.Logf("RESET->RTS: %v", err)
}

func TestUD(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		n0, n1 := testDevices(t)
		a := newSide(t, n0, m, sideOpts{typ: prov.QPTypeUD})
		b := newSide(t, n1, m, sideOpts{typ: prov.QPTypeUD})
		const qkey = 0x11111111
		for _, s := range []*side{a, b} {
			modify(t, s.qp, prov.QPAttr{State: prov.QPStateInit, Port: 1, QKey: qkey}, prov.AttrState|prov.AttrPKeyIndex|prov.AttrPort|prov.AttrQKey)
			modify(t, s.qp, prov.QPAttr{State: prov.QPStateRTR}, prov.AttrState)
			modify(t, s.qp, prov.QPAttr{State: prov.QPStateRTS, SQPSN: 7}, prov.AttrState|prov.AttrSQPSN)
		}
		ah, err := a.pd.CreateAH(prov.AHAttr{IsGlobal: true, DGID: b.gid, SGIDIndex: 0, HopLimit: 64, Port: 1})
		if err != nil {
			t.Fatal(err)
		}
		closeLater(t, "ah", ah)
		postRecv(t, b.qp, []prov.RecvWR{{WRID: 1, NumSGE: 1}}, []prov.SGE{b.sge(0, 40+512)})
		copy(a.buf[0:], "datagram!")
		postSend(t, a.qp, []prov.SendWR{{WRID: 2, Opcode: prov.WRSendImm, Imm: 77, Flags: prov.SendSignaled, AH: ah.Handle(),
			RemoteQPN: b.qp.QPN(), RemoteQKey: qkey, NumSGE: 1}}, []prov.SGE{a.sge(0, 9)})
		wantOK(t, pollN(t, a.cq, 1)[0], prov.WCSend, 2)
		c := pollN(t, b.cq, 1)[0]
		wantOK(t, c, prov.WCRecv, 1)
		t.Logf("UD receive: %+v", c)
		if c.ByteLen != 40+9 || string(b.buf[40:49]) != "datagram!" || c.SrcQP != a.qp.QPN() || c.Imm != 77 || c.Flags&prov.WCWithGRH == 0 {
			t.Errorf("UD receive %+v, payload %q", c, b.buf[40:49])
		}
		// Wrong Q_Key: the datagram is dropped silently.
		postRecv(t, b.qp, []prov.RecvWR{{WRID: 3, NumSGE: 1}}, []prov.SGE{b.sge(0, 40+512)})
		postSend(t, a.qp, []prov.SendWR{{WRID: 4, Opcode: prov.WRSend, Flags: prov.SendSignaled, AH: ah.Handle(),
			RemoteQPN: b.qp.QPN(), RemoteQKey: qkey + 1, NumSGE: 1}}, []prov.SGE{a.sge(0, 9)})
		wantOK(t, pollN(t, a.cq, 1)[0], prov.WCSend, 4)
		time.Sleep(100 * time.Millisecond)
		var buf [4]prov.Completion
		if k, _ := b.cq.Poll(buf[:]); k != 0 {
			t.Errorf("datagram with a wrong Q_Key delivered: %+v", buf[:k])
		}
	})
}

func TestSRQ(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{srq: true})
		bq := b.qp.(*queuePair)
		srq := bq.init.SRQ
		attr, err := srq.Query()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("SRQ attr %+v", attr)
		if attr.MaxWR < 64 {
			t.Errorf("SRQ max_wr %d", attr.MaxWR)
		}
		if err := srq.Modify(prov.SRQAttr{SRQLimit: 2}, true); err != nil {
			t.Fatalf("SRQ modify limit: %v", err)
		}
		if attr, _ := srq.Query(); attr.SRQLimit != 2 {
			t.Errorf("limit after modify: %+v", attr)
		}
		n, err := srq.PostRecv([]prov.RecvWR{{WRID: 1, NumSGE: 1}, {WRID: 2, SGEIndex: 1, NumSGE: 1}},
			[]prov.SGE{b.sge(0, 128), b.sge(128, 128)})
		if err != nil || n != 2 {
			t.Fatalf("SRQ PostRecv %d %v", n, err)
		}
		copy(a.buf, "via srq")
		postSend(t, a.qp, []prov.SendWR{{WRID: 3, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1}}, []prov.SGE{a.sge(0, 7)})
		wantOK(t, pollN(t, a.cq, 1)[0], prov.WCSend, 3)
		c := pollN(t, b.cq, 1)[0]
		wantOK(t, c, prov.WCRecv, 1)
		if string(b.buf[:7]) != "via srq" || c.QPN != b.qp.QPN() {
			t.Errorf("SRQ receive %+v %q", c, b.buf[:7])
		}
		// Zero allocations on the SRQ receive path too.
		wrs := []prov.RecvWR{{WRID: 9, NumSGE: 1}}
		sges := []prov.SGE{b.sge(0, 64)}
		allocs := testing.AllocsPerRun(20, func() {
			if _, err := srq.PostRecv(wrs, sges); err != nil {
				panic(err)
			}
		})
		if allocs != 0 {
			t.Errorf("SRQ PostRecv allocates %v per call", allocs)
		}
	})
}

func TestCompChannel(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{channel: true})
		ch := a.ch

		// Nothing pending: the deadline ends the wait.
		if err := a.cq.Arm(false); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := ch.Wait(ctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait with nothing pending: %v, want DeadlineExceeded", err)
		}
		// Cancellation ends the wait.
		ctx, cancel = context.WithCancel(context.Background())
		time.AfterFunc(50*time.Millisecond, cancel)
		_, err = ch.Wait(ctx)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait cancelled: %v, want Canceled", err)
		}
		// An already-cancelled context returns at once.
		if _, err := ch.Wait(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait(cancelled ctx): %v", err)
		}

		// A completion wakes a waiter blocked in Wait.
		type res struct {
			cq  prov.CQ
			err error
		}
		done := make(chan res, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			cq, err := ch.Wait(ctx)
			done <- res{cq, err}
		}()
		time.Sleep(50 * time.Millisecond)
		postSend(t, a.qp, []prov.SendWR{{WRID: 5, Opcode: prov.WRWrite, Flags: prov.SendSignaled,
			RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), NumSGE: 1}}, []prov.SGE{a.sge(0, 8)})
		r := <-done
		if r.err != nil || r.cq != a.cq {
			t.Fatalf("Wait = %v, %v; want the CQ", r.cq, r.err)
		}
		wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, 5)

		// Many waits in a row, each re-arming (the usual event loop).
		for i := 0; i < 20; i++ {
			if err := a.cq.Arm(false); err != nil {
				t.Fatal(err)
			}
			postSend(t, a.qp, []prov.SendWR{{WRID: uint64(100 + i), Opcode: prov.WRWrite, Flags: prov.SendSignaled,
				RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), NumSGE: 1}}, []prov.SGE{a.sge(0, 8)})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			cq, err := ch.Wait(ctx)
			cancel()
			if err != nil || cq != a.cq {
				t.Fatalf("wait %d: %v %v", i, cq, err)
			}
			wantOK(t, pollN(t, a.cq, 1)[0], prov.WCWrite, uint64(100+i))
		}

		// Closing the channel with a CQ attached fails; a waiter is woken by Close.
		if err := ch.Close(); !errors.Is(err, syscall.EBUSY) {
			t.Errorf("Close with CQ attached: %v, want EBUSY", err)
		}
	})
}

func TestCompChannelClose(t *testing.T) {
	n0, _ := testDevices(t)
	c := openCtx(t, n0, modes[0])
	ch, err := c.CreateCompChannel()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ch.Wait(context.Background())
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	if err := ch.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, prov.ErrClosed) {
			t.Errorf("Wait after Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake the waiter")
	}
	if err := ch.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestAsyncEvent checks the delivery of an asynchronous event that rxe
// really raises: SRQ_LIMIT_REACHED, when its responder takes a receive from
// an SRQ whose armed limit is then above the receives left. AsyncEvent must
// return it with the SRQ as its element; with nothing pending it must wait
// until its context ends. The deadline of the wait for the event is a hang
// guard only: no event fails the test.
func TestAsyncEvent(t *testing.T) {
	a, b := rcPair(t, modes[0], sideOpts{srq: true})
	srq := b.qp.(*queuePair).init.SRQ

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	ev, err := b.ctx.AsyncEvent(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("AsyncEvent with nothing pending: %+v, %v; want DeadlineExceeded", ev, err)
	}

	const posted, limit, sends = 4, 3, 2 // 4 - 2 = 2 receives left < 3
	wrs := make([]prov.RecvWR, posted)
	sges := make([]prov.SGE, posted)
	for i := range wrs {
		wrs[i] = prov.RecvWR{WRID: uint64(i), SGEIndex: uint32(i), NumSGE: 1}
		sges[i] = b.sge(i*64, 64)
	}
	if n, err := srq.PostRecv(wrs, sges); err != nil || n != posted {
		t.Fatalf("SRQ PostRecv: %d, %v", n, err)
	}
	if err := srq.Modify(prov.SRQAttr{SRQLimit: limit}, true); err != nil {
		t.Fatalf("arm SRQ limit: %v", err)
	}
	for i := range sends {
		postSend(t, a.qp, []prov.SendWR{{WRID: uint64(10 + i), Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1}},
			[]prov.SGE{a.sge(0, 8)})
	}
	for i, c := range pollN(t, a.cq, sends) {
		wantOK(t, c, prov.WCSend, uint64(10+i))
	}
	pollN(t, b.cq, sends)

	ctx, cancel = context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		ev, err := b.ctx.AsyncEvent(ctx)
		if err != nil {
			t.Fatalf("no SRQ_LIMIT_REACHED after %d of %d receives were taken with the limit at %d: %v", sends, posted, limit, err)
		}
		t.Logf("async event %+v", ev)
		if ev.Type != 15 { // IBV_EVENT_SRQ_LIMIT_REACHED
			continue
		}
		if ev.Element != srq {
			t.Errorf("SRQ_LIMIT_REACHED for element %v, want the SRQ %v", ev.Element, srq)
		}
		break
	}
	// The limit is disarmed once reached.
	if attr, err := srq.Query(); err != nil || attr.SRQLimit != 0 {
		t.Errorf("SRQ after its limit event: %+v, %v; want limit 0", attr, err)
	}
}

// TestZeroAlloc checks that the data path (PostSend, PostRecv, Poll) does
// not allocate.
func TestZeroAlloc(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{})
		wrs := []prov.SendWR{
			{WRID: 1, Opcode: prov.WRWrite, RemoteAddr: b.mr.Addr(), RKey: b.mr.RKey(), NumSGE: 1},
			{WRID: 2, Opcode: prov.WRWrite, Flags: prov.SendSignaled, RemoteAddr: b.mr.Addr() + 64, RKey: b.mr.RKey(), SGEIndex: 1, NumSGE: 1},
		}
		sges := []prov.SGE{a.sge(0, 64), a.sge(64, 64)}
		comps := make([]prov.Completion, 8)
		var bad atomic.Value
		full := 0
		// testing.AllocsPerRun counts the process' allocations: other
		// goroutines (the runtime's, earlier tests' leftovers) may
		// allocate during a run (a CI rehearsal saw 1 per batch once). An allocation of the data path shows in
		// every run; the best of three is the data path's.
		allocs := 1.0
		for try := 0; try < 3 && allocs != 0; try++ {
			allocs = min(allocs, testing.AllocsPerRun(200, func() {
				// rxe may publish a send completion before it retires the
				// WQE from the send queue: a post right after it can find
				// the queue full (seen in the VM tier with 64 slots, 90
				// times in 201 batches once). Poll and post again; the
				// error allocates nothing (TestQueueFull).
				for k := 0; ; {
					n, err := a.qp.PostSend(wrs[k:], sges)
					if k += n; err == nil {
						break
					}
					if !errors.Is(err, prov.ErrQueueFull) || full >= 1000 {
						bad.Store(err)
						return
					}
					full++
					if _, err := a.cq.Poll(comps); err != nil {
						bad.Store(err)
						return
					}
				}
				for got := 0; got < 1; {
					n, err := a.cq.Poll(comps)
					if err != nil {
						bad.Store(err)
						return
					}
					got += n
				}
			}))
		}
		if err := bad.Load(); err != nil {
			t.Fatal(err)
		}
		if full > 0 {
			t.Logf("the send queue was full %d times", full)
		}
		if allocs != 0 {
			t.Errorf("PostSend+Poll allocates %v per batch", allocs)
		}
		rwrs := []prov.RecvWR{{WRID: 1, NumSGE: 1}}
		rsges := []prov.SGE{b.sge(0, 64)}
		allocs = testing.AllocsPerRun(30, func() {
			if _, err := b.qp.PostRecv(rwrs, rsges); err != nil {
				bad.Store(err)
			}
		})
		if err := bad.Load(); err != nil {
			t.Fatal(err)
		}
		if allocs != 0 {
			t.Errorf("PostRecv allocates %v per call", allocs)
		}
		// Empty poll.
		allocs = testing.AllocsPerRun(100, func() { a.cq.Poll(comps) })
		if allocs != 0 {
			t.Errorf("empty Poll allocates %v per call", allocs)
		}
	})
}

// BenchmarkWrite measures one signaled 64-byte RDMA write per iteration
// (post + poll until done), reporting allocations.
func BenchmarkWrite(b *testing.B) {
	for _, m := range modes {
		b.Run(m.name, func(bb *testing.B) {
			x, y := rcPair(bb, m, sideOpts{})
			wrs := []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, Flags: prov.SendSignaled, RemoteAddr: y.mr.Addr(), RKey: y.mr.RKey(), NumSGE: 1}}
			sges := []prov.SGE{x.sge(0, 64)}
			comps := make([]prov.Completion, 4)
			bb.ReportAllocs()
			bb.SetBytes(64)
			for bb.Loop() {
				if _, err := x.qp.PostSend(wrs, sges); err != nil {
					bb.Fatal(err)
				}
				for got := 0; got < 1; {
					n, _ := x.cq.Poll(comps)
					got += n
				}
			}
		})
	}
}

// PollBusy returns 0 after its spins on an empty CQ, returns completions
// as soon as they are there (never more than dst holds), in both data
// paths, and does not allocate.
func TestPollBusy(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		a, b := rcPair(t, m, sideOpts{})
		comps := make([]prov.Completion, 4)
		for _, spins := range []int{-1, 0, 1, 1000} {
			if n, err := a.cq.PollBusy(comps, spins); n != 0 || err != nil {
				t.Errorf("PollBusy(empty, spins %d) = %d, %v; want 0, nil", spins, n, err)
			}
		}
		if n, err := a.cq.PollBusy(nil, 10); n != 0 || err != nil {
			t.Errorf("PollBusy(nil) = %d, %v", n, err)
		}
		var wrs []prov.SendWR
		var sges []prov.SGE
		for i := range 3 {
			wrs = append(wrs, prov.SendWR{WRID: uint64(30 + i), Opcode: prov.WRWrite, Flags: prov.SendSignaled,
				RemoteAddr: b.mr.Addr() + uint64(i*64), RKey: b.mr.RKey(), SGEIndex: uint32(i), NumSGE: 1})
			sges = append(sges, a.sge(i*64, 64))
		}
		postSend(t, a.qp, wrs, sges)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var got []prov.Completion
		for len(got) < 3 {
			n, err := a.cq.PollBusy(comps[:2], 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			if n > 2 {
				t.Fatalf("PollBusy into 2 slots returned %d", n)
			}
			got = append(got, comps[:n]...)
			if ctx.Err() != nil {
				t.Fatalf("%d of 3 completions", len(got))
			}
		}
		for i, c := range got {
			wantOK(t, c, prov.WCWrite, uint64(30+i))
		}
		allocs := testing.AllocsPerRun(50, func() { a.cq.PollBusy(comps, 100) })
		if allocs != 0 {
			t.Errorf("empty PollBusy allocates %v per call", allocs)
		}
	})
}
