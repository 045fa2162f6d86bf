package verbs

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// pathInfo is what Connect programmed into a QP's RTR transition, for the
// error when the device refuses it: hardware answers a path it cannot
// resolve (a GID no neighbour owns, a LID no subnet manager assigned) with
// a bare errno, ETIMEDOUT on SoftRoCE.
type pathInfo struct {
	Port      uint8
	LinkLayer LinkLayer
	PortLID   uint16 // the local port's LID and its subnet manager's (InfiniBand)
	SMLID     uint16
	ActiveMTU MTU // of the local port

	AH      AHAttr // the address vector given
	PathMTU MTU
	Remote  Endpoint

	// Source is the GID entry AH.SGIDIndex names (when the AV has a GRH),
	// and Subnet the prefix of its netdev's address that holds it (RoCE),
	// if one does.
	Source    GIDEntry
	HasSource bool
	Subnet    netip.Prefix
}

// String words the path and what to check, e.g.
//
//	path: port 1 (Ethernet), source GID index 0 fe80::1 (RoCE v2, netdev
//	veth0, subnet fe80::/64) to GID fe80::dead:beef of QPN 17, path MTU 1024
//	(port active MTU 1024, peer 1024); check that the peer's GID is the one
//	its endpoint was made with and that it is reachable from veth0 ...
func (p pathInfo) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "path: port %d (%s), ", p.Port, p.LinkLayer)
	mtu := fmt.Sprintf("path MTU %s (port active MTU %s, peer %s)", p.PathMTU, p.ActiveMTU, p.Remote.MTU)
	if !p.AH.IsGlobal {
		fmt.Fprintf(&b, "no GRH, to LID %d of QPN %d, SL %d, %s; ", p.AH.DLID, p.Remote.QPN, p.AH.SL, mtu)
		fmt.Fprintf(&b, "check that a subnet manager runs (port LID %d, SM LID %d) and that LID %d is the peer port's; "+
			"across subnets connect with ConnectOptions.ForceGRH", p.PortLID, p.SMLID, p.AH.DLID)
		return b.String()
	}
	fmt.Fprintf(&b, "source GID index %d", p.AH.SGIDIndex)
	netdev := ""
	if p.HasSource {
		fmt.Fprintf(&b, " %s (%s", p.Source.GID, p.Source.Type)
		if p.Source.Netdev != "" {
			netdev = p.Source.Netdev
			fmt.Fprintf(&b, ", netdev %s", netdev)
		}
		if p.Subnet.IsValid() {
			fmt.Fprintf(&b, ", subnet %s", p.Subnet)
		}
		b.WriteString(")")
	}
	fmt.Fprintf(&b, " to GID %s of QPN %d", p.AH.DGID, p.Remote.QPN)
	if p.AH.DLID != 0 {
		fmt.Fprintf(&b, " (LID %d)", p.AH.DLID)
	}
	fmt.Fprintf(&b, ", hop limit %d, %s; ", p.AH.HopLimit, mtu)
	if p.LinkLayer != LinkLayerEthernet {
		b.WriteString("check that the peer's GID is the one its endpoint was made with and that a router joins the subnets")
		return b.String()
	}
	from := "this port"
	if netdev != "" {
		from = netdev
	}
	b.WriteString("check that the peer's GID is the one its endpoint was made with")
	dst := gidAddr(p.AH.DGID)
	if p.HasSource && gidAddr(p.Source.GID).Is4() != dst.Is4() {
		fam := map[bool]string{true: "IPv4", false: "IPv6"}
		fmt.Fprintf(&b, "; the peer's GID is %s but the source GID is %s: choose a source GID of the peer's family "+
			"(QPSpec.GIDIndex and FixedGID)", fam[dst.Is4()], fam[!dst.Is4()])
	} else if p.Subnet.IsValid() && !p.Subnet.Contains(dst) {
		fmt.Fprintf(&b, "; it lies outside %s, so it needs an IP route from %s, which only RoCE v2 has", p.Subnet, from)
	} else {
		fmt.Fprintf(&b, " and that its host answers neighbour discovery (ARP/NDP) on the link of %s", from)
	}
	if p.HasSource && p.Source.Type != GIDTypeRoCEv2 {
		b.WriteString("; the source GID is not RoCE v2: both sides must use the same RoCE version (choose with QPSpec.GIDIndex and FixedGID)")
	} else {
		b.WriteString("; both sides must use RoCE v2 GIDs (`goverbs devinfo -v` lists them)")
	}
	return b.String()
}

// gidAddr is the IP address of a RoCE GID (IPv4 for an IPv4-mapped one).
func gidAddr(g GID) netip.Addr { return netip.AddrFrom16(g).Unmap() }

// netdevSubnet returns the prefix of an address of the network device
// named netdev that holds ip (the zero Prefix if none does or the device
// is unknown). Link-local IPv6 addresses have the prefix fe80::/64.
func netdevSubnet(netdev string, ip netip.Addr) netip.Prefix {
	if netdev == "" {
		return netip.Prefix{}
	}
	ifc, err := net.InterfaceByName(netdev)
	if err != nil {
		return netip.Prefix{}
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return netip.Prefix{}
	}
	var pfx []netip.Prefix
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ones, _ := n.Mask.Size()
		if addr, ok := netip.AddrFromSlice(n.IP); ok {
			pfx = append(pfx, netip.PrefixFrom(addr.Unmap(), ones).Masked())
		}
	}
	return subnetOf(pfx, ip)
}

// subnetOf returns the first of pfx that holds ip, or for a link-local
// IPv6 address fe80::/64; the zero Prefix otherwise.
func subnetOf(pfx []netip.Prefix, ip netip.Addr) netip.Prefix {
	for _, p := range pfx {
		if p.Contains(ip) {
			return p
		}
	}
	if ip.Is6() && ip.IsLinkLocalUnicast() {
		return netip.MustParsePrefix("fe80::/64")
	}
	return netip.Prefix{}
}

// pathInfo gathers the path of an RTR transition to remote over ah.
func (q *qpCore) pathInfo(remote Endpoint, ah AHAttr, mtu MTU) pathInfo {
	p := pathInfo{Port: q.spec.Port, LinkLayer: q.port.LinkLayer, PortLID: q.port.LID, SMLID: q.port.SMLID,
		ActiveMTU: q.port.ActiveMTU, AH: ah, PathMTU: mtu, Remote: remote}
	if ah.IsGlobal && q.hasGID && q.gid.Index == int(ah.SGIDIndex) {
		p.Source, p.HasSource = q.gid, true
		if q.port.LinkLayer == LinkLayerEthernet {
			p.Subnet = netdevSubnet(q.gid.Netdev, gidAddr(q.gid.GID))
		}
	}
	return p
}
