package soft

import (
	"context"
	"encoding/binary"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

func udQP(t testing.TB, e *env, qkey uint32, srq prov.SRQ) *ep {
	t.Helper()
	q := e.newQP(prov.QPTypeUD, defaultCaps(), srq)
	o := defaultConn()
	o.qkey = qkey
	toInit(t, q.qp, prov.QPTypeUD, o)
	must0(t, q.qp.Modify(&prov.QPAttr{State: prov.QPStateRTR}, prov.AttrState))
	must0(t, q.qp.Modify(&prov.QPAttr{State: prov.QPStateRTS, SQPSN: 1}, prov.AttrState|prov.AttrSQPSN))
	return q
}

func TestUD(t *testing.T) {
	e := newEnv(t)
	a := udQP(t, e, 0x1111, nil)
	b := udQP(t, e, 0x2222, nil)
	m := e.alloc(16384, allAccess)
	for i := range m.b[:8192] {
		m.b[i] = byte(i * 7)
	}
	for _, gidIndex := range []uint8{0, 1} {
		av := avFor(b.qp, false)
		av.SGIDIndex, av.DGID, av.TrafficClass, av.HopLimit = gidIndex, getFabric().gids[gidIndex], 0x20, 9
		ah := must(e.pd.CreateAH(av))
		fill(m.b[8192:], 0xee)
		postRecv(t, b.qp, 1, m.sge(8192, 40+100))
		postSend(t, a.qp, []prov.SendWR{{WRID: 5, Opcode: prov.WRSendImm, Imm: 99, Flags: prov.SendSignaled, NumSGE: 1,
			AH: ah.Handle(), RemoteQPN: b.qp.QPN(), RemoteQKey: 0x2222}}, []prov.SGE{m.sge(0, 100)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.Opcode != prov.WCSend {
			t.Fatalf("send %+v", c)
		}
		c := poll(t, b.rcq, 1)[0]
		if c.WRID != 1 || c.ByteLen != 140 || c.Flags != prov.WCWithGRH|prov.WCWithImm || c.Imm != 99 ||
			c.SrcQP != a.qp.QPN() || c.QPN != b.qp.QPN() {
			t.Fatalf("recv %+v", c)
		}
		grh := m.b[8192 : 8192+40]
		for i := range 100 {
			if m.b[8192+40+i] != byte(i*7) {
				t.Fatalf("payload byte %d", i)
			}
		}
		if !allEq(m.b[8192+140:], 0xee) {
			t.Fatal("wrote past the message")
		}
		if gidIndex == 0 { // IPv6 header with the source GID
			if grh[0]>>4 != 6 || grh[7] != 9 || [16]byte(grh[8:24]) != getFabric().gids[0] {
				t.Errorf("IPv6 GRH % x", grh)
			}
		} else { // RoCE v2 over IPv4: header in the last 20 bytes
			ip := grh[20:]
			if ip[0] != 0x45 || ip[9] != 17 || ip[8] != 9 || [4]byte(ip[12:16]) != [4]byte{127, 0, 0, 1} || ipv4Checksum(ip) != 0 {
				t.Errorf("IPv4 GRH % x", grh)
			}
		}
		ah.Close()
	}

	ah := must(e.pd.CreateAH(avFor(b.qp, false)))
	defer ah.Close()
	send := func(qkey uint32, n int) {
		postSend(t, a.qp, []prov.SendWR{{WRID: 6, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1,
			AH: ah.Handle(), RemoteQPN: b.qp.QPN(), RemoteQKey: qkey}}, []prov.SGE{m.sge(0, n)})
	}
	// No receive posted: dropped, sender succeeds.
	send(0x2222, 10)
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("%+v", c)
	}
	// Wrong Q_Key: dropped; the receive stays posted.
	postRecv(t, b.qp, 2, m.sge(8192, 4096+40))
	send(0x3333, 10)
	poll(t, a.scq, 1)
	expectEmpty(t, b.rcq)
	// High bit: the sender's own Q_Key (0x1111) is used: dropped too.
	send(0x80000000, 10)
	poll(t, a.scq, 1)
	expectEmpty(t, b.rcq)
	// A full MTU is fine.
	send(0x2222, 4096)
	if c := poll(t, b.rcq, 1)[0]; c.WRID != 2 || c.ByteLen != 4096+40 {
		t.Fatalf("%+v", c)
	}
	poll(t, a.scq, 1)
	// Receive buffer without room for the GRH: LOC_LEN_ERR at the receiver.
	postRecv(t, b.qp, 3, m.sge(8192, 40+9))
	send(0x2222, 10)
	poll(t, a.scq, 1)
	if c := poll(t, b.rcq, 1)[0]; c.WRID != 3 || c.Status != prov.StatusLocLenErr {
		t.Fatalf("%+v", c)
	}
	// Above the MTU: LOC_LEN_ERR at the sender.
	send(0x2222, 4097)
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusLocLenErr {
		t.Fatalf("%+v", c)
	}
	waitState(t, a.qp, prov.QPStateErr)
}

func TestUDSameQKeyHighBit(t *testing.T) {
	e := newEnv(t)
	a := udQP(t, e, 0x4444, nil)
	b := udQP(t, e, 0x4444, nil)
	m := e.alloc(4096, allAccess)
	ah := must(e.pd.CreateAH(avFor(b.qp, true))) // routed by GID only
	defer ah.Close()
	postRecv(t, b.qp, 1, m.sge(0, 1000))
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, AH: ah.Handle(),
		RemoteQPN: b.qp.QPN(), RemoteQKey: 0x80000000}}, []prov.SGE{m.sge(2000, 16)})
	if c := poll(t, b.rcq, 1)[0]; c.ByteLen != 56 {
		t.Fatalf("%+v", c)
	}
	if _, err := e.pd.CreateAH(prov.AHAttr{DGID: getFabric().gids[1]}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("AH without GRH: %v", err)
	}
}

