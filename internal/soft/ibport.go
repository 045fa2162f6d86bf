package soft

import (
	"sync/atomic"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// ibPorts counts the ForceInfiniBand calls not yet restored.
var ibPorts atomic.Int32

// ForceInfiniBand makes soft0 present its port as an InfiniBand port from
// now on, until the returned function restores the Ethernet (RoCE) port.
// It is for tests only, in one process: the test tiers have no InfiniBand
// device, and this is how the InfiniBand addressing of the verbs layer
// (LID routing without a GRH, ConnectOptions.ForceGRH) runs end to end.
// While it is in force:
//
//   - QueryPort reports link layer InfiniBand, the port's LID (derived
//     from the process' fabric id, 1..0xBFFF) and SM LID 1;
//   - the GID table has one entry, the link-local GID 0, of type IB;
//   - an address vector may omit the GRH (IsGlobal false); it then needs a
//     DLID, which must be the LID of the port its provider address names:
//     another is refused with EINVAL, as a path no subnet manager knows
//     (hardware would accept it and fail the requests with
//     RETRY_EXC_ERR). Connections are still carried by provider address;
//     without one, the DLID of this process' own port reaches it;
//   - an address vector with a GRH must use source GID index 0;
//   - UD receive completions carry the sender's LID (SLID).
//   - UD receives still start with a GRH (soft0 builds one per datagram),
//     which an InfiniBand receiver gets only from senders that add one.
//
// Connections, QPs and address handles keep what they were set up with.
func ForceInfiniBand() (restore func()) {
	ibPorts.Add(1)
	var once atomic.Bool
	return func() {
		if once.CompareAndSwap(false, true) {
			ibPorts.Add(-1)
		}
	}
}

// infiniBand reports whether ForceInfiniBand is in force.
func infiniBand() bool { return ibPorts.Load() > 0 }

// portLID is the InfiniBand LID of the port of the fabric with id fabric
// (a unicast LID, 1..0xBFFF).
func portLID(fabric uint64) uint16 { return uint16(fabric%0xBFFF) + 1 }

// asInfiniBand turns the attributes of the Ethernet port of fabric f into
// those of an InfiniBand port.
func (f *fabric) asInfiniBand(a prov.PortAttr) prov.PortAttr {
	a.LinkLayer = prov.LinkLayerInfiniBand
	a.LID, a.SMLID = portLID(f.id), 1
	return a
}

// checkLIDRoute checks an address vector without a GRH on an InfiniBand
// port: it needs a DLID, and the DLID must be the LID of the port its
// provider address names.
func checkLIDRoute(a *prov.AHAttr, op string) error {
	if a.DLID == 0 {
		return errnof(syscall.EINVAL, "%s: the address has neither a GRH nor a DLID", op)
	}
	if len(a.ProviderAddr) == 0 {
		return nil
	}
	pa, err := parseAddr(a.ProviderAddr)
	if err != nil {
		return errnof(syscall.EINVAL, "%s: %v", op, err)
	}
	if lid := portLID(pa.fabric); lid != a.DLID {
		return errnof(syscall.EINVAL, "%s: DLID %d is not the LID of the destination port (%d): no path to it", op, a.DLID, lid)
	}
	return nil
}
