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

// TestQPStartStorage: what a QP that was created and connected but never
// posted to costs. A rank of a large world has a QP to every other rank
// and uses a few; 512 ranks of one host each made 511 QPs with a
// receive ring of the full depth (10 KiB at 128 receives of 4 SGEs), a
// 3 KiB completion buffer for its requests, and, connected to another
// process, a goroutine each. Now the receive ring grows as receives are
// posted, the completion buffer comes with the send ring (first post),
// and the goroutine that runs the send queue starts at the first
// request that needs it (and still does: a write to an unreachable
// process completes with an error).
func TestQPStartStorage(t *testing.T) {
	restore, err := ForceTransport("auto")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	e := newEnv(t)
	cq := e.cq(maxCQE)
	caps := prov.QPCap{MaxSendWR: 128, MaxRecvWR: 128, MaxSendSGE: 4, MaxRecvSGE: 4, MaxInlineData: 256}
	const n = 64
	qps := make([]prov.QP, 0, n+1)
	t.Cleanup(func() {
		for _, q := range qps {
			if err := q.Close(); err != nil {
				t.Errorf("close qp: %v", err)
			}
		}
	})
	pa, err := parseAddr(e.newQP(prov.QPTypeRC, defaultCaps(), nil).qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	fake := fakeProcOf(pa.fabric ^ 0x5eed).addr() // a made-up process: nothing listens
	connect := func(q prov.QP) {
		t.Helper()
		toInit(t, q, prov.QPTypeRC, defaultConn())
		av := prov.AHAttr{DGID: getFabric().gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1,
			ProviderAddr: encodePeerAddr(&fake)}
		rtr := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: fakeSrcQPN, MaxDestRDAtom: 16, MinRNRTimer: 1, AH: av}
		if err := q.Modify(&rtr, prov.AttrState|prov.AttrAV|prov.AttrPathMTU|prov.AttrDestQPN|prov.AttrRQPSN|
			prov.AttrMaxDestRDAtom|prov.AttrMinRNRTimer); err != nil {
			t.Fatal(err)
		}
		// The shortest transport timeout, no retry: a request to the
		// made-up process fails at once.
		rts := prov.QPAttr{State: prov.QPStateRTS, Timeout: 1, RetryCnt: 0, RNRRetry: 0, MaxRDAtomic: 1}
		if err := q.Modify(&rts, prov.AttrState|prov.AttrSQPSN|prov.AttrTimeout|prov.AttrRetryCnt|prov.AttrRNRRetry|prov.AttrMaxQPRDAtomic); err != nil {
			t.Fatal(err)
		}
	}
	create := func() prov.QP {
		t.Helper()
		q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: caps}))
		qps = append(qps, q)
		return q
	}
	connect(create()) // the service's own goroutines, if any, start here

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	g0 := runtime.NumGoroutine()
	for range n {
		connect(create())
	}
	g1 := runtime.NumGoroutine()
	runtime.ReadMemStats(&after)
	per := (after.TotalAlloc - before.TotalAlloc) / n
	recvRing := uint64(caps.MaxRecvWR) * uint64(unsafe.Sizeof(recvSlot{})+uintptr(caps.MaxRecvSGE)*unsafe.Sizeof(prov.SGE{}))
	t.Logf("%d bytes allocated per QP created and connected (a full receive ring is %d bytes); %d goroutines more for %d QPs", per, recvRing, g1-g0, n)
	if per > 8<<10 {
		t.Errorf("%d bytes allocated per QP created and connected, want at most 8 KiB (a full receive ring is %d bytes)", per, recvRing)
	}
	if g1-g0 >= n/2 {
		t.Errorf("%d goroutines more after connecting %d QPs to another process that nothing was posted to, want few", g1-g0, n)
	}

	// The QPs work: a receive queue takes its full depth, and a write to
	// the made-up process starts the QP's goroutine, which fails it.
	q := qps[1]
	for i := range caps.MaxRecvWR {
		postRecv(t, q, uint64(i))
	}
	if k, err := q.PostRecv([]prov.RecvWR{{WRID: 999}}, nil); k != 0 || err == nil {
		t.Fatalf("receive %d on a queue of %d: posted %d, err %v; want a full queue", caps.MaxRecvWR+1, caps.MaxRecvWR, k, err)
	}
	src := e.alloc(8, allAccess)
	postSend(t, q, []prov.SendWR{{WRID: 7, Opcode: prov.WRWrite, Flags: prov.SendSignaled, NumSGE: 1,
		RemoteAddr: 4096, RKey: 1}}, []prov.SGE{src.sge(0, 8)})
	for {
		c := poll(t, cq, 1)[0]
		if c.WRID != 7 {
			continue // a receive flushed as the failure moved the QP to ERR
		}
		if c.Status == prov.StatusSuccess {
			t.Fatalf("a write to a process that does not exist succeeded")
		}
		t.Logf("write to a made-up process: %v", c.Status)
		break
	}
}

// TestCQGrowsToItsSize: a CQ holds its completions in a ring that grows
// as they queue up (a CQ of 65536 entries is 3 MiB, and a rank of a large
// world has one sized for every QP), keeping their order when the ring
// wraps, and overflows at its size, not before.
func TestCQGrowsToItsSize(t *testing.T) {
	e := newEnv(t)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	big := must(e.ctx.CreateCQ(maxCQE, nil, 0))
	runtime.ReadMemStats(&after)
	if err := big.Close(); err != nil {
		t.Fatal(err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 64<<10 {
		t.Errorf("a CQ of %d entries allocated %d bytes at creation, want at most 64 KiB", maxCQE, got)
	}

	const size = 300
	cq := e.cq(size)
	if got := cq.Cap(); got != size {
		t.Errorf("Cap %d, want %d", got, size)
	}
	caps := prov.QPCap{MaxSendWR: 1, MaxRecvWR: size + 1, MaxSendSGE: 1, MaxRecvSGE: 1}
	// flushed posts k receives (WRIDs base, base+1...) on a new QP and
	// moves it to ERR: k flush completions, in order.
	flushed := func(base, k int) {
		t.Helper()
		q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: caps}))
		t.Cleanup(func() { q.Close() })
		toInit(t, q, prov.QPTypeRC, defaultConn())
		for i := range k {
			postRecv(t, q, uint64(base+i))
		}
		if err := q.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState); err != nil {
			t.Fatal(err)
		}
	}
	expect := func(from, to int) {
		t.Helper()
		for i, c := range poll(t, cq, to-from) {
			if c.WRID != uint64(from+i) || c.Status != prov.StatusWRFlushErr {
				t.Fatalf("completion %d: WRID %d status %v, want WRID %d flushed", i, c.WRID, c.Status, from+i)
			}
		}
	}
	flushed(0, 40)
	expect(0, 30) // the ring's head moves on
	flushed(40, 100)
	expect(30, 140) // the ring grew while it wrapped
	flushed(1000, size)
	expect(1000, 1000+size) // full
	flushed(2000, size)
	flushed(3000, 1) // one too many
	var dst [4]prov.Completion
	if _, err := cq.Poll(dst[:]); err == nil {
		t.Fatalf("a CQ of %d entries took %d completions: want an overflow", size, size+1)
	}
}
