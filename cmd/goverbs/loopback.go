package main

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/goverbs/verbs"
)

// side is one end of the loopback: a device context with its PD, CQ, RC
// queue pair and one memory region, and the state of its completions.
type side struct {
	name  string // "local" or "remote"
	ctx   *verbs.Context
	pd    *verbs.ProtectionDomain
	cq    *verbs.CompletionQueue
	qp    *verbs.RCQueuePair
	mr    *verbs.MemoryRegion
	ep    verbs.Endpoint
	batch *verbs.RCBatch
	recv  *verbs.RecvBatch
	wcs   []verbs.Completion

	half    int // offset of the second half of mr (latency: where the peer writes)
	maxSize int // largest message: every receive buffer holds this much

	// Completion accounting, updated by reap.
	lastWRID    uint64 // highest wr_id of a send-queue completion
	sendDone    int    // send-queue completions
	outstanding int    // signaled send requests not completed yet
	recvPosted  int    // receives posted and not completed
	recvs       int    // receive completions not yet consumed

	lastYield uint64 // cycles() of the last yield
}

// loopback is two RC queue pairs of this process connected to each other.
type loopback struct {
	a, b      *side
	closers   []func() error
	transport string
	pathMTU   verbs.MTU
	port      verbs.PortAttr
	inline    int       // max inline data of the QPs
	opStart   time.Time // start of the current latency operation (stall check)
}

const progressTimeout = 10 * time.Second

// newLoopback opens the devices and builds, connects and checks the two
// queue pairs, with buffers for messages of up to maxSize bytes.
func newLoopback(cfg benchConfig, maxSize int) (_ *loopback, err error) {
	lb := &loopback{}
	defer func() {
		if err != nil {
			lb.Close()
		}
	}()
	devA := cfg.dev
	if devA == "" {
		devA = verbs.DefaultDevice()
	}
	devB := cfg.dev2
	if devB == "" {
		devB = devA
	}
	if lb.a, err = lb.newSide("local", devA, cfg, maxSize); err != nil {
		return nil, err
	}
	if lb.b, err = lb.newSide("remote", devB, cfg, maxSize); err != nil {
		return nil, err
	}
	if devs, _ := verbs.Devices(); devs != nil {
		for _, d := range devs {
			if d.Name == lb.a.ctx.Name() {
				lb.transport = d.Transport
			}
		}
	}
	// Exchange the endpoints as two processes would: through their binary
	// encoding.
	for _, s := range []*side{lb.a, lb.b} {
		ep, err := s.qp.Endpoint()
		if err != nil {
			return nil, err
		}
		wire, err := ep.MarshalBinary()
		if err != nil {
			return nil, err
		}
		if err := s.ep.UnmarshalBinary(wire); err != nil {
			return nil, err
		}
	}
	if err := lb.a.qp.Connect(lb.b.ep); err != nil {
		return nil, err
	}
	if err := lb.b.qp.Connect(lb.a.ep); err != nil {
		return nil, err
	}
	attr, err := lb.a.qp.Query()
	if err != nil {
		return nil, err
	}
	lb.pathMTU = attr.PathMTU
	if lb.port, err = lb.a.ctx.QueryPort(lb.a.ep.Port); err != nil {
		return nil, err
	}
	lb.inline = min(lb.a.qp.Cap().MaxInlineData, lb.b.qp.Cap().MaxInlineData)
	return lb, nil
}

