package soft

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

// Memory amplification by an authenticated peer: a process that a peer
// has connected to holds, for anything the peer sends or asks, no more
// than a bounded amount of memory, and gives it back when the connection
// ends. The target runs in a child process (the test binary re-executed,
// see rssChild) so that its RSS and peak RSS (VmRSS, VmHWM) measure the
// soft service alone; the test process is the attacker, a raw peer that
// completed the handshake (rawDial) and poses as the QP the child's QP is
// connected to.

// rssRegion is the size of the child's registered region: room for a
// write of more than 256 MiB.
const rssRegion = 256<<20 + 1<<20

// The bounds. The child's baseline is its RSS once its region is
// registered and written (so the region is in it) and its heap collected.
//
//   - Peak: the baseline and rssSlack. The service may hold, per
//     connection, its receive buffer (sockRxSize: 1 MiB), the send
//     queue (maxQueued: 16 MiB of frames and queued read responses), a
//     segment buffer for the flusher (256 KiB), and the buffer pool
//     (bufPoolMax: 8 MiB); the Go heap may grow to twice its live size
//     before a collection. 48 MiB covers that with a margin for the
//     runtime (and the race detector's shadow of what the heap uses).
//     The old code reached the size of the messages several times over.
//   - After the connection closed (and debug.FreeOSMemory, which returns
//     the freed heap to the OS at once instead of over minutes):
//     the baseline and rssAfterSlack, for what the pool keeps (8 MiB)
//     and the runtime's own caches.
//
// With the race detector, the shadow memory of what the heap used (about
// three times as much) is in RSS too, and is never given back: both
// bounds get 48 MiB more.
const (
	rssSlack      = 48 << 20
	rssAfterSlack = 16 << 20
	rssRaceSlack  = 48 << 20
)

// raceBuild reports whether the test binary has the race detector.
func raceBuild() bool {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "-race" {
				return s.Value == "true"
			}
		}
	}
	return false
}

// rssTarget is what the child tells the attacker.
type rssTarget struct {
	addr     []byte // the child's provider address
	qpn      uint32
	fabric   uint64 // the fabric id the child's QP is connected to
	srcQPN   uint32 // the QPN it is connected to
	raddr    uint64 // the region
	rkey     uint32
	rss, hwm int64 // baseline, in bytes
	p        *testproc.Proc
}

// TestAmplification attacks a soft service in a child process over a raw,
// authenticated connection, and checks the child's memory: its peak RSS
// stays within rssSlack of its baseline (the registered region included),
// and its RSS comes back within rssAfterSlack once the connection closed.
func TestAmplification(t *testing.T) {
	if testing.Short() {
		t.Skip("moves hundreds of MiB")
	}
	for _, tc := range []struct {
		name   string
		attack func(t *testing.T, p *rawPeer, tg *rssTarget)
	}{
		// The attack of the issue: a frame declaring 2 GiB, then 400 MiB
		// of payload. The old service grew a buffer as they came (938 MB
		// RSS); now no frame may be larger than maxFrame, and the
		// connection is dropped at the header.
		{"HugeFrame", func(t *testing.T, p *rawPeer, tg *rssTarget) {
			var h [hdrLen + reqBodyLen]byte
			putHdr(h[:], frReq, reqBodyLen+maxMsgSize, p.nextID())
			req := p.req(opWrite, tg.raddr, tg.rkey, maxMsgSize)
			putReq(h[hdrLen:], &req, 0)
			if _, err := p.nc.Write(h[:]); err != nil {
				t.Fatal(err)
			}
			chunk := make([]byte, 1<<20)
			for range 400 {
				if _, err := p.nc.Write(chunk); err != nil {
					break // dropped: what the test wants
				}
			}
		}},
		// Large writes, 400 MiB in all: a message of more than 256 MiB
		// into the region (written in place, segment by segment), and one
		// of 144 MiB past its end (refused at its first segment, the rest
		// dropped as it comes).
		{"LargeWrites", func(t *testing.T, p *rawPeer, tg *rssTarget) {
			n := 256<<20 + 4096
			p.write(t, tg.raddr, tg.rkey, n)
			if r := p.resp(t); r.code != respACK {
				t.Fatalf("write of %d bytes: response %d, want ACK", n, r.code)
			}
			p.write(t, tg.raddr+rssRegion-4096, tg.rkey, 144<<20)
			if r := p.resp(t); r.code != respAccess {
				t.Fatalf("write past the region: response %d, want a remote access NAK", r.code)
			}
		}},
		// Large reads of the region, their data read by the attacker.
		{"LargeReads", func(t *testing.T, p *rawPeer, tg *rssTarget) {
			for range 2 {
				p.read(t, tg.raddr, tg.rkey, 256<<20)
				if n, r := p.readData(t); r.code != respACK || n != 256<<20 {
					t.Fatalf("read: %d bytes, response %d", n, r.code)
				}
			}
		}},
		// Reads whose responses the attacker never reads: 4096 reads of
		// 1 MiB (4 GiB), then 200000 of 4 KiB. The service queues what
		// the socket does not take, up to maxQueued, and then drops the
		// connection.
		{"UnreadReads", func(t *testing.T, p *rawPeer, tg *rssTarget) {
			for i := range 4096 {
				p.read(t, tg.raddr+uint64(i%128)<<20, tg.rkey, 1<<20)
			}
			for i := range 200000 {
				if !p.tryRead(tg.raddr+uint64(i%1024)<<12, tg.rkey, 4096) {
					break // dropped
				}
			}
			// Let the service take it all in before the connection
			// closes.
			tg.report(t, "rss")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := startRSSChild(t)
			p := &rawPeer{nc: guardedConn{rawDial(t, tg.addr, "tcp", tg.fabric)}, qpn: tg.qpn, srcQPN: tg.srcQPN}
			tc.attack(t, p, tg)
			p.nc.Close()
			rss, hwm := tg.report(t, "idle")
			t.Logf("baseline %d MiB; peak %d MiB (+%d); after %d MiB (+%d)", tg.rss>>20, hwm>>20, (hwm-tg.rss)>>20,
				rss>>20, (rss-tg.rss)>>20)
			slack, after := int64(rssSlack), int64(rssAfterSlack)
			if raceBuild() {
				slack += rssRaceSlack
				after += rssRaceSlack
			}
			if hwm > tg.rss+slack {
				t.Errorf("peak RSS %d MiB: more than %d MiB above the baseline of %d MiB", hwm>>20, slack>>20, tg.rss>>20)
			}
			if rss > tg.rss+after {
				t.Errorf("RSS %d MiB after the connection closed: more than %d MiB above the baseline of %d MiB",
					rss>>20, after>>20, tg.rss>>20)
			}
			tg.stop(t)
		})
	}
}

