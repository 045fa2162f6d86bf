package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// hangGuard is how long an adversarial test waits for the command before
// it declares a hang.
const hangGuard = 30 * time.Second

// startServer runs goverbs bench ... --server on 127.0.0.1:port in the
// background; the returned function waits for it (failing the test after
// hangGuard) and returns its result.
func startServer(t *testing.T, port string, args ...string) func() cmdResult {
	t.Helper()
	done := make(chan cmdResult, 1)
	go func() {
		var o, e bytes.Buffer
		st := run(append(append([]string{}, args...), "--server", "--bind", "127.0.0.1", "-p", port), &o, &e)
		done <- cmdResult{st, o.String(), e.String()}
	}()
	return func() cmdResult {
		t.Helper()
		select {
		case r := <-done:
			return r
		case <-time.After(hangGuard):
			t.Fatalf("goverbs %s --server hangs", strings.Join(args, " "))
			return cmdResult{}
		}
	}
}

// benchCfg is the configuration goverbs bench write -s 4K -n 50 -d soft0
// parses to.
func benchCfg(server bool, port int) benchConfig {
	return benchConfig{op: "write", sizes: []int{4096}, iters: 50, dev: verbs.SoftDevice, batch: 16, cqMod: 16,
		txDepth: 128, rxDepth: 512, inline: -1, server: server, host: "127.0.0.1", bind: "127.0.0.1", port: port,
		timeout: hangGuard}
}

// TestAdversarialSilentPeer: a peer that completes the parameter exchange
// (a valid hello or welcome, a connected queue pair) and then says nothing
// more must fail the other side after --timeout with a clear error, not
// leave it waiting forever.
func TestAdversarialSilentPeer(t *testing.T) {
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--timeout", "1s"}
	t.Run("client", func(t *testing.T) {
		// The fake client's own setup (its device, before its hello)
		// must fit in the server's --timeout: 1 s did not once, in a CI
		// rehearsal's load. The stranger: a real client's exchange,
		// then silence.
		_, _, wait := fakeClient(t, args, "5s")
		srv := wait()
		if srv.status != exitError || !strings.Contains(srv.stderr, "waiting for sync") || !strings.Contains(srv.stderr, "deadline exceeded") {
			t.Errorf("server with a silent client: exit %d, stderr:\n%s", srv.status, srv.stderr)
		}
	})
	for _, then := range []string{"silence", "done"} {
		t.Run("client measuring then "+then, func(t *testing.T) { silentMeasuring(t, args, then) })
	}
	t.Run("server", func(t *testing.T) {
		port := freePort(t)
		p, _ := strconv.Atoi(port)
		ready := make(chan struct{})
		fake := make(chan error, 1)
		r := &remote{cfg: benchCfg(true, p), server: true}
		defer r.Close()
		ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
		defer cancel()
		go func() {
			var err error
			r.oob, err = acceptOOB(ctx, "127.0.0.1:"+port, "", func(net.Addr) { close(ready) }, &bytes.Buffer{})
			if err == nil {
				r.closers = append(r.closers, r.oob.Close)
				err = r.setup(ctx)
			}
			fake <- err
		}()
		<-ready
		done := make(chan cmdResult, 1)
		go func() {
			var o, e bytes.Buffer
			st := run(append(append([]string{}, args...), "-p", port, "127.0.0.1"), &o, &e)
			done <- cmdResult{st, o.String(), e.String()}
		}()
		select {
		case cli := <-done:
			if cli.status != exitError || !strings.Contains(cli.stderr, "waiting for sync") || !strings.Contains(cli.stderr, "deadline exceeded") {
				t.Errorf("client of a silent server: exit %d, stderr:\n%s", cli.status, cli.stderr)
			}
		case <-time.After(hangGuard):
			t.Fatal("the client of a silent server hangs")
		}
		if err := <-fake; err != nil {
			t.Fatalf("the fake server: %v", err)
		}
	})
}

