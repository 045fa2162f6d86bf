package spinwait

import (
	"testing"
	"time"
)

// TestPolicy: waits that end while spinning keep the policy spinning; a
// run of waits that had to sleep makes it sleep at once, with a spinning
// probe every ProbeEvery waits; hits from probes bring spinning back.
func TestPolicy(t *testing.T) {
	var p Policy
	if p.Budget() != MaxSpin {
		t.Fatal("a new policy does not spin")
	}
	for range 5 {
		p.Budget()
		p.Record(time.Microsecond)
	}
	for range scoreMax - sleepBelow {
		p.Record(Short) // misses among hits, up to the margin: still spinning
	}
	if p.Sleeping() || p.Budget() != MaxSpin {
		t.Fatal("a few misses after hits stopped spinning")
	}
	for range 2 {
		p.Record(Short)
	}
	if !p.Sleeping() {
		t.Fatal("a run of misses did not stop spinning")
	}
	spins := 0
	for range 3 * ProbeEvery {
		if p.Budget() > 0 {
			spins++
		}
	}
	if spins != 3 {
		t.Fatalf("%d spinning waits in %d while sleeping, want 3 probes", spins, 3*ProbeEvery)
	}
	for range -sleepBelow {
		p.Record(time.Microsecond)
	}
	if p.Sleeping() || p.Budget() != MaxSpin {
		t.Fatal("hits did not bring spinning back")
	}
}
