package collective_test

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs/collective"
)

// TestCustomOpGoexit: a Custom operation that ends its goroutine
// (runtime.Goexit, as t.Fatal does) ends the call like a panic would: the
// turn is given up, the communicator is poisoned and the peers are told,
// so the peer's call fails, Close returns, and a non-blocking call's Wait
// reports ErrOpPanicked instead of success. Before, the call's turn stayed
// held for ever: the peer's call waited for its context, Close never
// returned, and IAllreduce's Wait reported success.
func TestCustomOpGoexit(t *testing.T) {
	for _, nonBlocking := range []bool{false, true} {
		name := "blocking"
		if nonBlocking {
			name = "non-blocking"
		}
		t.Run(name, func(t *testing.T) {
			cs := world(t, 2, collective.Options{})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			exit := collective.Custom("exit", func(inout, in []int64) { runtime.Goexit() })
			errc := make(chan error, 2)
			for r := range 2 {
				go func() {
					buf := make([]int64, 4)
					if nonBlocking {
						errc <- collective.IAllreduce(ctx, cs[r], nil, buf, exit).Wait(ctx)
						return
					}
					exited := true
					defer func() {
						if exited {
							errc <- errGoexit
						}
					}()
					err := collective.Allreduce(ctx, cs[r], nil, buf, exit)
					exited = false
					errc <- err
				}()
			}
			exits := 0
			for range 2 {
				err := <-errc
				switch {
				case err == errGoexit:
					exits++
				case err == nil:
					t.Error("a call succeeded")
				case ctx.Err() != nil:
					t.Fatalf("a call waited until its context ended: %v", err)
				case nonBlocking && !errors.Is(err, collective.ErrOpPanicked) && !errors.Is(err, collective.ErrPeerAborted):
					t.Errorf("Wait: %v, want ErrOpPanicked or ErrPeerAborted", err)
				}
			}
			if !nonBlocking && exits == 0 {
				t.Error("no call's goroutine exited")
			}
			closed := make(chan error, 2)
			for r := range 2 {
				go func() { closed <- cs[r].Close() }()
			}
			for range 2 {
				select {
				case <-closed:
				case <-ctx.Done():
					t.Fatal("Close did not return")
				}
			}
		})
	}
}

var errGoexit = errors.New("the goroutine exited")
