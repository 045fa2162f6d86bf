package soft

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// hostile is a target QP and a raw, handshaken TCP connection to its
// process' service, posing as the QP it is connected to.
type hostile struct {
	nc     net.Conn
	qpn    uint32 // the target QP
	srcQPN uint32 // the QP the target is connected to
	page   []byte // the MR and a page on either side
	mr     prov.MR
	e      *env
	q      *ep // the target QP
}

const fakeSrcQPN = 0x77

func newHostile(t *testing.T) *hostile { return newHostileN(t, prov.QPTypeRC, 4096) }

// newHostileN is newHostile with a target QP of type typ (RC or UC) and
// an MR of n bytes (whole pages).
func newHostileN(t *testing.T, typ prov.QPType, n int) *hostile {
	t.Helper()
	return newHostileOn(t, typ, n, "tcp")
}

// newHostileOn is newHostileN with the peer on network (tcp or unix).
func newHostileOn(t *testing.T, typ prov.QPType, n int, network string) *hostile {
	t.Helper()
	restore, err := ForceTransport("auto")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	e := newEnv(t)
	b := e.newQP(typ, defaultCaps(), nil)
	r := must(mem.Alloc(n+2*4096, "test", false))
	t.Cleanup(func() { r.Free() })
	m := must(e.pd.RegMR(prov.Mem{Ptr: unsafe.Add(r.Ptr(), 4096), Len: n, FD: -1}, allAccess))
	t.Cleanup(func() { m.Close() })

	// Connect the target to a QP of a made-up process.
	pa, err := parseAddr(b.qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	fake := fakeProcOf(pa.fabric ^ 0xdead).addr()
	toInit(t, b.qp, typ, defaultConn())
	av := prov.AHAttr{DGID: getFabric().gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1,
		ProviderAddr: encodePeerAddr(&fake)}
	rtr := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: fakeSrcQPN, MaxDestRDAtom: 16, MinRNRTimer: 1, AH: av}
	mask := prov.AttrState | prov.AttrAV | prov.AttrPathMTU | prov.AttrDestQPN | prov.AttrRQPSN
	if typ == prov.QPTypeRC {
		mask |= prov.AttrMaxDestRDAtom | prov.AttrMinRNRTimer
	}
	if err := b.qp.Modify(&rtr, mask); err != nil {
		t.Fatal(err)
	}

	nc := rawDial(t, b.qp.Address(), network, fake.fabric)
	return &hostile{nc: nc, qpn: b.qp.QPN(), srcQPN: fakeSrcQPN, page: r.Bytes(), mr: m, e: e, q: b}
}

// peer is the raw peer of h (amplify_test.go).
func (h *hostile) peer() *rawPeer { return &rawPeer{nc: h.nc, qpn: h.qpn, srcQPN: h.srcQPN} }

// reqFrame encodes a request frame; payload is appended as is.
func (h *hostile) reqFrame(op reqOp, raddr uint64, length uint32, payload []byte) []byte {
	req := request{op: op, qpType: uint8(prov.QPTypeRC), srcQPN: h.srcQPN, dstQPN: h.qpn, npkts: 1, mtu: 4096,
		length: length, raddr: raddr, rkey: h.mr.RKey()}
	b := make([]byte, hdrLen+reqBodyLen, hdrLen+reqBodyLen+len(payload))
	putHdr(b, frReq, uint32(reqBodyLen+len(payload)), 1)
	putReq(b[hdrLen:], &req, 0)
	return append(b, payload...)
}

// expectDropped reads until the service closes the connection.
func expectDropped(t *testing.T, nc net.Conn) {
	t.Helper()
	_, err := io.Copy(io.Discard, nc)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the service did not drop the connection")
	}
}

// readResp reads one response frame.
func readResp(t *testing.T, nc net.Conn) response {
	t.Helper()
	b := make([]byte, hdrLen+respBodyLen)
	if _, err := io.ReadFull(nc, b); err != nil {
		t.Fatalf("read response: %v", err)
	}
	h, err := parseHdr(b)
	if err != nil || h.typ != frResp || h.length != respBodyLen {
		t.Fatalf("response header %+v, %v", h, err)
	}
	var r response
	if qpn, err := parseResp(b[hdrLen:], 0, &r); err != nil || qpn != fakeSrcQPN {
		t.Fatalf("response for QP %#x, %v", qpn, err)
	}
	return r
}

