package session

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// Adversarial tests: the session used the way a careless or demanding
// application would (messages released out of order from several
// goroutines, receivers racing each other, contexts cancelled at any
// moment, Close in the middle of everything), each asserting what must
// hold: every message delivered once, in order, with its bytes and
// immediate data, and clear errors.

// advCtx is a context that only guards against a hang.
func advCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// A test message is identified by its immediate data: kind (a message
// or the notice of a WriteImm), sender and sequence number. Its size
// and bytes follow from them (advPlan).
const (
	advMsg    = 0
	advNotice = 1
)

func advImm(kind, sender, seq int) uint32 {
	return uint32(kind)<<30 | uint32(sender)<<22 | uint32(seq)
}

func advDecode(imm uint32) (kind, sender, seq int) {
	return int(imm >> 30), int(imm>>22) & 0xff, int(imm & (1<<22 - 1))
}

func advFill(b []byte, sender, seq int) {
	for i := range b {
		b[i] = byte(seq*31 + sender*7 + i)
	}
}

// advPlan is the traffic of a test: senders send msgs messages each,
// message seq of size sizes[seq%len(sizes)], every notice-th a WriteImm
// into the receiver's region (0: none).
type advPlan struct {
	senders, msgs int
	sizes         []int
	notice        int
}

func (p advPlan) kind(seq int) int {
	if p.notice > 0 && seq%p.notice == p.notice-1 {
		return advNotice
	}
	return advMsg
}

func (p advPlan) size(seq int) int { return p.sizes[seq%len(p.sizes)] }

func (p advPlan) total() int { return p.senders * p.msgs }

// noticeOff is where the WriteImm of (sender, seq) writes its 8 bytes in
// the receiver's region.
func (p advPlan) noticeOff(sender, seq int) int { return (sender*p.msgs + seq) * 8 }

func (p advPlan) noticeRegion() int { return max(p.total()*8, 8) }

func advNoticeWord(sender, seq int) uint64 { return 1<<40 | uint64(sender)<<24 | uint64(seq) }

// advEnds are the two ends of the traffic: the sending session, with
// the region of the receiver it may write (notices), and the receiving
// session with that region.
type advEnds struct {
	plan   advPlan
	tx, rx *Session
	remote *RemoteMR // rx's region, for tx's WriteImm
	region LocalMR   // the same, rx's
}

// advSetup offers a region of rx to tx for the plan's notices.
func advSetup(t testing.TB, ctx context.Context, plan advPlan, tx, rx *Session) *advEnds {
	t.Helper()
	e := &advEnds{plan: plan, tx: tx, rx: rx}
	if plan.notice == 0 {
		return e
	}
	var err error
	if e.region, err = rx.mem.AllocZeroed(plan.noticeRegion()); err != nil {
		t.Fatal(err)
	}
	if _, err := rx.SendLocalMR(ctx, e.region, verbs.AccessRemoteWrite, time.Hour); err != nil {
		t.Fatal(err)
	}
	if e.remote, err = tx.ReceiveRemoteMR(ctx); err != nil {
		t.Fatal(err)
	}
	return e
}

// send sends message seq of sender, by a method chosen by seq (SendImm,
// SendSlice, PostSendSlice and Wait), or its notice (WriteImm). ctx may
// be cancelled: a region whose send did not return nil is kept (it may
// still be read), in keep.
func (e *advEnds) send(ctx context.Context, sender, seq int, keep *[]LocalMR) error {
	imm := advImm(e.plan.kind(seq), sender, seq)
	if e.plan.kind(seq) == advNotice {
		src, err := e.tx.Alloc(8)
		if err != nil {
			return err
		}
		binary.LittleEndian.PutUint64(src.Bytes(), advNoticeWord(sender, seq))
		dst, err := e.remote.Slice(e.plan.noticeOff(sender, seq), 8)
		if err != nil {
			return err
		}
		err = e.tx.WriteImm(ctx, dst, imm, src.All())
		if err != nil {
			*keep = append(*keep, src)
		} else {
			src.Free()
		}
		return err
	}
	n := e.plan.size(seq)
	switch seq % 4 {
	case 1, 2:
		r, err := e.tx.Alloc(max(n, 1))
		if err != nil {
			return err
		}
		advFill(r.Bytes()[:n], sender, seq)
		sl, _ := r.Slice(0, n)
		if seq%4 == 1 {
			err = e.tx.SendSlice(ctx, sl, imm, true)
		} else {
			var p Pending
			if p, err = e.tx.PostSendSlice(ctx, sl, imm, true); err == nil {
				err = p.Wait(ctx)
			}
		}
		if err != nil {
			*keep = append(*keep, r)
		} else {
			r.Free()
		}
		return err
	default:
		b := make([]byte, n)
		advFill(b, sender, seq)
		return e.tx.SendImm(ctx, imm, b)
	}
}

// check checks a received message (kind, bytes, immediate data) and
// returns its sender and sequence number.
func (e *advEnds) check(m Message) (sender, seq int, err error) {
	imm, ok := m.Imm()
	if !ok {
		return 0, 0, fmt.Errorf("a message without immediate data (%d bytes)", m.Len())
	}
	kind, sender, seq := advDecode(imm)
	if kind != e.plan.kind(seq) || m.IsWrite() != (kind == advNotice) {
		return 0, 0, fmt.Errorf("message %d of sender %d: kind %d, IsWrite %v", seq, sender, kind, m.IsWrite())
	}
	if kind == advNotice {
		return sender, seq, e.checkNotice(sender, seq, m.Len())
	}
	return sender, seq, e.checkBytes(m.Bytes(), sender, seq)
}

func (e *advEnds) checkBytes(b []byte, sender, seq int) error {
	want := make([]byte, e.plan.size(seq))
	advFill(want, sender, seq)
	if !bytes.Equal(b, want) {
		return fmt.Errorf("message %d of sender %d: %d bytes, not the %d sent (or changed)", seq, sender, len(b), len(want))
	}
	return nil
}

func (e *advEnds) checkNotice(sender, seq, n int) error {
	if n != 0 {
		return fmt.Errorf("the notice %d of sender %d has %d bytes", seq, sender, n)
	}
	off := e.plan.noticeOff(sender, seq)
	if got := binary.LittleEndian.Uint64(e.region.Bytes()[off:]); got != advNoticeWord(sender, seq) {
		return fmt.Errorf("the notice %d of sender %d came before its data: %#x", seq, sender, got)
	}
	return nil
}

// checkInto checks a message received by ReceiveInto.
func (e *advEnds) checkInto(b []byte, imm uint32, hasImm bool) (sender, seq int, err error) {
	if !hasImm {
		return 0, 0, fmt.Errorf("a message without immediate data (%d bytes)", len(b))
	}
	kind, sender, seq := advDecode(imm)
	if kind != e.plan.kind(seq) {
		return 0, 0, fmt.Errorf("message %d of sender %d: kind %d", seq, sender, kind)
	}
	if kind == advNotice {
		return sender, seq, e.checkNotice(sender, seq, len(b))
	}
	return sender, seq, e.checkBytes(b, sender, seq)
}

