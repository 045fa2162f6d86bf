package collective

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/goverbs/verbs/internal/spinwait"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/internal/bells"
)

// Errors of the package. A failed collective returns an *Error wrapping
// one of them, a *cluster.RankError (a rank failed), or the context's
// error; test with errors.Is and errors.As.
var (
	// ErrPoisoned: an earlier collective of the communicator failed, so
	// its ranks no longer agree on what was sent: every call fails until
	// the communicator is rebuilt (New, on every rank). The error wraps
	// the first failure.
	ErrPoisoned = errors.New("collective: communicator poisoned by an earlier failure (rebuild it)")
	// ErrMismatch: a peer called another collective than this rank (an
	// other kind, operation, element type, count, root, or message
	// length), or called them in another order.
	ErrMismatch = errors.New("collective: ranks disagree on the collective call")
	// ErrArgs: the arguments are invalid at this rank (slice lengths,
	// root, counts); nothing was sent and the communicator stays usable,
	// unless the arguments are ones only the root of the call uses (a
	// gather's recv, a scatter's send, a reduce's recv): then the root
	// gives the call up, and the communicator is poisoned (see
	// Failures in the package documentation).
	ErrArgs = errors.New("collective: invalid arguments")
	// ErrClosed: the communicator was closed.
	ErrClosed = errors.New("collective: communicator closed")
	// ErrPeerAborted: a peer gave up the call (it detected a mismatch,
	// its context ended, its communicator was closed or poisoned), so
	// this rank's cannot complete. When the peer's reason was a
	// mismatch, the error wraps ErrMismatch too; when it was the root's
	// bad arguments, ErrArgs.
	ErrPeerAborted = errors.New("collective: a peer gave up the call")
)

// Error is the error of a failed collective: which call (its name, this
// rank in the communicator, the peer it was exchanging with or -1) and
// the cause.
type Error struct {
	Call string // "allreduce", "barrier", ...
	Rank int    // this rank, in the communicator
	Peer int    // the peer involved (rank in the communicator), or -1
	Err  error
}

