package verbs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/goverbs/verbs/internal/ibv"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/provhook"
	"github.com/goverbs/verbs/internal/soft"
)

func init() {
	provhook.NewContext = func(pc prov.Context, dev prov.DeviceInfo, providerName string) (any, error) {
		return newContext(pc, dev, providerName)
	}
}

// SoftDevice is the name of the software device, present in every build.
const SoftDevice = soft.DeviceName

// HardwareCompiled reports whether this binary was built with the hardware
// provider (build tag ibverbs, Linux, cgo).
const HardwareCompiled = ibv.Compiled

// providers returns the compiled-in providers, hardware first.
func providers() []prov.Provider {
	return []prov.Provider{ibv.New(), soft.New()}
}

// Device describes an RDMA device.
type Device struct {
	Name      string // e.g. "mlx5_0", "rxe0", "soft0"
	GUID      uint64 // node GUID
	Transport string // "InfiniBand", "iWARP", "software", ...
	Provider  string // "ibverbs" or "soft"
}

// Devices lists the devices of every compiled-in provider: hardware devices
// first (when built with -tags ibverbs and libibverbs finds any), then soft0.
func Devices() ([]Device, error) {
	var devs []Device
	var errs []error
	for _, p := range providers() {
		list, err := p.Devices()
		if err != nil {
			errs = append(errs, fmt.Errorf("verbs: list %s devices: %w", p.Name(), err))
			continue
		}
		for _, d := range list {
			devs = append(devs, Device{Name: d.Name, GUID: d.GUID, Transport: d.Transport, Provider: p.Name()})
		}
	}
	if len(devs) == 0 {
		errs = append(errs, ErrNoDevice)
	}
	return devs, errors.Join(errs...)
}

// DefaultDevice returns the name of the device Open("") opens: the first
// hardware device if there is one, otherwise soft0. The environment variable
// GOVERBS_DEVICE overrides it.
func DefaultDevice() string {
	if d := getenv("GOVERBS_DEVICE"); d != "" {
		return d
	}
	devs, _ := Devices()
	if len(devs) > 0 {
		return devs[0].Name
	}
	return SoftDevice
}

// Context is an open device. It is safe for concurrent use. Close it after
// every object created from it.
type Context struct {
	res      resource
	ctx      prov.Context
	name     string
	provider string
	dev      Device
	locks    bool // the provider pins memory (memlock applies)
}

// Open opens the named device ("" for DefaultDevice).
func Open(name string) (*Context, error) {
	if name == "" {
		name = DefaultDevice()
	}
	var errs []error
	for _, p := range providers() {
		list, err := p.Devices()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, d := range list {
			if d.Name != name {
				continue
			}
			pc, err := p.Open(name)
			if err != nil {
				return nil, opErr("open device", name, err)
			}
			c, err := newContext(pc, d, p.Name())
			if err != nil {
				pc.Close()
				return nil, err
			}
			return c, nil
		}
	}
	if name == SoftDevice {
		// Should not happen: soft0 is always listed.
		return nil, opErr("open device", name, errors.Join(append(errs, ErrNoDevice)...))
	}
	err := fmt.Errorf("%w (see `goverbs devices`)", ErrNoDevice)
	if !HardwareCompiled {
		err = fmt.Errorf("%w; this binary has no hardware provider: build with -tags ibverbs", ErrNoDevice)
	}
	return nil, opErr("open device", name, err)
}

// newContext makes the Context of pc, an open context of device d of the
// provider named provider. On error the caller closes pc.
func newContext(pc prov.Context, d prov.DeviceInfo, provider string) (*Context, error) {
	c := &Context{ctx: pc, name: d.Name, provider: provider, locks: provider != "soft",
		dev: Device{Name: d.Name, GUID: d.GUID, Transport: d.Transport, Provider: provider}}
	if err := initResource(c, &c.res, "device context", d.Name); err != nil {
		return nil, err
	}
	return c, nil
}

// Name returns the device name.
func (c *Context) Name() string { return c.name }

// Device describes the open device.
func (c *Context) Device() Device { return c.dev }

// Provider returns "ibverbs" or "soft".
func (c *Context) Provider() string { return c.provider }

// Close closes the device. It fails, naming them, while objects created from
// the context are open. Close is idempotent.
func (c *Context) Close() error {
	return c.res.close(func() error { return opErr("close device", c.name, c.ctx.Close()) })
}

func (c *Context) check(op string) error {
	if c.res.isClosed() {
		return c.res.errClosed(op)
	}
	return nil
}

