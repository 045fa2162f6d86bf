package session

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/leak"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// The child process of the cross-process tests (xproc_test.go): the test
// binary started again by internal/testproc, with envChild set.
//
// As a server (envChild=server) it reads commands on its stdin, one a
// line:
//
//	listen NAME CONFIG   Listen on 127.0.0.1:0 with CONFIG (JSON); it
//	                     answers "addr NAME HOST:PORT" (and, with the
//	                     CM, where its CM listens) and accepts
//	                     sessions on it until stdin ends
//
// Each session it accepts serves one scenario: the client's first message
// names it (and its arguments), serverScenarios runs it. A check that
// fails is reported to the client as a message "FAIL: ..." (and on
// stderr), and the session is closed; otherwise the server waits for the
// client to end the session. When stdin ends it closes its listeners,
// waits for its sessions to end, and exits 0 unless a goroutine or a
// verbs object is left (reported on stderr).
//
// As a client (envChild=client) it dials envChildAddr with the Config in
// envChildConfig, sends envChildHello as its first message, says
// "connected", and waits in Receive until the session ends or it is
// killed: the peer a test kills or stops to see what the server reports.
const (
	envChild       = "GOVERBS_SESSION_CHILD"
	envChildAddr   = "GOVERBS_SESSION_ADDR"
	envChildConfig = "GOVERBS_SESSION_CONFIG"
	envChildHello  = "GOVERBS_SESSION_HELLO"
)

func childIfRequested() {
	switch os.Getenv(envChild) {
	case "":
		return
	case "server":
		os.Exit(runServerChild())
	case "client":
		os.Exit(runClientChild())
	}
	fmt.Fprintf(os.Stderr, "child: %s=%q: want server or client\n", envChild, os.Getenv(envChild))
	os.Exit(2)
}

// lines writes whole lines to stdout for concurrent writers.
type lines struct{ mu sync.Mutex }

func (l *lines) println(args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Println(args...)
}

func runServerChild() int {
	start := leak.Count()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out lines
	var wg sync.WaitGroup
	var ls []*Listener
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.SplitN(in.Text(), " ", 3)
		if len(f) != 3 || f[0] != "listen" {
			fmt.Fprintf(os.Stderr, "child: bad command %q\n", in.Text())
			return 2
		}
		var cfg Config
		if err := json.Unmarshal([]byte(f[2]), &cfg); err != nil {
			fmt.Fprintf(os.Stderr, "child: config %s: %v\n", f[2], err)
			return 2
		}
		l, err := Listen(ctx, "127.0.0.1:0", cfg)
		if err != nil {
			fmt.Fprintf(os.Stderr, "child: %v\n", err)
			return 1
		}
		ls = append(ls, l)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				s, err := l.Accept(ctx)
				if err != nil {
					return
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					serveScenario(ctx, s, &out)
				}()
			}
		}()
		if l.cm != nil {
			out.println("addr", f[1], l.Addr(), l.cm.addr)
		} else {
			out.println("addr", f[1], l.Addr())
		}
	}
	for _, l := range ls {
		l.Close()
	}
	ended := make(chan struct{})
	go func() { wg.Wait(); close(ended) }()
	select {
	case <-ended:
	case <-time.After(30 * time.Second):
		buf := make([]byte, 1<<20)
		fmt.Fprintf(os.Stderr, "child: sessions still served 30 s after stdin ended:\n%s\n", buf[:runtime.Stack(buf, true)])
		return 1
	}
	cancel()
	status := 0
	if err := goleak.Find(); err != nil {
		fmt.Fprintf(os.Stderr, "child: goroutines left: %v\n", err)
		status = 1
	}
	for range 4 {
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
	}
	if l := leak.Since(start); len(l) > 0 {
		fmt.Fprintf(os.Stderr, "child: %d verbs object(s) leaked:\n\t%s\n", len(l), strings.Join(l, "\n\t"))
		status = 1
	}
	return status
}

