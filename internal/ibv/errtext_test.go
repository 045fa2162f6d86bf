package ibv

import (
	"errors"
	"math"
	"syscall"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

func TestModifyOp(t *testing.T) {
	for _, tc := range []struct {
		qpn  uint32
		to   prov.QPState
		mask prov.QPAttrMask
		want string
	}{
		// The RTR transition of an RC QP as verbs.Connect asks for it: the
		// mask of the rxe report in issue 12.
		{66, prov.QPStateRTR, 0x129181,
			"ibv_modify_qp (QPN 66, to RTR, attributes STATE|AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN = mask 0x129181)"},
		{7, prov.QPStateInit, prov.AttrState | prov.AttrPKeyIndex | prov.AttrPort | prov.AttrAccessFlags,
			"ibv_modify_qp (QPN 7, to INIT, attributes STATE|ACCESS_FLAGS|PKEY_INDEX|PORT = mask 0x39)"},
		{8, prov.QPStateRTS, prov.AttrState | prov.AttrSQPSN | prov.AttrTimeout | prov.AttrRetryCnt | prov.AttrRNRRetry | prov.AttrMaxQPRDAtomic,
			"ibv_modify_qp (QPN 8, to RTS, attributes STATE|TIMEOUT|RETRY_CNT|RNR_RETRY|MAX_QP_RD_ATOMIC|SQ_PSN = mask 0x12e01)"},
		{9, prov.QPStateErr, prov.AttrState, "ibv_modify_qp (QPN 9, to ERR, attributes STATE = mask 0x1)"},
		// Without AttrState the state field is not a target.
		{9, prov.QPStateRTS, prov.AttrMinRNRTimer, "ibv_modify_qp (QPN 9, no state change, attributes MIN_RNR_TIMER = mask 0x8000)"},
		// Unknown bits and states stay visible.
		{10, 9, prov.AttrState | 1<<25, "ibv_modify_qp (QPN 10, to state 9, attributes STATE|0x2000000 = mask 0x2000001)"},
		{11, prov.QPStateReset, 0, "ibv_modify_qp (QPN 11, no state change, attributes none = mask 0x0)"},
	} {
		if got := modifyOp(tc.qpn, tc.to, tc.mask); got != tc.want {
			t.Errorf("modifyOp(%d, %d, %#x)\n got %s\nwant %s", tc.qpn, tc.to, uint32(tc.mask), got, tc.want)
		}
	}
}

func TestQueryPortOp(t *testing.T) {
	for _, tc := range []struct {
		port   uint8
		nports int
		want   string
	}{
		{9, 1, "ibv_query_port (port 9): rxe0 has port 1, there is no port 9"},
		{0, 1, "ibv_query_port (port 0): rxe0 has port 1, there is no port 0"},
		{3, 2, "ibv_query_port (port 3): rxe0 has ports 1-2, there is no port 3"},
		{1, 0, "ibv_query_port (port 1): rxe0 has no ports, there is no port 1"},
		// A port that exists (or an unknown count): the call failed for
		// another reason, which the errno says.
		{2, 2, "ibv_query_port (port 2 of rxe0)"},
		{9, -1, "ibv_query_port (port 9 of rxe0)"},
	} {
		if got := queryPortOp("rxe0", tc.port, tc.nports); got != tc.want {
			t.Errorf("queryPortOp(rxe0, %d, %d)\n got %s\nwant %s", tc.port, tc.nports, got, tc.want)
		}
	}
}

// TestFieldChecks: values that do not fit the C fields they become are
// refused with EINVAL (on every host: these checks have no cgo), the
// largest that fit are taken; an ENODATA for a bad source GID index also
// matches EINVAL.
func TestFieldChecks(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		ok   bool
	}{
		{"u32 max", fitU32("op", "x", math.MaxUint32), true},
		{"u32 over", fitU32("op", "x", math.MaxUint32+1), false},
		{"u32 negative", fitU32("op", "x", -1), false},
		{"i32 min", fitI32("op", "x", math.MinInt32), true},
		{"i32 over", fitI32("op", "x", math.MaxInt32+1), false},
		{"cap", checkCap("op", prov.QPCap{MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}), true},
		{"cap over", checkCap("op", prov.QPCap{MaxSendWR: 1<<32 + 4}), false},
		{"cap inline over", checkCap("op", prov.QPCap{MaxInlineData: -1}), false},
		{"srq", checkSRQAttr("op", prov.SRQAttr{MaxWR: 64, MaxSGE: 1, SRQLimit: 8}), true},
		{"srq limit over", checkSRQAttr("op", prov.SRQAttr{MaxWR: 64, SRQLimit: 1<<32 + 1}), false},
		{"bad gid index", gidIndexErr(syscall.ENODATA, syscall.ENODATA, true, 9, 1), false},
	} {
		if tc.ok != (tc.err == nil) || (!tc.ok && !errors.Is(tc.err, syscall.EINVAL)) {
			t.Errorf("%s: %v, want ok %v or EINVAL", tc.name, tc.err, tc.ok)
		}
	}
	if err := gidIndexErr(syscall.EPERM, syscall.EPERM, true, 9, 1); err != syscall.EPERM {
		t.Errorf("another error: %v, want it unchanged", err)
	}
}
