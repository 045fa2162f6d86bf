//go:build ibverbs && linux && cgo

// Package ibv is the hardware provider over libibverbs (and librdmacm for
// connection management). It is the only package of the module that uses
// cgo. Every libibverbs macro or static inline function is called from the
// C shim (shim.c), and the data path crosses into C once per batch:
//
//   - QP.PostSend: one call (gv_post_send) converts the pointer-free
//     prov.SendWR array into ibv_send_wr chains on the C stack (32 per
//     doorbell) and posts them; the SGE array is handed to the library in
//     place (prov.SGE has the layout of struct ibv_sge).
//   - QP.PostRecv, SRQ.PostRecv: one call each, likewise.
//   - CQ.Poll: one call; ibv_poll_cq writes into the caller's
//     prov.Completion array itself (prov.Completion has the layout of struct
//     ibv_wc); the shim only converts immediate data to host byte order.
//
// Go passes only pointer-free arrays (prov.SendWR, RecvWR, SGE, Completion)
// to those calls, annotated #cgo noescape/nocallback, so the data path does
// not allocate.
//
// Extended verbs: QueryDevice uses ibv_query_device_ex, QueryGIDTable uses
// ibv_query_gid_table (falling back to ibv_query_gid_ex per index, then to
// ibv_query_gid and sysfs). The work-request API (ibv_create_qp_ex with
// send_ops_flags, ibv_wr_start/ibv_wr_*/ibv_wr_complete) and extended CQs
// (ibv_create_cq_ex, ibv_start_poll/ibv_next_poll) are implemented but
// opt-in, with GOVERBS_IBV_WR_API=1 and GOVERBS_IBV_CQ_EX=1 in the
// environment when the device is opened: the classic calls are the default
// because they report exactly which request failed (bad_wr) and let
// ibv_poll_cq fill the caller's array without per-field reads. Each extended
// path falls back to the classic one when the device refuses it. With the
// work-request API a batch refused before ibv_wr_complete (an unsupported
// opcode, too many SGEs or inline bytes) is posted not at all (PostSend
// returns 0), and one that ibv_wr_complete refuses (a full queue) is posted
// again with ibv_post_send, which posts the requests that fit;
// inline requests are gathered into one buffer (ibv_wr_set_inline_data), and
// on SoftRoCE, whose ibv_wr_set_sge_list miscomputes lengths, batches with a
// multi-SGE request go through ibv_post_send.
//
// Listen, Dial and ConnRequest.Accept (cm.go) connect RC QPs with the RDMA
// connection manager, for the session layer.
//
// Completion channels, the asynchronous event fd and RDMA CM event channels
// are made non-blocking and registered with the Go runtime poller, so
// waiting never parks an OS thread in a blocking C call and honours the
// context. Completion events are acknowledged as soon as they are read.
//
// Objects are safe for concurrent use as far as libibverbs makes them so
// (posting and polling from several goroutines is fine); Close must not
// race with other calls on the same object.
package ibv

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// Compiled reports whether the hardware provider is compiled in.
const Compiled = true

// New returns the hardware provider.
func New() prov.Provider { return provider{} }

type provider struct{}

func (provider) Name() string { return "ibverbs" }

func transportName(t C.enum_ibv_transport_type) string {
	switch t {
	case C.IBV_TRANSPORT_IB:
		return "InfiniBand"
	case C.IBV_TRANSPORT_IWARP:
		return "iWARP"
	case C.IBV_TRANSPORT_USNIC:
		return "usNIC"
	case C.IBV_TRANSPORT_USNIC_UDP:
		return "usNIC UDP"
	case C.IBV_TRANSPORT_UNSPECIFIED:
		return "unspecified"
	}
	return "unknown"
}

// be64 reads a big-endian 64-bit value stored in memory.
func be64(v C.__be64) uint64 {
	return binary.BigEndian.Uint64((*[8]byte)(unsafe.Pointer(&v))[:])
}

