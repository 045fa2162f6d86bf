package collective

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/cluster"
)

// Transport. Every rank registers a receive window region (rx):
//
//	per peer j (peerFlagBytes): data count (chunks j has written into
//	my slots for it), ack count (chunks of mine j has consumed), done
//	flag (j closed the communicator: see Close), abort word (j gave up
//	a call: see abort), landing announcement (land.go), sleep word (j
//	sleeps while it is odd: bells.go), where j waits (its probes:
//	peerElsewhere)
//	the probe word
//	per peer j: Slots slots of hdrBytes + ChunkSize bytes
//
// and a send staging region (tx): per peer Slots staging slots, Slots
// flag source words and an ack source word, the probe's source, the done
// flag's and the abort word's, the landing announcement's and the sleep
// words'.
//
// To send chunk s of a message to peer j, a rank waits for a credit (j
// has acknowledged chunk s−Slots), copies the header and the data into
// staging slot s mod Slots, RDMA-writes them into its slot s mod Slots
// of j's window, then RDMA-writes s+1 into its data count at j. The
// queue pair places writes in order, so j, polling its data count, finds
// the chunk complete once the count exceeds s. j consumes it (copies or
// reduces it into its destination) and, every Slots/2 chunks, writes its
// ack count back. Staging slots and flag words are reused only after the
// credit for them came back, which proves the writes reading them were
// executed; so no write needs its completion awaited: flags,
// acknowledgements and small messages are posted unsignaled (signal), the
// chunks' writes with their handles released at once, and a failure shows
// as a broken channel. A rank that sleeps is woken by a doorbell its
// peers ring when it said it sleeps (bells.go).
//
// A message of at most llMax bytes is one write instead (small.go).
//
// The header of a chunk carries the pair's chunk sequence, the call's
// sequence number on the communicator and its description (kind, op,
// element type, root, count, message length): a rank that receives a
// chunk of another call fails with ErrMismatch naming both.

// Kinds of calls.
const (
	kindBarrier uint8 = iota + 1
	kindBroadcast
	kindReduce
	kindAllreduce
	kindAllgather
	kindAllgatherv
	kindReduceScatter
	kindAlltoall
	kindAlltoallv
	kindGather
	kindScatter
	kindScan
	kindExScan
	kindSplit
	kindGatherv
	kindScatterv
)

var kindNames = [...]string{"?", "barrier", "broadcast", "reduce", "allreduce", "allgather", "allgatherv",
	"reduce-scatter", "alltoall", "alltoallv", "gather", "scatter", "scan", "exscan", "split", "gatherv", "scatterv"}

func kindName(k uint8) string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("kind %d", k)
}

// anyCount in callInfo.count: the count is not compared (v-variants).
const anyCount = ^uint64(0)

// countsFlag marks a callInfo.count that is a hash of a counts vector
// (countsHash), not a count.
const countsFlag = 1 << 63

// countsHash returns the count of the description of a v-variant whose
// ranks all pass the same counts (Allgatherv, ReduceScatterV): a hash of counts (FNV-1a
// over the 8-byte values) with countsFlag set, never anyCount. Ranks
// that disagree on the counts then send messages of other descriptions
// (ErrMismatch), also where every message's length agrees, as when the
// counts of the blocks a message bundles (Bruck's algorithm, recursive
// doubling and halving) add up alike: the receiver would place (or
// reduce) them wrongly. No allocation: a loop over counts.
func countsHash(counts []int) uint64 {
	h := uint64(14695981039346656037)
	for _, n := range counts {
		v := uint64(n)
		for range 8 {
			h ^= v & 0xff
			h *= 1099511628211
			v >>= 8
		}
	}
	h |= countsFlag
	if h == anyCount {
		h--
	}
	return h
}

// callInfo describes a call, as every rank must agree on it.
type callInfo struct {
	kind  uint8
	op    opKind
	dtype uint8
	root  int32
	count uint64
	opID  uint32 // of a Custom op (its name's hash), else 0
}

func (ci callInfo) String() string {
	s := kindName(ci.kind)
	if ci.op != opNone {
		s += " " + opNames[ci.op]
	}
	if ci.opID != 0 {
		s += fmt.Sprintf(" (name hash %08x)", ci.opID)
	}
	if ci.dtype != 0 {
		s += " of " + dtypeName(ci.dtype)
	}
	switch {
	case ci.count == anyCount:
	case ci.count&countsFlag != 0:
		s += fmt.Sprintf(", counts hash %016x", ci.count&^countsFlag)
	default:
		s += fmt.Sprintf(", count %d", ci.count)
	}
	if ci.root >= 0 {
		s += fmt.Sprintf(", root %d", ci.root)
	}
	return s
}

var opNames = [...]string{"", "sum", "prod", "min", "max", "and", "or", "xor", "custom"}

// dtypeOf returns the code of T: its reflect.Kind, or 30 for BFloat16 and
// 31 for Float16.
func dtypeOf[T Number]() uint8 {
	var z T
	switch any(z).(type) {
	case BFloat16:
		return 30
	case Float16:
		return 31
	}
	return uint8(reflect.TypeFor[T]().Kind())
}

func dtypeName(d uint8) string {
	switch d {
	case 30:
		return "bfloat16"
	case 31:
		return "float16"
	}
	return reflect.Kind(d).String()
}

// Header of a chunk (little endian):
//
//	0 seq u64 | 8 call u32 | 12 kind u8 | 13 op u8 | 14 dtype u8 | 15 0 |
//	16 root i32 | 20 len u32 | 24 count u64 | 32 message length u64 |
//	40 Custom op id u32

