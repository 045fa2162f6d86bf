// Package provproxy runs the objects of a provider in another process: a
// Client is a prov.Provider whose contexts, PDs, MRs, CQs, completion
// channels, QPs, SRQs and AHs forward every call to a server (Serve) in a
// peer process, which executes it on its own provider (the soft provider,
// in the tests that use it). verbstest uses it to run the unchanged
// conformance suite with side B in a peer process: side B's verbs objects
// live in the test process, but its queue pairs, completion queues, keys
// and data movement live in the peer, so every byte between the sides
// crosses the provider's real inter-process transport.
//
// # Model
//
// Client and server talk over a unix SOCK_SEQPACKET socket pair (Pair;
// Start hands one end to a child process, ServeEnv serves it there). A
// message is one packet: a header (kind, operation, request id) and a
// compact binary payload (codec.go, wire.go). Requests are multiplexed:
// each carries an id chosen by the client, the server runs each in a
// goroutine of its own and answers with the same id, so a blocking call
// (CompChannel.Wait, Context.AsyncEvent) does not hold up others. When the
// context of a blocking call ends, the client sends a cancel for its id
// and waits for the answer, which the server sends as soon as the wait
// it cancelled returns.
//
// Objects are named by ids the server assigns; references inside data
// (the CQs and SRQ of a QP, the AH of a UD work request, the element of an
// async event, the CQ a completion channel returns, Query results) are
// translated between ids and each side's objects. Values that never
// change are returned when an object is created and answered locally
// afterwards: the QPN, an MR's address, length and keys, a CQ's capacity.
// An AH's Handle is its id, which the server replaces by its provider's
// handle when it posts.
//
// Memory: RegMR needs memory with a file descriptor (verbs' Alloc makes
// memfd-backed mappings). The descriptor travels with the request
// (SCM_RIGHTS); the server checks that it is a memfd sealed at its size
// and large enough, maps it (MAP_SHARED) and registers that mapping, with
// the descriptor, so that its provider can share it further. Both
// processes see the same pages. The MR's address and keys are the
// server's, so the SGEs of work requests and the remote addresses peers
// target need no translation: they are addresses in the server. Memory
// without a descriptor (Go memory from verbs' Register) cannot be mapped
// by the server and is refused with an error wrapping
// prov.ErrNotSupported. Closing the MR unmaps it in the server; the
// client's mapping belongs to whoever allocated it.
//
// Inline sends: a provider reads inline data through the SGE addresses,
// without a key check. The server posts an inline work request only if
// each of its SGEs lies inside one MR registered through the QP's
// context (in the server's address space), and fails the post with
// EINVAL otherwise, so a client can never make the server read an
// arbitrary address. MRs cannot go away while such a post reads them.
//
// Posts are one call each (split into several only if a batch does not
// fit into one message, keeping the order); a poll is one call returning
// at most 1024 completions.
//
// # Lifetime
//
// Objects are closed by their Close methods, as with any provider. When
// the connection ends (Client.Close, or the client process dies), the
// server cancels the requests still waiting, closes every object still
// open (children first) and Serve returns: an error if objects were left
// open or the connection broke, so that a peer process can exit non-zero
// and make its test fail. When the connection ends on the client's side
// without Client.Close (the peer process exited, was killed or sent a
// malformed packet), every outstanding and later call fails with an error
// wrapping ErrConnLost and the cause. A peer that is alive but does not
// answer (stopped, hung) ends the connection the same way once the call
// guard has passed (DefaultCallGuard, Client.SetCallGuard): it bounds every
// call that cannot block in the provider and whose ctx has no deadline,
// and the answer to a cancellation, so no call waits for ever on a peer.
// Malformed messages never panic:
// a payload that does not decode fails its call; a packet that cannot be
// attributed to a call ends the connection.
//
// # Concurrency
//
// A Client and every object made through it are safe for concurrent use.
// Calls from several goroutines are in flight at the same time; the server
// executes them concurrently, and calls made one after the other reach the
// provider in that order. Posts to one queue are serialized on the client
// so that a split post stays contiguous.
package provproxy
