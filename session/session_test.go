package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

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

// TestEagerLayout: a message of up to MessageSize bytes travels eager,
// into a ring slot, whether sent as bytes (Send) or from a region
// (SendSlice), with its payload on a cache line (payOff), where a
// provider's copy is fastest; one byte more goes by rendezvous.
func TestEagerLayout(t *testing.T) {
	const size = 4096
	a, b := pair(t, Config{MessageSize: size})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	region, err := a.Alloc(size + 1)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Free()
	for i := range region.Bytes() {
		region.Bytes()[i] = byte(i * 7)
	}
	for _, tc := range []struct {
		name  string
		n     int
		slice bool
		eager bool
	}{
		{"Send 1", 1, false, true},
		{"Send MessageSize", size, false, true},
		{"Send MessageSize+1", size + 1, false, false},
		{"SendSlice 1", 1, true, true},
		{"SendSlice MessageSize", size, true, true},
		{"SendSlice MessageSize+1", size + 1, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := region.Bytes()[:tc.n]
			errc := make(chan error, 1)
			go func() {
				if tc.slice {
					sl, _ := region.Slice(0, tc.n)
					errc <- a.SendSlice(ctx, sl, 0, false)
					return
				}
				errc <- a.Send(ctx, data)
			}()
			m, err := b.Receive(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Release()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(m.Bytes(), data) {
				t.Fatalf("got %d bytes, not the %d sent", m.Len(), tc.n)
			}
			if eager := m.slot >= 0; eager != tc.eager {
				t.Fatalf("eager %v, want %v", eager, tc.eager)
			}
			if p := uintptr(unsafe.Pointer(&m.Bytes()[0])); tc.eager && p%64 != 0 {
				t.Fatalf("the payload is at %#x, not on a cache line", p)
			}
		})
	}
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

// TestReceiveInto copies messages out, eager and by rendezvous, with and
// without immediate data. A destination too small is an error that says
// the sizes and loses nothing: the message stays for the next Receive or
// ReceiveInto.
func TestReceiveInto(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 256})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	big := bytes.Repeat([]byte("rendezvous"), 100) // over MessageSize
	cases := []struct {
		name    string
		data    []byte
		imm     uint32
		hasImm  bool
		short   int // a first ReceiveInto into this many bytes fails (0: none)
		thenGet bool
	}{
		{name: "eager", data: []byte("hello")},
		{name: "eager with immediate", data: []byte("hi"), imm: 7, hasImm: true},
		{name: "empty", data: []byte{}},
		{name: "eager, short first", data: []byte("hello"), short: 4},
		{name: "eager, short first, then Receive", data: []byte("held"), short: 1, thenGet: true},
		{name: "rendezvous", data: big, imm: 9, hasImm: true},
		{name: "rendezvous, short first", data: big, short: 256},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			errc := make(chan error, 1)
			go func() {
				if tc.hasImm {
					errc <- a.SendImm(ctx, tc.imm, tc.data)
				} else {
					errc <- a.Send(ctx, tc.data)
				}
			}()
			if tc.short > 0 {
				dst := make([]byte, tc.short)
				_, _, _, err := b.ReceiveInto(ctx, dst)
				if !errors.Is(err, io.ErrShortBuffer) {
					t.Fatalf("into %d bytes: %v, want io.ErrShortBuffer", tc.short, err)
				}
				if want := fmt.Sprintf("%d bytes into %d", len(tc.data), tc.short); !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
			var got []byte
			var imm uint32
			var hasImm bool
			if tc.thenGet {
				m, err := b.Receive(ctx)
				if err != nil {
					t.Fatal(err)
				}
				got = append([]byte(nil), m.Bytes()...)
				imm, hasImm = m.Imm()
				m.Release()
			} else {
				dst := make([]byte, len(tc.data)+10)
				n, i, ok, err := b.ReceiveInto(ctx, dst)
				if err != nil {
					t.Fatal(err)
				}
				got, imm, hasImm = dst[:n], i, ok
			}
			if !bytes.Equal(got, tc.data) || imm != tc.imm || hasImm != tc.hasImm {
				t.Fatalf("got %d bytes, imm %d %v; want %d bytes, imm %d %v", len(got), imm, hasImm, len(tc.data), tc.imm, tc.hasImm)
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
		})
	}
	// Every buffer went back: as many messages again as there are
	// buffers go through.
	for i := range 2 * 64 {
		if err := a.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		var one [1]byte
		if n, _, _, err := b.ReceiveInto(ctx, one[:]); err != nil || n != 1 || one[0] != byte(i) {
			t.Fatalf("message %d: %d %v %v", i, n, one, err)
		}
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

// TestSendRegion grants part of a region the caller registered itself:
// bad bounds or access are errors before anything reaches the peer; the
// peer reads and writes exactly the part granted, with the access
// granted, and nothing after a revoke.
func TestSendRegion(t *testing.T) {
	a, b := pair(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	mr, err := a.pd.Alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteRead|verbs.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		// The grants are over: the region is the caller's alone.
		if err := mr.Close(); err != nil {
			t.Error(err)
		}
	}()
	rw := verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	for _, tc := range []struct {
		name   string
		mr     *verbs.MemoryRegion
		off, n int
		access verbs.Access
		want   error
	}{
		{"no region", nil, 0, 16, rw, ErrAccess},
		{"negative offset", mr, -1, 16, rw, ErrOutOfBounds},
		{"no bytes", mr, 0, 0, rw, ErrOutOfBounds},
		{"past the end", mr, 4000, 100, rw, ErrOutOfBounds},
		{"local access only", mr, 0, 16, verbs.AccessLocalWrite, ErrAccess},
	} {
		if g, err := a.SendRegion(ctx, tc.mr, tc.off, tc.n, tc.access, time.Minute); !errors.Is(err, tc.want) || g != nil {
			t.Errorf("%s: %v, %v; want %v", tc.name, g, err, tc.want)
		}
	}
	copy(mr.Bytes()[1024:], "granted part")
	g, err := a.SendRegion(ctx, mr, 1024, 64, verbs.AccessRemoteRead, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	r, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Len() != 64 {
		t.Fatalf("the peer got %d bytes", r.Len())
	}
	loc, err := b.Alloc(128)
	if err != nil {
		t.Fatal(err)
	}
	defer loc.Free()
	dst, _ := loc.Slice(0, 64)
	if err := b.Read(ctx, dst, r.All()); err != nil {
		t.Fatal(err)
	}
	if got := string(dst.Bytes()[:12]); got != "granted part" {
		t.Fatalf("the peer read %q", got)
	}
	if _, err := r.Slice(0, 65); !errors.Is(err, ErrOutOfBounds) {
		t.Errorf("a slice past the grant: %v", err)
	}
	if err := b.Write(ctx, r.All(), dst); !errors.Is(err, ErrAccess) {
		t.Errorf("a write into a read-only grant: %v", err)
	}
	if err := g.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.Read(ctx, dst, r.All()); !errors.Is(err, ErrLeaseExpired) {
		t.Errorf("a read after the revoke: %v", err)
	}
	// Written by the peer: the bytes land in the granted part only.
	g, err = a.SendRegion(ctx, mr, 2048, 16, verbs.AccessRemoteWrite, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Revoke(ctx)
	if r, err = b.ReceiveRemoteMR(ctx); err != nil {
		t.Fatal(err)
	}
	src, _ := loc.Slice(0, 16)
	copy(src.Bytes(), "sixteen bytes ok")
	if err := b.Write(ctx, r.All(), src); err != nil {
		t.Fatal(err)
	}
	if got := string(mr.Bytes()[2048:2064]); got != "sixteen bytes ok" {
		t.Fatalf("the region holds %q", got)
	}
	if mr.Bytes()[2047] != 0 || mr.Bytes()[2064] != 0 {
		t.Fatal("a write went past the granted part")
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

// TestPendingUsedAfterEnd: a Pending waited for (or released) already
// says so, with an error wrapping ErrClosed, also once the session has
// ended and been closed, as its doc says; before, a second Wait after the
// peer's Close and this side's returned the session's end, ErrPeerClosed,
// as if the message had not been waited for (TestAdvCloseDuringTraffic
// saw it once in a CI rehearsal).
func TestPendingUsedAfterEnd(t *testing.T) {
	for _, first := range []string{"wait", "release"} {
		t.Run(first, func(t *testing.T) {
			a, b := pair(t, Config{})
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			r, err := a.Alloc(64)
			if err != nil {
				t.Fatal(err)
			}
			p, err := a.PostSendSlice(ctx, r.All(), 0, false)
			if err != nil {
				t.Fatal(err)
			}
			if first == "wait" {
				if err := p.Wait(ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				p.Release()
			}
			b.Close()
			<-a.Done()
			a.Close()
			if err := p.Wait(ctx); !errors.Is(err, ErrClosed) || errors.Is(err, ErrPeerClosed) {
				t.Fatalf("Wait after %s and the peer's Close: %v, want ErrClosed (the Pending was used)", first, err)
			}
		})
	}
}

// TestRendezvousNoMemory: a message the receiver has no memory for (its
// allocator's MaxMemory) is dropped, both sides are told, and the session
// goes on: the receiver's Receive and the sender's Send fail with errors
// wrapping ErrLimit, and the next messages, small and large, arrive.
// Before, the receiver ended the session with a protocol error.
func TestRendezvousNoMemory(t *testing.T) {
	small := AllocatorConfig{ArenaSize: 1 << 20, MaxMemory: 4 << 20}
	a, b := pairWith(t, Config{Allocator: small}, Config{}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	big := bytes.Repeat([]byte("big!"), 2<<20) // 8 MiB: more than a can hold
	sent := make(chan error, 1)
	go func() { sent <- b.Send(ctx, big) }()
	_, err := a.Receive(ctx)
	if !errors.Is(err, ErrLimit) {
		t.Fatalf("receiving a message larger than MaxMemory: %v, want ErrLimit", err)
	}
	t.Logf("receiver: %v", err)
	if err := <-sent; !errors.Is(err, ErrLimit) {
		t.Fatalf("sending it: %v, want ErrLimit", err)
	} else {
		t.Logf("sender: %v", err)
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatalf("the session ended: %v, %v", a.Err(), b.Err())
	}
	for _, n := range []int{5, 1 << 20} { // eager, then rendezvous
		msg := bytes.Repeat([]byte{byte(n)}, n)
		go func() { sent <- b.Send(ctx, msg) }()
		m, err := a.Receive(ctx)
		if err != nil {
			t.Fatalf("a message of %d bytes after the dropped one: %v", n, err)
		}
		if !bytes.Equal(m.Bytes(), msg) {
			t.Fatalf("a message of %d bytes arrived as %d bytes", n, m.Len())
		}
		m.Release()
		if err := <-sent; err != nil {
			t.Fatalf("sending %d bytes: %v", n, err)
		}
	}
}

// TestDialErrorSaysOnce: a Dial that fails names the call and the
// address once ("session: dial ADDR: ..."); it said it twice.
func TestDialErrorSaysOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nobody listens there now
	_, err = Dial(context.Background(), addr, Config{HandshakeTimeout: time.Second})
	if err == nil {
		t.Fatal("Dial to a closed port succeeded")
	}
	if n := strings.Count(err.Error(), "dial "+addr); n != 1 {
		t.Fatalf("the error names the dial %d times: %v", n, err)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("%v: want ECONNREFUSED wrapped", err)
	}
}

// TestQueueDepth: a session reports its own Config.QueueDepth, the
// default for 0.
func TestQueueDepth(t *testing.T) {
	for _, tc := range []struct{ set, want int }{{0, defaultQueueDepth}, {5, 5}} {
		a, b := pair(t, Config{QueueDepth: tc.set})
		if a.QueueDepth() != tc.want || b.QueueDepth() != tc.want {
			t.Errorf("QueueDepth %d: the sessions report %d and %d, want %d", tc.set, a.QueueDepth(), b.QueueDepth(), tc.want)
		}
	}
}
