package soft

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
)

// The handshake of a connection between two soft services (wire version
// 2). The dialer holds an endpoint of the acceptor's process, and with it
// the acceptor's fabric id and connection secret (addr.go); the secret
// never crosses the wire. Both sides prove that they hold it with HMACs
// over a transcript of both sides' fresh nonces, so a recorded handshake
// cannot be replayed and a sniffer of the handshake learns nothing it
// could connect with:
//
//	dialer   → HELLO      kind, pid, fabric, target fabric, job, host, nonce_d
//	acceptor → CHALLENGE  status, pid, fabric, nonce_a,
//	                      proof_a = HMAC(S_t, "acceptor" ‖ T)
//	dialer   → AUTH       proof_d = HMAC(S_t, "dialer" ‖ T),
//	                      ident_d = HMAC(S_d, "identity" ‖ T)
//	acceptor → AUTH_ACK   status
//
// S_t is the acceptor's secret, S_d the dialer's, and T the SHA-256 of the
// HELLO body, the acceptor's pid, fabric id and nonce, and, on TLS, 32
// bytes exported from the TLS session (RFC 8446 exporter), which binds
// the proofs to that session: a relay between two TLS sessions fails.
// MACs are compared in constant time.
//
// proof_a tells the dialer that it reached the process the endpoint came
// from; proof_d tells the acceptor that the dialer holds one of its
// endpoints (a stranger's HELLO is answered with a CHALLENGE and then
// dropped: nothing else is allocated for it). ident_d is the dialer's
// claim to its own fabric identity: the acceptor cannot check it at once,
// since it knows S_d only from an endpoint of the dialer's process that
// one of its QPs is connected to. It keeps ident_d with T and checks it
// the first time a request on the connection claims to come from a QP
// connected to that process (peerAuth.proves). So a holder of one of this
// process' endpoints that claims the fabric id of a real peer gets its
// requests dropped, as a stranger's packets are on hardware, and never
// becomes the route of the QPs connected to that peer.
//
// The HELLO of a shared-memory link carries the segment and its two
// eventfds (SCM_RIGHTS); a unix socket peer's credentials are checked with
// SO_PEERCRED on both sides. TCP connections to an address that is not a
// loopback one are encrypted with TLS 1.3 first (tls.go).

const (
	helloLen     = 88
	challengeLen = 80
	authLen      = 64
	authAckLen   = 8

	hsNonceLen = 32
	hsMACLen   = sha256.Size
)

// Link kinds in HELLO.
const (
	kindTCP  = 1
	kindUnix = 2
	kindShm  = 3 // unix socket for the handshake, rings in shared memory
)

type hello struct {
	kind   uint8
	pid    uint32
	fabric uint64 // the dialer's fabric id
	target uint64 // the acceptor's fabric id, from its address
	job    [16]byte
	host   [16]byte
	nonce  [hsNonceLen]byte
}

func putHello(b []byte, h *hello) {
	b[0] = h.kind
	b[1], b[2], b[3] = 0, 0, 0
	binary.LittleEndian.PutUint32(b[4:], h.pid)
	binary.LittleEndian.PutUint64(b[8:], h.fabric)
	binary.LittleEndian.PutUint64(b[16:], h.target)
	copy(b[24:40], h.job[:])
	copy(b[40:56], h.host[:])
	copy(b[56:88], h.nonce[:])
}

var errBadHello = errors.New("malformed handshake")

func parseHello(b []byte) (hello, error) {
	var h hello
	if len(b) < helloLen {
		return h, errBadHello
	}
	h.kind = b[0]
	h.pid = binary.LittleEndian.Uint32(b[4:])
	h.fabric = binary.LittleEndian.Uint64(b[8:])
	h.target = binary.LittleEndian.Uint64(b[16:])
	copy(h.job[:], b[24:40])
	copy(h.host[:], b[40:56])
	copy(h.nonce[:], b[56:88])
	if h.kind != kindTCP && h.kind != kindUnix && h.kind != kindShm {
		return h, fmt.Errorf("%w: link kind %d", errBadHello, h.kind)
	}
	return h, checkReserved(b[1:4])
}