// --- the attacker ---

// guardedConn bounds each of its reads and writes by hangGuard, where
// rawDial's deadline bounds the whole connection: an attack moves hundreds
// of MiB, which the race detector on a loaded machine (CI: 2 processors,
// every package's tests beside) did not always move in hangGuard (a
// segment write or a response read of LargeWrites and LargeReads failed
// with "i/o timeout" 20 s after the dial, the service still working). A
// service that stops taking or answering still fails the attack
// hangGuard after its last progress.
type guardedConn struct{ net.Conn }

func (c guardedConn) Read(b []byte) (int, error) {
	c.SetReadDeadline(time.Now().Add(hangGuard))
	return c.Conn.Read(b)
}

func (c guardedConn) Write(b []byte) (int, error) {
	c.SetWriteDeadline(time.Now().Add(hangGuard))
	return c.Conn.Write(b)
}

// rawPeer speaks frames on an authenticated connection as the QP srcQPN
// that the target QP qpn is connected to.
type rawPeer struct {
	nc     net.Conn
	qpn    uint32
	srcQPN uint32
	psn    uint32
	id     uint64
	buf    []byte // segMax bytes of payload
	data   []byte // where readData puts read data (if large enough)
	lastID uint64 // the id of the last response readData read
	uc     bool   // the QPs are UC (no responses)
}

func (p *rawPeer) nextID() uint64 {
	p.id++
	return p.id
}

func (p *rawPeer) req(op reqOp, raddr uint64, rkey uint32, n uint32) request {
	typ := prov.QPTypeRC
	if p.uc {
		typ = prov.QPTypeUC
	}
	return request{op: op, qpType: uint8(typ), srcQPN: p.srcQPN, dstQPN: p.qpn, psn: p.psn,
		npkts: max(1, (n+4095)/4096), mtu: 4096, length: n, raddr: raddr, rkey: rkey}
}

// flags are the request flags of the peer's QP type.
func (p *rawPeer) flags() uint8 {
	if p.uc {
		return reqNoResp
	}
	return 0
}

// write sends a write of n bytes of pattern, in segments.
func (p *rawPeer) write(t *testing.T, raddr uint64, rkey uint32, n int) {
	t.Helper()
	req, id := p.msg(opWrite, raddr, rkey, n)
	for off := 0; off < n; off += segMax {
		p.seg(t, &req, id, off)
	}
}

