package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// Adversarial tests, second pass: a peer that completed the bootstrap
// and then breaks the protocol on purpose (writes beyond its credits,
// answers requests with what was not asked for), and a careless
// application (lengths that overflow, negative configuration, leases
// "for ever"). Each asserts a clear, typed error and no panic; those of
// a peer's violation, that the session ends with ErrProtocol.

// TestAdv2SendRegionBounds: SendRegion refuses with ErrOutOfBounds every
// part that does not lie in the region, lengths whose sum with the
// offset overflows included (before, off 1 and n math.MaxInt passed the
// check and the slice expression panicked).
func TestAdv2SendRegionBounds(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	mr, err := a.pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	for _, tc := range []struct {
		name   string
		off, n int
	}{
		{"off+n overflows", 1, math.MaxInt},
		{"n overflows alone", 4095, math.MaxInt - 4000},
		{"off at the maximum", math.MaxInt, 1},
		{"off past the end", 4097, 1},
		{"one byte past the end", 4000, 97},
		{"negative offset", -1, 1},
		{"empty", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := a.SendRegion(ctx, mr, tc.off, tc.n, verbs.AccessRemoteRead, 0)
			if !errors.Is(err, ErrOutOfBounds) {
				if g != nil {
					g.Revoke(ctx)
				}
				t.Fatalf("SendRegion(%d, %d) of a region of 4096: %v, want ErrOutOfBounds", tc.off, tc.n, err)
			}
		})
	}
	// The session goes on: the whole region can be sent.
	g, err := a.SendRegion(ctx, mr, 0, 4096, verbs.AccessRemoteRead, 0)
	if err != nil {
		t.Fatal(err)
	}
	r, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Len() != 4096 {
		t.Fatalf("the region offered is of %d bytes", r.Len())
	}
	if err := g.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestAdv2ConfigNegative: a Config with a negative count, size, lease or
// cap (or an invalid allocator) is refused by Listen and Dial with an
// error naming the field. Before, a negative QueueDepth crashed the
// process in Accept (makechan: size out of range), a negative Lease or
// MaxMessage made the peer end the session for a protocol error (the
// lease went out as 2^64 - 1 s), a negative MaxRequest lifted the cap
// on the peer's requests, and a Listener with a negative MaxMemory
// dropped every peer in silence while its Accept waited for ever.
func TestAdv2ConfigNegative(t *testing.T) {
	for _, tc := range []struct {
		field string
		cfg   Config
	}{
		{"QueueDepth", Config{QueueDepth: -1}},
		{"MessageSize", Config{MessageSize: -1}},
		{"ReceiveBuffers", Config{ReceiveBuffers: -1}},
		{"MaxMessage", Config{MaxMessage: -1}},
		{"Lease", Config{Lease: -time.Second}},
		{"MaxGranted", Config{MaxGranted: -1}},
		{"MaxRequest", Config{MaxRequest: -1}},
		{"MaxMemory", Config{Allocator: AllocatorConfig{MaxMemory: -1}}},
		{"ArenaSize", Config{Allocator: AllocatorConfig{ArenaSize: -4096}}},
		{"MaxMemory", Config{Allocator: AllocatorConfig{ArenaSize: 8 << 20, MaxMemory: 4 << 20}}},
	} {
		t.Run(tc.field, func(t *testing.T) { wantConfigRefused(t, tc.cfg, tc.field) })
	}
}

// TestAdv2LeaseBounds: a lease longer than the wire carries (a year),
// math.MaxInt64 as "for ever" included, is a year, for RequestRemoteMR
// and SendLocalMR alike: the region is granted and usable, and both
// sessions live. Before, the peer ended the session for a protocol error
// (lease of 9223372036854775807 ns), and a SendLocalMR's window was
// closed at once (its timer, lease plus leaseGrace, overflowed).
func TestAdv2LeaseBounds(t *testing.T) {
	for _, lease := range []time.Duration{math.MaxInt64, math.MaxInt64 - leaseGrace/2, maxLease + 1, 10 * maxLease} {
		t.Run(lease.String(), func(t *testing.T) {
			a, b := pair(t, Config{})
			ctx := advCtx(t)
			src, err := b.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Free()
			copy(src.Bytes(), "leased")
			t0 := time.Now()
			r, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, lease)
			if err != nil {
				t.Fatalf("RequestRemoteMR with a lease of %v: %v", lease, err)
			}
			if d := r.Deadline().Sub(t0); d < maxLease-time.Minute || d > maxLease+time.Minute {
				t.Errorf("the requested region's lease is %v, want a year", d)
			}
			if err := b.Write(ctx, r.All(), src.All()); err != nil {
				t.Fatal(err)
			}
			if err := r.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// Offered the other way, with the same lease.
			mr, err := a.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			defer mr.Free()
			g, err := a.SendLocalMR(ctx, mr, verbs.AccessRemoteWrite, lease)
			if err != nil {
				t.Fatalf("SendLocalMR with a lease of %v: %v", lease, err)
			}
			r, err = b.ReceiveRemoteMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if d := r.Deadline().Sub(t0); d < maxLease-time.Minute || d > maxLease+time.Minute {
				t.Errorf("the offered region's lease is %v, want a year", d)
			}
			// The window lives past the moment an overflowed timer
			// fired: a write after it reaches the region.
			time.Sleep(10 * time.Millisecond)
			if err := b.Write(ctx, r.All(), src.All()); err != nil {
				t.Fatalf("a write into the offered region: %v", err)
			}
			if !bytes.HasPrefix(mr.Bytes(), []byte("leased")) {
				t.Fatal("the write did not reach the offered region")
			}
			if err := g.Revoke(ctx); err != nil {
				t.Fatal(err)
			}
			if a.Err() != nil || b.Err() != nil {
				t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
			}
		})
	}
}

