package soft

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/goverbs/verbs/internal/prov"
)

// recvQueue is a ring of receive work requests (a QP's RQ or an SRQ).
type recvQueue struct {
	// The ring grows (grow) as receives are posted, up to depth: a QP
	// may never have more than a few receives posted (a rank of a large
	// world has a QP to every other rank, each with a few doorbell
	// receives), and a ring of the usual depth is kilobytes.
	slots  []recvSlot
	sges   []prov.SGE // len(slots) * maxSGE
	depth  int        // the most receives the queue holds (max_wr)
	maxSGE int
	head   int
	count  int
}

type recvSlot struct {
	wrid uint64
	nsge int
}

// recvRingMin is the length of a receive ring when it is first made.
const recvRingMin = 4

func (q *recvQueue) init(depth, maxSGE int) {
	*q = recvQueue{depth: depth, maxSGE: maxSGE}
}

func (q *recvQueue) full() bool { return q.count >= q.depth }

// push queues a receive; the queue must not be full.
func (q *recvQueue) push(wr *prov.RecvWR, sges []prov.SGE) {
	if q.count == len(q.slots) {
		q.relayout(min(q.depth, max(recvRingMin, 2*len(q.slots))))
	}
	i := q.head + q.count
	if i >= len(q.slots) {
		i -= len(q.slots)
	}
	q.slots[i] = recvSlot{wrid: wr.WRID, nsge: int(wr.NumSGE)}
	copy(q.sges[i*q.maxSGE:], sges[wr.SGEIndex:wr.SGEIndex+wr.NumSGE])
	q.count++
}

// front returns the oldest receive; the SGE slice aliases the queue.
func (q *recvQueue) front() (uint64, []prov.SGE) {
	s := &q.slots[q.head]
	b := q.head * q.maxSGE
	return s.wrid, q.sges[b : b+s.nsge : b+s.nsge]
}

func (q *recvQueue) pop() {
	q.head++
	if q.head == len(q.slots) {
		q.head = 0
	}
	q.count--
}

// unpop puts a receive back at the head (the oldest again), as pop took
// it; the queue must not be full.
func (q *recvQueue) unpop(wrid uint64, sges []prov.SGE) {
	if q.count == len(q.slots) {
		q.relayout(min(q.depth, max(recvRingMin, 2*len(q.slots))))
	}
	if q.head--; q.head < 0 {
		q.head = len(q.slots) - 1
	}
	q.slots[q.head] = recvSlot{wrid: wrid, nsge: len(sges)}
	copy(q.sges[q.head*q.maxSGE:], sges)
	q.count++
}

func (q *recvQueue) reset() { q.head, q.count = 0, 0 }

// resize changes the depth, keeping the queued requests (depth >= count).
func (q *recvQueue) resize(depth int) {
	q.depth = depth
	if len(q.slots) > depth {
		q.relayout(depth)
	}
}

// relayout moves the queued receives, oldest first, into a new ring of n
// slots (n >= count).
func (q *recvQueue) relayout(n int) {
	slots := make([]recvSlot, n)
	sges := make([]prov.SGE, n*q.maxSGE)
	for k := range q.count {
		i := (q.head + k) % len(q.slots)
		slots[k] = q.slots[i]
		copy(sges[k*q.maxSGE:(k+1)*q.maxSGE], q.sges[i*q.maxSGE:])
	}
	q.slots, q.sges, q.head = slots, sges, 0
}

// checkRecvWR validates one receive work request against the queue's SGE
// limit and the SGE slice.
func checkRecvWR(wr *prov.RecvWR, sges []prov.SGE, maxSGE int) error {
	if int(wr.NumSGE) > maxSGE {
		return errnof(einval, "post recv: %d SGEs, the queue allows %d", wr.NumSGE, maxSGE)
	}
	if uint64(wr.SGEIndex)+uint64(wr.NumSGE) > uint64(len(sges)) {
		return errSGERange
	}
	return nil
}

// srq is a shared receive queue.
type srq struct {
	pd  *pd
	ctx *devContext

	mu      sync.Mutex
	q       recvQueue
	limit   int // armed limit; 0 = disarmed
	waiters []waker
	users   int
	closed  atomic.Bool
	dead    bool
}

var _ prov.SRQ = (*srq)(nil)

func newSRQ(p *pd, attr prov.SRQAttr) (*srq, error) {
	if attr.MaxWR < 1 || attr.MaxWR > maxQPWR {
		return nil, errnof(einval, "create srq: max_wr %d (1..%d)", attr.MaxWR, maxQPWR)
	}
	if attr.MaxSGE < 0 || attr.MaxSGE > maxSGE {
		return nil, errnof(einval, "create srq: max_sge %d (1..%d)", attr.MaxSGE, maxSGE)
	}
	if err := p.hold(&p.nsrq, "create srq"); err != nil {
		return nil, err
	}
	s := &srq{pd: p, ctx: p.ctx}
	s.q.init(attr.MaxWR, max(attr.MaxSGE, 1))
	return s, nil
}

