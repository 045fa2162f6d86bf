package prov

import (
	"errors"
	"fmt"
)

// Sentinel errors shared by the public package and the providers. The public
// package re-exports them, so errors.Is works across the boundary.
var (
	// ErrNotSupported: the provider or device does not support the operation.
	// It matches errors.ErrUnsupported.
	ErrNotSupported = fmt.Errorf("not supported: %w", errors.ErrUnsupported)
	// ErrClosed: the object was closed.
	ErrClosed = errors.New("use of closed object")
	// ErrNoDevice: no device by that name.
	ErrNoDevice = errors.New("no such device")
	// ErrQueueFull: more work requests than the queue holds (errno ENOMEM).
	ErrQueueFull = errors.New("queue full")
	// ErrTimeout: a deadline passed.
	ErrTimeout = errors.New("timed out")
	// ErrWoken: CompChannel.Wait returned for a Wake, not for an event.
	ErrWoken = errors.New("woken")
)

// Errno pairs a sentinel with the errno a real provider would return, so
// that errors.Is matches both (e.g. ErrQueueFull and syscall.ENOMEM).
type Errno struct {
	Sentinel error
	Errno    error
	Msg      string
}

func (e *Errno) Error() string {
	if e.Msg != "" {
		return e.Msg
	}
	if e.Sentinel != nil {
		return e.Sentinel.Error()
	}
	return e.Errno.Error()
}

// Unwrap returns both the sentinel and the errno.
func (e *Errno) Unwrap() []error {
	var errs []error
	if e.Sentinel != nil {
		errs = append(errs, e.Sentinel)
	}
	if e.Errno != nil {
		errs = append(errs, e.Errno)
	}
	return errs
}
