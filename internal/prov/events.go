package prov

import (
	"context"
	"sync"
)

// EventQueueDepth is how many async events an EventQueue holds.
const EventQueueDepth = 256

// EventQueue is a bounded queue of a device context's async events, for
// its providers: they Push what the device reports, and AsyncEvent Waits.
// When it is full, the oldest event is dropped (a program that never
// reads events must not make the provider hold an unbounded number). The
// zero value is not usable: call Init. It is safe for concurrent use.
type EventQueue struct {
	mu     sync.Mutex
	buf    [EventQueueDepth]AsyncEvent
	head   int
	n      int
	sig    chan struct{} // a token when events may be queued
	done   chan struct{} // closed by Close or Fail
	closed bool
	err    error // set by Fail
}

// Init prepares the queue.
func (e *EventQueue) Init() {
	e.sig = make(chan struct{}, 1)
	e.done = make(chan struct{})
}

// Push queues ev, dropping the oldest event if the queue is full. After
// Close or Fail it does nothing.
func (e *EventQueue) Push(ev AsyncEvent) {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	if e.n == len(e.buf) {
		e.buf[e.head] = AsyncEvent{}
		e.head = (e.head + 1) % len(e.buf)
		e.n--
	}
	e.buf[(e.head+e.n)%len(e.buf)] = ev
	e.n++
	e.mu.Unlock()
	e.signal()
}

// signal leaves a token for a Wait: events may be queued.
func (e *EventQueue) signal() {
	select {
	case e.sig <- struct{}{}:
	default:
	}
}

// Wait returns the oldest queued event, waiting for one until ctx ends
// (then it returns ctx.Err()). After Close it returns ErrClosed, after
// Fail(err), once the events queued before are taken, err.
func (e *EventQueue) Wait(ctx context.Context) (AsyncEvent, error) {
	for {
		e.mu.Lock()
		if e.closed && (e.err == nil || e.n == 0) {
			err := e.err
			e.mu.Unlock()
			if err == nil {
				err = ErrClosed
			}
			return AsyncEvent{}, err
		}
		if e.n > 0 {
			ev := e.buf[e.head]
			e.buf[e.head] = AsyncEvent{}
			e.head = (e.head + 1) % len(e.buf)
			e.n--
			more := e.n > 0
			e.mu.Unlock()
			if more {
				e.signal() // for the next Wait
			}
			return ev, nil
		}
		e.mu.Unlock()
		select {
		case <-e.sig:
		case <-e.done:
		case <-ctx.Done():
			return AsyncEvent{}, ctx.Err()
		}
	}
}

// Close ends the queue: Wait returns ErrClosed, at once. Idempotent.
func (e *EventQueue) Close() {
	e.mu.Lock()
	e.err = nil
	e.end()
	e.mu.Unlock()
}

// Fail ends the queue with err: Wait returns the events already queued,
// then err. After Close or Fail it does nothing.
func (e *EventQueue) Fail(err error) {
	e.mu.Lock()
	if !e.closed {
		e.err = err
		e.end()
	}
	e.mu.Unlock()
}

// end closes the queue; called with e.mu held.
func (e *EventQueue) end() {
	if !e.closed {
		e.closed = true
		close(e.done)
	}
}
