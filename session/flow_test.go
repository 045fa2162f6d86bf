package session

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestCreditWaitDrives: a sender out of credits drives the progress of
// its queue pair while it waits, and sees the count its peer wrote once
// a drive has placed it: soft0 places a remote write only when the
// queue pair's completion queue is polled (or its connection's reader
// takes over, hundreds of microseconds after the polls stopped). Here
// the "provider" places the count at the third drive; a wait that did
// not drive would wait until the context's end.
func TestCreditWaitDrives(t *testing.T) {
	for _, tc := range []struct {
		name    string
		placeAt int64 // the drive that places the count; 0: none does
		want    error
	}{
		{"placed at once", 1, nil},
		{"placed later", 3, nil},
		{"placed after the yields", 100, nil},
		{"never placed", 0, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var word uint32
			var drives atomic.Int64
			f := sendFlow{r: 4, word: &word}
			f.sent.Store(4) // every credit taken
			f.progress = func() error {
				if n := drives.Add(1); n == tc.placeAt {
					atomic.StoreUint32(&word, 2) // the peer reposted two buffers
				}
				return nil
			}
			d := time.Minute // a hang guard, not a timing assertion
			if tc.want != nil {
				d = 50 * time.Millisecond
			}
			ctx, cancel := context.WithTimeout(context.Background(), d)
			defer cancel()
			err := f.wait(ctx, nil)
			if !errors.Is(err, tc.want) {
				t.Fatalf("wait: %v, want %v", err, tc.want)
			}
			if tc.placeAt > 0 && drives.Load() < tc.placeAt {
				t.Fatalf("returned after %d drives, before the count was placed", drives.Load())
			}
			if tc.want == nil && !f.tryTake() {
				t.Fatal("no credit after the wait")
			}
		})
	}
}

// TestCreditWrite: the receiver tells the sender its count by a write
// once the sender may have fewer than half of the buffers left or a
// quarter of them were posted again since it was told, and only when
// there is something new to tell.
func TestCreditWrite(t *testing.T) {
	for _, tc := range []struct {
		name                           string
		reposted, advertised, consumed uint32
		want                           bool
	}{
		{"nothing new", 40, 40, 40, false},
		{"nothing new, none left", 40, 40, 104, false},
		{"plenty left", 10, 0, 10, false},                   // 64 + 0 - 10 = 54 credits, 10 new
		{"a quarter new", 16, 0, 16, true},                  // 48 credits, 16 new
		{"fewer than half, few new", 33, 30, 63, true},      // 31 credits, 3 new
		{"half left, few new", 33, 30, 62, false},           // 32: not fewer than half, 3 new
		{"behind, a quarter new", 16, 0, 20, true},          // the receiver consumed 20 of 64 sent
		{"wrapped", 5, 1<<32 - 40, 5, true},                 // 64 - 45 = 19
		{"wrapped, plenty", 5, 1<<32 - 4, 3, false},         // 64 - 7 = 57, 9 new
		{"wrapped, a quarter new", 12, 1<<32 - 4, 12, true}, // 16 new
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := recvFlow{r: 64}
			f.reposted.Store(tc.reposted)
			f.advertised.Store(tc.advertised)
			f.consumed.Store(tc.consumed)
			rep, ok := f.shouldWrite()
			if ok != tc.want || rep != tc.reposted {
				t.Fatalf("shouldWrite = %d, %v; want %d, %v", rep, ok, tc.reposted, tc.want)
			}
		})
	}
}
