package cluster

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// ErrNodeState: a Node method was called in the wrong phase (Connect
// before LocalEndpoints, twice, or a barrier before Connect).
var ErrNodeState = errors.New("cluster: node: wrong phase")

// NodeOptions configure a Node. The zero value is usable.
type NodeOptions struct {
	// Channel configures the MultiChannel (queue depths, polling...).
	// Its Doorbells default to 64 per peer (at most the receive queue
	// depth): the queue pairs carry one-sided operations only, and peers
	// wake a rank that sleeps for their writes with writes with immediate
	// data (see channel.Options.Doorbells). Every rank of a world must
	// use doorbells.
	Channel channel.Options
	// Barrier is the barrier algorithm; every rank must ask for the same
	// one. Default Auto: chosen from where the ranks run, alike on every
	// rank (Node.BarrierAlgorithm says which).
	Barrier BarrierAlgorithm
	// CloseGrace bounds how long Close waits for this rank's last
	// unsignaled writes (a barrier's final signals) to reach the peers
	// (see Close). Default 1s; negative: do not wait.
	CloseGrace time.Duration
}

const defaultCloseGrace = time.Second

// Node is one rank of a world of ranks: its rank, the world size, a
// MultiChannel with a reliable connected queue pair to every other rank,
// and a barrier.
//
// A Node is built in phases: NewNode creates the queue pairs and the
// barrier's flags; LocalEndpoints returns what this rank must send to
// every other; the program exchanges them (Exchange, or any other way);
// Connect takes what every other rank sent and brings the queue pairs up.
// Join and FromEnv do all of it.
//
// After Connect, a Node is safe for concurrent use (barriers are
// serialised; see Barrier).
type Node struct {
	rank, size int
	mc         *channel.MultiChannel
	bar        *barrier
	probe      *verbs.MemoryRegion // 8 bytes per rank: peers read slot 0, our reads land in slot j
	probes     []verbs.RemoteRegion
	grace      time.Duration

	mu        sync.Mutex
	phase     int // 0 built, 1 endpoints given, 2 connected, 3 closed
	peerData  [][]byte
	onClose   []func() error // OnClose functions, run in reverse order
	owned     []func() error // closed after the channel, in order
	closeErr  error
	closeOnce sync.Once
}

// MaxWorldSize is the largest world NewNode builds, an exchange runs
// and ParseLaunch accepts: 1 048 576 ranks. A node holds a queue pair
// and registered flags and mailboxes per rank (NewNode allocates per
// rank at once), and the exchange carries ranks in 32 bits, so a world
// size read from a malformed environment (WORLD_SIZE=9223372036854775807)
// must fail with an error before anything is allocated for it.
const MaxWorldSize = 1 << 20

// defaultDoorbells is the number of doorbell receives per peer
// (NodeOptions.Channel.Doorbells).
const defaultDoorbells = 64

