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
//  2. LocalCard returns what every rank needs: a card, the same for all
//     (the endpoint of the queue pairs but for their numbers, the
//     barrier's flags, and application bytes, typically the address and
//     key of a region the peers may access), and for every rank j an
//     item of ItemSize bytes, the number of the queue pair for j.
//     (LocalEndpoints returns the same as one message per rank.)
//  3. They are exchanged out of band; ExchangeCards does it over TCP
//     (Exchange for LocalEndpoints' messages).
//  4. ConnectCards (Connect) takes what every rank sent this one and
//     brings the queue pairs up. PeerData then returns each rank's
//     application bytes.
//
// Join runs the four phases from a network configuration (Config, a JSON
// file listing every rank's host, port and device), and FromEnv from the
// environment of the launcher that started the process.
//
// # Endpoint exchange
//
// Exchange is a personalised all-to-all over TCP, authenticated and
// encrypted; ExchangeCards is the same for data made of a card that
// every rank receives and a small item per rank (Join and FromEnv use
// it). Both run in one of two modes:
//
//   - AllToAll: every rank listens on its configured address; rank i
//     dials every rank below it. N(N−1)/2 connections, each carrying only
//     what the two ranks need from each other.
//   - Rendezvous: only rank 0 listens; every rank sends it everything (its
//     card once and its items, with ExchangeCards), and rank 0 sends each
//     rank its share (the table of cards and its column of items) once
//     all have arrived. N−1
//     connections, for large worlds and for launchers that name only rank
//     0's address (MASTER_ADDR, the first node of a Slurm job).
//
// Dialers retry with a growing, jittered backoff until the context ends,
// so ranks may start in any order. A rank that is missing makes the
// others fail with ErrPeerMissing by their deadline; a rank that dies
// after its handshake makes them fail at once with ErrPeerLost; in a
// rendezvous, rank 0 tells every waiting rank why it gave up
// (ErrAborted). Nothing waits past the context.
//
// # Wire protocol (version 3)
//
// Every connection starts with a handshake of fixed-size messages, each
// beginning with the magic "GVCX", the protocol version and a type, so
// that a peer of another version is refused with ErrVersion from its
// first 8 bytes (version 1 peers, which read a 44-byte header and check
// the version byte first, report ErrVersion too):
//
//  1. The dialer sends its hello (100 bytes): its exchange mode, the
//     shape of its data (entries, or cards with items of a given size:
//     version 3), its rank, the rank it dials, the world size, a job tag, a fresh 32-byte
//     nonce, and an HMAC-SHA256 of all that under a key derived from the
//     token (HKDF). The job tag is an HMAC of the job id under the same
//     key: the hello stays fixed-size and the job id does not travel.
//  2. The acceptor checks the MAC, then the job tag (ErrJobMismatch), the
//     mode and the data's shape (ErrModeMismatch), the world size (ErrSizeMismatch) and the
//     ranks (ErrBadFrame), and answers with its own hello, with its own
//     fresh nonce, whose MAC also covers the dialer's hello: it proves
//     the acceptor knows the token now.
//  3. The dialer checks it and sends its proof (40 bytes): an HMAC under
//     the token's key over both hellos, hence over the acceptor's fresh
//     nonce. The acceptor checks it in constant time: a recorded hello
//     replayed by someone who does not know the token stops here.
//  4. The acceptor claims the rank and sends an 8-byte accept. Until then
//     an I/O failure makes the dialer dial again.
//
// Two members of the job (both know the token, the job tags match) that
// disagree on the mode, the shape of the data or the world size cannot
// both be right: both fail at once, naming both settings. The acceptor answers such a hello and
// waits for the proof before it gives up (and the dialer sends the proof
// before it does), so that a replayed hello cannot end an exchange.
//
// A refusal is answered with an unauthenticated reject (277 bytes: a code
// and a short text) so that a misconfigured rank fails at once with the
// reason; the connection is then dropped and the exchange goes on
// waiting for the real peer, naming the last refusal if it never comes.
// The token itself never crosses the wire.
//
// After the accept, the entries travel in records of at most 16 KiB,
// sealed with AES-256-GCM. Each direction of each connection has its own
// key, derived by HKDF-SHA256 from the token and a hash of both hellos
// (both nonces), and each record's nonce is its sequence number in its
// direction: a record cannot be altered, replayed, reordered, reflected
// or moved to another connection without failing with ErrAuth. A
// message (an entry; a vector of entries in a rendezvous; a card and
// items, the table of cards, a column of items; the root's abort reason)
// may span records; it is refused with ErrFrameTooLarge as
// soon as it would exceed ExchangeConfig.MaxFrame (a card and items, as
// soon as it would exceed the largest the world allows: a card of
// (MaxFrame−4)/Size−4 bytes and the items), and is held only as its
// records arrive and authenticate.
//
// # Security
//
// An exchange listens on the network, so anyone who reaches its port may
// connect. A connection that has not completed the handshake (a
// stranger) costs a goroutine, a socket and at most 277 bytes of message;
// nothing is allocated from a length it declares, and nothing but the
// fixed-size handshake is read from it. A listener holds at most
// ExchangeConfig.MaxStrangers strangers (MaxStrangersPerHost from one
// source address, half of MaxStrangers from one IPv6 /64); over a limit
// it drops the oldest, and it drops
// every stranger that has not completed the handshake within
// HelloTimeout (or by the context's deadline). The exchange's error
// counts the connections refused and dropped (ExchangeError.Refused,
// Dropped).
//
// With a token, only holders of the token can join, and someone who
// sees the traffic learns the ranks, the world size and the sizes of the
// messages, but not the entries (the endpoints, with the addresses and
// secrets they carry), the job id or the token; someone on the path can
// break connections or forge the unauthenticated rejects (a denial of
// service), but not read, alter or redirect what they carry. In a
// rendezvous, rank 0 sees every entry, as any rank could. An empty token
// authenticates nothing: the keys then derive from values on the wire,
// so that anyone who knows the protocol can read the entries, join, or
// impersonate a rank. Exchange logs a warning (log/slog), once per
// process, when it runs without a token on an address that is not
// loopback.
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
// algorithm (BinaryTree, Dissemination, Centralized) is asked for per
// node and must be the same on every rank. The default, Auto, picks
// Dissemination where every rank has a processor and Centralized where
// ranks outnumber them (BinaryTree beyond 64 ranks), alike on every
// rank. A barrier that times out poisons the node's barrier until every
// rank calls ResetBarrier.
//
// Node.Share is a small all-to-all exchange (up to MaxShare bytes per
// rank, every rank gets every rank's bytes) over the same kind of
// writes: each rank registers, with its barrier flags, one mailbox per
// rank of the world; rank j writes its bytes into box j at every peer,
// then the box's header (call number, length), waits for the headers of
// every box at itself, copies them out and joins a world barrier, after
// which the boxes are reused. It exchanges what a layer above the node
// needs once a world is up (package collective: the addresses of its
// windows) without sends or receives, so that the receive queues of
// the node's channel may serve other purposes. It fails like a barrier
// (and poisons it like one), and checks what it reads: a header no
// correct peer writes fails with ErrShareCorrupt, naming the rank.
//
// # Failures
//
// A world fails together. When a rank dies (its process exits or is
// killed) or stops answering for longer than the queue pairs' transport
// timeout (verbs.QPSpec.Timeout and RetryCount, in
// NodeOptions.Channel.QP: the liveness bound; a stopped process, a hung
// host), the first rank whose queue pair to it breaks writes the news
// into the flags of every rank it can still reach. From then on every
// barrier of every rank fails, within about the liveness bound plus a
// few one-way latencies and whatever its context, with an error naming
// the rank that failed: a *RankError (errors.As) wrapping ErrPeerLost.
// The world stays failed (Node.Err); ResetBarrier does not repair it. A
// rank waiting in a barrier checks, every 10 ms once it has waited 2 ms,
// that the peer it waits for is alive (every 10 ms times the ranks per
// processor, at most 1 s, when the machine's ranks outnumber its
// processors: see Scale), so a
// failure is seen even when no rank was sending to the failed one. A
// rank that dies after the endpoint exchange, before or while the
// others connect, makes Join fail or the first barrier fail, naming it:
// no world goes on with a hole.
//
// A rank waits for a flag by polling — driving the transport's progress:
// soft0 places a peer's write when a process of it polls, so the flag is
// looked at after each poll, before any pause; every fourth poll lets
// the process' goroutines run — for up to
// 1 ms, then sleeps on its channel's completion channel
// (channel.MultiChannel.Sleep). When the machine has more ranks of the
// world than processors (LocalRanks against runtime.NumCPU) a spinning
// rank offers its processor to the other threads between polls
// (sched_yield, as MPI libraries do), so the rank it waits for runs at
// once; with more than 32 ranks per processor (spinwait.MaxYieldRanks)
// it sleeps at once, since
// the rank waited for would queue behind every spinner of its
// processor. A sleeping rank is woken by a doorbell: a write with
// immediate data (NodeOptions.Channel.Doorbells, 64 per peer by default),
// whose completion wakes it. Where waits spin first, a barrier's flags
// are plain writes and a rank rings a peer only when the peer wrote,
// before it went to sleep, that it sleeps (doorbells on demand, see
// internal/bells); where they sleep at once, every flag rings. So ranks
// that outnumber the processors sleep until their signal arrives. The queue pairs of a
// Node's channel carry one-sided operations only: its receive queues
// hold the doorbells (sends and receives fail with ErrNotSupported);
// exchange small data with Share. Ranks that outnumber the processors
// should each run with GOMAXPROCS set to their share of the processors,
// at least 1 (package collective, Waiting, has the measurements);
// BenchmarkBarrierXproc's ranks do: its dissemination barrier on soft0
// shared memory, 2 vCPUs, 3 rounds alternating, took 425–460 µs with 4
// ranks and 1.53–1.87 ms with 8 when every rank had the runtime's
// default, and 154–266 µs and 0.63–0.79 ms with one processor each.
// Until 2026-11-26 the benchmark's child ranks ran on the goroutine of
// package initialisation, which is locked to the main thread: every yield
// handed the processor to another thread and back, and the numbers above
// include that. Without it (2 rounds): one-way write 3.9–4.0 µs (was
// 17–24 µs), dissemination barrier 5.3–7.3 µs with 2 ranks (17–28 µs),
// 73–89 µs with 4 (140–142 µs), 365–374 µs with 8 (643–649 µs).
// Over soft0's sockets (GOVERBS_SOFT_TRANSPORT=unix or tcp) a spinning
// rank's polls could not read a socket whose reader waited on it until
// the runtime's network poller ran (every 10 ms in a process whose
// goroutines only yield); a poll now ends that wait. Measured on the idle
// machine, before and after (2 rounds, unix): dissemination barrier 4
// ranks 0.99–1.01 ms → 57–77 µs, 8 ranks 1.87–2.00 → 0.19–0.39 ms;
// binary tree 8 ranks 2.47 → 0.13 ms; TCP dissemination 4 ranks 1.02 ms →
// 85 µs.
// BenchmarkBarrierXproc measures barriers between processes, up to four
// times as many as processors, against the one-way latency of the same
// transport.
//
// # Scale
//
// Start-up has three parts whose cost grows with the world size N: every
// rank builds a queue pair to every other (NewNode), rank 0 gathers and
// scatters the exchange (a rendezvous of cards: every rank sends it its
// card, ~290 bytes with soft0, once, and an item of 6 bytes per rank, and
// gets back the table of N cards and its column of N items), and every
// rank connects its N−1 queue pairs (ConnectCards). soft0's connections
// between processes (a socket, and over shared memory a ring segment)
// are made at a queue pair's first request, not at Connect: a rank
// connects to the few peers it talks to (a binary-tree barrier to 3, a
// dissemination barrier to 2 log2 N).
//
// Measured on one host with 2 CPUs shared with other work, soft0 over
// shared memory: BARRIERS=100 WRITE=0 scripts/scale.sh 32 64 128 256 512,
// before (commit 04b9a1a: cards, a queue pair's send ring and a peer's
// batches made on first use, 4 doorbell receives at Connect) and after
// the per-peer cuts below, run one after the other. Start-up is from the
// first process' start, which includes starting the N processes one
// after the other (spawn), to the last rank's Join; cpu is the CPU time
// of all the ranks together, barriers included; rss the largest rank's
// peak (rank 0's); fds the most descriptors seen in a rank:
//
//	        start-up (s)  spawn (s)    cpu (s)      rss (MiB)  fds
//	N       before after  before after before after before after before after
//	32         2.2   1.9     1.5   2.0    4.7   3.6    14  13     79   44
//	64         4.7   3.1     3.6   2.8   11.0   7.1    16  15    143   80
//	128       11.0   7.2     8.6   5.9   26.2  18.8    19  17    151  141
//	256       29.3  18.8    20.9  15.5   65.8  51.0    28  21    526  271
//	512      106.1  55.4    51.3  37.4  264.2 165.8    43  32   1037  521
//
// Other runs of 512 ranks: before, 99.2 s (spawn 53.0, cpu 249); after,
// 61.2, 60.8 s (spawn 38.1, 39.1, cpu 146, 154), and 69.2, 99.1 and
// 71.1 s in three earlier runs of a build without the scratch and
// goroutine channels made on first use, while other work loaded the
// machine (one under perf record -a). Every run of 512 ranks, 8 in all,
// started and passed its 100 barriers: the failure seen once before (no
// rank passed its barriers, output not kept) did not recur.
//
// Where a rank's start-up goes (phases timed with getrusage in the
// ranks, median CPU per rank, before → after, for N = 128, 256, 512):
// starting the process and the Go runtime, about 35 ms whatever N;
// NewNode 53 → 22, 86 → 32, 122 → 44…68 ms; LocalCard 6 → 5, 7 → 13,
// 8 → 8…13 ms; the exchange (dial, send, wait, decode N cards) 4 → 4,
// 6 → 15, 18 → 15…16 ms; ConnectCards 25 → 5, 41 → 8, 162 → 19…24 ms.
// In one process (BenchmarkNodeStartup, N = 512, runs alternating the
// two builds) NewNode went from 78…92 µs to 7…11 µs per peer and
// ConnectCards from 36…74 µs to 4…5 µs, allocating 10 KiB per peer
// instead of 31 KiB, by making at first use what a rank of a large
// world does not use: channel's doorbell receives are posted one by one,
// not through a request batch per queue pair (a memfd, a mapping and a
// page fault each: most of ConnectCards, and half the descriptors); a
// soft0 queue pair's receive ring grows as receives are posted, its
// requester's scratch (4 KiB) comes with its send ring at the first post
// and its responder's (1.3 KiB) with the first request it receives, and
// the goroutine that runs the send queue of a queue pair connected to
// another process starts at its first request; a completion queue's ring
// grows as completions queue up (65536 entries were 3 MiB at creation).
// A fresh process pays more per peer than the benchmark's warm one: each
// new heap page costs a page fault, and at 512 peers a garbage
// collection; on the loaded machine, the phases above are worth 60 to
// 110 µs per peer in NewNode and 40 µs in ConnectCards (0.4 to 0.5 ms in
// all before).
//
// Start-up on one host still grows faster than N: ×2.4 and ×2.6 per
// doubling from 64 ranks to 256, ×3.0 (55 to 61 s) from 256 to 512; the
// ranks' CPU ×2.7 and ×3.2. Two parts of it. The spawn grows ×2.4 to
// ×2.6 per doubling itself (43, 61, 74 ms per process at 128, 256, 512 ranks): the
// spawning script shares the 2 CPUs with the ranks already started,
// which build their nodes (35 ms + 0.1 ms × N each) as it goes. And
// after the last process started, every rank decodes the N cards and
// connects N − 1 queue pairs at once, when the column arrives: 35 ms of
// CPU per rank at 512, 18 s of CPU for the world, which with the first
// barriers of the ranks that are done makes the 18 to 23 s between the
// last spawn and the last Join (3 to 5 s at 256 ranks; 46 to 55 s at
// 512 before). perf record -a over that stretch at 512 ranks (the parts
// overlap: a page fault counts in the code that caused it too): the
// ranks' Go runtimes 40 % (sysmon 28 %: it polls again every 20 µs each
// time it preempts a goroutine that has run for 10 ms, as every running
// goroutine seems to have when its thread waits for a processor; the
// scheduler's search for work), kernel page faults for fresh memory 20 %,
// ConnectCards 17 %, soft0's transport for the first barriers 25 %. The
// per-peer work is O(N) per rank and O(N²) for the world however cheap
// it is made; only queue pairs made and connected on first use (below)
// make start-up on one host linear.
//
// Before the changes of which this paragraph is the account, 512 ranks
// did not start (510 of 512 had connected after 345 s when rank 0 gave
// up on a live rank that had not read its column for 10 s); 256 took
// 67 s. perf record -a over the start-up of 128 and 256 ranks showed:
// building the queue pairs, 0.4 ms per peer and rank, mostly soft0
// allocating and zeroing each queue pair's send ring (32 KiB at the
// default depth of 128) and the channel's three request batches per peer
// (three memfds and mappings); connecting, 0.1 ms per peer and rank, half
// of it posting 64 doorbell receives per queue pair; and, from 256 ranks
// on, the Go runtimes of processes woken all the time (runtime.sysmon and
// the scheduler's search for work: 40 % of the machine) by the alarms of
// the ranks sleeping in a barrier, every 10 ms each. So a rank now pays
// at start only for what it uses: soft0 makes a queue pair's send ring at
// its first post, the channel a peer's batches at its first use, a queue
// pair starts with 4 doorbell receives and gains one at each ring (when
// the peer's extra rings wait, the default), and the alarms of sleeping
// waits are spaced by the ranks per processor, up to 1 s, when the
// ranks outnumber the processors (a failure nobody sends to is then seen
// within the liveness bound plus at most 1 s), and rank 0 waits for a
// rank of its host to read its column the longer the more ranks the host
// has beyond its processors (100 ms each: a starved live rank is not
// declared lost).
//
// 10 000 ranks across hosts (say 100 hosts of 100 ranks, a 10 Gb/s link
// at rank 0). Per rank, with a queue pair to every rank as now (per peer:
// about 10 KiB resident — the median rank's peak grows from 14.3 to
// 17.0 MiB between 256 and 512 ranks, 24 KiB per peer before —, no
// descriptor — one, a doorbell batch's memfd, before —, 0.1 ms of CPU
// to build and connect on a loaded host, 0.43 ms before): 100 MiB and 1 s
// of CPU; per host 10 GiB — heavy but not a wall. The
// exchange of one entry per pair of ranks was the wall: 10 000 × 9 999 ×
// 310 bytes = 31 GB into rank 0, held in its memory, and 31 GB out (25 s
// each way at line rate). In order, what the numbers call for:
//
//   - Cards (done): a rank sends its card once and an item of 6 bytes (the
//     queue pair's number and first packet sequence number) per rank:
//     10 000 × (290 + 60 000) bytes = 0.6 GB into rank 0, which holds
//     that, and out the columns (0.6 GB) and the table of cards (2.9 MB)
//     to every rank: 29 GB, still, as rank 0 sends the table to each.
//   - A tree: the table of cards spread down a tree of fan-out k (each
//     rank forwards it to its k children; 16: 4 levels, rank 0 sends
//     46 MB), and the gather up the same tree, so that no rank holds more
//     than k exchange connections. The leaves would listen, their
//     addresses in their cards.
//   - Queue pairs on first use: a queue pair and its number made when a
//     rank first talks to a peer, with the peer's card from the table (a
//     connection request over soft0's own link, or an RDMA CM exchange):
//     start-up then moves only the cards (2.9 MB per rank, by the tree),
//     each rank holds the queue pairs of its partners (3 to 28 for the
//     barriers) instead of 10 000, and start-up on one host becomes
//     linear (the 0.1 ms × N per rank above goes).
//   - Failures told by a tree: a rank that sees a rank fail writes the
//     news to every other rank (Node.Fail, the barrier), which with
//     soft0's connections made on first use means 9 999 connection
//     handshakes from one rank (TLS between hosts: seconds); relayed
//     along the barrier's partners, it takes log2 N hops over
//     connections that exist.
//
// What makes large worlds on one host work: a local peer that is
// runnable or ran at all is alive (soft0 reads its threads' schedstat
// when its clock ticks did not move), so soft0's handshakes and
// requests wait for a starved peer instead of declaring it dead; rank 0
// bounds each record of a column it sends, not the whole column, so a
// rank that drains it slowly is not lost; Close reads only from the
// peers it may still have writes in flight to; a process has at most a
// few soft0 handshakes with processes of its host in progress at once;
// and sleeping ranks wake each other as little as their liveness allows.
//
// # Lifetimes and concurrency
//
// A Node built by NewNode uses the caller's protection domain, which must
// outlive it; one built by Join or FromEnv owns its device context and
// protection domain and closes them in Close. Memory the application
// registers in Node.PD must be closed before the Node, or handed to it
// with OnClose. Close first makes sure this rank's last barrier signals
// reached its peers (at most NodeOptions.CloseGrace), so a rank may leave
// right after its last barrier. LocalCard and ConnectCards (or
// LocalEndpoints and Connect) are called once each, in that order, by one
// goroutine; after it connected, a Node is safe for concurrent use:
// channel operations run concurrently, barriers are serialised. Close is
// idempotent.
//
// Exchange, ExchangeCards, Join and FromEnv block and take a context; a Config, a Launch
// and an ExchangeConfig are plain values.
package cluster
