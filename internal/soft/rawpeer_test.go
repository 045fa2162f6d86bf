package soft

import (
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// rawDial connects to the soft service of the process whose provider
// address is addr, over network ("tcp" or "unix"), and completes the
// handshake from raw bytes as the process of fabric id fabric (this
// process' pid: on a unix socket the service checks it). It returns the
// authenticated connection, on which the caller speaks frames, with
// hangGuard as its deadline.
//
// It is the one place where tests perform the handshake by hand.
func rawDial(t testing.TB, addr []byte, network string, fabric uint64) net.Conn {
	t.Helper()
	pa, err := parseAddr(addr)
	if err != nil {
		t.Fatal(err)
	}
	kind, address := uint8(kindTCP), pa.tcp
	if network == "unix" {
		kind, address = kindUnix, pa.unix
	}
	nc, err := net.Dial(network, address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(hangGuard))
	hb := make([]byte, hdrLen+helloLen)
	putHdr(hb, frHello, helloLen, 0)
	putHello(hb[hdrLen:], &hello{kind: kind, pid: uint32(os.Getpid()), fabric: fabric, target: pa.fabric,
		secret: pa.secret, job: jobIdentity(), host: hostIdentity()})
	if _, err := nc.Write(hb); err != nil {
		t.Fatal(err)
	}
	ab := make([]byte, hdrLen+ackLen)
	if _, err := io.ReadFull(nc, ab); err != nil {
		t.Fatal(err)
	}
	if err := checkAck(ab, &pa); err != nil {
		t.Fatal(err)
	}
	return nc
}
