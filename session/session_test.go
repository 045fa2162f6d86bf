package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// pair sets up a session between a Listener and a Dial in this process.
func pair(t testing.TB, cfg Config) (a, b *Session) {
	t.Helper()
	return pairWith(t, cfg, cfg, nil)
}

func TestSendReceiveSizes(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 4096})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, n := range []int{0, 1, 100, 4096, 4097, 1 << 20} {
		data := bytes.Repeat([]byte{byte(n)}, n)
		errc := make(chan error, 1)
		go func() { errc <- a.SendImm(ctx, uint32(n), data) }()
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatalf("%d: %v", n, err)
		}
		if !bytes.Equal(m.Bytes(), data) {
			t.Fatalf("%d: got %d bytes", n, m.Len())
		}
		if imm, ok := m.Imm(); !ok || imm != uint32(n) {
			t.Fatalf("%d: imm %d %v", n, imm, ok)
		}
		m.Release()
		if err := <-errc; err != nil {
			t.Fatalf("%d: send: %v", n, err)
		}
	}
	t.Log(a.Transport(), b.Transport())
}

func TestManyMessagesCredits(t *testing.T) {
	a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 256})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 2000
	errc := make(chan error, 1)
	go func() {
		for i := range n {
			if err := a.Send(ctx, []byte{byte(i), byte(i >> 8)}); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	for i := range n {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(i, err)
		}
		if got := int(m.Bytes()[0]) | int(m.Bytes()[1])<<8; got != i&0xffff {
			t.Fatalf("message %d carries %d", i, got)
		}
		m.Release()
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// TestHeldMessageHoldsCredits: buffers go back to the sender in the order
// their messages came. A message held while those after it are released
// keeps the sender waiting once the others are used again; its release
// frees them all, and nothing is lost or reordered.
func TestHeldMessageHoldsCredits(t *testing.T) {
	const r = 4
	a, b := pair(t, Config{ReceiveBuffers: r, MessageSize: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	recv := func(want byte) Message {
		t.Helper()
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m.Len() != 1 || m.Bytes()[0] != want {
			t.Fatalf("got %v, want message %d", m.Bytes(), want)
		}
		return m
	}
	for i := range r {
		if err := a.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(i, err)
		}
	}
	held := recv(0)
	for i := 1; i < r; i++ {
		recv(byte(i)).Release()
	}
	// Three buffers are free, but behind the held one: no credit.
	short, stop := context.WithTimeout(ctx, 200*time.Millisecond)
	err := a.Send(short, []byte{r})
	stop()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a send with the first buffer held: %v, want the deadline", err)
	}
	held.Release()
	for i := r; i < 2*r; i++ {
		if err := a.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(i, err)
		}
	}
	for i := r; i < 2*r; i++ {
		recv(byte(i)).Release()
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatal(a.Err(), b.Err())
	}
}

// TestRemoteMemory: requested and offered regions, their bounds, access
// and leases, with the agents sleeping at once and with AgentSpin.
func TestRemoteMemory(t *testing.T) {
	for _, spin := range []bool{false, true} {
		t.Run(fmt.Sprintf("AgentSpin=%v", spin), func(t *testing.T) { testRemoteMemory(t, Config{AgentSpin: spin}) })
	}
}

func testRemoteMemory(t *testing.T, cfg Config) {
	a, b := pair(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	r, err := b.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteRead|verbs.AccessRemoteWrite|verbs.AccessRemoteAtomic, 0)
	if err != nil {
		t.Fatal(err)
	}
	loc, err := b.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	copy(loc.Bytes(), "hello, server")
	if err := b.Write(ctx, r.All(), loc.All()); err != nil {
		t.Fatal(err)
	}
	w, _ := r.Slice(8, 8)
	if v, err := b.FetchAdd(ctx, w, 5); err != nil || v == 0 {
		t.Fatal(v, err)
	}
	bad, _ := r.Slice(4, 8)
	if _, err := b.FetchAdd(ctx, bad, 1); !errors.Is(err, ErrMisaligned) {
		t.Fatal(err)
	}
	if _, err := r.Slice(4000, 200); !errors.Is(err, ErrOutOfBounds) {
		t.Fatal(err)
	}
	if err := b.SendRemoteMR(ctx, r); err != nil {
		t.Fatal(err)
	}
	back, err := a.ReceiveLocalMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(back.Bytes()[:5]); got != "hello" {
		t.Fatalf("server reads %q", back.Bytes()[:16])
	}
	back.Free()
	if err := b.Write(ctx, r.All(), loc.All()); !errors.Is(err, ErrLeaseExpired) {
		t.Fatal(err)
	}
	// offer of a local region without remote write
	mine, _ := a.Alloc(64)
	copy(mine.Bytes(), "read me")
	g, err := a.SendLocalMR(ctx, mine, verbs.AccessRemoteRead, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	rr, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dst, _ := loc.Slice(0, 64)
	if err := b.Read(ctx, dst, rr.All()); err != nil {
		t.Fatal(err)
	}
	if string(dst.Bytes()[:7]) != "read me" {
		t.Fatalf("%q", dst.Bytes()[:7])
	}
	if err := b.Write(ctx, rr.All(), dst); !errors.Is(err, ErrAccess) {
		t.Fatal(err)
	}
	if err := g.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Read(ctx, dst, rr.All()); !errors.Is(err, ErrLeaseExpired) {
		t.Fatal(err)
	}
}

func TestCloseReportsPeerClosed(t *testing.T) {
	a, b := pair(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { _, err := b.Receive(ctx); errc <- err }()
	a.Close()
	if err := <-errc; !errors.Is(err, ErrPeerClosed) {
		t.Fatal(err)
	}
	<-b.Done()
	if !errors.Is(b.Err(), ErrPeerClosed) {
		t.Fatal(b.Err())
	}
}

// TestReleaseTwice releases every message twice at once: each buffer is
// posted again once (the queue holds every buffer once, no more).
func TestReleaseTwice(t *testing.T) {
	a, b := pair(t, Config{ReceiveBuffers: 8, MessageSize: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := range 200 {
		if err := a.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m.Bytes()[0] != byte(i) {
			t.Fatalf("message %d carries %d", i, m.Bytes()[0])
		}
		done := make(chan struct{})
		go func() { m.Release(); close(done) }()
		m.Release()
		<-done
		if m.Bytes() != nil {
			t.Fatal("a released message still has bytes")
		}
		b.rmu.Lock()
		n := len(b.fifo)
		b.rmu.Unlock()
		if n != 8 {
			t.Fatalf("round %d: %d receive buffers posted, want 8", i, n)
		}
	}
}