// NewNode creates the node of rank in a world of size ranks: a
// MultiChannel in pd (which the caller keeps and closes after the Node)
// and a barrier.
func NewNode(pd *verbs.ProtectionDomain, rank, size int, opts NodeOptions) (*Node, error) {
	if size < 1 || size > MaxWorldSize {
		return nil, fmt.Errorf("cluster: node: world size %d (want 1 to %d)", size, MaxWorldSize)
	}
	if rank < 0 || rank >= size {
		return nil, fmt.Errorf("cluster: node: rank %d outside [0, %d)", rank, size)
	}
	if pd == nil {
		return nil, errors.New("cluster: node: nil protection domain")
	}
	copts := opts.Channel
	if copts.Doorbells == 0 {
		depth := copts.QP.MaxRecvWR
		if depth == 0 {
			depth = defaultDoorbells
		}
		copts.Doorbells = min(defaultDoorbells, max(depth, 1))
	}
	mc, err := channel.NewMulti(pd, size, rank, copts)
	if err != nil {
		return nil, fmt.Errorf("cluster: node: %w", err)
	}
	bar, err := newBarrier(mc, opts.Barrier)
	if err != nil {
		mc.Close()
		return nil, fmt.Errorf("cluster: node: %w", err)
	}
	probe, err := pd.Alloc(8*size, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	if err != nil {
		bar.close()
		mc.Close()
		return nil, fmt.Errorf("cluster: node: %w", err)
	}
	grace := opts.CloseGrace
	if grace == 0 {
		grace = defaultCloseGrace
	}
	return &Node{rank: rank, size: size, mc: mc, bar: bar, probe: probe, grace: grace}, nil
}

// LocalRanks returns how many ranks of the world (this one included) run
// on this machine, as the endpoint exchange told (1 before Connect).
// More local ranks than processors (runtime.NumCPU) means the machine is
// oversubscribed: waits that spin take the processor from the rank they
// wait for, so the library's waits sleep at once (see Barrier, and the
// collective package).
func (n *Node) LocalRanks() int {
	if n.bar == nil {
		return 1 // a zero Node
	}
	return max(1, int(n.bar.local.Load()))
}

// BarrierAlgorithm returns the algorithm of the node's barriers: the one
// NodeOptions.Barrier asked for, or, when that is Auto, the one Auto
// picked once the endpoint exchange connected the world (Auto before
// that).
func (n *Node) BarrierAlgorithm() BarrierAlgorithm {
	if n.bar == nil {
		return Auto // a zero Node
	}
	return BarrierAlgorithm(n.bar.inUse.Load())
}

// Rank returns this node's rank.
func (n *Node) Rank() int { return n.rank }

// Size returns the world size.
func (n *Node) Size() int { return n.size }

// Channel returns the MultiChannel to every rank (peer number = rank; the
// entry of this rank is self).
func (n *Node) Channel() *channel.MultiChannel { return n.mc }

// PD returns the protection domain of the channel: memory registered in
// it serves every peer.
func (n *Node) PD() *verbs.ProtectionDomain {
	if n.mc == nil {
		return nil // a zero Node
	}
	return n.mc.PD()
}

// What a rank publishes is a card, the same for every peer, and an item
// per peer (ExchangeCards carries them; LocalEndpoints wraps them into
// one message per peer for other exchanges):
//
//	card of rank i: magic "GVCD" | version u8 | i u32 | world size u32 |
//	  vector of 4 entries: endpoint of i's queue pairs but for their
//	  numbers (binary; empty in a world of one) | barrier info of i |
//	  application data of i | probe region of i (address u64, length
//	  u64, rkey u32)
//	item of rank i for rank j: queue pair number u24 | initial packet
//	  sequence number u24 of i's queue pair for j (zero for i == j)
//	message of rank i to rank j (LocalEndpoints): magic "GVND" |
//	  version u8 | i u32 | j u32 | world size u32 | vector of 2 entries:
//	  card of i | item of i for j
//
// Version 1 sent the whole endpoint, with the card's fields, in each of
// the N messages of a rank.
const (
	nodeMagic   = "GVND"
	cardMagic   = "GVCD"
	nodeVersion = 2
	// ItemSize is the size of a node's item for a peer (LocalCard).
	ItemSize = 6
	cardHdr  = 4 + 1 + 8
	nodeHdr  = 4 + 1 + 12
	probeLen = 20
)

// LocalCard returns what this rank must send to every rank: card, the
// same for all (its queue pairs' endpoint but for their numbers, its
// barrier flags, its probe region, and data, application bytes that
// every peer will see as PeerData; data may be nil), and items,
// ItemSize bytes for each rank j at items[j*ItemSize:] (the number and
// initial packet sequence number of its queue pair for rank j).
// ExchangeCards delivers them; ConnectCards takes what it returns.
// LocalCard and LocalEndpoints are alternatives: call one, once.
func (n *Node) LocalCard(data []byte) (card, items []byte, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.phase >= 2 {
		return nil, nil, fmt.Errorf("%w: LocalCard after Connect or Close", ErrNodeState)
	}
	card, items, err = n.localCard(data)
	if err != nil {
		return nil, nil, err
	}
	n.phase = 1
	return card, items, nil
}

func (n *Node) localCard(data []byte) (card, items []byte, err error) {
	eps, err := n.mc.Endpoints()
	if err != nil {
		return nil, nil, fmt.Errorf("cluster: node: %w", err)
	}
	var tmpl []byte
	items = make([]byte, n.size*ItemSize)
	first := -1
	for j, ep := range eps {
		if j == n.rank {
			continue
		}
		if first < 0 {
			first = j
			if tmpl, err = ep.MarshalBinary(); err != nil {
				return nil, nil, fmt.Errorf("cluster: node: endpoint for rank %d: %w", j, err)
			}
		} else if !sameButNumbers(ep, eps[first]) {
			return nil, nil, fmt.Errorf("cluster: node: the endpoints for ranks %d and %d differ beyond their queue pair numbers: they cannot share a card", first, j)
		}
		putItem(items[j*ItemSize:], ep.QPN, ep.PSN)
	}
	pr := n.probe.Remote()
	probe := binary.BigEndian.AppendUint64(nil, pr.Addr)
	probe = binary.BigEndian.AppendUint64(probe, pr.Len)
	probe = binary.BigEndian.AppendUint32(probe, pr.RKey)
	card = append([]byte(cardMagic), nodeVersion)
	card = binary.BigEndian.AppendUint32(card, uint32(n.rank))
	card = binary.BigEndian.AppendUint32(card, uint32(n.size))
	card = append(card, encodeVector([][]byte{tmpl, n.bar.localInfo(), data, probe})...)
	return card, items, nil
}

// sameButNumbers reports whether a and b are equal but for their queue
// pair numbers and initial packet sequence numbers: whether their
// encodings (a card's template) are the same with b's numbers in a. A
// field added to verbs.Endpoint is in its encoding, so it is compared
// too.
func sameButNumbers(a, b verbs.Endpoint) bool {
	a.QPN, a.PSN = b.QPN, b.PSN
	x, err := a.MarshalBinary()
	if err != nil {
		return false
	}
	y, err := b.MarshalBinary()
	return err == nil && bytes.Equal(x, y)
}

// putItem writes an item: qpn and psn, 24 bits each.
func putItem(b []byte, qpn, psn uint32) {
	b[0], b[1], b[2] = byte(qpn>>16), byte(qpn>>8), byte(qpn)
	b[3], b[4], b[5] = byte(psn>>16), byte(psn>>8), byte(psn)
}

// peerInfo is what a rank learns of a peer from its card and item.
type peerInfo struct {
	ep    verbs.Endpoint // zero for this rank itself
	info  []byte         // barrier info
	data  []byte         // application data
	probe verbs.RemoteRegion
}

// decodeCard decodes rank j's card and its item for this rank (self) in a
// world of size ranks.
func decodeCard(card, item []byte, j, self, size int) (p peerInfo, err error) {
	bad := func(format string, args ...any) (peerInfo, error) {
		return peerInfo{}, fmt.Errorf("cluster: node: rank %d's card: "+format, append([]any{j}, args...)...)
	}
	if len(card) < cardHdr || string(card[:4]) != cardMagic {
		return bad("not a node's card")
	}
	if card[4] != nodeVersion {
		return bad("version %d (want %d)", card[4], nodeVersion)
	}
	from, n := binary.BigEndian.Uint32(card[5:]), binary.BigEndian.Uint32(card[9:])
	if from != uint32(j) || n != uint32(size) {
		return bad("it is the card of rank %d in a world of %d, not of rank %d in a world of %d", from, n, j, size)
	}
	v, err := decodeVector(card[cardHdr:], 4)
	if err != nil {
		return bad("%w", err)
	}
	if len(item) != ItemSize {
		return bad("item of %d bytes (want %d)", len(item), ItemSize)
	}
	if j != self {
		if err := p.ep.UnmarshalBinary(v[0]); err != nil {
			return bad("endpoint: %w", err)
		}
		p.ep.QPN = uint32(item[0])<<16 | uint32(item[1])<<8 | uint32(item[2])
		p.ep.PSN = uint32(item[3])<<16 | uint32(item[4])<<8 | uint32(item[5])
		if err := p.ep.Validate(); err != nil {
			return bad("item for rank %d: %w", self, err)
		}
	}
	if len(v[3]) != probeLen {
		return bad("probe region of %d bytes, want %d", len(v[3]), probeLen)
	}
	p.probe = verbs.RemoteRegion{Addr: binary.BigEndian.Uint64(v[3]), Len: binary.BigEndian.Uint64(v[3][8:]), RKey: binary.BigEndian.Uint32(v[3][16:])}
	if p.probe.Len < 8 {
		return bad("probe region of %d bytes long, want at least 8", p.probe.Len)
	}
	p.info, p.data = v[1], v[2]
	return p, nil
}

// LocalEndpoints returns what this rank must send to every rank, indexed
// by rank, for exchanges that carry one message per pair of ranks
// (Exchange): its card and its item for that rank (see LocalCard), with
// data the application bytes every peer will see as PeerData (it may be
// nil). The entry of this rank itself must be handed back to Connect
// too (Exchange does). LocalCard and ExchangeCards carry the same with
// N−1 fewer copies of the card.
func (n *Node) LocalEndpoints(data []byte) ([][]byte, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.phase >= 2 {
		return nil, fmt.Errorf("%w: LocalEndpoints after Connect or Close", ErrNodeState)
	}
	card, items, err := n.localCard(data)
	if err != nil {
		return nil, err
	}
	out := make([][]byte, n.size)
	for j := range n.size {
		b := append([]byte(nodeMagic), nodeVersion)
		b = binary.BigEndian.AppendUint32(b, uint32(n.rank))
		b = binary.BigEndian.AppendUint32(b, uint32(j))
		b = binary.BigEndian.AppendUint32(b, uint32(n.size))
		out[j] = append(b, encodeVector([][]byte{card, items[j*ItemSize : (j+1)*ItemSize]})...)
	}
	n.phase = 1
	return out, nil
}

// decodePeer decodes the message of rank j to this rank (self) in a world
// of size ranks into its card and item.
func decodePeer(b []byte, j, self, size int) (card, item []byte, err error) {
	if len(b) < nodeHdr || string(b[:4]) != nodeMagic {
		return nil, nil, fmt.Errorf("cluster: node: rank %d's message is not a node message", j)
	}
	if b[4] != nodeVersion {
		return nil, nil, fmt.Errorf("cluster: node: rank %d's message has version %d (want %d)", j, b[4], nodeVersion)
	}
	from, to, n := binary.BigEndian.Uint32(b[5:]), binary.BigEndian.Uint32(b[9:]), binary.BigEndian.Uint32(b[13:])
	if from != uint32(j) || to != uint32(self) || n != uint32(size) {
		return nil, nil, fmt.Errorf("cluster: node: entry %d is the message of rank %d to rank %d in a world of %d, not of rank %d to rank %d in a world of %d",
			j, from, to, n, j, self, size)
	}
	v, err := decodeVector(b[nodeHdr:], 2)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster: node: rank %d's message: %w", j, err)
	}
	return v[0], v[1], nil
}

