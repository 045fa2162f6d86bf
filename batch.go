package verbs

import (
	"fmt"
	"runtime"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// errBatchFull is recorded by a batch that was asked to hold more requests
// (or SGEs) than its capacity; Submit returns it.
var errNoAH = fmt.Errorf("destination has no address handle: %w", syscall.EINVAL)

var errBatchFull = fmt.Errorf("batch is full: %w", ErrQueueFull)

// Request is one work request inside a batch. Its methods set per-request
// modifiers and return the request, so calls chain:
//
//	b.Write(id, dst, sge).Signaled().Fenced()
//
// A Request is valid until the batch's next Submit or Reset.
type Request struct {
	wr *prov.SendWR // the request in the batch's memory, or the batch's scratch
	// b keeps the batch, whose memory outside the Go heap holds wr, alive
	// as long as the Request is reachable: a Request kept after its batch
	// was dropped must not write into freed (or reused) memory.
	b *sendBatch
}

// set adds flags f to the request.
func (r *Request) set(f prov.SendFlags) *Request {
	if r.wr != nil {
		r.wr.Flags |= f
	}
	return r
}

// Signaled asks for a completion even when the QP does not signal all requests.
func (r *Request) Signaled() *Request { return r.set(prov.SendSignaled) }

// Fenced makes the request wait until the RDMA reads and atomics posted
// before it on the QP have completed (their data is in local memory), so
// that it can send or write what they fetched. Without it, RC lets a send
// or write start while a read before it is still outstanding.
//
// On the kernel's SoftRoCE driver (rdma_rxe, seen on Linux 6.1) the send
// queue can stop for good at a fenced request after everything before it
// completed, rarely (about 1 run in 80 of the conformance suite's Fence
// case, which posts reads, sends and fenced writes of up to 70000 bytes);
// code that must not hang on rxe bounds its waits for the completion.
func (r *Request) Fenced() *Request { return r.set(prov.SendFence) }

// Solicited sets the solicited-event bit (sends and writes with immediate).
func (r *Request) Solicited() *Request { return r.set(prov.SendSolicited) }

// Inline copies the payload into the request at Submit: the buffer may be
// reused as soon as Submit returns. The request must be a send or a
// write of at most the QP's MaxInlineData bytes, and, unlike what
// libibverbs requires, every SGE must still name memory registered in the
// QP's PD with its lkey and lie inside it: Submit checks it before
// anything is posted, so that a bad SGE is an error, not a read of
// arbitrary memory. For bytes that are not in a memory region, use
// SendInline, WriteInline and their kin.
func (r *Request) Inline() *Request { return r.set(prov.SendInline) }

// WithFlags adds send flags.
func (r *Request) WithFlags(f SendFlags) *Request { return r.set(prov.SendFlags(f)) }

// sendBatch holds work requests in memory outside the Go heap until Submit
// posts all of them with one provider call.
type sendBatch struct {
	q       *qpCore
	wrs     []prov.SendWR
	sges    []prov.SGE
	maxSGE  int
	err     error
	reqs    []Request   // reqs[i] names wrs[i]
	scratch Request     // target of modifiers after an overflow
	sink    prov.SendWR // what scratch names

	// Inline payloads of SendInline and its kin, copied into staging (n
	// times MaxInlineData bytes outside the Go heap, next to the requests)
	// up to staged. Bit i of own marks request i as one of them: its SGE
	// names staging, not memory of an MR.
	staging []byte
	staged  int
	own     []uint64
	nown    int
	hold    inlineHold // MRs read by the inline requests of a Submit

	// UD batches: ahs[i] is the address handle of request i, held open
	// (ahHold) while Submit posts.
	ahs    []*AddressHandle
	ahHold []*AddressHandle
}

// batchSize is the number of requests of a batch asked for n: 64 if n is
// not positive, at most limit (the device's queue depth, if known: no
// Submit can post more), so that a huge n does not exhaust memory.
func batchSize(n, limit int) int {
	if n <= 0 {
		n = 64
	}
	if limit > 0 {
		n = min(n, limit)
	}
	return n
}

func newSendBatch[T any](owner *T, b *sendBatch, q *qpCore, n int) {
	n = batchSize(n, q.maxWR)
	b.q = q
	b.maxSGE = max(q.cap.MaxSendSGE, 1)
	b.own = make([]uint64, (n+63)/64)
	wrSize := int(unsafe.Sizeof(prov.SendWR{}))
	sgeSize := int(unsafe.Sizeof(prov.SGE{}))
	inline := n * max(q.cap.MaxInlineData, 0)
	if r, err := mem.Alloc(n*wrSize+n*b.maxSGE*sgeSize+inline, "batch", false); err == nil {
		base := r.Ptr()
		b.wrs = unsafe.Slice((*prov.SendWR)(base), n)[:0]
		b.sges = unsafe.Slice((*prov.SGE)(unsafe.Add(base, n*wrSize)), n*b.maxSGE)[:0]
		b.staging = r.Bytes()[n*wrSize+n*b.maxSGE*sgeSize:][:inline:inline]
		runtime.AddCleanup(owner, func(r *mem.Region) { r.Free() }, r)
	} else {
		// Fall back to the Go heap: still correct, just not off-heap
		// (and without staging: SendInline and its kin fail).
		b.wrs = make([]prov.SendWR, 0, n)
		b.sges = make([]prov.SGE, 0, n*b.maxSGE)
	}
	b.reqs = make([]Request, n)
	for i := range b.reqs {
		b.reqs[i] = Request{wr: &b.wrs[:n][i], b: b}
	}
	b.scratch = Request{wr: &b.sink, b: b}
}

func (b *sendBatch) add(wr prov.SendWR, sgl []SGE) *Request {
	if b.err != nil {
		return &b.scratch
	}
	if len(b.wrs) == cap(b.wrs) {
		b.err = fmt.Errorf("%w (%d requests)", errBatchFull, cap(b.wrs))
		return &b.scratch
	}
	if len(sgl) > b.maxSGE {
		b.err = fmt.Errorf("request %d has %d SGEs, more than max_send_sge %d: %w", len(b.wrs), len(sgl), b.maxSGE, syscall.EINVAL)
		return &b.scratch
	}
	wr.SGEIndex, wr.NumSGE = uint32(len(b.sges)), uint32(len(sgl))
	for _, s := range sgl {
		b.sges = append(b.sges, prov.SGE(s))
	}
	b.wrs = append(b.wrs, wr)
	return &b.reqs[len(b.wrs)-1]
}

// fail records err for the request the batch was asked to add next (Submit
// returns it, posting nothing) and returns the scratch request.
func (b *sendBatch) fail(err error) *Request {
	if b.err == nil {
		b.err = fmt.Errorf("request %d: %w", len(b.wrs), err)
	}
	return &b.scratch
}

// checkAtomic checks an atomic request in the verbs layer, before any
// provider sees it, so that every provider refuses the same requests with
// the same explanation: the target must be an 8-byte aligned word and the
// result SGE must hold exactly its 8 bytes. (SoftRoCE and soft0 refuse
// both at post with a bare EINVAL or in their own words; other devices
// send a misaligned atomic and fail it with a remote error.)
func checkAtomic(dst RemoteAddr, result SGE) error {
	if dst.Addr&7 == 0 && result.Length == 8 {
		return nil
	}
	if dst.Addr&7 != 0 {
		return fmt.Errorf("atomic target address %#x is not 8-byte aligned (it is %d bytes past %#x): "+
			"CompareSwap and FetchAdd operate on an aligned 8-byte word: %w", dst.Addr, dst.Addr&7, dst.Addr&^7, syscall.EINVAL)
	}
	return fmt.Errorf("atomic result SGE of %d bytes: it receives the 8-byte prior value and must be exactly 8 bytes: %w",
		result.Length, syscall.EINVAL)
}

// addData adds wr as an inline request whose payload is a copy of data
// in the batch's staging memory.
func (b *sendBatch) addData(wr prov.SendWR, data []byte) *Request {
	if b.err != nil {
		return &b.scratch
	}
	if len(b.wrs) == cap(b.wrs) {
		b.err = fmt.Errorf("%w (%d requests)", errBatchFull, cap(b.wrs))
		return &b.scratch
	}
	if len(data) > b.q.cap.MaxInlineData {
		b.err = fmt.Errorf("request %d: %d bytes of inline data, the queue pair allows %d (max_inline_data): %w",
			len(b.wrs), len(data), max(b.q.cap.MaxInlineData, 0), syscall.EINVAL)
		return &b.scratch
	}
	i := len(b.wrs)
	wr.SGEIndex, wr.NumSGE = uint32(len(b.sges)), 0
	if len(data) > 0 { // empty: a plain send or write of nothing
		wr.Flags |= prov.SendInline
		if len(b.staging)-b.staged < len(data) {
			// Only without staging memory: each request's share is
			// MaxInlineData bytes.
			b.err = fmt.Errorf("request %d: no memory to stage %d bytes of inline data: %w", i, len(data), ErrQueueFull)
			return &b.scratch
		}
		dst := b.staging[b.staged : b.staged+len(data)]
		copy(dst, data)
		b.staged += len(data)
		b.sges = append(b.sges, prov.SGE{Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(dst)))), Length: uint32(len(data))})
		wr.NumSGE = 1
	}
	b.own[i>>6] |= 1 << (i & 63)
	b.nown++
	b.wrs = append(b.wrs, wr)
	return &b.reqs[i]
}