// TestHostileFrames sends malformed and hostile frames to the service: the
// connection must be dropped (or the request refused), and no byte outside
// the target MR may change.
func TestHostileFrames(t *testing.T) {
	big := make([]byte, hdrLen)
	putHdr(big, frReq, reqBodyLen+maxPayload, 1)
	for _, tc := range []struct {
		name  string
		frame func(h *hostile) []byte
		// drop: the connection must be closed; otherwise the service
		// answers with code want.
		drop bool
		want respCode
	}{
		{"BadMagic", func(h *hostile) []byte { return bytes.Repeat([]byte{0xff}, 64) }, true, 0},
		{"UnknownType", func(h *hostile) []byte {
			b := make([]byte, hdrLen)
			putHdr(b, 99, 0, 0)
			return b
		}, true, 0},
		{"HelloAgain", func(h *hostile) []byte {
			b := make([]byte, hdrLen+helloLen)
			putHdr(b, frHello, helloLen, 0)
			return b
		}, true, 0},
		{"PayloadShorterThanLength", func(h *hostile) []byte {
			b := h.reqFrame(opWrite, h.mr.Addr(), 100, make([]byte, 50))
			return b
		}, true, 0},
		{"ReadWithPayload", func(h *hostile) []byte {
			return h.reqFrame(opRead, h.mr.Addr(), 8, make([]byte, 8))
		}, true, 0},
		{"BadOpcode", func(h *hostile) []byte {
			b := h.reqFrame(opWrite, h.mr.Addr(), 0, nil)
			b[hdrLen] = 200
			return b
		}, true, 0},
		{"HugeLengthThenEOF", func(h *hostile) []byte { return big }, true, 0},
		{"MapOnTCP", func(h *hostile) []byte {
			b := make([]byte, hdrLen+mapLen)
			putHdr(b, frMap, mapLen, 1)
			return b
		}, true, 0},
		{"DirectWriteOnTCP", func(h *hostile) []byte {
			b := h.reqFrame(opWrite, h.mr.Addr(), 64, nil)
			b[hdrLen+2] |= reqDirect
			return b
		}, true, 0},
		{"DirectWriteImmOnTCP", func(h *hostile) []byte {
			// Its data would be in a mapping only shared memory has.
			b := h.reqFrame(opWriteImm, h.mr.Addr(), 64, nil)
			b[hdrLen+2] |= reqDirect
			return b
		}, true, 0},
		{"DirectSend", func(h *hostile) []byte {
			b := h.reqFrame(opSend, 0, 64, nil)
			b[hdrLen+2] |= reqDirect
			return b
		}, true, 0},
		{"PullProbeOnTCP", func(h *hostile) []byte {
			b := make([]byte, hdrLen+pullProbeLen)
			putHdr(b, frPullProbe, pullProbeLen, 0)
			return b
		}, true, 0},
		{"PullOnTCP", func(h *hostile) []byte {
			// The peer would read this process's memory at the pieces'
			// addresses: only where it offered to.
			var p [pullHead + pullDesc]byte
			le := binary.LittleEndian
			le.PutUint64(p[:], uint64(h.mr.Addr())) // the claim
			le.PutUint64(p[8:], 1)
			le.PutUint64(p[pullHead:], uint64(h.mr.Addr())) // the piece
			le.PutUint64(p[pullHead+8:], 64)
			b := h.reqFrame(opWrite, h.mr.Addr(), 64, p[:])
			b[hdrLen+2] |= reqPull
			return b
		}, true, 0},
		{"PullRead", func(h *hostile) []byte {
			var p [pullHead + pullDesc]byte
			b := h.reqFrame(opRead, h.mr.Addr(), 16, p[:])
			b[hdrLen+2] |= reqPull
			return b
		}, true, 0},
		{"DirectRead", func(h *hostile) []byte {
			b := h.reqFrame(opRead, h.mr.Addr(), 64, nil)
			b[hdrLen+2] |= reqDirect
			return b
		}, true, 0},
		{"OldVersion", func(h *hostile) []byte {
			// A build before alive frames (version 6).
			b := h.reqFrame(opWrite, h.mr.Addr(), 8, make([]byte, 8))
			b[2] = 6
			return b
		}, true, 0},
		{"AliveShort", func(h *hostile) []byte {
			b := make([]byte, hdrLen)
			putHdr(b, frAlive, 0, 0)
			return b
		}, true, 0},
		{"AliveLong", func(h *hostile) []byte {
			b := make([]byte, hdrLen+2*aliveLen)
			putHdr(b, frAlive, 2*aliveLen, 0)
			return b
		}, true, 0},
		{"AliveFromAnyone", func(h *hostile) []byte {
			// Alive frames name nothing and change nothing: they are
			// skipped, and the write after them is answered.
			a := make([]byte, hdrLen+aliveLen)
			putHdr(a, frAlive, aliveLen, 77)
			binary.LittleEndian.PutUint64(a[hdrLen:], ^uint64(0))
			b := append(bytes.Repeat(a, 3), h.reqFrame(opWrite, h.mr.Addr()+4096-10, 100, bytes.Repeat([]byte{0xAB}, 100))...)
			return b
		}, false, respAccess},
		{"WritePastTheEnd", func(h *hostile) []byte {
			return h.reqFrame(opWrite, h.mr.Addr()+4096-10, 100, bytes.Repeat([]byte{0xAB}, 100))
		}, false, respAccess},
		{"WriteBeforeTheStart", func(h *hostile) []byte {
			return h.reqFrame(opWrite, h.mr.Addr()-10, 20, bytes.Repeat([]byte{0xAB}, 20))
		}, false, respAccess},
		{"WriteWrapsAround", func(h *hostile) []byte {
			return h.reqFrame(opWrite, ^uint64(0)-5, 20, bytes.Repeat([]byte{0xAB}, 20))
		}, false, respAccess},
		{"ReadPastTheEnd", func(h *hostile) []byte {
			return h.reqFrame(opRead, h.mr.Addr()+4000, 200, nil)
		}, false, respAccess},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostile(t)
			for i := range h.page {
				h.page[i] = byte(i * 13)
			}
			before := bytes.Clone(h.page)
			if _, err := h.nc.Write(tc.frame(h)); err != nil {
				t.Fatal(err)
			}
			if tc.drop {
				if tc.name == "HugeLengthThenEOF" {
					h.nc.(*net.TCPConn).CloseWrite()
				}
				expectDropped(t, h.nc)
			} else if r := readResp(t, h.nc); r.code != tc.want {
				t.Errorf("response code %d, want %d", r.code, tc.want)
			}
			if !bytes.Equal(h.page, before) {
				t.Errorf("memory changed")
			}
		})
	}
}

