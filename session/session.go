package session

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// protoVersion is the version of the setup messages and of what travels
// on the queue pairs (wire.go).
const protoVersion = 1

// Setup messages on the bootstrap connection (application types of ctrl).
const (
	msgHello = 1 // hello: the device this side proposes
	msgSetup = 2 // setup: endpoints, control block, buffers
	msgReady = 3 // the queue pairs are connected (RTR/RTS): traffic may start
	msgFail  = 4 // setup failed on the sender's side: a text follows
)

// hello is the first setup message of each side.
type hello struct {
	Version  int    `json:"version"`
	Device   string `json:"device"`   // the device this side would use
	Hardware bool   `json:"hardware"` // it is not soft0
	Explicit bool   `json:"explicit"` // Config.Device named it
	CM       bool   `json:"cm"`       // Config.UseCM
	// The acceptor's, with CM: where its connection manager listens, and
	// the cookie the dialer's CM requests must carry.
	CMAddr   string `json:"cm_addr,omitempty"`
	CMCookie []byte `json:"cm_cookie,omitempty"`
}

// setup is the second.
type setup struct {
	Data        *verbs.Endpoint    `json:"data,omitempty"` // nil with CM
	Ctrl        *verbs.Endpoint    `json:"ctrl,omitempty"`
	Block       verbs.RemoteRegion `json:"block"`     // the control block (credit words)
	Ring        verbs.RemoteRegion `json:"ring"`      // the receive ring, for writes
	RecvBuffers int                `json:"recv"`      // data receive buffers posted
	SlotSize    int                `json:"slot"`      // bytes of each
	CtrlBuffers int                `json:"ctrl_recv"` // control receive buffers posted
	MaxMessage  int                `json:"max_message"`
}

// Session is a connection to one peer process: two RC queue pairs (the
// application's messages and RDMA operations on one, the agents'
// messages on the other), their receive buffers and flow control, an
// allocator of registered memory, and an agent that serves the peer's
// requests for memory. See the package documentation for the model.
//
// A Session is safe for concurrent use.
type Session struct {
	cfg  Config
	ctl  *ctrl
	dev  *verbs.Context
	pd   *verbs.ProtectionDomain
	mem  *Allocator
	cmem *Allocator // the buffers of the control messages this side sends
	data *channel.Channel
	agc  *channel.Channel // the agents' queue pair

	block     *verbs.MemoryRegion // credit words the peer writes: [0:4] data, [4:8] control
	peerBlock verbs.RemoteRegion
	peer      setup // what the peer announced

	// data receives (msg.go)
	dflow   sendFlow
	drflow  recvFlow
	ring    *verbs.MemoryRegion // ReceiveBuffers slots of slotSize bytes, the peer writes into
	slot    int
	rmu     sync.Mutex // rh, fifo, rgen, busy, freed; the posting of receives
	rh      []channel.Handle
	fifo    []int32    // receives in the order they were posted
	rgen    []uint32   // per ring slot: the generation of its message
	busy    []bool     // per ring slot: a message holds it
	freed   uint32     // ring slots given back in order (wrapping)
	smu     sync.Mutex // orders the taking of credits and the posting of messages
	turn    chan struct{}
	pending *pendingRead // a rendezvous read a cancelled Receive left (turn held)
	held    *Message     // a message ReceiveInto could not take (turn held)
	credMu  sync.Mutex   // orders credit writes (flow.go)

	// the agent (agent.go)
	cflow   sendFlow
	crflow  recvFlow
	cring   *verbs.MemoryRegion // ctrlBuffers buffers of ctrlBufSize bytes: the control receives
	crh     []channel.Handle
	cfifo   []int32
	cmu     sync.Mutex // crh, cfifo; the posting of control receives
	ccred   sync.Mutex // orders control credit writes
	agent   agentState
	ids     atomic.Uint64
	bg      context.Context // ends with the session
	bgStop  context.CancelFunc
	agentWG sync.WaitGroup // the agent and the watcher
	tasks   tasks          // reapers, the agent's answers and revocations
	owed    owedCtrl       // control messages waiting for a credit (sendAsyncCtrl)
	leases  sync.WaitGroup // lease timers of grants: one per timer not stopped before it fired

	ops     chan struct{}  // a token per request of the data queue pair in flight (QueueDepth)
	pend    chan *pendSend // free records of posted messages (PostSendSlice), QueueDepth of them
	pairs   chan struct{}  // one caller taking two tokens at a time (acquireOps2)
	done    chan struct{}
	endOnce sync.Once
	err     error // why it ended (set before done is closed)
	closed  atomic.Bool
	shut    chan struct{} // closed when the first Close has torn the session down

	// API calls that touch the session's memory (its ring, buffers and
	// the allocator's arenas) hold one of these for reading (enter), the
	// receives their own; Close takes both before it releases that
	// memory, once the calls in progress returned for the session's end.
	calls, rcalls sync.RWMutex
}

