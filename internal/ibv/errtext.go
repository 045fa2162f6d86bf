package ibv

import (
	"fmt"
	"math"
	"strings"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// This file words the errors of the hardware provider. It has no cgo and no
// build tag, so its unit tests run on every host.

var qpStateNames = [...]string{"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"}

// qpStateName names a QP state as verbs.h does without its IBV_QPS_ prefix.
func qpStateName(s prov.QPState) string {
	if int(s) < len(qpStateNames) {
		return qpStateNames[s]
	}
	return fmt.Sprintf("state %d", uint32(s))
}

// qpMaskNames are the bits of enum ibv_qp_attr_mask without their IBV_QP_
// prefix, in bit order.
var qpMaskNames = [...]string{"STATE", "CUR_STATE", "EN_SQD_ASYNC_NOTIFY", "ACCESS_FLAGS", "PKEY_INDEX",
	"PORT", "QKEY", "AV", "PATH_MTU", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "RQ_PSN", "MAX_QP_RD_ATOMIC",
	"ALT_PATH", "MIN_RNR_TIMER", "SQ_PSN", "MAX_DEST_RD_ATOMIC", "PATH_MIG_STATE", "CAP", "DEST_QPN"}

// qpMaskString names the bits of m ("STATE|AV|PATH_MTU"); bits without a
// name are given in hex.
func qpMaskString(m prov.QPAttrMask) string {
	var b strings.Builder
	for i, n := range qpMaskNames {
		if m&(1<<i) == 0 {
			continue
		}
		if b.Len() > 0 {
			b.WriteByte('|')
		}
		b.WriteString(n)
	}
	if rest := m &^ (1<<len(qpMaskNames) - 1); rest != 0 {
		if b.Len() > 0 {
			b.WriteByte('|')
		}
		fmt.Fprintf(&b, "%#x", uint32(rest))
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}

// modifyOp is the operation text of a failed ibv_modify_qp: the QP, the
// state it was moved to and the attributes given, by name and as the mask
// libibverbs saw:
//
//	ibv_modify_qp (QPN 66, to RTR, attributes STATE|AV|PATH_MTU|... = mask 0x129181)
func modifyOp(qpn uint32, to prov.QPState, mask prov.QPAttrMask) string {
	target := "no state change"
	if mask&prov.AttrState != 0 {
		target = "to " + qpStateName(to)
	}
	return fmt.Sprintf("ibv_modify_qp (QPN %d, %s, attributes %s = mask %#x)", qpn, target, qpMaskString(mask), uint32(mask))
}

// portsText says which ports a device with n physical ports has:
// "port 1", "ports 1-2", "no ports".
func portsText(n int) string {
	switch {
	case n <= 0:
		return "no ports"
	case n == 1:
		return "port 1"
	}
	return fmt.Sprintf("ports 1-%d", n)
}

// queryPortOp is the operation text of a failed ibv_query_port. When port
// is outside 1..nports (the device's port count, or -1 if unknown) it says
// so and which ports exist.
func queryPortOp(dev string, port uint8, nports int) string {
	if nports >= 0 && (port == 0 || int(port) > nports) {
		return fmt.Sprintf("ibv_query_port (port %d): %s has %s, there is no port %d", port, dev, portsText(nports), port)
	}
	return fmt.Sprintf("ibv_query_port (port %d of %s)", port, dev)
}

// gidIndexErr words the failure of a call given an address vector whose
// source GID index names no GID of the port: libibverbs (and the kernel)
// report it as ENODATA, a code no caller tests for, where soft0 and the
// verbs layer's own checks (QPSpec.FixedGID) report EINVAL. The error
// matches both. Other errors are returned as they are.
func gidIndexErr(err error, e syscall.Errno, global bool, sgid, port uint8) error {
	if e != syscall.ENODATA || !global {
		return err
	}
	return fmt.Errorf("%w: source GID index %d is not a valid entry of port %d's GID table (see `goverbs devinfo -v`): %w",
		err, sgid, port, syscall.EINVAL)
}

// fitField checks that v, an int the caller gave, fits the C field it
// becomes (lo..hi: an int, a uint32_t): a conversion would otherwise keep
// its low bits, silently (1<<32 + 4 send WRs made a queue of 4, a CQ of
// 1<<32 + 5 entries one of 5), where soft0 refuses the value.
func fitField(op, what string, v int, lo, hi int64) error {
	if int64(v) < lo || int64(v) > hi {
		return fmt.Errorf("%s: %s %d out of range (%d..%d): %w", op, what, v, lo, hi, syscall.EINVAL)
	}
	return nil
}

// fitU32 checks fields that become a uint32_t, fitI32 those that become an int.
func fitU32(op, what string, v int) error { return fitField(op, what, v, 0, math.MaxUint32) }
func fitI32(op, what string, v int) error {
	return fitField(op, what, v, math.MinInt32, math.MaxInt32)
}

// checkCap checks that the capacities of c fit the uint32_t fields of
// struct ibv_qp_cap.
func checkCap(op string, c prov.QPCap) error {
	for _, f := range []struct {
		what string
		v    int
	}{{"max_send_wr", c.MaxSendWR}, {"max_recv_wr", c.MaxRecvWR}, {"max_send_sge", c.MaxSendSGE},
		{"max_recv_sge", c.MaxRecvSGE}, {"max_inline_data", c.MaxInlineData}} {
		if err := fitU32(op, f.what, f.v); err != nil {
			return err
		}
	}
	return nil
}

// checkSRQAttr checks that the fields of a become the uint32_t fields of
// struct ibv_srq_attr unchanged.
func checkSRQAttr(op string, a prov.SRQAttr) error {
	if err := fitU32(op, "max_wr", a.MaxWR); err != nil {
		return err
	}
	if err := fitU32(op, "max_sge", a.MaxSGE); err != nil {
		return err
	}
	return fitU32(op, "srq_limit", a.SRQLimit)
}
