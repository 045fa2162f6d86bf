package cluster

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
)

// Exchange protocol errors. Errors of the exchange wrap them; test with
// errors.Is.
var (
	// ErrAuth: a message does not authenticate: the peer uses another
	// token, does not know it (a replayed handshake), or the message was
	// altered in transit. The connection is dropped.
	ErrAuth = errors.New("cluster: exchange: authentication failed")
	// ErrJobMismatch: the peer belongs to another job.
	ErrJobMismatch = errors.New("cluster: exchange: job id mismatch")
	// ErrBadFrame: a message is malformed (magic, reserved bits, lengths,
	// type, ranks).
	ErrBadFrame = errors.New("cluster: exchange: malformed frame")
	// ErrFrameTooLarge: a message exceeds the maximum size
	// (ExchangeConfig.MaxFrame).
	ErrFrameTooLarge = errors.New("cluster: exchange: frame too large")
	// ErrVersion: the peer speaks another version of the protocol.
	ErrVersion = errors.New("cluster: exchange: unsupported protocol version")
	// ErrModeMismatch: the peer runs the exchange in another Mode
	// (rendezvous against all-to-all).
	ErrModeMismatch = errors.New("cluster: exchange: the ranks use different exchange modes")
	// ErrSizeMismatch: the peer has another world size.
	ErrSizeMismatch = errors.New("cluster: exchange: the ranks disagree on the world size")
)

// DefaultMaxFrame is the default maximum size of one message of the
// exchange (ExchangeConfig.MaxFrame).
const DefaultMaxFrame = 64 << 20

// Wire protocol, version 3. See the package documentation for the
// exchange of messages; this file has their encodings.
//
// The handshake is made of fixed-size control messages, each starting
// with an 8-byte prefix (big endian throughout):
//
//	[0:4]  magic "GVCX"
//	[4]    version (3)
//	[5]    type: msgHello, msgProof, msgAccept, msgReject
//	[6]    in a hello, the sender's exchange Mode (0 all-to-all, 1
//	       rendezvous); reserved, zero, in the other messages
//	[7]    in a hello, the shape of the sender's data: 0 for one entry
//	       per rank (Exchange), w in [1, 255] for a card and w-byte
//	       items (ExchangeCards); reserved, zero, in the other messages
//
// A reader checks the magic and the version from the prefix alone, so a
// peer of another version fails with ErrVersion whatever it sends next;
// the rest of a control message has a size fixed by its type.
//
//	hello (100 bytes):  prefix, sender rank [8:12], receiver rank [12:16],
//	                    world size [16:20], job tag [20:36], nonce [36:68],
//	                    MAC [68:100]
//	proof (40 bytes):   prefix, MAC [8:40]
//	accept (8 bytes):   prefix
//	reject (277 bytes): prefix, sender rank, receiver rank, world size
//	                    [8:20], code [20], text length [21], text [22:277]
//	                    (zero padded)
//
// After the handshake every message travels in records, sealed with
// AES-256-GCM under a key per direction:
//
//	[0]    record type: recData or recAbort
//	[1]    flags: recFinal on the last record of a message
//	[2:4]  plaintext length, at most recordMax
//	[4:]   ciphertext and 16-byte tag; the 4 header bytes are the
//	       additional data, the nonce is 4 zero bytes and the record's
//	       sequence number in its direction (64 bits, from 0)
//
// A message is one or more records of one type: every record but the
// last holds exactly recordMax bytes, and only a message's single record
// may be empty.
const (
	frameMagic   = "GVCX"
	frameVersion = 3

	prefixLen = 8
	nonceLen  = 32
	tagLen    = 16 // job tag
	macLen    = sha256.Size
	helloLen  = prefixLen + 12 + tagLen + nonceLen + macLen // 100
	proofLen  = prefixLen + macLen                          // 40
	acceptLen = prefixLen                                   // 8
	rejectLen = prefixLen + 12 + 2 + maxRejectText          // 277

	maxRejectText = 255
	maxJobLen     = 255
	maxAbortText  = 1024

	recordHeader = 4
	recordMax    = 16 << 10
	aeadOverhead = 16
)

