package soft

import (
	"context"
	"os"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(envTestChild); mode != "" {
		// The test binary re-executed as a child process of a test
		// (child_test.go).
		os.Exit(runChild(mode))
	}
	goleak.VerifyTestMain(m)
}

// hangGuard bounds waits in tests; it is not a performance assertion.
const hangGuard = 20 * time.Second

type env struct {
	t   testing.TB
	ctx prov.Context
	pd  prov.PD
}

// must returns v or panics with err (tests only).
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func newEnv(t testing.TB) *env {
	t.Helper()
	ctx := must(New().Open(DeviceName))
	t.Cleanup(func() {
		if err := ctx.Close(); err != nil {
			t.Errorf("close context: %v", err)
		}
	})
	pd := must(ctx.AllocPD())
	t.Cleanup(func() {
		if err := pd.Close(); err != nil {
			t.Errorf("close pd: %v", err)
		}
	})
	return &env{t: t, ctx: ctx, pd: pd}
}

// buf is registered memory outside the Go heap.
type buf struct {
	b  []byte
	mr prov.MR
}

func (b *buf) sge(off, n int) prov.SGE {
	return prov.SGE{Addr: b.mr.Addr() + uint64(off), Length: uint32(n), LKey: b.mr.LKey()}
}

func (b *buf) addr(off int) uint64 { return b.mr.Addr() + uint64(off) }

func (e *env) alloc(n int, access prov.Access) *buf {
	return allocIn(e.t, e.pd, n, access)
}

func allocIn(t testing.TB, pd prov.PD, n int, access prov.Access) *buf {
	t.Helper()
	// Whole pages: mem.Region.Free mis-sizes the unmap of a partial page
	// (cap(b) is n, not the mapping size).
	r := must(mem.Alloc(mem.RoundUp(n), "test", false))
	m := must(pd.RegMR(prov.Mem{Ptr: r.Ptr(), Len: n, FD: r.FD()}, access))
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("close mr: %v", err)
		}
		r.Free()
	})
	return &buf{b: r.Bytes()[:n:n], mr: m}
}

const allAccess = prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead | prov.AccessRemoteAtomic

func (e *env) cq(n int) prov.CQ {
	e.t.Helper()
	c := must(e.ctx.CreateCQ(n, nil, 0))
	e.t.Cleanup(func() {
		if err := c.Close(); err != nil {
			e.t.Errorf("close cq: %v", err)
		}
	})
	return c
}

func defaultCaps() prov.QPCap {
	return prov.QPCap{MaxSendWR: 64, MaxRecvWR: 64, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInlineData: 256}
}

// ep is a QP with its CQs.
type ep struct {
	e   *env
	qp  prov.QP
	scq prov.CQ
	rcq prov.CQ
}

func (e *env) newQP(typ prov.QPType, caps prov.QPCap, srq prov.SRQ) *ep {
	e.t.Helper()
	scq, rcq := e.cq(1024), e.cq(1024)
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: typ, SendCQ: scq, RecvCQ: rcq, SRQ: srq, Cap: caps}))
	e.t.Cleanup(func() {
		if err := q.Close(); err != nil {
			e.t.Errorf("close qp: %v", err)
		}
	})
	return &ep{e: e, qp: q, scq: scq, rcq: rcq}
}

// connOpts are the connection parameters of one side.
type connOpts struct {
	access      prov.Access
	mtu         prov.MTU
	minRNR      uint8
	rnrRetry    uint8
	retryCnt    uint8
	timeout     uint8
	rdAtomic    uint8
	destRDAtom  uint8
	sqPSN       uint32
	rqPSN       uint32
	noProvAddr  bool
	skipRTS     bool
	qkey        uint32
	overrideDst *uint32
}

func defaultConn() connOpts {
	return connOpts{access: allAccess, mtu: prov.MTU4096, minRNR: 1, rnrRetry: 7, retryCnt: 7, timeout: 14,
		rdAtomic: 16, destRDAtom: 16}
}

func toInit(t testing.TB, q prov.QP, typ prov.QPType, o connOpts) {
	t.Helper()
	a := prov.QPAttr{State: prov.QPStateInit, PKeyIndex: 0, Port: 1, Access: o.access, QKey: o.qkey}
	mask := prov.AttrState | prov.AttrPKeyIndex | prov.AttrPort
	if typ == prov.QPTypeUD {
		mask |= prov.AttrQKey
	} else {
		mask |= prov.AttrAccessFlags
	}
	if err := q.Modify(&a, mask); err != nil {
		t.Fatal(err)
	}
}

func avFor(remote prov.QP, noProvAddr bool) prov.AHAttr {
	f := getFabric()
	av := prov.AHAttr{DGID: f.gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1}
	if !noProvAddr {
		av.ProviderAddr = remote.Address()
	}
	return av
}

