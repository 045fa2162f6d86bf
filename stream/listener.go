package stream

import (
	"context"
	"net"
	"sync/atomic"

	"github.com/goverbs/verbs/session"
)

// Listener is a net.Listener of streams: a session.Listener whose
// sessions become Conns.
type Listener struct {
	l      *session.Listener
	ctx    context.Context // ends at Close: Accept's
	cancel context.CancelFunc
	closed atomic.Bool
}

// Listen listens for streams on addr (host:port of the bootstrap);
// cfg configures the sessions.
func Listen(ctx context.Context, addr string, cfg session.Config) (*Listener, error) {
	l, err := session.Listen(ctx, addr, cfg)
	if err != nil {
		return nil, &net.OpError{Op: "listen", Net: netName, Err: err}
	}
	lctx, cancel := context.WithCancel(context.Background())
	return &Listener{l: l, ctx: lctx, cancel: cancel}, nil
}

// Accept waits for the next stream, until Close (net.Listener).
func (l *Listener) Accept() (net.Conn, error) {
	c, err := l.AcceptContext(l.ctx)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// AcceptContext waits for the next stream, until ctx ends or Close.
func (l *Listener) AcceptContext(ctx context.Context) (*Conn, error) {
	if l.l == nil || l.ctx.Err() != nil { // closed, or a zero Listener
		return nil, l.opErr(net.ErrClosed)
	}
	ctx, stop := mergeCancel(ctx, l.ctx)
	defer stop()
	s, err := l.l.Accept(ctx)
	if err != nil {
		if l.ctx.Err() != nil {
			return nil, l.opErr(net.ErrClosed)
		}
		return nil, l.opErr(err)
	}
	return New(s), nil
}

// Close stops Accept; the streams accepted stay open. Only the first of
// any number of (concurrent) Closes does it; the others return an error
// wrapping net.ErrClosed.
func (l *Listener) Close() error {
	if l.l == nil || !l.closed.CompareAndSwap(false, true) {
		return l.opErr(net.ErrClosed)
	}
	l.cancel()
	return l.l.Close()
}

// Addr returns the bootstrap's address (nil for a zero Listener).
func (l *Listener) Addr() net.Addr {
	if l.l == nil {
		return nil
	}
	return l.l.Addr()
}

func (l *Listener) opErr(err error) error {
	return &net.OpError{Op: "accept", Net: netName, Addr: l.Addr(), Err: err}
}

// mergeCancel returns a context that ends with ctx or with also.
func mergeCancel(ctx, also context.Context) (context.Context, context.CancelFunc) {
	if ctx == also {
		return ctx, func() {}
	}
	merged, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(also, cancel)
	return merged, func() { stop(); cancel() }
}
