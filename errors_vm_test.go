//go:build ibverbs && linux && cgo

package verbs_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// TestConnectErrorDevices connects a QP on rxe0 to an endpoint of rxe1 whose
// GID was replaced by one nobody owns: SoftRoCE refuses the RTR transition
// (ETIMEDOUT: the neighbour does not answer). The error must name the
// transition and its attributes, and the path: source GID index and type,
// netdev, subnet, destination and MTU.
func TestConnectErrorDevices(t *testing.T) {
	devs := vmtest.Require(t)
	a := openCMSide(t, devs[0])
	b := openCMSide(t, devs[1])
	qa, err := a.pd.NewRCQueuePair(a.spec())
	if err != nil {
		t.Fatal(err)
	}
	defer checkClose(t, "qp of "+devs[0], qa)
	qb, err := b.pd.NewRCQueuePair(b.spec())
	if err != nil {
		t.Fatal(err)
	}
	defer checkClose(t, "qp of "+devs[1], qb)
	port, err := a.dev.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	eb, err := qb.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	if eb.GID, err = verbs.ParseGID("fe80::dead:beef"); err != nil {
		t.Fatal(err)
	}
	err = qa.Connect(eb)
	t.Logf("Connect: %v", err)
	var oe *verbs.OpError
	if !errors.As(err, &oe) || oe.Op != "connect qp" || oe.Device != devs[0] {
		t.Errorf("Connect to a GID nobody owns: %v; want an *OpError of connect qp on %s", err, devs[0])
	}
	if !errors.Is(err, syscall.ETIMEDOUT) {
		t.Errorf("Connect to a GID nobody owns: %v; want ETIMEDOUT", err)
	}
	mtu := min(port.ActiveMTU, eb.MTU).String()
	msg := fmt.Sprint(err)
	for _, want := range []string{
		"to RTR, attributes STATE|AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN = mask 0x129181",
		"path: port 1 (Ethernet), source GID index 0 fe80::",
		"(RoCE v2, netdev veth0, subnet fe80::/64) to GID fe80::dead:beef of QPN ",
		"path MTU " + mtu + " (port active MTU " + port.ActiveMTU.String(),
		"neighbour discovery (ARP/NDP) on the link of veth0",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("connect error lacks %q", want)
		}
	}
}

// TestForceGRHDevices checks the address vector Connect programs on RoCE: a
// GRH always (IsGlobal, the peer's GID, the chosen source GID index), and
// with ConnectOptions the given traffic class; ForceGRH changes nothing
// there, as RoCE needs the GRH anyway. The hop limit is the kernel's: it
// takes it from the IP route to the GID when it resolves the peer's MAC
// (ib_resolve_eth_dmac), 64 here whatever ConnectOptions.HopLimit says.
// Data then flows over the connection.
func TestForceGRHDevices(t *testing.T) {
	devs := vmtest.Require(t)
	a := openCMSide(t, devs[0])
	b := openCMSide(t, devs[1])
	for _, tc := range []struct {
		name   string
		o      verbs.ConnectOptions
		tclass uint8
	}{
		{"default", verbs.ConnectOptions{}, 0},
		{"ForceGRH", verbs.ConnectOptions{ForceGRH: true, HopLimit: 7, TrafficClass: 0x20}, 0x20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			qa, err := a.pd.NewRCQueuePair(a.spec())
			if err != nil {
				t.Fatal(err)
			}
			defer checkClose(t, "qp A", qa)
			qb, err := b.pd.NewRCQueuePair(b.spec())
			if err != nil {
				t.Fatal(err)
			}
			defer checkClose(t, "qp B", qb)
			ea, err := qa.Endpoint()
			if err != nil {
				t.Fatal(err)
			}
			eb, err := qb.Endpoint()
			if err != nil {
				t.Fatal(err)
			}
			if err := qa.ConnectWith(eb, tc.o); err != nil {
				t.Fatal(err)
			}
			if err := qb.ConnectWith(ea, tc.o); err != nil {
				t.Fatal(err)
			}
			attr, err := qa.Query()
			if err != nil {
				t.Fatal(err)
			}
			ah := attr.AH
			t.Logf("A's address vector: %+v", ah)
			if !ah.IsGlobal || ah.DGID != eb.GID || ah.SGIDIndex != ea.GIDIndex || ah.HopLimit == 0 || ah.TrafficClass != tc.tclass {
				t.Errorf("A's address vector %+v: want a GRH to %s from GID index %d, a hop limit, traffic class %#x",
					ah, eb.GID, ea.GIDIndex, tc.tclass)
			}
			// The path works: B reads from A.
			copy(a.mr.Bytes(), "over the GRH")
			if err := qb.PostRead(1, verbs.Signaled, a.mr.Remote().At(0), verbs.SGE{Addr: b.mr.Addr(), Length: 12, LKey: b.mr.LKey()}); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			wcs, err := verbstest.PollN(ctx, b.cq, 1)
			if err != nil {
				t.Fatal(err)
			}
			if wc := wcs[0]; wc.Status != verbs.StatusSuccess || string(b.mr.Bytes()[:12]) != "over the GRH" {
				t.Errorf("read over the connection: %+v, %q", wcs[0], b.mr.Bytes()[:12])
			}
		})
	}
}
