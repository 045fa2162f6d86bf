package bells

import "testing"

// TestBook walks one writer's books through a peer's sleeps: a bell is
// owed for an odd word it has not rung for, again after each write since
// it rang, never for an even (awake) word, and the sleep and awake
// numbers alternate odd and even.
func TestBook(t *testing.T) {
	b := New(3)
	steps := []struct {
		name  string
		do    func()
		peer  int
		word  uint64
		owes  bool
		wrote []int
	}{
		{"nothing written, awake", func() {}, 1, 0, false, nil},
		{"written, peer awake", func() { b.Wrote(1) }, 1, 2, false, []int{1}},
		{"peer sleeps", func() {}, 1, 3, true, []int{1}},
		{"rung for it", func() { b.Rang(1, 3) }, 1, 3, false, []int{1}},
		{"written again, same sleep", func() { b.Wrote(1) }, 1, 3, true, []int{1}},
		{"rung again", func() { b.Rang(1, 3) }, 1, 3, false, []int{1}},
		{"a new sleep, nothing written since", func() {}, 1, 5, true, []int{1}},
		{"other peer, never written", func() { b.Rang(1, 5) }, 2, 7, true, []int{1}},
		{"call ends", func() { b.Forget() }, 1, 5, false, nil},
		{"written after the call", func() { b.Wrote(2); b.Wrote(2) }, 2, 6, false, []int{2}},
	}
	for _, s := range steps {
		s.do()
		if got := b.Owes(s.peer, s.word); got != s.owes {
			t.Errorf("%s: Owes(%d, %d) = %v, want %v", s.name, s.peer, s.word, got, s.owes)
		}
		if got := b.WroteTo(); len(got) != len(s.wrote) || len(got) > 0 && got[0] != s.wrote[0] {
			t.Errorf("%s: WroteTo %v, want %v", s.name, got, s.wrote)
		}
	}
	if v, to := b.Awake(); v != 0 || to != nil {
		t.Errorf("Awake with nobody told: %d %v", v, to)
	}
	for i := range 3 {
		s := b.NextSleep()
		if s%2 != 1 {
			t.Fatalf("sleep %d numbered %d: not odd", i, s)
		}
		if b.Telling(0) {
			t.Fatalf("sleep %d: peer 0 told before Told", i)
		}
		b.Told(0)
		b.Told(0)
		if !b.Telling(0) {
			t.Fatalf("sleep %d: peer 0 not told after Told", i)
		}
		a, to := b.Awake()
		if a != s+1 || len(to) != 1 || to[0] != 0 {
			t.Fatalf("sleep %d (%d): Awake %d %v, want %d [0]", i, s, a, to, s+1)
		}
		if b.Telling(0) {
			t.Fatalf("sleep %d: peer 0 still told after Awake", i)
		}
	}
	if got := b.Sleeps(); got != 3 {
		t.Errorf("Sleeps %d, want 3", got)
	}
}