// Connect connects the queue pair to every rank j to remote[j], what rank j
// sent this one (remote[Rank()] is this rank's own entry, as Exchange
// returns it), and sets up the barrier. It follows LocalEndpoints. On
// error the node is unusable: close it.
func (n *Node) Connect(remote [][]byte) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.phase != 1 {
		return fmt.Errorf("%w: Connect must follow LocalEndpoints, once", ErrNodeState)
	}
	if len(remote) != n.size {
		return fmt.Errorf("cluster: node: connect: %d messages for a world of %d", len(remote), n.size)
	}
	peers := make([]peerInfo, n.size)
	for j, b := range remote {
		card, item, err := decodePeer(b, j, n.rank, n.size)
		if err == nil {
			peers[j], err = decodeCard(card, item, j, n.rank, n.size)
		}
		if err != nil {
			return err
		}
	}
	return n.connect(peers)
}

// ConnectCards connects the queue pair to every rank j with cards[j],
// rank j's card, and column[j*ItemSize:], its item for this rank, as
// ExchangeCards returns them (this rank's own card and item included),
// and sets up the barrier. It follows LocalCard. On error the node is
// unusable: close it.
func (n *Node) ConnectCards(cards [][]byte, column []byte) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.phase != 1 {
		return fmt.Errorf("%w: ConnectCards must follow LocalCard, once", ErrNodeState)
	}
	if len(cards) != n.size || len(column) != n.size*ItemSize {
		return fmt.Errorf("cluster: node: connect: %d cards and %d bytes of items for a world of %d (want %d and %d)",
			len(cards), len(column), n.size, n.size, n.size*ItemSize)
	}
	peers := make([]peerInfo, n.size)
	for j, c := range cards {
		var err error
		if peers[j], err = decodeCard(c, column[j*ItemSize:(j+1)*ItemSize], j, n.rank, n.size); err != nil {
			return err
		}
	}
	return n.connect(peers)
}

