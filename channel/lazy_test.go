package channel_test

import (
	"os"
	"strings"
	"testing"

	"github.com/goverbs/verbs/channel"
)

// batchFDs counts this process' descriptors of request batches (the
// memfds that hold a batch's requests outside the Go heap).
func batchFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.Contains(l, "batch") {
			n++
		}
	}
	return n
}

// TestMultiBatchesOnFirstUse: a MultiChannel holds the request batches of
// a peer (two descriptors and mappings, a queue depth of requests each)
// only once something is posted to it, and the doorbell batch of each
// peer when it has doorbells. A rank of a large world has a queue pair
// to every other rank and posts to a few (512 ranks of one host held
// 1 500 descriptors each).
func TestMultiBatchesOnFirstUse(t *testing.T) {
	pd := channel.SoftPD(t)
	const peers = 64
	for _, tc := range []struct {
		name      string
		doorbells int
	}{{"no doorbells", 0}, {"doorbells", 8}} {
		t.Run(tc.name, func(t *testing.T) {
			before := batchFDs(t)
			m, err := channel.NewMulti(pd, peers+1, 0, channel.Options{Doorbells: tc.doorbells})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			got := batchFDs(t) - before
			want := 0
			if tc.doorbells > 0 {
				want = peers // one doorbell batch per peer
			}
			if got > want {
				t.Errorf("%d batch descriptors for %d peers nothing was posted to, want at most %d", got, peers, want)
			}
		})
	}
}