// serveScenario serves one session: the scenario its first message names.
func serveScenario(ctx context.Context, s *Session, out *lines) {
	defer s.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute) // a hang guard
	defer cancel()
	first, err := recvStr(ctx, s)
	if err != nil {
		fmt.Fprintf(os.Stderr, "child: first message: %v\n", err)
		return
	}
	f := strings.Fields(first)
	if len(f) == 0 {
		f = []string{""}
	}
	h := serverScenarios[f[0]]
	if h == nil {
		err = fmt.Errorf("no scenario %q", f[0])
	} else {
		err = h(ctx, s, f[1:], out)
	}
	if err != nil {
		// (ErrPeerClosed too: it may follow a failure of the client's,
		// or a last send whose acknowledgement the client's close beat.)
		fmt.Fprintf(os.Stderr, "child: scenario %s: %v\n", first, err)
		if s.Err() == nil {
			sendStr(ctx, s, "FAIL: "+first+": "+err.Error())
		}
		return
	}
	select {
	case <-s.Done(): // the client ends the session
	case <-ctx.Done():
		fmt.Fprintf(os.Stderr, "child: scenario %s: the client did not end the session\n", first)
	}
}

// serverScenarios are the server sides of the scenarios, by name.
var serverScenarios = map[string]func(ctx context.Context, s *Session, args []string, out *lines) error{
	"ping":        servePing,
	"atomics":     serveAtomics,
	"imm":         serveImm,
	"writeimm":    serveWriteImm,
	"loop":        func(ctx context.Context, s *Session, _ []string, _ *lines) error { return loopExchange(ctx, s) },
	"slices":      serveSlices,
	"access":      serveAccess,
	"caps":        serveCaps,
	"lease":       serveLease,
	"rawlease":    serveRawLease,
	"cancel":      serveCancel,
	"canceloffer": serveCancel,
	"example":     serveExample,
	"rpc":         serveRPC,
	"close":       func(_ context.Context, s *Session, _ []string, _ *lines) error { return s.Close() },
	"idle":        serveIdle,
}

// --- helpers of both sides ---

var le = binary.LittleEndian

func sendStr(ctx context.Context, s *Session, str string) error { return s.Send(ctx, []byte(str)) }

// recvStr receives a message as a string. A message "FAIL: ..." is the
// peer's report of a failed check: an error.
func recvStr(ctx context.Context, s *Session) (string, error) {
	m, err := s.Receive(ctx)
	if err != nil {
		return "", err
	}
	str := string(m.Bytes())
	m.Release()
	if strings.HasPrefix(str, "FAIL:") {
		return "", fmt.Errorf("the peer reports: %s", str)
	}
	return str, nil
}

func expectStr(ctx context.Context, s *Session, want string) error {
	got, err := recvStr(ctx, s)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("got message %q, want %q", got, want)
	}
	return nil
}

// grantLive reports whether g still grants its region to the peer.
func grantLive(g *Grant) bool {
	a := &g.s.agent
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.grants[g.g.id] == g.g
}

// grantedBytes is what this side grants its peer at the moment.
func grantedBytes(s *Session) int64 {
	a := &s.agent
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.granted
}

// errClass names the end of a session as the tests assert it.
func errClass(err error) string {
	switch {
	case err == nil:
		return "none"
	case errors.Is(err, ErrPeerClosed):
		return "closed"
	case errors.Is(err, ErrPeerLost):
		return "lost"
	case errors.Is(err, ErrPeerUnresponsive):
		return "unresponsive"
	}
	return "other:" + strings.ReplaceAll(err.Error(), " ", "_")
}

// checkLocalSlices is async-rdma's local_mr_slice and
// local_mr_slice_overbound: slices of a local region lie where they say,
// and a slice out of bounds is an error.
func checkLocalSlices(s *Session) error {
	const n = 4096
	mr, err := s.Alloc(n)
	if err != nil {
		return err
	}
	defer mr.Free()
	if mr.Len() != n {
		return fmt.Errorf("a region of %d bytes is %d long", n, mr.Len())
	}
	base := mr.All().SGE().Addr
	for _, c := range [][2]int{{0, n}, {2048, n - 2048}, {1000, 3000}, {1234, 1}} {
		sl, err := mr.Slice(c[0], c[1])
		if err != nil {
			return fmt.Errorf("slice %d+%d of %d: %v", c[0], c[1], n, err)
		}
		if sl.Len() != c[1] || sl.SGE().Addr != base+uint64(c[0]) || sl.SGE().Length != uint32(c[1]) {
			return fmt.Errorf("slice %d+%d: %d bytes at %#x, region at %#x", c[0], c[1], sl.Len(), sl.SGE().Addr, base)
		}
	}
	for _, c := range [][2]int{{2, -2}, {0, n + 1}, {n, 1}, {-1, 1}, {1, math.MaxInt}, {math.MaxInt, 1}} {
		if _, err := mr.Slice(c[0], c[1]); !errors.Is(err, ErrOutOfBounds) {
			return fmt.Errorf("slice %d+%d of %d: %v, want ErrOutOfBounds", c[0], c[1], n, err)
		}
	}
	sub, _ := mr.Slice(1000, 100)
	if _, err := sub.Slice(50, 51); !errors.Is(err, ErrOutOfBounds) {
		return fmt.Errorf("slice 50+51 of a slice of 100: %v, want ErrOutOfBounds", err)
	}
	s5, _ := mr.Slice(0, 5)
	copy(s5.Bytes(), "hello")
	if string(mr.Bytes()[:5]) != "hello" {
		return fmt.Errorf("wrote hello into a slice, the region holds %q", mr.Bytes()[:5])
	}
	return nil
}

