package soft

import (
	"net"
	"slices"
	"strconv"
	"strings"
)

// What a process advertises of its TCP listener, and what a dialer tries.
//
// A listener on a specific address advertises that address. One on an
// unspecified address (GOVERBS_SOFT_LISTEN=0.0.0.0:0, [::]:0 or :0)
// cannot advertise it: a peer would dial its own host. It advertises
// instead every address of the host's interfaces that are up (IPv4 only
// for 0.0.0.0), loopback last, as far as fit in the address (maxTCPList
// bytes); IPv6 link-local addresses, which need a zone, are left out.
// GOVERBS_SOFT_ADVERTISE overrides all this with an explicit list (for
// NAT, or interfaces peers cannot reach).
//
// A dialer tries the addresses in this order: on the same host, loopback
// ones first; then those in a subnet of one of its own interfaces (the
// route to them is direct); then the rest, in the advertised order. A
// loopback address of another host is never tried. It stops at the first
// address where the peer's process answers, even with a refusal.

// advertisedTCP returns the TCP address list to put in the endpoints of a
// listener on laddr; override is GOVERBS_SOFT_ADVERTISE.
func advertisedTCP(laddr *net.TCPAddr, override string) string {
	port := strconv.Itoa(laddr.Port)
	var list []string
	if override = strings.TrimSpace(override); override != "" {
		for _, h := range strings.Split(override, ",") {
			if h = strings.TrimSpace(h); h == "" {
				continue
			}
			if _, _, err := net.SplitHostPort(h); err != nil {
				h = net.JoinHostPort(strings.Trim(h, "[]"), port)
			}
			list = append(list, h)
		}
		return joinTCPList(list)
	}
	if !laddr.IP.IsUnspecified() {
		return laddr.String()
	}
	v4only := laddr.IP.To4() != nil
	var loop []string
	for _, n := range upNets() {
		ip := n.IP
		if v4only && ip.To4() == nil {
			continue
		}
		if ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() {
			continue
		}
		a := net.JoinHostPort(ip.String(), port)
		if ip.IsLoopback() {
			loop = append(loop, a)
		} else {
			list = append(list, a)
		}
	}
	return joinTCPList(append(list, loop...))
}

// joinTCPList joins addresses with commas, as many as fit in maxTCPList
// bytes.
func joinTCPList(list []string) string {
	var b strings.Builder
	for _, a := range list {
		if b.Len()+len(a)+1 > maxTCPList {
			break
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(a)
	}
	return b.String()
}

// upNets returns the addresses, with their subnets, of the interfaces
// that are up.
func upNets() []*net.IPNet {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil
	}
	var nets []*net.IPNet
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				nets = append(nets, n)
			}
		}
	}
	return nets
}

// tcpCandidates orders the advertised TCP addresses for a dialer (see
// above); sameHost says whether the peer runs on this host.
func tcpCandidates(list string, sameHost bool) []string {
	const (
		rankLoop = iota
		rankSubnet
		rankOther
	)
	type cand struct {
		addr string
		rank int
	}
	var nets []*net.IPNet
	var cs []cand
	for _, a := range strings.Split(list, ",") {
		if a = strings.TrimSpace(a); a == "" {
			continue
		}
		host, _, err := net.SplitHostPort(a)
		if err != nil {
			continue
		}
		r := rankOther
		if ip := net.ParseIP(host); ip != nil {
			switch {
			case ip.IsLoopback():
				if !sameHost {
					continue // it would reach this host, not the peer's
				}
				r = rankLoop
			default:
				if nets == nil {
					nets = upNets()
				}
				if slices.ContainsFunc(nets, func(n *net.IPNet) bool { return !n.IP.IsLoopback() && n.Contains(ip) }) {
					r = rankSubnet
				}
			}
		} else if host == "localhost" {
			if !sameHost {
				continue
			}
			r = rankLoop
		}
		cs = append(cs, cand{a, r})
	}
	slices.SortStableFunc(cs, func(x, y cand) int { return x.rank - y.rank })
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.addr
	}
	return out
}
