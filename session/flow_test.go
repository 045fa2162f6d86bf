package session

import (
	"context"
	"errors"
	"fmt"
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

// TestRendezvousReceiveNotStarved: both sides send and receive
// concurrently. Senders waiting for the peer's credits hold op tokens
// (postEager takes one before it waits for a credit), so a Receive whose
// next message is a rendezvous finds no token for its read; each side's
// receiver waited for the other's senders, which waited for the other's
// receiver: neither side ever got a message again, although both
// received in a loop. The read takes no token now (dataOptions).
func TestRendezvousReceiveNotStarved(t *testing.T) {
	cfg := Config{QueueDepth: 2, ReceiveBuffers: 2, MessageSize: 1024}
	a, b := pair(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	big := make([]byte, 8192)
	small := make([]byte, 16)
	sendErrs := make(chan error, 10)
	for _, s := range []*Session{a, b} {
		go func() { sendErrs <- s.Send(ctx, big) }() // rendezvous: the RTS takes the peer's slot 0
		for s.dflow.sent.Load() != 1 || len(s.ops) != 0 {
			time.Sleep(time.Millisecond)
		}
		for range 3 { // one fills the peer's slot 1; two wait for a credit, holding both tokens
			go func() { sendErrs <- s.Send(ctx, small) }()
		}
		for s.dflow.sent.Load() != 2 || len(s.ops) != 2 {
			time.Sleep(time.Millisecond)
		}
		// One more sender, which waits for a token: it is queued for
		// one before the receiver.
		go func() { sendErrs <- s.Send(ctx, small) }()
		time.Sleep(200 * time.Millisecond)
	}
	// Now both sides receive (and release) everything that comes.
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	recvErrs := make(chan error, 2)
	for _, s := range []*Session{a, b} {
		go func() {
			for i := range 5 {
				m, err := s.Receive(rctx)
				if err != nil {
					recvErrs <- fmt.Errorf("after %d messages: %w (ops held %d)", i, err, len(s.ops))
					return
				}
				m.Release()
			}
			recvErrs <- nil
		}()
	}
	var failed error
	for range 2 {
		if err := <-recvErrs; err != nil {
			failed = err
		}
	}
	cancel() // let the senders go (goleak)
	for range 10 {
		<-sendErrs
	}
	if failed != nil {
		t.Fatalf("Receive with both sides receiving in a loop: %v (a rendezvous read starved of op tokens by senders waiting for credits)", failed)
	}
}
