package provproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// The protocol. Every message is one SOCK_SEQPACKET packet: a header
//
//	kind  uint8   kindRequest, kindResponse or kindCancel
//	op    uint8   the operation (a response repeats its request's)
//	id    uint64  little endian: the request's id, chosen by the client
//
// followed by the payload, the encoding (codec.go) of the operation's
// request struct, or for a response, a wireError followed by the
// operation's response struct. A cancel has no payload. A request that
// carries a file descriptor (opRegMR) sends it with the packet, as
// SCM_RIGHTS. No packet is longer than maxMsg bytes.

// protocolVersion is checked by opHello.
const protocolVersion = 1

const (
	headerLen = 10
	// maxMsg bounds a packet. Posts are split and polls are capped so
	// that no message comes close (see maxPoll, maxPostBytes).
	maxMsg = 64 << 10
	// maxPoll is the most completions one poll request returns.
	maxPoll = 1024
	// maxPostBytes bounds the encoded work requests and SGEs of one post
	// request.
	maxPostBytes = 48 << 10
	// encoded sizes of the data-path structs (see codec.go)
	sendWRSize = 5*8 + 8*4
	recvWRSize = 8 + 2*4
	sgeSize    = 8 + 2*4
)

// Message kinds.
const (
	kindRequest  = 1
	kindResponse = 2
	kindCancel   = 3
)

type opcode uint8

// Operations.
const (
	opHello opcode = iota + 1
	opOpen
	opQueryDevice
	opQueryPort
	opQueryGIDTable
	opAllocPD
	opCreateCompChannel
	opCreateCQ
	opAsyncEvent
	opClose
	opRegMR
	opCreateQP
	opCreateSRQ
	opCreateAH
	opChanWait
	opPoll
	opArm
	opModifyQP
	opQueryQP
	opPostSend
	opPostRecv
	opQPAddress
	opSRQPostRecv
	opSRQModify
	opSRQQuery
	opQPLink
	opChanWake
	numOps
)

var opNames = [numOps]string{
	opHello: "hello", opOpen: "open device", opQueryDevice: "query device", opQueryPort: "query port",
	opQueryGIDTable: "query gid table", opAllocPD: "alloc pd", opCreateCompChannel: "create completion channel",
	opCreateCQ: "create cq", opAsyncEvent: "get async event", opClose: "close", opRegMR: "register mr",
	opCreateQP: "create qp", opCreateSRQ: "create srq", opCreateAH: "create ah", opChanWait: "wait for completion event",
	opPoll: "poll cq", opArm: "arm cq", opModifyQP: "modify qp", opQueryQP: "query qp", opPostSend: "post send",
	opPostRecv: "post recv", opQPAddress: "qp address", opSRQPostRecv: "post srq recv", opSRQModify: "modify srq",
	opSRQQuery: "query srq", opQPLink: "qp link", opChanWake: "wake completion channel",
}

func (o opcode) String() string {
	if o > 0 && o < numOps {
		return opNames[o]
	}
	return fmt.Sprintf("operation %d", uint8(o))
}

// header is a message header.
type header struct {
	kind uint8
	op   opcode
	id   uint64
}

func appendHeader(b []byte, h header) []byte {
	b = append(b, h.kind, uint8(h.op))
	return binary.LittleEndian.AppendUint64(b, h.id)
}

// parseHeader splits a packet into its header and payload. The operation
// is not checked: the receiver answers an unknown one (reqType and
// respType return nil for it).
func parseHeader(p []byte) (header, []byte, error) {
	if len(p) < headerLen {
		return header{}, nil, fmt.Errorf("%w: %d-byte packet, shorter than a header", errMalformed, len(p))
	}
	h := header{kind: p[0], op: opcode(p[1]), id: binary.LittleEndian.Uint64(p[2:])}
	switch {
	case h.kind < kindRequest || h.kind > kindCancel:
		return h, nil, fmt.Errorf("%w: message kind %d", errMalformed, h.kind)
	case h.kind == kindCancel && len(p) > headerLen:
		return h, nil, fmt.Errorf("%w: cancel with a %d-byte payload", errMalformed, len(p)-headerLen)
	}
	return h, p[headerLen:], nil
}

// Object kinds, for references to objects in data (async events).
const (
	objNone = iota
	objContext
	objPD
	objMR
	objCompChannel
	objCQ
	objQP
	objSRQ
	objAH
)

// Request and response payloads. Object references are the server's
// object ids; 0 is none.

type helloReq struct{ Version uint32 }

type helloResp struct {
	Version  uint32
	Provider string
	PID      int64
	Devices  []prov.DeviceInfo
}

type nameReq struct{ Name string }

// idReq names the object an operation applies to.
type idReq struct{ ID uint64 }

// idResp returns a new object.
type idResp struct{ ID uint64 }

type empty struct{}

type portReq struct {
	ID   uint64
	Port uint8
}

type deviceResp struct{ Attr prov.DeviceAttr }

type portResp struct{ Attr prov.PortAttr }

type gidResp struct{ Entries []prov.GIDEntry }

type createCQReq struct {
	Ctx     uint64
	CQE     int64
	Channel uint64
	Vector  int64
}

type createCQResp struct {
	ID  uint64
	Cap int64
}

type asyncEventResp struct {
	Type     uint32
	QPN      uint32
	Port     uint8
	ElemKind uint8
	Elem     uint64
}

// regMRReq registers Len bytes at Offset of the file descriptor sent
// with the request.
type regMRReq struct {
	PD     uint64
	Len    int64
	Offset int64
	Access uint32
}

type regMRResp struct {
	ID   uint64
	Addr uint64
	Len  int64
	LKey uint32
	RKey uint32
}