// flow is one message of a step: to send (buf is the source) or to
// receive (buf is the destination, copied or reduced into).
type flow struct {
	peer    int // rank in the communicator
	buf     []byte
	off     int
	started bool
	reduce  bool   // receive: reduce into buf instead of copying
	srcLow  bool   // receive: the incoming data is the lower ranks' operand
	init    []byte // receive (reduce): buf's operand, combined with the data chunk by chunk (c.comb, or copied into buf and reduced); nil: buf holds it
	after   *flow  // send: only what this receive has filled in (forwarding)

	// A send whose data lies in a Buffer is sent from there (zeroCopy):
	zreg  *registered    // the Buffer's region, nil if the data is staged
	zoff  int            // the offset of buf in it
	zlast channel.Handle // the last write that read it, awaited at the end of the step
	zheld bool           // zlast is held

	// Landing (land.go): a send may write straight into the receiver's
	// Buffer, a receive may find its data in place.
	land      uint8              // send: landWindow, landWait or landOnto
	landOff   int                // send: the offset of buf in the receiver's destination
	landTotal int                // send: the length of the receiver's destination
	landDst   verbs.RemoteRegion // send (landOnto): the receiver's destination
	landed    bool               // receive: the sender writes into buf (announced)
}

func (f *flow) done() bool { return f.started && f.off == len(f.buf) }

// ready returns how many bytes of f (a send) may be sent: up to what its
// after flow has received.
func (f *flow) ready() (int, bool) {
	if f.after == nil {
		return len(f.buf), true
	}
	return f.after.off, f.after.started
}

// begin starts a call: it takes the call's ticket (or the one a
// non-blocking twin took when it was issued, see start), waits for its
// turn, checks the communicator and sets the call's description. The
// call must end with end(t, err).
//
// data are the call's slices: the Buffers they lie in count the call as
// a user from now until it ends (Buffer.Close fails with ErrBufferBusy),
// also while it waits for its turn.
func (c *Comm) begin(ctx context.Context, info callInfo, data ...[]byte) (uint64, error) {
	if err := c.zeroErr(info.kind); err != nil {
		return 0, err
	}
	var hold callHold
	c.bufs.holdCall(&hold, data...)
	var t uint64
	held, _ := ctx.Value(ticketKey{}).(*heldTicket)
	// One lock for the ticket, the turn and the state when it is this
	// call's turn at once (the common case).
	c.mu.Lock()
	if held != nil && !held.used {
		held.used = true
		t = held.t
	} else {
		t = c.ticketLocked()
	}
	fast := c.serving == t
	closed, perr := c.closed, c.err
	c.mu.Unlock()
	if !fast {
		if err := c.await(ctx, t); err != nil {
			hold.release()
			return t, &Error{Call: kindName(info.kind), Rank: c.rank, Peer: -1, Err: fmt.Errorf("%w: %w", verbs.ErrTimeout, err)}
		}
		c.mu.Lock()
		closed, perr = c.closed, c.err
		c.mu.Unlock()
	}
	c.call = info
	c.hold = hold // released by end
	c.held = nil
	if held != nil && held.t == t {
		c.held = held // its request hands the turn on (handOn)
	}
	// The error is made (fail reads c.call) before the turn is handed
	// on: the next call sets c.call once it has the turn.
	switch {
	case closed:
		err := c.fail(ErrClosed, -1)
		c.hold.release()
		c.handOn(t)
		return t, err
	case perr != nil:
		err := c.fail(fmt.Errorf("%w: %w", ErrPoisoned, perr), -1)
		c.hold.release()
		c.handOn(t)
		return t, err
	}
	c.callSeq++
	c.deadline, c.deadlineSet = time.Time{}, false // set by the first wait (callDeadline)
	// The probes of this call's waits tell the peers probed where this
	// rank waits (peerElsewhere).
	atomic.StoreUint64(word(c.tx, c.probeSrc), c.where())
	if err := c.node.Err(); err != nil {
		// The world lost a rank (this rank saw it, or was told): it stays
		// failed, and so does every call of every communicator of it, also
		// one that needs no wait for a peer (a gather's non-root, a
		// communicator of one rank), which would otherwise complete as if
		// the world were whole.
		return t, c.end(t, c.fail(err, -1))
	}
	if err := ctx.Err(); err != nil {
		// The peers are in this call, or will be, and wait for this
		// rank: it fails like a call whose context ended in a wait
		// (poisoning the communicator, telling the peers), not silently
		// out of step with them.
		return t, c.end(t, c.fail(fmt.Errorf("%w: %w", verbs.ErrTimeout, err), -1))
	}
	return t, nil
}

// whereOff is the offset, in a peer's flags at a rank, of the word
// where the peer's probes say which call it waits in (where).
const whereOff = 96

// where is the word a waiting rank's probes write at the peer they wait
// for: the call's sequence number, its kind, and a hash of its whole
// description.
func (c *Comm) where() uint64 {
	ci := c.call
	h := uint32(2166136261)
	for _, v := range [...]uint64{uint64(ci.kind), uint64(ci.op), uint64(ci.dtype), uint64(uint32(ci.root)), ci.count, uint64(ci.opID)} {
		for range 8 {
			h ^= uint32(v & 0xff)
			h *= 16777619
			v >>= 8
		}
	}
	return uint64(c.callSeq)<<32 | uint64(ci.kind)<<24 | uint64(h&0xffffff)
}

// peerElsewhere returns ErrMismatch when a peer's probe says that it
// waits in this rank's call (by sequence number) but that its call is
// another: ranks whose mismatched calls wait for each other without
// exchanging a chunk (each waits to receive from the other) would
// otherwise wait until their contexts end.
func (c *Comm) peerElsewhere() error {
	mine := c.where()
	for p := range c.size {
		if p == c.rank {
			continue
		}
		v := atomic.LoadUint64(word(c.rx, p*peerFlagBytes+whereOff))
		if v>>32 != mine>>32 || v == mine {
			continue
		}
		return c.fail(fmt.Errorf("%w: rank %d waits in its call %d, a %s, which differs from this rank's (%v)",
			ErrMismatch, p, v>>32, kindName(uint8(v>>24)), c.call), p)
	}
	return nil
}

// ticket hands out the next place in the order of calls.
func (c *Comm) ticket() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ticketLocked()
}

// ticketLocked is ticket with mu held.
func (c *Comm) ticketLocked() uint64 {
	t := c.issued
	c.issued++
	return t
}

