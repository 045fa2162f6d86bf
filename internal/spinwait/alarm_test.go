package spinwait

import (
	"testing"
	"time"
)

// TestAlarm: an armed alarm goes off once, counted, calling fire with
// its argument; a disarmed one does not call fire (a sleep that ended
// must not see it).
func TestAlarm(t *testing.T) {
	got := make(chan int, 4)
	a := NewAlarm(func(arg int) { got <- arg })
	a.Arm(time.Millisecond, 7)
	if arg := <-got; arg != 7 {
		t.Fatalf("fire(%d), want fire(7)", arg)
	}
	for a.Fired() != 1 {
		time.Sleep(time.Millisecond)
	}
	a.Disarm()
	a.Arm(time.Hour, 8)
	a.Disarm()
	a.ring() // as if the timer went off after Disarm
	select {
	case arg := <-got:
		t.Fatalf("fire(%d) after Disarm", arg)
	default:
	}
	if a.Fired() != 2 {
		t.Fatalf("fired %d times, want 2", a.Fired())
	}
}

// TestAlarmStaleRingDoesNotFireNextSleep guards the next sleep against
// the ring of the previous one: the timer of a sleep that ended goes off
// (its ring started) just as Disarm stops it, and the sleeper arms the
// alarm for its next sleep before that ring takes the mutex (simulated
// as TestAlarm does, by calling ring). Before, ring checked only that
// the alarm was armed, so the stale ring called fire for the new sleep
// at once, not after d, and the new sleep's own timer went off again
// later.
func TestAlarmStaleRingDoesNotFireNextSleep(t *testing.T) {
	got := make(chan int, 4)
	a := NewAlarm(func(arg int) { got <- arg })
	a.Arm(time.Hour, 1) // sleep 1
	a.Disarm()          // sleep 1 ends; its timer's ring is (as if) already running
	a.Arm(time.Hour, 2) // sleep 2: should not go off for an hour
	defer a.Disarm()
	a.ring() // the stale ring of sleep 1 reaches the mutex now
	select {
	case arg := <-got:
		t.Fatalf("fire(%d) ran at once in a sleep armed for an hour (a ring of the previous sleep); fired %d", arg, a.Fired())
	default:
	}
	if a.Fired() != 1 { // the stale ring went off, for sleep 1
		t.Fatalf("fired %d times, want 1", a.Fired())
	}
}
