package soft

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
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
	cn := qpConn(t, a.qp)
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
			r := cn.callMap(tc.rkey, handshakeTimeout)
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

func init() { childModes["mapper"] = mapperChild }

// TestShmMapNeedsQPInPDChild is TestShmMapNeedsQPInPD with the peer in a
// process of its own (shared memory between two processes): the child's
// QP is connected to this process' QP of PD A. Its large read of an A
// region and its large write into another are direct copies and move the
// bytes; its MAP of A's rkey is answered, its MAP of the rkey of a
// remote-readable region of PD B is not shared; its large read of B's
// region fails REM_ACCESS_ERR and leaves no mapping.
func TestShmMapNeedsQPInPDChild(t *testing.T) {
	forceTransport(t, "shm")
	e := newEnv(t)
	q := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	pdB := must(e.ctx.AllocPD())
	t.Cleanup(func() {
		if err := pdB.Close(); err != nil {
			t.Errorf("close pd B: %v", err)
		}
	})
	(&env{t: t, ctx: e.ctx, pd: pdB}).newQP(prov.QPTypeRC, defaultCaps(), nil) // not connected
	const size = 1 << 20
	readA := e.alloc(size, prov.AccessLocalWrite|prov.AccessRemoteRead)
	writeA := e.alloc(size, allAccess)
	inB := allocIn(t, pdB, size, prov.AccessLocalWrite|prov.AccessRemoteRead)
	for i := range readA.b {
		readA.b[i] = byte(i * 5)
		inB.b[i] = byte(i*11 + 1)
	}

	p := testproc.Start(t, envTestChild+"=mapper", envTransport+"=shm")
	f := p.Line(t, "addr")
	addr := must(hex.DecodeString(f[0]))
	qpn := must(strconv.Atoi(f[1]))
	if err := connectTo(q.qp, addr, uint32(qpn), 18, 7); err != nil {
		t.Fatal(err)
	}
	p.Send(t, "connect %s %d %d %d %d %d %d %d", hex.EncodeToString(q.qp.Address()), q.qp.QPN(),
		readA.mr.RKey(), readA.addr(0), writeA.mr.RKey(), writeA.addr(0), inB.mr.RKey(), inB.addr(0))
	r := p.Line(t, "result")
	p.Send(t, "exit")
	p.Stop(t)
	want := []string{
		fmt.Sprint(prov.StatusSuccess), "true", // read of A: status, bytes
		fmt.Sprint(prov.StatusSuccess), // write into A
		"true",                         // A's region mapped
		fmt.Sprint(mapOK), fmt.Sprint(mapNotShare),
		fmt.Sprint(prov.StatusRemAccessErr), "false", // read of B: status, mapped
	}
	if strings.Join(r, " ") != strings.Join(want, " ") {
		t.Fatalf("child: %q, want %q (read A status, bytes; write A status; A mapped; MAP A, MAP B; read B status, B mapped)", r, want)
	}
	for i := range writeA.b {
		if writeA.b[i] != byte(i*7+3) {
			t.Fatalf("write into A's region: byte %d is %#x", i, writeA.b[i])
		}
	}
}

// mapperChild (TestShmMapNeedsQPInPDChild) opens a RC QP and prints
// "addr HEX QPN"; told "connect HEX QPN rkeyA addrA rkeyW addrW rkeyB
// addrB", it connects its QP there, reads region A, writes region W, asks
// MAP of A and of B, reads region B, prints "result ..." and waits for
// "exit".
func mapperChild(in *bufio.Scanner, out io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, err := New().Open(DeviceName)
	if err != nil {
		return fail(err)
	}
	defer ctx.Close()
	pd, err := ctx.AllocPD()
	if err != nil {
		return fail(err)
	}
	defer pd.Close()
	cq, err := ctx.CreateCQ(16, nil, 0)
	if err != nil {
		return fail(err)
	}
	defer cq.Close()
	q, err := pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()})
	if err != nil {
		return fail(err)
	}
	defer q.Close()
	const size = 1 << 20
	r, err := mem.Alloc(size, "test", false)
	if err != nil {
		return fail(err)
	}
	defer r.Free()
	m, err := pd.RegMR(prov.Mem{Ptr: r.Ptr(), Len: size, FD: r.FD()}, allAccess)
	if err != nil {
		return fail(err)
	}
	defer m.Close()
	b := r.Bytes()[:size]
	fmt.Fprintf(out, "addr %s %d\n", hex.EncodeToString(q.Address()), q.QPN())
	if !in.Scan() {
		return fail(errors.New("no connect line"))
	}
	var (
		hexAddr             string
		qpn, rkA, rkW, rkB  uint32
		addrA, addrW, addrB uint64
	)
	if _, err := fmt.Sscanf(in.Text(), "connect %s %d %d %d %d %d %d %d", &hexAddr, &qpn, &rkA, &addrA, &rkW, &addrW, &rkB, &addrB); err != nil {
		return fail(err)
	}
	addr, err := hex.DecodeString(hexAddr)
	if err != nil {
		return fail(err)
	}
	if err := connectTo(q, addr, qpn, 18, 7); err != nil {
		return fail(err)
	}
	op := func(code prov.WROpcode, raddr uint64, rkey uint32) (prov.Status, error) {
		wr := []prov.SendWR{{Opcode: code, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: raddr, RKey: rkey}}
		if _, err := q.PostSend(wr, []prov.SGE{{Addr: m.Addr(), Length: size, LKey: m.LKey()}}); err != nil {
			return 0, err
		}
		var c [1]prov.Completion
		deadline := time.Now().Add(hangGuard)
		for {
			n, err := cq.Poll(c[:])
			if err != nil {
				return 0, err
			}
			if n == 1 {
				return c[0].Status, nil
			}
			if time.Now().After(deadline) {
				return 0, errors.New("no completion")
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	readSt, err := op(prov.WRRead, addrA, rkA)
	if err != nil {
		return fail(err)
	}
	bytesOK := true
	for i := range b {
		if b[i] != byte(i*5) {
			bytesOK = false
		}
		b[i] = byte(i*7 + 3)
	}
	writeSt, err := op(prov.WRWrite, addrW, rkW)
	if err != nil {
		return fail(err)
	}
	cn := q.(*qp).route.(*peer).current()
	if cn == nil {
		return fail(errors.New("no connection"))
	}
	mapped := func(rkey uint32) bool {
		cn.impMu.RLock()
		defer cn.impMu.RUnlock()
		imp := cn.imports[rkey]
		return imp != nil && imp.mem != nil
	}
	mappedA := mapped(rkA)
	var st [2]uint8
	for i, rk := range []uint32{rkA, rkB} {
		rep := cn.callMap(rk, handshakeTimeout)
		if rep.fd >= 0 {
			unix.Close(rep.fd)
		}
		if rep.err != nil {
			return fail(rep.err)
		}
		st[i] = rep.ack.status
	}
	readBSt, err := op(prov.WRRead, addrB, rkB)
	if err != nil {
		return fail(err)
	}
	fmt.Fprintln(out, "result", readSt, bytesOK, writeSt, mappedA, st[0], st[1], readBSt, mapped(rkB))
	for in.Scan() {
		if strings.TrimSpace(in.Text()) == "exit" {
			break
		}
	}
	return 0
}
