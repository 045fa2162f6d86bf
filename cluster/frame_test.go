package cluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"testing"
)

var xKey = macKey([]byte("k"))

// xHellos returns a dialer's hello and the acceptor's answer.
func xHellos() (dh, ah [helloLen]byte) {
	job := jobTag(xKey, "job-1")
	dh = encodeHello(&hello{mode: Rendezvous, from: 3, to: 5, size: 8, job: job, nonce: [nonceLen]byte{1, 2, 3}}, xKey, nil)
	ah = encodeHello(&hello{mode: Rendezvous, from: 5, to: 3, size: 8, job: job, nonce: [nonceLen]byte{4, 5, 6}}, xKey, dh[:])
	return dh, ah
}

// xSessions returns the dialer's and the acceptor's sessions of the
// handshake of xHellos.
func xSessions() (d, a *session) {
	dh, ah := xHellos()
	d2a, a2d := sessionKeys([]byte("k"), dh[:], ah[:])
	return newSession(d2a, a2d), newSession(a2d, d2a)
}

func xRead(b []byte, want ...byte) ([]byte, int, error) {
	r := bytes.NewReader(b)
	var buf [rejectLen]byte
	m, err := readControl(r, &buf, want...)
	return m, len(b) - r.Len(), err
}

func TestHelloRoundTrip(t *testing.T) {
	dh, ah := xHellos()
	for _, tc := range []struct {
		name   string
		b      []byte
		dialer []byte
		want   uint32
	}{
		{"dialer", dh[:], nil, 3},
		{"acceptor", ah[:], dh[:], 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, n, err := xRead(append(bytes.Clone(tc.b), "next"...), msgHello)
			if err != nil || n != helloLen {
				t.Fatalf("read %d bytes: %v", n, err)
			}
			h, err := decodeHello(m, xKey, tc.dialer)
			if err != nil {
				t.Fatal(err)
			}
			if h.mode != Rendezvous || h.from != tc.want || h.size != 8 || h.job != jobTag(xKey, "job-1") {
				t.Errorf("decoded %+v", h)
			}
		})
	}
	// A dialer's hello is no acceptor's, and an acceptor's hello answers
	// one dialer's hello only.
	if _, err := decodeHello(dh[:], xKey, dh[:]); !errors.Is(err, ErrAuth) {
		t.Errorf("dialer's hello as an answer: %v, want ErrAuth", err)
	}
	other := dh
	other[40] ^= 1
	if _, err := decodeHello(ah[:], xKey, other[:]); !errors.Is(err, ErrAuth) {
		t.Errorf("answer to another hello: %v, want ErrAuth", err)
	}
	if _, err := decodeHello(dh[:], macKey([]byte("other")), nil); !errors.Is(err, ErrAuth) {
		t.Errorf("other token: %v, want ErrAuth", err)
	}
	if jobTag(xKey, "a") == jobTag(xKey, "b") || jobTag(xKey, "a") == jobTag(macKey(nil), "a") {
		t.Error("job tags collide")
	}
}

// TestHelloTamper flips every bit of both hellos: each change must be an
// error (never a hello with other contents).
func TestHelloTamper(t *testing.T) {
	dh, ah := xHellos()
	for _, tc := range []struct {
		name   string
		b      []byte
		dialer []byte
	}{{"dialer", dh[:], nil}, {"acceptor", ah[:], dh[:]}} {
		for i := range tc.b {
			for bit := range 8 {
				c := bytes.Clone(tc.b)
				c[i] ^= 1 << bit
				m, _, err := xRead(c, msgHello)
				if err == nil {
					_, err = decodeHello(m, xKey, tc.dialer)
				}
				if err == nil {
					t.Fatalf("%s: byte %d bit %d flipped: hello accepted", tc.name, i, bit)
				}
			}
		}
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
		r.t.Fatalf("read of %d bytes past the limit", len(p))
	}
	n, err := r.r.Read(p)
	r.limit -= n
	return n, err
}

// xV1Header is the header of a version 1 frame declaring the maximum
// frame (what version 1 peers, and the attack of issue 11, send).
func xV1Header() []byte {
	b := make([]byte, 44)
	copy(b, "GVCX")
	b[4], b[5] = 1, 2
	b[24], b[25], b[26], b[27] = 0x03, 0xff, 0xff, 0xff
	return b
}

