package verbstest

import (
	"context"
	"errors"
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
			if err := qa.PostWrite(uint64(i), verbs.Signaled, m.Remote().At(0), m.SGE(8, 8)); err != nil {
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