func TestUC(t *testing.T) {
	o := defaultConn()
	o.access = prov.AccessLocalWrite | prov.AccessRemoteWrite
	e, a, b := pair(t, prov.QPTypeUC, o, o)
	m := e.alloc(4096, allAccess)
	ro := e.alloc(4096, prov.AccessLocalWrite)
	fill(m.b[1024:], 0xee)
	copy(m.b, "uc data")
	// Send without a receive: dropped, success at the sender.
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 7)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("%+v", c)
	}
	// Write with a bad rkey and to a read-only MR: dropped silently.
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 2, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: m.addr(1024), RKey: 5},
		{WRID: 3, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: ro.addr(0), RKey: ro.mr.RKey()},
	}, []prov.SGE{m.sge(0, 7)})
	for _, c := range poll(t, a.scq, 2) {
		if c.Status != prov.StatusSuccess {
			t.Fatalf("%+v", c)
		}
	}
	if !allEq(m.b[1024:], 0xee) || !allEq(ro.b, 0) {
		t.Fatal("memory modified")
	}
	if state(t, a.qp) != prov.QPStateRTS || state(t, b.qp) != prov.QPStateRTS {
		t.Fatal("UC QPs left RTS")
	}
	// A good write and a send with a receive.
	postRecv(t, b.qp, 10, m.sge(2048, 64))
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 4, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(1024), RKey: m.mr.RKey()},
		{WRID: 5, Opcode: prov.WRSendImm, Imm: 3, NumSGE: 1, Flags: prov.SendSignaled},
	}, []prov.SGE{m.sge(0, 7)})
	poll(t, a.scq, 1)
	if c := poll(t, b.rcq, 1)[0]; c.WRID != 10 || c.ByteLen != 7 || c.Imm != 3 || string(m.b[2048:2055]) != "uc data" ||
		string(m.b[1024:1031]) != "uc data" {
		t.Fatalf("%+v", c)
	}
}

