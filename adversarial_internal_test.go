package verbs

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// A fake provider whose calls can be held inside the provider, to check
// that Close never destroys a provider object while a call is using it
// (on hardware: ibv_destroy_cq or ibv_destroy_qp under ibv_poll_cq or
// ibv_post_send, a use after free in C), nor hands a destroyed one out.

// gate records the calls into one fake provider object.
type gate struct {
	hold     atomic.Bool   // calls block until release is closed
	entered  chan struct{} // a held call has entered
	release  chan struct{}
	inFlight atomic.Int32
	closed   atomic.Bool
	misuse   atomic.Value // string: what went wrong
}

func newGate() *gate { return &gate{entered: make(chan struct{}, 1), release: make(chan struct{})} }

func (g *gate) call(what string) {
	if g.closed.Load() {
		g.misuse.Store(what + " of a destroyed object")
	}
	g.inFlight.Add(1)
	defer g.inFlight.Add(-1)
	if g.hold.Load() {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		<-g.release
	}
}

func (g *gate) close() {
	if g.inFlight.Load() > 0 {
		g.misuse.Store("destroyed while a call was using it")
	}
	g.closed.Store(true)
}

type fakeCtx struct {
	prov.Context
	cq, qp *gate
	g      *gate // the context's own calls
}

func (c *fakeCtx) QueryDevice() (prov.DeviceAttr, error) {
	return prov.DeviceAttr{MaxQPWR: 64, MaxSGE: 4, MaxQPRDAtom: 4, MaxQPInitRDAtom: 4, MaxInlineData: 64}, nil
}
func (c *fakeCtx) QueryPort(uint8) (prov.PortAttr, error) {
	return prov.PortAttr{State: 4, MaxMTU: prov.MTU4096, ActiveMTU: prov.MTU4096, LinkLayer: 1, LID: 1}, nil
}
func (c *fakeCtx) AllocPD() (prov.PD, error) { return &fakePD{c: c}, nil }
func (c *fakeCtx) CreateCQ(n int, _ prov.CompChannel, _ int) (prov.CQ, error) {
	c.g.call("create cq")
	return &fakeCQ{g: c.cq, n: n}, nil
}
func (c *fakeCtx) Close() error { c.g.close(); return nil }

type fakePD struct {
	prov.PD
	c *fakeCtx
}

func (pd *fakePD) CreateQP(a prov.QPInitAttr) (prov.QP, error) {
	a.SendCQ.(*fakeCQ).g.call("create qp")
	return &fakeQP{g: pd.c.qp, init: a}, nil
}
func (pd *fakePD) Close() error { return nil }

type fakeCQ struct {
	g *gate
	n int
}

func (q *fakeCQ) Poll(dst []prov.Completion) (int, error) { q.g.call("poll"); return 0, nil }
func (q *fakeCQ) PollBusy(dst []prov.Completion, spins int) (int, error) {
	q.g.call("poll")
	return 0, nil
}
func (q *fakeCQ) Arm(bool) error { q.g.call("arm"); return nil }
func (q *fakeCQ) Cap() int       { q.g.call("cap"); return q.n }
func (q *fakeCQ) Close() error   { q.g.close(); return nil }

type fakeQP struct {
	g     *gate
	init  prov.QPInitAttr
	state atomic.Uint32
}

func (q *fakeQP) QPN() uint32 { return 7 }
func (q *fakeQP) Modify(a *prov.QPAttr, m prov.QPAttrMask) error {
	q.g.call("modify")
	if m&prov.AttrState != 0 {
		q.state.Store(uint32(a.State))
	}
	return nil
}
func (q *fakeQP) Query() (prov.QPAttr, prov.QPInitAttr, error) {
	q.g.call("query")
	return prov.QPAttr{State: prov.QPState(q.state.Load())}, q.init, nil
}
func (q *fakeQP) PostSend(w []prov.SendWR, _ []prov.SGE) (int, error) {
	q.g.call("post send")
	return len(w), nil
}
func (q *fakeQP) PostRecv(w []prov.RecvWR, _ []prov.SGE) (int, error) {
	q.g.call("post recv")
	return len(w), nil
}
func (q *fakeQP) Address() []byte { return nil }
func (q *fakeQP) Close() error    { q.g.close(); return nil }

