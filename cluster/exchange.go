package cluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/goverbs/verbs/internal/netsrc"
)

// Exchange errors (besides the protocol errors of frame.go).
var (
	// ErrPeerMissing: peers did not connect (or could not be reached)
	// before the context ended. The error also wraps the context's error
	// and, if connections were refused meanwhile, the last reason.
	ErrPeerMissing = errors.New("cluster: exchange: peers missing")
	// ErrPeerLost: a peer failed: in the exchange, its connection failed
	// after its handshake (the peer process died, or closed the
	// connection); after it, its queue pair broke or it stopped answering
	// (see RankError).
	ErrPeerLost = errors.New("cluster: peer lost")
	// ErrAborted: the root aborted the rendezvous (a rank is missing, or
	// failed); the error carries the root's reason.
	ErrAborted = errors.New("cluster: exchange: aborted by the root")
)

// Mode is how ranks exchange their endpoints.
type Mode int

const (
	// AllToAll: every pair of ranks connects directly (rank i dials every
	// rank below it; every rank but the last listens). N(N-1)/2
	// connections; each carries only what the two ranks need from each
	// other.
	AllToAll Mode = iota
	// Rendezvous: every rank connects to rank 0, which gathers what each
	// rank has for every other and sends each rank its share. N-1
	// connections, for large worlds; only rank 0 listens.
	Rendezvous
)

func (m Mode) String() string {
	switch m {
	case AllToAll:
		return "all-to-all"
	case Rendezvous:
		return "rendezvous"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// ParseMode parses "all-to-all" or "rendezvous".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "all-to-all", "alltoall", "":
		return AllToAll, nil
	case "rendezvous", "root":
		return Rendezvous, nil
	}
	return 0, fmt.Errorf("cluster: unknown exchange mode %q (want all-to-all or rendezvous)", s)
}

// ExchangeConfig configures Exchange. Rank, Size and the addresses the
// mode needs are required; the zero value of every other field is usable.
type ExchangeConfig struct {
	Rank, Size int
	Mode       Mode
	// Addrs is the exchange address (host:port) of every rank, indexed by
	// rank (AllToAll). Rendezvous needs only rank 0's: Root, or Addrs[0].
	Addrs []string
	// Root is rank 0's address in the Rendezvous mode (default Addrs[0]).
	Root string
	// Listen is the address this rank listens on (default: its own
	// address). Ignored when Listener is set.
	Listen string
	// Listener, if set, is used instead of listening on Listen (for
	// example a listener inherited from a launcher). Exchange closes it.
	Listener net.Listener
	// Job identifies the job: ranks of other jobs are refused.
	Job string
	// Token is the secret the ranks share: they prove it to each other
	// (it never crosses the wire) and every connection's encryption keys
	// derive from it. Ranks with different tokens refuse each other. An
	// empty token still detects accidents (other jobs, other programs on
	// the port) but authenticates nothing, and the keys derive from
	// public values: nothing is confidential (see the package
	// documentation). Exchange logs a warning, once per process, when it
	// runs without a token on an address that is not loopback.
	Token []byte
	// MaxFrame bounds the size of one message (an entry, or in the
	// Rendezvous mode a rank's vector of entries); larger messages are
	// refused as soon as a record would exceed it. Default
	// DefaultMaxFrame.
	MaxFrame int
	// MaxStrangers bounds the connections a listening rank holds before
	// they authenticate, and MaxStrangersPerHost those from one source
	// address (and half of MaxStrangers those from one IPv6 /64
	// network, at least MaxStrangersPerHost: a host given a /64 has 2^64
	// addresses to connect from; link-local and loopback addresses
	// excepted). Over a limit the oldest such connection (from that
	// address or network, for the others) is dropped: a real peer completes its
	// handshake in a round trip, and one that is dropped dials again (a
	// large world whose ranks all dial one root at once retries less
	// with MaxStrangers near its size). The limits bound what strangers
	// cost: a goroutine, a socket and a few hundred bytes each.
	// Defaults DefaultMaxStrangers and DefaultMaxStrangersPerHost.
	MaxStrangers, MaxStrangersPerHost int
	// HelloTimeout bounds the handshake of an accepted connection, and
	// the context's deadline bounds it too (a dialer waits twice as long
	// for the answers before it dials again). Default
	// DefaultHelloTimeout.
	HelloTimeout time.Duration
	// MinBackoff and MaxBackoff bound the delay between attempts to
	// connect to a peer that is not listening yet. Defaults 10ms and
	// 500ms. Attempts go on until the context ends.
	MinBackoff, MaxBackoff time.Duration
}

// Defaults of ExchangeConfig.
const (
	DefaultMaxStrangers        = 128
	DefaultMaxStrangersPerHost = 32
	DefaultHelloTimeout        = 2 * time.Second
)

// ExchangeError is the error of Exchange: this rank, the peer concerned
// (-1 if none), the peers that never connected, and the cause. Refused
// counts the connections refused during the handshake (another token,
// job, version, or garbage), Dropped those dropped before their
// handshake ended because they exceeded MaxStrangers or
// MaxStrangersPerHost, or HelloTimeout.
type ExchangeError struct {
	Rank    int
	Peer    int
	Missing []int
	Refused int
	Dropped int
	Err     error
}

func (e *ExchangeError) Error() string {
	s := fmt.Sprintf("cluster: exchange: rank %d", e.Rank)
	if e.Peer >= 0 {
		s += fmt.Sprintf(": peer %d", e.Peer)
	}
	if len(e.Missing) > 0 {
		s += fmt.Sprintf(": ranks %v did not connect", e.Missing)
	}
	s += ": " + e.Err.Error()
	if e.Refused > 0 || e.Dropped > 0 {
		s += fmt.Sprintf(" (unauthenticated connections: %d refused, %d dropped over the limits or the hello timeout)", e.Refused, e.Dropped)
	}
	return s
}

func (e *ExchangeError) Unwrap() error { return e.Err }

// Exchange sends out[j] to rank j, for every rank j, and returns in, where
// in[j] is what rank j sent to this rank (in[Rank] is out[Rank]). Every
// rank of the world must call it with the same Size, Mode, Job and Token.
//
// It blocks until every share has arrived or ctx ends: a missing or dead
// rank makes it fail (with ErrPeerMissing, ErrPeerLost or ErrAborted)
// by ctx's deadline at the latest, never hang. Connections that fail the
// handshake (wrong token, job or rank) are refused and dropped; they do
// not end the exchange, but the error at the deadline names the reason
// and counts them.
func Exchange(ctx context.Context, cfg ExchangeConfig, out [][]byte) ([][]byte, error) {
	x, err := newExchange(cfg, out)
	if err != nil {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return nil, err
	}
	if cfg.Size == 1 {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return [][]byte{out[0]}, nil
	}
	x.warnNoToken()
	if cfg.Mode == Rendezvous {
		if cfg.Rank == 0 {
			return x.root(ctx)
		}
		return x.leaf(ctx)
	}
	return x.allToAll(ctx)
}