// DeviceAttr holds the device attributes (struct ibv_device_attr).
type DeviceAttr struct {
	FWVersion         string
	NodeGUID          uint64
	SysImageGUID      uint64
	MaxMRSize         uint64
	PageSizeCap       uint64
	VendorID          uint32
	VendorPartID      uint32
	HWVersion         uint32
	MaxQP             int
	MaxQPWR           int
	MaxSGE            int
	MaxSGERD          int
	MaxCQ             int
	MaxCQE            int
	MaxMR             int
	MaxPD             int
	MaxQPRDAtom       int
	MaxQPInitRDAtom   int
	MaxSRQ            int
	MaxSRQWR          int
	MaxSRQSGE         int
	MaxAH             int
	MaxPKeys          int
	MaxInlineData     int
	AtomicCap         int // 0 none, 1 atomic within the HCA, 2 global
	PhysPortCnt       int
	LocalCACKDelay    int
	CompletionVectors int
}

// QueryDevice returns the device attributes.
func (c *Context) QueryDevice() (DeviceAttr, error) {
	if !c.res.enter() {
		return DeviceAttr{}, c.res.errClosed("query device")
	}
	defer c.res.exit()
	a, err := c.ctx.QueryDevice()
	if err != nil {
		return DeviceAttr{}, opErr("query device", c.name, err)
	}
	return DeviceAttr(a), nil
}

// PortAttr holds the attributes of a port (struct ibv_port_attr).
type PortAttr struct {
	State        PortState
	MaxMTU       MTU
	ActiveMTU    MTU
	GIDTableLen  int
	PKeyTableLen int
	LID          uint16
	SMLID        uint16
	LMC          uint8
	MaxMsgSize   uint32
	ActiveWidth  uint8  // IB encoding: 1=1x 2=4x 4=8x 8=12x 16=2x
	ActiveSpeed  uint32 // IB encoding (ibv_port_attr.active_speed / active_speed_ex)
	PhysState    uint8
	LinkLayer    LinkLayer
	PortCapFlags uint32
}

// WidthString returns the active width as "4X" etc.
func (p PortAttr) WidthString() string {
	switch p.ActiveWidth {
	case 1:
		return "1X"
	case 2:
		return "4X"
	case 4:
		return "8X"
	case 8:
		return "12X"
	case 16:
		return "2X"
	}
	return fmt.Sprintf("invalid width %d", p.ActiveWidth)
}

// SpeedString returns the per-lane speed name ("EDR", "25.0 Gbps", ...).
func (p PortAttr) SpeedString() string {
	switch p.ActiveSpeed {
	case 1:
		return "2.5 Gbps"
	case 2:
		return "5.0 Gbps"
	case 4, 8:
		return "10.0 Gbps"
	case 16:
		return "14.0 Gbps"
	case 32:
		return "25.0 Gbps"
	case 64:
		return "50.0 Gbps"
	case 128:
		return "100.0 Gbps"
	case 256:
		return "200.0 Gbps"
	}
	return fmt.Sprintf("invalid speed %d", p.ActiveSpeed)
}

// QueryPort returns the attributes of a port (ports count from 1).
func (c *Context) QueryPort(port uint8) (PortAttr, error) {
	if !c.res.enter() {
		return PortAttr{}, c.res.errClosed("query port")
	}
	defer c.res.exit()
	a, err := c.ctx.QueryPort(port)
	if err != nil {
		return PortAttr{}, opErr(fmt.Sprintf("query port %d", port), c.name, err)
	}
	return PortAttr{
		State: PortState(a.State), MaxMTU: MTU(a.MaxMTU), ActiveMTU: MTU(a.ActiveMTU),
		GIDTableLen: a.GIDTableLen, PKeyTableLen: a.PKeyTableLen, LID: a.LID, SMLID: a.SMLID,
		LMC: a.LMC, MaxMsgSize: a.MaxMsgSize, ActiveWidth: a.ActiveWidth, ActiveSpeed: a.ActiveSpeed,
		PhysState: a.PhysState, LinkLayer: LinkLayer(a.LinkLayer), PortCapFlags: a.PortCapFlags,
	}, nil
}

// GID is a 128-bit global identifier (an IPv6 address on RoCE).
type GID [16]byte

// String formats the GID as an IPv6 address.
func (g GID) String() string { return netip.AddrFrom16(g).String() }

// IsZero reports whether the GID is all zeros.
func (g GID) IsZero() bool { return g == GID{} }

// IsIPv4Mapped reports whether the GID is an IPv4-mapped address (::ffff:a.b.c.d).
func (g GID) IsIPv4Mapped() bool { return netip.AddrFrom16(g).Is4In6() }

// IsLinkLocal reports whether the GID is an fe80::/10 address.
func (g GID) IsLinkLocal() bool { return netip.AddrFrom16(g).IsLinkLocalUnicast() }

