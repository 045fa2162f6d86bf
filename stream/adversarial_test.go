package stream

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/internal/testproc"
	"github.com/goverbs/verbs/session"
)

// hangGuard bounds every wait of these tests for a call that should
// return: a guard against a hang, never a performance bound.
const hangGuard = 60 * time.Second

// advPipe is pipe for the tests here: the streams as *Conn, closed
// (with the listener) when t ends.
func advPipe(t *testing.T, lcfg, dcfg session.Config) (c1, c2 *Conn) {
	t.Helper()
	a, b, stop, err := pipeWith(lcfg, dcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return a.(*Conn), b.(*Conn)
}

// await runs f in a goroutine and returns a channel that gets its error.
func await(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

// accepted is what an AcceptContext returned.
type accepted struct {
	c   *Conn
	err error
}

// acceptLater runs l.AcceptContext(ctx) in a goroutine; the channel gives
// its result.
func acceptLater(ctx context.Context, l *Listener) <-chan accepted {
	ch := make(chan accepted, 1)
	go func() { c, err := l.AcceptContext(ctx); ch <- accepted{c, err} }()
	return ch
}

// wait returns what ch gives, failing the test if nothing comes within
// hangGuard (what says what hung).
func wait[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	timer := time.NewTimer(hangGuard)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("%s: no return within %v (hung)", what, hangGuard)
		panic("unreachable")
	}
}

// settle gives a goroutine just started a moment to block in its call.
// Nothing depends on it for correctness: a test passes either way, it
// only makes the interesting interleaving (the call already blocked)
// the likely one.
func settle() { time.Sleep(20 * time.Millisecond) }

// isTimeout reports whether err is a deadline's error as a socket's.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() && errors.Is(err, os.ErrDeadlineExceeded)
}

// readN reads exactly n bytes of c (under a hang guard).
func readN(t *testing.T, c *Conn, n int) []byte {
	t.Helper()
	type res struct {
		b   []byte
		err error
	}
	ch := make(chan res, 1)
	go func() {
		b := make([]byte, n)
		_, err := io.ReadFull(c, b)
		ch <- res{b, err}
	}()
	r := wait(t, ch, "reading")
	if r.err != nil {
		t.Fatalf("reading %d bytes: %v", n, r.err)
	}
	return r.b
}

// TestAdvDeadlineContexts drives the deadline type directly: a context
// taken before a sequence of moves must be live or ended as a socket's
// deadline would be (a deadline cleared and set again in the future
// must not end the calls already waiting).
func TestAdvDeadlineContexts(t *testing.T) {
	future := func() time.Time { return time.Now().Add(time.Hour) }
	past := func() time.Time { return time.Now().Add(-time.Second) }
	zero := func() time.Time { return time.Time{} }
	for _, tc := range []struct {
		name   string
		before []func() time.Time // sets before the context is taken
		after  []func() time.Time // sets after
		live   bool               // the context taken is live after them
	}{
		{"none", nil, nil, true},
		{"future", []func() time.Time{future}, nil, true},
		{"future, moved", []func() time.Time{future}, []func() time.Time{future}, true},
		{"future, cleared", []func() time.Time{future}, []func() time.Time{zero}, true},
		{"future, cleared, future", []func() time.Time{future}, []func() time.Time{zero, future}, true},
		{"future, cleared twice, future", []func() time.Time{future}, []func() time.Time{zero, zero, future}, true},
		{"none, cleared, future", nil, []func() time.Time{zero, future}, true},
		{"past", []func() time.Time{past}, nil, false},
		{"future, past", []func() time.Time{future}, []func() time.Time{past}, false},
		{"future, past, future", []func() time.Time{future}, []func() time.Time{past, future}, false},
		{"cleared, past", []func() time.Time{zero}, []func() time.Time{past}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d deadline
			defer d.end()
			for _, at := range tc.before {
				d.set(at())
			}
			ctx := d.context()
			for _, at := range tc.after {
				d.set(at())
			}
			if live := ctx.Err() == nil; live != tc.live {
				t.Fatalf("the context is live: %v, want %v", live, tc.live)
			}
			// Whatever came before, the current context is live after a
			// future deadline and ended after a past one.
			d.set(future())
			if err := d.context().Err(); err != nil {
				t.Fatalf("after a future deadline: %v", err)
			}
			d.set(past())
			if d.context().Err() == nil {
				t.Fatal("after a past deadline: live")
			}
		})
	}
}

// TestAdvDeadlineMovedWhileBlocked: a Read (or a Write held by flow
// control) already blocked when its deadline is set in the future,
// cleared and set in the future again must not time out: it returns the
// bytes when they come (or posts all of its bytes once the peer reads).
func TestAdvDeadlineMovedWhileBlocked(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 256}
	for _, tc := range []struct {
		name string
		set  func(c *Conn, t time.Time) error
	}{
		{"SetDeadline", (*Conn).SetDeadline},
		{"SetReadDeadline/SetWriteDeadline", nil},
	} {
		t.Run("read/"+tc.name, func(t *testing.T) {
			c1, c2 := advPipe(t, cfg, cfg)
			set := tc.set
			if set == nil {
				set = (*Conn).SetReadDeadline
			}
			type res struct {
				n   int
				err error
				b   []byte
			}
			ch := make(chan res, 1)
			go func() {
				b := make([]byte, 16)
				n, err := c2.Read(b)
				ch <- res{n, err, b[:n]}
			}()
			settle()
			for _, at := range []time.Time{time.Now().Add(time.Hour), {}, time.Now().Add(time.Hour), time.Now().Add(2 * time.Hour)} {
				if err := set(c2, at); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c1.Write([]byte("hello")); err != nil {
				t.Fatal(err)
			}
			r := wait(t, ch, "Read")
			if r.err != nil || string(r.b) != "hello" {
				t.Fatalf("Read: %q, %v; want \"hello\"", r.b, r.err)
			}
		})
		t.Run("write/"+tc.name, func(t *testing.T) {
			c1, c2 := advPipe(t, cfg, cfg)
			set := tc.set
			if set == nil {
				set = (*Conn).SetWriteDeadline
			}
			want := pattern(64 << 10) // far more than 4 buffers of 256 bytes
			type res struct {
				n   int
				err error
			}
			ch := make(chan res, 1)
			go func() {
				n, err := c1.Write(want)
				ch <- res{n, err}
			}()
			settle()
			for _, at := range []time.Time{time.Now().Add(time.Hour), {}, time.Now().Add(time.Hour)} {
				if err := set(c1, at); err != nil {
					t.Fatal(err)
				}
			}
			type read struct {
				b   []byte
				err error
			}
			rch := make(chan read, 1)
			go func() {
				b := make([]byte, len(want))
				_, err := io.ReadFull(c2, b)
				rch <- read{b, err}
			}()
			r := wait(t, ch, "Write")
			if r.err != nil || r.n != len(want) {
				t.Fatalf("Write: %d, %v; want %d, nil", r.n, r.err, len(want))
			}
			got := wait(t, rch, "reading")
			if got.err != nil || !bytes.Equal(got.b, want) {
				t.Fatal("the bytes read are not those written")
			}
		})
	}
}

