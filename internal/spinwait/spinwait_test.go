package spinwait

import (
	"testing"
	"time"
)

func TestFor(t *testing.T) {
	for _, c := range []struct {
		ranks, cpus int
		want        Policy
	}{
		{1, 1, Policy{Spin: MaxSpin}},
		{2, 2, Policy{Spin: MaxSpin}},
		{8, 64, Policy{Spin: MaxSpin}},
		{3, 2, Policy{Spin: MaxSpin, Yield: true}},
		{8, 2, Policy{Spin: MaxSpin, Yield: true}},
		{64, 2, Policy{Spin: MaxSpin, Yield: true}},
		{65, 2, Policy{Yield: true}},
		{512, 2, Policy{Yield: true}},
		{2, 0, Policy{Spin: MaxSpin, Yield: true}}, // no processor reported: one
		{33, 0, Policy{Yield: true}},
	} {
		c.want.Every = interval(c.ranks, c.cpus) // TestInterval
		if got := For(c.ranks, c.cpus); got != c.want {
			t.Errorf("For(%d ranks, %d cpus) = %+v, want %+v", c.ranks, c.cpus, got, c.want)
		}
	}
}

// TestInterval: the alarms and probes of a sleeping wait come every
// ProbeEvery while every local rank has a processor, and are spaced out
// in proportion to the ranks per processor when they outnumber the
// processors, up to MaxProbeEvery (the old fixed 10 ms made 256 ranks on
// 2 CPUs spend the processors on waking each other).
func TestInterval(t *testing.T) {
	for _, c := range []struct {
		ranks, cpus int
		want        time.Duration
	}{
		{1, 1, ProbeEvery},
		{2, 2, ProbeEvery},
		{8, 64, ProbeEvery},
		{3, 2, 2 * ProbeEvery},
		{8, 2, 4 * ProbeEvery},
		{20, 2, 10 * ProbeEvery},
		{200, 2, MaxProbeEvery},
		{512, 2, MaxProbeEvery},
		{4, 0, 4 * ProbeEvery}, // no processor count: taken as one
	} {
		if got := interval(c.ranks, c.cpus); got != c.want {
			t.Errorf("interval(%d ranks, %d cpus) = %v, want %v", c.ranks, c.cpus, got, c.want)
		}
	}
}

// TestProcs: the processors shared out among the ranks, at least one each.
func TestProcs(t *testing.T) {
	for _, c := range []struct{ ranks, cpus, want int }{
		{1, 2, 2}, {2, 2, 1}, {3, 8, 2}, {4, 2, 1}, {512, 2, 1}, {0, 4, 4}, {2, 0, 1},
	} {
		if got := Procs(c.ranks, c.cpus); got != c.want {
			t.Errorf("Procs(%d ranks, %d cpus) = %d, want %d", c.ranks, c.cpus, got, c.want)
		}
	}
}
