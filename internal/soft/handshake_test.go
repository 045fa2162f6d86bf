package soft

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/pintls"
	"github.com/goverbs/verbs/internal/prov"
)

// fakeProc is a made-up process that speaks the handshake from raw bytes:
// its fabric id and connection secret are the test's.
type fakeProc struct {
	fabric uint64
	pid    uint32
	secret [16]byte
	kind   uint8 // link kind of its hello (0: kindTCP)
	// unbound: the dialer's proofs leave out the TLS binding, as a
	// relay between two TLS sessions would have to
	unbound bool
}

// fakeProcOf is the made-up process of fabric id fabric, with a secret
// derived from it: a test and the child process it starts agree on it
// without telling each other.
func fakeProcOf(fabric uint64) *fakeProc {
	rp := &fakeProc{fabric: fabric, pid: 1}
	sum := sha256.Sum256(binary.LittleEndian.AppendUint64([]byte("goverbs soft test process\x00"), fabric))
	copy(rp.secret[:], sum[:])
	return rp
}

// addr is the provider address of the made-up process (unreachable).
func (rp *fakeProc) addr() peerAddr {
	return peerAddr{fabric: rp.fabric, pid: rp.pid, tcp: "127.0.0.1:1", secret: rp.secret, hasSecret: true}
}

// handshakeResult is what the raw dialer saw.
type handshakeResult struct {
	challenge challenge
	status    uint8 // AUTH_ACK status, or the challenge's refusal
	sent      []byte
}

// rawHandshake runs the dialer's side of the handshake on rw as rp,
// towards the process at pa, proving targetSecret (the secret of pa's
// endpoint if the dialer holds it). binding is the TLS exporter value
// (nil: plain). It checks the acceptor's proof against pa's secret.
func rawHandshake(t testing.TB, rw io.ReadWriter, rp *fakeProc, pa *peerAddr, targetSecret [16]byte, binding []byte) handshakeResult {
	t.Helper()
	var res handshakeResult
	hb := make([]byte, hdrLen+helloLen)
	putHdr(hb, frHello, helloLen, 0)
	hl := hello{kind: cmp.Or(rp.kind, kindTCP), pid: rp.pid, fabric: rp.fabric, target: pa.fabric, job: jobIdentity(), host: hostIdentity()}
	copy(hl.nonce[:], randomBytes(hsNonceLen))
	putHello(hb[hdrLen:], &hl)
	if _, err := rw.Write(hb); err != nil {
		t.Fatalf("write hello: %v", err)
	}
	res.sent = append(res.sent, hb...)
	cb := make([]byte, hdrLen+challengeLen)
	if _, err := io.ReadFull(rw, cb); err != nil {
		t.Fatalf("read challenge: %v", err)
	}
	body, err := handshakeBody(cb, frChallenge)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := parseChallenge(body)
	if err != nil {
		t.Fatal(err)
	}
	res.challenge = ch
	if ch.status != ackOK {
		res.status = ch.status
		return res
	}
	tr := transcript(hb[hdrLen:], ch.pid, ch.fabric, &ch.nonce, binding)
	if want := handshakeMAC(&pa.secret, labelAcceptor, &tr); !macEqual(&want, &ch.proof) {
		t.Fatalf("the acceptor's proof does not match its secret")
	}
	if rp.unbound {
		tr = transcript(hb[hdrLen:], ch.pid, ch.fabric, &ch.nonce, nil)
	}
	a := auth{proof: handshakeMAC(&targetSecret, labelDialer, &tr), ident: handshakeMAC(&rp.secret, labelIdentity, &tr)}
	ab := make([]byte, hdrLen+authLen)
	putHdr(ab, frAuth, authLen, 0)
	putAuth(ab[hdrLen:], &a)
	if _, err := rw.Write(ab); err != nil {
		t.Fatalf("write auth: %v", err)
	}
	res.sent = append(res.sent, ab...)
	aa := make([]byte, hdrLen+authAckLen)
	if _, err := io.ReadFull(rw, aa); err != nil {
		res.status = 0xff // dropped
		return res
	}
	body, err = handshakeBody(aa, frAuthAck)
	if err != nil {
		t.Fatal(err)
	}
	if res.status, err = parseAuthAck(body); err != nil {
		t.Fatal(err)
	}
	return res
}

// dialTCP connects to addr, with hangGuard as the deadline; the
// connection is closed when the test ends.
func dialTCP(t testing.TB, addr string) net.Conn {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(hangGuard))
	return nc
}

