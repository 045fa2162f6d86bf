package soft

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// drivesNow sums the drives of the process' connections (drive.go).
func drivesNow() uint64 { return sumConns(func(c *conn) uint64 { return c.drives.Load() }) }

// polledNow sums the frames that polls handled on the process'
// connections.
func polledNow() uint64 { return sumConns(func(c *conn) uint64 { return c.polled.Load() }) }

// sumConns sums f over the process' connections.
func sumConns(f func(*conn) uint64) uint64 {
	s := getFabric().svc.Load()
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var n uint64
	for c := range s.conns {
		n += f(c)
	}
	return n
}

// waitDrive waits until a drive began since the count before.
func waitDrive(t *testing.T, before uint64) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for drivesNow() == before {
		if time.Now().After(deadline) {
			t.Fatal("no wait drove the connection")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// awaitErrIs waits for the error from done, failing t unless it matches
// want, or if none comes within hangGuard (what did not return).
func awaitErrIs(t *testing.T, done <-chan error, want error, what string) {
	t.Helper()
	select {
	case err := <-done:
		if !errors.Is(err, want) {
			t.Fatalf("%s: %v, want %v", what, err, want)
		}
	case <-time.After(hangGuard):
		t.Fatalf("%s did not return", what)
	}
}

// awaitNil waits for the error from done, failing t if it is not nil, or
// with hang if none comes within hangGuard.
func awaitNil(t *testing.T, done <-chan error, hang string) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(hangGuard):
		t.Fatal(hang)
	}
}

// drivePair is two RC QPs of one process connected through a socket of
// kind, each with its CQ and completion channel, and registered memory.
type drivePair struct {
	e        *env
	qa, qb   prov.QP
	cqa, cqb prov.CQ
	cha, chb prov.CompChannel
	m        *buf
}

func newDrivePair(t *testing.T, kind string) *drivePair {
	forceTransport(t, kind)
	forceTLS(t, tlsOff)
	p := &drivePair{e: newEnv(t)}
	p.qa, p.cqa, p.cha = xprocSide(t, p.e)
	p.qb, p.cqb, p.chb = xprocSide(t, p.e)
	connectOne(t, p.qa, p.qb, prov.QPTypeRC, defaultConn())
	connectOne(t, p.qb, p.qa, prov.QPTypeRC, defaultConn())
	p.m = p.e.alloc(8192, allAccess)
	return p
}

// sendOne sends 8 bytes from a to b and waits, sleeping in the channels,
// for b's receive and a's send.
func (p *drivePair) sendOne(t *testing.T) {
	var dst [4]prov.Completion
	if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	waitCQ(t, p.cqb, p.chb, dst[:], 1)
	waitCQ(t, p.cqa, p.cha, dst[:], 1)
	// waitCQ leaves an event on a channel when the completion came
	// between its arm and its second poll (the CQ fires as it takes the
	// completion in): taken, so that the next Wait waits. Left, a Wait
	// the test meant to drive the connection returned at once, and the
	// test waited for a drive that never came (TestDrivePlacesAcrossWaits
	// and TestDriveShmStaleWant under load).
	takeEvents(p.cha)
	takeEvents(p.chb)
}

// armedDriveConn sends a message from a to b (the CQs learn their
// connections), arms b's CQ and returns b's channel and the connection a
// Wait on it would drive.
func (p *drivePair) armedDriveConn(t *testing.T) (*compChannel, *conn) {
	t.Helper()
	p.sendOne(t)
	if err := p.cqb.Arm(false); err != nil {
		t.Fatal(err)
	}
	ch := p.chb.(*compChannel)
	c := ch.driveConn()
	if c == nil {
		t.Fatal("no connection to drive (one peer process)")
	}
	return ch, c
}

// takeEvents takes the events queued on ch without waiting.
func takeEvents(ch prov.CompChannel) {
	for ch.(*compChannel).takeEvent() != nil {
	}
}

// drivenWait sends a message from a to b, arms b's CQ and starts a Wait
// on b's channel with ctx, whose result goes to done, once the wait
// drives the connection; before is the count of drives before it.
func (p *drivePair) drivenWait(t *testing.T, ctx context.Context) (done chan error, before uint64) {
	p.sendOne(t)
	if err := p.cqb.Arm(false); err != nil {
		t.Fatal(err)
	}
	before = drivesNow()
	done = make(chan error, 1)
	go func() {
		_, err := p.chb.Wait(ctx)
		done <- err
	}()
	waitDrive(t, before)
	return done, before
}