var errSessionEnded = errors.New("session: ended")

// Dial connects to the Listener at addr (host:port) and sets up a
// session. It honours ctx until the session is set up; the session then
// lives until Close or the peer's end. The setup needs the server's
// Accept: the listener authenticates a dialer at once, but a server that
// does not call Accept leaves it waiting, for as long as ctx allows (as
// a TCP connection the kernel took waits for the server's accept): give
// Dial a ctx with a deadline.
func Dial(ctx context.Context, addr string, cfg Config) (*Session, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	c, err := dialCtrl(ctx, addr, &cfg)
	if err != nil {
		return nil, fmt.Errorf("session: dial %s: %w", addr, err)
	}
	s, err := establish(ctx, c, cfg, nil)
	if err != nil {
		c.close()
		return nil, fmt.Errorf("session: dial %s: %w", addr, err)
	}
	return s, nil
}

// Listener accepts sessions. It is safe for concurrent use; sessions it
// accepted are independent of it and of each other (closing the Listener
// does not close them).
type Listener struct {
	cfg Config
	l   *ctrlListener
	cm  *cmListen // with Config.UseCM
}

// Listen listens for sessions on addr (host:port; port 0 picks one).
func Listen(ctx context.Context, addr string, cfg Config) (*Listener, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	l, err := listenCtrl(addr, &cfg)
	if err != nil {
		return nil, fmt.Errorf("session: listen %s: %w", addr, err)
	}
	sl := &Listener{cfg: cfg, l: l}
	if cfg.UseCM {
		if sl.cm, err = listenCM(ctx, &cfg, l.Addr()); err != nil {
			l.close()
			return nil, fmt.Errorf("session: listen %s: %w", addr, err)
		}
	}
	return sl, nil
}

// Addr is the address the Listener listens on.
func (l *Listener) Addr() net.Addr {
	if l.l == nil {
		return nil // a zero Listener
	}
	return l.l.Addr()
}

// Accept waits for the next peer that authenticates and sets up a
// session with it. A peer that fails the setup is dropped and Accept
// goes on waiting; it returns an error only when ctx ends or the
// Listener is closed.
func (l *Listener) Accept(ctx context.Context) (*Session, error) {
	if l.l == nil {
		return nil, fmt.Errorf("session: accept: %w (a zero Listener: make one with Listen)", ErrClosed)
	}
	for {
		c, err := l.l.accept(ctx)
		if err != nil {
			return nil, fmt.Errorf("session: accept: %w", err)
		}
		s, err := l.establish(ctx, c)
		if err != nil {
			c.close()
			if ctx.Err() != nil {
				return nil, fmt.Errorf("session: accept: %w", ctx.Err())
			}
			continue // the next accept says if the Listener closed
		}
		return s, nil
	}
}

// establish sets up the session of an accepted peer within
// HandshakeTimeout, and until the Listener closes: a peer that
// authenticated and then stalled held Accept (and every peer behind it)
// until Accept's ctx ended, Close of the Listener included
// (TestAcceptStalledSetup).
func (l *Listener) establish(ctx context.Context, c *ctrl) (*Session, error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if t := l.cfg.HandshakeTimeout; t > 0 {
		var tcancel context.CancelFunc
		sctx, tcancel = context.WithTimeout(sctx, t)
		defer tcancel()
	}
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-l.l.closing:
			cancel()
		case <-stop:
		}
	}()
	return establish(sctx, c, l.cfg, l.cm)
}

// Close stops listening. Sessions already accepted go on.
func (l *Listener) Close() error {
	if l.l == nil {
		return nil // a zero Listener, as good as closed
	}
	if l.cm != nil {
		l.cm.close()
	}
	return l.l.close()
}

