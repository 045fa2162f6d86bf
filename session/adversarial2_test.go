package session

import (
	"errors"
	"math"
	"testing"

	"github.com/goverbs/verbs"
)

// Adversarial tests, second pass: a peer that completed the bootstrap
// and then breaks the protocol on purpose (writes beyond its credits,
// answers requests with what was not asked for), and a careless
// application (lengths that overflow, negative configuration, leases
// "for ever"). Each asserts a clear, typed error and no panic; those of
// a peer's violation, that the session ends with ErrProtocol.

// TestAdv2SendRegionBounds: SendRegion refuses with ErrOutOfBounds every
// part that does not lie in the region, lengths whose sum with the
// offset overflows included (before, off 1 and n math.MaxInt passed the
// check and the slice expression panicked).
func TestAdv2SendRegionBounds(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	mr, err := a.pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	for _, tc := range []struct {
		name   string
		off, n int
	}{
		{"off+n overflows", 1, math.MaxInt},
		{"n overflows alone", 4095, math.MaxInt - 4000},
		{"off at the maximum", math.MaxInt, 1},
		{"off past the end", 4097, 1},
		{"one byte past the end", 4000, 97},
		{"negative offset", -1, 1},
		{"empty", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := a.SendRegion(ctx, mr, tc.off, tc.n, verbs.AccessRemoteRead, 0)
			if !errors.Is(err, ErrOutOfBounds) {
				if g != nil {
					g.Revoke(ctx)
				}
				t.Fatalf("SendRegion(%d, %d) of a region of 4096: %v, want ErrOutOfBounds", tc.off, tc.n, err)
			}
		})
	}
	// The session goes on: the whole region can be sent.
	g, err := a.SendRegion(ctx, mr, 0, 4096, verbs.AccessRemoteRead, 0)
	if err != nil {
		t.Fatal(err)
	}
	r, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Len() != 4096 {
		t.Fatalf("the region offered is of %d bytes", r.Len())
	}
	if err := g.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
}