// connect brings the queue pairs and the barrier up; n.mu is held.
func (n *Node) connect(peers []peerInfo) error {
	eps := make([]verbs.Endpoint, n.size)
	infos := make([][]byte, n.size)
	data := make([][]byte, n.size)
	probes := make([]verbs.RemoteRegion, n.size)
	for j, p := range peers {
		eps[j], infos[j], data[j], probes[j] = p.ep, p.info, p.data, p.probe
	}
	if err := n.bar.setRemote(infos); err != nil {
		return fmt.Errorf("cluster: node: %w", err)
	}
	if err := n.mc.Connect(eps); err != nil {
		return fmt.Errorf("cluster: node: connect: %w", err)
	}
	n.peerData, n.probes = data, probes
	n.phase = 2
	return nil
}

// PeerData returns the application data rank j passed to LocalEndpoints
// (nil before Connect, or for an out-of-range j). The caller must not
// modify it.
func (n *Node) PeerData(j int) []byte {
	n.mu.Lock()
	defer n.mu.Unlock()
	if j < 0 || j >= len(n.peerData) {
		return nil
	}
	return n.peerData[j]
}

// Barrier returns once every rank of the group has entered it: the whole
// world when peers is nil, otherwise peers, a list of distinct ranks in
// ascending order that includes this rank. Every member must call Barrier
// with the same group, and ranks must enter the barriers of overlapping
// groups in the same order. Calls on one node are serialised.
//
// It fails with a *BarrierError: ErrNotInGroup or ErrBadGroup for a bad
// group; a timeout (wrapping verbs.ErrTimeout and ctx's error) when ctx
// ends first; a *RankError (wrapping ErrPeerLost) when a rank of the
// world failed. After a timeout the barrier is poisoned (ErrPoisoned)
// until every rank calls ResetBarrier; after a rank failed, for good.
//
// Failures reach every rank: the rank that sees a rank fail (its queue
// pair breaks: the process died, or stopped answering for longer than
// the queue pairs' transport timeout, verbs.QPSpec.Timeout × (RetryCount
// + 1)) writes the news into every other rank's flags, where every
// waiting rank sees it as it polls. A rank that waits for a peer for a
// while (beyond its first spins) checks that the peer is alive, with one
// small RDMA write every few milliseconds. So every barrier of every
// surviving rank fails, naming the rank that failed, within about the
// transport timeout plus a few one-way latencies, whatever its ctx.
func (n *Node) Barrier(ctx context.Context, peers []int) error {
	n.mu.Lock()
	phase := n.phase
	n.mu.Unlock()
	if phase != 2 {
		return fmt.Errorf("%w: barrier before Connect or after Close", ErrNodeState)
	}
	return n.bar.wait(ctx, peers)
}

