//go:build ibverbs && linux && cgo

package ibv

import (
	"testing"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// TestLayout checks that the C mirrors in shim.h have the layout of the
// prov data-path types (the C side also checks itself with static asserts).
// No device needed.
func TestLayout(t *testing.T) {
	var s prov.SendWR
	var r prov.RecvWR
	var g prov.SGE
	var w prov.Completion
	want := map[string]uintptr{
		"SendWR":            unsafe.Sizeof(s),
		"SendWR.WRID":       unsafe.Offsetof(s.WRID),
		"SendWR.RemoteAddr": unsafe.Offsetof(s.RemoteAddr),
		"SendWR.CompareAdd": unsafe.Offsetof(s.CompareAdd),
		"SendWR.Swap":       unsafe.Offsetof(s.Swap),
		"SendWR.AH":         unsafe.Offsetof(s.AH),
		"SendWR.Opcode":     unsafe.Offsetof(s.Opcode),
		"SendWR.Flags":      unsafe.Offsetof(s.Flags),
		"SendWR.Imm":        unsafe.Offsetof(s.Imm),
		"SendWR.RKey":       unsafe.Offsetof(s.RKey),
		"SendWR.SGEIndex":   unsafe.Offsetof(s.SGEIndex),
		"SendWR.NumSGE":     unsafe.Offsetof(s.NumSGE),
		"SendWR.RemoteQPN":  unsafe.Offsetof(s.RemoteQPN),
		"SendWR.RemoteQKey": unsafe.Offsetof(s.RemoteQKey),

		"RecvWR":          unsafe.Sizeof(r),
		"RecvWR.WRID":     unsafe.Offsetof(r.WRID),
		"RecvWR.SGEIndex": unsafe.Offsetof(r.SGEIndex),
		"RecvWR.NumSGE":   unsafe.Offsetof(r.NumSGE),

		"SGE":        unsafe.Sizeof(g),
		"SGE.Addr":   unsafe.Offsetof(g.Addr),
		"SGE.Length": unsafe.Offsetof(g.Length),
		"SGE.LKey":   unsafe.Offsetof(g.LKey),

		"Completion":           unsafe.Sizeof(w),
		"Completion.WRID":      unsafe.Offsetof(w.WRID),
		"Completion.Status":    unsafe.Offsetof(w.Status),
		"Completion.Opcode":    unsafe.Offsetof(w.Opcode),
		"Completion.VendorErr": unsafe.Offsetof(w.VendorErr),
		"Completion.ByteLen":   unsafe.Offsetof(w.ByteLen),
		"Completion.Imm":       unsafe.Offsetof(w.Imm),
		"Completion.QPN":       unsafe.Offsetof(w.QPN),
		"Completion.SrcQP":     unsafe.Offsetof(w.SrcQP),
		"Completion.Flags":     unsafe.Offsetof(w.Flags),
		"Completion.PKeyIndex": unsafe.Offsetof(w.PKeyIndex),
		"Completion.SLID":      unsafe.Offsetof(w.SLID),
		"Completion.SL":        unsafe.Offsetof(w.SL),
		"Completion.DLIDBits":  unsafe.Offsetof(w.DLIDBits),

		"ibv_sge": unsafe.Sizeof(g), // passed to libibverbs in place
	}
	got := cLayout()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: C has %d, Go has %d", k, got[k], v)
		}
	}
	if got["ibv_wc"] != unsafe.Sizeof(w) {
		t.Errorf("struct ibv_wc (%d bytes) differs from prov.Completion (%d bytes): ibv_poll_cq writes into it in place", got["ibv_wc"], unsafe.Sizeof(w))
	}
	t.Logf("sizes: SendWR %d, RecvWR %d, SGE %d, Completion %d; ibv_send_wr %d, ibv_wc %d",
		unsafe.Sizeof(s), unsafe.Sizeof(r), unsafe.Sizeof(g), unsafe.Sizeof(w), got["ibv_send_wr"], got["ibv_wc"])
}
