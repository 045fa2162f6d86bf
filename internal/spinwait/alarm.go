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
// sleep: the sleeper may release what fire uses. fire runs at most once
// per Arm, and not before the d of that Arm has passed: a ring of an
// earlier sleep's timer that comes late (it went off as that sleep
// ended) is counted but does not go off in the next sleep.
//
// Arm and Disarm are the sleeper's (one goroutine at a time); Fired is
// safe for concurrent use.
type Alarm struct {
	fire  func(arg int)
	timer *time.Timer // the sleeper's
	fired atomic.Uint64
	mu    sync.Mutex // the fields below, between the sleeper and the timer
	armed bool
	rang  bool      // fire ran for this Arm
	due   time.Time // this Arm's timer goes off no sooner (monotonic)
	arg   int
}

// NewAlarm returns a disarmed alarm that calls fire when it goes off.
// fire must not block.
func NewAlarm(fire func(arg int)) *Alarm { return &Alarm{fire: fire} }

// Arm makes the alarm go off after d, calling fire(arg), unless Disarm
// comes first.
func (a *Alarm) Arm(d time.Duration, arg int) {
	a.mu.Lock()
	// The timer is reused, so a ring cannot tell by itself which Arm it
	// belongs to: a ring of the previous sleep may still be on its way to
	// the mutex. Its time tells: the timer of this Arm, Reset below,
	// goes off on the same monotonic clock no sooner than due.
	a.armed, a.rang, a.due, a.arg = true, false, time.Now().Add(d), arg
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
	// Not before due: the ring of an earlier Arm, late. Once per Arm: a
	// late ring after due went off for it already.
	if a.armed && !a.rang && !time.Now().Before(a.due) {
		a.rang = true
		a.fire(a.arg)
	}
}
