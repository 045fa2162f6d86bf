package verbstest

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/goverbs/verbs"
)

// rtrAttr builds the INIT → RTR attributes that connect local q (of node n)
// to remote by hand, as a program that does not use Connect would: a GRH
// unless both ports are InfiniBand, the smaller MTU, MaxDestRDAtomic 4 and
// MinRNRTimer 14.
func rtrAttr(t testing.TB, n *Node, q interface {
	Endpoint() (verbs.Endpoint, error)
}, remote verbs.Endpoint) (verbs.QPAttr, verbs.QPAttrMask) {
	t.Helper()
	local := Endpoint(t, q)
	ah := verbs.AHAttr{Port: local.Port, DLID: remote.LID, ProviderAddr: remote.Addr}
	if local.LinkLayer != verbs.LinkLayerInfiniBand || remote.LinkLayer != verbs.LinkLayerInfiniBand {
		ah.IsGlobal, ah.DGID, ah.SGIDIndex, ah.HopLimit = true, remote.GID, local.GIDIndex, 64
	}
	a := verbs.QPAttr{State: verbs.StateRTR, PathMTU: min(local.MTU, remote.MTU), DestQPN: remote.QPN,
		RQPSN: remote.PSN, AH: ah, MaxDestRDAtomic: 4, MinRNRTimer: 14}
	return a, verbs.AttrState | verbs.AttrAV | verbs.AttrPathMTU | verbs.AttrDestQPN | verbs.AttrRQPSN |
		verbs.AttrMaxDestAtomic | verbs.AttrMinRNRTimer
}

// rtsAttr builds RTR → RTS attributes: SQPSN from the local endpoint,
// Timeout 10, RetryCount 5, RNRRetry 3, MaxRDAtomic 4.
func rtsAttr(local verbs.Endpoint) (verbs.QPAttr, verbs.QPAttrMask) {
	a := verbs.QPAttr{State: verbs.StateRTS, SQPSN: local.PSN, Timeout: 10, RetryCount: 5, RNRRetry: 3, MaxRDAtomic: 4}
	return a, verbs.AttrState | verbs.AttrSQPSN | verbs.AttrTimeout | verbs.AttrRetryCount | verbs.AttrRNRRetry |
		verbs.AttrMaxRDAtomic
}

func query(t testing.TB, what string, q interface{ Query() (verbs.QPAttr, error) }) verbs.QPAttr {
	t.Helper()
	a, err := q.Query()
	if err != nil {
		t.Fatalf("query %s: %v", what, err)
	}
	return a
}

// pingPong sends one message each way over a connected RC pair.
func (c *tcase) pingPong(t *testing.T, a, b *Node, qa, qb *verbs.RCQueuePair, seed byte) {
	t.Helper()
	ma := a.Alloc(t, 128, accessLocal)
	mb := b.Alloc(t, 128, accessLocal)
	Pattern(ma.Bytes()[:64], seed)
	Pattern(mb.Bytes()[:64], seed+1)
	must(t, "post recv at B", qb.PostRecv(0xB00, SGE(t, mb, 64, 64)))
	must(t, "post recv at A", qa.PostRecv(0xA00, SGE(t, ma, 64, 64)))
	must(t, "post send from A", qa.PostSend(0xA01, verbs.Signaled, SGE(t, ma, 0, 64)))
	must(t, "post send from B", qb.PostSend(0xB01, verbs.Signaled, SGE(t, mb, 0, 64)))
	for _, wc := range c.poll(t, a.CQ, 2) {
		if wc.WRID == 0xA01 {
			expectOK(t, "send completion at A", wc, 0xA01, verbs.OpSend, qa.QPN())
		} else {
			expectOK(t, "recv completion at A", wc, 0xA00, verbs.OpRecv, qa.QPN())
		}
	}
	for _, wc := range c.poll(t, b.CQ, 2) {
		if wc.WRID == 0xB01 {
			expectOK(t, "send completion at B", wc, 0xB01, verbs.OpSend, qb.QPN())
		} else {
			expectOK(t, "recv completion at B", wc, 0xB00, verbs.OpRecv, qb.QPN())
		}
	}
	checkBytes(t, "data received at B", mb.Bytes()[64:], ma.Bytes()[:64])
	checkBytes(t, "data received at A", ma.Bytes()[64:], mb.Bytes()[:64])
}

