package cluster

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

func xFrame() *frame {
	return &frame{typ: frameData, from: 3, to: 5, size: 8, nonce: [nonceLen]byte{1, 2, 3}, job: "job-1", payload: []byte("payload")}
}

func TestFrameRoundTrip(t *testing.T) {
	key := []byte("k")
	for _, f := range []*frame{
		xFrame(),
		{typ: frameHello, from: 1, size: 2, nonce: [nonceLen]byte{9}},
		{typ: frameAbort, from: 0, to: 1, size: 2, job: string(make([]byte, maxJobLen)), payload: []byte("why")},
		{typ: frameReject, from: 0, to: 1, size: 2, payload: []byte{rejectAuth, 'x'}},
	} {
		b, err := encodeFrame(f, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) != frameSize(len(f.job), len(f.payload)) {
			t.Errorf("type %d: %d bytes, frameSize says %d", f.typ, len(b), frameSize(len(f.job), len(f.payload)))
		}
		r := bytes.NewReader(b)
		g, err := readFrame(r, key, DefaultMaxFrame)
		if err != nil {
			t.Fatalf("type %d: %v", f.typ, err)
		}
		if r.Len() != 0 {
			t.Errorf("type %d: %d bytes left unread", f.typ, r.Len())
		}
		if g.typ != f.typ || g.from != f.from || g.to != f.to || g.size != f.size || g.nonce != f.nonce ||
			g.job != f.job || !bytes.Equal(g.payload, f.payload) {
			t.Errorf("type %d: decoded %+v, want %+v", f.typ, g, f)
		}
	}
}

// TestFrameTamper flips every bit of an encoded frame: each change must
// be an error (never a frame with other contents).
func TestFrameTamper(t *testing.T) {
	key := []byte("k")
	b, err := encodeFrame(xFrame(), key)
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		for bit := range 8 {
			c := bytes.Clone(b)
			c[i] ^= 1 << bit
			if _, err := readFrame(bytes.NewReader(c), key, DefaultMaxFrame); err == nil {
				t.Fatalf("byte %d bit %d flipped: frame accepted", i, bit)
			}
		}
	}
	if _, err := readFrame(bytes.NewReader(b), []byte("other key"), DefaultMaxFrame); !errors.Is(err, ErrAuth) {
		t.Errorf("other key: %v, want ErrAuth", err)
	}
}

// refuser fails the test if more than limit bytes are read.
type refuser struct {
	t     *testing.T
	r     io.Reader
	limit int
}

func (r *refuser) Read(p []byte) (int, error) {
	if len(p) > r.limit {
		r.t.Fatalf("read of %d bytes past the header", len(p))
	}
	n, err := r.r.Read(p)
	r.limit -= n
	return n, err
}

