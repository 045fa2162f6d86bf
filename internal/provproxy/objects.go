package provproxy

import (
	"context"
	"fmt"
	"sync"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// The objects of the client side. Each is a server object id; every
// method is one call to the server, except the constant properties
// (QPN, MR keys, CQ capacity, AH handle), which the creating call
// returned.

// errnof returns an error "provproxy: <msg>: <errno>" that wraps errno.
func errnof(errno syscall.Errno, format string, args ...any) error {
	return fmt.Errorf("provproxy: "+format+": %w", append(args, errno)...)
}

var errSGERange = errnof(syscall.EINVAL, "post: work request's SGE range lies outside the SGE slice")

type devContext struct{ obj }

var _ prov.Context = (*devContext)(nil)

func (x *devContext) QueryDevice() (prov.DeviceAttr, error) {
	var r deviceResp
	err := x.c.call(context.Background(), opQueryDevice, idReq{ID: x.id}, &r)
	return r.Attr, err
}

func (x *devContext) QueryPort(port uint8) (prov.PortAttr, error) {
	var r portResp
	err := x.c.call(context.Background(), opQueryPort, portReq{ID: x.id, Port: port}, &r)
	return r.Attr, err
}

func (x *devContext) QueryGIDTable(port uint8) ([]prov.GIDEntry, error) {
	var r gidResp
	err := x.c.call(context.Background(), opQueryGIDTable, portReq{ID: x.id, Port: port}, &r)
	return r.Entries, err
}

func (x *devContext) AllocPD() (prov.PD, error) {
	var r idResp
	if err := x.c.call(context.Background(), opAllocPD, idReq{ID: x.id}, &r); err != nil {
		return nil, err
	}
	p := &pd{obj: obj{c: x.c, id: r.ID}}
	x.c.register(r.ID, p)
	return p, nil
}

func (x *devContext) CreateCompChannel() (prov.CompChannel, error) {
	var r idResp
	if err := x.c.call(context.Background(), opCreateCompChannel, idReq{ID: x.id}, &r); err != nil {
		return nil, err
	}
	ch := &compChannel{obj: obj{c: x.c, id: r.ID}}
	x.c.register(r.ID, ch)
	return ch, nil
}

func (x *devContext) CreateCQ(cqe int, ch prov.CompChannel, vector int) (prov.CQ, error) {
	req := createCQReq{Ctx: x.id, CQE: int64(cqe), Vector: int64(vector)}
	if ch != nil {
		pch, ok := ch.(*compChannel)
		if !ok || pch.c != x.c {
			return nil, errnof(syscall.EINVAL, "create cq: completion channel of another provider or peer process (%T)", ch)
		}
		req.Channel = pch.id
	}
	var r createCQResp
	if err := x.c.call(context.Background(), opCreateCQ, req, &r); err != nil {
		return nil, err
	}
	q := &cq{obj: obj{c: x.c, id: r.ID}, cap: int(r.Cap)}
	x.c.register(r.ID, q)
	return q, nil
}

// AsyncEvent waits in the server; when ctx ends, the server's wait is
// cancelled.
func (x *devContext) AsyncEvent(ctx context.Context) (prov.AsyncEvent, error) {
	var r asyncEventResp
	if err := x.c.call(ctx, opAsyncEvent, idReq{ID: x.id}, &r); err != nil {
		return prov.AsyncEvent{}, err
	}
	ev := prov.AsyncEvent{Type: r.Type, QPN: r.QPN, Port: r.Port}
	// Element is the object of this side, if it is still open.
	switch o := x.c.object(r.Elem).(type) {
	case *qp:
		ev.Element = prov.QP(o)
	case *cq:
		ev.Element = prov.CQ(o)
	case *srq:
		ev.Element = prov.SRQ(o)
	}
	return ev, nil
}

func (x *devContext) Close() error { return x.close() }

type pd struct{ obj }

var _ prov.PD = (*pd)(nil)

// RegMR registers memory that has a file descriptor: the server maps it
// (MAP_SHARED), so both processes see the same pages. Memory without
// one cannot be shared and is refused.
func (p *pd) RegMR(m prov.Mem, access prov.Access) (prov.MR, error) {
	if m.FD < 0 {
		return nil, fmt.Errorf("provproxy: register mr: %d bytes at %p have no file descriptor (Go memory, from Register): "+
			"the peer process that holds the device cannot map them; allocate the memory with Alloc instead: %w", m.Len, m.Ptr, prov.ErrNotSupported)
	}
	if m.Len <= 0 || m.Offset < 0 {
		return nil, errnof(syscall.EINVAL, "register mr: %d bytes at offset %d", m.Len, m.Offset)
	}
	var r regMRResp
	if err := p.c.call(context.Background(), opRegMR, regMRReq{PD: p.id, Len: int64(m.Len), Offset: m.Offset, Access: uint32(access)}, &r, m.FD); err != nil {
		return nil, err
	}
	x := &mr{obj: obj{c: p.c, id: r.ID}, addr: r.Addr, n: int(r.Len), lkey: r.LKey, rkey: r.RKey}
	p.c.register(r.ID, x)
	return x, nil
}

func (p *pd) RegDMABuf(offset uint64, length int, iova uint64, fd int, access prov.Access) (prov.MR, error) {
	return nil, fmt.Errorf("provproxy: register dma-buf: device memory is not forwarded to the peer process: %w", prov.ErrNotSupported)
}

// cqID returns the server id of v, a CQ of this client (0 for nil).
func (c *Client) cqID(v prov.CQ, what string) (uint64, error) {
	if v == nil {
		return 0, nil
	}
	if q, ok := v.(*cq); ok && q != nil && q.c == c {
		return q.id, nil
	}
	return 0, errnof(syscall.EINVAL, "%s of another provider or peer process (%T)", what, v)
}

// srqID returns the server id of v, an SRQ of this client (0 for nil).
func (c *Client) srqID(v prov.SRQ, what string) (uint64, error) {
	if v == nil {
		return 0, nil
	}
	if s, ok := v.(*srq); ok && s != nil && s.c == c {
		return s.id, nil
	}
	return 0, errnof(syscall.EINVAL, "%s of another provider or peer process (%T)", what, v)
}

func (p *pd) CreateQP(attr prov.QPInitAttr) (prov.QP, error) {
	req := createQPReq{PD: p.id, Type: uint32(attr.Type), Cap: attr.Cap, SignalAll: attr.SignalAll}
	var err error
	if req.SendCQ, err = p.c.cqID(attr.SendCQ, "create qp: send cq"); err != nil {
		return nil, err
	}
	if req.RecvCQ, err = p.c.cqID(attr.RecvCQ, "create qp: receive cq"); err != nil {
		return nil, err
	}
	if req.SRQ, err = p.c.srqID(attr.SRQ, "create qp: srq"); err != nil {
		return nil, err
	}
	var r createQPResp
	if err := p.c.call(context.Background(), opCreateQP, req, &r); err != nil {
		return nil, err
	}
	q := &qp{obj: obj{c: p.c, id: r.ID}, qpn: r.QPN}
	p.c.register(r.ID, q)
	return q, nil
}

func (p *pd) CreateSRQ(attr prov.SRQAttr) (prov.SRQ, error) {
	var r idResp
	if err := p.c.call(context.Background(), opCreateSRQ, createSRQReq{PD: p.id, Attr: attr}, &r); err != nil {
		return nil, err
	}
	s := &srq{obj: obj{c: p.c, id: r.ID}}
	p.c.register(r.ID, s)
	return s, nil
}

func (p *pd) CreateAH(attr prov.AHAttr) (prov.AH, error) {
	var r idResp
	if err := p.c.call(context.Background(), opCreateAH, createAHReq{PD: p.id, Attr: attr}, &r); err != nil {
		return nil, err
	}
	a := &ah{obj: obj{c: p.c, id: r.ID}}
	p.c.register(r.ID, a)
	return a, nil
}

func (p *pd) Close() error { return p.close() }

// mr is a registered region. Its address and keys are the server's: work
// requests and remote peers name the memory by them.
type mr struct {
	obj
	addr       uint64
	n          int
	lkey, rkey uint32
}

var _ prov.MR = (*mr)(nil)

func (m *mr) Addr() uint64 { return m.addr }
func (m *mr) Len() int     { return m.n }
func (m *mr) LKey() uint32 { return m.lkey }
func (m *mr) RKey() uint32 { return m.rkey }

// Close deregisters the region and makes the server unmap it; this
// side's mapping is its owner's to free.
func (m *mr) Close() error { return m.close() }

type compChannel struct{ obj }

var _ prov.CompChannel = (*compChannel)(nil)

// Wait waits in the server; when ctx ends, the server's wait is
// cancelled.
func (ch *compChannel) Wait(ctx context.Context) (prov.CQ, error) {
	var r chanWaitResp
	if err := ch.c.call(ctx, opChanWait, idReq{ID: ch.id}, &r); err != nil {
		return nil, err
	}
	q, ok := ch.c.object(r.CQ).(*cq)
	if !ok {
		return nil, fmt.Errorf("provproxy: wait for completion event: event for cq %d, which is not open", r.CQ)
	}
	return q, nil
}

// Wake wakes the server's Wait (through a request of its own: the
// server runs requests concurrently).
func (ch *compChannel) Wake() {
	ch.c.call(context.Background(), opChanWake, idReq{ID: ch.id}, &empty{})
}

func (ch *compChannel) Close() error { return ch.close() }

type cq struct {
	obj
	cap int
}

var _ prov.CQ = (*cq)(nil)

// Poll returns at most maxPoll completions per call.
func (q *cq) Poll(dst []prov.Completion) (int, error) { return q.poll(dst, 0) }

// PollBusy spins in the server.
func (q *cq) PollBusy(dst []prov.Completion, spins int) (int, error) {
	return q.poll(dst, max(spins, 1))
}

func (q *cq) poll(dst []prov.Completion, spins int) (int, error) {
	n := min(len(dst), maxPoll)
	if n == 0 {
		return 0, nil
	}
	var r pollResp
	err := q.c.call(context.Background(), opPoll, pollReq{CQ: q.id, Max: int64(n), Spins: int64(spins)}, &r)
	if len(r.WCs) > n {
		return 0, fmt.Errorf("provproxy: poll cq: %w: %d completions for a poll of %d", errMalformed, len(r.WCs), n)
	}
	return copy(dst, r.WCs), err
}

func (q *cq) Arm(solicitedOnly bool) error {
	return q.c.call(context.Background(), opArm, armReq{CQ: q.id, Solicited: solicitedOnly}, &empty{})
}

func (q *cq) Cap() int     { return q.cap }
func (q *cq) Close() error { return q.close() }

type qp struct {
	obj
	qpn uint32

	smu, rmu sync.Mutex // posts, so that split posts stay in order

	addrMu sync.Mutex
	addr   []byte
}

var _ prov.QP = (*qp)(nil)

func (q *qp) QPN() uint32 { return q.qpn }

func (q *qp) Modify(attr *prov.QPAttr, mask prov.QPAttrMask) error {
	if attr == nil {
		return errnof(syscall.EINVAL, "modify qp: nil attributes")
	}
	return q.c.call(context.Background(), opModifyQP, modifyQPReq{QP: q.id, Attr: *attr, Mask: uint32(mask)}, &empty{})
}

func (q *qp) Query() (prov.QPAttr, prov.QPInitAttr, error) {
	var r queryQPResp
	if err := q.c.call(context.Background(), opQueryQP, idReq{ID: q.id}, &r); err != nil {
		return prov.QPAttr{}, prov.QPInitAttr{}, err
	}
	ia := prov.QPInitAttr{Type: prov.QPType(r.Type), Cap: r.Cap, SignalAll: r.SignalAll}
	if c, ok := q.c.object(r.SendCQ).(*cq); ok {
		ia.SendCQ = c
	}
	if c, ok := q.c.object(r.RecvCQ).(*cq); ok {
		ia.RecvCQ = c
	}
	if s, ok := q.c.object(r.SRQ).(*srq); ok {
		ia.SRQ = s
	}
	return r.Attr, ia, nil
}

// Address returns the server's provider address, which names the peer
// process (asked once, then remembered; nil if the call failed).
func (q *qp) Address() []byte {
	q.addrMu.Lock()
	defer q.addrMu.Unlock()
	if q.addr == nil {
		var r addressResp
		if err := q.c.call(context.Background(), opQPAddress, idReq{ID: q.id}, &r); err != nil {
			return nil
		}
		q.addr = r.Addr
	}
	return append([]byte(nil), q.addr...)
}

var _ prov.Linker = (*qp)(nil)

// Link returns what carries the traffic of the server's QP (prov.Linker),
// or "" if the call failed.
func (q *qp) Link() string {
	var r linkResp
	if err := q.c.call(context.Background(), opQPLink, idReq{ID: q.id}, &r); err != nil {
		return ""
	}
	return r.Link
}

// PostSend posts wrs with as few calls as fit in messages (all of them
// at once, unless the batch is very large). The SGEs of inline requests
// must lie in memory registered through this client's context: the
// server refuses others (EINVAL). The AH of a UD request is the Handle
// of an AH of this client.
func (q *qp) PostSend(wrs []prov.SendWR, sges []prov.SGE) (int, error) {
	q.smu.Lock()
	defer q.smu.Unlock()
	return postAll(&q.obj, opPostSend, wrs, sges, sendWRSize, func() (any, func(prov.SendWR, []prov.SGE)) {
		req := &postSendReq{QP: q.id}
		return req, func(wr prov.SendWR, sgl []prov.SGE) {
			wr.SGEIndex = uint32(len(req.SGEs))
			req.SGEs = append(req.SGEs, sgl...)
			req.WRs = append(req.WRs, wr)
		}
	})
}

func (q *qp) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	q.rmu.Lock()
	defer q.rmu.Unlock()
	return postRecv(&q.obj, opPostRecv, wrs, sges)
}

