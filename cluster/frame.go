package cluster

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Exchange protocol errors. Errors of the exchange wrap them; test with
// errors.Is.
var (
	// ErrAuth: a frame's HMAC does not match: the peer uses another token
	// (or the frame was altered). The connection is dropped.
	ErrAuth = errors.New("cluster: exchange: authentication failed (HMAC mismatch: do the ranks share the token?)")
	// ErrJobMismatch: the peer belongs to another job.
	ErrJobMismatch = errors.New("cluster: exchange: job id mismatch")
	// ErrBadFrame: a frame is malformed (magic, reserved bits, lengths,
	// type, ranks).
	ErrBadFrame = errors.New("cluster: exchange: malformed frame")
	// ErrFrameTooLarge: a frame exceeds the maximum frame size.
	ErrFrameTooLarge = errors.New("cluster: exchange: frame too large")
	// ErrVersion: the peer speaks another version of the protocol.
	ErrVersion = errors.New("cluster: exchange: unsupported protocol version")
)

const (
	frameMagic    = "GVCX"
	frameVersion  = 1
	frameHeader   = 44 // fixed part, see encodeFrame
	frameMAC      = sha256.Size
	nonceLen      = 16
	maxJobLen     = 255
	maxRejectText = 256

	// DefaultMaxFrame is the default maximum frame size.
	DefaultMaxFrame = 64 << 20
)

// Frame types.
const (
	frameHello  = 1 // nonce: the sender's fresh nonce; no payload
	frameData   = 2 // nonce: the receiver's nonce; payload: data
	frameAbort  = 3 // nonce: the receiver's nonce; payload: reason text
	frameReject = 4 // unauthenticated; payload: reject code + text
)

// Reject codes, sent unauthenticated to a dialer whose hello was refused.
const (
	rejectAuth    = 1
	rejectJob     = 2
	rejectVersion = 3
	rejectRank    = 4
)

// frame is one message of the exchange protocol. Layout (big endian):
//
//	[0:4]    magic "GVCX"
//	[4]      version
//	[5]      type
//	[6:8]    reserved, zero
//	[8:12]   sender rank
//	[12:16]  receiver rank
//	[16:20]  world size
//	[20:22]  job id length (at most 255)
//	[22:24]  reserved, zero
//	[24:28]  payload length
//	[28:44]  nonce
//	[44:]    job id, payload
//	[end-32:] HMAC-SHA256 (key: the token) of everything before it
//
// A reject frame carries a zero MAC and is not authenticated: it only
// tells a dialer why it was refused.
type frame struct {
	typ      byte
	from, to uint32
	size     uint32
	nonce    [nonceLen]byte
	job      string
	payload  []byte
}

// encodeFrame returns the wire form of f, authenticated with key.
func encodeFrame(f *frame, key []byte) ([]byte, error) {
	if len(f.job) > maxJobLen {
		return nil, fmt.Errorf("%w: job id of %d bytes (at most %d)", ErrBadFrame, len(f.job), maxJobLen)
	}
	if uint64(len(f.payload)) > 1<<32-1 {
		return nil, fmt.Errorf("%w: payload of %d bytes", ErrFrameTooLarge, len(f.payload))
	}
	b := make([]byte, frameHeader, frameHeader+len(f.job)+len(f.payload)+frameMAC)
	copy(b, frameMagic)
	b[4], b[5] = frameVersion, f.typ
	binary.BigEndian.PutUint32(b[8:], f.from)
	binary.BigEndian.PutUint32(b[12:], f.to)
	binary.BigEndian.PutUint32(b[16:], f.size)
	binary.BigEndian.PutUint16(b[20:], uint16(len(f.job)))
	binary.BigEndian.PutUint32(b[24:], uint32(len(f.payload)))
	copy(b[28:], f.nonce[:])
	b = append(b, f.job...)
	b = append(b, f.payload...)
	if f.typ == frameReject {
		return append(b, make([]byte, frameMAC)...), nil
	}
	m := hmac.New(sha256.New, key)
	m.Write(b)
	return m.Sum(b), nil
}