// runSenders sends the plan from its senders, each in order, with no
// cancellation; it returns a channel of their first errors.
func (e *advEnds) runSenders(ctx context.Context) <-chan error {
	errc := make(chan error, e.plan.senders)
	for id := range e.plan.senders {
		go func() {
			var keep []LocalMR
			for seq := range e.plan.msgs {
				if err := e.send(ctx, id, seq, &keep); err != nil {
					errc <- fmt.Errorf("sender %d, message %d: %w", id, seq, err)
					return
				}
			}
			errc <- nil
		}()
	}
	return errc
}

// order checks that each sender's messages come in order, each once.
type order struct {
	mu   sync.Mutex
	next []int
}

func newOrder(senders int) *order { return &order{next: make([]int, senders)} }

// got records message seq of sender; every message must come, in order.
func (o *order) got(sender, seq int) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if sender >= len(o.next) || seq != o.next[sender] {
		return fmt.Errorf("sender %d: message %d where %d was due", sender, seq, o.next[min(sender, len(o.next)-1)])
	}
	o.next[sender]++
	return nil
}

func firstErr(errc <-chan error, n int) error {
	var first error
	for range n {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// TestAdvReleaseOutOfOrder: received messages are handed to several
// goroutines that hold them for a while and release them in random
// order while the next ones arrive (from several senders, eager,
// rendezvous and WriteImm notices mixed), with few receive buffers: a
// held message keeps its bytes until its Release (the sender waits for
// credits, it never overwrites a slot still held), and every message
// arrives once, in its sender's order.
func TestAdvReleaseOutOfOrder(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cfg       Config
		plan      advPlan
		releasers int
	}{
		{"eager, 2 buffers", Config{ReceiveBuffers: 2, MessageSize: 64},
			advPlan{senders: 1, msgs: 20000, sizes: []int{1, 8, 64, 0, 33}}, 3},
		{"eager, 3 buffers, 3 senders", Config{ReceiveBuffers: 3, MessageSize: 128},
			advPlan{senders: 3, msgs: 5000, sizes: []int{128, 1, 77}}, 4},
		{"mixed, 4 buffers, 3 senders", Config{ReceiveBuffers: 4, MessageSize: 256},
			advPlan{senders: 3, msgs: 300, sizes: []int{0, 1, 100, 256, 257, 3000}, notice: 5}, 4},
		{"mixed, 1 buffer, depth 1, 2 senders", Config{ReceiveBuffers: 1, MessageSize: 1, QueueDepth: 1},
			advPlan{senders: 2, msgs: 200, sizes: []int{0, 1, 64, 65, 500}, notice: 4}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, tc.cfg)
			ctx := advCtx(t)
			e := advSetup(t, ctx, tc.plan, a, b)
			senders := e.runSenders(ctx)
			bad := make(chan error, tc.releasers+1)
			report := func(err error) {
				select {
				case bad <- err:
				default:
				}
			}
			// Each message goes to a releaser chosen at random.
			ins := make([]chan Message, tc.releasers)
			var outOfOrder atomic.Int64 // releases with another message held
			var wg sync.WaitGroup
			closeIns := sync.OnceFunc(func() {
				for _, in := range ins {
					close(in)
				}
			})
			// A failure below still ends the releasers (else they
			// leak, failing the leak checks of the tests after it).
			defer func() {
				closeIns()
				wg.Wait()
			}()
			for g := range tc.releasers {
				in := make(chan Message)
				ins[g] = in
				wg.Add(1)
				go func() {
					defer wg.Done()
					var stash []Message
					release := func() {
						if len(stash) > 1 {
							outOfOrder.Add(1)
						}
						i := rand.IntN(len(stash))
						m := stash[i]
						stash[i] = stash[len(stash)-1]
						stash = stash[:len(stash)-1]
						for range rand.IntN(4) {
							runtime.Gosched()
						}
						if _, _, err := e.check(m); err != nil {
							report(fmt.Errorf("held: %w", err))
						}
						m.Release()
						m.Release() // twice: nothing more is given back
					}
					for {
						if len(stash) == 0 {
							m, ok := <-in
							if !ok {
								return
							}
							stash = append(stash, m)
							continue
						}
						// Hold up to three, waiting a few yields for
						// the next before releasing one (never
						// blocking: the one held may be what keeps
						// the next from coming).
						var m Message
						ok, got := true, false
						for range rand.IntN(8) * min(3-len(stash), 1) {
							select {
							case m, ok = <-in:
								got = true
							default:
								runtime.Gosched()
								continue
							}
							break
						}
						switch {
						case !ok:
							for len(stash) > 0 {
								release()
							}
							return
						case got:
							stash = append(stash, m)
						default:
							release()
						}
					}
				}()
			}
			o := newOrder(tc.plan.senders)
			for range tc.plan.total() {
				m, err := b.Receive(ctx)
				if err != nil {
					t.Fatal(err)
				}
				sender, seq, err := e.check(m)
				if err == nil {
					err = o.got(sender, seq)
				}
				if err != nil {
					t.Fatal(err)
				}
				ins[rand.IntN(len(ins))] <- m
			}
			closeIns()
			wg.Wait()
			t.Logf("%d of %d releases chose among several held messages", outOfOrder.Load(), tc.plan.total())
			if err := firstErr(senders, tc.plan.senders); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-bad:
				t.Fatal(err)
			default:
			}
			advAllBack(t, ctx, a, b)
		})
	}
}