// ExchangeCards is Exchange for data most of which is the same for every
// peer: card, this rank's card, which every rank receives, and items, one
// item of w bytes for each rank (items[j*w:(j+1)*w] for rank j; w is
// len(items)/Size, from 1 to 255, the same for every rank). It returns
// every rank's card, indexed by rank (cards[Rank] is card), and column,
// where column[j*w:(j+1)*w] is rank j's item for this rank (at Rank, this
// rank's own item for itself). Join and FromEnv exchange a Node's card
// (LocalCard) this way.
//
// In the Rendezvous mode a rank sends the root its card once and its N
// items, instead of N entries that each repeat what is the same for all
// peers, and the root sends each rank the table of cards and its column
// of items: the root receives and sends N cards and N² items, where
// Exchange moves N² entries each way. In the AllToAll mode a pair of
// ranks exchanges a card and an item each way.
//
// Every rank must call ExchangeCards with the same item size: a rank
// that calls Exchange, or uses another item size, is refused by the
// handshake with ErrModeMismatch (both fail at once). A card is at most
// (MaxFrame−4)/Size−4 bytes, so that the table of cards fits in a
// message (with the default MaxFrame, 16 KiB for 4 096 ranks); a larger
// card fails with ErrFrameTooLarge, here or, sent by a peer, at the root
// (or at the peer, all-to-all). It blocks and fails like Exchange.
func ExchangeCards(ctx context.Context, cfg ExchangeConfig, card, items []byte) (cards [][]byte, column []byte, err error) {
	x, err := newCardExchange(cfg, card, items)
	if err != nil {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return nil, nil, err
	}
	if cfg.Size == 1 {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return [][]byte{card}, items, nil
	}
	x.warnNoToken()
	if cfg.Mode == Rendezvous {
		if cfg.Rank == 0 {
			return x.rootCards(ctx)
		}
		return x.leafCards(ctx)
	}
	in, err := x.allToAll(ctx)
	if err != nil {
		return nil, nil, err
	}
	w := x.items
	cards = make([][]byte, cfg.Size)
	column = make([]byte, cfg.Size*w)
	for j, b := range in {
		if j == cfg.Rank {
			cards[j] = card
			copy(column[j*w:], items[j*w:(j+1)*w])
			continue
		}
		c, it, err := decodeCardShare(b, w, x.maxCard)
		if err != nil {
			return nil, nil, x.fail(j, nil, err)
		}
		cards[j] = c
		copy(column[j*w:], it)
	}
	return cards, column, nil
}

// newCardExchange checks and prepares an ExchangeCards.
func newCardExchange(cfg ExchangeConfig, card, items []byte) (*exchange, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("cluster: exchange: "+format, args...)
	}
	if cfg.Size < 1 || cfg.Size > MaxWorldSize {
		return nil, bad("world size %d (want 1 to %d)", cfg.Size, MaxWorldSize)
	}
	w := len(items) / cfg.Size
	if w < 1 || w > 255 || len(items) != w*cfg.Size {
		return nil, bad("%d bytes of items for a world of %d ranks (want 1 to 255 bytes per rank)", len(items), cfg.Size)
	}
	out := make([][]byte, cfg.Size)
	if cfg.Mode == AllToAll {
		for j := range out {
			if j != cfg.Rank {
				out[j] = encodeCardShare(card, items[j*w:(j+1)*w])
			}
		}
	}
	x, err := newExchange(cfg, out)
	if err != nil {
		return nil, err
	}
	x.items, x.card, x.itemBuf = w, card, items
	if x.maxCard = maxCardLen(x.max, cfg.Size, w); x.maxCard < 0 {
		return nil, fmt.Errorf("cluster: exchange: items: %w: %d ranks' items of %d bytes do not fit in MaxFrame (%d bytes)", ErrFrameTooLarge, cfg.Size, w, x.max)
	}
	if len(card) > x.maxCard {
		return nil, fmt.Errorf("cluster: exchange: card: %w: %d bytes (at most %d for %d ranks)", ErrFrameTooLarge, len(card), x.maxCard, cfg.Size)
	}
	// A share is a vector of the card and the items: to the root Size
	// items, to an all-to-all peer one.
	x.shareMax = 4 + 4 + x.maxCard + 4 + w
	if cfg.Mode == Rendezvous {
		x.shareMax = 4 + 4 + x.maxCard + 4 + cfg.Size*w
	}
	return x, nil
}

type exchange struct {
	cfg     ExchangeConfig
	out     [][]byte
	items   int    // ExchangeCards: the item size w (0: Exchange)
	card    []byte // ExchangeCards: this rank's card
	itemBuf []byte // ExchangeCards: this rank's items, w bytes per rank
	maxCard int    // ExchangeCards: the largest card (maxCardLen)
	max     int
	// shareMax bounds a peer's share, the message a rank receives from
	// a peer first (the rendezvous root: every rank's; all-to-all: every
	// peer's): max for Exchange; for ExchangeCards the size of a card
	// share with the largest card (a root's read stops there, not at
	// MaxFrame).
	shareMax   int
	minB, maxB time.Duration
	helloT     time.Duration // HelloTimeout
	mk         []byte        // key of the handshake MACs
	job        [tagLen]byte  // the job id as it travels
}

func newExchange(cfg ExchangeConfig, out [][]byte) (*exchange, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("cluster: exchange: "+format, args...)
	}
	switch {
	case cfg.Size < 1 || cfg.Size > MaxWorldSize:
		return nil, bad("world size %d (want 1 to %d)", cfg.Size, MaxWorldSize)
	case cfg.Rank < 0 || cfg.Rank >= cfg.Size:
		return nil, bad("rank %d outside [0, %d)", cfg.Rank, cfg.Size)
	case len(out) != cfg.Size:
		return nil, bad("%d outgoing entries for world size %d", len(out), cfg.Size)
	case len(cfg.Job) > maxJobLen:
		return nil, bad("job id of %d bytes (at most %d)", len(cfg.Job), maxJobLen)
	case cfg.Mode != AllToAll && cfg.Mode != Rendezvous:
		return nil, bad("unknown mode %v", cfg.Mode)
	case cfg.MaxFrame < 0:
		return nil, bad("negative MaxFrame")
	case cfg.MaxStrangers < 0 || cfg.MaxStrangersPerHost < 0:
		return nil, bad("negative MaxStrangers or MaxStrangersPerHost")
	case cfg.HelloTimeout < 0:
		return nil, bad("negative HelloTimeout")
	}
	if cfg.Mode == AllToAll && len(cfg.Addrs) != cfg.Size && cfg.Size > 1 {
		return nil, bad("%d addresses for world size %d", len(cfg.Addrs), cfg.Size)
	}
	if cfg.Mode == Rendezvous && cfg.Root == "" {
		if len(cfg.Addrs) == 0 && cfg.Size > 1 {
			return nil, bad("rendezvous without a root address")
		}
		if len(cfg.Addrs) > 0 {
			cfg.Root = cfg.Addrs[0]
		}
	}
	x := &exchange{cfg: cfg, out: out, max: cfg.MaxFrame, minB: cfg.MinBackoff, maxB: cfg.MaxBackoff, helloT: cfg.HelloTimeout}
	if x.max == 0 {
		x.max = DefaultMaxFrame
	}
	x.shareMax = x.max
	if x.minB <= 0 {
		x.minB = 10 * time.Millisecond
	}
	if x.maxB < x.minB {
		x.maxB = max(500*time.Millisecond, x.minB)
	}
	if x.helloT == 0 {
		x.helloT = DefaultHelloTimeout
	}
	if x.cfg.MaxStrangers == 0 {
		x.cfg.MaxStrangers = DefaultMaxStrangers
	}
	if x.cfg.MaxStrangersPerHost == 0 {
		x.cfg.MaxStrangersPerHost = DefaultMaxStrangersPerHost
	}
	if cfg.Mode == Rendezvous {
		if n := vectorSize(out); n > x.max {
			return nil, fmt.Errorf("cluster: exchange: entries: %w: %d bytes (at most %d)", ErrFrameTooLarge, n, x.max)
		}
	}
	for j, o := range out {
		if n := wireSize(len(o)); n > x.max {
			return nil, fmt.Errorf("cluster: exchange: entry for rank %d: %w: %d bytes (at most %d)", j, ErrFrameTooLarge, n, x.max)
		}
	}
	x.mk = macKey(cfg.Token)
	x.job = jobTag(x.mk, cfg.Job)
	return x, nil
}

