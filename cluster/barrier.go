package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/goverbs/verbs/internal/spinwait"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/bells"
)

// BarrierAlgorithm selects how a barrier synchronises its group. Every
// rank of a world must ask for the same algorithm (the endpoint exchange
// checks it). The zero value is Auto, which picks one of the others when
// the world is up, alike on every rank (see Auto).
//
// All three are built from one-sided RDMA writes of epoch counters into
// flags that the receiving rank polls: no send, no receive, no atomic.
// With p ranks and a one-way write latency L:
//
//   - BinaryTree: arrivals climb a binary tree to rank 0 of the group and
//     releases come back down: about 2 × ⌈log2(p+1)⌉ × L, and at most 3
//     writes sent by each rank.
//   - Dissemination: ⌈log2 p⌉ rounds; in round k, position i signals
//     position i+2^k (mod p) and waits for i−2^k: about ⌈log2 p⌉ × L, with
//     ⌈log2 p⌉ writes sent by each rank.
//   - Centralized: every rank signals the group's first rank, which waits
//     for all of them and then signals each back: 2 × L plus the root's
//     p−1 serial writes.
type BarrierAlgorithm int

const (
	// Auto picks the algorithm from the world, once the endpoint exchange
	// has told every rank where every rank runs (each rank's host and
	// processor count are in its flag description, so every rank picks
	// the same): Dissemination when no machine runs more ranks than it
	// has processors (its ⌈log2 p⌉ rounds are the shortest when every
	// rank runs at once); Centralized when some machine runs more ranks
	// than processors, up to autoCentralMax ranks (each rank waits for
	// one signal and sends one, so ranks that share a processor take the
	// fewest turns); BinaryTree beyond that (the root talks to 2 peers,
	// not to all). Node.BarrierAlgorithm says which. Measured on a 2-CPU
	// machine, soft0 shared memory, one process per rank
	// (BenchmarkBarrierXproc): with 2 ranks dissemination 1.9 µs against
	// 2.7 for the binary tree; with 16 to 64 ranks the centralized
	// barrier 2.5–2.7 × faster than the binary tree and 2.9–4.6 × faster
	// than dissemination; at 128 and 256 ranks centralized and binary
	// tree within 20 % of each other, while the centralized root holds a
	// connection to every rank (scripts/scale.sh, 128 ranks: 89 MiB
	// resident at the root against 16).
	Auto BarrierAlgorithm = iota
	// BinaryTree gathers arrivals up a binary tree and broadcasts the
	// release down it.
	BinaryTree
	// Dissemination runs ⌈log2 p⌉ rounds of pairwise signals.
	Dissemination
	// Centralized gathers at the group's first rank, which releases all.
	Centralized
)

func (a BarrierAlgorithm) String() string {
	switch a {
	case Auto:
		return "auto"
	case BinaryTree:
		return "binary tree"
	case Dissemination:
		return "dissemination"
	case Centralized:
		return "centralized"
	}
	return fmt.Sprintf("BarrierAlgorithm(%d)", int(a))
}

func (a BarrierAlgorithm) valid() bool { return a >= Auto && a <= Centralized }

// autoCentralMax is the largest world in which Auto picks the centralized
// barrier where ranks outnumber processors (see Auto).
const autoCentralMax = 64

// autoAlgorithm is what Auto stands for in a world of n ranks, where
// oversubscribed says whether some machine runs more of them than it has
// processors.
func autoAlgorithm(n int, oversubscribed bool) BarrierAlgorithm {
	switch {
	case !oversubscribed:
		return Dissemination
	case n <= autoCentralMax:
		return Centralized
	}
	return BinaryTree
}

// oversubscribed reports whether some rank's machine runs more ranks than
// that rank has processors: hosts[j] and cpus[j] are rank j's.
func oversubscribed(hosts []uint64, cpus []int) bool {
	count := make(map[uint64]int, 1)
	for _, h := range hosts {
		count[h]++
	}
	for j, h := range hosts {
		if count[h] > cpus[j] {
			return true
		}
	}
	return false
}

// Barrier errors. A failed barrier returns a *BarrierError wrapping one of
// them (or the transport's or the context's error); test with errors.Is.
var (
	// ErrNotInGroup: the calling rank is not a member of the group it
	// asked to synchronise.
	ErrNotInGroup = errors.New("cluster: barrier: this rank is not in the group")
	// ErrBadGroup: the group is not a list of distinct ranks of the world in
	// ascending order (the error says which entry is wrong and why).
	ErrBadGroup = errors.New("cluster: barrier: bad group")
	// ErrPoisoned: an earlier barrier failed (timed out, or the transport
	// broke), so the flags of this rank and its peers no longer agree.
	// Every barrier fails with it until every rank calls Reset; after a
	// rank failed (the error wraps a *RankError), for good.
	ErrPoisoned = errors.New("cluster: barrier: poisoned by an earlier failure (every rank must reset the barrier)")
	// ErrBarrierMismatch: a peer signalled this rank for another barrier
	// (another group, or another epoch of the group) than the one this
	// rank waits in: the ranks call barriers in different orders.
	ErrBarrierMismatch = errors.New("cluster: barrier: a peer is in another barrier (the ranks call barriers in different orders)")
)

// RankError names a rank of the world that failed: its process died,
// its queue pair to this rank broke, or it stopped answering for longer
// than the queue pairs' transport timeout (verbs.QPSpec.Timeout and
// RetryCount, through NodeOptions.Channel.QP: the liveness bound). Err
// wraps ErrPeerLost, and the transport's error where this rank saw the
// failure itself. A barrier that fails because a rank failed wraps a
// *RankError (in its *BarrierError): find it with errors.As.
type RankError struct {
	Rank int
	Err  error
}

func (e *RankError) Error() string { return fmt.Sprintf("cluster: rank %d failed: %v", e.Rank, e.Err) }

