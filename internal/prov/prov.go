package prov

import (
	"context"
	"unsafe"
)

// Provider is one compiled-in implementation of verbs.
type Provider interface {
	// Name is a short name: "soft" or "ibverbs".
	Name() string
	// Devices lists the provider's devices. A provider that is compiled in
	// but finds no device returns an empty list and a nil error.
	Devices() ([]DeviceInfo, error)
	// Open opens a device by name.
	Open(name string) (Context, error)
}

// DeviceInfo names one device.
type DeviceInfo struct {
	Name      string
	GUID      uint64 // node GUID, host byte order
	Transport string // "InfiniBand", "iWARP", "software", ...
	Provider  string // provider name
	Dev       string // kernel device node or "", informational
}

// DeviceAttr is the subset of struct ibv_device_attr(_ex) that goverbs reports.
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
	MaxInlineData     int // provider's limit for inline sends (soft: 1024)
	AtomicCap         int // 0 none, 1 HCA, 2 global
	PhysPortCnt       int
	LocalCACKDelay    int
	CompletionVectors int
}

// PortAttr is the subset of struct ibv_port_attr that goverbs reports.
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
	ActiveWidth  uint8 // IB encoding: 1=1x 2=4x 4=8x 8=12x 16=2x
	ActiveSpeed  uint32
	PhysState    uint8
	LinkLayer    LinkLayer
	PortCapFlags uint32
}

// GIDEntry is one entry of a port's GID table (struct ibv_gid_entry).
type GIDEntry struct {
	GID     [16]byte
	Index   int
	Port    uint8
	Type    GIDType
	Netdev  string // Linux network device of a RoCE GID, if any
	IfIndex int
}

// AHAttr is struct ibv_ah_attr. IsGlobal selects the GRH fields.
type AHAttr struct {
	DGID         [16]byte
	FlowLabel    uint32
	SGIDIndex    uint8
	HopLimit     uint8
	TrafficClass uint8
	IsGlobal     bool
	DLID         uint16
	SL           uint8
	SrcPathBits  uint8
	StaticRate   uint8
	Port         uint8
	// ProviderAddr is the peer's provider address from its endpoint
	// (soft provider routing); hardware ignores it.
	ProviderAddr []byte
}

// QPCap is struct ibv_qp_cap.
type QPCap struct {
	MaxSendWR     int
	MaxRecvWR     int
	MaxSendSGE    int
	MaxRecvSGE    int
	MaxInlineData int
}

// QPInitAttr is struct ibv_qp_init_attr.
type QPInitAttr struct {
	Type      QPType
	SendCQ    CQ
	RecvCQ    CQ
	SRQ       SRQ // nil for none
	Cap       QPCap
	SignalAll bool
}

// QPAttr is struct ibv_qp_attr (the fields goverbs uses).
type QPAttr struct {
	State         QPState
	CurState      QPState
	PathMTU       MTU
	QKey          uint32
	RQPSN         uint32
	SQPSN         uint32
	DestQPN       uint32
	Access        Access
	Cap           QPCap
	AH            AHAttr
	PKeyIndex     uint16
	MaxRDAtomic   uint8
	MaxDestRDAtom uint8
	MinRNRTimer   uint8
	Port          uint8
	Timeout       uint8
	RetryCnt      uint8
	RNRRetry      uint8
}

// SRQAttr is struct ibv_srq_attr.
type SRQAttr struct {
	MaxWR    int
	MaxSGE   int
	SRQLimit int
}

// Mem describes memory handed to PD.RegMR. Ptr..Ptr+Len must stay valid
// until the MR is closed (the caller guarantees it). FD, when >= 0, is a
// memfd (or other mappable file) backing the range at Offset, which lets a
// provider share the memory with other processes.
type Mem struct {
	Ptr    unsafe.Pointer
	Len    int
	FD     int
	Offset int64
}

// Context is an open device.
type Context interface {
	QueryDevice() (DeviceAttr, error)
	QueryPort(port uint8) (PortAttr, error)
	// QueryGIDTable returns the valid entries of the port's GID table.
	QueryGIDTable(port uint8) ([]GIDEntry, error)
	AllocPD() (PD, error)
	CreateCompChannel() (CompChannel, error)
	// CreateCQ creates a CQ with at least cqe entries; ch may be nil.
	CreateCQ(cqe int, ch CompChannel, vector int) (CQ, error)
	// AsyncEvent blocks until the device reports an asynchronous event or
	// ctx ends. Providers without async events return ErrNotSupported-wrapped errors.
	AsyncEvent(ctx context.Context) (AsyncEvent, error)
	Close() error
}