// Share is a small all-to-all exchange: every rank of the world calls
// it, each with up to MaxShare bytes of its own (lengths may differ from
// rank to rank; 0 is allowed), and each gets every rank's contribution,
// indexed by rank (its own entry is a copy of data). It is collective:
// every rank calls it in the same order relative to its barriers (it
// ends with a world barrier). The result is the caller's, and so is data
// once Share returns.
//
// It uses one-sided RDMA writes only, no send or receive: rank j writes
// its contribution into box j of a mailbox area each rank registers with
// its barrier's flags, then the box's header (call number and length);
// each rank waits until the header of every peer's box here shows this
// call, copies the boxes out and joins a world barrier, after which the
// boxes may be reused. Cost at each rank: n−1 writes of the data and n−1
// writes of the 8-byte header, none awaited, then one barrier. Memory:
// n × (8 + MaxShare) bytes per rank, registered once.
//
// It fails like Barrier, with the cause wrapped in an error naming the
// call and the peer involved (errors.Is, errors.As; not a
// *BarrierError): a timeout, ctx's or the transport's, poisons the
// barrier until every rank calls ResetBarrier; a rank that failed makes
// every rank's Share fail with a *RankError naming it (the waits check
// for failures and probe the peer waited for, as a barrier does); a box
// holding a header no correct peer writes fails with ErrShareCorrupt,
// naming its rank (and poisons the barrier). data longer than MaxShare
// fails at once, with no effect: nothing is written and nothing is
// poisoned, so the caller may call Share again.
//
// Calls are serialised with each other and with Barrier on one node.
func (n *Node) Share(ctx context.Context, data []byte) ([][]byte, error) {
	n.mu.Lock()
	phase := n.phase
	n.mu.Unlock()
	if phase != 2 {
		return nil, fmt.Errorf("%w: share before Connect or after Close", ErrNodeState)
	}
	return n.bar.share(ctx, data)
}

