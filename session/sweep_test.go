package session

import (
	"errors"
	"testing"
	"time"

	"github.com/goverbs/verbs"
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
		b.newRemote(ctrlMsg{grant: uint64(i + 1), addr: 4096, len: 64, lease: time.Millisecond}, time.Time{}, false)
	}
	b.agent.mu.Lock()
	kept, next := len(b.agent.remotes), b.agent.sweepAt
	b.agent.mu.Unlock()
	if kept+10 >= next {
		t.Skipf("the table (%d regions) is to be swept at %d: this test needs it to stay below", kept, next)
	}
	time.Sleep(time.Millisecond + leaseGrace + 10*time.Millisecond) // every lease and its grace over
	for i := range 10 {
		b.newRemote(ctrlMsg{grant: uint64(expiring + i + 1), addr: 4096, len: 64, lease: time.Hour}, time.Time{}, false)
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

// TestRemoteLateGrantKept: a grant that comes more than leaseGrace after
// its request (a loaded machine), with a lease over by then, stays in the
// grantee's table until its requester takes it: RequestRemoteMR returns
// the region (its lease ended: its operations fail with ErrLeaseExpired).
// Before, the sweep that recording it ran forgot it at once, and
// RequestRemoteMR failed with ErrLeaseExpired
// (TestAdvExpiredRemotesForgotten failed so under load: "request 142:
// session: request remote region: session: lease expired").
func TestRemoteLateGrantKept(t *testing.T) {
	_, b := pair(t, Config{})
	// A table large enough to be swept, and last swept long ago.
	for i := range remoteSweepMin {
		b.newRemote(ctrlMsg{grant: uint64(i + 1), addr: 4096, len: 64, lease: time.Hour}, time.Time{}, false)
	}
	const id, grant = 1 << 40, 1 << 40
	ch := make(chan ctrlMsg, 1)
	b.agent.mu.Lock()
	b.agent.sweptAt = time.Time{}
	b.agent.waiters[id] = waiter{ch: ch, at: time.Now().Add(-time.Second)}
	b.agent.mu.Unlock()
	b.handle(ctrlMsg{typ: ctrlGrant, id: id, grant: grant, addr: 4096, len: 64, access: verbs.AccessRemoteWrite, lease: time.Millisecond})
	if m := <-ch; m.grant != grant {
		t.Fatalf("the waiter got grant %d, want %d", m.grant, grant)
	}
	r := b.claimRemote(grant)
	if r == nil {
		t.Fatal("the grant was forgotten before its requester took it")
	}
	if err := r.valid(); !errors.Is(err, ErrLeaseExpired) {
		t.Errorf("the region of a grant whose lease ended: %v, want ErrLeaseExpired", err)
	}
	// Taken, it is swept as the others.
	b.agent.mu.Lock()
	b.agent.sweepRemotesLocked(time.Now())
	_, kept := b.agent.remotes[grant]
	b.agent.mu.Unlock()
	if kept {
		t.Error("the sweep kept a region taken whose lease and grace ended")
	}
}