func TestSRQ(t *testing.T) {
	e := newEnv(t)
	s := must(e.pd.CreateSRQ(prov.SRQAttr{MaxWR: 8, MaxSGE: 2}))
	t.Cleanup(func() { must0(t, s.Close()) })
	a1 := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	a2 := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	b1 := e.newQP(prov.QPTypeRC, defaultCaps(), s)
	b2 := e.newQP(prov.QPTypeRC, defaultCaps(), s)
	for _, p := range [][2]*ep{{a1, b1}, {b1, a1}, {a2, b2}, {b2, a2}} {
		connectOne(t, p[0].qp, p[1].qp, prov.QPTypeRC, defaultConn())
	}
	if _, err := s.PostRecv([]prov.RecvWR{{NumSGE: 3}}, make([]prov.SGE, 3)); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("3 SGEs: %v", err)
	}
	if _, err := b1.qp.PostRecv([]prov.RecvWR{{NumSGE: 1}}, make([]prov.SGE, 1)); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("post to a QP with SRQ: %v", err)
	}
	_, ia, _ := b1.qp.Query()
	if ia.SRQ != s {
		t.Errorf("query SRQ %v", ia.SRQ)
	}
	m := e.alloc(4096, allAccess)
	wrs := make([]prov.RecvWR, 10)
	sges := make([]prov.SGE, 10)
	for i := range wrs {
		wrs[i] = prov.RecvWR{WRID: uint64(100 + i), SGEIndex: uint32(i), NumSGE: 1}
		sges[i] = m.sge(1024+64*i, 64)
	}
	n, err := s.PostRecv(wrs, sges)
	if n != 8 || !errors.Is(err, prov.ErrQueueFull) {
		t.Fatalf("post 10 into 8: %d %v", n, err)
	}
	must0(t, s.Modify(prov.SRQAttr{SRQLimit: 5}, true))
	if _, err := s.Query(); err != nil {
		t.Fatal(err)
	}
	// Four sends through two QPs consume four receives: 8 -> 4 < 5 fires once.
	for i := range 4 {
		q := a1
		if i%2 == 1 {
			q = a2
		}
		postSend(t, q.qp, []prov.SendWR{{WRID: uint64(i), Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{m.sge(0, 8)})
	}
	c1 := poll(t, b1.rcq, 2)
	c2 := poll(t, b2.rcq, 2)
	if c1[0].WRID != 100 || c2[0].WRID != 101 || c1[1].WRID != 102 || c2[1].WRID != 103 {
		t.Errorf("SRQ order %+v %+v", c1, c2)
	}
	ev := nextEvent(t, e.ctx)
	if ev.Type != evSRQLimit || ev.Element != s {
		t.Fatalf("event %+v", ev)
	}
	attr := must(s.Query())
	if attr.SRQLimit != 0 || attr.MaxWR != 8 || attr.MaxSGE != 2 {
		t.Errorf("after event %+v", attr)
	}
	// Resize keeps the posted receives.
	must0(t, s.Modify(prov.SRQAttr{MaxWR: 16}, false))
	if attr := must(s.Query()); attr.MaxWR != 16 {
		t.Errorf("resize %+v", attr)
	}
	if err := s.Modify(prov.SRQAttr{MaxWR: 2}, false); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("shrink below posted: %v", err)
	}
	postSend(t, a1.qp, []prov.SendWR{{WRID: 9, Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{m.sge(0, 8)})
	if c := poll(t, b1.rcq, 1)[0]; c.WRID != 104 {
		t.Errorf("after resize %+v", c)
	}
	if err := s.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("close SRQ in use: %v", err)
	}
	// RNR on an SRQ QP is woken by a post to the SRQ.
	for range 3 {
		postSend(t, a1.qp, []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{m.sge(0, 8)})
	}
	poll(t, b1.rcq, 3)
	postSend(t, a1.qp, []prov.SendWR{{WRID: 77, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 8)})
	expectEmpty(t, a1.scq)
	postRecv(t, s, 200, m.sge(1024, 64))
	if c := poll(t, a1.scq, 1)[0]; c.WRID != 77 || c.Status != prov.StatusSuccess {
		t.Fatalf("%+v", c)
	}
	poll(t, b1.rcq, 1)
	// ERR on a QP of an SRQ reports last WQE reached.
	must0(t, b2.qp.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState))
	if ev := nextEvent(t, e.ctx); ev.Type != evQPLastWQE || ev.QPN != b2.qp.QPN() {
		t.Errorf("event %+v", ev)
	}
}

func TestCQOverflow(t *testing.T) {
	e := newEnv(t)
	c := e.cq(2)
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: c, RecvCQ: c, Cap: defaultCaps()}))
	t.Cleanup(func() { q.Close() })
	connectOne(t, q, q, prov.QPTypeRC, defaultConn()) // loopback to itself
	m := e.alloc(64, allAccess)
	wr := prov.SendWR{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: m.addr(32), RKey: m.mr.RKey()}
	postSend(t, q, []prov.SendWR{wr, wr, wr}, []prov.SGE{m.sge(0, 8)})
	var dst [4]prov.Completion
	if _, err := c.Poll(dst[:]); !errors.Is(err, syscall.EOVERFLOW) {
		t.Fatalf("poll after overflow: %v", err)
	}
	ev := nextEvent(t, e.ctx)
	if ev.Type != evCQErr || ev.Element != c {
		t.Fatalf("event %+v", ev)
	}
}

