package cluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"slices"
	"sync"
	"time"
)

// Exchange errors (besides the protocol errors of frame.go).
var (
	// ErrPeerMissing: peers did not connect (or could not be reached)
	// before the context ended. The error also wraps the context's error
	// and, if connections were refused meanwhile, the last reason.
	ErrPeerMissing = errors.New("cluster: exchange: peers missing")
	// ErrPeerLost: a peer's connection failed after its handshake (the
	// peer process died, or closed the connection).
	ErrPeerLost = errors.New("cluster: exchange: connection to a peer lost")
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
	// Token is the shared secret every frame is authenticated with
	// (HMAC-SHA256). Ranks with different tokens refuse each other. An
	// empty token still detects accidents (other jobs, other programs on
	// the port) but authenticates nothing.
	Token []byte
	// MaxFrame bounds the size of a frame; larger frames are refused
	// before they are read. Default DefaultMaxFrame.
	MaxFrame int
	// MinBackoff and MaxBackoff bound the delay between attempts to
	// connect to a peer that is not listening yet. Defaults 10ms and
	// 500ms. Attempts go on until the context ends.
	MinBackoff, MaxBackoff time.Duration
}

// ExchangeError is the error of Exchange: this rank, the peer concerned
// (-1 if none), the peers that never connected, and the cause.
type ExchangeError struct {
	Rank    int
	Peer    int
	Missing []int
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
	return s + ": " + e.Err.Error()
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
// not end the exchange, but the error at the deadline names the reason.
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
	if cfg.Mode == Rendezvous {
		if cfg.Rank == 0 {
			return x.root(ctx)
		}
		return x.leaf(ctx)
	}
	return x.allToAll(ctx)
}

type exchange struct {
	cfg        ExchangeConfig
	out        [][]byte
	max        int
	minB, maxB time.Duration
}

func newExchange(cfg ExchangeConfig, out [][]byte) (*exchange, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("cluster: exchange: "+format, args...)
	}
	switch {
	case cfg.Size < 1:
		return nil, bad("world size %d", cfg.Size)
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
	x := &exchange{cfg: cfg, out: out, max: cfg.MaxFrame, minB: cfg.MinBackoff, maxB: cfg.MaxBackoff}
	if x.max == 0 {
		x.max = DefaultMaxFrame
	}
	if x.minB <= 0 {
		x.minB = 10 * time.Millisecond
	}
	if x.maxB < x.minB {
		x.maxB = max(500*time.Millisecond, x.minB)
	}
	for j, o := range out {
		if frameSize(len(cfg.Job), len(o)) > x.max {
			return nil, fmt.Errorf("cluster: exchange: entry for rank %d: %w: %d bytes (at most %d)", j, ErrFrameTooLarge, len(o), x.max)
		}
	}
	return x, nil
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
	mine      [nonceLen]byte // our nonce: the peer echoes it in its frames
	theirs    [nonceLen]byte
	stopWatch func() bool
}

// guard closes c when ctx ends, so that every blocked read and write
// returns.
func guard(ctx context.Context, c net.Conn) func() bool {
	return context.AfterFunc(ctx, func() { c.Close() })
}

func (x *exchange) frame(typ byte, to int, nonce [nonceLen]byte, payload []byte) *frame {
	return &frame{typ: typ, from: uint32(x.cfg.Rank), to: uint32(to), size: uint32(x.cfg.Size),
		nonce: nonce, job: x.cfg.Job, payload: payload}
}

func (x *exchange) write(c net.Conn, f *frame) error {
	b, err := encodeFrame(f, x.cfg.Token)
	if err != nil {
		return err
	}
	_, err = c.Write(b)
	return err
}

// check validates an authenticated frame from peer (-1: any) to this
// rank.
func (x *exchange) check(f *frame, typ byte, peer int) error {
	switch {
	case f.job != x.cfg.Job:
		return fmt.Errorf("%w: peer's job %q, this rank's %q", ErrJobMismatch, sanitize(f.job), x.cfg.Job)
	case f.size != uint32(x.cfg.Size):
		return fmt.Errorf("%w: peer's world size %d, this rank's %d", ErrBadFrame, f.size, x.cfg.Size)
	case f.to != uint32(x.cfg.Rank):
		return fmt.Errorf("%w: frame for rank %d reached rank %d", ErrBadFrame, f.to, x.cfg.Rank)
	case f.from >= uint32(x.cfg.Size) || f.from == uint32(x.cfg.Rank):
		return fmt.Errorf("%w: frame from rank %d", ErrBadFrame, f.from)
	case peer >= 0 && f.from != uint32(peer):
		return fmt.Errorf("%w: frame from rank %d, expected %d", ErrBadFrame, f.from, peer)
	case f.typ != typ && f.typ != frameAbort:
		return fmt.Errorf("%w: frame type %d, expected %d", ErrBadFrame, f.typ, typ)
	}
	return nil
}

