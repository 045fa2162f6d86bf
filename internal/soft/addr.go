package soft

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
)

// --- provider addresses ---
//
// A provider address says how to reach the process that owns a QP. Layout
// (version 1, little endian):
//
//	[0]     version (1)
//	[1]     transport kind: 1 = process (a soft0 fabric)
//	[2:10]  fabric id: random per process
//	[10:14] process id
//	[14:]   TLVs: type (1 byte), length (2 bytes), value; unknown types are
//	        skipped, so that later versions can add transports.
//
// TLVs of this version, present once the process' soft service runs (see
// service.go):
//
//	1 host     16 bytes: host identity (boot id and machine id, hashed);
//	           equal identities mean the shared-memory transport may work
//	2 secret   16 bytes: random per fabric; a connecting process must
//	           prove that it holds it (handshake.go: it never crosses the
//	           wire), so only holders of one of this process' endpoints
//	           connect. An endpoint is a credential: exchange it only
//	           with the peers it is meant for, confidentially.
//	3 unix     abstract unix socket name (same-host transport)
//	4 tcp      the TCP transport: host:port, or several separated by
//	           commas (a service listening on every interface advertises
//	           each of them; see advertisedTCP)
//	5 cert     32 bytes: SHA-256 of the process' TLS certificate, pinned
//	           by a dialer that encrypts (tls.go)
//
// Every QP of a process has the same address; the QPN selects the QP.

const (
	addrVersion     = 1
	addrKindProcess = 1
	addrMinLen      = 14

	tlvHost   = 1
	tlvSecret = 2
	tlvUnix   = 3
	tlvTCP    = 4
	tlvCert   = 5

	maxTLVString = 255
	maxTCPList   = 512 // the whole address must fit an Endpoint (1024 bytes)
)

// peerAddr is a decoded provider address.
type peerAddr struct {
	fabric    uint64
	pid       uint32
	host      [16]byte
	hasHost   bool
	secret    [16]byte
	hasSecret bool
	unix      string
	tcp       string // comma-separated host:port list
	cert      [32]byte
	hasCert   bool
}

func encodeAddr(id uint64, pid uint32) []byte {
	b := make([]byte, addrMinLen)
	b[0] = addrVersion
	b[1] = addrKindProcess
	binary.LittleEndian.PutUint64(b[2:], id)
	binary.LittleEndian.PutUint32(b[10:], pid)
	return b
}