// TestAdvDeadlinePastWhileBlocked: a blocked Read or Write whose deadline
// is moved into the past returns a timeout (net.Error, Timeout,
// os.ErrDeadlineExceeded); with the deadline cleared the Conn goes on
// and nothing was lost or duplicated: the peer reads exactly the bytes
// the timed-out Write said it posted, then the next Write's.
func TestAdvDeadlinePastWhileBlocked(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 256}
	t.Run("read", func(t *testing.T) {
		c1, c2 := advPipe(t, cfg, cfg)
		ch := await(func() error { _, err := c2.Read(make([]byte, 8)); return err })
		settle()
		c2.SetReadDeadline(time.Now().Add(-time.Second))
		if err := wait(t, ch, "Read"); !isTimeout(err) {
			t.Fatalf("Read: %v, want a timeout", err)
		}
		// Again at once: still past.
		if n, err := c2.Read(make([]byte, 8)); n != 0 || !isTimeout(err) {
			t.Fatalf("Read with the deadline past: %d, %v", n, err)
		}
		c2.SetReadDeadline(time.Time{})
		c1.Write([]byte("after"))
		if got := readN(t, c2, 5); string(got) != "after" {
			t.Fatalf("read %q", got)
		}
	})
	for run := range 5 {
		t.Run(fmt.Sprintf("write/%d", run), func(t *testing.T) {
			c1, c2 := advPipe(t, cfg, cfg)
			p := pattern(256 << 10)
			type res struct {
				n   int
				err error
			}
			ch := make(chan res, 1)
			go func() {
				n, err := c1.Write(p)
				ch <- res{n, err}
			}()
			time.Sleep(time.Duration(run) * 5 * time.Millisecond)
			c1.SetWriteDeadline(time.Now().Add(-time.Second))
			r := wait(t, ch, "Write")
			if !isTimeout(r.err) || r.n < 0 || r.n >= len(p) {
				t.Fatalf("Write: %d, %v; want fewer than %d bytes and a timeout", r.n, r.err, len(p))
			}
			if n, err := c1.Write([]byte("x")); n != 0 || !isTimeout(err) {
				t.Fatalf("Write with the deadline past: %d, %v", n, err)
			}
			c1.SetWriteDeadline(time.Time{})
			tail := []byte("--the end--")
			wch := await(func() error { _, err := c1.Write(tail); return err })
			got := readN(t, c2, r.n+len(tail))
			if err := wait(t, wch, "Write"); err != nil {
				t.Fatal(err)
			}
			want := append(append([]byte{}, p[:r.n]...), tail...)
			if !bytes.Equal(got, want) {
				t.Fatalf("the peer read %d bytes that are not the %d posted and the tail", len(got), r.n)
			}
		})
	}
}

// TestAdvTimeoutsLoseNothing: a writer whose every Write has a deadline
// a millisecond away (retrying the rest after each timeout) and a reader
// whose every Read has one too (retrying after each) move 2 MiB
// whole and in order: a timed-out Read loses nothing, a timed-out Write
// posted exactly the bytes it reported.
func TestAdvTimeoutsLoseNothing(t *testing.T) {
	c1, c2 := advPipe(t, session.Config{ReceiveBuffers: 4, MessageSize: 1024}, session.Config{ReceiveBuffers: 4, MessageSize: 1024})
	want := make([]byte, 2<<20)
	for i := range want {
		want[i] = byte(rand.N(256))
	}
	var timeouts atomic.Int64
	wrote := await(func() error {
		for b := want; len(b) > 0; {
			k := min(len(b), 1+rand.N(8<<10))
			c1.SetWriteDeadline(time.Now().Add(time.Duration(rand.N(300)) * time.Microsecond))
			n, err := c1.Write(b[:k])
			if err != nil {
				timeouts.Add(1)
			}
			b = b[n:]
			if err != nil && !isTimeout(err) {
				return err
			}
			if err == nil && n != k {
				return fmt.Errorf("Write: %d of %d bytes and no error", n, k)
			}
		}
		c1.SetWriteDeadline(time.Time{})
		return c1.CloseWrite()
	})
	var got bytes.Buffer
	buf := make([]byte, 3000)
	done := make(chan error, 1)
	go func() {
		for {
			c2.SetReadDeadline(time.Now().Add(time.Duration(rand.N(300)) * time.Microsecond))
			n, err := c2.Read(buf[:1+rand.N(len(buf))])
			if err != nil {
				timeouts.Add(1)
			}
			got.Write(buf[:n])
			if n > 0 && err != nil {
				done <- fmt.Errorf("Read: %d bytes and %v", n, err)
				return
			}
			if err == io.EOF {
				done <- nil
				return
			}
			if err != nil && !isTimeout(err) {
				done <- err
				return
			}
		}
	}()
	if err := wait(t, done, "reading"); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, wrote, "writing"); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatalf("read %d bytes that are not the %d written", got.Len(), len(want))
	}
	t.Logf("%d calls timed out", timeouts.Load())
}

// readAll reads c until an error (under a hang guard) and returns the
// bytes and the error (io.EOF, not nil, at the end).
func readAll(t *testing.T, c *Conn, bufSize int) ([]byte, error) {
	t.Helper()
	type res struct {
		b   []byte
		err error
	}
	ch := make(chan res, 1)
	go func() {
		var got bytes.Buffer
		buf := make([]byte, bufSize)
		for {
			n, err := c.Read(buf)
			got.Write(buf[:n])
			if err != nil {
				ch <- res{got.Bytes(), err}
				return
			}
		}
	}()
	r := wait(t, ch, "reading to the end")
	return r.b, r.err
}

// TestAdvMessageLimits: Writes far larger than the peer's MessageSize
// and MaxMessage reach the peer whole: the stream cuts them into
// messages the peer takes, whatever its configuration (a MaxMessage
// below MessageSize included: MaxMessage bounds every message the peer
// accepts), and Reads of any size get them.
func TestAdvMessageLimits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lcfg  session.Config // the listener's: the reader's
		write int
		read  int
	}{
		{"defaults, 8 MiB, huge reads", session.Config{}, 8 << 20, 16 << 20},
		{"256-byte buffers, 1-byte reads", session.Config{ReceiveBuffers: 4, MessageSize: 256}, 20 << 10, 1},
		{"MaxMessage 1 MiB", session.Config{MaxMessage: 1 << 20}, 3 << 20, 100_000},
		{"MaxMessage below MessageSize", session.Config{MaxMessage: 1000}, 100_000, 4096},
		{"MaxMessage 1", session.Config{MaxMessage: 1, ReceiveBuffers: 8, MessageSize: 256}, 3000, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := advPipe(t, tc.lcfg, session.Config{})
			// r is the listener's side, w the dialer's (pipe returns the
			// dialed Conn first).
			if mm := tc.lcfg.MaxMessage; mm > 0 && mm < w.chunk || w.chunk < 1 {
				t.Errorf("the writer cuts messages of %d bytes; the peer takes at most %d", w.chunk, mm)
			} else if mm > 0 && mm < w.s.PeerMessageSize() && w.chunk != mm {
				t.Errorf("the writer cuts messages of %d bytes, want the peer's MaxMessage %d, not less", w.chunk, mm)
			}
			want := pattern(tc.write)
			wrote := await(func() error {
				n, err := w.Write(want)
				if err == nil && n != len(want) {
					err = fmt.Errorf("Write: %d of %d bytes and no error", n, len(want))
				}
				if err == nil {
					err = w.CloseWrite()
				}
				if err != nil {
					w.Close() // the reader's end
				}
				return err
			})
			got, err := readAll(t, r, tc.read)
			if werr := wait(t, wrote, "Write"); werr != nil {
				t.Fatalf("Write: %v", werr)
			}
			if err != io.EOF {
				t.Fatalf("Read: %v after %d bytes, want io.EOF", err, len(got))
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("read %d bytes that are not the %d written", len(got), len(want))
			}
		})
	}
}

