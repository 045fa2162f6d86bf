package soft

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// quietPair is a TCP loopback connection whose first end is a quietSock.
func quietPair(t *testing.T) (*quietSock, net.Conn) { return quietPairOf(t, "tcp") }

// quietPairOf is quietPair over a socket of kind (rawKinds).
func quietPairOf(t *testing.T, kind string) (*quietSock, net.Conn) {
	t.Helper()
	c1, c2 := socketPair(t, kind)
	q, err := newQuietSock(c1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	return q, c2
}

func TestQuietSockReadWrite(t *testing.T) {
	q, peer := quietPair(t)
	qc := q.conn()
	// The peer writes while the reader waits, and while it is silenced:
	// nothing is lost either way.
	for i, silence := range []bool{false, true, false, true} {
		if silence {
			if err := q.silence(); err != nil {
				t.Fatal(err)
			}
		}
		msg := bytes.Repeat([]byte{byte(i + 1)}, 1000)
		errc := make(chan error, 1)
		go func() {
			_, err := peer.Write(msg)
			errc <- err
		}()
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(qc, got); err != nil {
			t.Fatalf("round %d: read: %v", i, err)
		}
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("round %d: read %x..., want %x...", i, got[:4], msg[:4])
		}
		if _, err := qc.Write(msg); err != nil {
			t.Fatalf("round %d: write: %v", i, err)
		}
		if _, err := io.ReadFull(peer, got); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("round %d: peer read %v", i, err)
		}
	}
	// End of file when the peer closes.
	peer.Close()
	var b [8]byte
	if n, err := qc.Read(b[:]); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer closed: %d, %v; want 0, EOF", n, err)
	}
}

// A write to a peer that reads nothing waits for room until its
// deadline, and reports how much it wrote.
func TestQuietSockWriteDeadline(t *testing.T) {
	q, _ := quietPair(t)
	qc := q.conn()
	if err := qc.SetWriteDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 64<<20)
	n, err := qc.Write(big)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write to a peer that reads nothing: %d, %v; want a deadline error", n, err)
	}
	if n <= 0 || n >= len(big) {
		t.Fatalf("wrote %d of %d bytes before the deadline", n, len(big))
	}
}

// Close ends a read that waits, with net.ErrClosed.
func TestQuietSockCloseWakesReader(t *testing.T) {
	q, _ := quietPair(t)
	errc := make(chan error, 1)
	go func() {
		var b [8]byte
		_, err := q.conn().Read(b[:])
		errc <- err
	}()
	// The reader may or may not wait yet: it fails either way.
	q.Close()
	if err := <-errc; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read ended by Close: %v, want net.ErrClosed", err)
	}
}

// outEvents returns the events q's write instance holds now.
func outEvents(t *testing.T, q *quietSock) int {
	t.Helper()
	var n int
	var werr error
	if err := q.out.rc.Control(func(fd uintptr) {
		var ev [4]unix.EpollEvent
		n, werr = unix.EpollWait(int(fd), ev[:], 0)
	}); err != nil {
		t.Fatal(err)
	}
	if werr != nil {
		t.Fatal(werr)
	}
	return n
}

// Room is watched only while a write waits for it: a socket with room
// is not an event of the write instance, which is in the runtime's poller
// (a unix socket reports room after every read of its peer, and each
// report woke a thread of the process; a ping-pong over unix sockets
// paid two such wake-ups per round trip). A write that must wait for
// room still gets it.
func TestQuietSockRoomWatchedOnlyWhileWaiting(t *testing.T) {
	for _, kind := range rawKinds {
		t.Run(kind, func(t *testing.T) {
			q, peer := quietPairOf(t, kind)
			qc := q.conn()
			msg := make([]byte, 100)
			got := make([]byte, len(msg))
			for range 3 {
				if _, err := qc.Write(msg); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(peer, got); err != nil {
					t.Fatal(err)
				}
				if n := outEvents(t, q); n != 0 {
					t.Fatalf("an idle socket with room: %d events in the write instance, want 0", n)
				}
			}
			// More than the socket holds: the write waits for the
			// peer, which reads everything.
			big := make([]byte, 32<<20)
			for i := range big {
				big[i] = byte(i / 4096)
			}
			done := make(chan []byte, 1)
			go func() {
				b := make([]byte, len(big))
				io.ReadFull(peer, b)
				done <- b
			}()
			if n, err := qc.Write(big); n != len(big) || err != nil {
				t.Fatalf("write of %d bytes that waited for room: %d, %v", len(big), n, err)
			}
			if b := <-done; !bytes.Equal(b, big) {
				t.Fatal("the peer read other bytes than were written")
			}
			if n := outEvents(t, q); n != 0 {
				t.Fatalf("after a write that waited: %d events in the write instance, want 0", n)
			}
		})
	}
}
