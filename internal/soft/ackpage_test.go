package soft

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// TestAckPageChecks: the acceptor takes only a memfd of the page's size
// sealed against resizing as a unix connection's acknowledgement page.
func TestAckPageChecks(t *testing.T) {
	good := must(newAckPageFD())
	defer unix.Close(good)
	if err := checkAckPageFD(good); err != nil {
		t.Fatalf("a good page refused: %v", err)
	}
	unsealed, big, pipe := badMemFDs(t, ackPageSize, 1<<20)
	for _, tc := range []struct {
		name string
		fd   int
	}{
		{"Unsealed", unsealed},
		{"WrongSize", big},
		{"Pipe", pipe},
	} {
		if err := checkAckPageFD(tc.fd); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
	// Two mappings of one page: each side's word is the other's peer word.
	d, a := must(mapAckPage(good, true)), must(mapAckPage(good, false))
	defer d.unmap()
	defer a.unmap()
	d.held(41)
	a.held(42)
	if d.peerHeld() != 42 || a.peerHeld() != 41 {
		t.Errorf("the dialer sees %d, the acceptor %d; want 42 and 41", d.peerHeld(), a.peerHeld())
	}
}

// TestAckPageHandshakeRefused: a unix HELLO whose acknowledgement page is
// unusable (not sealed, or more descriptors than one) is refused with a
// reason, before the acceptor maps anything.
func TestAckPageHandshakeRefused(t *testing.T) {
	unsealed, _, _ := badMemFDs(t, ackPageSize, 1<<20)
	good := must(newAckPageFD())
	defer unix.Close(good)
	for _, tc := range []struct {
		name string
		fds  []int
	}{
		{"Unsealed", []int{unsealed}},
		{"TwoPages", []int{good, good}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ch, err := helloChallenge(t, kindUnix, tc.fds)
			if err != nil || ch.status != ackBadShm {
				t.Errorf("challenge %+v, %v; want status %d (%s)", ch, err, ackBadShm, ackReason(ackBadShm))
			}
		})
	}
}

// TestAckPageInUse: unix connections have an acknowledgement page,
// shared-memory ones its words in their rings' headers, TCP connections
// none (their acknowledgements are corked in the socket).
func TestAckPageInUse(t *testing.T) {
	for _, tc := range []struct {
		kind string
		page bool
	}{{"unix", true}, {"shm", true}, {"tcp", false}} {
		t.Run(tc.kind, func(t *testing.T) {
			forceTransport(t, tc.kind)
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
			m := privMem(t, e, 64)
			if _, err := b.qp.PostRecv([]prov.RecvWR{{WRID: 9, NumSGE: 1}}, []prov.SGE{m.sge(32, 8)}); err != nil {
				t.Fatal(err)
			}
			wr := []prov.SendWR{{WRID: 1, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
			if _, err := a.qp.PostSend(wr, []prov.SGE{m.sge(0, 8)}); err != nil {
				t.Fatal(err)
			}
			if c := spin(t, b.rcq, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("receive: %+v", c)
			}
			if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("send: %+v", c)
			}
			c := revConn(t, b.qp)
			if (c.acks != nil) != tc.page {
				t.Errorf("acknowledgement page %v, want %v", c.acks != nil, tc.page)
			}
			if tc.kind == "unix" && c.acks.mem == nil {
				t.Errorf("the page is not mapped")
			}
			if tc.kind == "shm" && (c.shm == nil || c.acks.mine != c.shm.in.ackWord()) {
				t.Errorf("the acknowledgements are not published in the inbound ring's word")
			}
		})
	}
}

// TestAckPageBurst: a burst of more messages than the connection holds
// responses for, handled in one go by the target's consumer, each held
// behind the acknowledgement page: every one is acknowledged and
// received (the held responses go out when they fill their buffer; the
// consumer used to append past it and panic). Over unix sockets and
// shared memory.
func TestAckPageBurst(t *testing.T) {
	for _, kind := range []string{"unix", "shm"} {
		t.Run(kind, func(t *testing.T) { testAckPageBurst(t, kind) })
	}
}

func testAckPageBurst(t *testing.T, kind string) {
	forceTransport(t, kind)
	e := newEnv(t)
	caps := defaultCaps()
	caps.MaxSendWR, caps.MaxRecvWR = 256, 256
	a := e.newQP(prov.QPTypeRC, caps, nil)
	b := e.newQP(prov.QPTypeRC, caps, nil)
	oa, ob := defaultConn(), defaultConn()
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, oa)
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, ob)
	const n = 200
	m := privMem(t, e, 8*n+8)
	recvs := make([]prov.RecvWR, n)
	rsges := make([]prov.SGE, n)
	for i := range recvs {
		recvs[i] = prov.RecvWR{WRID: uint64(i), NumSGE: 1}
		rsges[i] = m.sge(8+8*i, 8)
	}
	if k, err := b.qp.PostRecv(recvs, rsges); err != nil || k != n {
		t.Fatalf("post recv: %d, %v", k, err)
	}
	for round := range 3 {
		wrs := make([]prov.SendWR, n)
		sges := make([]prov.SGE, n)
		for i := range wrs {
			wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}
			sges[i] = m.sge(0, 8)
		}
		if k, err := a.qp.PostSend(wrs, sges); err != nil || k != n {
			t.Fatalf("round %d: post send: %d, %v", round, k, err)
		}
		for i, c := range spin(t, a.scq, n) {
			if c.Status != prov.StatusSuccess || c.WRID != uint64(i) {
				t.Fatalf("round %d: send %d: %+v", round, i, c)
			}
		}
		for i, c := range spin(t, b.rcq, n) {
			if c.Status != prov.StatusSuccess {
				t.Fatalf("round %d: receive %d: %+v", round, i, c)
			}
		}
		if k, err := b.qp.PostRecv(recvs, rsges); err != nil || k != n {
			t.Fatalf("post recv: %d, %v", k, err)
		}
	}
	if c := revConn(t, b.qp); c.acks == nil {
		t.Errorf("the connection has no acknowledgement page: the test did not test it")
	}
}
