package verbs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"syscall"

	"github.com/goverbs/verbs/internal/ibv"
	"github.com/goverbs/verbs/internal/prov"
)

// RDMA connection manager (librdmacm).
//
// The connection manager (CM) connects RC queue pairs by IP address and
// port, like TCP: it resolves the address to a local device, port and
// path, exchanges QP numbers and a few bytes of private data with the peer
// over the CM protocol, and drives the QP through INIT, RTR and RTS with
// the attributes the path dictates. The QP is an ordinary *RCQueuePair
// created on the caller's ProtectionDomain with the caller's completion
// queues (QPSpec), so everything else (memory regions, batches, polling)
// works as with Endpoint and Connect.
//
// It needs the hardware provider (build tag ibverbs, librdmacm) and a
// device with an IP address: an RoCE netdev's address, or IPoIB on
// InfiniBand. The soft device soft0 has none: there, and in builds without
// the hardware provider, every CM call fails with an error wrapping
// ErrNotSupported; connect soft0 queue pairs with Endpoint and Connect.

// Private data limits of the InfiniBand/RoCE CM, in bytes. The CM pads
// private data to these sizes: the peer receives the padded length
// (zero-filled), so encode your own length when it matters. iWARP has other
// limits.
const (
	MaxCMDialData   = 56  // with a connection request (DialCM)
	MaxCMAcceptData = 196 // with the reply (CMRequest.Accept)
	MaxCMRejectData = 148 // with a rejection (CMRequest.Reject)
)

// CMRoute is where the CM resolved an address to: the local device and
// port a connection uses, and the IP endpoints.
type CMRoute struct {
	Device     string // local RDMA device, e.g. "mlx5_0"
	Port       uint8  // port of Device
	LocalAddr  netip.AddrPort
	RemoteAddr netip.AddrPort
}

func cmRoute(r ibv.Route) CMRoute {
	return CMRoute{Device: r.Device, Port: r.Port, LocalAddr: r.Local, RemoteAddr: r.Remote}
}

// CMRejectError reports a connection request that was rejected: by the
// peer's application (CMRequest.Reject), or by its CM, for example when
// nothing listens on the port. errors.Is(err, syscall.ECONNREFUSED) holds.
type CMRejectError struct {
	// Reason is the CM's reject reason. On InfiniBand/RoCE: 28 when the
	// peer's application rejected the request, 8 (invalid service ID)
	// when nothing listens on the port.
	Reason int
	// PrivateData is the reject data of the peer's application (padded to
	// MaxCMRejectData on InfiniBand/RoCE).
	PrivateData []byte
}

func (e *CMRejectError) Error() string {
	switch e.Reason {
	case 28:
		return fmt.Sprintf("rejected by the peer (CM reason 28, %d bytes of private data): %v", len(e.PrivateData), syscall.ECONNREFUSED)
	case 8:
		return "rejected by the peer's CM: nothing listens on the port (CM reason 8, invalid service ID): " + syscall.ECONNREFUSED.Error()
	}
	return fmt.Sprintf("rejected by the peer's CM (reason %d): %v", e.Reason, syscall.ECONNREFUSED)
}

// Unwrap returns syscall.ECONNREFUSED.
func (e *CMRejectError) Unwrap() error { return syscall.ECONNREFUSED }

// ByApplication reports whether the peer's application rejected the
// request (InfiniBand/RoCE reason 28), as opposed to its CM.
func (e *CMRejectError) ByApplication() bool { return e.Reason == 28 }

// cmSupported fails unless the RDMA CM can work in this process: the
// hardware provider is compiled in and has at least one device.
func cmSupported(op string) error {
	if !HardwareCompiled {
		return opErr(op, "", fmt.Errorf("the RDMA connection manager needs the hardware provider, and this binary has none: build with -tags ibverbs on Linux with cgo, libibverbs-dev and librdmacm-dev (soft0 has no CM: connect its queue pairs with Endpoint and Connect): %w", ErrNotSupported))
	}
	if devs, err := ibv.New().Devices(); err == nil && len(devs) == 0 {
		return opErr(op, "", fmt.Errorf("the RDMA connection manager needs a hardware RDMA device and there is none (soft0 has no CM: connect its queue pairs with Endpoint and Connect): %w, %w", ErrNotSupported, ErrNoDevice))
	}
	return nil
}