// establish sets up a session over the authenticated connection c: the
// device both sides use, the queue pairs, their receive buffers; then
// it exchanges endpoints and connects (or, with CM, has the connection
// manager connect the queue pairs). lc is the Listener's CM side (nil for
// a dialer).
func establish(ctx context.Context, c *ctrl, cfg Config, lc *cmListen) (s *Session, err error) {
	// hello: agree on a device
	var mine hello
	var wait *cmWait
	if cfg.UseCM {
		mine = hello{Version: protoVersion, CM: true, Hardware: true}
		if lc != nil {
			if lc.l == nil {
				return nil, fmt.Errorf("session: the Listener has no connection manager: %w", lc.err)
			}
			wait = lc.expect()
			defer lc.forget(wait)
			mine.Device, mine.CMAddr, mine.CMCookie = lc.device, lc.addr, wait.cookie[:]
		}
	} else if mine, err = chooseDevice(cfg.Device, c.localAddr()); err != nil {
		return nil, err
	}
	var peer hello
	if err := exchange(ctx, c, msgHello, mine, &peer); err != nil {
		return nil, err
	}
	if peer.Version != protoVersion {
		return nil, fmt.Errorf("%w: the peer speaks version %d, this side %d", ErrProtocol, peer.Version, protoVersion)
	}
	if peer.CM != mine.CM {
		return nil, fmt.Errorf("session: this side connects through the RDMA CM (Config.UseCM) %v, the peer %v: both must agree", mine.CM, peer.CM)
	}
	name := mine.Device
	if mine.CM && lc == nil {
		// The dialer's device is the one its CM route to the acceptor
		// takes.
		target := peer.CMAddr
		if cfg.CMAddr != "" {
			target = cfg.CMAddr
		}
		if len(peer.CMCookie) != cmCookieLen || target == "" {
			return nil, fmt.Errorf("%w: the peer gives no CM address or cookie", ErrProtocol)
		}
		r, err := verbs.ResolveCM(ctx, target)
		if err != nil {
			return nil, err
		}
		name, mine.CMAddr, mine.CMCookie = r.Device, target, peer.CMCookie
	} else if !mine.CM && mine.Hardware != peer.Hardware {
		if mine.Explicit && mine.Hardware {
			return nil, fmt.Errorf("session: device %s was asked for, but the peer uses %s, which cannot reach it", mine.Device, peer.Device)
		}
		name = softDevice
	}
	s = &Session{cfg: cfg, ctl: c, done: make(chan struct{}), shut: make(chan struct{}), turn: make(chan struct{}, 1), ops: make(chan struct{}, cfg.QueueDepth), pairs: make(chan struct{}, 1)}
	s.turn <- struct{}{}
	s.bg, s.bgStop = context.WithCancel(context.Background())
	sess := s // s is nil once a failure is returned
	defer func() {
		if err != nil {
			sess.release()
		}
	}()
	if err := s.build(name, mine.CM); err != nil {
		return nil, err
	}
	// setup: endpoints and buffers
	out := setup{Block: s.block.Remote(), Ring: s.ring.Remote(), RecvBuffers: cfg.ReceiveBuffers,
		SlotSize: s.slot, CtrlBuffers: ctrlBuffers, MaxMessage: cfg.MaxMessage}
	if !mine.CM {
		de, err := s.data.Endpoint()
		if err != nil {
			return nil, err
		}
		ce, err := s.agc.Endpoint()
		if err != nil {
			return nil, err
		}
		out.Data, out.Ctrl = &de, &ce
	}
	if err := exchange(ctx, c, msgSetup, out, &s.peer); err != nil {
		return nil, err
	}
	if err := s.peer.validate(!mine.CM); err != nil {
		return nil, err
	}
	s.peerBlock = s.peer.Block
	s.dflow = sendFlow{r: uint32(s.peer.RecvBuffers), word: s.word(0), progress: s.dataProgress}
	s.cflow = sendFlow{r: uint32(s.peer.CtrlBuffers), word: s.word(4), progress: s.ctrlProgress}
	switch {
	case !mine.CM:
		if err := s.data.Connect(*s.peer.Data); err != nil {
			return nil, err
		}
		if err := s.agc.Connect(*s.peer.Ctrl); err != nil {
			return nil, err
		}
	case lc == nil:
		if err := s.dialCM(ctx, mine.CMAddr, mine.CMCookie); err != nil {
			return nil, err
		}
	default:
		if err := s.acceptCM(ctx, wait); err != nil {
			return nil, err
		}
	}
	// The records of posted messages, once the device took queue pairs
	// of QueueDepth: before, a QueueDepth far beyond what it takes
	// (1<<28 for "no limit") had them allocated first, gigabytes of
	// them, before the device refused (TestAdv2QueueDepthTooLarge).
	s.pend = make(chan *pendSend, cfg.QueueDepth)
	for range cfg.QueueDepth {
		s.pend <- &pendSend{s: s}
	}
	// ready: both queue pairs of both sides are connected
	var r struct{}
	if err := exchange(ctx, c, msgReady, struct{}{}, &r); err != nil {
		return nil, err
	}
	c.startKeepalive(cfg.Keepalive)
	s.agentWG.Add(2)
	go s.agentLoop()
	go s.watch()
	return s, nil
}