// TestAdversarialCloseWaitsForProviderCalls closes a CQ while a Poll
// (and PollBusy, RequestNotify) is inside the provider, and a QP while a
// post (single, batched, receive) is: Close must wait for the call
// before destroying the provider object, and the calls after it must
// fail with ErrClosed without reaching the provider.
func TestAdversarialCloseWaitsForProviderCalls(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(cq *CompletionQueue, qp *RCQueuePair) error
		qp   bool // the call uses the QP (else the CQ), which is closed
	}{
		{"Poll", func(cq *CompletionQueue, _ *RCQueuePair) error { _, err := cq.Poll(make([]Completion, 4)); return err }, false},
		{"PollBusy", func(cq *CompletionQueue, _ *RCQueuePair) error {
			_, err := cq.PollBusy(make([]Completion, 4), 10)
			return err
		}, false},
		{"RequestNotify", func(cq *CompletionQueue, _ *RCQueuePair) error { return cq.RequestNotify(false) }, false},
		{"PostSend", func(_ *CompletionQueue, q *RCQueuePair) error { return q.PostSend(1, Signaled) }, true},
		{"PostSendInline", func(_ *CompletionQueue, q *RCQueuePair) error {
			return q.PostSendInline(1, Signaled, []byte("x"))
		}, true},
		{"Batch", func(_ *CompletionQueue, q *RCQueuePair) error { b := q.NewBatch(1); b.Send(1); return b.Submit() }, true},
		{"PostRecv", func(_ *CompletionQueue, q *RCQueuePair) error { return q.PostRecv(1) }, true},
		{"RecvBatch", func(_ *CompletionQueue, q *RCQueuePair) error { b := q.NewRecvBatch(1); b.Recv(1); return b.Submit() }, true},
		{"Query", func(_ *CompletionQueue, q *RCQueuePair) error { _, err := q.Query(); return err }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc := &fakeCtx{cq: newGate(), qp: newGate(), g: newGate()}
			c, err := newContext(fc, prov.DeviceInfo{Name: "fake0"}, "fake")
			if err != nil {
				t.Fatal(err)
			}
			pd, err := c.AllocPD()
			if err != nil {
				t.Fatal(err)
			}
			cq, err := c.NewCompletionQueue(CQSpec{NoChannel: true})
			if err != nil {
				t.Fatal(err)
			}
			qp, err := pd.NewRCQueuePair(QPSpec{SendCQ: cq})
			if err != nil {
				t.Fatal(err)
			}
			g, closeFn := fc.cq, func() error { qp.Close(); return cq.Close() }
			if tc.qp {
				g, closeFn = fc.qp, qp.Close
			}
			g.hold.Store(true)
			called := make(chan error, 1)
			go func() { called <- tc.call(cq, qp) }()
			<-g.entered // the call is inside the provider
			closed := make(chan error, 1)
			go func() { closed <- closeFn() }()
			var closeErr error
			returned := false
			select {
			case closeErr = <-closed:
				// Close returned while the call was still inside the
				// provider: it did not wait (g records the misuse).
				returned = true
			case <-time.After(200 * time.Millisecond):
				// Close waits for the call, as it should (or is slow).
			}
			close(g.release)
			if err := <-called; err != nil {
				t.Errorf("the call that entered before Close: %v", err)
			}
			if !returned {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				select {
				case closeErr = <-closed:
				case <-ctx.Done():
					t.Fatal("Close hangs after the call returned")
				}
			}
			if closeErr != nil {
				t.Fatalf("close: %v", closeErr)
			}
			first := g.misuse.Load()
			if first != nil {
				t.Errorf("the provider's object was %s", first)
			}
			if err := tc.call(cq, qp); !errors.Is(err, ErrClosed) {
				t.Errorf("the call after Close: %v, want ErrClosed", err)
			}
			if m := g.misuse.Load(); m != first {
				t.Errorf("the call after Close reached the provider: %s", m)
			}
			qp.Close()
			cq.Close()
			pd.Close()
			c.Close()
		})
	}
}