// --- loop: concurrent sends and receives, both ways ---

const (
	loopSenders = 4  // goroutines sending, on each side
	loopRecvs   = 4  // goroutines receiving, on each side
	loopEach    = 40 // messages of each sender
)

// loopMessage is message seq of sender g: its header says who, its
// payload a pattern of both; every tenth is larger than a receive buffer
// (rendezvous).
func loopMessage(g, seq int) []byte {
	n := 16 + (g*131+seq*37)%1500
	if seq%10 == 9 {
		n = defaultMessageSize + 4000
	}
	b := make([]byte, n)
	le.PutUint32(b, uint32(g))
	le.PutUint32(b[4:], uint32(seq))
	le.PutUint32(b[8:], uint32(n))
	for i := 12; i < n; i++ {
		b[i] = byte(g*31 + seq*7 + i)
	}
	return b
}

// loopExchange sends loopSenders×loopEach messages from as many
// goroutines while loopRecvs goroutines receive as many from the peer,
// checking every byte and that each arrives exactly once.
func loopExchange(ctx context.Context, s *Session) error {
	const total = loopSenders * loopEach
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, loopSenders+loopRecvs)
	var wg sync.WaitGroup
	for g := range loopSenders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := range loopEach {
				if err := s.Send(ctx, loopMessage(g, seq)); err != nil {
					errc <- fmt.Errorf("send %d of sender %d: %w", seq, g, err)
					cancel()
					return
				}
			}
		}()
	}
	var claimed atomic.Int32
	var mu sync.Mutex
	seen := map[[2]int]int{}
	for range loopRecvs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for claimed.Add(1) <= total {
				m, err := s.Receive(ctx)
				if err != nil {
					errc <- fmt.Errorf("receive: %w", err)
					cancel()
					return
				}
				b := m.Bytes()
				var g, seq int
				ok := len(b) >= 12
				if ok {
					g, seq = int(le.Uint32(b)), int(le.Uint32(b[4:]))
					ok = g < loopSenders && seq < loopEach && bytes.Equal(b, loopMessage(g, seq))
				}
				n := m.Len()
				m.Release()
				if !ok {
					errc <- fmt.Errorf("a message of %d bytes is none that was sent", n)
					cancel()
					return
				}
				mu.Lock()
				seen[[2]int{g, seq}]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errc)
	if err := <-errc; err != nil {
		return err
	}
	for g := range loopSenders {
		for seq := range loopEach {
			if c := seen[[2]int{g, seq}]; c != 1 {
				return fmt.Errorf("message %d of sender %d received %d times", seq, g, c)
			}
		}
	}
	return sendStr(ctx, s, "ok")
}

// --- server sides ---

func servePing(ctx context.Context, s *Session, _ []string, _ *lines) error {
	return sendStr(ctx, s, "pong")
}

const (
	atomicsSwap  = 0x0101010101010101
	atomicsFinal = atomicsSwap + 5
)

// serveAtomics: the client compared-and-swapped and added into a region
// it requested, then handed it back: the words hold what the successful
// operations made of them, and nothing of the refused ones.
func serveAtomics(ctx context.Context, s *Session, _ []string, _ *lines) error {
	mr, err := s.ReceiveLocalMR(ctx)
	if err != nil {
		return err
	}
	defer mr.Free()
	b := mr.Bytes()
	if len(b) != 16 {
		return fmt.Errorf("a region of %d bytes handed back, want 16", len(b))
	}
	if w0, w1 := le.Uint64(b), le.Uint64(b[8:]); w0 != atomicsFinal || w1 != 0 {
		return fmt.Errorf("the words hold %#x %#x, want %#x 0", w0, w1, uint64(atomicsFinal))
	}
	return sendStr(ctx, s, "ok")
}

const immMsg = "hello world"

