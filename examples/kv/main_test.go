package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/session"
	"github.com/goverbs/verbs/verbstest"
)

// childEnv marks a re-executed test binary that runs the command with
// the arguments after -args.
const childEnv = "GOVERBS_KV_EXAMPLE_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		args := os.Args[1:]
		for i, a := range args {
			if a == "-args" {
				args = args[i+1:]
				break
			}
		}
		os.Exit(run(context.Background(), args, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// command is the test binary running kv with args, over soft0's
// transport kind.
func command(t *testing.T, kind string, args ...string) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, append([]string{"-test.run=^$", "-args"}, args...)...)
	cmd.Env = append(os.Environ(), childEnv+"=1", "GOVERBS_SOFT_TRANSPORT="+kind, "GOVERBS_TOKEN=kv-test-token")
	return cmd
}

// TestServerAndClients runs a server and two clients, each a process of
// its own, over every transport of soft0: each client puts its keys,
// gets them back, and measures.
func TestServerAndClients(t *testing.T) {
	for _, kind := range []string{"shm", "unix", "tcp"} {
		t.Run(kind, func(t *testing.T) {
			srv := command(t, kind, "-serve", "127.0.0.1:0", "-buckets", "1024", "-heap", "1048576")
			var stderr bytes.Buffer
			srv.Stderr = &stderr
			out, err := srv.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := srv.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
			lines := bufio.NewScanner(out)
			addrc := make(chan string, 1)
			go func() {
				for lines.Scan() {
					if f := strings.Fields(lines.Text()); len(f) == 4 && f[1] == "serving" {
						addrc <- f[3]
					}
				}
				close(addrc)
			}()
			var addr string
			select {
			case a, ok := <-addrc:
				if !ok {
					t.Fatalf("server ended: %s", stderr.String())
				}
				addr = a
			case <-time.After(time.Minute):
				t.Fatalf("no address from the server: %s", stderr.String())
			}
			var wg sync.WaitGroup
			for c := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					cmd := command(t, kind, "-connect", addr, "-keys", "300", "-n", "500", "-timeout", "2m")
					b, err := cmd.CombinedOutput()
					if err != nil {
						t.Errorf("client %d: %v\n%s", c, err, b)
						return
					}
					for _, want := range []string{"kv: connected to " + addr + " over soft0/" + kind, "kv: 300 puts, 300 gets checked", "× read), 500 each"} {
						if !bytes.Contains(b, []byte(want)) {
							t.Errorf("client %d: output lacks %q:\n%s", c, want, b)
						}
					}
				}()
			}
			wg.Wait()
		})
	}
}

// TestWrongToken: a client without the server's token is refused.
func TestWrongToken(t *testing.T) {
	srv := command(t, "tcp", "-serve", "127.0.0.1:0")
	out, err := srv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	s := bufio.NewScanner(out)
	if !s.Scan() {
		t.Fatal("no address from the server")
	}
	addr := strings.Fields(s.Text())[3]
	cmd := command(t, "tcp", "-connect", addr, "-timeout", "20s", "-token", "not the token")
	b, err := cmd.CombinedOutput()
	if err == nil || !bytes.Contains(b, []byte("authentication")) {
		t.Fatalf("a client with the wrong token: %v\n%s", err, b)
	}
}

// TestHashKeyHome: the keys' home buckets spread over the whole index
// (they were all odd: the stored hash is odd, and the home bucket came
// from it, so every even bucket held collisions only), and a key's
// stored hash is never 0.
func TestHashKeyHome(t *testing.T) {
	const buckets = 4096
	used := map[int]bool{}
	even := 0
	for i := range 1000 {
		h, home := hashKey([]byte(fmt.Sprintf("key-%d", i)), buckets)
		if h == 0 || home < 0 || home >= buckets {
			t.Fatalf("key-%d: hash %#x, home %d", i, h, home)
		}
		used[home] = true
		if home%2 == 0 {
			even++
		}
	}
	if even < 400 || even > 600 {
		t.Errorf("%d of 1000 keys start at an even bucket, want about half", even)
	}
	if len(used) < 850 {
		t.Errorf("1000 keys start at %d distinct buckets of %d, want about 890", len(used), buckets)
	}
}

