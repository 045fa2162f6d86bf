package verbstest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// RunCrossProcess runs the cross-process conformance cases on soft0: side
// A in the test process, side B in a peer process (StartPeer with env), so
// that every request crosses the inter-process transport. The caller picks
// the transport of both processes (GOVERBS_SOFT_TRANSPORT in its own
// environment and in env). The test binary's TestMain must call
// ServePeerIfRequested.
func RunCrossProcess(t *testing.T, env ...string) {
	t.Helper()
	for _, def := range xcases {
		t.Run(def.name, func(t *testing.T) {
			CheckLeaks(t)
			p := StartPeer(t, env...)
			def.fn(t, &xcase{tcase: tcase{cfg: Config{DeviceA: verbs.SoftDevice}.withDefaults(), name: def.name}, peer: p})
		})
	}
}

type xcase struct {
	tcase
	peer *Peer
}

type xcaseDef struct {
	name string
	fn   func(t *testing.T, c *xcase)
}

var xcases = []xcaseDef{
	{"SendRecv", xSendRecv},
	{"SendRecvLarge", xSendRecvLarge},
	{"PeerSends", xPeerSends},
	{"SendImm", xSendImm},
	{"Write", xWrite},
	{"WriteImm", xWriteImm},
	{"Read", xRead},
	{"Atomics", xAtomics},
	{"PeerWritesAndReads", xPeerWritesAndReads},
	{"ErrBadRKey", xErrBadRKey},
	{"ErrOutOfBounds", xErrOutOfBounds},
	{"ErrNoRemotePermission", xErrNoRemotePermission},
	{"ErrRecvTooSmall", xErrRecvTooSmall},
	{"ErrRNRRetryExceeded", xErrRNRRetryExceeded},
	{"RNRWaitsForReceive", xRNRWaitsForReceive},
	{"PipelinedRNR", xPipelinedRNR},
	{"LargeWritesThenSend", xLargeWritesThenSend},
	{"LargeWriteErrors", xLargeWriteErrors},
	{"LargeReads", xLargeReads},
	{"FlushAfterError", xFlushAfterError},
	{"UDSend", xUDSend},
	{"UCSendWrite", xUCSendWrite},
	{"GoMemoryTarget", xGoMemoryTarget},
	{"PeerOnGoMemory", xPeerOnGoMemory},
}

// XCases returns the names of the cross-process cases.
func XCases() []string {
	n := make([]string, len(xcases))
	for i, c := range xcases {
		n[i] = c.name
	}
	return n
}

const peerWait = int(DefaultTimeout / time.Millisecond)

// xrc is an RC pair: qa in this process, side b in the peer.
type xrc struct {
	a    *Node
	qa   *verbs.RCQueuePair
	b    int // the peer's side
	rb   verbs.RemoteRegion
	qpnB uint32
}

// newXRC creates and connects an RC pair; the peer's side has an MR of
// size bytes with access.
func newXRC(t *testing.T, c *xcase, spec verbs.QPSpec, size int, access verbs.Access) *xrc {
	t.Helper()
	return newXRCMem(t, c, spec, size, access, false)
}

// newXRCMem is newXRC with the peer's MR in Go memory (Register) when
// goMem is set.
func newXRCMem(t *testing.T, c *xcase, spec verbs.QPSpec, size int, access verbs.Access, goMem bool) *xrc {
	t.Helper()
	a, _ := NewNodes(t, c.cfg)
	qa := a.NewRC(t, spec)
	pspec := spec
	r := c.peer.Do(PeerReq{Op: "new", Type: "rc", Size: size, Access: access, Go: goMem, Spec: &pspec})
	ea := Endpoint(t, qa)
	must(t, "connect A", qa.Connect(*r.EP))
	c.peer.Do(PeerReq{Op: "connect", ID: r.ID, EP: &ea})
	return &xrc{a: a, qa: qa, b: r.ID, rb: r.Region, qpnB: r.EP.QPN}
}

// peerPoll takes n completions from the peer side's CQ.
func (c *xcase) peerPoll(t *testing.T, id, n int) []verbs.Completion {
	t.Helper()
	return c.peer.Do(PeerReq{Op: "poll", ID: id, N: n, MS: peerWait}).WCs
}

