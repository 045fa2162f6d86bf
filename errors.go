package verbs

import (
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// Sentinel errors. Errors returned by this module wrap them where they apply,
// so test with errors.Is.
var (
	// ErrNotSupported: the provider, device or transport lacks the feature.
	// errors.Is(err, errors.ErrUnsupported) also holds.
	ErrNotSupported = prov.ErrNotSupported
	// ErrClosed: the object (or its parent) was closed.
	ErrClosed = prov.ErrClosed
	// ErrNoDevice: no device by that name, or none at all.
	ErrNoDevice = prov.ErrNoDevice
	// ErrQueueFull: a post would exceed the queue's depth (errno ENOMEM).
	ErrQueueFull = prov.ErrQueueFull
	// ErrTimeout: a deadline passed before the operation finished.
	ErrTimeout = prov.ErrTimeout
)

// OpError is the error of a verbs call: which operation, on which device,
// and the cause (usually a syscall.Errno or one of the sentinels).
type OpError struct {
	Op     string // e.g. "post send", "modify qp", "register mr"
	Device string // device name, "" when unknown
	Err    error
}

func (e *OpError) Error() string {
	if e.Device != "" {
		return "verbs: " + e.Op + " on " + e.Device + ": " + e.Err.Error()
	}
	return "verbs: " + e.Op + ": " + e.Err.Error()
}

func (e *OpError) Unwrap() error { return e.Err }

func opErr(op, dev string, err error) error {
	if err == nil {
		return nil
	}
	return &OpError{Op: op, Device: dev, Err: err}
}

// PostError reports a post that failed part-way: the first Posted requests
// of the batch were accepted (and will complete), the rest were not.
type PostError struct {
	Posted int
	Err    error
}

func (e *PostError) Error() string {
	return fmt.Sprintf("%v (request %d of the batch failed; %d accepted)", e.Err, e.Posted, e.Posted)
}

func (e *PostError) Unwrap() error { return e.Err }

// Status is the status of a completion (enum ibv_wc_status).
type Status uint32

// Completion statuses.
const (
	StatusSuccess        = Status(prov.StatusSuccess)
	StatusLocLenErr      = Status(prov.StatusLocLenErr)
	StatusLocQPOpErr     = Status(prov.StatusLocQPOpErr)
	StatusLocEECOpErr    = Status(prov.StatusLocEECOpErr)
	StatusLocProtErr     = Status(prov.StatusLocProtErr)
	StatusWRFlushErr     = Status(prov.StatusWRFlushErr)
	StatusMWBindErr      = Status(prov.StatusMWBindErr)
	StatusBadRespErr     = Status(prov.StatusBadRespErr)
	StatusLocAccessErr   = Status(prov.StatusLocAccessErr)
	StatusRemInvReqErr   = Status(prov.StatusRemInvReqErr)
	StatusRemAccessErr   = Status(prov.StatusRemAccessErr)
	StatusRemOpErr       = Status(prov.StatusRemOpErr)
	StatusRetryExcErr    = Status(prov.StatusRetryExcErr)
	StatusRNRRetryExcErr = Status(prov.StatusRNRRetryExcErr)
	StatusLocRDDViolErr  = Status(prov.StatusLocRDDViolErr)
	StatusRemInvRDReqErr = Status(prov.StatusRemInvRDReqErr)
	StatusRemAbortErr    = Status(prov.StatusRemAbortErr)
	StatusInvEECNErr     = Status(prov.StatusInvEECNErr)
	StatusInvEECStateErr = Status(prov.StatusInvEECStateErr)
	StatusFatalErr       = Status(prov.StatusFatalErr)
	StatusRespTimeoutErr = Status(prov.StatusRespTimeoutErr)
	StatusGeneralErr     = Status(prov.StatusGeneralErr)
)

// StatusClass groups statuses by who is at fault.
type StatusClass int

// Status classes.
const (
	ClassSuccess       StatusClass = iota
	ClassLocalProgram              // the local program posted something invalid
	ClassLocalResource             // a local queue or resource ran out
	ClassRemote                    // the remote side rejected the request
	ClassTransport                 // the network or peer did not answer
	ClassFlush                     // flushed because the QP entered the error state
	ClassFatal                     // the device failed
)

var classNames = [...]string{"success", "local programming error", "local resource error",
	"remote error", "transport error", "flushed", "fatal error"}

func (c StatusClass) String() string {
	if c < 0 || int(c) >= len(classNames) {
		return fmt.Sprintf("StatusClass(%d)", int(c))
	}
	return classNames[c]
}

var statusInfo = [...]struct {
	name  string
	class StatusClass
	hint  string
}{
	StatusSuccess:        {"success", ClassSuccess, ""},
	StatusLocLenErr:      {"local length error", ClassLocalProgram, "the receive buffer is smaller than the incoming message, or a UD send is larger than the path MTU"},
	StatusLocQPOpErr:     {"local QP operation error", ClassLocalProgram, "the work request is invalid for this QP (opcode, inline size, SGE count) or the QP is misconfigured"},
	StatusLocEECOpErr:    {"local EE context operation error", ClassLocalProgram, "EE context error"},
	StatusLocProtErr:     {"local protection error", ClassLocalProgram, "an SGE uses a wrong lkey, lies outside its memory region, or the region lacks LocalWrite for data written into it"},
	StatusWRFlushErr:     {"work request flushed error", ClassFlush, "the QP entered the error state (look for the first non-flush error) or was moved there by the user"},
	StatusMWBindErr:      {"memory window bind error", ClassLocalProgram, "memory window bind failed"},
	StatusBadRespErr:     {"bad response error", ClassTransport, "the responder sent an unexpected transport-layer opcode"},
	StatusLocAccessErr:   {"local access error", ClassLocalProgram, "a protection error on a local buffer of an RDMA read or atomic response"},
	StatusRemInvReqErr:   {"remote invalid request error", ClassRemote, "the receive buffer at the peer is too small, the operation is not supported by the peer QP, or the message exceeds the peer's limits"},
	StatusRemAccessErr:   {"remote access error", ClassRemote, "wrong rkey, access outside the remote memory region, or the region or QP lacks the remote access flag (RemoteWrite, RemoteRead, RemoteAtomic) or the atomic address is not 8-byte aligned"},
	StatusRemOpErr:       {"remote operation error", ClassRemote, "the responder could not complete the operation (for example a protection error on its receive buffer)"},
	StatusRetryExcErr:    {"transport retry counter exceeded", ClassTransport, "the peer did not acknowledge: it is gone, unreachable, or the path (GID, LID, MTU) is wrong"},
	StatusRNRRetryExcErr: {"RNR retry counter exceeded", ClassTransport, "the peer had no receive posted for a send: post receives before the sender sends, or raise rnr_retry / min_rnr_timer"},
	StatusLocRDDViolErr:  {"local RDD violation error", ClassLocalProgram, "RD domain violation"},
	StatusRemInvRDReqErr: {"remote invalid RD request", ClassRemote, "invalid RD request"},
	StatusRemAbortErr:    {"operation aborted", ClassRemote, "the responder aborted the operation"},
	StatusInvEECNErr:     {"invalid EE context number", ClassLocalProgram, "invalid EE context number"},
	StatusInvEECStateErr: {"invalid EE context state", ClassLocalProgram, "invalid EE context state"},
	StatusFatalErr:       {"fatal error", ClassFatal, "the device reported a fatal error"},
	StatusRespTimeoutErr: {"response timeout error", ClassTransport, "the responder did not answer in time"},
	StatusGeneralErr:     {"general error", ClassFatal, "an unspecified error"},
}

func (s Status) String() string {
	if int(s) < len(statusInfo) && statusInfo[s].name != "" {
		return statusInfo[s].name
	}
	return fmt.Sprintf("status %d", uint32(s))
}

// Class returns the status class.
func (s Status) Class() StatusClass {
	if int(s) < len(statusInfo) && statusInfo[s].name != "" {
		return statusInfo[s].class
	}
	return ClassFatal
}

// Hint names the usual cause of a failure status.
func (s Status) Hint() string {
	if int(s) < len(statusInfo) {
		return statusInfo[s].hint
	}
	return ""
}

// CompletionError is the error of a completion with a failure status.
type CompletionError struct {
	Status    Status
	VendorErr uint32
	WRID      uint64
	QPN       uint32
	Opcode    Opcode
}

func (e *CompletionError) Error() string {
	s := fmt.Sprintf("verbs: completion error: %s (status %d, vendor error %#x) for wr_id %#x on qp %d",
		e.Status, uint32(e.Status), e.VendorErr, e.WRID, e.QPN)
	if h := e.Status.Hint(); h != "" {
		s += ": " + h
	}
	return s
}

// Class returns the status class of the error.
func (e *CompletionError) Class() StatusClass { return e.Status.Class() }

// Is matches another *CompletionError with the same status, so that
// errors.Is(err, &CompletionError{Status: StatusRemAccessErr}) works.
func (e *CompletionError) Is(target error) bool {
	t, ok := target.(*CompletionError)
	return ok && t.Status == e.Status
}
