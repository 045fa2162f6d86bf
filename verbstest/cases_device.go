package verbstest

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs"
)

// testDeviceQuery checks the device, port and GID table of each device.
func testDeviceQuery(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	devs, err := verbs.Devices()
	if err != nil {
		t.Logf("Devices: %v", err)
	}
	for _, n := range []*Node{a, b} {
		name := n.Ctx.Name()
		t.Run("Device"+n.Name, func(t *testing.T) {
			want := c.cfg.DeviceA
			if n == b {
				want = c.cfg.DeviceB
			}
			if name != want {
				t.Errorf("context name %q, want %q", name, want)
			}
			found := false
			for _, d := range devs {
				if d.Name == name {
					found = true
					if d.Provider != n.Ctx.Provider() || d.Transport == "" {
						t.Errorf("Devices lists %+v; want provider %q and a transport", d, n.Ctx.Provider())
					}
				}
			}
			if !found {
				t.Errorf("Devices() = %v does not list %s", devs, name)
			}
			checkDevice(t, c, n.Ctx)
		})
	}
}

func checkDevice(t *testing.T, c *tcase, ctx *verbs.Context) {
	da, err := ctx.QueryDevice()
	must(t, "query device", err)
	for _, f := range []struct {
		name string
		v    int
	}{
		{"MaxQP", da.MaxQP}, {"MaxQPWR", da.MaxQPWR}, {"MaxSGE", da.MaxSGE}, {"MaxCQ", da.MaxCQ},
		{"MaxCQE", da.MaxCQE}, {"MaxMR", da.MaxMR}, {"MaxPD", da.MaxPD}, {"MaxSRQ", da.MaxSRQ},
		{"MaxSRQWR", da.MaxSRQWR}, {"MaxAH", da.MaxAH},
	} {
		if f.v <= 0 {
			t.Errorf("device attribute %s = %d, want > 0", f.name, f.v)
		}
	}
	if da.MaxMRSize < 1<<20 {
		t.Errorf("device MaxMRSize %d, want at least 1 MiB", da.MaxMRSize)
	}
	if da.PhysPortCnt < int(c.cfg.Port) {
		t.Fatalf("device has %d ports; the suite uses port %d", da.PhysPortCnt, c.cfg.Port)
	}

	pa, err := ctx.QueryPort(c.cfg.Port)
	must(t, "query port", err)
	if pa.State != verbs.PortActive {
		t.Errorf("port %d state %s, want PORT_ACTIVE", c.cfg.Port, pa.State)
	}
	if pa.ActiveMTU.Bytes() == 0 || pa.MaxMTU.Bytes() == 0 || pa.ActiveMTU > pa.MaxMTU {
		t.Errorf("port MTUs: active %v, max %v; want valid MTUs with active <= max", pa.ActiveMTU, pa.MaxMTU)
	}
	if pa.MaxMsgSize < 1<<20 {
		t.Errorf("port max message size %d; the suite sends 1 MiB messages", pa.MaxMsgSize)
	}
	if pa.LinkLayer != verbs.LinkLayerEthernet && pa.LinkLayer != verbs.LinkLayerInfiniBand {
		t.Errorf("port link layer %v, want Ethernet or InfiniBand", pa.LinkLayer)
	}
	if pa.LinkLayer == verbs.LinkLayerInfiniBand && pa.LID == 0 {
		t.Errorf("InfiniBand port has LID 0")
	}
	if pa.GIDTableLen <= 0 {
		t.Errorf("port GID table length %d", pa.GIDTableLen)
	}

	gids, err := ctx.GIDTable(c.cfg.Port)
	must(t, "query GID table", err)
	if len(gids) == 0 {
		t.Fatalf("GID table of port %d has no valid entry", c.cfg.Port)
	}
	seen := map[int]bool{}
	v2 := false
	for _, g := range gids {
		if g.Port != c.cfg.Port {
			t.Errorf("GID entry %+v: port %d, want %d", g, g.Port, c.cfg.Port)
		}
		if g.Index < 0 || g.Index >= pa.GIDTableLen || seen[g.Index] {
			t.Errorf("GID entry %+v: index out of range [0, %d) or repeated", g, pa.GIDTableLen)
		}
		seen[g.Index] = true
		if g.GID.IsZero() {
			t.Errorf("GID entry %d is all zeros", g.Index)
		}
		switch pa.LinkLayer {
		case verbs.LinkLayerEthernet:
			if g.Type != verbs.GIDTypeRoCEv1 && g.Type != verbs.GIDTypeRoCEv2 {
				t.Errorf("GID entry %d on Ethernet has type %v, want RoCE v1 or v2", g.Index, g.Type)
			}
			v2 = v2 || g.Type == verbs.GIDTypeRoCEv2
		case verbs.LinkLayerInfiniBand:
			if g.Type != verbs.GIDTypeIB {
				t.Errorf("GID entry %d on InfiniBand has type %v, want IB", g.Index, g.Type)
			}
		}
	}
	if pa.LinkLayer == verbs.LinkLayerEthernet && !v2 {
		t.Errorf("Ethernet port has no RoCE v2 GID: %+v", gids)
	}
	if c.cfg.FixedGID && !seen[c.cfg.GIDIndex] {
		t.Errorf("Config.GIDIndex %d is not a valid GID entry of port %d", c.cfg.GIDIndex, c.cfg.Port)
	}

	if _, err := ctx.QueryPort(0); err == nil {
		t.Errorf("QueryPort(0) succeeded; ports count from 1")
	}
	if _, err := ctx.QueryPort(uint8(da.PhysPortCnt + 1)); err == nil {
		t.Errorf("QueryPort(%d) succeeded on a device with %d port(s)", da.PhysPortCnt+1, da.PhysPortCnt)
	}
}

