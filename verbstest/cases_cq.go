package verbstest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// expectCtxErr checks that err reports the end of a context: it matches
// both the context's error and verbs.ErrTimeout.
func expectCtxErr(t testing.TB, what string, err, ctxErr error) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s: returned nil, want an error matching %v and verbs.ErrTimeout", what, ctxErr)
	case !errors.Is(err, ctxErr) || !errors.Is(err, verbs.ErrTimeout):
		t.Errorf("%s: %v, want an error matching %v and verbs.ErrTimeout", what, err, ctxErr)
	}
}

// testCQWait checks CompletionQueue.Wait: it honours a cancelled context
// and a deadline, and returns once a completion arrives.
func testCQWait(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expectCtxErr(t, "Wait on an empty CQ with a cancelled context", p.B.CQ.Wait(cancelled), context.Canceled)
	short, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	expectCtxErr(t, "Wait on an empty CQ with a short deadline", p.B.CQ.Wait(short), context.DeadlineExceeded)

	// A waiter in another goroutine wakes up for a completion.
	guard := c.guard(t)
	done := make(chan error, 1)
	go func() { done <- p.B.CQ.Wait(guard) }()
	src := p.A.Alloc(t, 64, accessLocal)
	dst := p.B.Alloc(t, 64, accessLocal)
	must(t, "post recv", p.QB.PostRecv(1, dst.All()))
	must(t, "post send", p.QA.PostSend(2, verbs.Signaled, SGE(t, src, 0, 8)))
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Wait while a completion arrives: %v", err)
		}
	case <-guard.Done():
		t.Fatalf("Wait did not return after a completion arrived (hang guard %v)", c.cfg.Timeout)
	}
	// The completion is still there: Wait returns at once, and Poll gets it.
	if err := p.B.CQ.Wait(guard); err != nil {
		t.Errorf("Wait on a CQ that holds a completion: %v", err)
	}
	var wc [2]verbs.Completion
	n, err := p.B.CQ.Poll(wc[:])
	must(t, "poll", err)
	if n != 1 {
		t.Fatalf("Poll after Wait returned %d completions, want 1", n)
	}
	expectOK(t, "completion after Wait", wc[0], 1, verbs.OpRecv, p.QB.QPN())
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())

	// A CQ without a channel cannot Wait.
	nc := p.B.NewCQ(t, verbs.CQSpec{NoChannel: true})
	if err := nc.Wait(guard); !errors.Is(err, verbs.ErrNotSupported) {
		t.Errorf("Wait on a CQ created with NoChannel: %v, want an error matching ErrNotSupported", err)
	}
}

// testCQWake checks CompletionQueue.Wake: it ends a Wait in progress with
// nil, or the next Wait when none is in progress (several Wakes, one
// wake); a Wait after a woken one waits again; the CQ works on; a CQ
// without a channel of its own cannot be woken, nor can a closed one.
func testCQWake(t *testing.T, c *tcase) {
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{})
	guard := c.guard(t)

	done := make(chan error, 1)
	go func() { done <- p.B.CQ.Wait(guard) }()
	// Wake until the Wait returns: a Wake before the goroutine waits
	// ends its Wait at once as well.
	var err error
	for woken := false; !woken; {
		must(t, "wake", p.B.CQ.Wake())
		select {
		case err = <-done:
			woken = true
		case <-time.After(10 * time.Millisecond):
		case <-guard.Done():
			t.Fatalf("Wake did not end a Wait (hang guard %v)", c.cfg.Timeout)
		}
	}
	if err != nil {
		t.Fatalf("Wait ended by Wake: %v, want nil", err)
	}
	// The Wakes the loop made after the Wait slept may have left one
	// pending: a Wait takes it, or waits until its deadline.
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	p.B.CQ.Wait(short)
	cancel()
	short, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	expectCtxErr(t, "Wait after a woken one", p.B.CQ.Wait(short), context.DeadlineExceeded)

	must(t, "wake", p.B.CQ.Wake())
	must(t, "wake", p.B.CQ.Wake())
	if err := p.B.CQ.Wait(guard); err != nil {
		t.Fatalf("Wait after Wake: %v, want nil", err)
	}
	short2, cancel2 := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel2()
	expectCtxErr(t, "Wait after two Wakes and one Wait", p.B.CQ.Wait(short2), context.DeadlineExceeded)

	// The CQ works on: a completion ends a Wait, and is polled.
	src := p.A.Alloc(t, 64, accessLocal)
	dst := p.B.Alloc(t, 64, accessLocal)
	must(t, "post recv", p.QB.PostRecv(1, dst.All()))
	must(t, "post send", p.QA.PostSend(2, verbs.Signaled, SGE(t, src, 0, 8)))
	must(t, "wait for the receive", p.B.CQ.Wait(guard))
	expectOK(t, "completion after Wait", c.pollOne(t, p.B.CQ), 1, verbs.OpRecv, p.QB.QPN())
	expectOK(t, "send completion", c.pollOne(t, p.A.CQ), 2, verbs.OpSend, p.QA.QPN())

	nc := p.B.NewCQ(t, verbs.CQSpec{NoChannel: true})
	if err := nc.Wake(); !errors.Is(err, verbs.ErrNotSupported) {
		t.Errorf("Wake of a CQ created with NoChannel: %v, want an error matching ErrNotSupported", err)
	}
	cq := p.B.NewCQ(t, verbs.CQSpec{})
	must(t, "close cq", cq.Close())
	if err := cq.Wake(); !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("Wake of a closed CQ: %v, want an error matching ErrClosed", err)
	}
}

