package spinwait

import (
	"sync"
	"sync/atomic"
	"time"
)

// Alarm ends the sleep of a wait that lasts. A sleeper arms it before it
// sleeps on the completion channel and disarms it when it wakes; if it
// goes off in between, it counts (Fired) and calls fire(arg) on a
// timer's goroutine. fire is to make a completion that wakes the sleeper
// (a probe write to the peer waited for), so that it sees Fired move and
// makes its checks. After Disarm returns, fire does not run for that
// sleep: the sleeper may release what fire uses.
//
// Arm and Disarm are the sleeper's (one goroutine at a time); Fired is
// safe for concurrent use.
type Alarm struct {
	fire  func(arg int)
	timer *time.Timer // the sleeper's
	fired atomic.Uint64
	mu    sync.Mutex // armed and arg, between the sleeper and the timer
	armed bool
	arg   int
}

// NewAlarm returns a disarmed alarm that calls fire when it goes off.
// fire must not block.
func NewAlarm(fire func(arg int)) *Alarm { return &Alarm{fire: fire} }

// Arm makes the alarm go off after d, calling fire(arg), unless Disarm
// comes first.
func (a *Alarm) Arm(d time.Duration, arg int) {
	a.mu.Lock()
	a.armed, a.arg = true, arg
	a.mu.Unlock()
	if a.timer == nil {
		a.timer = time.AfterFunc(d, a.ring)
	} else {
		a.timer.Reset(d)
	}
}

// Disarm ends the sleep: the alarm does not go off, or did already.
func (a *Alarm) Disarm() {
	a.timer.Stop()
	a.mu.Lock()
	a.armed = false
	a.mu.Unlock()
}

// Fired returns how often the alarm went off.
func (a *Alarm) Fired() uint64 { return a.fired.Load() }

func (a *Alarm) ring() {
	a.fired.Add(1)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.armed {
		a.fire(a.arg)
	}
}