func (e *RankError) Unwrap() error { return e.Err }

// BarrierError is the error of a failed barrier: which barrier (algorithm,
// rank, group, epoch), which peer it was exchanging with (-1 if none), and
// the cause. The cause is ErrNotInGroup, ErrBadGroup, ErrPoisoned or
// ErrBarrierMismatch (wrapped with details); a timeout (wrapping both
// verbs.ErrTimeout and the context's error); or a *RankError naming a
// rank that failed (wrapping ErrPeerLost and, at the rank that saw it, a
// *channel.OpError, usually wrapping channel.ErrBroken and the
// completion error).
type BarrierError struct {
	Algorithm BarrierAlgorithm
	Rank      int    // this rank
	Group     []int  // the group, nil for the whole world
	Epoch     uint64 // how many barriers of this group this rank entered before (since the last reset)
	Peer      int    // the peer involved, or -1
	Err       error
}

func (e *BarrierError) Error() string {
	group := "world"
	if e.Group != nil {
		group = fmt.Sprintf("group %v", e.Group)
	}
	peer := ""
	if e.Peer >= 0 {
		peer = fmt.Sprintf(", peer %d", e.Peer)
	}
	return fmt.Sprintf("cluster: barrier (%s, rank %d, %s, epoch %d%s): %v", e.Algorithm, e.Rank, group, e.Epoch, peer, e.Err)
}

func (e *BarrierError) Unwrap() error { return e.Err }

// Flag memory. Every rank registers 2 words of 8 bytes per rank of the
// world, then the poison word and the probe word; peer j writes only
// words 2j and 2j+1 of the first part. A rank writes to a
// given peer at most once per barrier, and cannot get two writes ahead of
// the peer on that pair (it cannot leave the barrier after the next one
// before the peer has entered it, which the peer does only after reading
// the first write): so each pair alternates between its two words, by the
// parity of the pair's write count (seq). A word holds
//
//	bits 63..48 generation (bumped by reset; 0 is never used)
//	bits 47..32 seq (low 16 bits of the pair's write count since reset)
//	bits 31..16 tag of the group (a hash of its members)
//	bits 15..0  epoch of the group (low 16 bits)
//
// The reader waits until the word holds exactly the value it expects.
// Generation and seq make a stale word (of an older barrier, or of a
// barrier abandoned before a reset) never match; tag and epoch, checked
// once generation and seq match, turn a mismatched call order into
// ErrBarrierMismatch instead of a silent wrong release. Writes are 8-byte
// aligned 8-byte RDMA writes, which neither hardware nor soft0 tears.
//
// The poison word (word 2N) is written by any rank that saw a rank fail,
// to every rank it can still reach:
//
//	bits 63..56 poisonMark
//	bits 55..32 the rank that saw the failure (low 24 bits)
//	bits 31..0  the rank that failed
//
// Every wait checks it as it polls, and so does every later barrier: a
// failure reaches the whole world one write after a rank saw it (zero
// means none; any rank's value will do when several raced). It is never
// cleared: a world that lost a rank stays failed (reset does not help).
//
// The probe word (word 2N+1) is the target of the writes by which a rank
// that has waited for a peer for a while checks that the peer is alive:
// a peer that died or stopped fails the write (at once, or after the
// queue pair's transport timeout), which breaks the channel.
//
// The mailboxes of Share follow the words: one box of boxBytes per rank
// of the world, box j written only by rank j (see share.go).
const (
	wordsPerPeer = 2
	flagBytes    = 8
	extraWords   = 2 // the poison word, the probe word
	poisonMark   = 0xd1
)

// flagWords is the number of words of the flag region of a world of n
// (before the mailboxes): the signals' words, the poison and probe words,
// and a sleep word per rank (bells.go).
func flagWords(n int) int { return n*wordsPerPeer + extraWords + n }

// regionBytes is the length of the flag region of a world of n: the
// words, then n mailboxes.
func regionBytes(n int) int { return flagWords(n)*flagBytes + n*boxBytes }

// barrierInfo is what a rank hands its peers about its flags (localInfo):
//
//	magic "GVBR" | version u16 | algorithm u16 | rank u32 | world size u32 |
//	flag address u64 | flag length u64 | rkey u32 | host u64 | processors u32
//
// little endian, 48 bytes. The algorithm is the one asked for (Auto
// too). Version 4 has the host (hostID), which counts the ranks sharing a
// machine (Node.LocalRanks). Version 2 has the poison and probe words;
// version 3 the mailboxes of Share after them; version 5 a sleep word per
// rank between the probe word and the mailboxes (bells.go); version 6 the
// rank's processor count (runtime.NumCPU), from which Auto picks.
const (
	barrierMagic    = "GVBR"
	barrierVersion  = 6
	barrierInfoSize = 48
)

// Waiting. A wait spins for a while, polling (which drives the
// transport's progress: soft0 places a peer's write when a process polls,
// see internal/soft) with a pause in between, then sleeps on the
// completion channel of the node's channel (channel.MultiChannel.Sleep).
// It spins for up to 1 ms, pausing for the process' goroutines when the
// machine has a processor for every rank of the world on it
// (Node.LocalRanks), and for every thread of the machine (sched_yield)
// when the ranks outnumber the processors up to 4 to 1, so that the peer
// it waits for runs; beyond that it sleeps at once (internal/spinwait).
// A sleeping rank is woken by a doorbell, a write with immediate data
// (channel.Options.Doorbells), whose completion wakes it, instead of
// timers (milliseconds per barrier): every signal carries one where waits
// sleep at once, and where they spin first a rank rings only a peer that
// said it sleeps (bells.go). A
// wait woken without its signal (an alarm every spinwait.Policy.Every, the poison
// word, the context) checks the context, the poison word and the peer's
// channel; after probeAfter it probes the peer it waits for.
const (
	// pollCheck is how many spinning polls pass between checks.
	pollCheck = 64
	// probeAfter is how long a wait lasts before it probes the peer it
	// waits for (probe).
	probeAfter = 2 * time.Millisecond
)

