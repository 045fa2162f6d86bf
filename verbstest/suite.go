package verbstest

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// DefaultTimeout is the default Config.Timeout.
const DefaultTimeout = 30 * time.Second

// Config describes what the conformance suite runs against. The zero value
// of every field except DeviceA selects a default.
type Config struct {
	// DeviceA and DeviceB name the devices of the two sides of every case
	// (for example "soft0", or "rxe0" and "rxe1"). DeviceB defaults to
	// DeviceA: one-device loopback.
	DeviceA, DeviceB string
	// SeparateContexts opens side B with its own verbs.Open when DeviceB is
	// the same device as DeviceA, as a second process would. Different
	// devices always have separate contexts.
	SeparateContexts bool
	// Port is the device port of both sides; default 1.
	Port uint8
	// FixedGID selects GIDIndex as the source GID of every queue pair
	// (verbs.QPSpec.FixedGID). Otherwise goverbs chooses the GID.
	FixedGID bool
	GIDIndex int
	// Deviations lists the cases, or single checks "Case/Check", that the
	// provider knowingly does not pass, each mapped to the reason. They
	// are reported as skipped with the reason. Names that are not cases
	// fail the run, so that a renamed case cannot hide a deviation.
	Deviations map[string]string
	// Timeout bounds each wait for completions or events, as a guard
	// against hangs (never an assertion about speed); default
	// DefaultTimeout.
	Timeout time.Duration
	// PeerProcessB puts side B of every case in a peer process: each
	// NewNodes call re-executes the test binary, which opens DeviceB
	// with the soft provider and serves it to this process over a unix
	// socket (internal/provproxy). Side B's verbs objects in this process
	// are ordinary ones whose every call runs in the peer: the peer holds
	// the queue pairs, completion queues and keys, side B's memory (from
	// Alloc) is mapped in both processes, and every byte between the
	// sides crosses the provider's inter-process transport (shared
	// memory, unix socket or TCP: GOVERBS_SOFT_TRANSPORT, which the peer
	// inherits, forces one). The peer exits when the test ends; one that
	// does not exit cleanly (an error, a panic, a data race) fails the
	// test. The test binary's TestMain must call ServePeerIfRequested
	// first. SeparateContexts does not matter then. The few checks that
	// need what a peer process cannot do are skipped with the reason
	// (PeerProcessLimits).
	PeerProcessB bool
}

// goMemoryLimit is why a check that registers Go memory on side B cannot
// run with side B in a peer process.
const goMemoryLimit = "side B registers Go memory of the test process (Register) and checks the bytes around it: " +
	"Go memory of one process cannot be registered with a device context in another process " +
	"(the same checks on a window of memory from Alloc, ErrOutOfBounds/Window*, run)"

// peerProcessLimits lists the checks that cannot run with side B in a
// peer process (Config.PeerProcessB), each with the reason.
var peerProcessLimits = map[string]string{
	"ErrOutOfBounds/WriteAcrossEnd":   goMemoryLimit,
	"ErrOutOfBounds/WriteBeforeStart": goMemoryLimit,
	"ErrOutOfBounds/WritePastEnd":     goMemoryLimit,
	"ErrOutOfBounds/ReadAcrossEnd":    goMemoryLimit,
	"ErrOutOfBounds/AtomicPastEnd":    goMemoryLimit,
}

// PeerProcessLimits returns the cases or checks ("Case/Check") that are
// skipped when side B is in a peer process (Config.PeerProcessB), each
// mapped to the reason.
func PeerProcessLimits() map[string]string { return maps.Clone(peerProcessLimits) }

// skipReason says why the case or check name is skipped under c, if it is.
func (c Config) skipReason(name string) (string, bool) {
	if reason, ok := c.Deviations[name]; ok {
		return "deviation of this provider: " + reason, true
	}
	if reason, ok := peerProcessLimits[name]; ok && c.PeerProcessB {
		return "side B in a peer process: " + reason, true
	}
	return "", false
}

