package pintls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"time"
)

// ServerName is the name in every certificate of this package.
const ServerName = "goverbs"

// ErrFingerprint is returned by a handshake whose peer presented another
// certificate than the pinned one.
var ErrFingerprint = errors.New("pintls: the peer's TLS certificate does not match the pinned fingerprint")

// Identity is an ephemeral key with its self-signed certificate.
type Identity struct {
	cert tls.Certificate
	fp   [32]byte
}

// NewIdentity makes a fresh key and certificate.
func NewIdentity() (*Identity, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("pintls: key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("pintls: certificate serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: ServerName},
		DNSNames:     []string{ServerName},
		NotBefore:    now.Add(-time.Hour),
		// Pinned, not validated: the key lives as long as the process.
		NotAfter:    now.Add(100 * 365 * 24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("pintls: certificate: %w", err)
	}
	return &Identity{
		cert: tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key},
		fp:   sha256.Sum256(der),
	}, nil
}

// Fingerprint is the SHA-256 of the certificate (DER).
func (id *Identity) Fingerprint() [32]byte { return id.fp }

// ServerConfig is a TLS 1.3 server configuration presenting the
// identity; clients are not asked for certificates.
func (id *Identity) ServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion:             tls.VersionTLS13,
		Certificates:           []tls.Certificate{id.cert},
		ClientAuth:             tls.NoClientCert,
		SessionTicketsDisabled: true,
	}
}

// ClientConfig is a TLS 1.3 client configuration that accepts only the
// certificate whose SHA-256 is fp.
func ClientConfig(fp [32]byte) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ServerName: ServerName,
		// The certificate is pinned by its fingerprint; there is no CA
		// to verify a chain against.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return ErrFingerprint
			}
			got := sha256.Sum256(cs.PeerCertificates[0].Raw)
			if subtle.ConstantTimeCompare(got[:], fp[:]) != 1 {
				return ErrFingerprint
			}
			return nil
		},
	}
}

// UnpinnedClientConfig accepts any certificate: the session must then be
// authenticated by a proof over Binding (see Prove).
func UnpinnedClientConfig() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, ServerName: ServerName, InsecureSkipVerify: true}
}

// Handshake runs tc's handshake, bounded by ctx and timeout.
func Handshake(ctx context.Context, tc *tls.Conn, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return tc.HandshakeContext(ctx)
}

// Binding returns 32 bytes of keying material exported from the session
// of tc under label (RFC 8446 section 7.5): both ends get the same bytes,
// two sessions different ones.
func Binding(tc *tls.Conn, label string) ([]byte, error) {
	cs := tc.ConnectionState()
	return cs.ExportKeyingMaterial(label, nil, 32)
}

// Prove returns HMAC-SHA256(secret, role ‖ 0 ‖ binding): a proof that the
// sender holds secret, valid for one session and one role.
func Prove(secret []byte, role string, binding []byte) [32]byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(role))
	m.Write([]byte{0})
	m.Write(binding)
	var out [32]byte
	m.Sum(out[:0])
	return out
}

// Equal compares two proofs in constant time.
func Equal(a, b [32]byte) bool { return subtle.ConstantTimeCompare(a[:], b[:]) == 1 }

// PrefixConn is a net.Conn whose first bytes were already read (Pre):
// they are returned first.
type PrefixConn struct {
	net.Conn
	Pre []byte
}

func (c *PrefixConn) Read(p []byte) (int, error) {
	if len(c.Pre) > 0 {
		n := copy(p, c.Pre)
		c.Pre = c.Pre[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
