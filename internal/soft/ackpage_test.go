package soft

import (
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
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
	unsealed := must(unix.MemfdCreate("x", unix.MFD_CLOEXEC))
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, ackPageSize); err != nil {
		t.Fatal(err)
	}
	big := must(unix.MemfdCreate("x", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING))
	defer unix.Close(big)
	unix.Ftruncate(big, 1<<20)
	unix.FcntlInt(uintptr(big), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer fdpass.Close(pipe[:])
	for _, tc := range []struct {
		name string
		fd   int
	}{
		{"Unsealed", unsealed},
		{"WrongSize", big},
		{"Pipe", pipe[0]},
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
	restore, err := ForceTransport("auto")
	if err != nil {
		t.Fatal(err)
	}
	defer restore()
	e := newEnv(t)
	q := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	pa, err := parseAddr(q.qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	unsealed := must(unix.MemfdCreate("x", unix.MFD_CLOEXEC))
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, ackPageSize); err != nil {
		t.Fatal(err)
	}
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
			nc, err := net.Dial("unix", pa.unix)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			nc.SetDeadline(time.Now().Add(hangGuard))
			hb := make([]byte, hdrLen+helloLen)
			putHdr(hb, frHello, helloLen, 0)
			putHello(hb[hdrLen:], &hello{kind: kindUnix, pid: uint32(os.Getpid()), fabric: 7, target: pa.fabric,
				job: jobIdentity(), host: hostIdentity()})
			if _, _, err := nc.(*net.UnixConn).WriteMsgUnix(hb, unix.UnixRights(tc.fds...), nil); err != nil {
				t.Fatal(err)
			}
			cb := make([]byte, hdrLen+challengeLen)
			if _, err := io.ReadFull(nc, cb); err != nil {
				t.Fatal(err)
			}
			body, err := handshakeBody(cb, frChallenge)
			if err != nil {
				t.Fatal(err)
			}
			ch, err := parseChallenge(body)
			if err != nil || ch.status != ackBadShm {
				t.Errorf("challenge %+v, %v; want status %d (%s)", ch, err, ackBadShm, ackReason(ackBadShm))
			}
		})
	}
}

// TestAckPageInUse: unix connections have an acknowledgement page, TCP
// connections none (their acknowledgements are corked in the socket).
func TestAckPageInUse(t *testing.T) {
	for _, tc := range []struct {
		kind string
		page bool
	}{{"unix", true}, {"tcp", false}} {
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
			c := b.qp.(*qp).x.rev.Load()
			if (c.acks != nil) != tc.page {
				t.Errorf("acknowledgement page %v, want %v", c.acks != nil, tc.page)
			}
			if tc.page && c.acks.mem == nil {
				t.Errorf("the page is not mapped")
			}
		})
	}
}