func TestControlErrors(t *testing.T) {
	dh, _ := xHellos()
	mod := func(f func(b []byte)) []byte {
		c := bytes.Clone(dh[:])
		f(c)
		return c
	}
	for _, tc := range []struct {
		name  string
		b     []byte
		limit int // bytes the reader may read
		want  error
	}{
		{"magic", mod(func(b []byte) { b[0] = 'X' }), prefixLen, ErrBadFrame},
		{"version 4", mod(func(b []byte) { b[4] = 4 }), prefixLen, ErrVersion},
		{"version 2 (entries only)", mod(func(b []byte) { b[4] = 2 }), prefixLen, ErrVersion},
		{"version 1 frame", xV1Header(), prefixLen, ErrVersion},
		{"type", mod(func(b []byte) { b[5] = msgProof }), prefixLen, ErrBadFrame},
		{"unknown type", mod(func(b []byte) { b[5] = 9 }), prefixLen, ErrBadFrame},
		{"reserved [6] of an accept", mod(func(b []byte) { b[5], b[6] = msgAccept, 1 }), prefixLen, ErrBadFrame},
		{"reserved [7] of an accept", mod(func(b []byte) { b[5], b[7] = msgAccept, 1 }), prefixLen, ErrBadFrame},
		{"truncated", dh[:helloLen-1], helloLen, io.ErrUnexpectedEOF},
		{"short prefix", dh[:5], helloLen, io.ErrUnexpectedEOF},
		{"empty", nil, helloLen, io.EOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf [rejectLen]byte
			_, err := readControl(&refuser{t: t, r: bytes.NewReader(tc.b), limit: tc.limit}, &buf, msgHello, msgAccept)
			if !errors.Is(err, tc.want) {
				t.Errorf("%v, want %v", err, tc.want)
			}
		})
	}
}

func TestProof(t *testing.T) {
	dh, ah := xHellos()
	p := proof(xKey, dh[:], ah[:])
	m, n, err := xRead(p[:], msgProof)
	if err != nil || n != proofLen {
		t.Fatalf("read %d: %v", n, err)
	}
	if err := checkProof(m, xKey, dh[:], ah[:]); err != nil {
		t.Fatal(err)
	}
	other := ah
	other[50] ^= 1 // another acceptor nonce: a replayed dialer
	for name, err := range map[string]error{
		"other nonce": checkProof(m, xKey, dh[:], other[:]),
		"other token": checkProof(m, macKey([]byte("x")), dh[:], ah[:]),
		"altered":     checkProof(append(bytes.Clone(m[:proofLen-1]), m[proofLen-1]^1), xKey, dh[:], ah[:]),
	} {
		if !errors.Is(err, ErrAuth) {
			t.Errorf("%s: %v, want ErrAuth", name, err)
		}
	}
}

func TestReject(t *testing.T) {
	for _, text := range []string{"", "why", string(bytes.Repeat([]byte("x"), 300))} {
		b := encodeReject(&reject{from: 1, to: 2, size: 3, code: rejectJob, text: text})
		m, n, err := xRead(b[:], msgHello, msgReject)
		if err != nil || n != rejectLen {
			t.Fatalf("read %d: %v", n, err)
		}
		r, err := decodeReject(m)
		if err != nil {
			t.Fatal(err)
		}
		if r.from != 1 || r.code != rejectJob || r.text != text[:min(len(text), maxRejectText)] {
			t.Errorf("decoded %+v", r)
		}
		if err := rejectError(r); !errors.Is(err, ErrJobMismatch) {
			t.Errorf("%v, want ErrJobMismatch", err)
		}
	}
	b := encodeReject(&reject{code: rejectAuth, text: "x"})
	for name, mod := range map[string]func(b []byte){
		"code":    func(b []byte) { b[20] = 9 },
		"padding": func(b []byte) { b[rejectLen-1] = 1 },
	} {
		c := b
		mod(c[:])
		if _, err := decodeReject(c[:]); !errors.Is(err, ErrBadFrame) {
			t.Errorf("%s: %v, want ErrBadFrame", name, err)
		}
	}
}

func xSeal(t testing.TB, s *session, typ byte, msgs ...[]byte) []byte {
	var w bytes.Buffer
	for _, m := range msgs {
		if err := s.writeMsg(&w, typ, m); err != nil {
			t.Fatal(err)
		}
	}
	return w.Bytes()
}

func TestSessionRoundTrip(t *testing.T) {
	d, a := xSessions()
	var msgs [][]byte
	for i, n := range []int{0, 1, recordMax - 1, recordMax, recordMax + 1, 3*recordMax + 5} {
		msgs = append(msgs, bytes.Repeat([]byte{byte(i + 1)}, n))
	}
	b := xSeal(t, d, recData, msgs...)
	want := 0
	for _, m := range msgs {
		want += wireSize(len(m))
	}
	if len(b) != want {
		t.Errorf("%d bytes on the wire, wireSize says %d", len(b), want)
	}
	r := bytes.NewReader(b)
	for _, m := range msgs {
		typ, got, err := a.readMsg(r, DefaultMaxFrame)
		if err != nil {
			t.Fatalf("%d bytes: %v", len(m), err)
		}
		if typ != recData || !bytes.Equal(got, m) {
			t.Errorf("%d bytes: got type %d, %d bytes", len(m), typ, len(got))
		}
	}
	if r.Len() != 0 {
		t.Errorf("%d bytes left", r.Len())
	}
	// The other direction has its own key and sequence.
	r = bytes.NewReader(xSeal(t, a, recAbort, []byte("why")))
	if typ, got, err := d.readMsg(r, DefaultMaxFrame); err != nil || typ != recAbort || string(got) != "why" {
		t.Errorf("abort: %d %q %v", typ, got, err)
	}
}

