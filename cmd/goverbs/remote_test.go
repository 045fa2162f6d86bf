package main

import (
	"bytes"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
)

// freePort returns a TCP port of 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

type cmdResult struct {
	status      int
	out, stderr string
}

// runPair runs the server and the client command lines (without the
// HOST/--server arguments, which it adds) concurrently, out-of-band over
// 127.0.0.1.
func runPair(t *testing.T, server, client []string) (srv, cli cmdResult) {
	t.Helper()
	port := freePort(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var o, e bytes.Buffer
		args := append(append([]string{}, server...), "--server", "--bind", "127.0.0.1", "-p", port, "--timeout", "30s")
		srv.status = run(args, &o, &e)
		srv.out, srv.stderr = o.String(), e.String()
	}()
	var o, e bytes.Buffer
	args := append(append([]string{}, client...), "-p", port, "--timeout", "30s", "127.0.0.1")
	cli.status = run(args, &o, &e)
	cli.out, cli.stderr = o.String(), e.String()
	wg.Wait()
	return srv, cli
}

// TestBenchTwoSides runs every test in perftest's topology, server and
// client in this process (on soft0 both QPs live in one process, as the
// soft provider connects them within a process), and checks that both
// print the client's result row.
func TestBenchTwoSides(t *testing.T) {
	dev := verbs.SoftDevice
	if devs := vmtest.Devices(); len(devs) >= 2 {
		dev = devs[0] // the VM: server and client on rxe0 and rxe1 below
	}
	dev2 := dev
	if devs := vmtest.Devices(); len(devs) >= 2 {
		dev2 = devs[1]
	}
	for _, tc := range []struct {
		args []string
		lat  bool
	}{
		{[]string{"bench", "write", "-n", "300", "-s", "4K", "--batch", "8", "--tx-depth", "32"}, false},
		{[]string{"bench", "read", "-n", "200", "-s", "4K"}, false},
		{[]string{"bench", "send", "-n", "300", "-s", "4K", "--rx-depth", "64"}, false},
		{[]string{"bench", "write", "-n", "64", "-s", "64", "--batch", "16", "--tx-depth", "128"}, false},
		{[]string{"bench", "write", "--lat", "-n", "100", "-s", "2"}, true},
		{[]string{"bench", "write", "--lat", "-n", "100", "-s", "4K"}, true},
		{[]string{"bench", "send", "--lat", "-n", "100", "-s", "64", "--rx-depth", "8"}, true},
		{[]string{"bench", "read", "--lat", "-n", "50", "-s", "64"}, true},
	} {
		t.Run(strings.Join(tc.args[1:], " "), func(t *testing.T) {
			srv, cli := runPair(t, append(tc.args, "-d", dev), append(tc.args, "-d", dev2))
			if srv.status != 0 || cli.status != 0 {
				t.Fatalf("server exit %d:\n%s%s\nclient exit %d:\n%s%s", srv.status, srv.out, srv.stderr, cli.status, cli.out, cli.stderr)
			}
			cols := bwColumns
			if tc.lat {
				cols = latColumns
			}
			_, crows := table(t, cli.out)
			_, srows := table(t, srv.out)
			if len(crows) != 1 || len(crows[0]) != len(cols) {
				t.Fatalf("client rows %q, want one of %d columns:\n%s", crows, len(cols), cli.out)
			}
			if len(srows) != 1 || strings.Join(srows[0], " ") != strings.Join(crows[0], " ") {
				t.Errorf("server rows %q, want the client's %q", srows, crows)
			}
			size, _ := parseSize(tc.args[slicesIndex(tc.args, "-s")+1])
			iters, _ := strconv.Atoi(tc.args[slicesIndex(tc.args, "-n")+1])
			checkNumbers(t, crows[0], size, iters)
			if !strings.Contains(cli.out, "client of 127.0.0.1:") || !strings.Contains(srv.out, "server; client 127.0.0.1:") {
				t.Errorf("the headers do not name the topology:\n%s\n%s", cli.out, srv.out)
			}
			t.Logf("client:\n%s", cli.out)
		})
	}
}