// group is the state of one distinct group at this rank: its members, its
// epoch and its schedule for the barrier's algorithm.
type group struct {
	members []int  // world ranks, ascending; nil for the world
	tag     uint64 // 16 bits
	epoch   uint64
	steps   []step
	size    int
}

// step is one action of a schedule: signal a peer, or wait for its signal.
type step struct {
	wait bool
	peer int // world rank
}

// barrier synchronises the ranks of a MultiChannel. It is safe for
// concurrent use, but calls are serialised: one wait at a time per rank
// (and the ranks must enter the barriers of overlapping groups in the same
// order).
type barrier struct {
	mc      *channel.MultiChannel
	want    BarrierAlgorithm // asked for (Auto too): what the ranks compare
	inUse   atomic.Int32     // the algorithm in use: want, or what Auto picked (setRemote, under mu; read anywhere: alg)
	rank, n int
	all     []int // the world's ranks, 0 to n−1 (the world group's members)

	flags   *verbs.MemoryRegion // 2 words per world rank, written by peers, then the poison and probe words
	staging *verbs.MemoryRegion // source words of the signals: two per peer; then the sleep and awake numbers' (bells.go)
	aux     *verbs.MemoryRegion // sources of probes (word 0, zero), of the poison (word 1) and of Share (auxShare)
	remote  []verbs.RemoteRegion

	mu         sync.Mutex
	turn       chan struct{} // one barrier or Share at a time (takeTurn), before mu
	closed     atomic.Bool
	gen        uint64
	sendSeq    []uint32 // writes to each peer since reset
	recvSeq    []uint32 // writes expected from each peer since reset
	world      *group
	calls      uint32                    // Shares entered since reset (low 32 bits)
	groups     map[uint64][]*group       // by member hash
	poison     error                     // a local failure (timeout, mismatch): until reset
	lost       atomic.Pointer[RankError] // a rank failed: for good
	tellMu     sync.Mutex                // serialises tell (the source word in aux); close releases the memory under it
	told       bool                      // this rank told every peer of lost (under tellMu)
	partners   []atomic.Bool             // the peers this rank wrote to or waited for (spread)
	wokenFn    func() bool               // b.woken, bound once
	local      atomic.Int32              // ranks of the world on this host (setRemote)
	spin       spinwait.Policy           // how a wait spins before it sleeps, and its alarms and probes (setRemote, mu)
	onDemand   bool                      // signals ring no doorbell unless the peer sleeps (bells.go; setRemote, mu)
	book       *bells.Book               // of the doorbells on demand (mu)
	ann        channel.Handle            // the sleep announcement in flight, if annPending (mu)
	annPending bool
	annPeer    int           // where it goes
	sleeps     atomic.Uint64 // sleeps begun (tests)

	// The sleep of a wait (mu): its alarm (ring), and what woken looks at.
	alarm                *spinwait.Alarm
	waitWord             *uint64
	waitSeen, seenAlarms uint64
	waitPeer             int
}

// newBarrier creates the barrier of rank mc.Self() in a world of mc.Len()
// ranks and registers its flags in mc.PD(). Hand localInfo to every peer
// (with the endpoints) and pass theirs to setRemote before the first wait.
func newBarrier(mc *channel.MultiChannel, alg BarrierAlgorithm) (*barrier, error) {
	if mc == nil {
		return nil, errors.New("cluster: barrier: nil MultiChannel")
	}
	if !alg.valid() {
		return nil, fmt.Errorf("cluster: barrier: unknown algorithm %d", int(alg))
	}
	n, rank := mc.Len(), mc.Self()
	if n > 1 && mc.Doorbells() == 0 {
		return nil, errors.New("cluster: barrier: the MultiChannel has no doorbells (channel.Options.Doorbells): signals are writes with immediate data")
	}
	if rank < 0 || rank >= n {
		return nil, fmt.Errorf("cluster: barrier: the MultiChannel has no self rank (self %d of %d)", rank, n)
	}
	flags, err := mc.PD().Alloc(regionBytes(n), verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		return nil, fmt.Errorf("cluster: barrier: flag memory: %w", err)
	}
	aux, err := mc.PD().Alloc(auxBytes, verbs.AccessLocalWrite)
	if err != nil {
		flags.Close()
		return nil, fmt.Errorf("cluster: barrier: probe memory: %w", err)
	}
	b := &barrier{mc: mc, want: alg, rank: rank, n: n, flags: flags, aux: aux, gen: 1, turn: make(chan struct{}, 1), spin: spinwait.Policy{Every: spinwait.ProbeEvery},
		sendSeq: make([]uint32, n), recvSeq: make([]uint32, n), partners: make([]atomic.Bool, n), groups: make(map[uint64][]*group)}
	if b.staging, err = mc.PD().Alloc((2*n+2)*flagBytes, verbs.AccessLocalWrite); err != nil {
		flags.Close()
		aux.Close()
		return nil, fmt.Errorf("cluster: barrier: staging memory: %w", err)
	}
	b.inUse.Store(int32(alg))
	b.all = make([]int, n)
	for i := range b.all {
		b.all[i] = i
	}
	b.wokenFn = b.woken
	b.book = bells.New(n)
	b.alarm = spinwait.NewAlarm(b.ring)
	b.world = b.newGroup(nil)
	return b, nil
}