// rawConnect dials the TCP listener of the process at pa and handshakes
// as rp, proving pa's secret; it fails the test unless the acceptor
// takes the connection.
func rawConnect(t *testing.T, pa *peerAddr, rp *fakeProc) net.Conn {
	t.Helper()
	nc := dialTCP(t, pa.tcp)
	if r := rawHandshake(t, nc, rp, pa, pa.secret, nil); r.status != ackOK {
		t.Fatalf("handshake refused: %s", ackReason(r.status))
	}
	return nc
}

// recordingProxy forwards TCP connections to target and records every
// byte in both directions.
type recordingProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	rec    bytes.Buffer
	wg     sync.WaitGroup
	conns  []net.Conn
}

func newRecordingProxy(t *testing.T, target string) *recordingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &recordingProxy{ln: ln, target: target}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			p.wg.Add(2)
			go p.copy(u, c)
			go p.copy(c, u)
		}
	}()
	t.Cleanup(p.close)
	return p
}

func (p *recordingProxy) copy(dst, src net.Conn) {
	defer p.wg.Done()
	b := make([]byte, 64<<10)
	for {
		n, err := src.Read(b)
		if n > 0 {
			p.mu.Lock()
			p.rec.Write(b[:n])
			p.mu.Unlock()
			if _, err := dst.Write(b[:n]); err != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
}

func (p *recordingProxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *recordingProxy) recorded() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return bytes.Clone(p.rec.Bytes())
}

// viaProxy returns a provider address whose TCP transport is the proxy's.
func viaProxy(t *testing.T, addr []byte, proxy string) []byte {
	t.Helper()
	pa, err := parseAddr(addr)
	if err != nil {
		t.Fatal(err)
	}
	pa.tcp = proxy
	return encodePeerAddr(&pa)
}

func forceTLS(t testing.TB, policy string) {
	t.Helper()
	restore, err := ForceTLS(policy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
}

// addrQP is a QP whose provider address reads as addr.
type addrQP struct {
	prov.QP
	addr []byte
}

func (q addrQP) Address() []byte { return q.addr }

// connectVia connects a and b (RC) with b's endpoint rewritten to reach
// its process through the proxy (a's requests, and so the connection,
// go through it).
func connectVia(t *testing.T, a, b *ep, proxy string) {
	t.Helper()
	connectOne(t, a.qp, addrQP{b.qp, viaProxy(t, b.qp.Address(), proxy)}, prov.QPTypeRC, defaultConn())
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
}

// TestSnifferLearnsNothing records every byte of a TCP connection
// between two QPs, handshake and traffic, with a proxy in the middle:
// the connection secret of the process never appears on the wire (it did
// in the hello of wire version 1), and with TLS the payload does not
// either.
func TestSnifferLearnsNothing(t *testing.T) {
	for _, tc := range []struct {
		policy      string
		payloadSeen bool
	}{
		{tlsOff, true},
		{tlsOn, false},
	} {
		t.Run("tls="+tc.policy, func(t *testing.T) {
			forceTransport(t, "tcp")
			forceTLS(t, tc.policy)
			e := newEnv(t)
			a := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
			b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
			pa, err := parseAddr(b.qp.Address())
			if err != nil {
				t.Fatal(err)
			}
			proxy := newRecordingProxy(t, strings.Split(pa.tcp, ",")[0])
			connectVia(t, a, b, proxy.ln.Addr().String())

			payload := bytes.Repeat([]byte("SECRET-PAYLOAD-"), 100)
			src := e.alloc(len(payload), allAccess)
			dst := e.alloc(len(payload), allAccess)
			copy(src.b, payload)
			wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
				RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
			if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, len(payload))}); err != nil {
				t.Fatal(err)
			}
			if c := poll(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
				t.Fatalf("write: %+v", c)
			}
			if !bytes.Equal(dst.b, payload) {
				t.Fatalf("the write did not arrive")
			}
			rec := proxy.recorded()
			if len(rec) < hdrLen+helloLen {
				t.Fatalf("recorded %d bytes: the connection did not go through the proxy", len(rec))
			}
			if bytes.Contains(rec, pa.secret[:]) {
				t.Errorf("the connection secret crossed the wire")
			}
			if got := bytes.Contains(rec, []byte("SECRET-PAYLOAD-")); got != tc.payloadSeen {
				t.Errorf("payload on the wire: %v, want %v", got, tc.payloadSeen)
			}
		})
	}
}

