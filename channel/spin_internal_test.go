package channel

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

func TestSpinWins(t *testing.T) {
	us := func(n int64) int64 { return n * int64(time.Microsecond) }
	for _, tc := range []struct {
		name        string
		spin, sleep int64
		want        bool
	}{
		{"no data yet", 0, 0, true},
		{"no sleeping wait yet", us(30), 0, true},
		{"no sleeping wait yet, long waits", int64(spinLong) + 1, 0, false},
		{"spinning saves more than a quarter", us(10), us(40), true},
		{"spinning saves less than a quarter", us(35), us(40), false},
		{"spinning costs more", us(60), us(40), false},
		{"long waits", int64(spinLong) + 1, us(100000), false},
		{"waits of spinLong", int64(spinLong), us(100000), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s spinStats
			s.spin.Store(tc.spin)
			s.sleep.Store(tc.sleep)
			if got := s.spinWins(); got != tc.want {
				t.Errorf("spin %v, sleep %v: spinWins %v, want %v", time.Duration(tc.spin), time.Duration(tc.sleep), got, tc.want)
			}
		})
	}
}

// TestSpinProbes: the way not chosen is tried at the probeMin-th wait,
// then at gaps that double up to probeMax; a probe that finds it better
// makes it the choice.
func TestSpinProbes(t *testing.T) {
	var s spinStats
	s.spin.Store(int64(time.Millisecond)) // sleeping wins
	s.sleep.Store(int64(50 * time.Microsecond))
	// waitOnce chooses for one wait and, for a probe, records d as its
	// duration, as done does; it returns the budget and whether it was
	// a probe.
	waitOnce := func(d time.Duration) (time.Duration, bool) {
		w := waiter{mode: SpinAdaptive}
		w.budget, w.probe = s.budget()
		if w.probe {
			record(&s.spin, d, probeShift)
			s.probed()
		} else {
			record(&s.sleep, 50*time.Microsecond, ewmaShift)
		}
		return w.budget, w.probe
	}
	var gaps []int
	last := 0
	for i := 1; len(gaps) < 8; i++ {
		budget, probe := waitOnce(time.Millisecond) // probes find spinning slow
		if probe != (budget > 0) {
			t.Fatalf("wait %d: budget %v, probe %v: only probes spin", i, budget, probe)
		}
		if budget != 0 && budget != spinCap {
			t.Fatalf("wait %d: budget %v, want 0 or %v", i, budget, spinCap)
		}
		if probe {
			gaps = append(gaps, i-last)
			last = i
		}
	}
	want := []int{probeMin + 1, probeMin, 2 * probeMin, 4 * probeMin, 8 * probeMin, 16 * probeMin, probeMax, probeMax}
	for i := range want {
		if gaps[i] != want[i] {
			t.Fatalf("waits between probes %v, want %v", gaps, want)
		}
	}
	// A probe that finds spinning fast makes it the choice: the
	// following waits spin, and probe sleeping every probeMax-th.
	for i := 0; ; i++ {
		if i > probeMax {
			t.Fatal("no probe within probeMax waits")
		}
		if _, probe := waitOnce(5 * time.Microsecond); probe {
			break
		}
	}
	if !s.spinWins() {
		t.Fatalf("a fast probe did not make spinning the choice: spin %v, sleep %v", time.Duration(s.spin.Load()), time.Duration(s.sleep.Load()))
	}
	spins := 0
	for range probeMax {
		if budget, _ := s.budget(); budget > 0 {
			spins++
		}
	}
	if spins != probeMax-1 {
		t.Errorf("%d of %d waits spin, want all but the probe", spins, probeMax)
	}
}