// testQPModifyQuery walks an RC QP through INIT → RTR → RTS by hand,
// checking Query after each step and that invalid transitions and
// attributes are refused with EINVAL, then on to ERR and RESET.
func testQPModifyQuery(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	qa := a.NewRC(t, verbs.QPSpec{MaxSendWR: 32, MaxRecvWR: 32, MaxSendSGE: 2, MaxRecvSGE: 2})
	qb := b.NewRC(t, verbs.QPSpec{})
	ea, eb := Endpoint(t, qa), Endpoint(t, qb)

	caps := qa.Cap()
	if caps.MaxSendWR < 32 || caps.MaxRecvWR < 32 || caps.MaxSendSGE < 2 || caps.MaxRecvSGE < 2 {
		t.Errorf("granted caps %+v, want at least the requested 32/32 WRs and 2/2 SGEs", caps)
	}
	init := query(t, "new QP", qa)
	if init.State != verbs.StateInit {
		t.Errorf("new RC QP in state %s, want INIT", init.State)
	}
	if init.Port != c.cfg.Port {
		t.Errorf("INIT: port %d, want %d", init.Port, c.cfg.Port)
	}
	if init.PKeyIndex != 0 {
		t.Errorf("INIT: pkey index %d, want 0", init.PKeyIndex)
	}
	if want := verbs.AccessRemoteWrite | verbs.AccessRemoteRead | verbs.AccessRemoteAtomic; init.Access != want {
		t.Errorf("INIT: access flags %v, want %v", init.Access, want)
	}

	// Invalid transitions and missing attributes.
	rts, rtsMask := rtsAttr(ea)
	expectEINVAL(t, "modify INIT → RTS", qa.Modify(rts, rtsMask))
	rtr, rtrMask := rtrAttr(t, a, qa, eb)
	expectEINVAL(t, "modify INIT → RTR without the address vector", qa.Modify(rtr, rtrMask&^verbs.AttrAV))
	expectEINVAL(t, "modify INIT → RTR without the destination QPN", qa.Modify(rtr, rtrMask&^verbs.AttrDestQPN))
	expectState(t, "after refused modifies", qa, verbs.StateInit)

	// INIT → RTR.
	must(t, "modify INIT → RTR", qa.Modify(rtr, rtrMask))
	got := query(t, "RTR", qa)
	if got.State != verbs.StateRTR {
		t.Errorf("RTR: state %s", got.State)
	}
	if got.PathMTU != rtr.PathMTU {
		t.Errorf("RTR: path MTU %s, want %s", got.PathMTU, rtr.PathMTU)
	}
	if got.DestQPN != eb.QPN {
		t.Errorf("RTR: dest QPN %d, want %d", got.DestQPN, eb.QPN)
	}
	if got.RQPSN != eb.PSN {
		t.Errorf("RTR: rq PSN %#x, want %#x", got.RQPSN, eb.PSN)
	}
	if got.MaxDestRDAtomic < 4 {
		t.Errorf("RTR: max dest rd atomic %d, want at least 4", got.MaxDestRDAtomic)
	}
	if got.MinRNRTimer != 14 {
		t.Errorf("RTR: min RNR timer %d, want 14", got.MinRNRTimer)
	}
	if rtr.AH.IsGlobal && (!got.AH.IsGlobal || got.AH.DGID != eb.GID) {
		t.Errorf("RTR: address vector global=%v dgid=%s, want global with dgid %s", got.AH.IsGlobal, got.AH.DGID, eb.GID)
	}
	expectEINVAL(t, "modify RTR → RTR", qa.Modify(rtr, rtrMask))

	// RTR → RTS.
	must(t, "modify RTR → RTS", qa.Modify(rts, rtsMask))
	got = query(t, "RTS", qa)
	if got.State != verbs.StateRTS {
		t.Errorf("RTS: state %s", got.State)
	}
	if got.SQPSN != ea.PSN {
		t.Errorf("RTS: sq PSN %#x, want %#x", got.SQPSN, ea.PSN)
	}
	if got.Timeout != 10 || got.RetryCount != 5 || got.RNRRetry != 3 {
		t.Errorf("RTS: timeout %d, retry count %d, RNR retry %d; want 10, 5, 3", got.Timeout, got.RetryCount, got.RNRRetry)
	}
	if got.MaxRDAtomic < 4 {
		t.Errorf("RTS: max rd atomic %d, want at least 4", got.MaxRDAtomic)
	}

	// The hand-connected QP works with a peer connected by Connect.
	must(t, "connect B", qb.Connect(ea))
	c.pingPong(t, a, b, qa, qb, 0x10)

	// RTS → RTS may change the RNR timer, but not the send PSN.
	must(t, "modify RTS → RTS (min RNR timer)", qa.Modify(verbs.QPAttr{State: verbs.StateRTS, MinRNRTimer: 5}, verbs.AttrState|verbs.AttrMinRNRTimer))
	if got := query(t, "RTS after RTS → RTS", qa); got.MinRNRTimer != 5 || got.State != verbs.StateRTS {
		t.Errorf("after RTS → RTS: state %s, min RNR timer %d; want RTS, 5", got.State, got.MinRNRTimer)
	}
	expectEINVAL(t, "modify RTS → RTS with the send PSN", qa.Modify(verbs.QPAttr{State: verbs.StateRTS, SQPSN: 1}, verbs.AttrState|verbs.AttrSQPSN))
	expectEINVAL(t, "modify RTS → RTR", qa.Modify(rtr, rtrMask))
	expectState(t, "after refused modifies", qa, verbs.StateRTS)

	// Any state → ERR → RESET.
	must(t, "modify RTS → ERR", qa.Modify(verbs.QPAttr{State: verbs.StateError}, verbs.AttrState))
	expectState(t, "after the move to ERR", qa, verbs.StateError)
	expectEINVAL(t, "modify ERR → RTS", qa.Modify(rts, rtsMask))
	must(t, "modify ERR → RESET", qa.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState))
	expectState(t, "after the move to RESET", qa, verbs.StateReset)
	expectEINVAL(t, "modify RESET → RTR", qa.Modify(rtr, rtrMask))
	expectEINVAL(t, "modify RESET → INIT without the port", qa.Modify(
		verbs.QPAttr{State: verbs.StateInit, Access: verbs.AccessRemoteWrite},
		verbs.AttrState|verbs.AttrPKeyIndex|verbs.AttrAccessFlags))
	expectState(t, "after refused modifies", qa, verbs.StateReset)
}

