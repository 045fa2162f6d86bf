package provproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// Serve takes over f, one end of a connection from Pair, and executes the
// requests of the client at the other end on provider p, each in its own
// goroutine, until the connection ends. Then it cancels the requests
// still waiting, closes every object the client left open and returns:
// nil if the client closed the connection with nothing left open,
// otherwise an error saying what went wrong (a malformed packet ends the
// connection too).
func Serve(f *os.File, p prov.Provider) error {
	cn, err := newConn(f)
	if err != nil {
		return err
	}
	s := &server{conn: cn, p: p, objs: map[uint64]*sobj{}, ids: map[any]uint64{}, inflight: map[uint64]context.CancelFunc{}}
	err = s.loop()
	cn.close()
	s.mu.Lock()
	for _, cancel := range s.inflight {
		cancel()
	}
	s.mu.Unlock()
	s.wg.Wait()
	if left := s.closeAll(); left != "" {
		err = errors.Join(err, fmt.Errorf("provproxy: the client left objects open (%s); the server closed them", left))
	}
	return err
}

// server is the state of one connection.
type server struct {
	conn *conn
	p    prov.Provider

	mu       sync.Mutex
	objs     map[uint64]*sobj
	ids      map[any]uint64 // provider object → id, for objects in results
	next     uint64
	inflight map[uint64]context.CancelFunc // by request id
	wg       sync.WaitGroup                // request goroutines
}

// sobj is a provider object the client holds.
type sobj struct {
	kind int
	v    any
	ctx  *sctx // the device context it belongs to

	// QPs
	qpType prov.QPType
	// AHs
	handle uint64
	// MRs: the mapping of the client's memory, its descriptor and the
	// region's addresses [lo, hi)
	mapping []byte
	fd      int
	lo, hi  uint64
}

// sctx is the state of a device context: its MRs, which inline work
// requests may read from.
type sctx struct {
	memMu sync.RWMutex // read: a post reading inline data; write: an MR going away
	mrs   map[uint64]*sobj
}

var kindNames = [...]string{objNone: "object", objContext: "device context", objPD: "pd", objMR: "mr",
	objCompChannel: "completion channel", objCQ: "cq", objQP: "qp", objSRQ: "srq", objAH: "ah"}

func (s *server) loop() error {
	for {
		p, fds, err := s.conn.recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("provproxy: serve: %w", err)
		}
		h, payload, err := parseHeader(p)
		if err != nil {
			fdpass.Close(fds)
			return fmt.Errorf("provproxy: serve: %w", err)
		}
		switch h.kind {
		case kindCancel:
			fdpass.Close(fds)
			s.mu.Lock()
			if cancel := s.inflight[h.id]; cancel != nil {
				cancel()
			}
			s.mu.Unlock()
		case kindRequest:
			s.start(h, payload, fds)
		default:
			fdpass.Close(fds)
			return fmt.Errorf("provproxy: serve: %w: message kind %d sent to the server", errMalformed, h.kind)
		}
	}
}

// start decodes a request and runs it in a goroutine of its own.
func (s *server) start(h header, payload []byte, fds []int) {
	req := reqType(h.op)
	if req == nil {
		fdpass.Close(fds)
		s.respond(h, nil, fmt.Errorf("provproxy: %w: unknown operation %d", errMalformed, uint8(h.op)))
		return
	}
	if err := unmarshal(payload, req); err != nil {
		fdpass.Close(fds)
		s.respond(h, nil, fmt.Errorf("provproxy: %s: request: %w", h.op, err))
		return
	}
	want := 0
	if h.op == opRegMR {
		want = 1
	}
	if len(fds) != want {
		fdpass.Close(fds)
		s.respond(h, nil, errnof(syscall.EINVAL, "%s: %d file descriptors with the request, want %d", h.op, len(fds), want))
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.mu.Lock()
	if s.inflight[h.id] != nil {
		s.mu.Unlock()
		cancel()
		fdpass.Close(fds)
		s.respond(h, nil, fmt.Errorf("provproxy: %s: %w: request id %d is already in flight", h.op, errMalformed, h.id))
		return
	}
	s.inflight[h.id] = cancel
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		resp, err := s.handle(ctx, h.op, req, fds)
		s.mu.Lock()
		delete(s.inflight, h.id)
		s.mu.Unlock()
		cancel()
		s.respond(h, resp, err)
	}()
}