// end finishes the call of ticket t: a failure poisons the
// communicator (unless it is an argument error of this rank, detected
// before anything was sent: see rootArgs for those only the root finds).
func (c *Comm) end(t uint64, err error) error {
	if err != nil && (!errors.Is(err, ErrArgs) || errors.Is(err, ErrPeerAborted)) {
		err = c.brokenPeer(err)
		c.mu.Lock()
		if c.err == nil {
			c.err = err
		}
		c.mu.Unlock()
		reason := uint64(abortOther)
		if errors.Is(err, ErrMismatch) {
			reason = abortMismatch
		}
		var re *cluster.RankError
		if errors.As(err, &re) {
			// Tell every peer again, before this rank writes anything else
			// (its done flag when it closes): a peer that waits for this
			// rank then finds the failure, not its consequence.
			c.node.Fail(re.Rank, re.Err)
		} else {
			c.abort(reason)
		}
	}
	c.endQuiet()
	c.hold.release()
	c.handOn(t)
	return err
}

// brokenPeer returns the error of a call that failed because the queue
// pair to a peer broke (err wraps channel.ErrBroken) as the failure of
// that peer, reported to the world (peerFailed), when it is not one
// already: whichever write or poll saw the broken queue pair, the peer
// failed, and the other ranks must learn it from this rank (not only
// that it gave up its call). The peer is the one the error names if its
// channel broke, else the first of the communicator whose channel did.
func (c *Comm) brokenPeer(err error) error {
	var re *cluster.RankError
	if !errors.Is(err, channel.ErrBroken) || errors.As(err, &re) {
		return err
	}
	cause, peer := err, -1
	var e *Error
	if errors.As(err, &e) {
		cause, peer = e.Err, e.Peer
	}
	if peer < 0 || peer >= c.size || peer == c.rank || !c.mc.Peer(c.ranks[peer]).Broken() {
		peer = -1
		for p := range c.size {
			if p != c.rank && c.mc.Peer(c.ranks[p]).Broken() {
				peer = p
				break
			}
		}
	}
	if peer < 0 {
		return err
	}
	return c.peerFailed(peer, cause)
}

// Reasons of an abort.
const (
	abortMismatch = 1
	abortOther    = 2
	abortArgs     = 3 // rootArgs
)

// abort tells every peer that this rank gave up its current call (and
// the communicator, now poisoned): it writes the call's sequence number
// and the reason into its abort word at every peer, where a peer waiting
// for this rank, which would otherwise wait forever, finds it (checks).
// Once per communicator; best effort (a peer that failed is skipped).
// The caller holds the turn.
func (c *Comm) abort(reason uint64) {
	if c.aborted || c.size == 1 {
		return
	}
	c.aborted = true
	src := c.probeSrc + 16
	*word(c.tx, src) = uint64(c.callSeq)<<8 | reason
	sge, err := c.tx.SGE(src, 8)
	if err != nil {
		return
	}
	for p := range c.size {
		if p == c.rank || c.remote[p].Len == 0 || c.mc.Peer(c.ranks[p]).Err() != nil {
			continue
		}
		for tries := 0; ; tries++ {
			h, err := c.mc.Peer(c.ranks[p]).PostWriteImm(c.remote[p].At(uint64(c.rank*peerFlagBytes+24)), 0, sge)
			if err == nil {
				h.Release()
			}
			if !errors.Is(err, verbs.ErrQueueFull) || tries == 1000 {
				break
			}
			c.mc.Progress()
			c.spin.Pause()
		}
	}
}

// peerAborted returns the error of the first peer whose abort word is
// set, or nil.
func (c *Comm) peerAborted() error {
	for p := range c.size {
		if p == c.rank {
			continue
		}
		v := atomic.LoadUint64(word(c.rx, p*peerFlagBytes+24))
		if v == 0 {
			continue
		}
		switch v & 0xff {
		case abortMismatch:
			return c.fail(fmt.Errorf("%w: %w: rank %d detected it in its call %d", ErrPeerAborted, ErrMismatch, p, v>>8), p)
		case abortArgs:
			return c.fail(fmt.Errorf("%w: %w: rank %d, the root, found its arguments of its call %d bad", ErrPeerAborted, ErrArgs, p, v>>8), p)
		}
		return c.fail(fmt.Errorf("%w: rank %d gave up its call %d", ErrPeerAborted, p, v>>8), p)
	}
	return nil
}

// fail wraps err as the *Error of the current call.
func (c *Comm) fail(err error, peer int) error {
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	return &Error{Call: kindName(c.call.kind), Rank: c.rank, Peer: peer, Err: err}
}

// rootArgs returns err, the argument error the root of a rooted call
// (Gather, Scatter, Reduce and their v-variants) found in the arguments
// only it uses, after the call took its turn, and gives the call up: the
// other ranks, which cannot see those arguments, are in the call and
// may wait for the root (a scatter's receivers at once, the senders of
// a gather once the windows are full), so the root aborts it (abort):
// they fail at once with ErrPeerAborted wrapping ErrArgs, naming the
// root, and the communicator is poisoned at every rank, as after any
// failure that ranks do not share, not only when a context or
// Options.Timeout ends their waits. The caller ends the call with the
// error.
func (c *Comm) rootArgs(err error) error {
	if err == nil || c.size == 1 || !errors.Is(err, ErrArgs) {
		return err
	}
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	c.mu.Unlock()
	c.abort(abortArgs)
	return err
}

// argErr is an argument error of a call of kind k.
func (c *Comm) argErr(k uint8, format string, args ...any) error {
	if err := c.zeroErr(k); err != nil {
		return err // the arguments were checked against no ranks
	}
	return &Error{Call: kindName(k), Rank: c.rank, Peer: -1, Err: fmt.Errorf("%w: "+format, append([]any{ErrArgs}, args...)...)}
}

// errZeroComm is why a call on a zero Comm (not made by New, Split or
// Dup) fails: it is as good as closed.
var errZeroComm = fmt.Errorf("%w (a zero Comm: make one with New)", ErrClosed)

// zeroErr fails call k on a zero Comm; nil on any other.
func (c *Comm) zeroErr(k uint8) error {
	if c.ranks != nil {
		return nil
	}
	return &Error{Call: kindName(k), Rank: c.rank, Peer: -1, Err: errZeroComm}
}