// warnedNoToken makes the warning of warnNoToken once per process.
var warnedNoToken sync.Once

// warnNoToken warns, once per process, that an exchange without a token
// on an address that is not loopback is open to anyone who can reach it,
// and readable by anyone who sees its traffic.
func (x *exchange) warnNoToken() {
	if len(x.cfg.Token) != 0 {
		return
	}
	for _, a := range x.addrs() {
		if !isLoopback(a) {
			warnedNoToken.Do(func() {
				slog.Warn("cluster: exchange without a token on a non-loopback address: any host that reaches it can join, "+
					"and its endpoints are not confidential (set ExchangeConfig.Token, or GOVERBS_TOKEN)", "addr", a, "rank", x.cfg.Rank)
			})
			return
		}
	}
}

// addrs lists the addresses this rank listens on or dials.
func (x *exchange) addrs() []string {
	var a []string
	r := x.cfg.Rank
	listens := r == 0 || (x.cfg.Mode == AllToAll && r < x.cfg.Size-1)
	switch {
	case !listens:
	case x.cfg.Listener != nil:
		a = append(a, x.cfg.Listener.Addr().String())
	case x.cfg.Listen != "":
		a = append(a, x.cfg.Listen)
	case x.cfg.Mode == Rendezvous:
		a = append(a, x.cfg.Root)
	default:
		a = append(a, x.cfg.Addrs[r])
	}
	if x.cfg.Mode == Rendezvous {
		if r != 0 {
			a = append(a, x.cfg.Root)
		}
		return a
	}
	return append(a, x.cfg.Addrs[:r]...)
}

// isLoopback reports whether addr (host:port) is a loopback address or
// localhost; a wildcard address is not.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	if i := strings.IndexByte(host, '%'); i >= 0 {
		host = host[:i]
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func (x *exchange) fail(peer int, missing []int, err error) error {
	return &ExchangeError{Rank: x.cfg.Rank, Peer: peer, Missing: missing, Err: err}
}

func (x *exchange) listen() (net.Listener, error) {
	if x.cfg.Listener != nil {
		return x.cfg.Listener, nil
	}
	addr := x.cfg.Listen
	if addr == "" {
		if x.cfg.Mode == Rendezvous {
			addr = x.cfg.Root
		} else {
			addr = x.cfg.Addrs[x.cfg.Rank]
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, x.fail(-1, nil, fmt.Errorf("listen: %w", err))
	}
	return ln, nil
}

// conn is an authenticated connection to one peer.
type conn struct {
	c         net.Conn
	peer      int
	s         *session
	stopWatch func() bool
}

// guard closes c when ctx ends, so that every blocked read and write
// returns.
func guard(ctx context.Context, c net.Conn) func() bool {
	return context.AfterFunc(ctx, func() { c.Close() })
}

// send sends a data message to k's peer.
func (x *exchange) send(k *conn, payload []byte) error {
	return k.s.writeMsg(k.c, recData, payload)
}

// recv reads the next message of an established connection: a data
// message of at most MaxFrame bytes. An abort becomes ErrAborted.
func (x *exchange) recv(ctx context.Context, k *conn) ([]byte, error) {
	return x.recvMax(ctx, k, x.max)
}

// recvShare reads a peer's share (see shareMax).
func (x *exchange) recvShare(ctx context.Context, k *conn) ([]byte, error) {
	return x.recvMax(ctx, k, x.shareMax)
}

// checkShare checks a peer's share in the all-to-all mode as it arrives,
// so that a malformed one fails the exchange at once (naming the peer),
// not once every other peer has come: for ExchangeCards, a card share
// of one item; anything for Exchange.
func (x *exchange) checkShare(data []byte) error {
	if x.items == 0 {
		return nil
	}
	_, _, err := decodeCardShare(data, x.items, x.maxCard)
	return err
}

// recvMax is recv of a message of at most max bytes.
func (x *exchange) recvMax(ctx context.Context, k *conn, max int) ([]byte, error) {
	typ, msg, err := k.s.readMsg(k.c, max)
	if err != nil {
		return nil, x.ioErr(ctx, err)
	}
	if typ == recAbort {
		return nil, fmt.Errorf("%w: %s", ErrAborted, sanitize(string(msg)))
	}
	return msg, nil
}

// ioErr describes a read or write failure on an established connection.
func (x *exchange) ioErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", context.Cause(ctx), err)
	}
	if !isIOErr(err) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrPeerLost, err)
}

func newNonce() [nonceLen]byte {
	var n [nonceLen]byte
	rand.Read(n[:]) // never fails (crypto/rand)
	return n
}

// checkHello validates an authenticated hello from peer (-1: any) to
// this rank. Its errors carry nothing secret: they go back to the peer in
// a reject.
func (x *exchange) checkHello(h *hello, peer int) error {
	switch {
	case h.job != x.job:
		return fmt.Errorf("%w: the peer's job tag is %x, this rank's %x", ErrJobMismatch, h.job[:4], x.job[:4])
	case h.mode != x.cfg.Mode:
		return fmt.Errorf("%w: rank %d uses the %v exchange, rank %d the %v exchange (every rank must use the same mode)",
			ErrModeMismatch, h.from, h.mode, x.cfg.Rank, x.cfg.Mode)
	case int(h.items) != x.items:
		return fmt.Errorf("%w: rank %d exchanges %s, rank %d %s (every rank must call the same function: Join and FromEnv use ExchangeCards)",
			ErrModeMismatch, h.from, shape(int(h.items)), x.cfg.Rank, shape(x.items))
	case h.size != uint32(x.cfg.Size):
		return fmt.Errorf("%w: rank %d has a world of %d ranks, rank %d a world of %d", ErrSizeMismatch, h.from, h.size, x.cfg.Rank, x.cfg.Size)
	case h.to != uint32(x.cfg.Rank):
		return fmt.Errorf("%w: hello for rank %d reached rank %d", ErrBadFrame, h.to, x.cfg.Rank)
	case h.from >= uint32(x.cfg.Size) || h.from == uint32(x.cfg.Rank):
		return fmt.Errorf("%w: hello from rank %d", ErrBadFrame, h.from)
	case peer >= 0 && h.from != uint32(peer):
		return fmt.Errorf("%w: hello from rank %d, expected %d", ErrBadFrame, h.from, peer)
	}
	return nil
}

// shape describes the data of an exchange whose items are w bytes (0:
// entries).
func shape(w int) string {
	if w == 0 {
		return "one entry per rank (Exchange)"
	}
	return fmt.Sprintf("a card and %d-byte items (ExchangeCards)", w)
}

// mismatch reports whether err is a disagreement between two members of
// the job (their hellos authenticated): a configuration error that no
// later connection can repair.
func mismatch(err error) bool {
	return errors.Is(err, ErrModeMismatch) || errors.Is(err, ErrSizeMismatch)
}