type createQPReq struct {
	PD        uint64
	Type      uint32
	SendCQ    uint64
	RecvCQ    uint64
	SRQ       uint64
	Cap       prov.QPCap
	SignalAll bool
}

type createQPResp struct {
	ID  uint64
	QPN uint32
}

type createSRQReq struct {
	PD   uint64
	Attr prov.SRQAttr
}

type createAHReq struct {
	PD   uint64
	Attr prov.AHAttr
}

type chanWaitResp struct{ CQ uint64 }

// pollReq polls up to Max completions; Spins > 0 is PollBusy.
type pollReq struct {
	CQ    uint64
	Max   int64
	Spins int64
}

type pollResp struct{ WCs []prov.Completion }

type armReq struct {
	CQ        uint64
	Solicited bool
}

type modifyQPReq struct {
	QP   uint64
	Attr prov.QPAttr
	Mask uint32
}

type queryQPResp struct {
	Attr      prov.QPAttr
	Type      uint32
	SendCQ    uint64
	RecvCQ    uint64
	SRQ       uint64
	Cap       prov.QPCap
	SignalAll bool
}

// postSendReq posts WRs whose SGEIndex values index SGEs. For UD QPs,
// each WR's AH is the object id of an address handle.
type postSendReq struct {
	QP   uint64
	WRs  []prov.SendWR
	SGEs []prov.SGE
}

// postRecvReq posts receives to a QP or an SRQ.
type postRecvReq struct {
	ID   uint64
	WRs  []prov.RecvWR
	SGEs []prov.SGE
}

// postResp is how many work requests were accepted; with an error, WRs[N]
// is the one that failed.
type postResp struct{ N int64 }

type addressResp struct{ Addr []byte }

type linkResp struct{ Link string }

type srqModifyReq struct {
	SRQ       uint64
	Attr      prov.SRQAttr
	LimitOnly bool
}

type srqQueryResp struct{ Attr prov.SRQAttr }

// reqType and respType return, per operation, a new request or response
// payload to decode into.
func reqType(op opcode) any {
	switch op {
	case opHello:
		return &helloReq{}
	case opOpen:
		return &nameReq{}
	case opQueryDevice, opAllocPD, opCreateCompChannel, opAsyncEvent, opClose,
		opChanWait, opQueryQP, opQPAddress, opSRQQuery, opQPLink, opChanWake:
		return &idReq{}
	case opQueryPort, opQueryGIDTable:
		return &portReq{}
	case opCreateCQ:
		return &createCQReq{}
	case opRegMR:
		return &regMRReq{}
	case opCreateQP:
		return &createQPReq{}
	case opCreateSRQ:
		return &createSRQReq{}
	case opCreateAH:
		return &createAHReq{}
	case opPoll:
		return &pollReq{}
	case opArm:
		return &armReq{}
	case opModifyQP:
		return &modifyQPReq{}
	case opPostSend:
		return &postSendReq{}
	case opPostRecv, opSRQPostRecv:
		return &postRecvReq{}
	case opSRQModify:
		return &srqModifyReq{}
	}
	return nil
}

func respType(op opcode) any {
	switch op {
	case opHello:
		return &helloResp{}
	case opOpen, opAllocPD, opCreateCompChannel, opCreateSRQ, opCreateAH:
		return &idResp{}
	case opQueryDevice:
		return &deviceResp{}
	case opQueryPort:
		return &portResp{}
	case opQueryGIDTable:
		return &gidResp{}
	case opCreateCQ:
		return &createCQResp{}
	case opAsyncEvent:
		return &asyncEventResp{}
	case opClose, opArm, opModifyQP, opSRQModify, opChanWake:
		return &empty{}
	case opRegMR:
		return &regMRResp{}
	case opCreateQP:
		return &createQPResp{}
	case opChanWait:
		return &chanWaitResp{}
	case opPoll:
		return &pollResp{}
	case opQueryQP:
		return &queryQPResp{}
	case opPostSend, opPostRecv, opSRQPostRecv:
		return &postResp{}
	case opQPAddress:
		return &addressResp{}
	case opQPLink:
		return &linkResp{}
	case opSRQQuery:
		return &srqQueryResp{}
	}
	return nil
}

// Sentinels that an error can match across the connection, as bits of
// wireError.Sentinels.
var sentinels = []error{
	prov.ErrNotSupported, prov.ErrClosed, prov.ErrNoDevice, prov.ErrQueueFull, prov.ErrTimeout,
	context.Canceled, context.DeadlineExceeded, errors.ErrUnsupported, prov.ErrWoken,
}

// wireError is the error of an operation, or Set false for none.
type wireError struct {
	Set       bool
	Msg       string
	Errno     uint32 // syscall.Errno the error wraps, or 0
	Sentinels uint32 // bit i: errors.Is(err, sentinels[i])
}

func toWire(err error) wireError {
	if err == nil {
		return wireError{}
	}
	w := wireError{Set: true, Msg: err.Error()}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		w.Errno = uint32(errno)
	}
	for i, s := range sentinels {
		if errors.Is(err, s) {
			w.Sentinels |= 1 << i
		}
	}
	return w
}

// remoteError is an error returned by the peer process: its message, and
// the errno and sentinels it matched there, so that errors.Is works on
// this side too.
type remoteError struct {
	msg  string
	errs []error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return e.errs }

func (w wireError) err() error {
	if !w.Set {
		return nil
	}
	e := &remoteError{msg: w.Msg}
	for i, s := range sentinels {
		// ErrNotSupported already matches errors.ErrUnsupported.
		if w.Sentinels&(1<<i) != 0 && !(s == errors.ErrUnsupported && w.Sentinels&1 != 0) {
			e.errs = append(e.errs, s)
		}
	}
	if w.Errno != 0 {
		e.errs = append(e.errs, syscall.Errno(w.Errno))
	}
	return e
}