func (q *qp) Close() error { return q.close() }

// post sends a post request holding k work requests and checks the
// answer.
func (o *obj) post(op opcode, req any, k int) (int, error) {
	if k == 0 {
		return 0, nil
	}
	var r postResp
	err := o.c.call(context.Background(), op, req, &r)
	n := int(r.N)
	if n < 0 || n > k {
		return 0, fmt.Errorf("provproxy: %s: %w: %d of %d requests accepted", op, errMalformed, r.N, k)
	}
	if err == nil && n < k {
		err = fmt.Errorf("provproxy: %s: %w: %d of %d requests accepted, without an error", op, errMalformed, n, k)
	}
	return n, err
}

// split adds the longest prefix of wrs that fits in one message with add,
// each request with its SGEs, and returns its length. bad is the error
// of the request after the prefix, if that one is invalid (its SGE range
// lies outside sges, or it alone does not fit in a message).
func split[W prov.SendWR | prov.RecvWR](wrs []W, sges []prov.SGE, wrSize int, add func(W, []prov.SGE)) (k int, bad error) {
	size := 0
	for _, wr := range wrs {
		var idx, num uint32
		switch w := any(wr).(type) {
		case prov.SendWR:
			idx, num = w.SGEIndex, w.NumSGE
		case prov.RecvWR:
			idx, num = w.SGEIndex, w.NumSGE
		}
		if uint64(idx)+uint64(num) > uint64(len(sges)) {
			return k, errSGERange
		}
		sz := wrSize + int(num)*sgeSize
		if sz > maxPostBytes {
			return k, errnof(syscall.EINVAL, "post: a work request with %d SGEs", num)
		}
		if size+sz > maxPostBytes {
			return k, nil
		}
		size += sz
		add(wr, sges[idx:idx+num])
		k++
	}
	return k, nil
}

