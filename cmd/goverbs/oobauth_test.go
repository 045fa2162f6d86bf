package main

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/pintls"
)

// TestBenchToken: a server with --token serves only a client that proves
// the token; strangers (no token, a wrong token, a raw TLS client with a
// made-up proof) are dropped having received nothing of the server's
// exchange, and the server goes on to serve the real client.
func TestBenchToken(t *testing.T) {
	port := freePort(t)
	const token = "correct horse battery staple"
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-n", "50", "-s", "4K", "-p", port, "--timeout", "60s"}
	var srv cmdResult
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var o, e bytes.Buffer
		srv.status = run(append(append([]string{}, args...), "--server", "--bind", "127.0.0.1", "--token", token), &o, &e)
		srv.out, srv.stderr = o.String(), e.String()
	}()
	addr := "127.0.0.1:" + port
	waitListening(t, addr)

	// A client without a token speaks in clear: the server's TLS
	// handshake fails, the client learns nothing.
	st, _, errs := runCmd(t, append(append([]string{}, args...), "--timeout", "5s", "127.0.0.1")...)
	if st == 0 {
		t.Fatalf("a client without the token was served")
	}
	t.Logf("client without token: %s", strings.TrimSpace(errs))

	// A client with a wrong token.
	st, _, errs = runCmd(t, append(append([]string{}, args...), "--timeout", "5s", "--token", "wrong", "127.0.0.1")...)
	if st == 0 || !strings.Contains(errs, "does not hold the token") {
		t.Fatalf("a client with a wrong token: exit %d, %s", st, errs)
	}

	// A raw TLS client with a made-up proof reads nothing but the end of
	// the stream.
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(30 * time.Second))
	tc := tls.Client(nc, pintls.UnpinnedClientConfig())
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	tc.Write(bytes.Repeat([]byte{1}, 32))
	got, _ := io.ReadAll(tc)
	tc.Close()
	if len(got) != 0 {
		t.Fatalf("a stranger received %d bytes: %q", len(got), got)
	}

	// The real client is served.
	st, out, errs := runCmd(t, append(append([]string{}, args...), "--token", token, "127.0.0.1")...)
	wg.Wait()
	if st != 0 || srv.status != 0 {
		t.Fatalf("client exit %d: %s%s\nserver exit %d: %s%s", st, out, errs, srv.status, srv.out, srv.stderr)
	}
	if _, rows := table(t, out); len(rows) != 1 {
		t.Fatalf("client output:\n%s", out)
	}
	if n := strings.Count(srv.stderr, "dropped client"); n < 3 {
		t.Errorf("the server reported %d dropped clients, want 3:\n%s", n, srv.stderr)
	}
}

// waitListening waits until something accepts TCP connections at addr.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