// deviceList returns the device list (free with C.ibv_free_device_list) or
// nil when the system has no RDMA support at all.
func deviceList() ([]*C.struct_ibv_device, **C.struct_ibv_device, error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		if errors.Is(err, syscall.ENOSYS) || err == nil {
			return nil, nil, nil // no kernel support: no devices
		}
		return nil, nil, wrapErr("ibv_get_device_list", err)
	}
	return unsafe.Slice(list, int(n)), list, nil
}

func (provider) Devices() ([]prov.DeviceInfo, error) {
	devs, list, err := deviceList()
	if err != nil || list == nil {
		return nil, err
	}
	defer C.ibv_free_device_list(list)
	out := make([]prov.DeviceInfo, 0, len(devs))
	for _, d := range devs {
		info := prov.DeviceInfo{
			Name:      C.GoString(C.ibv_get_device_name(d)),
			GUID:      be64(C.ibv_get_device_guid(d)),
			Transport: transportName(d.transport_type),
			Provider:  "ibverbs",
		}
		if dev := C.GoString(&d.dev_name[0]); dev != "" {
			info.Dev = "/dev/infiniband/" + dev
		}
		out = append(out, info)
	}
	return out, nil
}

func (provider) Open(name string) (prov.Context, error) {
	devs, list, err := deviceList()
	if err != nil {
		return nil, fmt.Errorf("open %q: %w", name, err)
	}
	if list == nil {
		return nil, fmt.Errorf("open %q: no RDMA support in this kernel: %w", name, prov.ErrNoDevice)
	}
	defer C.ibv_free_device_list(list)
	for _, d := range devs {
		if C.GoString(C.ibv_get_device_name(d)) != name {
			continue
		}
		ctx, err := C.ibv_open_device(d)
		if ctx == nil {
			return nil, wrapErr("ibv_open_device "+name, err)
		}
		c := &devContext{
			ctx:     ctx,
			name:    name,
			handles: map[uint64]any{},
			wrAPI:   envOn("GOVERBS_IBV_WR_API"),
			cqEx:    envOn("GOVERBS_IBV_CQ_EX"),
		}
		var a C.struct_ibv_device_attr
		var ports C.uint32_t
		if C.gv_query_device(ctx, &a, &ports) == 0 && a.vendor_id == rxeVendorID && a.vendor_part_id == 0 {
			c.quirkSGEList, c.quirkNextPoll = true, true
		}
		c.startEvents()
		return c, nil
	}
	return nil, fmt.Errorf("open %q: %w", name, prov.ErrNoDevice)
}

// rxeVendorID is the vendor ID the SoftRoCE driver reports.
const rxeVendorID = 0xffffff

func envOn(key string) bool {
	v, _ := strconv.ParseBool(os.Getenv(key))
	return v
}

// devContext is an open device (prov.Context).
type devContext struct {
	ctx  *C.struct_ibv_context
	name string

	// wrAPI selects ibv_create_qp_ex + ibv_wr_* posting, cqEx extended CQs.
	wrAPI, cqEx bool
	// quirkSGEList: the device is SoftRoCE (rxe), whose
	// ibv_wr_set_sge_list miscomputes the length (see shim.c).
	quirkSGEList bool
	// quirkNextPoll: the device is SoftRoCE (rxe), whose ibv_end_poll
	// after an ibv_next_poll that found the CQ empty skips an entry
	// (see gv_poll_cq).
	quirkNextPoll bool

	// handles maps the integers stored in cq_context, qp_context and
	// srq_context back to the Go objects (no Go pointers in C memory).
	mu      sync.Mutex
	next    uint64
	handles map[uint64]any

	// The async events, read from the device by readEvents from Open to
	// Close, whether or not the program asks for them: a CQ_ERR marks its
	// CQ overrun (the kernel lost completions), so that its Poll fails.
	events    prov.EventQueue
	async     *evFD
	asyncDone chan struct{} // closed when readEvents returns

	closer closer
}

