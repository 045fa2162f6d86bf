package session

import (
	"context"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// sessionTasks returns the stacks of the goroutines of this process that
// a session or listener started for a while (reapers of cancelled
// requests, the agent's answers, revocations, lease timers, the
// listener's handshakes): those created by a function of this package
// (not of a test file), or running a lease timer's function. The long-lived ones
// of a session that is still open (the agent, the watcher, the bootstrap
// connection's reader, pinger and keepalive) are left out.
func sessionTasks() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	const pkg = "github.com/goverbs/verbs/session."
	live := []string{"establish", "newCtrl", "(*ctrl).startKeepalive"}
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		created, where := "", ""
		if i := strings.LastIndex(g, "\ncreated by "); i >= 0 {
			lines := strings.SplitN(g[i+1:], "\n", 3)
			created = strings.TrimPrefix(strings.SplitN(lines[0], " in goroutine", 2)[0], "created by ")
			if len(lines) > 1 {
				where = strings.SplitN(strings.TrimSpace(lines[1]), ":", 2)[0]
			}
		}
		task := strings.Contains(g, pkg+"(*Session).grantBytes.func")
		if fn, ok := strings.CutPrefix(created, pkg); ok && !strings.HasSuffix(where, "_test.go") {
			task = true
			for _, l := range live {
				if strings.HasPrefix(fn, l) {
					task = false
				}
			}
		}
		if task && !exiting(g) {
			out = append(out, g)
		}
	}
	return out
}

// exiting reports whether goroutine g (a stack of runtime.Stack) runs
// nothing but one of the functions whose last act is to tell a wait
// group they are done (the deferred Done), and so may be seen for a
// moment after the wait returned: it has nothing left to do but exit.
// (Such a function can be seen with no callee before it starts, too:
// but each is counted in its group before it is started.) A goroutine
// with no frame but the runtime's has returned from its function: it is
// exiting too.
func exiting(g string) bool {
	const pkg = "github.com/goverbs/verbs/session."
	tracked := []string{"(*Session).goTask.func", "(*Session).agentLoop(", "(*Session).watch(",
		"(*Session).grantBytes.func", "(*ctrl).readLoop(", "(*ctrl).pinger(", "(*ctrl).watch(",
		"(*ctrlListener).acceptLoop(", "(*ctrlListener).serve(", "(*ctrlListener).close.func", "(*cmListen).serve("}
	var frames []string
	for _, l := range strings.Split(g, "\n")[1:] {
		if l == "" || strings.HasPrefix(l, "\t") || strings.HasPrefix(l, "created by ") {
			continue
		}
		// The runtime's frames, and the deferred Done itself (seen
		// inside it, after the wait it released returned).
		if !strings.HasPrefix(l, "runtime.") && !strings.HasPrefix(l, "sync.(*WaitGroup).") {
			frames = append(frames, l)
		}
	}
	if len(frames) == 0 {
		// Past its function, in runtime.goexit1: its Done ran (the CI
		// rehearsal of 2026-11-26 caught one there).
		return true
	}
	if len(frames) != 1 {
		return false
	}
	for _, f := range tracked {
		if strings.HasPrefix(frames[0], pkg+f) {
			return true
		}
	}
	return false
}

// TestCloseWaitsForGoroutines closes a session while it is busy with
// work that runs in goroutines of its own (reapers of requests whose
// calls were cancelled, answers of its agent to a peer that requests
// and releases memory in a loop, lease timers), half of the rounds after
// the peer's bootstrap connection broke (Close then does not linger on a
// bye): when Close returns, none of them may be left. (Before Close
// waited for them, some were, and one that read the credit word of the
// unmapped control block crashed the process.) The peer's own such
// goroutines (its agent's answers to the offers of the setup) are done
// before the work starts, so every one the check sees is the closed
// session's. Then a Listener with handshakes in progress is closed: none
// of its goroutines may be left either.
func TestCloseWaitsForGoroutines(t *testing.T) {
	t.Run("session", func(t *testing.T) {
		const rounds = 64
		leftover := 0
		for round := range rounds {
			leftover += closeBusy(t, round%2 == 1, round < 2)
			if t.Failed() {
				break
			}
		}
		if leftover > 0 {
			t.Errorf("%d goroutines of closed sessions were still running when Close returned (over %d rounds)", leftover, rounds)
		}
	})
	t.Run("listener", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		l, err := Listen(ctx, "127.0.0.1:0", Config{Token: []byte("secret")})
		if err != nil {
			t.Fatal(err)
		}
		// Strangers in the middle of their handshakes: connected, and
		// silent, or sending part of a hello.
		var conns []net.Conn
		for i := range 8 {
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			if i%2 == 1 {
				c.Write([]byte{1, 0})
			}
			conns = append(conns, c)
		}
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		// A peer that authenticated and waits for Accept.
		dctx, dcancel := context.WithCancel(ctx)
		dialed := make(chan struct{})
		go func() {
			defer close(dialed)
			if s, err := Dial(dctx, l.Addr().String(), Config{Token: []byte("secret")}); err == nil {
				s.Close()
			}
		}()
		time.Sleep(100 * time.Millisecond) // let the handshakes start (no assertion depends on it)
		l.Close()
		// (Its connections' readers and pingers are left out: they
		// cannot be told from those of the dialer in this process.)
		if g := sessionTasks(); len(g) > 0 {
			t.Errorf("%d goroutines of the listener left after Close:\n%s", len(g), strings.Join(g, "\n\n"))
		}
		dcancel()
		<-dialed
	})
}

