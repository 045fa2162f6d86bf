// Package session connects two processes over RDMA in one call and gives
// them what async-rdma gives Rust programs: messages with flow control,
// one-sided reads, writes and atomics on memory the peer hands out, and
// an agent that serves the peer's requests for memory behind the API.
//
// # Model
//
// A Listener (Listen) accepts sessions; Dial connects to one. Any number
// of sessions per Listener, independent of each other and of the
// Listener; a client whose server restarted simply dials again.
//
// Setting up runs over a TCP bootstrap connection: both sides prove the
// shared Config.Token (HMAC over both sides' nonces, bound to the TLS
// session when the connection leaves the host, which it then does
// encrypted), agree on a device (a hardware device that routes to the
// peer on both sides, else soft0), and exchange the endpoints of two RC
// queue pairs: one for the application's messages and RDMA operations,
// one for the agents. The bootstrap connection then carries keepalives:
// Done and Err report the peer's end within bounded time, even to a side
// that only waits for messages (ErrPeerClosed: it closed the session;
// ErrPeerLost: its process died or the connection broke;
// ErrPeerUnresponsive: it answered no keepalive for Config.Keepalive).
// Transport says what carries the session ("soft0/shm", "rc/rxe0 ...").
//
// Messages: Send (and SendImm, SendSlice) and Receive (or ReceiveInto).
// Each side posts Config.ReceiveBuffers buffers of Config.MessageSize
// bytes, and a sender holds one credit per buffer of its peer, so it
// never meets "receiver not ready": when credits run out it waits. A
// received Message lies in a library buffer until Release (zero copy);
// ReceiveInto copies it out instead. Buffers go back to the sender in the
// order their messages came, as a receive queue's do: a message held
// keeps the buffers of those after it from the sender until its Release,
// so a receiver can get at most ReceiveBuffers-1 messages past the oldest
// one it holds (copy out what it keeps longer). Messages larger than a
// buffer go by rendezvous: the sender registers a window of the message,
// the receiver reads it into memory of its allocator and tells the
// sender's agent.
// Send returns once the message is delivered (and a delivered message is
// received even if the peer closed the session since: Receive reports the
// end after the last one); PostSendSlice returns once it is posted, with a
// Pending to Wait for (or Release) once, so that one goroutine can keep
// several messages in flight.
//
// Memory: each session has an Allocator of registered memory (arenas
// registered once, size classes, handles as values). Memory of the peer
// comes as a RemoteMR: requested from the peer's agent
// (RequestRemoteMR, zeroed, for a lease), or offered by the peer's
// application (SendLocalMR, then ReceiveRemoteMR). A RemoteMR can be
// handed back to its owner (SendRemoteMR, then the owner's
// ReceiveLocalMR) or released. Each grant is a window of its own
// (registered with exactly the access granted), so the end of a lease,
// a revocation, a release or a hand-back closes it and the peer's next
// access fails on the device; this side refuses beforehand what it
// knows would fail (ErrOutOfBounds, ErrAccess, ErrLeaseExpired,
// ErrMisaligned), so the session is not broken by a mistake. Config caps
// what the peer may hold (MaxGranted) and ask for at once (MaxRequest).
// Each agent sleeps between control messages far apart, so an isolated
// RequestRemoteMR costs two wake-ups of a sleeping thread (one per side);
// in a burst (the last two control messages less than a millisecond
// apart) an agent polls for a while before it sleeps, so requests in a
// loop find the agents awake (about a fifth of the time over soft0).
// Config.AgentSpin, set on both sides, has them poll after every
// message, isolated ones too, for processor time after each.
//
// # Contexts and cancellation
//
// Every call that can block takes a context. Ending it never breaks the
// session: a request the device already has stays in flight, its
// buffers held by the library until it completes (then they are
// freed); the call returns the context's error. A message whose Send
// was cancelled may still be delivered; a Receive that was cancelled
// loses nothing (the next Receive returns the message). Only a
// transport failure, a protocol violation of the peer, or either side's
// Close ends a session.
//
// # Lifetimes and concurrency
//
// A Session, Listener, Allocator and RemoteMR are safe for concurrent
// use. Receives take turns (messages are returned in the order they
// were sent). Close ends the session for both sides; regions of its
// allocator become invalid, and windows granted to the peer are closed.
// Messages must be released, regions freed; a region granted to the
// peer (SendLocalMR) must stay allocated until the grant ends.
package session