// recv reads the next frame of an established connection: a data frame
// echoing our nonce. An abort frame becomes ErrAborted.
func (x *exchange) recv(ctx context.Context, k *conn) ([]byte, error) {
	f, err := readFrame(k.c, x.cfg.Token, x.max)
	if err != nil {
		return nil, x.ioErr(ctx, err)
	}
	if err := x.check(f, frameData, k.peer); err != nil {
		return nil, err
	}
	if f.nonce != k.mine {
		return nil, fmt.Errorf("%w: stale nonce (replayed frame?)", ErrAuth)
	}
	if f.typ == frameAbort {
		return nil, fmt.Errorf("%w: %s", ErrAborted, sanitize(string(f.payload)))
	}
	return f.payload, nil
}

// ioErr describes a read or write failure on an established connection.
func (x *exchange) ioErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", context.Cause(ctx), err)
	}
	if errors.Is(err, ErrAuth) || errors.Is(err, ErrBadFrame) || errors.Is(err, ErrFrameTooLarge) || errors.Is(err, ErrVersion) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrPeerLost, err)
}

func newNonce() [nonceLen]byte {
	var n [nonceLen]byte
	rand.Read(n[:]) // never fails (crypto/rand)
	return n
}

// accept runs the acceptor side of a handshake on c: it reads the peer's
// hello, checks it with ok (which claims the peer), answers with its own.
// A refused hello is answered with a reject frame; the error says why.
func (x *exchange) accept(ctx context.Context, c net.Conn, ok func(peer int) error) (*conn, error) {
	// A peer says hello at once: a connection that does not is not one.
	c.SetReadDeadline(time.Now().Add(helloTimeout))
	f, err := readFrame(c, x.cfg.Token, x.max)
	c.SetReadDeadline(time.Time{})
	if err == nil {
		err = x.check(f, frameHello, -1)
		if err == nil && f.typ != frameHello {
			err = fmt.Errorf("%w: expected a hello", ErrBadFrame)
		}
		if err == nil {
			err = ok(int(f.from))
		}
	}
	if err != nil {
		var from uint32
		if f != nil {
			from = f.from
		}
		if !isIOErr(err) {
			msg := err.Error()
			if len(msg) > maxRejectText {
				msg = msg[:maxRejectText]
			}
			rej := x.frame(frameReject, int(from), [nonceLen]byte{}, append([]byte{rejectCode(err)}, msg...))
			x.write(c, rej)
		}
		if f != nil && !errors.Is(err, ErrAuth) {
			return nil, fmt.Errorf("connection from %s (claiming rank %d) refused: %w", c.RemoteAddr(), f.from, err)
		}
		return nil, fmt.Errorf("connection from %s refused: %w", c.RemoteAddr(), err)
	}
	k := &conn{c: c, peer: int(f.from), mine: newNonce(), theirs: f.nonce}
	if err := x.write(c, x.frame(frameHello, k.peer, k.mine, nil)); err != nil {
		return k, x.ioErr(ctx, err)
	}
	return k, nil
}

func isIOErr(err error) bool {
	return !(errors.Is(err, ErrAuth) || errors.Is(err, ErrBadFrame) || errors.Is(err, ErrFrameTooLarge) ||
		errors.Is(err, ErrVersion) || errors.Is(err, ErrJobMismatch))
}

// helloTimeout bounds the wait for a connecting peer's hello.
const helloTimeout = 10 * time.Second

// errRetry marks a dial attempt worth repeating.
type errRetry struct{ err error }

func (e errRetry) Error() string { return e.err.Error() }
func (e errRetry) Unwrap() error { return e.err }