// TestWaitDrivesSocket: an application that sleeps in its completion
// channel reads the socket itself (most of its waits drive the
// connection), and the messages arrive whole. (In one process, polls
// consume a shared-memory ring before any wait: TestDriveShmWakes.)
func TestWaitDrivesSocket(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			f := sendPingPong(t, p.e, p.qa, p.qb, [2]prov.CQ{p.cqa, p.cqb}, [2]prov.CompChannel{p.cha, p.chb}, false)
			before := drivesNow()
			// Each round waits three times; a wait that finds its
			// completion polling does not drive (under load, when the
			// reader was quicker, many do not: TestDriveLooksAgain saw
			// none in 20 rounds in a CI run), so at least 200 rounds,
			// and up to 5000 until one drove.
			rounds := 0
			for ; rounds < 200 || rounds < 5000 && drivesNow() == before; rounds++ {
				f()
			}
			d := drivesNow() - before
			t.Logf("%d drives in %d rounds", d, rounds)
			if d == 0 {
				t.Errorf("no drive in %d rounds: the waits left the socket to the reader", rounds)
			}
		})
	}
}

// TestDriveLooksAgain: a drive that had to wait for its bytes makes the
// next drive wait on the socket at once (it listens), but one whose bytes
// were there when it read makes the next look first, without listening:
// a socket that listens wakes the runtime's poller with every segment.
// Before, one drive that waited made every later one listen.
func TestDriveLooksAgain(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			// A drive that waits: nothing has come when it starts.
			done, _ := p.drivenWait(t, context.Background())
			p.endWait(t, done)
			// Then messages that are there before b waits for them.
			if err := p.cqb.Arm(false); err != nil {
				t.Fatal(err)
			}
			c := p.chb.(*compChannel).driveConn() // b's
			if c == nil {
				t.Fatal("no connection to drive")
			}
			// A wait that finds its completion polling does not drive
			// (under load the reader is often quicker: a CI run had no
			// drive in 20 rounds), so messages go until a drive looked
			// first, or many rounds had drives and none did.
			before, drives := c.looked.Load(), c.drives.Load()
			const maxRounds = 2000
			rounds := 0
			for ; rounds < maxRounds && c.looked.Load() == before; rounds++ {
				p.sendOne(t)
			}
			d := c.drives.Load() - drives
			t.Logf("%d rounds, %d drives of b's connection, %d looked first and found their bytes", rounds, d, c.looked.Load()-before)
			if d == 0 {
				t.Fatalf("%d messages, and no wait drove b's connection", rounds)
			}
			if c.looked.Load() == before {
				t.Errorf("%d messages there before their waits, %d drives, and none looked for them first: every drive listened", rounds, d)
			}
		})
	}
}

// TestDriveHandsBack: after a wait drove the connection, the application
// stops waiting; the reader takes the socket back, and the peer's RDMA
// reads of the application's memory are answered.
func TestDriveHandsBack(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			// Until a wait drives the connection (a wait finds its
			// completion polling when the reader was quicker).
			before := drivesNow()
			for i := 0; drivesNow() == before; i++ {
				if i == 1000 {
					t.Fatal("1000 exchanges, and no wait drove the connection")
				}
				p.sendOne(t)
			}
			// b neither waits nor polls from now on: its reader
			// answers a's reads.
			var dst [4]prov.Completion
			for i := range 50 {
				want := fmt.Sprintf("read %4d", i)
				copy(p.m.b[4096:], want)
				wr := []prov.SendWR{{Opcode: prov.WRRead, NumSGE: 1, Flags: prov.SendSignaled,
					RemoteAddr: p.m.mr.Addr() + 4096, RKey: p.m.mr.RKey()}}
				if _, err := p.qa.PostSend(wr, []prov.SGE{p.m.sge(0, len(want))}); err != nil {
					t.Fatal(err)
				}
				waitCQ(t, p.cqa, p.cha, dst[:], 1)
				if got := string(p.m.b[:len(want)]); got != want {
					t.Fatalf("read %q, want %q", got, want)
				}
			}
		})
	}
}