// TestAdvSmallAllocator: a writer whose allocator can hold fewer bytes
// than the stream keeps in flight (its MaxMemory) still writes: the
// stream waits for the messages in flight, which frees their copies,
// instead of failing the Write (and every later one) with ErrLimit.
func TestAdvSmallAllocator(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  session.Config // the writer's
	}{
		{"1 MiB arenas, 2 MiB", session.Config{Allocator: session.AllocatorConfig{ArenaSize: 1 << 20, MaxMemory: 2 << 20}}},
		{"256 KiB arenas, 1 MiB", session.Config{Allocator: session.AllocatorConfig{ArenaSize: 256 << 10, MaxMemory: 1 << 20}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := advPipe(t, session.Config{}, tc.cfg) // w dialed, with tc.cfg
			want := pattern(16 << 20)
			wrote := await(func() error {
				n, err := w.Write(want)
				if err == nil && n != len(want) {
					err = fmt.Errorf("Write: %d of %d bytes and no error", n, len(want))
				}
				if err == nil {
					err = w.CloseWrite()
				}
				if err != nil {
					w.Close() // the reader's end
				}
				return err
			})
			got, err := readAll(t, r, 1<<20)
			if werr := wait(t, wrote, "Write"); werr != nil {
				t.Fatalf("Write: %v (stats %+v)", werr, w.Session().Allocator().Stats())
			}
			if err != io.EOF || !bytes.Equal(got, want) {
				t.Fatalf("read %d bytes of %d, then %v", len(got), len(want), err)
			}
		})
	}
}

// TestAdvCloseUnblocks: Close unblocks every call blocked on the Conn
// (a Read waiting for data, a Write and a CloseWrite waiting for the
// peer's credits, a Read and a Write queued behind them): each returns
// an error wrapping net.ErrClosed, not io.EOF; the peer reads a prefix
// of what was written, then io.EOF.
func TestAdvCloseUnblocks(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 256}
	for _, tc := range []struct {
		name  string
		calls func(c *Conn) []func() error
	}{
		{"Read", func(c *Conn) []func() error {
			return []func() error{func() error { _, err := c.Read(make([]byte, 8)); return err }}
		}},
		{"Reads", func(c *Conn) []func() error {
			r := func() error { _, err := c.Read(make([]byte, 8)); return err }
			return []func() error{r, r, r}
		}},
		{"Write", func(c *Conn) []func() error {
			return []func() error{func() error { _, err := c.Write(pattern(1 << 20)); return err }}
		}},
		{"Writes, CloseWrite and a Read", func(c *Conn) []func() error {
			w := func() error { _, err := c.Write(pattern(1 << 20)); return err }
			return []func() error{w, w, c.CloseWrite, func() error { _, err := c.Read(make([]byte, 8)); return err }}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c1, c2 := advPipe(t, cfg, cfg)
			var chs []<-chan error
			for _, f := range tc.calls(c1) {
				chs = append(chs, await(f))
			}
			settle()
			if err := c1.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			errs := make([]error, len(chs))
			for i, ch := range chs {
				errs[i] = wait(t, ch, fmt.Sprintf("call %d", i))
			}
			// The CloseWrite may have taken its turn before the
			// Writes: it then succeeded, and they failed for it.
			shut := len(errs) == 4 && errs[2] == nil
			for i, err := range errs {
				if shut && (i == 2 || i < 2 && errors.Is(err, errWriteClosed)) {
					continue
				}
				if !errors.Is(err, net.ErrClosed) {
					t.Errorf("call %d: %v, want net.ErrClosed", i, err)
				}
			}
			got, err := readAll(t, c2, 4096)
			if err != io.EOF {
				t.Fatalf("the peer: %v after %d bytes, want io.EOF", err, len(got))
			}
			// Writes take turns: the bytes are one Write's prefix, or a
			// whole one and the next one's prefix.
			p := pattern(1 << 20)
			for b := got; len(b) > 0; b = b[min(len(b), len(p)):] {
				if !bytes.Equal(b[:min(len(b), len(p))], p[:min(len(b), len(p))]) {
					t.Fatal("the peer read bytes that were not written")
				}
			}
		})
	}
}

// TestAdvContract checks details of the net.Conn contract: zero-length
// Writes and Reads are no-ops (the peer sees no bytes and no end),
// io.EOF comes only after every byte and again on every later Read (0
// bytes), a Read never returns bytes and an error together, errors are
// *net.OpError with Net "goverbs", and after Close the addresses are
// still there while every call fails with net.ErrClosed.
func TestAdvContract(t *testing.T) {
	c1, c2 := advPipe(t, session.Config{}, session.Config{})
	la, ra := c1.LocalAddr(), c1.RemoteAddr()
	if la == nil || ra == nil || la.String() == ra.String() {
		t.Fatalf("addresses %v, %v", la, ra)
	}
	if c2.RemoteAddr().String() != la.String() || c2.LocalAddr().String() != ra.String() {
		t.Fatalf("the peer's addresses %v, %v do not mirror %v, %v", c2.LocalAddr(), c2.RemoteAddr(), la, ra)
	}
	if n, err := c1.Write(nil); n != 0 || err != nil {
		t.Fatalf("Write(nil): %d, %v", n, err)
	}
	if n, err := c1.Write([]byte{}); n != 0 || err != nil {
		t.Fatalf("Write of 0 bytes: %d, %v", n, err)
	}
	if n, err := c2.Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil): %d, %v", n, err)
	}
	if _, err := c1.Write([]byte("abc")); err != nil {
		t.Fatal(err)
	}
	if err := c1.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := c1.CloseWrite(); err != nil {
		t.Fatalf("CloseWrite again: %v", err)
	}
	if n, err := c1.Write([]byte("x")); n != 0 || !errors.Is(err, errWriteClosed) {
		t.Fatalf("Write after CloseWrite: %d, %v", n, err)
	}
	if n, err := c1.Write(nil); n != 0 || err == nil {
		t.Fatalf("Write(nil) after CloseWrite: %d, %v; want an error", n, err)
	}
	b := make([]byte, 2)
	if n, err := c2.Read(b); n != 2 || err != nil || string(b) != "ab" {
		t.Fatalf("Read: %d %q, %v", n, b[:n], err)
	}
	if n, err := c2.Read(b); n != 1 || err != nil || b[0] != 'c' {
		t.Fatalf("Read: %d %q, %v", n, b[:n], err)
	}
	for range 3 {
		if n, err := c2.Read(b); n != 0 || err != io.EOF {
			t.Fatalf("Read at the end: %d, %v", n, err)
		}
	}
	if n, err := c2.Read(nil); n != 0 || (err != nil && err != io.EOF) {
		t.Fatalf("Read(nil) at the end: %d, %v", n, err)
	}
	// The other direction still works.
	if _, err := c2.Write([]byte("back")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, c1, 4); string(got) != "back" {
		t.Fatalf("read %q", got)
	}
	if err := c1.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if c1.LocalAddr() == nil || c1.RemoteAddr() == nil || c1.LocalAddr().String() != la.String() || c1.RemoteAddr().String() != ra.String() {
		t.Fatalf("after Close: addresses %v, %v", c1.LocalAddr(), c1.RemoteAddr())
	}
	for _, f := range []struct {
		name string
		call func() error
	}{
		{"Read", func() error { _, err := c1.Read(b); return err }},
		{"Read(nil)", func() error { _, err := c1.Read(nil); return err }},
		{"Write", func() error { _, err := c1.Write(b); return err }},
		{"Write(nil)", func() error { _, err := c1.Write(nil); return err }},
		{"CloseWrite", c1.CloseWrite},
		{"SetDeadline", func() error { return c1.SetDeadline(time.Now()) }},
		{"SetReadDeadline", func() error { return c1.SetReadDeadline(time.Now()) }},
		{"SetWriteDeadline", func() error { return c1.SetWriteDeadline(time.Now()) }},
		{"Close", c1.Close},
	} {
		err := f.call()
		var oe *net.OpError
		if !errors.Is(err, net.ErrClosed) || !errors.As(err, &oe) || oe.Net != netName {
			t.Errorf("%s after Close: %v, want a *net.OpError (Net %q) wrapping net.ErrClosed", f.name, err, netName)
		}
	}
	// The peer: the end, and its Writes fail (the session ended).
	if n, err := c2.Read(b); n != 0 || err != io.EOF {
		t.Fatalf("the peer's Read after Close: %d, %v", n, err)
	}
	ch := await(func() error {
		for {
			if _, err := c2.Write([]byte("x")); err != nil {
				return err
			}
		}
	})
	err := wait(t, ch, "the peer's Writes")
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Net != netName || !errors.Is(err, session.ErrPeerClosed) {
		t.Fatalf("the peer's Write after Close: %v, want a *net.OpError wrapping session.ErrPeerClosed", err)
	}
}