func (c Config) withDefaults() Config {
	if c.DeviceB == "" {
		c.DeviceB = c.DeviceA
	}
	if c.Port == 0 {
		c.Port = 1
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	return c
}

// caseFunc is one conformance case.
type caseFunc func(t *testing.T, c *tcase)

type caseDef struct {
	name string
	fn   caseFunc
}

// cases is the suite, in the order Run runs it.
var cases = []caseDef{
	// Data transfer.
	{"SendRecv", testSendRecv},
	{"SendRecvLarge", testSendRecvLarge},
	{"SendRecvMultiSGE", testSendRecvMultiSGE},
	{"SendImm", testSendImm},
	{"Write", testWrite},
	{"WriteImm", testWriteImm},
	{"Read", testRead},
	{"CompareSwap", testCompareSwap},
	{"FetchAdd", testFetchAdd},
	{"AtomicMisaligned", testAtomicMisaligned},
	{"InlineSend", testInlineSend},
	{"InlineData", testInlineData},
	{"BatchWrites", testBatchWrites},
	{"Fence", testFence},
	// Queues and signaling.
	{"SendQueueFull", testSendQueueFull},
	{"RecvQueueFull", testRecvQueueFull},
	{"SelectiveSignaling", testSelectiveSignaling},
	{"SignalAll", testSignalAll},
	{"LimitsEnforced", testLimitsEnforced},
	{"SRQShared", testSRQShared},
	{"SRQLimitEvent", testSRQLimitEvent},
	// Other transports.
	{"UDSend", testUDSend},
	{"UDQKeyMismatch", testUDQKeyMismatch},
	{"UDOversize", testUDOversize},
	{"UDBatch", testUDBatch},
	{"UCSendWrite", testUCSendWrite},
	{"UCHelpers", testUCHelpers},
	{"SrcQP", testSrcQP},
	{"GIDRouting", testGIDRouting},
	// Errors.
	{"ErrBadRKey", testErrBadRKey},
	{"ErrOutOfBounds", testErrOutOfBounds},
	{"ErrNoRemotePermission", testErrNoRemotePermission},
	{"ErrLocalProtection", testErrLocalProtection},
	{"ErrInlineSGE", testErrInlineSGE},
	{"ErrRecvTooSmall", testErrRecvTooSmall},
	{"RecvMRClosed", testRecvMRClosed},
	{"ErrRNRRetryExceeded", testErrRNRRetryExceeded},
	{"ErrPostWrongState", testErrPostWrongState},
	{"FlushAfterError", testFlushAfterError},
	// Queue pair state machine.
	{"QPModifyQuery", testQPModifyQuery},
	{"QPResetReuse", testQPResetReuse},
	{"Link", testLink},
	// Completion channels.
	{"CQWait", testCQWait},
	{"CQWake", testCQWake},
	{"ChannelShared", testChannelShared},
	{"SolicitedEvents", testSolicitedEvents},
	// Devices, memory and object lifetimes.
	{"DeviceQuery", testDeviceQuery},
	{"MRRegistration", testMRRegistration},
	{"SGEBounds", testSGEBounds},
	{"CloseOrdering", testCloseOrdering},
	{"EndpointEncoding", testEndpointEncoding},
}

// Cases returns the names of the conformance cases, in the order Run runs
// them.
func Cases() []string {
	names := make([]string, len(cases))
	for i, c := range cases {
		names[i] = c.name
	}
	return names
}

// Run runs every conformance case against the devices of cfg, each as a
// subtest named after the case. Cases listed in cfg.Deviations are skipped
// with their reason, and so are, with cfg.PeerProcessB, those of
// PeerProcessLimits. Run does not call t.Parallel; the cases run one after
// the other.
func Run(t *testing.T, cfg Config) {
	t.Helper()
	if cfg.DeviceA == "" {
		t.Fatal("verbstest: Config.DeviceA is empty")
	}
	cfg = cfg.withDefaults()
	names := Cases()
	for d := range cfg.Deviations {
		if !slices.Contains(names, strings.SplitN(d, "/", 2)[0]) {
			t.Errorf("verbstest: Config.Deviations names %q, which is not a conformance case (see verbstest.Cases)", d)
		}
	}
	for _, def := range cases {
		t.Run(def.name, func(t *testing.T) {
			if reason, ok := cfg.skipReason(def.name); ok {
				t.Skip(reason)
			}
			CheckLeaks(t)
			def.fn(t, &tcase{cfg: cfg, name: def.name})
		})
	}
}

// tcase is the state of one running case.
type tcase struct {
	cfg  Config
	name string
}

// check runs f as a named check of the case (a subtest), skipped when the
// Config lists "Case/name" as a deviation, or side B is in a peer process
// and the check cannot run there.
func (c *tcase) check(t *testing.T, name string, f func(t *testing.T)) bool {
	t.Helper()
	return t.Run(name, func(t *testing.T) {
		if reason, ok := c.cfg.skipReason(c.name + "/" + name); ok {
			t.Skip(reason)
		}
		f(t)
	})
}

// guard returns a context that ends after the hang guard.
func (c *tcase) guard(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	t.Cleanup(cancel)
	return ctx
}

// poll collects exactly n completions from cq or fails the test.
func (c *tcase) poll(t testing.TB, cq *verbs.CompletionQueue, n int) []verbs.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	wcs, err := PollN(ctx, cq, n)
	if err != nil {
		t.Fatalf("%v (got %v)", err, wcs)
	}
	return wcs
}