// TestHostileWriteInBounds checks the other side of TestHostileFrames: a
// well-formed write from the connected QP lands exactly in the MR.
func TestHostileWriteInBounds(t *testing.T) {
	h := newHostile(t)
	before := bytes.Clone(h.page)
	data := bytes.Repeat([]byte{0xCD}, 100)
	if _, err := h.nc.Write(h.reqFrame(opWrite, h.mr.Addr()+4096-100, 100, data)); err != nil {
		t.Fatal(err)
	}
	if r := readResp(t, h.nc); r.code != respACK {
		t.Fatalf("response code %d, want ACK", r.code)
	}
	want := before
	copy(want[2*4096-100:], data)
	if !bytes.Equal(h.page, want) {
		t.Errorf("memory after the write differs from the expectation")
	}
}

// --- fuzzing ---

func validReqFrame() []byte {
	h := &hostile{qpn: 0x11, srcQPN: 0x12}
	req := request{op: opWrite, qpType: uint8(prov.QPTypeRC), srcQPN: h.srcQPN, dstQPN: h.qpn, npkts: 1, mtu: 4096,
		length: 4, raddr: 0x1000, rkey: 7}
	b := make([]byte, hdrLen+reqBodyLen+4)
	putHdr(b, frReq, reqBodyLen+4, 1)
	putReq(b[hdrLen:], &req, 0)
	return b
}