// exchange sends v as message typ and reads the peer's message of the
// same type into out (JSON, bounded by the bootstrap connection).
func exchange(ctx context.Context, c *ctrl, typ uint8, v, out any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := c.send(typ, b); err != nil {
		return err
	}
	t, p, err := c.recv(ctx)
	if err != nil {
		return err
	}
	if t == msgFail {
		return fmt.Errorf("session: the peer failed to set up: %s", sanitize(p))
	}
	if t != typ {
		return fmt.Errorf("%w: setup message %d where %d was due", ErrProtocol, t, typ)
	}
	if err := json.Unmarshal(p, out); err != nil {
		return fmt.Errorf("%w: setup message %d: %v", ErrProtocol, t, err)
	}
	return nil
}

// The largest receive rings a side accepts of its peer: ReceiveBuffers,
// and slots (MessageSize plus the header's room, payOff).
const (
	maxRecvBuffers = 1 << 16
	maxSlotSize    = 64 << 20
)

// maxMessage is the largest message (Config.MaxMessage) and the largest
// Read, Write or WriteImm: 2 GiB, the largest RDMA message (an
// InfiniBand port's max_msg_sz, soft0's): a rendezvous message is one
// RDMA read of the receiver's, and the length fields of the session's
// headers have 32 bits. Before, a message of 4 GiB + 1 byte arrived as
// a message of 1 byte (TestMessageOverLimit). (An int holds no more on
// 32-bit platforms.)
const maxMessage = min(1<<31, math.MaxInt)

func (p *setup) validate(endpoints bool) error {
	switch {
	case p.RecvBuffers < 1 || p.RecvBuffers > maxRecvBuffers:
		return fmt.Errorf("%w: the peer posts %d receive buffers", ErrProtocol, p.RecvBuffers)
	case p.SlotSize < hdrAt+rtsHdr || p.SlotSize > maxSlotSize:
		return fmt.Errorf("%w: the peer's receive buffers are %d bytes", ErrProtocol, p.SlotSize)
	case p.CtrlBuffers < 2 || p.CtrlBuffers > 1<<12:
		return fmt.Errorf("%w: the peer posts %d control buffers", ErrProtocol, p.CtrlBuffers)
	case p.MaxMessage < 0 || p.MaxMessage > maxMessage:
		return fmt.Errorf("%w: the peer's largest message is %d bytes", ErrProtocol, p.MaxMessage)
	case p.Block.Len < 8:
		return fmt.Errorf("%w: the peer's control block is %d bytes", ErrProtocol, p.Block.Len)
	case p.Ring.Len < uint64(p.RecvBuffers)*uint64(p.SlotSize):
		return fmt.Errorf("%w: the peer's ring is %d bytes, for %d slots of %d", ErrProtocol, p.Ring.Len, p.RecvBuffers, p.SlotSize)
	}
	if !endpoints {
		return nil
	}
	if p.Data == nil || p.Ctrl == nil {
		return fmt.Errorf("%w: the peer sent no endpoints", ErrProtocol)
	}
	if err := p.Data.Validate(); err != nil {
		return fmt.Errorf("%w: the peer's data endpoint: %v", ErrProtocol, err)
	}
	if err := p.Ctrl.Validate(); err != nil {
		return fmt.Errorf("%w: the peer's control endpoint: %v", ErrProtocol, err)
	}
	return nil
}

// ctrlBuffers is how many control receive buffers each side posts.
const ctrlBuffers = 32