// local adds to a handshake error what only this rank should know.
func (x *exchange) local(err error) error {
	if errors.Is(err, ErrJobMismatch) {
		return fmt.Errorf("%w (this rank's job is %q)", err, x.cfg.Job)
	}
	return err
}

// errDropped: a stranger dropped over the limits of MaxStrangers.
var errDropped = errors.New("dropped before its handshake ended (over MaxStrangers or MaxStrangersPerHost, or past HelloTimeout)")

// accept runs the acceptor side of a handshake on c, registered as the
// stranger st of g: it reads the peer's hello, answers with its own,
// checks the peer's proof, then (the peer authenticated) promotes it out
// of the strangers, checks it with ok (which claims the peer) and accepts
// it. Nothing but fixed-size control messages is read before the proof.
// A refused connection is answered with a reject; the error says why.
// The error comes with a conn only if the peer was claimed.
func (x *exchange) accept(ctx context.Context, c net.Conn, g *gate, st *stranger, ok func(peer int) error) (*conn, error) {
	// A peer says hello at once and proves itself one round trip later:
	// a connection that does not is not one.
	deadline := time.Now().Add(x.helloT)
	if d, has := ctx.Deadline(); has && d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	var buf [rejectLen]byte
	var h *hello
	var dh, ah [helloLen]byte
	var disagree error // the peer's mode or world size is not ours
	b, err := readControl(c, &buf, msgHello)
	if err == nil {
		copy(dh[:], b)
		if h, err = decodeHello(dh[:], x.mk, nil); err == nil {
			if err = x.checkHello(h, -1); mismatch(err) {
				// Finish the handshake: once the peer proved it knows
				// the token, the disagreement ends the exchange here
				// too (and a replayed hello cannot).
				disagree, err = err, nil
			}
		}
	}
	if err == nil {
		ah = encodeHello(&hello{mode: x.cfg.Mode, items: uint8(x.items), from: uint32(x.cfg.Rank), to: h.from, size: uint32(x.cfg.Size), job: x.job, nonce: newNonce()}, x.mk, dh[:])
		if _, err = c.Write(ah[:]); err == nil {
			if b, err = readControl(c, &buf, msgProof); err == nil {
				err = checkProof(b, x.mk, dh[:], ah[:])
			}
		}
	}
	if err == nil && disagree != nil {
		rej := encodeReject(&reject{from: uint32(x.cfg.Rank), to: h.from, size: uint32(x.cfg.Size), code: rejectCode(disagree), text: disagree.Error()})
		c.Write(rej[:])
		return nil, &peerErr{int(h.from), fmt.Errorf("connection from %s: %w", c.RemoteAddr(), disagree)}
	}
	if err == nil && !g.promote(st) {
		err = errDropped
	}
	if err == nil {
		err = ok(int(h.from))
	}
	if err != nil {
		var from uint32
		if h != nil {
			from = h.from
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			g.drop(st)
		}
		if g.dropped(st) && !errors.Is(err, errDropped) {
			err = fmt.Errorf("%w (%w)", errDropped, err)
		}
		if !isIOErr(err) {
			rej := encodeReject(&reject{from: uint32(x.cfg.Rank), to: from, size: uint32(x.cfg.Size), code: rejectCode(err), text: err.Error()})
			c.Write(rej[:])
		}
		err = x.local(err)
		if errors.Is(err, errDropped) {
			return nil, fmt.Errorf("connection from %s %w", c.RemoteAddr(), err)
		}
		if h != nil && !errors.Is(err, ErrAuth) {
			return nil, fmt.Errorf("connection from %s (claiming rank %d) refused: %w", c.RemoteAddr(), h.from, err)
		}
		return nil, fmt.Errorf("connection from %s refused: %w", c.RemoteAddr(), err)
	}
	c.SetDeadline(time.Time{})
	d2a, a2d := sessionKeys(x.cfg.Token, dh[:], ah[:])
	k := &conn{c: c, peer: int(h.from), s: newSession(a2d, d2a)}
	a := acceptMsg()
	if _, err := c.Write(a[:]); err != nil {
		return k, x.ioErr(ctx, err)
	}
	return k, nil
}

func isIOErr(err error) bool {
	return !(errors.Is(err, ErrAuth) || errors.Is(err, ErrBadFrame) || errors.Is(err, ErrFrameTooLarge) ||
		errors.Is(err, ErrVersion) || errors.Is(err, ErrJobMismatch))
}

// errRetry marks a dial attempt worth repeating.
type errRetry struct{ err error }

func (e errRetry) Error() string { return e.err.Error() }
func (e errRetry) Unwrap() error { return e.err }

// dial connects to peer at addr and runs the dialer side of the
// handshake, retrying with backoff while the peer is not there yet (or
// dropped the connection before accepting it).
func (x *exchange) dial(ctx context.Context, peer int, addr string) (*conn, error) {
	var d net.Dialer
	backoff := x.minB
	var last error
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			stop := guard(ctx, c)
			k, err := x.handshake(ctx, c, peer)
			if err == nil {
				k.stopWatch = stop
				return k, nil
			}
			stop()
			c.Close()
			var r errRetry
			if !errors.As(err, &r) {
				return nil, err
			}
			last = r.err
		} else {
			last = err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: could not reach rank %d at %s: %w (last attempt: %w)", ErrPeerMissing, peer, addr, context.Cause(ctx), last)
		}
		t := time.NewTimer(backoff/2 + mrand.N(backoff/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%w: could not reach rank %d at %s: %w (last attempt: %w)", ErrPeerMissing, peer, addr, context.Cause(ctx), last)
		case <-t.C:
		}
		backoff = min(2*backoff, x.maxB)
	}
}

// handshake runs the dialer side of the handshake on a fresh connection:
// hello, the acceptor's hello (which proves it knows the token), our
// proof, and the acceptor's verdict. Until the acceptor accepts, an I/O
// error is worth a retry: the acceptor may have dropped us as a stranger.
func (x *exchange) handshake(ctx context.Context, c net.Conn, peer int) (*conn, error) {
	c.SetDeadline(time.Now().Add(2 * x.helloT))
	retry := func(err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("%w: rank %d: %w (%w)", ErrPeerMissing, peer, context.Cause(ctx), err)
		}
		if isIOErr(err) {
			// Closed without a word: a listener that went away, one that
			// is not ours yet, or one that dropped us. Try again.
			return errRetry{err}
		}
		if errors.Is(err, ErrVersion) {
			return fmt.Errorf("rank %d answered with a bad message: %w", peer, err)
		}
		return fmt.Errorf("something at %s answered, but does not speak the goverbs exchange protocol (is it rank %d's exchange port?): %w",
			c.RemoteAddr(), peer, err)
	}
	dh := encodeHello(&hello{mode: x.cfg.Mode, items: uint8(x.items), from: uint32(x.cfg.Rank), to: uint32(peer), size: uint32(x.cfg.Size), job: x.job, nonce: newNonce()}, x.mk, nil)
	if _, err := c.Write(dh[:]); err != nil {
		return nil, errRetry{err}
	}
	var buf [rejectLen]byte
	b, err := readControl(c, &buf, msgHello, msgReject)
	if err != nil {
		if isIOErr(err) && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, syscall.ECONNRESET) {
			// Connected and said hello, and heard nothing back.
			err = &noAnswer{addr: c.RemoteAddr().String(), err: err}
		}
		return nil, retry(err)
	}
	if b[5] == msgReject {
		return nil, x.rejected(b)
	}
	var ah [helloLen]byte
	copy(ah[:], b)
	h, err := decodeHello(ah[:], x.mk, dh[:])
	if err != nil {
		return nil, fmt.Errorf("rank %d's answer: %w", peer, err)
	}
	p := proof(x.mk, dh[:], ah[:])
	if err := x.checkHello(h, peer); err != nil {
		if mismatch(err) {
			// Prove ourselves all the same, so that the acceptor, a
			// member of the job that disagrees, fails now too.
			c.Write(p[:])
		}
		return nil, fmt.Errorf("rank %d's answer: %w", peer, x.local(err))
	}
	if _, err := c.Write(p[:]); err != nil {
		return nil, retry(err)
	}
	// The acceptor proved it knows the token: wait for its verdict as
	// long as the context allows. An acceptor that claimed this rank and
	// accepted it takes a connection closed now for a rank that died
	// after its handshake (ErrPeerLost), so giving up on a slow one (a
	// loaded host) would end the exchange. One that drops us closes the
	// connection: we dial again.
	c.SetDeadline(time.Time{})
	if b, err = readControl(c, &buf, msgAccept, msgReject); err != nil {
		return nil, retry(err)
	}
	if b[5] == msgReject {
		return nil, x.rejected(b)
	}
	c.SetDeadline(time.Time{})
	d2a, a2d := sessionKeys(x.cfg.Token, dh[:], ah[:])
	return &conn{c: c, peer: peer, s: newSession(d2a, a2d)}, nil
}