// advAllBack checks that every ring slot of rx went back to tx: as many
// messages as rx has buffers go through without a wait for credits.
func advAllBack(t *testing.T, ctx context.Context, tx, rx *Session) {
	t.Helper()
	rx.rmu.Lock()
	busy := 0
	for _, b := range rx.busy {
		if b {
			busy++
		}
	}
	posted := len(rx.fifo)
	rx.rmu.Unlock()
	if busy != 0 || posted != rx.cfg.ReceiveBuffers {
		t.Fatalf("%d ring slots still busy, %d receives posted of %d", busy, posted, rx.cfg.ReceiveBuffers)
	}
	for i := range rx.cfg.ReceiveBuffers {
		if err := tx.Send(ctx, []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range rx.cfg.ReceiveBuffers {
		var one [1]byte
		if n, _, _, err := rx.ReceiveInto(ctx, one[:]); err != nil || n != 1 || one[0] != byte(i) {
			t.Fatalf("the last messages: %d: %d %v %v", i, n, one, err)
		}
	}
}

// TestAdvConcurrentReceivers: several goroutines receive at once, with
// Receive, ReceiveInto, or both, ReceiveInto often into a buffer too
// short (the message then stays for the next receive, whoever makes
// it), while eager, rendezvous and empty messages and WriteImm notices
// of several senders arrive: each message is received once, with its
// bytes and immediate data, and each goroutine sees each sender's
// messages in order.
func TestAdvConcurrentReceivers(t *testing.T) {
	plan := advPlan{senders: 2, msgs: 1500, sizes: []int{0, 5, 200, 256, 1000, 40000, 17}, notice: 6}
	for _, tc := range []struct {
		name  string
		into  func(g int) bool // goroutine g uses ReceiveInto
		goros int
	}{
		{"Receive", func(int) bool { return false }, 4},
		{"ReceiveInto", func(int) bool { return true }, 4},
		{"mixed", func(g int) bool { return g%2 == 1 }, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 256})
			ctx := advCtx(t)
			e := advSetup(t, ctx, plan, a, b)
			senders := e.runSenders(ctx)
			done, finish := context.WithCancel(ctx)
			defer finish()
			var count atomic.Int64
			seen := make([]atomic.Int32, plan.total())
			var shorts atomic.Int64
			errc := make(chan error, tc.goros)
			for g := range tc.goros {
				go func() {
					last := make([]int, plan.senders)
					for i := range last {
						last[i] = -1
					}
					dst := make([]byte, 64<<10)
					took := func(sender, seq int, err error) error {
						if err != nil {
							return err
						}
						if seq <= last[sender] {
							return fmt.Errorf("goroutine %d: message %d of sender %d after %d", g, seq, sender, last[sender])
						}
						last[sender] = seq
						if n := seen[sender*plan.msgs+seq].Add(1); n != 1 {
							return fmt.Errorf("message %d of sender %d received %d times", seq, sender, n)
						}
						if count.Add(1) == int64(plan.total()) {
							finish()
						}
						return nil
					}
					for {
						var err error
						if tc.into(g) {
							size := []int{len(dst), 0, 16, 300}[rand.IntN(4)]
							n, imm, hasImm, rerr := b.ReceiveInto(done, dst[:size])
							switch {
							case errors.Is(rerr, io.ErrShortBuffer):
								shorts.Add(1)
								continue
							case rerr != nil:
								err = rerr
							default:
								err = took(e.checkInto(dst[:n], imm, hasImm))
							}
						} else {
							m, rerr := b.Receive(done)
							if rerr == nil {
								err = took(e.check(m))
								m.Release()
							} else {
								err = rerr
							}
						}
						if err != nil {
							if count.Load() == int64(plan.total()) && errors.Is(err, context.Canceled) {
								err = nil
							}
							errc <- err
							return
						}
					}
				}()
			}
			if err := firstErr(errc, tc.goros); err != nil {
				t.Fatal(err)
			}
			if err := firstErr(senders, plan.senders); err != nil {
				t.Fatal(err)
			}
			t.Logf("%d receives into too short a buffer", shorts.Load())
			advAllBack(t, ctx, a, b)
		})
	}
}

// advCanceller returns a context that ends at a random moment: at once,
// after a few yields, or after a few microseconds.
func advCanceller(parent context.Context, i int) (context.Context, context.CancelFunc) {
	switch i % 5 {
	case 0:
		ctx, cancel := context.WithCancel(parent)
		cancel()
		return ctx, cancel
	case 1, 2:
		ctx, cancel := context.WithCancel(parent)
		go func() {
			for range rand.IntN(20) {
				runtime.Gosched()
			}
			cancel()
		}()
		return ctx, cancel
	default:
		return context.WithTimeout(parent, time.Duration(rand.IntN(200))*time.Microsecond)
	}
}

func isCtxErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// TestAdvCancelReceive: Receives and ReceiveIntos whose contexts end at
// random moments (before the turn, waiting for the message, in the
// middle of a rendezvous read of 256 KiB), and ReceiveIntos into too
// short a buffer, lose nothing: retried, they return every message once,
// in order, whole.
func TestAdvCancelReceive(t *testing.T) {
	plan := advPlan{senders: 1, msgs: 1200, sizes: []int{10, 256 << 10, 0, 4096, 300, 100 << 10}, notice: 7}
	a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 4096})
	ctx := advCtx(t)
	e := advSetup(t, ctx, plan, a, b)
	senders := e.runSenders(ctx)
	dst := make([]byte, 256<<10)
	cancelled, short := 0, 0
	for i, seq := 0, 0; seq < plan.msgs; i++ {
		rctx, cancel := advCanceller(ctx, i)
		var sender, got int
		var err error
		if i%2 == 0 {
			var m Message
			if m, err = b.Receive(rctx); err == nil {
				sender, got, err = e.check(m)
				m.Release()
			}
		} else {
			// Now and then too short: the message stays (with its
			// rendezvous read done, or still pending if cancelled).
			into := dst[:[]int{len(dst), len(dst), 1, 0}[i%4]]
			n, imm, hasImm, rerr := b.ReceiveInto(rctx, into)
			if err = rerr; err == nil {
				sender, got, err = e.checkInto(into[:n], imm, hasImm)
			}
		}
		cancel()
		if isCtxErr(err) && ctx.Err() == nil {
			cancelled++
			continue
		}
		if errors.Is(err, io.ErrShortBuffer) {
			short++
			continue
		}
		if err != nil {
			t.Fatalf("receive %d (message %d due): %v", i, seq, err)
		}
		if sender != 0 || got != seq {
			t.Fatalf("message %d of sender %d where %d was due", got, sender, seq)
		}
		seq++
	}
	t.Logf("%d receives cancelled, %d into too short a buffer", cancelled, short)
	if err := firstErr(senders, plan.senders); err != nil {
		t.Fatal(err)
	}
	advAllBack(t, ctx, a, b)
}