// testChannelShared shares one completion channel between two CQs: Wait
// returns the CQ that has the event.
func testChannelShared(t *testing.T, c *tcase) {
	a, b, ch, cqSend, cqRecv, qa, qb := channelPair(t, c)
	ma := a.Alloc(t, 64, accessLocal)
	mb := b.Alloc(t, 64, accessLocal)
	guard := c.guard(t)

	must(t, "arm send cq", cqSend.RequestNotify(false))
	must(t, "arm recv cq", cqRecv.RequestNotify(false))

	// A receive at B: an event for the receive CQ.
	must(t, "post recv at B", qb.PostRecv(1, SGE(t, mb, 0, 32)))
	must(t, "post send from A", qa.PostSend(2, verbs.Signaled, SGE(t, ma, 0, 8)))
	got, err := ch.Wait(guard)
	must(t, "wait on the shared channel", err)
	if got != cqRecv {
		t.Errorf("Wait returned the %s, want the receive CQ", cqName(got, cqSend, cqRecv))
	}
	expectOK(t, "receive completion", c.pollOne(t, cqRecv), 1, verbs.OpRecv, qb.QPN())
	expectOK(t, "send completion at A", c.pollOne(t, a.CQ), 2, verbs.OpSend, qa.QPN())
	expectEmpty(t, "send CQ of B", cqSend)

	// A send from B: an event for the send CQ, armed since the start.
	must(t, "post recv at A", qa.PostRecv(3, SGE(t, ma, 32, 32)))
	must(t, "post send from B", qb.PostSend(4, verbs.Signaled, SGE(t, mb, 0, 8)))
	got, err = ch.Wait(guard)
	must(t, "wait on the shared channel", err)
	if got != cqSend {
		t.Errorf("Wait returned the %s, want the send CQ", cqName(got, cqSend, cqRecv))
	}
	expectOK(t, "send completion at B", c.pollOne(t, cqSend), 4, verbs.OpSend, qb.QPN())
	expectOK(t, "receive completion at A", c.pollOne(t, a.CQ), 3, verbs.OpRecv, qa.QPN())

	// No CQ is armed: Wait ends with the context.
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = ch.Wait(cancelled)
	expectCtxErr(t, "channel Wait with a cancelled context", err, context.Canceled)

	if err := cqRecv.Wait(guard); !errors.Is(err, verbs.ErrNotSupported) {
		t.Errorf("CompletionQueue.Wait on a CQ with a shared channel: %v, want an error matching ErrNotSupported", err)
	}
	if err := ch.Close(); err == nil || !strings.Contains(err.Error(), "completion queue") {
		t.Errorf("closing a channel used by two CQs: %v, want an error naming them", err)
	}
}

// channelPair connects a RC queue pair of A to one of B whose send and
// receive CQs share one completion channel.
func channelPair(t *testing.T, c *tcase) (a, b *Node, ch *verbs.CompletionChannel, scq, rcq *verbs.CompletionQueue, qa, qb *verbs.RCQueuePair) {
	a, b = NewNodes(t, c.cfg)
	ch = b.NewChannel(t)
	scq = b.NewCQ(t, verbs.CQSpec{Channel: ch})
	rcq = b.NewCQ(t, verbs.CQSpec{Channel: ch})
	qa = a.NewRC(t, verbs.QPSpec{})
	qb = b.NewRC(t, verbs.QPSpec{SendCQ: scq, RecvCQ: rcq})
	ConnectRC(t, qa, qb)
	return a, b, ch, scq, rcq, qa, qb
}

func cqName(got, send, recv *verbs.CompletionQueue) string {
	switch got {
	case send:
		return "send CQ"
	case recv:
		return "receive CQ"
	case nil:
		return "nil CQ"
	}
	return "unknown CQ"
}