// fakeClient starts goverbs ARGS --server with --timeout timeout (the
// last of args) and connects a client of this process to it, through the
// parameter exchange; the client is closed when the test ends.
func fakeClient(t *testing.T, args []string, timeout string) (*remote, context.Context, func() cmdResult) {
	t.Helper()
	port := freePort(t)
	wait := startServer(t, port, append(args[:len(args)-1:len(args)-1], timeout)...)
	p, _ := strconv.Atoi(port)
	r := &remote{cfg: benchCfg(false, p)}
	t.Cleanup(func() { r.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	var err error
	if r.oob, err = dialOOB(ctx, "127.0.0.1:"+port, ""); err != nil {
		t.Fatal(err)
	}
	r.closers = append(r.closers, r.oob.Close)
	if err := r.setup(ctx); err != nil {
		t.Fatal(err)
	}
	return r, ctx, wait
}

// silentMeasuring: a client that stops (or whose host vanishes) while it
// measures, after its alive frames kept the server waiting longer than
// --timeout: the server's wait for done, which spans the measurement,
// ends --timeout after the client's last frame (then "silence"); a
// client that measured that long and then sends done is served (then
// "done").
func silentMeasuring(t *testing.T, args []string, then string) {
	r, ctx, wait := fakeClient(t, args, "2s")
	if err := r.sync(ctx, "start", "ready", 4096); err != nil {
		t.Fatal(err)
	}
	// Alive for a while, longer than the server's --timeout, then
	// silent.
	stop := r.alive(ctx)
	time.Sleep(3 * time.Second)
	stop()
	want := []string{"waiting for sync", "not a word from client"}
	if then == "done" {
		// Measured (alive) for longer than --timeout, then done:
		// the server checks the data, which this client never
		// wrote.
		if err := r.oob.send(ctx, frameSync, syncMsg{Phase: "done", Size: 4096}); err != nil {
			t.Fatal(err)
		}
		want = []string{"data check failed"}
	}
	srv := wait()
	for _, w := range want {
		if srv.status != exitError || !strings.Contains(srv.stderr, w) {
			t.Errorf("server with a client alive, then %s: exit %d, want %q in stderr:\n%s", then, srv.status, w, srv.stderr)
		}
	}
}

// frame builds an out-of-band frame header of type typ announcing n bytes.
func frame(typ byte, n uint32) []byte {
	b := make([]byte, 12)
	copy(b, frameMagic)
	b[4] = typ
	binary.BigEndian.PutUint32(b[8:], n)
	return b
}

// TestAdversarialServerGarbage: strangers sending garbage to a server
// without a token make it fail with a clear error and exit status 1 (the
// first client to connect is served; see the package documentation),
// never panic or wait for more than --timeout.
func TestAdversarialServerGarbage(t *testing.T) {
	for _, tc := range []struct {
		name string
		send []byte
		want string
	}{
		{"http", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "not a goverbs bench"},
		{"other version", append([]byte("GVB9"), make([]byte, 8)...), "version 9"},
		{"huge length", frame(frameHello, 1<<31), "malformed frame"},
		{"version 1", append([]byte("GVB1"), make([]byte, 8)...), "version 1 of the goverbs bench protocol, this is version 2"},
		{"alive with a payload", frame(frameAlive, 5), "malformed frame"},
		{"alive frames then silence", append(frame(frameAlive, 0), frame(frameAlive, 0)...), "deadline exceeded"},
		{"nonzero padding", append(append([]byte(frameMagic), frameHello, 1, 0, 0), 0, 0, 0, 2), "malformed frame"},
		{"half header", []byte(frameMagic + "\x01"), "deadline exceeded"},
		{"header then silence", frame(frameHello, 100), "deadline exceeded"},
		{"header then close", frame(frameHello, 100), "reading hello"},
		{"bad json", append(frame(frameHello, 5), "{{{{{"...), "malformed hello"},
		{"wrong type", append(frame(frameSync, 2), "{}"...), "sent sync, want hello"},
		{"empty hello", append(frame(frameHello, 2), "{}"...), "version 0"},
		{"no sizes", append(frame(frameHello, 40), `{"version":1,"test":"write","sizes":[]} `...), "message sizes differ"},
		{"error frame", append(frame(frameError, 4), "null"...), "the peer failed"},
		{"test escapes", append(frame(frameHello, 32), `{"version":1,"test":"\u001b[2J"}`...), "run both with the same test"},
		{"error frame escapes", append(frame(frameError, 41), `{"error":"\u001b]0;owned\u0007\u001b[2J"}`...), `the peer failed: "\x1b]0;owned\a\x1b[2J"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			wait := startServer(t, port, "bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--timeout", "1s")
			addr := "127.0.0.1:" + port
			var c net.Conn
			var err error
			for deadline := time.Now().Add(hangGuard); ; time.Sleep(20 * time.Millisecond) {
				if c, err = net.Dial("tcp", addr); err == nil || time.Now().After(deadline) {
					break
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.Write(tc.send)
			if tc.name == "header then close" {
				c.Close()
			}
			srv := wait()
			if srv.status != exitError || !strings.Contains(srv.stderr, tc.want) || strings.Contains(srv.stderr, "panic") || strings.ContainsAny(srv.stderr, "\x1b\x07") {
				t.Errorf("exit %d, stderr lacks %q:\n%s", srv.status, tc.want, srv.stderr)
			}
		})
	}
}

// TestAdversarialUsage: a user's mistakes exit with status 2 and a
// message, never a panic.
func TestAdversarialUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"bench", "write", "--lat", "-n", "9223372036854775807"}, "-n must be"},
		{[]string{"bench", "send", "--lat", "-n", "4611686018427387904"}, "-n must be"},
		{[]string{"bench", "read", "--lat", "-n", "4611686018427387904", "--server"}, "-n must be"},
		{[]string{"bench", "write", "-p", "5", "127.0.0.1:18515"}, "-p"},
		{[]string{"bench", "write", "[::1]:18515"}, "-p"},
		{[]string{"bench", "write", "--server", "--bind", "127.0.0.1:18515"}, "--bind \"127.0.0.1:18515\" has a port"},
		{[]string{"bench", "write", "-s", "-4K"}, "invalid size"},
		{[]string{"bench", "write", "-s", "9999999999999999999G"}, "invalid size"},
		{[]string{"bench", "write", "--tx-depth", "-1"}, "--tx-depth must be at least 1"},
		{[]string{"bench", "send", "--rx-depth", "0"}, "--rx-depth must be at least 1"},
		{[]string{"bench", "write", "--server", "-p", "65536"}, "-p must be a TCP port"},
		{[]string{"bench", "write", "--timeout", "-1s", "127.0.0.1"}, "--timeout must be positive"},
		{[]string{"bench", "write", "--token", "x"}, "--token is for the two-process mode"},
		{[]string{"coll", "-min", "64", "-max", "8"}, "-max (8) is below -min (64)"},
		// Every size below one element: an empty table and status 0 before.
		{[]string{"coll", "-min", "1", "-max", "2", "-ops", "allreduce,barrier"}, "below one float32 element"},
		{[]string{"coll", "-min", "4", "-max", "7", "-type", "float64"}, "below one float64 element"},
		{[]string{"coll", "-p", "0"}, "-p must be between 2"},
		{[]string{"coll", "-p", "100000"}, "-p must be between 2"},
		{[]string{"coll", "-ops", "allreduce,frob"}, `unknown collective "frob"`},
		{[]string{"coll", "-step", "3"}, "-step must be 2 or 4"},
		{[]string{"coll", "-iters", "0"}, "-iters must be at least 1"},
		{[]string{"coll", "-iters", "9223372036854775807"}, "-iters must be at most"},
		{[]string{"coll", "-lat-iters", "4611686018427387904"}, "-lat-iters must be at most"},
	} {
		st, out, errs := runCmd(t, tc.args...)
		if st != exitUsage || !strings.Contains(errs, tc.msg) {
			t.Errorf("goverbs %q: status %d, want %d with %q\nstdout:\n%s\nstderr:\n%s", tc.args, st, exitUsage, tc.msg, out, errs)
		}
	}
}

// TestAdversarialTokenSilentStrangers: strangers that open connections to
// a server with --token and say nothing must not keep the real client
// out: the server authenticates clients side by side, drops the oldest
// past maxPending, and the silent ones after its authentication timeout.
func TestAdversarialTokenSilentStrangers(t *testing.T) {
	port := freePort(t)
	const token = "s3cret"
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--token", token, "--timeout", "25s"}
	wait := startServer(t, port, args...)
	addr := "127.0.0.1:" + port
	waitListening(t, addr)
	// As many strangers as the server authenticates at once, and more:
	// the oldest are dropped as newer clients come (before, the real
	// client was dropped while maxPending strangers said nothing).
	for range maxPending + 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	st, out, errs := runCmd(t, append(args, "-p", port, "127.0.0.1")...)
	srv := wait()
	if st != 0 || srv.status != 0 {
		t.Fatalf("client exit %d: %s%s\nserver exit %d: %s%s", st, out, errs, srv.status, srv.out, srv.stderr)
	}
	if _, rows := table(t, out); len(rows) != 1 {
		t.Fatalf("client output:\n%s", out)
	}
}

// TestAdversarialTokenMismatch: a server and a client of which only one
// has --token fail with messages that name the token, not TLS record
// internals or a bare closed connection.
func TestAdversarialTokenMismatch(t *testing.T) {
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--timeout", "5s"}
	for _, tc := range []struct {
		name                   string
		server, client         []string
		wantServer, wantClient string
	}{
		{"client only", nil, []string{"--token", "x"}, "with --token", "without --token"},
		{"server only", []string{"--token", "x"}, nil, "dropped client", "--token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			wait := startServer(t, port, append(append([]string{}, args...), tc.server...)...)
			waitListening(t, "127.0.0.1:"+port)
			if len(tc.server) == 0 {
				// waitListening's probe was the server's first client.
				wait()
				wait = startServer(t, port, append(append([]string{}, args...), tc.server...)...)
			}
			st, _, errs := runCmd(t, append(append(append([]string{}, args...), tc.client...), "-p", port, "127.0.0.1")...)
			srv := wait()
			if st != exitError || !strings.Contains(errs, tc.wantClient) {
				t.Errorf("client: exit %d, stderr lacks %q:\n%s", st, tc.wantClient, errs)
			}
			if srv.status != exitError || !strings.Contains(srv.stderr, tc.wantServer) {
				t.Errorf("server: exit %d, stderr lacks %q:\n%s", srv.status, tc.wantServer, srv.stderr)
			}
		})
	}
}

// TestAdversarialServerDiesMidRun: a server that goes away (its queue
// pair, memory and connection closed) after it said ready fails the
// client with an error, not a hang or a panic.
func TestAdversarialServerDiesMidRun(t *testing.T) {
	for _, op := range []string{"write", "read", "send"} {
		t.Run(op, func(t *testing.T) {
			port := freePort(t)
			p, _ := strconv.Atoi(port)
			cfg := benchCfg(true, p)
			cfg.op = op
			cfg.iters = 100000000 // the client's -n
			r := &remote{cfg: cfg, server: true}
			defer r.Close()
			ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
			defer cancel()
			ready := make(chan struct{})
			fake := make(chan error, 1)
			go func() {
				var err error
				r.oob, err = acceptOOB(ctx, "127.0.0.1:"+port, "", func(net.Addr) { close(ready) }, &bytes.Buffer{})
				if err == nil {
					r.closers = append(r.closers, r.oob.Close)
					err = r.setup(ctx)
				}
				if err == nil {
					err = r.expect(ctx, "start", 4096)
				}
				if err == nil {
					err = r.oob.send(ctx, frameSync, syncMsg{Phase: "ready", Size: 4096})
				}
				r.Close() // the server dies
				fake <- err
			}()
			<-ready
			done := make(chan cmdResult, 1)
			go func() {
				var o, e bytes.Buffer
				// Iterations enough to outlast the server: with 50, a
				// client of one-sided writes or reads, which the server
				// takes no part in, finished one run in about 45 before
				// the server died, and failed later, at the results.
				st := run([]string{"bench", op, "-d", verbs.SoftDevice, "-s", "4K", "-n", "100000000", "--timeout", "5s", "-p", port, "127.0.0.1"}, &o, &e)
				done <- cmdResult{st, o.String(), e.String()}
			}()
			select {
			case cli := <-done:
				if cli.status != exitError || !strings.Contains(cli.stderr, op+" of 4096 bytes") || strings.Contains(cli.stderr, "panic") {
					t.Errorf("client of a dying server: exit %d, stderr:\n%s", cli.status, cli.stderr)
				}
				t.Logf("client: %s", strings.TrimSpace(cli.stderr))
			case <-time.After(hangGuard):
				t.Fatal("the client of a dying server hangs")
			}
			if err := <-fake; err != nil {
				t.Fatalf("the fake server: %v", err)
			}
		})
	}
}

// TestAdversarialInterrupt: SIGINT ends a server waiting for its client
// and a client waiting for a silent server (the test binary is goverbs
// when GOVERBS_COLL_CHILD is set, see TestMain) with status 1 and a
// message, not a hang or the default signal death.
func TestAdversarialInterrupt(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0") // a server that accepts and says nothing
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	silent := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	for _, tc := range []struct {
		name  string
		args  []string
		ready func(stderr *syncBuffer) bool
	}{
		{"server", []string{"--server", "--bind", "127.0.0.1", "-p", freePort(t)},
			func(e *syncBuffer) bool { return strings.Contains(e.String(), "waiting for a client") }},
		{"client", []string{"-p", silent, "127.0.0.1"},
			func(*syncBuffer) bool { return len(accepted) > 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(exe, append([]string{"bench", "write", "-d", verbs.SoftDevice, "--timeout", "10m"}, tc.args...)...)
			cmd.Env = append(os.Environ(), envCollChild+"=1")
			var stderr syncBuffer
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill()
			for deadline := time.Now().Add(hangGuard); !tc.ready(&stderr); time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("not ready: %s", stderr.String())
				}
			}
			time.Sleep(100 * time.Millisecond) // into the blocking wait
			cmd.Process.Signal(os.Interrupt)
			waited := make(chan error, 1)
			go func() { waited <- cmd.Wait() }()
			select {
			case err := <-waited:
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != exitError || !strings.Contains(stderr.String(), "context canceled") {
					t.Errorf("after SIGINT: %v, stderr:\n%s", err, stderr.String())
				}
			case <-time.After(hangGuard):
				t.Fatalf("SIGINT does not end goverbs bench: %s", stderr.String())
			}
		})
	}
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestAdversarialHello: a hello that passes the test's parameters but
// lies about the client's memory region (offsets outside it, also by
// wrapping around 2^64) or names its device with control characters
// (which the server would print in its table) is refused in the
// parameter exchange.
func TestAdversarialHello(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*peerParams)
		want   string
	}{
		{"dst past the end", func(p *peerParams) { p.DstOffset = 1 << 40 }, "too small for its offsets"},
		{"dst wraps", func(p *peerParams) { p.DstOffset = math.MaxUint64 - 100 }, "too small for its offsets"},
		{"src wraps", func(p *peerParams) { p.SrcOffset = math.MaxUint64 - 100 }, "too small for its offsets"},
		{"device escapes", func(p *peerParams) { p.Device = "soft0\x1b]0;owned\x07\x1b[2J" }, "device name"},
		{"device newline", func(p *peerParams) { p.Device = "soft0\n 65536 1000 99999.99 99999.99 1.0" }, "device name"},
		{"device long", func(p *peerParams) { p.Device = strings.Repeat("x", 1000) }, "device name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			wait := startServer(t, port, "bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--timeout", "5s")
			p, _ := strconv.Atoi(port)
			r := &remote{cfg: benchCfg(false, p)}
			defer r.Close()
			ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
			defer cancel()
			var err error
			if r.oob, err = dialOOB(ctx, "127.0.0.1:"+port, ""); err != nil {
				t.Fatal(err)
			}
			r.closers = append(r.closers, r.oob.Close)
			if r.s, err = openSide("client", verbs.SoftDevice, r.cfg, 4096, &r.closers); err != nil {
				t.Fatal(err)
			}
			if r.s.ep, err = r.s.qp.Endpoint(); err != nil {
				t.Fatal(err)
			}
			hello, err := r.params()
			if err != nil {
				t.Fatal(err)
			}
			tc.mutate(&hello)
			if err := r.oob.send(ctx, frameHello, hello); err != nil {
				t.Fatal(err)
			}
			err = r.oob.recv(ctx, frameWelcome, &r.peer)
			srv := wait()
			if !errors.Is(err, errPeer) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("welcome: %v, want the server's error", err)
			}
			if srv.status != exitError || !strings.Contains(srv.stderr, tc.want) || strings.ContainsAny(srv.out+srv.stderr, "\x1b\x07") {
				t.Errorf("server: exit %d, want %q\nstdout:\n%q\nstderr:\n%q", srv.status, tc.want, srv.out, srv.stderr)
			}
		})
	}
}

// TestAdversarialTokenReplay: the bytes a real client sent to a server
// with --token, replayed to another server with the same token, do not
// authenticate: the session's keys, and so the proof, differ.
func TestAdversarialTokenReplay(t *testing.T) {
	const token = "replay-me"
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "20", "--token", token}
	port := freePort(t)
	wait := startServer(t, port, append(append([]string{}, args...), "--timeout", "25s")...)
	waitListening(t, "127.0.0.1:"+port)
	// A recording proxy between the client and the server.
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pl.Close()
	recorded := make(chan []byte, 1)
	go func() {
		c, err := pl.Accept()
		if err != nil {
			recorded <- nil
			return
		}
		defer c.Close()
		s, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			recorded <- nil
			return
		}
		defer s.Close()
		go io.Copy(c, s)
		var rec bytes.Buffer
		io.Copy(io.MultiWriter(s, &rec), c)
		recorded <- rec.Bytes()
	}()
	pport := strconv.Itoa(pl.Addr().(*net.TCPAddr).Port)
	st, out, errs := runCmd(t, append(append([]string{}, args...), "--timeout", "25s", "-p", pport, "127.0.0.1")...)
	if srv := wait(); st != 0 || srv.status != 0 {
		t.Fatalf("through the proxy: client exit %d: %s%s\nserver exit %d: %s", st, out, errs, srv.status, srv.stderr)
	}
	var rec []byte
	select {
	case rec = <-recorded:
	case <-time.After(hangGuard):
		t.Fatal("the proxy hangs")
	}
	if len(rec) == 0 {
		t.Fatal("nothing recorded")
	}

	port = freePort(t)
	wait = startServer(t, port, append(append([]string{}, args...), "--timeout", "3s")...)
	waitListening(t, "127.0.0.1:"+port)
	c, err := net.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(hangGuard))
	c.Write(rec)
	io.Copy(io.Discard, c) // the server's handshake, then its close
	srv := wait()
	if srv.status != exitError || strings.Count(srv.stderr, "dropped client") < 2 || !strings.Contains(srv.stderr, "waiting for a client") {
		t.Errorf("the replay was served, or not dropped: exit %d, stderr:\n%s", srv.status, srv.stderr)
	}
	t.Logf("server:\n%s", srv.stderr)
}

// TestAdversarialInterruptMidRun: SIGINT ends a client in the middle of
// a long measurement (and the server, told by the client, with it), not
// only in the exchanges around it.
func TestAdversarialInterruptMidRun(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	for _, tc := range [][]string{
		{"bench", "write", "-s", "64", "-n", "1000000000"},
		{"bench", "write", "--lat", "-n", "60000000"},
		{"bench", "read", "--lat", "-n", "60000000"},
		{"bench", "send", "--lat", "-n", "60000000"},
	} {
		t.Run(strings.Join(tc[1:], " "), func(t *testing.T) {
			start := func(args ...string) (*exec.Cmd, *syncBuffer, *syncBuffer, chan error) {
				cmd := exec.Command(exe, append(append(append([]string{}, tc...), "-d", verbs.SoftDevice, "-p", port, "--timeout", "10m"), args...)...)
				cmd.Env = append(os.Environ(), envCollChild+"=1")
				var stdout, stderr syncBuffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { cmd.Process.Kill() })
				waited := make(chan error, 1)
				go func() { waited <- cmd.Wait() }()
				return cmd, &stdout, &stderr, waited
			}
			_, _, srvErr, srvDone := start("--server", "--bind", "127.0.0.1")
			cli, cliOut, cliErr, cliDone := start("127.0.0.1")
			for deadline := time.Now().Add(hangGuard); !strings.Contains(cliOut.String(), "#bytes"); time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the client did not start measuring:\n%s%s", cliOut.String(), cliErr.String())
				}
			}
			time.Sleep(200 * time.Millisecond) // into the measurement
			cli.Process.Signal(os.Interrupt)
			// The server learns it from the client's error frame, or, in
			// a ping-pong, as a peer that stopped answering.
			for name, w := range map[string]struct {
				done   chan error
				stderr *syncBuffer
				want   string
			}{"client": {cliDone, cliErr, "context canceled"}, "server": {srvDone, srvErr, "goverbs bench: "}} {
				select {
				case err := <-w.done:
					var ee *exec.ExitError
					if !errors.As(err, &ee) || ee.ExitCode() != exitError || !strings.Contains(w.stderr.String(), w.want) || strings.Contains(w.stderr.String(), "panic") {
						t.Errorf("%s after SIGINT: %v, stderr:\n%s", name, err, w.stderr.String())
					}
				case <-time.After(hangGuard):
					t.Fatalf("SIGINT does not end the %s mid-run:\n%s", name, w.stderr.String())
				}
			}
		})
	}
}

// TestBenchFlagsThatStall: flag values with which the bandwidth loop
// cannot go on are usage errors, and the combinations at the edge run to
// the end. Before, --cq-mod 127 with the defaults (batches of 16, a send
// queue of 128) and send with --rx-depth 8 (batches of 16) were taken,
// posted what fit, and waited for a completion that could not come: the
// watchdog ended them after 10 s, blaming the peer.
func TestBenchFlagsThatStall(t *testing.T) {
	for _, tc := range []struct {
		args []string
		msg  string // "" for a run that must succeed
	}{
		{[]string{"bench", "write", "-d", "soft0", "-s", "64", "-n", "1000", "--cq-mod", "127"}, "--cq-mod (127) + --batch (16) - 1 must be at most --tx-depth (128)"},
		{[]string{"bench", "write", "-d", "soft0", "-s", "64", "-n", "1000", "--batch", "100", "--cq-mod", "128"}, "must be at most --tx-depth"},
		{[]string{"bench", "send", "-d", "soft0", "-s", "64", "-n", "1000", "--rx-depth", "8"}, "--rx-depth (8) must be at least --batch (16)"},
		{[]string{"bench", "write", "-d", "soft0", "-s", "64", "-n", "1000", "--cq-mod", "113"}, ""},
		{[]string{"bench", "send", "-d", "soft0", "-s", "64", "-n", "1000", "--rx-depth", "16"}, ""},
	} {
		st, out, errs := runCmd(t, tc.args...)
		if tc.msg == "" {
			if st != exitOK {
				t.Errorf("goverbs %q: status %d, want %d\nstdout:\n%s\nstderr:\n%s", tc.args, st, exitOK, out, errs)
			}
			continue
		}
		if st != exitUsage || !strings.Contains(errs, tc.msg) {
			t.Errorf("goverbs %q: status %d, want %d with %q\nstderr:\n%s", tc.args, st, exitUsage, tc.msg, errs)
		}
	}
}

// TestBenchInlineBandwidth: -I works in the bandwidth tests as in
// perftest's: the queue pairs take that much inline data, writes and
// sends of at most that many bytes go inline, the header says so, and the
// run checks its data as always; without -I a bandwidth test sends
// nothing inline. Before, -I sized the queue pairs but no request was
// posted inline, and the header said 0.
func TestBenchInlineBandwidth(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "write", "-d", "soft0", "-s", "64", "-n", "500", "-I", "64"}, "Max inline data : 64[B]"},
		{[]string{"bench", "send", "-d", "soft0", "-s", "32", "-n", "500", "-I", "64"}, "Max inline data : 64[B]"},
		{[]string{"bench", "write", "-d", "soft0", "-s", "128", "-n", "500", "-I", "64"}, "Max inline data : 64[B]"},
		{[]string{"bench", "write", "-d", "soft0", "-s", "64", "-n", "500"}, "Max inline data : 0[B]"},
		{[]string{"bench", "read", "-d", "soft0", "-s", "64", "-n", "500", "-I", "64"}, "Max inline data : 0[B]"},
	} {
		st, out, errs := runCmd(t, tc.args...)
		if st != exitOK || !strings.Contains(out, tc.want) {
			t.Errorf("goverbs %q: status %d, want %d and %q\nstdout:\n%s\nstderr:\n%s", tc.args, st, exitOK, tc.want, out, errs)
		}
	}
}

// TestServerChecksResultRow: the server prints the client's result row
// only if it is a row of the test the server ran: of its mode (bandwidth
// or latency), of the size just run and of -n iterations; another row is
// a protocol error (exit status 1). Before, the server printed any row: a
// client of a bandwidth test of 4096 bytes x 50 sent a latency row of 999
// bytes x 7, and the server printed it under its bandwidth header and
// exited 0. A sweep of sizes (--all) is served row by row.
func TestServerChecksResultRow(t *testing.T) {
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "50", "--timeout", "10s"}
	for _, tc := range []struct {
		name string
		row  func(real bwResult) resultMsg
		want string // in the server's stderr; "" for a row it must print
	}{
		{"real row", func(b bwResult) resultMsg { return resultMsg{BW: &b} }, ""},
		{"latency row", func(bwResult) resultMsg {
			return resultMsg{Lat: &latResult{Size: 999, Iters: 7, Min: 1, Max: 2, Typical: 1, Avg: 1}}
		}, "protocol error: client 127.0.0.1"},
		{"latency row of the size", func(bwResult) resultMsg {
			return resultMsg{Lat: &latResult{Size: 4096, Iters: 50, Min: 1, Max: 2, Typical: 1, Avg: 1}}
		}, "sent a latency result of 4096 bytes x 50 iterations, want bandwidth of 4096 bytes x 50"},
		{"other size", func(b bwResult) resultMsg { b.Size = 8192; return resultMsg{BW: &b} }, "sent a bandwidth result of 8192 bytes"},
		{"other iterations", func(b bwResult) resultMsg { b.Iters = 5000; return resultMsg{BW: &b} }, "x 5000 iterations, want bandwidth of 4096 bytes x 50"},
		{"two rows", func(b bwResult) resultMsg { return resultMsg{BW: &b, Lat: &latResult{Size: 4096, Iters: 50}} }, "without exactly one row"},
		{"no row", func(bwResult) resultMsg { return resultMsg{} }, "without exactly one row"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, ctx, wait := fakeClient(t, args, "10s")
			fillPattern(r.s.mr.Bytes()[:4096])
			if err := r.sync(ctx, "start", "ready", 4096); err != nil {
				t.Fatal(err)
			}
			b, err := r.streamBW(4096)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.sync(ctx, "done", "ok", 4096); err != nil {
				t.Fatal(err)
			}
			if err := r.oob.send(ctx, frameResult, tc.row(b)); err != nil {
				t.Fatal(err)
			}
			srv := wait()
			_, rows := table(t, srv.out)
			if tc.want == "" {
				if srv.status != exitOK || len(rows) != 1 || rows[0][0] != "4096" || rows[0][1] != "50" {
					t.Errorf("server of a real row: exit %d, rows %q\nstderr: %s", srv.status, rows, srv.stderr)
				}
				return
			}
			if srv.status != exitError || !strings.Contains(srv.stderr, tc.want) || len(rows) != 0 {
				t.Errorf("server of a forged row: exit %d, want %d with %q in stderr; rows %q\nstderr: %s", srv.status, exitError, tc.want, rows, srv.stderr)
			}
		})
	}
	t.Run("all sizes", func(t *testing.T) {
		args := []string{"bench", "write", "--all", "-n", "20", "-d", verbs.SoftDevice}
		srv, cli := runPair(t, args, args)
		if srv.status != exitOK || cli.status != exitOK {
			t.Fatalf("server exit %d:\n%s%s\nclient exit %d:\n%s%s", srv.status, srv.out, srv.stderr, cli.status, cli.out, cli.stderr)
		}
		_, srows := table(t, srv.out)
		_, crows := table(t, cli.out)
		if len(srows) != maxSweepShift || fmt.Sprint(srows) != fmt.Sprint(crows) {
			t.Errorf("server rows %q, want the client's %d rows %q", srows, maxSweepShift, crows)
		}
	})
}