// TestAdvCancelSend: sends of every kind (SendImm, SendSlice,
// PostSendSlice then Wait, WriteImm; eager and rendezvous) whose
// contexts end at random moments, with few credits. A send that
// returned nil was delivered; one cancelled may have been: the
// receiver gets, in order and whole, each message once, every one that
// was delivered among them, and then the messages sent after with no
// cancellation. Every request the cancelled calls left behind is
// reclaimed: the queue and the credits are whole at the end.
func TestAdvCancelSend(t *testing.T) {
	plan := advPlan{senders: 1, msgs: 2500, sizes: []int{10, 20000, 0, 1024, 300, 1025}, notice: 9}
	cfg := Config{ReceiveBuffers: 2, MessageSize: 1024, QueueDepth: 8}
	a, b := pair(t, cfg)
	ctx := advCtx(t)
	e := advSetup(t, ctx, plan, a, b)
	const tail = 20 // messages sent without cancellation at the end
	delivered := make([]bool, plan.msgs)
	var keep []LocalMR
	senderr := make(chan error, 1)
	go func() {
		cancelled := 0
		for seq := range plan.msgs {
			sctx, cancel := advCanceller(ctx, seq)
			if seq >= plan.msgs-tail {
				sctx = ctx
			}
			err := e.send(sctx, 0, seq, &keep)
			cancel()
			switch {
			case err == nil:
				delivered[seq] = true
			case isCtxErr(err) && ctx.Err() == nil:
				cancelled++
			default:
				senderr <- fmt.Errorf("message %d: %w", seq, err)
				return
			}
		}
		t.Logf("%d sends cancelled", cancelled)
		senderr <- nil
	}()
	received := make([]bool, plan.msgs)
	for next := 0; next < plan.msgs; {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatalf("after message %d: %v", next-1, err)
		}
		_, seq, err := e.check(m)
		m.Release()
		if err != nil {
			t.Fatal(err)
		}
		if seq < next {
			t.Fatalf("message %d after %d", seq, next-1)
		}
		received[seq] = true
		next = seq + 1
	}
	if err := <-senderr; err != nil {
		t.Fatal(err)
	}
	// delivered is the sender's, read after its last write (senderr).
	n := 0
	for seq := range plan.msgs {
		if delivered[seq] && !received[seq] {
			t.Errorf("message %d was delivered (its send returned nil), but never received", seq)
		}
		if received[seq] {
			n++
		}
	}
	for _, r := range keep {
		r.Free()
	}
	t.Logf("%d messages received of %d", n, plan.msgs)
	advAllBack(t, ctx, a, b)
	advQueueWhole(t, ctx, a)
}

// advQueueWhole checks that every op token of s came back: QueueDepth
// messages posted at once do not wait for room.
func advQueueWhole(t *testing.T, ctx context.Context, s *Session) {
	t.Helper()
	waitFor(t, ctx, "the op tokens to come back", func() bool { return len(s.ops) == 0 })
}

// waitFor polls cond until it holds (ctx is the hang guard).
func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// TestAdvCancelRequestRemoteMR: RequestRemoteMR calls whose contexts end
// at random moments (before the request leaves, while the peer's agent
// serves it, as its answer arrives) leak nothing: the regions of the
// requests that were answered too late go back to the peer, whose
// MaxGranted is then free again for requests that succeed, and the
// requester's agent forgets every request.
func TestAdvCancelRequestRemoteMR(t *testing.T) {
	const size, cap = 4096, 4 * 4096
	a, b := pair(t, Config{MaxGranted: cap})
	ctx := advCtx(t)
	// Many at once, so that some wait for a control credit when their
	// contexts end: their requests never leave.
	const requesters, requests = 48, 25
	var cancelled, got atomic.Int64
	errc := make(chan error, requesters)
	for g := range requesters {
		go func() {
			for i := range requests {
				rctx, cancel := advCanceller(ctx, g+i)
				r, err := b.RequestRemoteMR(rctx, size, verbs.AccessRemoteWrite, 0)
				cancel()
				switch {
				case err == nil:
					got.Add(1)
					if err := r.Release(ctx); err != nil {
						errc <- fmt.Errorf("requester %d, request %d: release: %w", g, i, err)
						return
					}
				case isCtxErr(err) && ctx.Err() == nil:
					cancelled.Add(1)
				case errors.Is(err, ErrLimit):
					// The cap is taken (by others, or by grants of
					// requests given up on, on their way back).
				default:
					errc <- fmt.Errorf("requester %d, request %d: %w", g, i, err)
					return
				}
			}
			errc <- nil
		}()
	}
	if err := firstErr(errc, requesters); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d requests granted, %d cancelled", got.Load(), cancelled.Load())
	waitFor(t, ctx, "the grants given up on to go back", func() bool {
		a.agent.mu.Lock()
		defer a.agent.mu.Unlock()
		return a.agent.granted == 0 && len(a.agent.grants) == 0
	})
	// Every request was answered or never left: the requester forgets
	// them all (before, one that never left stayed in its table for the
	// session's life, waiting for an answer that could not come).
	waitFor(t, ctx, "the requests given up on to be forgotten", func() bool {
		b.agent.mu.Lock()
		defer b.agent.mu.Unlock()
		return len(b.agent.waiters) == 0
	})
	// The whole cap is free: four requests at once succeed.
	var rs []*RemoteMR
	for i := range cap / size {
		r, err := b.RequestRemoteMR(ctx, size, verbs.AccessRemoteWrite, 0)
		if err != nil {
			t.Fatalf("request %d of the cap after the cancellations: %v", i, err)
		}
		rs = append(rs, r)
	}
	for _, r := range rs {
		if err := r.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAdvAllocWhileSending: goroutines allocate regions, fill them,
// send them (SendSlice, PostSendSlice, eager and rendezvous, some with
// an arena of their own) and free them, while others allocate and free
// regions of the same classes in a loop, growing and releasing arenas
// (small ones) under the sends: every message arrives with the bytes of
// its region.
func TestAdvAllocWhileSending(t *testing.T) {
	plan := advPlan{senders: 3, msgs: 200, sizes: []int{1, 64, 65, 1024, 1025, 5000, 20000, 70000}}
	cfg := Config{ReceiveBuffers: 4, MessageSize: 1024, Allocator: AllocatorConfig{ArenaSize: 64 << 10}}
	a, b := pair(t, cfg)
	ctx := advCtx(t)
	e := advSetup(t, ctx, plan, a, b)
	stop := make(chan struct{})
	var churn sync.WaitGroup
	churnErr := make(chan error, 4)
	for _, s := range []*Session{a, a, b} {
		churn.Add(1)
		go func() {
			defer churn.Done()
			var held []LocalMR
			defer func() {
				for _, r := range held {
					r.Free()
				}
			}()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if len(held) > 0 && (len(held) > 40 || rand.IntN(2) == 0) {
					i := rand.IntN(len(held))
					r := held[i]
					held[i] = held[len(held)-1]
					held = held[:len(held)-1]
					want := byte(r.Len())
					if got := r.Bytes(); len(got) != r.Len() || got[0] != want || got[len(got)-1] != want {
						churnErr <- fmt.Errorf("a held region of %d bytes changed", r.Len())
						return
					}
					if err := r.Free(); err != nil {
						churnErr <- err
						return
					}
					continue
				}
				n := plan.sizes[rand.IntN(len(plan.sizes))]
				r, err := s.Alloc(n)
				if err != nil {
					churnErr <- err
					return
				}
				for i := range r.Bytes() {
					r.Bytes()[i] = byte(n)
				}
				held = append(held, r)
			}
		}()
	}
	senders := e.runSenders(ctx)
	o := newOrder(plan.senders)
	for range plan.total() {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sender, seq, err := e.check(m)
		m.Release()
		if err == nil {
			err = o.got(sender, seq)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	churn.Wait()
	close(churnErr)
	for err := range churnErr {
		t.Fatal(err)
	}
	if err := firstErr(senders, plan.senders); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Session{a, b} {
		if st := s.mem.Stats(); st.Pinned != 0 {
			t.Errorf("%d arenas pinned (a window left open)", st.Pinned)
		}
	}
}

// TestAdvBothWaysPosted: both sides keep QueueDepth messages posted
// (PostSendSlice) while they receive and release the other's (and read
// and write memory the other offered): the credit writes of their
// releases share the send queue with the posted requests, and no
// request fails for want of room in it (ErrQueueFull), nor is a
// message lost or reordered. Before, posts, reads and writes failed
// with ErrQueueFull within a few hundred messages, and a message whose
// post failed after it had taken its credit left a hole in the ring's
// sequence that ended the session (a protocol error at the peer).
func TestAdvBothWaysPosted(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cfg      Config
		size     int
		oneSided bool // reads and writes beside the messages
	}{
		{"eager, depth 4", Config{MessageSize: 256, ReceiveBuffers: 4, QueueDepth: 4}, 64, true},
		{"eager, depth 2", Config{MessageSize: 256, ReceiveBuffers: 2, QueueDepth: 2}, 200, true},
		{"eager, depth 4, messages only", Config{MessageSize: 256, ReceiveBuffers: 4, QueueDepth: 4}, 64, false},
		// (With reads and writes beside, both sides' agents and the
		// loops all poll at once: on two processors the rendezvous
		// take milliseconds each, every poller waiting for a time
		// slice.)
		{"rendezvous, depth 4", Config{MessageSize: 256, ReceiveBuffers: 4, QueueDepth: 4}, 1000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := pair(t, tc.cfg)
			ctx, stopAll := context.WithCancel(advCtx(t))
			defer stopAll()
			const n = 1500
			depth := tc.cfg.QueueDepth
			var msgs, ops sync.WaitGroup
			errs := make(chan error, 8)
			fail := func(err error) {
				select {
				case errs <- err:
				default:
				}
				stopAll() // the first error ends every loop
			}
			stop := make(chan struct{})
			for _, sides := range [][2]*Session{{a, b}, {b, a}} {
				s, peer := sides[0], sides[1]
				mine, err := peer.Alloc(4096)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := peer.SendLocalMR(ctx, mine, verbs.AccessRemoteRead|verbs.AccessRemoteWrite, time.Hour); err != nil {
					t.Fatal(err)
				}
				remote, err := s.ReceiveRemoteMR(ctx)
				if err != nil {
					t.Fatal(err)
				}
				msgs.Add(2)
				ops.Add(1)
				go func() { // posts
					defer msgs.Done()
					bufs := make([]LocalMR, depth)
					for i := range bufs {
						bufs[i], _ = s.Alloc(tc.size)
						defer bufs[i].Free()
					}
					ps := make([]Pending, depth)
					for i := range n + depth {
						if i >= depth {
							if err := ps[i%depth].Wait(ctx); err != nil {
								fail(fmt.Errorf("wait for message %d: %w", i-depth, err))
								return
							}
						}
						if i < n {
							buf := bufs[i%depth]
							advFill(buf.Bytes(), 0, i)
							p, err := s.PostSendSlice(ctx, buf.All(), uint32(i), true)
							if err != nil {
								fail(fmt.Errorf("post message %d: %w", i, err))
								return
							}
							ps[i%depth] = p
						}
					}
				}()
				go func() { // receives
					defer msgs.Done()
					want := make([]byte, tc.size)
					for i := range n {
						m, err := s.Receive(ctx)
						if err != nil {
							fail(fmt.Errorf("receive message %d: %w", i, err))
							return
						}
						advFill(want, 0, i)
						if imm, _ := m.Imm(); imm != uint32(i) || !bytes.Equal(m.Bytes(), want) {
							fail(fmt.Errorf("message %d arrived as %d (%d bytes)", i, imm, m.Len()))
							m.Release()
							return
						}
						m.Release()
					}
				}()
				go func() { // one-sided operations
					defer ops.Done()
					if !tc.oneSided {
						return
					}
					loc, _ := s.Alloc(64)
					defer loc.Free()
					for i := 0; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						sl, _ := remote.Slice(64*(i%64), 64)
						var err error
						if i%2 == 0 {
							err = s.Write(ctx, sl, loc.All())
						} else {
							err = s.Read(ctx, loc.All(), sl)
						}
						if err != nil {
							fail(fmt.Errorf("one-sided operation %d: %w", i, err))
							return
						}
					}
				}()
			}
			msgs.Wait() // every call ends by ctx at the latest
			close(stop)
			ops.Wait()
			select {
			case err := <-errs:
				t.Fatal(err)
			default:
			}
		})
	}
}

