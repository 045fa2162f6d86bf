package channel_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// TestBatchesHoldingEverySlot checks that Batch scopes that between them
// hold every operation slot (Options.MaxOutstanding) and each want one
// more do not wait for each other forever: no slot can come free while
// every holder waits for one, so the scope that would complete the
// circle fails its request at once with verbs.ErrQueueFull (saying why)
// and the others go on when it ends. Before, each waited until its
// context ended.
func TestBatchesHoldingEverySlot(t *testing.T) {
	for _, tc := range []struct {
		name          string
		slots, scopes int
	}{
		{"two scopes of two", 4, 2},
		{"four scopes of two", 8, 4},
		{"three scopes of one", 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newPair(t, channel.Options{MaxOutstanding: tc.slots})
			per := tc.slots / tc.scopes
			// A hang guard: the scopes must not need it.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var holding, wg sync.WaitGroup
			holding.Add(tc.scopes)
			errs := make([]error, tc.scopes)
			extra := make([]error, tc.scopes)
			for i := range tc.scopes {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = a.ch.Batch(ctx, func(bt *channel.Batch) error {
						off := 512 * i
						var hs []channel.Handle
						for k := range per {
							hs = append(hs, bt.Write(b.buf.Remote().At(uint64(off+64*k)), a.sge(off+64*k, 64)))
						}
						if err := bt.WaitAll(hs...); err != nil {
							return err
						}
						holding.Done()
						holding.Wait() // every scope holds its slots
						h := bt.Write(b.buf.Remote().At(uint64(off+64*per)), a.sge(off+64*per, 64))
						extra[i] = bt.Wait(h)
						return nil
					})
				}()
			}
			wg.Wait()
			failed := 0
			for i := range tc.scopes {
				// The failed request is the scope's error too.
				if errs[i] != nil && !(errors.Is(errs[i], verbs.ErrQueueFull) && extra[i] != nil) {
					t.Errorf("scope %d: %v", i, errs[i])
				}
				switch {
				case extra[i] == nil:
				case errors.Is(extra[i], verbs.ErrQueueFull):
					failed++
					t.Logf("scope %d: %v", i, extra[i])
				default:
					t.Errorf("scope %d: its request beyond the slots it held: %v, want nil or ErrQueueFull", i, extra[i])
				}
			}
			if failed != 1 {
				t.Errorf("%d scopes' requests failed with ErrQueueFull, want exactly 1 (the one that completed the circle)", failed)
			}
		})
	}
}
