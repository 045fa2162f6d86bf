package soft

import (
	"fmt"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// errnof returns an error "soft: <msg>: <errno>" that wraps errno.
func errnof(errno syscall.Errno, format string, args ...any) error {
	return fmt.Errorf("soft: "+format+": %w", append(args, errno)...)
}

// closedErr returns an error for an operation on a closed object.
func closedErr(op string) error {
	return fmt.Errorf("soft: %s: %w", op, prov.ErrClosed)
}

// busyErr is the error of closing an object that others still use.
func busyErr(op string, n int, what string) error {
	return fmt.Errorf("soft: %s: still used by %d %s: %w", op, n, what, syscall.EBUSY)
}

// Preallocated errors of the data path, so that a caller retrying a post or
// a poll in a loop does not allocate.
var (
	errPostSendClosed = closedErr("post send")
	errPostRecvClosed = closedErr("post recv")
	errPollClosed     = closedErr("poll cq")
	errPostSendState  = errnof(syscall.EINVAL, "post send: the QP is not in RTS (or SQD/ERR)")
	errPostRecvState  = errnof(syscall.EINVAL, "post recv: the QP is in RESET")
	errPostRecvSRQ    = errnof(syscall.EINVAL, "post recv: the QP uses a shared receive queue; post to the SRQ")
	errCQOverflow     = errnof(syscall.EOVERFLOW, "poll cq: completion queue overflowed; it is in the error state")
	errSGERange       = errnof(syscall.EINVAL, "post: work request's SGE range lies outside the SGE slice")
)

func queueFullErr(msg string) error {
	return &prov.Errno{Sentinel: prov.ErrQueueFull, Errno: syscall.ENOMEM, Msg: msg}
}

const einval = syscall.EINVAL
