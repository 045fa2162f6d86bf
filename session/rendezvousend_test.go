package session

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// TestFinNotReadAtEnd: a rendezvous whose fin never came fails when the
// session ends, although the end also wakes the fin's waiter (it frees
// the window): a Send that took that wake-up for the fin returned nil
// for a message the peer never read. Here the session ended before the
// wait, so both wake-ups are there at once (before: nil about half the
// time, 40 tries).
func TestFinNotReadAtEnd(t *testing.T) {
	a, _ := pair(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := a.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	a.end(ErrPeerClosed)
	for i := range 40 {
		win, err := a.pd.Register(r.Bytes(), verbs.AccessRemoteRead)
		if err != nil {
			t.Fatal(err)
		}
		w := a.agent.expectFin(uint64(1000+i), win, LocalMR{}, LocalMR{})
		if err := a.awaitFin(ctx, w); !errors.Is(err, ErrPeerClosed) {
			t.Fatalf("try %d: a fin that never came: %v, want ErrPeerClosed", i, err)
		}
	}
}