// word is the 8-byte word at off in m's bytes.
func word(m *verbs.MemoryRegion, off int) *uint64 {
	return (*uint64)(unsafe.Pointer(&m.Bytes()[off]))
}

// run moves the messages of one step: every send and every receive,
// interleaved chunk by chunk, until all are done. At most one send and
// one receive per peer.
func (c *Comm) run(ctx context.Context, sends, recvs []flow) error {
	c.w.reset()
	if c.zeroCopy(sends, recvs) {
		defer c.zeroCopyDone(sends)
	}
	for {
		c.w.rung = c.mc.Rung() // before looking: see sleep
		// Flags and acks a full send queue left owed go out first, also
		// those of finished messages: a peer may wait for the last
		// flag of a send that is done, or for an ack to send again,
		// while this rank waits for the peer.
		if _, err := c.retryOwed(); err != nil {
			return err
		}
		movedS, pendingS, err := c.advance(sends, true)
		if err != nil {
			return err
		}
		movedR, pendingR, err := c.advance(recvs, false)
		if err != nil {
			return err
		}
		moved, pending := movedS || movedR, pendingS || pendingR
		if !pending {
			c.awake()
			if err := c.flushOwed(ctx); err != nil {
				return err
			}
			return c.zeroCopyWait(ctx, sends)
		}
		if moved {
			c.w.reset()
			c.awake()
			continue
		}
		if err := c.idle(ctx, sends, recvs); err != nil {
			return err
		}
	}
}

// advance tries to move each flow of fs that is not done (sends, or
// receives), and reports whether one moved and whether some are not done.
func (c *Comm) advance(fs []flow, send bool) (moved, pending bool, err error) {
	for i := range fs {
		f := &fs[i]
		if f.done() {
			continue
		}
		var ok bool
		if send {
			ok, err = c.trySend(f)
		} else {
			ok, err = c.tryRecv(f)
		}
		if err != nil {
			return moved, pending, c.stepErr(f.peer, err)
		}
		moved = moved || ok
		pending = pending || !f.done()
	}
	return moved, pending, nil
}

// trySend posts the next chunk of f if the peer has a slot free.
func (c *Comm) trySend(f *flow) (bool, error) {
	p := f.peer
	if c.flagOwed[p] {
		return false, nil // still owed after run's retry: the send queue is full
	}
	if c.finished(p) {
		return false, c.peerClosed(p)
	}
	seq := c.sendSeq[p]
	if seq-c.credit(p) >= uint64(c.slots) {
		return false, nil
	}
	limit, ok := f.ready()
	if !ok || limit == f.off && f.started {
		return false, nil
	}
	if f.land == landWait {
		if ok, err := c.landLookup(f); !ok || err != nil {
			return false, err
		}
	}
	n := min(c.chunk, limit-f.off)
	if n < c.chunk && n < len(f.buf)-f.off {
		return false, nil // a whole chunk, unless it is the last
	}
	k := int(seq % uint64(c.slots))
	slot := (p*c.slots + k) * c.slotBytes
	dst := c.remote[p].At(uint64(c.slotBase + (c.rank*c.slots+k)*c.slotBytes))
	if c.small(f) {
		return c.sendSmall(f, seq, slot, dst)
	}
	st := c.tx.Bytes()[slot : slot+hdrBytes+n]
	var src [2]verbs.SGE
	nsge := 1
	var err error
	switch {
	case f.land == landOnto:
		// The data only, into the receiver's Buffer: from the sender's
		// Buffer, or staged (the staging slot is reused, as any, once the
		// chunk's credit came back).
		dst = f.landDst.At(uint64(f.landOff + f.off))
		if f.zreg != nil {
			src[0], err = f.zreg.mr.SGE(f.zoff+f.off, n)
		} else {
			copy(st[hdrBytes:], f.buf[f.off:f.off+n])
			src[0], err = c.tx.SGE(slot+hdrBytes, n)
		}
	case f.zreg != nil:
		// The header from the staging slot, the data in place.
		c.header(st, seq, n, len(f.buf))
		if src[0], err = c.tx.SGE(slot, hdrBytes); err == nil {
			src[1], err = f.zreg.mr.SGE(f.zoff+f.off, n)
		}
		nsge = 2
	default:
		c.header(st, seq, n, len(f.buf))
		copy(st[hdrBytes:], f.buf[f.off:f.off+n])
		src[0], err = c.tx.SGE(slot, hdrBytes+n)
	}
	if err != nil {
		return false, err
	}
	if f.land == landOnto && n == 0 {
		nsge = 0 // an empty message lands nothing: only its count goes
	}
	var h channel.Handle
	if nsge > 0 {
		h, err = c.post(p, dst, false, src[:nsge]...)
	}
	if err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			return false, nil
		}
		return false, err
	}
	if nsge == 0 {
		// Nothing posted.
	} else if f.zreg != nil {
		// Kept: its completion proves that every write before it on
		// the queue pair read the Buffer too (zeroCopyWait).
		if f.zheld {
			f.zlast.Release()
		}
		f.zlast, f.zheld = h, true
		c.zeroCopied++
	} else {
		h.Release()
	}
	c.sendSeq[p] = seq + 1
	f.off += n
	f.started = true
	c.flagOwed[p] = true
	if err := c.postFlag(p); err != nil {
		return true, err
	}
	return true, nil
}

// post posts an RDMA write to p and returns its handle; a full send queue
// or a channel without free handles gets a second try (postTwice).
func (c *Comm) post(p int, dst verbs.RemoteAddr, bell bool, src ...verbs.SGE) (channel.Handle, error) {
	ch := c.mc.Peer(c.ranks[p])
	var h channel.Handle
	err := c.postTwice(func() (err error) {
		h, err = postWrite(ch, dst, bell, src)
		return err
	})
	return h, err
}

// postTwice runs postOnce, and once more after a drive of the progress
// if the send queue or the channel's handles were full (completions free
// them: writes are posted detached or unsignaled, and only polling
// retires them). It counts the write posted.
func (c *Comm) postTwice(postOnce func() error) error {
	err := postOnce()
	if err != nil && errors.Is(err, verbs.ErrQueueFull) {
		if perr := c.mc.Progress(); perr != nil {
			return perr
		}
		err = postOnce()
	}
	if err == nil {
		c.writes++
	}
	return err
}