// Err returns the failure of a rank of the world, a *RankError, once this
// rank saw one (in a barrier) or another rank told it of one, and nil
// otherwise. Once it is set, every barrier fails (ErrPoisoned wrapping
// it), for good: a world that lost a rank cannot be repaired. Safe for
// concurrent use, also during a barrier; nil after Close.
func (n *Node) Err() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.phase != 2 {
		return nil
	}
	return n.bar.worldErr()
}

// Fail records that rank failed, as the caller saw it (cause: typically
// the error of an operation on the queue pair to rank, or a wait for it
// that outlived its liveness bound), and tells every rank it can still
// reach, as a barrier does when it sees a rank fail: from then on Err
// returns the failure and every barrier of every rank fails, naming the
// rank. Layers above the node (package collective) call it so that a
// failure they see reaches the whole world. If a failure was recorded
// before (seen here or told by another rank), Fail keeps it and tells
// every rank about it again: a rank that gives up because of a failure
// it was told of calls Fail before it writes anything else to its peers,
// so that the news reaches each of them before any consequence (queue
// pairs deliver in order). It returns the failure recorded, a
// *RankError. Safe for concurrent use.
func (n *Node) Fail(rank int, cause error) error {
	n.mu.Lock()
	phase := n.phase
	n.mu.Unlock()
	if rank < 0 || rank >= n.size || rank == n.rank {
		return fmt.Errorf("cluster: node: Fail(%d): not a peer rank of a world of %d (this rank %d)", rank, n.size, n.rank)
	}
	if phase != 2 {
		return fmt.Errorf("%w: Fail before Connect or after Close", ErrNodeState)
	}
	if err := n.bar.worldErr(); err != nil {
		var re *RankError
		if errors.As(err, &re) {
			rank, cause = re.Rank, re.Err
		}
	}
	return n.bar.report(rank, cause)
}