// serveImm is async-rdma's imm test: sends with and without immediate
// data, a write with immediate into a region the client requested and
// handed back; then the same the other way (the server writes with
// immediate into memory of the client's).
func serveImm(ctx context.Context, s *Session, _ []string, _ *lines) error {
	for i, w := range []struct {
		imm uint32
		has bool
	}{{123, true}, {123, true}, {0, false}, {0, false}} {
		m, err := s.Receive(ctx)
		if err != nil {
			return err
		}
		imm, has := m.Imm()
		got, isw := string(m.Bytes()), m.IsWrite()
		m.Release()
		if got != immMsg || has != w.has || imm != w.imm || isw {
			return fmt.Errorf("message %d: %q imm %d (%v) write %v, want %q imm %d (%v)", i, got, imm, has, isw, immMsg, w.imm, w.has)
		}
	}
	m, err := s.Receive(ctx)
	if err != nil {
		return err
	}
	imm, has := m.Imm()
	isw, n := m.IsWrite(), m.Len()
	m.Release()
	if !isw || !has || imm != 124 || n != 0 {
		return fmt.Errorf("the write with immediate's notice: write %v imm %d (%v), %d bytes; want write, imm 124, no bytes", isw, imm, has, n)
	}
	lmr, err := s.ReceiveLocalMR(ctx)
	if err != nil {
		return err
	}
	b := lmr.Bytes()
	ok := string(b[:len(immMsg)]) == immMsg && allZero(b[len(immMsg):])
	lmr.Free()
	if !ok {
		return fmt.Errorf("the region written with immediate holds %q", b)
	}
	r, err := s.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, 0)
	if err != nil {
		return err
	}
	src, err := s.Alloc(len(fromServer))
	if err != nil {
		return err
	}
	copy(src.Bytes(), fromServer)
	dst, _ := r.Slice(0, len(fromServer))
	err = s.WriteImm(ctx, dst, 125, src.All())
	src.Free()
	if err != nil {
		return err
	}
	if err := s.SendRemoteMR(ctx, r); err != nil {
		return err
	}
	return s.SendImm(ctx, 77, []byte("ok"))
}

const fromServer = "from the server"

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func slicePattern(i int) byte { return byte(i*7 + 1) }

// serveSlices offers a region of 4096 bytes (read, write) and checks, when
// the client is done, that exactly the bytes it wrote changed.
func serveSlices(ctx context.Context, s *Session, _ []string, _ *lines) error {
	local := checkLocalSlices(s) // reported at the end
	mr, err := s.Alloc(4096)
	if err != nil {
		return err
	}
	b := mr.Bytes()
	for i := range b {
		b[i] = slicePattern(i)
	}
	g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, 0)
	if err != nil {
		return err
	}
	if err := expectStr(ctx, s, "done"); err != nil {
		return err
	}
	for i, c := range b {
		want := slicePattern(i)
		if i >= 1000 && i < 4000 {
			want = byte(i * 3)
		}
		if c != want {
			return fmt.Errorf("byte %d of the offered region is %#x, want %#x", i, c, want)
		}
	}
	if err := g.Revoke(ctx); err != nil {
		return err
	}
	mr.Free()
	if local != nil {
		return local
	}
	return sendStr(ctx, s, "ok")
}

// serveAccess offers a region for remote read only, and checks that a
// grant of more than a window allows is refused.
func serveAccess(ctx context.Context, s *Session, _ []string, _ *lines) error {
	mr, err := s.Alloc(64)
	if err != nil {
		return err
	}
	copy(mr.Bytes(), "read me")
	for _, a := range []verbs.Access{verbs.AccessLocalWrite, verbs.AccessRemoteRead | verbs.AccessLocalWrite, 0} {
		if _, err := s.SendLocalMR(ctx, mr, a, 0); !errors.Is(err, ErrAccess) {
			return fmt.Errorf("an offer with access %v: %v, want ErrAccess", a, err)
		}
	}
	g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead, 0)
	if err != nil {
		return err
	}
	if err := expectStr(ctx, s, "done"); err != nil {
		return err
	}
	if b := mr.Bytes(); string(b[:7]) != "read me" || !allZero(b[7:]) {
		return fmt.Errorf("the read-only region holds %q", b)
	}
	if err := g.Revoke(ctx); err != nil {
		return err
	}
	mr.Free()
	return sendStr(ctx, s, "ok")
}

