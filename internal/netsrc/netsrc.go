package netsrc

import "net"

// Net64 returns the /64 network of a global unicast or unique-local IPv6
// address, in CIDR notation ("2001:db8::/64"), and "" for any other
// address: IPv4 and IPv4-mapped IPv6 (one host each), link-local and
// loopback (whose /64 every host of a link, or every process of this
// host, shares), multicast and unspecified.
func Net64(ip net.IP) string {
	if ip.To4() != nil || len(ip) != net.IPv6len || ip.IsLoopback() || ip.IsLinkLocalUnicast() ||
		ip.IsMulticast() || ip.IsUnspecified() {
		return ""
	}
	mask := net.CIDRMask(64, 128)
	return (&net.IPNet{IP: ip.Mask(mask), Mask: mask}).String()
}