// localInfo returns what the peers need to signal this rank: opaque bytes
// for setRemote.
func (b *barrier) localInfo() []byte {
	r := b.flags.Remote()
	buf := make([]byte, barrierInfoSize)
	copy(buf, barrierMagic)
	binary.LittleEndian.PutUint16(buf[4:], barrierVersion)
	binary.LittleEndian.PutUint16(buf[6:], uint16(b.want))
	binary.LittleEndian.PutUint32(buf[8:], uint32(b.rank))
	binary.LittleEndian.PutUint32(buf[12:], uint32(b.n))
	binary.LittleEndian.PutUint64(buf[16:], r.Addr)
	binary.LittleEndian.PutUint64(buf[24:], r.Len)
	binary.LittleEndian.PutUint32(buf[32:], r.RKey)
	binary.LittleEndian.PutUint64(buf[36:], hostID())
	binary.LittleEndian.PutUint32(buf[44:], uint32(runtime.NumCPU()))
	return buf
}

// setRemote takes every rank's localInfo, indexed by rank (this rank's own
// entry is checked too). It validates them all before it keeps any.
func (b *barrier) setRemote(infos [][]byte) error {
	if len(infos) != b.n {
		return fmt.Errorf("cluster: barrier: %d flag descriptions for a world of %d ranks", len(infos), b.n)
	}
	remote := make([]verbs.RemoteRegion, b.n)
	need := uint64(regionBytes(b.n))
	hosts, cpus := make([]uint64, b.n), make([]int, b.n)
	for j, info := range infos {
		if len(info) != barrierInfoSize {
			return fmt.Errorf("cluster: barrier: rank %d's flag description is %d bytes, want %d", j, len(info), barrierInfoSize)
		}
		if string(info[:4]) != barrierMagic {
			return fmt.Errorf("cluster: barrier: rank %d's flag description has magic %q, want %q", j, info[:4], barrierMagic)
		}
		if v := binary.LittleEndian.Uint16(info[4:]); v != barrierVersion {
			return fmt.Errorf("cluster: barrier: rank %d's flag description has version %d, want %d", j, v, barrierVersion)
		}
		if a := BarrierAlgorithm(binary.LittleEndian.Uint16(info[6:])); a != b.want {
			return fmt.Errorf("cluster: barrier: rank %d uses the %v barrier, this rank %v: every rank must use the same algorithm", j, a, b.want)
		}
		if r := binary.LittleEndian.Uint32(info[8:]); r != uint32(j) {
			return fmt.Errorf("cluster: barrier: entry %d holds the flag description of rank %d", j, r)
		}
		if n := binary.LittleEndian.Uint32(info[12:]); n != uint32(b.n) {
			return fmt.Errorf("cluster: barrier: rank %d has a world of %d ranks, this rank %d", j, n, b.n)
		}
		r := verbs.RemoteRegion{Addr: binary.LittleEndian.Uint64(info[16:]), Len: binary.LittleEndian.Uint64(info[24:]),
			RKey: binary.LittleEndian.Uint32(info[32:])}
		if r.Len < need {
			return fmt.Errorf("cluster: barrier: rank %d's flag region has %d bytes, want %d", j, r.Len, need)
		}
		if r.Addr%flagBytes != 0 {
			return fmt.Errorf("cluster: barrier: rank %d's flag region at %#x is not 8-byte aligned", j, r.Addr)
		}
		if r.Addr+need < r.Addr {
			return fmt.Errorf("cluster: barrier: rank %d's flag region at %#x wraps around", j, r.Addr)
		}
		c := binary.LittleEndian.Uint32(info[44:])
		if c == 0 {
			return fmt.Errorf("cluster: barrier: rank %d says it has no processor", j)
		}
		remote[j] = r
		hosts[j], cpus[j] = binary.LittleEndian.Uint64(info[36:]), int(min(c, 1<<20))
	}
	local := 0
	for _, h := range hosts {
		if h == hostID() {
			local++
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Load() {
		return fmt.Errorf("cluster: barrier: %w", channel.ErrClosed)
	}
	b.remote = remote
	b.local.Store(int32(local))
	if b.want == Auto {
		b.inUse.Store(int32(autoAlgorithm(b.n, oversubscribed(hosts, cpus))))
		b.reschedule(b.world)
		for _, gs := range b.groups {
			for _, g := range gs {
				b.reschedule(g)
			}
		}
	}
	b.spin = spinwait.For(local, runtime.NumCPU())
	b.onDemand = b.spin.Spin > 0
	return nil
}

// hostID identifies this machine (its boot, and its host name): the same
// in every process of a host, another on another host.
var hostID = sync.OnceValue(func() uint64 {
	h := sha256.New()
	if id, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		h.Write(id)
	}
	name, _ := os.Hostname()
	h.Write([]byte(name))
	return binary.LittleEndian.Uint64(h.Sum(nil))
})

// hashGroup hashes a member list (FNV-1a over the ranks).
func hashGroup(members []int) uint64 {
	h := uint64(14695981039346656037)
	for _, m := range members {
		for v := uint64(m); ; v >>= 8 {
			h ^= v & 0xff
			h *= 1099511628211
			if v < 0x100 {
				break
			}
		}
		h ^= 0xff // separator
		h *= 1099511628211
	}
	return h
}

// newGroup builds the state of a group (nil: the world) at this rank.
func (b *barrier) newGroup(members []int) *group {
	g := &group{size: b.n}
	world := b.all
	if members != nil {
		g.members = append([]int(nil), members...)
		g.size = len(members)
		world = g.members
	}
	h := hashGroup(world)
	g.tag = (h >> 48) ^ (h & 0xffff)
	b.reschedule(g)
	return g
}

// alg returns the algorithm in use.
func (b *barrier) alg() BarrierAlgorithm { return BarrierAlgorithm(b.inUse.Load()) }

// reschedule computes g's steps for b.alg().
func (b *barrier) reschedule(g *group) {
	world := g.members
	if world == nil {
		world = b.all
	}
	me := 0
	for i, m := range world {
		if m == b.rank {
			me = i
		}
	}
	g.steps = schedule(b.alg(), world, me)
}

// schedule returns the steps of rank members[me] in a barrier of members.
func schedule(alg BarrierAlgorithm, members []int, me int) []step {
	p := len(members)
	if p <= 1 {
		return nil
	}
	var s []step
	switch alg {
	case Dissemination:
		for d := 1; d < p; d <<= 1 {
			s = append(s, step{peer: members[(me+d)%p]}, step{wait: true, peer: members[(me-d+p)%p]})
		}
	case Centralized:
		if me == 0 {
			for i := 1; i < p; i++ {
				s = append(s, step{wait: true, peer: members[i]})
			}
			for i := 1; i < p; i++ {
				s = append(s, step{peer: members[i]})
			}
		} else {
			s = append(s, step{peer: members[0]}, step{wait: true, peer: members[0]})
		}
	default: // BinaryTree: children of position i are 2i+1 and 2i+2.
		for c := 2*me + 1; c <= 2*me+2 && c < p; c++ {
			s = append(s, step{wait: true, peer: members[c]})
		}
		if me > 0 {
			parent := members[(me-1)/2]
			s = append(s, step{peer: parent}, step{wait: true, peer: parent})
		}
		for c := 2*me + 1; c <= 2*me+2 && c < p; c++ {
			s = append(s, step{peer: members[c]})
		}
	}
	return s
}

// lookup validates peers and returns the group's state (created on first
// use).
func (b *barrier) lookup(peers []int) (*group, error) {
	if peers == nil {
		return b.world, nil
	}
	if len(peers) == 0 {
		return nil, fmt.Errorf("%w: empty group (pass nil for the whole world)", ErrBadGroup)
	}
	in := false
	for i, p := range peers {
		if p < 0 || p >= b.n {
			return nil, fmt.Errorf("%w: entry %d is rank %d, outside the world [0, %d)", ErrBadGroup, i, p, b.n)
		}
		if i > 0 && p == peers[i-1] {
			return nil, fmt.Errorf("%w: rank %d appears twice (entries %d and %d)", ErrBadGroup, p, i-1, i)
		}
		if i > 0 && p < peers[i-1] {
			return nil, fmt.Errorf("%w: ranks not in ascending order (entry %d is rank %d, after rank %d)", ErrBadGroup, i, p, peers[i-1])
		}
		if p == b.rank {
			in = true
		}
	}
	if !in {
		return nil, fmt.Errorf("%w: rank %d is not in %v", ErrNotInGroup, b.rank, peers)
	}
	if len(peers) == b.n {
		return b.world, nil // every rank: the same group as nil
	}
	h := hashGroup(peers)
	for _, g := range b.groups[h] {
		if equal(g.members, peers) {
			return g, nil
		}
	}
	g := b.newGroup(peers)
	b.groups[h] = append(b.groups[h], g)
	return g, nil
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// wait returns once every rank of the group (nil: the world; otherwise a
// sorted subgroup containing this rank) has entered this barrier, or fails
// when ctx ends (the barrier is then poisoned, unless ctx had ended before
// the call), the transport breaks (poisoned too), or the group is invalid
// (not poisoned).
func (b *barrier) wait(ctx context.Context, peers []int) error {
	if err := b.takeTurn(ctx); err != nil {
		return b.fail(nil, peers, -1, err)
	}
	defer b.giveTurn()
	b.mu.Lock()
	defer b.mu.Unlock()
	g, err := b.lookup(peers)
	if err != nil {
		return b.fail(nil, peers, -1, err)
	}
	if err := b.ready(ctx, len(g.steps) > 0); err != nil {
		return b.fail(g, peers, -1, err)
	}
	if peer, err := b.run(ctx, g); err != nil {
		err, poison := b.settle(peer, err)
		err = b.fail(g, peers, peer, err)
		if poison {
			b.poison = err
		}
		return err
	}
	return nil
}

// takeTurn waits for the turn of the node's barriers and Shares, which
// run one at a time, until ctx ends: then it fails with a timeout that
// poisons nothing (nothing was signalled). Before, a call waited for the
// one in progress whatever its own ctx said, as long as that one's ctx
// let it run (TestBarrierTurnHonoursCtx).
func (b *barrier) takeTurn(ctx context.Context) error {
	select {
	case b.turn <- struct{}{}:
		return nil
	default:
	}
	select {
	case b.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for the barrier or Share in progress on this node: %w: %w", verbs.ErrTimeout, ctx.Err())
	}
}

// giveTurn ends a turn of takeTurn.
func (b *barrier) giveTurn() { <-b.turn }

// ready checks, before a barrier or a Share writes anything, that it may
// run: the barrier is open, no rank failed, it is not poisoned, ctx has
// not ended, and (if peers is set) the peers' flags are known. Its
// errors poison nothing. Call with mu held.
func (b *barrier) ready(ctx context.Context, peers bool) error {
	if b.closed.Load() {
		return channel.ErrClosed
	}
	if err := b.worldErr(); err != nil {
		return fmt.Errorf("%w: %w", ErrPoisoned, err)
	}
	if b.poison != nil {
		return fmt.Errorf("%w: %w", ErrPoisoned, b.poison)
	}
	if err := ctx.Err(); err != nil { // nothing signalled yet: not poisoned
		return fmt.Errorf("%w: %w", verbs.ErrTimeout, err)
	}
	if peers && b.remote == nil {
		return fmt.Errorf("the peers' flags are not known yet (setRemote): %w", channel.ErrNotConnected)
	}
	return nil
}

// run runs the steps of the barrier of g and moves g to its next epoch.
// On failure it returns the peer of the step that failed and the raw
// error, for settle. Call with mu held.
func (b *barrier) run(ctx context.Context, g *group) (int, error) {
	for _, s := range g.steps {
		var err error
		if s.wait {
			err = b.await(ctx, g, s.peer)
		} else {
			err = b.signal(ctx, g, s.peer)
		}
		if err != nil {
			b.book.Forget()
			if pf := (*peerFault)(nil); errors.As(err, &pf) {
				return pf.peer, pf.err // a doorbell to another peer failed
			}
			return s.peer, err
		}
	}
	b.endQuiet(ctx)
	g.epoch++
	return -1, nil
}

// settle records the failure err of a step involving peer and returns
// the error to report, and whether it poisons the barrier (the caller
// stores its final error as the poison): another rank's news of a
// failed rank is kept for good; a timeout or a disagreement between the
// ranks (ErrBarrierMismatch, ErrShareCorrupt) poisons until reset;
// closing is just reported; anything else is the transport to peer
// breaking: peer failed, and every rank is told.
func (b *barrier) settle(peer int, err error) (error, bool) {
	var re *RankError
	switch {
	case errors.As(err, &re): // another rank saw a rank fail
		b.lost.CompareAndSwap(nil, re)
		return b.lost.Load(), false
	case errors.Is(err, channel.ErrClosed):
		return err, false
	case errors.Is(err, verbs.ErrTimeout) || errors.Is(err, ErrBarrierMismatch) || errors.Is(err, ErrShareCorrupt):
		return err, true
	case peer < 0:
		return err, true
	default:
		// The transport to peer broke: it failed, unless the world had
		// failed already: a rank that knows of a failure tells its
		// partners before it closes (spread), so news of the first
		// failure is in this rank's memory before its queue pair to a
		// peer that closed after learning of it breaks.
		if re := b.worldErr(); re != nil {
			return re, false
		}
		return b.report(peer, err), false
	}
}

// worldErr returns the failure of a rank of the world, as this rank saw
// it or was told (the poison word), or nil. Safe for concurrent use, also
// with close: once the flag memory is released, it reports only what
// was recorded (Node.Fail and Node.Err check the node's phase first, but
// Close may release the memory right after). Call without tellMu held.
func (b *barrier) worldErr() error {
	if re := b.lost.Load(); re != nil {
		return re
	}
	b.tellMu.Lock() // close releases the flags with tellMu held
	defer b.tellMu.Unlock()
	if b.closed.Load() {
		if re := b.lost.Load(); re != nil {
			return re
		}
		return nil
	}
	if v := atomic.LoadUint64(b.poisonWord()); v != 0 {
		if re := b.poisoned(v); re != nil {
			b.lost.CompareAndSwap(nil, re)
			return b.lost.Load()
		}
	}
	return nil
}

// poisonWord is this rank's poison word.
func (b *barrier) poisonWord() *uint64 {
	return (*uint64)(unsafe.Pointer(&b.flags.Bytes()[b.n*wordsPerPeer*flagBytes]))
}

// poisoned decodes a poison word v (nil if it is not one).
func (b *barrier) poisoned(v uint64) *RankError {
	if v>>56 != poisonMark {
		return nil
	}
	dead, by := int(uint32(v)), int(v>>32&0xffffff)
	return &RankError{Rank: dead, Err: fmt.Errorf("%w (rank %d saw it fail)", ErrPeerLost, by)}
}

// report records that rank dead failed (cause: what this rank saw),
// unless a failure was recorded before, and tells every peer the failure
// recorded (the first one), which it returns. Safe for concurrent use.
func (b *barrier) report(dead int, cause error) *RankError {
	err := fmt.Errorf("%w (reported without a cause)", ErrPeerLost)
	if cause != nil {
		err = fmt.Errorf("%w: %w", ErrPeerLost, cause)
	}
	b.lost.CompareAndSwap(nil, &RankError{Rank: dead, Err: err})
	re := b.lost.Load()
	b.tellMu.Lock()
	if !b.closed.Load() {
		b.told = true
		b.tell(re.Rank, nil)
	}
	b.tellMu.Unlock()
	return re
}

// spread tells the partners of this rank (the peers it wrote to or
// waited for) of the failure recorded, unless it told every peer when it
// saw the failure itself. Node.Close calls it before the queue pairs go:
// the rank that saw a failure tells every rank, but a rank that connects
// for the first time to a peer to tell it can be slower than a rank that
// learned of the failure, gave up and closed; a partner of that rank
// would see its queue pair to it break first and blame it. Told by it
// before (queue pairs deliver in order, and Close quiesces), the partner
// reports the first failure (see settle).
func (b *barrier) spread() {
	if b.worldErr() == nil { // it records a failure told by the poison word
		return
	}
	re := b.lost.Load()
	b.tellMu.Lock()
	defer b.tellMu.Unlock()
	if b.closed.Load() || b.told {
		return
	}
	b.told = true
	b.tell(re.Rank, func(p int) bool { return b.partners[p].Load() })
}

// partner records that this rank wrote to peer or waited for it.
func (b *barrier) partner(peer int) {
	if !b.partners[peer].Load() {
		b.partners[peer].Store(true)
	}
}

// tell writes the poison word naming dead into every peer this rank can
// still reach (those to accepts, if it is not nil), without waiting for
// the writes to complete (Node.Close makes sure they leave). Best effort:
// a peer it cannot reach finds out by itself. Call with tellMu held.
func (b *barrier) tell(dead int, to func(p int) bool) {
	if b.remote == nil {
		return
	}
	v := uint64(poisonMark)<<56 | uint64(b.rank&0xffffff)<<32 | uint64(uint32(dead))
	binary.NativeEndian.PutUint64(b.aux.Bytes()[flagBytes:], v)
	src, err := b.aux.SGE(flagBytes, flagBytes)
	if err != nil {
		return
	}
	off := uint64(b.n * wordsPerPeer * flagBytes)
	for _, p := range b.mc.Peers() {
		ch := b.mc.Peer(p)
		if p == dead || ch.Err() != nil || (to != nil && !to(p)) {
			continue
		}
		if h, err := ch.PostWriteImm(b.remote[p].At(off), 0, src); err == nil {
			h.Release() // detached: its completion is not awaited
		}
	}
}

// fail builds the error of a barrier.
func (b *barrier) fail(g *group, peers []int, peer int, err error) error {
	e := &BarrierError{Algorithm: b.alg(), Rank: b.rank, Peer: peer, Err: err}
	if peers != nil {
		e.Group = append([]int(nil), peers...)
	}
	if g != nil {
		e.Epoch = g.epoch
	}
	return e
}

// value is the word the barrier of g writes on the pair with write count
// seq.
func (b *barrier) value(g *group, seq uint32) uint64 {
	return b.gen<<48 | uint64(seq&0xffff)<<32 | g.tag<<16 | g.epoch&0xffff
}

// signal writes this rank's word for g into peer's flags, with
// immediate data (the peer's doorbell, which wakes it if it sleeps in
// awaitWord) unless doorbells are on demand (bells.go). The write is not
// awaited. Its source is one of two staging
// words of the pair, by the parity of the pair's write count: the next
// write with the same parity comes after the peer has read this one (see
// Flag memory), so after the device has read the source.
func (b *barrier) signal(ctx context.Context, g *group, peer int) error {
	seq := b.sendSeq[peer]
	v := b.value(g, seq)
	off := uint64((b.rank*wordsPerPeer + int(seq&1)) * flagBytes)
	stage := (peer*2 + int(seq&1)) * flagBytes
	binary.NativeEndian.PutUint64(b.staging.Bytes()[stage:], v)
	src, err := b.staging.SGE(stage, flagBytes)
	if err != nil {
		return err
	}
	if err := b.postWrite(ctx, peer, b.mc.Peer(peer), b.remote[peer].At(off), src, !b.onDemand); err != nil {
		return err
	}
	if b.onDemand {
		b.book.Wrote(peer)
	}
	b.sendSeq[peer] = seq + 1
	return nil
}

// await polls the word peer writes for g until it holds the expected
// value, ctx ends, or the transport to peer breaks.
func (b *barrier) await(ctx context.Context, g *group, peer int) error {
	seq := b.recvSeq[peer]
	want := b.value(g, seq)
	off := (peer*wordsPerPeer + int(seq&1)) * flagBytes
	err := b.awaitWord(ctx, peer, b.word64(off), func(v uint64) (bool, error) {
		if v == want {
			return true, nil
		}
		if v>>32 == want>>32 {
			return false, fmt.Errorf("%w: rank %d signalled group tag %#04x epoch %d, this rank waits for tag %#04x epoch %d",
				ErrBarrierMismatch, peer, v>>16&0xffff, v&0xffff, g.tag, g.epoch&0xffff)
		}
		return false, nil
	})
	if err != nil {
		return err
	}
	b.recvSeq[peer] = seq + 1
	return nil
}

// word64 is the word at byte offset off of this rank's flag region.
func (b *barrier) word64(off int) *uint64 {
	return (*uint64)(unsafe.Pointer(&b.flags.Bytes()[off]))
}

// awaitWord polls *w, a word of the flag region that peer writes, until
// match accepts its value (true) or rejects it (an error), ctx ends, a
// rank of the world fails (the poison word), the barrier closes, or the
// transport to peer breaks; after a while it probes peer (probe). match
// must be cheap: it sees every value polled. Call with mu held.
func (b *barrier) awaitWord(ctx context.Context, peer int, w *uint64, match func(v uint64) (bool, error)) error {
	b.partner(peer)
	pw := b.poisonWord()
	var probe channel.Handle // in flight if probing
	probing := false
	var start, nextProbe time.Time
	told := false // the peer knows this rank sleeps: its announcement was placed (bells.go)
	defer func() {
		if probing {
			probe.Release()
		}
		b.awake(ctx)
	}()
	// Spinning, as b.spin allows: poll (driving the transport's
	// progress), check now and then, yield to the process' goroutines.
	// The word is looked at after each poll, before the pause: soft0
	// places the peer's write in the poll, and with ranks that outnumber
	// the processors a pause is a context switch or several.
	if b.spin.Spin > 0 {
		if ok, err := match(atomic.LoadUint64(w)); ok || err != nil {
			return err
		}
		until := time.Now().Add(b.spin.Spin)
		for i := 1; ; i++ {
			if err := b.mc.Progress(); err != nil {
				return err
			}
			if ok, err := match(atomic.LoadUint64(w)); ok || err != nil {
				return err
			}
			if i%pollCheck == 0 {
				if err := b.checkWait(ctx, peer, pw); err != nil {
					return err
				}
				if time.Now().After(until) {
					break
				}
			}
			if err := b.ringSleepers(ctx); err != nil {
				return err
			}
			b.spin.PauseAt(i)
		}
	}
	for i := 0; ; i++ {
		v := atomic.LoadUint64(w)
		if ok, err := match(v); ok || err != nil {
			return err
		}
		if i > 0 {
			// Woken without the word: the context, the alarm, news.
			if err := b.checkWait(ctx, peer, pw); err != nil {
				return err
			}
			now := time.Now()
			if start.IsZero() {
				start = now
			} else if now.Sub(start) >= probeAfter {
				// A long wait: check that the peer is alive.
				if err := b.probe(peer, &probe, &probing, &nextProbe); err != nil {
					return err
				}
			}
		}
		if b.onDemand {
			// Tell the peer, wait until it is placed, look once more
			// (bells.go); a peer signalled in this barrier may sleep too.
			if err := b.ringSleepers(ctx); err != nil {
				return err
			}
			if done, err := b.announced(); done && err == nil && b.annPeer == peer {
				told = true
				continue
			}
			if !told {
				pending, err := b.announce(peer)
				if err != nil {
					return err
				}
				if !pending { // a full send queue: its completions free it
					if err := b.mc.Progress(); err != nil {
						return err
					}
					b.spin.Pause()
					continue
				}
			}
		}
		if !b.annPending {
			b.sleeps.Add(1)
		}
		b.sleep(ctx, peer, w, v)
	}
}

// checkWait looks for the reasons to give up a wait for peer: the
// context, the barrier's close, a rank failure (the poison word pw), the
// peer's channel.
func (b *barrier) checkWait(ctx context.Context, peer int, pw *uint64) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("waiting for rank %d: %w: %w", peer, verbs.ErrTimeout, err)
	}
	if b.closed.Load() {
		return channel.ErrClosed
	}
	if v := atomic.LoadUint64(pw); v != 0 {
		if re := b.poisoned(v); re != nil {
			return re
		}
	}
	return b.mc.Peer(peer).Err()
}