func (c *devContext) addHandle(v any) uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.next++
	c.handles[c.next] = v
	return c.next
}

func (c *devContext) setHandle(h uint64, v any) {
	c.mu.Lock()
	c.handles[h] = v
	c.mu.Unlock()
}

func (c *devContext) lookup(h uint64) any {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.handles[h]
}

func (c *devContext) dropHandle(h uint64) {
	c.mu.Lock()
	delete(c.handles, h)
	c.mu.Unlock()
}

func (c *devContext) QueryDevice() (prov.DeviceAttr, error) {
	var a C.struct_ibv_device_attr
	var ports C.uint32_t
	if rc := C.gv_query_device(c.ctx, &a, &ports); rc != 0 {
		return prov.DeviceAttr{}, errnoErr("ibv_query_device_ex", rc)
	}
	return prov.DeviceAttr{
		FWVersion:         C.GoString(&a.fw_ver[0]),
		NodeGUID:          be64(a.node_guid),
		SysImageGUID:      be64(a.sys_image_guid),
		MaxMRSize:         uint64(a.max_mr_size),
		PageSizeCap:       uint64(a.page_size_cap),
		VendorID:          uint32(a.vendor_id),
		VendorPartID:      uint32(a.vendor_part_id),
		HWVersion:         uint32(a.hw_ver),
		MaxQP:             int(a.max_qp),
		MaxQPWR:           int(a.max_qp_wr),
		MaxSGE:            int(a.max_sge),
		MaxSGERD:          int(a.max_sge_rd),
		MaxCQ:             int(a.max_cq),
		MaxCQE:            int(a.max_cqe),
		MaxMR:             int(a.max_mr),
		MaxPD:             int(a.max_pd),
		MaxQPRDAtom:       int(a.max_qp_rd_atom),
		MaxQPInitRDAtom:   int(a.max_qp_init_rd_atom),
		MaxSRQ:            int(a.max_srq),
		MaxSRQWR:          int(a.max_srq_wr),
		MaxSRQSGE:         int(a.max_srq_sge),
		MaxAH:             int(a.max_ah),
		MaxPKeys:          int(a.max_pkeys),
		MaxInlineData:     0, // verbs does not report it; granted per QP
		AtomicCap:         int(a.atomic_cap),
		PhysPortCnt:       int(ports),
		LocalCACKDelay:    int(a.local_ca_ack_delay),
		CompletionVectors: int(c.ctx.num_comp_vectors),
	}, nil
}

// portCount returns the number of physical ports, -1 if the device cannot
// tell.
func (c *devContext) portCount() int {
	var a C.struct_ibv_device_attr
	var ports C.uint32_t
	if C.gv_query_device(c.ctx, &a, &ports) != 0 {
		return -1
	}
	return int(ports)
}

func (c *devContext) QueryPort(port uint8) (prov.PortAttr, error) {
	var a C.gv_port_attr
	if rc := C.gv_query_port(c.ctx, C.uint8_t(port), &a); rc != 0 {
		return prov.PortAttr{}, errnoErr(queryPortOp(c.name, port, c.portCount()), rc)
	}
	return prov.PortAttr{
		State:        prov.PortState(a.state),
		MaxMTU:       prov.MTU(a.max_mtu),
		ActiveMTU:    prov.MTU(a.active_mtu),
		GIDTableLen:  int(a.gid_tbl_len),
		PKeyTableLen: int(a.pkey_tbl_len),
		LID:          uint16(a.lid),
		SMLID:        uint16(a.sm_lid),
		LMC:          uint8(a.lmc),
		MaxMsgSize:   uint32(a.max_msg_sz),
		ActiveWidth:  uint8(a.active_width),
		ActiveSpeed:  uint32(a.active_speed),
		PhysState:    uint8(a.phys_state),
		LinkLayer:    prov.LinkLayer(a.link_layer),
		PortCapFlags: uint32(a.port_cap_flags),
	}, nil
}