// Control message types.
const (
	msgHello  = 1 // a dialer's or an acceptor's hello
	msgProof  = 2 // the dialer proves the token over both hellos
	msgAccept = 3 // the acceptor took the peer: records follow
	msgReject = 4 // unauthenticated: why the acceptor refused
)

// Record types.
const (
	recData  = 1 // an entry, a vector of entries, a share of cards, a table of cards or a column of items
	recAbort = 2 // the reason the root gave up
)

const recFinal = 1 // record flag: last record of its message

// Reject codes, sent unauthenticated to a dialer that was refused.
const (
	rejectAuth    = 1
	rejectJob     = 2
	rejectVersion = 3
	rejectRank    = 4
	rejectMode    = 5
	rejectSize    = 6
)

// Labels of the MACs and keys: every use of the token has its own.
const (
	labelMACKey      = "goverbs/cluster/v2 handshake MAC key"
	labelJob         = "goverbs/cluster/v2 job\x00"
	labelDialHello   = "goverbs/cluster/v2 dialer hello\x00"
	labelAcceptHello = "goverbs/cluster/v2 acceptor hello\x00"
	labelProof       = "goverbs/cluster/v2 dialer proof\x00"
	labelDialKey     = "goverbs/cluster/v2 dialer to acceptor"
	labelAcceptKey   = "goverbs/cluster/v2 acceptor to dialer"
)

// macKey derives the key of the handshake MACs from the token.
func macKey(token []byte) []byte {
	k, err := hkdf.Key(sha256.New, token, nil, labelMACKey, sha256.Size)
	if err != nil {
		panic(err) // only for lengths above 255 hashes
	}
	return k
}

// jobTag is the job id as it travels: a MAC under the token, so that the
// job id stays private to the holders of the token and the hello stays
// fixed-size.
func jobTag(mk []byte, job string) [tagLen]byte {
	m := hmac.New(sha256.New, mk)
	m.Write([]byte(labelJob))
	m.Write([]byte(job))
	var t [tagLen]byte
	copy(t[:], m.Sum(nil))
	return t
}

func mac(mk []byte, parts ...[]byte) []byte {
	m := hmac.New(sha256.New, mk)
	for _, p := range parts {
		m.Write(p)
	}
	return m.Sum(nil)
}

func putPrefix(b []byte, typ byte) {
	copy(b, frameMagic)
	b[4], b[5], b[6], b[7] = frameVersion, typ, 0, 0
}

// hello is a decoded hello message.
type hello struct {
	mode           Mode
	items          uint8 // the data's shape: 0 entries, else the item size of cards
	from, to, size uint32
	job            [tagLen]byte
	nonce          [nonceLen]byte
}

// encodeHello returns the wire form of h. A dialer's hello (dialer nil)
// is authenticated on its own; an acceptor's also covers the dialer's
// hello it answers, which proves the acceptor knows the token now.
func encodeHello(h *hello, mk []byte, dialer []byte) [helloLen]byte {
	var b [helloLen]byte
	putPrefix(b[:], msgHello)
	b[6] = byte(h.mode)
	b[7] = h.items
	binary.BigEndian.PutUint32(b[8:], h.from)
	binary.BigEndian.PutUint32(b[12:], h.to)
	binary.BigEndian.PutUint32(b[16:], h.size)
	copy(b[20:], h.job[:])
	copy(b[36:], h.nonce[:])
	copy(b[68:], helloMAC(mk, dialer, b[:68]))
	return b
}

func helloMAC(mk, dialer, body []byte) []byte {
	if dialer == nil {
		return mac(mk, []byte(labelDialHello), body)
	}
	return mac(mk, []byte(labelAcceptHello), dialer, body)
}

