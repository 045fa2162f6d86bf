package soft

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

// Tests of a connection's life and death across processes: what a peer
// that exits, closes, stops or dies leaves behind. The peer is the test
// binary re-executed (child_test.go) in the mode "peer" (peerChild).

func init() { childModes["peer"] = peerChild }

// lifeKinds are the inter-process transports under test ("tls": TCP with
// TLS on loopback).
var lifeKinds = []string{"tcp", "unix", "shm", "tls"}

// lifeEnv is the child's environment for the transport kind.
func lifeEnv(kind string) []string {
	env := []string{envTestChild + "=peer"}
	if kind == "tls" {
		return append(env, envTransport+"=tcp", envTLS+"=on")
	}
	return append(env, envTransport+"="+kind)
}

// forceLife forces the transport kind on this process for the test.
func forceLife(t *testing.T, kind string) {
	t.Helper()
	if kind == "tls" {
		forceTransport(t, "tcp")
		restore, err := ForceTLS("on")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(restore)
		return
	}
	forceTransport(t, kind)
}

// peerSide is the child's soft0 objects: a RC QP with one CQ (on a
// completion channel), and a page of memory.
type peerSide struct {
	ctx prov.Context
	pd  prov.PD
	ch  prov.CompChannel
	cq  prov.CQ
	qp  prov.QP
	reg *mem.Region
	mr  prov.MR
}

func openPeerSide() (*peerSide, error) {
	s := &peerSide{}
	var err error
	if s.ctx, err = New().Open(DeviceName); err != nil {
		return nil, err
	}
	if s.pd, err = s.ctx.AllocPD(); err != nil {
		return s, err
	}
	if s.ch, err = s.ctx.CreateCompChannel(); err != nil {
		return s, err
	}
	if s.cq, err = s.ctx.CreateCQ(256, s.ch, 0); err != nil {
		return s, err
	}
	if s.qp, err = s.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: s.cq, RecvCQ: s.cq, Cap: defaultCaps()}); err != nil {
		return s, err
	}
	if s.reg, err = mem.Alloc(4096, "test", false); err != nil {
		return s, err
	}
	s.mr, err = s.pd.RegMR(prov.Mem{Ptr: s.reg.Ptr(), Len: 4096, FD: s.reg.FD()}, allAccess)
	return s, err
}

func (s *peerSide) close() error {
	var errs []string
	for _, c := range []interface{ Close() error }{s.qp, s.mr, s.cq, s.ch, s.pd, s.ctx} {
		if c == nil || c == prov.QP(nil) || c == prov.MR(nil) || c == prov.CQ(nil) || c == prov.CompChannel(nil) || c == prov.PD(nil) || c == prov.Context(nil) {
			continue
		}
		if err := c.Close(); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if s.reg != nil {
		s.reg.Free()
	}
	if errs != nil {
		return fmt.Errorf("close: %s", strings.Join(errs, "; "))
	}
	return nil
}

// childRegion allocates n bytes of shareable memory and registers them
// in pd with every access, for the parent's RDMA (the child commands
// "region" and "slowregion"); free deregisters and frees them.
func childRegion(pd prov.PD, n int, shared bool) (reg *mem.Region, m prov.MR, free func(), err error) {
	if reg, err = mem.Alloc(mem.RoundUp(n), "test", false); err != nil {
		return nil, nil, nil, err
	}
	fd := reg.FD()
	if !shared {
		fd = -1 // a peer cannot map it: writes into it go through the ring or socket
	}
	if m, err = pd.RegMR(prov.Mem{Ptr: reg.Ptr(), Len: n, FD: fd}, allAccess); err != nil {
		reg.Free()
		return nil, nil, nil, err
	}
	return reg, m, func() { m.Close(); reg.Free() }, nil
}

// connectTo moves q from RESET to RTS, connected to the QP qpn at the
// provider address addr, with the transport timeout and retry count.
func connectTo(q prov.QP, addr []byte, qpn uint32, timeout, retry uint8) error {
	a := prov.QPAttr{State: prov.QPStateInit, Port: 1, Access: allAccess}
	if err := q.Modify(&a, prov.AttrState|prov.AttrPKeyIndex|prov.AttrPort|prov.AttrAccessFlags); err != nil {
		return err
	}
	av := prov.AHAttr{DGID: getFabric().gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1, ProviderAddr: addr}
	r := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: qpn, MaxDestRDAtom: 16, MinRNRTimer: 1, AH: av}
	if err := q.Modify(&r, prov.AttrState|prov.AttrAV|prov.AttrPathMTU|prov.AttrDestQPN|prov.AttrRQPSN|
		prov.AttrMaxDestRDAtom|prov.AttrMinRNRTimer); err != nil {
		return err
	}
	s := prov.QPAttr{State: prov.QPStateRTS, Timeout: timeout, RetryCnt: retry, RNRRetry: 7, MaxRDAtomic: 16}
	return q.Modify(&s, prov.AttrState|prov.AttrSQPSN|prov.AttrTimeout|prov.AttrRetryCnt|prov.AttrRNRRetry|prov.AttrMaxQPRDAtomic)
}