// testMRRegistration checks MR properties and the access rules of
// ibv_reg_mr(3).
func testMRRegistration(t *testing.T, c *tcase) {
	a, _ := NewNodes(t, c.cfg)
	const n = 10000
	mr := a.Alloc(t, n, accessAll)
	if mr.Len() != n || len(mr.Bytes()) != n {
		t.Errorf("Alloc(%d): Len %d, len(Bytes) %d", n, mr.Len(), len(mr.Bytes()))
	}
	if !bytes.Equal(mr.Bytes(), make([]byte, n)) {
		t.Errorf("Alloc(%d): memory is not zeroed", n)
	}
	if p := uintptr(unsafe.Pointer(unsafe.SliceData(mr.Bytes()))); p%uintptr(os.Getpagesize()) != 0 {
		t.Errorf("Alloc(%d): memory at %#x is not page-aligned", n, p)
	}
	if r := mr.Remote(); r.Addr != mr.Addr() || r.Len != n || r.RKey != mr.RKey() {
		t.Errorf("Remote() = %+v, want addr %#x, len %d, rkey %#x", r, mr.Addr(), n, mr.RKey())
	}
	if s := SGE(t, mr, 10, 20); s.Addr != mr.Addr()+10 || s.Length != 20 || s.LKey != mr.LKey() {
		t.Errorf("SGE(10, 20) = %+v", s)
	}
	if mr.Access() != accessAll || mr.PD() != a.PD {
		t.Errorf("Access() %v, PD() %p; want %v, %p", mr.Access(), mr.PD(), accessAll, a.PD)
	}
	mr2 := a.Alloc(t, 100, accessAll)
	buf := make([]byte, 100)
	mr3 := a.Register(t, buf, accessAll)
	if mr3.Len() != len(buf) || &mr3.Bytes()[0] != &buf[0] {
		t.Errorf("Register: Len %d, Bytes not the registered buffer", mr3.Len())
	}
	// Keys identify MRs: no two of them share an lkey or an rkey.
	lkeys, rkeys := map[uint32]int{}, map[uint32]int{}
	for i, m := range []*verbs.MemoryRegion{mr, mr2, mr3} {
		if j, dup := lkeys[m.LKey()]; dup {
			t.Errorf("MRs %d and %d share lkey %#x", j, i, m.LKey())
		}
		if j, dup := rkeys[m.RKey()]; dup {
			t.Errorf("MRs %d and %d share rkey %#x", j, i, m.RKey())
		}
		lkeys[m.LKey()], rkeys[m.RKey()] = i, i
	}

	for _, access := range []verbs.Access{verbs.AccessRemoteWrite, verbs.AccessRemoteAtomic, verbs.AccessRemoteWrite | verbs.AccessRemoteRead} {
		m, err := a.PD.Alloc(64, access)
		if err == nil {
			m.Close()
			t.Errorf("Alloc with access %v (remote write or atomic without LocalWrite) succeeded", access)
		} else if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("Alloc with access %v: %v, want EINVAL", access, err)
		}
	}
	if m, err := a.PD.Alloc(0, accessLocal); err == nil {
		m.Close()
		t.Errorf("Alloc(0) succeeded")
	}
	if m, err := a.PD.Register(buf[:0], accessLocal); err == nil {
		m.Close()
		t.Errorf("Register of an empty buffer succeeded")
	}
}

// expectNames checks that err is a Close error that names every name.
func expectNames(t testing.TB, what string, err error, names ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want an error naming %s", what, strings.Join(names, ", "))
		return
	}
	for _, n := range names {
		if !strings.Contains(err.Error(), n) {
			t.Errorf("%s: %q does not name %q", what, err, n)
		}
	}
}