// build opens the device and makes the session's resources; with cm
// nil, its queue pairs too (with their receive buffers posted), else
// the queue pairs come later, from the CM (connectCM).
func (s *Session) build(name string, cm bool) (err error) {
	cfg := &s.cfg
	if s.dev, err = verbs.Open(name); err != nil {
		return err
	}
	if s.pd, err = s.dev.AllocPD(); err != nil {
		return err
	}
	if s.mem, err = NewAllocator(s.pd, cfg.Allocator); err != nil {
		return err
	}
	// The control messages this side sends (answers, fins, releases)
	// take buffers of an allocator of their own (an arena holds 256 of
	// them): an application (or the peer's requests) that took all of
	// Config.Allocator.MaxMemory left the agent no buffer for its
	// answers, which were lost, and the peer's calls waited for them
	// for ever, the regions granted for them held until their leases
	// ended (TestAdv2ControlWithoutMemory).
	if s.cmem, err = NewAllocator(s.pd, AllocatorConfig{ArenaSize: 256 * ctrlBufSize}); err != nil {
		return err
	}
	if s.block, err = s.pd.Alloc(64, verbs.AccessLocalWrite|verbs.AccessRemoteWrite); err != nil {
		return err
	}
	s.slot = (max(cfg.MessageSize, rtsHdr-dataHdr) + payOff + 63) &^ 63
	n := cfg.ReceiveBuffers
	// A region of its own, with remote read access too, so that soft0
	// can share it with the peer's process (large payloads are then
	// copied once, by the peer's provider, straight into the slot).
	if s.ring, err = s.pd.Alloc(n*s.slot, verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead); err != nil {
		return err
	}
	s.drflow = recvFlow{r: uint32(n)}
	s.rh, s.fifo = make([]channel.Handle, n), make([]int32, 0, n)
	s.rgen, s.busy = make([]uint32, n), make([]bool, n)
	for i := range s.rgen {
		s.rgen[i] = 1
	}
	// The control receives land in a region of their own too, which
	// lives as long as the session: before, they lay in a region of
	// s.mem, which the application can close (Allocator().Close): then
	// the agent crashed the process on the ring's nil Bytes (its arena
	// pinned by a window), or the receives posted into unmapped memory
	// broke the control queue pair and ended the session
	// (TestAdv2ControlAfterAllocatorClose).
	if s.cring, err = s.pd.Alloc(ctrlBuffers*ctrlBufSize, verbs.AccessLocalWrite); err != nil {
		return err
	}
	s.crflow = recvFlow{r: ctrlBuffers}
	s.crh, s.cfifo = make([]channel.Handle, ctrlBuffers), make([]int32, 0, ctrlBuffers)
	s.agent.init()
	if cm {
		return nil
	}
	if s.data, err = channel.New(s.pd, s.dataOptions()); err != nil {
		return err
	}
	if s.agc, err = channel.New(s.pd, ctrlOptions()); err != nil {
		return err
	}
	if err := s.postDataAll(s.data); err != nil {
		return err
	}
	return s.postCtrlAll(s.agc)
}

// dataProgress and ctrlProgress drive the progress of the data and
// control queue pairs (sendFlow.progress). They read the channels when
// called: with the RDMA CM the channels are made after the flows.
func (s *Session) dataProgress() error { return progressOf(s.data) }
func (s *Session) ctrlProgress() error { return progressOf(s.agc) }

func progressOf(c *channel.Channel) error {
	if c == nil {
		return nil
	}
	return c.Progress()
}

func (s *Session) dataOptions() channel.Options {
	cfg := &s.cfg
	// One send request more than the op tokens: the rendezvous read of
	// the receive turn's holder (finishRead), which takes no token. Senders
	// waiting for the peer's credits hold tokens; a read that needed one
	// waited behind them, and two sides each waiting for the other's
	// receiver to read deadlocked (TestRendezvousReceiveNotStarved).
	return channel.Options{
		QP:             verbs.QPSpec{MaxSendWR: cfg.QueueDepth + 1, MaxRecvWR: cfg.ReceiveBuffers, MaxSendSGE: 2, MaxRecvSGE: 1},
		MaxOutstanding: 2*cfg.QueueDepth + cfg.ReceiveBuffers + 1,
	}
}

// ctrlOptions are the options of the control channel: a wait polls
// agentSpinPolls times before it sleeps; the agent waits so only when it
// spins (agentSpins), and sleeps at once otherwise (Channel.Sleep).
func ctrlOptions() channel.Options {
	return channel.Options{
		QP:             verbs.QPSpec{MaxSendWR: 2 * ctrlBuffers, MaxRecvWR: ctrlBuffers, MaxSendSGE: 1, MaxRecvSGE: 1},
		MaxOutstanding: 4 * ctrlBuffers,
		SpinPolls:      agentSpinPolls,
	}
}