// plainTarget forces plain TCP for the test and returns the provider
// address of a new RC QP, the target of a raw peer.
func plainTarget(t *testing.T) peerAddr {
	t.Helper()
	forceTransport(t, "tcp")
	forceTLS(t, tlsOff)
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	pa, err := parseAddr(b.qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	return pa
}

// TestHandshakeReplay replays a recorded dialer's bytes (HELLO and AUTH)
// to the acceptor: the fresh challenge makes its proof worthless.
func TestHandshakeReplay(t *testing.T) {
	pa := plainTarget(t)
	rp := &fakeProc{fabric: 0x1234, pid: 1}
	copy(rp.secret[:], randomBytes(16))

	// Record a real handshake, then replay its bytes.
	nc := dialTCP(t, pa.tcp)
	r := rawHandshake(t, nc, rp, &pa, pa.secret, nil)
	nc.Close()
	if r.status != ackOK {
		t.Fatalf("handshake: %s", ackReason(r.status))
	}
	nc = dialTCP(t, pa.tcp)
	if _, err := nc.Write(r.sent[:hdrLen+helloLen]); err != nil {
		t.Fatal(err)
	}
	cb := make([]byte, hdrLen+challengeLen)
	if _, err := io.ReadFull(nc, cb); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Write(r.sent[hdrLen+helloLen:]); err != nil {
		t.Fatal(err)
	}
	aa := make([]byte, hdrLen+authAckLen)
	if _, err := io.ReadFull(nc, aa); err != nil {
		t.Fatal(err)
	}
	if st, err := parseAuthAck(aa[hdrLen:]); err != nil || st != ackBadSecret {
		t.Fatalf("replayed handshake: status %d (%s), %v; want %s", st, ackReason(st), err, ackReason(ackBadSecret))
	}
	expectDropped(t, nc)
}

// TestHandshakeWrongSecret: a dialer that does not hold the secret of
// the endpoint is refused after the challenge.
func TestHandshakeWrongSecret(t *testing.T) {
	pa := plainTarget(t)
	nc := dialTCP(t, pa.tcp)
	var guess [16]byte
	copy(guess[:], randomBytes(16))
	rp := &fakeProc{fabric: 0x99, pid: 1}
	if r := rawHandshake(t, nc, rp, &pa, guess, nil); r.status != ackBadSecret {
		t.Fatalf("status %d (%s), want %s", r.status, ackReason(r.status), ackReason(ackBadSecret))
	}
	expectDropped(t, nc)
}

// TestHandshakeImpostor: something listening at an endpoint's TCP
// address that does not hold the endpoint's secret (it answers a
// challenge with a made-up proof) is refused by the dialer.
func TestHandshakeImpostor(t *testing.T) {
	forceTLS(t, tlsOff)
	e := newEnv(t)
	s := e.ctx.(*devContext).f.service()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(hangGuard))
		hb := make([]byte, hdrLen+helloLen)
		if _, err := io.ReadFull(c, hb); err != nil {
			return
		}
		hl, _ := parseHello(hb[hdrLen:])
		ch := challenge{status: ackOK, pid: 1, fabric: hl.target}
		copy(ch.proof[:], randomBytes(hsMACLen))
		out := make([]byte, hdrLen+challengeLen)
		putHdr(out, frChallenge, challengeLen, 0)
		putChallenge(out[hdrLen:], &ch)
		c.Write(out)
		io.Copy(io.Discard, c)
	}()
	pa := peerAddr{fabric: 0x5555, pid: 1, tcp: ln.Addr().String(), hasSecret: true, host: hostIdentity(), hasHost: true}
	copy(pa.secret[:], randomBytes(16))
	_, err = s.dial(&pa, transportTCP)
	if err == nil || !strings.Contains(err.Error(), "does not hold the endpoint's connection secret") {
		t.Fatalf("dial to an impostor: %v", err)
	}
	<-done
}

