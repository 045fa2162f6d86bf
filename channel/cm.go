package channel

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
)

// Channels connected through the RDMA connection manager: DialCM,
// AcceptCM (their documentation describes the ready handshake and the
// watch for the peer's disconnection).

// Private data limits of DialCM and AcceptCM: the CM's limits
// (verbs.MaxCMDialData, verbs.MaxCMAcceptData) less the 16 bytes of the
// ready handshake. Unlike the CM's, the peer receives the private data
// with its exact length (no padding).
const (
	MaxCMDialData   = verbs.MaxCMDialData - cmHeaderLen   // 40 bytes
	MaxCMAcceptData = verbs.MaxCMAcceptData - cmHeaderLen // 180 bytes
)

// The header of the private data of DialCM and AcceptCM: 'g' 'c', version,
// length of the caller's data, then the peer's ready word (rkey, address;
// little endian). The caller's data follows.
const (
	cmHeaderLen = 16
	cmVersion   = 1
	// cmReady is the value a side writes into the peer's ready word.
	cmReady uint64 = 0x79646165726d6367 // "gcmready", little endian
)

// cmHandshake is one side's ready word: 16 bytes registered for remote
// write; the peer writes cmReady into bytes 0-7, bytes 8-15 hold cmReady
// as the source of this side's write to the peer.
type cmHandshake struct {
	mr *verbs.MemoryRegion
}

func newCMHandshake(pd *verbs.ProtectionDomain) (*cmHandshake, error) {
	mr, err := pd.Alloc(cmHeaderLen, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		return nil, fmt.Errorf("ready word: %w", err)
	}
	binary.LittleEndian.PutUint64(mr.Bytes()[8:], cmReady)
	return &cmHandshake{mr: mr}, nil
}

// encode returns the private data to send: the header and data.
func (h *cmHandshake) encode(data []byte) []byte {
	b := make([]byte, cmHeaderLen, cmHeaderLen+len(data))
	b[0], b[1], b[2], b[3] = 'g', 'c', cmVersion, byte(len(data))
	binary.LittleEndian.PutUint32(b[4:], h.mr.RKey())
	binary.LittleEndian.PutUint64(b[8:], h.mr.Addr())
	return append(b, data...)
}

// parseCMData splits the private data of a peer of this package into the
// peer's ready word and the peer's data (at most limit bytes).
func parseCMData(b []byte, limit int) (verbs.RemoteAddr, []byte, error) {
	if len(b) < cmHeaderLen || b[0] != 'g' || b[1] != 'c' {
		return verbs.RemoteAddr{}, nil, fmt.Errorf("the peer's private data (%d bytes) does not come from channel.DialCM or channel.AcceptCM: %w", len(b), syscall.EPROTO)
	}
	if b[2] != cmVersion {
		return verbs.RemoteAddr{}, nil, fmt.Errorf("the peer speaks version %d of the channel's CM handshake, this side version %d: %w", b[2], cmVersion, syscall.EPROTO)
	}
	n := int(b[3])
	if n > limit || n > len(b)-cmHeaderLen {
		return verbs.RemoteAddr{}, nil, fmt.Errorf("the peer's private data claims %d bytes, it carries %d and may carry %d: %w", n, len(b)-cmHeaderLen, limit, syscall.EPROTO)
	}
	ready := verbs.RemoteAddr{Addr: binary.LittleEndian.Uint64(b[8:]), RKey: binary.LittleEndian.Uint32(b[4:])}
	return ready, slices.Clone(b[cmHeaderLen : cmHeaderLen+n]), nil
}

// wait waits until the peer's ready word arrived, the channel breaks (the
// peer disconnected, or the ready write failed) or ctx ends.
func (h *cmHandshake) wait(ctx context.Context, c *Channel) error {
	// The device writes the word; Alloc's memory is page-aligned.
	word := (*uint64)(unsafe.Pointer(&h.mr.Bytes()[0]))
	delay := 10 * time.Microsecond
	for i := 0; ; i++ {
		if atomic.LoadUint64(word) == cmReady {
			return nil
		}
		if err := c.Err(); err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return waitErr(err)
		}
		if i < 64 {
			runtime.Gosched()
			continue
		}
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		delay = min(2*delay, time.Millisecond)
	}
}

func (h *cmHandshake) close() {
	if h != nil {
		h.mr.Close()
	}
}