// decodeHello authenticates and decodes a hello read by readControl (see
// encodeHello for dialer). The MAC is checked before any field is used.
func decodeHello(b []byte, mk []byte, dialer []byte) (*hello, error) {
	if len(b) != helloLen || b[5] != msgHello {
		return nil, fmt.Errorf("%w: not a hello", ErrBadFrame)
	}
	if !hmac.Equal(helloMAC(mk, dialer, b[:68]), b[68:]) {
		return nil, fmt.Errorf("%w: the hello's MAC does not match (do the ranks share the token?)", ErrAuth)
	}
	if b[6] > byte(Rendezvous) {
		return nil, fmt.Errorf("%w: unknown exchange mode %d in a hello", ErrBadFrame, b[6])
	}
	h := &hello{
		mode:  Mode(b[6]),
		items: b[7],
		from:  binary.BigEndian.Uint32(b[8:]),
		to:    binary.BigEndian.Uint32(b[12:]),
		size:  binary.BigEndian.Uint32(b[16:]),
	}
	copy(h.job[:], b[20:36])
	copy(h.nonce[:], b[36:68])
	return h, nil
}

// proof is the dialer's answer to the acceptor's challenge: a MAC under
// the token over both hellos, hence over both fresh nonces.
func proof(mk, dialer, acceptor []byte) [proofLen]byte {
	var b [proofLen]byte
	putPrefix(b[:], msgProof)
	copy(b[8:], mac(mk, []byte(labelProof), dialer, acceptor))
	return b
}

// checkProof verifies a proof read by readControl, in constant time.
func checkProof(b []byte, mk, dialer, acceptor []byte) error {
	want := proof(mk, dialer, acceptor)
	if len(b) != proofLen || subtle.ConstantTimeCompare(b, want[:]) != 1 {
		return fmt.Errorf("%w: the dialer's proof does not match (a replayed hello?)", ErrAuth)
	}
	return nil
}

func acceptMsg() [acceptLen]byte {
	var b [acceptLen]byte
	putPrefix(b[:], msgAccept)
	return b
}

// reject is a decoded reject message.
type reject struct {
	from, to, size uint32
	code           byte
	text           string
}

func encodeReject(r *reject) [rejectLen]byte {
	var b [rejectLen]byte
	putPrefix(b[:], msgReject)
	binary.BigEndian.PutUint32(b[8:], r.from)
	binary.BigEndian.PutUint32(b[12:], r.to)
	binary.BigEndian.PutUint32(b[16:], r.size)
	text := r.text
	if len(text) > maxRejectText {
		text = text[:maxRejectText]
	}
	b[20], b[21] = r.code, byte(len(text))
	copy(b[22:], text)
	return b
}

func decodeReject(b []byte) (*reject, error) {
	if len(b) != rejectLen || b[5] != msgReject {
		return nil, fmt.Errorf("%w: not a reject", ErrBadFrame)
	}
	n := int(b[21])
	if b[20] < rejectAuth || b[20] > rejectSize {
		return nil, fmt.Errorf("%w: reject code %d", ErrBadFrame, b[20])
	}
	for _, c := range b[22+n:] {
		if c != 0 {
			return nil, fmt.Errorf("%w: reject padding not zero", ErrBadFrame)
		}
	}
	return &reject{
		from: binary.BigEndian.Uint32(b[8:]),
		to:   binary.BigEndian.Uint32(b[12:]),
		size: binary.BigEndian.Uint32(b[16:]),
		code: b[20],
		text: string(b[22 : 22+n]),
	}, nil
}

// controlLen is the size of a control message of type typ.
func controlLen(typ byte) int {
	switch typ {
	case msgHello:
		return helloLen
	case msgProof:
		return proofLen
	case msgAccept:
		return acceptLen
	case msgReject:
		return rejectLen
	}
	return 0
}

