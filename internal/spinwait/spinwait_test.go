package spinwait

import "testing"

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
		{9, 2, Policy{}},
		{512, 2, Policy{}},
		{2, 0, Policy{Spin: MaxSpin, Yield: true}}, // no processor reported: one
		{5, 0, Policy{}},
	} {
		if got := For(c.ranks, c.cpus); got != c.want {
			t.Errorf("For(%d ranks, %d cpus) = %+v, want %+v", c.ranks, c.cpus, got, c.want)
		}
	}
}