// cmErr wraps an error of the internal CM, adding ErrTimeout when ctx
// ended the call.
func cmErr(ctx context.Context, op, dev string, err error) error {
	if err == nil {
		return nil
	}
	if waitEnded(ctx, err) != nil && !errors.Is(err, ErrTimeout) {
		err = fmt.Errorf("%w: %w", ErrTimeout, err)
	}
	return opErr(op, dev, err)
}

// CMListenOptions configure ListenCM. The zero value is usable.
type CMListenOptions struct {
	// Backlog bounds the connection requests the kernel queues before
	// Accept takes them; default 128.
	Backlog int
}

// CMListener receives RDMA CM connection requests on an IP address and
// port. It is safe for concurrent use: several goroutines may Accept.
type CMListener struct {
	res  resource
	l    *ibv.Listener
	addr netip.AddrPort

	mu      sync.Mutex
	pending map[*CMRequest]struct{} // returned by Accept, not yet answered
}

// ListenCM listens for RDMA CM connection requests on addr: "ip:port", a
// host name, "[fe80::1%eth0]:port" for an IPv6 link-local address, or
// ":port" for every address of every RDMA device. Port 0 picks a free port
// (see Addr). ctx bounds the name lookup only.
//
// The listener does not create queue pairs: each request names the device
// it arrived on, and CMRequest.Accept creates the QP on a PD of that
// device. Close the listener when done.
func ListenCM(ctx context.Context, addr string, opts CMListenOptions) (*CMListener, error) {
	op := "listen rdma cm " + addr
	if err := cmSupported(op); err != nil {
		return nil, err
	}
	il, err := ibv.Listen(ctx, addr, opts.Backlog)
	if err != nil {
		return nil, cmErr(ctx, op, "", err)
	}
	l := &CMListener{l: il, addr: il.Addr()}
	if err := initResource(l, &l.res, "rdma cm listener", l.addr.String()); err != nil {
		il.Close()
		return nil, err
	}
	return l, nil
}

// Addr returns the bound address, with the port the system chose when
// ListenCM asked for port 0.
func (l *CMListener) Addr() netip.AddrPort { return l.addr }

// Accept waits for the next connection request, or until ctx ends or the
// listener is closed. Answer every request it returns with Accept or
// Reject: the peer waits (until its CM times out) for the answer.
func (l *CMListener) Accept(ctx context.Context) (*CMRequest, error) {
	const op = "accept rdma cm request"
	if l.res.isClosed() {
		return nil, l.res.errClosed(op)
	}
	ir, err := l.l.Next(ctx)
	if err != nil {
		if l.res.isClosed() || errors.Is(err, ErrClosed) {
			return nil, l.res.errClosed(op)
		}
		return nil, cmErr(ctx, op, "", err)
	}
	r := &CMRequest{r: ir, l: l}
	desc := fmt.Sprintf("from %v on %s port %d", ir.RemoteAddr(), ir.Device(), ir.Port())
	if err := initResource(r, &r.res, "rdma cm request", desc); err != nil {
		ir.Reject(nil)
		return nil, err
	}
	l.mu.Lock()
	if l.pending == nil {
		l.pending = make(map[*CMRequest]struct{})
	}
	l.pending[r] = struct{}{}
	l.mu.Unlock()
	return r, nil
}