// noAnswer: a dialer connected and said hello, and the listener did not
// answer (before the handshake's deadline, or the context's end).
type noAnswer struct {
	addr string
	err  error
}

func (e *noAnswer) Error() string {
	return fmt.Sprintf("something at %s accepted the connection but did not answer the hello (%v): "+
		"it does not speak the goverbs exchange protocol, or is too busy to", e.addr, e.err)
}

func (e *noAnswer) Unwrap() error { return e.err }

// rejected is the error for a reject b.
func (x *exchange) rejected(b []byte) error {
	r, err := decodeReject(b)
	if err != nil {
		return fmt.Errorf("a bad reject: %w", err)
	}
	return x.local(rejectError(r))
}

// state collects the shares of an exchange.
type state struct {
	mu        sync.Mutex
	in        [][]byte
	have      []bool
	claimed   []bool
	left      int
	err       error // first fatal error
	rejected  error // last refused connection
	unreached error // why the last dial that the context ended failed
	refused   int   // connections refused during their handshake
	done      chan struct{}
	gate      *gate
}

func newState(size, self int, expect func(int) bool) *state {
	s := &state{in: make([][]byte, size), have: make([]bool, size), claimed: make([]bool, size), done: make(chan struct{})}
	for j := range size {
		if expect(j) {
			s.left++
		} else {
			s.claimed[j] = true
		}
	}
	if s.left == 0 {
		close(s.done)
	}
	return s
}

func (s *state) claim(peer int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.claimed[peer] {
		return fmt.Errorf("%w: rank %d is not expected to connect here, or already did", ErrBadFrame, peer)
	}
	s.claimed[peer] = true
	return nil
}

func (s *state) put(peer int, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.have[peer] || s.err != nil {
		return
	}
	s.in[peer], s.have[peer] = data, true
	s.left--
	if s.left == 0 {
		close(s.done)
	}
}

func (s *state) fatal(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err == nil && s.left > 0 {
		s.err = err
		close(s.done)
	}
}

// listenerGone fails the exchange with err, the listener's end, if a
// rank that connects to this one (from reports whether rank j does) has
// not been claimed yet: it can no longer connect.
func (s *state) listenerGone(err error, from func(j int) bool) {
	s.mu.Lock()
	var waiting []int
	for j, c := range s.claimed {
		if from(j) && !c {
			waiting = append(waiting, j)
		}
	}
	s.mu.Unlock()
	if len(waiting) > 0 {
		s.fatal(fmt.Errorf("%w, and ranks %v had still to connect", err, waiting))
	}
}

// reject records a refused connection. A refusal for a protocol reason
// (token, job, rank...) is kept over a later one for an I/O error (a
// connection closed before its hello). Dropped strangers are counted by
// the gate, not here.
func (s *state) reject(err error) {
	s.mu.Lock()
	if !errors.Is(err, errDropped) {
		s.refused++
	}
	if s.rejected == nil || !isIOErr(err) || isIOErr(s.rejected) {
		s.rejected = err
	}
	s.mu.Unlock()
}

// wait waits for every share, a fatal error, or the end of ctx.
func (s *state) wait(ctx context.Context, x *exchange) error {
	select {
	case <-s.done:
	case <-ctx.Done():
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var xe *ExchangeError
	missing := func() []int {
		var m []int
		for j, ok := range s.have {
			if !ok && j != x.cfg.Rank {
				m = append(m, j)
			}
		}
		return m
	}
	if s.err != nil {
		var pe *peerErr
		if errors.As(s.err, &pe) {
			xe = &ExchangeError{Rank: x.cfg.Rank, Peer: pe.peer, Err: pe.err}
			if m := missing(); len(m) > 0 && errors.Is(pe.err, ErrPeerLost) {
				// A rank that left while others had still to join may
				// have died, or given up waiting for them (its deadline
				// is this one's): both are said.
				xe.Err = fmt.Errorf("%w (while ranks %v had still to join: %w)", pe.err, m, ErrPeerMissing)
			}
		} else {
			xe = &ExchangeError{Rank: x.cfg.Rank, Peer: -1, Err: s.err}
		}
	} else if s.left == 0 {
		return nil
	} else {
		missing := missing()
		err := fmt.Errorf("%w (%w)", ErrPeerMissing, context.Cause(ctx))
		if s.rejected != nil {
			err = fmt.Errorf("%w; last refused connection: %w", err, s.rejected)
		}
		if s.unreached != nil {
			err = fmt.Errorf("%w; %w", err, s.unreached)
		}
		xe = &ExchangeError{Rank: x.cfg.Rank, Peer: -1, Missing: missing, Err: err}
	}
	xe.Refused = s.refused
	if s.gate != nil {
		xe.Dropped = s.gate.droppedCount()
	}
	return xe
}

type peerErr struct {
	peer int
	err  error
}

func (e *peerErr) Error() string { return fmt.Sprintf("peer %d: %v", e.peer, e.err) }
func (e *peerErr) Unwrap() error { return e.err }

// gate bounds the strangers of a listener: the connections accepted and
// not yet authenticated. Over MaxStrangersPerHost from one source address,
// or MaxStrangers in all, it drops the oldest (from that address first),
// by closing it: its handler's reads fail at once. The goroutines that
// serve strangers, dropped or not, are bounded too: admit waits for a
// slot, which a handler returns once its peer authenticated or it
// returned, so that a flood of connections costs at most MaxStrangers
// goroutines at a time. It is safe for concurrent use. A nil gate (a
// test's acceptor) promotes every stranger and drops none.
//
// An IPv6 host is usually given a whole /64 network, 2^64 addresses to
// open connections from: the strangers of one /64 (not link-local or
// loopback, whose /64 is shared by every host of a link) count together
// too, up to half of MaxStrangers (at least MaxStrangersPerHost), so
// that one such host holds at most half of them, whatever address each
// connection comes from.
type gate struct {
	max, perHost int
	perNet       int           // strangers of one IPv6 /64
	slots        chan struct{} // one per stranger's goroutine
	mu           sync.Mutex
	list         []*stranger // by age, oldest first
	hosts        map[string]int
	nets         map[string]int // by IPv6 /64 (netsrc.Net64)
	drops        int
}

// stranger is an accepted connection that has not authenticated yet.
type stranger struct {
	c        net.Conn
	host     string
	net      string // its IPv6 /64, "" if none (netsrc.Net64)
	out      bool   // dropped, promoted, or gone
	dropped  bool
	released bool // its slot returned
}

func newGate(most, perHost int) *gate {
	return &gate{max: most, perHost: perHost, perNet: max(perHost, most/2), slots: make(chan struct{}, most),
		hosts: make(map[string]int), nets: make(map[string]int)}
}

// admit registers c, dropping older strangers over the limits, and waits
// for a slot for its goroutine. It fails only when ctx ends (c is then
// closed).
func (g *gate) admit(ctx context.Context, c net.Conn) (*stranger, error) {
	st := &stranger{c: c, host: c.RemoteAddr().String()}
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		st.host, st.net = a.IP.String(), netsrc.Net64(a.IP)
	}
	var drop []net.Conn
	g.mu.Lock()
	var same func(*stranger) bool // whose oldest goes
	switch {
	case g.hosts[st.host] >= g.perHost:
		same = func(o *stranger) bool { return o.host == st.host }
	case st.net != "" && g.nets[st.net] >= g.perNet:
		same = func(o *stranger) bool { return o.net == st.net }
	}
	if same != nil {
		if i := slices.IndexFunc(g.list, same); i >= 0 {
			o := g.list[i]
			g.dropLocked(o)
			drop = append(drop, o.c)
		}
	}
	if len(g.list) >= g.max {
		o := g.list[0]
		g.dropLocked(o)
		drop = append(drop, o.c)
	}
	g.list = append(g.list, st)
	g.hosts[st.host]++
	if st.net != "" {
		g.nets[st.net]++
	}
	g.mu.Unlock()
	for _, c := range drop {
		c.Close()
	}
	select {
	case g.slots <- struct{}{}:
		return st, nil
	case <-ctx.Done():
		g.mu.Lock()
		g.removeLocked(st)
		st.released = true
		g.mu.Unlock()
		c.Close()
		return nil, ctx.Err()
	}
}