// waitComps collects n completions of cq: polling (spin), or sleeping on
// the completion channel ch.
func waitComps(ctx context.Context, cq prov.CQ, ch prov.CompChannel, n int, spin bool) ([]prov.Completion, error) {
	var out []prov.Completion
	dst := make([]prov.Completion, 16)
	for len(out) < n {
		k, err := cq.Poll(dst[:min(len(dst), n-len(out))])
		if err != nil {
			return out, err
		}
		out = append(out, dst[:k]...)
		if k > 0 || spin {
			if ctx.Err() != nil {
				return out, ctx.Err()
			}
			continue
		}
		if err := cq.Arm(false); err != nil {
			return out, err
		}
		k, err = cq.Poll(dst[:min(len(dst), n-len(out))])
		if err != nil {
			return out, err
		}
		out = append(out, dst[:k]...)
		if k > 0 {
			continue
		}
		if _, err := ch.Wait(ctx); err != nil {
			return out, err
		}
	}
	return out, nil
}

// peerChild is a soft0 process driven by its parent, a command a line:
//
//	open                 open a context with a RC QP: "addr HEX QPN"
//	connect HEX QPN T R  connect the QP (timeout T, retry count R): "ok"
//	recv N               post N receives: "ok"
//	send N               send N messages of 8 bytes, wait for their
//	                     completions: "sent STATUS..."
//	recvexit MODE        wait for one receive completion (MODE poll or
//	                     wait), then exit at once: status 0 if it
//	                     succeeded, without closing anything
//	recvclose MODE       wait for one receive completion, then close
//	                     everything at once: "closed STATUS"
//	writeexit SIZE KIND  register a region of SIZE bytes (KIND memfd:
//	                     memory from mem.Alloc, which a peer over shared
//	                     memory maps and writes directly; heap: Go memory),
//	                     "region ADDR RKEY", and exit at once (status 0,
//	                     closing nothing) when its last 8 bytes hold
//	                     writeMark; status 4 after hangGuard
//	atomicexit           "region ADDR RKEY" of its page, "polling", then
//	                     poll the CQ (an application that waits for
//	                     completions), say "spinning" once the
//	                     connection's reader left it to the polls (its
//	                     grace), and exit at once (status 0, closing
//	                     nothing) when the page's first word is not 0;
//	                     status 4 after hangGuard
//	stall MS             handle nothing from the parent for MS ms while
//	                     keeping a processor busy: "stalling", then
//	                     "resumed"
//	slowregion SIZE MS   register a region of SIZE bytes for the
//	                     parent's RDMA writes, and have the responder
//	                     sleep MS ms before each segment of a message
//	                     but the last: "region ADDR RKEY"
//	sum                  "sum HASH": the FNV-1a hash of slowregion's
//	                     region
//	exit                 exit (status 0)
func peerChild(in *bufio.Scanner, out io.Writer) int {
	var s *peerSide
	var slow []byte // slowregion's
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx := context.Background()
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		arg := func(i int) int {
			if i >= len(f) {
				return 0
			}
			v, _ := strconv.Atoi(f[i])
			return v
		}
		switch f[0] {
		case "open":
			var err error
			if s, err = openPeerSide(); err != nil {
				return fail(err)
			}
			fmt.Fprintf(out, "addr %s %d\n", hex.EncodeToString(s.qp.Address()), s.qp.QPN())
		case "connect":
			addr, err := hex.DecodeString(f[1])
			if err != nil {
				return fail(err)
			}
			if err := connectTo(s.qp, addr, uint32(arg(2)), uint8(arg(3)), uint8(arg(4))); err != nil {
				return fail(err)
			}
			fmt.Fprintln(out, "ok")
		case "region":
			// A region of arg(1) bytes for the parent's RDMA writes
			// (BenchmarkChildWriteBandwidth): "region ADDR RKEY".
			_, m, free, err := childRegion(s.pd, arg(1), true)
			if err != nil {
				return fail(err)
			}
			defer free()
			fmt.Fprintf(out, "region %d %d\n", m.Addr(), m.RKey())
		case "recv":
			for i := range arg(1) {
				wr := []prov.RecvWR{{WRID: uint64(1000 + i), NumSGE: 1}}
				if _, err := s.qp.PostRecv(wr, []prov.SGE{{Addr: s.mr.Addr(), Length: 64, LKey: s.mr.LKey()}}); err != nil {
					return fail(err)
				}
			}
			fmt.Fprintln(out, "ok")
		case "send":
			n := arg(1)
			for i := range n {
				wr := []prov.SendWR{{WRID: uint64(i), Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
				if _, err := s.qp.PostSend(wr, []prov.SGE{{Addr: s.mr.Addr(), Length: 8, LKey: s.mr.LKey()}}); err != nil {
					return fail(err)
				}
			}
			cs, err := waitComps(ctx, s.cq, s.ch, n, false)
			if err != nil {
				return fail(err)
			}
			fmt.Fprintf(out, "sent%s\n", statuses(cs))
		case "recvexit", "recvclose":
			cs, err := waitComps(ctx, s.cq, s.ch, 1, len(f) > 1 && f[1] == "poll")
			if err != nil {
				return fail(err)
			}
			if f[0] == "recvexit" {
				// At once: no Close, no output.
				if cs[0].Status != prov.StatusSuccess {
					os.Exit(3)
				}
				os.Exit(0)
			}
			if err := s.close(); err != nil {
				return fail(err)
			}
			s = nil
			fmt.Fprintf(out, "closed%s\n", statuses(cs))
		case "writeexit":
			n := arg(1)
			var p unsafe.Pointer
			fd := -1
			if f[2] == "memfd" {
				reg, err := mem.Alloc(mem.RoundUp(n), "test", false)
				if err != nil {
					return fail(err)
				}
				p, fd = reg.Ptr(), reg.FD()
			} else {
				p = unsafe.Pointer(unsafe.SliceData(make([]uint64, (n+7)/8)))
			}
			m, err := s.pd.RegMR(prov.Mem{Ptr: p, Len: n, FD: fd}, allAccess)
			if err != nil {
				return fail(err)
			}
			fmt.Fprintf(out, "region %d %d\n", m.Addr(), m.RKey())
			last := (*uint64)(unsafe.Add(p, n-8))
			for end := time.Now().Add(hangGuard); atomic.LoadUint64(last) != writeMark; {
				if time.Now().After(end) {
					os.Exit(4)
				}
			}
			os.Exit(0) // at once: no Close, no output
		case "atomicexit":
			fmt.Fprintf(out, "region %d %d\npolling\n", s.mr.Addr(), s.mr.RKey())
			word := (*uint64)(s.reg.Ptr())
			var dst [16]prov.Completion
			told := false
			for end := time.Now().Add(hangGuard); time.Now().Before(end); {
				if _, err := s.cq.Poll(dst[:]); err != nil {
					return fail(err)
				}
				if atomic.LoadUint64(word) != 0 {
					os.Exit(0) // at once: no Close, no output
				}
				if c := onlyConn(); !told && c != nil && c.grace.Load() {
					fmt.Fprintln(out, "spinning")
					told = true
				}
			}
			os.Exit(4)
		case "stall":
			// Answer nothing for arg(1) ms while running: the QP's
			// responder lock held (the connection's consumer waits for
			// it with the request), a processor kept busy.
			q := s.qp.(*qp)
			q.rmu.Lock()
			fmt.Fprintln(out, "stalling")
			var spin uint64
			for end := time.Now().Add(time.Duration(arg(1)) * time.Millisecond); time.Now().Before(end); {
				for range 1000 {
					spin++
				}
			}
			q.rmu.Unlock()
			if spin == 0 {
				return fail(errors.New("stall: no spin"))
			}
			fmt.Fprintln(out, "resumed")
		case "slowregion":
			reg, m, free, err := childRegion(s.pd, arg(1), arg(3) == 0)
			if err != nil {
				return fail(err)
			}
			defer free()
			slow = reg.Bytes()[:arg(1)]
			getFabric().testSegDelay.Store(int64(time.Duration(arg(2)) * time.Millisecond))
			fmt.Fprintf(out, "region %d %d\n", m.Addr(), m.RKey())
		case "sum":
			h := fnv.New64a()
			h.Write(slow)
			fmt.Fprintf(out, "sum %x\n", h.Sum64())
		case "exit":
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", f[0]))
		}
	}
	return 0
}

func statuses(cs []prov.Completion) string {
	var b strings.Builder
	for _, c := range cs {
		fmt.Fprintf(&b, " %d", c.Status)
	}
	return b.String()
}

// lifeQP is this process' side of a test: a RC QP with its CQ (on a
// completion channel) and a page.
type lifeQP struct {
	qp prov.QP
	cq prov.CQ
	ch prov.CompChannel
	m  *buf
}

func newLifeQP(t *testing.T, e *env) *lifeQP {
	t.Helper()
	ch := must(e.ctx.CreateCompChannel())
	cq := must(e.ctx.CreateCQ(256, ch, 0))
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()}))
	l := &lifeQP{qp: q, cq: cq, ch: ch, m: e.alloc(4096, allAccess)}
	t.Cleanup(func() { l.close(t) })
	return l
}

