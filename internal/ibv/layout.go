//go:build ibverbs && linux && cgo

package ibv

/*
#include "shim.h"
*/
import "C"

import "unsafe"

// cLayout reports sizes and field offsets of the C mirrors of the prov
// data-path types, as the C compiler laid them out (layout_test.go compares
// them with the Go types; cgo is not allowed in test files).
func cLayout() map[string]uintptr {
	var s C.gv_send_wr
	var r C.gv_recv_wr
	var g C.gv_sge
	var w C.gv_wc
	return map[string]uintptr{
		"SendWR":            unsafe.Sizeof(s),
		"SendWR.WRID":       unsafe.Offsetof(s.wr_id),
		"SendWR.RemoteAddr": unsafe.Offsetof(s.remote_addr),
		"SendWR.CompareAdd": unsafe.Offsetof(s.compare_add),
		"SendWR.Swap":       unsafe.Offsetof(s.swap),
		"SendWR.AH":         unsafe.Offsetof(s.ah),
		"SendWR.Opcode":     unsafe.Offsetof(s.opcode),
		"SendWR.Flags":      unsafe.Offsetof(s.flags),
		"SendWR.Imm":        unsafe.Offsetof(s.imm),
		"SendWR.RKey":       unsafe.Offsetof(s.rkey),
		"SendWR.SGEIndex":   unsafe.Offsetof(s.sge_index),
		"SendWR.NumSGE":     unsafe.Offsetof(s.num_sge),
		"SendWR.RemoteQPN":  unsafe.Offsetof(s.remote_qpn),
		"SendWR.RemoteQKey": unsafe.Offsetof(s.remote_qkey),

		"RecvWR":          unsafe.Sizeof(r),
		"RecvWR.WRID":     unsafe.Offsetof(r.wr_id),
		"RecvWR.SGEIndex": unsafe.Offsetof(r.sge_index),
		"RecvWR.NumSGE":   unsafe.Offsetof(r.num_sge),

		"SGE":        unsafe.Sizeof(g),
		"SGE.Addr":   unsafe.Offsetof(g.addr),
		"SGE.Length": unsafe.Offsetof(g.length),
		"SGE.LKey":   unsafe.Offsetof(g.lkey),

		"Completion":           unsafe.Sizeof(w),
		"Completion.WRID":      unsafe.Offsetof(w.wr_id),
		"Completion.Status":    unsafe.Offsetof(w.status),
		"Completion.Opcode":    unsafe.Offsetof(w.opcode),
		"Completion.VendorErr": unsafe.Offsetof(w.vendor_err),
		"Completion.ByteLen":   unsafe.Offsetof(w.byte_len),
		"Completion.Imm":       unsafe.Offsetof(w.imm),
		"Completion.QPN":       unsafe.Offsetof(w.qpn),
		"Completion.SrcQP":     unsafe.Offsetof(w.src_qp),
		"Completion.Flags":     unsafe.Offsetof(w.flags),
		"Completion.PKeyIndex": unsafe.Offsetof(w.pkey_index),
		"Completion.SLID":      unsafe.Offsetof(w.slid),
		"Completion.SL":        unsafe.Offsetof(w.sl),
		"Completion.DLIDBits":  unsafe.Offsetof(w.dlid_bits),

		// struct ibv_sge must match SGE exactly (passed in place).
		"ibv_sge":     C.sizeof_struct_ibv_sge,
		"ibv_wc":      C.sizeof_struct_ibv_wc,
		"ibv_send_wr": C.sizeof_struct_ibv_send_wr,
	}
}
