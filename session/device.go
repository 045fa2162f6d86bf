package session

import (
	"fmt"
	"net"
	"strings"

	"github.com/goverbs/verbs"
)

const softDevice = "soft0"

// chooseDevice proposes this side's device: the one Config.Device names,
// else a hardware device with a GID of the bootstrap connection's local
// IP address (it routes to the peer, as the connection does), else
// soft0.
func chooseDevice(name string, local net.Addr) (hello, error) {
	h := hello{Version: protoVersion, Device: name, Explicit: name != ""}
	if name != "" {
		devs, err := verbs.Devices()
		if err != nil && len(devs) == 0 {
			return h, err
		}
		for _, d := range devs {
			if d.Name == name {
				h.Hardware = name != softDevice
				return h, nil
			}
		}
		return h, fmt.Errorf("session: no RDMA device %q (have %s): %w", name, deviceNames(devs), verbs.ErrNoDevice)
	}
	h.Device = softDevice
	ip := addrIP(local)
	if ip == nil {
		return h, nil
	}
	devs, _ := verbs.Devices()
	for _, d := range devs {
		if d.Name == softDevice {
			continue
		}
		if hasGID(d.Name, ip) {
			h.Device, h.Hardware = d.Name, true
			return h, nil
		}
	}
	return h, nil
}

func deviceNames(devs []verbs.Device) string {
	var n []string
	for _, d := range devs {
		n = append(n, d.Name)
	}
	if len(n) == 0 {
		return "none"
	}
	return strings.Join(n, ", ")
}

func addrIP(a net.Addr) net.IP {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP
	}
	return nil
}

// hasGID reports whether port 1 of device name has a GID of ip (RoCE:
// the IPv4-mapped or IPv6 GID of an address of its netdev).
func hasGID(name string, ip net.IP) bool {
	c, err := verbs.Open(name)
	if err != nil {
		return false
	}
	defer c.Close()
	gids, err := c.GIDTable(1)
	if err != nil {
		return false
	}
	want := ip.To16()
	for _, g := range gids {
		if net.IP(g.GID[:]).Equal(want) {
			return true
		}
	}
	return false
}

// describe says what carries the session (Transport).
func (s *Session) describe() string {
	name := s.dev.Name()
	if k := s.data.QueuePair().Link(); k != "" {
		if name == softDevice {
			return softDevice + "/" + k
		}
		return "rc/" + k
	}
	if name == softDevice {
		return softDevice
	}
	return "rc/" + name
}
