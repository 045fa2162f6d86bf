package session

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"testing"
	"time"
)

// TestPostSendSlice: one goroutine keeps a window of posted messages in
// flight (many more in all than the queue holds, and a rendezvous one
// among them), and the peer receives every message whole, in order,
// with its immediate data.
func TestPostSendSlice(t *testing.T) {
	cfg := Config{MessageSize: 4096, QueueDepth: 16, ReceiveBuffers: 8}
	a, b := pair(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const n, window = 100, 12
	sizes := func(i int) int {
		switch {
		case i == 50:
			return 3 * 4096 // larger than the receive buffers: rendezvous
		case i%7 == 0:
			return 0
		}
		return 1 + i*37%4000
	}
	bufs := make([]LocalMR, window)
	for i := range bufs {
		var err error
		if bufs[i], err = a.Alloc(3 * 4096); err != nil {
			t.Fatal(err)
		}
		defer bufs[i].Free()
	}
	got := make(chan error, 1)
	go func() {
		for i := range n {
			m, err := b.Receive(ctx)
			if err != nil {
				got <- err
				return
			}
			want := bytes.Repeat([]byte{byte(i)}, sizes(i))
			imm, ok := m.Imm()
			if !bytes.Equal(m.Bytes(), want) || !ok || imm != uint32(i) {
				got <- errors.New("message " + strconv.Itoa(i) + ": wrong bytes or immediate")
				m.Release()
				return
			}
			m.Release()
		}
		got <- nil
	}()
	var ring [window]Pending
	for i := range n + window {
		if i >= window {
			if err := ring[i%window].Wait(ctx); err != nil {
				t.Fatalf("wait for message %d: %v", i-window, err)
			}
		}
		if i < n {
			buf := bufs[i%window]
			copy(buf.Bytes(), bytes.Repeat([]byte{byte(i)}, sizes(i)))
			sl, err := buf.Slice(0, sizes(i))
			if err != nil {
				t.Fatal(err)
			}
			if ring[i%window], err = a.PostSendSlice(ctx, sl, uint32(i), true); err != nil {
				t.Fatalf("post message %d: %v", i, err)
			}
		}
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// TestPendingOnce: a Pending is waited for (or released) once; a copy
// used again reports ErrClosed and gives nothing back twice; released
// Pendings give their queue room back (posting a queue's worth more
// after releasing a queue's worth never waits for room); the zero
// Pending is done.
func TestPendingOnce(t *testing.T) {
	cfg := Config{MessageSize: 4096, QueueDepth: 8, ReceiveBuffers: 64}
	a, b := pair(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := (Pending{}).Wait(ctx); err != nil {
		t.Fatalf("the zero Pending: %v", err)
	}
	(Pending{}).Release()
	buf, err := a.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	p, err := a.PostSendSlice(ctx, buf.All(), 0, false)
	if err != nil {
		t.Fatal(err)
	}
	again := p
	if err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := again.Wait(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("a second Wait: %v, want ErrClosed", err)
	}
	again.Release() // does nothing
	received := 1
	// A queue's worth released without waiting, then a queue's worth
	// more: each post needs an op token, which only the released
	// Pendings' completions give back.
	for round := range 3 {
		var ps [8]Pending
		for i := range ps {
			if ps[i], err = a.PostSendSlice(ctx, buf.All(), 0, false); err != nil {
				t.Fatalf("round %d, post %d: %v", round, i, err)
			}
		}
		for _, p := range ps {
			p.Release()
		}
		// Take them in, so that the credits come back too.
		for range ps {
			m, err := b.Receive(ctx)
			if err != nil {
				t.Fatal(err)
			}
			m.Release()
			received++
		}
	}
	if received != 25 {
		t.Fatalf("received %d messages", received)
	}
	// Every op token came back: the queue takes QueueDepth at once.
	var ps [8]Pending
	for i := range ps {
		post, cancelPost := context.WithTimeout(ctx, hangGuard)
		ps[i], err = a.PostSendSlice(post, buf.All(), 0, false)
		cancelPost()
		if err != nil {
			t.Fatalf("post %d of a full queue's worth after the releases: %v", i, err)
		}
	}
	for _, p := range ps {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPostSendSliceAllocatesNothing: posting a message and waiting for
// it allocates nothing (the Pending's record is one of the session's).
func TestPostSendSliceAllocatesNothing(t *testing.T) {
	cfg := Config{MessageSize: 4096, QueueDepth: 16, ReceiveBuffers: 64}
	a, b := pair(t, cfg)
	ctx := context.Background()
	buf, err := a.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	sl := buf.All()
	round := func() {
		p, err := a.PostSendSlice(ctx, sl, 7, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		m.Release()
	}
	for range 200 {
		round()
	}
	if n := testing.AllocsPerRun(1000, round); n != 0 {
		t.Fatalf("%v allocations per posted message", n)
	}
}