// TestDriveEndsForOtherEvents: a wait drives the connection of the CQ
// armed last; an event of another CQ of its channel, fed by another
// connection, ends it, however long a drive may last.
func TestDriveEndsForOtherEvents(t *testing.T) {
	defer func(d time.Duration) { driveMax = d }(driveMax)
	driveMax = time.Hour
	for _, kind := range []string{"tcp", "unix", "shm"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			p.sendOne(t) // b's CQ is fed by b's end of the connection
			// A second CQ on b's channel, fed by a's end: the send
			// completions of a QP of a's side.
			cq2 := must(p.e.ctx.CreateCQ(16, p.chb, 0))
			t.Cleanup(func() { cq2.Close() })
			caps := defaultCaps()
			q2 := must(p.e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq2, RecvCQ: cq2, Cap: caps}))
			t.Cleanup(func() { q2.Close() })
			q3, _, _ := xprocSide(t, p.e)
			connectOne(t, q2, q3, prov.QPTypeRC, defaultConn())
			connectOne(t, q3, q2, prov.QPTypeRC, defaultConn())

			if err := cq2.Arm(false); err != nil {
				t.Fatal(err)
			}
			if err := p.cqb.Arm(false); err != nil { // armed last: driven
				t.Fatal(err)
			}
			got := make(chan prov.CQ, 1)
			before := drivesNow()
			go func() {
				q, err := p.chb.Wait(context.Background())
				if err != nil {
					t.Error(err)
				}
				got <- q
			}()
			// The wait drives b's end before the event exists.
			waitDrive(t, before)
			wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
				RemoteAddr: p.m.mr.Addr() + 4096, RKey: p.m.mr.RKey()}}
			if _, err := q2.PostSend(wr, []prov.SGE{p.m.sge(0, 8)}); err != nil {
				t.Fatal(err)
			}
			select {
			case q := <-got:
				if q != cq2 {
					t.Fatalf("event of %v, want the second CQ", q)
				}
			case <-time.After(hangGuard):
				t.Fatal("the wait did not end")
			}
		})
	}
}

// TestDriveHonoursContext: a wait that drives the connection ends when
// its ctx does.
func TestDriveHonoursContext(t *testing.T) {
	for _, kind := range []string{"tcp", "unix", "shm"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			ctx, cancel := context.WithCancel(context.Background())
			done, _ := p.drivenWait(t, ctx)
			cancel()
			awaitErrIs(t, done, context.Canceled, "the wait")
			// The connection works on: the reader took it back.
			p.sendOne(t)
		})
	}
}

// TestDriveEndsAtWake: Wake ends a Wait that drives the connection with
// ErrWoken, whether its ctx can end (the drive has a read deadline of its
// own, which the wake must not undo) or not; the next Wait is not woken
// again, and the connection works on. Wake ends a Wait that sleeps in the
// channel too, and one Wake before a Wait ends that Wait at once.
func TestDriveEndsAtWake(t *testing.T) {
	defer func(d time.Duration) { driveMax = d }(driveMax)
	driveMax = time.Hour // a drive that ignored the wake would outlast hangGuard
	for _, kind := range []string{"tcp", "unix", "shm"} {
		for _, cancelable := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/cancelable=%v", kind, cancelable), func(t *testing.T) {
				p := newDrivePair(t, kind)
				ctx := context.Background()
				if cancelable {
					var cancel context.CancelFunc
					ctx, cancel = context.WithCancel(ctx)
					defer cancel()
				}
				done, _ := p.drivenWait(t, ctx)
				p.chb.Wake()
				awaitErrIs(t, done, prov.ErrWoken, "the wait Wake ends")
				// Woken once: a Wait after it waits (until its ctx
				// ends).
				short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				_, err := p.chb.Wait(short)
				cancel()
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("a Wait after the woken one: %v, want DeadlineExceeded", err)
				}
				// A Wake before a Wait (twice: one wake) ends it at once.
				p.chb.Wake()
				p.chb.Wake()
				if _, err := p.chb.Wait(context.Background()); !errors.Is(err, prov.ErrWoken) {
					t.Fatalf("a Wait after Wake: %v, want ErrWoken", err)
				}
				// The connection works on.
				p.sendOne(t)
			})
		}
	}
}