// TestIdentityHijack: a raw peer that holds an endpoint of this process
// (so it passes the handshake) claims the fabric identity of the process
// a QP is connected to. Its requests to that QP are dropped, memory is
// untouched, and the QP's own requests keep going to the real peer: in
// wire version 1 the claim was believed, the write landed, and the QP
// started sending its requests to the impostor.
func TestIdentityHijack(t *testing.T) {
	forceTransport(t, "tcp")
	forceTLS(t, tlsOff)
	e := newEnv(t)
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	r := must(mem.Alloc(4096, "test", false))
	t.Cleanup(func() { r.Free() })
	m := must(e.pd.RegMR(prov.Mem{Ptr: r.Ptr(), Len: 4096, FD: -1}, allAccess))
	t.Cleanup(func() { m.Close() })
	pa, err := parseAddr(b.qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	// The real peer: a made-up process whose secret the test holds.
	real := &fakeProc{fabric: pa.fabric ^ 0xbeef, pid: 1}
	copy(real.secret[:], randomBytes(16))
	ra := real.addr()
	toInit(t, b.qp, prov.QPTypeRC, defaultConn())
	av := prov.AHAttr{DGID: getFabric().gids[1], SGIDIndex: 1, HopLimit: 64, IsGlobal: true, Port: 1,
		ProviderAddr: encodePeerAddr(&ra)}
	rtr := prov.QPAttr{State: prov.QPStateRTR, PathMTU: prov.MTU4096, DestQPN: fakeSrcQPN, MaxDestRDAtom: 16, MinRNRTimer: 1, AH: av}
	if err := b.qp.Modify(&rtr, prov.AttrState|prov.AttrAV|prov.AttrPathMTU|prov.AttrDestQPN|prov.AttrRQPSN|
		prov.AttrMaxDestRDAtom|prov.AttrMinRNRTimer); err != nil {
		t.Fatal(err)
	}
	rts := prov.QPAttr{State: prov.QPStateRTS, Timeout: 14, RetryCnt: 7, RNRRetry: 7, MaxRDAtomic: 16}
	if err := b.qp.Modify(&rts, prov.AttrState|prov.AttrTimeout|prov.AttrRetryCnt|prov.AttrRNRRetry|
		prov.AttrSQPSN|prov.AttrMaxQPRDAtomic); err != nil {
		t.Fatal(err)
	}
	legit := &hostile{nc: rawConnect(t, &pa, real), qpn: b.qp.QPN(), srcQPN: fakeSrcQPN, mr: m}

	// The real peer writes: acknowledged, and b's requests now go back
	// on its connection.
	psn := uint32(0)
	w := legit.reqFrame(opWrite, m.Addr(), 4, []byte("real"))
	if _, err := legit.nc.Write(w); err != nil {
		t.Fatal(err)
	}
	if resp := readResp(t, legit.nc); resp.code != respACK {
		t.Fatalf("the real peer's write: code %d", resp.code)
	}
	psn++

	// The impostor holds b's endpoint, claims the real peer's identity,
	// but not its secret.
	imp := &fakeProc{fabric: real.fabric, pid: 2}
	copy(imp.secret[:], randomBytes(16))
	bad := &hostile{nc: rawConnect(t, &pa, imp), qpn: b.qp.QPN(), srcQPN: fakeSrcQPN, mr: m}
	for _, op := range []struct {
		name  string
		frame []byte
	}{
		{"write", withPSN(bad.reqFrame(opWrite, m.Addr(), 4, []byte("evil")), psn)},
		{"read", withPSN(bad.reqFrame(opRead, m.Addr(), 4, nil), psn)},
		{"atomic", withPSN(atomicFrame(bad, m.Addr()), psn)},
	} {
		if _, err := bad.nc.Write(op.frame); err != nil {
			t.Fatal(err)
		}
		if resp := readResp(t, bad.nc); resp.code != respDropped {
			t.Errorf("the impostor's %s: code %d, want dropped (%d)", op.name, resp.code, respDropped)
		}
	}
	if got := string(r.Bytes()[:4]); got != "real" {
		t.Fatalf("target memory %q after the impostor's requests, want %q", got, "real")
	}

	// b's next request goes to the real peer, not to the impostor.
	src := e.alloc(8, allAccess)
	copy(src.b, "to-real!")
	if _, err := b.qp.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{src.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	legit.nc.SetReadDeadline(time.Now().Add(hangGuard))
	if h, body := readFrame(t, legit.nc); h.typ != frReq || !bytes.HasSuffix(body, []byte("to-real!")) {
		t.Fatalf("the real peer got frame %+v", h)
	}
	bad.nc.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, _ := bad.nc.Read(make([]byte, 1)); n > 0 {
		t.Fatalf("the impostor received b's request")
	}
}

// withPSN sets the PSN of a request frame.
func withPSN(b []byte, psn uint32) []byte {
	binary.LittleEndian.PutUint32(b[hdrLen+16:], psn)
	return b
}

func atomicFrame(h *hostile, raddr uint64) []byte {
	req := request{op: opFAA, qpType: uint8(prov.QPTypeRC), srcQPN: h.srcQPN, dstQPN: h.qpn, npkts: 1, mtu: 4096,
		length: 8, raddr: raddr, rkey: h.mr.RKey(), compare: 1}
	b := make([]byte, hdrLen+reqBodyLen)
	putHdr(b, frReq, reqBodyLen, 1)
	putReq(b[hdrLen:], &req, 0)
	return b
}

// readFrame reads one frame: its header and the rest.
func readFrame(t *testing.T, nc net.Conn) (frameHdr, []byte) {
	t.Helper()
	hb := make([]byte, hdrLen)
	if _, err := io.ReadFull(nc, hb); err != nil {
		t.Fatalf("read frame: %v", err)
	}
	h, err := parseHdr(hb)
	if err != nil {
		t.Fatal(err)
	}
	body := make([]byte, h.length)
	if _, err := io.ReadFull(nc, body); err != nil {
		t.Fatalf("read frame body: %v", err)
	}
	return h, body
}

// TestTLSPinning: an encrypted connection goes only to the certificate
// the endpoint names; an endpoint without one cannot be reached when
// encryption is required; a plain hello is refused where TLS is required.
func TestTLSPinning(t *testing.T) {
	forceTLS(t, tlsOn)
	e := newEnv(t)
	s := e.ctx.(*devContext).f.service()
	b := e.newQP(prov.QPTypeRC, defaultCaps(), nil)
	pa, err := parseAddr(b.qp.Address())
	if err != nil {
		t.Fatal(err)
	}
	if !pa.hasCert || pa.cert != s.tlsID.Fingerprint() {
		t.Fatalf("the endpoint does not carry the process' certificate fingerprint")
	}
	t.Run("WrongFingerprint", func(t *testing.T) {
		wrong := pa
		wrong.cert[0] ^= 1
		_, err := s.dial(&wrong, transportTCP)
		if !errors.Is(err, pintls.ErrFingerprint) {
			t.Fatalf("dial with a wrong fingerprint: %v, want %v", err, pintls.ErrFingerprint)
		}
	})
	t.Run("NoFingerprint", func(t *testing.T) {
		none := pa
		none.hasCert, none.cert = false, [32]byte{}
		_, err := s.dial(&none, transportTCP)
		if err == nil || !strings.Contains(err.Error(), "carries no certificate fingerprint") {
			t.Fatalf("dial without a fingerprint: %v", err)
		}
	})
	t.Run("PlainRefused", func(t *testing.T) {
		nc := dialTCP(t, pa.tcp)
		rp := &fakeProc{fabric: 7, pid: 1}
		if r := rawHandshake(t, nc, rp, &pa, pa.secret, nil); r.status != ackNeedTLS {
			t.Fatalf("plain hello with TLS required: status %d (%s)", r.status, ackReason(r.status))
		}
	})
	t.Run("Pinned", func(t *testing.T) {
		c, err := s.dial(&pa, transportTCP)
		if err != nil {
			t.Fatal(err)
		}
		if c.link == nil {
			t.Fatalf("the connection is not encrypted")
		}
		c.fail(errors.New("test done"))
	})
	t.Run("RawTLSPeer", func(t *testing.T) {
		// Proofs bound to the session are accepted, proofs that are
		// not (a relay's) are refused.
		tc, binding := tlsSession(t, pa.tcp, pa.cert)
		rp := &fakeProc{fabric: 8, pid: 1}
		if r := rawHandshake(t, tc, rp, &pa, pa.secret, binding); r.status != ackOK {
			t.Fatalf("bound proofs refused: %s", ackReason(r.status))
		}
		tc2, binding2 := tlsSession(t, pa.tcp, pa.cert)
		rp.unbound = true
		if r := rawHandshake(t, tc2, rp, &pa, pa.secret, binding2); r.status != ackBadSecret {
			t.Fatalf("unbound proofs: status %d (%s), want %s", r.status, ackReason(r.status), ackReason(ackBadSecret))
		}
	})
}

// tlsSession opens a TLS session to the service at addr, pinning fp,
// and returns it with its binding.
func tlsSession(t *testing.T, addr string, fp [32]byte) (*tls.Conn, []byte) {
	t.Helper()
	nc := dialTCP(t, addr)
	tc := tls.Client(nc, pintls.ClientConfig(fp))
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	binding, err := tlsBinding(tc)
	if err != nil {
		t.Fatal(err)
	}
	return tc, binding
}

// TestTLSTraffic runs every kind of RC request over an encrypted TCP
// connection.
func TestTLSTraffic(t *testing.T) {
	forceTransport(t, "tcp")
	forceTLS(t, tlsOn)
	e, a, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	const n = 1 << 20
	src := e.alloc(n, allAccess)
	dst := e.alloc(n, allAccess)
	for i := range src.b {
		src.b[i] = byte(i * 7)
	}
	// Write, then read it back into a third buffer, then send.
	back := e.alloc(n, allAccess)
	wrs := []prov.SendWR{
		{WRID: 1, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()},
		{WRID: 2, Opcode: prov.WRRead, SGEIndex: 1, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()},
	}
	if _, err := a.qp.PostSend(wrs, []prov.SGE{src.sge(0, n), back.sge(0, n)}); err != nil {
		t.Fatal(err)
	}
	for _, c := range poll(t, a.scq, 2) {
		if c.Status != prov.StatusSuccess {
			t.Fatalf("completion %+v", c)
		}
	}
	if !bytes.Equal(dst.b, src.b) || !bytes.Equal(back.b, src.b) {
		t.Fatalf("data differs after an encrypted write and read")
	}
}

// TestProvesAfterProof: once a connection's peer has proven a secret,
// proves compares the secret of the address asked about with it, every
// byte of it.
func TestProvesAfterProof(t *testing.T) {
	secret := [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	var a peerAuth
	a.proven.Store(&secret)
	tests := []struct {
		name string
		flip int // the byte changed (-1: none)
		has  bool
		want bool
	}{
		{"same", -1, true, true},
		{"no secret", -1, false, false},
		{"first byte", 0, true, false},
		{"last of the first word", 7, true, false},
		{"first of the second word", 8, true, false},
		{"last byte", 15, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pa := peerAddr{secret: secret, hasSecret: tt.has}
			if tt.flip >= 0 {
				pa.secret[tt.flip] ^= 0x80
			}
			if got := a.proves(&pa); got != tt.want {
				t.Fatalf("proves = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestTLSStrangerMemory: strangers (no endpoint, no secret) that complete
// a TLS handshake with the TCP listener and then say nothing make it hold
// tens of KiB each (service.go: "a few hundred bytes (tens of KiB with
// TLS)"; DESIGN §8: nothing beyond a small hello before the peer is
// authenticated), as many as maxHandshakes of them at once. Before, the
// socket under each session had its full buffers from the first byte, a
// reader and a writer of tlsBuf: 526 KiB of live heap per stranger, 32 MiB
// for 64.
func TestTLSStrangerMemory(t *testing.T) {
	forceTransport(t, "tcp")
	e, _, _ := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	s := e.ctx.(*devContext).f.service()
	pa, err := parseAddr(s.addr)
	if err != nil {
		t.Fatal(err)
	}
	_, port, err := net.SplitHostPort(pa.tcp)
	if err != nil {
		t.Fatal(err)
	}
	const perSrc = maxHandshakesPerSource
	const nsrc = maxHandshakes / perSrc
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	for i := range nsrc {
		src := &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(2+i))}
		for range perSrc {
			d := net.Dialer{LocalAddr: src}
			nc, err := d.Dial("tcp", net.JoinHostPort("127.0.0.1", port))
			if err != nil {
				t.Fatal(err)
			}
			tc := tls.Client(nc, pintls.UnpinnedClientConfig())
			if err := tc.Handshake(); err != nil {
				nc.Close()
				t.Fatalf("a stranger's TLS handshake: %v", err)
			}
			held = append(held, tc)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	grew := int64(m1.HeapAlloc) - int64(m0.HeapAlloc)
	per := grew / int64(len(held))
	t.Logf("%d strangers in their handshake: the live heap grew by %d KiB, %d KiB each", len(held), grew>>10, per>>10)
	if per > 128<<10 {
		t.Errorf("each unauthenticated TLS stranger holds %d KiB of the listener's heap (tens of KiB at most); %d of them %d MiB", per>>10, len(held), grew>>20)
	}
}