// FuzzFrame feeds arbitrary bytes to the frame decoders the connection
// reader uses: they must not panic, and what they accept must be
// self-consistent: no frame larger than maxFrame, segments that tile their
// message, data only on ACKs.
func FuzzFrame(f *testing.F) {
	f.Add(validReqFrame())
	seg := make([]byte, hdrLen+reqBodyLen)
	putHdr(seg, frReq, reqBodyLen+segMax, 2)
	putReq(seg[hdrLen:], &request{op: opSend, qpType: uint8(prov.QPTypeRC), npkts: 32, mtu: 4096,
		length: 3*segMax + 5, off: segMax, more: true}, 0)
	f.Add(seg)
	var r [hdrLen + respBodyLen]byte
	putHdr(r[:], frResp, respBodyLen, 3)
	putResp(r[hdrLen:], 0x12, &response{code: respRNR, rnrTimer: 4})
	f.Add(r[:])
	putHdr(r[:], frResp, respBodyLen+segMax, 4)
	putResp(r[hdrLen:], 0x12, &response{orig: 2 * segMax, more: true})
	f.Add(r[:])
	var w [hdrLen + wakeLen]byte
	putHdr(w[:], frWake, wakeLen, 0)
	f.Add(w[:])
	var a [hdrLen + aliveLen]byte
	putHdr(a[:], frAlive, aliveLen, 5)
	f.Add(a[:])
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, hdrLen+reqBodyLen))
	var ma [hdrLen + mapAckLen]byte
	putHdr(ma[:], frMapAck, mapAckLen, 9)
	putMapAck(ma[hdrLen:], &mapAck{status: mapOK, addr: 0x10000, length: 4096})
	f.Add(ma[:])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHdr(b)
		if err != nil {
			return
		}
		if hdrLen+int(h.length) > maxFrame {
			t.Fatalf("accepted a frame of %d bytes", hdrLen+h.length)
		}
		if h.typ == frReq && h.length < reqBodyLen || h.typ == frResp && h.length < respBodyLen {
			t.Fatalf("accepted a frame of type %d with %d bytes", h.typ, h.length)
		}
		body := b[hdrLen:]
		bl := bodyLen(h)
		if len(body) < bl {
			return
		}
		payload := h.length - uint32(bl) // what the reader passes
		switch h.typ {
		case frReq:
			var req request
			if _, err := parseReq(body[:bl], payload, &req); err != nil {
				return
			}
			end := uint64(req.off) + uint64(payload)
			switch {
			case req.length > maxMsgSize || req.dstQPN > maxQPN || req.srcQPN > maxQPN || req.psn > psnMask:
				t.Fatalf("accepted %+v", req)
			case req.direct && (payload != 0 || req.more || req.off != 0):
				// A direct write carries no payload: the requester
				// copies into the shared mapping (shm.go).
				t.Fatalf("accepted a direct request %+v with %d payload bytes", req, payload)
			case !hasPayload(req.op) && (payload != 0 || req.more || req.off != 0):
				t.Fatalf("accepted a read or atomic %+v with %d payload bytes", req, payload)
			case hasPayload(req.op) && !req.direct && (req.off%segMax != 0 || end > uint64(req.length) ||
				req.more && (payload != segMax || end == uint64(req.length)) || !req.more && end != uint64(req.length)):
				t.Fatalf("accepted a segment %+v of %d bytes that does not tile its message", req, payload)
			case req.qpType == uint8(prov.QPTypeUD) && (req.more || req.off != 0):
				t.Fatalf("accepted a UD segment %+v", req)
			}
		case frResp:
			var r response
			if _, err := parseResp(body[:bl], payload, &r); err != nil {
				return
			}
			switch {
			case r.code > respPullLost:
				t.Fatalf("accepted response code %d", r.code)
			case payload > 0 && r.code != respACK:
				t.Fatalf("accepted data on a response %+v", r)
			case r.pulled && (r.more || payload != pulledReadLen || r.orig != 0):
				t.Fatalf("accepted a pulled read's answer %+v of %d bytes", r, payload)
			case r.pulled:
			case r.more && payload != segMax, payload > 0 && (r.orig%segMax != 0 || r.orig+uint64(payload) > maxMsgSize):
				t.Fatalf("accepted read data %+v of %d bytes", r, payload)
			}
		case frMapAck:
			if m, err := parseMapAck(body[:bl]); err == nil && m.status == mapOK && (m.length == 0 || m.addr+m.length < m.addr) {
				t.Fatalf("accepted map answer %+v", m)
			}
		}
	})
}

// FuzzHandshake feeds arbitrary bytes to the handshake decoders: they
// must not panic, and what they accept must be self-consistent.
func FuzzHandshake(f *testing.F) {
	hb := make([]byte, hdrLen+helloLen)
	putHdr(hb, frHello, helloLen, 0)
	putHello(hb[hdrLen:], &hello{kind: kindUnix, pid: 42, fabric: 1, target: 2})
	f.Add(hb)
	cb := make([]byte, hdrLen+challengeLen)
	putHdr(cb, frChallenge, challengeLen, 0)
	putChallenge(cb[hdrLen:], &challenge{status: ackBadJob, pid: 3, fabric: 2})
	f.Add(cb)
	ab := make([]byte, hdrLen+authLen)
	putHdr(ab, frAuth, authLen, 0)
	putAuth(ab[hdrLen:], &auth{})
	f.Add(ab)
	aa := make([]byte, hdrLen+authAckLen)
	putHdr(aa, frAuthAck, authAckLen, 0)
	putAuthAck(aa[hdrLen:], ackBadSecret)
	f.Add(aa)
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= hdrLen+helloLen {
			if h, err := decodeHello(b[:hdrLen+helloLen]); err == nil && h.kind != kindTCP && h.kind != kindUnix && h.kind != kindShm {
				t.Fatalf("accepted link kind %d", h.kind)
			}
		}
		for _, k := range []struct {
			typ frameType
			n   int
		}{{frChallenge, challengeLen}, {frAuth, authLen}, {frAuthAck, authAckLen}} {
			if len(b) < hdrLen+k.n {
				continue
			}
			body, err := handshakeBody(b[:hdrLen+k.n], k.typ)
			if err != nil {
				continue
			}
			if h, _ := parseHdr(b); h.typ != k.typ || int(h.length) != k.n {
				t.Fatalf("accepted frame %+v as type %d", h, k.typ)
			}
			switch k.typ {
			case frChallenge:
				parseChallenge(body)
			case frAuth:
				parseAuth(body)
			case frAuthAck:
				parseAuthAck(body)
			}
		}
		// A proof over arbitrary bytes never matches another secret's.
		if len(b) >= helloLen {
			var n [hsNonceLen]byte
			tr := transcript(b[:helloLen], 1, 2, &n, nil)
			var s1, s2 [16]byte
			s2[0] = 1
			m1, m2 := handshakeMAC(&s1, labelDialer, &tr), handshakeMAC(&s2, labelDialer, &tr)
			if macEqual(&m1, &m2) {
				t.Fatalf("two secrets give the same proof")
			}
		}
	})
}