// serveCaps runs on a Listener with MaxGranted 64 KiB: when the client
// holds all of it, an offer of 16 KiB more is refused.
func serveCaps(ctx context.Context, s *Session, _ []string, _ *lines) error {
	if err := expectStr(ctx, s, "offer"); err != nil {
		return err
	}
	mr, err := s.Alloc(16 << 10)
	if err != nil {
		return err
	}
	defer mr.Free()
	if g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead, 0); !errors.Is(err, ErrLimit) {
		if err == nil {
			g.Revoke(ctx)
		}
		return fmt.Errorf("an offer over MaxGranted (%d bytes granted): %v, want ErrLimit", grantedBytes(s), err)
	}
	return sendStr(ctx, s, "ok")
}

// leaseShort is the lease of the lease scenarios.
const leaseShort = 300 * time.Millisecond

// serveLease offers a region for leaseShort; when the client is done
// ("done N": it handed N regions back) it checks the last region handed
// back.
func serveLease(ctx context.Context, s *Session, _ []string, _ *lines) error {
	mr, err := s.Alloc(64)
	if err != nil {
		return err
	}
	mr.Bytes()[0] = 's'
	g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, leaseShort)
	if err != nil {
		return err
	}
	done, err := recvStr(ctx, s)
	if err != nil {
		return err
	}
	var n int
	if _, err := fmt.Sscanf(done, "done %d", &n); err != nil || n < 1 {
		return fmt.Errorf("got %q, want done N", done)
	}
	if err := g.Revoke(ctx); err != nil { // nothing to do if its lease ended
		return err
	}
	mr.Free()
	var c byte
	for range n {
		lmr, err := s.ReceiveLocalMR(ctx)
		if err != nil {
			return err
		}
		c = lmr.Bytes()[0]
		lmr.Free()
	}
	if c != 't' {
		return fmt.Errorf("the region handed back last holds %q, want 't'", c)
	}
	return sendStr(ctx, s, "ok")
}

// serveRawLease offers a region for leaseShort if asked ("offer"), and
// frees it once the grant has ended.
func serveRawLease(ctx context.Context, s *Session, args []string, _ *lines) error {
	if len(args) == 0 || args[0] != "offer" {
		return nil
	}
	mr, err := s.Alloc(64)
	if err != nil {
		return err
	}
	g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, leaseShort)
	if err != nil {
		return err
	}
	if err := verbstest.Until(ctx, func() bool { return !grantLive(g) }); err != nil {
		return fmt.Errorf("the grant of %v did not end: %w", leaseShort, err)
	}
	mr.Free()
	return nil
}

// cancelMessage is message seq of the cancel scenario: every fifth one
// goes by rendezvous.
func cancelMessage(seq uint64) []byte {
	n := 8 + int(seq*53%700)
	if seq%5 == 4 {
		n = defaultMessageSize + 1000
	}
	b := make([]byte, n)
	le.PutUint64(b, seq)
	for i := 8; i < n; i++ {
		b[i] = byte(seq + uint64(i))
	}
	return b
}

// serveCancel echoes the sequence number of every message until "end
// DEFINITE;MAYBE;OFFERED;OFFERMAYBE": the sequence numbers
// (comma-separated) of the messages whose Send returned nil, and of
// those whose Send was cancelled; how many SendLocalMR returned nil, and
// how many were cancelled. It checks that it got each definite message
// exactly once, each maybe one at most once, and nothing else; takes
// the offers (every definite one, maybe some others), reads each (a
// region whose offer was cancelled may be revoked: ErrLeaseExpired, but
// never a broken session) and releases it; waits until it grants nothing
// (the client released every region, and those of cancelled requests);
// and answers "ok" followed by the sequence numbers in the order they
// came.
func serveCancel(ctx context.Context, s *Session, _ []string, _ *lines) error {
	var got []uint64
	for {
		m, err := s.Receive(ctx)
		if err != nil {
			return err
		}
		b := bytes.Clone(m.Bytes())
		m.Release()
		if str, ok := strings.CutPrefix(string(b), "end "); ok {
			f := strings.Split(str, ";")
			if len(f) != 4 {
				return fmt.Errorf("got %q", b)
			}
			count := map[uint64]int{}
			for _, q := range got {
				count[q]++
			}
			for _, q := range parseSeqs(f[0]) {
				if count[q] != 1 {
					return fmt.Errorf("message %d, sent, received %d times", q, count[q])
				}
				delete(count, q)
			}
			for _, q := range parseSeqs(f[1]) {
				if count[q] > 1 {
					return fmt.Errorf("message %d, cancelled, received %d times", q, count[q])
				}
				delete(count, q)
			}
			if len(count) > 0 {
				return fmt.Errorf("messages received that were never sent: %v", count)
			}
			od, _ := strconv.Atoi(f[2])
			om, _ := strconv.Atoi(f[3])
			if err := takeOffers(ctx, s, od, om); err != nil {
				return err
			}
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := verbstest.Until(wctx, func() bool { return grantedBytes(s) == 0 })
			cancel()
			if err != nil {
				return fmt.Errorf("%d bytes still granted to the client, which holds none", grantedBytes(s))
			}
			return sendStr(ctx, s, "ok "+formatSeqs(got))
		}
		if len(b) < 8 || !bytes.Equal(b, cancelMessage(le.Uint64(b))) {
			return fmt.Errorf("a message of %d bytes is none that was sent", len(b))
		}
		q := le.Uint64(b)
		got = append(got, q)
		e := [9]byte{'e'}
		le.PutUint64(e[1:], q)
		if err := s.Send(ctx, e[:]); err != nil {
			return err
		}
	}
}

