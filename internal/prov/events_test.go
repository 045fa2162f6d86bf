package prov

import (
	"context"
	"errors"
	"testing"
)

func TestEventQueue(t *testing.T) {
	var q EventQueue
	q.Init()
	bg := context.Background()
	// More than it holds: the oldest are dropped.
	for i := range EventQueueDepth + 3 {
		q.Push(AsyncEvent{QPN: uint32(i)})
	}
	for i := 3; i < EventQueueDepth+3; i++ {
		ev, err := q.Wait(bg)
		if err != nil || ev.QPN != uint32(i) {
			t.Fatalf("event %d: %+v, %v", i, ev, err)
		}
	}
	ctx, cancel := context.WithCancel(bg)
	cancel()
	if _, err := q.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on an empty queue with a cancelled ctx: %v", err)
	}
	// Fail: what was queued first, then the error.
	q.Push(AsyncEvent{QPN: 1})
	boom := errors.New("boom")
	q.Fail(boom)
	q.Push(AsyncEvent{QPN: 2}) // ignored
	if ev, err := q.Wait(bg); err != nil || ev.QPN != 1 {
		t.Fatalf("after Fail: %+v, %v, want the event queued before", ev, err)
	}
	if _, err := q.Wait(bg); err != boom {
		t.Fatalf("after Fail: %v, want its error", err)
	}
	// Close overrides: ErrClosed at once.
	q.Close()
	if _, err := q.Wait(bg); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

// TestEventQueueWakes: a Wait blocked on an empty queue returns the
// event a later Push queues, and another returns ErrClosed at Close.
func TestEventQueueWakes(t *testing.T) {
	var q EventQueue
	q.Init()
	got := make(chan error, 1)
	go func() {
		ev, err := q.Wait(context.Background())
		if err == nil && ev.QPN != 7 {
			err = errors.New("wrong event")
		}
		got <- err
	}()
	q.Push(AsyncEvent{QPN: 7})
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := q.Wait(context.Background())
		got <- err
	}()
	q.Close()
	if err := <-got; !errors.Is(err, ErrClosed) {
		t.Fatalf("Wait at Close: %v", err)
	}
}