// TestSpinnerLimit: an adaptive wait does not spin while
// max(1, GOMAXPROCS-1) goroutines of the process spin.
func TestSpinnerLimit(t *testing.T) {
	limit := spinLimit()
	if want := int32(max(1, runtime.GOMAXPROCS(0)-1)); limit != want {
		t.Fatalf("spinLimit %d, want %d", limit, want)
	}
	spinners.Add(limit)
	var s spinStats // no data: spinning wins
	w := unhurried(newWaiter(SpinAdaptive))
	if w.spin(&s, time.Now()) {
		spinners.Add(-limit)
		t.Fatalf("a wait spins with %d spinners already", limit)
	}
	w.done(&s, true)
	spinners.Add(-limit)
	if !w.limited {
		t.Error("the wait is not marked as limited")
	}
	if s.spin.Load() != 0 || s.sleep.Load() != 0 {
		t.Error("a wait kept from spinning was recorded as a choice")
	}
	w = unhurried(newWaiter(SpinAdaptive))
	if !w.spin(&s, time.Now()) {
		t.Fatal("a wait does not spin with no spinners")
	}
	if got := spinners.Load(); got != 1 {
		t.Errorf("%d spinners while one waits, want 1", got)
	}
	w.done(&s, true)
	if got := spinners.Load(); got != 0 {
		t.Errorf("%d spinners after the wait, want 0", got)
	}
}

// unhurried starts w in the future, so that its spinning budget cannot
// run out between its creation and its first poll however the test is
// scheduled (the budget is microseconds).
func unhurried(w waiter) waiter {
	w.start = time.Now().Add(time.Hour)
	return w
}

// TestSpinModes: SpinPolls > 0 spins that many empty polls, SpinNever
// none, SpinAlways without end.
func TestSpinModes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mode  int
		spins int // -1: without end
	}{
		{"never", SpinNever, 0},
		{"negative", -7, 0},
		{"64 polls", 64, 64},
		{"always", SpinAlways, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts, err := Options{SpinPolls: tc.mode}.withDefaults()
			if err != nil {
				t.Fatal(err)
			}
			var s spinStats
			w := newWaiter(opts.SpinPolls)
			n := 0
			for n < 10000 && w.spin(&s, time.Now()) {
				n++
			}
			if tc.spins < 0 && n != 10000 || tc.spins >= 0 && n != tc.spins {
				t.Errorf("spun %d times, want %d (-1: without end)", n, tc.spins)
			}
			if w.spin(&s, time.Now()) && tc.spins >= 0 {
				t.Error("spins again after saying no")
			}
		})
	}
}

// TestAdaptiveWaitLearns: waits on a real channel feed the averages; waits
// that last 20 ms make sleeping the choice, so that a goroutine waiting
// for something far away does not burn a processor.
func TestAdaptiveWaitLearns(t *testing.T) {
	a, b := internalPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	mr, err := b.e.pd.Alloc(4096, verbs.AccessRemoteAll)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	amr, err := a.e.pd.Alloc(4096, verbs.AccessRemoteAll)
	if err != nil {
		t.Fatal(err)
	}
	defer amr.Close()
	sge, err := amr.SGE(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	// Receives that wait 20 ms each for their message.
	bsge, err := mr.SGE(0, 8)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		done := make(chan error, 1)
		go func() {
			time.Sleep(20 * time.Millisecond)
			done <- b.Send(ctx, bsge)
		}()
		if _, err := a.Receive(ctx, sge); err != nil {
			t.Fatalf("receive %d: %v", i, err)
		}
		if err := <-done; err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
	}
	if a.e.spin.spin.Load() == 0 && a.e.spin.sleep.Load() == 0 {
		t.Fatal("40 receives recorded nothing")
	}
	if a.e.spin.spinWins() {
		t.Errorf("after waits of 20 ms spinning still wins: spin %v, sleep %v",
			time.Duration(a.e.spin.spin.Load()), time.Duration(a.e.spin.sleep.Load()))
	}
	if budget, probe := a.e.spin.budget(); budget != 0 && !probe {
		t.Errorf("the next wait spins for %v", budget)
	}
}

// internalPair returns two connected channels with default options, each
// on its own device context.
func internalPair(t *testing.T) (a, b *Channel) {
	t.Helper()
	return internalPairWith(t, Options{})
}

// internalPairWith is internalPair with the options opts.
func internalPairWith(t *testing.T, opts Options) (a, b *Channel) {
	t.Helper()
	side := func() *Channel {
		c, err := New(softPD(t), opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	a, b = side(), side()
	ea, err := a.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	eb, err := b.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Connect(eb); err != nil {
		t.Fatal(err)
	}
	if err := b.Connect(ea); err != nil {
		t.Fatal(err)
	}
	return a, b
}

// softPD opens soft0 and allocates a protection domain, both closed when
// the test ends.
func softPD(t testing.TB) *verbs.ProtectionDomain {
	t.Helper()
	return verbstest.OpenPD(t, verbs.SoftDevice)
}