// TestAdvListener: Accept after Close and an Accept blocked when Close
// comes fail with net.ErrClosed; Close again is an error, not a panic;
// AcceptContext ends with its context; a Conn accepted before Close
// stays usable after it; a Dial in its handshake when Close comes, and
// one after, fail (no hang).
func TestAdvListener(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// AcceptContext with a context that ends.
	actx, acancel := context.WithCancel(ctx)
	ach := await(func() error { _, err := l.AcceptContext(actx); return err })
	settle()
	acancel()
	if err := wait(t, ach, "AcceptContext"); !errors.Is(err, context.Canceled) {
		t.Fatalf("AcceptContext with its context cancelled: %v", err)
	}
	// One accepted.
	type acc struct {
		c   net.Conn
		err error
	}
	accCh := make(chan acc, 1)
	go func() { c, err := l.Accept(); accCh <- acc{c, err} }()
	d1, err := Dial(ctx, l.Addr().String(), session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d1.Close()
	a := wait(t, accCh, "Accept")
	if a.err != nil {
		t.Fatal(a.err)
	}
	s1 := a.c.(*Conn)
	defer s1.Close()
	// A dialer that no Accept takes waits in its handshake: Close
	// (of another Listener) must end it.
	l2, err := Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	d2ch := make(chan error, 1)
	go func() {
		d2, err := Dial(ctx, l2.Addr().String(), session.Config{})
		if err == nil {
			d2.Close()
			err = errors.New("dialed a Listener that accepted nothing")
		}
		d2ch <- err
	}()
	settle()
	if err := l2.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := wait(t, d2ch, "Dial during Close"); err == nil {
		t.Fatal("Dial during Close succeeded")
	}
	// Accepts blocked (or about to be) when Close comes.
	blocked := make(chan error, 2)
	for range 2 {
		go func() {
			c, err := l.Accept()
			if c != nil {
				c.Close()
				err = errors.New("accepted a Conn nobody dialed")
			}
			blocked <- err
		}()
	}
	settle()
	if err := l.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for range 2 {
		if err := wait(t, blocked, "Accept during Close"); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept during Close: %v, want net.ErrClosed", err)
		}
	}
	if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v", err)
	}
	if _, err := l.AcceptContext(ctx); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("AcceptContext after Close: %v", err)
	}
	if err := l.Close(); err == nil {
		t.Fatal("Close again: nil, want an error")
	}
	if l.Addr() == nil {
		t.Fatal("Addr after Close: nil")
	}
	if _, err := Dial(ctx, l.Addr().String(), session.Config{}); err == nil {
		t.Fatal("Dial after Close succeeded")
	}
	// The accepted Conn goes on.
	if _, err := d1.Write([]byte("still here")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, s1, 10); string(got) != "still here" {
		t.Fatalf("read %q", got)
	}
}

// TestAdvManyConns: 12 dialers at once on one Listener (three
// goroutines accepting), each echoed by its own accepted Conn, each with its own bytes: every one gets back
// exactly its own, then io.EOF.
func TestAdvManyConns(t *testing.T) {
	const n = 12
	cfg := session.Config{ReceiveBuffers: 8, MessageSize: 1024}
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var servers sync.WaitGroup
	// Three goroutines accept at once, n in all.
	var left atomic.Int32
	left.Store(n)
	for range 3 {
		servers.Add(1)
		go func() {
			defer servers.Done()
			for left.Add(-1) >= 0 {
				c, err := l.Accept()
				if err != nil {
					t.Error(err)
					return
				}
				servers.Add(1)
				go func() {
					defer servers.Done()
					defer c.Close()
					if _, err := io.Copy(c, c); err != nil {
						t.Error(err)
					}
					c.(*Conn).CloseWrite()
				}()
			}
		}()
	}
	var clients sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		clients.Add(1)
		go func() {
			defer clients.Done()
			c, err := Dial(ctx, l.Addr().String(), cfg)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			want := make([]byte, 64<<10+i)
			for j := range want {
				want[j] = byte(i*31 + j*7)
			}
			go func() {
				c.Write(want)
				c.CloseWrite()
			}()
			var got bytes.Buffer
			_, err = io.Copy(&got, c)
			if err == nil && !bytes.Equal(got.Bytes(), want) {
				err = fmt.Errorf("conn %d: read back %d bytes that are not the %d written", i, got.Len(), len(want))
			}
			errs <- err
		}()
	}
	for range n {
		if err := wait(t, errs, "a client"); err != nil {
			t.Error(err)
		}
	}
	clients.Wait()
	servers.Wait()
}

