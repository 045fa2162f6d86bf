//go:build ibverbs && linux && cgo

package ibv

/*
#include "shim.h"
#cgo noescape gv_post_send
#cgo nocallback gv_post_send
#cgo noescape gv_post_send_wr
#cgo nocallback gv_post_send_wr
#cgo noescape gv_post_recv
#cgo nocallback gv_post_recv
*/
import "C"

import (
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// queuePair is a QP (prov.QP).
type queuePair struct {
	c      *devContext
	pd     *protDomain
	q      C.gv_qp
	qpn    uint32
	handle uint64
	init   prov.QPInitAttr // with the granted caps

	closer closer
}

func toCQ(cq prov.CQ, what string) (*compQueue, error) {
	x, ok := cq.(*compQueue)
	if !ok || x == nil {
		return nil, fmt.Errorf("ibv_create_qp: %s is not a CQ of this provider: %w", what, syscall.EINVAL)
	}
	return x, nil
}

func (pd *protDomain) CreateQP(attr prov.QPInitAttr) (prov.QP, error) {
	scq, err := toCQ(attr.SendCQ, "send CQ")
	if err != nil {
		return nil, err
	}
	rcq, err := toCQ(attr.RecvCQ, "receive CQ")
	if err != nil {
		return nil, err
	}
	if err := checkCap("ibv_create_qp", attr.Cap); err != nil {
		return nil, err
	}
	var ia C.struct_ibv_qp_init_attr
	ia.send_cq = scq.cq.cq
	ia.recv_cq = rcq.cq.cq
	if attr.SRQ != nil {
		s, ok := attr.SRQ.(*sharedRQ)
		if !ok || s == nil {
			return nil, fmt.Errorf("ibv_create_qp: SRQ of another provider: %w", syscall.EINVAL)
		}
		ia.srq = s.srq
	}
	ia.cap = toCCap(attr.Cap)
	ia.qp_type = C.enum_ibv_qp_type(attr.Type)
	if attr.SignalAll {
		ia.sq_sig_all = 1
	}
	q := &queuePair{c: pd.c, pd: pd}
	q.handle = pd.c.addHandle(nil)
	useEx := C.int(0)
	if pd.c.wrAPI {
		useEx = 1
	}
	if rc := C.gv_create_qp(pd.pd, &ia, C.uint64_t(q.handle), useEx, &q.q); rc != 0 {
		pd.c.dropHandle(q.handle)
		return nil, errnoErr("ibv_create_qp", rc)
	}
	if pd.c.quirkSGEList {
		q.q.sge_list_broken = 1
	}
	q.qpn = uint32(q.q.qp.qp_num)
	q.init = attr
	q.init.Cap = fromCCap(ia.cap)
	pd.c.setHandle(q.handle, q)
	return q, nil
}

func toCCap(c prov.QPCap) C.struct_ibv_qp_cap {
	return C.struct_ibv_qp_cap{
		max_send_wr:     C.uint32_t(c.MaxSendWR),
		max_recv_wr:     C.uint32_t(c.MaxRecvWR),
		max_send_sge:    C.uint32_t(c.MaxSendSGE),
		max_recv_sge:    C.uint32_t(c.MaxRecvSGE),
		max_inline_data: C.uint32_t(c.MaxInlineData),
	}
}

func fromCCap(c C.struct_ibv_qp_cap) prov.QPCap {
	return prov.QPCap{
		MaxSendWR:     int(c.max_send_wr),
		MaxRecvWR:     int(c.max_recv_wr),
		MaxSendSGE:    int(c.max_send_sge),
		MaxRecvSGE:    int(c.max_recv_sge),
		MaxInlineData: int(c.max_inline_data),
	}
}

// WRAPI reports whether PostSend uses ibv_wr_start/ibv_wr_*/ibv_wr_complete.
func (q *queuePair) WRAPI() bool { return q.q.qpx != nil }

func (q *queuePair) QPN() uint32 { return q.qpn }

func (q *queuePair) Address() []byte { return nil }

func sgePtr(sges []prov.SGE) *C.gv_sge {
	if len(sges) == 0 {
		return nil
	}
	return (*C.gv_sge)(unsafe.Pointer(&sges[0]))
}

// PostSend is one cgo call for the whole batch.
func (q *queuePair) PostSend(wrs []prov.SendWR, sges []prov.SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	var acc C.int
	var rc C.int
	wp := (*C.gv_send_wr)(unsafe.Pointer(&wrs[0]))
	countCall(callPostSend)
	if q.q.qpx != nil {
		rc = C.gv_post_send_wr(&q.q, wp, C.int(len(wrs)), sgePtr(sges), C.int(len(sges)), &acc)
	} else {
		rc = C.gv_post_send(&q.q, wp, C.int(len(wrs)), sgePtr(sges), C.int(len(sges)), &acc)
	}
	if rc != 0 {
		return int(acc), postErr("ibv_post_send", rc)
	}
	return len(wrs), nil
}

// PostRecv is one cgo call for the whole batch.
func (q *queuePair) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	var acc C.int
	countCall(callPostRecv)
	rc := C.gv_post_recv(&q.q, (*C.gv_recv_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), sgePtr(sges), C.int(len(sges)), &acc)
	if rc != 0 {
		return int(acc), postErr("ibv_post_recv", rc)
	}
	return len(wrs), nil
}

