package session

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// TestReleaseWhileReceiving: messages released by another goroutine
// while the next ones arrive keep their bytes until released: a slot
// goes back to the sender only once its message is released. (Before
// f432501 receive counted a message consumed before it marked its slot
// busy; a Release in between moved the credit count over the new slot,
// the sender wrote the message after next into it, and the first
// message's Release then freed that one: an empty Bytes. Three runs in
// three failed at once.)
func TestReleaseWhileReceiving(t *testing.T) {
	a, b := pair(t, Config{ReceiveBuffers: 2, MessageSize: 64})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n = 20000
	errc := make(chan error, 1)
	go func() {
		var msg [64]byte
		for i := range n {
			binary.LittleEndian.PutUint64(msg[:], uint64(i))
			copy(msg[8:], bytes.Repeat([]byte{byte(i)}, 56))
			if err := a.Send(ctx, msg[:]); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	held := make(chan Message, 1)
	bad := make(chan string, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range held {
			runtime.Gosched()
			if b := m.Bytes(); len(b) != 64 || !bytes.Equal(b[8:], bytes.Repeat([]byte{b[0]}, 56)) {
				select {
				case bad <- fmt.Sprintf("a held message changed: %d bytes %x", len(b), b):
				default:
				}
			}
			m.Release()
		}
	}()
	for i := range n {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if b := m.Bytes(); len(b) != 64 || binary.LittleEndian.Uint64(b) != uint64(i) {
			t.Fatalf("message %d arrived as %x", i, b)
		}
		held <- m
	}
	close(held)
	<-done
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-bad:
		t.Fatal(s)
	default:
	}
}
