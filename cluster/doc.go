// Package cluster builds worlds of ranked processes connected over RDMA:
// a Node is one rank, with the world size, a channel.MultiChannel holding
// a reliable connected queue pair to every other rank, and a barrier.
//
// # Model
//
// A world has Size ranks, numbered from 0. Each rank builds its Node in
// phases, like a queue pair:
//
//  1. NewNode creates the MultiChannel (one queue pair per peer, all in one
//     protection domain) and registers the barrier's flags.
//  2. LocalEndpoints returns, for every rank j, the message rank j needs:
//     the endpoint of the queue pair for j, the barrier's flags, and
//     application bytes (typically the address and key of a region the
//     peers may access).
//  3. The messages are exchanged out of band; Exchange does it over TCP.
//  4. Connect takes what every rank sent this one and brings the queue
//     pairs up. PeerData then returns each rank's application bytes.
//
// Join runs the four phases from a network configuration (Config, a JSON
// file listing every rank's host, port and device), and FromEnv from the
// environment of the launcher that started the process.
//
// # Endpoint exchange
//
// Exchange is a personalised all-to-all over TCP, in one of two modes:
//
//   - AllToAll: every rank listens on its configured address; rank i
//     dials every rank below it. N(N−1)/2 connections, each carrying only
//     what the two ranks need from each other.
//   - Rendezvous: only rank 0 listens; every rank sends it everything, and
//     rank 0 sends each rank its share once all have arrived. N−1
//     connections, for large worlds and for launchers that name only rank
//     0's address (MASTER_ADDR, the first node of a Slurm job).
//
// Dialers retry with a growing, jittered backoff until the context ends,
// so ranks may start in any order. Every frame carries a magic number, a
// protocol version, the sender's and receiver's ranks, the world size, the
// job id and an HMAC-SHA256 over a token the ranks share; data frames
// echo a nonce the receiver chose for the connection, so frames cannot be
// replayed. Frames above a maximum size are refused from their header. A
// connection that fails the handshake (another token: ErrAuth; another
// job: ErrJobMismatch; garbage: ErrBadFrame) is answered with a short
// unauthenticated reject, so that a misconfigured rank fails at once with
// the reason, and dropped; the exchange goes on waiting for the real
// peer and names the refusal if the peer never comes. A rank that is
// missing makes the others fail with ErrPeerMissing by their deadline; a
// rank that dies after its handshake makes them fail at once with
// ErrPeerLost; in a rendezvous, rank 0 tells every waiting rank why it
// gave up (ErrAborted). Nothing waits past the context.
//
// # Launchers
//
// ParseLaunch reads rank, world size, local rank, rank 0's address and the
// job id from Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the node
// list, expanded by ExpandNodeList), Open MPI (OMPI_COMM_WORLD_*), PMI
// (PMI_RANK, PMI_SIZE), torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT), Kubernetes indexed Jobs
// (JOB_COMPLETION_INDEX with a host pattern) or GOVERBS_RANK and
// GOVERBS_WORLD_SIZE. GOVERBS_ROOT, GOVERBS_PORT, GOVERBS_JOB,
// GOVERBS_TOKEN, GOVERBS_DEVICE and GOVERBS_LISTEN override or complete
// what the launcher says. FromEnv uses the Rendezvous mode.
//
// # Barriers
//
// Node.Barrier synchronises the world or a sorted subgroup of it with
// one-sided RDMA writes of epoch counters into registered flags; the
// algorithm (BinaryTree, Dissemination, Centralized) is chosen per node
// and must be the same on every rank. A barrier that times out or whose
// transport breaks poisons the node's barrier until every rank calls
// ResetBarrier.
//
// # Lifetimes and concurrency
//
// A Node built by NewNode uses the caller's protection domain, which must
// outlive it; one built by Join or FromEnv owns its device context and
// protection domain and closes them in Close. Memory the application
// registers in Node.PD must be closed before the Node, or handed to it
// with OnClose. Close first makes sure this rank's last barrier signals
// reached its peers (at most NodeOptions.CloseGrace), so a rank may leave
// right after its last barrier. LocalEndpoints and
// Connect are called once each, in that order, by one goroutine; after
// Connect, a Node is safe for concurrent use: channel operations run
// concurrently, barriers are serialised. Close is idempotent.
//
// Exchange, Join and FromEnv block and take a context; a Config, a Launch
// and an ExchangeConfig are plain values.
package cluster