// takeOffers takes definite offers, and at most maybe more (those that
// come soon), reads and releases each.
func takeOffers(ctx context.Context, s *Session, definite, maybe int) error {
	var offers []*RemoteMR
	for len(offers) < definite {
		r, err := s.ReceiveRemoteMR(ctx)
		if err != nil {
			return fmt.Errorf("offer %d of %d: %w", len(offers), definite, err)
		}
		offers = append(offers, r)
	}
	for range maybe {
		c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		r, err := s.ReceiveRemoteMR(c)
		cancel()
		if err != nil {
			break
		}
		offers = append(offers, r)
	}
	loc, err := s.Alloc(64)
	if err != nil {
		return err
	}
	defer loc.Free()
	revoked := 0
	for i, r := range offers {
		err := s.Read(ctx, loc.All(), r.All())
		if errors.Is(err, ErrLeaseExpired) {
			revoked++
			continue
		}
		if err != nil {
			return fmt.Errorf("read of offer %d (%d definite, %d maybe, %d received, %d revoked): %w", i, definite, maybe, len(offers), revoked, err)
		}
		if !bytes.HasPrefix(loc.Bytes(), []byte("offer")) {
			return fmt.Errorf("offer %d holds %q", i, loc.Bytes())
		}
		if err := r.Release(ctx); err != nil && !errors.Is(err, ErrLeaseExpired) {
			return fmt.Errorf("release of offer %d: %w", i, err)
		}
	}
	if len(offers)-revoked < definite {
		return fmt.Errorf("%d offers received, %d of them revoked; %d SendLocalMR returned nil", len(offers), revoked, definite)
	}
	return nil
}

func formatSeqs(q []uint64) string {
	s := make([]string, len(q))
	for i, v := range q {
		s[i] = strconv.FormatUint(v, 10)
	}
	return strings.Join(s, ",")
}

func parseSeqs(s string) []uint64 {
	var out []uint64
	for _, f := range strings.Split(s, ",") {
		if v, err := strconv.ParseUint(f, 10, 64); err == nil {
			out = append(out, v)
		}
	}
	return out
}

