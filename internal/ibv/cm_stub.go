//go:build !(ibverbs && linux && cgo)

package ibv

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/goverbs/verbs/internal/prov"
)

func errNoCM(op string) error {
	return fmt.Errorf("%s: RDMA connection manager not compiled in; build with `-tags ibverbs` on Linux with cgo, libibverbs-dev and librdmacm-dev: %w", op, prov.ErrNotSupported)
}

// Conn is an established RDMA CM connection (not available in this build).
type Conn struct{}

func (c *Conn) QP() prov.QP                              { return nil }
func (c *Conn) PrivateData() []byte                      { return nil }
func (c *Conn) Device() string                           { return "" }
func (c *Conn) Port() uint8                              { return 0 }
func (c *Conn) LocalAddr() netip.AddrPort                { return netip.AddrPort{} }
func (c *Conn) RemoteAddr() netip.AddrPort               { return netip.AddrPort{} }
func (c *Conn) RemoteQPN() uint32                        { return 0 }
func (c *Conn) WaitDisconnect(ctx context.Context) error { return errNoCM("rdma_cm") }
func (c *Conn) Disconnect() error                        { return nil }
func (c *Conn) Close() error                             { return nil }

// Listener accepts RDMA CM connection requests (not available in this build).
type Listener struct{}

func Listen(ctx context.Context, addr string, backlog int) (*Listener, error) {
	return nil, errNoCM("rdma_cm listen " + addr)
}
func (l *Listener) Addr() netip.AddrPort                           { return netip.AddrPort{} }
func (l *Listener) Close() error                                   { return nil }
func (l *Listener) Next(ctx context.Context) (*ConnRequest, error) { return nil, errNoCM("rdma_cm") }
func (l *Listener) Accept(ctx context.Context, p CMParams) (*Conn, error) {
	return nil, errNoCM("rdma_cm")
}

// ConnRequest is a pending connection request (not available in this build).
type ConnRequest struct{}

func (r *ConnRequest) PrivateData() []byte             { return nil }
func (r *ConnRequest) Device() string                  { return "" }
func (r *ConnRequest) Port() uint8                     { return 0 }
func (r *ConnRequest) RemoteAddr() netip.AddrPort      { return netip.AddrPort{} }
func (r *ConnRequest) LocalAddr() netip.AddrPort       { return netip.AddrPort{} }
func (r *ConnRequest) Reject(privateData []byte) error { return errNoCM("rdma_reject") }
func (r *ConnRequest) Accept(ctx context.Context, p CMParams) (*Conn, error) {
	return nil, errNoCM("rdma_accept")
}

func Resolve(ctx context.Context, addr string) (Route, error) {
	return Route{}, errNoCM("rdma_cm resolve " + addr)
}

func Dial(ctx context.Context, addr string, p CMParams) (*Conn, error) {
	return nil, errNoCM("rdma_cm dial " + addr)
}
