package verbs

import (
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// QPAttrMask selects the QPAttr fields a Modify sets (enum ibv_qp_attr_mask).
type QPAttrMask uint32

// QP attribute mask bits.
const (
	AttrState         = QPAttrMask(prov.AttrState)
	AttrCurState      = QPAttrMask(prov.AttrCurState)
	AttrAccessFlags   = QPAttrMask(prov.AttrAccessFlags)
	AttrPKeyIndex     = QPAttrMask(prov.AttrPKeyIndex)
	AttrPort          = QPAttrMask(prov.AttrPort)
	AttrQKey          = QPAttrMask(prov.AttrQKey)
	AttrAV            = QPAttrMask(prov.AttrAV)
	AttrPathMTU       = QPAttrMask(prov.AttrPathMTU)
	AttrTimeout       = QPAttrMask(prov.AttrTimeout)
	AttrRetryCount    = QPAttrMask(prov.AttrRetryCnt)
	AttrRNRRetry      = QPAttrMask(prov.AttrRNRRetry)
	AttrRQPSN         = QPAttrMask(prov.AttrRQPSN)
	AttrMaxRDAtomic   = QPAttrMask(prov.AttrMaxQPRDAtomic)
	AttrMinRNRTimer   = QPAttrMask(prov.AttrMinRNRTimer)
	AttrSQPSN         = QPAttrMask(prov.AttrSQPSN)
	AttrMaxDestAtomic = QPAttrMask(prov.AttrMaxDestRDAtom)
	AttrCap           = QPAttrMask(prov.AttrCap)
	AttrDestQPN       = QPAttrMask(prov.AttrDestQPN)
)

// AHAttr is an address vector: how to reach a remote port.
type AHAttr struct {
	DGID         GID
	FlowLabel    uint32
	SGIDIndex    uint8
	HopLimit     uint8
	TrafficClass uint8
	IsGlobal     bool // use a GRH (required on RoCE)
	DLID         uint16
	SL           uint8
	SrcPathBits  uint8
	StaticRate   uint8
	Port         uint8
	// ProviderAddr is the peer's Endpoint.Addr (soft provider routing):
	// how to reach the port that owns DGID. The GID still routes: soft0
	// refuses a DGID that is not a GID of the port the address names
	// (an error wrapping EHOSTUNREACH), as hardware cannot route to it.
	ProviderAddr []byte
}

func (a AHAttr) prov() prov.AHAttr {
	return prov.AHAttr{DGID: a.DGID, FlowLabel: a.FlowLabel, SGIDIndex: a.SGIDIndex, HopLimit: a.HopLimit,
		TrafficClass: a.TrafficClass, IsGlobal: a.IsGlobal, DLID: a.DLID, SL: a.SL, SrcPathBits: a.SrcPathBits,
		StaticRate: a.StaticRate, Port: a.Port, ProviderAddr: a.ProviderAddr}
}

func ahFromProv(a prov.AHAttr) AHAttr {
	return AHAttr{DGID: a.DGID, FlowLabel: a.FlowLabel, SGIDIndex: a.SGIDIndex, HopLimit: a.HopLimit,
		TrafficClass: a.TrafficClass, IsGlobal: a.IsGlobal, DLID: a.DLID, SL: a.SL, SrcPathBits: a.SrcPathBits,
		StaticRate: a.StaticRate, Port: a.Port, ProviderAddr: a.ProviderAddr}
}

// QPCap holds the capacities of a queue pair.
type QPCap struct {
	MaxSendWR     int
	MaxRecvWR     int
	MaxSendSGE    int
	MaxRecvSGE    int
	MaxInlineData int
}

// QPAttr holds the attributes of a queue pair (struct ibv_qp_attr).
type QPAttr struct {
	State           QPState
	CurState        QPState
	PathMTU         MTU
	QKey            uint32
	RQPSN           uint32
	SQPSN           uint32
	DestQPN         uint32
	Access          Access
	Cap             QPCap
	AH              AHAttr
	PKeyIndex       uint16
	MaxRDAtomic     uint8
	MaxDestRDAtomic uint8
	MinRNRTimer     uint8
	Port            uint8
	Timeout         uint8
	RetryCount      uint8
	RNRRetry        uint8
}

func (a *QPAttr) prov() prov.QPAttr {
	return prov.QPAttr{State: prov.QPState(a.State), CurState: prov.QPState(a.CurState), PathMTU: prov.MTU(a.PathMTU),
		QKey: a.QKey, RQPSN: a.RQPSN, SQPSN: a.SQPSN, DestQPN: a.DestQPN, Access: prov.Access(a.Access),
		Cap: prov.QPCap(a.Cap), AH: a.AH.prov(), PKeyIndex: a.PKeyIndex, MaxRDAtomic: a.MaxRDAtomic,
		MaxDestRDAtom: a.MaxDestRDAtomic, MinRNRTimer: a.MinRNRTimer, Port: a.Port, Timeout: a.Timeout,
		RetryCnt: a.RetryCount, RNRRetry: a.RNRRetry}
}

func qpAttrFromProv(a prov.QPAttr) QPAttr {
	return QPAttr{State: QPState(a.State), CurState: QPState(a.CurState), PathMTU: MTU(a.PathMTU),
		QKey: a.QKey, RQPSN: a.RQPSN, SQPSN: a.SQPSN, DestQPN: a.DestQPN, Access: Access(a.Access),
		Cap: QPCap(a.Cap), AH: ahFromProv(a.AH), PKeyIndex: a.PKeyIndex, MaxRDAtomic: a.MaxRDAtomic,
		MaxDestRDAtomic: a.MaxDestRDAtom, MinRNRTimer: a.MinRNRTimer, Port: a.Port, Timeout: a.Timeout,
		RetryCount: a.RetryCnt, RNRRetry: a.RNRRetry}
}

// transition describes one allowed state change and the attributes it needs.
type transition struct{ from, to QPState }

var required = map[Transport]map[transition]QPAttrMask{
	TransportRC: {
		{StateReset, StateInit}: AttrState | AttrPKeyIndex | AttrPort | AttrAccessFlags,
		{StateInit, StateInit}:  AttrState,
		{StateInit, StateRTR}:   AttrState | AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN | AttrMaxDestAtomic | AttrMinRNRTimer,
		{StateRTR, StateRTS}:    AttrState | AttrSQPSN | AttrTimeout | AttrRetryCount | AttrRNRRetry | AttrMaxRDAtomic,
	},
	TransportUC: {
		{StateReset, StateInit}: AttrState | AttrPKeyIndex | AttrPort | AttrAccessFlags,
		{StateInit, StateInit}:  AttrState,
		{StateInit, StateRTR}:   AttrState | AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN,
		{StateRTR, StateRTS}:    AttrState | AttrSQPSN,
	},
	TransportUD: {
		{StateReset, StateInit}: AttrState | AttrPKeyIndex | AttrPort | AttrQKey,
		{StateInit, StateInit}:  AttrState,
		{StateInit, StateRTR}:   AttrState,
		{StateRTR, StateRTS}:    AttrState | AttrSQPSN,
	},
}

// validateTransition checks a Modify against the verbs state table.
func validateTransition(t Transport, from QPState, attr *QPAttr, mask QPAttrMask) error {
	if mask&AttrState == 0 {
		if from == StateReset {
			return fmt.Errorf("modify without AttrState is not allowed in RESET")
		}
		return nil // attribute change without transition; the provider validates
	}
	to := attr.State
	if mask&AttrCurState != 0 && attr.CurState != from {
		return fmt.Errorf("AttrCurState %s does not match the current state %s", attr.CurState, from)
	}
	switch to {
	case StateReset, StateError:
		return nil // always allowed
	}
	key := transition{from, to}
	need, ok := required[t][key]
	if !ok {
		switch key {
		case transition{StateRTS, StateRTS}, transition{StateSQD, StateRTS}, transition{StateSQE, StateRTS},
			transition{StateRTS, StateSQD}, transition{StateSQD, StateSQD}:
			return nil
		}
		return fmt.Errorf("invalid transition %s -> %s", from, to)
	}
	if missing := need &^ mask; missing != 0 {
		return fmt.Errorf("transition %s -> %s on a %s QP needs attributes %s", from, to, t, missing)
	}
	return nil
}

var maskNames = []struct {
	m QPAttrMask
	n string
}{
	{AttrState, "State"}, {AttrCurState, "CurState"}, {AttrAccessFlags, "AccessFlags"}, {AttrPKeyIndex, "PKeyIndex"},
	{AttrPort, "Port"}, {AttrQKey, "QKey"}, {AttrAV, "AV"}, {AttrPathMTU, "PathMTU"}, {AttrTimeout, "Timeout"},
	{AttrRetryCount, "RetryCount"}, {AttrRNRRetry, "RNRRetry"}, {AttrRQPSN, "RQPSN"}, {AttrMaxRDAtomic, "MaxRDAtomic"},
	{AttrMinRNRTimer, "MinRNRTimer"}, {AttrSQPSN, "SQPSN"}, {AttrMaxDestAtomic, "MaxDestAtomic"}, {AttrCap, "Cap"},
	{AttrDestQPN, "DestQPN"},
}

func (m QPAttrMask) String() string {
	s := ""
	for _, n := range maskNames {
		if m&n.m != 0 {
			if s != "" {
				s += "|"
			}
			s += n.n
			m &^= n.m
		}
	}
	if m != 0 {
		if s != "" {
			s += "|"
		}
		s += fmt.Sprintf("%#x", uint32(m))
	}
	return s
}

// checkAttrRanges refuses attributes selected by mask whose values do not
// fit the fields they go into on the wire or the limits the device
// advertised (maxRDAtom, maxInitRDAtom: max_qp_rd_atom and
// max_qp_init_rd_atom, 0 if unknown), for every provider alike: rdma_rxe
// accepted a 25-bit destination QPN (its packets then name another QP),
// PSNs of 25 bits, and more outstanding reads and atomics than it
// advertises, where soft0 refused some of them.
func checkAttrRanges(a *QPAttr, mask QPAttrMask, maxRDAtom, maxInitRDAtom int) error {
	const max24 = 1<<24 - 1
	switch {
	case mask&AttrDestQPN != 0 && a.DestQPN > max24:
		return fmt.Errorf("destination QPN %#x does not fit 24 bits", a.DestQPN)
	case mask&AttrRQPSN != 0 && a.RQPSN > max24:
		return fmt.Errorf("receive PSN %#x does not fit 24 bits", a.RQPSN)
	case mask&AttrSQPSN != 0 && a.SQPSN > max24:
		return fmt.Errorf("send PSN %#x does not fit 24 bits", a.SQPSN)
	case mask&AttrTimeout != 0 && a.Timeout > 31:
		return fmt.Errorf("timeout %d: want 0..31 (0: infinite)", a.Timeout)
	case mask&AttrRetryCount != 0 && a.RetryCount > 7:
		return fmt.Errorf("retry count %d: want 0..7", a.RetryCount)
	case mask&AttrRNRRetry != 0 && a.RNRRetry > 7:
		return fmt.Errorf("RNR retry %d: want 0..7 (7: retry forever)", a.RNRRetry)
	case mask&AttrMinRNRTimer != 0 && a.MinRNRTimer > 31:
		return fmt.Errorf("minimum RNR timer %d: want 0..31", a.MinRNRTimer)
	case mask&AttrMaxDestAtomic != 0 && maxRDAtom > 0 && int(a.MaxDestRDAtomic) > maxRDAtom:
		return fmt.Errorf("MaxDestRDAtomic %d: the device allows %d (max_qp_rd_atom)", a.MaxDestRDAtomic, maxRDAtom)
	case mask&AttrMaxRDAtomic != 0 && maxInitRDAtom > 0 && int(a.MaxRDAtomic) > maxInitRDAtom:
		return fmt.Errorf("MaxRDAtomic %d: the device allows %d (max_qp_init_rd_atom)", a.MaxRDAtomic, maxInitRDAtom)
	}
	return nil
}