// signal posts an RDMA write to p without a completion: the credits and
// acknowledgements of the transport tell when its source may change (see
// Transport). Where waits spin before they sleep it rings no doorbell
// (bells.go: a peer that sleeps is rung when it says so), elsewhere it
// carries immediate data (the peer's doorbell, which wakes it if it
// sleeps for this write: see Comm.sleep). A full send queue gets a second
// try (postTwice).
//
// Small messages went signaled where the ranks outnumber the processors
// until doorbells became on demand: measured then with 4 ranks on one
// CPU, unsignaled ones made the median of the per-iteration maximum of a
// barrier settle at 29-34 µs where signaled ones gave a mix of 20, 30
// and 42 µs. With doorbells on demand, rounds alternating the two
// (goverbs coll -transport shm -ops barrier,allreduce -max 8), medians:
// the loop's mean time per barrier was 18.3 µs unsignaled against 21.0
// signaled with 4 ranks on one CPU (taskset -c 0, six rounds), 41.9
// against 50.7 µs with 8 ranks on 2 CPUs (five rounds), where the median
// of the maximum went 61.2 → 57.7 µs: unsignaled everywhere.
func (c *Comm) signal(p int, dst verbs.RemoteAddr, src verbs.SGE) error {
	ch := c.mc.Peer(c.ranks[p])
	if c.onDemand {
		c.book.Wrote(p)
		return c.postTwice(func() error { return ch.PostWriteUnsignaled(dst, src) })
	}
	return c.postTwice(func() error { return ch.PostWriteImmUnsignaled(dst, 0, src) })
}

// postWrite posts an RDMA write, with immediate data if bell is set: the
// peer's doorbell (channel.Options.Doorbells), which wakes it if it
// sleeps for this write (see Comm.sleep).
func postWrite(ch *channel.Channel, dst verbs.RemoteAddr, bell bool, src []verbs.SGE) (channel.Handle, error) {
	if bell {
		return ch.PostWriteImm(dst, 0, src...)
	}
	return ch.PostWrite(dst, src...)
}

// zeroCopy marks the sends of a step whose data lies in a Buffer, to be
// sent from there, and reports whether it marked any. A send qualifies
// if it is at least zeroCopyMin bytes long and no receive of the step
// writes the memory it reads, but the one it forwards (its after flow,
// which writes only ahead of what the send reads): a write reading the
// Buffer may run until the end of the step (zeroCopyWait), and the
// algorithms change the memory a step sent only in later steps.
func (c *Comm) zeroCopy(sends, recvs []flow) bool {
	marked := false
	for i := range sends {
		f := &sends[i]
		f.zreg, f.zheld = nil, false
		if len(f.buf) < zeroCopyMin {
			continue
		}
		clash := false
		for j := range recvs {
			r := &recvs[j]
			if r != f.after && overlap(f.buf, r.buf) {
				clash = true
				break
			}
		}
		if !clash {
			if f.zreg, f.zoff = c.bufs.use(f.buf); f.zreg != nil {
				marked = true
			}
		}
	}
	return marked
}

// zeroCopyWait waits, at the end of a step, until the writes that read
// Buffers have been executed: the caller, or the next step, may change
// that memory. The last write of each such send tells, as the queue
// pair executes writes in order. The wait polls: the write is executed
// as soon as the peer's side takes it (soft0 copies the data of a large
// write when the peer has acknowledged the request).
func (c *Comm) zeroCopyWait(ctx context.Context, sends []flow) error {
	for i := range sends {
		f := &sends[i]
		if !f.zheld {
			continue
		}
		for n := 0; !f.zlast.Done(); n++ {
			if err := c.mc.Progress(); err != nil {
				return c.stepErr(f.peer, err)
			}
			if n%waitCheck == waitCheck-1 {
				if err := c.expired(ctx, time.Now()); err != nil {
					return c.fail(err, f.peer)
				}
			}
			c.spin.Pause()
		}
		err := f.zlast.Err()
		f.zlast.Release()
		f.zheld = false
		if err != nil {
			return c.stepErr(f.peer, err)
		}
	}
	return nil
}

// zeroCopyDone ends a step's use of Buffers.
func (c *Comm) zeroCopyDone(sends []flow) {
	for i := range sends {
		f := &sends[i]
		if f.zheld {
			f.zlast.Release()
			f.zheld = false
		}
		if f.zreg != nil {
			f.zreg.users.Add(-1)
			f.zreg = nil
		}
	}
}

// postFlag posts the write of this rank's data count at p, if it is
// owed (left owed when the send queue is full).
func (c *Comm) postFlag(p int) error {
	seq := c.sendSeq[p] // the count to publish
	off := c.flagBase + (p*c.slots+int((seq-1)%uint64(c.slots)))*8
	*word(c.tx, off) = seq
	src, err := c.tx.SGE(off, 8)
	if err != nil {
		return err
	}
	if err := c.signal(p, c.remote[p].At(uint64(c.rank*peerFlagBytes)), src); err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			c.anyOwed = true
			return nil
		}
		return err
	}
	c.flagOwed[p] = false
	c.countWrites++
	return nil
}

// header writes the header of chunk seq (n bytes of a message of total
// bytes) into b.
func (c *Comm) header(b []byte, seq uint64, n, total int) {
	binary.LittleEndian.PutUint64(b[0:], seq)
	binary.LittleEndian.PutUint32(b[8:], c.callSeq)
	b[12], b[13], b[14], b[15] = c.call.kind, byte(c.call.op), c.call.dtype, 0
	binary.LittleEndian.PutUint32(b[16:], uint32(c.call.root))
	binary.LittleEndian.PutUint32(b[20:], uint32(n))
	binary.LittleEndian.PutUint64(b[24:], c.call.count)
	binary.LittleEndian.PutUint64(b[32:], uint64(total))
	binary.LittleEndian.PutUint32(b[40:], c.call.opID)
}