// advEndErr reports whether err is an error a call may return once the
// session ended: the session closed by this side or the peer (a remote
// region's operations say its lease ended with the session).
func advEndErr(err error) bool {
	return errors.Is(err, ErrClosed) || errors.Is(err, ErrPeerClosed) || errors.Is(err, ErrLeaseExpired)
}

// TestAdvCloseDuringTraffic: either side, or both at once, closes while
// goroutines on both send (eager and rendezvous), receive and hand
// messages to others that release them (also after the Close), receive
// into short buffers, post messages and release their Pendings unwaited,
// allocate and free (twice), request, write and release remote memory,
// and WriteImm: no panic, no hang, no race; every call ends with an
// error that says the session ended (ErrClosed on the closing side,
// ErrPeerClosed on the other, ErrLeaseExpired for a remote region), and
// Close returns nil, also when called again.
func TestAdvCloseDuringTraffic(t *testing.T) {
	for run := range 30 {
		a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 256, QueueDepth: 8})
		ctx := advCtx(t)
		var wg sync.WaitGroup
		errc := make(chan error, 64)
		var started sync.WaitGroup
		loop := func(name string, f func(i int) error) {
			wg.Add(1)
			started.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					if i == 3 {
						started.Done()
					}
					if err := f(i); err != nil {
						if i < 3 {
							started.Done()
						}
						if !advEndErr(err) {
							errc <- fmt.Errorf("%s: %w", name, err)
						}
						return
					}
				}
			}()
		}
		for side, s := range []*Session{a, b} {
			peer := []*Session{b, a}[side]
			mine, err := peer.Alloc(4096)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := peer.SendLocalMR(ctx, mine, verbs.AccessRemoteWrite, time.Hour); err != nil {
				t.Fatal(err)
			}
			remote, err := s.ReceiveRemoteMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			loop("send", func(i int) error {
				msg := make([]byte, []int{10, 256, 3000}[i%3])
				advFill(msg, side, i)
				return s.SendImm(ctx, uint32(len(msg)), msg)
			})
			held := make(chan Message, 16)
			wg.Add(1)
			go func() { // releases, also after the Close
				defer wg.Done()
				for m := range held {
					runtime.Gosched()
					m.Release()
				}
			}()
			loop("receive", func(i int) error {
				m, err := s.Receive(ctx)
				if err != nil {
					close(held)
					return err
				}
				if imm, _ := m.Imm(); int(imm) != m.Len() {
					return fmt.Errorf("a message of %d bytes says %d", m.Len(), imm)
				}
				held <- m
				return nil
			})
			short := make([]byte, 100)
			loop("receive into", func(int) error {
				_, _, _, err := s.ReceiveInto(ctx, short)
				if errors.Is(err, io.ErrShortBuffer) {
					// The message stays: the next Receive (this
					// one, or the other goroutine's) takes it.
					m, err := s.Receive(ctx)
					m.Release()
					return err
				}
				return err
			})
			loop("post", func(i int) error {
				r, err := s.Alloc(64)
				if err != nil {
					return err
				}
				// The region stays allocated: a released Pending's
				// message may still be on its way.
				p, err := s.PostSendSlice(ctx, r.All(), 64, true)
				if err != nil {
					return err
				}
				if i%2 == 0 {
					p.Release()
					p.Release()
					return nil
				}
				if err := p.Wait(ctx); err != nil {
					return err
				}
				if err := p.Wait(ctx); !errors.Is(err, ErrClosed) {
					return fmt.Errorf("a Pending waited for twice: %v", err)
				}
				return r.Free()
			})
			loop("alloc", func(i int) error {
				runtime.Gosched() // no call here blocks
				r, err := s.Alloc(1 + i%5000)
				if err != nil {
					return err
				}
				if err := r.Free(); err != nil {
					return err
				}
				if err := r.Free(); !errors.Is(err, ErrClosed) {
					return fmt.Errorf("a region freed twice: %v", err)
				}
				return nil
			})
			loop("remote", func(i int) error {
				r, err := s.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, 0)
				if err != nil {
					return err
				}
				src, err := s.Alloc(64)
				if err != nil {
					return err
				}
				defer src.Free()
				if err := s.Write(ctx, r.All(), src.All()); err != nil {
					return err
				}
				return r.Release(ctx)
			})
			loop("write with immediate", func(i int) error {
				src, err := s.Alloc(8)
				if err != nil {
					return err
				}
				defer src.Free()
				dst, _ := remote.Slice(8*(i%512), 8)
				return s.WriteImm(ctx, dst, 0, src.All())
			})
		}
		started.Wait()
		closer, other := a, b
		if run%3 == 1 {
			closer, other = b, a
		}
		if run%3 == 2 {
			// Both at once: each ends with its own Close or the
			// peer's.
			closed := make(chan error, 1)
			go func() { closed <- other.Close() }()
			if err := closer.Close(); err != nil {
				t.Fatal(err)
			}
			if err := <-closed; err != nil {
				t.Fatal(err)
			}
			for _, s := range []*Session{a, b} {
				if err := s.Err(); !errors.Is(err, ErrClosed) && !errors.Is(err, ErrPeerClosed) {
					t.Fatalf("run %d: both closed, a side ended with %v", run, err)
				}
			}
		} else {
			if err := closer.Close(); err != nil {
				t.Fatal(err)
			}
			<-other.Done()
			if !errors.Is(other.Err(), ErrPeerClosed) {
				t.Fatalf("run %d: the peer of the side that closed ended with %v", run, other.Err())
			}
			other.Close()
		}
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Errorf("run %d: %v", run, err)
		}
		if err := closer.Close(); err != nil {
			t.Fatalf("a second Close: %v", err)
		}
	}
}