// readControl reads one control message of one of the types in want into
// buf and returns it. It reads the prefix first: a peer speaking another
// version (or not this protocol) is refused from its first 8 bytes, and
// nothing beyond the fixed size of the message is ever read.
func readControl(r io.Reader, buf *[rejectLen]byte, want ...byte) ([]byte, error) {
	b := buf[:prefixLen]
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	if string(b[:4]) != frameMagic {
		return nil, fmt.Errorf("%w: bad magic %q", ErrBadFrame, b[:4])
	}
	if b[4] != frameVersion {
		return nil, fmt.Errorf("%w: the peer speaks version %d, this rank %d", ErrVersion, b[4], frameVersion)
	}
	if (b[6] != 0 || b[7] != 0) && b[5] != msgHello {
		return nil, fmt.Errorf("%w: reserved bits set", ErrBadFrame)
	}
	ok := false
	for _, t := range want {
		ok = ok || b[5] == t
	}
	if !ok {
		return nil, fmt.Errorf("%w: message type %d, expected one of %v", ErrBadFrame, b[5], want)
	}
	b = buf[:controlLen(b[5])]
	if _, err := io.ReadFull(r, b[prefixLen:]); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return b, nil
}

// sessionKeys derives the record keys of a connection from the token and
// the transcript of its handshake (both hellos, hence both nonces): every
// connection, and each direction of it, has its own keys.
func sessionKeys(token, dialer, acceptor []byte) (d2a, a2d []byte) {
	th := sha256.New()
	th.Write(dialer)
	th.Write(acceptor)
	salt := th.Sum(nil)
	d2a, err1 := hkdf.Key(sha256.New, token, salt, labelDialKey, 32)
	a2d, err2 := hkdf.Key(sha256.New, token, salt, labelAcceptKey, 32)
	if err := errors.Join(err1, err2); err != nil {
		panic(err)
	}
	return d2a, a2d
}

func newAEAD(key []byte) cipher.AEAD {
	b, err := aes.NewCipher(key)
	if err != nil {
		panic(err) // 32-byte keys only
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		panic(err)
	}
	return g
}

// session seals and opens the records of an authenticated connection.
// Writing and reading may run concurrently, each in one goroutine at a
// time.
type session struct {
	send, recv       cipher.AEAD
	sendSeq, recvSeq uint64
}

func newSession(sendKey, recvKey []byte) *session {
	return &session{send: newAEAD(sendKey), recv: newAEAD(recvKey)}
}

func seqNonce(seq uint64) []byte {
	var n [12]byte
	binary.BigEndian.PutUint64(n[4:], seq)
	return n[:]
}

// writeMsg sends payload as a message of type typ, in records of at most
// recordMax bytes.
func (s *session) writeMsg(w io.Writer, typ byte, payload []byte) error {
	buf := make([]byte, recordHeader+min(len(payload), recordMax)+aeadOverhead)
	for first := true; first || len(payload) > 0; first = false {
		n := min(len(payload), recordMax)
		if s.sendSeq == math.MaxUint64 {
			return fmt.Errorf("cluster: exchange: record sequence exhausted")
		}
		h := buf[:recordHeader]
		h[0], h[1] = typ, 0
		if n == len(payload) {
			h[1] = recFinal
		}
		binary.BigEndian.PutUint16(h[2:], uint16(n))
		rec := s.send.Seal(h, seqNonce(s.sendSeq), payload[:n], h)
		s.sendSeq++
		if _, err := w.Write(rec); err != nil {
			return err
		}
		payload = payload[n:]
	}
	return nil
}

