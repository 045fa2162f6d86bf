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
// frees its place. Before, every one was accepted.
func TestAdversarialConnLimit(t *testing.T) {
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	s := getFabric().service()
	// maxRemoteConns is read under the service's lock.
	s.mu.Lock()
	old := maxRemoteConns
	maxRemoteConns = s.remote + 3
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		maxRemoteConns = old
		s.mu.Unlock()
	}()
	var ncs []net.Conn
	for i := range 3 {
		nc, st := rawDialStatus(t, b.qp.Address(), 0xc0ffee+uint64(i))
		if st != ackOK {
			t.Fatalf("connection %d of 3: %s", i, ackReason(st))
		}
		ncs = append(ncs, nc)
	}
	if _, st := rawDialStatus(t, b.qp.Address(), 0xc0ffee+3); st != ackTooMany {
		t.Fatalf("a connection past the limit: %s, want %q", ackReason(st), ackReason(ackTooMany))
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
			t.Fatalf("a connection after one was closed: %s", ackReason(st))
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
