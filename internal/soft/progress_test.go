package soft

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// privMem registers n bytes that the peer cannot map (no descriptor): its
// requests carry their payload in frames, whatever the transport. (The
// memory is outside the Go heap, like a NIC's target memory, so that the
// race detector does not take the responder's writes, ordered before the
// completion only through the socket or ring, for races.)
func privMem(t *testing.T, e *env, n int) *buf {
	t.Helper()
	r := must(mem.Alloc(mem.RoundUp(n), "test", false))
	m := must(e.pd.RegMR(prov.Mem{Ptr: r.Ptr(), Len: n, FD: -1}, allAccess))
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("close mr: %v", err)
		}
		r.Free()
	})
	return &buf{b: r.Bytes()[:n:n], mr: m}
}

// spin polls c, without ever sleeping, until it has n completions.
func spin(t *testing.T, c prov.CQ, n int) []prov.Completion {
	t.Helper()
	out := make([]prov.Completion, 0, n)
	var dst [16]prov.Completion
	deadline := time.Now().Add(hangGuard)
	for i := 0; len(out) < n; i++ {
		k, err := c.Poll(dst[:min(len(dst), n-len(out))])
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		out = append(out, dst[:k]...)
		if i%4096 == 4095 && time.Now().After(deadline) {
			t.Fatalf("poll: got %d of %d completions: %+v", len(out), n, out)
		}
	}
	return out
}

// TestPollProgress: the transports carry sends, writes and reads of every
// size to an application that only polls (progress.go: its polls handle
// the frames; a message larger than a segment travels in several, each
// of which fits the ring and the receive buffer), with the bytes intact,
// and the connection survives a mix of sizes in flight at once.
func TestPollProgress(t *testing.T) {
	sizes := []int{1, 8, 4 << 10, sockRxSize - hdrLen - reqBodyLen, sockRxSize + 1, ringCap + 4096}
	for _, kind := range xprocKinds {
		t.Run(kind, func(t *testing.T) {
			forceTransport(t, kind)
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
			max := sizes[len(sizes)-1]
			src, dst := privMem(t, e, max), privMem(t, e, max)
			for i := range src.b {
				src.b[i] = byte(i*7 + i>>11)
			}
			for _, size := range sizes {
				t.Run(fmt.Sprintf("write/%d", size), func(t *testing.T) {
					clear(dst.b)
					wr := []prov.SendWR{{WRID: uint64(size), Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
						RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
					if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, size)}); err != nil {
						t.Fatal(err)
					}
					if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != uint64(size) {
						t.Fatalf("completion %+v", c)
					}
					if !bytes.Equal(dst.b[:size], src.b[:size]) || bytes.ContainsFunc(dst.b[size:], func(r rune) bool { return r != 0 }) {
						t.Fatalf("destination differs from the %d bytes written", size)
					}
				})
				t.Run(fmt.Sprintf("read/%d", size), func(t *testing.T) {
					clear(dst.b)
					wr := []prov.SendWR{{WRID: uint64(size), Opcode: prov.WRRead, NumSGE: 1, Flags: prov.SendSignaled,
						RemoteAddr: src.addr(0), RKey: src.mr.RKey()}}
					if _, err := a.qp.PostSend(wr, []prov.SGE{dst.sge(0, size)}); err != nil {
						t.Fatal(err)
					}
					if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != uint64(size) {
						t.Fatalf("completion %+v", c)
					}
					if !bytes.Equal(dst.b[:size], src.b[:size]) || bytes.ContainsFunc(dst.b[size:], func(r rune) bool { return r != 0 }) {
						t.Fatalf("destination differs from the %d bytes read", size)
					}
				})
				t.Run(fmt.Sprintf("send/%d", size), func(t *testing.T) {
					clear(dst.b)
					if _, err := b.qp.PostRecv([]prov.RecvWR{{WRID: 1, NumSGE: 1}}, []prov.SGE{dst.sge(0, max)}); err != nil {
						t.Fatal(err)
					}
					wr := []prov.SendWR{{WRID: 2, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
					if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, size)}); err != nil {
						t.Fatal(err)
					}
					if c := spin(t, b.rcq, 1)[0]; c.Status != prov.StatusSuccess || int(c.ByteLen) != size {
						t.Fatalf("receive completion %+v", c)
					}
					if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
						t.Fatalf("send completion %+v", c)
					}
					if !bytes.Equal(dst.b[:size], src.b[:size]) {
						t.Fatalf("received bytes differ from the %d sent", size)
					}
				})
			}
			t.Run("mixed", func(t *testing.T) {
				// Every size in flight at once, into disjoint halves.
				half := max / 2
				var wrs []prov.SendWR
				var sges []prov.SGE
				for i, size := range sizes {
					size = min(size, half)
					wrs = append(wrs, prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
						RemoteAddr: dst.addr(i % 2 * half), RKey: dst.mr.RKey()})
					sges = append(sges, src.sge(i%2*half, size))
				}
				if n, err := a.qp.PostSend(wrs, sges); err != nil || n != len(wrs) {
					t.Fatalf("post: %d %v", n, err)
				}
				for i, c := range spin(t, a.scq, len(wrs)) {
					if c.Status != prov.StatusSuccess || c.WRID != uint64(i) {
						t.Fatalf("completion %d: %+v", i, c)
					}
				}
				if !bytes.Equal(dst.b[:half], src.b[:half]) {
					t.Fatal("the first half differs")
				}
			})
		})
	}
}