// TestSessionTamper flips every bit of a sealed message: each change is
// an error, never a message with other contents.
func TestSessionTamper(t *testing.T) {
	d, _ := xSessions()
	b := xSeal(t, d, recData, []byte("endpoint secret"))
	for i := range b {
		for bit := range 8 {
			c := bytes.Clone(b)
			c[i] ^= 1 << bit
			_, a := xSessions()
			if _, got, err := a.readMsg(bytes.NewReader(c), DefaultMaxFrame); err == nil {
				t.Fatalf("byte %d bit %d flipped: message %q accepted", i, bit, got)
			} else if i >= recordHeader && !errors.Is(err, ErrAuth) {
				t.Fatalf("byte %d bit %d flipped: %v, want ErrAuth", i, bit, err)
			}
		}
	}
}

func TestSessionErrors(t *testing.T) {
	d, _ := xSessions()
	big := xSeal(t, d, recData, make([]byte, 2*recordMax+1))
	d, _ = xSessions()
	small := xSeal(t, d, recData, []byte("abc"))
	d, _ = xSessions()
	two := xSeal(t, d, recData, []byte("first!"), []byte("second"))
	mod := func(b []byte, f func(b []byte)) []byte {
		c := bytes.Clone(b)
		f(c)
		return c
	}
	for _, tc := range []struct {
		name  string
		b     []byte
		max   int
		limit int // bytes the reader may read
		want  error
	}{
		{"too large", big, 2 * recordMax, 2*(recordHeader+recordMax+aeadOverhead) + recordHeader, ErrFrameTooLarge},
		{"too large at once", big, recordMax - 1, recordHeader, ErrFrameTooLarge},
		{"record type", mod(small, func(b []byte) { b[0] = 7 }), DefaultMaxFrame, recordHeader, ErrBadFrame},
		{"type change", mod(big, func(b []byte) { b[recordHeader+recordMax+aeadOverhead] = recAbort }), DefaultMaxFrame, len(big), ErrBadFrame},
		{"flags", mod(small, func(b []byte) { b[1] = 3 }), DefaultMaxFrame, recordHeader, ErrBadFrame},
		{"record too long", mod(small, func(b []byte) { b[2], b[3] = 0x40, 1 }), DefaultMaxFrame, recordHeader, ErrBadFrame},
		{"short inner record", mod(small, func(b []byte) { b[1] = 0 }), DefaultMaxFrame, recordHeader, ErrBadFrame},
		{"abort too long", mod(big, func(b []byte) { b[0] = recAbort }), DefaultMaxFrame, recordHeader, ErrFrameTooLarge},
		{"replayed record", append(bytes.Clone(small), small...), DefaultMaxFrame, len(small) * 2, ErrAuth},
		{"reordered", append(bytes.Clone(two[len(two)/2:]), two[:len(two)/2]...), DefaultMaxFrame, len(two), ErrAuth},
		{"truncated", small[:len(small)-1], DefaultMaxFrame, len(small), io.ErrUnexpectedEOF},
		{"truncated message", big[:recordHeader+recordMax+aeadOverhead], DefaultMaxFrame, len(big), io.ErrUnexpectedEOF},
		{"empty", nil, DefaultMaxFrame, len(small), io.EOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, a := xSessions()
			r := &refuser{t: t, r: bytes.NewReader(tc.b), limit: tc.limit}
			var err error
			for err == nil {
				_, _, err = a.readMsg(r, tc.max)
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("%v, want %v", err, tc.want)
			}
		})
	}
	// A message sealed for the other direction (reflected back to its
	// sender) does not open.
	d, _ = xSessions()
	if _, _, err := d.readMsg(bytes.NewReader(xSeal(t, d, recData, []byte("x"))), DefaultMaxFrame); !errors.Is(err, ErrAuth) {
		t.Errorf("reflected: %v, want ErrAuth", err)
	}
}