// respond answers a request; resp nil is the zero response.
func (s *server) respond(h header, resp any, err error) {
	if resp == nil {
		resp = respType(h.op)
	}
	if resp == nil {
		resp = &empty{} // unknown operation
	}
	b := appendHeader(make([]byte, 0, 256), header{kind: kindResponse, op: h.op, id: h.id})
	b, merr := marshal(b, toWire(err))
	if merr == nil {
		b, merr = marshal(b, resp)
	}
	if merr == nil && len(b) > maxMsg {
		merr = fmt.Errorf("provproxy: %s: a %d-byte response, the limit is %d", h.op, len(b), maxMsg)
	}
	if merr != nil {
		b = appendHeader(b[:0], header{kind: kindResponse, op: h.op, id: h.id})
		b, _ = marshal(b, toWire(merr))
		if r := respType(h.op); r != nil {
			b, _ = marshal(b, r)
		}
	}
	// A failed send means the connection is ending: nobody to tell.
	s.conn.send(b)
}

// add records a new object and returns its id.
func (s *server) add(o *sobj) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.next++
	s.objs[s.next] = o
	s.ids[o.v] = s.next
	return s.next
}

// get returns the object id of the given kind (objNone: any kind).
func (s *server) get(id uint64, kind int) (*sobj, error) {
	s.mu.Lock()
	o := s.objs[id]
	s.mu.Unlock()
	if o == nil || (kind != objNone && o.kind != kind) {
		return nil, fmt.Errorf("provproxy: no open %s with id %d: %w", kindNames[kind], id, prov.ErrClosed)
	}
	return o, nil
}

// getOpt is get, with id 0 meaning none (nil).
func (s *server) getOpt(id uint64, kind int) (*sobj, error) {
	if id == 0 {
		return nil, nil
	}
	return s.get(id, kind)
}