func (g *gate) removeLocked(st *stranger) {
	if st.out {
		return
	}
	st.out = true
	g.list = slices.DeleteFunc(g.list, func(o *stranger) bool { return o == st })
	if g.hosts[st.host]--; g.hosts[st.host] == 0 {
		delete(g.hosts, st.host)
	}
	if st.net != "" {
		if g.nets[st.net]--; g.nets[st.net] == 0 {
			delete(g.nets, st.net)
		}
	}
}

func (g *gate) releaseLocked(st *stranger) {
	if !st.released {
		st.released = true
		<-g.slots
	}
}

// promote takes an authenticated st out of the strangers; false if it was
// dropped meanwhile.
func (g *gate) promote(st *stranger) bool {
	if g == nil {
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if st.out {
		return false
	}
	g.removeLocked(st)
	g.releaseLocked(st)
	return true
}

// leave forgets st (its handler returned).
func (g *gate) leave(st *stranger) {
	g.mu.Lock()
	g.removeLocked(st)
	g.releaseLocked(st)
	g.mu.Unlock()
}

func (g *gate) dropLocked(st *stranger) {
	if !st.out {
		g.removeLocked(st)
		st.dropped = true
		g.drops++
	}
}

// drop counts st, which did not finish its handshake in time, as
// dropped. Its handler closes it.
func (g *gate) drop(st *stranger) {
	if g == nil {
		return
	}
	g.mu.Lock()
	g.dropLocked(st)
	g.mu.Unlock()
}

// dropped reports whether st was dropped.
func (g *gate) dropped(st *stranger) bool {
	if g == nil {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return st.dropped
}

func (g *gate) droppedCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.drops
}

// serve accepts connections on ln until ctx ends, registering each with g
// and handing it to h in its own goroutine tracked by wg. h owns the
// connection (serve closes it when h returns) and must guard its blocking
// calls itself. If ln is closed before ctx ends (by its owner: a
// Listener of the configuration), serve stops and tells gone.
func serve(ctx context.Context, ln net.Listener, g *gate, wg *sync.WaitGroup, h func(c net.Conn, st *stranger), gone func(err error)) {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stop()
		defer ln.Close()
		for {
			c, err := ln.Accept()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if errors.Is(err, net.ErrClosed) {
					gone(fmt.Errorf("the listener on %s was closed: %w", ln.Addr(), err))
					return
				}
				// Transient accept errors (EMFILE...): back off a little.
				t := time.NewTimer(10 * time.Millisecond)
				select {
				case <-ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
				continue
			}
			st, err := g.admit(ctx, c)
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				defer g.leave(st)
				h(c, st)
			}()
		}
	}()
}

// allToAll: rank r dials every rank below it and accepts every rank
// above it.
func (x *exchange) allToAll(ctx context.Context) ([][]byte, error) {
	r, n := x.cfg.Rank, x.cfg.Size
	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel: every goroutine returns promptly
	s := newState(n, r, func(j int) bool { return j != r })
	s.in[r] = x.out[r]

	if r < n-1 {
		ln, err := x.listen()
		if err != nil {
			return nil, err
		}
		s.gate = newGate(x.cfg.MaxStrangers, x.cfg.MaxStrangersPerHost)
		serve(ctx, ln, s.gate, &wg, func(c net.Conn, st *stranger) {
			defer guard(ctx, c)()
			k, err := x.accept(ctx, c, s.gate, st, func(p int) error {
				if p < r {
					return fmt.Errorf("%w: rank %d should be dialed by rank %d, not dial it", ErrBadFrame, p, r)
				}
				return s.claim(p)
			})
			var pe *peerErr
			if err != nil {
				if errors.As(err, &pe) {
					s.fatal(pe) // a member of the job that disagrees
				} else if k == nil && ctx.Err() == nil {
					s.reject(err)
				} else if k != nil {
					s.fatal(&peerErr{k.peer, err})
				}
				return
			}
			data, err := x.recvShare(ctx, k)
			if err == nil {
				err = x.checkShare(data)
			}
			if err == nil {
				if err = x.send(k, x.out[k.peer]); err != nil {
					err = x.ioErr(ctx, err)
				}
			}
			if err != nil {
				s.fatal(&peerErr{k.peer, err})
				return
			}
			s.put(k.peer, data)
		}, func(err error) { s.listenerGone(err, func(j int) bool { return j > r }) })
	} else if x.cfg.Listener != nil {
		x.cfg.Listener.Close()
	}
	for j := range r {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k, err := x.dial(ctx, j, x.cfg.Addrs[j])
			if err != nil {
				if ctx.Err() == nil {
					s.fatal(&peerErr{j, err})
				} else {
					s.mu.Lock()
					s.unreached = err
					s.mu.Unlock()
				}
				return
			}
			defer k.stopWatch()
			defer k.c.Close()
			if err = x.send(k, x.out[j]); err != nil {
				err = x.ioErr(ctx, err)
			} else {
				var data []byte
				if data, err = x.recvShare(ctx, k); err == nil {
					if err = x.checkShare(data); err == nil {
						s.put(j, data)
						return
					}
				}
			}
			s.fatal(&peerErr{j, err})
		}()
	}
	select {
	case <-s.done:
	case <-ctx.Done():
	}
	cancel()
	wg.Wait() // the dialers' reasons are in s now
	if err := s.wait(parent, x); err != nil {
		return nil, err
	}
	return s.in, nil
}