// TestBucketOverflow: keys that share a home bucket fill its 4 slots and
// then the next bucket's, and every one is found by a GET (two reads, or
// three for those in the next bucket); a missing key with the same home
// ends at the next bucket's empty slot; a full table refuses a PUT.
// Server and client are sessions of this process.
func TestBucketOverflow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const buckets = 2
	pd := verbstest.OpenPD(t, "")
	mr, err := pd.Alloc(buckets*bucketSize+64<<10, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	tab := &table{mr: mr, buckets: buckets}
	l, err := session.Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	served := make(chan error, 1)
	go func() {
		s, err := l.Accept(ctx)
		if err != nil {
			served <- err
			return
		}
		err = serveClient(ctx, s, tab)
		s.Close() // its grant of the table ends before the table's region closes
		served <- err
	}()
	s, err := session.Dial(ctx, l.Addr().String(), session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := newClient(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	// Keys whose home is bucket 0, and one more of bucket 1's.
	var home0 [][]byte
	var other []byte
	for i := 0; len(home0) < 7 || other == nil; i++ {
		k := []byte(fmt.Sprintf("k%d", i))
		if _, home := hashKey(k, buckets); home == 0 {
			home0 = append(home0, k)
		} else if other == nil {
			other = k
		}
	}
	for i, k := range home0[:6] {
		if err := c.put(ctx, k, []byte(fmt.Sprintf("value %d", i))); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
	}
	if err := c.put(ctx, other, []byte("other")); err != nil {
		t.Fatal(err)
	}
	for i, k := range home0[:6] {
		v, ok, err := c.get(ctx, k)
		if want := fmt.Sprintf("value %d", i); err != nil || !ok || string(v) != want {
			t.Errorf("get %s: %q, %v, %v; want %q", k, v, ok, err, want)
		}
	}
	if v, ok, err := c.get(ctx, other); err != nil || !ok || string(v) != "other" {
		t.Errorf("get %s: %q, %v, %v", other, v, ok, err)
	}
	// Bucket 1 holds 2 of home 0's keys and other: one slot is empty.
	if v, ok, err := c.get(ctx, home0[6]); err != nil || ok {
		t.Errorf("get of missing %s: %q, %v, %v", home0[6], v, ok, err)
	}
	// An update of a key in the next bucket stays there.
	if err := c.put(ctx, home0[5], []byte("new")); err != nil {
		t.Fatal(err)
	}
	if v, ok, err := c.get(ctx, home0[5]); err != nil || !ok || string(v) != "new" {
		t.Errorf("get %s after its update: %q, %v, %v", home0[5], v, ok, err)
	}
	if err := c.put(ctx, home0[6], []byte("fills the table")); err != nil {
		t.Fatal(err)
	}
	err = c.put(ctx, []byte("one too many"), nil)
	if err == nil || !strings.Contains(err.Error(), "no free slot") {
		t.Errorf("put into a full table: %v", err)
	}
	s.Close()
	if err := <-served; err != nil && !errors.Is(err, session.ErrPeerClosed) {
		t.Errorf("server: %v", err)
	}
}

// TestServerSizeBounds: a server asked for a table larger than it takes
// refuses to start (status 2, saying the bounds). Before, -buckets was
// only checked to be positive: 288230376151711745 buckets of 64 bytes
// wrapped to a table of 64 bytes plus the heap, and the first client's
// PUTs made the server panic (index out of range).
func TestServerSizeBounds(t *testing.T) {
	for _, args := range [][]string{
		{"-serve", "127.0.0.1:0", "-buckets", "288230376151711745"},
		{"-serve", "127.0.0.1:0", "-buckets", fmt.Sprint(maxBuckets + 1)},
		{"-serve", "127.0.0.1:0", "-heap", fmt.Sprint(int64(maxHeap) + 1)},
	} {
		b, err := command(t, "shm", args...).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !bytes.Contains(b, []byte("-buckets is at most")) {
			t.Errorf("kv %q: %v\n%s\nwant status 2 and the bounds", args, err, b)
		}
	}
}

// TestServerTimeout: -timeout bounds a client's run (5 minutes unless
// given) and a server's only when given; a server without it serves
// until it is stopped, as the README says ("keeps serving: stop it with
// kill $!"). Before, the default 5 minutes bounded the server too, and it
// quietly exited 0.
func TestServerTimeout(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration // 0: no bound
	}{
		{[]string{"-serve", "127.0.0.1:7070"}, 0},
		{[]string{"-serve", "127.0.0.1:7070", "-buckets", "1024"}, 0},
		{[]string{"-serve", "127.0.0.1:7070", "-timeout", "1h"}, time.Hour},
		{[]string{"-timeout=5m", "-serve", "127.0.0.1:7070"}, defaultTimeout},
		{[]string{"-connect", "127.0.0.1:7070"}, defaultTimeout},
		{[]string{"-connect", "127.0.0.1:7070", "-timeout", "30s"}, 30 * time.Second},
		{[]string{"-connect", "127.0.0.1:7070", "-timeout", "0"}, 0},
	} {
		var errb bytes.Buffer
		o, ok := parseArgs(tc.args, &errb)
		if !ok || o.timeout != tc.want {
			t.Errorf("kv %q: timeout %v (ok %v), want %v\n%s", tc.args, o.timeout, ok, tc.want, errb.String())
		}
	}
}

// TestClientQuotesServerText: the client prints a server's answer to a
// PUT (an error text) as it is only if it is printable, else quoted.
// Before, it printed it as it was: a hostile (or compromised) server's
// answer with terminal escape sequences (here: set the window title,
// clear the screen) reached the user's terminal through the client's
// stderr. The goverbs command quotes a peer's text the same way
// (cmd/goverbs printable).
func TestClientQuotesServerText(t *testing.T) {
	for _, tc := range []struct {
		answer, want string
	}{
		{"\x1b]0;owned\a\x1b[2J", `kv: put "key-0": "\x1b]0;owned\a\x1b[2J"` + "\n"},
		{"the heap is full", `kv: put "key-0": the heap is full` + "\n"},
		{"line\nbreak", `kv: put "key-0": "line\nbreak"` + "\n"},
		{"\xff\xfe", `kv: put "key-0": "\xff\xfe"` + "\n"},
	} {
		t.Run(fmt.Sprintf("%q", tc.answer), func(t *testing.T) {
			stdout, stderr := putToFakeServer(t, tc.answer)
			if strings.ContainsAny(stdout+stderr, "\x1b\x07") || stderr != tc.want {
				t.Errorf("stderr %q, want %q", stderr, tc.want)
			}
		})
	}
}

// putToFakeServer runs a client of one PUT against a server that answers
// it with answer; it returns the client's stdout and stderr.
func putToFakeServer(t *testing.T, answer string) (string, string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pd := verbstest.OpenPD(t, "")
	mr, err := pd.Alloc(bucketSize+4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mr.Close()
	l, err := session.Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		s, err := l.Accept(ctx)
		if err != nil {
			return
		}
		defer s.Close()
		if _, err := s.SendRegion(ctx, mr, 0, len(mr.Bytes()), verbs.AccessRemoteRead, time.Hour); err != nil {
			return
		}
		if err := s.Send(ctx, binary.LittleEndian.AppendUint32(nil, 1)); err != nil {
			return
		}
		m, err := s.Receive(ctx)
		if err != nil {
			return
		}
		m.Release()
		s.Send(ctx, []byte(answer))
		s.Receive(ctx) // until the client leaves
	}()
	t.Setenv("GOVERBS_TOKEN", "")
	var out, errb bytes.Buffer
	code := run(ctx, []string{"-connect", l.Addr().String(), "-keys", "1", "-n", "1", "-timeout", "50s"}, &out, &errb)
	<-served
	if code != 1 {
		t.Fatalf("exit %d, want 1\nstdout: %q\nstderr: %q", code, out.String(), errb.String())
	}
	return out.String(), errb.String()
}