func (b *sendBatch) submit() error {
	if err := b.err; err != nil {
		b.reset()
		dev := ""
		if b.q != nil { // nil: a zero batch, not from NewBatch (it holds nothing)
			dev = b.q.devNm
		}
		return opErr("post send", dev, err)
	}
	if len(b.wrs) == 0 {
		return nil
	}
	if !b.q.res.enter() {
		b.reset()
		return b.q.res.errClosed("post send")
	}
	defer b.q.res.exit()
	var own []uint64
	if b.nown > 0 {
		own = b.own
	}
	k, bad := checkInline(&b.q.pd.mrs, &b.hold, b.wrs, b.sges, own, b.q.cap.MaxInlineData)
	if b.ahs != nil {
		if i, err := b.holdAHs(k); err != nil {
			k, bad = i, err
		}
	}
	n, err := 0, error(nil)
	if k > 0 {
		n, err = b.q.qp.PostSend(b.wrs[:k], b.sges)
	}
	b.hold.release()
	for i, a := range b.ahHold {
		a.release()
		b.ahHold[i] = nil
	}
	b.ahHold = b.ahHold[:0]
	b.reset()
	if err == nil && bad != nil {
		n, err = k, bad
	}
	if err != nil {
		return &PostError{Posted: n, Err: opErr("post send", b.q.devNm, err)}
	}
	return nil
}