func (c *xcase) peerBytes(t *testing.T, id, off, n int) []byte {
	t.Helper()
	return c.peer.Do(PeerReq{Op: "read", ID: id, Off: off, Len: n}).Data
}

func (c *xcase) peerFill(t *testing.T, id, off int, data []byte) {
	t.Helper()
	c.peer.Do(PeerReq{Op: "fill", ID: id, Off: off, Data: data})
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	Pattern(b, seed)
	return b
}

func xsendRecv(t *testing.T, c *xcase, size int) {
	p := newXRC(t, c, verbs.QPSpec{}, size+256, accessLocal)
	src := p.a.Alloc(t, size, accessLocal)
	Pattern(src.Bytes(), 0x11)
	c.peerFill(t, p.b, 0, pattern(size+256, 0xEE))
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 0xB0, Len: size + 256})
	must(t, "post send", p.qa.PostSend(0xA0, verbs.Signaled, src.All()))
	expectOK(t, "send completion", c.pollOne(t, p.a.CQ), 0xA0, verbs.OpSend, p.qa.QPN())
	wc := c.peerPoll(t, p.b, 1)[0]
	expectOK(t, "recv completion", wc, 0xB0, verbs.OpRecv, p.qpnB)
	expectByteLen(t, "recv completion", wc, size)
	got := c.peerBytes(t, p.b, 0, size+256)
	checkBytes(t, "received data", got[:size], src.Bytes())
	checkBytes(t, "receive buffer beyond the message", got[size:], pattern(size+256, 0xEE)[size:])
}

func xSendRecv(t *testing.T, c *xcase)      { xsendRecv(t, c, 64) }
func xSendRecvLarge(t *testing.T, c *xcase) { xsendRecv(t, c, 3<<20+5) }

// xPeerSends sends from the peer to this process, several messages in a row.
func xPeerSends(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 4096, accessLocal)
	dst := p.a.Alloc(t, 4*4096, accessLocal)
	for i := range 4 {
		must(t, "post recv", p.qa.PostRecv(uint64(i), SGE(t, dst, i*4096, 4096)))
	}
	c.peerFill(t, p.b, 0, pattern(4096, 0x5A))
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "send", WRID: 7, Len: 4096, Count: 4})
	for i, wc := range c.peerPoll(t, p.b, 4) {
		expectOK(t, "peer send completion", wc, 7, verbs.OpSend, p.qpnB)
		_ = i
	}
	for i, wc := range c.poll(t, p.a.CQ, 4) {
		expectOK(t, "recv completion", wc, uint64(i), verbs.OpRecv, p.qa.QPN())
		expectByteLen(t, "recv completion", wc, 4096)
		checkBytes(t, "received data", dst.Bytes()[i*4096:(i+1)*4096], pattern(4096, 0x5A))
	}
}

func xSendImm(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 128, accessLocal)
	src := p.a.Alloc(t, 100, accessLocal)
	Pattern(src.Bytes(), 0x31)
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 1, Len: 128})
	must(t, "post send imm", p.qa.PostSendImm(2, verbs.Signaled, 0x12345678, src.All()))
	expectOK(t, "send completion", c.pollOne(t, p.a.CQ), 2, verbs.OpSend, p.qa.QPN())
	wc := c.peerPoll(t, p.b, 1)[0]
	expectOK(t, "recv completion", wc, 1, verbs.OpRecv, p.qpnB)
	expectByteLen(t, "recv completion", wc, 100)
	expectImm(t, "recv completion", wc, 0x12345678)
	checkBytes(t, "received data", c.peerBytes(t, p.b, 0, 100), src.Bytes())
}

func xWrite(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 16384, accessAll)
	src := p.a.Alloc(t, 16384, accessLocal)
	Pattern(src.Bytes(), 0x51)
	want := pattern(16384, 0xEE)
	c.peerFill(t, p.b, 0, want)
	must(t, "post write", p.qa.PostWrite(10, verbs.Signaled, p.rb.At(100), SGE(t, src, 0, 5000)))
	expectOK(t, "write completion", c.pollOne(t, p.a.CQ), 10, verbs.OpWrite, p.qa.QPN())
	copy(want[100:5100], src.Bytes()[:5000])
	checkBytes(t, "remote MR after write", c.peerBytes(t, p.b, 0, 16384), want)
}