// checkReserved checks that the reserved bytes b are zero.
func checkReserved(b []byte) error {
	for _, x := range b {
		if x != 0 {
			return fmt.Errorf("%w: reserved bytes set", errBadHello)
		}
	}
	return nil
}

// decodeHello checks a HELLO frame (header and body).
func decodeHello(b []byte) (hello, error) {
	body, err := handshakeBody(b, frHello)
	if err != nil {
		return hello{}, err
	}
	return parseHello(body)
}

// Handshake results, in CHALLENGE and AUTH_ACK.
const (
	ackOK        = 0
	ackBadTarget = 1 // the dialer named another fabric
	ackBadSecret = 2 // the dialer's proof does not match the acceptor's secret
	ackBadJob    = 3
	ackBadPeer   = 4 // credentials do not match (unix socket)
	ackClosing   = 5 // the service is stopping
	ackBadShm    = 6 // the shared memory descriptors are unusable
	ackNeedTLS   = 7 // a plain TCP connection where the acceptor requires TLS
	ackTooMany   = 8 // the acceptor holds maxRemoteConns TCP connections
)

var ackReasons = [...]string{
	ackOK:        "ok",
	ackBadTarget: "the address names another process (stale endpoint?)",
	ackBadSecret: "the connection secret does not match (the endpoint did not come from this process)",
	ackBadJob:    "the processes belong to different jobs (GOVERBS_SOFT_JOB)",
	ackBadPeer:   "the peer's credentials do not match its hello",
	ackClosing:   "the service is stopping",
	ackBadShm:    "the shared memory segment or eventfds sent are unusable",
	ackNeedTLS:   "it accepts TCP from this address only with TLS (" + envTLS + ")",
	ackTooMany:   "it holds as many TCP connections as it accepts",
}

func ackReason(s uint8) string {
	if int(s) < len(ackReasons) {
		return ackReasons[s]
	}
	return fmt.Sprintf("status %d", s)
}

// challenge is the acceptor's answer to a HELLO.
type challenge struct {
	status uint8
	pid    uint32
	fabric uint64
	nonce  [hsNonceLen]byte
	proof  [hsMACLen]byte // proof_a; zero unless status is ackOK
}

func putChallenge(b []byte, c *challenge) {
	clear(b[:challengeLen])
	b[0] = c.status
	binary.LittleEndian.PutUint32(b[4:], c.pid)
	binary.LittleEndian.PutUint64(b[8:], c.fabric)
	copy(b[16:48], c.nonce[:])
	copy(b[48:80], c.proof[:])
}

func parseChallenge(b []byte) (challenge, error) {
	var c challenge
	if len(b) < challengeLen {
		return c, errBadHello
	}
	c.status = b[0]
	c.pid = binary.LittleEndian.Uint32(b[4:])
	c.fabric = binary.LittleEndian.Uint64(b[8:])
	copy(c.nonce[:], b[16:48])
	copy(c.proof[:], b[48:80])
	return c, checkReserved(b[1:4])
}

// auth is the dialer's answer to a CHALLENGE.
type auth struct {
	proof [hsMACLen]byte // proof_d
	ident [hsMACLen]byte // ident_d
}

func putAuth(b []byte, a *auth) {
	copy(b[0:32], a.proof[:])
	copy(b[32:64], a.ident[:])
}

func parseAuth(b []byte) (auth, error) {
	var a auth
	if len(b) < authLen {
		return a, errBadHello
	}
	copy(a.proof[:], b[0:32])
	copy(a.ident[:], b[32:64])
	return a, nil
}

func putAuthAck(b []byte, status uint8) {
	clear(b[:authAckLen])
	b[0] = status
}