// TestReadMsgAllocation: a record header declaring the largest record
// makes the reader allocate one record's buffer, not more, and a message
// grows only with the records that arrive (never by its declared size).
func TestReadMsgAllocation(t *testing.T) {
	d, _ := xSessions()
	full := xSeal(t, d, recData, make([]byte, 8*recordMax))
	for _, tc := range []struct {
		name  string
		b     []byte
		bound uint64
	}{
		{"header only", []byte{recData, 0, 0x40, 0}, 2 * recordMax},
		{"one record of eight", full[:recordHeader+recordMax+aeadOverhead], 4 * recordMax},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			_, a := xSessions()
			if _, _, err := a.readMsg(bytes.NewReader(tc.b), DefaultMaxFrame); !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("%v, want io.ErrUnexpectedEOF", err)
			}
			runtime.ReadMemStats(&after)
			if got := after.TotalAlloc - before.TotalAlloc; got > tc.bound {
				t.Errorf("allocated %d bytes, want at most %d", got, tc.bound)
			}
		})
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

// FuzzReadFrame: no sequence of records panics, reads more than a record
// at a time, or is accepted unless sealed with the session's key in
// order; accepted messages re-seal to the same bytes.
func FuzzReadFrame(f *testing.F) {
	const max = 3 * recordMax
	for _, msgs := range [][][]byte{
		{[]byte("payload")},
		{nil},
		{make([]byte, recordMax+1)},
		{[]byte("a"), []byte("b")},
		{make([]byte, max+1)}, // too large
	} {
		d, _ := xSessions()
		f.Add(xSeal(f, d, recData, msgs...))
	}
	d, _ := xSessions()
	f.Add(xSeal(f, d, recAbort, []byte("why")))
	f.Add([]byte{recData, recFinal, 0x40, 0})
	f.Add([]byte{recData, 0, 0, 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, a := xSessions()
		r := bytes.NewReader(b)
		var got [][]byte
		typ := byte(0)
		for {
			before := r.Len()
			tp, m, err := a.readMsg(chunked{r}, max)
			if err != nil {
				break
			}
			if before-r.Len() != wireSize(len(m)) {
				t.Fatalf("a message of %d bytes read %d bytes", len(m), before-r.Len())
			}
			if typ != 0 && tp != typ {
				break // the check below re-seals messages of one type
			}
			typ = tp
			got = append(got, m)
		}
		if len(got) == 0 {
			return
		}
		d, _ := xSessions()
		again := xSeal(t, d, typ, got...)
		if !bytes.HasPrefix(b, again) {
			t.Fatalf("accepted messages re-seal differently:\n%x\n%x", again, b[:min(len(b), len(again))])
		}
	})
}

// chunked makes sure the reader never asks for more than a record.
type chunked struct{ r io.Reader }

func (c chunked) Read(p []byte) (int, error) {
	if len(p) > recordMax+aeadOverhead {
		panic(fmt.Sprintf("read of %d bytes", len(p)))
	}
	return c.r.Read(p)
}

// FuzzReadHello: the acceptor's side of the handshake. No input panics,
// reads past a hello, or is accepted without a valid MAC; accepted hellos
// re-encode to the same bytes.
func FuzzReadHello(f *testing.F) {
	dh, ah := xHellos()
	f.Add(dh[:])
	f.Add(ah[:])
	f.Add(xV1Header())
	f.Add([]byte("GVCX\x04\x01\x00\x00"))
	f.Add([]byte("GVCX\x03\x01\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, n, err := xRead(b, msgHello)
		if err != nil {
			return
		}
		if n != helloLen {
			t.Fatalf("read %d bytes", n)
		}
		h, err := decodeHello(m, xKey, nil)
		if err != nil {
			return
		}
		again := encodeHello(h, xKey, nil)
		if !bytes.Equal(again[:], b[:helloLen]) {
			t.Fatalf("accepted hello re-encodes differently:\n%x\n%x", again, b[:helloLen])
		}
	})
}

// FuzzReadReply: the dialer's side of the handshake: the acceptor's
// hello, a reject, or its accept. No input panics or reads past the
// message; an accepted hello answers the dialer's.
func FuzzReadReply(f *testing.F) {
	dh, ah := xHellos()
	rej := encodeReject(&reject{code: rejectAuth, text: "no"})
	acc := acceptMsg()
	f.Add(ah[:])
	f.Add(rej[:])
	f.Add(acc[:])
	f.Add(dh[:])
	f.Fuzz(func(t *testing.T, b []byte) {
		m, n, err := xRead(b, msgHello, msgReject, msgAccept)
		if err != nil {
			return
		}
		if n != controlLen(m[5]) || n != len(m) {
			t.Fatalf("read %d bytes of a message of type %d", n, m[5])
		}
		switch m[5] {
		case msgReject:
			if r, err := decodeReject(m); err == nil {
				_ = rejectError(r).Error()
			}
		case msgHello:
			h, err := decodeHello(m, xKey, dh[:])
			if err != nil {
				return
			}
			again := encodeHello(h, xKey, dh[:])
			if !bytes.Equal(again[:], m) {
				t.Fatal("accepted hello re-encodes differently")
			}
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