// TestAdvConcurrentWriters: 8 goroutines write records (writer, sequence
// number, length, bytes derived from them) in single Writes of up to
// three messages, while 3 goroutines read the stream in pieces of
// random sizes, taking turns on a shared buffer under a lock: every
// record arrives whole and contiguous (the bytes of one Write are not
// interleaved with another's), each writer's in order, none missing.
func TestAdvConcurrentWriters(t *testing.T) {
	const writers, records = 8, 200
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 512}
	c1, c2 := advPipe(t, cfg, cfg)
	record := func(w, seq int) []byte {
		n := 1 + (w*7919+seq*104729)%1500
		b := make([]byte, 12+n)
		binary.LittleEndian.PutUint32(b, uint32(w))
		binary.LittleEndian.PutUint32(b[4:], uint32(seq))
		binary.LittleEndian.PutUint32(b[8:], uint32(n))
		for i := range n {
			b[12+i] = byte(w*13 + seq*3 + i)
		}
		return b
	}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := range records {
				if _, err := c1.Write(record(w, seq)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	go func() { wg.Wait(); c1.CloseWrite() }()
	var mu sync.Mutex
	var stream bytes.Buffer
	var readers sync.WaitGroup
	rerr := make(chan error, 3)
	for range 3 {
		readers.Add(1)
		go func() {
			defer readers.Done()
			buf := make([]byte, 2000)
			for {
				// The lock makes "read, then append" one step, so
				// that the shared buffer is in stream order.
				mu.Lock()
				n, err := c2.Read(buf[:1+rand.N(len(buf))])
				stream.Write(buf[:n])
				mu.Unlock()
				if err == io.EOF {
					return
				}
				if err != nil {
					rerr <- err
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { readers.Wait(); close(done) }()
	wait(t, done, "the readers")
	select {
	case err := <-rerr:
		t.Fatal(err)
	default:
	}
	next := make([]int, writers)
	b := stream.Bytes()
	for len(b) > 0 {
		if len(b) < 12 {
			t.Fatalf("%d bytes left, not a record", len(b))
		}
		w, seq := int(binary.LittleEndian.Uint32(b)), int(binary.LittleEndian.Uint32(b[4:]))
		if w >= writers || seq != next[w] {
			t.Fatalf("record of writer %d, sequence %d; want sequence %d", w, seq, next[min(w, writers-1)])
		}
		want := record(w, seq)
		if len(b) < len(want) || !bytes.Equal(b[:len(want)], want) {
			t.Fatalf("writer %d, record %d: not contiguous or not its bytes", w, seq)
		}
		next[w]++
		b = b[len(want):]
	}
	for w, n := range next {
		if n != records {
			t.Errorf("writer %d: %d records, want %d", w, n, records)
		}
	}
}

// TestAdvChaos: many goroutines call every method of both Conns at once
// (Reads of random sizes, Writes, CloseWrite, the three deadline setters
// with past, near, far and zero deadlines) while the Conns are closed
// under them: every call returns (no hang, no panic, no race under
// -race), every error is a *net.OpError or io.EOF, a Read never returns
// bytes with an error, and no goroutine is left behind after Close.
func TestAdvChaos(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for run := range 4 {
		t.Run(fmt.Sprint(run), func(t *testing.T) {
			cfg := session.Config{ReceiveBuffers: 4, MessageSize: 256}
			a, b, stop, err := pipeWith(cfg, cfg)
			if err != nil {
				t.Fatal(err)
			}
			conns := []*Conn{a.(*Conn), b.(*Conn)}
			var wg sync.WaitGroup
			bad := make(chan error, 64)
			check := func(op string, n int, err error) bool {
				if err == nil {
					return true
				}
				var oe *net.OpError
				if err != io.EOF && !errors.As(err, &oe) {
					bad <- fmt.Errorf("%s: %T %v", op, err, err)
				}
				if op == "read" && n > 0 {
					bad <- fmt.Errorf("read: %d bytes and %v", n, err)
				}
				return !errors.Is(err, net.ErrClosed)
			}
			deadline := func() time.Time {
				switch rand.N(4) {
				case 0:
					return time.Time{}
				case 1:
					return time.Now().Add(-time.Millisecond)
				case 2:
					return time.Now().Add(time.Duration(rand.N(2000)) * time.Microsecond)
				}
				return time.Now().Add(time.Hour)
			}
			for _, c := range conns {
				for g := range 8 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						buf := make([]byte, 4096)
						for i := 0; ; i++ {
							var n int
							var err error
							op := "read"
							switch (g + i) % 8 {
							case 0, 1, 2:
								n, err = c.Read(buf[:rand.N(len(buf)+1)])
							case 3, 4:
								op = "write"
								n, err = c.Write(buf[:rand.N(len(buf)+1)])
							case 5:
								op = "deadline"
								err = c.SetDeadline(deadline())
							case 6:
								op = "deadline"
								if g%2 == 0 {
									err = c.SetReadDeadline(deadline())
								} else {
									err = c.SetWriteDeadline(deadline())
								}
							case 7:
								op = "closewrite"
								if rand.N(50) == 0 {
									err = c.CloseWrite()
								}
							}
							if !check(op, n, err) {
								return
							}
							if errors.Is(err, io.EOF) {
								time.Sleep(time.Millisecond)
							}
						}
					}()
				}
			}
			time.Sleep(time.Duration(20+run*30) * time.Millisecond)
			closed := make(chan struct{})
			go func() {
				var cw sync.WaitGroup
				for _, c := range conns {
					cw.Add(2)
					go func() { defer cw.Done(); c.Close() }()
					go func() { defer cw.Done(); c.Close() }()
				}
				cw.Wait()
				wg.Wait()
				close(closed)
			}()
			wait(t, closed, "the calls after Close")
			stop()
			close(bad)
			for err := range bad {
				t.Error(err)
			}
		})
	}
}

// TestAdvPeerKilled: the peer process is killed (SIGKILL) in the middle
// of the stream, over each of soft0's transports. A Read of a peer that
// was writing returns the bytes it sent (a prefix of its stream), then
// an error that is not io.EOF (a killed peer did not end the stream):
// session.ErrPeerLost, never a hang. A Write blocked on a peer that
// read nothing returns an error too, and so does every later call.
func TestAdvPeerKilled(t *testing.T) {
	for _, kind := range kinds {
		t.Run(kind+"/reading", func(t *testing.T) {
			c, p := dialChild(t, kind, "flood")
			defer c.Close()
			unit := pattern(1 << 20)
			got := readN(t, c, 3<<20/2)
			for i := range got {
				if got[i] != unit[i%len(unit)] {
					t.Fatalf("byte %d: %d, want %d", i, got[i], unit[i%len(unit)])
				}
			}
			if err := p.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			rest, err := readAll(t, c, 64<<10)
			for i := range rest {
				if j := len(got) + i; rest[i] != unit[j%len(unit)] {
					t.Fatalf("byte %d: %d, want %d", j, rest[i], unit[j%len(unit)])
				}
			}
			if err == io.EOF || !errors.Is(err, session.ErrPeerLost) {
				t.Fatalf("Read after the peer was killed: %v, want session.ErrPeerLost", err)
			}
			if _, err2 := c.Read(make([]byte, 8)); err2 == nil || err2 == io.EOF {
				t.Fatalf("Read again: %v, want the error", err2)
			}
			if _, err := c.Write([]byte("x")); err == nil {
				t.Fatal("Write to the killed peer: no error")
			}
		})
		t.Run(kind+"/writing", func(t *testing.T) {
			c, p := dialChild(t, kind, "stall")
			defer c.Close()
			p.Line(t, "ready")
			type res struct {
				n   int
				err error
			}
			ch := make(chan res, 1)
			go func() {
				n, err := c.Write(pattern(64 << 20))
				ch <- res{n, err}
			}()
			settle()
			if err := p.Cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			r := wait(t, ch, "Write to a killed peer")
			if r.err == nil || isTimeout(r.err) || !errors.Is(r.err, session.ErrPeerLost) {
				t.Fatalf("Write: %d, %v; want session.ErrPeerLost", r.n, r.err)
			}
			if _, err := c.Write([]byte("x")); !errors.Is(err, session.ErrPeerLost) {
				t.Fatalf("Write again: %v, want the same error", err)
			}
			if _, err := readAll(t, c, 64); err == nil || err == io.EOF {
				t.Fatalf("Read: %v, want an error, not io.EOF", err)
			}
		})
	}
}

// TestAdvStalledReader: a writer whose peer reads nothing is held by
// flow control: Writes with a deadline time out again and again
// (reporting the bytes posted), and the writer's registered memory stays
// bounded by the messages in flight, not by the bytes it tried to write.
// When the peer reads at last, it gets exactly the bytes posted.
func TestAdvStalledReader(t *testing.T) {
	c1, c2 := advPipe(t, session.Config{}, session.Config{})
	p := pattern(1 << 20)
	posted, timeouts := 0, 0
	var want []byte // what each Write posted: a prefix of p
	for range 40 {
		c1.SetWriteDeadline(time.Now().Add(2 * time.Millisecond))
		n, err := c1.Write(p)
		posted += n
		want = append(want, p[:n]...)
		switch {
		case isTimeout(err):
			timeouts++
		case err != nil || n != len(p):
			// Until the peer's buffers are full, Writes go through.
			t.Fatalf("Write to a peer that reads nothing: %d, %v; want all or a timeout", n, err)
		}
	}
	// 4 MiB of credits (64 buffers of 64 KiB) at most: the rest of
	// the 40 MiB is held.
	if timeouts < 30 || posted > 5<<20 {
		t.Fatalf("%d of 40 Writes timed out, %d bytes posted: flow control did not hold the writer", timeouts, posted)
	}
	st := c1.Session().Allocator().Stats()
	// The copies of the messages in flight (at most inFlight, of
	// c1.chunk bytes each, counted at their class size: twice at most)
	// and the headers of the session's.
	if bound := int64(2*(inFlight+1)*c1.chunk + 1<<20); st.InUse > bound {
		t.Fatalf("the writer holds %d bytes of registered memory (stats %+v), over %d", st.InUse, st, bound)
	}
	t.Logf("posted %d bytes; writer's allocator %+v", posted, st)
	c1.SetWriteDeadline(time.Time{})
	ended := await(c1.CloseWrite) // held until the peer reads
	got, err := readAll(t, c2, 1<<20)
	if err := wait(t, ended, "CloseWrite"); err != nil {
		t.Fatal(err)
	}
	if err != io.EOF {
		t.Fatalf("Read: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes that are not the %d posted", len(got), posted)
	}
}

// TestAdvCloseKeepsWritten: Close while another goroutine is writing
// (its Write under way, maybe waiting for a message's delivery or for
// credits) still delivers every byte of the Writes that returned before
// Close was called: the peer reads at least those, as a prefix of the
// stream, then io.EOF (over soft0's in-process, unix and tcp links).
func TestAdvCloseKeepsWritten(t *testing.T) {
	for _, kind := range []string{"inproc", "unix", "tcp"} {
		for run := range 5 {
			t.Run(fmt.Sprintf("%s/%d", kind, run), func(t *testing.T) {
				restore, err := soft.ForceTransport(kind)
				if err != nil {
					t.Fatal(err)
				}
				cfg := session.Config{ReceiveBuffers: 8, MessageSize: 4096}
				w, r := advPipe(t, cfg, cfg)
				restore()
				p := pattern(1 << 20)
				var done atomic.Int64 // bytes of the Writes that returned
				wrote := await(func() error {
					for off := 0; ; {
						k := 1 + rand.N(32<<10)
						if off+k > len(p) {
							off = 0
						}
						n, err := w.Write(p[off : off+k])
						if err != nil {
							if errors.Is(err, net.ErrClosed) {
								return nil
							}
							return err
						}
						off += n
						done.Add(int64(n))
					}
				})
				type res struct {
					b   []byte
					err error
				}
				rch := make(chan res, 1)
				go func() {
					var got bytes.Buffer
					buf := make([]byte, 1+rand.N(8192))
					for {
						n, err := r.Read(buf)
						got.Write(buf[:n])
						if err != nil {
							rch <- res{got.Bytes(), err}
							return
						}
					}
				}()
				time.Sleep(time.Duration(1+rand.N(20)) * time.Millisecond)
				before := done.Load()
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
				if err := wait(t, wrote, "the writer"); err != nil {
					t.Fatal(err)
				}
				got := wait(t, rch, "the reader")
				if got.err != io.EOF {
					t.Fatalf("the reader: %v after %d bytes", got.err, len(got.b))
				}
				if int64(len(got.b)) < before {
					t.Fatalf("the peer read %d bytes, but Writes had returned for %d before Close", len(got.b), before)
				}
			})
		}
	}
}

// rawPeer is a Conn accepted from a peer that speaks session, not
// stream: the test plays the peer with the session s.
func rawPeer(t *testing.T, lcfg, dcfg session.Config) (c *Conn, s *session.Session) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", lcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ch := acceptLater(ctx, l)
	s, err = session.Dial(ctx, l.Addr().String(), dcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	a := wait(t, ch, "Accept")
	if a.err != nil {
		t.Fatal(a.err)
	}
	t.Cleanup(func() { a.c.Close() })
	return a.c, s
}

// TestAdvForeignPeer: a peer that is not a stream (a bare session)
// sends what a stream would not: empty messages (no bytes, no end),
// messages larger than the receive buffers (rendezvous: bytes like any
// other), the end with bytes in it or other immediate data (a protocol
// error, for good), bytes after the end (ignored: the stream ended), and
// a session closed without the end (io.EOF after the bytes). Reads get
// exactly the bytes of the data messages, in order, then the end or the
// error; none of them panics or hangs.
func TestAdvForeignPeer(t *testing.T) {
	type msg struct {
		imm    uint32
		hasImm bool
		data   []byte
	}
	data := func(s string) msg { return msg{data: []byte(s)} }
	big := pattern(300_000)
	fin := msg{imm: finImm, hasImm: true}
	for _, tc := range []struct {
		name  string
		msgs  []msg
		close bool   // the peer closes its session after the messages
		want  []byte // the bytes read
		end   error  // then: io.EOF or an error wrapping this one
	}{
		{"empty messages", []msg{data("ab"), {}, {}, data("cd"), {}, fin}, false, []byte("abcd"), io.EOF},
		{"rendezvous", []msg{data("<"), {data: big}, data(">"), fin}, false, append(append([]byte("<"), big...), '>'), io.EOF},
		{"bytes after the end", []msg{data("abc"), fin, data("more"), fin}, false, []byte("abc"), io.EOF},
		{"end with bytes", []msg{data("abc"), {imm: finImm, hasImm: true, data: []byte("x")}, data("d")}, false, []byte("abc"), ErrProtocol},
		{"other immediate data", []msg{data("abc"), {imm: 2, hasImm: true}}, false, []byte("abc"), ErrProtocol},
		{"immediate 0", []msg{{imm: 0, hasImm: true, data: []byte("x")}}, false, nil, ErrProtocol},
		{"closed without the end", []msg{data("abc"), data("def")}, true, []byte("abcdef"), io.EOF},
		{"closed at once", nil, true, nil, io.EOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := session.Config{ReceiveBuffers: 8, MessageSize: 4096}
			c, s := rawPeer(t, cfg, cfg)
			sent := await(func() error {
				ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
				defer cancel()
				for _, m := range tc.msgs {
					var err error
					if m.hasImm {
						err = s.SendImm(ctx, m.imm, m.data)
					} else {
						err = s.Send(ctx, m.data)
					}
					if err != nil {
						return err
					}
				}
				if tc.close {
					return s.Close()
				}
				return nil
			})
			got, err := readAll(t, c, 1000)
			if err := wait(t, sent, "the peer"); err != nil {
				t.Fatalf("the peer: %v", err)
			}
			if !bytes.Equal(got, tc.want) {
				t.Fatalf("read %q, want %q", got[:min(len(got), 64)], tc.want[:min(len(tc.want), 64)])
			}
			if tc.end == io.EOF && err != io.EOF || !errors.Is(err, tc.end) {
				t.Fatalf("after the bytes: %v, want %v", err, tc.end)
			}
			if _, err2 := c.Read(make([]byte, 8)); !errors.Is(err2, tc.end) {
				t.Fatalf("the next Read: %v, want %v again", err2, tc.end)
			}
		})
	}
}

// TestAdvForeignReader: a stream's bytes as a bare session sees them:
// messages of at most PeerMessageSize bytes without immediate data, and
// CloseWrite's end: an empty message with immediate data 1, and nothing
// else (no empty message for a Write of nothing).
func TestAdvForeignReader(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 8, MessageSize: 4096}
	c, s := rawPeer(t, cfg, cfg)
	want := pattern(50_000)
	wrote := await(func() error {
		if _, err := c.Write(nil); err != nil {
			return err
		}
		if _, err := c.Write(want); err != nil {
			return err
		}
		return c.CloseWrite()
	})
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	var got []byte
	for {
		m, err := s.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		imm, hasImm := m.Imm()
		b := append([]byte(nil), m.Bytes()...)
		m.Release()
		if hasImm {
			if imm != finImm || len(b) != 0 {
				t.Fatalf("a message with immediate data %d and %d bytes", imm, len(b))
			}
			break
		}
		if len(b) == 0 || len(b) > s.PeerMessageSize() {
			t.Fatalf("a message of %d bytes (the peer's buffers take %d)", len(b), s.PeerMessageSize())
		}
		got = append(got, b...)
	}
	if err := wait(t, wrote, "the writer"); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("received %d bytes that are not the %d written", len(got), len(want))
	}
}

