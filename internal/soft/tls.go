package soft

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/pintls"
)

// Encryption of soft0 traffic that leaves the host.
//
// Every process whose service listens on TCP has an ephemeral identity:
// an ECDSA P-256 key made at start and a self-signed certificate, whose
// SHA-256 fingerprint its provider address carries (addr.go). A dialer
// that must encrypt runs TLS 1.3 (crypto/tls) and accepts only the
// certificate whose fingerprint the endpoint names; the handshake proofs
// (handshake.go) are then bound to the TLS session. The acceptor tells a
// TLS ClientHello from a plain HELLO by the first byte.
//
// When: GOVERBS_SOFT_TLS, or ForceTLS, chooses
//
//	auto  (default) TCP to or from an address that is not a loopback
//	      one is encrypted; loopback TCP, unix sockets and shared memory
//	      are not (they never leave the host)
//	on    every TCP connection is encrypted, loopback too
//	off   nothing is encrypted, and an acceptor takes plain TCP from
//	      any address (for networks the user trusts, or to measure)
//
// The acceptor refuses plain TCP from a non-loopback address unless the
// policy is off, and any plain TCP if it is on.
//
// The data path of an encrypted connection runs through a socket pair:
// the connection (conn.go) reads and writes one end as it would a plain
// socket, and two goroutines move the bytes between the other end and the
// TLS session, encrypting and decrypting.

const envTLS = "GOVERBS_SOFT_TLS"

const (
	tlsAuto = "auto"
	tlsOn   = "on"
	tlsOff  = "off"
)

var forcedTLS struct {
	mu     sync.Mutex
	policy string
	set    bool
}

// ForceTLS sets the encryption policy ("auto", "on" or "off") of the
// connections set up from now on, taking precedence over
// GOVERBS_SOFT_TLS, until the returned function restores the previous
// setting. It is meant for tests.
func ForceTLS(policy string) (restore func(), err error) {
	p, err := parseTLSPolicy(policy)
	if err != nil {
		return nil, err
	}
	forcedTLS.mu.Lock()
	prev, prevSet := forcedTLS.policy, forcedTLS.set
	forcedTLS.policy, forcedTLS.set = p, true
	forcedTLS.mu.Unlock()
	return func() {
		forcedTLS.mu.Lock()
		forcedTLS.policy, forcedTLS.set = prev, prevSet
		forcedTLS.mu.Unlock()
	}, nil
}

func parseTLSPolicy(s string) (string, error) {
	switch p := strings.ToLower(strings.TrimSpace(s)); p {
	case "", tlsAuto:
		return tlsAuto, nil
	case tlsOn, "1", "true", "yes":
		return tlsOn, nil
	case tlsOff, "0", "false", "no":
		return tlsOff, nil
	}
	return "", fmt.Errorf("soft: %s=%q: want auto, on or off: %w", envTLS, s, syscall.EINVAL)
}

// tlsPolicy returns the policy in force.
func tlsPolicy() (string, error) {
	forcedTLS.mu.Lock()
	p, set := forcedTLS.policy, forcedTLS.set
	forcedTLS.mu.Unlock()
	if set {
		return p, nil
	}
	return parseTLSPolicy(os.Getenv(envTLS))
}

// needTLS reports whether a TCP connection whose other end is at addr
// must be encrypted under policy.
func needTLS(policy string, addr net.Addr) bool {
	switch policy {
	case tlsOn:
		return true
	case tlsOff:
		return false
	}
	return !isLoopback(addr)
}

// isLoopback reports whether addr is a loopback IP address (127.0.0.0/8,
// ::1, or an IPv4-mapped loopback).
func isLoopback(addr net.Addr) bool {
	var ip net.IP
	switch a := addr.(type) {
	case *net.TCPAddr:
		ip = a.IP
	case *net.UDPAddr:
		ip = a.IP
	case *net.IPAddr:
		ip = a.IP
	default:
		return false
	}
	return ip != nil && ip.IsLoopback()
}

