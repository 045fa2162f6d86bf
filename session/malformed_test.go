package session

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// TestMalformedMessages: what a peer writes into the ring that no session
// sends (a write for another slot, a header that does not match what
// arrived, a kind no session knows, a rendezvous over MaxMessage) ends the
// receiving session with ErrProtocol (ErrLimit for the size), from
// Receive and Err, and the peer's session ends with it; nothing panics
// and nothing outside the ring is read.
func TestMalformedMessages(t *testing.T) {
	const msgSize, maxMsg = 256, 1 << 20
	eager := func(n int) func(b []byte) {
		return func(b []byte) {
			b[0] = dataEager
			binary.LittleEndian.PutUint32(b[8:], uint32(n))
		}
	}
	rts := func(n int) func(b []byte) {
		return func(b []byte) {
			b[0] = dataRTS
			binary.LittleEndian.PutUint32(b[8:], uint32(n))
		}
	}
	cases := []struct {
		name string
		imm  uint32       // the slot the write names (0 is the next one)
		hdr  func([]byte) // the header written
		n    int          // bytes written
		want error
	}{
		{"another slot", 3, eager(1), dataHdr + 1, ErrProtocol},
		{"shorter than a header", 0, eager(0), dataHdr - 4, ErrProtocol},
		{"length not what arrived", 0, eager(100), dataHdr + 10, ErrProtocol},
		{"longer than a slot", 0, eager(msgSize + payOff - hdrAt + 1 - dataHdr), msgSize + payOff - hdrAt + 1, ErrProtocol},
		{"unknown kind", 0, func(b []byte) { b[0] = 9 }, dataHdr, ErrProtocol},
		{"kind zero", 0, func([]byte) {}, dataHdr, ErrProtocol},
		{"rendezvous header of the wrong size", 0, rts(1000), rtsHdr + 8, ErrProtocol},
		{"rendezvous over MaxMessage", 0, rts(maxMsg + 1), rtsHdr, ErrLimit},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{MessageSize: msgSize, MaxMessage: maxMsg}
			a, b := pair(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			buf, err := a.Alloc(tc.n)
			if err != nil {
				t.Fatal(err)
			}
			defer buf.Free()
			tc.hdr(buf.Bytes())
			// Straight to the ring's first slot, as a peer that does
			// not follow the protocol would.
			dst := verbs.RemoteAddr{Addr: a.peer.Ring.Addr + hdrAt, RKey: a.peer.Ring.RKey}
			if err := a.data.WriteImm(ctx, dst, tc.imm, buf.All().SGE()); err != nil {
				t.Fatal(err)
			}
			m, err := b.Receive(ctx)
			if !errors.Is(err, tc.want) {
				m.Release()
				t.Fatalf("receive: %v, want %v", err, tc.want)
			}
			select {
			case <-b.Done():
			default:
				t.Fatal("the receiving session lives on")
			}
			if !errors.Is(b.Err(), tc.want) {
				t.Fatalf("Err: %v, want %v", b.Err(), tc.want)
			}
			if _, err := b.Receive(ctx); err == nil {
				t.Fatal("a receive after the session ended succeeded")
			}
			// The sender learns that the session is over.
			select {
			case <-a.Done():
			case <-ctx.Done():
				t.Fatal("the sending session did not end")
			}
		})
	}
}