// holdAHs holds the address handles of the first k requests open (in
// ahHold) for the post. If one of them is closed, it returns its index
// and why; the handles of the requests before it stay held.
func (b *sendBatch) holdAHs(k int) (int, error) {
	var last *AddressHandle
	for i, a := range b.ahs[:k] {
		if a == last {
			continue
		}
		if !a.acquire() {
			return i, fmt.Errorf("request %d: %w", i, a.errClosed())
		}
		b.ahHold = append(b.ahHold, a)
		last = a
	}
	return k, nil
}

func (b *sendBatch) reset() {
	if b.ahs != nil {
		clear(b.ahs)
		b.ahs = b.ahs[:0]
	}
	if b.nown > 0 {
		clear(b.own)
		b.nown, b.staged = 0, 0
	}
	b.wrs, b.sges, b.err = b.wrs[:0], b.sges[:0], nil
	b.sink = prov.SendWR{}
}

// Len returns the number of requests in the batch.
func (b *sendBatch) Len() int { return len(b.wrs) }

// Cap returns the number of requests the batch holds.
func (b *sendBatch) Cap() int { return cap(b.wrs) }

// Reset drops the requests collected so far.
func (b *sendBatch) Reset() { b.reset() }

// Submit posts every request of the batch with one provider call and
// empties the batch. If the device rejects a request, the error is a
// *PostError saying how many were accepted (those will complete); the rest
// were not posted. Overfilling the batch, and inline data that is too
// long, are reported here too, with nothing posted. Inline requests are
// checked first (see Request.Inline): the requests before the first that
// fails the check are posted, and a *PostError names it.
func (b *sendBatch) Submit() error { return b.submit() }

func sendWR(op prov.WROpcode, wrid uint64) prov.SendWR { return prov.SendWR{WRID: wrid, Opcode: op} }

