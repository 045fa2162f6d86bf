package soft

import (
	"fmt"
	"net"
	"slices"
	"testing"

	"github.com/goverbs/verbs/internal/netsrc"
)

// fromAddr is a connection that says it comes from addr.
type fromAddr struct {
	net.Conn
	addr net.Addr
}

func (c fromAddr) RemoteAddr() net.Addr { return c.addr }

// TestHandshakeSources: the handshakes of strangers are bounded per
// source address, and per IPv6 /64 too (a host given a /64 connects from
// as many addresses as it likes); link-local addresses count apart, as
// IPv4 ones do. The oldest of the source or network is closed first.
func TestHandshakeSources(t *testing.T) {
	for _, tc := range []struct {
		name    string
		n       int
		addr    func(i int) string
		dropped int // the first this many
	}{
		{"one address", 20, func(int) string { return "2001:db8::1" }, 20 - maxHandshakesPerSource},
		{"one /64", 40, func(i int) string { return fmt.Sprintf("2001:db8::%x", i+1) }, 40 - maxHandshakesPerNet},
		{"a /64 each", 40, func(i int) string { return fmt.Sprintf("2001:db8:0:%x::1", i+1) }, 0},
		{"link-local", 40, func(i int) string { return fmt.Sprintf("fe80::%x", i+1) }, 0},
		{"IPv4", 40, func(i int) string { return fmt.Sprintf("10.0.0.%d", i+1) }, 0},
		{"past the global limit", maxHandshakes + 5, func(i int) string { return fmt.Sprintf("10.0.%d.1", i+1) }, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &service{hsBySrc: map[string]int{}}
			hs := make([]*handshaking, tc.n)
			for i := range hs {
				a, b := net.Pipe()
				defer a.Close()
				defer b.Close()
				c := fromAddr{b, &net.TCPAddr{IP: net.ParseIP(tc.addr(i)), Port: 1000 + i}}
				src, net64, _ := sourceKey(c)
				if want := netsrc.Net64(c.addr.(*net.TCPAddr).IP); net64 != want {
					t.Fatalf("sourceKey of %s: network %q, want %q", tc.addr(i), net64, want)
				}
				hs[i] = s.startHandshake(c, src, net64)
			}
			for i, h := range hs {
				if held, want := slices.Contains(s.hs, h), i >= tc.dropped; held != want {
					t.Errorf("handshake %d from %s: held %v, want %v", i, tc.addr(i), held, want)
				}
			}
			for _, h := range hs {
				s.endHandshake(h)
			}
			if len(s.hs) != 0 || len(s.hsBySrc) != 0 {
				t.Errorf("after every handshake ended: %d held, counts %v", len(s.hs), s.hsBySrc)
			}
		})
	}
}