func toCAH(a *prov.AHAttr) C.struct_ibv_ah_attr {
	var c C.struct_ibv_ah_attr
	*(*[16]byte)(unsafe.Pointer(&c.grh.dgid)) = a.DGID
	c.grh.flow_label = C.uint32_t(a.FlowLabel)
	c.grh.sgid_index = C.uint8_t(a.SGIDIndex)
	c.grh.hop_limit = C.uint8_t(a.HopLimit)
	c.grh.traffic_class = C.uint8_t(a.TrafficClass)
	if a.IsGlobal {
		c.is_global = 1
	}
	c.dlid = C.uint16_t(a.DLID)
	c.sl = C.uint8_t(a.SL)
	c.src_path_bits = C.uint8_t(a.SrcPathBits)
	c.static_rate = C.uint8_t(a.StaticRate)
	c.port_num = C.uint8_t(a.Port)
	return c
}

func fromCAH(c *C.struct_ibv_ah_attr) prov.AHAttr {
	return prov.AHAttr{
		DGID:         *(*[16]byte)(unsafe.Pointer(&c.grh.dgid)),
		FlowLabel:    uint32(c.grh.flow_label),
		SGIDIndex:    uint8(c.grh.sgid_index),
		HopLimit:     uint8(c.grh.hop_limit),
		TrafficClass: uint8(c.grh.traffic_class),
		IsGlobal:     c.is_global != 0,
		DLID:         uint16(c.dlid),
		SL:           uint8(c.sl),
		SrcPathBits:  uint8(c.src_path_bits),
		StaticRate:   uint8(c.static_rate),
		Port:         uint8(c.port_num),
	}
}

