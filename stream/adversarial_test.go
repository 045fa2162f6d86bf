package stream

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

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
			defer d.stop()
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
