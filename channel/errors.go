package channel

import (
	"errors"
	"fmt"

	"github.com/goverbs/verbs"
)

// Sentinel errors. Errors of this package wrap them (and the verbs errors
// that caused them) where they apply; test with errors.Is.
var (
	// ErrBroken: the queue pair to the peer is in the error state, because
	// an operation failed (the cause is wrapped too), a blocking call was
	// cancelled, or Break was called. A broken channel stays broken; close
	// it and build a new one.
	ErrBroken = errors.New("channel: broken")
	// ErrNotConnected: the channel (or the peer's queue pair) has not been
	// connected yet.
	ErrNotConnected = errors.New("channel: not connected")
	// ErrStale: a Handle was used after its operation was released (after
	// Release, or after the Batch scope that created it returned).
	ErrStale = errors.New("channel: stale handle")
	// ErrNoPeer: the peer number is out of range or names this process
	// itself.
	ErrNoPeer = errors.New("channel: no such peer")
	// ErrNotPosted: the operation was never handed to the device (its scope
	// ended with an error or a panic before it was flushed, or an earlier
	// request of the same post failed), or, from a wait outside its Batch
	// (Handle.Wait, Handle.Poll, another scope's waits), it is still queued
	// in its Batch: the handle stays valid, and the Batch's waits post it.
	ErrNotPosted = errors.New("channel: operation not posted")
	// ErrDisconnected: the peer of a channel connected through the RDMA
	// CM (DialCM, AcceptCM) disconnected: it closed its channel, or its
	// process ended. The channel is broken with this cause.
	ErrDisconnected = errors.New("channel: the peer disconnected")
)

// ErrClosed is verbs.ErrClosed: the channel was closed.
var ErrClosed = verbs.ErrClosed

// OpError is the error of one operation: which operation, to which peer,
// and the cause (a *verbs.CompletionError, a *verbs.OpError, a context
// error, or one of this package's sentinels).
type OpError struct {
	Op   string // "send", "receive", "write", "write with immediate", "read", "compare-and-swap", "fetch-and-add", ...
	Peer int    // peer number (always 0 for a Channel of its own)
	Err  error
}

func (e *OpError) Error() string {
	return fmt.Sprintf("channel: %s (peer %d): %v", e.Op, e.Peer, e.Err)
}

func (e *OpError) Unwrap() error { return e.Err }

// brokenError is the cause a broken peer reports: ErrBroken and the reason.
type brokenError struct{ cause error }

func (e *brokenError) Error() string {
	return "channel: broken: " + e.cause.Error()
}

func (e *brokenError) Unwrap() []error { return []error{ErrBroken, e.cause} }
