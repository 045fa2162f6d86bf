package provproxy

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
)

// Pair returns the two ends of a new connection between a client and a
// server (a unix SOCK_SEQPACKET socket pair, close-on-exec). Typically
// local goes to NewClient and remote to a peer process, in
// exec.Cmd.ExtraFiles; the parent closes its copy of remote once the
// process started, so that the client sees the connection end when the
// process does.
func Pair() (local, remote *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("provproxy: socketpair: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "provproxy-client"), os.NewFile(uintptr(fds[1]), "provproxy-server"), nil
}

// conn is one end of a connection: whole packets, each with the file
// descriptors sent along. send is safe for concurrent use (a packet is
// written by one sendmsg); recv is for one goroutine.
type conn struct {
	uc   *net.UnixConn
	rbuf []byte
	oob  []byte
}

// newConn takes over f, which must be a SOCK_SEQPACKET unix socket.
func newConn(f *os.File) (*conn, error) {
	defer f.Close()
	typ, err := unix.GetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil {
		return nil, fmt.Errorf("provproxy: %s: %w", f.Name(), err)
	}
	if typ != unix.SOCK_SEQPACKET {
		return nil, fmt.Errorf("provproxy: %s: socket type %d, want SOCK_SEQPACKET: %w", f.Name(), typ, unix.EPROTOTYPE)
	}
	nc, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("provproxy: %s: %w", f.Name(), err)
	}
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		nc.Close()
		return nil, fmt.Errorf("provproxy: %s: a %T, not a unix socket: %w", f.Name(), nc, unix.EPROTOTYPE)
	}
	return &conn{uc: uc, rbuf: make([]byte, maxMsg), oob: make([]byte, unix.CmsgSpace(4*4))}, nil
}

// send writes one packet with fds attached.
func (c *conn) send(p []byte, fds ...int) error {
	if len(p) > maxMsg {
		return fmt.Errorf("provproxy: %d-byte message, the limit is %d", len(p), maxMsg)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := c.uc.WriteMsgUnix(p, oob, nil)
	return err
}

// recv reads one packet; the slice is valid until the next recv. The
// caller owns the returned descriptors. The end of the connection is
// io.EOF (a zero-length packet, which no end sends, reads as one too).
// A packet that was too long, or came with more descriptors than fit, is
// an error wrapping errMalformed; the connection stays usable.
func (c *conn) recv() ([]byte, []int, error) {
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(c.rbuf, c.oob)
	var fds []int
	if oobn > 0 {
		fds = fdpass.Rights(c.oob[:oobn])
	}
	switch {
	case err != nil:
		fdpass.Close(fds)
		return nil, nil, err
	case flags&unix.MSG_TRUNC != 0:
		fdpass.Close(fds)
		return nil, nil, fmt.Errorf("%w: packet longer than %d bytes", errMalformed, maxMsg)
	case flags&unix.MSG_CTRUNC != 0:
		fdpass.Close(fds)
		return nil, nil, fmt.Errorf("%w: more file descriptors than expected", errMalformed)
	}
	return c.rbuf[:n], fds, nil
}

func (c *conn) close() error { return c.uc.Close() }
