package soft

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// pd is a protection domain.
type pd struct {
	ctx *devContext

	mu   sync.Mutex // children counts vs Close
	nmr  int
	nqp  int
	nsrq int
	nah  int
	dead bool
}

var _ prov.PD = (*pd)(nil)

func (p *pd) hold(n *int, op string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead {
		return closedErr(op)
	}
	*n++
	return nil
}

func (p *pd) release(n *int) {
	p.mu.Lock()
	*n--
	p.mu.Unlock()
}

const validMRAccess = prov.AccessLocalWrite | prov.AccessRemoteWrite | prov.AccessRemoteRead |
	prov.AccessRemoteAtomic | prov.AccessMWBind | prov.AccessRelaxedOrder

// RegMR registers m. Like ibv_reg_mr, remote write or atomic access
// requires local write access. The region's address (iova) is the virtual
// address of m.Ptr.
func (p *pd) RegMR(m prov.Mem, access prov.Access) (prov.MR, error) {
	if m.Len < 0 || (m.Ptr == nil && m.Len > 0) {
		return nil, errnof(syscall.EINVAL, "register mr: invalid memory (%d bytes at %p)", m.Len, m.Ptr)
	}
	if access&(prov.AccessZeroBased|prov.AccessOnDemand) != 0 {
		return nil, fmt.Errorf("soft: register mr: zero-based and on-demand-paging regions: %w", prov.ErrNotSupported)
	}
	if access&^validMRAccess != 0 {
		return nil, errnof(syscall.EINVAL, "register mr: unknown access flags %#x", uint32(access&^validMRAccess))
	}
	if access&(prov.AccessRemoteWrite|prov.AccessRemoteAtomic) != 0 && access&prov.AccessLocalWrite == 0 {
		return nil, errnof(syscall.EINVAL, "register mr: remote write or remote atomic access requires local write access")
	}
	if err := checkMapped(m.Ptr, m.Len, access&prov.AccessLocalWrite != 0); err != nil {
		return nil, err
	}
	if err := p.hold(&p.nmr, "register mr"); err != nil {
		return nil, err
	}
	r := &mr{
		pd:     p,
		base:   m.Ptr,
		addr:   uint64(uintptr(m.Ptr)),
		length: uint64(m.Len),
		access: access,
		fd:     m.FD,
		off:    m.Offset,
	}
	r.live.Store(newClaim())
	if err := p.ctx.f.addMR(r); err != nil {
		p.release(&p.nmr)
		return nil, err
	}
	return r, nil
}

func (p *pd) RegDMABuf(offset uint64, length int, iova uint64, fd int, access prov.Access) (prov.MR, error) {
	return nil, fmt.Errorf("soft: register dma-buf: the software device has no device memory to import a dma-buf into; register host memory instead: %w", prov.ErrNotSupported)
}

func (p *pd) CreateQP(attr prov.QPInitAttr) (prov.QP, error) {
	q, err := newQP(p, attr)
	if err != nil {
		return nil, err // not a QP holding a nil *qp
	}
	return q, nil
}

func (p *pd) CreateSRQ(attr prov.SRQAttr) (prov.SRQ, error) {
	return newSRQ(p, attr)
}

// CreateAH creates an address handle. As on RoCE, the GRH (IsGlobal) is
// required. The destination is resolved now; an unreachable destination
// is not an error (sends to it are dropped), a malformed provider address
// is (EINVAL).
func (p *pd) CreateAH(attr prov.AHAttr) (prov.AH, error) {
	f := p.ctx.f
	if err := checkAV(&attr, "create ah"); err != nil {
		return nil, err
	}
	l, _, err := f.resolve(attr.DGID, attr.IsGlobal, attr.DLID, attr.ProviderAddr)
	if err != nil {
		return nil, fmt.Errorf("soft: create ah: %w", err)
	}
	if err := p.hold(&p.nah, "create ah"); err != nil {
		return nil, err
	}
	a := &ah{pd: p, attr: attr}
	a.attr.ProviderAddr = append([]byte(nil), attr.ProviderAddr...)
	a.dest = udDest{l: l, dgid: attr.DGID, sgid: f.gids[attr.SGIDIndex], tclass: attr.TrafficClass,
		hopLimit: attr.HopLimit, flow: attr.FlowLabel}
	if err := f.addAH(a); err != nil {
		p.release(&p.nah)
		return nil, err
	}
	return a, nil
}

// checkAV validates an address vector for the Ethernet port.
func checkAV(a *prov.AHAttr, op string) error {
	if !a.IsGlobal {
		if infiniBand() { // ForceInfiniBand: routed by LID
			return checkLIDRoute(a, op)
		}
		return errnof(syscall.EINVAL, "%s: the port's link layer is Ethernet (RoCE): the address needs a GRH (IsGlobal)", op)
	}
	if int(a.SGIDIndex) >= numGIDs {
		return errnof(syscall.EINVAL, "%s: source GID index %d (the table has %d entries)", op, a.SGIDIndex, numGIDs)
	}
	if infiniBand() && a.SGIDIndex != 0 {
		return errnof(syscall.EINVAL, "%s: source GID index %d (the InfiniBand port's table has 1 entry)", op, a.SGIDIndex)
	}
	if a.Port > 1 {
		return errnof(syscall.EINVAL, "%s: port %d (the device has port 1)", op, a.Port)
	}
	return nil
}

// Close deallocates the PD; it fails with EBUSY while objects use it.
func (p *pd) Close() error {
	p.mu.Lock()
	if p.dead {
		p.mu.Unlock()
		return nil
	}
	if n := p.nmr + p.nqp + p.nsrq + p.nah; n > 0 {
		err := busyErr("dealloc pd", n, fmt.Sprintf("objects (%d MRs, %d QPs, %d SRQs, %d AHs)", p.nmr, p.nqp, p.nsrq, p.nah))
		p.mu.Unlock()
		return err
	}
	p.dead = true
	p.mu.Unlock()
	p.ctx.release(&p.ctx.npd)
	return nil
}

// udDest is a resolved UD destination (from an address handle).
type udDest struct {
	l        link // nil: unreachable
	dgid     [16]byte
	sgid     [16]byte
	tclass   uint8
	hopLimit uint8
	flow     uint32
}

// ah is an address handle.
type ah struct {
	pd     *pd
	handle uint64
	attr   prov.AHAttr
	dest   udDest
	closed atomic.Bool
}

func (a *ah) Handle() uint64 { return a.handle }

func (a *ah) Close() error {
	if !a.closed.CompareAndSwap(false, true) {
		return nil
	}
	a.pd.ctx.f.removeAH(a)
	a.pd.release(&a.pd.nah)
	return nil
}