// TestAdvReadPastDeadlineHeld: a Read made after its deadline passed
// times out even when bytes are already there (the rest of a message
// partly read, or a whole one waiting), as a socket's does and as the
// package documents: the deadline is how a program stops its reader.
// Nothing is lost: with the deadline cleared, the next Reads get every
// byte.
func TestAdvReadPastDeadlineHeld(t *testing.T) {
	c1, c2 := advPipe(t, session.Config{}, session.Config{})
	want := pattern(1000)
	if _, err := c1.Write(want[:600]); err != nil {
		t.Fatal(err)
	}
	if _, err := c1.Write(want[600:]); err != nil {
		t.Fatal(err)
	}
	got := readN(t, c2, 100) // the first message is held, partly read
	c2.SetReadDeadline(time.Now().Add(-time.Second))
	for i := range 3 {
		if n, err := c2.Read(make([]byte, 50)); n != 0 || !isTimeout(err) {
			t.Fatalf("Read %d after the deadline, with bytes waiting: %d, %v; want a timeout", i, n, err)
		}
	}
	c2.SetReadDeadline(time.Time{})
	got = append(got, readN(t, c2, 900)...)
	if !bytes.Equal(got, want) {
		t.Fatal("the bytes read are not those written")
	}
}

// startStall forces soft0's unix transport for the test and starts a
// "stall" child over it; it returns the child and its stream's address.
func startStall(t *testing.T) (*testproc.Proc, string) {
	restore, err := soft.ForceTransport("unix")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restore)
	p := testproc.Start(t, envChild+"=stall", "GOVERBS_SOFT_TRANSPORT=unix")
	return p, p.Line(t, "addr")[0]
}