func ifName(index int) string {
	if index <= 0 {
		return ""
	}
	ifc, err := net.InterfaceByIndex(index)
	if err != nil {
		return ""
	}
	return ifc.Name
}

func (c *devContext) QueryGIDTable(port uint8) ([]prov.GIDEntry, error) {
	pa, err := c.QueryPort(port)
	if err != nil {
		return nil, err
	}
	if pa.GIDTableLen <= 0 {
		return nil, nil
	}
	buf := make([]C.gv_gid, pa.GIDTableLen)
	n := C.gv_query_gid_table(c.ctx, C.uint8_t(port), C.int(pa.GIDTableLen), &buf[0], C.int(len(buf)))
	if n < 0 {
		e := syscall.Errno(-n)
		if e != syscall.EOPNOTSUPP && e != syscall.ENOSYS {
			return nil, errnoErr("ibv_query_gid_ex", C.int(-n))
		}
		return c.queryGIDTableSysfs(port, pa)
	}
	out := make([]prov.GIDEntry, 0, int(n))
	for _, g := range buf[:n] {
		e := prov.GIDEntry{
			Index:   int(g.index),
			Port:    uint8(g.port),
			Type:    prov.GIDType(g.gid_type),
			IfIndex: int(g.ifindex),
		}
		copy(e.GID[:], unsafe.Slice((*byte)(unsafe.Pointer(&g.gid[0])), 16))
		e.Netdev = ifName(e.IfIndex)
		out = append(out, e)
	}
	return out, nil
}

// queryGIDTableSysfs is the last fallback: ibv_query_gid per index and the
// GID type and netdev from sysfs.
func (c *devContext) queryGIDTableSysfs(port uint8, pa prov.PortAttr) ([]prov.GIDEntry, error) {
	base := fmt.Sprintf("/sys/class/infiniband/%s/ports/%d/gid_attrs", c.name, port)
	var out []prov.GIDEntry
	for i := 0; i < pa.GIDTableLen; i++ {
		var g C.union_ibv_gid
		if rc := C.ibv_query_gid(c.ctx, C.uint8_t(port), C.int(i), &g); rc != 0 {
			continue
		}
		e := prov.GIDEntry{Index: i, Port: port}
		copy(e.GID[:], g[:])
		if e.GID == ([16]byte{}) {
			continue
		}
		if pa.LinkLayer == prov.LinkLayerEthernet {
			e.Type = prov.GIDTypeRoCEv1
			if b, err := os.ReadFile(fmt.Sprintf("%s/types/%d", base, i)); err == nil &&
				strings.Contains(string(b), "v2") {
				e.Type = prov.GIDTypeRoCEv2
			}
			if b, err := os.ReadFile(fmt.Sprintf("%s/ndevs/%d", base, i)); err == nil {
				e.Netdev = strings.TrimSpace(string(b))
				if ifc, err := net.InterfaceByName(e.Netdev); err == nil {
					e.IfIndex = ifc.Index
				}
			}
		}
		out = append(out, e)
	}
	return out, nil
}

func (c *devContext) AllocPD() (prov.PD, error) {
	pd, err := C.ibv_alloc_pd(c.ctx)
	if pd == nil {
		return nil, wrapErr("ibv_alloc_pd", err)
	}
	return &protDomain{c: c, pd: pd}, nil
}

// startEvents starts readEvents.
func (c *devContext) startEvents() {
	c.events.Init()
	c.asyncDone = make(chan struct{})
	var err error
	if c.async, err = newEvFD(int(c.ctx.async_fd), "ibv-async-"+c.name); err != nil {
		c.events.Fail(err)
		close(c.asyncDone)
		return
	}
	go c.readEvents()
}

