// Package collective runs MPI-style collective operations — barrier,
// broadcast, reductions, gathers, scatters, all-to-all, scans — among the
// ranks of a cluster world, over one-sided RDMA writes into registered
// buffers.
//
// # Model
//
// A Comm (communicator) is an ordered group of ranks of a cluster.Node's
// world: New makes the communicator of the whole world, Split and Dup
// derive others. Rank and Size are positions within the communicator.
// Collectives are generic package functions over the element types of
// Number (Go's fixed-size integers and floats, and BFloat16 and Float16
// stored as uint16), on slices the caller owns:
//
//	err := collective.Allreduce(ctx, comm, nil, grads, collective.Sum)
//
// Every rank of the communicator calls every collective, with matching
// arguments (the same kind, operation, element type, count and root),
// in the same order. A rank that calls something else is detected: every
// message carries the call's description, and the receiver of a
// mismatched one fails with ErrMismatch naming both calls. Ranks whose
// mismatched calls wait for each other without exchanging anything
// (each waits to receive from the other) find out too: a waiting rank's
// probes tell the peer it waits for which call it is in, and a peer in
// the same call of another description fails with ErrMismatch. A rank
// that waits for a peer that completed its mismatched call and called
// nothing more fails by its context or Options.Timeout. Whichever rank
// detects it, the others' calls fail as it gives up (ErrPeerAborted,
// wrapping ErrMismatch). Mismatches are never silently combined.
//
// The description covers the counts vector of Allgatherv and
// ReduceScatterV (a hash of it; every rank passes the same): ranks that
// disagree on it fail with ErrMismatch, also where the lengths of all
// messages agree (a message bundles several blocks whose counts add up
// alike), instead of placing or reducing blocks by counts other than
// their sender's. The counts of Alltoallv, Gatherv and Scatterv differ
// between ranks by design (or are the root's only); their blocks travel
// alone, and a block of another length than its receiver expects is a
// mismatch.
//
// A mismatch that no message shows during the call — ranks of a rooted
// call (Broadcast, Gather, Scatter, Reduce) that disagree on the root:
// each takes itself for the root, sends, receives nothing and returns
// — shows at the next call that receives from the disagreeing rank (its
// stray message is of another call: ErrMismatch), or, if none does, at
// Close: a rank whose communicator is not poisoned and which finds in
// its windows a message of one of its calls that none of them took in
// returns ErrMismatch from Close, naming the peer and the peer's call.
// Close does not wait: a stray message that had not arrived when it
// looked goes unreported (a barrier of the node before Close makes sure
// it has). No round trip is added to any call for it.
//
// # Data path
//
// Each rank registers, once per communicator, a receive window for every
// peer: Options.Slots slots of Options.ChunkSize bytes, and two counters
// per peer. A message travels in chunks: the sender copies a chunk and
// its header into a registered staging slot, RDMA-writes it into its
// slot of the receiver's window and then writes the receiver's data
// counter; the receiver, polling the counter, consumes the chunk (copies
// it out or reduces it into place) and returns credits by writing the
// sender's ack counter. Senders never wait for a completion: a slot is
// reused only after its credit came back. Nothing is registered or
// allocated per call; the windows take 2 × (Size−1) × Slots × ChunkSize
// bytes of registered memory (8 MiB at 2 ranks by default, chunks of 1
// MiB; at most 16 MiB in all with the default chunk size, which shrinks
// from 4 ranks on).
//
// A message of at most 1 KiB (a barrier's, a small allreduce's) is one
// write instead of two: its slot gets 8-byte words that each carry 4
// bytes of it and a flag, the chunk's sequence number, as in NCCL's LL
// protocol; the receiver finds it complete when every word carries the
// flag, and no data counter is written. Such a message also carries the
// sender's ack counter for the receiver, which then needs no write of
// its own. On soft0 shared memory this took a barrier between 2
// processes from 4.3–4.7 µs to 2.5 µs, an 8-byte allreduce from 4.4–4.5
// to 2.6 µs (1.5 µs one-way; `goverbs coll -p 2 -max 8 -iters 100000`,
// 3 runs alternating with the code before).
//
// With chunks of 256 KiB or more (the default up to 9 ranks) the
// windows also allow remote reads, which lets soft0 map them into the
// peer processes of the host: a write of 16 KiB or more into them is
// then one copy by the writer, after the target acknowledged the
// request, instead of two (into the connection's ring at once, out of it
// by the target). The round trip makes direct writes lose with small
// chunks and win with large ones; on soft0 shared memory, 2 ranks, 16
// MiB in place from Buffers, 3 runs alternating the three: 64 KiB
// chunks through the ring 3.7–5.5 ms, 64 KiB direct 4.7–8.5 ms, 1 MiB
// direct 2.2–3.1 ms.
//
// Data in a Buffer (Alloc: memory registered once, for the communicator
// and those made from it) is sent in place: a chunk of a message of at
// least 64 KiB is one RDMA write of the header from the staging slot and
// the data from the Buffer, without the copy into the slot. A step that
// sent so waits, before it ends, until those writes were executed, so
// that the caller (or the next step) may change the memory. On soft0
// shared memory, a 16 MiB allreduce in place between 2 ranks takes
// 2.1 ms from Buffers, 3.9 ms from Go memory (medians; `goverbs coll
// -p 2 -ops allreduce -min 16MiB -max 16MiB -inplace` with and without
// -registered; the README has the table).
//
// A Buffer also takes data in place: in the ring allreduce, a rank whose
// vector lies in a Buffer announces it to its left neighbour once its
// reduce-scatter is done (one small write, and one more for the
// announcement's tag), and the neighbour writes the allgather's blocks
// straight into it, at their offsets, followed by the data counts as
// usual: no window slot, no copy out by the receiver. Buffers are
// therefore registered for remote writes (and reads, for soft0's direct
// copies); only the left neighbour of a call learns a Buffer's key, for
// the call. A call that failed may still see its Buffer written by the
// neighbour until that one fails too (its context or Options.Timeout).
//
// Out of place, the ring does not copy send into recv first: block r of
// recv is written only by the allgather, and every other block takes its
// operand from send chunk by chunk as the reduce-scatter combines it.
// Sum on float32 and float64 combines with AVX2 where the processor has
// it (the same bits as the Go loop; about 4 times its speed on data in
// cache).
//
// # Algorithms
//
// Allreduce chooses by the vector's size (AlgAuto, overridable with
// Options.Algorithm): recursive doubling below SmallMax bytes (⌈log2 p⌉
// rounds of whole vectors), Rabenseifner's recursive halving
// reduce-scatter and doubling allgather up to RingMin, and the ring
// (reduce-scatter then allgather in p−1 steps each, chunks pipelined)
// above. Sizes that are not powers of two fold the first 2·(p−2^⌊log2 p⌋)
// ranks in pairs first. Barrier is a butterfly for powers of two, else a
// dissemination barrier, or, where some rank's machine has more ranks
// than processors, a gather at rank 0 and its release
// (Comm.BarrierAlgorithm). There (with AlgAuto) recursive doubling is
// gathered too: every rank sends its vector to rank 0, which combines
// them in recursive doubling's order and sends the result back — the
// same bits, two turns of each rank instead of ⌈log2 p⌉ rounds of all
// (Comm.AllreduceAlgorithm says "gather"; 8 ranks on 2 CPUs, 8 bytes:
// 55.6 → 27.6 µs, see GatherMax). Each collective documents its
// algorithm and cost.
//
// Results are bitwise identical on every rank: each element's final value
// is computed by one rank and copied to the others (ring, Rabenseifner,
// gathered recursive doubling), or computed by every rank in the same
// order, with the lower ranks' partial result as the left operand
// (recursive doubling).
//
// # Waiting
//
// A rank waiting for a peer polls (which drives the transport's
// progress), yielding to the process' goroutines every fourth poll (a
// trip through the Go scheduler at every poll was 16 % of a 2-rank
// barrier), for up to 1 ms, then
// sleeps on the completion channel of the node's channel
// (channel.MultiChannel.Sleep). When the machine has more ranks of the
// world than processors (cluster.Node.LocalRanks against
// runtime.NumCPU) a spinning rank offers its processor to the other
// threads between any two polls (sched_yield, as MPI libraries do), so that the
// rank it waits for runs at once; with more than 32 ranks per processor
// it sleeps at once, since the rank waited for would queue behind every
// spinner of its processor (internal/spinwait). A spinning wait pauses
// before it drives the progress, not after, so that it looks at what the
// poll placed (soft0 places a peer's writes as the process polls) before
// the next pause: with ranks that outnumber the processors a pause is a
// context switch or more, and looking after it cost one per message.
//
// A sleeping rank is woken by a doorbell: an RDMA write with immediate
// data (channel.Options.Doorbells, on by default on a cluster.Node's
// channel), whose completion wakes it. Where waits spin first, the
// counters written at a peer (a chunk's data count, an ack count) and the
// small messages are plain writes, and a rank rings a peer only when the
// peer wrote, before it went to sleep, that it sleeps (bells.go: it then
// looks once more; its peers read that word as they spin and when their
// calls end). Where waits sleep at once (more than 32 ranks per
// processor), and for the done flag and the abort word, every write
// rings. So ranks that outnumber the processors leave them to the ranks
// with work and wake when their data arrives. An alarm every 10 ms (or at
// the Options.Timeout deadline) wakes a sleeper for its checks; when the
// ranks outnumber the processors it comes every 10 ms times the ranks
// per processor, up to 1 s, as cluster's barrier's, so that the alarms
// of many sleeping ranks do not keep the processors busy waking them (a
// failure nobody sends to is then seen up to that much later).
//
// Ranks that outnumber the processors should each run with GOMAXPROCS
// set to their share of the processors, at least 1 (goverbs coll does so
// for the ranks it starts, as torchrun sets OMP_NUM_THREADS=1 for its
// workers): with the Go runtime's default every rank runs as many threads
// as the machine has processors, and the ranks wait behind each other's
// extra threads. On 2 processors, under a load average of 27 to 52 from
// other work, 3 rounds alternating (`goverbs coll -p P -max 8`), an
// 8-byte allreduce took 0.31–0.59 ms with 4 ranks and 1.8–2.4 ms with 8
// with the default, 0.09–0.24 ms and 0.67–0.82 ms with GOMAXPROCS=1.
//
// # Failures
//
// A rank that dies or stops makes every surviving rank's call fail,
// naming it: the rank that sees the failure (its queue pair to the rank
// breaks, at once or after the queue pair's transport timeout — a waiting
// rank probes the peer it waits for with small writes) reports it to the
// world with cluster.Node.Fail, which writes it into every rank's poison
// word, which every wait checks. The error wraps a *cluster.RankError
// (errors.As). Any failed call — a rank failure, a timeout, a mismatch,
// Close — poisons the communicator: every later call fails with
// ErrPoisoned wrapping the first failure, since the ranks no longer agree
// on what was sent; build a new communicator (New, on every rank) to go
// on after a timeout or mismatch. A world that lost a rank stays failed
// (cluster): once a rank's node knows of the failure (cluster.Node.Err),
// every later call of every communicator of that rank fails naming the
// failed rank, also one that needs no peer's answer (a gather's non-root,
// a communicator of one rank). Argument errors (ErrArgs) are found
// before anything is sent and do not poison, except those only the root
// of a rooted call can find (the root's recv of Gather, Gatherv and
// Reduce, its send of Scatter and Scatterv, which the other ranks do not
// pass): the other ranks are in the call and may wait for the root, so
// the root returns ErrArgs and gives the call up like a failed one
// (poisoning the communicator), and every other rank's call fails at
// once with ErrPeerAborted wrapping ErrArgs, naming the root, instead
// of waiting until its context or Options.Timeout ends. A non-blocking
// call whose context ends while it waits for its turn gives that turn up
// the same way (ErrPeerAborted at the peers, naming its call's number),
// poisoning the communicator.
//
// # Concurrency and lifetime
//
// A Comm is safe for concurrent use, and its calls run one at a time in
// the order they were issued. The non-blocking twins (IAllreduce,
// IBarrier, ...) take their place in that order when called and return a
// Request; the library runs them in order in the background; Wait or
// Test the request, and leave the buffers alone until it completes.
// Communicators of the same node (Split, Dup) have independent orders.
//
// Close is collective (every rank closes the communicator) and does not
// wait for the peers: a rank's windows stay registered until every peer
// has said it is done with them (a late acknowledgement into a released
// window would break the node's queue pair), and are released by a later
// New or Close on the node, or when the node closes. Close communicators
// before their node. New exchanges the windows' addresses with
// cluster.Node.Share (RDMA writes and a world barrier; no send or
// receive on the node's queue pairs), so it counts as one of the node's
// barriers: call it on every rank in the same order relative to them.
package collective