// TestAdvPeerStopped: a peer process that stops (SIGSTOP) without
// closing anything: a Read waiting for it returns an error (the
// session's keepalive: session.ErrPeerUnresponsive), not io.EOF and not
// a hang; Close, with messages maybe in flight to it, returns.
func TestAdvPeerStopped(t *testing.T) {
	p, addr := startStall(t)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	cfg := childCfg
	cfg.Keepalive = time.Second
	c, err := Dial(ctx, addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	p.Line(t, "ready")
	// Fill the peer's buffers, then stop it.
	c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	c.Write(pattern(1 << 20))
	c.SetWriteDeadline(time.Time{})
	if err := p.Cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer p.Cmd.Process.Signal(syscall.SIGCONT)
	wch := await(func() error { _, err := c.Write(pattern(1 << 20)); return err })
	_, err = readAll(t, c, 64)
	if err == io.EOF || !errors.Is(err, session.ErrPeerUnresponsive) {
		t.Fatalf("Read of a stopped peer: %v, want session.ErrPeerUnresponsive", err)
	}
	if err := wait(t, wch, "Write to a stopped peer"); !errors.Is(err, session.ErrPeerUnresponsive) {
		t.Fatalf("Write to a stopped peer: %v, want session.ErrPeerUnresponsive", err)
	}
	if err := wait(t, await(c.Close), "Close"); err != nil {
		t.Logf("Close: %v", err)
	}
}

// TestAdvConcurrentCloses: many goroutines close one Conn, and one
// Listener, at once: exactly one Close of each succeeds, the others
// report net.ErrClosed (as a second Close does); none panics or hangs.
func TestAdvConcurrentCloses(t *testing.T) {
	const n = 8
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	c1, c2 := advPipe(t, session.Config{}, session.Config{})
	c1.Write([]byte("x"))
	for _, tc := range []struct {
		name  string
		close func() error
	}{
		{"Conn", c1.Close},
		{"Conn's peer", c2.Close},
		{"Listener", l.Close},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := make(chan struct{})
			errs := make(chan error, n)
			for range n {
				go func() { <-start; errs <- tc.close() }()
			}
			close(start)
			ok := 0
			for range n {
				err := wait(t, errs, "Close")
				switch {
				case err == nil:
					ok++
				case !errors.Is(err, net.ErrClosed):
					t.Errorf("Close: %v, want nil or net.ErrClosed", err)
				}
			}
			if ok != 1 {
				t.Fatalf("%d of %d concurrent Closes succeeded, want 1", ok, n)
			}
		})
	}
}

// TestAdvCrossProcessCloseKeepsWritten: a child process closes its
// stream while another of its goroutines is writing: the bytes of every
// Write that returned before Close reach this side (over shared memory,
// unix and tcp), in order, then io.EOF.
func TestAdvCrossProcessCloseKeepsWritten(t *testing.T) {
	for _, kind := range kinds {
		for run := range 3 {
			t.Run(fmt.Sprintf("%s/%d", kind, run), func(t *testing.T) {
				c, p := dialChild(t, kind, "closer")
				defer c.Close()
				got, err := readAll(t, c, 32<<10)
				if err != io.EOF {
					t.Fatalf("Read: %v after %d bytes, want io.EOF", err, len(got))
				}
				before, perr := strconv.Atoi(p.Line(t, "before")[0])
				if perr != nil {
					t.Fatal(perr)
				}
				unit := pattern(1 << 20)
				for i := range got {
					if got[i] != unit[i%len(unit)] {
						t.Fatalf("byte %d: %d, want %d", i, got[i], unit[i%len(unit)])
					}
				}
				if len(got) < before {
					t.Fatalf("read %d bytes, but the child's Writes had returned for %d before its Close", len(got), before)
				}
				t.Logf("read %d bytes; %d written before Close", len(got), before)
				p.Stop(t)
			})
		}
	}
}

