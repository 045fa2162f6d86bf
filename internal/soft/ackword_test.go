package soft

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

func init() { childModes["acktarget"] = ackTargetChild }

// waitUntil polls cond until it holds (true) or hangGuard passes (false).
func waitUntil(cond func() bool) bool {
	for end := time.Now().Add(hangGuard); !cond(); {
		if time.Now().After(end) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// ackTargetChild is a target process with three RC QPs and a region
// that a peer cannot map (its writes and reads go through the ring):
//
//	open               "addr HEX QPN0 QPN1 QPN2 RADDR RKEY"
//	connect HEX Q0 Q1 Q2   connect the QPs: "ok"
//	hold               take the connection's write lock (as a writer of
//	                   this process that waits for room does): "held"
//	waitq N            wait until N items are queued: "queued"
//	release            let the write lock go and wait until a writer took
//	                   the queue: "flushing WORD" (this side's ack word)
//	landed OFF         wait until the region's word at OFF is not 0:
//	                   "landed WORD" (this side's ack word)
func ackTargetChild(in *bufio.Scanner, out io.Writer) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var qps [3]prov.QP
	var c *conn
	var reg *mem.Region
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "open":
			ctx, err := New().Open(DeviceName)
			if err != nil {
				return fail(err)
			}
			pd, err := ctx.AllocPD()
			if err != nil {
				return fail(err)
			}
			cq, err := ctx.CreateCQ(256, nil, 0)
			if err != nil {
				return fail(err)
			}
			for i := range qps {
				if qps[i], err = pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()}); err != nil {
					return fail(err)
				}
			}
			var m prov.MR
			reg, m, _, err = childRegion(pd, 6<<20, false)
			if err != nil {
				return fail(err)
			}
			fmt.Fprintf(out, "addr %s %d %d %d %d %d\n", hex.EncodeToString(qps[0].Address()),
				qps[0].QPN(), qps[1].QPN(), qps[2].QPN(), m.Addr(), m.RKey())
		case "connect":
			addr, err := hex.DecodeString(f[1])
			if err != nil {
				return fail(err)
			}
			for i := range qps {
				qpn, _ := strconv.Atoi(f[2+i])
				if err := connectTo(qps[i], addr, uint32(qpn), 18, 7); err != nil {
					return fail(err)
				}
			}
			fmt.Fprintln(out, "ok")
		case "hold":
			if c = onlyConn(); c == nil {
				return fail(fmt.Errorf("no connection"))
			}
			c.wmu.Lock()
			fmt.Fprintln(out, "held")
		case "waitq":
			n, _ := strconv.Atoi(f[1])
			if !waitUntil(func() bool { return int(c.qlen.Load()) >= n }) {
				return fail(fmt.Errorf("queue: %d items, want %d", c.qlen.Load(), n))
			}
			fmt.Fprintln(out, "queued")
		case "release":
			c.wmu.Unlock()
			if !waitUntil(func() bool { return c.qlen.Load() == 0 }) {
				return fail(fmt.Errorf("nobody took the queue"))
			}
			fmt.Fprintf(out, "flushing %d\n", atomic.LoadUint64(c.acks.mine))
		case "landed":
			off, _ := strconv.Atoi(f[1])
			word := (*uint64)(unsafe.Add(reg.Ptr(), off))
			if !waitUntil(func() bool { return atomic.LoadUint64(word) != 0 }) {
				return fail(fmt.Errorf("no write landed at %d", off))
			}
			fmt.Fprintf(out, "landed %d\n", atomic.LoadUint64(c.acks.mine))
		default:
			return fail(fmt.Errorf("unknown command %q", f[0]))
		}
	}
	return 0
}