// FuzzAddr feeds arbitrary provider addresses to the decoder; what it
// accepts must encode back to an address that decodes the same.
func FuzzAddr(f *testing.F) {
	f.Add(encodePeerAddr(&peerAddr{fabric: 1, pid: 2, hasHost: true, hasSecret: true, unix: "@x", tcp: "127.0.0.1:9"}))
	f.Add(encodePeerAddr(&peerAddr{fabric: 3, pid: 4, hasSecret: true, tcp: "10.0.0.1:9,[fd00::1]:9,127.0.0.1:9", hasCert: true, cert: [32]byte{1, 2, 3}}))
	f.Add(encodeAddr(5, 6))
	f.Add([]byte{1, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := parseAddr(b)
		if err != nil {
			return
		}
		a2, err := parseAddr(encodePeerAddr(&a))
		if err != nil || a2 != a {
			t.Fatalf("address %+v re-encodes to %+v, %v", a, a2, err)
		}
	})
}

// TestBlockingWriteLeavesNoDeadline: a large write goes through the QP's
// goroutine with a write deadline; once the deadline has passed, small
// requests (written without waiting) must still go out. (A deadline left
// on the socket failed them with a timeout and took the connection down.)
func TestBlockingWriteLeavesNoDeadline(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			forceTransport(t, kind)
			o := defaultConn()
			o.timeout, o.retryCnt = 1, 0 // the shortest response timeout: minRespTimeout
			e, a, b := pair(t, prov.QPTypeRC, o, o)
			_ = b
			src := e.alloc(1<<20, allAccess)
			dst := e.alloc(1<<20, allAccess)
			wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
				RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
			if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, 1<<20)}); err != nil {
				t.Fatal(err)
			}
			if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("large write: %+v", c)
			}
			time.Sleep(minRespTimeout + 100*time.Millisecond)
			for i := range 3 {
				if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, 64)}); err != nil {
					t.Fatal(err)
				}
				if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
					t.Fatalf("small write %d after the deadline: %+v", i, c)
				}
			}
		})
	}
}