// tryRecv consumes the next chunk of f if it has arrived.
func (c *Comm) tryRecv(f *flow) (bool, error) {
	p := f.peer
	seq := c.recvSeq[p]
	n := min(c.chunk, len(f.buf)-f.off)
	if f.landed {
		if atomic.LoadUint64(word(c.rx, p*peerFlagBytes)) <= seq {
			return false, nil
		}
		c.landedChunks++ // the sender wrote it in place
	} else {
		slot := c.rxSlot(p, seq)
		// A small message (small.go), expected or not: one that is not
		// expected is a mismatch.
		small, err := c.recvSmall(slot, p, seq, len(f.buf)-f.off)
		if err != nil {
			return false, err
		}
		counted := !small && atomic.LoadUint64(word(c.rx, p*peerFlagBytes)) > seq
		if counted {
			// The data count of a later chunk may have come since the
			// look, with this small message before it (queue pairs
			// place writes in order): look again.
			if small, err = c.recvSmall(slot, p, seq, len(f.buf)-f.off); err != nil {
				return false, err
			}
		}
		var data []byte
		switch {
		case small:
			data = c.llData[:n]
		case !counted:
			return false, nil
		default:
			if err := c.check(slot, p, seq, n, len(f.buf)); err != nil {
				return false, err
			}
			data = slot[hdrBytes : hdrBytes+n]
		}
		switch {
		case f.init != nil && c.comb != nil:
			c.comb(f.buf[f.off:f.off+n], f.init[f.off:f.off+n], data, f.srcLow)
		case f.init != nil:
			copy(f.buf[f.off:f.off+n], f.init[f.off:f.off+n])
			c.red(f.buf[f.off:f.off+n], data, f.srcLow)
		case f.reduce:
			c.red(f.buf[f.off:f.off+n], data, f.srcLow)
		default:
			copy(f.buf[f.off:f.off+n], data)
		}
		if !small {
			// What the chunk wrote where small messages' words go
			// (small.go: only the sender's next use of the slot may
			// flag words).
			clear(slot[:min(hdrBytes+n, llRegion)])
		}
	}
	c.recvSeq[p] = seq + 1
	f.off += n
	f.started = true
	if c.recvSeq[p]-c.ackSent[p] >= uint64(c.ackEvery) {
		c.ackOwed[p] = true
		if err := c.postAck(p); err != nil {
			return true, err
		}
	}
	return true, nil
}

// check validates the header of chunk seq from p against what this rank
// expects.
func (c *Comm) check(h []byte, p int, seq uint64, n, total int) error {
	if s := binary.LittleEndian.Uint64(h); s != seq {
		return fmt.Errorf("rank %d's chunk %d arrived where chunk %d was expected (corrupted window)", p, s, seq)
	}
	call, peer := chunkCall(h)
	if err := c.checkCall(p, call, peer, binary.LittleEndian.Uint64(h[32:]), total); err != nil {
		return err
	}
	if l := int(binary.LittleEndian.Uint32(h[20:])); l != n {
		return fmt.Errorf("rank %d's chunk has %d bytes, want %d (corrupted window)", p, l, n)
	}
	return nil
}

// chunkCall returns the call's sequence number and description in the
// header h of a chunk.
func chunkCall(h []byte) (uint32, callInfo) {
	return binary.LittleEndian.Uint32(h[8:]), callInfo{kind: h[12], op: opKind(h[13]), dtype: h[14],
		root: int32(binary.LittleEndian.Uint32(h[16:])), count: binary.LittleEndian.Uint64(h[24:]), opID: binary.LittleEndian.Uint32(h[40:])}
}

// checkCall checks what a chunk's header or a small message says of the
// call p is in (its sequence number call, its description peer, the
// message's length total) against this rank's call and the length it
// expects.
func (c *Comm) checkCall(p int, call uint32, peer callInfo, total uint64, expect int) error {
	if call != c.callSeq {
		return fmt.Errorf("%w: rank %d is in its call %d (%v), this rank in its call %d (%v)", ErrMismatch, p, call, peer, c.callSeq, c.call)
	}
	if peer != c.call {
		return fmt.Errorf("%w: rank %d called %v, this rank %v", ErrMismatch, p, peer, c.call)
	}
	if total != uint64(expect) {
		return fmt.Errorf("%w: rank %d sends %d bytes, this rank expects %d", ErrMismatch, p, total, expect)
	}
	return nil
}

// postAck posts the write of this rank's ack count at p, if owed.
func (c *Comm) postAck(p int) error {
	off := c.ackBase + p*8
	v := c.recvSeq[p]
	*word(c.tx, off) = v
	src, err := c.tx.SGE(off, 8)
	if err != nil {
		return err
	}
	if err := c.signal(p, c.remote[p].At(uint64(c.rank*peerFlagBytes+8)), src); err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			c.anyOwed = true
			return nil
		}
		return err
	}
	c.ackSent[p] = v
	c.ackWritten[p] = v
	c.ackOwed[p] = false
	c.ackWrites++
	return nil
}

// retryOwed posts the counters (data and ack) left owed by a full send
// queue, and reports whether some are still owed. A peer may be waiting
// for them (its data, or its credit) before it sends what this rank waits
// for: waits retry them as they poll.
func (c *Comm) retryOwed() (bool, error) {
	if !c.anyOwed {
		return false, nil
	}
	owed := false
	for p := range c.size {
		if c.flagOwed[p] {
			if err := c.postFlag(p); err != nil {
				return true, c.stepErr(p, err)
			}
		}
		if c.ackOwed[p] {
			if err := c.postAck(p); err != nil {
				return true, c.stepErr(p, err)
			}
		}
		owed = owed || c.flagOwed[p] || c.ackOwed[p]
	}
	c.anyOwed = owed
	return owed, nil
}

// flushOwed posts the counters still owed at the end of a step.
func (c *Comm) flushOwed(ctx context.Context) error {
	for {
		c.w.rung = c.mc.Rung()
		owed, err := c.retryOwed()
		if err != nil || !owed {
			return err
		}
		if err := c.idle(ctx, nil, nil); err != nil {
			return err
		}
	}
}

