// Package prov defines the contract between the public verbs package and its
// providers (internal/soft, internal/ibv). Users never see it.
//
// Every type here is plain data with a fixed layout (no Go pointers in the
// data-path structs SendWR, RecvWR, SGE and Completion) so that a provider
// may keep them in C or mmap memory and read them from C. Numeric values of
// enums are those of libibverbs, so the hardware provider maps them without
// translation tables.
package prov

// Access is a set of memory/QP access flags (enum ibv_access_flags).
type Access uint32

const (
	AccessLocalWrite   Access = 1 << 0
	AccessRemoteWrite  Access = 1 << 1
	AccessRemoteRead   Access = 1 << 2
	AccessRemoteAtomic Access = 1 << 3
	AccessMWBind       Access = 1 << 4
	AccessZeroBased    Access = 1 << 5
	AccessOnDemand     Access = 1 << 6
	AccessRelaxedOrder Access = 1 << 20
)

// QPType is enum ibv_qp_type.
type QPType uint32

const (
	QPTypeRC QPType = 2
	QPTypeUC QPType = 3
	QPTypeUD QPType = 4
)

// QPState is enum ibv_qp_state.
type QPState uint32

const (
	QPStateReset QPState = 0
	QPStateInit  QPState = 1
	QPStateRTR   QPState = 2
	QPStateRTS   QPState = 3
	QPStateSQD   QPState = 4
	QPStateSQE   QPState = 5
	QPStateErr   QPState = 6
)

// MTU is enum ibv_mtu (1 = 256 ... 5 = 4096).
type MTU uint32

const (
	MTU256  MTU = 1
	MTU512  MTU = 2
	MTU1024 MTU = 3
	MTU2048 MTU = 4
	MTU4096 MTU = 5
)

// Bytes returns the MTU in bytes, or 0 for an invalid value.
func (m MTU) Bytes() int {
	if m < MTU256 || m > MTU4096 {
		return 0
	}
	return 128 << m
}

// PortState is enum ibv_port_state.
type PortState uint32

const (
	PortNop         PortState = 0
	PortDown        PortState = 1
	PortInit        PortState = 2
	PortArmed       PortState = 3
	PortActive      PortState = 4
	PortActiveDefer PortState = 5
)

// LinkLayer is IBV_LINK_LAYER_*.
type LinkLayer uint8

const (
	LinkLayerUnspecified LinkLayer = 0
	LinkLayerInfiniBand  LinkLayer = 1
	LinkLayerEthernet    LinkLayer = 2
)

// GIDType is enum ibv_gid_type.
type GIDType uint32

const (
	GIDTypeIB     GIDType = 0
	GIDTypeRoCEv1 GIDType = 1
	GIDTypeRoCEv2 GIDType = 2
)

// WROpcode is enum ibv_wr_opcode.
type WROpcode uint32

const (
	WRWrite        WROpcode = 0
	WRWriteImm     WROpcode = 1
	WRSend         WROpcode = 2
	WRSendImm      WROpcode = 3
	WRRead         WROpcode = 4
	WRAtomicCAS    WROpcode = 5
	WRAtomicFAA    WROpcode = 6
	WRLocalInv     WROpcode = 7
	WRBindMW       WROpcode = 8
	WRSendInv      WROpcode = 9
	WRTSO          WROpcode = 10
	WRDriver1      WROpcode = 11
	WRFlushPersist WROpcode = 14
	WRAtomicWrite  WROpcode = 15
)

// SendFlags is enum ibv_send_flags.
type SendFlags uint32

const (
	SendFence     SendFlags = 1 << 0
	SendSignaled  SendFlags = 1 << 1
	SendSolicited SendFlags = 1 << 2
	SendInline    SendFlags = 1 << 3
)

// WCOpcode is enum ibv_wc_opcode.
type WCOpcode uint32

const (
	WCSend        WCOpcode = 0
	WCWrite       WCOpcode = 1
	WCRead        WCOpcode = 2
	WCCompSwap    WCOpcode = 3
	WCFetchAdd    WCOpcode = 4
	WCBindMW      WCOpcode = 5
	WCLocalInv    WCOpcode = 6
	WCRecv        WCOpcode = 128
	WCRecvRDMAImm WCOpcode = 129
)

// WCFlags is enum ibv_wc_flags.
type WCFlags uint32