// closeBusy sets up a pair, makes side a busy, closes it (after the
// peer's bootstrap connection broke, if abrupt: then Close has no bye to
// linger on) and returns how many of its goroutines were left when Close
// returned. With leases, lease timers of a's fire around Close too.
func closeBusy(t *testing.T, abrupt, leases bool) int {
	a, b := pair(t, Config{Lease: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A region of b's that a may write.
	bm, err := b.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer bm.Free()
	if _, err := b.SendLocalMR(ctx, bm, verbs.AccessRemoteWrite, 0); err != nil {
		t.Fatal(err)
	}
	r, err := a.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	src, err := a.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	// Lease timers of a's that fire around Close (leaseGrace after
	// their leases, 1 to 8 ms).
	for i := range 8 {
		if !leases {
			break
		}
		m, err := a.Alloc(64)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.SendLocalMR(ctx, m, verbs.AccessRemoteRead, time.Duration(i+1)*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if _, err := b.ReceiveRemoteMR(ctx); err != nil {
			t.Fatal(err)
		}
	}
	stop, stopWrites := make(chan struct{}), make(chan struct{})
	var wg, writers sync.WaitGroup
	for range 6 {
		wg.Add(1)
		writers.Add(1)
		// a: writes whose calls are cancelled once posted (a reaper
		// each).
		go func() {
			defer writers.Done()
			gone, cancelled := context.WithCancel(ctx)
			cancelled()
			for {
				select {
				case <-stopWrites:
					return
				default:
				}
				a.Write(gone, r.All(), src.All())
				if a.Err() != nil {
					return
				}
			}
		}()
		// b: requests and releases of a's memory (a's agent answers
		// each in a goroutine).
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				rm, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteRead, 0)
				if err != nil {
					return
				}
				if rm.Release(ctx) != nil {
					return
				}
			}
		}()
	}
	// Amid the timers, or once the work started (no assertion depends
	// on it).
	if leases {
		time.Sleep(leaseGrace + 4*time.Millisecond)
	} else {
		time.Sleep(10 * time.Millisecond)
	}
	// a's callers stop before its Close (a call racing Close may meet
	// its memory unmapped: not what this test is about); the reapers of
	// their last writes may still run.
	close(stopWrites)
	writers.Wait()
	if abrupt {
		// b's bootstrap connection breaks (as if b's process died): a
		// ends by itself, and its Close has no bye to linger on.
		b.ctl.raw.Close()
		<-a.Done()
	}
	a.Close()
	left := sessionTasks()
	close(stop)
	wg.Wait()
	if len(left) > 0 {
		t.Logf("left after Close:\n%s", strings.Join(left, "\n\n"))
	}
	b.Close()
	return len(left)
}

// TestCloseConcurrent has two goroutines close a session at once: when
// either Close returns, the session must be torn down (the package doc:
// every goroutine it started has ended; regions of its allocator are
// invalid), whichever of them does the work. Before, the Close that came
// second returned at once, while the first was still tearing down (its
// caller saw its regions valid, the allocator open).
func TestCloseConcurrent(t *testing.T) {
	const rounds = 20
	for round := range rounds {
		a, _ := pair(t, Config{})
		m, err := a.Alloc(64)
		if err != nil {
			t.Fatal(err)
		}
		start := make(chan struct{})
		valid := make(chan bool, 2)
		for range 2 {
			go func() {
				<-start
				a.Close()
				valid <- m.Valid()
			}()
		}
		close(start)
		for range 2 {
			if <-valid {
				t.Fatalf("round %d: a Close returned with a region of the session's allocator still valid (the other Close was still tearing the session down)", round)
			}
		}
	}
}