// ParseGID parses an IPv6 (or IPv4, mapped) address.
func ParseGID(s string) (GID, error) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		return GID{}, fmt.Errorf("verbs: parse gid: %w", err)
	}
	return GID(a.As16()), nil
}

// MarshalText implements encoding.TextMarshaler.
func (g GID) MarshalText() ([]byte, error) { return []byte(g.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (g *GID) UnmarshalText(b []byte) error {
	v, err := ParseGID(string(b))
	if err != nil {
		return err
	}
	*g = v
	return nil
}

// GIDEntry is one valid entry of a port's GID table.
type GIDEntry struct {
	GID     GID
	Index   int
	Port    uint8
	Type    GIDType
	Netdev  string // network device of a RoCE GID
	IfIndex int
}

// GIDTable returns the valid entries of a port's GID table.
func (c *Context) GIDTable(port uint8) ([]GIDEntry, error) {
	if !c.res.enter() {
		return nil, c.res.errClosed("query gid table")
	}
	defer c.res.exit()
	es, err := c.ctx.QueryGIDTable(port)
	if err != nil {
		return nil, opErr(fmt.Sprintf("query gid table of port %d", port), c.name, err)
	}
	out := make([]GIDEntry, len(es))
	for i, e := range es {
		out[i] = GIDEntry{GID: GID(e.GID), Index: e.Index, Port: e.Port, Type: GIDType(e.Type), Netdev: e.Netdev, IfIndex: e.IfIndex}
	}
	return out, nil
}

// AsyncEvent is an asynchronous device event.
type AsyncEvent struct {
	Type AsyncEventType
	QPN  uint32 // for QP events
	Port uint8  // for port events
}

// AsyncEventType is enum ibv_event_type.
type AsyncEventType uint32

// Asynchronous event types.
const (
	EventCQError         AsyncEventType = 0
	EventQPFatal         AsyncEventType = 1
	EventQPRequestError  AsyncEventType = 2
	EventQPAccessError   AsyncEventType = 3
	EventCommEstablished AsyncEventType = 4
	EventSQDrained       AsyncEventType = 5
	EventDeviceFatal     AsyncEventType = 8
	EventPortActive      AsyncEventType = 9
	EventPortError       AsyncEventType = 10
	EventSRQError        AsyncEventType = 14
	EventSRQLimitReached AsyncEventType = 15
	EventQPLastWQE       AsyncEventType = 16
	EventGIDChange       AsyncEventType = 18
)

func (t AsyncEventType) String() string {
	names := map[AsyncEventType]string{
		EventCQError: "CQ_ERR", EventQPFatal: "QP_FATAL", EventQPRequestError: "QP_REQ_ERR",
		EventQPAccessError: "QP_ACCESS_ERR", EventCommEstablished: "COMM_EST", EventSQDrained: "SQ_DRAINED",
		EventDeviceFatal: "DEVICE_FATAL", EventPortActive: "PORT_ACTIVE", EventPortError: "PORT_ERR",
		EventSRQError: "SRQ_ERR", EventSRQLimitReached: "SRQ_LIMIT_REACHED", EventQPLastWQE: "QP_LAST_WQE_REACHED",
		EventGIDChange: "GID_CHANGE",
	}
	if n, ok := names[t]; ok {
		return n
	}
	return fmt.Sprintf("event %d", uint32(t))
}

// AsyncEvent blocks until the device reports an asynchronous event (port
// state changes, QPs or CQs entering the error state, SRQ limits) or ctx ends.
//
// Every provider reads the device's events from Open to Close, whether or
// not the program calls AsyncEvent, and holds the last 256 (older ones
// are dropped): so a CQ that overran fails its Polls with EOVERFLOW on
// every device (on hardware, from the moment its EventCQError arrived;
// the completions the device had no room for are lost).
//
// soft0 also reports EventQPFatal for each RC and UC queue pair
// connected to a queue pair of another process when its connection to
// that process is lost (it exited, was killed, or closed its last
// context): the queue pair moves to StateError after delivering what
// had arrived, and its posted receives complete with StatusWRFlushErr,
// so that a side that only waits for receives learns of the peer's
// death. Hardware has no such event (a queue pair learns of a dead peer
// only when a request of its own times out).
func (c *Context) AsyncEvent(ctx context.Context) (AsyncEvent, error) {
	if err := c.check("get async event"); err != nil {
		return AsyncEvent{}, err
	}
	e, err := c.ctx.AsyncEvent(ctx)
	if err != nil {
		if cerr := waitEnded(ctx, err); cerr != nil {
			err = fmt.Errorf("%w: %w", ErrTimeout, cerr) // as every wait's
		}
		return AsyncEvent{}, opErr("get async event", c.name, err)
	}
	return AsyncEvent{Type: AsyncEventType(e.Type), QPN: e.QPN, Port: e.Port}, nil
}