// postAll posts wrs through o in as few messages as fit (split): for each
// message, next returns a new request and the function that adds a work
// request with its SGEs to it. It returns how many the server accepted;
// the error is that of the first message that failed, or of the first
// work request that cannot be sent.
func postAll[W prov.SendWR | prov.RecvWR](o *obj, op opcode, wrs []W, sges []prov.SGE, wrSize int, next func() (req any, add func(W, []prov.SGE))) (int, error) {
	posted := 0
	for posted < len(wrs) {
		req, add := next()
		k, bad := split(wrs[posted:], sges, wrSize, add)
		n, err := o.post(op, req, k)
		posted += n
		if err != nil {
			return posted, err
		}
		if bad != nil {
			return posted, bad
		}
	}
	return posted, nil
}

// postRecv posts receives to the QP or SRQ o (op says which).
func postRecv(o *obj, op opcode, wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	return postAll(o, op, wrs, sges, recvWRSize, func() (any, func(prov.RecvWR, []prov.SGE)) {
		req := &postRecvReq{ID: o.id}
		return req, func(wr prov.RecvWR, sgl []prov.SGE) {
			wr.SGEIndex = uint32(len(req.SGEs))
			req.SGEs = append(req.SGEs, sgl...)
			req.WRs = append(req.WRs, wr)
		}
	})
}

type srq struct {
	obj
	mu sync.Mutex // posts, so that split posts stay in order
}

var _ prov.SRQ = (*srq)(nil)

func (s *srq) PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return postRecv(&s.obj, opSRQPostRecv, wrs, sges)
}

func (s *srq) Modify(attr prov.SRQAttr, limitOnly bool) error {
	return s.c.call(context.Background(), opSRQModify, srqModifyReq{SRQ: s.id, Attr: attr, LimitOnly: limitOnly}, &empty{})
}

func (s *srq) Query() (prov.SRQAttr, error) {
	var r srqQueryResp
	err := s.c.call(context.Background(), opSRQQuery, idReq{ID: s.id}, &r)
	return r.Attr, err
}

func (s *srq) Close() error { return s.close() }

// ah is an address handle. Its Handle is its server id, which the server
// translates for UD work requests.
type ah struct{ obj }

var _ prov.AH = (*ah)(nil)

func (a *ah) Handle() uint64 { return a.id }
func (a *ah) Close() error   { return a.close() }