const (
	WCWithGRH WCFlags = 1 << 0
	WCWithImm WCFlags = 1 << 1
	WCWithInv WCFlags = 1 << 3
)

// Status is enum ibv_wc_status.
type Status uint32

const (
	StatusSuccess          Status = 0
	StatusLocLenErr        Status = 1
	StatusLocQPOpErr       Status = 2
	StatusLocEECOpErr      Status = 3
	StatusLocProtErr       Status = 4
	StatusWRFlushErr       Status = 5
	StatusMWBindErr        Status = 6
	StatusBadRespErr       Status = 7
	StatusLocAccessErr     Status = 8
	StatusRemInvReqErr     Status = 9
	StatusRemAccessErr     Status = 10
	StatusRemOpErr         Status = 11
	StatusRetryExcErr      Status = 12
	StatusRNRRetryExcErr   Status = 13
	StatusLocRDDViolErr    Status = 14
	StatusRemInvRDReqErr   Status = 15
	StatusRemAbortErr      Status = 16
	StatusInvEECNErr       Status = 17
	StatusInvEECStateErr   Status = 18
	StatusFatalErr         Status = 19
	StatusRespTimeoutErr   Status = 20
	StatusGeneralErr       Status = 21
	StatusTMErr            Status = 22
	StatusTMRndvIncomplete Status = 23
)

// QPAttrMask is enum ibv_qp_attr_mask.
type QPAttrMask uint32

const (
	AttrState          QPAttrMask = 1 << 0
	AttrCurState       QPAttrMask = 1 << 1
	AttrEnSQDAsyncNtfy QPAttrMask = 1 << 2
	AttrAccessFlags    QPAttrMask = 1 << 3
	AttrPKeyIndex      QPAttrMask = 1 << 4
	AttrPort           QPAttrMask = 1 << 5
	AttrQKey           QPAttrMask = 1 << 6
	AttrAV             QPAttrMask = 1 << 7
	AttrPathMTU        QPAttrMask = 1 << 8
	AttrTimeout        QPAttrMask = 1 << 9
	AttrRetryCnt       QPAttrMask = 1 << 10
	AttrRNRRetry       QPAttrMask = 1 << 11
	AttrRQPSN          QPAttrMask = 1 << 12
	AttrMaxQPRDAtomic  QPAttrMask = 1 << 13
	AttrAltPath        QPAttrMask = 1 << 14
	AttrMinRNRTimer    QPAttrMask = 1 << 15
	AttrSQPSN          QPAttrMask = 1 << 16
	AttrMaxDestRDAtom  QPAttrMask = 1 << 17
	AttrPathMigState   QPAttrMask = 1 << 18
	AttrCap            QPAttrMask = 1 << 19
	AttrDestQPN        QPAttrMask = 1 << 20
)

// SGE is struct ibv_sge.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// SendWR is one send work request. Its scatter/gather list is
// SGEs[SGEIndex : SGEIndex+NumSGE] of the slice passed next to it to
// QP.PostSend. The layout is fixed (72 bytes) and pointer-free.
type SendWR struct {
	WRID       uint64
	RemoteAddr uint64 // RDMA and atomic operations
	CompareAdd uint64 // CAS compare value, FAA add value
	Swap       uint64 // CAS swap value
	AH         uint64 // UD: provider address-handle handle
	Opcode     WROpcode
	Flags      SendFlags
	Imm        uint32 // host byte order; providers convert to the wire
	RKey       uint32
	SGEIndex   uint32
	NumSGE     uint32
	RemoteQPN  uint32 // UD
	RemoteQKey uint32 // UD
}

// RecvWR is one receive work request; its SGL is SGEs[SGEIndex:SGEIndex+NumSGE].
type RecvWR struct {
	WRID     uint64
	SGEIndex uint32
	NumSGE   uint32
}

// Completion is one work completion (struct ibv_wc, host byte order).
// The layout is that of struct ibv_wc (48 bytes), pointer-free; the public
// verbs.Completion has the same layout.
type Completion struct {
	WRID      uint64
	Status    Status
	Opcode    WCOpcode
	VendorErr uint32
	ByteLen   uint32
	Imm       uint32
	QPN       uint32
	SrcQP     uint32
	Flags     WCFlags
	PKeyIndex uint16
	SLID      uint16
	SL        uint8
	DLIDBits  uint8
	_         [2]byte
}
