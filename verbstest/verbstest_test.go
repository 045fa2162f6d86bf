package verbstest

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

func TestCaseNamesUnique(t *testing.T) {
	seen := map[string]bool{}
	for _, n := range Cases() {
		if n == "" || seen[n] {
			t.Errorf("case name %q is empty or repeated", n)
		}
		seen[n] = true
	}
}

// TestPeerProcessLimits checks that every check skipped with side B in a
// peer process names a case of the suite, and says why.
func TestPeerProcessLimits(t *testing.T) {
	limits := PeerProcessLimits()
	if len(limits) == 0 {
		t.Fatal("no limits: update this test and the README if none are needed any more")
	}
	for name, reason := range limits {
		c, check, ok := strings.Cut(name, "/")
		if !slices.Contains(Cases(), c) || (ok && check == "") || reason == "" {
			t.Errorf("limit %q (%q) does not name a case or check of the suite with a reason", name, reason)
		}
	}
	cfg := Config{DeviceA: "x", PeerProcessB: true, Deviations: map[string]string{"SendRecv": "r"}}
	if r, ok := cfg.skipReason("ErrOutOfBounds/WritePastEnd"); !ok || !strings.Contains(r, "peer process") {
		t.Errorf("skipReason with PeerProcessB = %q, %v", r, ok)
	}
	if r, ok := cfg.skipReason("SendRecv"); !ok || !strings.Contains(r, "deviation") {
		t.Errorf("skipReason of a deviation = %q, %v", r, ok)
	}
	cfg.PeerProcessB = false
	if _, ok := cfg.skipReason("ErrOutOfBounds/WritePastEnd"); ok {
		t.Errorf("a peer-process limit skips without PeerProcessB")
	}
}

func TestConfigDefaults(t *testing.T) {
	c := Config{DeviceA: "x"}.withDefaults()
	if c.DeviceB != "x" || c.Port != 1 || c.Timeout != DefaultTimeout {
		t.Errorf("defaults: %+v", c)
	}
}

// TestPollN checks that PollN takes exactly n completions, with and
// without a completion channel, and ends with the context.
func TestPollN(t *testing.T) {
	CheckLeaks(t)
	for _, spec := range []verbs.CQSpec{{}, {NoChannel: true}} {
		cfg := Config{DeviceA: verbs.SoftDevice}
		a, b := NewNodes(t, cfg)
		cq := a.NewCQ(t, spec)
		qa := a.NewRC(t, verbs.QPSpec{SendCQ: cq})
		qb := b.NewRC(t, verbs.QPSpec{})
		ConnectRC(t, qa, qb)
		m := a.Alloc(t, 64, verbs.AccessRemoteAll)
		for i := range 3 {
			if err := qa.PostWrite(uint64(i), verbs.Signaled, m.Remote().At(0), SGE(t, m, 8, 8)); err != nil {
				t.Fatal(err)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
		wcs, err := PollN(ctx, cq, 2)
		cancel()
		if err != nil || len(wcs) != 2 || wcs[0].WRID != 0 || wcs[1].WRID != 1 {
			t.Fatalf("PollN(2) = %v, %v", wcs, err)
		}
		ctx, cancel = context.WithTimeout(context.Background(), DefaultTimeout)
		wcs, err = PollN(ctx, cq, 1)
		cancel()
		if err != nil || len(wcs) != 1 || wcs[0].WRID != 2 {
			t.Fatalf("PollN(1) = %v, %v", wcs, err)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 10*time.Millisecond)
		wcs, err = PollN(ctx, cq, 1)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || len(wcs) != 0 {
			t.Errorf("PollN on an empty CQ (spec %+v) = %v, %v; want a deadline error", spec, wcs, err)
		}
	}
}