func xWriteImm(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 4096, accessAll)
	src := p.a.Alloc(t, 256, accessLocal)
	Pattern(src.Bytes(), 0x61)
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 3})
	must(t, "post write imm", p.qa.PostWriteImm(4, verbs.Signaled, p.rb.At(512), 0xABCD, src.All()))
	expectOK(t, "write imm completion", c.pollOne(t, p.a.CQ), 4, verbs.OpWrite, p.qa.QPN())
	wc := c.peerPoll(t, p.b, 1)[0]
	expectOK(t, "recv completion", wc, 3, verbs.OpRecvWriteImm, p.qpnB)
	expectImm(t, "recv completion", wc, 0xABCD)
	checkBytes(t, "remote MR after write imm", c.peerBytes(t, p.b, 512, 256), src.Bytes())
}

func xRead(t *testing.T, c *xcase) {
	const n = 200000
	p := newXRC(t, c, verbs.QPSpec{}, n, accessAll)
	c.peerFill(t, p.b, 0, pattern(n, 0x71))
	dst := p.a.Alloc(t, n+64, accessLocal)
	Pattern(dst.Bytes(), 0xEE)
	must(t, "post read", p.qa.PostRead(5, verbs.Signaled, p.rb.At(0), SGE(t, dst, 32, n)))
	expectOK(t, "read completion", c.pollOne(t, p.a.CQ), 5, verbs.OpRead, p.qa.QPN())
	checkBytes(t, "read data", dst.Bytes()[32:32+n], pattern(n, 0x71))
	checkBytes(t, "bytes before the read", dst.Bytes()[:32], pattern(n+64, 0xEE)[:32])
	checkBytes(t, "bytes after the read", dst.Bytes()[32+n:], pattern(n+64, 0xEE)[32+n:])
}

func xAtomics(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 64, accessAll)
	var v [8]byte
	binary.NativeEndian.PutUint64(v[:], 100)
	c.peerFill(t, p.b, 8, v[:])
	res := p.a.Alloc(t, 16, accessLocal)
	must(t, "post faa", p.qa.PostFetchAdd(1, verbs.Signaled, p.rb.At(8), 5, SGE(t, res, 0, 8)))
	expectOK(t, "faa completion", c.pollOne(t, p.a.CQ), 1, verbs.OpFetchAdd, p.qa.QPN())
	must(t, "post cas", p.qa.PostCompareSwap(2, verbs.Signaled, p.rb.At(8), 105, 7, SGE(t, res, 8, 8)))
	expectOK(t, "cas completion", c.pollOne(t, p.a.CQ), 2, verbs.OpCompareSwap, p.qa.QPN())
	if got := binary.NativeEndian.Uint64(res.Bytes()[0:8]); got != 100 {
		t.Errorf("fetch-add returned %d, want 100", got)
	}
	if got := binary.NativeEndian.Uint64(res.Bytes()[8:16]); got != 105 {
		t.Errorf("compare-swap returned %d, want 105", got)
	}
	if got := binary.NativeEndian.Uint64(c.peerBytes(t, p.b, 8, 8)); got != 7 {
		t.Errorf("remote word after the atomics: %d, want 7", got)
	}
}

// xPeerWritesAndReads makes the peer the requester of one-sided operations
// on this process' memory.
func xPeerWritesAndReads(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 8192, accessAll)
	m := p.a.Alloc(t, 8192, accessAll)
	Pattern(m.Bytes(), 0xEE)
	want := bytes.Clone(m.Bytes())
	c.peerFill(t, p.b, 0, pattern(8192, 0x3C))
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "write", WRID: 1, Off: 0, Len: 3000, Remote: m.Remote().At(1000)})
	expectOK(t, "peer write", c.peerPoll(t, p.b, 1)[0], 1, verbs.OpWrite, p.qpnB)
	copy(want[1000:4000], pattern(8192, 0x3C)[:3000])
	checkBytes(t, "local MR after the peer's write", m.Bytes(), want)
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "read", WRID: 2, Off: 4096, Len: 4096, Remote: m.Remote().At(0)})
	expectOK(t, "peer read", c.peerPoll(t, p.b, 1)[0], 2, verbs.OpRead, p.qpnB)
	checkBytes(t, "peer's MR after its read", c.peerBytes(t, p.b, 4096, 4096), want[:4096])
}