// TestAckCorked: over TCP, the acknowledgement of a message whose receive
// completion a poll delivered leaves before the completion is visible,
// but corked (conn.send): it waits in the socket for the answer that
// usually follows, which pushes it along in one segment, or for the next
// poll that finds nothing new. Either way the sender's completion comes.
// (An acknowledgement pushed at once cost a second segment, and the
// whole receive path of the peer's stack, per message: 8-byte round
// trips over TCP took 1.6 times a raw TCP ping-pong.)
//
// Over unix sockets the acknowledgement is held (ackpage.go) instead of
// corked, and leaves the same ways. A poll that finds another writer of
// the connection at work leaves the push to it (conn.pushAck): such
// rounds are counted, and must stay fewer than those the poll pushed
// (without the poll's push, none is pushed by the time it returns).
func TestAckCorked(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) { testAckCorked(t, kind) })
	}
}

func testAckCorked(t *testing.T, kind string) {
	forceTransport(t, kind)
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	m := privMem(t, e, 64)
	send := func(from *ep, wrid uint64) {
		t.Helper()
		wr := []prov.SendWR{{WRID: wrid, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
		if _, err := from.qp.PostSend(wr, []prov.SGE{m.sge(0, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	recv := func(to *ep) {
		t.Helper()
		if _, err := to.qp.PostRecv([]prov.RecvWR{{WRID: 9, NumSGE: 1}}, []prov.SGE{m.sge(32, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	ok := func(c prov.Completion, what string) {
		t.Helper()
		if c.Status != prov.StatusSuccess {
			t.Fatalf("%s: %+v", what, c)
		}
	}
	// The first messages may be handled by the connection's reader,
	// which pushes what it corked before it sleeps; once b polls, its
	// polls handle them.
	corked, pushed, busy := 0, 0, 0
	for round := 0; round < 2000 && pushed < 10; round++ {
		// a sends, b receives by polling and answers: b's answer takes
		// the acknowledgement along.
		recv(b)
		recv(a)
		send(a, uint64(round))
		ok(spin(t, b.rcq, 1)[0], "b's receive")
		c := revConn(t, b.qp)
		held := func() bool { return c.corked.Load() || kind == "unix" && c.holdsResps() }
		if held() {
			corked++
			if round%2 == 1 {
				// No answer: b's next poll, which finds nothing,
				// pushes the acknowledgement.
				var dst [1]prov.Completion
				if n, err := b.rcq.Poll(dst[:]); n != 0 || err != nil {
					t.Fatalf("b's poll: %d %v", n, err)
				}
				if held() {
					// Another writer of b's connection held it (its
					// write pushes the acknowledgement along): the poll
					// left it to that writer.
					busy++
				} else {
					pushed++
				}
			}
		}
		send(b, 100)
		ok(spin(t, a.rcq, 1)[0], "a's receive")
		ok(spin(t, b.scq, 1)[0], "b's send")
		ok(spin(t, a.scq, 1)[0], "a's send")
	}
	if pushed < 10 || busy > pushed {
		t.Fatalf("%d acknowledgements corked, %d pushed by a poll, %d left corked by one: want 10 pushed, and more than left", corked, pushed, busy)
	}
}

// revConn returns the connection by which q's peer reached it. The
// consumer records it after the responder has run, so a completion of the
// request can be polled a moment before: wait for it.
func revConn(t *testing.T, q prov.QP) *conn {
	t.Helper()
	for end := time.Now().Add(hangGuard); ; runtime.Gosched() {
		if c := q.(*qp).x.rev.Load(); c != nil {
			return c
		}
		if time.Now().After(end) {
			t.Fatal("no connection recorded for the peer's requests")
		}
	}
}

// TestAckCorkedWhenSleeping: the acknowledgement of a message that the
// connection's reader delivered to a sleeping application is corked
// too (ackFirst), and leaves with what the application does next: its
// answer takes it along, or its next arm of the CQ (it goes back to
// sleep without answering: pollersGone) pushes it. Before, the reader
// wrote it at once: two writes per message of a sleeping ping-pong
// instead of one. (Corked with only the reader's timer to push it, it
// waited up to a millisecond, the granularity of the runtime's sleeps:
// session's WriteImm over TCP took 1.2 ms instead of 0.12 ms.)
//
// Over unix sockets the acknowledgement is held (ackpage.go) instead of
// corked, and leaves the same ways.
func TestAckCorkedWhenSleeping(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) { testAckHeldWhenSleeping(t, kind) })
	}
}

func testAckHeldWhenSleeping(t *testing.T, kind string) {
	forceTransport(t, kind)
	e := newEnv(t)
	aq, acq, _ := xprocSide(t, e)
	bq, bcq, bch := xprocSide(t, e)
	connectOne(t, aq, bq, prov.QPTypeRC, defaultConn())
	connectOne(t, bq, aq, prov.QPTypeRC, defaultConn())
	m := privMem(t, e, 64)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	post := func(q prov.QP, id uint64) {
		t.Helper()
		wr := []prov.SendWR{{WRID: id, Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
		if _, err := q.PostSend(wr, []prov.SGE{m.sge(0, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	recv := func(q prov.QP) {
		t.Helper()
		if _, err := q.PostRecv([]prov.RecvWR{{WRID: 9, NumSGE: 1}}, []prov.SGE{m.sge(32, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	var dst [4]prov.Completion
	corked, byAnswer, byArm := 0, 0, 0
	for round := 0; round < 2000 && (byAnswer < 10 || byArm < 10); round++ {
		recv(bq)
		if err := bcq.Arm(false); err != nil {
			t.Fatal(err)
		}
		post(aq, uint64(round))
		if _, err := bch.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if n, err := bcq.Poll(dst[:1]); n != 1 || err != nil || dst[0].Status != prov.StatusSuccess {
			t.Fatalf("round %d: b's poll: %d %v %+v", round, n, err, dst[0])
		}
		c := revConn(t, bq)
		held := func() bool { return c.corked.Load() || kind == "unix" && c.holdsResps() }
		wasCorked := held()
		if wasCorked {
			corked++
		}
		if round%2 == 0 {
			// b answers: its send pushes the acknowledgement along.
			recv(aq)
			post(bq, 100)
			if wasCorked {
				if held() {
					t.Fatalf("round %d: b answered and its acknowledgement stayed corked", round)
				}
				byAnswer++
			}
			if got := spin(t, acq, 2); got[0].Status != prov.StatusSuccess || got[1].Status != prov.StatusSuccess {
				t.Fatalf("round %d: a's send and receive: %+v", round, got)
			}
			if got := spin(t, bcq, 1)[0]; got.Status != prov.StatusSuccess {
				t.Fatalf("round %d: b's send: %+v", round, got)
			}
			continue
		}
		// b goes back to sleep without answering: its arm pushes it.
		if err := bcq.Arm(false); err != nil {
			t.Fatal(err)
		}
		if wasCorked {
			if held() {
				t.Fatalf("round %d: b armed its CQ again and its acknowledgement stayed corked", round)
			}
			byArm++
		}
		if got := spin(t, acq, 1)[0]; got.Status != prov.StatusSuccess {
			t.Fatalf("round %d: a's send: %+v", round, got)
		}
	}
	if byAnswer < 10 || byArm < 10 {
		t.Fatalf("%d acknowledgements corked by the reader; %d pushed by an answer, %d by an arm: want 10 of each", corked, byAnswer, byArm)
	}
}

// TestGraceWatch: the watcher leaves a reader in its grace while its
// connection's polls move between two looks, and kicks it (once, taking
// it off the watch) when they did not move or the connection is down;
// the last kick ends the watch.
func TestGraceWatch(t *testing.T) {
	newConn := func() *conn { return &conn{pollState: pollState{kick: make(chan struct{}, 1)}} }
	kicked := func(c *conn) bool {
		select {
		case <-c.kick:
			return true
		default:
			return false
		}
	}
	w := &graceWatch{on: true} // no timer: the test looks itself
	polling, stopped, down := newConn(), newConn(), newConn()
	for _, c := range []*conn{polling, stopped, down} {
		w.add(c)
	}
	polling.polls.Add(1)
	stopped.polls.Add(1)
	down.polls.Add(1)
	down.dead.Store(true)
	if !w.look() {
		t.Fatal("look: no reader left in grace, want two")
	}
	if kicked(polling) || kicked(stopped) {
		t.Fatal("kicked a reader whose polls moved")
	}
	if !kicked(down) {
		t.Fatal("the reader of a connection that is down was not kicked")
	}
	polling.polls.Add(3)
	if !w.look() {
		t.Fatal("look: no reader left in grace, want one")
	}
	if !kicked(stopped) {
		t.Fatal("the reader whose polls stopped was not kicked")
	}
	if kicked(polling) {
		t.Fatal("kicked a reader whose polls moved")
	}
	if len(w.conns) != 1 {
		t.Fatalf("%d connections watched, want 1", len(w.conns))
	}
	w.remove(polling) // its grace ended (an arm)
	if w.look() || w.on {
		t.Fatal("the watch goes on with no reader in grace")
	}
	if kicked(polling) {
		t.Fatal("kicked a reader off the watch")
	}
}

// TestBigResponsesLeave: over shared memory, the acknowledgement of a
// large request (ackNowMin or more) leaves as soon as the request is
// handled, while those of small ones are held for the caller of drain
// (a poll, a drive or the reader) to send when it is done, or for the
// answer the application is likely to send. A held acknowledgement of a
// large write waited for whatever the target's consumer did next, the
// next frames of a window or its application: RDMA writes of 64 KiB
// into a process, 16 in flight, went at half the speed (session's
// BenchmarkXprocBandwidth/shm/channel, 5.6 against 11 GB/s).
func TestBigResponsesLeave(t *testing.T) {
	p := newConsumedPair(t, ackNowMin)
	for _, tc := range []struct {
		size int
		held bool
	}{
		{8, true},
		{ackNowMin - 1, true},
		{ackNowMin, false},
	} {
		_, all, held, err := p.consume(tc.size, 4, func() (int, error) { return p.c.drain(false) })
		if err != nil {
			t.Fatal(err)
		}
		if all != 4 {
			t.Fatalf("%d-byte writes: %d of 4 arrived", tc.size, all)
		}
		if held != tc.held {
			t.Errorf("%d-byte writes: acknowledgements held after the drain %v, want %v", tc.size, held, tc.held)
		}
		if got := spin(t, p.a.scq, 1)[0]; got.Status != prov.StatusSuccess {
			t.Fatalf("%d-byte writes: %+v", tc.size, got)
		}
	}
}

// TestPollMovesAShare: a poll of a shared-memory connection returns once
// the requests it handled brought pollMoveMax bytes, leaving the rest to
// the next poll, so that its application works on what came while the
// peer sends more; small messages are not held back (a poll handles all
// the 8-byte writes that came).
func TestPollMovesAShare(t *testing.T) {
	const size = pullMin
	p := newConsumedPair(t, size)
	for _, tc := range []struct {
		size, count int
		perPoll     int // frames the first poll handles
	}{
		{8, 32, 32},
		{size, 2 * pollMoveMax / size, pollMoveMax / size},
	} {
		first, all, _, err := p.consume(tc.size, tc.count, p.c.pollDrain)
		if err != nil {
			t.Fatal(err)
		}
		if first != tc.perPoll || all != tc.count {
			t.Errorf("%d writes of %d bytes: the first poll handled %d, want %d; %d in all", tc.count, tc.size, first, tc.perPoll, all)
		}
		if got := spin(t, p.a.scq, 1)[0]; got.Status != prov.StatusSuccess {
			t.Fatalf("%d-byte writes: %+v", tc.size, got)
		}
	}
}

// consumedPair is an RC pair over shared memory whose target side's
// connection a test consumes itself (it holds the connection's rmu and
// drains it), with a region of the same size on each side.
type consumedPair struct {
	a, b     *ep
	c        *conn // b's side of the connection
	src, dst *buf
}

func newConsumedPair(t *testing.T, size int) *consumedPair {
	t.Helper()
	forceTransport(t, "shm")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	p := &consumedPair{a: a, b: b, src: privMem(t, e, size), dst: privMem(t, e, size)}
	// The first writes set up what the later ones use (a large one has
	// the requester map the target's region: MAP, which b's consumer
	// answers).
	for _, n := range []int{8, size} {
		if err := p.write(n, true); err != nil {
			t.Fatal(err)
		}
		spin(t, a.scq, 1)
	}
	p.c = revConn(t, b.qp)
	return p
}

// write posts an RDMA write of n bytes from a to b.
func (p *consumedPair) write(n int, signaled bool) error {
	wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: p.dst.addr(0), RKey: p.dst.mr.RKey()}}
	if signaled {
		wr[0].Flags = prov.SendSignaled
	}
	_, err := p.a.qp.PostSend(wr, []prov.SGE{p.src.sge(0, n)})
	return err
}

// consume posts count writes of size bytes (the last signaled) and
// drains b's side with drain until they have all been handled (or a
// hang guard passed): first is what the first drain handled, all what
// the drains handled, held whether responses were held after the last.
// The reader and polls wait meanwhile; the responses leave before it
// returns. The frames are in the ring when PostSend returns (it runs
// the send queue in this goroutine).
func (p *consumedPair) consume(size, count int, drain func() (int, error)) (first, all int, held bool, err error) {
	p.c.rmu.Lock()
	defer p.c.rmu.Unlock()
	for i := 0; i < count && err == nil; i++ {
		err = p.write(size, i == count-1)
	}
	for i, deadline := 0, time.Now().Add(hangGuard); err == nil && all < count && time.Now().Before(deadline); i++ {
		var k int
		k, err = drain()
		if i == 0 {
			first = k
		}
		all += k
	}
	held = p.c.holdsResps()
	p.c.flushResps()
	return first, all, held, err
}

// TestAckWakeWaits: over shared memory, the acknowledgement that goes
// ahead of a receive completion (ackFirst) is held, published in the
// ring's acknowledgement word, and leaves with the other held responses
// when the consumer is done (one wake-up of a sleeping peer for all).
// When it cannot be held (a response of another kind is held: heldOther)
// it is in the ring at once, but a peer whose consumer sleeps is not
// woken for it then: the drain wakes it once wakeBatch more frames were
// handled, or when it returns (a stream of sends woke a sleeping sender
// once per message).
func TestAckWakeWaits(t *testing.T) {
	p := newConsumedPair(t, 64)
	// a's side of the connection: its consumer is held (the test holds
	// its rmu), and said to sleep.
	var ac *conn
	s := p.c.s
	s.mu.Lock()
	for c := range s.conns {
		if c != p.c && c.shm != nil {
			ac = c
		}
	}
	s.mu.Unlock()
	if ac == nil {
		t.Fatal("no connection of a")
	}
	ac.rmu.Lock()
	defer ac.rmu.Unlock()
	for _, tc := range []struct {
		held          bool // the acknowledgements can be held
		sends, wokeAt int
	}{
		{true, 1, 1},
		{true, 2 * wakeBatch, 2 * wakeBatch},
		{false, 1, 1},
		{false, wakeBatch - 1, wakeBatch - 1},
		{false, 2 * wakeBatch, wakeBatch + 1},
	} {
		// Without the acknowledgement words, ackFirst sends at once, as
		// when it may not hold (a response of another kind held, or
		// frames queued).
		acks := p.c.acks
		if !tc.held {
			p.c.acks = nil
		}
		for i := range tc.sends {
			postRecv(t, p.b.qp, uint64(i), p.dst.sge(0, 8))
		}
		// Under b's rmu: its reader, which flushes under it too, signals
		// nothing meanwhile.
		p.c.rmu.Lock()
		base := p.c.rxSeen.Load()
		var mu sync.Mutex
		var woke []uint64 // frames handled when b woke a
		record := func() {
			mu.Lock()
			woke = append(woke, p.c.rxSeen.Load()-base)
			mu.Unlock()
		}
		p.c.shm.onSignal.Store(&record)
		atomic.StoreUint32(p.c.shm.out.sleep, 1)
		var err error
		for i := 0; i < tc.sends && err == nil; i++ {
			_, err = p.a.qp.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1}}, []prov.SGE{p.src.sge(0, 8)})
		}
		handled := 0
		for deadline := time.Now().Add(hangGuard); err == nil && handled < tc.sends && time.Now().Before(deadline); {
			var k int
			k, err = p.c.drain(false)
			handled += k
		}
		if held := p.c.holdsResps(); held != tc.held {
			t.Errorf("held %t, want %t", held, tc.held)
		}
		p.c.flushResps()
		p.c.acks = acks
		p.c.shm.onSignal.Store(nil)
		p.c.rmu.Unlock()
		mu.Lock()
		woken := woke
		mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		if got := poll(t, p.b.rcq, tc.sends); len(got) != tc.sends {
			t.Fatalf("%d receives of %d", len(got), tc.sends)
		}
		if len(woken) != 1 || woken[0] != uint64(tc.wokeAt) {
			t.Errorf("%d sends to a sleeping peer (held %t): woken after frames %v, want once, after %d", tc.sends, tc.held, woken, tc.wokeAt)
		}
	}
}

// TestPollSilencesInGrace: a socket whose reader is in its grace is
// silenced (quiet.go) even when the reader could not do it itself (a
// poller held rmu when it went into the grace: waitRx only tries the
// lock). Before, the socket then listened for the whole grace, and every
// segment woke the runtime's poller for nothing: a polling round trip
// over TCP, in one run of two, made 7k to 30k wake-ups per 50 000
// instead of 1k, the slow runs 10-25 % slower (perf stat -e
// sched:sched_wakeup of BenchmarkXprocSendRTT/wait=spin/tcp).
func TestPollSilencesInGrace(t *testing.T) {
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			forceTransport(t, kind)
			e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
			m := privMem(t, e, 64)
			postRecv(t, b.qp, 1, m.sge(32, 8))
			if _, err := a.qp.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{m.sge(0, 8)}); err != nil {
				t.Fatal(err)
			}
			spin(t, b.rcq, 1)
			c := revConn(t, b.qp)
			if c.quiet == nil {
				t.Fatalf("the %s connection's socket is not a quietSock", kind)
			}
			checked := false
			for end := time.Now().Add(hangGuard); !checked && time.Now().Before(end); {
				// Polls that keep coming put the reader in its grace.
				c.poll()
				if !c.grace.Load() {
					runtime.Gosched()
					continue
				}
				// The reader's silence missed, as when a poller held
				// rmu: the socket listens in the grace.
				c.rmu.Lock()
				err := c.quiet.listen()
				c.rmu.Unlock()
				if err != nil {
					t.Fatal(err)
				}
				c.poll()
				// Only if the grace lasted through the poll (graceWatch
				// ends it when polls stop for a while).
				if c.grace.Load() {
					if !c.quiet.quiet.Load() {
						t.Fatal("a poll in the reader's grace left the socket listening")
					}
					checked = true
				}
			}
			if !checked {
				t.Fatal("the reader never stayed in its grace through a poll")
			}
		})
	}
}

// TestAckHoldBounded: over a unix socket, a consumer that finds message
// after message waiting holds at most ackHoldMax acknowledgements: the
// sender's sends complete while the consumer is still busy, not when it
// next finds nothing. Holding them all (up to 64) left a sender with
// fewer messages in flight than that waiting for the consumer to go idle.
func TestAckHoldBounded(t *testing.T) {
	forceTransport(t, "unix")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	src, dst := privMem(t, e, 64), privMem(t, e, 64)
	send := func() error {
		_, err := a.qp.PostSend([]prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}, []prov.SGE{src.sge(0, 8)})
		return err
	}
	// One message first, so that the connection b's consumer serves is
	// known (revConn).
	postRecv(t, b.qp, 0, dst.sge(0, 8))
	if err := send(); err != nil {
		t.Fatal(err)
	}
	poll(t, b.rcq, 1)
	poll(t, a.scq, 1)
	c := revConn(t, b.qp)
	if c.acks == nil {
		t.Fatal("the unix connection holds no acknowledgements (no acknowledgement page)")
	}
	const n = 3*ackHoldMax + 2
	for i := range n {
		postRecv(t, b.qp, uint64(i), dst.sge(0, 8))
	}
	// The test is b's consumer: the reader stays aside meanwhile.
	takeSocket(t, c)
	var err error
	for i := 0; i < n && err == nil; i++ {
		err = send()
	}
	for handled, deadline := 0, time.Now().Add(hangGuard); err == nil && handled < n; {
		if time.Now().After(deadline) {
			c.rmu.Unlock()
			t.Fatalf("the consumer handled %d of %d", handled, n)
		}
		var k int
		k, err = c.drain(false)
		handled += k
	}
	c.respMu.Lock()
	held := len(c.resps) / (hdrLen + respBodyLen)
	c.respMu.Unlock()
	if err != nil || held > ackHoldMax {
		c.rmu.Unlock()
		t.Fatalf("%d acknowledgements held after %d messages (at most %d), %v", held, n, ackHoldMax, err)
	}
	// Those that left completed their sends while the consumer had not
	// gone idle yet.
	done := poll(t, a.scq, n-held)
	c.flushResps()
	c.rmu.Unlock()
	done = append(done, poll(t, a.scq, held)...)
	for _, wc := range append(done, poll(t, b.rcq, n)...) {
		if wc.Status != prov.StatusSuccess {
			t.Fatalf("%+v", wc)
		}
	}
}