// TestShmDescriptorChecks: the acceptor refuses descriptors that are not a
// sealed segment of the right size and two eventfds.
func TestShmDescriptorChecks(t *testing.T) {
	good, err := newShmFDs()
	if err != nil {
		t.Fatal(err)
	}
	defer fdpass.Close(good[:])
	if err := checkShmFDs(good[:]); err != nil {
		t.Fatalf("good descriptors refused: %v", err)
	}
	unsealed, small, pipe := badMemFDs(t, segSize, 4096)
	for _, tc := range []struct {
		name string
		fds  []int
	}{
		{"TooFew", good[:2]},
		{"Unsealed", []int{unsealed, good[1], good[2]}},
		{"WrongSize", []int{small, good[1], good[2]}},
		{"PipeForEventfd", []int{good[0], pipe, good[2]}},
		{"SegmentForEventfd", []int{good[0], good[0], good[2]}},
	} {
		if err := checkShmFDs(tc.fds); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

// TestRingCorruption: indices a peer scribbled on make the ring fail
// instead of reading or writing outside it.
func TestRingCorruption(t *testing.T) {
	seg := make([]byte, segSize)
	for _, tc := range []struct {
		name  string
		setup func(in, out *ring)
	}{
		{"TailFarAhead", func(in, out *ring) { *in.tail = 1 << 40 }},
		{"TailBehindHead", func(in, out *ring) { in.pos = 100; *in.tail = 50 }},
		// The producer loads head when the room it knows of is short
		// or its lap may end (ring.seen): here, far into the lap.
		{"HeadAhead", func(in, out *ring) { out.pos = lapSkipAt + 10; *out.head = 1 << 40 }},
		{"HeadAheadRoomShort", func(in, out *ring) { out.pos = ringCap - 8; *out.head = 1 << 40 }},
		{"LapOffStart", func(in, out *ring) { in.pos = 100; *in.tail = 1000; *in.lap = 500 }},
		{"LapTooFar", func(in, out *ring) { in.pos = 100; *in.tail = 3 * ringCap; *in.lap = 2 * ringCap }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(seg)
			in, out := newRing(seg, 0), newRing(seg, 1)
			tc.setup(&in, &out)
			var p [64]byte
			_, errIn := in.get(p[:])
			_, _, errOut := out.put([][]byte{p[:]})
			if errIn == nil && errOut == nil {
				t.Errorf("corruption not detected")
			}
		})
	}
	// And a ring that works: bytes across the wrap-around point (two
	// unread bytes before them: a producer that finds its ring empty
	// goes on at the next lap instead).
	clear(seg)
	in := newRing(seg, 0)
	out := newRing(seg, 0)
	out.pos, in.pos = ringCap-10, ringCap-12
	*out.tail, *out.head = ringCap-10, ringCap-12
	msg := []byte("across the end of the ring")
	if n, _, err := out.put([][]byte{msg}); err != nil || n != len(msg) {
		t.Fatalf("put %d, %v", n, err)
	}
	got := make([]byte, 64)
	n, err := in.get(got)
	if err != nil || string(got[2:n]) != string(msg) {
		t.Fatalf("get %q, %v", got[:n], err)
	}
}

// TestRingLapSkip: a producer that finds its ring empty far into a lap
// goes on at the start of the next lap, and the consumer follows it
// there; an empty ring early in its lap, or one with unread bytes, goes
// on where it is.
func TestRingLapSkip(t *testing.T) {
	seg := make([]byte, segSize)
	for _, tc := range []struct {
		name      string
		pos, head uint64 // the producer's index and the consumer's
		wantPos   uint64 // where the message goes
	}{
		{"FarIntoLap", lapSkipAt + 100, lapSkipAt + 100, ringCap},
		{"FarIntoSecondLap", ringCap + lapSkipAt, ringCap + lapSkipAt, 2 * ringCap},
		{"EarlyInLap", lapSkipAt - 1, lapSkipAt - 1, lapSkipAt - 1},
		{"NotEmpty", lapSkipAt + 100, lapSkipAt + 90, lapSkipAt + 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clear(seg)
			in, out := newRing(seg, 0), newRing(seg, 0)
			out.pos, in.pos = tc.pos, tc.head
			*out.tail, *out.head = tc.pos, tc.head
			msg := []byte("where does this go")
			if n, _, err := out.put([][]byte{msg}); err != nil || n != len(msg) {
				t.Fatalf("put %d, %v", n, err)
			}
			if out.pos != tc.wantPos+uint64(len(msg)) {
				t.Fatalf("the producer is at %d, want %d", out.pos, tc.wantPos+uint64(len(msg)))
			}
			got := make([]byte, 64)
			n, err := in.get(got)
			skipped := int(tc.pos - tc.head) // unread bytes before the message
			if err != nil || n != skipped+len(msg) || string(got[skipped:n]) != string(msg) {
				t.Fatalf("get %q, %v", got[:n], err)
			}
			if in.pos != out.pos || *in.head != out.pos {
				t.Fatalf("the consumer is at %d (head %d), the producer at %d", in.pos, *in.head, out.pos)
			}
		})
	}
}

// badMemFDs returns descriptors a peer might send instead of a sealed
// memfd of size bytes: a memfd of that size that is not sealed, a sealed
// one of other bytes, and the read end of a pipe. They are closed when t
// ends.
func badMemFDs(t *testing.T, size, other int64) (unsealed, wrongSize, pipe int) {
	t.Helper()
	unsealed = must(unix.MemfdCreate("x", unix.MFD_CLOEXEC))
	t.Cleanup(func() { unix.Close(unsealed) })
	if err := unix.Ftruncate(unsealed, size); err != nil {
		t.Fatal(err)
	}
	wrongSize = must(unix.MemfdCreate("x", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING))
	t.Cleanup(func() { unix.Close(wrongSize) })
	if err := unix.Ftruncate(wrongSize, other); err != nil {
		t.Fatal(err)
	}
	unix.FcntlInt(uintptr(wrongSize), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fdpass.Close(p[:]) })
	return unsealed, wrongSize, p[0]
}

// TestShmHandshakeRefused: a shared-memory HELLO without usable
// descriptors is refused with a reason.
func TestShmHandshakeRefused(t *testing.T) {
	ch, err := helloChallenge(t, kindShm, nil)
	if err != nil || ch.status != ackBadShm {
		t.Errorf("challenge %+v, %v; want status %d (%s)", ch, err, ackBadShm, ackReason(ackBadShm))
	}
	if ch.proof != [hsMACLen]byte{} {
		t.Errorf("a refusal carries a proof")
	}
}

