package netsrc

import (
	"net"
	"testing"
)

func TestNet64(t *testing.T) {
	for _, tc := range []struct{ ip, want string }{
		{"2001:db8::1", "2001:db8::/64"},
		{"2001:db8:0:0:ffff:ffff:ffff:ffff", "2001:db8::/64"},
		{"2001:db8:0:1::1", "2001:db8:0:1::/64"},
		{"fd00:1:2:3:4:5:6:7", "fd00:1:2:3::/64"}, // unique local
		{"10.0.0.1", ""},
		{"::ffff:10.0.0.1", ""}, // IPv4-mapped
		{"::1", ""},
		{"fe80::1", ""},
		{"ff02::1", ""},
		{"::", ""},
	} {
		if got := Net64(net.ParseIP(tc.ip)); got != tc.want {
			t.Errorf("Net64(%s) = %q, want %q", tc.ip, got, tc.want)
		}
	}
	if got := Net64(nil); got != "" {
		t.Errorf("Net64(nil) = %q", got)
	}
}