// Waiting. A rank with nothing to move spins for a while (polling, which
// drives the transport's progress: soft0 places a peer's writes when the
// process polls; yielding to the process' goroutines in between), then
// sleeps on the completion channel of the node's channel
// (channel.MultiChannel.Sleep). It spins for up to 1 ms when the machine
// has a processor for every rank of the world on it
// (cluster.Node.LocalRanks), and not at all when the ranks outnumber the
// processors: a spinner then keeps the processor its peer needs
// (internal/spinwait). Every counter a peer writes here (data count,
// ack count, done flag, abort word) is written with immediate data, which
// consumes one of the doorbell receives of the node's queue pairs
// (cluster.NodeOptions) and makes a completion: a sleep ends when one has
// been dispatched since the round began. An alarm (every 10 ms, spaced
// by the ranks per processor when they outnumber the processors, up to
// 1 s: spinwait.Policy.Every, as cluster's barrier; or the deadline) ends a
// sleep too: it posts a probe to the peer waited for,
// whose completion wakes the rank for its checks. Every waitCheck
// spinning rounds, when a sleeping round moved nothing, after an alarm
// and once the context ended, the wait checks the context, the deadline,
// the communicator, the world (cluster.Node.Err: a failure another rank
// saw) and the queue pairs of the peers it waits for; after probeAfter
// it probes the first of them with a small write at the same interval, so
// that a peer that died or stopped fails the write after the queue
// pair's transport timeout.
const (
	spinCheck  = 16 // spinning rounds between looks at the clock
	waitCheck  = 64 // spinning rounds between checks
	probeAfter = 2 * time.Millisecond
)

type waiter struct {
	i         int
	start     time.Time     // of a wait that needed checks
	budget    time.Duration // of the wait in progress: how long it may spin
	spinUntil time.Time
	slept     bool // the wait in progress slept
	announced bool // and its sleep was announced to the peers (bells.go)
	probe     channel.Handle
	probing   bool
	probePeer int
	nextProbe time.Time
	rung      uint64 // the doorbells rung when the round began (sleep)
	alarms    uint64 // alarms gone off when the sleep began
	sleepPeer int    // the peer a sleep waits for
}

// spinning reports whether a spinning wait may go on at now: its budget
// runs from its first look at the clock (spinCheck rounds in), so that a
// wait that ends sooner reads no clock.
func (w *waiter) spinning(now time.Time) bool {
	if w.spinUntil.IsZero() {
		w.spinUntil = now.Add(w.budget)
	}
	return now.Before(w.spinUntil)
}

// reset ends a wait (something moved, or a step begins).
func (w *waiter) reset() {
	w.i = 0
	w.start = time.Time{}
	w.slept = false
	w.announced = false
}

// idle waits a little for the flows (nil: for owed writes) to move.
func (c *Comm) idle(ctx context.Context, sends, recvs []flow) error {
	w := &c.w
	w.i++
	if _, err := c.retryOwed(); err != nil {
		return err
	}
	if w.i == 1 {
		w.budget = c.spin.Spin
		w.spinUntil = time.Time{} // set at the first look at the clock
	}
	if w.budget > 0 && !w.slept && (w.i%spinCheck != 0 || w.spinning(time.Now())) {
		// Spinning: drive the progress (soft0 places a peer's writes as
		// the process polls) and let the process' goroutines (and, with
		// ranks that outnumber the processors, the peers) run.
		// The pause comes before the drive, so that the run looks at what
		// the drive placed before it pauses again: with doorbells on
		// demand (bells.go) nothing tells that a peer's write arrived,
		// and with ranks that outnumber the processors a pause is a
		// context switch or several.
		if w.i > 1 {
			c.spin.PauseAt(w.i)
		}
		if err := c.mc.Progress(); err != nil {
			return c.fail(err, -1)
		}
		if w.i%waitCheck == 0 {
			if err := c.writeRodeAcks(); err != nil {
				return err
			}
			if err := c.checks(ctx, sends, recvs); err != nil {
				return err
			}
		}
		return c.ringSleepers()
	}
	if w.i > 1 || c.alarm.Fired() != w.alarms || ctx.Err() != nil {
		// Woken without moving: news (an abort word, a done flag), the
		// alarm, the context.
		if err := c.checks(ctx, sends, recvs); err != nil {
			return err
		}
	}
	if c.anyOwed {
		// Waiting for send-queue room: the completions of this rank's
		// writes free it, and they ring no doorbell.
		if err := c.mc.Progress(); err != nil {
			return c.fail(err, -1)
		}
		c.spin.Pause()
		return nil
	}
	if err := c.writeRodeAcks(); err != nil {
		return err
	}
	if c.anyOwed {
		return nil // the next round retries it
	}
	w.slept = true
	return c.sleep(ctx, sends, recvs)
}

// sleep waits on the completion channel until a doorbell rang since the
// round began (w.rung: whatever arrived before was seen by the round),
// the alarm went off, or ctx ended (which the next round's checks
// report).
func (c *Comm) sleep(ctx context.Context, sends, recvs []flow) error {
	w := &c.w
	w.sleepPeer = c.waitedFor(sends, recvs)
	if w.sleepPeer < 0 {
		w.sleepPeer = (c.rank + 1) % c.size // waiting for send-queue room: any completion will do
	}
	ok, err := c.announceSleep(sends, recvs)
	if err != nil {
		return err
	}
	if err := c.ringSleepers(); err != nil {
		return err
	}
	if !ok && len(c.ann) == 0 {
		c.spin.Pause() // the send queue is full: its completions free it
		return nil
	}
	w.alarms = c.alarm.Fired()
	d := c.spin.Every
	now := time.Now()
	if dl := c.callDeadline(now); !dl.IsZero() {
		d = max(min(d, dl.Sub(now)), time.Microsecond)
	}
	c.alarm.Arm(d, w.sleepPeer)
	if len(c.ann) == 0 {
		c.sleeps.Add(1)
	}
	err = c.mc.Sleep(ctx, c.wokenFn)
	c.alarm.Disarm()
	if err != nil && ctx.Err() == nil {
		return c.fail(err, -1) // the node's channel closed
	}
	if len(c.ann) > 0 {
		c.slept()
	}
	return nil
}

