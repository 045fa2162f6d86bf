package session

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestReceiveAfterPeerClose: messages the peer sent (Send returned: they
// were delivered) before it closed the session are received, in order,
// even once this side saw the session end; then Receive reports the end.
// (Before, the first Receive after the end failed: the message was
// there, but its receive could not be posted again.)
func TestReceiveAfterPeerClose(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 1024, ReceiveBuffers: 8})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 5
	for i := range n {
		if err := a.SendImm(ctx, uint32(i), []byte{byte(i), 1, 2, 3}); err != nil {
			t.Fatal(err)
		}
	}
	a.Close()
	<-b.Done()
	for i := range n {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatalf("message %d of %d: %v", i, n, err)
		}
		if imm, _ := m.Imm(); m.Len() != 4 || m.Bytes()[0] != byte(i) || imm != uint32(i) {
			t.Fatalf("message %d: %x, immediate %d", i, m.Bytes(), imm)
		}
		m.Release()
	}
	if _, err := b.Receive(ctx); !errors.Is(err, ErrPeerClosed) {
		t.Fatalf("after the last message: %v, want ErrPeerClosed", err)
	}
}
