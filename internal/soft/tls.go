package soft

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

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
// An encrypted connection (conn.go) reads and writes its TLS session
// directly: its reader goroutine waits in the session's reads (pollers
// cannot read a TLS session without waiting: they only handle what the
// reader took in, and the reader never leaves the connection to them),
// and every write goes through the send queue and the flusher, gathered
// into large records (tlsWriter).

const envTLS = "GOVERBS_SOFT_TLS"

const (
	tlsAuto = "auto"
	tlsOn   = "on"
	tlsOff  = "off"
)

var tlsSetting = override{env: envTLS, parse: parseTLSPolicy}

// ForceTLS sets the encryption policy ("auto", "on" or "off") of the
// connections set up from now on, taking precedence over
// GOVERBS_SOFT_TLS, until the returned function restores the previous
// setting. It is meant for tests.
func ForceTLS(policy string) (restore func(), err error) { return tlsSetting.force(policy) }

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
func tlsPolicy() (string, error) { return tlsSetting.get() }

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

// tlsExporterLabel labels the keying material that binds the handshake
// proofs to a TLS session.
const tlsExporterLabel = "EXPORTER-goverbs-soft-handshake-v2"

func tlsBinding(tc *tls.Conn) ([]byte, error) { return pintls.Binding(tc, tlsExporterLabel) }

// tlsHandshake runs the TLS handshake of tc within timeout.
func tlsHandshake(tc *tls.Conn, timeout time.Duration) error {
	return pintls.Handshake(context.Background(), tc, timeout)
}

// bufConn is the socket under a TLS session. Its reads are buffered, so
// that the session's many small reads (a record header, then its body)
// cost one system call per tlsBuf bytes; while a connection writes
// (tlsWriter), its writes are gathered too, so that a write of many
// records costs one system call.
type bufConn struct {
	net.Conn
	r     *bufio.Reader
	w     *bufio.Writer
	batch atomic.Bool  // writes go to w (set and cleared under the connection's wmu)
	span  atomic.Int64 // how far ahead the write deadline was set (ns; 0: none)
}

// tlsBuf is the size of the buffers of a TLS connection: 16 records.
const tlsBuf = 256 << 10

// tlsHandshakeBuf is the read buffer of a TLS connection until it is a
// connection of the fabric (grow): a record and its header. A stranger
// that starts a TLS handshake with the listener makes it hold that, and
// no write buffer: before, every such stranger made it hold two of
// tlsBuf, 512 KiB, for up to the handshake timeout (TestTLSStrangerMemory).
const tlsHandshakeBuf = maxTLSRecord + 1024

func newBufConn(c net.Conn) *bufConn {
	return &bufConn{Conn: c, r: bufio.NewReaderSize(c, tlsHandshakeBuf)}
}

// grow gives the socket of an authenticated connection its full buffers
// (newTLSWriter, before the connection's reader starts): reads of tlsBuf
// (through the handshake's reader, which hands on what it still holds
// and then reads the socket straight into the larger buffer), and the
// writer of its batches.
func (c *bufConn) grow() {
	c.r = bufio.NewReaderSize(c.r, tlsBuf)
	c.w = bufio.NewWriterSize(patientConn{c}, tlsBuf)
}

func (c *bufConn) Read(b []byte) (int, error) { return c.r.Read(b) }

func (c *bufConn) Write(b []byte) (int, error) {
	if c.batch.Load() {
		return c.w.Write(b)
	}
	return c.patientWrite(b)
}

// SetWriteDeadline sets the socket's write deadline, and remembers how
// far ahead it is (patientWrite).
func (c *bufConn) SetWriteDeadline(t time.Time) error {
	c.storeSpan(t)
	return c.Conn.SetWriteDeadline(t)
}

// SetDeadline sets the socket's deadlines (see SetWriteDeadline).
func (c *bufConn) SetDeadline(t time.Time) error {
	c.storeSpan(t)
	return c.Conn.SetDeadline(t)
}

func (c *bufConn) storeSpan(t time.Time) { c.span.Store(int64(deadlineSpan(t))) }

// patientWrite writes b to the socket: a write that times out after the
// socket took some of b waits again, as long (conn.writeAllLocked). A
// TLS session fails for good on a write error, so the socket under it is
// patient in its place.
func (c *bufConn) patientWrite(b []byte) (int, error) {
	n := 0
	for {
		k, err := c.Conn.Write(b[n:])
		n += k
		d := time.Duration(c.span.Load())
		if !writeGoesOn(k, err, d) {
			return n, err
		}
		c.Conn.SetWriteDeadline(time.Now().Add(d))
	}
}

// patientConn is what the buffered writer of a bufConn writes to.
type patientConn struct{ c *bufConn }

func (p patientConn) Write(b []byte) (int, error) { return p.c.patientWrite(b) }

// tlsWriter writes a connection's frames into its TLS session (wmu
// held). A frame's header and a small payload are separate buffers:
// written one by one, each would be a record of its own, so small buffers
// are gathered (stage) into records; a buffer of a record's size or more
// is written from where it is. What the records make is sent with one
// system call per tlsBuf bytes (bufConn).
type tlsWriter struct {
	tc    *tls.Conn
	bc    *bufConn
	stage []byte
}

// maxTLSRecord is the largest plaintext of a TLS record.
const maxTLSRecord = 16 << 10

func newTLSWriter(tc *tls.Conn) *tlsWriter {
	bc := tc.NetConn().(*bufConn)
	bc.grow()
	return &tlsWriter{tc: tc, bc: bc, stage: make([]byte, 0, maxTLSRecord)}
}

func (w *tlsWriter) writeAll(bufs [][]byte) error {
	w.bc.batch.Store(true)
	defer w.bc.batch.Store(false)
	for _, b := range bufs {
		if len(b) >= maxTLSRecord {
			if err := w.flushStage(); err != nil {
				return err
			}
			if _, err := w.tc.Write(b); err != nil {
				return err
			}
			continue
		}
		for len(b) > 0 {
			k := min(len(b), cap(w.stage)-len(w.stage))
			w.stage = append(w.stage, b[:k]...)
			b = b[k:]
			if len(w.stage) == cap(w.stage) {
				if err := w.flushStage(); err != nil {
					return err
				}
			}
		}
	}
	if err := w.flushStage(); err != nil {
		return err
	}
	return w.bc.w.Flush()
}

func (w *tlsWriter) flushStage() error {
	if len(w.stage) == 0 {
		return nil
	}
	_, err := w.tc.Write(w.stage)
	w.stage = w.stage[:0]
	return err
}