// agentSpinPolls is how many empty polls an agent that spins (agentSpins)
// makes before it sleeps: control messages come in bursts (a request,
// its answer, the release), each well within it, while a session that
// is quiet costs no processor. channel.SpinAdaptive did not help here:
// the waits between requests are long (tens of µs, a wake-up each), so
// it chose to sleep. Measured over soft0 shared memory
// (BenchmarkXprocRequestSpin, 2000 requests): 200 polls 13.6–16.7 µs per
// RequestRemoteMR, 1000 polls 14.7–15.7, 5000 polls 13.6–20.9, sleeping
// at once 88–95.
const agentSpinPolls = 1000

// agentBurst is how close two control messages come in a burst
// (agentSpins). Measured (BenchmarkXprocRequest, 2000 requests, three
// runs alternating with agents that always slept): RequestRemoteMR over
// shared memory 18–26 µs against 171–174, unix 42–68 against 251–264,
// TCP 75–92 against 271–277, as with Config.AgentSpin.
const agentBurst = time.Millisecond

// postDataAll makes c the data channel and posts every receive buffer
// (before the peer may send).
func (s *Session) postDataAll(c *channel.Channel) error {
	s.data = c
	s.rmu.Lock()
	defer s.rmu.Unlock()
	for i := range s.cfg.ReceiveBuffers {
		if err := s.postRecv(i); err != nil {
			return err
		}
	}
	return nil
}

// postCtrlAll makes c the control channel and posts every control
// receive buffer.
func (s *Session) postCtrlAll(c *channel.Channel) error {
	s.agc = c
	s.cmu.Lock()
	defer s.cmu.Unlock()
	for i := range ctrlBuffers {
		if err := s.postCtrl(i); err != nil {
			return err
		}
	}
	return nil
}

// word is the credit word at off in this side's control block.
func (s *Session) word(off int) *uint32 {
	return (*uint32)(unsafe.Pointer(&s.block.Bytes()[off]))
}

// watch ends the session when the bootstrap connection ends (the peer
// closed, died or stopped answering) or a queue pair breaks.
func (s *Session) watch() {
	defer s.agentWG.Done()
	select {
	case <-s.ctl.done():
		s.end(s.ctl.err())
	case <-s.done:
	}
}

// end ends the session with cause (once): the queue pairs break, which
// flushes every request in flight, and every waiter returns.
func (s *Session) end(cause error) {
	s.endOnce.Do(func() {
		if cause == nil {
			cause = ErrPeerLost
		}
		s.err = cause
		close(s.done)
		s.bgStop()
		s.data.Break()
		s.agc.Break()
		s.agent.fail(cause)
	})
}

// Done is closed when the session has ended: Close, or the peer closed
// it, died or stopped answering (Err says which). A zero Session's is
// closed (it is as good as closed).
func (s *Session) Done() <-chan struct{} {
	if s.done == nil {
		return closedDone
	}
	return s.done
}

// closedDone is the Done of a zero Session.
var closedDone = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Err is why the session ended: ErrClosed (Close), ErrPeerClosed,
// ErrPeerLost or ErrPeerUnresponsive (wrapped, with detail), or the
// failure of a queue pair. It is nil while the session lives, and
// ErrClosed for a zero Session.
func (s *Session) Err() error {
	if s.done == nil {
		return errZeroSession
	}
	select {
	case <-s.done:
		return s.err
	default:
		return nil
	}
}

// fail returns the error of an operation that failed with err: the
// session's end, if it ended (the operation's own error is then only a
// consequence, e.g. a flush), else err.
func (s *Session) fail(op string, err error) error {
	if e := s.Err(); e != nil {
		return fmt.Errorf("session: %s: %w", op, e)
	}
	if err == nil {
		return nil
	}
	var ce *verbs.CompletionError
	isCE := errors.As(err, &ce)
	if s.data.Err() != nil || s.agc.Err() != nil || isCE {
		// A queue pair broke (a remote access error, a transport
		// failure): the session cannot go on. If the peer closed or
		// died, its bootstrap connection says so soon: that is the
		// cause.
		select {
		case <-s.ctl.done():
			s.end(s.ctl.err())
		case <-time.After(time.Second):
			if !isCE || ce.Status == verbs.StatusWRFlushErr {
				// The operation failed only as a consequence (the
				// channel broke, its request was flushed): the queue
				// pair's own failure says why. Before, a flushed
				// receive that reached fail first (a Receive, the
				// agent) ended the session with "a queue pair failed"
				// where the send that was never acknowledged said
				// ErrPeerUnresponsive.
				if c, qerr := s.qpFailure(); c != nil {
					err, ce = qerr, c
				}
			}
			if ce != nil && ce.Status == verbs.StatusRetryExcErr {
				// The bootstrap connection lives, but the peer
				// acknowledged nothing for the queue pair's
				// transport timeout: a stopped or wedged process
				// (found so with or without a keepalive).
				s.end(fmt.Errorf("%w: a request got no acknowledgement within the queue pair's transport timeout: %w", ErrPeerUnresponsive, err))
			} else {
				s.end(fmt.Errorf("session: a queue pair failed: %w", err))
			}
			s.ctl.close()
		}
		return fmt.Errorf("session: %s: %w", op, s.Err())
	}
	return fmt.Errorf("session: %s: %w", op, err)
}