// TestAdversarialCloseWaitsForCreation closes a context while a CQ is
// being created in it, and a CQ while a QP is being created on it: the
// parent, which has no child yet, must not be destroyed under the
// provider's create. Either the create wins (the parent's Close then
// fails, naming the new child) or the Close does (the create fails with
// ErrClosed).
func TestAdversarialCloseWaitsForCreation(t *testing.T) {
	for _, name := range []string{"CQ", "QP"} {
		t.Run(name, func(t *testing.T) {
			fc := &fakeCtx{cq: newGate(), qp: newGate(), g: newGate()}
			c, err := newContext(fc, prov.DeviceInfo{Name: "fake0"}, "fake")
			if err != nil {
				t.Fatal(err)
			}
			pd, err := c.AllocPD()
			if err != nil {
				t.Fatal(err)
			}
			type closer interface{ Close() error }
			var cq *CompletionQueue
			var create func() (closer, error)
			var closeParent func() error
			g := fc.g
			if name == "CQ" {
				create = func() (closer, error) { return c.NewCompletionQueue(CQSpec{NoChannel: true}) }
				pd.Close()
				closeParent = c.Close
			} else {
				if cq, err = c.NewCompletionQueue(CQSpec{NoChannel: true}); err != nil {
					t.Fatal(err)
				}
				g = fc.cq
				create = func() (closer, error) { return pd.NewRCQueuePair(QPSpec{SendCQ: cq}) }
				closeParent = cq.Close
			}
			g.hold.Store(true)
			type made struct {
				o   closer
				err error
			}
			created := make(chan made, 1)
			go func() { o, err := create(); created <- made{o, err} }()
			<-g.entered
			closed := make(chan error, 1)
			go func() { closed <- closeParent() }()
			var closeErr error
			returned := false
			select {
			case closeErr = <-closed:
				returned = true // without waiting for the create
			case <-time.After(200 * time.Millisecond):
			}
			close(g.release)
			m := <-created
			if !returned {
				select {
				case closeErr = <-closed:
				case <-time.After(30 * time.Second):
					t.Fatal("Close hangs after the create returned")
				}
			}
			if mis := g.misuse.Load(); mis != nil {
				t.Errorf("the parent was %s (its create)", mis)
			}
			switch {
			case m.err == nil && closeErr != nil:
				m.o.Close()
				if err := closeParent(); err != nil {
					t.Errorf("closing the parent after its child: %v", err)
				}
			case m.err != nil && closeErr == nil:
				if !errors.Is(m.err, ErrClosed) {
					t.Errorf("create under a closed parent: %v, want ErrClosed", m.err)
				}
			default:
				t.Errorf("create: %v; close of its parent: %v (want exactly one to fail)", m.err, closeErr)
				if m.err == nil {
					m.o.Close()
				}
			}
			if cq != nil {
				cq.Close()
			}
			pd.Close()
			c.Close()
		})
	}
}

type fakeMR struct {
	g    *gate
	addr uint64
	n    int
}

func (m *fakeMR) Addr() uint64 { m.g.call("addr"); return m.addr }
func (m *fakeMR) Len() int     { m.g.call("len"); return m.n }
func (m *fakeMR) LKey() uint32 { m.g.call("lkey"); return 0x1234 }
func (m *fakeMR) RKey() uint32 { m.g.call("rkey"); return 0x5678 }
func (m *fakeMR) Close() error { m.g.close(); return nil }

type fakeMRPD struct {
	fakePD
	g *gate
}

