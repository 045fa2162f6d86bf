package channel_test

import (
	"context"
	"encoding/binary"
	"errors"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// word returns the 8-byte word at off of s.buf, for atomic loads.
func (s *side) word(off int) *uint64 {
	return (*uint64)(unsafe.Pointer(&s.buf.Bytes()[off]))
}

// TestDoorbellWakesWait: a side that never spins (SpinNever) sleeps on
// its completion channel in Wait; only the completion of a doorbell can
// wake it. Every write with immediate data of the peer is one, also
// beyond the number of doorbell receives (they are re-posted as the side
// polls). Without doorbells the first write would find no receive and
// retry forever, and Wait would never return.
func TestDoorbellWakesWait(t *testing.T) {
	for _, bells := range []int{1, 4, 64} {
		t.Run(map[int]string{1: "one", 4: "four", 64: "many"}[bells], func(t *testing.T) {
			opts := channel.Options{Doorbells: bells, SpinPolls: channel.SpinNever}
			a, b := newPair(t, opts)
			ctx := testCtx(t)
			const rounds = 200
			flag := a.word(0)
			src := b.sge(8, 8)
			dst := verbs.RemoteRegion{Addr: a.buf.Addr(), Len: uint64(a.buf.Len()), RKey: a.buf.RKey()}
			errc := make(chan error, 1)
			go func() {
				for i := 1; i <= rounds; i++ {
					binary.NativeEndian.PutUint64(b.buf.Bytes()[8:], uint64(i))
					if err := b.ch.WriteImm(ctx, dst.At(0), uint32(i), src); err != nil {
						errc <- err
						return
					}
				}
				errc <- nil
			}()
			for i := uint64(1); i <= rounds; i++ {
				if err := a.ch.Wait(ctx, func() bool { return atomic.LoadUint64(flag) >= i }); err != nil {
					t.Fatalf("round %d: %v", i, err)
				}
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			// Every write rang once; the last ones may still wait to be
			// polled.
			if err := a.ch.Wait(ctx, func() bool { return a.ch.Rung() == rounds }); err != nil {
				t.Fatalf("rung %d of %d: %v", a.ch.Rung(), rounds, err)
			}
			if err := a.ch.Err(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestDoorbellBurst: a peer rings many more times than doorbell receives
// are posted while this side does not poll; every ring is delivered
// (receiver-not-ready retries), none is lost, and the pair still works.
func TestDoorbellBurst(t *testing.T) {
	a, b := newPair(t, channel.Options{Doorbells: 2})
	ctx := testCtx(t)
	dst := verbs.RemoteRegion{Addr: a.buf.Addr(), Len: uint64(a.buf.Len()), RKey: a.buf.RKey()}
	const n = 16
	hs := make([]channel.Handle, 0, n)
	for i := range n {
		h, err := b.ch.PostWriteImm(dst.At(uint64(8*i)), uint32(i), b.sge(8*i, 8))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if err := a.ch.Wait(ctx, func() bool { return a.ch.Rung() == n }); err != nil {
		t.Fatalf("rung %d of %d: %v", a.ch.Rung(), n, err)
	}
	for i, h := range hs {
		if err := h.Wait(ctx); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		h.Release()
	}
}

// TestDoorbellRefusesMessages: on a doorbell channel the receive queue
// holds the doorbells: sends and receives fail before anything is posted,
// and the channel still works.
func TestDoorbellRefusesMessages(t *testing.T) {
	a, b := newPair(t, channel.Options{Doorbells: 8})
	ctx := testCtx(t)
	calls := []struct {
		name string
		call func() error
	}{
		{"Send", func() error { return b.ch.Send(ctx, b.sge(0, 8)) }},
		{"SendImm", func() error { return b.ch.SendImm(ctx, 1, b.sge(0, 8)) }},
		{"Receive", func() error { _, err := a.ch.Receive(ctx, a.sge(0, 8)); return err }},
		{"PostSend", func() error { _, err := b.ch.PostSend(b.sge(0, 8)); return err }},
		{"PostReceive", func() error { _, err := a.ch.PostReceive(a.sge(0, 8)); return err }},
		{"Batch.Send", func() error {
			return b.ch.Batch(ctx, func(bt *channel.Batch) error { return bt.Wait(bt.Send(b.sge(0, 8))) })
		}},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			if err := c.call(); !errors.Is(err, verbs.ErrNotSupported) {
				t.Fatalf("got %v, want an error wrapping ErrNotSupported", err)
			}
		})
	}
	dst := verbs.RemoteRegion{Addr: a.buf.Addr(), Len: uint64(a.buf.Len()), RKey: a.buf.RKey()}
	if err := b.ch.WriteImm(ctx, dst.At(0), 7, b.sge(0, 8)); err != nil {
		t.Fatal(err)
	}
	if err := a.ch.Wait(ctx, func() bool { return a.ch.Rung() == 1 }); err != nil {
		t.Fatal(err)
	}
}

// TestDoorbellOptions: bad Doorbells values are refused by New.
func TestDoorbellOptions(t *testing.T) {
	s := newSide(t, channel.Options{})
	for _, o := range []channel.Options{
		{Doorbells: -1},
		{Doorbells: 129},
		{Doorbells: 9, QP: verbs.QPSpec{MaxRecvWR: 8}},
	} {
		if ch, err := channel.New(s.pd, o); err == nil {
			ch.Close()
			t.Errorf("Doorbells %d (receive depth %d) accepted", o.Doorbells, o.QP.MaxRecvWR)
		}
	}
}

// TestWaitCondHonoursContext: a Wait whose condition never holds ends with
// its context.
func TestWaitCondHonoursContext(t *testing.T) {
	a, _ := newPair(t, channel.Options{Doorbells: 1})
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	if err := a.ch.Wait(ctx, func() bool { return false }); !errors.Is(err, verbs.ErrTimeout) {
		t.Fatalf("got %v, want ErrTimeout", err)
	}
}
