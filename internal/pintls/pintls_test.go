package pintls

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"testing"
	"time"
)

// session runs a TLS handshake over a loopback connection: the server
// presents id, the client uses cfg. It returns both ends and the
// client's handshake error.
func session(t *testing.T, id *Identity, cfg *tls.Config) (client, server *tls.Conn, err error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan *tls.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- nil
			return
		}
		s := tls.Server(c, id.ServerConfig())
		Handshake(context.Background(), s, 10*time.Second)
		done <- s
	}()
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	client = tls.Client(nc, cfg)
	err = Handshake(context.Background(), client, 10*time.Second)
	if err != nil {
		nc.Close()
	}
	server = <-done
	t.Cleanup(func() {
		client.Close()
		if server != nil {
			server.Close()
		}
	})
	return client, server, err
}

func TestPinning(t *testing.T) {
	id, err := NewIdentity()
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewIdentity()
	if err != nil {
		t.Fatal(err)
	}
	if id.Fingerprint() == other.Fingerprint() {
		t.Fatal("two identities have one fingerprint")
	}
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
		ok   bool
	}{
		{"Pinned", ClientConfig(id.Fingerprint()), true},
		{"OtherFingerprint", ClientConfig(other.Fingerprint()), false},
		{"Unpinned", UnpinnedClientConfig(), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, err := session(t, id, tc.cfg)
			if tc.ok != (err == nil) {
				t.Fatalf("handshake: %v, want success %v", err, tc.ok)
			}
			if !tc.ok {
				if !errors.Is(err, ErrFingerprint) {
					t.Fatalf("error %v, want ErrFingerprint", err)
				}
				return
			}
			if v := c.ConnectionState().Version; v != tls.VersionTLS13 {
				t.Fatalf("TLS version %#x, want 1.3", v)
			}
		})
	}
}

// TestBinding: both ends export the same bytes; another session other
// bytes, so a proof made for one fails in the other.
func TestBinding(t *testing.T) {
	id, err := NewIdentity()
	if err != nil {
		t.Fatal(err)
	}
	c1, s1, err := session(t, id, ClientConfig(id.Fingerprint()))
	if err != nil {
		t.Fatal(err)
	}
	c2, _, err := session(t, id, ClientConfig(id.Fingerprint()))
	if err != nil {
		t.Fatal(err)
	}
	b1, err := Binding(c1, "EXPORTER-test")
	if err != nil {
		t.Fatal(err)
	}
	sb1, err := Binding(s1, "EXPORTER-test")
	if err != nil {
		t.Fatal(err)
	}
	b2, err := Binding(c2, "EXPORTER-test")
	if err != nil {
		t.Fatal(err)
	}
	secret := []byte("shared token")
	if !Equal(Prove(secret, "client", b1), Prove(secret, "client", sb1)) {
		t.Fatal("the two ends of a session disagree on the proof")
	}
	if Equal(Prove(secret, "client", b1), Prove(secret, "client", b2)) {
		t.Fatal("a proof is valid in another session")
	}
	if Equal(Prove(secret, "client", b1), Prove(secret, "server", b1)) {
		t.Fatal("a proof is valid for another role")
	}
	if Equal(Prove(secret, "client", b1), Prove([]byte("other token"), "client", b1)) {
		t.Fatal("a proof is valid for another secret")
	}
}
