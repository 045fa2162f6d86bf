package verbs

import (
	"fmt"
	"sync"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// SRQSpec describes a shared receive queue. Zero values select defaults.
type SRQSpec struct {
	MaxWR  int // outstanding receives; default 1024
	MaxSGE int // SGEs per receive; default 4
	// Limit arms the low-watermark event: when fewer than Limit receives
	// remain posted, the device raises EventSRQLimitReached once. 0: unarmed.
	Limit int
}

// SharedReceiveQueue supplies receive buffers to many queue pairs. It is
// safe for concurrent use.
type SharedReceiveQueue struct {
	res   resource
	pd    *ProtectionDomain
	srq   prov.SRQ
	spec  SRQSpec
	mu    sync.Mutex
	oneR  [1]prov.RecvWR
	sgeR  []prov.SGE
	devNm string
	maxWR int // the device's max_srq_wr, 0 if unknown: see batchSize
}

// NewSharedReceiveQueue creates an SRQ.
func (pd *ProtectionDomain) NewSharedReceiveQueue(spec SRQSpec) (*SharedReceiveQueue, error) {
	if !pd.res.enter() {
		return nil, pd.res.errClosed("create srq")
	}
	defer pd.res.exit()
	dev, err := pd.c.QueryDevice()
	if err != nil {
		return nil, err
	}
	spec.MaxWR = orDefault(spec.MaxWR, 1024)
	spec.MaxSGE = orDefault(spec.MaxSGE, 4)
	if spec.Limit < 0 {
		return nil, opErr("create srq", pd.c.name, fmt.Errorf("%+v: negative limit: %w", spec, syscall.EINVAL))
	}
	ps, err := pd.pd.CreateSRQ(prov.SRQAttr{MaxWR: spec.MaxWR, MaxSGE: spec.MaxSGE, SRQLimit: spec.Limit})
	if err != nil {
		return nil, opErr("create srq", pd.c.name, fmt.Errorf("%+v: %w", spec, err))
	}
	if spec.Limit > 0 {
		// ibv_create_srq ignores srq_limit: arm it as ArmLimit does.
		if err := ps.Modify(prov.SRQAttr{SRQLimit: spec.Limit}, true); err != nil {
			ps.Close()
			return nil, opErr("create srq", pd.c.name, fmt.Errorf("%+v: arm limit: %w", spec, err))
		}
	}
	if got, err := ps.Query(); err == nil && got.MaxSGE > spec.MaxSGE {
		// The device may grant more than asked (soft0 one SGE for a
		// MaxSGE of -1, asked as 0): PostRecv takes what it granted,
		// as RecvBatch does. Before, PostRecv refused an SGE the queue
		// granted (TestSRQGrantedSGEs).
		spec.MaxSGE = got.MaxSGE
	}
	s := &SharedReceiveQueue{pd: pd, srq: ps, spec: spec, sgeR: make([]prov.SGE, spec.MaxSGE), devNm: pd.c.name, maxWR: dev.MaxSRQWR}
	if err := initResource(s, &s.res, "shared receive queue", "", &pd.res); err != nil {
		ps.Close()
		return nil, err
	}
	return s, nil
}

func (s *SharedReceiveQueue) check(op string) error {
	if s.res.isClosed() {
		return s.res.errClosed(op)
	}
	return nil
}

// PostRecv posts one receive buffer.
func (s *SharedReceiveQueue) PostRecv(wrid uint64, sgl ...SGE) error {
	if !s.res.enter() {
		return s.res.errClosed("post srq recv")
	}
	defer s.res.exit()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(sgl) > len(s.sgeR) {
		return opErr("post srq recv", s.devNm, fmt.Errorf("%d SGEs exceed max_sge %d: %w", len(sgl), len(s.sgeR), syscall.EINVAL))
	}
	for i, g := range sgl {
		s.sgeR[i] = prov.SGE(g)
	}
	s.oneR[0] = prov.RecvWR{WRID: wrid, NumSGE: uint32(len(sgl))}
	_, err := s.srq.PostRecv(s.oneR[:], s.sgeR)
	return opErr("post srq recv", s.devNm, err)
}

// ArmLimit sets the low-watermark (see SRQSpec.Limit) and arms its event.
func (s *SharedReceiveQueue) ArmLimit(limit int) error {
	if !s.res.enter() {
		return s.res.errClosed("modify srq")
	}
	defer s.res.exit()
	return opErr("modify srq", s.devNm, s.srq.Modify(prov.SRQAttr{SRQLimit: limit}, true))
}

// Query returns the SRQ's current MaxWR, MaxSGE and Limit.
func (s *SharedReceiveQueue) Query() (SRQSpec, error) {
	if !s.res.enter() {
		return SRQSpec{}, s.res.errClosed("query srq")
	}
	defer s.res.exit()
	a, err := s.srq.Query()
	if err != nil {
		return SRQSpec{}, opErr("query srq", s.devNm, err)
	}
	return SRQSpec{MaxWR: a.MaxWR, MaxSGE: a.MaxSGE, Limit: a.SRQLimit}, nil
}

// NewRecvBatch returns a batch of up to n receives (default 64) for the
// SRQ; an n above the device's max_srq_wr counts as max_srq_wr.
func (s *SharedReceiveQueue) NewRecvBatch(n int) *RecvBatch {
	b := newRecvBatch(s.srq, n, s.maxWR, s.spec.MaxSGE, s.devNm)
	b.res = &s.res
	return b
}

// Close destroys the SRQ. It fails while QPs use it. Idempotent.
func (s *SharedReceiveQueue) Close() error {
	return s.res.close(func() error { return opErr("destroy srq", s.devNm, s.srq.Close()) })
}

// AddressHandle names a remote port for UD sends. Safe for concurrent use.
type AddressHandle struct {
	res resource
	pd  *ProtectionDomain
	ah  prov.AH

	// use is held for reading (TryRLock, never blocking) by every post
	// that names the AH, and for writing by Close, which therefore waits
	// for those posts and makes later ones fail (dead): a provider never
	// gets a destroyed AH.
	use  sync.RWMutex
	dead bool
}

// acquire holds the AH open for a post; it fails if the AH is closed or
// being closed.
func (a *AddressHandle) acquire() bool {
	if !a.use.TryRLock() {
		return false
	}
	if a.dead {
		a.use.RUnlock()
		return false
	}
	return true
}

func (a *AddressHandle) release() { a.use.RUnlock() }

var errAHOtherPD = fmt.Errorf("the destination's address handle belongs to another protection domain than the queue pair: %w", syscall.EINVAL)

// checkDest checks that to names an address handle of the protection
// domain pd that is open.
func checkDest(pd *ProtectionDomain, to Destination) error {
	switch {
	case to.AH == nil:
		return errNoAH
	case to.AH.pd != pd:
		return errAHOtherPD
	case to.AH.res.isClosed():
		return to.AH.errClosed()
	}
	return nil
}

func (a *AddressHandle) errClosed() error {
	return fmt.Errorf("destination's %s is closed: %w", a.res.n, ErrClosed)
}

// NewAddressHandle creates an address handle from an address vector.
func (pd *ProtectionDomain) NewAddressHandle(attr AHAttr) (*AddressHandle, error) {
	if !pd.res.enter() {
		return nil, pd.res.errClosed("create ah")
	}
	defer pd.res.exit()
	if attr.Port == 0 {
		attr.Port = 1
	}
	pa, err := pd.pd.CreateAH(attr.prov())
	if err != nil {
		return nil, opErr("create ah", pd.c.name, err)
	}
	a := &AddressHandle{pd: pd, ah: pa}
	if err := initResource(a, &a.res, "address handle", attr.DGID.String(), &pd.res); err != nil {
		pa.Close()
		return nil, err
	}
	return a, nil
}

// AddressHandleTo creates an address handle that reaches the port of the
// remote endpoint, addressed from q (its port and source GID).
func (q *UDQueuePair) AddressHandleTo(remote Endpoint) (*AddressHandle, error) {
	if !q.res.enter() {
		return nil, q.res.errClosed("create ah")
	}
	defer q.res.exit()
	if err := remote.Validate(); err != nil {
		return nil, opErr("create ah", q.devNm, fmt.Errorf("%w: %w", err, syscall.EINVAL))
	}
	attr, err := q.addressTo(remote, ConnectOptions{})
	if err != nil {
		return nil, opErr("create ah", q.devNm, err)
	}
	return q.pd.NewAddressHandle(attr)
}

// Close destroys the address handle. Idempotent.
func (a *AddressHandle) Close() error {
	return a.res.close(func() error {
		a.use.Lock()
		defer a.use.Unlock()
		if err := a.ah.Close(); err != nil {
			return opErr("destroy ah", a.pd.c.name, err)
		}
		a.dead = true
		return nil
	})
}