func (q *queuePair) Modify(attr *prov.QPAttr, mask prov.QPAttrMask) error {
	if mask&prov.AttrCap != 0 {
		if err := checkCap(modifyOp(q.qpn, attr.State, mask), attr.Cap); err != nil {
			return err
		}
	}
	var a C.struct_ibv_qp_attr
	a.qp_state = C.enum_ibv_qp_state(attr.State)
	a.cur_qp_state = C.enum_ibv_qp_state(attr.CurState)
	a.path_mtu = C.enum_ibv_mtu(attr.PathMTU)
	a.qkey = C.uint32_t(attr.QKey)
	a.rq_psn = C.uint32_t(attr.RQPSN)
	a.sq_psn = C.uint32_t(attr.SQPSN)
	a.dest_qp_num = C.uint32_t(attr.DestQPN)
	a.qp_access_flags = C.uint(attr.Access)
	a.cap = toCCap(attr.Cap)
	a.ah_attr = toCAH(&attr.AH)
	a.pkey_index = C.uint16_t(attr.PKeyIndex)
	a.max_rd_atomic = C.uint8_t(attr.MaxRDAtomic)
	a.max_dest_rd_atomic = C.uint8_t(attr.MaxDestRDAtom)
	a.min_rnr_timer = C.uint8_t(attr.MinRNRTimer)
	a.port_num = C.uint8_t(attr.Port)
	a.timeout = C.uint8_t(attr.Timeout)
	a.retry_cnt = C.uint8_t(attr.RetryCnt)
	a.rnr_retry = C.uint8_t(attr.RNRRetry)
	if rc := C.ibv_modify_qp(q.q.qp, &a, C.int(mask)); rc != 0 {
		err := errnoErr(modifyOp(q.qpn, attr.State, mask), rc)
		if mask&prov.AttrAV != 0 {
			err = gidIndexErr(err, syscall.Errno(rc), attr.AH.IsGlobal, attr.AH.SGIDIndex, attr.AH.Port)
		}
		return err
	}
	if mask&prov.AttrQKey != 0 {
		// For UD requests with a controlled Q_Key (see gv_qkey).
		atomic.StoreUint32((*uint32)(unsafe.Pointer(&q.q.qkey)), attr.QKey)
	}
	return nil
}

const queryMask = prov.AttrState | prov.AttrCurState | prov.AttrAccessFlags |
	prov.AttrPKeyIndex | prov.AttrPort | prov.AttrQKey | prov.AttrAV |
	prov.AttrPathMTU | prov.AttrTimeout | prov.AttrRetryCnt | prov.AttrRNRRetry |
	prov.AttrRQPSN | prov.AttrMaxQPRDAtomic | prov.AttrMinRNRTimer |
	prov.AttrSQPSN | prov.AttrMaxDestRDAtom | prov.AttrCap | prov.AttrDestQPN

func (q *queuePair) Query() (prov.QPAttr, prov.QPInitAttr, error) {
	var a C.struct_ibv_qp_attr
	var ia C.struct_ibv_qp_init_attr
	if rc := C.ibv_query_qp(q.q.qp, &a, C.int(queryMask), &ia); rc != 0 {
		return prov.QPAttr{}, prov.QPInitAttr{}, errnoErr("ibv_query_qp", rc)
	}
	attr := prov.QPAttr{
		State:         prov.QPState(a.qp_state),
		CurState:      prov.QPState(a.cur_qp_state),
		PathMTU:       prov.MTU(a.path_mtu),
		QKey:          uint32(a.qkey),
		RQPSN:         uint32(a.rq_psn),
		SQPSN:         uint32(a.sq_psn),
		DestQPN:       uint32(a.dest_qp_num),
		Access:        prov.Access(a.qp_access_flags),
		Cap:           fromCCap(a.cap),
		AH:            fromCAH(&a.ah_attr),
		PKeyIndex:     uint16(a.pkey_index),
		MaxRDAtomic:   uint8(a.max_rd_atomic),
		MaxDestRDAtom: uint8(a.max_dest_rd_atomic),
		MinRNRTimer:   uint8(a.min_rnr_timer),
		Port:          uint8(a.port_num),
		Timeout:       uint8(a.timeout),
		RetryCnt:      uint8(a.retry_cnt),
		RNRRetry:      uint8(a.rnr_retry),
	}
	init := q.init
	init.Cap = fromCCap(ia.cap)
	init.SignalAll = ia.sq_sig_all != 0
	return attr, init, nil
}

func (q *queuePair) Close() error {
	return q.closer.do(func() error {
		if rc := C.gv_destroy_qp(&q.q); rc != 0 {
			return errnoErr("ibv_destroy_qp", rc)
		}
		q.c.dropHandle(q.handle)
		return nil
	})
}
