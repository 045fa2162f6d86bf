package provproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/prov"
)

// ErrConnLost is wrapped, together with the cause, by the errors of calls
// that were outstanding or made after the connection to the server ended
// without Client.Close (the peer process exited or was killed, or broke
// the protocol).
var ErrConnLost = errors.New("connection to the peer process lost")

// DefaultCallGuard bounds how long a call waits for the server's answer
// when nothing else bounds it: a call that cannot block in the provider
// (every call but the waits for completion and asynchronous events) whose
// ctx has no deadline, and the answer to a cancellation. A server that has
// not answered by then is taken for stopped or hung: the connection ends,
// failing every call with an error wrapping ErrConnLost, as a RC queue
// pair fails its requests when the peer stops answering. Client.SetCallGuard
// changes it.
const DefaultCallGuard = 30 * time.Second

// errClientClosed is the error of calls made after Client.Close.
var errClientClosed = fmt.Errorf("provproxy: client closed: %w", prov.ErrClosed)

// Client is the client end of a connection to a server (Serve) that holds
// the provider objects in another process. It is a prov.Provider whose
// devices are those of the server's provider: every object opened
// through it forwards each call to the server.
//
// A Client and all objects made through it are safe for concurrent use.
// Calls from different goroutines are in flight at the same time; calls
// made one after the other reach the server in that order.
type Client struct {
	conn     *conn
	provider string
	pid      int
	devices  []prov.DeviceInfo

	nextID atomic.Uint64
	guard  atomic.Int64 // time.Duration; <= 0: no guard

	mu      sync.Mutex
	pending map[uint64]*call
	objs    map[uint64]any // the server's object id → this side's object
	err     error          // why the connection ended; nil while it is up
	closing bool

	readerDone chan struct{}
}

// call is a request waiting for its response.
type call struct {
	op opcode
	ch chan result // buffered: the reader never blocks on it
}

type result struct {
	payload []byte
	err     error
}

// NewClient takes over f, one end of a connection from Pair whose other
// end a server serves, and greets the server. ctx bounds the greeting
// (a peer process that never serves would otherwise block it).
func NewClient(ctx context.Context, f *os.File) (*Client, error) {
	cn, err := newConn(f)
	if err != nil {
		return nil, err
	}
	c := &Client{conn: cn, pending: map[uint64]*call{}, objs: map[uint64]any{}, readerDone: make(chan struct{})}
	c.guard.Store(int64(DefaultCallGuard))
	go c.read()
	var r helloResp
	if err := c.call(ctx, opHello, helloReq{Version: protocolVersion}, &r); err != nil {
		c.Close()
		return nil, err
	}
	if r.Version != protocolVersion {
		c.Close()
		return nil, fmt.Errorf("provproxy: the server speaks protocol version %d, not %d", r.Version, protocolVersion)
	}
	c.provider, c.pid, c.devices = r.Provider, int(r.PID), r.Devices
	return c, nil
}

// PID is the process id of the server, as it reported it.
func (c *Client) PID() int { return c.pid }

// Name is the name of the server's provider ("soft").
func (c *Client) Name() string { return c.provider }

// Devices lists the devices of the server's provider.
func (c *Client) Devices() ([]prov.DeviceInfo, error) {
	return append([]prov.DeviceInfo(nil), c.devices...), nil
}

// Open opens a device in the server.
func (c *Client) Open(name string) (prov.Context, error) {
	var r idResp
	if err := c.call(context.Background(), opOpen, nameReq{Name: name}, &r); err != nil {
		return nil, err
	}
	x := &devContext{obj: obj{c: c, id: r.ID}}
	c.register(r.ID, x)
	return x, nil
}

// SetCallGuard sets how long a call waits for an answer when nothing else
// bounds it (see DefaultCallGuard); d <= 0 lets such calls wait for ever.
// It applies to calls made after it returns.
func (c *Client) SetCallGuard(d time.Duration) { c.guard.Store(int64(d)) }

// Err returns why the connection ended, or nil while it is up.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close ends the connection: the server closes every object still open
// and returns. Outstanding and later calls fail with an error wrapping
// prov.ErrClosed. Close returns once the client's goroutine has ended. It
// is idempotent.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closing = true
	c.mu.Unlock()
	err := c.conn.close()
	<-c.readerDone
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// read delivers responses until the connection ends, then fails every
// call still waiting.
func (c *Client) read() {
	defer close(c.readerDone)
	for {
		p, fds, err := c.conn.recv()
		if err == nil && len(fds) > 0 {
			fdpass.Close(fds)
			err = fmt.Errorf("%w: %d file descriptors sent to the client", errMalformed, len(fds))
		}
		var h header
		if err == nil {
			var payload []byte
			h, payload, err = parseHeader(p)
			if err == nil {
				err = c.deliver(h, payload)
			}
		}
		if err != nil {
			c.end(err)
			return
		}
	}
}

// deliver hands a response to its call.
func (c *Client) deliver(h header, payload []byte) error {
	if h.kind != kindResponse {
		return fmt.Errorf("%w: message kind %d sent to the client", errMalformed, h.kind)
	}
	c.mu.Lock()
	cl := c.pending[h.id]
	if cl != nil && cl.op == h.op {
		delete(c.pending, h.id)
	}
	c.mu.Unlock()
	switch {
	case cl == nil:
		return fmt.Errorf("%w: response to request %d, which is not outstanding", errMalformed, h.id)
	case cl.op != h.op:
		return fmt.Errorf("%w: %s response to a %s request", errMalformed, h.op, cl.op)
	}
	cl.ch <- result{payload: append([]byte(nil), payload...)}
	return nil
}