// AsyncEvent is an asynchronous device event (struct ibv_async_event).
type AsyncEvent struct {
	Type    uint32 // enum ibv_event_type
	QPN     uint32 // for QP events
	Port    uint8  // for port events
	Element any    // the provider object (QP, CQ, SRQ) or nil
}

// PD is a protection domain.
type PD interface {
	RegMR(m Mem, access Access) (MR, error)
	// RegDMABuf registers a dma-buf; providers without support return an
	// error wrapping ErrNotSupported.
	RegDMABuf(offset uint64, length int, iova uint64, fd int, access Access) (MR, error)
	CreateQP(attr QPInitAttr) (QP, error)
	CreateSRQ(attr SRQAttr) (SRQ, error)
	CreateAH(attr AHAttr) (AH, error)
	Close() error
}

// MR is a registered memory region.
type MR interface {
	// Addr is the address of the first byte as work requests name it:
	// for memory of this process, its virtual address, through which
	// the provider reads inline data.
	Addr() uint64
	Len() int
	LKey() uint32
	RKey() uint32
	Close() error
}

// CompChannel is a completion event channel (struct ibv_comp_channel).
type CompChannel interface {
	// Wait blocks until one of its CQs has an event or ctx ends, acknowledges
	// the event and returns the CQ. It must not park an OS thread in a
	// blocking system call.
	Wait(ctx context.Context) (CQ, error)
	// Wake makes a Wait in progress, or else the next one, return
	// ErrWoken (an event queued already may be returned first). It never
	// blocks for long and allocates nothing.
	Wake()
	Close() error
}

// CQ is a completion queue.
type CQ interface {
	// Poll fills dst with up to len(dst) completions, in one provider call.
	Poll(dst []Completion) (int, error)
	// PollBusy is Poll repeated until it finds completions or spins
	// polls (at least one) found the CQ empty, still in one provider call.
	PollBusy(dst []Completion, spins int) (int, error)
	// Arm requests a completion event on the CQ's channel for the next
	// completion (ibv_req_notify_cq).
	Arm(solicitedOnly bool) error
	// Cap is the number of entries the CQ holds.
	Cap() int
	Close() error
}

// QP is a queue pair.
type QP interface {
	QPN() uint32
	Modify(attr *QPAttr, mask QPAttrMask) error
	Query() (QPAttr, QPInitAttr, error)
	// PostSend posts wrs in one provider call. It returns how many were
	// accepted; on error, wrs[n] is the one that failed (bad_wr).
	//
	// A provider copies the payload of an inline request (SendInline)
	// from its SGE addresses before PostSend returns, without checking
	// their lkeys, as libibverbs does. The verbs package guarantees that
	// each such range is readable for the duration of the call: it lies
	// inside an open MR of the QP's PD (at its Addr), which cannot be
	// closed until PostSend returns, or it holds bytes in no MR (lkey
	// 0): a batch's copy outside the Go heap, or Go memory pinned for
	// the call.
	PostSend(wrs []SendWR, sges []SGE) (int, error)
	PostRecv(wrs []RecvWR, sges []SGE) (int, error)
	// Address is the provider address a peer needs in addition to the GID
	// and QPN to reach this QP (soft provider); hardware returns nil.
	Address() []byte
	Close() error
}

// Linker is implemented by the QPs of a provider that knows what carries
// a QP's traffic better than its device and port do (the soft provider:
// which of its transports). Package verbs names the device, port and link
// layer for the QPs of other providers.
type Linker interface {
	// Link names what carries the QP's traffic (see verbs' Link): "" if
	// it has none (not connected, or no single path).
	Link() string
}

// SRQ is a shared receive queue.
type SRQ interface {
	PostRecv(wrs []RecvWR, sges []SGE) (int, error)
	Modify(attr SRQAttr, limitOnly bool) error
	Query() (SRQAttr, error)
	Close() error
}

// AH is an address handle; Handle is the value placed in SendWR.AH.
type AH interface {
	Handle() uint64
	Close() error
}