// PostRecv posts receives to the SRQ.
func (s *srq) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return 0, errPostRecvClosed
	}
	n := 0
	var err error
	for i := range wrs {
		wr := &wrs[i]
		if err = checkRecvWR(wr, sges, s.q.maxSGE); err != nil {
			break
		}
		if s.q.full() {
			err = queueFullErr(fmt.Sprintf("soft: post srq recv: shared receive queue full (max_wr %d)", s.q.depth))
			break
		}
		s.q.push(wr, sges)
		n++
	}
	wake := n > 0 && len(s.waiters) > 0
	var ws []waker
	if wake {
		ws, s.waiters = s.waiters, nil
	}
	s.mu.Unlock()
	for _, w := range ws {
		w.wake()
	}
	return n, err
}

// take removes the oldest receive, copying its SGEs into buf. If the SRQ is
// empty it registers w (if not nil) to be woken by the next post.
func (s *srq) take(buf []prov.SGE, w waker) (wrid uint64, sges []prov.SGE, ok bool) {
	s.mu.Lock()
	if s.q.count == 0 || s.dead {
		if w != nil && !s.dead {
			s.waiters = addWaiter(s.waiters, w)
		}
		s.mu.Unlock()
		return 0, nil, false
	}
	wrid, q := s.q.front()
	n := copy(buf, q)
	s.q.pop()
	fire := s.limit > 0 && s.q.count < s.limit
	if fire {
		s.limit = 0
	}
	s.mu.Unlock()
	if fire {
		s.ctx.events.Push(prov.AsyncEvent{Type: evSRQLimit, Element: prov.SRQ(s)})
	}
	return wrid, buf[:n], true
}

// giveBack returns a receive that take gave for a message that did not
// consume it (a pulled payload its requester let go of, cma.go) to the
// front of the queue; it reports false if the SRQ is gone or full (posts
// since filled it), leaving the receive to the caller.
func (s *srq) giveBack(wrid uint64, sges []prov.SGE) bool {
	s.mu.Lock()
	if s.dead || s.q.full() {
		s.mu.Unlock()
		return false
	}
	s.q.unpop(wrid, sges)
	ws := s.waiters
	s.waiters = nil
	s.mu.Unlock()
	for _, w := range ws {
		w.wake()
	}
	return true
}

// Modify arms the limit event (limitOnly) or also resizes the queue to
// attr.MaxWR.
func (s *srq) Modify(attr prov.SRQAttr, limitOnly bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return closedErr("modify srq")
	}
	depth := s.q.depth
	if !limitOnly {
		if attr.MaxWR < 1 || attr.MaxWR > maxQPWR {
			return errnof(einval, "modify srq: max_wr %d (1..%d)", attr.MaxWR, maxQPWR)
		}
		if attr.MaxWR < s.q.count {
			return errnof(einval, "modify srq: max_wr %d is below the %d receives posted", attr.MaxWR, s.q.count)
		}
		depth = attr.MaxWR
	}
	if attr.SRQLimit < 0 || attr.SRQLimit > depth {
		return errnof(einval, "modify srq: limit %d above max_wr %d", attr.SRQLimit, depth)
	}
	if depth != s.q.depth {
		s.q.resize(depth)
	}
	s.limit = attr.SRQLimit
	return nil
}

func (s *srq) Query() (prov.SRQAttr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return prov.SRQAttr{}, closedErr("query srq")
	}
	return prov.SRQAttr{MaxWR: s.q.depth, MaxSGE: s.q.maxSGE, SRQLimit: s.limit}, nil
}

func (s *srq) use() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return closedErr("create qp: shared receive queue")
	}
	s.users++
	return nil
}

func (s *srq) unuse() {
	s.mu.Lock()
	s.users--
	s.mu.Unlock()
}

// Close destroys the SRQ; it fails with EBUSY while QPs use it.
func (s *srq) Close() error {
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return nil
	}
	if s.users > 0 {
		err := busyErr("destroy srq", s.users, "queue pairs")
		s.mu.Unlock()
		return err
	}
	s.dead = true
	s.closed.Store(true)
	s.q.reset()
	ws := s.waiters
	s.waiters = nil
	s.mu.Unlock()
	for _, w := range ws {
		w.wake()
	}
	s.pd.release(&s.pd.nsrq)
	return nil
}

// addWaiter adds w to ws unless present.
func addWaiter(ws []waker, w waker) []waker {
	for _, x := range ws {
		if x == w {
			return ws
		}
	}
	return append(ws, w)
}