func appendTLV(b []byte, typ byte, v []byte) []byte {
	b = append(b, typ)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

// encodePeerAddr encodes a full address.
func encodePeerAddr(a *peerAddr) []byte {
	b := encodeAddr(a.fabric, a.pid)
	if a.hasHost {
		b = appendTLV(b, tlvHost, a.host[:])
	}
	if a.hasSecret {
		b = appendTLV(b, tlvSecret, a.secret[:])
	}
	if a.unix != "" {
		b = appendTLV(b, tlvUnix, []byte(a.unix))
	}
	if a.tcp != "" {
		b = appendTLV(b, tlvTCP, []byte(a.tcp))
	}
	if a.hasCert {
		b = appendTLV(b, tlvCert, a.cert[:])
	}
	return b
}

// parseAddr decodes a provider address. It fails (EINVAL) on a malformed
// address or another version.
func parseAddr(b []byte) (peerAddr, error) {
	var a peerAddr
	if len(b) < addrMinLen || b[0] == 0 {
		return a, fmt.Errorf("malformed soft provider address (%d bytes): %w", len(b), syscall.EINVAL)
	}
	if b[0] != addrVersion {
		return a, fmt.Errorf("soft provider address version %d is not supported by this version (%d): %w", b[0], addrVersion, syscall.EINVAL)
	}
	a.fabric = binary.LittleEndian.Uint64(b[2:])
	a.pid = binary.LittleEndian.Uint32(b[10:])
	rest := b[addrMinLen:]
	for len(rest) > 0 {
		if len(rest) < 3 {
			return a, fmt.Errorf("malformed soft provider address: truncated option: %w", syscall.EINVAL)
		}
		typ, n := rest[0], int(binary.LittleEndian.Uint16(rest[1:]))
		if len(rest) < 3+n {
			return a, fmt.Errorf("malformed soft provider address: option %d of %d bytes is truncated: %w", typ, n, syscall.EINVAL)
		}
		v := rest[3 : 3+n]
		rest = rest[3+n:]
		switch typ {
		case tlvHost, tlvSecret:
			if n != 16 {
				return a, fmt.Errorf("malformed soft provider address: option %d has %d bytes, want 16: %w", typ, n, syscall.EINVAL)
			}
			if typ == tlvHost {
				copy(a.host[:], v)
				a.hasHost = true
			} else {
				copy(a.secret[:], v)
				a.hasSecret = true
			}
		case tlvUnix, tlvTCP:
			limit := maxTLVString
			if typ == tlvTCP {
				limit = maxTCPList
			}
			if n == 0 || n > limit || bytes.IndexByte(v, 0) >= 0 {
				return a, fmt.Errorf("malformed soft provider address: option %d of %d bytes: %w", typ, n, syscall.EINVAL)
			}
			if typ == tlvUnix {
				a.unix = string(v)
			} else {
				a.tcp = string(v)
			}
		case tlvCert:
			if n != len(a.cert) {
				return a, fmt.Errorf("malformed soft provider address: certificate fingerprint of %d bytes, want %d: %w", n, len(a.cert), syscall.EINVAL)
			}
			copy(a.cert[:], v)
			a.hasCert = true
		}
	}
	return a, nil
}

// --- transport selection ---

// Transport kinds. The environment variable GOVERBS_SOFT_TRANSPORT (or
// ForceTransport) forces one for every connection set up afterwards:
//
//	auto    (default) same process: direct; same host: shared memory,
//	        falling back to the unix socket, then TCP; otherwise TCP
//	direct  (or inproc) only QPs of the same process are reachable
//	shm     shared memory (shm.go), also between QPs of one process;
//	        other hosts are unreachable
//	unix    the unix socket, also between QPs of one process
//	tcp     TCP, also between QPs of one process or one host
const (
	transportAuto   = ""
	transportDirect = "direct"
	transportShm    = "shm"
	transportUnix   = "unix"
	transportTCP    = "tcp"
)

const envTransport = "GOVERBS_SOFT_TRANSPORT"

var transportSetting = override{env: envTransport, parse: parseTransport}

// ForceTransport makes every connection the soft provider sets up from now
// on use the named transport ("inproc", "shm", "unix", "tcp" or "auto"), taking
// precedence over GOVERBS_SOFT_TRANSPORT, until the returned function
// restores the previous setting. It is meant for tests: established
// connections keep their transport.
func ForceTransport(kind string) (restore func(), err error) { return transportSetting.force(kind) }

func parseTransport(s string) (string, error) {
	switch k := strings.ToLower(strings.TrimSpace(s)); k {
	case "", "auto":
		return transportAuto, nil
	case transportDirect, "inproc":
		return transportDirect, nil
	case transportShm, transportUnix, transportTCP:
		return k, nil
	}
	return "", fmt.Errorf("soft: transport %q: want auto, inproc, shm, unix or tcp: %w", s, syscall.EINVAL)
}

// transportChoice returns the transport in force.
func transportChoice() (string, error) {
	k, err := transportSetting.get()
	if err != nil {
		return "", fmt.Errorf("%s: %w", envTransport, err)
	}
	return k, nil
}

// --- host and job identity ---

var hostIdentity = sync.OnceValue(func() [16]byte {
	var parts []string
	for _, p := range []string{"/proc/sys/kernel/random/boot_id", "/etc/machine-id", "/var/lib/dbus/machine-id"} {
		if b, err := os.ReadFile(p); err == nil {
			parts = append(parts, strings.TrimSpace(string(b)))
		}
	}
	var id [16]byte
	if len(parts) == 0 || parts[0] == "" {
		// Unknown host: never the same host as another process.
		copy(id[:], randomBytes(16))
		return id
	}
	sum := sha256.Sum256([]byte("goverbs-host\x00" + strings.Join(parts, "\x00")))
	copy(id[:], sum[:16])
	return id
})

// jobIdentity names the job a process belongs to: processes of different
// jobs refuse each other's connections. It is GOVERBS_SOFT_JOB, or else
// SLURM_JOB_ID, hashed (both unset: the empty job).
func jobIdentity() [16]byte {
	j := os.Getenv("GOVERBS_SOFT_JOB")
	if j == "" {
		j = os.Getenv("SLURM_JOB_ID")
	}
	sum := sha256.Sum256([]byte("goverbs-job\x00" + j))
	var id [16]byte
	copy(id[:], sum[:16])
	return id
}

// AddrPID returns the id of the process that owns the QP whose provider
// address (as in its endpoint) is b, for tests that must know which
// process holds a queue pair.
func AddrPID(b []byte) (int, error) {
	a, err := parseAddr(b)
	if err != nil {
		return 0, err
	}
	return int(a.pid), nil
}

// AddrTCP returns the TCP addresses (comma-separated) that the provider
// address b advertises, for tests.
func AddrTCP(b []byte) (string, error) {
	a, err := parseAddr(b)
	if err != nil {
		return "", err
	}
	return a.tcp, nil
}