func (l *lifeQP) close(t *testing.T) {
	if l.qp == nil {
		return
	}
	for _, c := range []interface{ Close() error }{l.qp, l.cq, l.ch} {
		if err := c.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}
	l.qp = nil
}

// connectChild has the child open its side and connects l's QP to it;
// the child's QP is connected back with timeout and retry.
func (l *lifeQP) connectChild(t *testing.T, p *testproc.Proc, timeout, retry uint8) {
	t.Helper()
	p.Send(t, "open")
	f := p.Line(t, "addr")
	addr := must(hex.DecodeString(f[0]))
	qpn := must(strconv.Atoi(f[1]))
	if err := connectTo(l.qp, addr, uint32(qpn), timeout, retry); err != nil {
		t.Fatal(err)
	}
	p.Send(t, "connect %s %d %d %d", hex.EncodeToString(l.qp.Address()), l.qp.QPN(), timeout, retry)
	p.Line(t, "ok")
}

func (l *lifeQP) send(t *testing.T, wrid uint64) {
	t.Helper()
	wr := []prov.SendWR{{WRID: wrid, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
	if _, err := l.qp.PostSend(wr, []prov.SGE{l.m.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
}

func (l *lifeQP) wait(t *testing.T, n int) []prov.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	cs, err := waitComps(ctx, l.cq, l.ch, n, false)
	if err != nil {
		t.Fatalf("%d of %d completions: %v (%+v)", len(cs), n, err, cs)
	}
	return cs
}

// exitRounds and closeRounds are how many times
// TestDeliveredBeforeExit has a peer exit or close right after its
// receive, on each transport. A peer that exits is a process of its own
// (40 ms a round, 200 ms with -race, most of it the start of the test
// binary); one that closes is a long-lived child that opens and closes
// its device context (its service: every connection) each round (15 ms,
// 60 ms with TLS and -race). Against the old code the first few rounds
// failed. GOVERBS_SOFT_TEST_EXIT_ROUNDS and
// GOVERBS_SOFT_TEST_CLOSE_ROUNDS set them (1000 each for the issue's
// "1000 times in a row").
var (
	exitRounds  = 16
	closeRounds = 200
)

// ackTimeout is the transport timeout of TestDeliveredBeforeExit's QPs:
// about a second, so that a loaded host cannot make a response late
// (an acknowledgement that is lost fails the request when the
// connection closes, at once).
const ackTimeout = 18

// TestDeliveredBeforeExit: a peer receives a message and at once exits
// (without closing anything) or closes its device context: the sender
// must see success, every time, on every transport. (soft0 held the
// acknowledgement for a while, to take it along with the next message,
// and lost it when the process exited or closed: the sender saw
// RETRY_EXC_ERR for a message that was delivered.)
func TestDeliveredBeforeExit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts hundreds of processes")
	}
	rounds, crounds := exitRounds, closeRounds
	if v := os.Getenv("GOVERBS_SOFT_TEST_EXIT_ROUNDS"); v != "" {
		rounds = must(strconv.Atoi(v))
	}
	if v := os.Getenv("GOVERBS_SOFT_TEST_CLOSE_ROUNDS"); v != "" {
		crounds = must(strconv.Atoi(v))
	}
	for _, kind := range lifeKinds {
		t.Run(kind, func(t *testing.T) {
			forceLife(t, kind)
			t.Run("Exit", func(t *testing.T) {
				e := newEnv(t)
				children := &childrenAhead{rounds: rounds, env: lifeEnv(kind)}
				for i := 0; i < rounds; i++ {
					p := children.next(t)
					mode := []string{"poll", "wait"}[i%2]
					l := newLifeQP(t, e)
					l.connectChild(t, p, ackTimeout, 7)
					p.Send(t, "recv 1")
					p.Line(t, "ok")
					p.Send(t, "recvexit %s", mode)
					l.send(t, uint64(i))
					c := l.wait(t, 1)[0]
					p.Stop(t) // fails the test unless the child's receive succeeded
					if c.Status != prov.StatusSuccess {
						t.Fatalf("round %d (%s): the peer received the message and exited, the sender saw %+v", i, mode, c)
					}
					l.close(t)
				}
			})
			t.Run("Close", func(t *testing.T) {
				e := newEnv(t)
				p := testproc.Start(t, lifeEnv(kind)...)
				for i := 0; i < crounds; i++ {
					mode := []string{"poll", "wait"}[i%2]
					l := newLifeQP(t, e)
					l.connectChild(t, p, ackTimeout, 7)
					p.Send(t, "recv 1")
					p.Line(t, "ok")
					p.Send(t, "recvclose %s", mode)
					start := time.Now()
					l.send(t, uint64(i))
					c := l.wait(t, 1)[0]
					took := time.Since(start)
					f := p.Line(t, "closed")
					if c.Status != prov.StatusSuccess {
						t.Fatalf("round %d (%s): the peer received the message (status %v) and closed, the sender saw %+v after %v", i, mode, f, c, took)
					}
					l.close(t)
				}
				p.Send(t, "exit")
				p.Stop(t)
			})
		})
	}
}

// TestPeerKilledFlushesReceives: a QP that only waits for receives
// learns that the peer process died: what the peer sent before arrives,
// then the posted receives complete with WR_FLUSH_ERR (the wait for them
// returns), the QP is in ERR and its context reports QP_FATAL for it.
// (soft0 saw the connection close and said nothing: the wait blocked
// forever, as on hardware.)
func TestPeerKilledFlushesReceives(t *testing.T) {
	for _, kind := range lifeKinds {
		t.Run(kind, func(t *testing.T) {
			forceLife(t, kind)
			e := newEnv(t)
			l := newLifeQP(t, e)
			p := testproc.Start(t, lifeEnv(kind)...)
			l.connectChild(t, p, 14, 7)
			const sent, posted = 3, 8
			for i := range posted {
				wr := []prov.RecvWR{{WRID: uint64(100 + i), NumSGE: 1}}
				if _, err := l.qp.PostRecv(wr, []prov.SGE{l.m.sge(64*i, 64)}); err != nil {
					t.Fatal(err)
				}
			}
			p.Send(t, "send %d", sent)
			if f := p.Line(t, "sent"); strings.Join(f, " ") != "0 0 0" {
				t.Fatalf("the peer's sends completed with %v", f)
			}
			if err := p.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			cs := l.wait(t, posted)
			for i, c := range cs {
				want := prov.StatusSuccess
				if i >= sent {
					want = prov.StatusWRFlushErr
				}
				if c.WRID != uint64(100+i) || c.Status != want || c.Opcode != prov.WCRecv || c.QPN != l.qp.QPN() {
					t.Errorf("completion %d: %+v, want wr_id %d, status %v", i, c, 100+i, want)
				}
			}
			if ev := nextEvent(t, e.ctx); ev.Type != evQPFatal || ev.QPN != l.qp.QPN() {
				t.Errorf("event %+v, want QP_FATAL for QP %d", ev, l.qp.QPN())
			}
			if st := state(t, l.qp); st != prov.QPStateErr {
				t.Errorf("QP in %v, want ERR", st)
			}
		})
	}
}

// stopPeer stops the process p (SIGSTOP) and waits until it is stopped;
// it is continued when the test ends.
func stopPeer(t *testing.T, p *testproc.Proc) {
	t.Helper()
	pid := p.Cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
	deadline := time.Now().Add(hangGuard)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Skipf("cannot read the state of process %d: %v", pid, err)
		}
		// pid (comm) state ...: the state follows the last ')'.
		if i := strings.LastIndexByte(string(b), ')'); i > 0 && i+2 < len(b) && b[i+2] == 'T' {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d did not stop", pid)
		}
		time.Sleep(time.Millisecond)
	}
}