// expectClosed checks that err matches verbs.ErrClosed.
func expectClosed(t testing.TB, what string, err error) {
	t.Helper()
	if !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("%s: %v, want an error matching verbs.ErrClosed", what, err)
	}
}

// testCloseOrdering checks that closing a parent with live children fails
// naming them, that Close is idempotent, and that closed objects refuse use.
func testCloseOrdering(t *testing.T, c *tcase) {
	ctx, err := verbs.Open(c.cfg.DeviceA)
	must(t, "open", err)
	pd, err := ctx.AllocPD()
	if err != nil {
		ctx.Close()
		t.Fatalf("alloc pd: %v", err)
	}
	// Whatever happens below, close everything in the end (Close is
	// idempotent, so objects closed by the test are skipped).
	tr := newTracker(t)
	tr.add(levelContext, "context", ctx)
	tr.add(levelPD, "pd", pd)
	mr, err := pd.Alloc(4096, accessAll)
	must(t, "alloc mr", err)
	tr.add(levelMR, "mr", mr)
	cq, err := ctx.NewCompletionQueue(verbs.CQSpec{})
	must(t, "create cq", err)
	tr.add(levelCQ, "cq", cq)
	ch, err := ctx.NewCompletionChannel()
	must(t, "create channel", err)
	tr.add(levelChannel, "channel", ch)
	cq2, err := ctx.NewCompletionQueue(verbs.CQSpec{Channel: ch})
	must(t, "create cq on channel", err)
	tr.add(levelCQ, "cq2", cq2)
	qp, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq, Port: c.cfg.Port, FixedGID: c.cfg.FixedGID, GIDIndex: c.cfg.GIDIndex})
	must(t, "create qp", err)
	tr.add(levelQP, "qp", qp)
	qpn := fmt.Sprintf("qpn %d", qp.QPN())

	expectNames(t, "close context with live objects", ctx.Close(), "protection domain", "completion queue", "completion channel")
	expectNames(t, "close pd with an MR and a QP", pd.Close(), "memory region", "RC queue pair", qpn)
	expectNames(t, "close cq used by a QP", cq.Close(), "RC queue pair", qpn)
	expectNames(t, "close channel used by a CQ", ch.Close(), "completion queue")
	// The refused closes changed nothing.
	must(t, "query qp after refused closes", func() error { _, err := qp.Query(); return err }())
	must(t, "poll cq after refused closes", func() error { _, err := cq.Poll(make([]verbs.Completion, 1)); return err }())

	for i := range 2 {
		must(t, fmt.Sprintf("close qp (%d)", i+1), qp.Close())
	}
	expectClosed(t, "post send on a closed qp", qp.PostSend(1, verbs.Signaled, SGE(t, mr, 0, 8)))
	expectClosed(t, "post recv on a closed qp", qp.PostRecv(1, SGE(t, mr, 0, 8)))
	_, err = qp.Query()
	expectClosed(t, "query a closed qp", err)
	expectClosed(t, "modify a closed qp", qp.Modify(verbs.QPAttr{State: verbs.StateError}, verbs.AttrState))
	_, err = qp.Endpoint()
	expectClosed(t, "endpoint of a closed qp", err)
	bt := qp.NewBatch(1)
	bt.Send(1, SGE(t, mr, 0, 8))
	expectClosed(t, "submit a batch to a closed qp", bt.Submit())

	for i := range 2 {
		must(t, fmt.Sprintf("close cq (%d)", i+1), cq.Close())
	}
	_, err = cq.Poll(make([]verbs.Completion, 1))
	expectClosed(t, "poll a closed cq", err)
	expectClosed(t, "wait on a closed cq", cq.Wait(context.Background()))
	expectClosed(t, "arm a closed cq", cq.RequestNotify(false))
	_, err = pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	expectClosed(t, "create a qp on a closed cq", err)

	for i := range 2 {
		must(t, fmt.Sprintf("close mr (%d)", i+1), mr.Close())
		must(t, fmt.Sprintf("close pd (%d)", i+1), pd.Close())
	}
	_, err = pd.Alloc(64, accessLocal)
	expectClosed(t, "alloc in a closed pd", err)
	_, err = pd.NewSharedReceiveQueue(verbs.SRQSpec{})
	expectClosed(t, "create an srq in a closed pd", err)

	must(t, "close cq2", cq2.Close())
	must(t, "close channel", ch.Close())
	_, err = ch.Wait(context.Background())
	expectClosed(t, "wait on a closed channel", err)
	for i := range 2 {
		must(t, fmt.Sprintf("close context (%d)", i+1), ctx.Close())
	}
	_, err = ctx.AllocPD()
	expectClosed(t, "alloc pd on a closed context", err)
	_, err = ctx.QueryDevice()
	expectClosed(t, "query a closed context", err)
	_, err = ctx.NewCompletionQueue(verbs.CQSpec{})
	expectClosed(t, "create a cq on a closed context", err)
}

