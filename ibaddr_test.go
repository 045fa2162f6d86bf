package verbs

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/goverbs/verbs/internal/soft"
)

// TestAddressTo checks the address vector Connect builds from the two
// ports' link layers, the peer's endpoint and ConnectOptions: LID routing
// between InfiniBand ports, a GRH with ForceGRH or on Ethernet, and the
// refusals.
func TestAddressTo(t *testing.T) {
	gidA := mustGID(t, "fe80::2:c903:a:1")
	gidB := mustGID(t, "fe80::2:c903:a:2")
	ib := func(lid uint16) *qpCore {
		return &qpCore{spec: QPSpec{Port: 1}, port: PortAttr{LinkLayer: LinkLayerInfiniBand, LID: lid},
			gid: GIDEntry{GID: gidA, Index: 0, Type: GIDTypeIB}, hasGID: true}
	}
	eth := &qpCore{spec: QPSpec{Port: 2}, port: PortAttr{LinkLayer: LinkLayerEthernet},
		gid: GIDEntry{GID: gidA, Index: 3, Type: GIDTypeRoCEv2}, hasGID: true}
	ibPeer := Endpoint{LinkLayer: LinkLayerInfiniBand, LID: 12, GID: gidB, QPN: 40, Addr: []byte{1, 2}}
	ethPeer := Endpoint{LinkLayer: LinkLayerEthernet, GID: gidB, QPN: 41}
	for _, tc := range []struct {
		name   string
		q      *qpCore
		remote Endpoint
		o      ConnectOptions
		want   AHAttr
		err    string
	}{
		{name: "InfiniBand by LID", q: ib(3), remote: ibPeer, o: ConnectOptions{ServiceLevel: 2, HopLimit: 9},
			want: AHAttr{Port: 1, DLID: 12, SL: 2, ProviderAddr: []byte{1, 2}}},
		{name: "InfiniBand ForceGRH", q: ib(3), remote: ibPeer, o: ConnectOptions{ForceGRH: true, TrafficClass: 0x20, ServiceLevel: 1},
			want: AHAttr{Port: 1, IsGlobal: true, DGID: gidB, SGIDIndex: 0, HopLimit: 64, TrafficClass: 0x20, DLID: 12, SL: 1,
				ProviderAddr: []byte{1, 2}}},
		{name: "InfiniBand ForceGRH hop limit", q: ib(3), remote: ibPeer, o: ConnectOptions{ForceGRH: true, HopLimit: 5},
			want: AHAttr{Port: 1, IsGlobal: true, DGID: gidB, HopLimit: 5, DLID: 12, ProviderAddr: []byte{1, 2}}},
		{name: "InfiniBand peer without LID", q: ib(3), remote: Endpoint{LinkLayer: LinkLayerInfiniBand, GID: gidB, QPN: 40},
			err: "peer on InfiniBand has LID 0"},
		{name: "InfiniBand ForceGRH peer without GID", q: ib(3), remote: Endpoint{LinkLayer: LinkLayerInfiniBand, LID: 12, QPN: 40},
			o: ConnectOptions{ForceGRH: true}, err: "peer endpoint has no GID but the path needs a GRH"},
		{name: "InfiniBand to Ethernet", q: ib(3), remote: ethPeer, err: "local port 1 is InfiniBand but the peer is on Ethernet"},
		{name: "Ethernet to InfiniBand", q: eth, remote: ibPeer, err: "local port 2 is Ethernet (RoCE) but the peer is on InfiniBand"},
		{name: "RoCE", q: eth, remote: ethPeer,
			want: AHAttr{Port: 2, IsGlobal: true, DGID: gidB, SGIDIndex: 3, HopLimit: 64}},
		{name: "RoCE ForceGRH", q: eth, remote: ethPeer, o: ConnectOptions{ForceGRH: true, TrafficClass: 8},
			want: AHAttr{Port: 2, IsGlobal: true, DGID: gidB, SGIDIndex: 3, HopLimit: 64, TrafficClass: 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.q.addressTo(tc.remote, tc.o)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("addressTo = %+v, %v; want an error saying %q", got, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("address vector (-want +got):\n%s", d)
			}
		})
	}
}

