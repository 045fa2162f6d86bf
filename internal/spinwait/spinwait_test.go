package spinwait

import "testing"

func TestBudget(t *testing.T) {
	for _, c := range []struct {
		ranks, cpus int
		want        bool // spins
	}{
		{1, 1, true}, {2, 2, true}, {3, 2, false}, {8, 2, false}, {8, 64, true},
	} {
		if got := Budget(c.ranks, c.cpus) > 0; got != c.want {
			t.Errorf("Budget(%d ranks, %d cpus) spins: %v, want %v", c.ranks, c.cpus, got, c.want)
		}
	}
}
