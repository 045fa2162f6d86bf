// RDMA connection manager API shared by the hardware build and the stub.

package ibv

import (
	"errors"
	"net/netip"

	"github.com/goverbs/verbs/internal/prov"
)

// CMParams describes the QP a connection uses and the values exchanged.
type CMParams struct {
	// PD, SendCQ and RecvCQ must belong to the device the connection's route
	// uses (ConnRequest.Device on the passive side; on the active side the
	// device owning the local address that reaches the peer). SRQ is
	// optional.
	PD             prov.PD
	SendCQ, RecvCQ prov.CQ
	SRQ            prov.SRQ
	Cap            prov.QPCap
	SignalAll      bool
	// NewQP, when set, replaces PD/SendCQ/RecvCQ/SRQ/Cap: it creates the RC
	// QP once the route is known (e.g. to pick a context per device). It
	// may also set the other fields of *p, except PrivateData, before they
	// are used. A QP it returns stays the caller's, even when the
	// connection fails.
	NewQP func(r Route, p *CMParams) (prov.QP, error)
	// Access is the QP's access flags, set exactly (replacing the CM's
	// choice) when the QP enters INIT; zero means local write and remote
	// read, write and atomic.
	Access prov.Access
	// PrivateData goes with the request (Dial), the reply (Accept).
	PrivateData []byte
	// ResponderResources and InitiatorDepth bound outstanding RDMA reads
	// and atomics (zero: 16, within the device's limits).
	ResponderResources, InitiatorDepth uint8
	// RetryCount and RNRRetryCount are sent to the peer and set on the
	// local QP at RTS: zero means 7 (7 = infinite RNR retry), -1 none.
	RetryCount, RNRRetryCount int
	// MinRNRTimer, when not zero, replaces the CM's RNR NAK timer (IB
	// encoding; the kernel CM uses 0 = 655 ms) at RTR.
	MinRNRTimer uint8
	// Timeout, when not zero, replaces the CM's local ACK timeout
	// exponent at RTS; 0xff means no timeout.
	Timeout uint8
	// MaxMTU, when not zero, caps the path MTU the route gives.
	MaxMTU prov.MTU
}

// Route is where an address resolves to: the local RDMA device and port
// and the IP endpoints.
type Route struct {
	Device        string
	Port          uint8
	Local, Remote netip.AddrPort
}

// RejectError is a connection request the peer rejected.
type RejectError struct {
	Status      int    // CM reject reason (28: rejected by the consumer)
	PrivateData []byte // the peer's reject data (padded by the CM)
	err         error
}

func (e *RejectError) Error() string { return e.err.Error() }
func (e *RejectError) Unwrap() error { return e.err }

// IsRejected reports whether err is a rejected connection request.
func IsRejected(err error) bool {
	var r *RejectError
	return errors.As(err, &r)
}