// pollOne collects one completion from cq or fails the test.
func (c *tcase) pollOne(t testing.TB, cq *verbs.CompletionQueue) verbs.Completion {
	t.Helper()
	return c.poll(t, cq, 1)[0]
}

// expectEmpty fails t if cq holds a completion. Use it only where verbs
// ordering guarantees that no further completion can still arrive.
func expectEmpty(t testing.TB, what string, cq *verbs.CompletionQueue) {
	t.Helper()
	var wc [4]verbs.Completion
	n, err := cq.Poll(wc[:])
	if err != nil {
		t.Errorf("%s: poll: %v", what, err)
		return
	}
	if n > 0 {
		t.Errorf("%s: unexpected completion(s) %v", what, wc[:n])
	}
}

// stateQuerier is any queue pair.
type stateQuerier interface {
	State() (verbs.QPState, error)
}

// waitState waits until q is in state want (the provider may move a QP to
// ERR just after it delivers the completion that caused it), failing t if
// it is not when the hang guard ends.
func (c *tcase) waitState(t testing.TB, what string, q stateQuerier, want verbs.QPState) {
	t.Helper()
	deadline := time.Now().Add(c.cfg.Timeout)
	for {
		s, err := q.State()
		if err != nil {
			t.Errorf("%s: query state: %v", what, err)
			return
		}
		if s == want {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: QP state %s, want %s", what, s, want)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// expectState fails t unless q is in state want now.
func expectState(t testing.TB, what string, q stateQuerier, want verbs.QPState) {
	t.Helper()
	s, err := q.State()
	if err != nil {
		t.Errorf("%s: query state: %v", what, err)
	} else if s != want {
		t.Errorf("%s: QP state %s, want %s", what, s, want)
	}
}

// expectOK checks a successful completion: status, wr_id, opcode, QPN.
func expectOK(t testing.TB, what string, wc verbs.Completion, wrid uint64, op verbs.Opcode, qpn uint32) {
	t.Helper()
	if wc.Status != verbs.StatusSuccess {
		t.Errorf("%s: completion %v: status %s, want success", what, wc, wc.Status)
		return
	}
	if err := wc.Err(); err != nil {
		t.Errorf("%s: successful completion has Err() = %v", what, err)
	}
	if wc.WRID != wrid {
		t.Errorf("%s: wr_id %#x, want %#x", what, wc.WRID, wrid)
	}
	if wc.Opcode != op {
		t.Errorf("%s: opcode %s, want %s", what, wc.Opcode, op)
	}
	if wc.QPN != qpn {
		t.Errorf("%s: qp_num %d, want %d", what, wc.QPN, qpn)
	}
}

// expectStatus checks a failed completion. Only wr_id, status and qp_num
// are defined for those (ibv_poll_cq(3)).
func expectStatus(t testing.TB, what string, wc verbs.Completion, wrid uint64, status verbs.Status, qpn uint32) {
	t.Helper()
	if wc.Status != status {
		t.Errorf("%s: completion %v: status %s, want %s", what, wc, wc.Status, status)
	}
	if wc.WRID != wrid {
		t.Errorf("%s: wr_id %#x, want %#x", what, wc.WRID, wrid)
	}
	if wc.QPN != qpn {
		t.Errorf("%s: qp_num %d, want %d", what, wc.QPN, qpn)
	}
	if status != verbs.StatusSuccess {
		err := wc.Err()
		ce, ok := err.(*verbs.CompletionError)
		if !ok || ce.Status != wc.Status || ce.WRID != wc.WRID {
			t.Errorf("%s: Err() = %#v, want a *CompletionError with status %s and wr_id %#x", what, err, wc.Status, wc.WRID)
		}
	}
}

// expectByteLen checks byte_len of a receive completion.
func expectByteLen(t testing.TB, what string, wc verbs.Completion, n int) {
	t.Helper()
	if int(wc.ByteLen) != n {
		t.Errorf("%s: byte_len %d, want %d", what, wc.ByteLen, n)
	}
}

// expectImm checks the immediate data of a completion.
func expectImm(t testing.TB, what string, wc verbs.Completion, imm uint32) {
	t.Helper()
	if wc.Flags&verbs.WithImm == 0 {
		t.Errorf("%s: completion flags %#x lack WithImm", what, wc.Flags)
		return
	}
	if wc.Imm != imm {
		t.Errorf("%s: imm %#x, want %#x", what, wc.Imm, imm)
	}
}

// expectNoImm checks that a completion carries no immediate data.
func expectNoImm(t testing.TB, what string, wc verbs.Completion) {
	t.Helper()
	if wc.Flags&verbs.WithImm != 0 {
		t.Errorf("%s: completion has WithImm (imm %#x) but none was sent", what, wc.Imm)
	}
}

// must fails t on err.
func must(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}
