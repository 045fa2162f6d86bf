package channel_test

import (
	"testing"

	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// TestNewMultiPeerBound: a peer count NewMulti cannot hold is an error,
// not a panic (makeslice: len out of range, for 1<<61) or an attempt to
// allocate tables for billions of peers (out of memory, for 1<<32).
func TestNewMultiPeerBound(t *testing.T) {
	pd := verbstest.OpenPD(t, "soft0")
	for _, n := range []int{-1, 0, channel.MaxPeers + 1, 1 << 32, 1 << 61} {
		m, err := channel.NewMulti(pd, n, 0, channel.Options{})
		if err == nil {
			m.Close()
			t.Errorf("NewMulti with %d peers succeeded", n)
		}
	}
}
