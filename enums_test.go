package verbs_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/goverbs/verbs"
)

// TestMTUFromBytes: the five path MTUs round-trip through their byte
// counts; anything else is an error that says what is valid.
func TestMTUFromBytes(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want verbs.MTU
		ok   bool
	}{
		{256, verbs.MTU256, true},
		{512, verbs.MTU512, true},
		{1024, verbs.MTU1024, true},
		{2048, verbs.MTU2048, true},
		{4096, verbs.MTU4096, true},
		{0, 0, false},
		{-1024, 0, false},
		{1000, 0, false},
		{1500, 0, false},
		{8192, 0, false},
	} {
		m, err := verbs.MTUFromBytes(tc.n)
		switch {
		case tc.ok && (err != nil || m != tc.want || m.Bytes() != tc.n || m.String() != fmt.Sprint(tc.n)):
			t.Errorf("MTUFromBytes(%d) = %v (%d bytes), %v; want %v", tc.n, m, m.Bytes(), err, tc.want)
		case !tc.ok && (err == nil || !strings.Contains(err.Error(), "256, 512, 1024, 2048 or 4096")):
			t.Errorf("MTUFromBytes(%d) = %v, %v; want an error naming the valid sizes", tc.n, m, err)
		}
	}
	if s := verbs.MTU(9).String(); s != "MTU(9)" {
		t.Errorf("an invalid MTU prints %q", s)
	}
}