// readEvents reads the device's async events into c.events until Close
// (or a read fails: then AsyncEvent returns its error). A CQ_ERR marks
// its CQ overrun.
func (c *devContext) readEvents() {
	defer close(c.asyncDone)
	for {
		var (
			typ, qpn, port C.uint32_t
			h              C.uint64_t
			rc             C.int
		)
		err := c.async.wait(context.Background(), func() bool {
			rc = C.gv_get_async_event(c.ctx, &typ, &h, &qpn, &port)
			return rc != C.int(syscall.EAGAIN)
		})
		if err == nil && rc != 0 {
			err = errnoErr("ibv_get_async_event", rc)
		}
		if err != nil {
			if errors.Is(err, prov.ErrClosed) {
				c.events.Close()
			} else {
				c.events.Fail(err)
			}
			return
		}
		ev := prov.AsyncEvent{Type: uint32(typ), QPN: uint32(qpn), Port: uint8(port)}
		if h != 0 {
			ev.Element = c.lookup(uint64(h))
		}
		if q, ok := ev.Element.(*compQueue); ok && typ == C.IBV_EVENT_CQ_ERR {
			q.overrun.Store(true)
		}
		c.events.Push(ev)
	}
}

func (c *devContext) AsyncEvent(ctx context.Context) (prov.AsyncEvent, error) {
	return c.events.Wait(ctx)
}

func (c *devContext) Close() error {
	return c.closer.do(func() error {
		if c.async != nil {
			c.async.close() // readEvents returns
		}
		<-c.asyncDone
		c.events.Close()
		if rc := C.ibv_close_device(c.ctx); rc != 0 {
			return errnoErr("ibv_close_device", rc)
		}
		return nil
	})
}

// wrapErr wraps the errno of a failed C call (the second result of a cgo
// call). A missing errno becomes EIO.
func wrapErr(op string, err error) error {
	var e syscall.Errno
	if !errors.As(err, &e) || e == 0 {
		e = syscall.EIO
	}
	return errnoErr(op, C.int(e))
}

// errnoErr wraps an errno returned by the shim. EOPNOTSUPP and ENOSYS also
// match prov.ErrNotSupported.
func errnoErr(op string, rc C.int) error {
	e := syscall.Errno(rc)
	if rc < 0 {
		e = syscall.Errno(-rc)
	}
	if e == 0 {
		e = syscall.EIO
	}
	switch e {
	case syscall.EOPNOTSUPP, syscall.ENOSYS:
		return &prov.Errno{Sentinel: prov.ErrNotSupported, Errno: e, Msg: op + ": " + e.Error()}
	}
	return fmt.Errorf("%s: %w", op, e)
}

// postErr wraps an errno from a post call. ENOMEM (ibv_post_send) and
// ENOSPC (ibv_wr_complete; the shim checks SGE counts and inline sizes
// before, so it means no room) say the queue is full: the error matches
// ErrQueueFull and ENOMEM.
func postErr(op string, rc C.int) error {
	e := syscall.Errno(rc)
	if e == syscall.ENOMEM || e == syscall.ENOSPC {
		if errs, ok := queueFull[op]; ok {
			if e == syscall.ENOSPC {
				return errs.nospc
			}
			return errs.nomem
		}
		return newQueueFull(op, e)
	}
	return errnoErr(op, rc)
}

// queueFull holds the errors of a full queue of each post call, by
// errno (ENOSPC or ENOMEM), made once: a full queue is flow control, met
// in the posting loops of the hot path, which allocate nothing (rxe
// reports it often: it may publish a completion before it retires the
// request from the queue).
var queueFull = func() map[string]struct{ nomem, nospc error } {
	m := make(map[string]struct{ nomem, nospc error })
	for _, op := range []string{"ibv_post_send", "ibv_post_recv", "ibv_post_srq_recv"} {
		m[op] = struct{ nomem, nospc error }{newQueueFull(op, syscall.ENOMEM), newQueueFull(op, syscall.ENOSPC)}
	}
	return m
}()

func newQueueFull(op string, e syscall.Errno) error {
	return &prov.Errno{Sentinel: prov.ErrQueueFull, Errno: syscall.ENOMEM, Msg: op + ": queue full (" + e.Error() + ")"}
}
