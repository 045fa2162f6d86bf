package verbs

import (
	"net/netip"
	"strings"
	"testing"
)

func mustGID(t *testing.T, s string) GID {
	t.Helper()
	g, err := ParseGID(s)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// TestPathInfo checks the words of the path hint a failed RTR transition
// carries (Connect), per kind of path.
func TestPathInfo(t *testing.T) {
	ll := mustGID(t, "fe80::1c2a:3bff:fe4c:5d6e")
	v4 := mustGID(t, "::ffff:10.1.2.3")
	for _, tc := range []struct {
		name string
		p    pathInfo
		want []string // substrings, in order
		not  []string
	}{{
		name: "RoCE link-local",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerEthernet, ActiveMTU: MTU1024, PathMTU: MTU1024,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "fe80::dead:beef"), SGIDIndex: 0, HopLimit: 64, Port: 1},
			Remote: Endpoint{QPN: 17, MTU: MTU4096},
			Source: GIDEntry{GID: ll, Index: 0, Type: GIDTypeRoCEv2, Netdev: "veth0"}, HasSource: true,
			Subnet: netip.MustParsePrefix("fe80::/64")},
		want: []string{"path: port 1 (Ethernet), source GID index 0 fe80::1c2a:3bff:fe4c:5d6e (RoCE v2, netdev veth0, subnet fe80::/64)",
			"to GID fe80::dead:beef of QPN 17", "hop limit 64", "path MTU 1024 (port active MTU 1024, peer 4096)",
			"the peer's GID is the one its endpoint was made with", "neighbour discovery (ARP/NDP) on the link of veth0",
			"RoCE v2 GIDs"},
		not: []string{"outside", "LID", "not RoCE v2"},
	}, {
		name: "RoCE v2 peer in another subnet",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerEthernet, ActiveMTU: MTU4096, PathMTU: MTU2048,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "::ffff:10.9.0.1"), SGIDIndex: 3, HopLimit: 64},
			Remote: Endpoint{QPN: 5, MTU: MTU2048},
			Source: GIDEntry{GID: v4, Index: 3, Type: GIDTypeRoCEv2, Netdev: "eth1"}, HasSource: true,
			Subnet: netip.MustParsePrefix("10.1.2.0/24")},
		want: []string{"source GID index 3 ::ffff:10.1.2.3 (RoCE v2, netdev eth1, subnet 10.1.2.0/24)",
			"to GID ::ffff:10.9.0.1 of QPN 5", "path MTU 2048 (port active MTU 4096, peer 2048)",
			"it lies outside 10.1.2.0/24, so it needs an IP route from eth1, which only RoCE v2 has"},
		not: []string{"neighbour discovery"},
	}, {
		name: "RoCE IPv6 source, IPv4 peer",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerEthernet, ActiveMTU: MTU1024, PathMTU: MTU1024,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "::ffff:192.0.2.1"), HopLimit: 64},
			Remote: Endpoint{QPN: 18, MTU: MTU1024},
			Source: GIDEntry{GID: ll, Type: GIDTypeRoCEv2, Netdev: "veth0"}, HasSource: true,
			Subnet: netip.MustParsePrefix("fe80::/64")},
		want: []string{"to GID ::ffff:192.0.2.1 of QPN 18",
			"the peer's GID is IPv4 but the source GID is IPv6: choose a source GID of the peer's family"},
		not: []string{"outside", "neighbour"},
	}, {
		name: "RoCE v1 source",
		p: pathInfo{Port: 2, LinkLayer: LinkLayerEthernet, ActiveMTU: MTU1024, PathMTU: MTU1024,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "::ffff:10.1.2.4"), SGIDIndex: 1, HopLimit: 1},
			Remote: Endpoint{QPN: 9, MTU: MTU1024},
			Source: GIDEntry{GID: v4, Index: 1, Type: GIDTypeRoCEv1, Netdev: "eth1"}, HasSource: true,
			Subnet: netip.MustParsePrefix("10.1.2.0/24")},
		want: []string{"path: port 2 (Ethernet), source GID index 1 ::ffff:10.1.2.3 (RoCE v1",
			"on the link of eth1", "the source GID is not RoCE v2: both sides must use the same RoCE version"},
	}, {
		name: "source entry unknown",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerEthernet, ActiveMTU: MTU1024, PathMTU: MTU1024,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "fe80::2"), SGIDIndex: 7, HopLimit: 64},
			Remote: Endpoint{QPN: 3, MTU: MTU1024}},
		want: []string{"source GID index 7 to GID fe80::2 of QPN 3", "on the link of this port"},
		not:  []string{"subnet", "netdev"},
	}, {
		name: "InfiniBand by LID",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerInfiniBand, PortLID: 3, SMLID: 1, ActiveMTU: MTU4096, PathMTU: MTU2048,
			AH:     AHAttr{DLID: 12, SL: 2, Port: 1},
			Remote: Endpoint{QPN: 40, MTU: MTU2048, LID: 12}},
		want: []string{"path: port 1 (InfiniBand), no GRH, to LID 12 of QPN 40, SL 2, path MTU 2048 (port active MTU 4096, peer 2048)",
			"a subnet manager runs (port LID 3, SM LID 1) and that LID 12 is the peer port's", "ConnectOptions.ForceGRH"},
		not: []string{"GID"},
	}, {
		name: "InfiniBand with GRH",
		p: pathInfo{Port: 1, LinkLayer: LinkLayerInfiniBand, ActiveMTU: MTU4096, PathMTU: MTU4096,
			AH:     AHAttr{IsGlobal: true, DGID: mustGID(t, "fe80::2:c903:a:b"), DLID: 12, SGIDIndex: 0, HopLimit: 64},
			Remote: Endpoint{QPN: 40, MTU: MTU4096},
			Source: GIDEntry{GID: mustGID(t, "fe80::2:c903:a:c"), Type: GIDTypeIB}, HasSource: true},
		want: []string{"path: port 1 (InfiniBand), source GID index 0 fe80::2:c903:a:c (IB)", "to GID fe80::2:c903:a:b of QPN 40 (LID 12)",
			"a router joins the subnets"},
		not: []string{"RoCE", "neighbour"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.p.String()
			rest := s
			for _, w := range tc.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Errorf("hint lacks %q (in order):\n%s", w, s)
					continue
				}
				rest = rest[i+len(w):]
			}
			for _, w := range tc.not {
				if strings.Contains(s, w) {
					t.Errorf("hint has %q:\n%s", w, s)
				}
			}
		})
	}
}

func TestSubnetOf(t *testing.T) {
	pfx := []netip.Prefix{netip.MustParsePrefix("10.1.2.0/24"), netip.MustParsePrefix("2001:db8::/64")}
	for _, tc := range []struct{ ip, want string }{
		{"10.1.2.3", "10.1.2.0/24"},
		{"2001:db8::5", "2001:db8::/64"},
		{"fe80::1", "fe80::/64"},
		{"10.1.3.3", "invalid Prefix"},
	} {
		if got := subnetOf(pfx, netip.MustParseAddr(tc.ip)); got.String() != tc.want {
			t.Errorf("subnetOf(%s) = %s, want %s", tc.ip, got, tc.want)
		}
	}
	// The loopback device holds 127.0.0.1 in 127.0.0.0/8 on every Linux host.
	if got := netdevSubnet("lo", netip.MustParseAddr("127.0.0.1")); got != netip.MustParsePrefix("127.0.0.0/8") {
		t.Errorf("netdevSubnet(lo, 127.0.0.1) = %s, want 127.0.0.0/8", got)
	}
	if got := netdevSubnet("no-such-netdev0", netip.MustParseAddr("127.0.0.1")); got.IsValid() {
		t.Errorf("netdevSubnet of a missing device = %s", got)
	}
}