// serveExample is the server of async-rdma's client/server example, one
// round of it per session.
func serveExample(ctx context.Context, s *Session, _ []string, _ *lines) error {
	ones := bytes.Repeat([]byte{1}, 8)
	half := []byte{0, 0, 0, 0, 1, 1, 1, 1}
	// receive_data_from_client
	m, err := s.Receive(ctx)
	if err != nil {
		return err
	}
	got := bytes.Clone(m.Bytes())
	m.Release()
	if !bytes.Equal(got, ones) {
		return fmt.Errorf("received %v, want %v", got, ones)
	}
	// receive_data_with_imm_from_client
	if m, err = s.Receive(ctx); err != nil {
		return err
	}
	got = bytes.Clone(m.Bytes())
	imm, has := m.Imm()
	m.Release()
	if !has || !bytes.Equal(got, bytes.Repeat([]byte{byte(imm)}, 8)) {
		return fmt.Errorf("received %v with imm %d (%v), want the imm 8 times", got, imm, has)
	}
	// read_rmr_from_client
	rr, err := s.ReceiveRemoteMR(ctx)
	if err != nil {
		return err
	}
	lmr, err := s.Alloc(8)
	if err != nil {
		return err
	}
	err = s.Read(ctx, lmr.All(), rr.All())
	got = bytes.Clone(lmr.Bytes())
	lmr.Free()
	if err != nil {
		return err
	}
	if want := []byte{1, 1, 1, 1, 2, 2, 2, 2}; !bytes.Equal(got, want) {
		return fmt.Errorf("read %v of the client's region, want %v", got, want)
	}
	if err := rr.Release(ctx); err != nil {
		return err
	}
	// receive_mr_after_being_written
	if lmr, err = s.ReceiveLocalMR(ctx); err != nil {
		return err
	}
	got = bytes.Clone(lmr.Bytes())
	lmr.Free()
	if !bytes.Equal(got, half) {
		return fmt.Errorf("the region written holds %v, want %v", got, half)
	}
	// receive_mr_after_being_written_with_imm
	if m, err = s.Receive(ctx); err != nil {
		return err
	}
	imm, has = m.Imm()
	isw := m.IsWrite()
	m.Release()
	if !isw || !has || imm != 4 {
		return fmt.Errorf("the write with immediate's notice: write %v imm %d (%v)", isw, imm, has)
	}
	if lmr, err = s.ReceiveLocalMR(ctx); err != nil {
		return err
	}
	got = bytes.Clone(lmr.Bytes())
	lmr.Free()
	if !bytes.Equal(got, half) || got[imm-1] == got[imm] {
		return fmt.Errorf("the region written with immediate holds %v, want %v", got, half)
	}
	// receive_mr_after_being_written_by_cas
	if lmr, err = s.ReceiveLocalMR(ctx); err != nil {
		return err
	}
	got = bytes.Clone(lmr.Bytes())
	lmr.Free()
	if !bytes.Equal(got, ones) {
		return fmt.Errorf("the region swapped holds %v, want %v", got, ones)
	}
	return sendStr(ctx, s, "ok")
}

// RPC requests: op, two operands; the answer is their sum.
const (
	rpcSend  = 's' // the request is the message
	rpcMem   = 'm' // the request is in the offered region; this message tells
	rpcWrite = 'w' // the request is in a region the client requested and handed back
)

func rpcRequest(op byte, a, b uint32) []byte {
	r := make([]byte, 9)
	r[0] = op
	le.PutUint32(r[1:], a)
	le.PutUint32(r[5:], b)
	return r
}

func rpcSum(r []byte) (uint32, error) {
	if len(r) < 9 {
		return 0, fmt.Errorf("a request of %d bytes", len(r))
	}
	return le.Uint32(r[1:]) + le.Uint32(r[5:]), nil
}

// serveRPC is async-rdma's rpc example: requests by message, by write
// into a region the server offered (notified by a message or by the
// write's immediate data), and by a region the client requested, wrote
// and handed back (answered by a region the server offers for the
// client to read). It ends at "end".
func serveRPC(ctx context.Context, s *Session, _ []string, _ *lines) error {
	reqMR, err := s.Alloc(64)
	if err != nil {
		return err
	}
	reqGrant, err := s.SendLocalMR(ctx, reqMR, verbs.AccessRemoteWrite, 0)
	if err != nil {
		return err
	}
	type held struct {
		g  *Grant
		mr LocalMR
	}
	var answers []held
	answer := func(sum uint32) error {
		var b [4]byte
		le.PutUint32(b[:], sum)
		return s.Send(ctx, b[:])
	}
	for {
		m, err := s.Receive(ctx)
		if err != nil {
			return err
		}
		b := bytes.Clone(m.Bytes())
		imm, hasImm := m.Imm()
		isw := m.IsWrite()
		m.Release()
		switch {
		case isw:
			if !hasImm || imm != rpcMem {
				return fmt.Errorf("a write with immediate %d (%v)", imm, hasImm)
			}
			fallthrough
		case len(b) == 1 && b[0] == rpcMem:
			sum, err := rpcSum(reqMR.Bytes())
			if err != nil {
				return err
			}
			if err := answer(sum); err != nil {
				return err
			}
		case len(b) == 9 && b[0] == rpcSend:
			sum, _ := rpcSum(b)
			if err := answer(sum); err != nil {
				return err
			}
		case len(b) == 1 && b[0] == rpcWrite:
			lmr, err := s.ReceiveLocalMR(ctx)
			if err != nil {
				return err
			}
			sum, err := rpcSum(lmr.Bytes())
			lmr.Free()
			if err != nil {
				return err
			}
			resp, err := s.Alloc(4)
			if err != nil {
				return err
			}
			le.PutUint32(resp.Bytes(), sum)
			g, err := s.SendLocalMR(ctx, resp, verbs.AccessRemoteRead, 0)
			if err != nil {
				return err
			}
			answers = append(answers, held{g, resp})
		case string(b) == "end":
			for _, h := range append(answers, held{reqGrant, reqMR}) {
				if err := h.g.Revoke(ctx); err != nil {
					return err
				}
				h.mr.Free()
			}
			return sendStr(ctx, s, "ok")
		default:
			return fmt.Errorf("a request %q", b)
		}
	}
}