// stoppedFor is how long TestPeerStoppedTimeout keeps the peer stopped:
// the request must fail before (the QPs' transport timeouts are well
// below it).
const stoppedFor = 1500 * time.Millisecond

// TestPeerStoppedTimeout: a RC request to a stopped peer fails with
// RETRY_EXC_ERR after the QP's transport timeout × (retry_cnt+1) (at
// least minRespTimeout), while the peer is still stopped, and not
// before. (soft0 waited 2 s whatever the QP's attributes: here the peer
// was continued before, and answered.)
func TestPeerStoppedTimeout(t *testing.T) {
	for _, kind := range lifeKinds {
		t.Run(kind, func(t *testing.T) {
			forceLife(t, kind)
			e := newEnv(t)
			p := testproc.Start(t, lifeEnv(kind)...)
			for _, tc := range []struct{ timeout, retry uint8 }{{10, 0}, {12, 3}, {14, 7}} {
				t.Run(fmt.Sprintf("Timeout%dRetry%d", tc.timeout, tc.retry), func(t *testing.T) {
					want := transportTimeout(tc.timeout) * time.Duration(tc.retry+1)
					l := newLifeQP(t, e)
					l.connectChild(t, p, tc.timeout, tc.retry)
					p.Send(t, "recv 2")
					p.Line(t, "ok")
					// A first message makes sure the connection is up.
					l.send(t, 1)
					if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess {
						t.Fatalf("first send: %+v", c)
					}
					pid := p.Cmd.Process.Pid
					stopPeer(t, p)
					start := time.Now()
					l.send(t, 2)
					cont := time.AfterFunc(stoppedFor, func() { syscall.Kill(pid, syscall.SIGCONT) })
					c := l.wait(t, 1)[0]
					took := time.Since(start)
					stillStopped := cont.Stop()
					syscall.Kill(pid, syscall.SIGCONT)
					t.Logf("%s: transport timeout %v × %d: failed after %v", kind, transportTimeout(tc.timeout), tc.retry+1, took.Round(time.Millisecond))
					if c.Status != prov.StatusRetryExcErr || !stillStopped {
						t.Fatalf("send to a peer stopped for %v: %+v (after %v), want RETRY_EXC_ERR while it is stopped", stoppedFor, c, took)
					}
					if took < want {
						t.Errorf("the send failed after %v, before the transport timeout (%v)", took, want)
					}
				})
			}
			p.Send(t, "exit")
			p.Stop(t)
		})
	}
}