func TestFrameErrors(t *testing.T) {
	key := []byte("k")
	good, _ := encodeFrame(xFrame(), key)
	mod := func(f func(b []byte)) []byte {
		c := bytes.Clone(good)
		f(c)
		return c
	}
	for _, tc := range []struct {
		name string
		b    []byte
		max  int
		want error
	}{
		{"magic", mod(func(b []byte) { b[0] = 'X' }), DefaultMaxFrame, ErrBadFrame},
		{"version", mod(func(b []byte) { b[4] = 2 }), DefaultMaxFrame, ErrVersion},
		{"type", mod(func(b []byte) { b[5] = 9 }), DefaultMaxFrame, ErrBadFrame},
		{"reserved", mod(func(b []byte) { b[7] = 1 }), DefaultMaxFrame, ErrBadFrame},
		{"job length", mod(func(b []byte) { b[20] = 1 }), DefaultMaxFrame, ErrBadFrame},
		{"too large", good, len(good) - 1, ErrFrameTooLarge},
		{"huge length", mod(func(b []byte) { b[24], b[25] = 0xff, 0xff }), DefaultMaxFrame, ErrFrameTooLarge},
		{"mac", mod(func(b []byte) { b[len(b)-1] ^= 1 }), DefaultMaxFrame, ErrAuth},
		{"payload", mod(func(b []byte) { b[frameHeader+6] ^= 1 }), DefaultMaxFrame, ErrAuth},
		{"truncated", good[:len(good)-1], DefaultMaxFrame, io.ErrUnexpectedEOF},
		{"short header", good[:10], DefaultMaxFrame, io.ErrUnexpectedEOF},
		{"empty", nil, DefaultMaxFrame, io.EOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Oversized frames are refused from their header alone.
			r := io.Reader(bytes.NewReader(tc.b))
			if errors.Is(tc.want, ErrFrameTooLarge) {
				r = &refuser{t: t, r: r, limit: frameHeader}
			}
			_, err := readFrame(r, key, tc.max)
			if !errors.Is(err, tc.want) {
				t.Errorf("%v, want %v", err, tc.want)
			}
		})
	}
	// A hello with a payload, a reject without a code.
	for _, f := range []*frame{{typ: frameHello, payload: []byte("x")}, {typ: frameReject}} {
		b, _ := encodeFrame(f, key)
		if _, err := readFrame(bytes.NewReader(b), key, DefaultMaxFrame); !errors.Is(err, ErrBadFrame) {
			t.Errorf("type %d: %v, want ErrBadFrame", f.typ, err)
		}
	}
}

func TestVector(t *testing.T) {
	v := [][]byte{nil, []byte("a"), bytes.Repeat([]byte("b"), 300)}
	b := encodeVector(v)
	got, err := decodeVector(b, 3)
	if err != nil {
		t.Fatal(err)
	}
	for i := range v {
		if !bytes.Equal(got[i], v[i]) {
			t.Errorf("entry %d: %q", i, got[i])
		}
	}
	for _, bad := range [][]byte{nil, b[:3], b[:len(b)-1], append(bytes.Clone(b), 0)} {
		if _, err := decodeVector(bad, 3); !errors.Is(err, ErrBadFrame) {
			t.Errorf("%d bytes: %v, want ErrBadFrame", len(bad), err)
		}
	}
	if _, err := decodeVector(b, 2); !errors.Is(err, ErrBadFrame) {
		t.Errorf("wrong count: %v", err)
	}
}

// FuzzReadFrame: no input panics, reads past the frame, or is accepted
// without a valid HMAC; accepted frames re-encode to the same bytes.
func FuzzReadFrame(f *testing.F) {
	key := []byte("fuzz key")
	for _, fr := range []*frame{xFrame(), {typ: frameHello, from: 1, size: 2}, {typ: frameReject, payload: []byte{1}}} {
		b, _ := encodeFrame(fr, key)
		f.Add(b)
	}
	f.Add([]byte("GVCX\x01\x02"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		fr, err := readFrame(r, key, 1<<16)
		if err != nil {
			return
		}
		n := len(b) - r.Len()
		again, err := encodeFrame(fr, key)
		if err != nil {
			t.Fatalf("accepted frame does not re-encode: %v", err)
		}
		if fr.typ != frameReject && !bytes.Equal(again, b[:n]) {
			t.Fatalf("accepted frame re-encodes differently:\n%x\n%x", again, b[:n])
		}
		if fr.typ == frameReject {
			_ = rejectError(fr) // must not panic
		}
	})
}

// FuzzDecodeVector: no input panics; accepted vectors re-encode exactly.
func FuzzDecodeVector(f *testing.F) {
	f.Add(encodeVector([][]byte{[]byte("a"), nil}), 2)
	f.Add([]byte{0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff}, 1)
	f.Fuzz(func(t *testing.T, b []byte, n int) {
		if n < 0 || n > 1<<10 {
			return
		}
		v, err := decodeVector(b, n)
		if err != nil {
			return
		}
		if !bytes.Equal(encodeVector(v), b) {
			t.Fatal("accepted vector re-encodes differently")
		}
	})
}