func rdmaWR(op prov.WROpcode, wrid uint64, r RemoteAddr) prov.SendWR {
	return prov.SendWR{WRID: wrid, Opcode: op, RemoteAddr: r.Addr, RKey: r.RKey}
}

// connectedBatch holds what RC and UC batches share: sends and RDMA
// writes, with and without immediate data, inline or not.
type connectedBatch struct{ sendBatch }

// Send adds a send of the data in sgl.
func (b *connectedBatch) Send(wrid uint64, sgl ...SGE) *Request {
	return b.add(sendWR(prov.WRSend, wrid), sgl)
}

// SendImm adds a send with immediate data.
func (b *connectedBatch) SendImm(wrid uint64, imm uint32, sgl ...SGE) *Request {
	wr := sendWR(prov.WRSendImm, wrid)
	wr.Imm = imm
	return b.add(wr, sgl)
}

// Write adds an RDMA write of sgl to dst.
func (b *connectedBatch) Write(wrid uint64, dst RemoteAddr, sgl ...SGE) *Request {
	return b.add(rdmaWR(prov.WRWrite, wrid, dst), sgl)
}

// WriteImm adds an RDMA write with immediate data; it consumes a receive at the peer.
func (b *connectedBatch) WriteImm(wrid uint64, dst RemoteAddr, imm uint32, sgl ...SGE) *Request {
	wr := rdmaWR(prov.WRWriteImm, wrid, dst)
	wr.Imm = imm
	return b.add(wr, sgl)
}

// SendInline adds an inline send of data, which needs no memory region:
// it may be any Go memory. SendInline copies data into the batch (memory
// outside the Go heap, MaxInlineData bytes per request), so data may be
// reused as soon as it returns; Submit copies it into the work request.
// More than the QP's MaxInlineData bytes is an error, reported by Submit
// before anything is posted.
func (b *connectedBatch) SendInline(wrid uint64, data []byte) *Request {
	return b.addData(sendWR(prov.WRSend, wrid), data)
}

// SendImmInline adds an inline send of data with immediate data (see
// SendInline).
func (b *connectedBatch) SendImmInline(wrid uint64, imm uint32, data []byte) *Request {
	wr := sendWR(prov.WRSendImm, wrid)
	wr.Imm = imm
	return b.addData(wr, data)
}

// WriteInline adds an inline RDMA write of data to dst (see SendInline).
func (b *connectedBatch) WriteInline(wrid uint64, dst RemoteAddr, data []byte) *Request {
	return b.addData(rdmaWR(prov.WRWrite, wrid, dst), data)
}

// WriteImmInline adds an inline RDMA write of data to dst with immediate
// data (see SendInline).
func (b *connectedBatch) WriteImmInline(wrid uint64, dst RemoteAddr, imm uint32, data []byte) *Request {
	wr := rdmaWR(prov.WRWriteImm, wrid, dst)
	wr.Imm = imm
	return b.addData(wr, data)
}

// RCBatch collects work requests for an RC queue pair (doorbell batching).
// It is not safe for concurrent use; use one batch per goroutine.
type RCBatch struct{ connectedBatch }

// NewBatch returns a batch of up to n work requests (default 64) for the
// QP. The batch keeps its requests, and room for n times the QP's
// MaxInlineData bytes of inline data (SendInline and its kin), in memory
// outside the Go heap, freed when the batch is garbage-collected. An n
// above the device's max_qp_wr (no queue holds more) counts as max_qp_wr.
func (q *RCQueuePair) NewBatch(n int) *RCBatch {
	b := new(RCBatch)
	newSendBatch(b, &b.sendBatch, &q.qpCore, n)
	return b
}

// Read adds an RDMA read from src into sgl (the local MR needs AccessLocalWrite).
func (b *RCBatch) Read(wrid uint64, src RemoteAddr, sgl ...SGE) *Request {
	return b.add(rdmaWR(prov.WRRead, wrid, src), sgl)
}

// CompareSwap adds an atomic compare-and-swap of the 8-byte word at dst
// (8-byte aligned): if it equals compare it becomes swap. The prior value is
// written to result (8 bytes). A dst that is not 8-byte aligned, or a result
// of another length, makes Submit fail with EINVAL, posting nothing, on
// every device.
func (b *RCBatch) CompareSwap(wrid uint64, dst RemoteAddr, compare, swap uint64, result SGE) *Request {
	if err := checkAtomic(dst, result); err != nil {
		return b.fail(err)
	}
	wr := rdmaWR(prov.WRAtomicCAS, wrid, dst)
	wr.CompareAdd, wr.Swap = compare, swap
	return b.add(wr, []SGE{result})
}