// TestAckWordAfterQueuedNAK: over shared memory, a target process
// executes an RDMA write while a response to an earlier request (an RNR
// NAK to a send for which no receive was posted) is still in the batch
// its flusher took off the queue (the ring towards the requester is
// full: the requester is busy), and then dies. The requester completes
// every request up to the id in the target's acknowledgement word as
// acknowledged. The target published the write's id there: publishWrite
// (and ackFirst) judged "nothing waits in the queue" by qlen, which
// flushQueueLocked zeroed before the frames it took were in the ring, and
// the send that was never received completed with SUCCESS. (Found by a
// review of soft0's cross-process paths.)
func TestAckWordAfterQueuedNAK(t *testing.T) {
	forceTransport(t, "shm")
	e := newEnv(t)
	cq := e.cq(256)
	var qps [3]prov.QP
	for i := range qps {
		qps[i] = must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()}))
		q := qps[i]
		t.Cleanup(func() { q.Close() })
	}
	src := e.alloc(4096, allAccess)
	dst := e.alloc(6<<20, allAccess)
	p := testproc.Start(t, envTestChild+"=acktarget", envTransport+"=shm", envPull+"=0")
	p.Send(t, "open")
	f := p.Line(t, "addr")
	addr := must(hex.DecodeString(f[0]))
	raddr := must(strconv.ParseUint(f[4], 10, 64))
	rkey := uint32(must(strconv.ParseUint(f[5], 10, 32)))
	for i := range qps {
		if err := connectTo(qps[i], addr, uint32(must(strconv.Atoi(f[1+i]))), 18, 7); err != nil {
			t.Fatal(err)
		}
	}
	p.Send(t, "connect %s %d %d %d", hex.EncodeToString(qps[0].Address()), qps[0].QPN(), qps[1].QPN(), qps[2].QPN())
	p.Line(t, "ok")
	post := func(i int, wr prov.SendWR, sge prov.SGE) {
		t.Helper()
		wr.NumSGE, wr.Flags = 1, prov.SendSignaled
		if _, err := qps[i].PostSend([]prov.SendWR{wr}, []prov.SGE{sge}); err != nil {
			t.Fatal(err)
		}
	}
	// Warm up: a write on every QP.
	for i := range qps {
		post(i, prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, RemoteAddr: raddr, RKey: rkey}, src.sge(0, 8))
	}
	for _, c := range poll(t, cq, 3) {
		if c.Status != prov.StatusSuccess {
			t.Fatalf("warm-up: %+v", c)
		}
	}
	c := qps[0].(*qp).x.userOf.Load()
	if c == nil || c.shm == nil {
		t.Fatalf("no shared-memory connection: %v", c)
	}
	// This process is busy: its consumer reads nothing for a while.
	c.rmu.Lock()
	locked := true
	defer func() {
		if locked {
			c.rmu.Unlock()
		}
	}()
	p.Send(t, "hold")
	p.Line(t, "held")
	// A read larger than the ring (its response fills it) ...
	post(0, prov.SendWR{WRID: 10, Opcode: prov.WRRead, RemoteAddr: raddr, RKey: rkey}, dst.sge(0, 6<<20))
	p.Send(t, "waitq 1")
	p.Line(t, "queued")
	// ... then a send the target has no receive for: an RNR NAK.
	post(1, prov.SendWR{WRID: 11, Opcode: prov.WRSend}, src.sge(0, 8))
	p.Send(t, "waitq 2")
	p.Line(t, "queued")
	p.Send(t, "release")
	word := p.Line(t, "flushing")[0]
	// A write the target executes (and must not publish: the NAK
	// before it is not in the ring yet).
	binary.LittleEndian.PutUint64(src.b, 0x5752495445)
	post(2, prov.SendWR{WRID: 12, Opcode: prov.WRWrite, RemoteAddr: raddr + 64, RKey: rkey}, src.sge(0, 8))
	p.Send(t, "landed 64")
	if w := p.Line(t, "landed")[0]; w != word {
		t.Logf("the target's ack word went from %s to %s", word, w)
	}
	// The target dies.
	p.Cmd.Process.Kill()
	p.Cmd.Wait()
	locked = false
	c.rmu.Unlock()
	cs := poll(t, cq, 3)
	for _, c := range cs {
		t.Logf("completion %+v", c)
		if c.WRID == 11 && c.Status == prov.StatusSuccess {
			t.Errorf("a send that the target never received (no receive was posted, it answered RNR and died) completed with SUCCESS")
		}
	}
}

// targetConn returns the connection on which the requests of its
// peer arrive at q (the responder's side: x.rev, set by the first
// acknowledged request).
func targetConn(t *testing.T, q prov.QP) *conn {
	t.Helper()
	c := q.(*qp).x.rev.Load()
	if c == nil || c.dead.Load() {
		t.Fatal("no connection for the target")
	}
	return c
}

// ackedPair is two RC QPs of this process over a unix socket with the
// shortest response timeout (and so acknowledgement pages), connected by
// a first write, and regions src (a pattern) and dst of n bytes.
func ackedPair(t *testing.T, n int) (e *env, a, b *ep, src, dst *buf) {
	t.Helper()
	forceTransport(t, "unix")
	forceTLS(t, tlsOff)
	o := defaultConn()
	o.timeout, o.retryCnt = 1, 0 // minRespTimeout
	e, a, b = pair(t, prov.QPTypeRC, o, o)
	src, dst = e.alloc(n, allAccess), e.alloc(n, allAccess)
	for i := range src.b {
		src.b[i] = byte(i%251 + 1)
	}
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
		RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}, []prov.SGE{src.sge(0, 8)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("first write: %+v", c)
	}
	return e, a, b, src, dst
}