// checkCM fails unless pd can hold a CM channel, with private data of n
// bytes (at most limit) and opts.
func checkCM(op string, pd *verbs.ProtectionDomain, opts Options, n, limit int) error {
	if pd == nil {
		return &OpError{Op: op, Err: fmt.Errorf("nil protection domain: %w", syscall.EINVAL)}
	}
	if n > limit {
		return &OpError{Op: op, Err: fmt.Errorf("%d bytes of private data, at most %d: %w", n, limit, syscall.EINVAL)}
	}
	if _, err := opts.withDefaults(); err != nil {
		return err
	}
	if opts.Doorbells > 0 {
		return &OpError{Op: op, Err: fmt.Errorf("Options.Doorbells with the RDMA CM: %w", verbs.ErrNotSupported)}
	}
	if dev := pd.Context(); !verbs.HardwareCompiled || dev.Provider() != "ibverbs" {
		why := ""
		if !verbs.HardwareCompiled {
			why = " (this binary has no hardware provider: build with -tags ibverbs)"
		}
		return &OpError{Op: op, Err: fmt.Errorf("the RDMA connection manager needs a device of the hardware provider, and %s (provider %s) is not one%s; connect its channels with New, Endpoint and Connect: %w",
			dev.Name(), dev.Provider(), why, verbs.ErrNotSupported)}
	}
	return nil
}

// DialCM connects a new channel, in pd, through the RDMA CM to the
// listener at addr ("ip:port", "host:port" or "[fe80::1%eth0]:port"; see
// verbs.DialCM), whose side answers with AcceptCM. privateData (at most
// MaxCMDialData bytes) goes with the request; the acceptor's comes back in
// CMPrivateData. The channel's completion queue is created first and the
// CM's queue pair on it, so that everything else (slots, waiting, the Post
// methods, Batch, Close) works as for a channel from New and Connect.
//
// pd must belong to the device the route to addr uses (verbs.ResolveCM
// tells it), or DialCM fails with an error wrapping syscall.EXDEV. Of
// opts, the CM sets the queue pair's path (port, GID, MTU, PSNs) and
// read/atomic depths itself; Options.Connect is not used.
//
// Receives for the first messages. The CM moves the queue pair to RTS
// inside its handshake, and a peer may send as soon as its own call
// returns: receives posted after DialCM returned could come too late (the
// sender's queue pair then retries after RNR NAKs, forever with the
// default Options.QP.RNRRetry, and fails with a finite one). So prepare,
// when not nil, runs once the queue pair is connected and before DialCM
// returns: post there (PostReceive) the receives the peer's first
// messages need, and set up local state; do not send from it. Then both
// sides complete a ready handshake: each, once its prepare returned,
// RDMA-writes a ready word into a 16-byte region the peer registered for
// the purpose (its address and key travel in the private data), and waits
// until the peer's word arrived in its own. So when DialCM or AcceptCM
// returns, the peer's prepare has returned too: either side may send at
// once, and no message finds the peer without the receives its prepare
// posted. The handshake costs one round trip and 16 bytes of each side's
// private data (hence MaxCMDialData, MaxCMAcceptData). Both sides must use
// this package: a plain verbs CM peer is refused (syscall.EPROTO). An
// error from prepare ends the call (the channel is closed, and the peer's
// call fails with ErrDisconnected) and is returned wrapped. Whenever the
// call fails after prepare ran, the channel is closed: the receives
// prepare posted are flushed, their buffers are the caller's again and
// their Handles are stale. prepare must not keep the *Channel beyond the
// call unless the call succeeds (it is the channel the call returns).
//
// Disconnection. A goroutine per channel waits for the CM's disconnect
// event: when the peer disconnects (it closed its channel, or its process
// ended), the channel breaks with ErrDisconnected, so that blocked calls
// return and Err reports it. Close disconnects, flushes what is in flight,
// waits (at most Options.FlushGrace, so that the CM may retransmit) for
// the peer to confirm the disconnection, ends that goroutine and destroys
// the CM connection and its queue pair. The CM's disconnect request is a
// datagram: when the network loses it, the peer learns that the channel
// is gone only when its own requests fail; a side that only waits for
// messages needs a keepalive of its own.
//
// ctx bounds the whole call: address and route resolution, the CM
// exchange and the ready handshake. Every error is an *OpError (or an
// Options error); a rejection wraps a *verbs.CMRejectError (and
// syscall.ECONNREFUSED). With soft0, or in a build without the hardware
// provider, DialCM fails with an error wrapping verbs.ErrNotSupported
// before allocating anything: connect soft0 channels with New, Endpoint
// and Connect.
func DialCM(ctx context.Context, addr string, pd *verbs.ProtectionDomain, opts Options, privateData []byte, prepare func(*Channel) error) (*Channel, error) {
	const op = "dial rdma cm"
	if err := checkCM(op, pd, opts, len(privateData), MaxCMDialData); err != nil {
		return nil, err
	}
	h, err := newCMHandshake(pd)
	if err != nil {
		return nil, &OpError{Op: op, Err: err}
	}
	data := h.encode(privateData)
	e, err := newEngine(pd, 1, -1, opts, func(spec verbs.QPSpec) (*verbs.CMConn, error) {
		return verbs.DialCM(ctx, addr, pd, spec, data)
	})
	if err != nil {
		h.close()
		return nil, &OpError{Op: op, Err: err}
	}
	return finishCM(ctx, op, e, h, MaxCMAcceptData, prepare)
}

