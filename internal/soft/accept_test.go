package soft

import (
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

// TestAcceptAfterEMFILE: a soft0 process runs out of file descriptors
// (its RLIMIT_NOFILE is lowered with prlimit while strangers connect),
// so its listener's accept fails with EMFILE. Once descriptors are free
// again, new connections must be accepted and answered: the listener
// retries with a pause and logs it (before, one accept error ended the
// accept loop for good, and every later peer hung in the backlog).
func TestAcceptAfterEMFILE(t *testing.T) {
	c := testproc.Start(t, envTestChild+"=listener", envTLS+"=off")
	pa, err := parseChildAddr(c.Line(t, "addr")[0])
	if err != nil {
		t.Fatal(err)
	}
	pid := c.Cmd.Process.Pid
	open := countFDs(t, pid)
	// Only the soft limit moves, so that it can be raised again.
	var old unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &old); err != nil {
		t.Fatal(err)
	}
	lim := unix.Rlimit{Cur: uint64(open + 2), Max: old.Max}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatalf("prlimit on the child: %v", err)
	}
	// Strangers that say nothing: the first ones take the child's last
	// descriptors, the next ones make its accept fail.
	var strangers []net.Conn
	for range 8 {
		nc, err := net.Dial("tcp", pa.tcp)
		if err != nil {
			t.Fatal(err)
		}
		strangers = append(strangers, nc)
	}
	deadline := time.Now().Add(hangGuard)
	for !strings.Contains(c.Stderr(), "accept failed") {
		if time.Now().After(deadline) {
			t.Fatalf("the child's accept did not fail (stderr: %s)", c.Stderr())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Free the descriptors: the strangers leave, the limit is restored.
	for _, nc := range strangers {
		nc.Close()
	}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &old, nil); err != nil {
		t.Fatal(err)
	}
	// A new peer is answered (its hello names another process: the
	// refusal proves that the listener runs and handshakes).
	nc := dialTCP(t, pa.tcp)
	wrong := pa
	wrong.fabric ^= 1
	rp := &fakeProc{fabric: 3, pid: 1}
	if r := rawHandshake(t, nc, rp, &wrong, pa.secret, nil); r.status != ackBadTarget {
		t.Fatalf("status %d (%s), want %s", r.status, ackReason(r.status), ackReason(ackBadTarget))
	}
	c.Stop(t)
}

func parseChildAddr(s string) (peerAddr, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return peerAddr{}, err
	}
	return parseAddr(b)
}

// countFDs returns the number of open descriptors of process pid.
func countFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestHandshakeFlood: strangers open many TCP connections and say
// nothing. The service keeps at most maxHandshakesPerSource of one source
// address (the oldest are closed), and a real peer still connects while
// they hang on. (Before, every one was held for the handshake timeout.)
func TestHandshakeFlood(t *testing.T) {
	forceTransport(t, "tcp")
	forceTLS(t, tlsOff)
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	s := e.ctx.(*devContext).f.service()
	pa, err := parseAddr(s.addr)
	if err != nil {
		t.Fatal(err)
	}
	const n = 100
	strangers := make([]net.Conn, n)
	for i := range strangers {
		nc, err := net.Dial("tcp", pa.tcp)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		strangers[i] = nc
	}
	// All but the last maxHandshakesPerSource see the end of the stream.
	for i, nc := range strangers[:n-maxHandshakesPerSource] {
		nc.SetReadDeadline(time.Now().Add(hangGuard))
		if _, err := io.ReadFull(nc, make([]byte, 1)); err != io.EOF {
			t.Fatalf("stranger %d: %v, want the end of the stream", i, err)
		}
	}
	s.hsMu.Lock()
	held := len(s.hs)
	s.hsMu.Unlock()
	if held > maxHandshakesPerSource {
		t.Fatalf("%d connections in their handshake, want at most %d", held, maxHandshakesPerSource)
	}
	// A real peer connects meanwhile.
	src := e.alloc(64, allAccess)
	dst := e.alloc(64, allAccess)
	copy(src.b, "through the flood")
	wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
	postSend(t, a.qp, wr, []prov.SGE{src.sge(0, 17)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("write during the flood: %+v", c)
	}
	if string(dst.b[:17]) != "through the flood" {
		t.Fatalf("the write did not arrive")
	}
}

// TestLocalHandshakesNotDropped: processes of this user on this host
// (unix sockets) count apart from strangers: more of them than
// maxHandshakes may be in their handshake at once, as when the hundreds
// of ranks of a job on one host connect to each other at once. (Before,
// past 64 the oldest were closed, and their dialers failed.)
func TestLocalHandshakesNotDropped(t *testing.T) {
	forceTransport(t, "unix")
	e, _, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	s := e.ctx.(*devContext).f.service()
	pa, err := parseAddr(s.addr)
	if err != nil {
		t.Fatal(err)
	}
	const n = 2 * maxHandshakes
	for range n {
		nc, err := net.Dial("unix", pa.unix)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
	}
	deadline := time.Now().Add(hangGuard)
	for {
		s.hsMu.Lock()
		held, local, drops := len(s.hs), s.hsBySrc[localSource], s.hsDrops.Load()
		s.hsMu.Unlock()
		if drops > 0 {
			t.Fatalf("%d local connections in their handshake were closed", drops)
		}
		if held >= n {
			if local < n {
				t.Fatalf("%d of %d handshakes counted as local", local, n)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d local connections in their handshake", held, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestLocalDialsBounded: a process has at most maxLocalDials connections
// to processes of its host in their handshake at once; the others wait
// for a slot. Here the peer (a listener of this process) accepts and
// never answers: the old code had every dial in its handshake at once.
func TestLocalDialsBounded(t *testing.T) {
	forceTransport(t, "unix")
	e, _, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	s := e.ctx.(*devContext).f.service()
	name := fmt.Sprintf("@goverbs-test-dials-%x", randomBytes(4))
	ln, err := net.Listen("unix", name)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var held []net.Conn
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	pa := peerAddr{fabric: 1, pid: uint32(os.Getpid()), host: s.host, hasHost: true, hasSecret: true, unix: name}
	const n = 3 * maxLocalDials
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if c, err := s.dialKind(&pa, kindUnix, name); err == nil {
				c.abandon()
			}
		}()
	}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(held)
	}
	for deadline := time.Now().Add(hangGuard); count() < maxLocalDials; {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d dials connected", count(), maxLocalDials)
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // room for dials past the bound to connect
	got := count()
	ln.Close()
	<-accepted
	mu.Lock()
	for _, c := range held {
		c.Close() // the dials in their handshake fail; the rest find no listener
	}
	mu.Unlock()
	wg.Wait()
	if got != maxLocalDials {
		t.Fatalf("%d dials in their handshake at once, want %d", got, maxLocalDials)
	}
}