func (pd *fakeMRPD) RegMR(m prov.Mem, _ prov.Access) (prov.MR, error) {
	return &fakeMR{g: pd.g, addr: uint64(uintptr(m.Ptr)), n: m.Len}, nil
}

type fakeMRCtx struct{ fakeCtx }

func (c *fakeMRCtx) AllocPD() (prov.PD, error) {
	return &fakeMRPD{fakePD: fakePD{c: &c.fakeCtx}, g: c.qp}, nil
}

// TestAdversarialMRAfterClose asks a closed MR (and CQ) for its keys,
// range, SGEs and capacity, as a program that logs them after Close
// might: the answers must not come from the provider's object, which
// Close destroyed (on hardware, the lkey and rkey live in the freed
// struct ibv_mr), and must be the values the object had.
func TestAdversarialMRAfterClose(t *testing.T) {
	fc := &fakeMRCtx{fakeCtx{cq: newGate(), qp: newGate(), g: newGate()}}
	c, err := newContext(fc, prov.DeviceInfo{Name: "fake0"}, "fake")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	buf := make([]byte, 64)
	mr, err := pd.Register(buf, AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	cq, err := c.NewCompletionQueue(CQSpec{Entries: 16, NoChannel: true})
	if err != nil {
		t.Fatal(err)
	}
	type view struct {
		addr       uint64
		n, cqCap   int
		lkey, rkey uint32
		sge, all   SGE
		remote     RemoteRegion
	}
	look := func() view {
		s, _ := mr.SGE(8, 8)
		return view{mr.Addr(), mr.Len(), cq.Cap(), mr.LKey(), mr.RKey(), s, mr.All(), mr.Remote()}
	}
	before := look()
	if err := mr.Close(); err != nil {
		t.Fatal(err)
	}
	if err := cq.Close(); err != nil {
		t.Fatal(err)
	}
	after := look()
	for _, g := range []*gate{fc.qp, fc.cq} {
		if m := g.misuse.Load(); m != nil {
			t.Errorf("after Close, the provider was asked for the %s", m)
		}
	}
	if after != before {
		t.Errorf("after Close: %+v, before: %+v", after, before)
	}
}

type fakeChCtx struct {
	fakeCtx
	ch *fakeCh
}

func (c *fakeChCtx) CreateCompChannel() (prov.CompChannel, error) { return c.ch, nil }

// fakeCh delivers the events pushed into it.
type fakeCh struct{ events chan prov.CQ }

func (ch *fakeCh) Wait(ctx context.Context) (prov.CQ, error) {
	select {
	case q := <-ch.events:
		return q, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
func (ch *fakeCh) Wake()        {}
func (ch *fakeCh) Close() error { return nil }

// TestAdversarialChannelEventOfClosedCQ has a completion channel deliver
// the event of a CQ that was closed after the provider queued it (the
// event is acknowledged; the CQ left the channel), then the event of a
// live CQ: Wait must return the live CQ, not fail the caller's wait loop
// with an error about an unknown CQ.
func TestAdversarialChannelEventOfClosedCQ(t *testing.T) {
	fc := &fakeChCtx{fakeCtx: fakeCtx{cq: newGate(), qp: newGate(), g: newGate()}, ch: &fakeCh{events: make(chan prov.CQ, 2)}}
	c, err := newContext(fc, prov.DeviceInfo{Name: "fake0"}, "fake")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ch, err := c.NewCompletionChannel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	gone, err := c.NewCompletionQueue(CQSpec{Channel: ch})
	if err != nil {
		t.Fatal(err)
	}
	live, err := c.NewCompletionQueue(CQSpec{Channel: ch})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	fc.ch.events <- gone.cq
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	fc.ch.events <- live.cq
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := ch.Wait(ctx)
	if err != nil || got != live {
		t.Errorf("Wait after the event of a closed CQ: %p, %v; want the live CQ %p", got, err, live)
	}
}