// testQPResetReuse breaks a connection with an error, moves both QPs to
// RESET and back to INIT by hand, reconnects them and transfers data.
func testQPResetReuse(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	c.pingPong(t, p.A, p.B, p.QA, p.QB, 0x20)

	local := p.A.Alloc(t, 64, accessLocal)
	remote := p.B.Alloc(t, 64, accessAll)
	c.expectFailure(t, p, "write with a bad rkey", verbs.StatusRemAccessErr, func(wrid uint64) error {
		return p.QA.PostWrite(wrid, verbs.Signaled, verbs.RemoteAddr{Addr: remote.Addr(), RKey: badRKey(remote, local)}, SGE(t, local, 0, 8))
	})

	for _, q := range []*verbs.RCQueuePair{p.QA, p.QB} {
		must(t, "modify to RESET", q.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState))
		expectState(t, "after the move to RESET", q, verbs.StateReset)
		must(t, "modify RESET → INIT", q.Modify(
			verbs.QPAttr{State: verbs.StateInit, Port: c.cfg.Port, Access: verbs.AccessRemoteWrite | verbs.AccessRemoteRead},
			verbs.AttrState|verbs.AttrPKeyIndex|verbs.AttrPort|verbs.AttrAccessFlags))
		if got := query(t, "INIT after RESET", q); got.State != verbs.StateInit || got.Access != verbs.AccessRemoteWrite|verbs.AccessRemoteRead {
			t.Errorf("after RESET → INIT: state %s, access %v; want INIT, RemoteWrite|RemoteRead", got.State, got.Access)
		}
	}
	// Drop completions the failure may have left (flushes at B).
	var drain [16]verbs.Completion
	for _, cq := range []*verbs.CompletionQueue{p.A.CQ, p.B.CQ} {
		for {
			n, err := cq.Poll(drain[:])
			must(t, "poll", err)
			if n == 0 {
				break
			}
		}
	}
	ConnectRC(t, p.QA, p.QB)
	c.pingPong(t, p.A, p.B, p.QA, p.QB, 0x30)

	// The new access flags hold: RDMA write is still allowed.
	must(t, "post write", p.QA.PostWrite(1, verbs.Signaled, remote.Remote().At(0), SGE(t, local, 0, 8)))
	expectOK(t, "write after reconnect", c.pollOne(t, p.A.CQ), 1, verbs.OpWrite, p.QA.QPN())
	checkBytes(t, "written data", remote.Bytes()[:8], local.Bytes()[:8])
}