// Close stops listening and rejects the requests Accept returned that are
// not yet accepted or rejected (their Accept and Reject then fail with
// ErrClosed). Connections already accepted are not affected. Close is
// idempotent.
func (l *CMListener) Close() error {
	return l.res.close(func() error {
		if err := l.l.Close(); err != nil {
			return opErr("close rdma cm listener", "", err)
		}
		l.mu.Lock()
		pending := l.pending
		l.pending = nil
		l.mu.Unlock()
		for r := range pending {
			r.res.close(nil)
		}
		return nil
	})
}

// CMRequest is a connection request received by a CMListener. Answer it
// exactly once, with Accept or Reject; later calls fail with ErrClosed. Its
// methods are safe for concurrent use.
type CMRequest struct {
	res resource // closed once answered
	r   *ibv.ConnRequest
	l   *CMListener
}

// done marks r answered.
func (r *CMRequest) done() {
	r.l.mu.Lock()
	delete(r.l.pending, r)
	r.l.mu.Unlock()
	r.res.close(nil)
}

// PrivateData returns the private data of the request (padded to
// MaxCMDialData on InfiniBand/RoCE). The slice is the caller's.
func (r *CMRequest) PrivateData() []byte {
	if r.r == nil {
		return nil // a zero CMRequest
	}
	return slices.Clone(r.r.PrivateData())
}

// Device returns the local RDMA device the request arrived on: Accept
// needs a PD (and CQs) of this device.
func (r *CMRequest) Device() string {
	if r.r == nil {
		return ""
	}
	return r.r.Device()
}

// Port returns the port of Device the request arrived on.
func (r *CMRequest) Port() uint8 {
	if r.r == nil {
		return 0
	}
	return r.r.Port()
}

// LocalAddr returns the listening address the request was sent to.
func (r *CMRequest) LocalAddr() netip.AddrPort {
	if r.r == nil {
		return netip.AddrPort{}
	}
	return r.r.LocalAddr()
}

// RemoteAddr returns the requester's address.
func (r *CMRequest) RemoteAddr() netip.AddrPort {
	if r.r == nil {
		return netip.AddrPort{}
	}
	return r.r.RemoteAddr()
}

// Accept creates an RC queue pair on pd with spec (see DialCM for the
// fields of QPSpec the CM uses), brings it to RTS, replies with
// privateData (at most MaxCMAcceptData bytes) and returns once the
// connection is established, or fails when ctx ends first.
//
// pd, spec.SendCQ and spec.RecvCQ must belong to Device (port Port). If
// Accept fails for any reason, the request is rejected (without private
// data) and finished.
func (r *CMRequest) Accept(ctx context.Context, pd *ProtectionDomain, spec QPSpec, privateData []byte) (*CMConn, error) {
	const op = "accept rdma cm connection"
	if r.res.isClosed() {
		return nil, r.res.errClosed(op)
	}
	defer r.done()
	if err := checkCMPD(op, pd); err != nil {
		r.r.Reject(nil)
		return nil, err
	}
	var qp *RCQueuePair
	var qerr error
	p := ibv.CMParams{PrivateData: privateData}
	p.NewQP = func(rt ibv.Route, p *ibv.CMParams) (prov.QP, error) {
		qp, qerr = newCMQP(pd, spec, cmRoute(rt), p)
		if qerr != nil {
			return nil, qerr
		}
		return qp.qp, nil
	}
	ic, err := r.r.Accept(ctx, p)
	if err != nil {
		if qp != nil {
			qp.Close()
		}
		if qerr != nil {
			return nil, qerr
		}
		if errors.Is(err, ErrClosed) {
			return nil, r.res.errClosed(op)
		}
		return nil, cmErr(ctx, op, r.Device(), err)
	}
	return newCMConn(ic, qp)
}

// Reject refuses the request, sending privateData (at most
// MaxCMRejectData bytes) to the requester, whose DialCM fails with a
// *CMRejectError.
func (r *CMRequest) Reject(privateData []byte) error {
	const op = "reject rdma cm request"
	if r.res.isClosed() {
		return r.res.errClosed(op)
	}
	defer r.done()
	if err := r.r.Reject(privateData); err != nil {
		if errors.Is(err, ErrClosed) {
			return r.res.errClosed(op)
		}
		return opErr(op, r.Device(), err)
	}
	return nil
}

