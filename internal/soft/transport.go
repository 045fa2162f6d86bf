package soft

// The requester and the responder meet only here. A requester builds a
// request (the content of the packets a NIC would send for one message),
// hands it to a link together with its local data, and gets back a
// response (ACK, RNR NAK with timer, NAK with a syndrome, or "no answer").
// The responder side, (*qp).respond, runs at the target and is the same for
// every transport: rkey, bounds and access checks, PSN check, receive
// matching, scatter, atomics and receive completions all happen there.
//
// The in-process transport calls the target's respond directly, with data
// pointing at the requester's registered memory, so bytes move with one
// copy. The cross-process transport (peer in service.go, conn in conn.go)
// marshals the request and the gathered payload, runs respond in the
// target process against a span over the received payload (or, for reads,
// over a reply buffer) and returns the response; nothing else changes.

// link carries one request to the responder side of a remote QP and
// returns its response. exec must not retain req, data or resp.
//
// data is the requester's gather list for sends and writes (read by the
// responder) and its scatter list for RDMA reads (written by the
// responder). The requester keeps the memory behind data valid for the
// duration of exec.
type link interface {
	exec(req *request, data []span, resp *response)
}

// waker is something to notify when a condition that made a request wait
// (no receive posted, target QP not yet ready) may have cleared. For the
// in-process transport it is the requester QP itself; a cross-process
// transport passes a proxy that forwards the notification.
type waker interface {
	wake()
}

// reqOp is the operation of a request.
type reqOp uint8

const (
	opSend reqOp = iota
	opSendImm
	opWrite
	opWriteImm
	opRead
	opCAS
	opFAA
)

// isWrite reports whether op is an RDMA write, with or without immediate
// data.
func (op reqOp) isWrite() bool { return op == opWrite || op == opWriteImm }

// request is one message from a requester to a responder.
type request struct {
	op        reqOp
	qpType    uint8 // prov.QPType of the requester
	solicited bool
	srcQPN    uint32
	dstQPN    uint32
	srcFabric uint64 // the requester's fabric id
	srcConn   *conn  // the connection it came on (nil: from this process)
	psn       uint32 // first PSN of the message (RC)
	npkts     uint32 // packets (PSNs) the message uses
	mtu       uint32 // requester's path MTU in bytes
	length    uint32 // message length (RDMA: DMA length)
	raddr     uint64
	rkey      uint32
	imm       uint32 // host order
	compare   uint64
	swap      uint64 // CAS swap value; FAA add value is in compare
	qkey      uint32 // UD: effective Q_Key

	// UD: what the receiver's GRH shows.
	sgid     [16]byte
	dgid     [16]byte
	tclass   uint8
	hopLimit uint8
	flow     uint32

	// waker is notified when an RNR or not-ready condition may have
	// cleared (nil: do not notify).
	waker waker

	// owner is the requester QP (nil for requests from another process).
	owner *qp

	// direct: a RC write whose bytes the requester copies into the
	// region itself once the responder accepted it (shared memory).
	direct bool

	// pull: the payload is in the requester's memory, not in data
	// (cma.go): the responder reads it from there.
	pull *pullSrc

	// A segment of a message sent in several (wire.go): off is where its
	// bytes start in the message, more says that more follow. psn and
	// npkts are then those of the segment; length is the message's.
	// The in-process transport sends whole messages (off 0, more false).
	off  uint32
	more bool

	// deferRead: an RDMA read whose data the responder does not copy: it
	// names the region it checked in response.src (the connection sends
	// the data, see conn.sendRead).
	deferRead bool

	// placed: the payload of this write segment was read straight into
	// this region, at data (place.go); the responder does not copy it.
	placed *mr
}

// respCode is the responder's answer.
type respCode uint8

const (
	respACK      respCode = iota // executed
	respDropped                  // silently dropped: UC/UD normal; RC requester times out
	respNoQP                     // no such QP: RC requester times out
	respNotReady                 // target QP in RESET/INIT: dropped, a retry may succeed
	respRNR                      // RNR NAK; rnrTimer is the responder's min_rnr_timer
	respSeqErr                   // PSN sequence error NAK
	respInvReq                   // NAK: invalid request
	respAccess                   // NAK: remote access error
	respOpErr                    // NAK: remote operational error
	respPullLost                 // a pulled request's claim was gone (cma.go): not executed
	respStale                    // a direct write with immediate named another region than the one the key names (shm.go): not executed

	// respSilent is not on the wire: the responder drops a segment
	// without an answer (the segment of a message it refused or never
	// saw begin, like the rest of a NAKed message's packets).
	respSilent
)

type response struct {
	code     respCode
	rnrTimer uint8
	more     bool   // a segment of read data that more follow (wire.go)
	pulled   bool   // read: the payload says where the requester reads the data (cma.go)
	orig     uint64 // atomics: the prior value; read data: the segment's offset
	src      *mr    // deferRead: the region checked (not pinned)
}

// localLink is the in-process transport: the target QP is in this process'
// fabric and runs the request in the caller's goroutine.
type localLink struct{ f *fabric }

func (l *localLink) exec(req *request, data []span, resp *response) {
	t := l.f.qps.load(req.dstQPN)
	if t == nil {
		resp.code = respNoQP
		return
	}
	t.respond(req, data, resp)
}