// dial connects to peer at addr and runs the dialer side of the
// handshake, retrying with backoff while the peer is not there yet.
func (x *exchange) dial(ctx context.Context, peer int, addr string) (*conn, error) {
	var d net.Dialer
	backoff := x.minB
	var last error
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			stop := guard(ctx, c)
			k, err := x.hello(ctx, c, peer)
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

// hello sends our hello on a fresh connection and reads the answer.
func (x *exchange) hello(ctx context.Context, c net.Conn, peer int) (*conn, error) {
	k := &conn{c: c, peer: peer, mine: newNonce()}
	if err := x.write(c, x.frame(frameHello, peer, k.mine, nil)); err != nil {
		return nil, errRetry{err}
	}
	f, err := readFrame(c, x.cfg.Token, x.max)
	if err != nil {
		if isIOErr(err) && ctx.Err() == nil {
			// Closed without a word: a listener that went away, or one
			// that is not ours yet. Try again.
			return nil, errRetry{err}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: rank %d: %w", ErrPeerMissing, peer, context.Cause(ctx))
		}
		return nil, fmt.Errorf("rank %d answered with a bad frame: %w", peer, err)
	}
	if f.typ == frameReject {
		return nil, rejectError(f)
	}
	if err := x.check(f, frameHello, peer); err != nil {
		return nil, err
	}
	if f.typ != frameHello {
		return nil, fmt.Errorf("%w: expected a hello from rank %d", ErrBadFrame, peer)
	}
	k.theirs = f.nonce
	return k, nil
}

// state collects the shares of an exchange.
type state struct {
	mu       sync.Mutex
	in       [][]byte
	have     []bool
	claimed  []bool
	left     int
	err      error // first fatal error
	rejected error // last refused connection
	done     chan struct{}
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

// reject records a refused connection. A refusal for a protocol reason
// (token, job, rank...) is kept over a later one for an I/O error (a
// connection closed before its hello).
func (s *state) reject(err error) {
	s.mu.Lock()
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
	if s.err != nil {
		var pe *peerErr
		if errors.As(s.err, &pe) {
			return x.fail(pe.peer, nil, pe.err)
		}
		return x.fail(-1, nil, s.err)
	}
	if s.left == 0 {
		return nil
	}
	var missing []int
	for j, ok := range s.have {
		if !ok && j != x.cfg.Rank {
			missing = append(missing, j)
		}
	}
	err := fmt.Errorf("%w (%w)", ErrPeerMissing, context.Cause(ctx))
	if s.rejected != nil {
		err = fmt.Errorf("%w; last refused connection: %w", err, s.rejected)
	}
	return x.fail(-1, missing, err)
}

type peerErr struct {
	peer int
	err  error
}

func (e *peerErr) Error() string { return fmt.Sprintf("peer %d: %v", e.peer, e.err) }
func (e *peerErr) Unwrap() error { return e.err }

// serve accepts connections on ln until ctx ends, handing each to h in
// its own goroutine tracked by wg. h owns the connection (serve closes
// it when h returns) and must guard its blocking calls itself.
func serve(ctx context.Context, ln net.Listener, wg *sync.WaitGroup, h func(c net.Conn)) {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stop()
		defer ln.Close()
		for {
			c, err := ln.Accept()
			if err != nil {
				if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
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
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				h(c)
			}()
		}
	}()
}

// allToAll: rank r dials every rank below it and accepts every rank
// above it.
func (x *exchange) allToAll(ctx context.Context) ([][]byte, error) {
	r, n := x.cfg.Rank, x.cfg.Size
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
		serve(ctx, ln, &wg, func(c net.Conn) {
			defer guard(ctx, c)()
			k, err := x.accept(ctx, c, func(p int) error {
				if p < r {
					return fmt.Errorf("%w: rank %d should be dialed by rank %d, not dial it", ErrBadFrame, p, r)
				}
				return s.claim(p)
			})
			if err != nil {
				if k == nil {
					s.reject(err)
				} else {
					s.fatal(&peerErr{k.peer, err})
				}
				return
			}
			data, err := x.recv(ctx, k)
			if err == nil {
				err = x.write(c, x.frame(frameData, k.peer, k.theirs, x.out[k.peer]))
				if err != nil {
					err = x.ioErr(ctx, err)
				}
			}
			if err != nil {
				s.fatal(&peerErr{k.peer, err})
				return
			}
			s.put(k.peer, data)
		})
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
				}
				return
			}
			defer k.stopWatch()
			defer k.c.Close()
			err = x.write(k.c, x.frame(frameData, j, k.theirs, x.out[j]))
			if err != nil {
				err = x.ioErr(ctx, err)
			} else {
				var data []byte
				if data, err = x.recv(ctx, k); err == nil {
					s.put(j, data)
					return
				}
			}
			s.fatal(&peerErr{j, err})
		}()
	}
	err := s.wait(ctx, x)
	cancel()
	wg.Wait()
	if err != nil {
		return nil, err
	}
	return s.in, nil
}

