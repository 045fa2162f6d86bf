package stream

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	"github.com/goverbs/verbs/session"
)

// pipe makes a connected pair of streams in this process, over a
// listener on loopback; stop closes them and the listener.
func pipe(cfg session.Config) (c1, c2 net.Conn, stop func(), err error) {
	return pipeWith(cfg, cfg)
}

// pipeWith is pipe with a configuration per side: the listener's and
// the dialer's.
func pipeWith(lcfg, cfg session.Config) (c1, c2 net.Conn, stop func(), err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := Listen(ctx, "127.0.0.1:0", lcfg)
	if err != nil {
		return nil, nil, nil, err
	}
	type accepted struct {
		c   net.Conn
		err error
	}
	ac := make(chan accepted, 1)
	go func() {
		c, err := l.Accept()
		ac <- accepted{c, err}
	}()
	d, err := Dial(ctx, l.Addr().String(), cfg)
	if err != nil {
		l.Close()
		<-ac
		return nil, nil, nil, err
	}
	a := <-ac
	if a.err != nil {
		d.Close()
		l.Close()
		return nil, nil, nil, a.err
	}
	return d, a.c, func() { d.Close(); a.c.Close(); l.Close() }, nil
}

// TestConn runs x/net's conformance tests of net.Conn: basic I/O up to
// io.EOF after Close, ping-pong, Reads and Writes racing deadlines, past,
// present and future deadlines, Close under blocked calls, and every
// method concurrently. Small buffers (4 of 256 bytes), so that a writer
// whose peer does not read waits for credits, and big Writes span many
// messages.
func TestConn(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  session.Config
	}{
		{"default", session.Config{}},
		{"small buffers", session.Config{ReceiveBuffers: 4, MessageSize: 256}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nettest.TestConn(t, func() (net.Conn, net.Conn, func(), error) { return pipe(tc.cfg) })
		})
	}
}

// TestCloseWrite: a side that ends its direction still reads, and the
// other reads every byte before the end, then io.EOF, and can still
// write back.
func TestCloseWrite(t *testing.T) {
	c1, c2, stop, err := pipe(session.Config{ReceiveBuffers: 4, MessageSize: 512})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	want := make([]byte, 100_000)
	for i := range want {
		want[i] = byte(rand.N(256))
	}
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		if _, err := c1.Write(want); err != nil {
			t.Error(err)
		}
		if err := c1.(*Conn).CloseWrite(); err != nil {
			t.Error(err)
		}
		if _, err := c1.Write([]byte{1}); !errors.Is(err, errWriteClosed) {
			t.Errorf("a Write after CloseWrite: %v", err)
		}
	}()
	got, err := io.ReadAll(c2)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes, not the %d written", len(got), len(want))
	}
	if n, err := c2.Read(make([]byte, 8)); n != 0 || err != io.EOF {
		t.Fatalf("Read after the end: %d, %v; want io.EOF again", n, err)
	}
	if _, err := c2.Write([]byte("reply")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c1, buf); err != nil || string(buf) != "reply" {
		t.Fatalf("the reply: %q, %v", buf, err)
	}
	<-wrote
}

// TestForeignMessage: a message the stream did not send (with immediate
// data) is a protocol error of Read, not bytes of the stream.
func TestForeignMessage(t *testing.T) {
	c1, c2, stop, err := pipe(session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c1.(*Conn).Session().SendImm(ctx, 7, []byte("x")); err != nil {
		t.Fatal(err)
	}
	_, err = c2.Read(make([]byte, 8))
	if !errors.Is(err, ErrProtocol) {
		t.Fatalf("Read: %v, want ErrProtocol", err)
	}
	if _, err2 := c2.Read(make([]byte, 8)); !errors.Is(err2, ErrProtocol) {
		t.Fatalf("the next Read: %v, want the same error", err2)
	}
}

// TestCloseDelivers: a writer that closes right after its last Write
// loses nothing: the reader gets every byte, then io.EOF (twenty pairs;
// the session once lost the messages delivered before its peer's Close).
func TestCloseDelivers(t *testing.T) {
	want := make([]byte, 1<<20)
	for i := range want {
		want[i] = byte(i*13 + i>>10)
	}
	for run := range 20 {
		c1, c2, stop, err := pipe(session.Config{})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for b := want; len(b) > 0; b = b[min(len(b), 1024):] {
				if _, err := c1.Write(b[:min(len(b), 1024)]); err != nil {
					t.Error(err)
					return
				}
			}
			c1.Close()
		}()
		got, err := io.ReadAll(c2)
		stop()
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("run %d: read %d bytes of %d (%v)", run, len(got), len(want), err)
		}
	}
}
