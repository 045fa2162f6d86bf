// Package verbs is a safe, fast Go binding to RDMA verbs: devices, protection
// domains, memory regions, completion queues, typed queue pairs (RC, UC,
// UD), shared receive queues and address handles, with doorbell-batched
// posting and allocation-free polling.
//
// # Providers
//
// Two providers implement the same semantics. The hardware provider drives
// InfiniBand, RoCE and iWARP devices through libibverbs; it is compiled in
// with the build tag ibverbs (Linux, cgo, libibverbs-dev). The soft provider
// is pure Go and always present as device "soft0": it follows verbs
// semantics closely (state machine, limits, RNR retries, remote key and
// bounds checks, flush on error) so that code tested on it works on
// hardware. Devices lists both; Open("") picks hardware when there is any.
//
// # Object model and lifetimes
//
// Objects mirror verbs: Context (an open device) → ProtectionDomain →
// MemoryRegion, queue pairs, SharedReceiveQueue, AddressHandle; Context →
// CompletionChannel → CompletionQueue. Every object has an idempotent
// Close. A child keeps its parent alive, and closing a parent while
// children are open fails with an error naming them. Objects that are
// garbage-collected without Close are reported by a leak tracer
// (verbstest.CheckLeaks makes tests fail on them); one of Go memory
// (Register) stays pinned and alive, as the device may still write into
// it. The zero value of an object type (never made by its constructor) is
// as good as closed: its calls fail with ErrClosed, none panics; the
// same holds in channel, cluster, collective, session and stream.
//
// # Connecting
//
// A connected queue pair is created in INIT. Its Endpoint (GID, LID, QPN,
// PSN, MTU, provider address; binary and JSON encodings) is exchanged out of
// band, then Connect moves it through RTR to RTS with automatic addressing:
// LID on InfiniBand, a GRH with a routable RoCE v2 GID on Ethernet. Modify
// and Query offer manual control with validated transitions.
//
// # Posting and completions
//
// Work requests are collected in a batch (RCBatch, UCBatch, UDBatch,
// RecvBatch) whose Submit posts them all with one provider call: one cgo
// crossing on hardware. Per-request modifiers (Signaled, Fenced, Solicited,
// Inline) chain on the returned *Request. CompletionQueue.Poll fills a
// caller's slice without allocating; CompletionQueue.Wait sleeps until a
// completion arrives or the context ends, without holding an OS thread,
// and CompletionQueue.Wake ends such a sleep early (for a goroutine that
// sleeps on the CQ for others, whose conditions change without a
// completion).
//
// # Concurrency and buffers
//
// Contexts, PDs, MRs, CQs, QPs and SRQs are safe for concurrent use. A batch
// is not: give each goroutine its own. Closing a CQ, QP or SRQ waits for
// the calls that are using it in its provider (polls, posts, queries),
// and the calls after it fail with ErrClosed: a provider never gets a
// destroyed object. Memory named by a work request
// belongs to the device from post until the request's completion (or, for
// an unsignaled request, a later signaled completion on the same QP): do not
// touch it in between. Inline sends copy the data at Submit.
//
// # Memory safety
//
// Whatever its SGEs hold, a work request reads or writes only memory of
// the open memory regions it names, or the byte slices given to it
// (SendInline and its kin). Devices check non-inline SGEs against their
// lkeys; inline data, whose lkey libibverbs ignores, is checked by this
// package before any provider sees it: every inline SGE must lie inside
// an open memory region of the queue pair's protection domain, named by
// its lkey, or the post fails with an error wrapping syscall.EINVAL (the
// requests of a batch before it are posted; a *PostError says how many).
// The regions named stay mapped until the provider has copied the data:
// MemoryRegion.Close waits for such posts. Bytes in no memory region are
// sent inline with RCBatch.SendInline, WriteInline and their kin, and the
// Post...Inline helpers, up to the queue pair's MaxInlineData.
// MemoryRegion.SGE refuses a range outside the region.
//
// # Errors
//
// Calls fail with *OpError (operation, device, cause; errors.Is matches
// syscall errnos and the sentinels ErrNotSupported, ErrClosed, ErrNoDevice,
// ErrQueueFull, ErrTimeout). Failed completions convert to
// *CompletionError with Status, a StatusClass and a hint naming the usual
// cause.
package verbs
