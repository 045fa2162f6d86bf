package channel_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// spinModes are the values of Options.SpinPolls with a behaviour of
// their own. SpinAlways is spelt math.MaxInt: a channel spinning without
// end must still honour its context.
var spinModes = []struct {
	name string
	spin int
}{
	{"adaptive", channel.SpinAdaptive},
	{"never", channel.SpinNever},
	{"polls64", 64},
	{"always", math.MaxInt},
}

// TestWaitHonoursContext: a receive that nothing answers ends with its
// context, whatever the way of waiting, pure spinning included.
func TestWaitHonoursContext(t *testing.T) {
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			a, _ := newPair(t, channel.Options{SpinPolls: m.spin})
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := a.ch.Receive(ctx, a.sge(0, 8))
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("receive: %v, want ErrTimeout and context.DeadlineExceeded", err)
				}
			case <-time.After(20 * time.Second): // a hang guard
				t.Fatal("the receive did not return 20 s after its context ended")
			}
		})
	}
}

// TestWaitModes: a message sent later than any spin lasts reaches a
// receiver that waits in each way.
func TestWaitModes(t *testing.T) {
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			a, b := newPair(t, channel.Options{SpinPolls: m.spin})
			ctx := testCtx(t)
			copy(b.buf.Bytes(), "12345678")
			sent := make(chan error, 1)
			go func() {
				time.Sleep(5 * time.Millisecond)
				sent <- b.ch.Send(ctx, b.sge(0, 8))
			}()
			r, err := a.ch.Receive(ctx, a.sge(100, 8))
			if err != nil {
				t.Fatal(err)
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
			if r.Len != 8 || string(a.buf.Bytes()[100:108]) != "12345678" {
				t.Errorf("received %d bytes %q", r.Len, a.buf.Bytes()[100:108])
			}
		})
	}
}