// ResetBarrier clears a poisoned barrier. It is collective: after a
// barrier or a Share failed on any rank, every rank calls ResetBarrier
// before its next barrier or Share.
func (n *Node) ResetBarrier() error {
	if n.bar == nil {
		return fmt.Errorf("cluster: barrier: reset: %w (a zero Node: make one with Join or NewNode)", channel.ErrClosed)
	}
	return n.bar.reset()
}

// OnClose registers f to run when the node closes: after the barrier and
// the MultiChannel, before the protection domain and device the node owns
// (Join, FromEnv), in the reverse order of registration. Hand the node the
// memory regions registered in its PD this way (OnClose(mr.Close)); Join
// then also releases them when it fails. On a node that is closed (or
// closing) f runs at once, and its error is dropped: no Close is left to
// run it, or to report it.
func (n *Node) OnClose(f func() error) {
	if f == nil {
		return
	}
	n.mu.Lock()
	if n.phase != 3 {
		n.onClose = append(n.onClose, f)
		n.mu.Unlock()
		return
	}
	n.mu.Unlock()
	f()
}

// Close closes the barrier, the MultiChannel, runs the OnClose functions
// and, for a node built by Join or FromEnv, closes the protection domain
// and device it opened (memory regions registered in PD must be closed
// first, or handed to OnClose). Idempotent.
//
// Before it destroys the queue pairs, Close makes sure that what this
// rank posted has reached the peers: a barrier's last signals are
// unsignaled writes, which a rank leaving right after its last barrier
// would otherwise take down with its queue pairs, leaving its peers
// waiting in that barrier. It reads one word from every peer that is
// still connected and to which something it posted may still be in
// flight (RC completes requests in order, so the read's completion means
// every earlier write was delivered), waiting at most
// NodeOptions.CloseGrace.
func (n *Node) Close() error {
	n.closeOnce.Do(func() {
		n.mu.Lock()
		connected := n.phase == 2
		n.phase = 3
		owned, onClose := n.owned, n.onClose
		n.mu.Unlock()
		if connected {
			// Pass on news of a failure before the queue pairs go: a peer
			// whose queue pair to this rank then breaks must already know
			// what failed first (see barrier.settle).
			n.bar.spread()
		}
		if connected && n.grace > 0 {
			n.quiesce()
		}
		var errs []error
		if n.mc != nil { // not a zero Node
			errs = append(errs, n.bar.close(), n.mc.Close(), n.probe.Close())
		}
		for i := len(onClose) - 1; i >= 0; i-- {
			errs = append(errs, onClose[i]())
		}
		for _, c := range owned {
			errs = append(errs, c())
		}
		n.closeErr = errors.Join(errs...)
	})
	return n.closeErr
}

// quiescePeers returns the peers quiesce reads from: the healthy peers
// to which something this rank posted may still be in flight
// (channel.Channel.Posted). A rank of a large world talks to few of its
// peers (a barrier to O(log N)); reading from every peer connected
// soft0 to all of them as the world closed, N(N−1) handshakes at once
// (64 ranks on 2 CPUs: 8 s of a 31 s run).
func (n *Node) quiescePeers() []int {
	var peers []int
	for _, j := range n.mc.Peers() {
		if ch := n.mc.Peer(j); ch.Err() == nil && ch.Posted() > 0 {
			peers = append(peers, j)
		}
	}
	return peers
}

// quiesce reads a word from every healthy peer to which a write may still
// be in flight (see Close). Failures are ignored: a peer that is gone has
// nothing left to receive.
func (n *Node) quiesce() {
	var peers []int
	var srcs []verbs.RemoteAddr
	var bufs []verbs.SGE
	for _, j := range n.quiescePeers() {
		buf, err := n.probe.SGE(8*j, 8)
		if err != nil {
			continue
		}
		peers = append(peers, j)
		srcs = append(srcs, n.probes[j].At(0))
		bufs = append(bufs, buf)
	}
	if len(peers) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), n.grace)
	defer cancel()
	n.mc.GatherRead(ctx, peers, srcs, bufs)
}