// checkCMPD fails unless pd can hold a CM queue pair.
func checkCMPD(op string, pd *ProtectionDomain) error {
	if pd == nil {
		return opErr(op, "", fmt.Errorf("nil protection domain: %w", syscall.EINVAL))
	}
	if err := pd.check(op); err != nil {
		return err
	}
	if pd.c.provider != "ibverbs" {
		return opErr(op, pd.c.name, fmt.Errorf("the RDMA connection manager needs the hardware provider; %s (provider %s) has no CM: connect its queue pairs with Endpoint and Connect: %w", pd.c.name, pd.c.provider, ErrNotSupported))
	}
	return nil
}

// newCMQP creates the RC queue pair of a CM connection over route on pd,
// in RESET (the CM moves it on), and sets the QP-related fields of p from
// spec.
func newCMQP(pd *ProtectionDomain, spec QPSpec, route CMRoute, p *ibv.CMParams) (*RCQueuePair, error) {
	const op = "create rc qp for rdma cm"
	if err := checkCMPD(op, pd); err != nil {
		return nil, err
	}
	if pd.c.name != route.Device {
		return nil, opErr(op, pd.c.name, fmt.Errorf("the route to %v uses device %s port %d, but the protection domain belongs to %s (use a PD of %s; ResolveCM or DialCMFunc tell the device before connecting): %w",
			route.RemoteAddr, route.Device, route.Port, pd.c.name, route.Device, syscall.EXDEV))
	}
	if spec.Port != 0 && spec.Port != route.Port {
		return nil, opErr(op, pd.c.name, fmt.Errorf("QPSpec.Port is %d, but the route to %v uses port %d: %w", spec.Port, route.RemoteAddr, route.Port, syscall.EXDEV))
	}
	timeout, mtu := spec.Timeout, spec.MTU // zero: the CM's choice, not QPSpec's default
	spec.Port = route.Port
	plan, err := planQP(pd, TransportRC, spec)
	if err != nil {
		return nil, err
	}
	q := new(RCQueuePair)
	if err := buildQP(q, &q.qpCore, pd, &plan); err != nil {
		return nil, err
	}
	// Local write is ignored for a QP; it keeps Access non-zero, which
	// the internal CM would read as "everything", when no remote access
	// is granted.
	p.Access = prov.Access(q.remoteAccess() | AccessLocalWrite)
	p.ResponderResources = uint8(min(plan.spec.MaxRDAtomic, 255))
	p.InitiatorDepth = p.ResponderResources
	p.RetryCount = plan.spec.RetryCount
	p.RNRRetryCount = plan.spec.RNRRetry
	p.MinRNRTimer = plan.spec.MinRNRTimer
	p.Timeout = timeout
	p.MaxMTU = prov.MTU(mtu)
	return q, nil
}

// newCMConn wraps an established connection and its QP.
func newCMConn(ic *ibv.Conn, qp *RCQueuePair) (*CMConn, error) {
	c := &CMConn{c: ic, qp: qp, pdata: ic.PrivateData(),
		route: CMRoute{Device: ic.Device(), Port: ic.Port(), LocalAddr: ic.LocalAddr(), RemoteAddr: ic.RemoteAddr()}}
	if a, _, err := qp.qp.Query(); err == nil {
		qp.psn = a.SQPSN // the CM chose it
	}
	// The connection is a child of its QP: the QP cannot be closed under it.
	if err := initResource(c, &c.res, "rdma cm connection", fmt.Sprintf("%v to %v", c.route.LocalAddr, c.route.RemoteAddr), &qp.res); err != nil {
		ic.Close()
		qp.Close()
		return nil, err
	}
	return c, nil
}