// idOf returns the kind and id of a provider object, if the client holds it.
func (s *server) idOf(v any) (int, uint64) {
	if v == nil {
		return objNone, 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.ids[v]
	if o := s.objs[id]; o != nil {
		return o.kind, id
	}
	return objNone, 0
}

func (s *server) handle(ctx context.Context, op opcode, req any, fds []int) (any, error) {
	switch r := req.(type) {
	case *helloReq:
		if r.Version != protocolVersion {
			return nil, fmt.Errorf("provproxy: hello: protocol version %d, the server speaks %d", r.Version, protocolVersion)
		}
		devs, err := s.p.Devices()
		return &helloResp{Version: protocolVersion, Provider: s.p.Name(), PID: int64(os.Getpid()), Devices: devs}, err
	case *nameReq:
		pc, err := s.p.Open(r.Name)
		if err != nil {
			return nil, err
		}
		return &idResp{ID: s.add(&sobj{kind: objContext, v: pc, ctx: &sctx{mrs: map[uint64]*sobj{}}})}, nil
	case *portReq:
		o, err := s.get(r.ID, objContext)
		if err != nil {
			return nil, err
		}
		pc := o.v.(prov.Context)
		if op == opQueryGIDTable {
			es, err := pc.QueryGIDTable(r.Port)
			return &gidResp{Entries: es}, err
		}
		a, err := pc.QueryPort(r.Port)
		return &portResp{Attr: a}, err
	case *idReq:
		return s.handleID(ctx, op, r.ID)
	case *createCQReq:
		o, err := s.get(r.Ctx, objContext)
		if err != nil {
			return nil, err
		}
		chObj, err := s.getOpt(r.Channel, objCompChannel)
		if err != nil {
			return nil, err
		}
		var ch prov.CompChannel
		if chObj != nil {
			ch = chObj.v.(prov.CompChannel)
		}
		q, err := o.v.(prov.Context).CreateCQ(int(r.CQE), ch, int(r.Vector))
		if err != nil {
			return nil, err
		}
		return &createCQResp{ID: s.add(&sobj{kind: objCQ, v: q, ctx: o.ctx}), Cap: int64(q.Cap())}, nil
	case *regMRReq:
		return s.regMR(r, fds[0])
	case *createQPReq:
		return s.createQP(r)
	case *createSRQReq:
		o, err := s.get(r.PD, objPD)
		if err != nil {
			return nil, err
		}
		q, err := o.v.(prov.PD).CreateSRQ(r.Attr)
		if err != nil {
			return nil, err
		}
		return &idResp{ID: s.add(&sobj{kind: objSRQ, v: q, ctx: o.ctx})}, nil
	case *createAHReq:
		o, err := s.get(r.PD, objPD)
		if err != nil {
			return nil, err
		}
		a, err := o.v.(prov.PD).CreateAH(r.Attr)
		if err != nil {
			return nil, err
		}
		return &idResp{ID: s.add(&sobj{kind: objAH, v: a, ctx: o.ctx, handle: a.Handle()})}, nil
	case *pollReq:
		o, err := s.get(r.CQ, objCQ)
		if err != nil {
			return nil, err
		}
		if r.Max <= 0 || r.Max > maxPoll {
			return nil, errnof(syscall.EINVAL, "poll cq: %d completions (1..%d per call)", r.Max, maxPoll)
		}
		dst := make([]prov.Completion, r.Max)
		var n int
		if r.Spins > 0 {
			n, err = o.v.(prov.CQ).PollBusy(dst, int(min(r.Spins, 1<<30)))
		} else {
			n, err = o.v.(prov.CQ).Poll(dst)
		}
		return &pollResp{WCs: dst[:n]}, err
	case *armReq:
		o, err := s.get(r.CQ, objCQ)
		if err != nil {
			return nil, err
		}
		return nil, o.v.(prov.CQ).Arm(r.Solicited)
	case *modifyQPReq:
		o, err := s.get(r.QP, objQP)
		if err != nil {
			return nil, err
		}
		return nil, o.v.(prov.QP).Modify(&r.Attr, prov.QPAttrMask(r.Mask))
	case *postSendReq:
		o, err := s.get(r.QP, objQP)
		if err != nil {
			return nil, err
		}
		return s.postSend(o, r)
	case *postRecvReq:
		kind := objQP
		if op == opSRQPostRecv {
			kind = objSRQ
		}
		o, err := s.get(r.ID, kind)
		if err != nil {
			return nil, err
		}
		var n int
		if kind == objSRQ {
			n, err = o.v.(prov.SRQ).PostRecv(r.WRs, r.SGEs)
		} else {
			n, err = o.v.(prov.QP).PostRecv(r.WRs, r.SGEs)
		}
		return &postResp{N: int64(n)}, err
	case *srqModifyReq:
		o, err := s.get(r.SRQ, objSRQ)
		if err != nil {
			return nil, err
		}
		return nil, o.v.(prov.SRQ).Modify(r.Attr, r.LimitOnly)
	}
	return nil, fmt.Errorf("provproxy: %s: %w: no handler", op, errMalformed)
}

// idOpKinds is the kind of object that each operation whose request names
// one object (handleID) acts on; objNone: any kind.
var idOpKinds = map[opcode]int{
	opQueryDevice: objContext, opAllocPD: objContext,
	opCreateCompChannel: objContext, opAsyncEvent: objContext, opClose: objNone, opChanWait: objCompChannel,
	opChanWake: objCompChannel, opQueryQP: objQP, opQPAddress: objQP, opSRQQuery: objSRQ, opQPLink: objQP,
}

// handleID runs the operations whose request names one object.
func (s *server) handleID(ctx context.Context, op opcode, id uint64) (any, error) {
	o, err := s.get(id, idOpKinds[op])
	if err != nil {
		return nil, err
	}
	switch op {
	case opQueryDevice:
		a, err := o.v.(prov.Context).QueryDevice()
		return &deviceResp{Attr: a}, err
	case opAllocPD:
		p, err := o.v.(prov.Context).AllocPD()
		if err != nil {
			return nil, err
		}
		return &idResp{ID: s.add(&sobj{kind: objPD, v: p, ctx: o.ctx})}, nil
	case opCreateCompChannel:
		ch, err := o.v.(prov.Context).CreateCompChannel()
		if err != nil {
			return nil, err
		}
		return &idResp{ID: s.add(&sobj{kind: objCompChannel, v: ch, ctx: o.ctx})}, nil
	case opAsyncEvent:
		ev, err := o.v.(prov.Context).AsyncEvent(ctx)
		if err != nil {
			return nil, err
		}
		kind, eid := s.idOf(ev.Element)
		return &asyncEventResp{Type: ev.Type, QPN: ev.QPN, Port: ev.Port, ElemKind: uint8(kind), Elem: eid}, nil
	case opChanWait:
		q, err := o.v.(prov.CompChannel).Wait(ctx)
		if err != nil {
			return nil, err
		}
		_, cid := s.idOf(q)
		return &chanWaitResp{CQ: cid}, nil
	case opChanWake:
		o.v.(prov.CompChannel).Wake()
		return nil, nil
	case opQueryQP:
		a, ia, err := o.v.(prov.QP).Query()
		if err != nil {
			return nil, err
		}
		r := &queryQPResp{Attr: a, Type: uint32(ia.Type), Cap: ia.Cap, SignalAll: ia.SignalAll}
		_, r.SendCQ = s.idOf(ia.SendCQ)
		_, r.RecvCQ = s.idOf(ia.RecvCQ)
		_, r.SRQ = s.idOf(ia.SRQ)
		return r, nil
	case opQPAddress:
		return &addressResp{Addr: o.v.(prov.QP).Address()}, nil
	case opQPLink:
		l, ok := o.v.(prov.Linker)
		if !ok {
			return nil, fmt.Errorf("provproxy: %s: %w", op, prov.ErrNotSupported)
		}
		return &linkResp{Link: l.Link()}, nil
	case opSRQQuery:
		a, err := o.v.(prov.SRQ).Query()
		return &srqQueryResp{Attr: a}, err
	case opClose:
		return nil, s.close(id, o)
	}
	return nil, fmt.Errorf("provproxy: %s: %w: an object request", op, errMalformed)
}

// close closes an object; once it is closed, the id is forgotten and the
// memory of an MR unmapped.
func (s *server) close(id uint64, o *sobj) error {
	if err := o.v.(interface{ Close() error }).Close(); err != nil {
		return err
	}
	s.mu.Lock()
	if s.objs[id] != o {
		// Closed twice at the same time: the other call forgot it.
		s.mu.Unlock()
		return nil
	}
	delete(s.objs, id)
	delete(s.ids, o.v)
	s.mu.Unlock()
	if o.kind == objMR {
		// No post reads inline data from the region once it is out of
		// the table, and the provider no longer touches it.
		o.ctx.memMu.Lock()
		delete(o.ctx.mrs, id)
		o.ctx.memMu.Unlock()
		unix.Munmap(o.mapping)
		unix.Close(o.fd)
	}
	return nil
}

// closeAll closes every object still open, children first, and
// describes them ("" for none).
func (s *server) closeAll() string {
	s.mu.Lock()
	ids := make([]uint64, 0, len(s.objs))
	for id := range s.objs {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	order := []int{objAH, objQP, objSRQ, objMR, objCQ, objCompChannel, objPD, objContext}
	slices.SortFunc(ids, func(a, b uint64) int {
		return slices.Index(order, s.objs[a].kind) - slices.Index(order, s.objs[b].kind)
	})
	var names []string
	for _, id := range ids {
		o := s.objs[id]
		names = append(names, fmt.Sprintf("%s %d", kindNames[o.kind], id))
		if err := s.close(id, o); err != nil {
			names[len(names)-1] += fmt.Sprintf(" (close: %v)", err)
		}
	}
	return strings.Join(names, ", ")
}

// regMR maps the client's memory and registers the mapping. The memory
// must be a memfd sealed at its size and at least as large as the
// range (so that the mapping can never lose its pages).
func (s *server) regMR(r *regMRReq, fd int) (_ any, err error) {
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	o, err := s.get(r.PD, objPD)
	if err != nil {
		return nil, err
	}
	if r.Len <= 0 || r.Offset < 0 || r.Len > 1<<46 || r.Offset > 1<<46 {
		return nil, errnof(syscall.EINVAL, "register mr: %d bytes at offset %d", r.Len, r.Offset)
	}
	if !mem.Sealed(fd) {
		return nil, errnof(syscall.EINVAL, "register mr: the descriptor is not a memfd sealed at its size")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("provproxy: register mr: %w", err)
	}
	if st.Size < r.Offset+r.Len {
		return nil, errnof(syscall.EINVAL, "register mr: %d bytes at offset %d of a %d-byte memfd", r.Len, r.Offset, st.Size)
	}
	page := int64(mem.PageSize)
	start := r.Offset &^ (page - 1)
	delta := r.Offset - start
	m, err := unix.Mmap(fd, start, int(delta+r.Len), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("provproxy: register mr: mmap %d bytes: %w", delta+r.Len, err)
	}
	pm, err := o.v.(prov.PD).RegMR(prov.Mem{Ptr: unsafe.Pointer(&m[delta]), Len: int(r.Len), FD: fd, Offset: r.Offset}, prov.Access(r.Access))
	if err != nil {
		unix.Munmap(m)
		return nil, err
	}
	x := &sobj{kind: objMR, v: pm, ctx: o.ctx, mapping: m, fd: fd, lo: pm.Addr(), hi: pm.Addr() + uint64(r.Len)}
	id := s.add(x)
	o.ctx.memMu.Lock()
	o.ctx.mrs[id] = x
	o.ctx.memMu.Unlock()
	return &regMRResp{ID: id, Addr: pm.Addr(), Len: int64(pm.Len()), LKey: pm.LKey(), RKey: pm.RKey()}, nil
}

func (s *server) createQP(r *createQPReq) (any, error) {
	o, err := s.get(r.PD, objPD)
	if err != nil {
		return nil, err
	}
	attr := prov.QPInitAttr{Type: prov.QPType(r.Type), Cap: r.Cap, SignalAll: r.SignalAll}
	for _, c := range []struct {
		id   uint64
		kind int
		set  func(any)
	}{
		{r.SendCQ, objCQ, func(v any) { attr.SendCQ = v.(prov.CQ) }},
		{r.RecvCQ, objCQ, func(v any) { attr.RecvCQ = v.(prov.CQ) }},
		{r.SRQ, objSRQ, func(v any) { attr.SRQ = v.(prov.SRQ) }},
	} {
		x, err := s.getOpt(c.id, c.kind)
		if err != nil {
			return nil, err
		}
		if x != nil {
			c.set(x.v)
		}
	}
	q, err := o.v.(prov.PD).CreateQP(attr)
	if err != nil {
		return nil, err
	}
	return &createQPResp{ID: s.add(&sobj{kind: objQP, v: q, ctx: o.ctx, qpType: attr.Type}), QPN: q.QPN()}, nil
}

// postSend checks what the provider cannot check for itself, then posts:
// the AH of a UD request must be an AH of the client, and the SGEs of an
// inline request (which the provider reads by address) must lie in MRs
// of the QP's context. The requests before the first that fails the
// checks are posted, and that one is reported as the failed one.
func (s *server) postSend(o *sobj, r *postSendReq) (any, error) {
	wrs := r.WRs
	inline := slices.ContainsFunc(wrs, func(wr prov.SendWR) bool { return wr.Flags&prov.SendInline != 0 })
	if inline {
		o.ctx.memMu.RLock()
		defer o.ctx.memMu.RUnlock()
	}
	k := len(wrs)
	var bad error
	for i := range wrs {
		wr := &wrs[i]
		if o.qpType == prov.QPTypeUD {
			a, err := s.get(wr.AH, objAH)
			if err != nil {
				k, bad = i, errnof(syscall.EINVAL, "post send: unknown or destroyed address handle %#x", wr.AH)
				break
			}
			wr.AH = a.handle
		}
		if wr.Flags&prov.SendInline != 0 {
			if err := o.ctx.checkInline(wr, r.SGEs); err != nil {
				k, bad = i, err
				break
			}
		}
	}
	if k > 0 {
		n, err := o.v.(prov.QP).PostSend(wrs[:k], r.SGEs)
		if err != nil || n < k {
			return &postResp{N: int64(n)}, err
		}
	}
	return &postResp{N: int64(k)}, bad
}

// checkInline checks that the SGEs of an inline request lie in MRs of the
// context. Called with memMu held for reading.
func (x *sctx) checkInline(wr *prov.SendWR, sges []prov.SGE) error {
	if uint64(wr.SGEIndex)+uint64(wr.NumSGE) > uint64(len(sges)) {
		return errSGERange
	}
	for _, sg := range sges[wr.SGEIndex : wr.SGEIndex+wr.NumSGE] {
		if sg.Length == 0 {
			continue
		}
		end := sg.Addr + uint64(sg.Length)
		if end < sg.Addr || !x.inMR(sg.Addr, end) {
			return errnof(syscall.EINVAL, "post send: inline data at %#x (%d bytes) lies outside the memory regions registered "+
				"through this context (the peer process can read inline data only from its mappings of them)", sg.Addr, sg.Length)
		}
	}
	return nil
}

// inMR reports whether [lo, hi) lies within one MR of the context.
func (x *sctx) inMR(lo, hi uint64) bool {
	for _, m := range x.mrs {
		if lo >= m.lo && hi <= m.hi {
			return true
		}
	}
	return false
}