// xGoMemoryTarget runs one-sided operations on a peer MR of Go memory
// (Register): the peer cannot share it, so on shared memory too they
// are served by its service goroutine rather than by direct copies. The
// peer looks at its memory only after a message sent behind them, as an
// application must (the race detector watches Go memory).
func xGoMemoryTarget(t *testing.T, c *xcase) {
	const size = 16384
	p := newXRCMem(t, c, verbs.QPSpec{}, size, accessAll, true)
	want := pattern(size, 0xEE)
	var v [8]byte
	binary.NativeEndian.PutUint64(v[:], 40)
	copy(want[size-8:], v[:])
	c.peerFill(t, p.b, 0, want)
	src := p.a.Alloc(t, size, accessLocal)
	Pattern(src.Bytes(), 0x52)
	must(t, "post write", p.qa.PostWrite(1, verbs.Signaled, p.rb.At(100), SGE(t, src, 0, 5000)))
	expectOK(t, "write completion", c.pollOne(t, p.a.CQ), 1, verbs.OpWrite, p.qa.QPN())
	copy(want[100:5100], src.Bytes()[:5000])
	dst := p.a.Alloc(t, 8192, accessLocal)
	must(t, "post read", p.qa.PostRead(2, verbs.Signaled, p.rb.At(4096), SGE(t, dst, 0, 8192)))
	expectOK(t, "read completion", c.pollOne(t, p.a.CQ), 2, verbs.OpRead, p.qa.QPN())
	checkBytes(t, "data read from remote Go memory", dst.Bytes(), want[4096:12288])
	must(t, "post faa", p.qa.PostFetchAdd(3, verbs.Signaled, p.rb.At(size-8), 2, SGE(t, dst, 0, 8)))
	expectOK(t, "faa completion", c.pollOne(t, p.a.CQ), 3, verbs.OpFetchAdd, p.qa.QPN())
	if got := binary.NativeEndian.Uint64(dst.Bytes()[:8]); got != 40 {
		t.Errorf("fetch-add returned %d, want 40", got)
	}
	binary.NativeEndian.PutUint64(want[size-8:], 42)
	// The note, into a spare part of the region (its first 100 bytes).
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 7, Off: 0, Len: 8})
	must(t, "post note", p.qa.PostSend(4, verbs.Signaled, SGE(t, src, 0, 8)))
	expectOK(t, "note completion", c.pollOne(t, p.a.CQ), 4, verbs.OpSend, p.qa.QPN())
	expectOK(t, "peer's recv of the note", c.peerPoll(t, p.b, 1)[0], 7, verbs.OpRecv, p.qpnB)
	copy(want[:8], src.Bytes()[:8])
	checkBytes(t, "remote Go memory after the operations", c.peerBytes(t, p.b, 0, size), want)
}

// xPeerOnGoMemory makes the peer the requester of one-sided operations on
// an MR of this process' Go memory. As an application must, this side
// learns that the write is done from a message the peer sends after it
// (a RC QP delivers it after the write), not from the peer's completion,
// which it could not see: Go memory is watched by the race detector.
func xPeerOnGoMemory(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 8192, accessAll)
	buf := pattern(8192, 0xEE)
	m := p.a.Register(t, buf, accessAll)
	want := bytes.Clone(buf)
	note := p.a.Alloc(t, 64, accessLocal)
	must(t, "post recv", p.qa.PostRecv(9, note.All()))
	c.peerFill(t, p.b, 0, pattern(8192, 0x4D))
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "write", WRID: 1, Off: 0, Len: 3000, Remote: m.Remote().At(1000)})
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "send", WRID: 3, Off: 0, Len: 8})
	for _, wc := range c.peerPoll(t, p.b, 2) {
		expectStatus(t, "peer write and send", wc, wc.WRID, verbs.StatusSuccess, p.qpnB)
	}
	expectOK(t, "recv of the peer's note", c.pollOne(t, p.a.CQ), 9, verbs.OpRecv, p.qa.QPN())
	copy(want[1000:4000], pattern(8192, 0x4D)[:3000])
	checkBytes(t, "Go memory after the peer's write", m.Bytes(), want)
	c.peer.Do(PeerReq{Op: "post", ID: p.b, Kind: "read", WRID: 2, Off: 4096, Len: 4096, Remote: m.Remote().At(0)})
	expectOK(t, "peer read", c.peerPoll(t, p.b, 1)[0], 2, verbs.OpRead, p.qpnB)
	checkBytes(t, "peer's MR after its read of Go memory", c.peerBytes(t, p.b, 4096, 4096), want[:4096])
}