// FetchAdd adds an atomic fetch-and-add of add to the 8-byte word at dst
// (8-byte aligned). The prior value is written to result (8 bytes). The
// request is checked as in CompareSwap.
func (b *RCBatch) FetchAdd(wrid uint64, dst RemoteAddr, add uint64, result SGE) *Request {
	if err := checkAtomic(dst, result); err != nil {
		return b.fail(err)
	}
	wr := rdmaWR(prov.WRAtomicFAA, wrid, dst)
	wr.CompareAdd = add
	return b.add(wr, []SGE{result})
}

// UCBatch collects work requests for a UC queue pair: the sends and RDMA
// writes of RCBatch, without reads and atomics.
type UCBatch struct{ connectedBatch }

// NewBatch returns a batch of up to n work requests (default 64) for the
// QP (see RCQueuePair.NewBatch).
func (q *UCQueuePair) NewBatch(n int) *UCBatch {
	b := new(UCBatch)
	newSendBatch(b, &b.sendBatch, &q.qpCore, n)
	return b
}

// Destination addresses a UD send: the remote port (AH), QP number and Q_Key.
type Destination struct {
	AH   *AddressHandle
	QPN  uint32
	QKey uint32
}

// UDBatch collects sends for a UD queue pair.
type UDBatch struct{ sendBatch }

// NewBatch returns a batch of up to n sends (default 64) for the QP (see
// RCQueuePair.NewBatch).
func (q *UDQueuePair) NewBatch(n int) *UDBatch {
	b := new(UDBatch)
	newSendBatch(b, &b.sendBatch, &q.qpCore, n)
	b.ahs = make([]*AddressHandle, 0, b.Cap())
	return b
}

func udWR(op prov.WROpcode, wrid uint64, to Destination) prov.SendWR {
	wr := prov.SendWR{WRID: wrid, Opcode: op, RemoteQPN: to.QPN, RemoteQKey: to.QKey}
	if to.AH != nil {
		wr.AH = to.AH.ah.Handle()
	}
	return wr
}

// dest checks to (see checkDest) for the request the batch is asked to
// add next, recording the error if it fails.
func (b *UDBatch) dest(to Destination) bool {
	if b.q == nil { // a zero batch, not from NewBatch: it holds nothing
		b.add(prov.SendWR{}, nil)
		return false
	}
	if b.q.pd == nil { // a batch of a zero UDQueuePair, as good as closed
		b.fail(b.q.res.errClosed("post send"))
		return false
	}
	if err := checkDest(b.q.pd, to); err != nil {
		b.fail(err)
		return false
	}
	return true
}

// added records the address handle of r, the request just added (unless
// the batch returned its scratch request).
func (b *UDBatch) added(r *Request, ah *AddressHandle) *Request {
	if r != &b.scratch {
		b.ahs = append(b.ahs, ah)
	}
	return r
}

// Send adds a datagram to the destination. A destination without an
// address handle, or with one that is closed or of another protection
// domain, makes Submit fail, posting nothing; an address handle closed
// after Send makes Submit post only the requests before it.
func (b *UDBatch) Send(wrid uint64, to Destination, sgl ...SGE) *Request {
	if !b.dest(to) {
		return &b.scratch
	}
	return b.added(b.add(udWR(prov.WRSend, wrid, to), sgl), to.AH)
}

// SendImm adds a datagram with immediate data.
func (b *UDBatch) SendImm(wrid uint64, to Destination, imm uint32, sgl ...SGE) *Request {
	if !b.dest(to) {
		return &b.scratch
	}
	wr := udWR(prov.WRSendImm, wrid, to)
	wr.Imm = imm
	return b.added(b.add(wr, sgl), to.AH)
}

// SendInline adds an inline datagram of data to the destination (see
// RCBatch.SendInline).
func (b *UDBatch) SendInline(wrid uint64, to Destination, data []byte) *Request {
	if !b.dest(to) {
		return &b.scratch
	}
	return b.added(b.addData(udWR(prov.WRSend, wrid, to), data), to.AH)
}