// sleep waits, in the node channel's Wait (which polls, spinning as its
// Options.SpinPolls says, then sleeps on the completion channel), until
// the word w no longer holds seen, the poison word is set, the barrier
// closes, the alarm goes off or ctx ends (which the caller's checks
// report). A doorbell (bells.go) wakes a sleeping rank, and the word is
// in memory when the doorbell's completion is (a queue pair places
// writes in order). The alarm (ring, after b.spin.Every) posts a probe to the
// peer waited for, whose completion wakes this rank for its checks
// (liveness; the context's end is seen at once).
func (b *barrier) sleep(ctx context.Context, peer int, w *uint64, seen uint64) {
	b.waitWord, b.waitSeen, b.waitPeer, b.seenAlarms = w, seen, peer, b.alarm.Fired()
	b.alarm.Arm(b.spin.Every, peer)
	b.mc.Sleep(ctx, b.wokenFn) // ends early only with ctx or the channel, which the checks report
	b.alarm.Disarm()
}

// woken is the condition of sleep (the peer's broken queue pair flushes
// the doorbell receives, whose completions wake the sleeper).
func (b *barrier) woken() bool {
	return atomic.LoadUint64(b.waitWord) != b.waitSeen || atomic.LoadUint64(b.poisonWord()) != 0 ||
		b.alarm.Fired() != b.seenAlarms || b.closed.Load() || b.mc.Peer(b.waitPeer).Broken() ||
		b.annPending && b.ann.Done()
}

