package channel_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

func TestBlockingOperations(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)

	tests := []struct {
		name  string
		run   func(t *testing.T)
		check func(t *testing.T)
	}{
		{name: "send/receive", run: func(t *testing.T) {
			n := copy(a.buf.Bytes(), "hello")
			recv := make(chan channel.Received, 1)
			go func() {
				r, err := b.ch.Receive(ctx, b.sge(1024, 64))
				if err != nil {
					t.Error(err)
				}
				recv <- r
			}()
			if err := a.ch.Send(ctx, a.sge(0, n)); err != nil {
				t.Fatal(err)
			}
			r := <-recv
			if r.Len != n || r.HasImm || string(b.buf.Bytes()[1024:1024+n]) != "hello" {
				t.Errorf("received %+v %q", r, b.buf.Bytes()[1024:1024+n])
			}
		}},
		{name: "send with immediate", run: func(t *testing.T) {
			h, err := b.ch.PostReceive(b.sge(1024, 64))
			if err != nil {
				t.Fatal(err)
			}
			defer h.Release()
			if err := a.ch.SendImm(ctx, 0xfeed, a.sge(0, 3)); err != nil {
				t.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if r := h.Received(); r.Len != 3 || !r.HasImm || r.Imm != 0xfeed || r.Write {
				t.Errorf("received %+v", r)
			}
		}},
		{name: "write", run: func(t *testing.T) {
			copy(a.buf.Bytes()[100:], "written")
			if err := a.ch.Write(ctx, b.buf.Remote().At(2000), a.sge(100, 7)); err != nil {
				t.Fatal(err)
			}
			if got := string(b.buf.Bytes()[2000:2007]); got != "written" {
				t.Errorf("got %q", got)
			}
		}},
		{name: "write with immediate", run: func(t *testing.T) {
			h, err := b.ch.PostReceive()
			if err != nil {
				t.Fatal(err)
			}
			defer h.Release()
			copy(a.buf.Bytes()[100:], "imm-data")
			if err := a.ch.WriteImm(ctx, b.buf.Remote().At(3000), 42, a.sge(100, 8)); err != nil {
				t.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if r := h.Received(); !r.HasImm || r.Imm != 42 || !r.Write {
				t.Errorf("received %+v", r)
			}
			if got := string(b.buf.Bytes()[3000:3008]); got != "imm-data" {
				t.Errorf("got %q", got)
			}
		}},
		{name: "read", run: func(t *testing.T) {
			copy(b.buf.Bytes()[4000:], "remote bytes")
			if err := a.ch.Read(ctx, b.buf.Remote().At(4000), a.sge(5000, 12)); err != nil {
				t.Fatal(err)
			}
			if got := string(a.buf.Bytes()[5000:5012]); got != "remote bytes" {
				t.Errorf("got %q", got)
			}
		}},
		{name: "read into several SGEs", run: func(t *testing.T) {
			copy(b.buf.Bytes()[4000:], "abcdefgh")
			if err := a.ch.Read(ctx, b.buf.Remote().At(4000), a.sge(6000, 4), a.sge(7000, 4)); err != nil {
				t.Fatal(err)
			}
			if got := string(a.buf.Bytes()[6000:6004]) + string(a.buf.Bytes()[7000:7004]); got != "abcdefgh" {
				t.Errorf("got %q", got)
			}
		}},
		{name: "fetch-and-add", run: func(t *testing.T) {
			*b.word(8192) = 10
			prior, err := a.ch.FetchAdd(ctx, b.buf.Remote().At(8192), 5)
			if err != nil {
				t.Fatal(err)
			}
			if prior != 10 || *b.word(8192) != 15 {
				t.Errorf("prior %d, now %d; want 10, 15", prior, *b.word(8192))
			}
		}},
		{name: "compare-and-swap", run: func(t *testing.T) {
			*b.word(8192) = 7
			for _, tc := range []struct{ cmp, swap, prior, now uint64 }{{7, 100, 7, 100}, {7, 5, 100, 100}} {
				prior, err := a.ch.CompareSwap(ctx, b.buf.Remote().At(8192), tc.cmp, tc.swap)
				if err != nil {
					t.Fatal(err)
				}
				if prior != tc.prior || *b.word(8192) != tc.now {
					t.Errorf("CAS(%d, %d): prior %d, now %d; want %d, %d", tc.cmp, tc.swap, prior, *b.word(8192), tc.prior, tc.now)
				}
			}
		}},
		{name: "inline write", run: func(t *testing.T) {
			if err := a.ch.WriteInline(ctx, b.buf.Remote().At(9000), []byte("flag!")); err != nil {
				t.Fatal(err)
			}
			// Writes arrive in order: a signaled write after it completes
			// only after the inline one did.
			if err := a.ch.Write(ctx, b.buf.Remote().At(9100), a.sge(0, 1)); err != nil {
				t.Fatal(err)
			}
			if got := string(b.buf.Bytes()[9000:9005]); got != "flag!" {
				t.Errorf("got %q", got)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.run)
	}
	if err := a.ch.Err(); err != nil {
		t.Errorf("channel broke: %v", err)
	}
}

func TestWriteInlineRecyclesSendQueue(t *testing.T) {
	// Far more unsignaled writes than the send queue holds: the periodic
	// signaled one must retire them.
	a, b := newPair(t, channel.Options{QP: verbs.QPSpec{MaxSendWR: 8, MaxRecvWR: 8}})
	ctx := testCtx(t)
	var v [8]byte
	for i := range 1000 {
		binary.NativeEndian.PutUint64(v[:], uint64(i+1))
		if err := a.ch.WriteInline(ctx, b.buf.Remote().At(0), v[:]); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	if err := a.ch.Write(ctx, b.buf.Remote().At(64), a.sge(0, 8)); err != nil {
		t.Fatal(err)
	}
	if got := binary.NativeEndian.Uint64(b.buf.Bytes()); got != 1000 {
		t.Errorf("flag = %d, want 1000", got)
	}
	if err := a.ch.WriteInline(ctx, b.buf.Remote().At(0), make([]byte, a.ch.MaxInline()+1)); !errors.Is(err, verbs.ErrNotSupported) {
		t.Errorf("oversized inline write: %v, want ErrNotSupported", err)
	}
}

// TestPostUnsignaled: unsignaled writes, plain and with immediate data,
// far more than the send queue holds: the posts never block (a full
// queue is ErrQueueFull, and polling the channel frees it: the periodic
// signaled write retires the others), every write lands, in order, and
// every immediate arrives with its receive.
func TestPostUnsignaled(t *testing.T) {
	for _, imm := range []bool{false, true} {
		t.Run(fmt.Sprintf("imm=%v", imm), func(t *testing.T) {
			const n = 1000
			a, b := newPair(t, channel.Options{QP: verbs.QPSpec{MaxSendWR: 8, MaxRecvWR: 8}})
			ctx := testCtx(t)
			var recvs []channel.Handle
			defer func() {
				for _, h := range recvs {
					h.Release()
				}
			}()
			full, got := 0, 0
			for i := 0; i < n; {
				if imm {
					// Keep receives posted for the immediates, taking the
					// completed ones in order. A write is posted only
					// with a receive for it: its completion tells that
					// the write (and its source) is done with.
					if err := b.ch.Progress(); err != nil {
						t.Fatal(err)
					}
					for len(recvs) > 0 && recvs[0].Done() {
						r := recvs[0].Received()
						if err := recvs[0].Err(); err != nil || !r.HasImm || !r.Write || r.Imm != uint32(got+1) {
							t.Fatalf("receive %d: %+v, %v; want the immediate %d of a write", got, r, err, got+1)
						}
						recvs[0].Release()
						recvs = recvs[1:]
						got++
					}
					for len(recvs) < 8 && got+len(recvs) < n {
						h, err := b.ch.PostReceive()
						if err != nil {
							t.Fatal(err)
						}
						recvs = append(recvs, h)
					}
					if i >= got+len(recvs) {
						if err := a.ch.Progress(); err != nil {
							t.Fatal(err)
						}
						continue
					}
				}
				binary.NativeEndian.PutUint64(a.buf.Bytes()[8*(i%16):], uint64(i+1))
				src := a.sge(8*(i%16), 8)
				var err error
				if imm {
					err = a.ch.PostWriteImmUnsignaled(b.buf.Remote().At(0), uint32(i+1), src)
				} else {
					err = a.ch.PostWriteUnsignaled(b.buf.Remote().At(0), src)
				}
				switch {
				case errors.Is(err, verbs.ErrQueueFull):
					full++
					if err := a.ch.Progress(); err != nil {
						t.Fatal(err)
					}
					if err := b.ch.Progress(); err != nil {
						t.Fatal(err)
					}
				case err != nil:
					t.Fatalf("write %d: %v", i, err)
				default:
					i++
					if !imm && i%16 == 0 {
						// The source words are reused: a signaled write
						// after them completes once they were read.
						if err := a.ch.Write(ctx, b.buf.Remote().At(64), a.sge(0, 8)); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			if err := a.ch.Write(ctx, b.buf.Remote().At(64), a.sge(0, 8)); err != nil {
				t.Fatal(err)
			}
			if v := binary.NativeEndian.Uint64(b.buf.Bytes()); v != n {
				t.Errorf("the last write left %d, want %d", v, n)
			}
			for ; imm && got < n; got++ {
				if err := recvs[0].Wait(ctx); err != nil {
					t.Fatal(err)
				}
				if r := recvs[0].Received(); r.Imm != uint32(got+1) {
					t.Fatalf("receive %d: %+v, want the immediate %d", got, r, got+1)
				}
				recvs[0].Release()
				recvs = recvs[1:]
			}
			if full == 0 {
				t.Log("the send queue was never full: the test did not try ErrQueueFull")
			}
			if err := a.ch.Err(); err != nil {
				t.Errorf("channel broke: %v", err)
			}
		})
	}
}

// TestPostUnsignaledErrorBreaks: an unsignaled write that fails (a wrong
// rkey) breaks the channel, as a signaled one does.
func TestPostUnsignaledErrorBreaks(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	bad := b.buf.Remote()
	bad.RKey ^= 0x5a5a
	if err := a.ch.PostWriteUnsignaled(bad.At(0), a.sge(0, 8)); err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	for a.ch.Err() == nil {
		if err := a.ch.Progress(); err != nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the failed write never broke the channel")
		}
	}
	var ce *verbs.CompletionError
	if err := a.ch.Err(); !errors.Is(err, channel.ErrBroken) || !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr {
		t.Errorf("Err() = %v, want ErrBroken wrapping a remote access error", err)
	}
	if err := a.ch.PostWriteImmUnsignaled(b.buf.Remote().At(0), 1, a.sge(0, 8)); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("post on a broken channel: %v, want ErrBroken", err)
	}
}

func TestCompletionErrorsBreakTheChannel(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	bad := b.buf.Remote()
	bad.RKey ^= 0x5a5a
	err := a.ch.Write(ctx, bad.At(0), a.sge(0, 8))
	var ce *verbs.CompletionError
	var oe *channel.OpError
	if !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr || !errors.As(err, &oe) || oe.Op != "write" {
		t.Fatalf("write with a wrong rkey: %v, want a remote access error in a channel.OpError", err)
	}
	if err := a.ch.Err(); !errors.Is(err, channel.ErrBroken) || !errors.As(err, &ce) {
		t.Errorf("Err() = %v, want ErrBroken wrapping the completion error", err)
	}
	if err := a.ch.Send(ctx, a.sge(0, 1)); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("send on a broken channel: %v, want ErrBroken", err)
	}
	if _, err := a.ch.PostWrite(b.buf.Remote().At(0), a.sge(0, 1)); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("post on a broken channel: %v, want ErrBroken", err)
	}
}

func TestCancelledBlockingCallBreaks(t *testing.T) {
	_, b := newPair(t, channel.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := b.ch.Receive(ctx, b.sge(0, 64)) // nobody sends
	if !errors.Is(err, verbs.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, channel.ErrBroken) {
		t.Fatalf("receive: %v, want ErrTimeout, DeadlineExceeded and ErrBroken", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("receive returned after %v", d)
	}
	if err := b.ch.Err(); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("Err() = %v, want ErrBroken", err)
	}
	// The peer's queue pair is fine; ours flushes.
	if _, err := b.ch.Receive(testCtx(t), b.sge(0, 64)); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("receive after the break: %v", err)
	}
	// An already-cancelled context fails without posting or breaking.
	a2, b2 := newPair(t, channel.Options{})
	done, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if err := a2.ch.Write(done, b2.buf.Remote().At(0), a2.sge(0, 1)); !errors.Is(err, context.Canceled) {
		t.Errorf("write with a cancelled context: %v", err)
	}
	if err := a2.ch.Err(); err != nil {
		t.Errorf("a call that never posted broke the channel: %v", err)
	}
}

func TestHandleWaitTimesOutAndResumes(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	h, err := b.ch.PostReceive(b.sge(0, 64))
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if err := h.Wait(short); !errors.Is(err, verbs.ErrTimeout) {
		t.Fatalf("wait: %v, want ErrTimeout", err)
	}
	if h.Done() {
		t.Fatal("handle done before the message")
	}
	if done, err := h.Poll(); done || err != nil {
		t.Fatalf("poll: %v %v", done, err)
	}
	if err := b.ch.Err(); err != nil {
		t.Fatalf("a handle wait that timed out broke the channel: %v", err)
	}
	copy(a.buf.Bytes(), "late")
	if err := a.ch.Send(ctx, a.sge(0, 4)); err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if r := h.Received(); r.Len != 4 || string(b.buf.Bytes()[:4]) != "late" {
		t.Errorf("received %+v %q", r, b.buf.Bytes()[:4])
	}
	if wc, ok := h.Completion(); !ok || wc.Opcode != verbs.OpRecv {
		t.Errorf("completion %v %v", wc, ok)
	}
	h.Release()
	h.Release() // idempotent
	if err := h.Wait(ctx); !errors.Is(err, channel.ErrStale) {
		t.Errorf("wait on a released handle: %v, want ErrStale", err)
	}
	if h.Done() || h.Peer() != -1 || h.Value() != 0 {
		t.Error("a released handle still reports results")
	}
	var zero channel.Handle
	if err := zero.Wait(ctx); !errors.Is(err, channel.ErrStale) {
		t.Errorf("wait on the zero handle: %v", err)
	}
}

func TestDetachedHandleAndDrain(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	h, err := b.ch.PostReceive(b.sge(0, 64))
	if err != nil {
		t.Fatal(err)
	}
	h.Release() // detached: still posted
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if err := b.ch.Drain(short); !errors.Is(err, verbs.ErrTimeout) {
		t.Fatalf("drain with a posted receive: %v, want ErrTimeout", err)
	}
	if err := a.ch.Send(ctx, a.sge(0, 4)); err != nil {
		t.Fatal(err)
	}
	if err := b.ch.Drain(ctx); err != nil {
		t.Fatalf("drain: %v", err)
	}
}

func TestNotConnected(t *testing.T) {
	s := newSide(t, channel.Options{})
	ctx := testCtx(t)
	if err := s.ch.Write(ctx, s.buf.Remote().At(0), s.sge(0, 1)); !errors.Is(err, channel.ErrNotConnected) {
		t.Errorf("write before connect: %v, want ErrNotConnected", err)
	}
	// Receives may be posted before Connect.
	h, err := s.ch.PostReceive(s.sge(0, 8))
	if err != nil {
		t.Fatalf("post receive before connect: %v", err)
	}
	h.Release()
	if err := s.ch.Connect(verbs.Endpoint{}); err == nil {
		t.Error("connect to the zero endpoint succeeded")
	}
	if err := s.ch.Write(ctx, s.buf.Remote().At(0), s.sge(0, 1)); !errors.Is(err, channel.ErrBroken) {
		t.Errorf("write after a failed connect: %v, want ErrBroken", err)
	}
}

func TestOptionsValidation(t *testing.T) {
	s := newSide(t, channel.Options{})
	cq, err := s.dev.NewCompletionQueue(verbs.CQSpec{})
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	for _, tc := range []struct {
		name string
		opts channel.Options
	}{
		{"own CQ", channel.Options{QP: verbs.QPSpec{SendCQ: cq}}},
		{"negative depth", channel.Options{QP: verbs.QPSpec{MaxSendWR: -1}}},
		{"negative outstanding", channel.Options{MaxOutstanding: -3}},
	} {
		if c, err := channel.New(s.pd, tc.opts); err == nil {
			c.Close()
			t.Errorf("%s: New succeeded", tc.name)
		}
	}
	if _, err := channel.New(nil, channel.Options{}); err == nil {
		t.Error("New(nil) succeeded")
	}
}

func TestQueueFull(t *testing.T) {
	a, b := newPair(t, channel.Options{MaxOutstanding: 4})
	var hs []channel.Handle
	for range 4 {
		h, err := b.ch.PostReceive(b.sge(0, 8))
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if _, err := b.ch.PostReceive(b.sge(0, 8)); !errors.Is(err, verbs.ErrQueueFull) {
		t.Errorf("fifth post: %v, want ErrQueueFull", err)
	}
	ctx := testCtx(t)
	for range 4 {
		if err := a.ch.Send(ctx, a.sge(0, 1)); err != nil {
			t.Fatal(err)
		}
	}
	for _, h := range hs {
		if err := h.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		h.Release()
	}
	if _, err := b.ch.PostReceive(b.sge(0, 8)); err != nil {
		t.Errorf("post after releasing: %v", err)
	}
}

func TestConcurrentOperations(t *testing.T) {
	a, b := newPair(t, channel.Options{MaxOutstanding: 16, QP: verbs.QPSpec{MaxSendWR: 8}})
	ctx := testCtx(t)
	const workers, rounds = 8, 200
	counter := b.buf.Remote().At(0)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := 4096 + 256*w
			for i := range rounds {
				if _, err := a.ch.FetchAdd(ctx, counter, 1); err != nil {
					t.Error(err)
					return
				}
				binary.NativeEndian.PutUint64(a.buf.Bytes()[off:], uint64(i))
				if err := a.ch.Write(ctx, b.buf.Remote().At(uint64(off)), a.sge(off, 8)); err != nil {
					t.Error(err)
					return
				}
				if err := a.ch.Read(ctx, b.buf.Remote().At(uint64(off)), a.sge(off+64, 8)); err != nil {
					t.Error(err)
					return
				}
				if got := binary.NativeEndian.Uint64(a.buf.Bytes()[off+64:]); got != uint64(i) {
					t.Errorf("worker %d round %d read back %d", w, i, got)
					return
				}
			}
		}()
	}
	wg.Wait()
	if got := binary.NativeEndian.Uint64(b.buf.Bytes()); got != workers*rounds {
		t.Errorf("counter = %d, want %d", got, workers*rounds)
	}
}

func TestCloseWithOperationsInFlight(t *testing.T) {
	s1 := newSide(t, channel.Options{})
	s2 := newSide(t, channel.Options{})
	connect(t, s1.ch, s2.ch)
	h, err := s1.ch.PostReceive(s1.sge(0, 8))
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := s2.ch.Receive(context.Background(), s2.sge(0, 8))
		errc <- err
	}()
	time.Sleep(10 * time.Millisecond)
	if err := s1.ch.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s2.ch.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err == nil {
			t.Error("receive on a closed channel succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a blocked receive did not return after Close")
	}
	if err := h.Wait(testCtx(t)); err == nil {
		t.Error("wait on a handle of a closed channel succeeded")
	}
	if err := s1.ch.Write(testCtx(t), s2.buf.Remote().At(0), s1.sge(0, 1)); !errors.Is(err, channel.ErrClosed) {
		t.Errorf("write after close: %v, want ErrClosed", err)
	}
	if err := s1.ch.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
}

func TestBatch(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	src := a.buf.Bytes()
	for i := range 64 {
		src[i] = byte('A' + i%26)
	}
	err := a.ch.Batch(ctx, func(bt *channel.Batch) error {
		var hs []channel.Handle
		for i := range 64 {
			hs = append(hs, bt.Write(b.buf.Remote().At(uint64(2*i)), a.sge(i, 1)))
		}
		faa := bt.FetchAdd(b.buf.Remote().At(1024), 3)
		cas := bt.CompareSwap(b.buf.Remote().At(1032), 0, 9)
		if i, err := bt.WaitAny(faa, cas); err != nil || (i != 0 && i != 1) {
			return fmt.Errorf("WaitAny = %d, %v", i, err)
		}
		if err := bt.WaitAll(hs...); err != nil {
			return err
		}
		if err := bt.Wait(faa); err != nil {
			return err
		}
		if faa.Value() != 0 {
			return fmt.Errorf("fetch-and-add prior %d", faa.Value())
		}
		rd := bt.Read(b.buf.Remote().At(0), a.sge(4096, 128))
		if err := bt.Wait(rd); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 64 {
		if got := b.buf.Bytes()[2*i]; got != src[i] {
			t.Fatalf("byte %d = %q, want %q", 2*i, got, src[i])
		}
	}
	if !bytes.Equal(a.buf.Bytes()[4096:4096+128], b.buf.Bytes()[:128]) {
		t.Error("read back differs")
	}
	if v := binary.NativeEndian.Uint64(b.buf.Bytes()[1024:]); v != 3 {
		t.Errorf("counter = %d", v)
	}
	if v := binary.NativeEndian.Uint64(b.buf.Bytes()[1032:]); v != 9 {
		t.Errorf("swapped word = %d", v)
	}
}

func TestBatchEndsPollEverything(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	var leaked []channel.Handle
	tests := []struct {
		name    string
		fn      func(bt *channel.Batch) error
		wantErr error
		panics  bool
	}{
		{name: "return without waiting", fn: func(bt *channel.Batch) error {
			for i := range 16 {
				leaked = append(leaked, bt.Write(b.buf.Remote().At(uint64(i)), a.sge(i, 1)))
			}
			return nil // never flushed: posted and polled at the end
		}},
		{name: "error after flush", wantErr: errors.New("boom"), fn: func(bt *channel.Batch) error {
			for i := range 16 {
				leaked = append(leaked, bt.Write(b.buf.Remote().At(uint64(i)), a.sge(i, 1)))
			}
			if err := bt.Flush(); err != nil {
				return err
			}
			leaked = append(leaked, bt.Write(b.buf.Remote().At(0), a.sge(0, 1))) // dropped
			return errors.New("boom")
		}},
		{name: "panic", panics: true, fn: func(bt *channel.Batch) error {
			for i := range 16 {
				leaked = append(leaked, bt.Read(b.buf.Remote().At(uint64(i)), a.sge(i, 1)))
			}
			bt.Flush()
			panic("in the scope")
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			leaked = leaked[:0]
			var err error
			func() {
				defer func() {
					if r := recover(); (r != nil) != tc.panics {
						t.Errorf("recovered %v", r)
					}
				}()
				err = a.ch.Batch(ctx, tc.fn)
			}()
			if tc.wantErr != nil && (err == nil || err.Error() != tc.wantErr.Error()) {
				t.Errorf("Batch = %v, want %v", err, tc.wantErr)
			}
			if tc.wantErr == nil && !tc.panics && err != nil {
				t.Errorf("Batch = %v", err)
			}
			for _, h := range leaked {
				if err := h.Wait(ctx); !errors.Is(err, channel.ErrStale) {
					t.Fatalf("a handle survived its scope: %v", err)
				}
			}
			// Nothing of the scope is left in flight.
			short, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			if err := a.ch.Drain(short); err != nil {
				t.Errorf("drain after the scope: %v", err)
			}
			if err := a.ch.Err(); err != nil {
				t.Errorf("channel broken: %v", err)
			}
		})
	}
}

func TestBatchReportsUnobservedFailures(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	bad := b.buf.Remote()
	bad.RKey++
	err := a.ch.Batch(ctx, func(bt *channel.Batch) error {
		bt.Write(bad.At(0), a.sge(0, 8))
		return nil
	})
	var ce *verbs.CompletionError
	if !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr {
		t.Fatalf("Batch = %v, want the remote access error", err)
	}
}

func TestBatchCancelledBreaks(t *testing.T) {
	_, b := newPair(t, channel.Options{FlushGrace: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := b.ch.Batch(ctx, func(bt *channel.Batch) error {
		bt.Receive(b.sge(0, 8)) // nobody sends
		return bt.WaitAll()
	})
	if !errors.Is(err, verbs.ErrTimeout) {
		t.Fatalf("Batch = %v, want ErrTimeout", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v", d)
	}
	if !errors.Is(b.ch.Err(), channel.ErrBroken) {
		t.Errorf("Err() = %v, want ErrBroken", b.ch.Err())
	}
}

func TestBatchSendReceive(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	const n = 32
	errc := make(chan error, 1)
	go func() {
		errc <- b.ch.Batch(ctx, func(bt *channel.Batch) error {
			hs := make([]channel.Handle, n)
			for i := range hs {
				hs[i] = bt.Receive(b.sge(64*i, 64))
			}
			if err := bt.WaitAll(); err != nil {
				return err
			}
			for i, h := range hs {
				if r := h.Received(); r.Len != 8 || binary.NativeEndian.Uint64(b.buf.Bytes()[64*i:]) != uint64(i) {
					return fmt.Errorf("message %d: %+v", i, r)
				}
			}
			return nil
		})
	}()
	err := a.ch.Batch(ctx, func(bt *channel.Batch) error {
		for i := range n {
			binary.NativeEndian.PutUint64(a.buf.Bytes()[8*i:], uint64(i))
			bt.Send(a.sge(8*i, 8))
		}
		return bt.WaitAll()
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

func TestBatchHoldsAllSlots(t *testing.T) {
	a, b := newPair(t, channel.Options{MaxOutstanding: 8})
	err := a.ch.Batch(testCtx(t), func(bt *channel.Batch) error {
		for i := range 8 {
			bt.Write(b.buf.Remote().At(uint64(i)), a.sge(i, 1))
		}
		h := bt.Write(b.buf.Remote().At(9), a.sge(9, 1))
		if err := h.Err(); !errors.Is(err, verbs.ErrQueueFull) {
			return fmt.Errorf("ninth operation: %v, want ErrQueueFull", err)
		}
		if err := bt.WaitAll(); !errors.Is(err, verbs.ErrQueueFull) {
			return errors.New("WaitAll hid the failed operation")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestBlockingWriteAllocatesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	for _, m := range spinModes {
		t.Run(m.name, func(t *testing.T) {
			a, b := newPair(t, channel.Options{SpinPolls: m.spin})
			ctx := testCtx(t)
			dst, src := b.buf.Remote().At(0), a.sge(0, 64)
			allocs := testing.AllocsPerRun(200, func() {
				if err := a.ch.Write(ctx, dst, src); err != nil {
					t.Fatal(err)
				}
			})
			if allocs > 0 {
				t.Errorf("a blocking write allocates %.1f times", allocs)
			}
			allocs = testing.AllocsPerRun(200, func() {
				h, err := a.ch.PostWrite(dst, src)
				if err != nil {
					t.Fatal(err)
				}
				if err := h.Wait(ctx); err != nil {
					t.Fatal(err)
				}
				h.Release()
			})
			if allocs > 0 {
				t.Errorf("post, wait and release allocate %.1f times", allocs)
			}
			// Unsignaled posts (a full queue is flow control: polled
			// until there is room, allocation-free too).
			for _, imm := range []bool{false, true} {
				allocs = testing.AllocsPerRun(200, func() {
					var rh channel.Handle
					if imm {
						// The write consumes a receive: post one first
						// and take its completion after.
						var err error
						if rh, err = b.ch.PostReceive(); err != nil {
							t.Fatal(err)
						}
					}
					for {
						var err error
						if imm {
							err = a.ch.PostWriteImmUnsignaled(dst, 1, src)
						} else {
							err = a.ch.PostWriteUnsignaled(dst, src)
						}
						if err == nil {
							break
						}
						if !errors.Is(err, verbs.ErrQueueFull) {
							t.Fatal(err)
						}
						if err := a.ch.Progress(); err != nil {
							t.Fatal(err)
						}
					}
					if imm {
						if err := rh.Wait(ctx); err != nil {
							t.Fatal(err)
						}
						rh.Release()
					}
				})
				if allocs > 0 {
					t.Errorf("an unsignaled post (imm %v) allocates %.1f times", imm, allocs)
				}
			}
		})
	}
}

// TestPostedOperations: the posted form of every operation does what its
// blocking form does, its Handle saying so (the received immediate data,
// an atomic's prior value); the Batch forms with immediate data too.
func TestPostedOperations(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	wait := func(t *testing.T, h channel.Handle) {
		t.Helper()
		if err := h.Wait(ctx); err != nil || h.Err() != nil {
			t.Fatal(err, h.Err())
		}
	}
	// received posts a receive at b, runs post, and returns what it got.
	received := func(t *testing.T, post func() channel.Handle) channel.Received {
		t.Helper()
		r, err := b.ch.PostReceive(b.sge(1024, 64))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Release()
		h := post()
		defer h.Release()
		wait(t, h)
		wait(t, r)
		return r.Received()
	}
	// must(t)(post()) is post's Handle, failing t if post failed.
	must := func(t *testing.T) func(channel.Handle, error) channel.Handle {
		return func(h channel.Handle, err error) channel.Handle {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
			return h
		}
	}
	tests := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"PostSendImm", func(t *testing.T) {
			copy(a.buf.Bytes(), "imm")
			got := received(t, func() channel.Handle { return must(t)(a.ch.PostSendImm(0xabc, a.sge(0, 3))) })
			if got.Len != 3 || !got.HasImm || got.Imm != 0xabc || got.Write || string(b.buf.Bytes()[1024:1027]) != "imm" {
				t.Errorf("received %+v %q", got, b.buf.Bytes()[1024:1027])
			}
		}},
		{"PostWriteImm", func(t *testing.T) {
			copy(a.buf.Bytes()[100:], "posted")
			got := received(t, func() channel.Handle {
				return must(t)(a.ch.PostWriteImm(b.buf.Remote().At(3000), 77, a.sge(100, 6)))
			})
			if got.Len != 6 || !got.HasImm || got.Imm != 77 || !got.Write || string(b.buf.Bytes()[3000:3006]) != "posted" {
				t.Errorf("received %+v %q", got, b.buf.Bytes()[3000:3006])
			}
		}},
		{"PostRead", func(t *testing.T) {
			copy(b.buf.Bytes()[500:], "read back")
			h := must(t)(a.ch.PostRead(b.buf.Remote().At(500), a.sge(2000, 9)))
			defer h.Release()
			wait(t, h)
			if got := string(a.buf.Bytes()[2000:2009]); got != "read back" {
				t.Errorf("read %q", got)
			}
		}},
		{"PostCompareSwap", func(t *testing.T) {
			*b.word(4000) = 5
			miss := must(t)(a.ch.PostCompareSwap(b.buf.Remote().At(4000), 4, 100))
			defer miss.Release()
			wait(t, miss)
			hit := must(t)(a.ch.PostCompareSwap(b.buf.Remote().At(4000), 5, 100))
			defer hit.Release()
			wait(t, hit)
			if miss.Value() != 5 || hit.Value() != 5 || *b.word(4000) != 100 {
				t.Errorf("prior values %d, %d; word %d", miss.Value(), hit.Value(), *b.word(4000))
			}
		}},
		{"PostFetchAdd", func(t *testing.T) {
			*b.word(4008) = 40
			h := must(t)(a.ch.PostFetchAdd(b.buf.Remote().At(4008), 2))
			defer h.Release()
			wait(t, h)
			if h.Value() != 40 || *b.word(4008) != 42 {
				t.Errorf("prior %d, word %d", h.Value(), *b.word(4008))
			}
		}},
		{"Batch SendImm and WriteImm", func(t *testing.T) {
			r1, err := b.ch.PostReceive(b.sge(1024, 64))
			if err != nil {
				t.Fatal(err)
			}
			defer r1.Release()
			r2, err := b.ch.PostReceive()
			if err != nil {
				t.Fatal(err)
			}
			defer r2.Release()
			copy(a.buf.Bytes()[200:], "batched")
			err = a.ch.Batch(ctx, func(bt *channel.Batch) error {
				if bt.Context() != ctx {
					return errors.New("the batch's context is not its scope's")
				}
				s := bt.SendImm(1, a.sge(200, 7))
				w := bt.WriteImm(b.buf.Remote().At(3500), 2, a.sge(200, 7))
				return bt.WaitAll(s, w)
			})
			if err != nil {
				t.Fatal(err)
			}
			wait(t, r1)
			wait(t, r2)
			g1, g2 := r1.Received(), r2.Received()
			if g1.Imm != 1 || g1.Write || g1.Len != 7 || g2.Imm != 2 || !g2.Write || string(b.buf.Bytes()[3500:3507]) != "batched" {
				t.Errorf("received %+v and %+v", g1, g2)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.run)
	}
}

// TestBreak: Break fails what is in flight with a flush, and the channel
// stays broken: Broken and Err say so, later operations fail at once.
func TestBreak(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	r, err := b.ch.PostReceive(b.sge(0, 64))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Release()
	if b.ch.Broken() || b.ch.Err() != nil {
		t.Fatal("broken before Break", b.ch.Err())
	}
	b.ch.Break()
	err = r.Wait(ctx)
	for _, err := range []error{err, r.Err()} {
		var ce *verbs.CompletionError
		if !errors.As(err, &ce) || ce.Status != verbs.StatusWRFlushErr {
			t.Fatalf("the receive in flight: %v, want a flush", err)
		}
	}
	if !b.ch.Broken() || b.ch.Err() == nil {
		t.Fatal("not broken after Break")
	}
	if err := b.ch.Send(ctx, b.sge(0, 1)); err == nil {
		t.Fatal("a send on a broken channel succeeded")
	}
	// The other side's channel is not broken by it.
	if a.ch.Broken() {
		t.Fatal("Break broke the peer's channel too")
	}
}