// tlsIdentity is a process' ephemeral TLS identity.
type tlsIdentity struct {
	*pintls.Identity
	fp [32]byte // its fingerprint, as endpoints carry it
}

func newTLSIdentity() (*tlsIdentity, error) {
	id, err := pintls.NewIdentity()
	if err != nil {
		return nil, fmt.Errorf("soft: TLS identity: %w", err)
	}
	return &tlsIdentity{Identity: id, fp: id.Fingerprint()}, nil
}

func (id *tlsIdentity) serverConfig() *tls.Config { return id.ServerConfig() }

// errFingerprint: the acceptor's certificate is not the one the endpoint
// names.
var errFingerprint = pintls.ErrFingerprint

// clientTLSConfig accepts only the certificate whose SHA-256 is fp.
func clientTLSConfig(fp [32]byte) *tls.Config { return pintls.ClientConfig(fp) }

// tlsExporterLabel labels the keying material that binds the handshake
// proofs to a TLS session.
const tlsExporterLabel = "EXPORTER-goverbs-soft-handshake-v2"

func tlsBinding(tc *tls.Conn) ([]byte, error) { return pintls.Binding(tc, tlsExporterLabel) }

// tlsHandshake runs the TLS handshake of tc within timeout.
func tlsHandshake(tc *tls.Conn, timeout time.Duration) error {
	return pintls.Handshake(context.Background(), tc, timeout)
}

// prefixConn is a net.Conn whose first bytes were already read.
type prefixConn = pintls.PrefixConn

// tlsPipe carries a connection's bytes through a TLS session: the
// connection reads and writes inner (one end of a socket pair, a plain
// socket for conn.go), and two goroutines of the service move them to
// and from tc. Closing the pipe (or inner) ends both goroutines and
// closes tc.
type tlsPipe struct {
	tc    *tls.Conn
	outer net.Conn
	once  sync.Once
}

// tlsPipeBuf is the size of each direction's buffer: TLS records are at
// most 16 KiB, and a write of several records costs one system call.
const tlsPipeBuf = 256 << 10

// newTLSPipe starts the goroutines (tracked in s.wg) and returns the inner
// end of the pair.
func (s *service) newTLSPipe(tc *tls.Conn) (net.Conn, *tlsPipe, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, os.NewSyscallError("socketpair", err)
	}
	for _, fd := range fds {
		// Room for a few records in flight each way.
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, tlsPipeBuf)
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, tlsPipeBuf)
	}
	inner, err := fdConn(fds[0], "tls-inner")
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	outer, err := fdConn(fds[1], "tls-outer")
	if err != nil {
		inner.Close()
		return nil, nil, err
	}
	p := &tlsPipe{tc: tc, outer: outer}
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		defer p.close()
		pump(tc, outer) // what the connection writes, encrypted to the peer
	}()
	go func() {
		defer s.wg.Done()
		defer p.close()
		pump(outer, tc) // what the peer sends, decrypted for the connection
	}()
	return inner, p, nil
}

// fdConn makes a net.Conn of a socket descriptor (which it takes over).
func fdConn(fd int, name string) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), name)
	c, err := net.FileConn(f)
	f.Close() // FileConn made its own descriptor
	if err != nil {
		return nil, err
	}
	return c, nil
}

// pump copies src to dst until either fails.
func pump(dst io.Writer, src io.Reader) {
	buf := make([]byte, tlsPipeBuf)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// close ends the pipe: the TLS session's socket (the peer sees the end of
// the stream, as with a plain socket: no close_notify, which could wait
// for a peer that reads nothing) and the outer end, which ends the
// connection's reads of the inner one.
func (p *tlsPipe) close() {
	p.once.Do(func() {
		p.tc.NetConn().Close()
		p.outer.Close()
	})
}

// Close implements io.Closer for the connection (conn.link).
func (p *tlsPipe) Close() error {
	p.close()
	return nil
}