// msg starts a message of n bytes: its request (with the next PSN) and
// id. The PSN moves past it.
func (p *rawPeer) msg(op reqOp, raddr uint64, rkey uint32, n int) (request, uint64) {
	req := p.req(op, raddr, rkey, uint32(n))
	p.psn = (p.psn + req.npkts) & psnMask
	return req, p.nextID()
}

// seg sends the segment of the message req at off: the bytes of pattern
// from off on.
func (p *rawPeer) seg(t *testing.T, req *request, id uint64, off int) {
	t.Helper()
	if err := p.trySeg(req, id, off); err != nil {
		t.Fatalf("write segment at %d: %v", off, err)
	}
}

// pattern is the byte at off of the messages rawPeer sends.
func pattern(off int) byte { return byte(off*7 + off>>12) }

// read sends a read request of n bytes.
func (p *rawPeer) read(t *testing.T, raddr uint64, rkey uint32, n uint32) {
	t.Helper()
	if !p.tryRead(raddr, rkey, n) {
		t.Fatal("read request: the connection was dropped")
	}
}

func (p *rawPeer) tryRead(raddr uint64, rkey uint32, n uint32) bool {
	req := p.req(opRead, raddr, rkey, n)
	var h [hdrLen + reqBodyLen]byte
	putHdr(h[:], frReq, reqBodyLen, p.nextID())
	putReq(h[hdrLen:], &req, 0)
	p.psn = (p.psn + req.npkts) & psnMask
	_, err := p.nc.Write(h[:])
	return err == nil
}

// resp reads a response without data.
func (p *rawPeer) resp(t *testing.T) response {
	t.Helper()
	n, r := p.readData(t)
	if n != 0 {
		t.Fatalf("a response with %d bytes of data", n)
	}
	return r
}

