//go:build ibverbs && linux && cgo

package verbs_test

import (
	"errors"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// Adversarial tests of the hardware provider (internal/ibv over the
// kernel's SoftRoCE driver, in the VM of scripts/vm/run.sh): misuse that a
// hostile or careless caller makes must give the same error class
// (errors.Is) on rxe as on soft0. Their names end in Devices so that the
// VM tier of scripts/test.sh runs them.

// advDevicePairs returns the device pairs to run a comparison on: soft0
// with itself, and the VM's two rxe devices.
func advDevicePairs(t *testing.T) [][2]string {
	devs := vmtest.Require(t)
	return [][2]string{{verbs.SoftDevice, verbs.SoftDevice}, {devs[0], devs[1]}}
}

// TestAdversarialBadGIDIndexDevices gives an address vector whose source
// GID index names no entry of the GID table, to Modify (INIT -> RTR) and
// to NewAddressHandle: soft0 refuses both with EINVAL, as the verbs layer
// refuses QPSpec.FixedGID with a bad index; on rxe libibverbs fails them
// with ENODATA, which must match EINVAL too.
func TestAdversarialBadGIDIndexDevices(t *testing.T) {
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			verbstest.CheckLeaks(t)
			a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
			eb := verbstest.Endpoint(t, qb)
			ah := verbs.AHAttr{IsGlobal: true, DGID: eb.GID, SGIDIndex: 200, HopLimit: 64, Port: 1, ProviderAddr: eb.Addr}
			err := qa.Modify(verbs.QPAttr{State: verbs.StateRTR, PathMTU: eb.MTU, DestQPN: eb.QPN, RQPSN: eb.PSN,
				MaxDestRDAtomic: 1, MinRNRTimer: 12, AH: ah},
				verbs.AttrState|verbs.AttrAV|verbs.AttrPathMTU|verbs.AttrDestQPN|verbs.AttrRQPSN|verbs.AttrMaxDestAtomic|verbs.AttrMinRNRTimer)
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("Modify to RTR with source GID index 200: %v, want an error wrapping EINVAL", err)
			}
			if st, err := qa.State(); err != nil || st != verbs.StateInit {
				t.Errorf("state after the refused Modify: %v, %v; want INIT", st, err)
			}
			h, err := a.PD.NewAddressHandle(ah)
			if err == nil {
				h.Close()
			}
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("NewAddressHandle with source GID index 200: %v, want an error wrapping EINVAL", err)
			}
		})
	}
}