// xremoteErr posts a write from A that the peer must refuse, and checks
// the statuses, the states and that the peer's memory is untouched.
func xremoteErr(t *testing.T, c *xcase, access verbs.Access, dst func(r verbs.RemoteRegion) verbs.RemoteAddr, n int) {
	size := max(4096, n)
	p := newXRC(t, c, verbs.QPSpec{}, size, access)
	before := pattern(size, 0xEE)
	c.peerFill(t, p.b, 0, before)
	src := p.a.Alloc(t, max(8192, n), accessLocal)
	Pattern(src.Bytes(), 0x99)
	must(t, "post write", p.qa.PostWrite(1, verbs.Signaled, dst(p.rb), SGE(t, src, 0, n)))
	expectStatus(t, "write completion", c.pollOne(t, p.a.CQ), 1, verbs.StatusRemAccessErr, p.qa.QPN())
	c.waitState(t, "requester", p.qa, verbs.StateError)
	if st := c.peer.Do(PeerReq{Op: "state", ID: p.b}).State; st != verbs.StateError.String() {
		t.Errorf("peer QP state %s, want %s", st, verbs.StateError)
	}
	checkBytes(t, "peer MR after a refused write", c.peerBytes(t, p.b, 0, size), before)
}

func xErrBadRKey(t *testing.T, c *xcase) {
	xremoteErr(t, c, accessAll, func(r verbs.RemoteRegion) verbs.RemoteAddr {
		a := r.At(0)
		a.RKey ^= 0x5a5a
		return a
	}, 64)
}

func xErrOutOfBounds(t *testing.T, c *xcase) {
	xremoteErr(t, c, accessAll, func(r verbs.RemoteRegion) verbs.RemoteAddr { return r.At(r.Len - 100) }, 200)
}

func xErrNoRemotePermission(t *testing.T, c *xcase) {
	xremoteErr(t, c, accessLocal, func(r verbs.RemoteRegion) verbs.RemoteAddr { return r.At(0) }, 64)
}

func xErrRecvTooSmall(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 64, accessLocal)
	src := p.a.Alloc(t, 64, accessLocal)
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 9, Len: 16})
	must(t, "post send", p.qa.PostSend(8, verbs.Signaled, src.All()))
	expectStatus(t, "sender", c.pollOne(t, p.a.CQ), 8, verbs.StatusRemInvReqErr, p.qa.QPN())
	expectStatus(t, "receiver", c.peerPoll(t, p.b, 1)[0], 9, verbs.StatusLocLenErr, p.qpnB)
}

func xErrRNRRetryExceeded(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{RNRRetry: 2, MinRNRTimer: 1}, 64, accessLocal)
	src := p.a.Alloc(t, 64, accessLocal)
	must(t, "post send", p.qa.PostSend(1, verbs.Signaled, src.All()))
	expectStatus(t, "send without a receive", c.pollOne(t, p.a.CQ), 1, verbs.StatusRNRRetryExcErr, p.qa.QPN())
}

// xRNRWaitsForReceive sends before the peer posts its receive, with
// infinite RNR retries: the receive posted later wakes the sender.
func xRNRWaitsForReceive(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{RNRRetry: 7, MinRNRTimer: 31}, 64, accessLocal)
	src := p.a.Alloc(t, 64, accessLocal)
	Pattern(src.Bytes(), 0x42)
	must(t, "post send", p.qa.PostSend(1, verbs.Signaled, src.All()))
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 2, Len: 64})
	expectOK(t, "send completion", c.pollOne(t, p.a.CQ), 1, verbs.OpSend, p.qa.QPN())
	expectOK(t, "recv completion", c.peerPoll(t, p.b, 1)[0], 2, verbs.OpRecv, p.qpnB)
	checkBytes(t, "received data", c.peerBytes(t, p.b, 0, 64), src.Bytes())
}

