package channel

import (
	"bytes"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// TestCMData checks the private data of DialCM and AcceptCM: what encode
// writes parses back to the ready word and the caller's bytes (exact
// length), and every malformed header is refused with EPROTO, never read
// past its end.
func TestCMData(t *testing.T) {
	pd := softPD(t)
	h, err := newCMHandshake(pd)
	if err != nil {
		t.Fatal(err)
	}
	defer h.close()

	for _, n := range []int{0, 1, MaxCMDialData, MaxCMAcceptData} {
		data := bytes.Repeat([]byte{0xa5}, n)
		b := h.encode(data)
		// The CM pads private data with zeros: parsing must not care.
		b = append(b, make([]byte, verbs.MaxCMAcceptData-len(b))...)
		ready, got, err := parseCMData(b, MaxCMAcceptData)
		if err != nil {
			t.Fatalf("%d bytes: %v", n, err)
		}
		if ready != (verbs.RemoteAddr{Addr: h.mr.Addr(), RKey: h.mr.RKey()}) {
			t.Errorf("%d bytes: ready word %+v, want addr %#x rkey %#x", n, ready, h.mr.Addr(), h.mr.RKey())
		}
		if !bytes.Equal(got, data) {
			t.Errorf("%d bytes: data %x, want %x", n, got, data)
		}
	}

	good := h.encode([]byte("token"))
	withLen := func(n byte) []byte { b := bytes.Clone(good); b[3] = n; return b }
	for _, tc := range []struct {
		name    string
		b       []byte
		limit   int
		mention string
	}{
		{"Empty", nil, MaxCMDialData, "does not come from channel"},
		{"Short", good[:cmHeaderLen-1], MaxCMDialData, "does not come from channel"},
		{"PlainCM", append([]byte("hello from a verbs peer"), make([]byte, 33)...), MaxCMDialData, "does not come from channel"},
		{"Version", append([]byte{'g', 'c', cmVersion + 1}, good[3:]...), MaxCMDialData, "version 2"},
		{"LongerThanCarried", withLen(6), MaxCMDialData, "claims 6 bytes, it carries 5"},
		{"LongerThanLimit", withLen(5), 4, "may carry 4"},
		{"Max", withLen(255), MaxCMAcceptData, "claims 255"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := parseCMData(tc.b, tc.limit)
			if !errors.Is(err, syscall.EPROTO) {
				t.Errorf("parse: %v, want EPROTO", err)
			}
			if err != nil && !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("parse: %q does not mention %q", err, tc.mention)
			}
		})
	}
}