// qpFailure is the failed completion, other than a flush (a consequence
// of a failure before it), that broke a queue pair of the session, and
// its channel's error, or nil: the data channel's, else the control's.
// (A channel records the first failed completion it polls, which comes
// before the flushes it causes: a channel's queue pair has one
// completion queue.)
func (s *Session) qpFailure() (*verbs.CompletionError, error) {
	for _, err := range []error{s.data.Err(), s.agc.Err()} {
		var ce *verbs.CompletionError
		if errors.As(err, &ce) && ce.Status != verbs.StatusWRFlushErr {
			return ce, err
		}
	}
	return nil, nil
}

// acquireOp takes a token for a request on the data queue pair, so that
// posting never finds the queue full: at most QueueDepth in flight.
func (s *Session) acquireOp(ctx context.Context, op string) error {
	select {
	case s.ops <- struct{}{}:
		return nil
	default:
	}
	select {
	case s.ops <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("session: %s: %w", op, ctx.Err())
	case <-s.done:
		return s.fail(op, nil)
	}
}

func (s *Session) releaseOp() { <-s.ops }

// live returns the session's end error, if it ended.
func (s *Session) live(op string) error { return s.fail(op, nil) }

// Transport says what carries the session: "rc/" and the device, port
// and link layer on a hardware device ("rc/mlx5_0/1 infiniband"), or
// "soft0/" and soft0's link: "shm", "unix", "tcp", "tls" (TCP,
// encrypted) or "local" (the peer is in this process). Before the first
// message soft0 names the link it will try first (see
// verbs.RCQueuePair.Link).
func (s *Session) Transport() string {
	if s.ctl == nil {
		return "" // a zero Session
	}
	return s.describe()
}

// PeerMessageSize is the largest message that reaches the peer in one
// write into one of its receive buffers (eager): at least the peer's
// Config.MessageSize. Larger messages go by rendezvous, which costs a
// round trip more.
func (s *Session) PeerMessageSize() int { return s.peer.SlotSize - payOff }

// PeerMaxMessage is the largest message the peer takes (its
// Config.MaxMessage): a larger Send fails with ErrLimit before anything is
// sent. It may be below PeerMessageSize.
func (s *Session) PeerMaxMessage() int { return s.peer.MaxMessage }

// QueueDepth is this side's Config.QueueDepth (the default if it was 0):
// how many requests the session keeps in flight at most. A message posted
// with PostSendSlice holds one until it is waited for, so code that keeps
// messages posted (package stream) must keep fewer than QueueDepth, and
// leave some for the session's other requests.
func (s *Session) QueueDepth() int { return s.cfg.QueueDepth }

// LocalAddr and RemoteAddr are the bootstrap connection's addresses.
func (s *Session) LocalAddr() net.Addr {
	if s.ctl == nil {
		return nil // a zero Session
	}
	return s.ctl.localAddr()
}

// RemoteAddr is the peer's bootstrap address.
func (s *Session) RemoteAddr() net.Addr {
	if s.ctl == nil {
		return nil // a zero Session
	}
	return s.ctl.remoteAddr()
}

// Allocator is the session's allocator of registered memory: regions
// from it are what Read, Write, SendSlice and grants take. Closing it
// before the session's Close leaves the session up: what needs its
// memory then fails (Alloc and Send with ErrClosed, the peer's requests
// with ErrLimit).
func (s *Session) Allocator() *Allocator { return s.mem }

// Alloc allocates n bytes of registered memory (Allocator().Alloc).
func (s *Session) Alloc(n int) (LocalMR, error) {
	if s.mem == nil {
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: %w", n, errZeroSession)
	}
	return s.mem.Alloc(n)
}