// TestDriveEndsAtClose: a wait whose ctx cannot end drives without a
// read deadline (none ends it every driveMax, as one that can end is);
// closing its channel ends it. Before, every drive set a deadline before
// its wait and cleared it after, a tenth of a sleeping round trip's
// processor time.
func TestDriveEndsAtClose(t *testing.T) {
	defer func(d time.Duration) { driveMax = d }(driveMax)
	driveMax = time.Millisecond // a deadline, if one were set, would end the drive at once
	for _, kind := range []string{"tcp", "unix", "shm"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			done, before := p.drivenWait(t, context.Background())
			// Many driveMax later the same drive goes on: no deadline
			// ended it (a drive that ends is followed by the reader,
			// and the wait sleeps in the channel without driving).
			time.Sleep(50 * driveMax)
			if kind != "shm" {
				// (A drive of a ring gives it back at once to a
				// reader that sleeps on its eventfd, and the wait
				// sleeps in the channel: TestDriveShmFails.)
				if n := drivesNow(); n != before+1 {
					t.Errorf("%d drives since the wait began, want 1", n-before)
				}
				c := p.qb.(*qp).x.rev.Load()
				if c == nil {
					c = p.qa.(*qp).x.rev.Load()
				}
				if c == nil || c.driveOn.Load() != driveNow {
					t.Fatal("the wait no longer drives the connection")
				}
			}
			for _, cl := range []interface{ Close() error }{p.qb, p.cqb, p.chb} {
				if err := cl.Close(); err != nil {
					t.Fatal(err)
				}
			}
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("the wait on a closed channel returned no error")
				}
			case <-time.After(hangGuard):
				t.Fatal("closing the channel did not end the wait")
			}
		})
	}
}

// TestDriveOnePeerOnly: a Wait drives a connection only while the
// process talks to one peer process; with connections to several, the
// readers keep them all (the event may come on any).
func TestDriveOnePeerOnly(t *testing.T) {
	p := newDrivePair(t, "unix")
	ch, c := p.armedDriveConn(t)
	s := c.s
	saved := s.pc.list.Load()
	t.Cleanup(func() { s.pc.list.Store(saved) })
	for _, tc := range []struct {
		name  string
		list  []*conn
		drive bool
	}{
		{"one connection", []*conn{c}, true},
		{"two ends of one peer", []*conn{c, {peerFab: c.peerFab}}, true},
		{"two peers", []*conn{c, {peerFab: c.peerFab + 1}}, false},
		{"three connections", []*conn{c, {peerFab: c.peerFab}, {peerFab: c.peerFab}}, false},
	} {
		l := tc.list
		s.pc.list.Store(&l)
		if got := ch.driveConn() != nil; got != tc.drive {
			t.Errorf("%s: drives %v, want %v", tc.name, got, tc.drive)
		}
	}
}

// TestPollEndsReaderWait: an application that spins on its CQ (polls,
// yielding to its own goroutines) while the connection's reader waits on
// the socket takes its messages in itself: the poll ends the reader's
// wait, and the reader leaves the socket to the polls. Before, the
// reader held the socket until the runtime's network poller ran, which a
// process whose goroutines only yield to each other checks every 10 ms
// (a 4-rank barrier over unix sockets took 1.1 ms, every wait spinning).
func TestPollEndsReaderWait(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			p.sendOne(t)
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
			var dst [4]prov.Completion
			const rounds = 20
			byPolls := 0
			for range rounds {
				// The readers go back to waiting on their sockets.
				time.Sleep(2 * time.Millisecond)
				before := polledNow()
				if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
					t.Fatal(err)
				}
				if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
					t.Fatal(err)
				}
				deadline := time.Now().Add(hangGuard)
				for {
					n, err := p.cqb.Poll(dst[:])
					if err != nil {
						t.Fatal(err)
					}
					if n > 0 {
						if dst[0].Status != prov.StatusSuccess {
							t.Fatalf("%+v", dst[0])
						}
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("no receive completion")
					}
					runtime.Gosched()
				}
				if polledNow() != before {
					byPolls++
				}
			}
			// The reader may be between its waits when a round begins (on
			// a loaded machine, after the 2 ms) and take the message in
			// itself; before, it did in every round.
			t.Logf("the polls took the message in %d rounds of %d", byPolls, rounds)
			if byPolls < rounds/2 {
				t.Fatalf("the polls took the message in %d rounds of %d, the reader in the others", byPolls, rounds)
			}
		})
	}
}

// endWait sends a message from a to b, which ends the wait on b's
// channel whose result comes to done, and takes both completions.
func (p *drivePair) endWait(t *testing.T, done chan error) {
	t.Helper()
	if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var dst [4]prov.Completion
	waitCQ(t, p.cqb, p.chb, dst[:], 1)
	waitCQ(t, p.cqa, p.cha, dst[:], 1)
}