// helloChallenge sends a HELLO of kind, with the descriptors fds, to the
// unix socket of a new QP's service and returns the challenge it answers.
func helloChallenge(t *testing.T, kind uint8, fds []int) (challenge, error) {
	t.Helper()
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
	nc, err := net.Dial("unix", pa.unix)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(hangGuard))
	hb := make([]byte, hdrLen+helloLen)
	putHdr(hb, frHello, helloLen, 0)
	putHello(hb[hdrLen:], &hello{kind: kind, pid: uint32(os.Getpid()), fabric: 7, target: pa.fabric,
		job: jobIdentity(), host: hostIdentity()})
	if _, _, err := nc.(*net.UnixConn).WriteMsgUnix(hb, unix.UnixRights(fds...), nil); err != nil {
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
	return parseChallenge(body)
}

// TestShmDirectReadOnlyRegion: a large read from a region that allows
// only remote reads is copied from a mapping that cannot be made writable
// (the region's descriptor was handed out read-only).
func TestShmDirectReadOnlyRegion(t *testing.T) {
	forceTransport(t, "shm")
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	src := e.alloc(1<<20, prov.AccessLocalWrite|prov.AccessRemoteRead)
	dst := e.alloc(1<<20, allAccess)
	for i := range src.b {
		src.b[i] = byte(i * 3)
	}
	wr := []prov.SendWR{{Opcode: prov.WRRead, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: src.addr(0), RKey: src.mr.RKey()}}
	if _, err := a.qp.PostSend(wr, []prov.SGE{dst.sge(0, 1<<20)}); err != nil {
		t.Fatal(err)
	}
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("read: %+v", c)
	}
	if !bytes.Equal(src.b, dst.b) {
		t.Fatal("read data differs")
	}
	cn := qpConn(t, a.qp)
	cn.impMu.RLock()
	defer cn.impMu.RUnlock()
	imp := cn.imports[src.mr.RKey()]
	if imp == nil || imp.mem == nil {
		t.Fatal("the read did not map the region (not a direct copy)")
	}
	if imp.writable {
		t.Error("a read-only region is mapped writable")
	}
	if err := unix.Mprotect(imp.mem, unix.PROT_READ|unix.PROT_WRITE); err == nil {
		t.Error("the mapping of a read-only region could be made writable")
	}
}

// TestShmDirectWriteImm: over shared memory, a large RDMA write with
// immediate into a region the target shares is copied by the requester
// into its mapping of the region before the request leaves, from
// PostSend or, above maxNBFrame, from the QP's goroutine; a small one
// goes through the ring. The receive completes with the immediate and the
// length, and a direct write posted before it (copied after its ACK) has
// landed by then.
func TestShmDirectWriteImm(t *testing.T) {
	forceTransport(t, "shm")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	const size = 1 << 20
	src, first := e.alloc(size, allAccess), e.alloc(64<<10, allAccess)
	dst, other := e.alloc(size, allAccess), e.alloc(64<<10, allAccess)
	mapped := func() bool {
		cn := qpConn(t, a.qp)
		cn.impMu.RLock()
		defer cn.impMu.RUnlock()
		imp := cn.imports[dst.mr.RKey()]
		return imp != nil && imp.mem != nil
	}
	for i, tc := range []struct {
		name   string
		n      int
		direct bool
	}{
		{"BelowDirectMin", directMin / 2, false}, // first: nothing mapped the region yet
		{"DirectMin", directMin, true},
		{"64KiB", 64 << 10, true},
		{"AboveMaxNBFrame", maxNBFrame + 4096, true},
		{"1MiB", size, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for j := range src.b {
				src.b[j] = byte(j*7 + i)
			}
			for j := range first.b {
				first.b[j] = byte(j*13 + i)
			}
			clear(dst.b)
			if _, err := b.qp.PostRecv([]prov.RecvWR{{WRID: uint64(i)}}, nil); err != nil {
				t.Fatal(err)
			}
			imm := uint32(0xabc000 + i)
			wrs := []prov.SendWR{
				{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: other.addr(0), RKey: other.mr.RKey()},
				{WRID: 2, Opcode: prov.WRWriteImm, SGEIndex: 1, NumSGE: 1, Flags: prov.SendSignaled, Imm: imm, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()},
			}
			postSend(t, a.qp, wrs, []prov.SGE{first.sge(0, len(first.b)), src.sge(0, tc.n)})
			rc := poll(t, b.rcq, 1)[0]
			if rc.Status != prov.StatusSuccess || rc.Opcode != prov.WCRecvRDMAImm || rc.Imm != imm || int(rc.ByteLen) != tc.n {
				t.Fatalf("receive: %+v", rc)
			}
			// By the receive's completion, both writes have landed.
			if !bytes.Equal(other.b, first.b) {
				t.Error("the write before the write with immediate has not landed")
			}
			if !bytes.Equal(dst.b[:tc.n], src.b[:tc.n]) {
				t.Error("the data of the write with immediate differs")
			}
			if tc.n < size && dst.b[tc.n] != 0 {
				t.Error("a byte past the write with immediate changed")
			}
			if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != 2 {
				t.Fatalf("send completion: %+v", c)
			}
			if got := mapped(); got != tc.direct {
				t.Errorf("the requester mapped the target region: %v, want %v", got, tc.direct)
			}
		})
	}
}