// Close ends the session: the peer's calls and Done report
// ErrPeerClosed. Requests in flight are flushed; memory the peer was
// granted becomes unreachable; regions of the allocator become invalid.
// When Close returns, every goroutine the session started has ended
// (the bootstrap connection's reader, pinger and keepalive, the agent,
// reapers of cancelled requests, lease timers). Calls of other
// goroutines in progress return an error (the session's end) before Close
// releases the memory they may touch; calls made after it began fail.
// Close is idempotent: a Close while another is in progress waits for it.
func (s *Session) Close() error {
	if s.ctl == nil { // a zero Session is as good as closed
		return nil
	}
	if !s.closed.CompareAndSwap(false, true) {
		// Another Close tears the session down: this one returns when
		// it is done, as the first does. (Before, it returned at once,
		// with the session's goroutines and memory still there:
		// TestCloseConcurrent.)
		<-s.shut
		return nil
	}
	s.end(ErrClosed)
	s.ctl.close()
	s.agentWG.Wait()
	// The agent is gone: nothing starts tasks but tasks and callers of
	// the API racing Close, whose tasks no longer run (see goTask).
	s.tasks.close()
	s.rcalls.Lock()
	s.calls.Lock()
	s.dropMessages()
	s.release()
	s.calls.Unlock()
	s.rcalls.Unlock()
	close(s.shut)
	return nil
}

// dropMessages makes the messages of the ring still held read as
// released (Bytes nil, Len 0; Release does nothing), before release
// unmaps the ring: their Bytes pointed into it, and a message held across
// Close crashed the process when it read them (SIGSEGV,
// TestAdvUseAfterClose). (A message of a rendezvous lies in a region of
// the allocator, which its Close invalidates.)
func (s *Session) dropMessages() {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	for i := range s.rgen {
		if s.rgen[i]++; s.rgen[i] == 0 { // 0 is never a message's
			s.rgen[i] = 1
		}
	}
}

// errZeroSession is what the calls of a zero Session fail with.
var errZeroSession = fmt.Errorf("%w (a zero Session: make one with Dial or Accept)", ErrClosed)

// enter begins an API call that touches the session's memory (l is
// s.calls, or s.rcalls for receives): Close waits for the call to leave
// (l.RUnlock) before it releases the memory. It fails once Close began,
// and on a zero Session. A call must not enter twice (a Close waiting
// between would deadlock).
func (s *Session) enter(l *sync.RWMutex, op string) error {
	if s.ctl == nil {
		// A zero Session (not made by Dial or Accept) is as good as
		// closed: before, its calls met nil maps and channels, and
		// panicked or waited for ever (TestZeroObjectMethods).
		return fmt.Errorf("session: %s: %w", op, errZeroSession)
	}
	l.RLock()
	if s.closed.Load() {
		l.RUnlock()
		if e := s.Err(); e != nil {
			return fmt.Errorf("session: %s: %w", op, e)
		}
		return fmt.Errorf("session: %s: %w", op, ErrClosed)
	}
	return nil
}

// tasks tracks the short-lived goroutines of a session (reapers of
// cancelled requests, the agent's answers, revocations), so that Close
// waits for them. Safe for concurrent use.
type tasks struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

// goTask runs f in a goroutine of the session. Once Close has begun to
// wait for them, f does not run: the session has ended, so an answer
// would not go out, and what a reaper would give back (a buffer, an op
// token) goes with the session's resources; f could meet them freed.
func (s *Session) goTask(f func()) {
	t := &s.tasks
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return
	}
	t.wg.Add(1)
	t.mu.Unlock()
	go func() {
		defer t.wg.Done()
		f()
	}()
}

// close waits for the tasks running; later ones do not run.
func (t *tasks) close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.wg.Wait()
}

// release frees the session's resources (after end, or when the setup
// failed).
func (s *Session) release() {
	if s.bgStop != nil {
		s.bgStop()
	}
	s.agent.closeGrants()
	s.leases.Wait() // lease timers that fired before closeGrants stopped them
	// Children before parents; errors of a session that ended have
	// nobody to go to.
	for _, c := range []*channel.Channel{s.data, s.agc} {
		if c != nil {
			c.Close()
		}
	}
	for _, m := range []*verbs.MemoryRegion{s.block, s.ring, s.cring} {
		if m != nil {
			m.Close()
		}
	}
	if s.mem != nil {
		s.mem.Close()
	}
	if s.cmem != nil {
		s.cmem.Close()
	}
	if s.pd != nil {
		s.pd.Close()
	}
	if s.dev != nil {
		s.dev.Close()
	}
}
