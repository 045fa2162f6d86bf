package soft

import (
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// rawDialStatus is rawDial that returns the handshake's status instead of
// failing on a refusal.
func rawDialStatus(t *testing.T, addr []byte, fabric uint64) (net.Conn, uint8) {
	t.Helper()
	pa, err := parseAddr(addr)
	if err != nil {
		t.Fatal(err)
	}
	rp := fakeProcOf(fabric)
	rp.pid = uint32(os.Getpid())
	nc, err := net.Dial("tcp", pa.tcp)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(hangGuard))
	return nc, rawHandshake(t, nc, rp, &pa, pa.secret, nil).status
}

// TestAdversarialConnLimit: a holder of one of this process' endpoints
// that opens TCP connections without end (each passes the handshake) is
// refused past maxRemoteConns with ackTooMany, and a connection closed
// frees its place. Before, every one was accepted (until the test's
// bound on dials).
func TestAdversarialConnLimit(t *testing.T) {
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	s := getFabric().service()
	// maxRemoteConns is read under the service's lock.
	s.mu.Lock()
	old, held := maxRemoteConns, s.remote
	maxRemoteConns = held + 3
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		maxRemoteConns = old
		s.mu.Unlock()
	}()
	// Earlier tests' connections may still be going away: dial until
	// refused (3 at least are accepted, and at most 3 more than those
	// that went away meanwhile).
	var ncs []net.Conn
	for i := 0; ; i++ {
		nc, st := rawDialStatus(t, b.qp.Address(), 0xc0ffee+uint64(i))
		if st == ackTooMany {
			if i < 3 {
				t.Fatalf("connection %d refused: %s", i, ackReason(st))
			}
			break
		}
		if st != ackOK || i > 3+held {
			t.Fatalf("connection %d of a limit of %d: %s", i, held+3, ackReason(st))
		}
		ncs = append(ncs, nc)
	}
	ncs[0].Close()
	// The service notices the end of the connection: then a new one is
	// accepted (until the hang guard).
	for deadline := time.Now().Add(hangGuard); ; {
		_, st := rawDialStatus(t, b.qp.Address(), 0xc0ffee+4)
		if st == ackOK {
			break
		}
		if st != ackTooMany || time.Now().After(deadline) {
			s.mu.Lock()
			n, max := s.remote, maxRemoteConns
			s.mu.Unlock()
			t.Fatalf("a connection after one was closed: %s (the service holds %d accepted TCP connections, at most %d; this test opened %d)", ackReason(st), n, max, len(ncs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAdversarialIdleConnCost: idle authenticated TCP connections hold a
// small receive buffer each (sockRxInit), not the full one (sockRxSize,
// 1 MiB: 200 of them took 202 MiB of heap before).
func TestAdversarialIdleConnCost(t *testing.T) {
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	const n = 64
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	for i := range n {
		if _, st := rawDialStatus(t, b.qp.Address(), 0xfee0+uint64(i)); st != ackOK {
			t.Fatalf("connection %d: %s", i, ackReason(st))
		}
	}
	// The service adds a connection after its handshake's answer: wait
	// until it holds them all.
	s := getFabric().service()
	for deadline := time.Now().Add(hangGuard); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		k := len(s.conns)
		s.mu.Unlock()
		if k >= n || time.Now().After(deadline) {
			break
		}
	}
	grown := heap() - min(before, heap())
	if per := grown / n; per > sockRxSize/4 {
		t.Fatalf("%d idle connections took %d bytes of heap, %d each (the full receive buffer is %d)", n, grown, per, sockRxSize)
	}
}