// TestPeerStoppedLargeWrite: a RC write of directMin bytes or more to a
// stopped peer over shared memory fails with RETRY_EXC_ERR while the
// peer is still stopped, as TestPeerStoppedTimeout requires of small
// requests (after the QP's transport timeout twice at most: importRegion).
// The first such write to a region asks the peer for its memfd (callMap),
// which waited for the answer handshakeTimeout (5 s) whatever the QP's
// timeout, before the request even left: the write outlived the peer's
// 1.5 s stop and succeeded once it was continued. (Found by a review of
// soft0's cross-process paths.)
func TestPeerStoppedLargeWrite(t *testing.T) {
	forceLife(t, "shm")
	e := newEnv(t)
	p := testproc.Start(t, lifeEnv("shm")...)
	l := newLifeQP(t, e)
	l.connectChild(t, p, 10, 0) // 4 ms × 1: minRespTimeout
	p.Send(t, "region %d", 64<<10)
	f := p.Line(t, "region")
	raddr, rkey := must(strconv.ParseUint(f[0], 10, 64)), uint32(must(strconv.ParseUint(f[1], 10, 32)))
	src := e.alloc(64<<10, allAccess)
	write := func(wrid uint64, n int) {
		t.Helper()
		wr := []prov.SendWR{{WRID: wrid, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: raddr, RKey: rkey}}
		if _, err := l.qp.PostSend(wr, []prov.SGE{src.sge(0, n)}); err != nil {
			t.Fatal(err)
		}
	}
	// A small write first: the connection is up, the QP acknowledged.
	write(1, 8)
	if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("first write: %+v", c)
	}
	pid := p.Cmd.Process.Pid
	stopPeer(t, p)
	start := time.Now()
	write(2, 32<<10)
	cont := time.AfterFunc(stoppedFor, func() { syscall.Kill(pid, syscall.SIGCONT) })
	c := l.wait(t, 1)[0]
	took := time.Since(start)
	stillStopped := cont.Stop()
	syscall.Kill(pid, syscall.SIGCONT)
	if c.Status != prov.StatusRetryExcErr || !stillStopped {
		t.Fatalf("32 KiB write to a peer stopped for %v (QP timeout %v): %+v after %v, want RETRY_EXC_ERR while it is stopped",
			stoppedFor, l.qp.(*qp).respTimeout(), c, took.Round(time.Millisecond))
	}
	p.Send(t, "exit")
	p.Stop(t)
}