// TestAdvControlBurst: both sides request and release remote memory
// from several goroutines at once while rendezvous messages go both
// ways (each one's end is a fin on the agents' queue pair): the control
// messages of the agents fill the send queue of their queue pair (sends
// whose completions were not polled yet, credit writes), and none is
// lost for want of room: every request is answered, every rendezvous
// send returns, every region goes back.
func TestAdvControlBurst(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 256, ReceiveBuffers: 8})
	ctx, stopAll := context.WithCancel(advCtx(t))
	defer stopAll()
	const requesters, requests, messages = 12, 200, 600
	errs := make(chan error, 1)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
		stopAll()
	}
	var wg sync.WaitGroup
	for _, sides := range [][2]*Session{{a, b}, {b, a}} {
		s, peer := sides[0], sides[1]
		for g := range requesters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range requests {
					r, err := s.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, 0)
					if err != nil {
						fail(fmt.Errorf("requester %d, request %d: %w", g, i, err))
						return
					}
					if err := r.Release(ctx); err != nil {
						fail(fmt.Errorf("requester %d, release %d: %w", g, i, err))
						return
					}
				}
			}()
		}
		wg.Add(2)
		go func() {
			defer wg.Done()
			msg := make([]byte, 1000) // rendezvous
			for i := range messages {
				advFill(msg, 0, i)
				if err := s.SendImm(ctx, uint32(i), msg); err != nil {
					fail(fmt.Errorf("send %d: %w", i, err))
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			want := make([]byte, 1000)
			for i := range messages {
				m, err := peer.Receive(ctx)
				if err != nil {
					fail(fmt.Errorf("receive %d: %w", i, err))
					return
				}
				advFill(want, 0, i)
				imm, _ := m.Imm()
				ok := imm == uint32(i) && bytes.Equal(m.Bytes(), want)
				m.Release()
				if !ok {
					fail(fmt.Errorf("message %d arrived as %d", i, imm))
					return
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	for _, s := range []*Session{a, b} {
		waitFor(t, ctx, "the grants to go back", func() bool {
			s.agent.mu.Lock()
			defer s.agent.mu.Unlock()
			return s.agent.granted == 0
		})
	}
}

// TestAdvUseAfterClose: what an application holds when its session
// closes (received messages of every kind, a message ReceiveInto kept,
// regions, a posted message's Pending, a remote region) and every call,
// used after Close: no panic, no hang; messages and regions read as
// released (no bytes: the ring and the arenas are unmapped), Release and
// Free change nothing (Free says ErrClosed), calls fail with ErrClosed on
// the side that closed and with ErrPeerClosed on the other. Before, the
// Bytes of a message held across Close pointed into the unmapped ring:
// reading them crashed the process (SIGSEGV).
func TestAdvUseAfterClose(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 256, ReceiveBuffers: 8})
	ctx := advCtx(t)
	region, err := a.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.SendLocalMR(ctx, region, verbs.AccessRemoteWrite|verbs.AccessRemoteRead, time.Hour); err != nil {
		t.Fatal(err)
	}
	remote, err := b.ReceiveRemoteMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	src, _ := b.Alloc(8)
	dst, _ := remote.Slice(0, 8)
	// a receives: an eager message, a rendezvous one, a notice, and one
	// that ReceiveInto keeps; b holds an eager message of a's.
	sent := make(chan error, 1)
	go func() {
		for _, send := range []func() error{
			func() error { return b.SendImm(ctx, 1, []byte("eager")) },
			func() error { return b.SendImm(ctx, 2, bytes.Repeat([]byte("R"), 1000)) },
			func() error { return b.WriteImm(ctx, dst, 3, src.All()) },
			func() error { return b.SendImm(ctx, 4, []byte("kept by ReceiveInto")) },
		} {
			if err := send(); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	if err := a.Send(ctx, []byte("to b")); err != nil {
		t.Fatal(err)
	}
	var held []Message
	for range 3 {
		m, err := a.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, m)
	}
	if _, _, _, err := a.ReceiveInto(ctx, make([]byte, 1)); !errors.Is(err, io.ErrShortBuffer) {
		t.Fatalf("ReceiveInto into 1 byte: %v", err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	peerMsg, err := b.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	posted, _ := a.Alloc(64)
	p, err := a.PostSendSlice(ctx, posted.All(), 0, false)
	if err != nil {
		t.Fatal(err)
	}
	freed, _ := a.Alloc(64)
	if err := freed.Free(); err != nil {
		t.Fatal(err)
	}

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	<-b.Done()

	for i, m := range held {
		if got := m.Bytes(); got != nil || m.Len() != 0 {
			t.Errorf("message %d after Close: %d bytes, Len %d", i, len(got), m.Len())
		}
		m.Release()
		m.Release()
	}
	if imm, ok := held[2].Imm(); !held[2].IsWrite() || imm != 3 || !ok {
		t.Errorf("the notice after Close: IsWrite %v, immediate %d %v", held[2].IsWrite(), imm, ok)
	}
	if got := string(peerMsg.Bytes()); got != "to b" {
		t.Errorf("the peer's message after this side's Close: %q", got)
	}
	peerMsg.Release()
	// The posted message may have reached b before the Close (then b
	// receives it), or not; then b's receives report the end.
	for i := 0; ; i++ {
		m, err := b.Receive(ctx)
		if err != nil {
			if !errors.Is(err, ErrPeerClosed) {
				t.Errorf("the peer's Receive after the messages: %v", err)
			}
			break
		}
		if m.Len() != 64 || i > 0 {
			t.Errorf("the peer received a message of %d bytes (%d) after the Close", m.Len(), i)
		}
		m.Release()
	}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"Free of a region", region.Free()},
		{"Free of a region freed before", freed.Free()},
	} {
		if !errors.Is(tc.err, ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", tc.name, tc.err)
		}
	}
	if region.Bytes() != nil || region.Valid() {
		t.Errorf("a region after Close: valid %v, %d bytes", region.Valid(), len(region.Bytes()))
	}
	if err := p.Wait(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Wait of a Pending after Close: %v, want ErrClosed", err)
	}
	p.Release()
	if err := p.Wait(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("a second Wait of a Pending after Close: %v, want ErrClosed", err)
	}
	sl, _ := src.Slice(0, 8)
	for _, side := range []struct {
		s    *Session
		want error
	}{{a, ErrClosed}, {b, ErrPeerClosed}} {
		s := side.s
		calls := []struct {
			name string
			call func() error
		}{
			{"Send", func() error { return s.Send(ctx, []byte("x")) }},
			{"Send rendezvous", func() error { return s.Send(ctx, make([]byte, 1000)) }},
			{"SendSlice", func() error { return s.SendSlice(ctx, sl, 0, false) }},
			{"PostSendSlice", func() error { _, err := s.PostSendSlice(ctx, sl, 0, false); return err }},
			{"Receive", func() error { _, err := s.Receive(ctx); return err }},
			{"ReceiveInto", func() error { _, _, _, err := s.ReceiveInto(ctx, make([]byte, 64)); return err }},
			{"RequestRemoteMR", func() error { _, err := s.RequestRemoteMR(ctx, 64, verbs.AccessRemoteRead, 0); return err }},
			{"ReceiveRemoteMR", func() error { _, err := s.ReceiveRemoteMR(ctx); return err }},
			{"ReceiveLocalMR", func() error { _, err := s.ReceiveLocalMR(ctx); return err }},
		}
		if s == b {
			calls = append(calls,
				struct {
					name string
					call func() error
				}{"Write", func() error { return s.Write(ctx, dst, src.All()) }},
				struct {
					name string
					call func() error
				}{"WriteImm", func() error { return s.WriteImm(ctx, dst, 0, src.All()) }},
				struct {
					name string
					call func() error
				}{"RemoteMR.Release", func() error { return remote.Release(ctx) }},
			)
		} else {
			calls = append(calls, struct {
				name string
				call func() error
			}{"Alloc", func() error { _, err := s.Alloc(64); return err }})
		}
		for _, c := range calls {
			err := c.call()
			want := side.want
			if errors.Is(err, ErrLeaseExpired) && strings.Contains(c.name, "Write") || c.name == "RemoteMR.Release" {
				want = ErrLeaseExpired // the region's lease ended with the session
			}
			if !errors.Is(err, want) {
				t.Errorf("%s on the side %s: %v, want %v", c.name, map[bool]string{true: "that closed", false: "whose peer closed"}[s == a], err, want)
			}
		}
	}
	if err := a.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
}

// TestAdvSharedRegion: several goroutines send parts of one region at
// once (SendSlice and PostSendSlice, eager and rendezvous: windows of
// the same memory open together) while others allocate and free beside
// them: every message carries the region's bytes, and once the sends
// are done no window of the region is left (its Free releases the
// arena: nothing pinned).
func TestAdvSharedRegion(t *testing.T) {
	const senders, msgs, size = 4, 150, 12000
	a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 1024, Allocator: AllocatorConfig{ArenaSize: 64 << 10}})
	ctx := advCtx(t)
	shared, err := a.Alloc(size) // an arena of its own
	if err != nil {
		t.Fatal(err)
	}
	advFill(shared.Bytes(), 9, 9)
	lens := []int{1, 1024, 1025, 5000, size, 0, 700}
	stop := make(chan struct{})
	churned := make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				churned <- nil
				return
			default:
			}
			r, err := a.Alloc(1 + i*97%size)
			if err != nil {
				churned <- err
				return
			}
			r.Free()
			runtime.Gosched()
		}
	}()
	errc := make(chan error, senders)
	for g := range senders {
		go func() {
			for i := range msgs {
				n := lens[(g+i)%len(lens)]
				sl, _ := shared.Slice(0, n)
				imm := uint32(g<<16 | n)
				var err error
				if i%2 == 0 {
					err = a.SendSlice(ctx, sl, imm, true)
				} else {
					var p Pending
					if p, err = a.PostSendSlice(ctx, sl, imm, true); err == nil {
						err = p.Wait(ctx)
					}
				}
				if err != nil {
					errc <- fmt.Errorf("sender %d, message %d: %w", g, i, err)
					return
				}
			}
			errc <- nil
		}()
	}
	for i := range senders * msgs {
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		imm, _ := m.Imm()
		n := int(imm & 0xffff)
		if !bytes.Equal(m.Bytes(), shared.Bytes()[:n]) {
			t.Fatalf("message %d (sender %d): %d bytes, not the region's first %d", i, imm>>16, m.Len(), n)
		}
		m.Release()
	}
	if err := firstErr(errc, senders); err != nil {
		t.Fatal(err)
	}
	close(stop)
	if err := <-churned; err != nil {
		t.Fatal(err)
	}
	if err := shared.Free(); err != nil {
		t.Fatal(err)
	}
	if st := a.mem.Stats(); st.Pinned != 0 {
		t.Fatalf("%d arenas pinned after the shared region's Free: a window of it is open", st.Pinned)
	}
}