// normEndpoint makes an empty Addr nil, so that encodings compare equal.
func normEndpoint(e verbs.Endpoint) verbs.Endpoint {
	if len(e.Addr) == 0 {
		e.Addr = nil
	}
	return e
}

// testEndpointEncoding checks a real endpoint: its fields, binary and JSON
// round trips, rejection of malformed encodings, and that decoded
// endpoints connect.
func testEndpointEncoding(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
	ea, eb := Endpoint(t, qa), Endpoint(t, qb)
	pa, err := a.Ctx.QueryPort(c.cfg.Port)
	must(t, "query port", err)
	if ea.Version != verbs.EndpointVersion || ea.Transport != verbs.TransportRC || ea.QPN != qa.QPN() ||
		ea.Port != c.cfg.Port || ea.MTU.Bytes() == 0 || ea.MTU > pa.ActiveMTU || ea.PSN > 0xFFFFFF || ea.LinkLayer != pa.LinkLayer {
		t.Errorf("endpoint %+v: want version %d, RC, qpn %d, port %d, a valid MTU up to %v, a 24-bit PSN, link layer %v",
			ea, verbs.EndpointVersion, qa.QPN(), c.cfg.Port, pa.ActiveMTU, pa.LinkLayer)
	}
	if c.cfg.FixedGID && int(ea.GIDIndex) != c.cfg.GIDIndex {
		t.Errorf("endpoint GID index %d, want the configured %d", ea.GIDIndex, c.cfg.GIDIndex)
	}
	if pa.LinkLayer == verbs.LinkLayerEthernet && ea.GID.IsZero() {
		t.Errorf("endpoint on Ethernet has no GID")
	}
	if err := ea.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}

	bin, err := eb.MarshalBinary()
	must(t, "marshal binary", err)
	var fromBin verbs.Endpoint
	must(t, "unmarshal binary", fromBin.UnmarshalBinary(bin))
	if !reflect.DeepEqual(normEndpoint(fromBin), normEndpoint(eb)) {
		t.Errorf("binary round trip: %+v, want %+v", fromBin, eb)
	}
	js, err := json.Marshal(ea)
	must(t, "marshal json", err)
	var fromJSON verbs.Endpoint
	must(t, "unmarshal json", json.Unmarshal(js, &fromJSON))
	if !reflect.DeepEqual(normEndpoint(fromJSON), normEndpoint(ea)) {
		t.Errorf("JSON round trip of %s: %+v, want %+v", js, fromJSON, ea)
	}

	mutate := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(bin)) }
	for _, bad := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"truncated", bin[:len(bin)-1]},
		{"fixed part only half", bin[:len(bin)/2]},
		{"trailing byte", append(bytes.Clone(bin), 0)},
		{"bad magic", mutate(func(b []byte) []byte { b[0] ^= 0xFF; return b })},
		{"version 2", mutate(func(b []byte) []byte { b[4] = 2; return b })},
		{"unknown transport", mutate(func(b []byte) []byte { b[5] = 9; return b })},
		{"qpn 0", mutate(func(b []byte) []byte { binary.BigEndian.PutUint32(b[27:], 0); return b })},
		{"invalid mtu", mutate(func(b []byte) []byte { b[35] = 0; return b })},
	} {
		var e verbs.Endpoint
		if err := e.UnmarshalBinary(bad.b); err == nil {
			t.Errorf("UnmarshalBinary accepted a malformed endpoint (%s): %+v", bad.name, e)
		}
	}
	zeroQPN := ea
	zeroQPN.QPN = 0
	zjs, err := json.Marshal(zeroQPN)
	must(t, "marshal json", err)
	for _, bad := range []string{`{`, `{}`, string(zjs), strings.Replace(string(js), `"RC"`, `"XX"`, 1), `[1,2]`} {
		var e verbs.Endpoint
		if err := json.Unmarshal([]byte(bad), &e); err == nil {
			t.Errorf("json.Unmarshal accepted a malformed endpoint %s: %+v", bad, e)
		}
	}

	// An endpoint of another transport is refused, and changes nothing.
	ud := b.NewUD(t, verbs.QPSpec{})
	expectEINVAL(t, "connect an RC QP to a UD endpoint", qa.Connect(Endpoint(t, ud)))
	expectState(t, "after a refused connect", qa, verbs.StateInit)

	// The decoded endpoints connect.
	must(t, "connect A to the decoded endpoint of B", qa.Connect(fromBin))
	must(t, "connect B to the decoded endpoint of A", qb.Connect(fromJSON))
	c.pingPong(t, a, b, qa, qb, 0x40)
}