// TestSlowPeerNotDeclaredDead: a peer that is alive but gets the CPU
// only now and then (stopped 20 ms out of every 40) is not declared dead
// by a QP with the shortest transport timeout: soft0 waits at least
// minRespTimeout, as the peer's goroutines, unlike a NIC, need the CPU to
// answer.
func TestSlowPeerNotDeclaredDead(t *testing.T) {
	for _, kind := range lifeKinds {
		t.Run(kind, func(t *testing.T) {
			forceLife(t, kind)
			e := newEnv(t)
			p := testproc.Start(t, lifeEnv(kind)...)
			l := newLifeQP(t, e)
			l.connectChild(t, p, 1, 0)
			const n = 30
			p.Send(t, "recv %d", n)
			p.Line(t, "ok")
			pid := p.Cmd.Process.Pid
			done := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer syscall.Kill(pid, syscall.SIGCONT)
				for {
					syscall.Kill(pid, syscall.SIGSTOP)
					time.Sleep(20 * time.Millisecond)
					syscall.Kill(pid, syscall.SIGCONT)
					select {
					case <-done:
						return
					case <-time.After(20 * time.Millisecond):
					}
				}
			}()
			for i := range n {
				// Every 7 ms: many a message finds the peer stopped.
				time.Sleep(7 * time.Millisecond)
				l.send(t, uint64(i))
				if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess {
					close(done)
					wg.Wait()
					t.Fatalf("send %d to a slow peer: %+v", i, c)
				}
			}
			close(done)
			wg.Wait()
			p.Send(t, "exit")
			p.Stop(t)
		})
	}
}

