package verbs

import (
	"fmt"
	"strings"

	"github.com/goverbs/verbs/internal/prov"
)

// Access is a set of access flags for memory regions and queue pairs.
type Access uint32

// Access flags (enum ibv_access_flags).
const (
	// AccessLocalWrite lets the local HCA write the memory: needed for receive
	// buffers, RDMA read destinations, atomic results and any remote write.
	AccessLocalWrite   = Access(prov.AccessLocalWrite)
	AccessRemoteWrite  = Access(prov.AccessRemoteWrite)
	AccessRemoteRead   = Access(prov.AccessRemoteRead)
	AccessRemoteAtomic = Access(prov.AccessRemoteAtomic)
	AccessRelaxedOrder = Access(prov.AccessRelaxedOrder)

	// AccessRemoteAll is local write plus every remote access.
	AccessRemoteAll = AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead | AccessRemoteAtomic
)

var accessNames = []struct {
	a Access
	n string
}{
	{AccessLocalWrite, "LocalWrite"},
	{AccessRemoteWrite, "RemoteWrite"},
	{AccessRemoteRead, "RemoteRead"},
	{AccessRemoteAtomic, "RemoteAtomic"},
	{AccessRelaxedOrder, "RelaxedOrder"},
}

func (a Access) String() string {
	if a == 0 {
		return "None"
	}
	var parts []string
	for _, n := range accessNames {
		if a&n.a != 0 {
			parts = append(parts, n.n)
			a &^= n.a
		}
	}
	if a != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint32(a)))
	}
	return strings.Join(parts, "|")
}

// QPState is the state of a queue pair.
type QPState uint32

// Queue pair states.
const (
	StateReset = QPState(prov.QPStateReset)
	StateInit  = QPState(prov.QPStateInit)
	StateRTR   = QPState(prov.QPStateRTR)
	StateRTS   = QPState(prov.QPStateRTS)
	StateSQD   = QPState(prov.QPStateSQD)
	StateSQE   = QPState(prov.QPStateSQE)
	StateError = QPState(prov.QPStateErr)
)

func (s QPState) String() string {
	switch s {
	case StateReset:
		return "RESET"
	case StateInit:
		return "INIT"
	case StateRTR:
		return "RTR"
	case StateRTS:
		return "RTS"
	case StateSQD:
		return "SQD"
	case StateSQE:
		return "SQE"
	case StateError:
		return "ERR"
	}
	return fmt.Sprintf("QPState(%d)", uint32(s))
}

// MTU is a path MTU (enum ibv_mtu). The zero value means "negotiate": the
// smaller of the two ports' active MTUs.
type MTU uint32

// MTU values.
const (
	MTU256  = MTU(prov.MTU256)
	MTU512  = MTU(prov.MTU512)
	MTU1024 = MTU(prov.MTU1024)
	MTU2048 = MTU(prov.MTU2048)
	MTU4096 = MTU(prov.MTU4096)
)

// Bytes returns the MTU in bytes (0 for an invalid value).
func (m MTU) Bytes() int { return prov.MTU(m).Bytes() }

func (m MTU) String() string {
	if b := m.Bytes(); b != 0 {
		return fmt.Sprint(b)
	}
	return fmt.Sprintf("MTU(%d)", uint32(m))
}

// MTUFromBytes returns the MTU for 256, 512, 1024, 2048 or 4096 bytes.
func MTUFromBytes(n int) (MTU, error) {
	for m := MTU256; m <= MTU4096; m++ {
		if m.Bytes() == n {
			return m, nil
		}
	}
	return 0, fmt.Errorf("verbs: invalid MTU %d (want 256, 512, 1024, 2048 or 4096)", n)
}

// PortState is the logical state of a port.
type PortState uint32

// Port states.
const (
	PortDown   = PortState(prov.PortDown)
	PortInit   = PortState(prov.PortInit)
	PortArmed  = PortState(prov.PortArmed)
	PortActive = PortState(prov.PortActive)
)