// ring is the alarm of sleep (on a timer's goroutine, while the sleep
// lasts): a probe write to the peer waited for.
func (b *barrier) ring(peer int) {
	if h, err := b.postProbe(peer); err == nil {
		h.Release()
	}
}

// postProbe posts the write of the probe word at peer.
func (b *barrier) postProbe(peer int) (channel.Handle, error) {
	src, err := b.aux.SGE(0, flagBytes)
	if err != nil {
		return channel.Handle{}, err
	}
	return b.mc.Peer(peer).PostWrite(b.remote[peer].At(b.probeOff()), src)
}

// probeOff is the offset of the probe word in a rank's flag region.
func (b *barrier) probeOff() uint64 { return uint64((b.n*wordsPerPeer + 1) * flagBytes) }

// probe checks that peer is alive during a long wait: it keeps one write
// of the probe word in flight to it, a new one every b.spin.Every. A peer
// that died or stopped answering fails it (at once, or after the queue
// pair's transport timeout), and the error breaks the channel.
//
// Only the peer waited for is probed, and only its channel is checked: a
// channel to another peer may break without news of a failure (a peer
// that left after the last barrier before this rank's last write to it
// was acknowledged), and a rank that failed is always waited for by some
// other rank (it sends no more signals), which probes it and tells
// everyone.
func (b *barrier) probe(peer int, h *channel.Handle, probing *bool, next *time.Time) error {
	if *probing {
		done, err := h.Poll()
		if err == nil && done {
			err = h.Err()
		}
		if err != nil {
			h.Release()
			*probing = false
			return err
		}
		if !done {
			return nil
		}
		h.Release()
		*probing = false
	}
	now := time.Now()
	if now.Before(*next) {
		return nil
	}
	*next = now.Add(b.spin.Every)
	p, err := b.postProbe(peer)
	if err != nil {
		if errors.Is(err, verbs.ErrQueueFull) {
			return nil // try again later
		}
		return err
	}
	*h, *probing = p, true
	return nil
}

