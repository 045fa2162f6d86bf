package verbs_test

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// softDeviations lists the conformance cases in which the soft provider
// knowingly departs from verbs, each with the reason. Keep it empty: a
// deviation of soft0 is a bug unless it is listed here with a reason.
var softDeviations = map[string]string{}

// rxeDeviations lists where the kernel's SoftRoCE driver (rdma_rxe, as
// observed with Debian's 6.1 kernel in the VM tier) departs from verbs as
// the suite checks it.
var rxeDeviations = map[string]string{
	"ErrLocalProtection/SendBadLKey": "rxe completes a send whose SGE has an invalid lkey with LOC_QP_OP_ERR, " +
		"not LOC_PROT_ERR (its requester maps every copy failure except -EFAULT to LOC_QP_OP_ERR)",
	"ErrLocalProtection/SendFromOtherPD": "rxe completes a send whose lkey belongs to another PD with LOC_QP_OP_ERR, " +
		"not LOC_PROT_ERR (the same lkey lookup failure as SendBadLKey)",
	"ErrRecvTooSmall/SenderStatus": "rxe treats a receive buffer that is too small as a malformed WQE (class A): " +
		"the sender gets REM_OP_ERR, not REM_INV_REQ_ERR",
	"ErrRecvTooSmall/ReceiverStatus": "rxe treats a receive buffer that is too small as a malformed WQE (class A): " +
		"the receive completes with LOC_QP_OP_ERR, not LOC_LEN_ERR",
	"FlushAfterError/PostedInErr": "rxe does not flush a receive posted after the QP entered ERR " +
		"(the receive never completes; sends posted in ERR are flushed)",
	"Fence/StopsAtFence": "in about 1 run of the Fence case in 80 rxe's send queue stops for good at a fenced request " +
		"although every earlier request has completed (6 of 502 runs, each time at the fenced write that follows a " +
		"70000-byte read and send, in a round that posts one request at a time), and posting more requests does not restart it (a fence in rxe " +
		"waits until its count of outstanding reads and atomics, req.rd_atomic, is back at max_rd_atomic: that count " +
		"must have lost step with the completed reads and atomics)",
}

// TestConformanceSoft runs the provider conformance suite on soft0: with
// both sides of every case in one device context, with each side in its
// own context (as two processes would be), and with a fixed source GID.
func TestConformanceSoft(t *testing.T) {
	t.Run("SharedContext", func(t *testing.T) {
		verbstest.Run(t, verbstest.Config{DeviceA: verbs.SoftDevice, Deviations: softDeviations})
	})
	t.Run("SeparateContexts", func(t *testing.T) {
		verbstest.Run(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true, Deviations: softDeviations})
	})
	// soft0 picks its IPv4-mapped GID by default; GID index 0 is its
	// link-local IPv6 GID, which takes the other addressing path.
	t.Run("FixedGIDIndex0", func(t *testing.T) {
		verbstest.Run(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true, FixedGID: true, GIDIndex: 0,
			Deviations: softDeviations})
	})
}

// TestConformanceSoftCrossProcess runs the conformance suite on soft0 with
// side B of every case in a peer process (the test binary re-executed, see
// verbstest.Config.PeerProcessB), so that every byte between the two sides
// crosses soft0's inter-process transport. GOVERBS_SOFT_TRANSPORT chooses
// the transport (the peer inherits it); unset, the test runs once over
// each of tcp, unix and shm. Like every cross-process test it runs in the
// multiprocess tier of scripts/test.sh, not in the unit tier.
func TestConformanceSoftCrossProcess(t *testing.T) {
	run := func(t *testing.T) {
		verbstest.Run(t, verbstest.Config{DeviceA: verbs.SoftDevice, PeerProcessB: true, Deviations: softDeviations})
	}
	if os.Getenv("GOVERBS_SOFT_TRANSPORT") != "" {
		run(t)
		return
	}
	for _, tr := range []string{"tcp", "unix", "shm"} {
		t.Run(tr, func(t *testing.T) {
			t.Setenv("GOVERBS_SOFT_TRANSPORT", tr)
			run(t)
		})
	}
}

// TestConformanceDevices runs the conformance suite on the devices named
// by the environment, for hardware and the VM test tier:
//
//	GOVERBS_CONFORMANCE_DEVICES="rxe0,rxe1"   side A on rxe0, side B on rxe1
//	GOVERBS_CONFORMANCE_DEVICES="mlx5_0"      one-device loopback (two contexts)
//	GOVERBS_CONFORMANCE_GID_INDEX=1           optional: fixed source GID index
//	GOVERBS_CONFORMANCE_PORT=1                optional: port of both devices
//
// Inside the VM of scripts/vm/run.sh, GOVERBS_VM_DEVICES (rxe0,rxe1) is the
// default for GOVERBS_CONFORMANCE_DEVICES. The binary must be built with
// -tags ibverbs for hardware devices. The deviations of rdma_rxe apply to
// devices whose name starts with "rxe". Without either variable the test is
// skipped.
func TestConformanceDevices(t *testing.T) {
	spec := strings.TrimSpace(os.Getenv("GOVERBS_CONFORMANCE_DEVICES"))
	if spec == "" {
		spec = strings.TrimSpace(os.Getenv("GOVERBS_VM_DEVICES"))
	}
	if spec == "" {
		t.Skip("GOVERBS_CONFORMANCE_DEVICES is not set (e.g. \"rxe0,rxe1\"); the suite runs on soft0 in TestConformanceSoft")
	}
	devs := strings.Split(spec, ",")
	if len(devs) > 2 || strings.TrimSpace(devs[0]) == "" {
		t.Fatalf("GOVERBS_CONFORMANCE_DEVICES=%q: want one device or two, comma-separated", spec)
	}
	cfg := verbstest.Config{DeviceA: strings.TrimSpace(devs[0]), SeparateContexts: true}
	if len(devs) == 2 {
		cfg.DeviceB = strings.TrimSpace(devs[1])
	}
	if s := os.Getenv("GOVERBS_CONFORMANCE_GID_INDEX"); s != "" {
		i, err := strconv.Atoi(s)
		if err != nil || i < 0 {
			t.Fatalf("GOVERBS_CONFORMANCE_GID_INDEX=%q: want a GID table index", s)
		}
		cfg.FixedGID, cfg.GIDIndex = true, i
	}
	if s := os.Getenv("GOVERBS_CONFORMANCE_PORT"); s != "" {
		p, err := strconv.ParseUint(s, 10, 8)
		if err != nil || p == 0 {
			t.Fatalf("GOVERBS_CONFORMANCE_PORT=%q: want a port number from 1", s)
		}
		cfg.Port = uint8(p)
	}
	switch {
	case strings.HasPrefix(cfg.DeviceA, "rxe"):
		cfg.Deviations = rxeDeviations
	case cfg.DeviceA == verbs.SoftDevice:
		cfg.Deviations = softDeviations
	}
	verbstest.Run(t, cfg)
}