func slicesIndex(s []string, v string) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// TestBenchTwoSidesIPv6: a server bound to [::1] and a client of [::1]
// (IPv6 addresses in brackets, as in a URL) run; before, both failed on
// the address ("too many colons" / "missing port").
func TestBenchTwoSidesIPv6(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	args := []string{"bench", "write", "-d", verbs.SoftDevice, "-s", "4K", "-n", "20", "-p", port, "--timeout", "30s"}
	srvc := make(chan cmdResult, 1)
	go func() {
		var o, e bytes.Buffer
		st := run(append(append([]string{}, args...), "--server", "--bind", "[::1]"), &o, &e)
		srvc <- cmdResult{status: st, out: o.String(), stderr: e.String()}
	}()
	var o, e bytes.Buffer
	st := run(append(append([]string{}, args...), "[::1]"), &o, &e)
	srv := <-srvc
	if st != exitOK || srv.status != exitOK {
		t.Fatalf("client exit %d: %s%s\nserver exit %d: %s%s", st, o.String(), e.String(), srv.status, srv.out, srv.stderr)
	}
}

// TestBenchTwoSidesMismatch: different parameters fail on both sides with
// a message naming the difference, and nothing hangs.
func TestBenchTwoSidesMismatch(t *testing.T) {
	for _, tc := range []struct {
		name           string
		server, client []string
		want           string
	}{
		{"size", []string{"bench", "write", "-s", "64"}, []string{"bench", "write", "-s", "128"}, "message sizes differ"},
		{"test", []string{"bench", "write"}, []string{"bench", "send"}, "run both with the same test"},
		{"mode", []string{"bench", "write", "--lat"}, []string{"bench", "write"}, "run both with the same test"},
		// Both sides print the server's words: they name the sides
		// (before: "the peer uses -n 20, this side -n 10", which the
		// client printed as well).
		{"iters", []string{"bench", "write", "-n", "10"}, []string{"bench", "write", "-n", "20"}, "iterations differ: the client uses -n 20, the server -n 10"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, cli := runPair(t, append(tc.server, "-d", verbs.SoftDevice), append(tc.client, "-d", verbs.SoftDevice))
			if srv.status != exitError || cli.status != exitError {
				t.Fatalf("exit statuses server %d client %d, want %d", srv.status, cli.status, exitError)
			}
			if !strings.Contains(srv.stderr, tc.want) || !strings.Contains(cli.stderr, tc.want) {
				t.Errorf("errors lack %q:\nserver: %s\nclient: %s", tc.want, srv.stderr, cli.stderr)
			}
		})
	}
}

// TestBenchTwoSidesTimeout: a server without client and a client without
// server give up after --timeout with a clear error.
func TestBenchTwoSidesTimeout(t *testing.T) {
	port := freePort(t)
	st, _, errs := runCmd(t, "bench", "write", "-d", verbs.SoftDevice, "--server", "--bind", "127.0.0.1", "-p", port, "--timeout", "200ms")
	if st != exitError || !strings.Contains(errs, "waiting for a client") || !strings.Contains(errs, "deadline exceeded") {
		t.Errorf("server without client: exit %d, %s", st, errs)
	}
	start := time.Now()
	st, _, errs = runCmd(t, "bench", "write", "-d", verbs.SoftDevice, "-p", port, "--timeout", "200ms", "127.0.0.1")
	if st != exitError || !strings.Contains(errs, "nothing listens on 127.0.0.1:"+port) {
		t.Errorf("client without server: exit %d, %s", st, errs)
	}
	t.Logf("client gave up after %v: %s", time.Since(start).Round(time.Millisecond), errs)

	// A peer that is not a goverbs bench.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\n"))
			c.Close()
		}
	}()
	p := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	st, _, errs = runCmd(t, "bench", "write", "-d", verbs.SoftDevice, "-p", p, "--timeout", "5s", "127.0.0.1")
	if st != exitError || !strings.Contains(errs, "not a goverbs bench") {
		t.Errorf("client against a non-bench server: exit %d, %s", st, errs)
	}
}
