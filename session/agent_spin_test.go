package session

import (
	"testing"
	"time"
)

// TestAgentSpins: an agent spins before its next wait always with
// Config.AgentSpin, else only when its last two control messages came
// less than agentBurst apart.
func TestAgentSpins(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, c := range []struct {
		name       string
		spin       bool
		prev, last time.Time
		want       bool
	}{
		{"first message", false, time.Time{}, t0, false},
		{"no message yet", false, time.Time{}, time.Time{}, false},
		{"burst", false, t0, t0.Add(agentBurst / 10), true},
		{"just under the bound", false, t0, t0.Add(agentBurst - 1), true},
		{"at the bound", false, t0, t0.Add(agentBurst), false},
		{"far apart (keepalives)", false, t0, t0.Add(time.Second), false},
		{"AgentSpin, far apart", true, t0, t0.Add(time.Second), true},
		{"AgentSpin, first message", true, time.Time{}, t0, true},
	} {
		if got := agentSpins(c.spin, c.prev, c.last); got != c.want {
			t.Errorf("%s: agentSpins = %v, want %v", c.name, got, c.want)
		}
	}
}