// frameSize returns the encoded size of a frame with a job id of jobLen
// bytes and a payload of n bytes.
func frameSize(jobLen, n int) int { return frameHeader + jobLen + n + frameMAC }

// readFrame reads and authenticates one frame. Frames larger than max
// bytes are refused before their body is read. A reject frame is returned
// without authentication; every other frame must carry a valid HMAC.
func readFrame(r io.Reader, key []byte, max int) (*frame, error) {
	var h [frameHeader]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	if string(h[:4]) != frameMagic {
		return nil, fmt.Errorf("%w: bad magic %q", ErrBadFrame, h[:4])
	}
	if h[4] != frameVersion {
		return nil, fmt.Errorf("%w: version %d (this side speaks %d)", ErrVersion, h[4], frameVersion)
	}
	f := &frame{typ: h[5]}
	if f.typ < frameHello || f.typ > frameReject {
		return nil, fmt.Errorf("%w: unknown type %d", ErrBadFrame, f.typ)
	}
	if h[6] != 0 || h[7] != 0 || h[22] != 0 || h[23] != 0 {
		return nil, fmt.Errorf("%w: reserved bits set", ErrBadFrame)
	}
	f.from = binary.BigEndian.Uint32(h[8:])
	f.to = binary.BigEndian.Uint32(h[12:])
	f.size = binary.BigEndian.Uint32(h[16:])
	jobLen := int(binary.BigEndian.Uint16(h[20:]))
	n := uint64(binary.BigEndian.Uint32(h[24:]))
	copy(f.nonce[:], h[28:])
	if jobLen > maxJobLen {
		return nil, fmt.Errorf("%w: job id of %d bytes (at most %d)", ErrBadFrame, jobLen, maxJobLen)
	}
	if total := uint64(frameSize(jobLen, 0)) + n; total > uint64(max) {
		return nil, fmt.Errorf("%w: %d bytes (at most %d)", ErrFrameTooLarge, total, max)
	}
	if f.typ == frameHello && n != 0 {
		return nil, fmt.Errorf("%w: hello with a payload", ErrBadFrame)
	}
	if f.typ == frameReject && n > maxRejectText+1 {
		return nil, fmt.Errorf("%w: reject of %d bytes", ErrBadFrame, n)
	}
	b := make([]byte, frameHeader+jobLen+int(n)+frameMAC)
	copy(b, h[:])
	if _, err := io.ReadFull(r, b[frameHeader:]); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	body, mac := b[:len(b)-frameMAC], b[len(b)-frameMAC:]
	if f.typ != frameReject {
		m := hmac.New(sha256.New, key)
		m.Write(body)
		if !hmac.Equal(m.Sum(nil), mac) {
			return nil, ErrAuth
		}
	}
	f.job = string(body[frameHeader : frameHeader+jobLen])
	f.payload = body[frameHeader+jobLen:]
	if f.typ == frameReject && len(f.payload) == 0 {
		return nil, fmt.Errorf("%w: reject without a code", ErrBadFrame)
	}
	return f, nil
}

// rejectError turns a reject frame into the error the dialer reports.
func rejectError(f *frame) error {
	code, text := f.payload[0], string(f.payload[1:])
	var cause error
	switch code {
	case rejectAuth:
		cause = ErrAuth
	case rejectJob:
		cause = ErrJobMismatch
	case rejectVersion:
		cause = ErrVersion
	default:
		cause = ErrBadFrame
	}
	return fmt.Errorf("rank %d refused the connection: %w (%q)", f.from, cause, sanitize(text))
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
	}
	return rejectRank
}

// sanitize keeps printable ASCII of a peer-supplied text.
func sanitize(s string) string {
	if len(s) > maxRejectText {
		s = s[:maxRejectText]
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
	n := 4
	for _, e := range v {
		n += 4 + len(e)
	}
	b := make([]byte, 0, n)
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	for _, e := range v {
		b = binary.BigEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return b
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