func (e *Error) Error() string {
	peer := ""
	if e.Peer >= 0 {
		peer = fmt.Sprintf(", peer %d", e.Peer)
	}
	return fmt.Sprintf("collective: %s (rank %d%s): %v", e.Call, e.Rank, peer, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Options configure a communicator. The zero value is usable: every
// field documents its default. Every rank of a communicator must use
// the same ChunkSize, Slots and Algorithm (New and Split check it).
type Options struct {
	// ChunkSize is the payload of one slot of the receive windows, in
	// bytes: messages travel in chunks of at most ChunkSize, pipelined.
	// Default 1 MiB, reduced for communicators of more than 3 ranks so
	// that the windows of all peers take at most 8 MiB (256 KiB at 9
	// ranks, 64 KiB at 33); at least 256 bytes.
	ChunkSize int
	// Slots is the number of chunks a rank may have in flight to one peer
	// before the peer consumes them (the window). Default 4, at least 2.
	Slots int
	// Timeout bounds every call, besides its context: a call that has not
	// completed within Timeout (counted from its first wait for a peer)
	// fails (and poisons the communicator).
	// Zero: only the context bounds it.
	Timeout time.Duration
	// Algorithm forces the algorithm family of every collective that has
	// several (each documents what the families mean for it: for
	// Broadcast, AlgRecursiveDoubling is the binomial tree and AlgRing
	// the pipelined chain, for example); AlgAuto (the default) chooses by
	// message size and communicator size.
	Algorithm Algorithm
}

// Algorithm names an allreduce algorithm.
type Algorithm int

const (
	// AlgAuto chooses by size: recursive doubling below SmallMax bytes,
	// Rabenseifner's reduce-scatter and allgather by recursive halving
	// and doubling up to RingMin, the pipelined ring above.
	AlgAuto Algorithm = iota
	// AlgRecursiveDoubling exchanges whole vectors in ⌈log2 p⌉ rounds.
	AlgRecursiveDoubling
	// AlgRabenseifner reduce-scatters by recursive halving and allgathers
	// by recursive doubling.
	AlgRabenseifner
	// AlgRing reduce-scatters and allgathers around a ring, in p−1 steps
	// each, pipelined in chunks.
	AlgRing
)

func (a Algorithm) String() string {
	switch a {
	case AlgAuto:
		return "auto"
	case AlgRecursiveDoubling:
		return "recursive doubling"
	case AlgRabenseifner:
		return "rabenseifner"
	case AlgRing:
		return "ring"
	}
	return fmt.Sprintf("Algorithm(%d)", int(a))
}

const (
	defaultChunk  = 1 << 20
	defaultSlots  = 4
	windowBudget  = 8 << 20
	directChunk   = 256 << 10 // from this ChunkSize the windows take direct writes (newComm)
	minChunk      = 256
	hdrBytes      = 64  // header of a slot: 44 bytes used (see header), data 64-byte aligned
	peerFlagBytes = 128 // data count, ack count, done flag (Close), abort word (abort), landing (announce), sleep word (bells.go)
)

// Comm is a communicator: an ordered group of ranks of a cluster.Node's
// world (all of them for New, a subset for Split) that run collectives
// together. Rank and Size are within the communicator.
//
// Every collective is collective: every rank of the communicator calls
// it, with matching arguments, in the same order as the others. Calls on
// one Comm are executed one at a time, in the order they were issued
// (blocking calls and the non-blocking twins alike); a Comm is safe for
// concurrent use, but concurrent calls from several goroutines are
// issued in an order the ranks will not agree on unless the program
// orders them.
type Comm struct {
	node  *cluster.Node
	mc    *channel.MultiChannel
	opts  Options
	ranks []int // world rank of each rank of the communicator
	rank  int
	size  int

	chunk, slots, slotBytes, ackEvery int
	rx, tx                            *verbs.MemoryRegion
	slotBase                          int              // offset of the slots in rx
	flagBase, ackBase, probeSrc       int              // offsets in tx (the done flag's and the abort word's sources follow the probe's)
	landSrc                           int              // offset in tx of the landing announcement's source (announce)
	sleepSrc                          int              // offset in tx of the sleep announcement's source (bells.go)
	onDemand                          bool             // writes ring no doorbell unless the peer sleeps (bells.go)
	gather                            bool             // some rank's waits yield: Barrier gathers at rank 0 (the descriptors' flags)
	book                              *bells.Book      // of the doorbells on demand (bells.go)
	ann                               []channel.Handle // sleep announcements in flight
	annPartial                        bool             // some of them could not be posted
	sleeps                            atomic.Uint64    // sleeps begun, announced where bells are on demand (tests)
	remote                            []verbs.RemoteRegion
	sendSeq, recvSeq, ackSent         []uint64
	ackWritten, llAcked               []uint64 // ack counts written (ackSent counts those that rode on small messages too), and acks that came so (small.go)
	llData                            []byte   // the data of the small message taken in (small.go)
	acksRode                          bool     // some ackSent is past ackWritten (small.go)
	flagOwed, ackOwed                 []bool
	anyOwed                           bool // some flagOwed or ackOwed may be set
	red                               reducer
	comb                              combiner // of red, or nil (see combiner)
	call                              callInfo
	hold                              callHold    // the call's Buffers (begin)
	held                              *heldTicket // the call's, if a request runs it (begin; handOn)
	callSeq                           uint32
	deadline                          time.Time // of the call: see callDeadline
	deadlineSet                       bool
	w                                 waiter
	sends, recvs                      []flow           // scratch of the algorithms
	scratch                           []byte           // reduction scratch of the algorithms (Go memory)
	doneHs                            []channel.Handle // Close's done writes
	aborted                           bool             // this rank's abort word was written (abort)
	wokenFn                           func() bool      // c.woken, bound once
	spin                              spinwait.Policy  // how a wait spins before it sleeps, and its alarms and probes
	alarm                             *spinwait.Alarm  // ends the sleeps of waits (ring)
	bufs                              *bufSet          // the Buffers (Alloc), shared with the communicators made from this one
	zeroCopied                        uint64           // chunks sent from a Buffer (tests)
	landedChunks                      uint64           // chunks received in place, into a Buffer (tests)
	writes, countWrites, ackWrites    uint64           // writes posted by the calls, and how many were data counts and ack counts (tests)
	sleepWrites                       uint64           // and how many told peers of sleeps or rang them (bells.go, tests)

	mu      sync.Mutex
	issued  uint64        // tickets handed out
	serving uint64        // ticket being served
	turn    chan struct{} // closed when serving advances (slow path)
	err     error         // poison
	closed  bool
}

// New creates the communicator of the whole world of node, every rank of
// the world calling it. It registers the receive windows and hands every
// peer their address with one cluster.Node.Share (RDMA writes and a
// world barrier: it counts as one of the node's barriers, so every rank
// must call New in the same order relative to its barriers). The
// communicator's rank and size are the node's.
func New(ctx context.Context, node *cluster.Node, opts Options) (*Comm, error) {
	if node == nil || node.Size() < 1 {
		return nil, &Error{Call: "new", Peer: -1, Err: fmt.Errorf("%w: a nil or zero cluster.Node (make one with cluster.Join)", ErrArgs)}
	}
	ranks := make([]int, node.Size())
	for i := range ranks {
		ranks[i] = i
	}
	c, err := newComm(node, ranks, node.Rank(), opts, new(bufSet))
	if err != nil {
		return nil, err
	}
	if err := c.bootstrap(ctx); err != nil {
		c.release()
		return nil, &Error{Call: "new", Rank: c.rank, Peer: -1, Err: err}
	}
	return c, nil
}

// newComm allocates the communicator of ranks (world ranks) at position
// me, using the Buffers of bufs, without the peers' windows.
func newComm(node *cluster.Node, ranks []int, me int, opts Options, bufs *bufSet) (*Comm, error) {
	sweepLate(node)
	if opts.Slots == 0 {
		opts.Slots = defaultSlots
	}
	p := len(ranks)
	if opts.ChunkSize == 0 {
		opts.ChunkSize = defaultChunk
		if p > 1 {
			opts.ChunkSize = min(defaultChunk, max(minChunk, windowBudget/((p-1)*opts.Slots))&^63)
		}
	}
	if opts.Slots < 2 || opts.Slots > 1024 {
		return nil, fmt.Errorf("%w: Options.Slots %d (want 2 to 1024)", ErrArgs, opts.Slots)
	}
	if opts.ChunkSize < minChunk || opts.ChunkSize > 1<<30 {
		return nil, fmt.Errorf("%w: Options.ChunkSize %d (want %d bytes to 1 GiB)", ErrArgs, opts.ChunkSize, minChunk)
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("%w: negative Options.Timeout", ErrArgs)
	}
	c := &Comm{node: node, mc: node.Channel(), opts: opts, ranks: ranks, rank: me, size: p, bufs: bufs,
		chunk: opts.ChunkSize, slots: opts.Slots, ackEvery: max(1, opts.Slots/2),
		remote: make([]verbs.RemoteRegion, p), sendSeq: make([]uint64, p), recvSeq: make([]uint64, p),
		ackSent: make([]uint64, p), flagOwed: make([]bool, p), ackOwed: make([]bool, p),
		ackWritten: make([]uint64, p), llAcked: make([]uint64, p), llData: make([]byte, llMax+3)}
	c.wokenFn = c.woken
	c.alarm = spinwait.NewAlarm(c.ring)
	c.spin = spinwait.For(node.LocalRanks(), runtime.NumCPU())
	c.onDemand = c.spin.Spin > 0
	c.gather = c.spin.Yield
	c.book = bells.New(p)
	c.slotBytes = (hdrBytes + c.chunk + 63) &^ 63
	c.slotBase = (p*peerFlagBytes + 8 + 63) &^ 63 // flags, the probe word
	rxLen := c.slotBase + p*c.slots*c.slotBytes
	c.flagBase = p * c.slots * c.slotBytes
	c.ackBase = c.flagBase + p*c.slots*8
	c.probeSrc = c.ackBase + p*8
	c.landSrc = c.probeSrc + 24
	c.sleepSrc = c.landSrc + landBytes
	txLen := c.sleepSrc + 16 // the sleep words' sources: asleep, awake
	var err error
	// With chunks of directChunk bytes or more the windows allow remote
	// reads too: soft0 then maps them into the peer processes of the
	// host, whose writes of 16 KiB or more become one copy, by the writer
	// (a round trip: the target acknowledges first), instead of two (into
	// the connection's ring at once, out of it by the target). Measured
	// on soft0 shared memory (package documentation), the direct copy
	// pays off with large chunks and loses with small ones.
	access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite
	if c.chunk >= directChunk {
		access |= verbs.AccessRemoteRead
	}
	if c.rx, err = node.PD().Alloc(rxLen, access); err != nil {
		return nil, fmt.Errorf("collective: receive windows (%d bytes): %w", rxLen, err)
	}
	if c.tx, err = node.PD().Alloc(txLen, verbs.AccessLocalWrite); err != nil {
		c.rx.Close()
		return nil, fmt.Errorf("collective: send staging (%d bytes): %w", txLen, err)
	}
	return c, nil
}

// Window descriptor a rank hands each peer:
//
//	magic "GVCO" | version u16 | slots u16 | comm size u32 | comm rank u32 |
//	chunk u32 | addr u64 | len u64 | rkey u32 | flags u32
//
// little endian, 44 bytes. Flag descYields: the rank's waits yield (its
// machine has more ranks of the world than processors): Barrier gathers
// at rank 0 if any rank's do, a choice every rank makes alike. Bits 8-15
// of the flags: Options.Algorithm, which decides what each rank sends
// and must agree.
const (
	descMagic   = "GVCO"
	descVersion = 5 // 2: 64-byte peer flags (the landing announcement); 3: 128 (the sleep word), the flags; 4: Custom op ids in the headers; 5: the algorithm
	descBytes   = 44
	descYields  = 1
)

func (c *Comm) descriptor(b []byte) {
	r := c.rx.Remote()
	copy(b, descMagic)
	binary.LittleEndian.PutUint16(b[4:], descVersion)
	binary.LittleEndian.PutUint16(b[6:], uint16(c.slots))
	binary.LittleEndian.PutUint32(b[8:], uint32(c.size))
	binary.LittleEndian.PutUint32(b[12:], uint32(c.rank))
	binary.LittleEndian.PutUint32(b[16:], uint32(c.chunk))
	binary.LittleEndian.PutUint64(b[20:], r.Addr)
	binary.LittleEndian.PutUint64(b[28:], r.Len)
	binary.LittleEndian.PutUint32(b[36:], r.RKey)
	var flags uint32
	if c.spin.Yield {
		flags |= descYields
	}
	flags |= uint32(uint8(c.opts.Algorithm)) << 8
	binary.LittleEndian.PutUint32(b[40:], flags)
}

// setRemote checks and keeps rank j's descriptor.
func (c *Comm) setRemote(j int, b []byte) error {
	if len(b) != descBytes {
		return fmt.Errorf("rank %d's window description is %d bytes, want %d", j, len(b), descBytes)
	}
	if string(b[:4]) == "\x00\x00\x00\x00" {
		return fmt.Errorf("rank %d could not create its side of the communicator (no window description)", j)
	}
	if string(b[:4]) != descMagic {
		return fmt.Errorf("rank %d's window description has magic %q, want %q", j, b[:4], descMagic)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != descVersion {
		return fmt.Errorf("rank %d's window description has version %d, want %d", j, v, descVersion)
	}
	if n := int(binary.LittleEndian.Uint32(b[8:])); n != c.size {
		return fmt.Errorf("%w: rank %d has a communicator of %d ranks, this rank %d", ErrMismatch, j, n, c.size)
	}
	if r := int(binary.LittleEndian.Uint32(b[12:])); r != j {
		return fmt.Errorf("entry %d holds the window description of rank %d", j, r)
	}
	if binary.LittleEndian.Uint32(b[40:])&descYields != 0 {
		c.gather = true
	}
	if a := Algorithm(uint8(binary.LittleEndian.Uint32(b[40:]) >> 8)); a != Algorithm(uint8(c.opts.Algorithm)) {
		// Each algorithm sends other messages: ranks that disagree would
		// take one another's for their own (a Reduce returned one rank's
		// vector as the sum, without an error).
		return fmt.Errorf("%w: rank %d uses Options.Algorithm %v, this rank %v (it must agree)", ErrMismatch, j, a, c.opts.Algorithm)
	}
	s, ch := int(binary.LittleEndian.Uint16(b[6:])), int(binary.LittleEndian.Uint32(b[16:]))
	if s != c.slots || ch != c.chunk {
		return fmt.Errorf("%w: rank %d uses %d slots of %d bytes, this rank %d of %d (Options.Slots and ChunkSize must agree)",
			ErrMismatch, j, s, ch, c.slots, c.chunk)
	}
	r := verbs.RemoteRegion{Addr: binary.LittleEndian.Uint64(b[20:]), Len: binary.LittleEndian.Uint64(b[28:]),
		RKey: binary.LittleEndian.Uint32(b[36:])}
	if r.Len != uint64(c.rx.Len()) {
		return fmt.Errorf("rank %d's window region has %d bytes, want %d", j, r.Len, c.rx.Len())
	}
	if r.Addr%64 != 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("rank %d's window region at %#x is misaligned or wraps around", j, r.Addr)
	}
	c.remote[j] = r
	return nil
}

// bootstrap exchanges the window descriptors of a world communicator
// with Node.Share: RDMA writes into the node's mailboxes, then a world
// barrier (no send or receive on the node's channels).
func (c *Comm) bootstrap(ctx context.Context) error {
	if c.size == 1 {
		return nil
	}
	var desc [descBytes]byte
	c.descriptor(desc[:])
	all, err := c.node.Share(ctx, desc[:])
	if err != nil {
		return fmt.Errorf("exchanging window descriptions: %w", err)
	}
	for j := range c.size {
		if j == c.rank {
			continue
		}
		if err := c.setRemote(j, all[c.ranks[j]]); err != nil {
			return err
		}
	}
	return nil
}

// Rank returns this rank's position in the communicator.
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks of the communicator.
func (c *Comm) Size() int { return c.size }

// WorldRank returns the rank of the node's world of the communicator's
// rank r, or -1 if r is not a rank of the communicator.
func (c *Comm) WorldRank(r int) int {
	if r < 0 || r >= len(c.ranks) {
		return -1
	}
	return c.ranks[r]
}

// Node returns the node the communicator runs on.
func (c *Comm) Node() *cluster.Node { return c.node }

// Err returns why the communicator is poisoned, or nil.
func (c *Comm) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close releases the communicator. A call in progress fails with
// ErrClosed, and so does every later call. It does not close the node.
// Idempotent; it does not wait for the peers.
//
// The peers may still write into this rank's windows after their last
// call ended here (the acknowledgement of the last chunks they received,
// a probe), and such a write, reaching a released window, would fail
// their queue pair, and the world with it. So Close writes a done flag
// at every peer (after its own last writes: RC places them in order) and
// releases the windows once every peer's done flag is here (every peer
// closed its side too), or a rank of the world failed; until then they
// stay registered, and are released by a later New or Close on the same
// node that finds them quiet, or when the node closes.
//
// Close of a communicator that is not poisoned reports a mismatch that
// no call saw: it fails with ErrMismatch (an *Error of call "close",
// naming the peer and its call) when a peer's message of one of this
// rank's calls is in the windows, never taken in — the peer's call
// differed from this rank's without any message this rank received
// showing it, as when the ranks of a Broadcast, Gather, Scatter or
// Reduce disagree on the root and each, taking itself for the root,
// only sends. Close sees only the messages that have arrived: one still
// on its way is not reported (it does not wait for the peers). The
// communicator is closed all the same.
func (c *Comm) Close() error {
	if c.ranks == nil {
		return nil // a zero Comm, as good as closed
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	t := c.issued
	c.issued++
	c.mu.Unlock()
	// Wait for the calls issued before (they see closed at their next
	// check and fail), then say goodbye and release the memory.
	if err := c.await(context.Background(), t); err != nil {
		return err
	}
	defer c.done(t)
	stray := c.stray()
	// Counters left owed by a full send queue go before the done flag.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	c.flushOwed(ctx)
	cancel()
	c.sayDone()
	defer sweepLate(c.node)
	if c.quiet() {
		return errors.Join(stray, c.release())
	}
	lateMu.Lock()
	defer lateMu.Unlock()
	if _, ok := late[c.node]; !ok {
		node := c.node
		node.OnClose(func() error { return releaseLate(node) })
	}
	late[c.node] = append(late[c.node], c)
	return stray
}

// stray returns, at Close of a communicator that is not poisoned (every
// call of this rank completed, or failed with ErrArgs before it sent
// anything), ErrMismatch naming the first peer that wrote a message into
// this rank's windows that none of its calls took in: every message of
// a call is taken in by the call of the same number at its receiver, so
// the peer's call and this rank's differed, in a way that no message
// this rank received showed (ranks of a Broadcast, Gather, Scatter or
// Reduce that disagree on the root: each sent as the root and received
// nothing). A later call that receives from the peer finds such a
// message too (ErrMismatch); Close finds those nothing read. It sees
// only messages that have arrived: it does not wait for the peers.
func (c *Comm) stray() error {
	c.mu.Lock()
	poisoned := c.err != nil
	c.mu.Unlock()
	if poisoned || c.size == 1 {
		return nil
	}
	c.mc.Progress() // place what the peers wrote (soft0 places writes as the process polls)
	for p := range c.size {
		if p == c.rank || c.remote[p].Len == 0 {
			continue
		}
		seq := c.recvSeq[p]
		slot := c.rxSlot(p, seq)
		var call uint32
		var peer callInfo
		if h, ok := llHeader(slot, llFlag(seq)); ok {
			call, peer = llCall(h)
		} else if atomic.LoadUint64(word(c.rx, p*peerFlagBytes)) > seq {
			call, peer = chunkCall(slot)
		} else {
			continue
		}
		// A message of a later call than this rank's last is one of a
		// peer that called on after this rank's last call (it fails, with
		// ErrClosed, as this rank closed), not a mismatch.
		if call > c.callSeq {
			continue
		}
		return &Error{Call: "close", Rank: c.rank, Peer: p, Err: fmt.Errorf(
			"%w: rank %d sent a message of its call %d (%v) that no call of this rank took in; this rank's last call was %d (%v)",
			ErrMismatch, p, call, peer, c.callSeq, c.call)}
	}
	return nil
}

// late holds, per node, the closed communicators whose windows wait for
// their peers' done flags (see Close).
var (
	lateMu sync.Mutex
	late   = map[*cluster.Node][]*Comm{}
)

// sweepLate releases the windows of node's closed communicators that
// became quiet.
func sweepLate(node *cluster.Node) {
	lateMu.Lock()
	defer lateMu.Unlock()
	cs, ok := late[node]
	if !ok {
		return
	}
	keep := cs[:0]
	for _, c := range cs {
		if c.quiet() {
			c.release()
		} else {
			keep = append(keep, c)
		}
	}
	clear(cs[len(keep):])
	late[node] = keep
}

// releaseLate releases the windows of node's closed communicators when
// the node closes (after its queue pairs: nothing can reach them).
func releaseLate(node *cluster.Node) error {
	lateMu.Lock()
	cs := late[node]
	delete(late, node)
	lateMu.Unlock()
	var errs []error
	for _, c := range cs {
		errs = append(errs, c.release())
	}
	return errors.Join(errs...)
}

// sayDone posts the write of this rank's done flag at every peer. A
// probe still in flight (it reads tx too) is awaited with the done
// writes.
func (c *Comm) sayDone() {
	if c.w.probing {
		c.doneHs = append(c.doneHs, c.w.probe)
		c.w.probing = false
	}
	if c.size == 1 {
		return
	}
	src := c.probeSrc + 8
	*word(c.tx, src) = 1
	sge, err := c.tx.SGE(src, 8)
	if err != nil {
		return
	}
	for p := range c.size {
		if p == c.rank || c.remote[p].Len == 0 {
			continue
		}
		for tries := 0; ; tries++ {
			h, err := c.mc.Peer(c.ranks[p]).PostWriteImm(c.remote[p].At(uint64(c.rank*peerFlagBytes+16)), 0, sge)
			if err == nil {
				c.doneHs = append(c.doneHs, h)
			}
			if !errors.Is(err, verbs.ErrQueueFull) || tries == 1000 {
				break
			}
			c.mc.Progress()
			c.spin.Pause()
		}
	}
}

// quiet reports whether the windows of a closed communicator may be
// released: its done writes completed (they read tx), and every peer
// wrote its done flag, or failed, or a rank of the world failed.
func (c *Comm) quiet() bool {
	c.mc.Progress()
	for _, h := range c.doneHs {
		if done, err := h.Poll(); !done && err == nil {
			return false
		}
	}
	if c.node.Err() != nil {
		return true
	}
	for p := range c.size {
		if p == c.rank || c.remote[p].Len == 0 || c.mc.Peer(c.ranks[p]).Err() != nil {
			continue
		}
		if atomic.LoadUint64(word(c.rx, p*peerFlagBytes+16)) == 0 {
			return false
		}
	}
	return true
}

// finished reports whether peer p has closed the communicator.
func (c *Comm) finished(p int) bool {
	return atomic.LoadUint64(word(c.rx, p*peerFlagBytes+16)) != 0
}

func (c *Comm) release() error {
	for _, h := range c.doneHs {
		h.Release()
	}
	c.doneHs = nil
	releaseAnn(c.ann)
	c.ann = nil
	return errors.Join(c.rx.Close(), c.tx.Close())
}

// await waits until ticket t is served, or ctx ends.
func (c *Comm) await(ctx context.Context, t uint64) error {
	c.mu.Lock()
	for c.serving != t {
		if c.turn == nil {
			c.turn = make(chan struct{})
		}
		turn := c.turn
		c.mu.Unlock()
		select {
		case <-turn:
		case <-ctx.Done():
			// Our ticket must still be served in order: hand it to a
			// goroutine that skips it, poisoning the communicator (the
			// ranks no longer agree on the calls).
			go func() {
				_ = c.await(context.Background(), t)
				c.mu.Lock()
				if c.err == nil && !c.closed {
					// The abandoned call is the communicator's next one:
					// the abort names its number (the peers' call of this
					// turn), not the previous call's.
					c.callSeq++
					c.err = fmt.Errorf("a call was abandoned before it started: %w", ctx.Err())
				}
				c.mu.Unlock()
				c.abort(abortOther)
				c.done(t)
			}()
			return ctx.Err()
		}
		c.mu.Lock()
	}
	c.mu.Unlock()
	return nil
}

// handOn ends the service of the running call's ticket t (begin, end;
// the goroutine that has the turn): at once, or, for the call of a
// Request, once the request is complete (start): a call issued after it
// must not return while the request still reads as not done.
func (c *Comm) handOn(t uint64) {
	if h := c.held; h != nil && h.t == t {
		c.held = nil
		h.ended = true
		return
	}
	c.done(t)
}

// done ends the service of ticket t.
func (c *Comm) done(t uint64) {
	c.mu.Lock()
	c.serving = t + 1
	if c.turn != nil {
		close(c.turn)
		c.turn = nil
	}
	c.mu.Unlock()
}

var errSplitAlloc = errors.New("collective: split: the new communicator's windows could not be registered")
