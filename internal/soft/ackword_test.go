package soft

import (
	"bufio"
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