// drivenSleep starts a Wait on b's channel (after a message from a to b,
// b's CQ armed) and returns once it sleeps on the eventfd of b's
// shared-memory ring itself (driveShm), with the connection. A drive
// that finds the reader asleep there gives the ring back to it, so it
// tries again after another message, until one sleeps.
func (p *drivePair) drivenSleep(t *testing.T) (done chan error, c *conn) {
	t.Helper()
	for try := 0; try < 200; try++ {
		done, _ = p.drivenWait(t, context.Background())
		c = p.chb.(*compChannel).drv.Load()
		deadline := time.Now().Add(20 * time.Millisecond)
		for c != nil && time.Now().Before(deadline) {
			c.dlMu.Lock()
			sleeping := c.driver != nil
			c.dlMu.Unlock()
			if sleeping {
				return done, c
			}
			time.Sleep(100 * time.Microsecond)
			c = p.chb.(*compChannel).drv.Load()
		}
		p.endWait(t, done) // this wait does not drive: a message ends it
	}
	t.Fatal("no wait slept on the ring's eventfd in 200 tries")
	return nil, nil
}

// TestDriveShmWakes: a wait that sleeps on the eventfd of the ring it
// drives is woken by the peer's message, and returns its event.
func TestDriveShmWakes(t *testing.T) {
	p := newDrivePair(t, "shm")
	done, _ := p.drivenSleep(t)
	if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
		t.Fatal(err)
	}
	copy(p.m.b[:8], "woken up")
	if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	awaitNil(t, done, "the message did not wake the driving wait")
	var dst [4]prov.Completion
	waitCQ(t, p.cqb, p.chb, dst[:], 1)
	if dst[0].Status != prov.StatusSuccess || string(p.m.b[1024:1032]) != "woken up" {
		t.Fatalf("completion %+v, bytes %q", dst[0], p.m.b[1024:1032])
	}
}

// TestDriveShmFails: the connection fails (its peer went: watchSocket's
// failAfterDrain) while a wait sleeps on the eventfd of the ring it
// drives, holding the ring: the failure ends that wait before it takes
// the ring, so it neither waits for the wait nor the wait for a signal
// that cannot come; the posted receive is flushed and its event ends the
// wait.
func TestDriveShmFails(t *testing.T) {
	p := newDrivePair(t, "shm")
	if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
		t.Fatal(err)
	}
	p.sendOne(t) // takes that receive; sendOne posts its own
	done, c := p.drivenSleep(t)
	if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(2048, 8)}); err != nil {
		t.Fatal(err)
	}
	failed := make(chan struct{})
	go func() {
		c.failAfterDrain(errors.New("test: the peer went"))
		close(failed)
	}()
	select {
	case <-failed:
	case <-time.After(hangGuard):
		t.Fatal("failAfterDrain waited for the driving wait")
	}
	awaitNil(t, done, "the failure did not end the driving wait")
}

