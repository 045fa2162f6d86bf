package verbs

import "github.com/goverbs/verbs/internal/prov"

// Single-request helpers. Each posts one work request with one provider
// call; for many requests, a batch is faster. RC and UC queue pairs share
// the helpers of sends and writes (connectedQP), with or without immediate
// data; reads and atomics are RC's. flags may be 0, Signaled,
// Fenced, Solicited, Inline or a combination. With Inline, the SGEs are
// checked against their memory regions as in a batch (Request.Inline);
// the ...Inline helpers send bytes that are in no memory region (see
// RCBatch.SendInline): data is pinned while the provider copies it and
// may be reused when the call returns.

// connectedQP holds what RC and UC queue pairs share: connecting to one
// peer, and sends and RDMA writes with or without immediate data. On UC,
// a message that finds no receive posted (a send, or a write with
// immediate data) or that the target rejects is dropped silently, and the
// sender's completion reports success.
type connectedQP struct{ qpCore }

// Connect moves the QP to RTR and RTS, connected to remote.
func (q *connectedQP) Connect(remote Endpoint) error { return q.connect(remote, ConnectOptions{}) }

// ConnectWith is Connect with addressing options.
func (q *connectedQP) ConnectWith(remote Endpoint, o ConnectOptions) error {
	return q.connect(remote, o)
}

// PostSend posts a send of sgl.
func (q *connectedQP) PostSend(wrid uint64, flags SendFlags, sgl ...SGE) error {
	wr := sendWR(prov.WRSend, wrid)
	wr.Flags = prov.SendFlags(flags)
	return q.postOne(wr, sgl)
}

// PostSendImm posts a send with immediate data.
func (q *connectedQP) PostSendImm(wrid uint64, flags SendFlags, imm uint32, sgl ...SGE) error {
	wr := sendWR(prov.WRSendImm, wrid)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postOne(wr, sgl)
}

// PostWrite posts an RDMA write of sgl to dst.
func (q *connectedQP) PostWrite(wrid uint64, flags SendFlags, dst RemoteAddr, sgl ...SGE) error {
	wr := rdmaWR(prov.WRWrite, wrid, dst)
	wr.Flags = prov.SendFlags(flags)
	return q.postOne(wr, sgl)
}

// PostWriteImm posts an RDMA write with immediate data.
func (q *connectedQP) PostWriteImm(wrid uint64, flags SendFlags, dst RemoteAddr, imm uint32, sgl ...SGE) error {
	wr := rdmaWR(prov.WRWriteImm, wrid, dst)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postOne(wr, sgl)
}

// PostSendInline posts an inline send of data, which needs no memory
// region (at most the QP's MaxInlineData bytes).
func (q *connectedQP) PostSendInline(wrid uint64, flags SendFlags, data []byte) error {
	wr := sendWR(prov.WRSend, wrid)
	wr.Flags = prov.SendFlags(flags)
	return q.postData(wr, data)
}

// PostSendImmInline posts an inline send of data with immediate data.
func (q *connectedQP) PostSendImmInline(wrid uint64, flags SendFlags, imm uint32, data []byte) error {
	wr := sendWR(prov.WRSendImm, wrid)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postData(wr, data)
}

// PostWriteInline posts an inline RDMA write of data to dst.
func (q *connectedQP) PostWriteInline(wrid uint64, flags SendFlags, dst RemoteAddr, data []byte) error {
	wr := rdmaWR(prov.WRWrite, wrid, dst)
	wr.Flags = prov.SendFlags(flags)
	return q.postData(wr, data)
}

// PostWriteImmInline posts an inline RDMA write of data to dst with
// immediate data.
func (q *connectedQP) PostWriteImmInline(wrid uint64, flags SendFlags, dst RemoteAddr, imm uint32, data []byte) error {
	wr := rdmaWR(prov.WRWriteImm, wrid, dst)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postData(wr, data)
}

// PostRead posts an RDMA read of src into sgl.
func (q *RCQueuePair) PostRead(wrid uint64, flags SendFlags, src RemoteAddr, sgl ...SGE) error {
	wr := rdmaWR(prov.WRRead, wrid, src)
	wr.Flags = prov.SendFlags(flags)
	return q.postOne(wr, sgl)
}

// PostCompareSwap posts an atomic compare-and-swap (see RCBatch.CompareSwap).
func (q *RCQueuePair) PostCompareSwap(wrid uint64, flags SendFlags, dst RemoteAddr, compare, swap uint64, result SGE) error {
	if err := checkAtomic(dst, result); err != nil {
		return opErr("post send", q.devNm, err)
	}
	wr := rdmaWR(prov.WRAtomicCAS, wrid, dst)
	wr.Flags, wr.CompareAdd, wr.Swap = prov.SendFlags(flags), compare, swap
	return q.postOne(wr, []SGE{result})
}

// PostFetchAdd posts an atomic fetch-and-add (see RCBatch.FetchAdd).
func (q *RCQueuePair) PostFetchAdd(wrid uint64, flags SendFlags, dst RemoteAddr, add uint64, result SGE) error {
	if err := checkAtomic(dst, result); err != nil {
		return opErr("post send", q.devNm, err)
	}
	wr := rdmaWR(prov.WRAtomicFAA, wrid, dst)
	wr.Flags, wr.CompareAdd = prov.SendFlags(flags), add
	return q.postOne(wr, []SGE{result})
}

// PostSend posts a datagram to the destination.
func (q *UDQueuePair) PostSend(wrid uint64, flags SendFlags, to Destination, sgl ...SGE) error {
	if err := q.useAH(to); err != nil {
		return err
	}
	defer to.AH.release()
	wr := udWR(prov.WRSend, wrid, to)
	wr.Flags = prov.SendFlags(flags)
	return q.postOne(wr, sgl)
}

// PostSendImm posts a datagram with immediate data.
func (q *UDQueuePair) PostSendImm(wrid uint64, flags SendFlags, to Destination, imm uint32, sgl ...SGE) error {
	if err := q.useAH(to); err != nil {
		return err
	}
	defer to.AH.release()
	wr := udWR(prov.WRSendImm, wrid, to)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postOne(wr, sgl)
}

// PostSendInline posts an inline datagram of data to the destination
// (see RCQueuePair.PostSendInline).
func (q *UDQueuePair) PostSendInline(wrid uint64, flags SendFlags, to Destination, data []byte) error {
	if err := q.useAH(to); err != nil {
		return err
	}
	defer to.AH.release()
	wr := udWR(prov.WRSend, wrid, to)
	wr.Flags = prov.SendFlags(flags)
	return q.postData(wr, data)
}

// PostSendImmInline posts an inline datagram of data with immediate data.
func (q *UDQueuePair) PostSendImmInline(wrid uint64, flags SendFlags, to Destination, imm uint32, data []byte) error {
	if err := q.useAH(to); err != nil {
		return err
	}
	defer to.AH.release()
	wr := udWR(prov.WRSendImm, wrid, to)
	wr.Flags, wr.Imm = prov.SendFlags(flags), imm
	return q.postData(wr, data)
}

// useAH checks the destination of a post (see checkDest) and holds its
// address handle open until the caller releases it.
func (q *UDQueuePair) useAH(to Destination) error {
	if q.pd == nil {
		// A zero UDQueuePair is as good as closed: before, checkDest
		// took its nil PD for another one (TestZeroUDPostRealDestination).
		return q.res.errClosed("post send")
	}
	if err := checkDest(q.pd, to); err != nil {
		return opErr("post send", q.devNm, err)
	}
	if !to.AH.acquire() {
		return opErr("post send", q.devNm, to.AH.errClosed())
	}
	return nil
}