// TestInfiniBandPortSoft runs the InfiniBand addressing path end to end on
// soft0 with its port presented as InfiniBand (soft.ForceInfiniBand):
// endpoints carry the port's LID, Connect programs LID routing without a
// GRH (or a GRH with ForceGRH), data flows, and a LID that is not the
// peer's is refused with the path in the error.
func TestInfiniBandPortSoft(t *testing.T) {
	defer soft.ForceInfiniBand()()
	c, err := Open(SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	// Closed after the queue pairs of newRCPair (cleanups run last first).
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close context: %v", err)
		}
	})
	port, err := c.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	if port.LinkLayer != LinkLayerInfiniBand || port.LID == 0 || port.SMLID == 0 {
		t.Fatalf("forced InfiniBand port: %+v", port)
	}
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pd.Close(); err != nil {
			t.Errorf("close protection domain: %v", err)
		}
	})
	cq, err := c.NewCompletionQueue(CQSpec{Entries: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cq.Close(); err != nil {
			t.Errorf("close completion queue: %v", err)
		}
	})
	mr, err := pd.Alloc(4096, AccessLocalWrite|AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mr.Close(); err != nil {
			t.Errorf("close memory region: %v", err)
		}
	})

	for _, tc := range []struct {
		name   string
		o      ConnectOptions
		global bool
	}{
		{"LID", ConnectOptions{ServiceLevel: 3}, false},
		{"ForceGRH", ConnectOptions{ForceGRH: true}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			qa, qb := newRCPair(t, pd, cq)
			ea, err := qa.Endpoint()
			if err != nil {
				t.Fatal(err)
			}
			eb, err := qb.Endpoint()
			if err != nil {
				t.Fatal(err)
			}
			if ea.LinkLayer != LinkLayerInfiniBand || ea.LID != port.LID {
				t.Fatalf("endpoint %v: want InfiniBand with LID %d", ea, port.LID)
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
			if ah := attr.AH; ah.IsGlobal != tc.global || ah.DLID != eb.LID || ah.SL != tc.o.ServiceLevel ||
				(tc.global && ah.DGID != eb.GID) {
				t.Errorf("address vector %+v: want GRH %v, DLID %d, SL %d", ah, tc.global, eb.LID, tc.o.ServiceLevel)
			}
			copy(mr.Bytes(), "by LID")
			if err := qb.PostRead(7, Signaled, mr.Remote().At(0), SGE{Addr: mr.Addr() + 64, Length: 6, LKey: mr.LKey()}); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := cq.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			var wc [1]Completion
			if n, err := cq.Poll(wc[:]); n != 1 || err != nil || wc[0].Status != StatusSuccess || string(mr.Bytes()[64:70]) != "by LID" {
				t.Errorf("read: %d %v %+v %q", n, err, wc[0], mr.Bytes()[64:70])
			}
		})
	}

	// A LID that is not the peer's: no path.
	qa, qb := newRCPair(t, pd, cq)
	eb, err := qb.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	eb.LID++
	err = qa.Connect(eb)
	if !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "path: port 1 (InfiniBand), no GRH, to LID ") ||
		!strings.Contains(err.Error(), "a subnet manager runs") {
		t.Errorf("Connect to a wrong LID: %v; want EINVAL with the LID path", err)
	}
	t.Logf("Connect to a wrong LID: %v", err)
}

// newRCPair returns two RC QPs of pd on cq, closed when the test ends.
func newRCPair(t *testing.T, pd *ProtectionDomain, cq *CompletionQueue) (a, b *RCQueuePair) {
	t.Helper()
	newRC := func() *RCQueuePair {
		q, err := pd.NewRCQueuePair(QPSpec{SendCQ: cq})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { q.Close() })
		return q
	}
	return newRC(), newRC()
}