// serveIdle: "idle ID GUARD [grant]" offers a region of 4096 bytes (read,
// write) if asked, says "ready ID" on stdout, waits until the session
// ends (at most GUARD seconds) and says "ended ID CLASS" (errClass).
func serveIdle(ctx context.Context, s *Session, args []string, out *lines) error {
	if len(args) < 2 {
		return fmt.Errorf("idle %v: want ID GUARD [grant]", args)
	}
	guard, err := strconv.Atoi(args[1])
	if err != nil {
		return err
	}
	var mr LocalMR
	if len(args) > 2 && args[2] == "grant" {
		if mr, err = s.Alloc(4096); err != nil {
			return err
		}
		if _, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, 0); err != nil {
			return err
		}
	}
	out.println("ready", args[0])
	select {
	case <-s.Done():
	case <-time.After(time.Duration(guard) * time.Second):
	}
	out.println("ended", args[0], errClass(s.Err()))
	if mr.Valid() {
		s.agent.closeGrants() // the grant's window first (the session ended)
		mr.Free()
	}
	return nil
}

// --- the client child ---

func runClientChild() int {
	var cfg Config
	if err := json.Unmarshal([]byte(os.Getenv(envChildConfig)), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "child: config: %v\n", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := Dial(ctx, os.Getenv(envChildAddr), cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "child: %v\n", err)
		return 1
	}
	defer s.Close()
	if err := sendStr(ctx, s, os.Getenv(envChildHello)); err != nil {
		fmt.Fprintf(os.Stderr, "child: %v\n", err)
		return 1
	}
	fmt.Println("connected")
	_, err = s.Receive(ctx)
	fmt.Println("ended", errClass(err))
	return 0
}

// The writeimm scenario: the client writes with immediate data into a
// region the server offers, many times, each write of its own bytes
// (wimmPattern) into a slot of its own; the server checks, as each
// notice arrives, that the bytes are there.
const (
	wimmSlots = 2 * defaultReceiveBuffers // more than the notices a client can have ahead
	wimmSlot  = 16 << 10
)

// wimmIters is how many writes: 2000, 400 in the VM (rxe under QEMU
// takes 10 ms for some; both sides see the same environment).
func wimmIters() int {
	if vmtest.InVM() {
		return 400
	}
	return 2000
}

// wimmSizes are the sizes of the writes, in turn.
var wimmSizes = [...]int{8, 100, 4096, wimmSlot}

// wimmPattern fills b with the bytes of write i.
func wimmPattern(b []byte, i int) {
	for j := range b {
		b[j] = byte(i*7 + j*13 + 1)
	}
}

func serveWriteImm(ctx context.Context, s *Session, _ []string, _ *lines) error {
	mr, err := s.Alloc(wimmSlots * wimmSlot)
	if err != nil {
		return err
	}
	defer mr.Free()
	g, err := s.SendLocalMR(ctx, mr, verbs.AccessRemoteWrite, time.Hour)
	if err != nil {
		return err
	}
	want := make([]byte, wimmSlot)
	for i := range wimmIters() {
		m, err := s.Receive(ctx)
		if err != nil {
			return err
		}
		imm, has := m.Imm()
		isw := m.IsWrite()
		m.Release()
		if !isw || !has || imm != uint32(i) {
			return fmt.Errorf("notice %d: write %v imm %d (%v)", i, isw, imm, has)
		}
		n, off := wimmSizes[i%len(wimmSizes)], (i%wimmSlots)*wimmSlot
		wimmPattern(want[:n], i)
		if got := mr.Bytes()[off : off+n]; !bytes.Equal(got, want[:n]) {
			j := 0
			for got[j] == want[j] {
				j++
			}
			return fmt.Errorf("write %d (%d bytes): byte %d is %#x when its notice arrives, want %#x", i, n, j, got[j], want[j])
		}
	}
	if err := g.Revoke(ctx); err != nil {
		return err
	}
	return sendStr(ctx, s, "ok")
}
