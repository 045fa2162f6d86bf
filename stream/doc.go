// Package stream is a net.Conn and a net.Listener over a session: a byte
// stream between two processes carried by RDMA (or soft0), for code
// written against net.Conn (HTTP, gRPC, TLS, bufio protocols), as rsocket
// and SMC-R do for sockets.
//
// # Model
//
// A Conn owns the messages of one session.Session (Dial, Listener.Accept,
// or New on a session of the caller's): Write copies its bytes into
// registered memory of the session's allocator and posts them as
// messages of at most Session.PeerMessageSize bytes each (the size that
// travels in one RDMA write into the peer's receive buffers), or of
// Session.PeerMaxMessage if the peer takes no more, up to 16 in flight
// (at most half the session's Config.QueueDepth, one at least: each
// holds one of its request tokens until the stream saw it delivered;
// fewer, and smaller, when the allocator's MaxMemory has no room for
// more); Read copies out of the message at the head of the stream and
// releases its buffer once it has copied the last byte. Flow control is
// the session's: a writer whose peer does not read waits for credits, so
// nothing is dropped and nothing grows without bound. The session's
// remote memory operations (Session) stay available beside the stream;
// its messages do not: the stream owns them.
//
// Write returns once its bytes are posted (the library holds its copy
// until the peer's device has them), as a socket's Write returns once
// the kernel holds them. Close stops a Write under way (it reports the
// bytes it posted), waits for the messages posted to be delivered, then
// closes the session: the peer reads everything written before Close,
// then io.EOF. CloseWrite ends this direction only (an
// empty message with immediate data 1 marks the end; the peer's Read
// returns io.EOF after the bytes before it) and keeps reading.
//
// # Deadlines and errors
//
// SetDeadline, SetReadDeadline and SetWriteDeadline work as on a socket:
// a call blocked when its deadline passes, or one made after it, returns
// an error whose Timeout is true (os.ErrDeadlineExceeded in a
// *net.OpError), and the Conn stays usable: a Read that timed out loses
// nothing, a Write that timed out reports how many bytes it posted (the
// rest was not). Moving a deadline affects calls already blocked. Errors
// are *net.OpError with Net "goverbs" wrapping the cause: net.ErrClosed
// after Close, the session's error (session.ErrPeerLost, ...) when it
// ended otherwise; Read returns io.EOF itself when the peer closed or
// called CloseWrite. A Write past a posted message's delivery may wait
// for it while the session lives (the peer's device acknowledges it
// without the peer reading); the session's keepalive bounds that wait if
// the peer stops answering.
//
// # Lifetimes and concurrency
//
// A Conn is safe for concurrent use: Reads take turns, Writes take turns
// (the bytes of one Write are contiguous in the stream), and Close,
// SetDeadline and the address methods may be called at any time. Close
// unblocks every call. A Listener is safe for concurrent use; Close stops
// Accept and leaves the Conns it accepted open.
package stream