// root: rank 0 of a rendezvous gathers every rank's outgoing entries and
// sends each rank its column.
func (x *exchange) root(ctx context.Context) ([][]byte, error) {
	n := x.cfg.Size
	vecs := make([][][]byte, n)
	vecs[0] = x.out
	g, err := x.gather(ctx, func(peer int, data []byte) error {
		v, err := decodeVector(data, n)
		vecs[peer] = v
		return err
	})
	if err != nil {
		return nil, err
	}
	defer g.close()
	in := make([][]byte, n)
	for j := range n {
		in[j] = vecs[j][0]
	}
	// Rank k's column: what every rank sends it. Each rank checked its
	// own entries against MaxFrame, not what the others send it: a column
	// over it failed only at its rank, which could not read it, while the
	// others went on (the world split: TestRendezvousColumnOverMaxFrame).
	// Every rank fails instead.
	cols := make([][][]byte, n)
	for k := 1; k < n; k++ {
		cols[k] = make([][]byte, n)
		for j := range n {
			cols[k][j] = vecs[j][k]
		}
		if size := vectorSize(cols[k]); size > x.max {
			err := fmt.Errorf("%w: the entries for rank %d are %d bytes (at most %d)", ErrFrameTooLarge, k, size, x.max)
			why := []byte(sanitize(err.Error()))
			x.broadcast(g.list(false), func(*conn) (byte, [][]byte) { return recAbort, [][]byte{why} })
			return nil, err
		}
	}
	err = g.scatter(func(k *conn) (byte, [][]byte) {
		return recData, [][]byte{encodeVector(cols[k.peer])}
	})
	if err != nil {
		return nil, err
	}
	return in, nil
}

