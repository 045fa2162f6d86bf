// Package verbstest holds the provider conformance suite of goverbs and the
// test helpers built for it.
//
// # The conformance suite
//
// Run executes every conformance case against the devices named in a
// Config, each case as a subtest of its own. A case opens its own device
// contexts, creates and closes every object it uses (a failed Close fails
// the case), fails on verbs objects that were garbage-collected without
// Close (CheckLeaks), and asserts observable verbs behaviour: the bytes that
// arrive, completion statuses, opcodes, byte_len, immediate data, wr_ids,
// QP numbers and QP states. The expectations come from the verbs
// specification and rdma-core's documentation (ibv_post_send(3),
// ibv_poll_cq(3), ibv_modify_qp(3), ...), not from any one provider, so the
// same suite runs on the soft provider and on real devices such as the
// kernel's SoftRoCE (rxe).
//
// A provider that knowingly behaves differently from verbs in some case
// lists it in Config.Deviations with the reason; the case is then reported
// as skipped with that reason, never silently dropped. A deviation may name
// a whole case ("ErrRecvTooSmall") or one check of a case
// ("ErrRecvTooSmall/ReceiverStatus"); Cases lists the names.
//
// Waiting for completions and events is bounded by Config.Timeout as a
// guard against hangs only: the suite never asserts on elapsed time.
//
// A provider uses the suite from an ordinary test:
//
//	func TestConformance(t *testing.T) {
//		verbstest.Run(t, verbstest.Config{
//			DeviceA: "rxe0",
//			DeviceB: "rxe1",
//			Deviations: map[string]string{
//				"SRQLimitEvent": "this device has no SRQ limit event",
//			},
//		})
//	}
//
// DeviceB may equal DeviceA for one-device loopback; SeparateContexts then
// decides whether the two sides share one verbs.Context or open the device
// twice (as two processes would).
//
// # Side B in a peer process
//
// With Config.PeerProcessB, every NewNodes call (so every case, or every
// check that opens its own nodes) starts a peer process, the test binary
// re-executed, that opens DeviceB with the soft provider and holds side
// B's objects: its queue pairs, completion queues, keys and the data
// movement. Side B's verbs objects in the test process forward every call
// to it (internal/provproxy), and the memory side B allocates is mapped in
// both processes, so the unchanged cases check their bytes, completions and
// states while every byte between the sides crosses soft0's real
// inter-process transport (GOVERBS_SOFT_TRANSPORT, inherited by the peer,
// forces shm, unix or tcp). The peer exits when the test ends, after
// everything was closed; a peer that exits with an error, panics or reports
// a data race fails the test. The checks that need what a peer process
// cannot do are skipped with their reason, and only in this mode: they
// are listed by PeerProcessLimits (registering Go memory of the test
// process on side B).
//
// A test binary that uses PeerProcessB, StartPeer or RunCrossProcess must
// call ServePeerIfRequested first thing in its TestMain:
//
//	func TestMain(m *testing.M) {
//		verbstest.ServePeerIfRequested()
//		os.Exit(m.Run())
//	}
//
// # Helpers
//
// The helpers used by the suite are exported for other tests: NewNodes opens
// the two sides of a loopback test (a context, a PD and a CQ each) and
// closes everything created through them when the test ends, in a safe
// order (queue pairs before the memory they may still access);
// NewLoopbackRC and NewLoopbackUC return two connected queue pairs; PollN
// collects completions; CheckLeaks fails a test that leaked verbs objects.
package verbstest
