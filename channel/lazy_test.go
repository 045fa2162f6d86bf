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
// only once something is posted to it, and none for its doorbells, which
// it posts one by one, connected or not. A rank of a large world has a
// queue pair to every other rank and posts to a few (512 ranks of one
// host held 1 500 descriptors each, then one per peer for the doorbells,
// whose making was most of a rank's Connect).
func TestMultiBatchesOnFirstUse(t *testing.T) {
	pd := channel.SoftPD(t)
	const peers = 64
	for _, tc := range []struct {
		name      string
		doorbells int
	}{{"no doorbells", 0}, {"doorbells", 8}} {
		t.Run(tc.name, func(t *testing.T) {
			before := batchFDs(t)
			opts := channel.Options{Doorbells: tc.doorbells}
			m, err := channel.NewMulti(pd, peers+1, 0, opts)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if got := batchFDs(t) - before; got > 0 {
				t.Errorf("%d batch descriptors for %d peers nothing was posted to, want none", got, peers)
			}
			// The other side of every queue pair.
			o, err := channel.NewMulti(pd, peers+1, 0, opts)
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			me, err := m.Endpoints()
			if err != nil {
				t.Fatal(err)
			}
			oe, err := o.Endpoints()
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Connect(oe); err != nil {
				t.Fatal(err)
			}
			if err := o.Connect(me); err != nil {
				t.Fatal(err)
			}
			if got := batchFDs(t) - before; got > 0 {
				t.Errorf("%d batch descriptors for %d connected peers nothing was posted to, want none", got, 2*peers)
			}
		})
	}
}