// readData reads the response to one request: the segments of read data
// up to the last, whose response it returns with the number of bytes.
// The data goes to p.data if it is large enough; p.lastID is the id.
func (p *rawPeer) readData(t *testing.T) (int, response) {
	t.Helper()
	var h [hdrLen + respBodyLen]byte
	total := 0
	for {
		if _, err := io.ReadFull(p.nc, h[:hdrLen]); err != nil {
			t.Fatalf("read response: %v", err)
		}
		fh, err := parseHdr(h[:hdrLen])
		if err == nil && (fh.typ == frWake || fh.typ == frPullProbe || fh.typ == frAlive) {
			// A wake-up of the QP it stands for, the service's
			// question whether this peer could read it (unix sockets,
			// cma.go; unanswered: nothing is pulled), or its sign of
			// life while it takes a long message (conn.showLife):
			// skipped.
			if _, err := io.CopyN(io.Discard, p.nc, int64(fh.length)); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err != nil || fh.typ != frResp {
			t.Fatalf("response header %+v: %v", fh, err)
		}
		if _, err := io.ReadFull(p.nc, h[hdrLen:]); err != nil {
			t.Fatalf("read response: %v", err)
		}
		n := int(fh.length) - respBodyLen
		var r response
		if _, err := parseResp(h[hdrLen:], uint32(n), &r); err != nil {
			t.Fatal(err)
		}
		if total+n <= len(p.data) {
			_, err = io.ReadFull(p.nc, p.data[total:total+n])
		} else {
			_, err = io.CopyN(io.Discard, p.nc, int64(n))
		}
		if err != nil {
			t.Fatalf("read data: %v", err)
		}
		if n > 0 && (r.orig != uint64(total) || total > 0 && fh.id != p.lastID) {
			t.Fatalf("data segment at %d of request %d after %d bytes of request %d", r.orig, fh.id, total, p.lastID)
		}
		p.lastID = fh.id
		total += n
		if !r.more {
			return total, r
		}
	}
}

// --- the target ---

// startRSSChild starts the child and reads its target description.
func startRSSChild(t *testing.T) *rssTarget {
	t.Helper()
	tg := &rssTarget{p: testproc.Start(t, envTestChild+"=rss")}
	f := tg.p.Line(t, "ready")
	if len(f) != 8 {
		t.Fatalf("child: %q", f)
	}
	tg.addr = must(hex.DecodeString(f[0]))
	tg.qpn = uint32(must(strconv.ParseUint(f[1], 10, 32)))
	tg.fabric = must(strconv.ParseUint(f[2], 10, 64))
	tg.srcQPN = uint32(must(strconv.ParseUint(f[3], 10, 32)))
	tg.raddr = must(strconv.ParseUint(f[4], 10, 64))
	tg.rkey = uint32(must(strconv.ParseUint(f[5], 10, 32)))
	tg.rss = must(strconv.ParseInt(f[6], 10, 64))
	tg.hwm = must(strconv.ParseInt(f[7], 10, 64))
	return tg
}

// report asks the child for its RSS and peak RSS (cmd "rss": now; "idle":
// once it has no connection, after returning the freed heap to the OS).
func (tg *rssTarget) report(t *testing.T, cmd string) (rss, hwm int64) {
	t.Helper()
	tg.p.Send(t, "%s", cmd)
	f := tg.p.Line(t, "mem")
	if len(f) != 2 {
		t.Fatalf("child: %q", f)
	}
	return must(strconv.ParseInt(f[0], 10, 64)), must(strconv.ParseInt(f[1], 10, 64))
}

func (tg *rssTarget) stop(t *testing.T) { tg.p.Stop(t) }

// rssChild is the child (mode "rss"): a QP connected to a made-up peer, a
// registered region, and commands on stdin. It returns the exit status.
func rssChild(in *bufio.Scanner, out io.Writer) int {
	if err := serveRSSChild(in, out); err != nil {
		fmt.Fprintln(os.Stderr, "rss child:", err)
		return 1
	}
	return 0
}

func serveRSSChild(in *bufio.Scanner, out io.Writer) error {
	ctx, err := New().Open(DeviceName)
	if err != nil {
		return err
	}
	defer ctx.Close()
	pd, err := ctx.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	cq, err := ctx.CreateCQ(16, nil, 0)
	if err != nil {
		return err
	}
	defer cq.Close()
	q, err := pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()})
	if err != nil {
		return err
	}
	defer q.Close()
	r, err := mem.Alloc(rssRegion, "rss", false)
	if err != nil {
		return err
	}
	defer r.Free()
	m, err := pd.RegMR(prov.Mem{Ptr: r.Ptr(), Len: rssRegion, FD: -1}, allAccess)
	if err != nil {
		return err
	}
	defer m.Close()
	b := r.Bytes()
	for i := 0; i < len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], uint64(i))
	}

	// Connect to a QP of a made-up process: the attacker poses as it.
	pa, err := parseAddr(q.Address())
	if err != nil {
		return err
	}
	fake := fakeProcOf(pa.fabric ^ 0xdead).addr()
	const fakeQPN = 0x77
	o := defaultConn()
	init := prov.QPAttr{State: prov.QPStateInit, Port: 1, Access: o.access}
	if err := q.Modify(&init, prov.AttrState|prov.AttrPKeyIndex|prov.AttrPort|prov.AttrAccessFlags); err != nil {
		return err
	}
	av := prov.AHAttr{DGID: getFabric().gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1,
		ProviderAddr: encodePeerAddr(&fake)}
	rtr := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: fakeQPN, MaxDestRDAtom: 16, MinRNRTimer: 1, AH: av}
	if err := q.Modify(&rtr, prov.AttrState|prov.AttrAV|prov.AttrPathMTU|prov.AttrDestQPN|prov.AttrRQPSN|
		prov.AttrMaxDestRDAtom|prov.AttrMinRNRTimer); err != nil {
		return err
	}

	rss, hwm, err := childMem(true)
	if err != nil {
		return err
	}
	// The peak from here on (Linux 4.0 and later; else the peak of the
	// setup, which is about the baseline, stays).
	os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
	fmt.Fprintf(out, "ready %x %d %d %d %d %d %d %d\n", q.Address(), q.QPN(), fake.fabric, fakeQPN,
		m.Addr(), m.RKey(), rss, hwm)
	for in.Scan() {
		switch in.Text() {
		case "rss":
		case "idle":
			if err := waitNoConns(); err != nil {
				return err
			}
		default:
			return fmt.Errorf("command %q", in.Text())
		}
		rss, hwm, err := childMem(in.Text() == "idle")
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "mem %d %d\n", rss, hwm)
	}
	return in.Err()
}

// waitNoConns waits until the service of the process has no connection.
func waitNoConns() error {
	s := getFabric().svc.Load()
	if s == nil {
		return nil
	}
	deadline := time.Now().Add(hangGuard)
	for {
		s.mu.Lock()
		n := len(s.conns)
		s.mu.Unlock()
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the service still has connections")
		}
		time.Sleep(time.Millisecond)
	}
}

// childMem returns VmRSS and VmHWM, after a collection that returns the
// freed heap to the OS if free.
func childMem(free bool) (rss, hwm int64, err error) {
	if free {
		runtime.GC()
		debug.FreeOSMemory()
	}
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			rss = v << 10
		case "VmHWM:":
			hwm = v << 10
		}
	}
	if rss == 0 || hwm == 0 {
		return 0, 0, errors.New("no VmRSS or VmHWM in /proc/self/status")
	}
	return rss, hwm, nil
}