func xFlushAfterError(t *testing.T, c *xcase) {
	p := newXRC(t, c, verbs.QPSpec{}, 64, accessAll)
	src := p.a.Alloc(t, 64, accessLocal)
	bad := p.rb.At(0)
	bad.RKey ^= 1
	must(t, "post bad write", p.qa.PostWrite(1, verbs.Signaled, bad, src.All()))
	must(t, "post write", p.qa.PostWrite(2, verbs.Signaled, p.rb.At(0), src.All()))
	must(t, "post write", p.qa.PostWrite(3, 0, p.rb.At(0), src.All()))
	wcs := c.poll(t, p.a.CQ, 3)
	expectStatus(t, "bad write", wcs[0], 1, verbs.StatusRemAccessErr, p.qa.QPN())
	expectStatus(t, "flushed write", wcs[1], 2, verbs.StatusWRFlushErr, p.qa.QPN())
	expectStatus(t, "flushed unsignaled write", wcs[2], 3, verbs.StatusWRFlushErr, p.qa.QPN())
}

func xUDSend(t *testing.T, c *xcase) {
	a, _ := NewNodes(t, c.cfg)
	qa := a.NewUD(t, verbs.QPSpec{})
	r := c.peer.Do(PeerReq{Op: "new", Type: "ud", Size: 4096, Access: accessLocal})
	ea := Endpoint(t, qa)
	c.peer.Do(PeerReq{Op: "connect", ID: r.ID, EP: &ea}) // the peer's AH to A
	ah := a.AddressHandle(t, qa, *r.EP)
	src := a.Alloc(t, 256, accessLocal)
	Pattern(src.Bytes(), 0xE1)
	c.peer.Do(PeerReq{Op: "recv", ID: r.ID, WRID: 1, Len: grhLen + 256})
	must(t, "post UD send", qa.PostSend(10, verbs.Signaled, verbs.Destination{AH: ah, QPN: r.EP.QPN, QKey: r.EP.QKey}, SGE(t, src, 0, 200)))
	expectOK(t, "UD send completion", c.pollOne(t, a.CQ), 10, verbs.OpSend, qa.QPN())
	wc := c.peerPoll(t, r.ID, 1)[0]
	expectOK(t, "UD recv completion", wc, 1, verbs.OpRecv, r.EP.QPN)
	expectByteLen(t, "UD recv completion", wc, 200+grhLen)
	if wc.SrcQP != qa.QPN() {
		t.Errorf("UD recv completion: src_qp %d, want %d", wc.SrcQP, qa.QPN())
	}
	checkBytes(t, "UD payload", c.peerBytes(t, r.ID, grhLen, 200), src.Bytes()[:200])

	// And back.
	dst := a.Alloc(t, grhLen+256, accessLocal)
	must(t, "post recv", qa.PostRecv(3, dst.All()))
	c.peerFill(t, r.ID, 0, pattern(100, 0x17))
	c.peer.Do(PeerReq{Op: "post", ID: r.ID, Kind: "send", WRID: 4, Len: 100, QPN: ea.QPN, QKey: ea.QKey})
	expectOK(t, "peer UD send", c.peerPoll(t, r.ID, 1)[0], 4, verbs.OpSend, r.EP.QPN)
	wc = c.pollOne(t, a.CQ)
	expectOK(t, "UD recv completion", wc, 3, verbs.OpRecv, qa.QPN())
	checkBytes(t, "UD payload from the peer", dst.Bytes()[grhLen:grhLen+100], pattern(100, 0x17))
}