// TestAdvRendezvousReadTimeouts: Reads with deadlines a few
// microseconds away, retried after each timeout, of messages larger
// than the receive buffers (which a bare-session peer sends by
// rendezvous: the Read's Receive reads them from the peer) lose
// nothing: every byte comes, in order.
func TestAdvRendezvousReadTimeouts(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 1024}
	c, s := rawPeer(t, cfg, cfg)
	var want []byte
	for i := range 20 {
		want = append(want, pattern(10_000+i*5_000)...)
	}
	sent := await(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		for i, off := 0, 0; i < 20; i++ {
			n := 10_000 + i*5_000
			if err := s.Send(ctx, want[off:off+n]); err != nil {
				return err
			}
			off += n
		}
		return s.SendImm(ctx, finImm, nil)
	})
	var got []byte
	buf := make([]byte, 7000)
	timeouts := 0
	res := await(func() error {
		for {
			c.SetReadDeadline(time.Now().Add(time.Duration(rand.N(200)) * time.Microsecond))
			n, err := c.Read(buf)
			got = append(got, buf[:n]...)
			switch {
			case err == io.EOF:
				return nil
			case isTimeout(err):
				timeouts++
			case err != nil:
				return err
			}
		}
	})
	if err := wait(t, res, "reading"); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, sent, "the peer"); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes that are not the %d sent", len(got), len(want))
	}
	t.Logf("%d Reads timed out", timeouts)
}

// TestAdvBothBlockedClose: both sides write without reading, so both
// Writes wait for credits the other never gives (the classic deadlock
// of two writers); then both sides Close at once: every Write and Close
// returns (Writes with net.ErrClosed or the peer's end), none hangs.
func TestAdvBothBlockedClose(t *testing.T) {
	for run := range 3 {
		t.Run(fmt.Sprint(run), func(t *testing.T) {
			cfg := session.Config{ReceiveBuffers: 4, MessageSize: 1024}
			c1, c2 := advPipe(t, cfg, cfg)
			var ws []<-chan error
			for _, c := range []*Conn{c1, c2, c1, c2} {
				ws = append(ws, await(func() error { _, err := c.Write(pattern(4 << 20)); return err }))
			}
			settle()
			closes := []<-chan error{await(c1.Close), await(c2.Close)}
			for i, ch := range closes {
				if err := wait(t, ch, fmt.Sprintf("Close %d", i)); err != nil {
					t.Errorf("Close %d: %v", i, err)
				}
			}
			for i, ch := range ws {
				err := wait(t, ch, fmt.Sprintf("Write %d", i))
				if !errors.Is(err, net.ErrClosed) && !errors.Is(err, session.ErrPeerClosed) {
					t.Errorf("Write %d: %v, want net.ErrClosed or session.ErrPeerClosed", i, err)
				}
			}
		})
	}
}

// TestAdvAcceptStrangers: strangers at the Listener (a TCP connection
// that sends garbage, one that sends nothing and stays, a dialer with
// the wrong token) do not make Accept fail or return them: it returns
// the stream of the dialer that proves the token, which works.
func TestAdvAcceptStrangers(t *testing.T) {
	cfg := session.Config{Token: []byte("the right token"), HandshakeTimeout: 2 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ach := acceptLater(ctx, l)
	garbage, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer garbage.Close()
	garbage.Write(bytes.Repeat([]byte{0xff, 0, 0x7f, 0x80}, 1000))
	silent, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	wrong := cfg
	wrong.Token = []byte("a wrong token")
	if c, err := Dial(ctx, l.Addr().String(), wrong); err == nil {
		c.Close()
		t.Fatal("a dialer with the wrong token got a stream")
	}
	d, err := Dial(ctx, l.Addr().String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a := wait(t, ach, "Accept")
	if a.err != nil {
		t.Fatalf("Accept: %v", a.err)
	}
	defer a.c.Close()
	if _, err := d.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, a.c, 5); string(got) != "hello" {
		t.Fatalf("read %q", got)
	}
}

// TestDeadlineRacesPeerClose: a Read blocked with a deadline that
// passes about when the peer writes a byte and closes. Whatever wins,
// the byte must be read before io.EOF. Before, a Read whose deadline
// passed after the session had ended (the peer's close notice came
// before its last message's completion was taken) took the end for the
// stream's: io.EOF from then on, the byte left in the session (2 of 8
// runs of -count=8 failed).
func TestDeadlineRacesPeerClose(t *testing.T) {
	for iter := range 150 {
		c1, c2 := advPipe(t, session.Config{}, session.Config{})
		delay := time.Duration(iter%15) * 100 * time.Microsecond
		c1.SetReadDeadline(time.Now().Add(time.Millisecond))
		go func() {
			time.Sleep(delay)
			c2.Write([]byte("x"))
			c2.Close()
		}()
		got := false
		for range 10000 {
			b := make([]byte, 4)
			n, err := c1.Read(b)
			if isTimeout(err) {
				c1.SetReadDeadline(time.Now().Add(time.Duration(iter%7) * 50 * time.Microsecond))
				continue
			}
			if errors.Is(err, io.EOF) {
				if !got {
					// The byte is still in the session: the stream
					// dropped it, taking its end for the stream's.
					ctx, cancel := context.WithTimeout(context.Background(), time.Second)
					m, rerr := c1.Session().Receive(ctx)
					cancel()
					t.Fatalf("iteration %d: Read returned io.EOF before the byte written; the session still holds it: Receive = %q, %v; second Read: %v",
						iter, m.Bytes(), rerr, func() error { _, err := c1.Read(b); return err }())
				}
				break
			}
			if err != nil {
				t.Fatalf("iteration %d: %v", iter, err)
			}
			if n == 1 {
				got = true
			}
		}
		c1.Close()
	}
}

// TestCloseWritePastDeadline: the package documents that a call made
// after its deadline passed returns a timeout (os.ErrDeadlineExceeded),
// and CloseWrite is a call of the write direction ("It waits for credit
// to post the end (until the write deadline)"); Write honours it even for
// zero bytes (conn.go:253). CloseWrite with a write deadline already
// past did not look at it: when a credit and an op token were free,
// session.PostSendSlice took them without consulting its (ended)
// context, and CloseWrite returned nil and ended the direction; it timed
// out only if it had to wait. (Found by a review of stream.)
func TestCloseWritePastDeadline(t *testing.T) {
	cfg := session.Config{ReceiveBuffers: 4, MessageSize: 256}
	c1, _ := advPipe(t, cfg, cfg)
	if err := c1.SetWriteDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	// The Write direction is timed out, as documented:
	if _, err := c1.Write(nil); !isTimeout(err) {
		t.Fatalf("Write(nil) with a past write deadline: %v, want a timeout", err)
	}
	if _, err := c1.Write([]byte("x")); !isTimeout(err) {
		t.Fatalf("Write with a past write deadline: %v, want a timeout", err)
	}
	err := wait(t, await(c1.CloseWrite), "CloseWrite")
	if !isTimeout(err) {
		t.Fatalf("CloseWrite with a write deadline in the past: %v; want a timeout (os.ErrDeadlineExceeded) as every call made after its deadline", err)
	}
}