// TestAdvCancelledSliceFreed: a region whose zero-copy send was
// cancelled (here a rendezvous, after its announcement left) may be
// freed at once: the library holds its memory until the peer read it,
// so an Alloc meanwhile gets other memory, and the peer receives the
// region's bytes, not the next region's. (Before the allocator's holds,
// the slot was handed out again at once and the peer read the new
// region's bytes: 3 of 3 runs.)
func TestAdvCancelledSliceFreed(t *testing.T) {
	a, b := pair(t, Config{MessageSize: 256, ReceiveBuffers: 4})
	ctx := advCtx(t)
	r, err := a.Alloc(4096) // a rendezvous, in a slot of a size class
	if err != nil {
		t.Fatal(err)
	}
	for i := range r.Bytes() {
		r.Bytes()[i] = 0x11
	}
	sctx, cancel := context.WithCancel(ctx)
	sent := make(chan error, 1)
	go func() { sent <- a.SendSlice(sctx, r.All(), 0, false) }()
	// The announcement is in b's ring: the send waits for b's read.
	waitFor(t, ctx, "the announcement to arrive", func() bool {
		b.rmu.Lock()
		h := b.rh[b.fifo[0]]
		b.rmu.Unlock()
		b.dataProgress()
		return h.Done()
	})
	cancel()
	if err := <-sent; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled SendSlice: %v", err)
	}
	if err := r.Free(); err != nil {
		t.Fatal(err)
	}
	next, err := a.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Free()
	for i := range next.Bytes() {
		next.Bytes()[i] = 0xee
	}
	m, err := b.Receive(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Release()
	if !bytes.Equal(m.Bytes(), bytes.Repeat([]byte{0x11}, 4096)) {
		t.Fatalf("the message of the cancelled send carries %d bytes %x..., not the region's 0x11 (the next region's bytes)", m.Len(), m.Bytes()[:4])
	}
}