// AcceptCM accepts a connection request of a DialCM peer, taken from a
// verbs.CMListener, with a new channel in pd, and replies with privateData
// (at most MaxCMAcceptData bytes). The dialer's private data is in
// CMPrivateData (and, before accepting, CMRequestData).
//
// pd must belong to the device the request arrived on (req.Device()).
// prepare, the ready handshake, disconnection, ctx and errors are as for
// DialCM. If AcceptCM fails before the connection is established, the
// request is rejected; after, the channel is closed (disconnecting the
// peer). A request that is not from DialCM is rejected with an error
// wrapping syscall.EPROTO, before anything is allocated.
//
// Accepting allocates a channel (a completion queue, a queue pair, scratch
// memory) for whoever reached the listener: check who it is first, with
// CMRequestData and req.RemoteAddr (and req.Reject when in doubt).
func AcceptCM(ctx context.Context, req *verbs.CMRequest, pd *verbs.ProtectionDomain, opts Options, privateData []byte, prepare func(*Channel) error) (*Channel, error) {
	const op = "accept rdma cm"
	if err := checkCM(op, pd, opts, len(privateData), MaxCMAcceptData); err != nil {
		if req != nil {
			req.Reject(nil)
		}
		return nil, err
	}
	if req == nil {
		return nil, &OpError{Op: op, Err: fmt.Errorf("nil request: %w", syscall.EINVAL)}
	}
	if _, _, err := parseCMData(req.PrivateData(), MaxCMDialData); err != nil {
		req.Reject(nil)
		return nil, &OpError{Op: op, Err: err}
	}
	if dev := pd.Context().Name(); dev != req.Device() {
		req.Reject(nil)
		return nil, &OpError{Op: op, Err: fmt.Errorf("the request from %v arrived on %s, but the protection domain belongs to %s (use a PD of %s): %w",
			req.RemoteAddr(), req.Device(), dev, req.Device(), syscall.EXDEV)}
	}
	h, err := newCMHandshake(pd)
	if err != nil {
		req.Reject(nil)
		return nil, &OpError{Op: op, Err: err}
	}
	data := h.encode(privateData)
	e, err := newEngine(pd, 1, -1, opts, func(spec verbs.QPSpec) (*verbs.CMConn, error) {
		return req.Accept(ctx, pd, spec, data)
	})
	if err != nil {
		req.Reject(nil) // if newEngine failed before Accept; ErrClosed otherwise
		h.close()
		return nil, &OpError{Op: op, Err: err}
	}
	return finishCM(ctx, op, e, h, MaxCMDialData, prepare)
}