// TestAdv2PeerAllocatorLimit: a request the peer's allocator cannot serve
// within its MaxMemory, and an offer the peer's full queue of offers
// (maxQueued, not taken by ReceiveRemoteMR) cannot take, fail with
// errors wrapping ErrLimit, and the session goes on. Before, both were
// "session: refused", an unexported error nothing could match.
func TestAdv2PeerAllocatorLimit(t *testing.T) {
	a, b := pairWith(t, Config{Allocator: AllocatorConfig{MaxMemory: 8 << 20}}, Config{}, nil)
	ctx := advCtx(t)
	t.Run("request over MaxMemory", func(t *testing.T) {
		_, err := b.RequestRemoteMR(ctx, 9<<20, verbs.AccessRemoteRead, 0)
		if !errors.Is(err, ErrLimit) {
			t.Fatalf("a request of 9 MiB of a peer whose allocator holds 8: %v, want ErrLimit", err)
		}
	})
	t.Run("offers queue full", func(t *testing.T) {
		mr, err := b.Alloc(64)
		if err != nil {
			t.Fatal(err)
		}
		defer mr.Free()
		var grants []*Grant
		defer func() {
			for _, g := range grants {
				g.Revoke(ctx)
			}
		}()
		for i := 0; ; i++ {
			g, err := b.SendLocalMR(ctx, mr, verbs.AccessRemoteRead, 0)
			if err != nil {
				if !errors.Is(err, ErrLimit) || i != maxQueued {
					t.Fatalf("offer %d to a peer that takes none: %v, want ErrLimit after %d", i, err, maxQueued)
				}
				break
			}
			grants = append(grants, g)
		}
	})
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2RingOverrun: a peer that writes a message beyond its credits,
// into the ring slot of a message the receiver still holds, ends the
// session with ErrProtocol. Before, Receive returned it as a second
// Message of the slot, of the held message's generation: the held one
// read the new bytes, and the release of either invalidated both.
func TestAdv2RingOverrun(t *testing.T) {
	a, b := pair(t, Config{ReceiveBuffers: 2, MessageSize: 256})
	ctx := advCtx(t)
	for i := range 2 {
		if err := a.Send(ctx, []byte{byte(i), 1, 2, 3}); err != nil {
			t.Fatal(err)
		}
	}
	held, err := b.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	m, err := b.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m.Release() // slot 0 is still held: no credit goes back
	if a.dflow.has() {
		t.Fatal("the sender has a credit with the receiver's first slot held")
	}
	// Message 2, to slot 0, as a peer that ignores its credits would.
	buf, err := a.Alloc(dataHdr + 4)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	putDataHdr(buf.Bytes(), dataEager, 0, 4)
	copy(buf.Bytes()[dataHdr:], []byte{9, 9, 9, 9})
	dst := verbs.RemoteAddr{Addr: a.peer.Ring.Addr + hdrAt, RKey: a.peer.Ring.RKey}
	if err := a.data.WriteImm(ctx, dst, 0, buf.All().SGE()); err != nil {
		t.Fatal(err)
	}
	m2, err := b.Receive(ctx)
	if !errors.Is(err, ErrProtocol) {
		t.Fatalf("a message into the slot of a held one: %v (%d bytes %v, the held one reads %v), want ErrProtocol", err, m2.Len(), m2.Bytes(), held.Bytes())
	}
	if !errors.Is(b.Err(), ErrProtocol) {
		t.Fatalf("Err: %v, want ErrProtocol", b.Err())
	}
	select {
	case <-a.Done():
	case <-ctx.Done():
		t.Fatal("the sending session did not end")
	}
}

// freezeAgent stops s's agent from reading control messages (it waits
// for s.cmu) until the returned function is called: s then acts as a
// peer that sends control messages of its own making (sendCtrl) and
// answers nothing.
func freezeAgent(s *Session) (thaw func()) {
	s.cmu.Lock()
	return s.cmu.Unlock
}

// TestAdv2ForgedGrant: a peer that answers RequestRemoteMR with a grant
// of another size or access than asked, or with what is not a grant,
// breaks the protocol: the call fails with ErrProtocol (the session
// ends) and returns no region. Before, the caller got a region of the
// peer's choosing: 16 bytes for a request of 4096, read access for a
// request of write, or (an acknowledgement in place of the grant) any
// region its grant id named, one the application held already.
func TestAdv2ForgedGrant(t *testing.T) {
	const n = 4096
	for _, tc := range []struct {
		name   string
		answer ctrlMsg
	}{
		{"shorter", ctrlMsg{typ: ctrlGrant, len: 16, access: verbs.AccessRemoteWrite}},
		{"longer", ctrlMsg{typ: ctrlGrant, len: 1 << 40, access: verbs.AccessRemoteWrite}},
		{"longer than an int", ctrlMsg{typ: ctrlGrant, len: math.MaxUint64, access: verbs.AccessRemoteWrite}},
		{"other access", ctrlMsg{typ: ctrlGrant, len: n, access: verbs.AccessRemoteRead}},
		{"more access", ctrlMsg{typ: ctrlGrant, len: n, access: verbs.AccessRemoteWrite | verbs.AccessRemoteAtomic}},
		{"an acknowledgement", ctrlMsg{typ: ctrlAck}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			ctx := advCtx(t)
			// A region the peer offered, which the application holds:
			// the forged answer names its grant.
			mr, err := a.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			defer mr.Free()
			if _, err := a.SendLocalMR(ctx, mr, verbs.AccessRemoteRead, time.Hour); err != nil {
				t.Fatal(err)
			}
			offered, err := b.ReceiveRemoteMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			thaw := freezeAgent(a)
			defer thaw()
			type res struct {
				r   *RemoteMR
				err error
			}
			done := make(chan res, 1)
			go func() {
				r, err := b.RequestRemoteMR(ctx, n, verbs.AccessRemoteWrite, time.Hour)
				done <- res{r, err}
			}()
			var id uint64
			waitFor(t, ctx, "the request", func() bool {
				b.agent.mu.Lock()
				defer b.agent.mu.Unlock()
				for k := range b.agent.waiters {
					id = k
					return true
				}
				return false
			})
			m := tc.answer
			m.id, m.grant, m.lease = id, offered.grant, time.Hour
			if m.typ == ctrlGrant {
				m.addr, m.rkey = offered.region.Addr, offered.region.RKey
			}
			if _, err := a.sendCtrl(ctx, m); err != nil {
				t.Fatal(err)
			}
			var r res
			select {
			case r = <-done:
			case <-ctx.Done():
				t.Fatal("RequestRemoteMR did not return")
			}
			if !errors.Is(r.err, ErrProtocol) || r.r != nil {
				got := "no region"
				if r.r != nil {
					got = fmt.Sprintf("a region of %d bytes with access %v", r.r.region.Len, r.r.access)
					if r.r == offered {
						got += " (the one offered)"
					}
				}
				t.Fatalf("a request of %d bytes with write access answered by %+v: %s, %v; want ErrProtocol", n, m, got, r.err)
			}
			if !errors.Is(b.Err(), ErrProtocol) {
				t.Fatalf("Err: %v, want ErrProtocol", b.Err())
			}
		})
	}
}