// DialCM connects to the CM listener at addr ("ip:port", "host:port" or
// "[fe80::1%eth0]:port") with an RC queue pair created on pd with spec,
// sending privateData (at most MaxCMDialData bytes) with the request. It
// returns once the QP is in RTS and the connection established; ctx bounds
// the whole exchange (address and route resolution included).
//
// The CM chooses the local device from the route to addr: pd,
// spec.SendCQ and spec.RecvCQ must belong to it, or DialCM fails with an
// error naming the route's device and wrapping syscall.EXDEV. ResolveCM
// tells the device beforehand; DialCMFunc lets a callback choose the PD
// once it is known.
//
// The CM sets the path (port, source GID, MTU, PSNs, peer QPN) and
// negotiates the RDMA read/atomic depths (up to spec.MaxRDAtomic). Of
// spec, it uses the CQs, SRQ, capacities, SignalAll, Access/DenyRemote,
// MaxRDAtomic, RetryCount, RNRRetry and MinRNRTimer as for Connect, plus:
// Port must be zero or the route's port; MTU, when set, caps the path MTU;
// Timeout, when set, replaces the ACK timeout the CM derives from the path.
// PSN, GIDIndex, FixedGID and QKey are ignored.
//
// A rejection fails with a *CMRejectError (wrapping syscall.ECONNREFUSED);
// every error is an *OpError.
func DialCM(ctx context.Context, addr string, pd *ProtectionDomain, spec QPSpec, privateData []byte) (*CMConn, error) {
	op := "dial rdma cm " + addr
	if err := checkCMPD(op, pd); err != nil {
		return nil, err
	}
	return dialCM(ctx, op, addr, func(CMRoute) (*ProtectionDomain, QPSpec, error) { return pd, spec, nil }, privateData)
}

// CMSetupFunc returns the protection domain and QP spec of a connection
// once the CM has resolved its route (DialCMFunc). The PD, CQs and SRQ stay
// the caller's.
type CMSetupFunc func(route CMRoute) (*ProtectionDomain, QPSpec, error)

// DialCMFunc is DialCM for callers that pick the device by the route:
// setup is called once the route to addr is resolved, with the device and
// port, and returns the PD and spec for the QP (e.g. from a table of open
// devices). An error from setup ends the dial and is returned as is.
func DialCMFunc(ctx context.Context, addr string, setup CMSetupFunc, privateData []byte) (*CMConn, error) {
	op := "dial rdma cm " + addr
	if setup == nil {
		return nil, opErr(op, "", fmt.Errorf("nil setup function: %w", syscall.EINVAL))
	}
	return dialCM(ctx, op, addr, setup, privateData)
}

func dialCM(ctx context.Context, op, addr string, setup CMSetupFunc, privateData []byte) (*CMConn, error) {
	if err := cmSupported(op); err != nil {
		return nil, err
	}
	if len(privateData) > MaxCMDialData {
		return nil, opErr(op, "", fmt.Errorf("%d bytes of private data, at most %d: %w", len(privateData), MaxCMDialData, syscall.EINVAL))
	}
	var qp *RCQueuePair
	var qerr error
	dev := ""
	p := ibv.CMParams{PrivateData: privateData}
	p.NewQP = func(rt ibv.Route, p *ibv.CMParams) (prov.QP, error) {
		route := cmRoute(rt)
		dev = route.Device
		pd, spec, err := setup(route)
		if err != nil {
			qerr = err
			return nil, err
		}
		qp, qerr = newCMQP(pd, spec, route, p)
		if qerr != nil {
			return nil, qerr
		}
		return qp.qp, nil
	}
	ic, err := ibv.Dial(ctx, addr, p)
	if err != nil {
		if qp != nil {
			qp.Close()
		}
		if qerr != nil {
			return nil, qerr
		}
		var rej *ibv.RejectError
		if errors.As(err, &rej) {
			return nil, opErr(op, dev, &CMRejectError{Reason: rej.Status, PrivateData: rej.PrivateData})
		}
		return nil, cmErr(ctx, op, dev, err)
	}
	return newCMConn(ic, qp)
}