// TestDriveShmHandsBack: after a wait that drove the ring got its event,
// the application neither waits nor polls: its reader, aside meanwhile,
// takes the ring back and sleeps on the eventfd again (where the peer's
// next message wakes it), within two pollerGrace.
func TestDriveShmHandsBack(t *testing.T) {
	p := newDrivePair(t, "shm")
	done, c := p.drivenSleep(t)
	p.endWait(t, done)
	deadline := time.Now().Add(hangGuard)
	for c.driveOn.Load() != driveNone || !c.efdSleeping.Load() {
		if time.Now().After(deadline) {
			t.Fatalf("the reader did not take the ring back (driveOn %d, reader on the eventfd %v)", c.driveOn.Load(), c.efdSleeping.Load())
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// TestDriveShmStaleWant: a Wait that found the ring's consumer at work
// asked the reader for the ring (wantDrive); when the Wait then returns
// without it (its event came from that consumer, or its context ended),
// it takes the request back. Before, the request stayed, and a reader
// that later consumed the ring stepped aside for nobody at its next frame,
// leaving the ring to the next Wait or poll (up to two pollerGraces).
func TestDriveShmStaleWant(t *testing.T) {
	for _, end := range []string{"event", "context"} {
		t.Run(end, func(t *testing.T) {
			p := newDrivePair(t, "shm")
			p.sendOne(t)
			c := revConn(t, p.qb)
			ch := p.chb.(*compChannel)
			if _, err := p.qb.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
				t.Fatal(err)
			}
			// The test is the ring's consumer at work.
			c.rmu.Lock()
			locked := true
			defer func() {
				if locked {
					c.rmu.Unlock()
				}
			}()
			if err := p.cqb.Arm(false); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := p.chb.Wait(ctx)
				done <- err
			}()
			for deadline := time.Now().Add(hangGuard); c.wantDrive.Load() != ch; time.Sleep(50 * time.Microsecond) {
				if time.Now().After(deadline) {
					t.Fatal("the Wait did not ask for the ring")
				}
			}
			if end == "event" {
				if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
					t.Fatal(err)
				}
				// The consumer delivers the message; its completion
				// ends the Wait.
				for deadline := time.Now().Add(hangGuard); ; {
					n, err := c.drain(false)
					if err != nil {
						t.Fatal(err)
					}
					if n > 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the message did not come")
					}
				}
				c.flushResps()
			} else {
				cancel()
			}
			select {
			case err := <-done:
				if end == "event" && err != nil {
					t.Fatal(err)
				}
				if end == "context" && !errors.Is(err, context.Canceled) {
					t.Fatalf("Wait returned %v, want context.Canceled", err)
				}
			case <-time.After(hangGuard):
				t.Fatal("the Wait did not return")
			}
			if w := c.wantDrive.Load(); w != nil {
				t.Errorf("the Wait returned and left its request for the ring (wantDrive %p)", w)
			}
			c.rmu.Unlock()
			locked = false
			var dst [4]prov.Completion
			if end == "event" {
				waitCQ(t, p.cqb, p.chb, dst[:], 1)
				waitCQ(t, p.cqa, p.cha, dst[:], 1)
			}
		})
	}
}

