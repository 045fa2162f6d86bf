//go:build ibverbs && linux && cgo

package ibv

/*
#include "shim.h"
#cgo noescape gv_post_srq_recv
#cgo nocallback gv_post_srq_recv
*/
import "C"

import (
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// protDomain is a PD (prov.PD).
type protDomain struct {
	c      *devContext
	pd     *C.struct_ibv_pd
	closer closer
}

func (pd *protDomain) Close() error {
	return pd.closer.do(func() error {
		if rc := C.ibv_dealloc_pd(pd.pd); rc != 0 {
			return errnoErr("ibv_dealloc_pd", rc)
		}
		return nil
	})
}

// memRegion is an MR (prov.MR).
type memRegion struct {
	mr     *C.struct_ibv_mr
	addr   uint64
	length int
	closer closer
}

func newMR(mr *C.struct_ibv_mr) *memRegion {
	return &memRegion{mr: mr, addr: uint64(uintptr(mr.addr)), length: int(mr.length)}
}

// RegMR registers m.Ptr..m.Ptr+m.Len. The caller keeps the memory valid
// (and pinned, if it is Go memory) until the MR is closed.
func (pd *protDomain) RegMR(m prov.Mem, access prov.Access) (prov.MR, error) {
	mr, err := C.gv_reg_mr(pd.pd, m.Ptr, C.size_t(m.Len), C.int(access))
	if mr == nil {
		return nil, wrapErr(fmt.Sprintf("ibv_reg_mr (%d bytes, access %#x)", m.Len, uint32(access)), err)
	}
	return newMR(mr), nil
}

func (pd *protDomain) RegDMABuf(offset uint64, length int, iova uint64, fd int, access prov.Access) (prov.MR, error) {
	mr, err := C.gv_reg_dmabuf_mr(pd.pd, C.uint64_t(offset), C.size_t(length), C.uint64_t(iova), C.int(fd), C.int(access))
	if mr == nil {
		return nil, wrapErr("ibv_reg_dmabuf_mr", err)
	}
	return newMR(mr), nil
}

func (m *memRegion) Addr() uint64 { return m.addr }
func (m *memRegion) Len() int     { return m.length }
func (m *memRegion) LKey() uint32 { return uint32(m.mr.lkey) }
func (m *memRegion) RKey() uint32 { return uint32(m.mr.rkey) }

func (m *memRegion) Close() error {
	return m.closer.do(func() error {
		if rc := C.ibv_dereg_mr(m.mr); rc != 0 {
			return errnoErr("ibv_dereg_mr", rc)
		}
		return nil
	})
}

// sharedRQ is an SRQ (prov.SRQ).
type sharedRQ struct {
	c      *devContext
	srq    *C.struct_ibv_srq
	handle uint64
	closer closer
}

func (pd *protDomain) CreateSRQ(attr prov.SRQAttr) (prov.SRQ, error) {
	if err := checkSRQAttr("ibv_create_srq", attr); err != nil {
		return nil, err
	}
	var ia C.struct_ibv_srq_init_attr
	ia.attr.max_wr = C.uint32_t(attr.MaxWR)
	ia.attr.max_sge = C.uint32_t(attr.MaxSGE)
	ia.attr.srq_limit = C.uint32_t(attr.SRQLimit)
	s := &sharedRQ{c: pd.c}
	s.handle = pd.c.addHandle(nil)
	srq, err := C.gv_create_srq(pd.pd, &ia, C.uint64_t(s.handle))
	if srq == nil {
		pd.c.dropHandle(s.handle)
		return nil, wrapErr("ibv_create_srq", err)
	}
	s.srq = srq
	pd.c.setHandle(s.handle, s)
	return s, nil
}

// PostRecv is one cgo call for the whole batch.
func (s *sharedRQ) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	var acc C.int
	countCall(callPostSRQRecv)
	rc := C.gv_post_srq_recv(s.srq, (*C.gv_recv_wr)(unsafe.Pointer(&wrs[0])), C.int(len(wrs)), sgePtr(sges), C.int(len(sges)), &acc)
	if rc != 0 {
		return int(acc), postErr("ibv_post_srq_recv", rc)
	}
	return len(wrs), nil
}

// Modify sets the limit (limitOnly) or resizes the SRQ and sets the limit.
func (s *sharedRQ) Modify(attr prov.SRQAttr, limitOnly bool) error {
	if limitOnly {
		attr.MaxWR, attr.MaxSGE = 0, 0 // not given to the device
	}
	if err := checkSRQAttr("ibv_modify_srq", attr); err != nil {
		return err
	}
	var a C.struct_ibv_srq_attr
	a.max_wr = C.uint32_t(attr.MaxWR)
	a.max_sge = C.uint32_t(attr.MaxSGE)
	a.srq_limit = C.uint32_t(attr.SRQLimit)
	mask := C.int(C.IBV_SRQ_LIMIT)
	if !limitOnly {
		mask |= C.IBV_SRQ_MAX_WR
	}
	if rc := C.ibv_modify_srq(s.srq, &a, mask); rc != 0 {
		return errnoErr("ibv_modify_srq", rc)
	}
	return nil
}

func (s *sharedRQ) Query() (prov.SRQAttr, error) {
	var a C.struct_ibv_srq_attr
	if rc := C.ibv_query_srq(s.srq, &a); rc != 0 {
		return prov.SRQAttr{}, errnoErr("ibv_query_srq", rc)
	}
	return prov.SRQAttr{MaxWR: int(a.max_wr), MaxSGE: int(a.max_sge), SRQLimit: int(a.srq_limit)}, nil
}

func (s *sharedRQ) Close() error {
	return s.closer.do(func() error {
		if rc := C.ibv_destroy_srq(s.srq); rc != 0 {
			return errnoErr("ibv_destroy_srq", rc)
		}
		s.c.dropHandle(s.handle)
		return nil
	})
}

// addrHandle is an AH (prov.AH). Handle is the struct ibv_ah pointer, which
// the shim casts back when it posts a UD send.
type addrHandle struct {
	ah     *C.struct_ibv_ah
	closer closer
}

func (pd *protDomain) CreateAH(attr prov.AHAttr) (prov.AH, error) {
	a := toCAH(&attr)
	ah, err := C.ibv_create_ah(pd.pd, &a)
	if ah == nil {
		var e syscall.Errno
		errors.As(err, &e)
		return nil, gidIndexErr(wrapErr("ibv_create_ah", err), e, attr.IsGlobal, attr.SGIDIndex, attr.Port)
	}
	return &addrHandle{ah: ah}, nil
}

func (a *addrHandle) Handle() uint64 { return uint64(uintptr(unsafe.Pointer(a.ah))) }

func (a *addrHandle) Close() error {
	return a.closer.do(func() error {
		if rc := C.ibv_destroy_ah(a.ah); rc != 0 {
			return errnoErr("ibv_destroy_ah", rc)
		}
		return nil
	})
}