// readMsg reads one message, of at most max bytes (maxAbortText for an
// abort). Each record is authenticated before its plaintext is kept, and
// the message grows only as records arrive: a declared length is never
// allocated ahead.
func (s *session) readMsg(r io.Reader, max int) (typ byte, msg []byte, err error) {
	var h [recordHeader]byte
	var buf []byte
	for first := true; ; first = false {
		if _, err := io.ReadFull(r, h[:]); err != nil {
			if err == io.EOF && !first {
				err = io.ErrUnexpectedEOF
			}
			return 0, nil, err
		}
		t, flags, n := h[0], h[1], int(binary.BigEndian.Uint16(h[2:]))
		switch {
		case t != recData && t != recAbort:
			return 0, nil, fmt.Errorf("%w: record type %d", ErrBadFrame, t)
		case !first && t != typ:
			return 0, nil, fmt.Errorf("%w: record of type %d in a message of type %d", ErrBadFrame, t, typ)
		case flags&^recFinal != 0:
			return 0, nil, fmt.Errorf("%w: record flags %#x", ErrBadFrame, flags)
		case n > recordMax:
			return 0, nil, fmt.Errorf("%w: record of %d bytes (at most %d)", ErrBadFrame, n, recordMax)
		case flags&recFinal == 0 && n != recordMax:
			return 0, nil, fmt.Errorf("%w: short record of %d bytes inside a message", ErrBadFrame, n)
		case n == 0 && !first:
			return 0, nil, fmt.Errorf("%w: empty record ending a message", ErrBadFrame)
		}
		typ = t
		limit := max
		if t == recAbort {
			limit = maxAbortText
		}
		if len(msg)+n > limit {
			return 0, nil, fmt.Errorf("%w: message of more than %d bytes (at most %d)", ErrFrameTooLarge, len(msg)+n, limit)
		}
		if buf == nil {
			buf = make([]byte, recordMax+aeadOverhead)
		}
		ct := buf[:n+aeadOverhead]
		if _, err := io.ReadFull(r, ct); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return 0, nil, err
		}
		if s.recvSeq == math.MaxUint64 {
			return 0, nil, fmt.Errorf("cluster: exchange: record sequence exhausted")
		}
		pt, err := s.recv.Open(ct[:0], seqNonce(s.recvSeq), ct, h[:])
		if err != nil {
			return 0, nil, fmt.Errorf("%w: record %d does not authenticate (altered in transit, or not from the peer)", ErrAuth, s.recvSeq)
		}
		s.recvSeq++
		if msg == nil {
			msg = make([]byte, 0, n)
		}
		msg = append(msg, pt...)
		if flags&recFinal != 0 {
			return typ, msg, nil
		}
	}
}

// wireSize is the size on the wire of a message of n bytes.
func wireSize(n int) int {
	records := max(1, (n+recordMax-1)/recordMax)
	return n + records*(recordHeader+aeadOverhead)
}

// rejectError turns a reject into the error the dialer reports.
func rejectError(r *reject) error {
	var cause error
	switch r.code {
	case rejectAuth:
		cause = ErrAuth
	case rejectJob:
		cause = ErrJobMismatch
	case rejectVersion:
		cause = ErrVersion
	case rejectMode:
		cause = ErrModeMismatch
	case rejectSize:
		cause = ErrSizeMismatch
	default:
		cause = ErrBadFrame
	}
	return fmt.Errorf("rank %d refused the connection: %w (%q)", r.from, cause, sanitize(r.text))
}

// rejectCode is the reject code for a handshake error.
func rejectCode(err error) byte {
	switch {
	case errors.Is(err, ErrAuth):
		return rejectAuth
	case errors.Is(err, ErrJobMismatch):
		return rejectJob
	case errors.Is(err, ErrVersion):
		return rejectVersion
	case errors.Is(err, ErrModeMismatch):
		return rejectMode
	case errors.Is(err, ErrSizeMismatch):
		return rejectSize
	}
	return rejectRank
}

// sanitize keeps printable ASCII of a peer-supplied text.
func sanitize(s string) string {
	if len(s) > maxAbortText {
		s = s[:maxAbortText]
	}
	b := []byte(s)
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			b[i] = '?'
		}
	}
	return string(b)
}