// rootCards: rank 0 of a rendezvous of cards gathers every rank's card
// and items, and sends each rank the table of cards and its column of
// items.
func (x *exchange) rootCards(ctx context.Context) ([][]byte, []byte, error) {
	n, w := x.cfg.Size, x.items
	cards := make([][]byte, n)
	items := make([][]byte, n)
	cards[0], items[0] = x.card, x.itemBuf
	g, err := x.gather(ctx, func(peer int, data []byte) error {
		var err error
		cards[peer], items[peer], err = decodeCardShare(data, n*w, x.maxCard)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	defer g.close()
	table := encodeVector(cards) // the same for every rank
	column := func(to int) []byte {
		col := make([]byte, n*w)
		for i := range n {
			copy(col[i*w:], items[i][to*w:(to+1)*w])
		}
		return col
	}
	err = g.scatter(func(k *conn) (byte, [][]byte) {
		return recData, [][]byte{table, column(k.peer)}
	})
	if err != nil {
		return nil, nil, err
	}
	return cards, column(0), nil
}

// gathering is the root's connections to the ranks after the gather of a
// rendezvous: kept, unguarded, for the broadcast that follows (even past
// the deadline), until close.
type gathering struct {
	x     *exchange
	mu    sync.Mutex
	conns []*conn
	// pending are the ranks past their handshake whose share is still
	// being read: an abort goes to them too (a connection closed with
	// their share unread would reach them as a reset, without why).
	pending []*conn
	// why is the root's abort once it gives up: a rank whose handshake
	// completes after that gets it from its own goroutine.
	why []byte
	// claiming counts the handshakes that claimed a rank and have not
	// yet registered it as pending: the abort waits for them (a rank
	// told it was accepted is then told why the root gives up).
	claiming  int
	claimDone *sync.Cond // on mu
	// listed: the root has listed the ranks it tells why it gives up
	// (after why was set and claiming reached 0). A rank registered as
	// pending before is on the list; one whose handshake completes after
	// tells itself.
	listed  bool
	release chan struct{} // closed when the root is done with the connections
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// close releases the connections and waits for their goroutines.
func (g *gathering) close() {
	close(g.release)
	g.cancel()
	g.wg.Wait()
}

// list returns the connections kept for the broadcast, indexed by peer,
// and with pending, those whose share is still being read.
func (g *gathering) list(pending bool) []*conn {
	g.mu.Lock()
	defer g.mu.Unlock()
	l := slices.Clone(g.conns)
	if pending {
		for j, k := range g.pending {
			if k != nil && l[j] == nil {
				l[j] = k
			}
		}
	}
	return l
}

// scatter writes mk(k) to every connection k (exchange.broadcast) and
// fails, naming the rank, if a write to one failed.
func (g *gathering) scatter(mk func(k *conn) (byte, [][]byte)) error {
	for i, e := range g.x.broadcast(g.list(false), mk) {
		if e != nil {
			return g.x.fail(i, nil, fmt.Errorf("%w: %w", ErrPeerLost, e))
		}
	}
	return nil
}

// gather accepts every rank but the root, reads its message and hands it
// to put (called concurrently, once per rank, with distinct ranks; an
// error fails the exchange, naming the rank). It returns once every rank
// was put, or fails: then it has told the connected ranks why (an abort)
// and released them.
func (x *exchange) gather(ctx context.Context, put func(peer int, data []byte) error) (*gathering, error) {
	n := x.cfg.Size
	gctx, cancel := context.WithCancel(ctx)
	g := &gathering{x: x, conns: make([]*conn, n), pending: make([]*conn, n), release: make(chan struct{}), cancel: cancel}
	g.claimDone = sync.NewCond(&g.mu)
	s := newState(n, 0, func(j int) bool { return j != 0 })
	s.gate = newGate(x.cfg.MaxStrangers, x.cfg.MaxStrangersPerHost)

	ln, err := x.listen()
	if err != nil {
		cancel()
		return nil, err
	}
	serve(gctx, ln, s.gate, &g.wg, func(c net.Conn, st *stranger) {
		stop := guard(gctx, c)
		k, err := x.accept(gctx, c, s.gate, st, func(peer int) error {
			err := s.claim(peer)
			if err == nil {
				g.mu.Lock()
				g.claiming++
				g.mu.Unlock()
			}
			return err
		})
		if k != nil && err != nil {
			// Claimed, then failed (the accept message was not sent).
			g.mu.Lock()
			g.claiming--
			g.claimDone.Broadcast()
			g.mu.Unlock()
		}
		var pe *peerErr
		if err != nil {
			stop()
			if errors.As(err, &pe) {
				s.fatal(pe) // a member of the job that disagrees
			} else if k == nil && gctx.Err() == nil {
				s.reject(err) // (not a connection closed as the root gives up)
			} else if k != nil {
				s.fatal(&peerErr{k.peer, err})
			}
			return
		}
		// Told it was accepted: if the root gives up, the broadcast (it
		// waits for this registration) or this goroutine tells it why.
		g.mu.Lock()
		g.claiming--
		g.claimDone.Broadcast()
		// Until the root lists the ranks to tell why it gives up (it
		// waits for this registration), this rank is on that list.
		var why []byte
		if g.listed {
			why = g.why
		} else {
			g.pending[k.peer] = k
		}
		g.mu.Unlock()
		if why != nil {
			// The root gave up, and listed the ranks to tell, while this
			// rank's handshake completed (it claimed its rank after the
			// root had failed).
			if stop() {
				k.s.writeMsg(progressWriter{k.c, recordGrace([]*conn{k})}, recAbort, why)
				k.c.Close()
			}
			return
		}
		data, err := x.recvShare(gctx, k)
		if err == nil {
			err = put(k.peer, data)
		}
		if err != nil || !stop() {
			g.mu.Lock()
			g.pending[k.peer] = nil
			g.mu.Unlock()
			// Failed, or gctx ended (the connection is closed).
			if err == nil {
				err = x.ioErr(gctx, net.ErrClosed)
			}
			s.fatal(&peerErr{k.peer, err})
			return
		}
		// Keep the connection, unguarded, for the broadcast (or the
		// abort) that follows the gather, even past the deadline.
		g.mu.Lock()
		g.conns[k.peer], g.pending[k.peer] = k, nil
		g.mu.Unlock()
		s.put(k.peer, nil)
		// Watch the connection until the root is done with it: a rank
		// sends nothing after its share, so its end (the rank died) or
		// anything it sends fails the gather now, naming the rank,
		// rather than when the last rank comes (or at the deadline).
		watch := make(chan error, 1)
		go func() {
			var b [1]byte
			_, err := k.c.Read(b[:])
			if err == nil {
				err = fmt.Errorf("%w: rank %d sent data after its share", ErrBadFrame, k.peer)
			}
			watch <- err
		}()
		select {
		case <-g.release:
			k.c.SetReadDeadline(time.Now()) // ends the watch
			<-watch
			k.c.SetReadDeadline(time.Time{})
		case err := <-watch:
			if !errors.Is(err, ErrBadFrame) {
				err = fmt.Errorf("%w: its connection ended after it sent its share: %w", ErrPeerLost, err)
			}
			s.fatal(&peerErr{k.peer, err}) // nothing once every rank was put
			<-g.release
		}
	}, func(err error) { s.listenerGone(err, func(j int) bool { return j != 0 }) })
	if err := s.wait(gctx, x); err != nil {
		// Tell the connected ranks why, so that they fail now rather than
		// at their deadline.
		why := []byte(sanitize(err.Error()))
		if len(why) > maxAbortText {
			why = why[:maxAbortText]
		}
		g.mu.Lock()
		g.why = why
		for g.claiming > 0 {
			g.claimDone.Wait()
		}
		g.listed = true
		g.mu.Unlock()
		x.broadcast(g.list(true), func(*conn) (byte, [][]byte) { return recAbort, [][]byte{why} })
		g.close()
		return nil, err
	}
	return g, nil
}

// broadcast writes the messages mk(k) to every connection,
// concurrently, each record with a bounded deadline, and returns the
// write errors indexed by peer.
func (x *exchange) broadcast(list []*conn, mk func(k *conn) (byte, [][]byte)) []error {
	grace := recordGrace(list)
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, k := range list {
		if k == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			typ, msgs := mk(k)
			for _, msg := range msgs {
				if typ == recAbort && len(msg) > maxAbortText {
					msg = msg[:maxAbortText]
				}
				if errs[i] = k.s.writeMsg(progressWriter{k.c, grace}, typ, msg); errs[i] != nil {
					break
				}
			}
			k.c.SetWriteDeadline(time.Time{})
		}()
	}
	wg.Wait()
	return errs
}

// broadcastGrace bounds each record of the root's final writes (the
// ranks are reading at that point, so a record that takes longer means a
// dead peer). It bounds a record, not a message: a rank's column grows
// with the world (N entries, about 200 bytes each with soft0), and a
// live rank among hundreds on a few processors drains it slowly (192
// ranks on 2 CPUs: a whole column took more than 10 s).
var broadcastGrace = 10 * time.Second

// starveStep is how much longer each record of the root's final writes
// may wait per rank of its own host beyond one per processor (see
// recordGrace).
var starveStep = 100 * time.Millisecond

// numCPU is the number of processors of this host (a variable for tests).
var numCPU = runtime.NumCPU

// recordGrace bounds each record of the root's final writes to conns:
// broadcastGrace, plus starveStep for every rank of this host (over
// loopback) beyond one per processor. Ranks that outnumber the
// processors wait for them in turn, the longer the more there are: 512
// ranks on 2 CPUs left a live rank without a turn to read its column for
// more than 10 s, and the root gave up on it (and the world failed);
// there the bound is 61 s. A rank that died closes its connection, which
// fails the write at once, whatever the bound.
func recordGrace(conns []*conn) time.Duration {
	local := 0
	for _, k := range conns {
		if k == nil {
			continue
		}
		if a, ok := k.c.RemoteAddr().(*net.TCPAddr); ok && a.IP.IsLoopback() {
			local++
		}
	}
	over := max(local-numCPU(), 0)
	return broadcastGrace + time.Duration(over)*starveStep
}

// progressWriter writes to c with a deadline of grace from the start of
// each write: a peer that keeps reading is never cut off, one that stops
// for grace is.
type progressWriter struct {
	c     net.Conn
	grace time.Duration
}

func (w progressWriter) Write(p []byte) (int, error) {
	w.c.SetWriteDeadline(time.Now().Add(w.grace))
	return w.c.Write(p)
}

// leaf: a rank other than 0 of a rendezvous sends its entries to the root
// and receives its column.
func (x *exchange) leaf(ctx context.Context) ([][]byte, error) {
	var in [][]byte
	err := x.leafRound(ctx, encodeVector(x.out), func(data []byte) (err error) {
		in, err = decodeVector(data, x.cfg.Size)
		return err
	})
	if err != nil {
		return nil, err
	}
	in[x.cfg.Rank] = x.out[x.cfg.Rank]
	return in, nil
}

// leafCards: a rank other than 0 of a rendezvous of cards sends the root
// its card and items, and receives the table of cards and its column.
func (x *exchange) leafCards(ctx context.Context) ([][]byte, []byte, error) {
	n, w, r := x.cfg.Size, x.items, x.cfg.Rank
	var cards [][]byte
	var column []byte
	err := x.leafRound(ctx, encodeCardShare(x.card, x.itemBuf),
		func(data []byte) (err error) {
			cards, err = decodeCardTable(data, n, x.maxCard)
			return err
		},
		func(data []byte) error {
			if len(data) != n*w {
				return fmt.Errorf("%w: column of %d bytes (want %d items of %d bytes)", ErrBadFrame, len(data), n, w)
			}
			column = data
			return nil
		})
	if err != nil {
		return nil, nil, err
	}
	cards[r] = x.card
	copy(column[r*w:], x.itemBuf[r*w:(r+1)*w])
	return cards, column, nil
}

// leafRound is a leaf's part of a rendezvous: it sends the root share,
// then hands the root's answers, in order, one to each of take. A
// failure, or an error of take, fails the exchange naming the root.
func (x *exchange) leafRound(ctx context.Context, share []byte, take ...func(data []byte) error) error {
	if x.cfg.Listener != nil {
		x.cfg.Listener.Close()
	}
	k, err := x.dial(ctx, 0, x.cfg.Root)
	if err != nil {
		return x.fail(0, nil, err)
	}
	defer k.stopWatch()
	defer k.c.Close()
	if err := x.send(k, share); err != nil {
		return x.fail(0, nil, x.ioErr(ctx, err))
	}
	for _, f := range take {
		data, err := x.recv(ctx, k)
		if err != nil && ctx.Err() != nil {
			err = fmt.Errorf("%w: waiting for the root's answer: %w", ErrPeerMissing, err)
		}
		if err == nil {
			err = f(data)
		}
		if err != nil {
			return x.fail(0, nil, err)
		}
	}
	return nil
}