// TestShmDirectWriteImmStale: a write with immediate copied into a
// mapping the target no longer names by its key (here: the mapping's
// serial falsified, as after the key was reused for another region) is
// refused without taking a receive (respStale); the requester drops the
// mapping, maps the region again and sends the request again: the
// receive completes once, with the data in the region.
func TestShmDirectWriteImmStale(t *testing.T) {
	forceTransport(t, "shm")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	const n = 64 << 10
	src, dst := e.alloc(n, allAccess), e.alloc(n, allAccess)
	send := func(wrid uint64, fill byte) {
		t.Helper()
		for j := range src.b {
			src.b[j] = fill + byte(j)
		}
		if _, err := b.qp.PostRecv([]prov.RecvWR{{WRID: wrid}}, nil); err != nil {
			t.Fatal(err)
		}
		postSend(t, a.qp, []prov.SendWR{{WRID: wrid, Opcode: prov.WRWriteImm, NumSGE: 1, Flags: prov.SendSignaled,
			Imm: uint32(wrid), RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}, []prov.SGE{src.sge(0, n)})
		if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
			t.Fatalf("send %d: %+v", wrid, c)
		}
		rc := poll(t, b.rcq, 1)[0]
		if rc.Status != prov.StatusSuccess || rc.WRID != wrid || rc.Imm != uint32(wrid) || rc.ByteLen != n {
			t.Fatalf("receive %d: %+v", wrid, rc)
		}
		if !bytes.Equal(dst.b, src.b) {
			t.Fatalf("write %d: the region does not hold its data", wrid)
		}
	}
	send(1, 0x10) // through the target (the QP's first write: wrOK)
	send(2, 0x20) // maps the region
	cn := qpConn(t, a.qp)
	cn.impMu.Lock()
	old := cn.imports[dst.mr.RKey()]
	if old == nil || old.mem == nil {
		cn.impMu.Unlock()
		t.Fatal("the second write did not map the region (not a direct copy)")
	}
	old.serial += 1000 // another region's, as far as the target knows
	cn.impMu.Unlock()
	send(3, 0x40)
	cn.impMu.RLock()
	now := cn.imports[dst.mr.RKey()]
	cn.impMu.RUnlock()
	if now == nil || now == old || now.serial == old.serial {
		t.Errorf("the stale mapping was kept (%p, was %p)", now, old)
	}
	if k, err := b.rcq.Poll(make([]prov.Completion, 4)); err != nil || k != 0 {
		t.Errorf("%d more receive completions (%v): the refused request took a receive", k, err)
	}
	send(4, 0x70) // and the new mapping serves the next one
}

// TestShmDirectWriteImmRefused: a write with immediate to a QP that
// refuses remote writes (its access flags) fails and leaves the region
// as it was, although the region allows remote writes and is shared: a
// write with immediate is copied before it leaves only once a write of
// the QP was acknowledged (xstate.wrOK); before, it goes through the
// target, which checks the QP first, as a NIC does.
func TestShmDirectWriteImmRefused(t *testing.T) {
	forceTransport(t, "shm")
	ob := defaultConn()
	ob.access = prov.AccessLocalWrite | prov.AccessRemoteRead
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), ob)
	const n = 64 << 10
	src, dst := e.alloc(n, allAccess), e.alloc(n, allAccess)
	for i := range src.b {
		src.b[i] = 0x5A
	}
	postRecv(t, b.qp, 1)
	// A read maps the region (the requester then holds a writable
	// mapping of it): only the QP's refusal stands in the way.
	postSend(t, a.qp, []prov.SendWR{{WRID: 1, Opcode: prov.WRRead, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}},
		[]prov.SGE{src.sge(0, n)})
	if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("read: %+v", c)
	}
	for i := range src.b {
		src.b[i] = 0x5A
	}
	postSend(t, a.qp, []prov.SendWR{{WRID: 2, Opcode: prov.WRWriteImm, NumSGE: 1, Flags: prov.SendSignaled, Imm: 9, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}},
		[]prov.SGE{src.sge(0, n)})
	if c := poll(t, a.scq, 1)[0]; c.Status == prov.StatusSuccess {
		t.Fatalf("a write with immediate to a QP without remote write access succeeded: %+v", c)
	}
	if !bytes.Equal(dst.b, make([]byte, n)) {
		t.Error("the refused write with immediate changed the region")
	}
}
