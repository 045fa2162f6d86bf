package provproxy_test

import (
	"context"
	"errors"
	"io"
	"runtime"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/provproxy"
	"github.com/goverbs/verbs/verbstest"
)

// waitResult runs wait in a goroutine and returns its result, failing the
// test if it does not return before the hang guard.
func waitResult(t *testing.T, wait func() error) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- wait() }()
	return done
}

func expectReturn(t *testing.T, what string, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-guard(t).Done():
		t.Fatalf("%s did not return within the hang guard (%v)", what, timeout)
		return nil
	}
}

// TestWaitCancelled checks that a blocking wait in the peer ends when its
// context does (cancelled, or past its deadline), and that the cancelled
// wait really ended in the peer: the next event goes to the next wait.
func TestWaitCancelled(t *testing.T) {
	for _, tc := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"Cancel", func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }, context.Canceled},
		{"Deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 10*time.Millisecond)
		}, context.DeadlineExceeded},
		{"AlreadyCancelled", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx, cancel
		}, context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verbstest.CheckLeaks(t)
			p := crossPair(t, verbs.QPSpec{})
			ch := p.B.NewChannel(t)
			cq := p.B.NewCQ(t, verbs.CQSpec{Channel: ch})
			must(t, cq.RequestNotify(false))

			ctx, cancel := tc.ctx()
			defer cancel()
			done := waitResult(t, func() error { _, err := ch.Wait(ctx); return err })
			if tc.want == context.Canceled {
				cancel()
			}
			err := expectReturn(t, "a cancelled channel Wait", done)
			if !errors.Is(err, tc.want) || !errors.Is(err, verbs.ErrTimeout) {
				t.Fatalf("Wait: %v, want an error matching %v and ErrTimeout", err, tc.want)
			}

			// An event now goes to the next waiter, not to the ended one.
			qb := p.B.NewRC(t, verbs.QPSpec{SendCQ: cq})
			qa := p.A.NewRC(t, verbs.QPSpec{})
			verbstest.ConnectRC(t, qa, qb)
			src := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
			dst := p.A.Alloc(t, 64, verbs.AccessRemoteAll)
			must(t, qb.PostWrite(1, verbs.Signaled, dst.Remote().At(0), verbstest.SGE(t, src, 0, 8)))
			got, err := ch.Wait(guard(t))
			if err != nil || got != cq {
				t.Fatalf("Wait after the cancelled one: %v, %v; want the CQ", got, err)
			}
			if wc := pollOne(t, cq); wc.WRID != 1 {
				t.Errorf("completion %v, want wr_id 1", wc)
			}
		})
	}
}

// TestAsyncEventCancelled checks the same for Context.AsyncEvent: a
// cancelled wait ends, and the next event (an SRQ limit) goes to the next
// waiter.
func TestAsyncEventCancelled(t *testing.T) {
	verbstest.CheckLeaks(t)
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice, PeerProcessB: true})
	ctx, cancel := context.WithCancel(context.Background())
	done := waitResult(t, func() error { _, err := b.Ctx.AsyncEvent(ctx); return err })
	cancel()
	if err := expectReturn(t, "a cancelled AsyncEvent", done); !errors.Is(err, context.Canceled) {
		t.Fatalf("AsyncEvent: %v, want an error matching context.Canceled", err)
	}

	srq := b.NewSRQ(t, verbs.SRQSpec{MaxWR: 8})
	qb := b.NewRC(t, verbs.QPSpec{SRQ: srq})
	qa := a.NewRC(t, verbs.QPSpec{})
	verbstest.ConnectRC(t, qa, qb)
	bufs := b.Alloc(t, 4*64, verbs.AccessLocalWrite)
	for i := range 4 {
		must(t, srq.PostRecv(uint64(i), verbstest.SGE(t, bufs, i*64, 64)))
	}
	must(t, srq.ArmLimit(3))
	src := a.Alloc(t, 64, verbs.AccessLocalWrite)
	for i := range 2 {
		must(t, qa.PostSend(uint64(i), verbs.Signaled, verbstest.SGE(t, src, 0, 8)))
	}
	if _, err := verbstest.PollN(guard(t), b.CQ, 2); err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := b.Ctx.AsyncEvent(guard(t))
		if err != nil {
			t.Fatalf("AsyncEvent after the cancelled one: %v", err)
		}
		if ev.Type == verbs.EventSRQLimitReached {
			break
		}
	}
	if _, err := verbstest.PollN(guard(t), a.CQ, 2); err != nil {
		t.Fatal(err)
	}
}

// TestPeerKilled kills the peer while calls wait in it: each fails with an
// error wrapping ErrConnLost and the cause, later calls fail at once, and
// once the client is closed no goroutine is left.
func TestPeerKilled(t *testing.T) {
	ign := goleak.IgnoreCurrent()
	t.Run("run", func(t *testing.T) {
		p := startPeer(t)
		c, err := p.c.Open(verbs.SoftDevice)
		must(t, err)
		ch, err := c.CreateCompChannel()
		must(t, err)
		cq, err := c.CreateCQ(16, ch, 0)
		must(t, err)
		must(t, cq.Arm(false))
		waitCh := waitResult(t, func() error { _, err := ch.Wait(guard(t)); return err })
		waitEv := waitResult(t, func() error { _, err := c.AsyncEvent(guard(t)); return err })
		// Kill the peer once both calls wait for their answers.
		for provproxy.Outstanding(p.c) < 2 {
			if guard(t).Err() != nil {
				t.Fatalf("the waits were not sent within the hang guard")
			}
			runtime.Gosched()
		}
		p.kill()
		for _, w := range []struct {
			name string
			done <-chan error
		}{{"channel Wait", waitCh}, {"AsyncEvent", waitEv}} {
			err := expectReturn(t, w.name, w.done)
			// The cause is the end of the connection, as the reader or
			// (if the kill came between registering and sending a
			// request) the send saw it.
			if !errors.Is(err, provproxy.ErrConnLost) ||
				!(errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)) {
				t.Errorf("%s in a killed peer: %v, want an error wrapping ErrConnLost and the end of the connection", w.name, err)
			}
		}
		if _, err := c.QueryDevice(); !errors.Is(err, provproxy.ErrConnLost) {
			t.Errorf("QueryDevice after the peer died: %v, want an error wrapping ErrConnLost", err)
		}
		if !errors.Is(p.c.Err(), provproxy.ErrConnLost) {
			t.Errorf("Client.Err() = %v, want ErrConnLost", p.c.Err())
		}
		p.stop()
		if _, err := c.QueryDevice(); !errors.Is(err, prov.ErrClosed) && !errors.Is(err, provproxy.ErrConnLost) {
			t.Errorf("QueryDevice after Close: %v", err)
		}
	})
	goleak.VerifyNone(t, ign)
}
