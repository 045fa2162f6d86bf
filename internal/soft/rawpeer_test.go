package soft

import (
	"net"
	"os"
	"testing"
	"time"
)

// rawDial connects to the soft service of the process whose provider
// address is addr, over network ("tcp" or "unix"), and completes the
// handshake from raw bytes as the made-up process of fabric id fabric
// (fakeProcOf; with this process' pid: on a unix socket the service
// checks it). It returns the authenticated connection, on which the
// caller speaks frames, with hangGuard as its deadline.
func rawDial(t testing.TB, addr []byte, network string, fabric uint64) net.Conn {
	t.Helper()
	pa, err := parseAddr(addr)
	if err != nil {
		t.Fatal(err)
	}
	rp := fakeProcOf(fabric)
	rp.pid = uint32(os.Getpid())
	address := pa.tcp
	if network == "unix" {
		rp.kind, address = kindUnix, pa.unix
	}
	nc, err := net.Dial(network, address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(hangGuard))
	if r := rawHandshake(t, nc, rp, &pa, pa.secret, nil); r.status != ackOK {
		t.Fatalf("handshake refused: %s", ackReason(r.status))
	}
	return nc
}