// finishCM makes the channel of an established CM connection (the
// engine's only peer): it reads the peer's private data (at most limit
// bytes of the peer's own), starts watching for the peer's disconnection,
// runs prepare and the ready handshake. On failure (or a panic in
// prepare) it closes everything.
func finishCM(ctx context.Context, op string, e *engine, h *cmHandshake, limit int, prepare func(*Channel) error) (_ *Channel, err error) {
	p := e.peers[0]
	c := &Channel{e: e, p: p, own: true}
	ok := false
	defer func() {
		if !ok {
			// Disconnect before the ready word goes: the peer's
			// handshake then fails with ErrDisconnected rather than
			// with a remote access error.
			c.Close()
		}
		h.close()
	}()
	ready, data, err := parseCMData(p.cm.PrivateData(), limit)
	if err != nil {
		return nil, &OpError{Op: op, Err: err}
	}
	p.cmData = data
	p.state.Store(peerConnected)
	p.watch()
	if prepare != nil {
		if err := prepare(c); err != nil {
			return nil, &OpError{Op: op, Err: fmt.Errorf("prepare: %w", err)}
		}
	}
	sge, err := h.mr.SGE(8, 8)
	if err != nil {
		return nil, &OpError{Op: op, Err: err}
	}
	if err := c.Write(ctx, ready, sge); err != nil {
		return nil, &OpError{Op: op, Err: fmt.Errorf("ready handshake: %w", disconnected(c, err))}
	}
	if err := h.wait(ctx, c); err != nil {
		return nil, &OpError{Op: op, Err: fmt.Errorf("ready handshake: waiting for the peer: %w", disconnected(c, err))}
	}
	ok = true
	return c, nil
}

// disconnected adds ErrDisconnected to err, a failure of the ready
// handshake, when the peer disconnected meanwhile (it gave up: its prepare
// failed, its context ended) and err does not say so already.
func disconnected(c *Channel, err error) error {
	if errors.Is(err, ErrDisconnected) || !errors.Is(c.Err(), ErrDisconnected) {
		return err
	}
	return fmt.Errorf("%w (%w)", ErrDisconnected, err)
}

// watch starts the goroutine that breaks the peer when the CM reports its
// disconnection. stopWatch ends it.
func (p *peer) watch() {
	ctx, cancel := context.WithCancel(context.Background())
	p.cmStop, p.cmDone = cancel, make(chan struct{})
	go func() {
		defer close(p.cmDone)
		if p.cm.WaitDisconnect(ctx) == nil {
			p.breakQP(ErrDisconnected)
		}
	}()
}

func (p *peer) stopWatch() {
	if p.cmStop != nil {
		p.cmStop()
		<-p.cmDone
	}
}

// awaitDisconnect waits (at most the flush grace) for the CM to confirm
// the disconnection Close started: the peer's reply, or its own
// disconnection. Destroying the connection earlier would also end the
// CM's retransmissions of the disconnect request, and a peer whose first
// request was lost would never learn that the channel is gone.
func (p *peer) awaitDisconnect() {
	ctx, cancel := context.WithTimeout(context.Background(), p.e.opts.FlushGrace)
	defer cancel()
	p.cm.WaitDisconnect(ctx)
}

// closeQP destroys the peer's queue pair, and its CM connection if it has
// one (which owns the queue pair).
func (p *peer) closeQP() error {
	if p.cm != nil {
		return p.cm.Close()
	}
	return p.qp.Close()
}

// CMPrivateData returns the private data the peer sent when the channel
// was connected through the RDMA CM (DialCM: the acceptor's reply;
// AcceptCM: the dialer's request), with its exact length; nil for other
// channels. The slice is the caller's.
func (c *Channel) CMPrivateData() []byte {
	if c.p == nil || c.p.cm == nil {
		return nil
	}
	return slices.Clone(c.p.cmData)
}

// CMRoute returns the local device and port and the IP endpoints of a
// channel connected through the RDMA CM, and false for other channels.
func (c *Channel) CMRoute() (verbs.CMRoute, bool) {
	if c.p == nil || c.p.cm == nil {
		return verbs.CMRoute{}, false
	}
	cm := c.p.cm
	return verbs.CMRoute{Device: cm.Device(), Port: cm.Port(), LocalAddr: cm.LocalAddr(), RemoteAddr: cm.RemoteAddr()}, true
}

// CMRequestData returns the private data a DialCM peer sent with req
// (with its exact length), so that the listening side can check it (a
// token, a protocol version) before AcceptCM allocates anything. It fails
// with an error wrapping syscall.EPROTO when req is not from DialCM.
func CMRequestData(req *verbs.CMRequest) ([]byte, error) {
	if req == nil {
		return nil, &OpError{Op: "rdma cm request data", Err: fmt.Errorf("nil request: %w", syscall.EINVAL)}
	}
	_, data, err := parseCMData(req.PrivateData(), MaxCMDialData)
	if err != nil {
		return nil, &OpError{Op: "rdma cm request data", Err: err}
	}
	return data, nil
}