// TestDriveHandlesBuffered: a Wait that drives a socket first handles
// the frames the last consumer read into the buffer but left there (the
// reader hands the socket over between its read and its drain when a
// Wait takes rmu first). Before, the drive waited on the socket with a
// request in the buffer: nothing more came, the requester retried until
// RETRY_EXC_ERR and its peer waited forever for the message (a loaded
// machine, one sleeping ping-pong in thousands: TestXprocNoAllocs). The
// test takes both ends' sockets as a poll does, reads the request in
// without handling it, and drives with a deadline shorter than any
// retransmission.
func TestDriveHandlesBuffered(t *testing.T) {
	p := newDrivePair(t, "tcp")
	p.sendOne(t) // sets the connection up
	held := takeSockets(t)
	conns := held.conns
	if _, err := p.qb.PostRecv([]prov.RecvWR{{WRID: 7, NumSGE: 1}}, []prov.SGE{p.m.sge(1024, 8)}); err != nil {
		t.Fatal(err)
	}
	p.m.b[0] = 0x5a
	if _, err := p.qa.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{p.m.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	var in *conn // the end the request arrived at, read in and not handled
	deadline := time.Now().Add(hangGuard)
	for in == nil {
		for _, c := range conns {
			if err := c.sock.fill(); err != nil {
				t.Fatal(err)
			}
			if c.sock.w-c.sock.r >= hdrLen+reqBodyLen+8 {
				in = c
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the request did not arrive")
		}
	}
	for _, c := range conns {
		if c != in {
			held.release(c)
		}
	}
	if err := p.cqb.Arm(false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	held.handOver(in) // driveLocked releases it
	ev := p.chb.(*compChannel).driveLocked(ctx, in)
	if ev != p.cqb {
		t.Fatalf("the drive returned %v, want the event of b's CQ (the buffered request not handled)", ev)
	}
	var cs [1]prov.Completion
	if n, err := p.cqb.Poll(cs[:]); err != nil || n != 1 || cs[0].Status != prov.StatusSuccess || cs[0].WRID != 7 || p.m.b[1024] != 0x5a {
		t.Fatalf("b's receive: %d %v %+v, byte %#x", n, err, cs[0], p.m.b[1024])
	}
	waitCQ(t, p.cqa, p.cha, cs[:], 1)
}

// (Found by a review of soft0's waits, each of the three below failed
// before its fix.)

// waitWithin runs ch.Wait with a ctx of d and returns its result.
func waitWithin(ch prov.CompChannel, d time.Duration) (prov.CQ, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return ch.Wait(ctx)
}

// TestCQOverflowWakesArmed: a CQ armed for the next completion
// takes a batch of completions (a flush of posted receives) of which the
// first fits and a later one overflows. The first completion was queued
// while the CQ was armed: its event must reach the channel, so that a
// Wait sleeping on it wakes (and the application finds the overflow);
// overflowLocked cleared the arm without one, and the Wait slept on.
func TestCQOverflowWakesArmed(t *testing.T) {
	e := newEnv(t)
	ch := must(e.ctx.CreateCompChannel())
	t.Cleanup(func() { ch.Close() })
	cq := must(e.ctx.CreateCQ(1, ch, 0))
	t.Cleanup(func() { cq.Close() })
	scq := e.cq(16)
	q := must(e.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: scq, RecvCQ: cq, Cap: defaultCaps()}))
	t.Cleanup(func() { q.Close() })
	toInit(t, q, prov.QPTypeRC, defaultConn())
	m := e.alloc(4096, allAccess)
	for i := range 3 {
		if _, err := q.PostRecv([]prov.RecvWR{{WRID: uint64(i), NumSGE: 1}}, []prov.SGE{m.sge(0, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cq.Arm(false); err != nil {
		t.Fatal(err)
	}
	if err := q.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState); err != nil {
		t.Fatal(err)
	}
	got, err := waitWithin(ch, 3*time.Second)
	if errors.Is(err, context.DeadlineExceeded) {
		var dst [4]prov.Completion
		_, perr := cq.Poll(dst[:])
		t.Fatalf("armed CQ took a completion (then overflowed: poll %v) and no event came: Wait %v", perr, err)
	}
	if err != nil || got != cq {
		t.Fatalf("Wait: %v %v, want the CQ's event", got, err)
	}
}

// TestDriveEndsForEarlierClose: a Wait whose ctx cannot end checks that its
// channel is open, then drives the connection (drive.go); the channel is
// closed in between (its CQs closed first, so Close succeeds: nothing
// was driving yet, so Close interrupts nobody). The drive must see the
// channel closed and end, as driveShm does (isClosed in its loop);
// driveLocked did not look, waited on a silent socket without a
// deadline, and the Wait on a closed channel never returned. The test makes the
// interleaving deterministic by closing before it starts the drive, with
// the socket held as a poll would (TestDriveHandlesBuffered does the
// same).
func TestDriveEndsForEarlierClose(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			ch, c := p.armedDriveConn(t) // what wait() found before the Close
			for _, cl := range []interface{ Close() error }{p.qb, p.cqb, p.chb} {
				if err := cl.Close(); err != nil {
					t.Fatal(err)
				}
			}
			takeSocket(t, c) // driveLocked releases it
			done := make(chan prov.CQ, 1)
			go func() { done <- ch.driveLocked(context.Background(), c) }()
			select {
			case q := <-done:
				if q != nil {
					t.Fatalf("a drive of a closed channel returned %v", q)
				}
			case <-time.After(5 * time.Second):
				// Let the cleanup end it (the connection fails).
				t.Fatal("a drive begun on a closed channel did not end: the Wait hangs")
			}
		})
	}
}

// TestDriveSocketWantTakenBack: the socket counterpart of
// TestDriveShmStaleWant. A Wait that found the socket's consumer at work
// asked the reader for the socket (askSocket: c.want); its ctx ends and
// it returns without the socket. The request must go with it: it was
// left, and the reader's next wait stepped aside for nobody
// (readerWaits): nobody read the socket until stepAside gave up (two
// pollerGraces), for every other waiter of the connection.
func TestDriveSocketWantTakenBack(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			p := newDrivePair(t, kind)
			ch, c := p.armedDriveConn(t)
			takeSocket(t, c) // the test is the socket's consumer at work
			locked := true
			defer func() {
				if locked {
					c.rmu.Unlock()
				}
			}()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := p.chb.Wait(ctx)
				done <- err
			}()
			want := func() *compChannel {
				c.dlMu.Lock()
				defer c.dlMu.Unlock()
				return c.want
			}
			for deadline := time.Now().Add(hangGuard); want() != ch; time.Sleep(50 * time.Microsecond) {
				if time.Now().After(deadline) {
					t.Fatal("the Wait did not ask for the socket")
				}
			}
			cancel()
			awaitErrIs(t, done, context.Canceled, "the Wait")
			if w := want(); w != nil {
				t.Errorf("the Wait returned and left its request for the socket (want %p): the reader will step aside for nobody", w)
			}
			c.rmu.Unlock()
			locked = false
		})
	}
}