func TestCompChannel(t *testing.T) {
	e := newEnv(t)
	ch := must(e.ctx.CreateCompChannel())
	c := must(e.ctx.CreateCQ(16, ch, 0))
	if err := ch.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("close channel in use: %v", err)
	}
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: c, RecvCQ: c, Cap: defaultCaps()}))
	t.Cleanup(func() {
		must0(t, q.Close())
		must0(t, c.Close())
		must0(t, ch.Close())
	})
	connectOne(t, q, q, prov.QPTypeRC, defaultConn())
	m := e.alloc(64, allAccess)
	write := func(signaled bool) {
		wr := prov.SendWR{Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: m.addr(32), RKey: m.mr.RKey()}
		if signaled {
			wr.Flags = prov.SendSignaled
		}
		postSend(t, q, []prov.SendWR{wr}, []prov.SGE{m.sge(0, 8)})
	}
	wait := func(d time.Duration) (prov.CQ, error) {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		return ch.Wait(ctx)
	}
	// Not armed: no event.
	write(true)
	if _, err := wait(10 * time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("unarmed wait: %v", err)
	}
	poll(t, c, 1)
	// Armed: one event, then none until re-armed.
	must0(t, c.Arm(false))
	write(true)
	if got, err := wait(hangGuard); err != nil || got != c {
		t.Fatalf("armed wait: %v %v", got, err)
	}
	write(true)
	if _, err := wait(10 * time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("one-shot: %v", err)
	}
	poll(t, c, 2)
	// Solicited only: a send completion does not fire, a solicited receive does.
	must0(t, c.Arm(true))
	write(true)
	if _, err := wait(10 * time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("solicited-only fired on a send completion: %v", err)
	}
	postRecv(t, q, 1, m.sge(0, 8))
	postSend(t, q, []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSolicited}}, []prov.SGE{m.sge(8, 8)})
	if got, err := wait(hangGuard); err != nil || got != c {
		t.Fatalf("solicited wait: %v %v", got, err)
	}
	poll(t, c, 2)
	// A Wait blocked before the completion is woken by it.
	must0(t, c.Arm(false))
	done := make(chan error, 1)
	go func() {
		_, err := wait(hangGuard)
		done <- err
	}()
	time.Sleep(5 * time.Millisecond)
	write(true)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	poll(t, c, 1)
	// Cancellation.
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(5 * time.Millisecond)
		cancel()
	}()
	if _, err := ch.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancel: %v", err)
	}
	if err := (&cq{ring: make([]prov.Completion, 1)}).Arm(false); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("arm without channel: %v", err)
	}
}

func TestAsyncEventCancel(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	if _, err := e.ctx.AsyncEvent(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	// The queue is bounded: the oldest events are dropped.
	c := e.ctx.(*devContext)
	for i := range prov.EventQueueDepth + 10 {
		c.events.Push(prov.AsyncEvent{Type: evQPFatal, QPN: uint32(i)})
	}
	if ev := nextEvent(t, e.ctx); ev.QPN != 10 {
		t.Fatalf("oldest kept event %+v", ev)
	}
}

func TestAtomicsConcurrent(t *testing.T) {
	e := newEnv(t)
	target := e.alloc(4096, allAccess)
	const workers, per = 4, 500
	type pr struct{ a, b *ep }
	var pairs []pr
	for range workers {
		a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
		connectOne(t, a.qp, b.qp, prov.QPTypeRC, defaultConn())
		connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
		pairs = append(pairs, pr{a, b})
	}
	errc := make(chan error, workers)
	for w := range workers {
		go func() {
			a := pairs[w].a
			loc := allocIn(t, e.pd, 64, allAccess)
			var dst [8]prov.Completion
			for i := 0; i < per; i++ {
				wr := []prov.SendWR{{WRID: uint64(i), Opcode: prov.WRAtomicFAA, NumSGE: 1, Flags: prov.SendSignaled,
					RemoteAddr: target.addr(0), RKey: target.mr.RKey(), CompareAdd: 1}}
				if _, err := a.qp.PostSend(wr, []prov.SGE{loc.sge(0, 8)}); err != nil {
					errc <- err
					return
				}
				for {
					n, err := a.scq.Poll(dst[:])
					if err != nil {
						errc <- err
						return
					}
					if n == 1 {
						break
					}
				}
			}
			errc <- nil
		}()
	}
	for range workers {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	if got := binary.NativeEndian.Uint64(target.b); got != workers*per {
		t.Fatalf("counter %d, want %d", got, workers*per)
	}
}