// encodeVector encodes a list of byte strings: count, then length and
// bytes of each (big endian uint32s).
func encodeVector(v [][]byte) []byte {
	b := make([]byte, 0, vectorSize(v))
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	for _, e := range v {
		b = binary.BigEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return b
}

func vectorSize(v [][]byte) int {
	n := 4
	for _, e := range v {
		n += 4 + len(e)
	}
	return n
}

// decodeVector decodes encodeVector's output, which must hold exactly
// want entries.
func decodeVector(b []byte, want int) ([][]byte, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("%w: vector of %d bytes", ErrBadFrame, len(b))
	}
	n := binary.BigEndian.Uint32(b)
	if uint64(n) != uint64(want) {
		return nil, fmt.Errorf("%w: vector of %d entries (want %d)", ErrBadFrame, n, want)
	}
	b = b[4:]
	v := make([][]byte, want)
	for i := range v {
		if len(b) < 4 {
			return nil, fmt.Errorf("%w: vector entry %d truncated", ErrBadFrame, i)
		}
		l := binary.BigEndian.Uint32(b)
		b = b[4:]
		if uint64(l) > uint64(len(b)) {
			return nil, fmt.Errorf("%w: vector entry %d of %d bytes exceeds the %d left", ErrBadFrame, i, l, len(b))
		}
		v[i] = b[:l:l]
		b = b[l:]
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the vector", ErrBadFrame, len(b))
	}
	return v, nil
}

// A card share is what a rank sends the root of a card exchange
// (ExchangeCards), and what two ranks send each other in the all-to-all
// mode: a vector of two entries, the card and the items (Size items of w
// bytes for the root; the one item for the receiver from a peer). The
// root answers with two messages: the table of cards, a vector of Size
// cards indexed by rank, then the column, Size items of w bytes, the
// item of every rank for the receiver, in rank order.

// encodeCardShare encodes a card share.
func encodeCardShare(card, items []byte) []byte {
	return encodeVector([][]byte{card, items})
}

// decodeCardShare decodes a card share whose items must be exactly
// items bytes long and whose card must be at most maxCard bytes.
func decodeCardShare(b []byte, items, maxCard int) (card, its []byte, err error) {
	v, err := decodeVector(b, 2)
	if err != nil {
		return nil, nil, fmt.Errorf("card share: %w", err)
	}
	if len(v[1]) != items {
		return nil, nil, fmt.Errorf("%w: card share with %d bytes of items (want %d)", ErrBadFrame, len(v[1]), items)
	}
	if len(v[0]) > maxCard {
		return nil, nil, fmt.Errorf("card share: %w: card of %d bytes (at most %d in this world)", ErrFrameTooLarge, len(v[0]), maxCard)
	}
	return v[0], v[1], nil
}

// decodeCardTable decodes the root's table of n cards, each at most
// maxCard bytes.
func decodeCardTable(b []byte, n, maxCard int) ([][]byte, error) {
	v, err := decodeVector(b, n)
	if err != nil {
		return nil, fmt.Errorf("table of cards: %w", err)
	}
	for j, c := range v {
		if len(c) > maxCard {
			return nil, fmt.Errorf("table of cards: %w: rank %d's card is %d bytes (at most %d in this world)", ErrFrameTooLarge, j, len(c), maxCard)
		}
	}
	return v, nil
}

// maxCardLen is the largest card of a world of n ranks with w-byte items
// under the frame bound max: the root's table of n cards, and each rank's
// share (its card and n items), must each fit in a message. Negative if
// even an empty card does not fit.
func maxCardLen(max, n, w int) int {
	table := (max-4)/n - 4     // 4 + n(4 + card) ≤ max
	share := max - 4 - 8 - n*w // 4 + (4 + card) + (4 + n w) ≤ max
	return min(table, share)
}