func xUCSendWrite(t *testing.T, c *xcase) {
	a, _ := NewNodes(t, c.cfg)
	qa := a.NewUC(t, verbs.QPSpec{})
	r := c.peer.Do(PeerReq{Op: "new", Type: "uc", Size: 4096, Access: accessAll})
	ea := Endpoint(t, qa)
	must(t, "connect A", qa.Connect(*r.EP))
	c.peer.Do(PeerReq{Op: "connect", ID: r.ID, EP: &ea})
	src := a.Alloc(t, 1024, accessLocal)
	Pattern(src.Bytes(), 0xC1)
	c.peer.Do(PeerReq{Op: "recv", ID: r.ID, WRID: 1, Len: 1024})
	must(t, "post UC send", qa.PostSend(2, verbs.Signaled, SGE(t, src, 0, 512)))
	expectOK(t, "UC send completion", c.pollOne(t, a.CQ), 2, verbs.OpSend, qa.QPN())
	wc := c.peerPoll(t, r.ID, 1)[0]
	expectOK(t, "UC recv completion", wc, 1, verbs.OpRecv, r.EP.QPN)
	checkBytes(t, "UC payload", c.peerBytes(t, r.ID, 0, 512), src.Bytes()[:512])
	must(t, "post UC write", qa.PostWrite(3, verbs.Signaled, r.Region.At(2048), SGE(t, src, 512, 512)))
	expectOK(t, "UC write completion", c.pollOne(t, a.CQ), 3, verbs.OpWrite, qa.QPN())
	// UC gives the writer no acknowledgement: the bytes show up when the
	// peer's service has run the request. Poll the peer's memory.
	want := src.Bytes()[512:1024]
	deadline := time.Now().Add(DefaultTimeout)
	for !bytes.Equal(c.peerBytes(t, r.ID, 2048, 512), want) {
		if time.Now().After(deadline) {
			t.Fatalf("UC write did not arrive")
		}
		time.Sleep(time.Millisecond)
	}
}

// xPipelinedRNR posts many sends (and writes between them) before the
// peer has receives for all of them, so that requests in flight behind an
// RNR-NAKed send are dropped and sent again: every message must arrive
// once, in order, and every request complete successfully in order.
func xPipelinedRNR(t *testing.T, c *xcase) {
	const n, size = 64, 256
	p := newXRC(t, c, verbs.QPSpec{RNRRetry: 7, MinRNRTimer: 1, MaxSendWR: 2 * n}, n*size+4096, accessAll)
	src := p.a.Alloc(t, n*size, accessLocal)
	Pattern(src.Bytes(), 0x2D)
	// Receives for the first quarter only.
	c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: 100, Len: size, Count: n / 4})
	for i := range n {
		must(t, "post send", p.qa.PostSend(uint64(2*i), verbs.Signaled, SGE(t, src, i*size, size)))
		must(t, "post write", p.qa.PostWrite(uint64(2*i+1), verbs.Signaled, p.rb.At(uint64(n*size+i%16*8)), SGE(t, src, i*size, 8)))
	}
	// The rest of the receives, in small batches, each at its own offset.
	for i := n / 4; i < n; i += 4 {
		for k := i; k < i+4; k++ {
			c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: uint64(100 + k), Off: k * size, Len: size})
		}
	}
	wcs := c.poll(t, p.a.CQ, 2*n)
	for i, wc := range wcs {
		op := verbs.OpSend
		if i%2 == 1 {
			op = verbs.OpWrite
		}
		expectOK(t, fmt.Sprintf("completion %d", i), wc, uint64(i), op, p.qa.QPN())
	}
	rwcs := c.peerPoll(t, p.b, n)
	for i, wc := range rwcs {
		wrid := uint64(100)
		if i >= n/4 {
			wrid += uint64(i)
		}
		expectOK(t, fmt.Sprintf("receive %d", i), wc, wrid, verbs.OpRecv, p.qpnB)
	}
	// The first quarter landed at offset 0 (each overwriting the last);
	// the others at their own offsets.
	got := c.peerBytes(t, p.b, 0, n*size)
	checkBytes(t, "messages after the first quarter", got[n/4*size:], src.Bytes()[n/4*size:])
	checkBytes(t, "last message of the first quarter", got[:size], src.Bytes()[(n/4-1)*size:n/4*size])
}