// info describes the loopback for the report.
func (lb *loopback) info() *benchInfo {
	return &benchInfo{
		dev: lb.a.ctx.Name(), dev2: lb.b.ctx.Name(), provider: lb.a.ctx.Provider(),
		transport: lb.transport, mode: "ON (one process)", pathMTU: lb.pathMTU, port: lb.port,
		inline: lb.inline, local: lb.a.ep, remote: lb.b.ep,
	}
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

func (lb *loopback) newSide(name, dev string, cfg benchConfig, maxSize int) (*side, error) {
	return openSide(name, dev, cfg, maxSize, &lb.closers)
}

// openSide opens dev and creates one side's PD, CQ, memory and RC queue
// pair, appending their Close methods to closers.
func openSide(name, dev string, cfg benchConfig, maxSize int, closers *[]func() error) (*side, error) {
	s := &side{name: name, maxSize: maxSize, half: roundUp(maxSize, 4096)}
	var err error
	if s.ctx, err = verbs.Open(dev); err != nil {
		return nil, err
	}
	*closers = append(*closers, s.ctx.Close)
	if s.pd, err = s.ctx.AllocPD(); err != nil {
		return nil, err
	}
	*closers = append(*closers, s.pd.Close)
	if s.cq, err = s.ctx.NewCompletionQueue(verbs.CQSpec{Entries: cfg.txDepth + cfg.rxDepth + 64, NoChannel: true}); err != nil {
		return nil, err
	}
	*closers = append(*closers, s.cq.Close)
	// Two halves: latency tests write from the first into the peer's second.
	if s.mr, err = s.pd.Alloc(2*s.half, verbs.AccessRemoteAll); err != nil {
		return nil, err
	}
	*closers = append(*closers, s.mr.Close)
	spec := verbs.QPSpec{
		SendCQ:     s.cq,
		MaxSendWR:  cfg.txDepth,
		MaxRecvWR:  cfg.rxDepth,
		MaxSendSGE: 1,
		MaxRecvSGE: 1,
		MTU:        cfg.mtu,
		Timeout:    uint8(cfg.timeoutExp),
	}
	switch {
	case cfg.inline >= 0:
		spec.MaxInlineData = cfg.inline
		if cfg.inline == 0 {
			spec.MaxInlineData = -1
		}
	case !cfg.lat:
		spec.MaxInlineData = -1
	}
	if s.qp, err = s.pd.NewRCQueuePair(spec); err != nil {
		return nil, err
	}
	*closers = append(*closers, s.qp.Close)
	s.batch = s.qp.NewBatch(cfg.batch)
	s.recv = s.qp.NewRecvBatch(64)
	s.wcs = make([]verbs.Completion, 64)
	return s, nil
}

// Close destroys everything in reverse order of creation.
func (lb *loopback) Close() error {
	var errs []error
	for i := len(lb.closers) - 1; i >= 0; i-- {
		errs = append(errs, lb.closers[i]())
	}
	lb.closers = nil
	return errors.Join(errs...)
}

// busySpins is how many empty polls reapBusy makes in one provider call
// (CompletionQueue.PollBusy): a loop that waits for a completion crosses
// into C once per busySpins empty polls instead of once per poll, and takes
// a completion as soon as a poll sees it. An empty poll of a hardware CQ
// costs tens to hundreds of nanoseconds, so one call stays far below the
// 20 us after which the Go runtime may consider the thread blocked.
const busySpins = 64

// reap polls the side's CQ once and accounts for what it found. A failed
// completion is returned as an error naming the operation.
func (s *side) reap() (int, error) { return s.account(s.cq.Poll(s.wcs)) }

// reapBusy is reap for a latency loop that has nothing else to do until a
// completion arrives: it polls up to busySpins times in one call. (The
// bandwidth loops poll once per round, as perftest does: they post
// whenever the send queue has room.)
func (s *side) reapBusy() (int, error) { return s.account(s.cq.PollBusy(s.wcs, busySpins)) }

// yieldPeriod is how often a measured loop lets the Go scheduler run
// (see yield).
const yieldPeriod = 2 * time.Millisecond

// yieldTicks is yieldPeriod in cycles() ticks, calibrated once (tickClock)
// over 200 us.
var yieldTicks = sync.OnceValue(func() uint64 {
	clk := startTicks()
	for time.Since(clk.w0) < 200*time.Microsecond {
	}
	clk.stop()
	return uint64(float64(yieldPeriod) / clk.nsPT)
})

// yield calls runtime.Gosched when yieldPeriod has passed since the last
// time, between the operations of a measured loop (never inside a timed
// one); it reads only the tick counter. A goroutine that never blocks runs
// on the same scheduling tick for ever: after 10 ms of it the runtime's
// monitor thread tries to preempt it and, when it finds it inside a cgo
// call (a post, a poll), takes its P away instead and hands it to another
// thread, again on every tick, waking up every 20 us to do so: the loop
// and the runtime's threads keep switching. A Gosched starts a new tick.
// It is cheap with one P (GOMAXPROCS=1, as in a process pinned to one CPU:
// nothing else to run); with idle Ps it may wake a thread to look for
// work, hence every few milliseconds rather than every iteration.
func (s *side) yield() {
	if c := cycles(); c-s.lastYield >= yieldTicks() {
		runtime.Gosched()
		s.lastYield = cycles()
	}
}

// account records the completions of a poll.
func (s *side) account(n int, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	for i := range s.wcs[:n] {
		wc := &s.wcs[i]
		if wc.Status != verbs.StatusSuccess {
			return n, fmt.Errorf("%s queue pair %d: %w", s.name, wc.QPN, wc.Err())
		}
		switch wc.Opcode {
		case verbs.OpRecv, verbs.OpRecvWriteImm:
			s.recvs++
			s.recvPosted--
		default:
			s.sendDone++
			s.outstanding--
			s.lastWRID = max(s.lastWRID, wc.WRID)
		}
	}
	return n, nil
}

// recvRefill is how many receives fillRecvs lets complete before it posts
// again (capped at a quarter of the receives kept posted): one Submit then
// posts them all, instead of one call per received message.
const recvRefill = 16

// fillRecvs posts receives (each large enough for the largest message)
// until want are posted, once at least min(recvRefill, want/4) are missing.
func (s *side) fillRecvs(want int) error {
	if s.recvPosted > 0 && want-s.recvPosted < min(recvRefill, max(want/4, 1)) {
		return nil
	}
	sge, err := s.mr.SGE(s.half, s.maxSize)
	if err != nil {
		return err
	}
	for s.recvPosted < want {
		k := min(want-s.recvPosted, 64)
		for range k {
			s.recv.Recv(uint64(s.recvPosted), sge)
		}
		if err := s.recv.Submit(); err != nil {
			return err
		}
		s.recvPosted += k
	}
	return nil
}

// watchdog fails a loop that makes no progress for progressTimeout. It
// reads the clock only every 1024 idle rounds.
type watchdog struct {
	idle int
	last time.Time
	what string
}

// newWatchdog does not read the clock (which may be slow, see cycles): the
// first stalled check after 1024 idle rounds starts the timeout.
func newWatchdog(what string) watchdog { return watchdog{what: what} }

func (w *watchdog) progress() { w.idle = 0; w.last = time.Time{} }

func (w *watchdog) stalled() error {
	w.idle++
	if w.idle&1023 != 0 {
		return nil
	}
	now := time.Now()
	if w.last.IsZero() {
		w.last = now
		return nil
	}
	if now.Sub(w.last) > progressTimeout {
		return fmt.Errorf("%s: %w for %v: the peer queue pair stopped answering", w.what, errNoProgress, progressTimeout)
	}
	return nil
}