func (s PortState) String() string {
	switch PortState(s) {
	case 0:
		return "PORT_NOP"
	case PortDown:
		return "PORT_DOWN"
	case PortInit:
		return "PORT_INIT"
	case PortArmed:
		return "PORT_ARMED"
	case PortActive:
		return "PORT_ACTIVE"
	case PortState(prov.PortActiveDefer):
		return "PORT_ACTIVE_DEFER"
	}
	return fmt.Sprintf("PortState(%d)", uint32(s))
}

// LinkLayer is the link layer of a port.
type LinkLayer uint8

// Link layers.
const (
	LinkLayerUnspecified = LinkLayer(prov.LinkLayerUnspecified)
	LinkLayerInfiniBand  = LinkLayer(prov.LinkLayerInfiniBand)
	LinkLayerEthernet    = LinkLayer(prov.LinkLayerEthernet)
)

func (l LinkLayer) String() string {
	switch l {
	case LinkLayerInfiniBand:
		return "InfiniBand"
	case LinkLayerEthernet:
		return "Ethernet"
	}
	return "Unspecified"
}

// GIDType is the type of a GID table entry.
type GIDType uint32

// GID types.
const (
	GIDTypeIB     = GIDType(prov.GIDTypeIB)
	GIDTypeRoCEv1 = GIDType(prov.GIDTypeRoCEv1)
	GIDTypeRoCEv2 = GIDType(prov.GIDTypeRoCEv2)
)

func (t GIDType) String() string {
	switch t {
	case GIDTypeIB:
		return "IB"
	case GIDTypeRoCEv1:
		return "RoCE v1"
	case GIDTypeRoCEv2:
		return "RoCE v2"
	}
	return fmt.Sprintf("GIDType(%d)", uint32(t))
}

// Opcode is the operation a completion reports (enum ibv_wc_opcode).
type Opcode uint32

// Completion opcodes.
const (
	OpSend         = Opcode(prov.WCSend)
	OpWrite        = Opcode(prov.WCWrite)
	OpRead         = Opcode(prov.WCRead)
	OpCompareSwap  = Opcode(prov.WCCompSwap)
	OpFetchAdd     = Opcode(prov.WCFetchAdd)
	OpRecv         = Opcode(prov.WCRecv)
	OpRecvWriteImm = Opcode(prov.WCRecvRDMAImm)
)

func (o Opcode) String() string {
	switch o {
	case OpSend:
		return "SEND"
	case OpWrite:
		return "RDMA_WRITE"
	case OpRead:
		return "RDMA_READ"
	case OpCompareSwap:
		return "COMP_SWAP"
	case OpFetchAdd:
		return "FETCH_ADD"
	case OpRecv:
		return "RECV"
	case OpRecvWriteImm:
		return "RECV_RDMA_WITH_IMM"
	}
	return fmt.Sprintf("Opcode(%d)", uint32(o))
}

// CompletionFlags are the flags of a completion.
type CompletionFlags uint32

// Completion flags.
const (
	// WithGRH: a UD receive whose first 40 bytes hold the GRH.
	WithGRH = CompletionFlags(prov.WCWithGRH)
	// WithImm: the completion carries immediate data.
	WithImm = CompletionFlags(prov.WCWithImm)
)

// SendFlags are per-request modifiers of a send work request.
type SendFlags uint32

// Send flags.
const (
	// Fenced: wait for the RDMA reads and atomics posted before on the QP
	// to complete first (see Request.Fenced).
	Fenced = SendFlags(prov.SendFence)
	// Signaled: generate a completion even when the QP does not signal all.
	Signaled = SendFlags(prov.SendSignaled)
	// Solicited: set the solicited-event bit at the receiver.
	Solicited = SendFlags(prov.SendSolicited)
	// Inline: copy the payload into the work request at post time; the
	// buffer may be reused when Submit returns. Its SGEs must still lie
	// in memory regions of the QP's PD, named by their lkeys (the post
	// checks them; see Request.Inline). For bytes in no memory region,
	// use SendInline, WriteInline and their kin.
	Inline = SendFlags(prov.SendInline)
)