// linker is a queue pair that says what carries its traffic.
type linker interface{ Link() string }

// expectLink fails t unless q reports the link want.
func expectLink(t testing.TB, what string, q linker, want string) {
	t.Helper()
	if got := q.Link(); got != want {
		t.Errorf("%s: Link() = %q, want %q", what, got, want)
	}
}

// wantLink is the Link that a connected queue pair of device dev reports
// under c's configuration: "<device>/<port> <link layer>" on hardware; on
// soft0, "local" within one process unless GOVERBS_SOFT_TRANSPORT forces
// a transport, which it names ("tls" for tcp with GOVERBS_SOFT_TLS=on),
// and between processes "shm" by default.
func (c *tcase) wantLink(t testing.TB, n *Node) string {
	t.Helper()
	if n.Ctx.Name() != verbs.SoftDevice {
		pa, err := n.Ctx.QueryPort(c.cfg.Port)
		must(t, "query port", err)
		ll := map[verbs.LinkLayer]string{verbs.LinkLayerInfiniBand: " infiniband", verbs.LinkLayerEthernet: " ethernet"}[pa.LinkLayer]
		return fmt.Sprintf("%s/%d%s", n.Ctx.Name(), c.cfg.Port, ll)
	}
	switch tr := strings.ToLower(strings.TrimSpace(os.Getenv("GOVERBS_SOFT_TRANSPORT"))); tr {
	case "", "auto":
		if c.cfg.PeerProcessB {
			return "shm"
		}
		return "local"
	case "inproc", "direct":
		return "local"
	case "tcp":
		switch strings.ToLower(strings.TrimSpace(os.Getenv("GOVERBS_SOFT_TLS"))) {
		case "on", "1", "true", "yes":
			return "tls"
		}
		return "tcp"
	default:
		return tr
	}
}

// testLink checks what queue pairs report as the carrier of their traffic
// (Link): nothing before they are connected; once connected (before and
// after traffic) the device, port and link layer, or on soft0 its
// transport; nothing again after RESET. UD QPs name their device and port
// on hardware and nothing on soft0, where each destination has its own
// path.
func testLink(t *testing.T, c *tcase) {
	a, b := NewNodes(t, c.cfg)
	wantA, wantB := c.wantLink(t, a), c.wantLink(t, b)
	qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
	ua, ub := a.NewUC(t, verbs.QPSpec{}), b.NewUC(t, verbs.QPSpec{})
	for _, q := range []struct {
		what string
		q    linker
	}{{"RC of A in INIT", qa}, {"RC of B in INIT", qb}, {"UC of A in INIT", ua}, {"UC of B in INIT", ub}} {
		expectLink(t, q.what, q.q, "")
	}
	ConnectRC(t, qa, qb)
	ConnectUC(t, ua, ub)
	c.check(t, "Connected", func(t *testing.T) {
		expectLink(t, "RC of A, connected", qa, wantA)
		expectLink(t, "RC of B, connected", qb, wantB)
		expectLink(t, "UC of A, connected", ua, wantA)
		expectLink(t, "UC of B, connected", ub, wantB)
	})
	c.pingPong(t, a, b, qa, qb, 0x50)
	c.check(t, "AfterTraffic", func(t *testing.T) {
		expectLink(t, "RC of A, after traffic", qa, wantA)
		expectLink(t, "RC of B, after traffic", qb, wantB)
	})
	c.check(t, "UD", func(t *testing.T) {
		want := wantA
		if a.Ctx.Name() == verbs.SoftDevice {
			want = ""
		}
		expectLink(t, "UD of A", a.NewUD(t, verbs.QPSpec{}), want)
	})
	c.check(t, "Reset", func(t *testing.T) {
		must(t, "modify to RESET", qa.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState))
		expectLink(t, "RC of A in RESET", qa, "")
	})
}
