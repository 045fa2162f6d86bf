package session

import "errors"

var (
	// ErrPeerClosed: the peer closed the session (Session.Close on its
	// side, or its Listener/process ended it cleanly).
	ErrPeerClosed = errors.New("session: the peer closed the session")
	// ErrPeerLost: the peer is gone without closing: its process was
	// killed, or the connection to it broke.
	ErrPeerLost = errors.New("session: the peer is lost")
	// ErrPeerUnresponsive: the peer stopped answering keepalives for
	// longer than Config.Keepalive, or acknowledged no request within
	// its queue pair's transport timeout (a stopped or wedged process).
	ErrPeerUnresponsive = errors.New("session: the peer stopped answering")
	// ErrClosed: the session, listener or allocator was closed by this
	// side, or a handle (region, message) was already freed or released.
	ErrClosed = errors.New("session: closed")
	// ErrOutOfBounds: a slice of a local or remote region does not lie
	// inside it. Nothing was posted.
	ErrOutOfBounds = errors.New("session: out of bounds")
	// ErrAccess: the operation needs an access right the region was not
	// granted (or, for a grant, more than the region allows). Nothing
	// was posted.
	ErrAccess = errors.New("session: access not granted")
	// ErrLeaseExpired: the lease of a remote region ended (or it was
	// revoked or handed back). Nothing was posted.
	ErrLeaseExpired = errors.New("session: lease expired")
	// ErrLimit: a configured cap (memory of an allocator, memory granted
	// to or requested by the peer, message size) would be exceeded, or
	// the peer's queue of offered regions its application has not taken
	// (ReceiveRemoteMR) is full, or the peer could not allocate or
	// register the memory asked of it (its own limits: memory, the
	// locked-memory limit).
	ErrLimit = errors.New("session: limit exceeded")
	// ErrAuth: the peer did not prove the shared token (or proved
	// another one).
	ErrAuth = errors.New("session: authentication failed")
	// ErrProtocol: the peer sent something this side cannot accept
	// (malformed, out of order, or of another protocol version).
	ErrProtocol = errors.New("session: protocol error")
)