// reset clears the poison and starts every group over at epoch 0, and
// Shares at call 0. It is collective: after a barrier or a Share failed
// anywhere, every rank of the world calls reset (once) before its next
// barrier or Share, whether or not its own failed. It does not clear the
// failure of a rank (RankError): that world is broken for good. It does
// not communicate; signals and mailbox headers still in flight from the
// abandoned calls are recognised as stale (the generation changed) and
// ignored.
func (b *barrier) reset() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Load() {
		return fmt.Errorf("cluster: barrier: reset: %w", channel.ErrClosed)
	}
	b.poison = nil
	b.gen = b.gen%0xffff + 1 // 1..65535: generation 0 would match zeroed flags
	clear(b.sendSeq)
	clear(b.recvSeq)
	b.world.epoch = 0
	b.calls = 0
	for _, gs := range b.groups {
		for _, g := range gs {
			g.epoch = 0
		}
	}
	return nil
}

// close releases the flag memory. A wait in progress fails with
// channel.ErrClosed. Close the barrier before the MultiChannel's PD.
// Idempotent.
func (b *barrier) close() error {
	if b.closed.Swap(true) {
		return nil
	}
	b.mu.Lock() // a wait in progress sees closed and returns
	defer b.mu.Unlock()
	b.tellMu.Lock() // a report in progress has finished posting
	defer b.tellMu.Unlock()
	if b.annPending {
		b.ann.Release()
		b.annPending = false
	}
	var errs []error
	if err := b.flags.Close(); err != nil {
		errs = append(errs, err)
	}
	if err := b.staging.Close(); err != nil {
		errs = append(errs, err)
	}
	if err := b.aux.Close(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cluster: barrier: close: %w", err)
	}
	return nil
}