func parseAuthAck(b []byte) (uint8, error) {
	if len(b) < authAckLen {
		return 0, errBadHello
	}
	return b[0], checkReserved(b[1:authAckLen])
}

// readHandshake reads a handshake frame of type want into b (the frame's
// whole size) and returns its body.
func readHandshake(r io.Reader, b []byte, want frameType) ([]byte, error) {
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return handshakeBody(b, want)
}

// handshakeBody checks the header of a handshake frame of type want and
// returns its body.
func handshakeBody(b []byte, want frameType) ([]byte, error) {
	h, err := parseHdr(b)
	if err == nil && h.typ != want {
		err = fmt.Errorf("%w: frame type %d, want %d", errBadHello, h.typ, want)
	}
	if err != nil {
		return nil, err
	}
	return b[hdrLen:], nil
}

// transcript returns T: the hash of what both sides said before the
// proofs, bound to the TLS session when there is one (binding is nil
// otherwise).
func transcript(helloBody []byte, acceptorPID uint32, acceptorFabric uint64, nonceA *[hsNonceLen]byte, binding []byte) [32]byte {
	h := sha256.New()
	h.Write([]byte("goverbs-soft handshake v2\x00"))
	h.Write(helloBody[:helloLen])
	var b [12]byte
	binary.LittleEndian.PutUint32(b[0:], acceptorPID)
	binary.LittleEndian.PutUint64(b[4:], acceptorFabric)
	h.Write(b[:])
	h.Write(nonceA[:])
	var bl [1]byte
	bl[0] = byte(len(binding))
	h.Write(bl[:])
	h.Write(binding)
	var t [32]byte
	h.Sum(t[:0])
	return t
}

// Labels of the three proofs.
const (
	labelAcceptor = "acceptor"
	labelDialer   = "dialer"
	labelIdentity = "identity"
)

// handshakeMAC returns HMAC-SHA256(secret, label ‖ 0 ‖ t).
func handshakeMAC(secret *[16]byte, label string, t *[32]byte) [hsMACLen]byte {
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte(label))
	m.Write([]byte{0})
	m.Write(t[:])
	var out [hsMACLen]byte
	m.Sum(out[:0])
	return out
}

// macEqual compares two MACs in constant time.
func macEqual(a, b *[hsMACLen]byte) bool { return subtle.ConstantTimeCompare(a[:], b[:]) == 1 }

// secretEqual compares two connection secrets in constant time, as two
// words: it runs for every request a responder takes from another
// process (fromPeer), where subtle.ConstantTimeCompare's byte loop cost 4 %
// of a shared-memory round trip (BenchmarkXprocSendRTT/wait=spin/shm).
func secretEqual(a, b *[16]byte) bool {
	le := binary.LittleEndian
	d := le.Uint64(a[:8]) ^ le.Uint64(b[:8]) | le.Uint64(a[8:]) ^ le.Uint64(b[8:])
	return d == 0 // no branch on the bytes before the one answer
}

// peerAuth is what a connection knows of its peer's identity.
type peerAuth struct {
	// The identity proof the dialer sent and the transcript it covers
	// (acceptor side; zero on the dialer side).
	ident [hsMACLen]byte
	t     [32]byte
	// proven is the connection secret the peer has shown to hold: the
	// peer's fabric is the one whose endpoints carry it.
	proven atomic.Pointer[[16]byte]
}

// proves reports whether the peer of the connection is the process whose
// provider address is pa: it has shown to hold pa's secret. It is cheap
// once the answer is yes.
func (a *peerAuth) proves(pa *peerAddr) bool {
	if !pa.hasSecret {
		return false
	}
	if p := a.proven.Load(); p != nil {
		return secretEqual(p, &pa.secret)
	}
	if a.t == [32]byte{} {
		return false
	}
	want := handshakeMAC(&pa.secret, labelIdentity, &a.t)
	if !macEqual(&want, &a.ident) {
		return false
	}
	s := pa.secret
	a.proven.CompareAndSwap(nil, &s)
	return true
}