// JoinOptions configure Join and FromEnv. The zero value is usable.
type JoinOptions struct {
	// Node configures the node.
	Node NodeOptions
	// Mode is the endpoint exchange mode (Join only; FromEnv always uses
	// Rendezvous). Default AllToAll.
	Mode Mode
	// Job identifies the job; ranks with another job id are refused.
	Job string
	// Token is the shared secret of the exchange (see ExchangeConfig).
	Token []byte
	// Device overrides the device of the configuration (or of the
	// environment). Empty: the configured one, or verbs.DefaultDevice.
	Device string
	// Listener, if set, is the listener of this rank's exchange address.
	// Join and FromEnv take it over: the exchange closes it, and so do
	// they when they fail, whatever the error.
	Listener net.Listener
	// MaxFrame bounds exchange frames (default DefaultMaxFrame).
	MaxFrame int
	// Prepare, if set, runs after the node is built and before the
	// exchange: register memory in n.PD() there (and hand it to
	// n.OnClose, so that a failed Join releases it too) and return the
	// bytes to publish to every peer (PeerData). If it fails, Join fails.
	Prepare func(n *Node) ([]byte, error)
}

// Join builds the node of rank from a network configuration: it opens the
// rank's device, allocates a protection domain, builds the node, exchanges
// endpoints with every rank over TCP and connects. The returned node owns
// the device and the PD (Close closes them). It fails, without hanging, by
// ctx's deadline when a rank is missing.
func Join(ctx context.Context, cfg *Config, rank int, opts JoinOptions) (*Node, error) {
	if cfg == nil {
		return nil, errors.New("cluster: join: nil config")
	}
	if err := cfg.Validate(); err != nil {
		if opts.Listener != nil {
			opts.Listener.Close()
		}
		return nil, err
	}
	if rank < 0 || rank >= cfg.Size() {
		if opts.Listener != nil {
			opts.Listener.Close()
		}
		return nil, fmt.Errorf("cluster: join: rank %d outside the configuration's [0, %d)", rank, cfg.Size())
	}
	dev := opts.Device
	if dev == "" {
		dev = cfg.Hosts[rank].Device
	}
	xc := ExchangeConfig{Rank: rank, Size: cfg.Size(), Mode: opts.Mode, Addrs: cfg.Addrs()}
	return join(ctx, dev, xc, opts)
}

// join opens dev and builds, exchanges and connects a node.
func join(ctx context.Context, dev string, xc ExchangeConfig, opts JoinOptions) (_ *Node, err error) {
	xc.Job, xc.Token, xc.Listener, xc.MaxFrame = opts.Job, opts.Token, opts.Listener, opts.MaxFrame
	defer func() {
		if err != nil && xc.Listener != nil {
			xc.Listener.Close() // Exchange closes it; closing twice is harmless
		}
	}()
	vc, err := verbs.Open(dev)
	if err != nil {
		return nil, fmt.Errorf("cluster: join: %w", err)
	}
	pd, err := vc.AllocPD()
	if err != nil {
		vc.Close()
		return nil, fmt.Errorf("cluster: join: %w", err)
	}
	n, err := NewNode(pd, xc.Rank, xc.Size, opts.Node)
	if err != nil {
		pd.Close()
		vc.Close()
		return nil, err
	}
	n.owned = []func() error{pd.Close, vc.Close}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	var data []byte
	if opts.Prepare != nil {
		if data, err = opts.Prepare(n); err != nil {
			return nil, fmt.Errorf("cluster: join: prepare: %w", err)
		}
	}
	card, items, err := n.LocalCard(data)
	if err != nil {
		return nil, err
	}
	cards, column, err := ExchangeCards(ctx, xc, card, items)
	if err != nil {
		return nil, err
	}
	if err := n.ConnectCards(cards, column); err != nil {
		return nil, err
	}
	return n, nil
}