// SendImmInline adds an inline datagram of data with immediate data (see
// RCBatch.SendInline).
func (b *UDBatch) SendImmInline(wrid uint64, to Destination, imm uint32, data []byte) *Request {
	if !b.dest(to) {
		return &b.scratch
	}
	wr := udWR(prov.WRSendImm, wrid, to)
	wr.Imm = imm
	return b.added(b.addData(wr, data), to.AH)
}

// recvPoster is a QP or an SRQ.
type recvPoster interface {
	PostRecv(wrs []prov.RecvWR, sges []prov.SGE) (int, error)
}

// RecvBatch collects receive buffers for a QP or SRQ and posts them with
// one provider call. It is not safe for concurrent use.
type RecvBatch struct {
	post   recvPoster
	res    *resource // the QP's or SRQ's
	wrs    []prov.RecvWR
	sges   []prov.SGE
	maxSGE int
	err    error
	devNm  string
}

func newRecvBatch(p recvPoster, n, limit, maxSGE int, dev string) *RecvBatch {
	n = batchSize(n, limit)
	maxSGE = max(maxSGE, 1)
	b := &RecvBatch{post: p, maxSGE: maxSGE, devNm: dev}
	wrSize := int(unsafe.Sizeof(prov.RecvWR{}))
	sgeSize := int(unsafe.Sizeof(prov.SGE{}))
	r, err := mem.Alloc(n*wrSize+n*maxSGE*sgeSize, "recvbatch", false)
	if err != nil {
		b.wrs = make([]prov.RecvWR, 0, n)
		b.sges = make([]prov.SGE, 0, n*maxSGE)
		return b
	}
	base := r.Ptr()
	b.wrs = unsafe.Slice((*prov.RecvWR)(base), n)[:0]
	b.sges = unsafe.Slice((*prov.SGE)(unsafe.Add(base, n*wrSize)), n*maxSGE)[:0]
	runtime.AddCleanup(b, func(r *mem.Region) { r.Free() }, r)
	return b
}

// NewRecvBatch returns a batch of up to n receives (default 64) for the
// QP; an n above the device's max_qp_wr counts as max_qp_wr.
func (q *qpCore) NewRecvBatch(n int) *RecvBatch {
	b := newRecvBatch(q.qp, n, q.maxWR, q.cap.MaxRecvSGE, q.devNm)
	b.res = &q.res
	return b
}

// Recv adds a receive buffer made of sgl.
func (b *RecvBatch) Recv(wrid uint64, sgl ...SGE) {
	if b.err != nil {
		return
	}
	if len(b.wrs) == cap(b.wrs) {
		b.err = fmt.Errorf("%w (%d receives)", errBatchFull, cap(b.wrs))
		return
	}
	if len(sgl) > b.maxSGE {
		b.err = fmt.Errorf("receive %d has %d SGEs, more than max_recv_sge %d: %w", len(b.wrs), len(sgl), b.maxSGE, syscall.EINVAL)
		return
	}
	b.wrs = append(b.wrs, prov.RecvWR{WRID: wrid, SGEIndex: uint32(len(b.sges)), NumSGE: uint32(len(sgl))})
	for _, s := range sgl {
		b.sges = append(b.sges, prov.SGE(s))
	}
}

// Len returns the number of receives in the batch.
func (b *RecvBatch) Len() int { return len(b.wrs) }

// Reset drops the receives collected so far.
func (b *RecvBatch) Reset() { b.wrs, b.sges, b.err = b.wrs[:0], b.sges[:0], nil }

// Submit posts every receive with one provider call and empties the batch.
// A partial failure is a *PostError.
func (b *RecvBatch) Submit() error {
	if err := b.err; err != nil {
		b.Reset()
		return opErr("post recv", b.devNm, err)
	}
	if len(b.wrs) == 0 {
		return nil
	}
	if b.res != nil {
		if !b.res.enter() {
			b.Reset()
			return opErr("post recv", b.devNm, ErrClosed)
		}
		defer b.res.exit()
	}
	n, err := b.post.PostRecv(b.wrs, b.sges)
	b.Reset()
	if err != nil {
		return &PostError{Posted: n, Err: opErr("post recv", b.devNm, err)}
	}
	return nil
}
