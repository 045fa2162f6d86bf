// Package channel provides reliable connected channels over RDMA: a
// Channel to one peer and a MultiChannel to many, with blocking
// operations, scoped batches of operations, and handles for callers that
// manage completions themselves.
//
// # Model
//
// A Channel is one RC queue pair and the completion queue that serves it.
// A MultiChannel is one RC queue pair per peer, all in one protection
// domain (memory registered once serves every peer) and all served by one
// completion queue. Peers are numbered; MultiChannel.Peer(i) is the
// Channel view of peer i.
//
// Both are built in two phases, like queue pairs: New or NewMulti creates
// the queue pairs (INIT); Endpoint or Endpoints describe them; the program
// exchanges the endpoints out of band (package cluster does it over TCP);
// Connect brings them to RTS. Receives may be posted before Connect.
//
// On the hardware provider, DialCM and AcceptCM build a Channel whose
// queue pair the RDMA connection manager connects by IP address instead
// (one call per side, private data both ways). A prepare function posts
// the receives the peer's first messages need, and a ready handshake
// makes sure both sides' prepare ran before either call returns; see
// DialCM.
//
// Operations:
//
//   - Blocking: Send, SendImm, Receive, Write, WriteImm, Read, CompareSwap,
//     FetchAdd post one request and wait for its completion. They take a
//     context: if it ends first, the call fails with an error wrapping
//     verbs.ErrTimeout and the context's error, and the channel is broken
//     (moved to the error state, which flushes the request), because an
//     RDMA device cannot give a posted request back any other way. When a
//     blocking call returns, the device no longer uses its buffers.
//   - Scoped: Batch runs a function in which operations are queued, get
//     Handles, are posted in doorbell batches (one provider call per run of
//     requests to one peer), and are waited for with Wait, WaitAny or
//     WaitAll. When the function returns, with an error, or panics, every
//     operation of the scope still in flight is polled before Batch
//     returns: no buffer of the scope is left to the device.
//   - Unpolled: the Post methods return a Handle at once. The caller owns
//     its completion: wait for it (Handle.Wait, which may time out and be
//     resumed without breaking anything), read its result, and Release it.
//     The buffers belong to the device until the handle has completed.
//   - Fire and forget: WriteInline posts an unsignaled inline write of a few
//     bytes (flags, doorbells). It generates no completion unless it
//     fails, which breaks the channel. PostWriteUnsignaled and
//     PostWriteImmUnsignaled do the same for writes of registered memory
//     (with immediate data: a doorbell) without blocking; the caller
//     orders the reuse of their memory by other means (the peer's answer,
//     a later request's completion). Package collective's flags and small
//     messages go so: a 2-rank barrier on soft0 shared memory took 10 %
//     less than with a slot and a completion per write.
//   - Collective, on a MultiChannel: ScatterSend, GatherReceive,
//     ScatterWrite, GatherRead and MulticastSend post one request per peer
//     at once and wait for all; failures name their peers (*OpError).
//
// RemoteRef and RemoteArray address values, array elements and struct
// fields inside a peer's region by their Go type, without hand-computed
// offsets.
//
// Messages need a receive posted at the peer before they arrive; one
// that arrives first is NAKed (receiver not ready) and retried, on
// hardware after the queue pair's RNR timer (0.64 ms by default). Keep
// receives posted ahead: a side that answers each message should post
// the receive for the next one before it sends its answer, not after a
// blocking Send returns. The peer's next message can come as soon as the
// answer lands, sooner than the Send's completion reaches the sender:
// an echo between two processes that reposted after its Send met a NAK
// in 8 of 10 round trips on soft0 over unix sockets (111 µs per round
// trip against 54 µs with the receive posted ahead).
//
// # Completions
//
// Every signaled request carries a work request id that encodes the index
// and generation of an operation slot, so that a completion is routed to
// its waiter with one array lookup. Slots are allocated when the channel
// is built (Options.MaxOutstanding of them) and recycled: posting,
// completing and waiting allocate nothing on the data path. One waiting
// goroutine at a time polls the completion queue for all of them (it
// spins or sleeps on the completion channel, see Waiting); the others
// sleep until their completion is routed to them. What changes without a
// completion (a peer broken, a handle released, a post rolled back)
// wakes the sleeping poller too (CompletionQueue.Wake), so that it looks
// at its condition again. Atomic results land in
// per-slot scratch memory owned by the channel.
//
// # Waiting
//
// A goroutine that polls and finds nothing can spin (poll again,
// yielding the processor in between) or sleep on the completion channel.
// Spinning answers sooner while it has a processor of its own; sleeping
// costs wake-ups, tens of microseconds across processes, but leaves the
// processor to whoever would produce the completion. When spinners
// outnumber the processors, spinning collapses: a spinner holds a core
// for its whole time slice while the peer that would answer it waits.
//
// Options.SpinPolls chooses. The default, SpinAdaptive, decides per wait
// between spinning for at most 50 µs and sleeping at once, from a moving
// average of how long recent waits of each kind took (probing the other
// kind at gaps that double from 16 waits to 512); it sleeps when waits
// are long (spinning waits averaging over 200 µs) or when more goroutines
// of the process spin than max(1, GOMAXPROCS-1). Between polls a
// spinning adaptive wait offers its processor to the threads ready to run
// on it (sched_yield on Linux): the peer thread that would complete it
// may have been woken there. The aim is that a client waiting for one
// operation at a time keeps the kind that gives it the shorter average
// wait. SpinAlways (pure spinning) and SpinNever (pure sleeping) force
// one kind; a positive SpinPolls spins that many empty polls and then
// sleeps, which was the default (64) before. Every kind honours the
// wait's context and allocates nothing.
//
// Measured with BenchmarkPollKV: clients in processes of their own read
// 64-byte values from a server process with blocking RDMA reads over
// shared memory, on a 2-core machine. p50 latency per read, and time per
// read (wall time ÷ the reads of all clients, the inverse of
// throughput). On the idle machine, before spinning adaptive waits
// yielded (./scripts/bench.sh poll 5, medians of 5 runs):
//
//	                       spin     sleep   64 polls   adaptive
//	shm, 1 client  p50     8 µs     75 µs     47 µs      52 µs
//	               time   18 µs     83 µs     63 µs      69 µs
//	shm, 8 clients p50     8 µs    358 µs    397 µs     373 µs
//	               time  238 µs     71 µs     77 µs      73 µs
//
// Eight clients spinning on two cores take three times as long per read
// as sleeping ones (p99 24 ms), and the adaptive default stays with
// sleeping there. With one client it stayed with sleeping too, although
// spinning alone was four times faster: after waits that slept, the
// scheduler had woken the server's reader thread on the client's
// processor, where it waited for the spinner's time slice to end, so
// that every spinning wait hit the 50 µs cap (mean 119 µs) and slept,
// which made the next one as slow. The first spinning wait after
// sleeping ones took 88 µs, the eighth 9 µs; with the two processes
// pinned to different processors, 20 µs. Yielding between polls lets
// the woken thread run at once. On the machine loaded by other work
// (load average 11 to 13), the binaries before and after alternately,
// medians of three rounds:
//
//	                       spin     sleep   adaptive before   adaptive now
//	shm, 1 client  p50    19 µs     38 µs      39 µs            19 µs
//	               time  107 µs     63 µs      64 µs            36 µs
//	shm, 8 clients time     -      120 µs     105 µs           120 µs
//
// At a load average of 4.5 the adaptive default's median was 30 µs
// against spinning's 8 µs (time per read 44 µs, against 172 µs spinning
// and 60 µs sleeping): the server then mostly answered on the client's
// processor. The adaptive default was not measured again on an idle
// machine. With
// one client on a busy machine spinning has a low median but the longest
// tail (p99 1-4 ms: a spinner that used up its time slice waits for the
// next one). Set SpinAlways for a client that owns its core.
//
// # Doorbells
//
// A program that waits for words its peers write into its memory (flags,
// counters) cannot sleep on the completion channel for them: an RDMA
// write makes no completion at its target. With Options.Doorbells the
// channel keeps up to that many zero-length receives posted on each
// queue pair (a few at first, growing as the peer rings, unless the
// receiver-not-ready retry is finite) and re-posts them as it polls; a peer that writes with immediate data
// (WriteImm, PostWriteImm) consumes one, and its completion — which
// follows the written data — wakes the goroutines in Wait (Channel.Wait,
// MultiChannel.Wait), which call their ready function again. Rung counts
// the doorbells. Such a channel's receive queues belong to the doorbells:
// sends and receives fail with ErrNotSupported. cluster.Node's channels
// and the collective package work this way.
//
// # Lifetimes
//
// Memory named by an operation belongs to the device from the call that
// posts it until its completion: the return of a blocking call, the end
// of a Batch scope (or an earlier wait that reports it), or a completed
// Handle. The MRs must stay registered that long, and must outlive the
// channel's use of them. Close breaks the channel, waits (at most
// Options.FlushGrace) for the flushes of whatever is in flight, and
// destroys the queue pairs, the completion queue and the scratch memory;
// close the channel before the protection domain.
//
// # Concurrency
//
// Channel and MultiChannel are safe for concurrent use: blocking calls,
// Post methods and Batch scopes may run in many goroutines at once; each
// waits only for its own completions. A Batch (and a MultiBatch) belongs
// to the goroutine running its scope. A Handle must be used by one
// goroutine at a time. Requests to one peer from one goroutine are posted
// in program order and RC executes them in order; requests from different
// goroutines are ordered only by when they are posted.
//
// # Errors
//
// Operations fail with *OpError (operation, peer, cause). The cause is a
// *verbs.CompletionError for a failed completion, a *verbs.OpError for a
// rejected post, a context error (also matching verbs.ErrTimeout), or one
// of ErrBroken, ErrNotConnected, ErrStale, ErrNoPeer, ErrNotPosted,
// ErrDisconnected, ErrClosed, verbs.ErrQueueFull. A failed completion moves the queue pair
// to the error state: the channel is broken from then on, and every later
// operation fails with ErrBroken wrapping the first failure.
package channel