// TestStarvedPeerNotDeclaredDead: a peer process on this host that
// handles nothing for longer than the response timeout but runs (as a
// peer does that gets a processor only now and then on an oversubscribed
// host) is not declared dead: its processor time moves (peerlife.go).
// Its connection's consumers are held for stallFor, far longer than the
// QP's transport timeout (at least minRespTimeout); the send must
// succeed once the peer handles it. soft0 failed it with RETRY_EXC_ERR
// after minRespTimeout. TCP peers may be on other hosts: their
// processor time is not known, and they are not tested here.
func TestStarvedPeerNotDeclaredDead(t *testing.T) {
	const stallFor = 1500 // ms
	for _, kind := range localKinds {
		t.Run(kind, func(t *testing.T) {
			p, l := localLife(t, kind)
			l.connectChild(t, p, 10, 0)
			p.Send(t, "recv 2")
			p.Line(t, "ok")
			l.send(t, 1)
			if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("first send: %+v", c)
			}
			p.Send(t, "stall %d", stallFor)
			p.Line(t, "stalling")
			l.send(t, 2)
			c := l.wait(t, 1)[0]
			p.Line(t, "resumed")
			if c.Status != prov.StatusSuccess {
				t.Fatalf("send to a peer that ran but handled nothing for %d ms: %+v, want success once it handles it", stallFor, c)
			}
			p.Send(t, "exit")
			p.Stop(t)
		})
	}
}

// TestNotReadyPeerWaitedFor: a request to a QP that its process (on
// this host, alive) has not moved to RTR yet waits for it longer than the
// QP's retry count of transport timeouts, as the ranks of a large job on
// a busy host connect their QPs one after the other after telling their
// endpoints. soft0 failed it with RETRY_EXC_ERR after retry_cnt + 1
// transport timeouts (8 ms here).
func TestNotReadyPeerWaitedFor(t *testing.T) {
	for _, kind := range localKinds {
		t.Run(kind, func(t *testing.T) {
			p, l := localLife(t, kind)
			p.Send(t, "open")
			f := p.Line(t, "addr")
			addr := must(hex.DecodeString(f[0]))
			if err := connectTo(l.qp, addr, uint32(must(strconv.Atoi(f[1]))), 10, 1); err != nil {
				t.Fatal(err)
			}
			l.send(t, 1) // the peer's QP is in RESET
			time.Sleep(500 * time.Millisecond)
			p.Send(t, "connect %s %d %d %d", hex.EncodeToString(l.qp.Address()), l.qp.QPN(), 10, 1)
			p.Line(t, "ok")
			p.Send(t, "recv 1")
			p.Line(t, "ok")
			if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("send to a QP that reached RTR 500 ms later: %+v, want success", c)
			}
			p.Send(t, "exit")
			p.Stop(t)
		})
	}
}

// localKinds are the transports whose peer process is known to run on
// this host (peerlife.go).
var localKinds = []string{"unix", "shm"}

// localLife starts a peer child over kind and a QP of this process to
// talk to it.
func localLife(t *testing.T, kind string) (*testproc.Proc, *lifeQP) {
	t.Helper()
	forceLife(t, kind)
	e := newEnv(t)
	p := testproc.Start(t, lifeEnv(kind)...)
	return p, newLifeQP(t, e)
}

// writeMark is what TestWrittenBeforeExit writes at the end of the
// child's region.
const writeMark = 0x5752495445455849

// TestWrittenBeforeExit: a peer sees an RDMA write land in its memory
// and at once exits, without closing anything: the writer must see
// success, every time (a NIC acknowledges whatever its process does
// next). soft0 held the write's acknowledgement and lost it with the
// process: the writer saw RETRY_EXC_ERR for a write that was executed.
// Over the transports and paths that publish the acknowledgement before
// the payload lands (ackpage.go, Writes): a small write (copied by the
// responder), over unix and shared memory; over unix a large one (placed
// into the region from the socket, place.go); over shared memory a large
// one into Go memory (pulled by the responder, cma.go) and into a memfd
// (copied by the requester once acknowledged, shm.go).
// GOVERBS_SOFT_TEST_EXIT_ROUNDS sets the rounds (1000 for "1000 times in
// a row").
func TestWrittenBeforeExit(t *testing.T) {
	if testing.Short() {
		t.Skip("starts dozens of processes")
	}
	rounds := exitRounds
	if v := os.Getenv("GOVERBS_SOFT_TEST_EXIT_ROUNDS"); v != "" {
		rounds = must(strconv.Atoi(v))
	}
	for _, tc := range []struct {
		kind, mem string
		size      int
	}{
		{"unix", "heap", 64},
		{"unix", "heap", 1 << 20},
		{"shm", "heap", 64},
		{"shm", "heap", pullMin},
		{"shm", "memfd", pullMin},
	} {
		t.Run(fmt.Sprintf("%s/%s/%d", tc.kind, tc.mem, tc.size), func(t *testing.T) {
			forceLife(t, tc.kind)
			e := newEnv(t)
			src := e.alloc(tc.size, allAccess)
			binary.LittleEndian.PutUint64(src.b[tc.size-8:], writeMark)
			children := &childrenAhead{rounds: rounds, env: lifeEnv(tc.kind)}
			for i := 0; i < rounds; i++ {
				p := children.next(t)
				l := newLifeQP(t, e)
				l.connectChild(t, p, ackTimeout, 7)
				p.Send(t, "writeexit %d %s", tc.size, tc.mem)
				f := p.Line(t, "region")
				addr, rkey := must(strconv.ParseUint(f[0], 10, 64)), must(strconv.ParseUint(f[1], 10, 32))
				wr := []prov.SendWR{{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: addr, RKey: uint32(rkey)}}
				if _, err := l.qp.PostSend(wr, []prov.SGE{src.sge(0, tc.size)}); err != nil {
					t.Fatal(err)
				}
				c := l.wait(t, 1)[0]
				p.Stop(t) // fails the test unless the child saw the write
				if c.Status != prov.StatusSuccess {
					t.Fatalf("round %d: the peer saw the write land and exited, the writer saw %+v", i, c)
				}
				l.close(t)
			}
		})
	}
}