// stallTarget returns the connections of requester a (d) and target b
// (tc), with d's socket taking little (its writes wait for the target's
// reads) and tc's socket taken by the test, as a stalled consumer holds
// it: the caller unlocks tc.rmu.
func stallTarget(t *testing.T, a, b *ep) (d, tc *conn) {
	t.Helper()
	d, tc = qpConn(t, a.qp), targetConn(t, b.qp)
	if d.acks == nil || tc.acks == nil {
		t.Skip("no acknowledgement page")
	}
	d.sockControl(func(fd uintptr) { unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, 1) })
	takeSocket(t, tc)
	return d, tc
}

// awaitPlacement drains tc (the test holds its socket) until the
// placement of a write into its region has begun, or skips the test
// after 5 s (setup timing).
func awaitPlacement(t *testing.T, tc *conn) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !tc.sock.pending() {
		if _, err := tc.drain(false); err != nil {
			t.Fatalf("drain: %v", err)
		}
		if time.Now().After(deadline) {
			t.Skip("setup: the write's placement did not begin (rare timing)")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// TestPeerAckedNotSent: over a unix socket, the target
// publishes a placed write's acknowledgement in the acknowledgement page
// when the placement begins (placeStart), before the rest of the payload
// has come. If the requester's connection then fails (its write of the
// payload times out: the target's consumer does not read for a while),
// the requester read the page and completed the write as successful,
// though the payload never fully arrived and the target never executed
// it (the target lives on). A request whose frame was not written whole
// fails now (sendWQE.fcut). (Found by a review of soft0's socket path.)
func TestPeerAckedNotSent(t *testing.T) {
	const n = segMax
	_, a, b, src, dst := ackedPair(t, n)
	clear(dst.b)
	_, tc := stallTarget(t, a, b) // the requester's write waits for the target's reads
	held := true
	defer func() {
		if held {
			tc.rmu.Unlock()
		}
	}()
	postSend(t, a.qp, []prov.SendWR{{WRID: 2, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
		RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}, []prov.SGE{src.sge(0, n)})
	awaitPlacement(t, tc)
	rem := tc.sock.place.rem
	t.Logf("placement begun, %d bytes of the payload still to come; published %d", rem, *tc.acks.mine)
	// The target's consumer is held (a stalled process): the requester's
	// write times out and its connection fails.
	c := poll(t, a.scq, 1)[0]
	tc.rmu.Unlock()
	held = false
	waitState(t, b.qp, prov.QPStateErr)
	t.Logf("write completion: %+v", c)
	if c.Status == prov.StatusSuccess && !bytes.Equal(dst.b, src.b) {
		t.Fatalf("the write completed successfully, but its payload never arrived whole (%d bytes were still to come) and the target did not execute it", rem)
	}
}

// TestPeerAckedAtomic: the requester trusts the peer's
// acknowledgement word (ackpage.go) when its connection fails, even when
// the failure is its own (a write that timed out) and responses of the
// peer still wait unread in its socket: a CAS executed by the target,
// whose response (with the prior value) was sent but not read yet, is
// retired by a made-up acknowledgement whose prior value is 0: the CAS
// completed successfully with a result the target never had. An atomic
// is never retired by the word now. (Found by a review of soft0's socket
// path.)
func TestPeerAckedAtomic(t *testing.T) {
	const n = segMax
	e, a, b, src, dst := ackedPair(t, n)
	loc := e.alloc(4096, allAccess)
	const old, swap = 0x1111111111111111, 0x2222222222222222
	atom := e.alloc(4096, allAccess)
	*(*uint64)(unsafe.Pointer(&atom.b[0])) = old
	d, tc := stallTarget(t, a, b)
	takeSocket(t, d) // the requester's consumer is behind
	heldT, heldD := true, true
	defer func() {
		if heldT {
			tc.rmu.Unlock()
		}
		if heldD {
			d.rmu.Unlock()
		}
	}()
	postSend(t, a.qp, []prov.SendWR{
		{WRID: 2, Opcode: prov.WRAtomicCAS, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: atom.addr(0), RKey: atom.mr.RKey(),
			CompareAdd: old, Swap: swap},
		{WRID: 3, Opcode: prov.WRWrite, NumSGE: 1, SGEIndex: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()},
	}, []prov.SGE{loc.sge(0, 8), src.sge(0, n)})
	awaitPlacement(t, tc)
	if got := *(*uint64)(unsafe.Pointer(&atom.b[0])); got != swap {
		t.Fatalf("the target did not execute the CAS: %#x", got)
	}
	cs := poll(t, a.scq, 2)
	tc.rmu.Unlock()
	heldT = false
	d.rmu.Unlock()
	heldD = false
	res := *(*uint64)(unsafe.Pointer(&loc.b[0]))
	t.Logf("completions %+v; CAS result %#x", cs, res)
	if cs[0].WRID == 2 && cs[0].Status == prov.StatusSuccess && res != old {
		t.Fatalf("the CAS completed successfully with prior value %#x; the target's was %#x", res, old)
	}
}
