// Package soft is the pure-Go software provider: device soft0 with the
// semantics of RC, UC and UD verbs, between QPs of one process and between
// processes.
//
// Every context opened in a process is attached to the same fabric, so QPs
// of different contexts can connect. QPs of other processes are reached
// through the process' service (service.go, conn.go): a QP's provider
// address (in its endpoint) names the process, a secret, and the
// transports it offers (an abstract unix socket for the same host, and
// TCP addresses with the fingerprint of the process' TLS certificate). The transport is chosen per connection: direct memory in
// the same process; on the same host, shared memory (rings in a memfd
// segment set up over the unix socket, see shm.go), falling back to the
// unix socket and then TCP; TCP otherwise.
// GOVERBS_SOFT_TRANSPORT=inproc|shm|unix|tcp (or ForceTransport) forces
// one, also between QPs of one process, so that every transport can be
// tested on one machine.
// GOVERBS_SOFT_LISTEN sets the TCP listen address (default 127.0.0.1:0;
// "off" disables TCP); name a routable address, or 0.0.0.0:0, to reach
// other hosts (GOVERBS_SOFT_ADVERTISE overrides what an unspecified one
// advertises: advertise.go). GOVERBS_SOFT_TLS=auto|on|off (or ForceTLS)
// says when TCP is encrypted (default: unless loopback; tls.go). Who may
// connect, and how a peer proves it, is in handshake.go.
// GOVERBS_SOFT_JOB (or SLURM_JOB_ID) names the job: processes of different
// jobs refuse each other. The service starts when a QP's address is first
// asked for and stops, closing every connection, when the last context of
// the process closes.
//
// Between processes the target side of every request runs in the target
// process, through the same responder as in-process requests: in the
// reader goroutine of the connection, or, while the application polls a
// CQ, in its poll (progress.go: an empty Poll handles the frames waiting
// on the connections, so a polling application gets its completions
// without a goroutine wake-up, and each side's acknowledgements ride on
// its next request). Payloads land in a buffer of the target process
// (over shared memory: are read from the ring, whose bytes the peer may
// change but not their length), and keys and bounds are checked on a
// private copy of the header, so a hostile peer cannot reach memory
// outside an MR. Region memfds are sealed at their size (a peer cannot
// truncate them under a mapping). Over shared memory, a large RC write into a region from Alloc
// registered with remote write access is copied by the requester itself
// into its mapping of the region, after the target's responder accepted
// the request (shm.go); regions from Register (Go memory) are never
// shared. Between processes of one host (shared memory, unix sockets),
// the payload of a large RC send or write (over shared memory: one that
// cannot be direct) is read by the target's responder straight from the
// requester's memory with process_vm_readv, in the order of the ring or
// socket, where the kernel allows it (one copy instead of two; a request
// its requester let go of first is not delivered: cma.go;
// GOVERBS_SOFT_PULL=0 turns it off), and the data of a large RC read that
// is not direct by the requester from the target's. RC requests are pipelined (see xreq.go). A connection that fails
// (the peer died, a malformed frame, a write that times out) fails the
// oldest RC request in flight on it with RETRY_EXC_ERR and the QP flushes
// the rest, as a RC QP whose retries are exhausted; so does a request
// without a response after the QP's transport timeout, 4.096 µs ×
// 2^timeout × (retry_cnt+1), but at least minRespTimeout (250 ms: the
// peer's goroutines, unlike a NIC, need the CPU to answer, and a loaded
// host can deschedule them for tens of milliseconds), restarted while
// the peer shows signs of life (its frames arrive, alive frames among
// them while it handles the segments of a long message: a slow peer is
// not a dead one; conn.alive), not counting the periods during which this
// process itself was stalled (xreq.go, retire). A write waiting for room
// in a socket fails after the response timeout only if the socket took
// nothing meanwhile (conn.writeAllLocked). A receiver that exits right after it polled a
// receive completion, without closing anything, has acknowledged the
// message already: the acknowledgement leaves before the completion is
// visible (conn.ackFirst), or, over a unix socket or shared memory, is
// published in the connection's acknowledgement page or ring header,
// which the sender reads when the connection fails (ackpage.go); Close
// hands over what is held too.
// So is an RDMA write's, which completes nothing at the target: over
// shared memory and unix sockets the responder publishes that it holds
// the acknowledgement before the payload lands (ackpage.go, Writes), so
// a target that sees a write land and exits at once does not take it
// along. Over TCP it may: the writer then sees RETRY_EXC_ERR for a write
// that was executed (a NIC acknowledges whatever its process does next;
// between hosts only the socket can carry the acknowledgement, and
// writing it before each write's payload lands would be a system call
// per write).
// Requests run in the poster's goroutine
// where possible: PostSend executes the work requests it queued (copying
// memory directly between registered regions) unless another goroutine is
// already running that QP's send queue. The target side of every request
// (key, bounds and access checks, PSN check, receive matching, atomics) is
// done by the responder in responder.go, which sees only a
// transport-independent request (see link in transport.go).
//
// Where hardware behaviour varies or cannot be reproduced exactly, soft0
// does the following:
//
//   - A RC request to a QP that does not exist, was destroyed, is in ERR,
//     is connected to another QP, or expects another PSN gets no answer on
//     hardware and fails with RETRY_EXC_ERR after timeout × retry_cnt;
//     soft0 fails it at once with RETRY_EXC_ERR. A target in RESET or INIT
//     is retried per timeout/retry_cnt (timeout 0: forever) and the retry
//     happens at once when the target reaches RTR.
//   - An RNR-NAKed request is retried when the target posts a receive (to
//     its RQ or SRQ) without using a retry; each expiry of the target's
//     min_rnr_timer uses one of rnr_retry (7: infinite).
//   - Missing REMOTE_WRITE/READ/ATOMIC in the target QP's access flags,
//     a read or atomic to a QP with max_dest_rd_atomic 0, and a misaligned
//     atomic give REM_INV_REQ_ERR (rxe and hfi1 do the same); rkey, bounds,
//     PD or MR-access violations give REM_ACCESS_ERR. Both move the target
//     QP to ERR. Misaligned atomics and atomics whose SGE is not exactly 8
//     bytes are already refused by PostSend (EINVAL), like rxe.
//   - A receive buffer that is too small gives LOC_LEN_ERR at the receiver;
//     for RC the sender gets REM_INV_REQ_ERR and both QPs go to ERR, for UC
//     and UD the receiving QP stays operational and the sender succeeds.
//   - A UD message longer than the port MTU (4096) completes with
//     LOC_LEN_ERR at the sender (rxe silently drops it per C10-93.1.1).
//   - When the connection to a peer process is lost (the process exited,
//     was killed, or closed its last device context), the RC and UC QPs
//     connected to QPs of that process move to ERR as on a fatal
//     transport error: what arrived before is delivered, then the posted
//     receives complete with WR_FLUSH_ERR and the context reports
//     QP_FATAL for each (conn.failQPs). Hardware reports nothing there
//     (a QP that only receives waits forever); soft0 knows, and says so
//     where verbs has a place for it. A peer that only destroys its QP
//     and lives on is not noticed, as on hardware.
//   - Every requester-side error completion moves the QP to ERR (also for
//     UC and UD, which on some hardware go to SQE) and reports an async
//     QP_FATAL event; responder-side errors report QP_REQ_ERR or
//     QP_ACCESS_ERR.
//   - A UD work request with an unknown or destroyed AH is refused by
//     PostSend with EINVAL.
//   - Send completions carry ByteLen (the message length) for every
//     opcode, like rxe.
//   - Requests execute as soon as they are posted, so max_rd_atomic never
//     limits anything. In SQD the send queue starts no new message, and
//     SQ_DRAINED is reported once none is in progress: none in flight to
//     a peer process, none waiting for its retry after an RNR NAK (which,
//     as in rxe, is not sent again before the QP returns to RTS).
//   - Its copies and atomics on registered memory on behalf of requests
//     stand for a NIC's DMA: in race builds the race detector does not
//     see them (dma_race.go), for Go memory (Register) as for memory
//     outside the Go heap (Alloc), since applications synchronize with
//     them through completions and their peers' messages, which the
//     detector cannot follow across processes. Remote atomics on Go
//     memory are atomic among the provider's own operations
//     (IBV_ATOMIC_HCA), not with the CPU's.
package soft

import (
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// DeviceName is the name of the soft device.
const DeviceName = "soft0"

// New returns the soft provider.
func New() prov.Provider { return provider{} }

type provider struct{}

func (provider) Name() string { return "soft" }

func (provider) Devices() ([]prov.DeviceInfo, error) {
	f := getFabric()
	return []prov.DeviceInfo{{Name: DeviceName, GUID: f.guid, Transport: "software", Provider: "soft"}}, nil
}

func (provider) Open(name string) (prov.Context, error) {
	if name != DeviceName {
		return nil, fmt.Errorf("soft: open %q: %w", name, prov.ErrNoDevice)
	}
	c := &devContext{f: getFabric()}
	c.events.Init()
	c.f.openContext()
	return c, nil
}