// xLargeWritesThenSend writes large blocks (direct copies over shared
// memory) and then sends: when the send arrives, every written byte must
// be there (RC ordering).
func xLargeWritesThenSend(t *testing.T, c *xcase) {
	const size = 1 << 20
	p := newXRC(t, c, verbs.QPSpec{}, 4*size, accessAll)
	src := p.a.Alloc(t, 4*size, accessLocal)
	for round := range 3 {
		Pattern(src.Bytes(), byte(0x40+round))
		c.peer.Do(PeerReq{Op: "recv", ID: p.b, WRID: uint64(round)})
		for i := range 4 {
			must(t, "post write", p.qa.PostWrite(uint64(10*round+i), 0, p.rb.At(uint64(i*size)), SGE(t, src, i*size, size)))
		}
		must(t, "post send", p.qa.PostSend(uint64(10*round+9), verbs.Signaled))
		expectOK(t, "send after the writes", c.pollOne(t, p.a.CQ), uint64(10*round+9), verbs.OpSend, p.qa.QPN())
		expectOK(t, "receive", c.peerPoll(t, p.b, 1)[0], uint64(round), verbs.OpRecv, p.qpnB)
		checkBytes(t, fmt.Sprintf("round %d: peer MR when the send arrived", round), c.peerBytes(t, p.b, 0, 4*size), src.Bytes())
	}
}

// xLargeWriteErrors: large writes that the peer must refuse (bad rkey,
// out of bounds, to a region without remote write) fail with
// REM_ACCESS_ERR and leave the peer's memory alone, whatever the
// transport does with large writes.
func xLargeWriteErrors(t *testing.T, c *xcase) {
	const size = 256 << 10
	for _, tc := range []struct {
		name   string
		access verbs.Access
		dst    func(r verbs.RemoteRegion) verbs.RemoteAddr
	}{
		{"BadRKey", accessAll, func(r verbs.RemoteRegion) verbs.RemoteAddr { a := r.At(0); a.RKey ^= 0x77; return a }},
		{"PastTheEnd", accessAll, func(r verbs.RemoteRegion) verbs.RemoteAddr { return r.At(size / 2) }},
		{"ReadOnlyRegion", accessLocal | verbs.AccessRemoteRead, func(r verbs.RemoteRegion) verbs.RemoteAddr { return r.At(0) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xremoteErr(t, c, tc.access, tc.dst, size)
		})
	}
}

// xLargeReads reads large blocks (direct copies over shared memory) from
// a region the peer allows only remote reads on, and reads back what a
// large write just wrote.
func xLargeReads(t *testing.T, c *xcase) {
	const size = 1 << 20
	t.Run("ReadOnlyRegion", func(t *testing.T) {
		p := newXRC(t, c, verbs.QPSpec{}, size, accessLocal|verbs.AccessRemoteRead)
		c.peerFill(t, p.b, 0, pattern(size, 0x5E))
		dst := p.a.Alloc(t, size+8192, accessLocal)
		Pattern(dst.Bytes(), 0xEE)
		want := pattern(size+8192, 0xEE)
		must(t, "post read", p.qa.PostRead(1, verbs.Signaled, p.rb.At(4096), SGE(t, dst, 4096, size-8192)))
		must(t, "post read", p.qa.PostRead(2, verbs.Signaled, p.rb.At(0), SGE(t, dst, size, 4096)))
		expectOK(t, "large read", c.pollOne(t, p.a.CQ), 1, verbs.OpRead, p.qa.QPN())
		expectOK(t, "small read", c.pollOne(t, p.a.CQ), 2, verbs.OpRead, p.qa.QPN())
		copy(want[4096:size-4096], pattern(size, 0x5E)[4096:size-4096])
		copy(want[size:size+4096], pattern(size, 0x5E)[:4096])
		checkBytes(t, "local MR after the reads", dst.Bytes(), want)
	})
	t.Run("ReadBackAWrite", func(t *testing.T) {
		p := newXRC(t, c, verbs.QPSpec{}, size, accessAll)
		src := p.a.Alloc(t, 2*size, accessLocal)
		Pattern(src.Bytes()[:size], 0x6A)
		must(t, "post write", p.qa.PostWrite(1, 0, p.rb.At(0), SGE(t, src, 0, size)))
		must(t, "post read", p.qa.PostRead(2, verbs.Signaled, p.rb.At(0), SGE(t, src, size, size)))
		expectOK(t, "read", c.pollOne(t, p.a.CQ), 2, verbs.OpRead, p.qa.QPN())
		checkBytes(t, "read back", src.Bytes()[size:], src.Bytes()[:size])
	})
}