// ResolveCM resolves addr to the local device and port (and addresses) a
// DialCM to it would use, without connecting, so that the caller can open
// the device and create the PD and CQs first. ctx bounds the resolution.
func ResolveCM(ctx context.Context, addr string) (CMRoute, error) {
	op := "resolve rdma cm route to " + addr
	if err := cmSupported(op); err != nil {
		return CMRoute{}, err
	}
	r, err := ibv.Resolve(ctx, addr)
	if err != nil {
		return CMRoute{}, cmErr(ctx, op, "", err)
	}
	return cmRoute(r), nil
}

// CMConn is an established RDMA CM connection: an RC queue pair in RTS,
// connected to the peer, and the CM state that tracks the connection. It
// is safe for concurrent use.
//
// The CMConn owns its queue pair: Close disconnects and destroys both, and
// closing the QP alone fails while the CMConn is open. The PD and CQs stay
// the caller's; they cannot be closed before the CMConn.
type CMConn struct {
	res   resource
	c     *ibv.Conn
	qp    *RCQueuePair
	route CMRoute
	pdata []byte
}

// QP returns the connected queue pair. Post to it and poll its CQs as to
// any RC queue pair; do not Close it (CMConn.Close does) nor Connect it.
func (c *CMConn) QP() *RCQueuePair { return c.qp }

// PrivateData returns the peer's private data: the reply's for DialCM
// (padded to MaxCMAcceptData on InfiniBand/RoCE), the request's for
// CMRequest.Accept (padded to MaxCMDialData). The slice is the caller's.
func (c *CMConn) PrivateData() []byte { return slices.Clone(c.pdata) }

// Device returns the local RDMA device of the connection.
func (c *CMConn) Device() string { return c.route.Device }

// Port returns the local port of the connection.
func (c *CMConn) Port() uint8 { return c.route.Port }

// LocalAddr returns the local IP endpoint.
func (c *CMConn) LocalAddr() netip.AddrPort { return c.route.LocalAddr }

// RemoteAddr returns the peer's IP endpoint.
func (c *CMConn) RemoteAddr() netip.AddrPort { return c.route.RemoteAddr }

// RemoteQPN returns the peer's queue pair number.
func (c *CMConn) RemoteQPN() uint32 {
	if c.c == nil {
		return 0 // a zero CMConn
	}
	return c.c.RemoteQPN()
}

// WaitDisconnect blocks until the peer disconnects (it returns nil, also
// on every later call), ctx ends, or the connection is closed (ErrClosed).
// After the peer disconnected, its QP no longer answers: Close the CMConn.
func (c *CMConn) WaitDisconnect(ctx context.Context) error {
	const op = "wait for rdma cm disconnect"
	if c.res.isClosed() {
		return c.res.errClosed(op)
	}
	if err := c.c.WaitDisconnect(ctx); err != nil {
		if c.res.isClosed() || errors.Is(err, ErrClosed) {
			return c.res.errClosed(op)
		}
		return cmErr(ctx, op, c.route.Device, err)
	}
	return nil
}

// Disconnect tells the peer that the connection ends and moves the QP to
// the error state: its outstanding work requests complete with
// StatusWRFlushErr, so the buffers they name can be reclaimed by polling
// the CQs. The QP stays until Close. Only the first call acts.
func (c *CMConn) Disconnect() error {
	const op = "disconnect rdma cm"
	if c.res.isClosed() {
		return nil
	}
	return opErr(op, c.route.Device, c.c.Disconnect())
}

// Close disconnects (see Disconnect; without draining: outstanding work
// requests are dropped as by RCQueuePair.Close), releases the CM state and
// destroys the QP. Close is idempotent.
func (c *CMConn) Close() error {
	if err := c.res.close(func() error { return opErr("close rdma cm connection", c.route.Device, c.c.Close()) }); err != nil {
		return err
	}
	if c.qp == nil {
		return nil // a zero CMConn
	}
	return c.qp.Close()
}