// TestAdvHandBacksBounded: a peer that requests memory and hands it back
// (SendRemoteMR) in a loop, while this side's application does not take
// the regions (ReceiveLocalMR), holds no more of this side's memory than
// MaxGranted: the regions handed back count until they are taken, so the
// peer's next request is refused (ErrLimit); taken (with what the peer
// wrote) and freed, they make room again. Before, a hand-back ended the
// grant's count at once, and with a cap of 16 KiB the peer parked 4 MB of
// this side's memory in a thousand rounds, without bound.
func TestAdvHandBacksBounded(t *testing.T) {
	const size, cap = 4096, 4 * 4096
	a, b := pair(t, Config{MaxGranted: cap})
	ctx := advCtx(t)
	src, _ := b.Alloc(size)
	defer src.Free()
	handBack := func(i int) error {
		r, err := b.RequestRemoteMR(ctx, size, verbs.AccessRemoteWrite, 0)
		if err != nil {
			return err
		}
		advFill(src.Bytes(), 1, i)
		if err := b.Write(ctx, r.All(), src.All()); err != nil {
			t.Fatal(err)
		}
		if err := b.SendRemoteMR(ctx, r); err != nil {
			t.Fatal(err)
		}
		return nil
	}
	for round := range 3 {
		for i := range cap / size {
			if err := handBack(i); err != nil {
				t.Fatalf("round %d: request %d within the cap: %v", round, i, err)
			}
		}
		if err := handBack(-1); !errors.Is(err, ErrLimit) {
			t.Fatalf("round %d: a request past the cap, with the regions handed back not taken: %v, want ErrLimit", round, err)
		}
		want := make([]byte, size)
		for i := range cap / size {
			mr, err := a.ReceiveLocalMR(ctx)
			if err != nil {
				t.Fatal(err)
			}
			advFill(want, 1, i)
			if !bytes.Equal(mr.Bytes(), want) {
				t.Fatalf("round %d: region %d handed back without what the peer wrote", round, i)
			}
			if err := mr.Free(); err != nil {
				t.Fatal(err)
			}
		}
	}
	a.agent.mu.Lock()
	granted := a.agent.granted
	a.agent.mu.Unlock()
	if granted != 0 {
		t.Fatalf("%d bytes still counted as granted with every region taken", granted)
	}
}

// TestAdvExpiredRemotesForgotten: remote regions whose leases simply end
// (never released) are forgotten by the grantee as by the granter, not
// kept for the session's life: after 500 requests with a lease of a
// millisecond, left to expire, and 200 more kept live, the grantee's
// table holds few of the expired ones (before: all 500).
func TestAdvExpiredRemotesForgotten(t *testing.T) {
	a, b := pair(t, Config{})
	ctx := advCtx(t)
	var last time.Time
	for i := range 500 {
		r, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, time.Millisecond)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		last = r.Deadline()
	}
	// Past every lease and its grace (the granter's window is closed).
	for time.Now().Before(last.Add(leaseGrace)) {
		time.Sleep(10 * time.Millisecond)
	}
	waitFor(t, ctx, "the granter to drop the expired grants", func() bool {
		a.agent.mu.Lock()
		defer a.agent.mu.Unlock()
		return len(a.agent.grants) == 0
	})
	var live []*RemoteMR
	for i := range 200 {
		r, err := b.RequestRemoteMR(ctx, 64, verbs.AccessRemoteWrite, time.Hour)
		if err != nil {
			t.Fatalf("live request %d: %v", i, err)
		}
		live = append(live, r)
	}
	b.agent.mu.Lock()
	expired, kept := 0, len(b.agent.remotes)
	for _, r := range b.agent.remotes {
		if r.valid() != nil {
			expired++
		}
	}
	b.agent.mu.Unlock()
	if expired > remoteSweepMin {
		t.Fatalf("the grantee keeps %d regions whose leases ended (of %d it holds)", expired, kept)
	}
	for _, r := range live {
		if err := r.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
