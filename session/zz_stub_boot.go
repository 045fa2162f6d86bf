package session

// TEMPORARY stub (not committed): replaced by the bootstrap branch.

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"sync"
	"time"
)

type ctrl struct {
	c    net.Conn
	wmu  sync.Mutex
	dn   chan struct{}
	once sync.Once
	e    error
	msgs chan [2][]byte
	ka   sync.Once
}

func newCtrl(c net.Conn) *ctrl {
	k := &ctrl{c: c, dn: make(chan struct{}), msgs: make(chan [2][]byte, 16)}
	go k.read()
	return k
}

func (k *ctrl) read() {
	var h [5]byte
	for {
		if _, err := io.ReadFull(k.c, h[:]); err != nil {
			k.end(ErrPeerLost)
			return
		}
		n := binary.BigEndian.Uint32(h[1:])
		p := make([]byte, n)
		if _, err := io.ReadFull(k.c, p); err != nil {
			k.end(ErrPeerLost)
			return
		}
		switch h[0] {
		case 200:
			k.end(ErrPeerClosed)
			return
		case 201:
			continue
		}
		k.msgs <- [2][]byte{{h[0]}, p}
	}
}

func (k *ctrl) end(err error) {
	k.once.Do(func() { k.e = err; close(k.dn); k.c.Close() })
}

func dialCtrl(ctx context.Context, addr string, cfg *Config) (*ctrl, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return newCtrl(c), nil
}

type ctrlListener struct{ l net.Listener }

func listenCtrl(addr string, cfg *Config) (*ctrlListener, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &ctrlListener{l}, nil
}
func (l *ctrlListener) addr() net.Addr { return l.l.Addr() }
func (l *ctrlListener) accept(ctx context.Context) (*ctrl, error) {
	c, err := l.l.Accept()
	if err != nil {
		return nil, err
	}
	return newCtrl(c), nil
}
func (l *ctrlListener) close() error { return l.l.Close() }

func (k *ctrl) send(typ uint8, p []byte) error {
	k.wmu.Lock()
	defer k.wmu.Unlock()
	var h [5]byte
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:], uint32(len(p)))
	_, err := k.c.Write(append(h[:], p...))
	return err
}
func (k *ctrl) recv(ctx context.Context) (uint8, []byte, error) {
	select {
	case m := <-k.msgs:
		return m[0][0], m[1], nil
	case <-k.dn:
		return 0, nil, k.e
	case <-ctx.Done():
		return 0, nil, ctx.Err()
	}
}
func (k *ctrl) startKeepalive(d time.Duration) {}
func (k *ctrl) done() <-chan struct{}          { return k.dn }
func (k *ctrl) err() error                     { <-k.dn; return k.e }
func (k *ctrl) close() error {
	k.send(200, nil)
	k.end(ErrClosed)
	return nil
}
func (k *ctrl) localAddr() net.Addr  { return k.c.LocalAddr() }
func (k *ctrl) remoteAddr() net.Addr { return k.c.RemoteAddr() }
