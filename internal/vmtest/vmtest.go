// Package vmtest tells tests whether they run inside the SoftRoCE VM of
// scripts/vm/run.sh (tier 3 of the test plan) and which RDMA devices it has.
//
// Inside the VM, run.sh sets GOVERBS_VM=1 and GOVERBS_VM_DEVICES=rxe0,rxe1:
// two rdma_rxe devices over a veth pair, both PORT_ACTIVE, GID index 0 being
// the link-local RoCE v2 GID, memlock unlimited.
//
// Typical use in a hardware-provider test built with -tags ibverbs:
//
//	func TestLoopbackRC(t *testing.T) {
//		devs := vmtest.Require(t) // skips outside the VM
//		...open devs[0] and devs[1]...
//	}
//
// and on the host:
//
//	go test -tags ibverbs -exec "$PWD/scripts/vm/run.sh --" ./internal/ibv/...
package vmtest

import (
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
)

// EnvVM is set to "1" by scripts/vm/run.sh inside the guest.
const EnvVM = "GOVERBS_VM"

// EnvDevices lists the guest's RDMA devices, comma-separated.
const EnvDevices = "GOVERBS_VM_DEVICES"

// EnvAddrs maps each device to the IPv6 link-local address (with zone) of
// its netdev, for RDMA CM: "rxe0=fe80::1%veth0,rxe1=fe80::2%veth1".
const EnvAddrs = "GOVERBS_VM_ADDRS"

// InVM reports whether the process runs inside the SoftRoCE VM.
func InVM() bool { return os.Getenv(EnvVM) == "1" }

// Devices returns the RDMA device names of the VM (rxe0, rxe1), or nil
// outside it.
func Devices() []string {
	if !InVM() {
		return nil
	}
	var out []string
	for _, d := range strings.Split(os.Getenv(EnvDevices), ",") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}

// Require skips t unless it runs inside the SoftRoCE VM with at least two
// devices, and returns the device names.
func Require(t testing.TB) []string {
	t.Helper()
	devs := Devices()
	if len(devs) < 2 {
		t.Skip("needs the SoftRoCE VM: run with scripts/vm/run.sh (go test -exec \"$PWD/scripts/vm/run.sh --\")")
	}
	return devs
}

// Addr returns the IPv6 link-local address, with zone ("fe80::1%veth0"), of
// the netdev under RDMA device dev, for RDMA CM; "" outside the VM or for an
// unknown device. RDMA CM cannot use 127.0.0.1 in the VM.
func Addr(dev string) string {
	if !InVM() {
		return ""
	}
	for _, kv := range strings.Split(os.Getenv(EnvAddrs), ",") {
		if k, v, ok := strings.Cut(strings.TrimSpace(kv), "="); ok && k == dev {
			return v
		}
	}
	return ""
}

// CMPair is how RDMA CM tests connect the VM's first two devices: a
// server on the first, a client on the second (as perftest's tests do:
// server rxe0, client rxe1).
type CMPair struct {
	Server, Client string // the devices
	// Listen is the IPv6 link-local address of the server device's
	// netdev (with its zone), for a listener.
	Listen netip.Addr
	// DialZone is the zone of the client device's netdev.
	DialZone string
}

// Target is where the client dials a listener on port: the server's
// address with the zone of the client's netdev, so that the kernel
// routes it over the veth pair and the client device carries the
// connection.
func (p CMPair) Target(port uint16) string {
	return netip.AddrPortFrom(p.Listen.WithZone(p.DialZone), port).String()
}

// ListenAddr is the server's address with port (0: any), for a listener.
func (p CMPair) ListenAddr(port uint16) string {
	return netip.AddrPortFrom(p.Listen, port).String()
}

// CMAddrs returns the CMPair of the VM's devices. It skips t outside the
// VM, or if the VM gave its netdevs no addresses, and fails it if an
// address does not parse.
func CMAddrs(t testing.TB) CMPair {
	t.Helper()
	devs := Devices()
	if len(devs) < 2 {
		t.Skip("needs two RDMA devices with IP addresses (rxe0, rxe1): run in the SoftRoCE VM (go test -tags ibverbs -exec \"$PWD/scripts/vm/run.sh --\")")
	}
	a0, a1 := Addr(devs[0]), Addr(devs[1])
	if a0 == "" || a1 == "" {
		t.Skipf("the VM gave no IP address to the netdevs of %s and %s (%s=%s): RDMA CM needs one", devs[0], devs[1], EnvAddrs, strconv.Quote(os.Getenv(EnvAddrs)))
	}
	l, err := netip.ParseAddr(a0)
	if err != nil {
		t.Fatalf("vmtest: address of %s: %v", devs[0], err)
	}
	c, err := netip.ParseAddr(a1)
	if err != nil {
		t.Fatalf("vmtest: address of %s: %v", devs[1], err)
	}
	return CMPair{Server: devs[0], Client: devs[1], Listen: l, DialZone: c.Zone()}
}