// connect moves a (RC or UC) from RESET to RTS connected to b.
func connectOne(t testing.TB, a, b prov.QP, typ prov.QPType, o connOpts) {
	t.Helper()
	toInit(t, a, typ, o)
	dst := b.QPN()
	if o.overrideDst != nil {
		dst = *o.overrideDst
	}
	r := prov.QPAttr{State: prov.QPStateRTR, PathMTU: o.mtu, DestQPN: dst, RQPSN: o.rqPSN,
		MaxDestRDAtom: o.destRDAtom, MinRNRTimer: o.minRNR, AH: avFor(b, o.noProvAddr)}
	mask := prov.AttrState | prov.AttrAV | prov.AttrPathMTU | prov.AttrDestQPN | prov.AttrRQPSN
	if typ == prov.QPTypeRC {
		mask |= prov.AttrMaxDestRDAtom | prov.AttrMinRNRTimer
	}
	if err := a.Modify(&r, mask); err != nil {
		t.Fatal(err)
	}
	if o.skipRTS {
		return
	}
	s := prov.QPAttr{State: prov.QPStateRTS, SQPSN: o.sqPSN, Timeout: o.timeout, RetryCnt: o.retryCnt,
		RNRRetry: o.rnrRetry, MaxRDAtomic: o.rdAtomic}
	mask = prov.AttrState | prov.AttrSQPSN
	if typ == prov.QPTypeRC {
		mask |= prov.AttrTimeout | prov.AttrRetryCnt | prov.AttrRNRRetry | prov.AttrMaxQPRDAtomic
	}
	if err := a.Modify(&s, mask); err != nil {
		t.Fatal(err)
	}
}

// pair creates two connected QPs of type typ.
func pair(t testing.TB, typ prov.QPType, oa, ob connOpts) (*env, *ep, *ep) {
	t.Helper()
	e := newEnv(t)
	a := e.newQP(typ, defaultCaps(), nil)
	b := e.newQP(typ, defaultCaps(), nil)
	oa.sqPSN, ob.rqPSN = 100, 100
	ob.sqPSN, oa.rqPSN = 200, 200
	connectOne(t, a.qp, b.qp, typ, oa)
	connectOne(t, b.qp, a.qp, typ, ob)
	return e, a, b
}

func state(t testing.TB, q prov.QP) prov.QPState {
	t.Helper()
	a, _, err := q.Query()
	if err != nil {
		t.Fatal(err)
	}
	return a.State
}

// poll collects exactly n completions (hang-guarded).
func poll(t testing.TB, c prov.CQ, n int) []prov.Completion {
	t.Helper()
	return pollWithin(t, c, n, hangGuard)
}

// pollWithin collects exactly n completions within d, failing t otherwise.
func pollWithin(t testing.TB, c prov.CQ, n int, d time.Duration) []prov.Completion {
	t.Helper()
	out := make([]prov.Completion, 0, n)
	dst := make([]prov.Completion, 16)
	deadline := time.Now().Add(d)
	for len(out) < n {
		k, err := c.Poll(dst[:min(len(dst), n-len(out))])
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		out = append(out, dst[:k]...)
		if k == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("poll: got %d of %d completions in %v: %+v", len(out), n, d, out)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
	return out
}

// expectEmpty checks that c holds no completion.
func expectEmpty(t testing.TB, c prov.CQ) {
	t.Helper()
	var dst [4]prov.Completion
	n, err := c.Poll(dst[:])
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("unexpected completions: %+v", dst[:n])
	}
}

// qpConn is the connection that carries q's traffic to its peer process
// (made by q's first request), failing t if there is none.
func qpConn(t testing.TB, q prov.QP) *conn {
	t.Helper()
	c := q.(*qp).route.(*peer).current()
	if c == nil {
		t.Fatal("no connection")
	}
	return c
}

func postSend(t testing.TB, q prov.QP, wrs []prov.SendWR, sges []prov.SGE) {
	t.Helper()
	n, err := q.PostSend(wrs, sges)
	if err != nil || n != len(wrs) {
		t.Fatalf("post send: %d of %d: %v", n, len(wrs), err)
	}
}

func postRecv(t testing.TB, q interface {
	PostRecv([]prov.RecvWR, []prov.SGE) (int, error)
}, wrid uint64, sges ...prov.SGE) {
	t.Helper()
	n, err := q.PostRecv([]prov.RecvWR{{WRID: wrid, NumSGE: uint32(len(sges))}}, sges)
	if err != nil || n != 1 {
		t.Fatalf("post recv: %v", err)
	}
}

func waitState(t testing.TB, q prov.QP, want prov.QPState) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for state(t, q) != want {
		if time.Now().After(deadline) {
			t.Fatalf("QP %d in %v, want %v", q.QPN(), state(t, q), want)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func nextEvent(t testing.TB, c prov.Context) prov.AsyncEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	ev, err := c.AsyncEvent(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

func allEq(b []byte, v byte) bool {
	for _, x := range b {
		if x != v {
			return false
		}
	}
	return true
}

// sink forces test buffers to the heap.
var sink [][]byte

func heapBytes(n int) []byte {
	b := make([]byte, n)
	sink = append(sink[:0], b)
	return b
}

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