// TestAdv2ControlWithoutMemory: with the application's allocator full
// (every byte of its MaxMemory allocated), the agent still answers: a
// request of the peer is refused with ErrLimit, a rendezvous message
// this side has no memory for is dropped and the sender's Send fails
// with ErrLimit, and once memory is freed a request is served. Before,
// the agent took the buffers of its answers from that allocator: with
// none to have, the answer (or fin) was lost, and the peer's call
// waited for it until its context ended.
func TestAdv2ControlWithoutMemory(t *testing.T) {
	a, b := pairWith(t, Config{Allocator: AllocatorConfig{MaxMemory: 8 << 20}}, Config{}, nil)
	ctx := advCtx(t)
	var held []LocalMR
	defer func() {
		for _, m := range held {
			m.Free()
		}
	}()
	for {
		m, err := a.Alloc(ctrlBufSize)
		if err != nil {
			if !errors.Is(err, ErrLimit) {
				t.Fatal(err)
			}
			break
		}
		held = append(held, m)
	}
	// A hang guard per call: the calls must return well before.
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 10*time.Second) }
	t.Run("request", func(t *testing.T) {
		cctx, cancel := call()
		defer cancel()
		r, err := b.RequestRemoteMR(cctx, 64, verbs.AccessRemoteWrite, 0)
		if !errors.Is(err, ErrLimit) {
			if r != nil {
				r.Release(ctx)
			}
			t.Fatalf("a request of a peer whose allocator is full: %v, want ErrLimit", err)
		}
	})
	t.Run("rendezvous", func(t *testing.T) {
		cctx, cancel := call()
		defer cancel()
		errc := make(chan error, 1)
		go func() {
			m, err := a.Receive(cctx)
			m.Release()
			errc <- err
		}()
		err := b.Send(cctx, make([]byte, 100<<10))
		if !errors.Is(err, ErrLimit) {
			t.Errorf("a rendezvous to a peer whose allocator is full: %v, want ErrLimit", err)
		}
		if err := <-errc; !errors.Is(err, ErrLimit) {
			t.Errorf("the receive of a rendezvous with the allocator full: %v, want ErrLimit", err)
		}
	})
	for _, m := range held {
		m.Free()
	}
	held = nil
	t.Run("request after the memory is freed", func(t *testing.T) {
		cctx, cancel := call()
		defer cancel()
		r, err := b.RequestRemoteMR(cctx, 64, verbs.AccessRemoteWrite, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Release(ctx); err != nil {
			t.Fatal(err)
		}
	})
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2ControlAfterAllocatorClose: the application closes
// Session.Allocator() (with an arena pinned by a window granted to the
// peer, and without): the session goes on. Control traffic works both
// ways (requests, grants, revocations), messages too; what needs the
// allocator fails: this side's Alloc and Send with ErrClosed, the peer's
// requests with ErrLimit (this side has no memory for them). Before, the
// control receive ring lay in that allocator: with its arena pinned, the
// agent sliced the ring's nil Bytes and crashed the process; without,
// the ring was unmapped under its posted receives, and the next control
// message ended the session with a queue pair failure.
func TestAdv2ControlAfterAllocatorClose(t *testing.T) {
	for _, pinned := range []bool{true, false} {
		t.Run(fmt.Sprintf("pinned %v", pinned), func(t *testing.T) {
			a, b := pair(t, Config{})
			ctx := advCtx(t)
			if pinned {
				// A region of the size the control ring had, so of
				// the arena that held it.
				m, err := a.Alloc(ctrlBuffers * ctrlBufSize)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := a.SendLocalMR(ctx, m, verbs.AccessRemoteRead, time.Hour); err != nil {
					t.Fatal(err)
				}
				if _, err := b.ReceiveRemoteMR(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if err := a.Allocator().Close(); (err != nil) != pinned {
				t.Errorf("closing the allocator: %v (an arena pinned: %v)", err, pinned)
			}
			if _, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteRead, time.Hour); !errors.Is(err, ErrLimit) {
				t.Errorf("the peer's request, this side's allocator closed: %v, want ErrLimit", err)
			}
			r, err := a.RequestRemoteMR(ctx, 64, verbs.AccessRemoteRead, time.Hour)
			if err != nil {
				t.Fatalf("a request of this side, its allocator closed: %v", err)
			}
			if err := r.Release(ctx); err != nil {
				t.Errorf("release: %v", err)
			}
			m, err := b.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			g, err := b.SendLocalMR(ctx, m, verbs.AccessRemoteRead, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := a.ReceiveRemoteMR(ctx); err != nil {
				t.Fatalf("receive remote region: %v", err)
			}
			if err := g.Revoke(ctx); err != nil {
				t.Errorf("revoke: %v", err)
			}
			m.Free()
			if _, err := a.Alloc(64); !errors.Is(err, ErrClosed) {
				t.Errorf("Alloc, the allocator closed: %v, want ErrClosed", err)
			}
			if err := a.Send(ctx, []byte("eager")); !errors.Is(err, ErrClosed) {
				t.Errorf("Send, the allocator closed: %v, want ErrClosed", err)
			}
			if err := b.Send(ctx, []byte("eager")); err != nil {
				t.Fatal(err)
			}
			msg, err := a.Receive(ctx)
			if err != nil || string(msg.Bytes()) != "eager" {
				t.Fatalf("receive: %q, %v", msg.Bytes(), err)
			}
			msg.Release()
			if a.Err() != nil || b.Err() != nil {
				t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
			}
		})
	}
}

// TestAdv2WithheldCredits: a peer that sends control messages in a loop
// (releases of grants that do not exist, each refused) and reads the
// answers but gives none of its receive buffers back (it learns the
// credits the answers carry, and posts nothing again) breaks the flow
// control: the session ends with ErrProtocol once maxOwed answers wait,
// and what waits is bounded (no goroutine per answer). Before, each
// answer waited for a credit in a goroutine of its own, with its buffer,
// for the session's life: a peer could make this side hold any number.
func TestAdv2WithheldCredits(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	thaw := freezeAgent(a)
	defer thaw()
	g0, peak := runtime.NumGoroutine(), 0
	sent := 0
	for ; sent < maxOwed+4*ctrlBuffers && b.Err() == nil; sent++ {
		// Credits of b's, as the answers (read, never reposted) tell.
		for !a.cflow.has() && b.Err() == nil {
			a.cflow.learn(b.crflow.reposted.Load())
			select {
			case <-ctx.Done():
				t.Fatalf("no credit for release %d: %v", sent, ctx.Err())
			default:
				runtime.Gosched()
			}
		}
		if b.Err() != nil {
			break
		}
		if _, err := a.sendCtrl(ctx, ctrlMsg{typ: ctrlRelease, grant: uint64(1<<32 + sent)}); err != nil {
			if b.Err() != nil {
				break
			}
			t.Fatalf("release %d: %v", sent, err)
		}
		peak = max(peak, runtime.NumGoroutine()-g0)
	}
	if !errors.Is(b.Err(), ErrProtocol) {
		t.Fatalf("after %d releases with no credit given back for the answers: Err %v, want ErrProtocol (%d more goroutines at the peak)", sent, b.Err(), peak)
	}
	if sent < maxOwed {
		t.Fatalf("the session ended after %d releases, fewer than the %d answers that may wait: %v", sent, maxOwed, b.Err())
	}
	if peak > 4*ctrlBuffers {
		t.Fatalf("%d more goroutines at the peak, for %d answers owed", peak, sent)
	}
	t.Logf("ended after %d releases (%d more goroutines at the peak): %v", sent, peak, b.Err())
}

// TestAdv2UnansweredCallsForgotten: calls to a peer that never answers
// (here: acknowledgements, which the peer's agent takes and answers
// with nothing), each cancelled once its request reached the peer, are
// forgotten: the table of calls waiting for answers is empty after
// them. Before, each left an entry (nil, for an answer that might come)
// for the session's life.
func TestAdv2UnansweredCallsForgotten(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	const calls = 200
	for i := range calls {
		read := a.crflow.consumed.Load()
		cctx, cancel := context.WithCancel(ctx)
		errc := make(chan error, 1)
		go func() {
			_, err := b.call(cctx, "test call", ctrlMsg{typ: ctrlAck})
			errc <- err
		}()
		waitFor(t, ctx, "the peer's agent to read the call", func() bool { return a.crflow.consumed.Load() != read })
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("call %d: %v, want context.Canceled", i, err)
		}
	}
	b.agent.mu.Lock()
	n := len(b.agent.waiters)
	b.agent.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d calls of %d, cancelled with no answer, still wait for one", n, calls)
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2GrantLeaseFromRequest: the lease of a requested region counts,
// on the requester's side, from its request, not from when its agent
// took the grant: a grant that reached the requester's agent late (here:
// after the granter's window had closed at the lease's end plus
// leaseGrace) is refused by this side with ErrLeaseExpired, and the
// session lives. Before, the lease counted from the grant's arrival, so
// the region looked valid, the write went to a window already closed,
// and the remote access error ended the session.
func TestAdv2GrantLeaseFromRequest(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	const lease = 50 * time.Millisecond
	src, err := b.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	thawA := freezeAgent(a)
	type res struct {
		r   *RemoteMR
		err error
	}
	done := make(chan res, 1)
	go func() {
		r, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, lease)
		done <- res{r, err}
	}()
	waitFor(t, ctx, "the request to reach the granter", func() bool { return b.cflow.sent.Load() != 0 })
	thawB := freezeAgent(b) // the grant waits in b's queue
	thawA()
	waitFor(t, ctx, "the grant", func() bool {
		a.agent.mu.Lock()
		defer a.agent.mu.Unlock()
		return a.agent.nextG != 0
	})
	waitFor(t, ctx, "the granter to close the window at the lease's end", func() bool {
		a.agent.mu.Lock()
		defer a.agent.mu.Unlock()
		return len(a.agent.grants) == 0
	})
	thawB()
	r := <-done
	if r.err != nil {
		if !errors.Is(r.err, ErrLeaseExpired) {
			t.Fatalf("a request whose grant came after its lease: %v, want ErrLeaseExpired or a region", r.err)
		}
	} else if err := b.Write(ctx, r.r.All(), src.All()); !errors.Is(err, ErrLeaseExpired) {
		t.Fatalf("a write into a region whose window the granter closed at the lease's end: %v, want ErrLeaseExpired", err)
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2QueueDepthTooLarge: a QueueDepth beyond what the device takes
// fails the Dial with the device's refusal, having allocated little for
// it. Before, the session allocated its QueueDepth records of posted
// messages first (here 2^21 of them, about 180 MB; with 2^28 the
// process ran out of memory before the device could refuse).
func TestAdv2QueueDepthTooLarge(t *testing.T) {
	ctx := advCtx(t)
	l, err := Listen(ctx, "127.0.0.1:0", Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		if s, err := l.Accept(actx); err == nil {
			s.Close()
		}
	}()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	s, err := Dial(ctx, l.Addr().String(), Config{QueueDepth: 1 << 21})
	runtime.ReadMemStats(&after)
	if err == nil {
		s.Close()
		t.Skip("the device takes queue pairs of 2^21 requests")
	}
	if d := after.TotalAlloc - before.TotalAlloc; d > 32<<20 {
		t.Fatalf("a Dial the device refused (%v) allocated %d MB", err, d>>20)
	}
}

// TestAdv2ConfigOverPeerLimits: a MessageSize or ReceiveBuffers over what
// a peer accepts of the setup is refused by Listen and Dial with an
// error naming the field. Before, the dialer's setup went out and the
// peer refused it, so that Dial said only "the peer closed the session",
// and a Listener so configured dropped every peer while Accept waited.
func TestAdv2ConfigOverPeerLimits(t *testing.T) {
	for _, tc := range []struct {
		field string
		cfg   Config
	}{
		{"MessageSize", Config{MessageSize: maxSlotSize - payOff + 1}},
		{"MessageSize", Config{MessageSize: 1 << 30}},
		{"ReceiveBuffers", Config{ReceiveBuffers: maxRecvBuffers + 1}},
		{"MaxMessage", Config{MaxMessage: maxMessage + 1}},
	} {
		t.Run(tc.field, func(t *testing.T) { wantConfigRefused(t, tc.cfg, tc.field) })
	}
}

// TestAdv2SendSliceOtherAllocator: SendSlice and PostSendSlice of a
// region of another session's allocator (its memory registered in
// another protection domain) fail with ErrAccess, as Read and Write do,
// eager or rendezvous, and the session goes on. Before, the eager send
// failed on the device with a local protection error, which ended the
// session.
func TestAdv2SendSliceOtherAllocator(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 1024})
	other, _ := pair(t, Config{})
	ctx := advCtx(t)
	for _, n := range []int{100, 4096} {
		mr, err := other.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		defer mr.Free()
		if err := b.SendSlice(ctx, mr.All(), 0, false); !errors.Is(err, ErrAccess) {
			t.Fatalf("SendSlice of %d bytes of another session's allocator: %v, want ErrAccess", n, err)
		}
		p, err := b.PostSendSlice(ctx, mr.All(), 0, false)
		if !errors.Is(err, ErrAccess) {
			p.Wait(ctx)
			t.Fatalf("PostSendSlice of %d bytes of another session's allocator: %v, want ErrAccess", n, err)
		}
	}
	if err := b.Send(ctx, []byte("still here")); err != nil {
		t.Fatal(err)
	}
	m, err := a.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if string(m.Bytes()) != "still here" {
		t.Fatalf("received %q", m.Bytes())
	}
}

// TestAdv2RevokeCancelled: a Revoke whose context ends before the peer
// acknowledged it (here: at once, and the peer's agent takes nothing in
// meanwhile) does not close the window behind the peer's back: the peer,
// which may still use the region, writes into it, the session goes on,
// and a later Revoke ends the grant. Before, the window was closed anyway, the peer's write
// failed on the device with a remote access error, and the session
// ended: a cancelled call broke it.
func TestAdv2RevokeCancelled(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	mr, err := a.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Free()
	g, err := a.SendLocalMR(ctx, mr, verbs.AccessRemoteWrite, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	r, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	src, err := b.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	copy(src.Bytes(), "written after a cancelled revoke")
	// The peer's agent takes the revocation, if it went out, only after
	// the peer's write.
	thaw := freezeAgent(b)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := g.Revoke(cctx); !errors.Is(err, context.Canceled) {
		thaw()
		t.Fatalf("Revoke with its context ended: %v, want context.Canceled", err)
	}
	err = b.Write(ctx, r.All(), src.All())
	thaw()
	if err != nil {
		t.Fatalf("the peer's write after a cancelled Revoke: %v", err)
	}
	if !bytes.Equal(mr.Bytes(), src.Bytes()) {
		t.Fatal("the write did not reach the region")
	}
	if err := g.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Write(ctx, r.All(), src.All()); !errors.Is(err, ErrLeaseExpired) {
		t.Fatalf("a write after the Revoke: %v, want ErrLeaseExpired", err)
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2ReleaseCancelled: a Release or SendRemoteMR whose context ended
// before it could tell the peer (it waited for a control credit) still
// gives the region up there: the
// region is given up on this side already (its operations fail with
// ErrLeaseExpired), so the peer frees what it served (its MaxGranted is
// free again) or gets its region back (ReceiveLocalMR), long before the
// lease of an hour. Before, the peer was never told: it kept the memory,
// and counted it, until the lease ended.
func TestAdv2ReleaseCancelled(t *testing.T) {
	forEachGiveUp(t, func(t *testing.T, name string, handBack bool) {
		a, b := pair(t, Config{})
		ctx := advCtx(t)
		r, err := b.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteWrite, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		src, err := b.Alloc(4096)
		if err != nil {
			t.Fatal(err)
		}
		defer src.Free()
		// No control credit left: the peer's agent takes nothing
		// in while this side sends as many messages as it has
		// receive buffers (acknowledgements of nothing, which it
		// ignores).
		thaw := freezeAgent(a)
		for range ctrlBuffers {
			if _, err := b.sendCtrl(ctx, ctrlMsg{typ: ctrlAck}); err != nil {
				thaw()
				t.Fatal(err)
			}
		}
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		err = giveUp(cctx, b, r, handBack)
		cancel()
		thaw()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%s with its context ended: %v, want context.DeadlineExceeded", name, err)
		}
		if err := b.Write(ctx, r.All(), src.All()); !errors.Is(err, ErrLeaseExpired) {
			t.Fatalf("a write after the cancelled %s: %v, want ErrLeaseExpired", name, err)
		}
		waitGivenUp(t, ctx, a, b, handBack)
	})
}

// forEachGiveUp runs f in a subtest for each way b gives a remote region
// up: Release, and SendRemoteMR (handBack: the region goes back to its
// owner).
func forEachGiveUp(t *testing.T, f func(t *testing.T, name string, handBack bool)) {
	for _, handBack := range []bool{false, true} {
		name := "Release"
		if handBack {
			name = "SendRemoteMR"
		}
		t.Run(name, func(t *testing.T) { f(t, name, handBack) })
	}
}

// giveUp gives r, a region b was granted, up the way of handBack.
func giveUp(ctx context.Context, b *Session, r *RemoteMR, handBack bool) error {
	if handBack {
		return b.SendRemoteMR(ctx, r)
	}
	return r.Release(ctx)
}

// waitGivenUp waits until a, the granter of the region b gave up (handed
// back if handBack: a takes it and frees it), has freed what it served,
// and checks that both sessions go on.
func waitGivenUp(t *testing.T, ctx context.Context, a, b *Session, handBack bool) {
	t.Helper()
	if handBack {
		mr, err := a.ReceiveLocalMR(ctx)
		must(t, "the region handed back", err)
		mr.Free()
	}
	waitFor(t, ctx, "the peer to free what it served", func() bool {
		a.agent.mu.Lock()
		defer a.agent.mu.Unlock()
		return a.agent.granted == 0 && len(a.agent.grants) == 0
	})
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the sessions ended: %v / %v", a.Err(), b.Err())
	}
}

// TestAdv2RefusedRequestsCostNothing: requests the granter refuses for
// its MaxGranted (the peer holds all it may) are refused before any
// memory is allocated for them: a peer that asks again and again for
// more than it may hold makes this side allocate nothing. Before, each
// refused request allocated (and zeroed) its size first: with a request
// of MaxRequest (64 MiB by default) a message of 56 bytes cost the
// granter an arena mapped, registered, cleared and unmapped.
func TestAdv2RefusedRequestsCostNothing(t *testing.T) {
	const size = 4 << 20 // an arena of its own each
	a, b := pairWith(t, Config{MaxGranted: size}, Config{}, nil)
	ctx := advCtx(t)
	r, err := b.RequestRemoteMR(ctx, size, verbs.AccessRemoteRead, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release(ctx)
	before := a.mem.Stats().Allocs
	for i := range 20 {
		if _, err := b.RequestRemoteMR(ctx, size, verbs.AccessRemoteRead, 0); !errors.Is(err, ErrLimit) {
			t.Fatalf("request %d past MaxGranted: %v, want ErrLimit", i, err)
		}
	}
	if n := a.mem.Stats().Allocs - before; n != 0 {
		t.Fatalf("the granter allocated %d regions for 20 requests it refused", n)
	}
}

// wantConfigRefused checks that Listen, and Dial to a Listener with a
// good configuration, refuse cfg with an error naming field.
func wantConfigRefused(t *testing.T, cfg Config, field string) {
	t.Helper()
	ctx := advCtx(t)
	good, err := Listen(ctx, "127.0.0.1:0", Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	l, err := Listen(ctx, "127.0.0.1:0", cfg)
	if err == nil {
		l.Close()
	}
	if err == nil || !strings.Contains(err.Error(), field) {
		t.Errorf("Listen with %s invalid: %v, want an error naming it", field, err)
	}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		if s, err := good.Accept(actx); err == nil {
			s.Close()
		}
	}()
	s, err := Dial(ctx, good.Addr().String(), cfg)
	if err == nil {
		s.Close()
	}
	if err == nil || !strings.Contains(err.Error(), field) {
		t.Errorf("Dial with %s invalid: %v, want an error naming it", field, err)
	}
}

// TestMessageOverLimit: nothing over 2 GiB (maxMessage, the largest RDMA
// message) goes out. A Config.MaxMessage over it is refused
// (TestAdv2ConfigOverPeerLimits), as is a peer's setup that says more
// (TestSetupValidate), so that a larger Send fails with ErrLimit; a
// Read, Write or WriteImm of more fails with ErrLimit before anything is
// posted, and the session goes on. Before, a Config.MaxMessage of 8 GiB
// was taken, and a SendSlice of 4 GiB + 1 bytes arrived as a message of
// 1 byte (the rendezvous header's length has 32 bits); the slices here
// are made longer in place, not allocated.
func TestMessageOverLimit(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	granted, err := b.Alloc(4096)
	must(t, "alloc", err)
	defer granted.Free()
	_, err = b.SendLocalMR(ctx, granted, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, 0)
	must(t, "grant", err)
	r, err := a.ReceiveRemoteMR(ctx)
	must(t, "receive the grant", err)
	local, err := a.Alloc(4096)
	must(t, "alloc", err)
	defer local.Free()
	big := maxMessage + 1
	rs := r.All()
	rs.n = uint64(big)
	ls := local.All()
	ls.n = big
	for _, tc := range []struct {
		op string
		f  func() error
	}{
		{"read", func() error { return a.Read(ctx, ls, rs) }},
		{"write", func() error { return a.Write(ctx, rs, ls) }},
		{"write with immediate", func() error { return a.WriteImm(ctx, rs, 1, ls) }},
	} {
		if err := tc.f(); !errors.Is(err, ErrLimit) {
			t.Errorf("%s of %d bytes: %v, want ErrLimit", tc.op, big, err)
		}
	}
	if got := a.PeerMaxMessage(); got > maxMessage {
		t.Errorf("PeerMaxMessage() = %d, over %d", got, maxMessage)
	}
	must(t, "a write after them", a.Write(ctx, r.All(), local.All()))
}

// TestReleaseHonoursCtx: Release and SendRemoteMR wait for this side's
// operations on the region, but not past their ctx: with a WriteImm on
// the region in flight (its notice waits for a credit the peer does not
// give back), they return ctx's error, the region is given up all the
// same, and the peer frees what it served once the operation is done.
// Before, they waited for the operation whatever ctx said (quiesce
// watched only the session's end): here for ever.
func TestReleaseHonoursCtx(t *testing.T) {
	forEachGiveUp(t, func(t *testing.T, name string, handBack bool) {
		a, b := pair(t, Config{ReceiveBuffers: 2, MessageSize: 256})
		ctx := advCtx(t)
		r, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, time.Hour)
		must(t, "request", err)
		// b's two credits: a holds the messages, gives none back.
		for range 2 {
			must(t, "send", b.Send(ctx, []byte("x")))
		}
		src, err := b.Alloc(64)
		must(t, "alloc", err)
		defer src.Free()
		wctx, wcancel := context.WithCancel(ctx)
		defer wcancel()
		werr := make(chan error, 1)
		go func() { werr <- b.WriteImm(wctx, r.All(), 7, src.All()) }()
		waitFor(t, ctx, "the WriteImm to be in flight", func() bool { return r.inflight.Load() > 0 })
		rctx, rcancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer rcancel()
		rerr := make(chan error, 1)
		go func() { rerr <- giveUp(rctx, b, r, handBack) }()
		select {
		case err := <-rerr:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s with an operation in flight and its ctx ended: %v, want context.DeadlineExceeded", name, err)
			}
		case <-time.After(hangGuard):
			t.Fatalf("%s with a 50 ms ctx and an operation in flight has not returned in %v", name, hangGuard)
		}
		wcancel()
		if err := <-werr; !errors.Is(err, context.Canceled) {
			t.Errorf("the WriteImm: %v, want context.Canceled", err)
		}
		// The peer takes its messages (the notice was not posted:
		// its wait for a credit ended with wctx); the write is done,
		// and the release goes out.
		for range 2 {
			m, err := a.Receive(ctx)
			must(t, "receive", err)
			m.Release()
		}
		waitGivenUp(t, ctx, a, b, handBack)
	})
}

// TestReceiveDeadlineRacesPeerClose: a Receive whose ctx ends about when
// the peer sends a message and closes returns ctx's error or the
// message, and the session's end only once the message was taken.
// Before, a Receive whose wait ended with its ctx after the session had
// ended (the peer's close came before the message's completion was
// taken) reported the end (ErrPeerClosed), with the message still to
// come: a caller that stopped there lost it (found through package
// stream, whose Read then returned io.EOF: TestDeadlineRacesPeerClose).
func TestReceiveDeadlineRacesPeerClose(t *testing.T) {
	for iter := range 150 {
		a, b := pair(t, Config{})
		delay := time.Duration(iter%15) * 100 * time.Microsecond
		go func() {
			time.Sleep(delay)
			b.Send(context.Background(), []byte("x"))
			b.Close()
		}()
		wait := time.Millisecond
		got := false
		for {
			ctx, cancel := context.WithTimeout(context.Background(), wait)
			m, err := a.Receive(ctx)
			cancel()
			wait = time.Duration(iter%7) * 50 * time.Microsecond
			if err == nil {
				got = true
				m.Release()
				continue
			}
			if errors.Is(err, context.DeadlineExceeded) {
				continue
			}
			if !got {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				m, rerr := a.Receive(ctx)
				cancel()
				if rerr == nil {
					m.Release()
					t.Fatalf("iteration %d: Receive reported the end (%v) before the message the peer sent before it closed, which the next Receive returned", iter, err)
				}
				t.Fatalf("iteration %d: the session ended (%v) without the message the peer sent before it closed (then: %v)", iter, err, rerr)
			}
			if !errors.Is(err, ErrPeerClosed) {
				t.Fatalf("iteration %d: the end: %v, want ErrPeerClosed", iter, err)
			}
			break
		}
		a.Close()
	}
}

// TestAdv2OfferTooLong: an offer of a region longer than an int (or
// wrapping around the address space) is refused: it was queued, and
// ReceiveRemoteMR returned a RemoteMR whose Len was negative.
func TestAdv2OfferTooLong(t *testing.T) {
	for _, tc := range []struct {
		name      string
		addr, len uint64
	}{
		{"2^63 bytes", 4096, 1 << 63},
		{"max uint64", 0, math.MaxUint64},
		{"wrapping", math.MaxUint64 - 10, 4096},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			a.sendAsyncCtrl(ctrlMsg{typ: ctrlOffer, grant: 77, addr: tc.addr, len: tc.len, rkey: 1, access: verbs.AccessRemoteRead, lease: time.Hour})
			// A well-formed offer after it: what ReceiveRemoteMR returns.
			mr, err := a.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			defer mr.Free()
			ctx := advCtx(t)
			if _, err := a.SendLocalMR(ctx, mr, verbs.AccessRemoteRead, time.Hour); err != nil {
				t.Fatal(err)
			}
			r, err := b.ReceiveRemoteMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if r.Len() != 64 {
				t.Fatalf("ReceiveRemoteMR returned a region of %d bytes, want the well-formed offer of 64 (the forged one is refused)", r.Len())
			}
		})
	}
}
