package session

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// TestOfferLeaseOutlastsGrantee: the grantee of an offer counts its lease
// from when the offer reached it (it cannot know when the granter sent
// it), so the granter must not close the window before that count ends
// plus leaseGrace, however long the offer took to arrive. Before, the
// granter counted from before it sent the offer: an offer that took
// longer than leaseGrace to be taken in by the peer's agent (a busy or
// descheduled peer) left the grantee posting to a closed window, which
// fails on the device and ends the session.
func TestOfferLeaseOutlastsGrantee(t *testing.T) {
	for _, how := range []string{"SendLocalMR", "SendRegion"} {
		t.Run(how, func(t *testing.T) {
			a, b := pair(t, Config{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			mine, err := a.Alloc(4096)
			if err != nil {
				t.Fatal(err)
			}
			defer mine.Free()
			const lease = time.Minute
			var g *Grant
			if how == "SendLocalMR" {
				g, err = a.SendLocalMR(ctx, mine, verbs.AccessRemoteRead, lease)
			} else {
				g, err = a.SendRegion(ctx, mine.MemoryRegion(), 0, 4096, verbs.AccessRemoteRead, lease)
			}
			if err != nil {
				t.Fatal(err)
			}
			r, err := b.ReceiveRemoteMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			a.agent.mu.Lock()
			closes := g.g.closes
			a.agent.mu.Unlock()
			if want := r.Deadline().Add(leaseGrace); closes.Before(want) {
				t.Errorf("the granter closes the window at %s, %s before the grantee's lease ends plus leaseGrace (%s)",
					closes.Format(time.RFC3339Nano), want.Sub(closes), want.Format(time.RFC3339Nano))
			}
			if err := g.Revoke(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRefusalCodes: every refusal a peer's agent can send maps to an
// exported error a caller can test with errors.Is, with the peer's text.
// Before, a peer that could not allocate or register (errCodeNoMemory)
// and codes this side does not know gave an unexported error.
func TestRefusalCodes(t *testing.T) {
	for _, tc := range []struct {
		code uint8
		want error
	}{
		{errCodeLimit, ErrLimit},
		{errCodeNoMemory, ErrLimit},
		{errCodeUnknown, ErrLeaseExpired},
		{errCodeBusy, ErrLimit},
		{errCodeAccess, ErrAccess},
		{errCodeProtocol, ErrProtocol},
		{0, ErrProtocol},
		{200, ErrProtocol},
	} {
		err := codeErr(ctrlMsg{typ: ctrlErr, code: tc.code, text: "the peer's words"})
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), "the peer's words") {
			t.Errorf("code %d: %v, want an error wrapping %v with the peer's text", tc.code, err, tc.want)
		}
	}
}