// onlyConn returns a connection of the process' service (the only one,
// in a child with one peer), or nil.
func onlyConn() *conn {
	s := getFabric().svc.Load()
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		return c
	}
	return nil
}

// TestAtomicBeforeExit: a peer that polls its CQ sees a remote atomic
// land in its memory and at once exits, closing nothing: the requester
// must see success with the prior value, as TestWrittenBeforeExit
// requires of writes (a NIC answers whatever its process does next).
// The peer's polls handle the atomic while its connection's reader is in
// its grace (progress.go). soft0 held an atomic's response there, as a
// write's acknowledgement is held, but an atomic cannot be published in
// the acknowledgement page: the response died with the process, and the
// requester saw RETRY_EXC_ERR for an atomic that was executed (over
// shared memory every time; now its response leaves at once).
func TestAtomicBeforeExit(t *testing.T) {
	for _, kind := range []string{"tcp", "unix", "shm"} { // (a TLS connection has no grace)
		t.Run(kind, func(t *testing.T) {
			forceLife(t, kind)
			e := newEnv(t)
			for round := range 3 {
				p := testproc.Start(t, lifeEnv(kind)...)
				l := newLifeQP(t, e)
				l.connectChild(t, p, ackTimeout, 7)
				p.Send(t, "atomicexit")
				f := p.Line(t, "region")
				addr, rkey := must(strconv.ParseUint(f[0], 10, 64)), uint32(must(strconv.ParseUint(f[1], 10, 32)))
				p.Line(t, "polling")
				// Writes beside the word while the child polls, until
				// its reader leaves the connection to the polls.
				stop := make(chan struct{})
				werr := make(chan error, 1)
				go func() {
					for i := uint64(1); ; i++ {
						select {
						case <-stop:
							werr <- nil
							return
						default:
						}
						wr := []prov.SendWR{{WRID: i, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: addr + 64, RKey: rkey}}
						if _, err := l.qp.PostSend(wr, []prov.SGE{l.m.sge(0, 8)}); err != nil {
							werr <- err
							return
						}
						ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
						cs, err := waitComps(ctx, l.cq, l.ch, 1, false)
						cancel()
						if err == nil && cs[0].Status != prov.StatusSuccess {
							err = fmt.Errorf("write: %+v", cs[0])
						}
						if err != nil {
							werr <- err
							return
						}
					}
				}()
				p.Line(t, "spinning")
				close(stop)
				if err := <-werr; err != nil {
					t.Fatal(err)
				}
				binary.LittleEndian.PutUint64(l.m.b[8:], 0)
				wr := []prov.SendWR{{WRID: 100, Opcode: prov.WRAtomicFAA, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: addr, RKey: rkey, CompareAdd: 5}}
				if _, err := l.qp.PostSend(wr, []prov.SGE{l.m.sge(8, 8)}); err != nil {
					t.Fatal(err)
				}
				c := l.wait(t, 1)[0]
				p.Stop(t) // fails the test unless the child saw the atomic land
				if c.Status != prov.StatusSuccess {
					t.Fatalf("round %d: the peer saw the atomic land and exited; the requester saw %+v, want SUCCESS", round, c)
				}
				if v := binary.LittleEndian.Uint64(l.m.b[8:]); v != 0 {
					t.Fatalf("round %d: the atomic's prior value %d, want 0", round, v)
				}
				l.close(t)
			}
		})
	}
}

// childrenAhead starts the child processes of a test's rounds, one a
// round, a few rounds ahead: most of a round is the start of a process,
// which runs meanwhile.
type childrenAhead struct {
	rounds  int
	env     []string
	started int
	queue   []*testproc.Proc
}

// next returns the child of the next round.
func (c *childrenAhead) next(t *testing.T) *testproc.Proc {
	t.Helper()
	const ahead = 4
	for len(c.queue) < ahead && c.started < c.rounds {
		c.queue = append(c.queue, testproc.Start(t, c.env...))
		c.started++
	}
	p := c.queue[0]
	c.queue = c.queue[1:]
	return p
}