// end records why the connection ended (the first reason sticks), closes
// it and fails every outstanding call.
func (c *Client) end(cause error) {
	c.mu.Lock()
	switch {
	case c.err != nil:
		// Ended before.
	case c.closing:
		c.err = errClientClosed
	default:
		if errors.Is(cause, io.EOF) {
			cause = fmt.Errorf("the peer process closed it (exited?): %w", cause)
		}
		c.err = fmt.Errorf("provproxy: %w: %w", ErrConnLost, cause)
	}
	pending := c.pending
	c.pending = map[uint64]*call{}
	c.mu.Unlock()
	c.conn.close()
	for _, cl := range pending {
		cl.ch <- result{err: c.err}
	}
}

// call sends a request and waits for its response, decoding it into
// resp, which is filled in also when the operation failed (posts report
// how many requests were accepted). fds are sent along. When ctx ends,
// the server is told to cancel the request, and call still waits for its
// response (which comes as soon as the cancelled operation returns).
func (c *Client) call(ctx context.Context, op opcode, req, resp any, fds ...int) error {
	id := c.nextID.Add(1)
	b, err := marshal(appendHeader(make([]byte, 0, 128), header{kind: kindRequest, op: op, id: id}), req)
	if err != nil {
		return err
	}
	cl := &call{op: op, ch: make(chan result, 1)}
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return fmt.Errorf("provproxy: %s: %w", op, err)
	}
	c.pending[id] = cl
	c.mu.Unlock()
	if err := c.conn.send(b, fds...); err != nil {
		// A connected socket fails a send only when the connection is
		// gone: end it (unless it already ended), which fails this call
		// with the reason.
		c.end(fmt.Errorf("send: %w", err))
	}
	var r result
	cancelled := false
	var guard <-chan time.Time
	if _, ok := ctx.Deadline(); !ok && op != opChanWait && op != opAsyncEvent {
		if t := c.guardTimer(); t != nil {
			defer t.Stop()
			guard = t.C
		}
	}
	select {
	case r = <-cl.ch:
	case <-ctx.Done():
		cancelled = true
		// Best effort: if the send fails, the connection is ending and
		// the reader fails the call.
		c.conn.send(appendHeader(make([]byte, 0, headerLen), header{kind: kindCancel, id: id}))
		r = c.await(cl, "the cancellation of "+op.String())
	case <-guard:
		c.unresponsive(op.String())
		r = <-cl.ch
	}
	if r.err != nil {
		return fmt.Errorf("provproxy: %s: %w", op, r.err)
	}
	var werr wireError
	if err := unmarshal(r.payload, &werr, resp); err != nil {
		return fmt.Errorf("provproxy: %s: response: %w", op, err)
	}
	if err := werr.err(); err != nil {
		if cancelled && errors.Is(err, context.Canceled) {
			// Cancelled on our behalf: report ctx's own reason.
			return fmt.Errorf("provproxy: %s: %w", op, ctx.Err())
		}
		return fmt.Errorf("provproxy: %s in the peer process: %w", op, err)
	}
	return nil
}

// guardTimer returns a timer of the call guard, or nil if there is none.
func (c *Client) guardTimer() *time.Timer {
	if g := time.Duration(c.guard.Load()); g > 0 {
		return time.NewTimer(g)
	}
	return nil
}

// await waits for the result of cl, at most for the call guard; what
// names what is awaited.
func (c *Client) await(cl *call, what string) result {
	t := c.guardTimer()
	if t == nil {
		return <-cl.ch
	}
	defer t.Stop()
	select {
	case r := <-cl.ch:
		return r
	case <-t.C:
		c.unresponsive(what)
		return <-cl.ch
	}
}

// unresponsive ends the connection because the server did not answer
// what within the call guard; every outstanding call fails.
func (c *Client) unresponsive(what string) {
	c.end(fmt.Errorf("no answer to %s within %v: the peer process is stopped or hung", what, time.Duration(c.guard.Load())))
}

func (c *Client) register(id uint64, o any) {
	c.mu.Lock()
	c.objs[id] = o
	c.mu.Unlock()
}

// object returns this side's object for a server id, or nil.
func (c *Client) object(id uint64) any {
	if id == 0 {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.objs[id]
}

// obj is the part every object shares: its client and server id.
type obj struct {
	c  *Client
	id uint64

	closeMu sync.Mutex
	closed  bool
}

// close destroys the server's object; once that succeeded, close does
// nothing. Once the connection has ended, the object is gone with it (the
// server closes every object when the connection ends, or died with
// them): close then releases it on this side and returns nil, since a
// retry could never succeed.
func (o *obj) close() error {
	o.closeMu.Lock()
	defer o.closeMu.Unlock()
	if o.closed {
		return nil
	}
	if err := o.c.call(context.Background(), opClose, idReq{ID: o.id}, &empty{}); err != nil && o.c.Err() == nil {
		return err
	}
	o.closed = true
	o.c.mu.Lock()
	delete(o.c.objs, o.id)
	o.c.mu.Unlock()
	return nil
}
