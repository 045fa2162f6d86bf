package stream

import (
	"context"
	"sync"
	"time"
)

// deadline is one direction's deadline as a context: the calls of that
// direction wait with context(), which is cancelled when the deadline
// passes. Moving the deadline keeps the context while it has not
// passed, so a call already waiting sees the new one; once a context is
// cancelled, it stays so until the next set makes a new one.
type deadline struct {
	mu     sync.Mutex
	ctx    context.Context
	cancel context.CancelFunc
	timer  *time.Timer // cancels ctx when the deadline passes; nil: none made for it
	armed  bool        // timer is set (not stopped): Stop failing means it fired
	ended  bool        // end was called: every context is cancelled
}

// context returns the context that ends when the deadline passes (or
// passed).
func (d *deadline) context() context.Context {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx == nil {
		d.renewLocked()
	}
	return d.ctx
}

// renewLocked makes a new context if there is none or the current one
// ended.
func (d *deadline) renewLocked() {
	if d.ctx != nil && d.ctx.Err() == nil {
		return
	}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	d.timer, d.armed = nil, false // made for the old cancel
	if d.ended {
		d.cancel()
	}
}

// set moves the deadline to t (zero: none).
func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.armed {
		// Only a timer still set may have fired: Stop also fails on
		// one stopped before (a deadline cleared), whose context must
		// stay live (it cancelled the calls waiting on it, spuriously).
		if !d.timer.Stop() {
			// It fired: the context is cancelled, or is being.
			d.cancel()
		}
		d.armed = false
	}
	d.renewLocked()
	if t.IsZero() {
		return
	}
	wait := time.Until(t)
	if wait <= 0 {
		d.cancel()
		return
	}
	if d.timer == nil {
		d.timer = time.AfterFunc(wait, d.cancel)
	} else {
		d.timer.Reset(wait)
	}
	d.armed = true
}

// end cancels the context, and every later one, and disarms the timer
// (Close: it stops the calls waiting).
func (d *deadline) end() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.armed {
		d.timer.Stop()
		d.armed = false
	}
	d.ended = true
	if d.ctx != nil {
		d.cancel()
	}
}
