//go:build ibverbs && linux && cgo

package ibv

/*
#cgo LDFLAGS: -lrdmacm -libverbs
#include "cmshim.h"
#include <sys/socket.h>
#cgo nocallback gv_cm_get_event
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// RDMA connection manager (librdmacm) for the session layer: IP addressing,
// route resolution and connection establishment with private data, on RC
// queue pairs created on the caller's PD and CQs.
//
// The CM's own device context (rdma_cm_id.verbs) is not used for
// resources: the QP is created on the caller's PD (a context opened with
// Open) for the same device, and moved through INIT/RTR/RTS with the
// attributes rdma_init_qp_attr computes; rdma_connect/rdma_accept carry its
// QPN. Every connection has its own event channel whose fd is non-blocking
// on the Go runtime poller, so every wait honours its context.
//
// Private data: RoCE/IB CM pads it (to 56 bytes in a request, 196 in a
// reply, 148 in a reject); the peer sees the padded length, so encode your
// own length when it matters.

// Conn is an established RDMA CM connection.
type Conn struct {
	qp      *queuePair
	ownQP   bool
	id      *C.struct_rdma_cm_id
	ch      *C.struct_rdma_event_channel
	ev      *evFD
	device  string
	port    uint8
	local   netip.AddrPort
	remote  netip.AddrPort
	pdata   []byte
	peerQPN uint32

	disconnected chan struct{}
	discOnce     sync.Once // closes disconnected
	localDisc    sync.Once // Disconnect
	closer       closer
}

// QP is the connected RC queue pair (in RTS). It belongs to the caller:
// close it after Conn.Close.
func (c *Conn) QP() prov.QP { return c.qp }

// PrivateData is what the peer sent (reply on Dial, request on Accept).
func (c *Conn) PrivateData() []byte { return c.pdata }

// Device is the RDMA device of the connection, Port its port.
func (c *Conn) Device() string { return c.device }
func (c *Conn) Port() uint8    { return c.port }

// LocalAddr and RemoteAddr are the IP endpoints.
func (c *Conn) LocalAddr() netip.AddrPort  { return c.local }
func (c *Conn) RemoteAddr() netip.AddrPort { return c.remote }

// RemoteQPN is the peer's QP number.
func (c *Conn) RemoteQPN() uint32 { return c.peerQPN }

// WaitDisconnect blocks until the peer disconnects (nil) or ctx ends.
func (c *Conn) WaitDisconnect(ctx context.Context) error {
	for {
		select {
		case <-c.disconnected:
			return nil
		default:
		}
		ev, err := cmWait(ctx, c.ev, c.ch)
		if err != nil {
			return err
		}
		c.handle(&ev)
	}
}

func (c *Conn) handle(ev *C.gv_cm_event) {
	switch ev.event {
	case C.RDMA_CM_EVENT_DISCONNECTED, C.RDMA_CM_EVENT_DEVICE_REMOVAL:
		c.discOnce.Do(func() { close(c.disconnected) })
	}
}

// Disconnect sends a disconnect request to the peer and moves the QP to
// the error state, which flushes its outstanding work requests; the QP
// and the CM resources stay until Close. Only the first call acts.
func (c *Conn) Disconnect() error {
	var err error
	c.localDisc.Do(func() {
		if rc := C.gv_cm_disconnect(c.id); rc != 0 && rc != C.int(syscall.EINVAL) {
			// EINVAL: the peer disconnected first.
			err = cmErr("rdma_disconnect", rc)
		}
		if c.qp != nil {
			if merr := c.qp.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState); merr != nil && err == nil {
				err = merr
			}
		}
	})
	return err
}

// Close disconnects (see Disconnect) and releases the CM resources. The QP
// stays with the caller.
func (c *Conn) Close() error {
	return c.closer.do(func() error {
		c.Disconnect()
		destroyCM(c.id, c.ch, c.ev)
		return nil
	})
}

// Listener accepts RDMA CM connection requests.
type Listener struct {
	id     *C.struct_rdma_cm_id
	ch     *C.struct_rdma_event_channel
	ev     *evFD
	addr   netip.AddrPort
	closer closer

	// busy is read-held by Next from its wait until the request it
	// returns is in pending, and write-held by Close while it rejects the
	// pending requests and destroys the channel: a request's cm_id uses
	// the listener's channel until Accept migrates it.
	busy    sync.RWMutex
	closed  bool // under busy (write)
	pmu     sync.Mutex
	pending map[*ConnRequest]struct{}
}

// ConnRequest is a pending connection request.
type ConnRequest struct {
	l       *Listener
	mu      sync.Mutex // guards done and the cm_id until migrated or destroyed
	id      *C.struct_rdma_cm_id
	device  string
	port    uint8
	local   netip.AddrPort
	remote  netip.AddrPort
	pdata   []byte
	peerQPN uint32
	// what the peer asked for
	respRes, initDepth, rnrRetry uint8
	done                         bool
}

// PrivateData is the private data of the request.
func (r *ConnRequest) PrivateData() []byte { return r.pdata }

// Device and Port name the local RDMA port the request arrived on; the
// accepting QP must be created on it.
func (r *ConnRequest) Device() string { return r.device }
func (r *ConnRequest) Port() uint8    { return r.port }

// RemoteAddr is the requester's IP endpoint, LocalAddr the listening one.
func (r *ConnRequest) RemoteAddr() netip.AddrPort { return r.remote }
func (r *ConnRequest) LocalAddr() netip.AddrPort  { return r.local }

// parseAddr parses "ip:port", "[ip%zone]:port" or "host:port" (resolved
// with the system resolver when not a literal).
func parseAddr(ctx context.Context, addr string) (C.gv_sockaddr, netip.AddrPort, error) {
	var sa C.gv_sockaddr
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return sa, netip.AddrPort{}, err
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return sa, netip.AddrPort{}, fmt.Errorf("bad port in %q", addr)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		if host == "" {
			ip = netip.IPv6Unspecified()
		} else {
			ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
			if err != nil || len(ips) == 0 {
				return sa, netip.AddrPort{}, fmt.Errorf("resolve %q: %w", host, err)
			}
			ip = ips[0]
		}
	}
	ap := netip.AddrPortFrom(ip, uint16(port))
	sa.port = C.uint16_t(port)
	if ip.Is4() || ip.Is4In6() {
		sa.family = C.AF_INET
		a := ip.Unmap().As4()
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&sa.addr[0])), 4), a[:])
		return sa, ap, nil
	}
	sa.family = C.AF_INET6
	a := ip.As16()
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&sa.addr[0])), 16), a[:])
	if z := ip.Zone(); z != "" {
		ifc, err := net.InterfaceByName(z)
		if err != nil {
			if n, perr := strconv.Atoi(z); perr == nil {
				sa.scope_id = C.uint32_t(n)
			} else {
				return sa, netip.AddrPort{}, fmt.Errorf("zone of %q: %w", addr, err)
			}
		} else {
			sa.scope_id = C.uint32_t(ifc.Index)
		}
	}
	return sa, ap, nil
}

func toAddrPort(sa *C.gv_sockaddr) netip.AddrPort {
	b := unsafe.Slice((*byte)(unsafe.Pointer(&sa.addr[0])), 16)
	switch sa.family {
	case C.AF_INET:
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[:4])), uint16(sa.port))
	case C.AF_INET6:
		ip := netip.AddrFrom16([16]byte(b))
		if sa.scope_id != 0 {
			if ifc, err := net.InterfaceByIndex(int(sa.scope_id)); err == nil {
				ip = ip.WithZone(ifc.Name)
			} else {
				ip = ip.WithZone(strconv.Itoa(int(sa.scope_id)))
			}
		}
		return netip.AddrPortFrom(ip, uint16(sa.port))
	}
	return netip.AddrPort{}
}

func cmErr(op string, rc C.int) error {
	return errnoErr(op, rc)
}

// newCMChannel creates an event channel with its fd on the poller.
func newCMChannel() (*C.struct_rdma_event_channel, *evFD, error) {
	ch, err := C.rdma_create_event_channel()
	if ch == nil {
		return nil, nil, wrapErr("rdma_create_event_channel", err)
	}
	ev, err := newEvFD(int(ch.fd), "rdma-cm")
	if err != nil {
		C.rdma_destroy_event_channel(ch)
		return nil, nil, err
	}
	return ch, ev, nil
}

func destroyCM(id *C.struct_rdma_cm_id, ch *C.struct_rdma_event_channel, ev *evFD) {
	if ev != nil {
		ev.close()
	}
	if id != nil {
		C.gv_cm_destroy_id(id)
	}
	if ch != nil {
		C.rdma_destroy_event_channel(ch)
	}
}

// cmWait returns the next event of ch.
func cmWait(ctx context.Context, ev *evFD, ch *C.struct_rdma_event_channel) (C.gv_cm_event, error) {
	var out C.gv_cm_event
	var rc C.int
	err := ev.wait(ctx, func() bool {
		rc = C.gv_cm_get_event(ch, &out)
		return rc != C.int(syscall.EAGAIN)
	})
	if err != nil {
		return out, err
	}
	if rc != 0 {
		return out, cmErr("rdma_get_cm_event", rc)
	}
	return out, nil
}

// cmEventName names an enum rdma_cm_event_type value.
func cmEventName(e C.uint32_t) string {
	return C.GoString(C.rdma_event_str(C.enum_rdma_cm_event_type(e)))
}

// cmEventErr turns an unexpected event into an error.
func cmEventErr(op string, ev *C.gv_cm_event) error {
	name := cmEventName(ev.event)
	st := int(ev.status)
	var errno syscall.Errno
	switch ev.event {
	case C.RDMA_CM_EVENT_REJECTED:
		errno = syscall.ECONNREFUSED
	case C.RDMA_CM_EVENT_UNREACHABLE, C.RDMA_CM_EVENT_ADDR_ERROR, C.RDMA_CM_EVENT_ROUTE_ERROR:
		errno = syscall.EHOSTUNREACH
		if st == -int(syscall.ETIMEDOUT) {
			errno = syscall.ETIMEDOUT
		}
	case C.RDMA_CM_EVENT_CONNECT_ERROR:
		errno = syscall.ECONNABORTED
	case C.RDMA_CM_EVENT_DEVICE_REMOVAL:
		errno = syscall.ENODEV
	default:
		errno = syscall.EPROTO
	}
	return fmt.Errorf("%s: %s (status %d): %w", op, name, st, errno)
}

// expect waits for event want on ch; any other event is an error.
func expect(ctx context.Context, op string, ev *evFD, ch *C.struct_rdma_event_channel, want C.uint32_t) (C.gv_cm_event, error) {
	e, err := cmWait(ctx, ev, ch)
	if err != nil {
		return e, fmt.Errorf("%s: %w", op, err)
	}
	if e.event != want {
		return e, cmEventErr(op, &e)
	}
	return e, nil
}

func privateData(e *C.gv_cm_event) []byte {
	return C.GoBytes(unsafe.Pointer(&e.private_data[0]), C.int(e.private_data_len))
}

func deviceOf(id *C.struct_rdma_cm_id) (string, uint8) {
	n := C.gv_cm_device_name(id)
	if n == nil {
		return "", 0
	}
	return C.GoString(n), uint8(id.port_num)
}

// Listen binds addr ("ip:port"; port 0 picks one; "[fe80::1%eth0]:port"
// for link-local IPv6) and listens for connection requests.
func Listen(ctx context.Context, addr string, backlog int) (*Listener, error) {
	sa, _, err := parseAddr(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("rdma_cm listen %s: %w", addr, err)
	}
	ch, ev, err := newCMChannel()
	if err != nil {
		return nil, err
	}
	l := &Listener{ch: ch, ev: ev}
	if rc := C.gv_cm_create_id(ch, &l.id); rc != 0 {
		destroyCM(nil, ch, ev)
		return nil, cmErr("rdma_create_id", rc)
	}
	if rc := C.gv_cm_bind_addr(l.id, &sa); rc != 0 {
		destroyCM(l.id, ch, ev)
		return nil, cmErr("rdma_bind_addr "+addr, rc)
	}
	if backlog <= 0 {
		backlog = 128
	}
	if rc := C.gv_cm_listen(l.id, C.int(backlog)); rc != 0 {
		destroyCM(l.id, ch, ev)
		return nil, cmErr("rdma_listen "+addr, rc)
	}
	var local, peer C.gv_sockaddr
	C.gv_cm_addrs(l.id, &local, &peer)
	l.addr = toAddrPort(&local)
	return l, nil
}

// Addr is the bound address (with the port chosen when 0 was asked).
func (l *Listener) Addr() netip.AddrPort { return l.addr }

// Close stops listening. Requests returned by Next that are not yet
// accepted or rejected are rejected (their Accept and Reject then fail
// with ErrClosed); requests not yet returned by Next are rejected by the
// kernel.
func (l *Listener) Close() error {
	return l.closer.do(func() error {
		l.ev.close() // wakes the waiters of Next
		l.busy.Lock()
		defer l.busy.Unlock()
		l.closed = true
		l.pmu.Lock()
		pending := l.pending
		l.pending = nil
		l.pmu.Unlock()
		for r := range pending {
			r.mu.Lock()
			if !r.done {
				r.done = true
				r.rejectQuiet()
			}
			r.mu.Unlock()
		}
		destroyCM(l.id, l.ch, nil)
		return nil
	})
}

// forget drops r from the pending requests.
func (l *Listener) forget(r *ConnRequest) {
	l.pmu.Lock()
	delete(l.pending, r)
	l.pmu.Unlock()
}

// Next waits for the next connection request. The caller must Accept or
// Reject it.
func (l *Listener) Next(ctx context.Context) (*ConnRequest, error) {
	l.busy.RLock()
	defer l.busy.RUnlock()
	if l.closed {
		return nil, fmt.Errorf("rdma_cm accept: %w", prov.ErrClosed)
	}
	for {
		e, err := cmWait(ctx, l.ev, l.ch)
		if err != nil {
			return nil, fmt.Errorf("rdma_cm accept: %w", err)
		}
		if e.event != C.RDMA_CM_EVENT_CONNECT_REQUEST {
			continue // e.g. events of requests being torn down
		}
		r := &ConnRequest{
			l:         l,
			id:        e.id,
			pdata:     privateData(&e),
			peerQPN:   uint32(e.qp_num),
			respRes:   uint8(e.responder_resources),
			initDepth: uint8(e.initiator_depth),
			rnrRetry:  uint8(e.rnr_retry_count),
		}
		r.device, r.port = deviceOf(e.id)
		var local, peer C.gv_sockaddr
		C.gv_cm_addrs(e.id, &local, &peer)
		r.local, r.remote = toAddrPort(&local), toAddrPort(&peer)
		l.pmu.Lock()
		if l.pending == nil {
			l.pending = make(map[*ConnRequest]struct{})
		}
		l.pending[r] = struct{}{}
		l.pmu.Unlock()
		return r, nil
	}
}

// Accept waits for the next request and accepts it with p.
func (l *Listener) Accept(ctx context.Context, p CMParams) (*Conn, error) {
	r, err := l.Next(ctx)
	if err != nil {
		return nil, err
	}
	return r.Accept(ctx, p)
}

// Reject refuses the request with optional private data (at most 148
// bytes).
func (r *ConnRequest) Reject(privateData []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return prov.ErrClosed
	}
	r.done = true
	if r.l != nil {
		r.l.forget(r)
	}
	if len(privateData) > 148 {
		r.rejectQuiet()
		return fmt.Errorf("rdma_reject: %d bytes of private data, at most 148: %w", len(privateData), syscall.EINVAL)
	}
	p, n := bytesArg(privateData)
	rc := C.gv_cm_reject(r.id, p, n)
	C.gv_cm_destroy_id(r.id)
	if rc != 0 {
		return cmErr("rdma_reject", rc)
	}
	return nil
}

func (p *CMParams) defaults() {
	if p.Access == 0 {
		p.Access = prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead | prov.AccessRemoteAtomic
	}
	retries := func(v int) int {
		switch {
		case v == 0:
			return 7
		case v < 0:
			return 0
		}
		return min(v, 7)
	}
	p.RetryCount = retries(p.RetryCount)
	p.RNRRetryCount = retries(p.RNRRetryCount)
}

// createQP makes the RC QP for a connection over route r, then fills in
// the defaults of p.
func (p *CMParams) createQP(r Route) (*queuePair, bool, error) {
	q, own, err := p.createQP1(r)
	p.defaults()
	return q, own, err
}

func (p *CMParams) createQP1(r Route) (*queuePair, bool, error) {
	device := r.Device
	if p.NewQP != nil {
		qp, err := p.NewQP(r, p)
		if err != nil {
			return nil, false, err
		}
		q, ok := qp.(*queuePair)
		if !ok {
			return nil, false, fmt.Errorf("rdma_cm: NewQP returned a QP of another provider: %w", syscall.EINVAL)
		}
		return q, false, nil
	}
	pd, ok := p.PD.(*protDomain)
	if !ok || pd == nil {
		return nil, false, fmt.Errorf("rdma_cm: no PD of this provider in CMParams: %w", syscall.EINVAL)
	}
	if pd.c.name != device {
		return nil, false, fmt.Errorf("rdma_cm: the connection uses device %s, the PD belongs to %s: %w", device, pd.c.name, syscall.EXDEV)
	}
	qp, err := pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: p.SendCQ, RecvCQ: p.RecvCQ, SRQ: p.SRQ, Cap: p.Cap, SignalAll: p.SignalAll})
	if err != nil {
		return nil, false, err
	}
	return qp.(*queuePair), true, nil
}

// rdDepth clamps the requested read/atomic depth to the device's.
func rdDepth(want uint8, q *queuePair, init bool) uint8 {
	if want == 0 {
		want = 16
	}
	if da, err := q.c.QueryDevice(); err == nil {
		lim := da.MaxQPRDAtom
		if init {
			lim = da.MaxQPInitRDAtom
		}
		if lim > 0 && int(want) > lim {
			want = uint8(min(lim, 255))
		}
	}
	return want
}

// cmModify moves q to state with the attributes the CM computes for id,
// adjusted by the local choices of p (access, timers, retries, MTU).
func cmModify(id *C.struct_rdma_cm_id, q *queuePair, state prov.QPState, p *CMParams) error {
	var a C.struct_ibv_qp_attr
	var mask C.int
	if rc := C.gv_cm_init_qp_attr(id, C.int(state), &a, &mask); rc != 0 {
		return cmErr(fmt.Sprintf("rdma_init_qp_attr (state %d)", state), rc)
	}
	switch state {
	case prov.QPStateInit:
		a.qp_access_flags = C.uint(p.Access &^ prov.AccessLocalWrite)
		mask |= C.IBV_QP_ACCESS_FLAGS
	case prov.QPStateRTR:
		if p.MinRNRTimer != 0 {
			a.min_rnr_timer = C.uint8_t(p.MinRNRTimer)
			mask |= C.IBV_QP_MIN_RNR_TIMER
		}
		if p.MaxMTU != 0 && mask&C.IBV_QP_PATH_MTU != 0 && prov.MTU(a.path_mtu) > p.MaxMTU {
			a.path_mtu = C.enum_ibv_mtu(p.MaxMTU)
		}
	case prov.QPStateRTS:
		switch p.Timeout {
		case 0:
		case 0xff:
			a.timeout = 0
			mask |= C.IBV_QP_TIMEOUT
		default:
			a.timeout = C.uint8_t(p.Timeout)
			mask |= C.IBV_QP_TIMEOUT
		}
		a.retry_cnt = C.uint8_t(p.RetryCount)
		a.rnr_retry = C.uint8_t(p.RNRRetryCount)
		mask |= C.IBV_QP_RETRY_CNT | C.IBV_QP_RNR_RETRY
	}
	if rc := C.ibv_modify_qp(q.q.qp, &a, mask); rc != 0 {
		return errnoErr(modifyOp(q.qpn, state, prov.QPAttrMask(mask)), rc)
	}
	return nil
}

func connParam(p *CMParams, q *queuePair, respRes, initDepth uint8) C.gv_conn_param {
	var c C.gv_conn_param
	c.qp_num = C.uint32_t(q.qpn)
	c.responder_resources = C.uint8_t(respRes)
	c.initiator_depth = C.uint8_t(initDepth)
	c.retry_count = C.uint8_t(p.RetryCount)
	c.rnr_retry_count = C.uint8_t(p.RNRRetryCount)
	if q.init.SRQ != nil {
		c.srq = 1
	}
	return c
}

// Accept creates the QP (see CMParams), brings it to RTS, replies with
// p.PrivateData and waits until the connection is established.
func (r *ConnRequest) Accept(ctx context.Context, p CMParams) (conn *Conn, err error) {
	ch, ev, err := r.take(len(p.PrivateData))
	if err != nil {
		return nil, err
	}
	c := &Conn{id: r.id, ch: ch, ev: ev, device: r.device, port: r.port, local: r.local, remote: r.remote,
		pdata: r.pdata, peerQPN: r.peerQPN, disconnected: make(chan struct{})}
	defer func() {
		if err != nil {
			if c.qp != nil && c.ownQP {
				c.qp.Close()
			}
			destroyCM(c.id, c.ch, c.ev)
		}
	}()
	q, own, err := p.createQP(Route{Device: r.device, Port: r.port, Local: r.local, Remote: r.remote})
	if err != nil {
		C.gv_cm_reject(r.id, nil, 0)
		return nil, err
	}
	c.qp, c.ownQP = q, own
	for _, st := range []prov.QPState{prov.QPStateInit, prov.QPStateRTR, prov.QPStateRTS} {
		if err := cmModify(r.id, q, st, &p); err != nil {
			C.gv_cm_reject(r.id, nil, 0)
			return nil, err
		}
	}
	// Our responder resources answer the peer's initiator depth and vice versa.
	respRes := min(rdDepth(p.ResponderResources, q, false), max(r.initDepth, 1))
	initDepth := min(rdDepth(p.InitiatorDepth, q, true), r.respRes)
	cp := connParam(&p, q, respRes, initDepth)
	pd, pdLen := bytesArg(p.PrivateData)
	if rc := C.gv_cm_accept(r.id, &cp, pd, pdLen); rc != 0 {
		return nil, cmErr("rdma_accept", rc)
	}
	if _, err := expect(ctx, "rdma_accept", ev, ch, C.RDMA_CM_EVENT_ESTABLISHED); err != nil {
		return nil, err
	}
	c.ownQP = false // handed to the caller
	return c, nil
}

// take marks r done and moves its cm_id from the listener's event channel
// to a new one of its own (for ESTABLISHED and DISCONNECTED), so that the
// connection no longer depends on the listener. On failure r is rejected.
func (r *ConnRequest) take(pdLen int) (*C.struct_rdma_event_channel, *evFD, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return nil, nil, prov.ErrClosed
	}
	r.done = true
	if r.l != nil {
		r.l.forget(r)
	}
	if pdLen > 196 {
		r.rejectQuiet()
		return nil, nil, fmt.Errorf("rdma_accept: %d bytes of private data, at most 196: %w", pdLen, syscall.EINVAL)
	}
	ch, ev, err := newCMChannel()
	if err != nil {
		r.rejectQuiet()
		return nil, nil, err
	}
	if rc := C.gv_cm_migrate_id(r.id, ch); rc != 0 {
		destroyCM(nil, ch, ev)
		r.rejectQuiet()
		return nil, nil, cmErr("rdma_migrate_id", rc)
	}
	return ch, ev, nil
}

func (r *ConnRequest) rejectQuiet() {
	C.gv_cm_reject(r.id, nil, 0)
	C.gv_cm_destroy_id(r.id)
}

// Dial connects to addr ("ip:port"): it resolves the address and route,
// creates the QP (see CMParams) on the device the route uses, sends
// p.PrivateData with the request and returns once the QP is in RTS and the
// connection is established. A rejection fails with ECONNREFUSED and carries
// the peer's reject data in a *RejectError.
func Dial(ctx context.Context, addr string, p CMParams) (conn *Conn, err error) {
	if len(p.PrivateData) > 56 {
		return nil, fmt.Errorf("rdma_connect: %d bytes of private data, at most 56: %w", len(p.PrivateData), syscall.EINVAL)
	}
	sa, _, err := parseAddr(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("rdma_cm dial %s: %w", addr, err)
	}
	ch, ev, err := newCMChannel()
	if err != nil {
		return nil, err
	}
	c := &Conn{ch: ch, ev: ev, disconnected: make(chan struct{})}
	defer func() {
		if err != nil {
			if c.qp != nil && c.ownQP {
				c.qp.Close()
			}
			destroyCM(c.id, c.ch, c.ev)
		}
	}()
	if err := c.resolve(ctx, addr, sa); err != nil {
		return nil, err
	}
	q, own, err := p.createQP(Route{Device: c.device, Port: c.port, Local: c.local, Remote: c.remote})
	if err != nil {
		return nil, err
	}
	c.qp, c.ownQP = q, own
	if err := cmModify(c.id, q, prov.QPStateInit, &p); err != nil {
		return nil, err
	}
	cp := connParam(&p, q, rdDepth(p.ResponderResources, q, false), rdDepth(p.InitiatorDepth, q, true))
	pd, pdLen := bytesArg(p.PrivateData)
	if rc := C.gv_cm_connect(c.id, &cp, pd, pdLen); rc != 0 {
		return nil, cmErr("rdma_connect "+addr, rc)
	}
	e, err := cmWait(ctx, ev, ch)
	if err != nil {
		return nil, fmt.Errorf("rdma_connect %s: %w", addr, err)
	}
	switch e.event {
	case C.RDMA_CM_EVENT_CONNECT_RESPONSE:
	case C.RDMA_CM_EVENT_REJECTED:
		return nil, &RejectError{Status: int(e.status), PrivateData: privateData(&e), err: cmEventErr("rdma_connect "+addr, &e)}
	default:
		return nil, cmEventErr("rdma_connect "+addr, &e)
	}
	c.pdata = privateData(&e)
	c.peerQPN = uint32(e.qp_num)
	for _, st := range []prov.QPState{prov.QPStateRTR, prov.QPStateRTS} {
		if err := cmModify(c.id, q, st, &p); err != nil {
			C.gv_cm_reject(c.id, nil, 0)
			return nil, err
		}
	}
	if rc := C.gv_cm_establish(c.id); rc != 0 {
		return nil, cmErr("rdma_establish", rc)
	}
	c.ownQP = false
	return c, nil
}

// resolve creates c.id on c.ch and resolves the address and route to sa,
// filling in the device, port and addresses.
func (c *Conn) resolve(ctx context.Context, addr string, sa C.gv_sockaddr) error {
	if rc := C.gv_cm_create_id(c.ch, &c.id); rc != 0 {
		return cmErr("rdma_create_id", rc)
	}
	timeout := C.int(2000)
	bounded := false // the kernel's timeout is the context's deadline
	if dl, ok := ctx.Deadline(); ok {
		if ms := timeUntilMS(dl); ms < 2000 {
			timeout, bounded = C.int(max(ms, 1)), true
		}
	}
	if rc := C.gv_cm_resolve_addr(c.id, &sa, timeout); rc != 0 {
		return cmErr("rdma_resolve_addr "+addr, rc)
	}
	if _, err := expect(ctx, "rdma_resolve_addr "+addr, c.ev, c.ch, C.RDMA_CM_EVENT_ADDR_RESOLVED); err != nil {
		return resolveErr(bounded, err)
	}
	if rc := C.gv_cm_resolve_route(c.id, timeout); rc != 0 {
		return cmErr("rdma_resolve_route "+addr, rc)
	}
	if _, err := expect(ctx, "rdma_resolve_route "+addr, c.ev, c.ch, C.RDMA_CM_EVENT_ROUTE_RESOLVED); err != nil {
		return resolveErr(bounded, err)
	}
	c.device, c.port = deviceOf(c.id)
	var local, peer C.gv_sockaddr
	C.gv_cm_addrs(c.id, &local, &peer)
	c.local, c.remote = toAddrPort(&local), toAddrPort(&peer)
	return nil
}

// resolveErr is the error of a resolution step. When the kernel's
// timeout was the context's deadline (bounded), its ETIMEDOUT is that
// deadline passing, which the kernel may report a moment before the
// context's own timer: the error says so (context.DeadlineExceeded), as
// it does when the wait ends first. Seen in the VM tier: a dial to an
// unreachable address with a 300 ms deadline ended in ADDR_ERROR
// (ETIMEDOUT) without it.
func resolveErr(bounded bool, err error) error {
	if bounded && errors.Is(err, syscall.ETIMEDOUT) {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}

// Resolve resolves addr ("ip:port") to the local RDMA device and port a
// Dial to it would use, without connecting.
func Resolve(ctx context.Context, addr string) (Route, error) {
	sa, _, err := parseAddr(ctx, addr)
	if err != nil {
		return Route{}, fmt.Errorf("rdma_cm resolve %s: %w", addr, err)
	}
	ch, ev, err := newCMChannel()
	if err != nil {
		return Route{}, err
	}
	c := &Conn{ch: ch, ev: ev}
	defer func() { destroyCM(c.id, c.ch, c.ev) }() // c.id is set by resolve
	if err := c.resolve(ctx, addr, sa); err != nil {
		return Route{}, err
	}
	return Route{Device: c.device, Port: c.port, Local: c.local, Remote: c.remote}, nil
}

func timeUntilMS(t time.Time) int { return int(time.Until(t) / time.Millisecond) }

// bytesArg passes b to C for the duration of a call.
func bytesArg(b []byte) (*C.uint8_t, C.uint32_t) {
	if len(b) == 0 {
		return nil, 0
	}
	return (*C.uint8_t)(unsafe.Pointer(&b[0])), C.uint32_t(len(b))
}
