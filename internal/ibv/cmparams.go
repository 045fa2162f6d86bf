// RDMA connection manager API shared by the hardware build and the stub.

package ibv

import (
	"errors"

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
	// QP once the device is known (e.g. to pick a context per device).
	NewQP func(device string, port uint8) (prov.QP, error)
	// Access is the QP's remote access; zero means local write and remote
	// read, write and atomic.
	Access prov.Access
	// PrivateData goes with the request (Dial), the reply (Accept).
	PrivateData []byte
	// ResponderResources and InitiatorDepth bound outstanding RDMA reads
	// and atomics (zero: 16, within the device's limits).
	ResponderResources, InitiatorDepth uint8
	// RetryCount and RNRRetryCount: zero means 7 (7 = infinite RNR retry).
	RetryCount, RNRRetryCount uint8
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