// woken is the condition of sleep: a doorbell, the alarm, or the peer
// waited for broke (its queue pair's error flushes the doorbell receives,
// whose completions wake the sleeper: the alarm's probe may not be
// postable any more).
func (c *Comm) woken() bool {
	w := &c.w
	return c.mc.Rung() != w.rung || c.alarm.Fired() != w.alarms || c.mc.Peer(c.ranks[w.sleepPeer]).Broken() || c.annDone()
}

// ring is the alarm of sleep (on a timer's goroutine, while the sleep
// lasts): a probe write to the peer waited for, whose completion wakes
// the sleeper for its checks.
func (c *Comm) ring(p int) {
	if h, err := c.postProbe(p); err == nil {
		h.Release()
	}
}

// postProbe posts the write of the probe at p: the word that says
// which call this rank waits in (where, set by begin), into its flags
// at p (peerElsewhere).
func (c *Comm) postProbe(p int) (channel.Handle, error) {
	src, err := c.tx.SGE(c.probeSrc, 8)
	if err != nil {
		return channel.Handle{}, err
	}
	return c.mc.Peer(c.ranks[p]).PostWrite(c.remote[p].At(uint64(c.rank*peerFlagBytes+whereOff)), src)
}

// expired returns why a wait must end for time, the end of ctx or of
// Options.Timeout (now is past the call's deadline), or nil.
func (c *Comm) expired(ctx context.Context, now time.Time) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", verbs.ErrTimeout, err)
	}
	if d := c.callDeadline(now); !d.IsZero() && now.After(d) {
		return fmt.Errorf("%w: Options.Timeout (%v) passed", verbs.ErrTimeout, c.opts.Timeout)
	}
	return nil
}

// callDeadline returns the end of the call's Options.Timeout (zero: none),
// counted from the first wait of the call that looks at the clock (now):
// a call that never waits reads no clock for it (a 2-rank barrier took
// 7 % of its time in time.Now).
func (c *Comm) callDeadline(now time.Time) time.Time {
	if !c.deadlineSet {
		c.deadlineSet = true
		if c.opts.Timeout > 0 {
			c.deadline = now.Add(c.opts.Timeout)
		}
	}
	return c.deadline
}

// checks looks for the reasons to give up a wait.
func (c *Comm) checks(ctx context.Context, sends, recvs []flow) error {
	w := &c.w
	now := time.Now()
	if err := c.expired(ctx, now); err != nil {
		return c.fail(err, c.waitedFor(sends, recvs))
	}
	if w.start.IsZero() {
		w.start = now
	}
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return c.fail(ErrClosed, -1)
	}
	if err := c.node.Err(); err != nil {
		return c.fail(err, -1)
	}
	if err := c.peerAborted(); err != nil {
		return err
	}
	if err := c.peerElsewhere(); err != nil {
		return err
	}
	for k, fs := range [2][]flow{sends, recvs} {
		for i := range fs {
			if fs[i].done() {
				continue
			}
			p := fs[i].peer
			if err := c.mc.Peer(c.ranks[p]).Err(); err != nil {
				return c.peerFailed(p, err)
			}
			// A peer that closed sends nothing more; what it sent before
			// its done flag is here (queue pairs place writes in order): a
			// receive fails only when none of it is left to consume.
			if c.finished(p) && (k == 0 || atomic.LoadUint64(word(c.rx, p*peerFlagBytes)) <= c.recvSeq[p] && !c.llArrived(p, c.recvSeq[p])) {
				return c.peerClosed(p)
			}
		}
	}
	if now.Sub(w.start) >= probeAfter {
		if p := c.waitedFor(sends, recvs); p >= 0 {
			if err := c.probe(p, now); err != nil {
				return c.peerFailed(p, err)
			}
		}
	}
	return nil
}

// stepErr is the error of a step whose message to or from peer p failed
// with err: when the channel to p broke (posting to it failed), p failed,
// and the world learns it.
func (c *Comm) stepErr(p int, err error) error {
	if cerr := c.mc.Peer(c.ranks[p]).Err(); cerr != nil {
		return c.peerFailed(p, err)
	}
	return c.fail(err, p)
}

// peerClosed is the error of a call that needs peer p after p closed the
// communicator. The news p wrote before its done flag (a rank failure in
// the poison word, its abort word) arrived before it and is what made p
// give up: report that instead.
func (c *Comm) peerClosed(p int) error {
	if err := c.node.Err(); err != nil {
		return c.fail(err, -1)
	}
	if err := c.peerAborted(); err != nil {
		return err
	}
	return c.fail(fmt.Errorf("%w: rank %d closed it", ErrClosed, p), p)
}

// peerFailed reports that peer p failed to the world (cluster.Node.Fail)
// and returns the call's error, wrapping the world's *cluster.RankError.
func (c *Comm) peerFailed(p int, err error) error {
	re := c.node.Fail(c.ranks[p], err)
	var rank *cluster.RankError
	if !errors.As(re, &rank) {
		re = errors.Join(err, re)
	}
	return c.fail(re, p)
}

// waitedFor returns the first peer a pending flow waits for, or -1.
func (c *Comm) waitedFor(sends, recvs []flow) int {
	for _, fs := range [2][]flow{recvs, sends} {
		for i := range fs {
			if !fs[i].done() {
				return fs[i].peer
			}
		}
	}
	return -1
}

// probe keeps one small write in flight to p while a wait lasts, a new
// one every c.spin.Every: a peer that died or stopped fails it.
func (c *Comm) probe(p int, now time.Time) error {
	w := &c.w
	if w.probing {
		done, err := w.probe.Poll()
		if err == nil && done {
			err = w.probe.Err()
		}
		if err != nil {
			w.probe.Release()
			w.probing = false
			return err
		}
		if !done {
			return nil
		}
		w.probe.Release()
		w.probing = false
	}
	if now.Before(w.nextProbe) && w.probePeer == p {
		return nil
	}
	w.nextProbe = now.Add(c.spin.Every)
	w.probePeer = p
	h, err := c.postProbe(p)
	if err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			return nil
		}
		return err
	}
	w.probe, w.probing = h, true
	return nil
}
