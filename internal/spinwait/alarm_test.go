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
