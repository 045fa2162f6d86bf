package session

import (
	"testing"
	"time"
)

// TestRemoteSweepAfterPause: remote regions still in their lease (or its
// grace) when the grantee's table last doubled are forgotten once they
// expire, at the next region recorded, not when the table doubles
// again. Before, on a machine slow enough that the leases of the regions
// of TestAdvExpiredRemotesForgotten outlived its sweeps, the grantee
// kept 246 expired regions of 446 (CI).
func TestRemoteSweepAfterPause(t *testing.T) {
	_, b := pair(t, Config{})
	const expiring = 200
	for i := range expiring {
		b.newRemote(ctrlMsg{grant: uint64(i + 1), addr: 4096, len: 64, lease: time.Millisecond}, time.Time{})
	}
	b.agent.mu.Lock()
	kept, next := len(b.agent.remotes), b.agent.sweepAt
	b.agent.mu.Unlock()
	if kept+10 >= next {
		t.Skipf("the table (%d regions) is to be swept at %d: this test needs it to stay below", kept, next)
	}
	time.Sleep(time.Millisecond + leaseGrace + 10*time.Millisecond) // every lease and its grace over
	for i := range 10 {
		b.newRemote(ctrlMsg{grant: uint64(expiring + i + 1), addr: 4096, len: 64, lease: time.Hour}, time.Time{})
	}
	b.agent.mu.Lock()
	defer b.agent.mu.Unlock()
	expired := 0
	for _, r := range b.agent.remotes {
		if r.valid() != nil {
			expired++
		}
	}
	if expired > 0 {
		t.Errorf("the grantee keeps %d regions whose leases and grace ended (of %d it holds)", expired, len(b.agent.remotes))
	}
}