// root: rank 0 of a rendezvous gathers every rank's outgoing entries and
// sends each rank its column.
func (x *exchange) root(ctx context.Context) ([][]byte, error) {
	n := x.cfg.Size
	gctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	s := newState(n, 0, func(j int) bool { return j != 0 })
	var mu sync.Mutex
	conns := make([]*conn, n)
	vecs := make([][][]byte, n)
	vecs[0] = x.out

	ln, err := x.listen()
	if err != nil {
		return nil, err
	}
	release := make(chan struct{}) // closed when the root is done with the connections
	serve(gctx, ln, &wg, func(c net.Conn) {
		stop := guard(gctx, c)
		k, err := x.accept(gctx, c, s.claim)
		if err != nil {
			stop()
			if k == nil {
				s.reject(err)
			} else {
				s.fatal(&peerErr{k.peer, err})
			}
			return
		}
		data, err := x.recv(gctx, k)
		var v [][]byte
		if err == nil {
			v, err = decodeVector(data, n)
		}
		if err != nil || !stop() {
			// Failed, or gctx ended (the connection is closed).
			if err == nil {
				err = x.ioErr(gctx, net.ErrClosed)
			}
			s.fatal(&peerErr{k.peer, err})
			return
		}
		// Keep the connection, unguarded, for the broadcast (or the
		// abort) that follows the gather, even past the deadline.
		mu.Lock()
		conns[k.peer], vecs[k.peer] = k, v
		mu.Unlock()
		s.put(k.peer, nil)
		<-release
	})
	defer func() {
		close(release)
		cancel()
		wg.Wait()
	}()
	err = s.wait(gctx, x)
	if err != nil {
		// Tell the connected ranks why, so that they fail now rather than
		// at their deadline.
		x.broadcast(conns, &mu, func(k *conn) *frame {
			return x.frame(frameAbort, k.peer, k.theirs, []byte(sanitize(err.Error())))
		})
		return nil, err
	}
	in := make([][]byte, n)
	for j := range n {
		in[j] = vecs[j][0]
	}
	errs := x.broadcast(conns, &mu, func(k *conn) *frame {
		col := make([][]byte, n)
		for j := range n {
			col[j] = vecs[j][k.peer]
		}
		return x.frame(frameData, k.peer, k.theirs, encodeVector(col))
	})
	for i, e := range errs {
		if e != nil {
			return nil, x.fail(i, nil, fmt.Errorf("%w: %w", ErrPeerLost, e))
		}
	}
	return in, nil
}

// broadcast writes mk(k) to every connection, concurrently, each with a
// bounded deadline, and returns the write errors indexed by peer.
func (x *exchange) broadcast(conns []*conn, mu *sync.Mutex, mk func(k *conn) *frame) []error {
	mu.Lock()
	list := slices.Clone(conns)
	mu.Unlock()
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, k := range list {
		if k == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			k.c.SetWriteDeadline(time.Now().Add(broadcastGrace))
			errs[i] = x.write(k.c, mk(k))
		}()
	}
	wg.Wait()
	return errs
}

// broadcastGrace bounds each of the root's final writes (the ranks are
// reading at that point, so a write that takes longer means a dead peer).
const broadcastGrace = 10 * time.Second

// leaf: a rank other than 0 of a rendezvous sends its entries to the root
// and receives its column.
func (x *exchange) leaf(ctx context.Context) ([][]byte, error) {
	if x.cfg.Listener != nil {
		x.cfg.Listener.Close()
	}
	k, err := x.dial(ctx, 0, x.cfg.Root)
	if err != nil {
		return nil, x.fail(0, nil, err)
	}
	defer k.stopWatch()
	defer k.c.Close()
	if err := x.write(k.c, x.frame(frameData, 0, k.theirs, encodeVector(x.out))); err != nil {
		return nil, x.fail(0, nil, x.ioErr(ctx, err))
	}
	data, err := x.recv(ctx, k)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w: waiting for the root's answer: %w", ErrPeerMissing, err)
		}
		return nil, x.fail(0, nil, err)
	}
	in, err := decodeVector(data, x.cfg.Size)
	if err != nil {
		return nil, x.fail(0, nil, err)
	}
	in[x.cfg.Rank] = x.out[x.cfg.Rank]
	return in, nil
}
