package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/testproc"
)

// This file uses only the package's public API (and the helpers of
// exchange_test.go), so that it runs against older versions of the
// exchange too.

// attackConns is the number of unauthenticated connections of
// TestExchangeStrangerMemory.
const attackConns = 1000

// attackRSSBound is how much the root's peak RSS may exceed its baseline
// while it serves attackConns strangers and the exchange. What the root
// holds per stranger is bounded and small (a goroutine, a socket, and a
// control message of at most 277 bytes) and it holds at most
// DefaultMaxStrangers of them at a time: about 2 MiB. 16 MiB leaves room
// for the garbage of a thousand handshakes (the collector lets a small
// heap reach 4 MiB before its first cycle) and for the text of code run
// for the first time; measured: 3.6 MiB for a thousand connections,
// 5.8 MiB for two or four thousand. Under the race detector, whose
// runtime keeps state for every goroutine a program ever ran, 48 MiB
// (measured: 20 MiB, and 38 MiB for four thousand connections). Either
// way one stranger allocating the 64 MiB frame it declares, as version 1
// let it, exceeds the bound.
var attackRSSBound int64 = 16 << 20

func init() {
	if raceEnabled {
		attackRSSBound = 48 << 20
	}
}

// attackWatchdog is the RSS growth at which the root kills itself, to
// spare the machine when run against a version that allocates what
// strangers declare (version 1 would reach tens of GiB).
const attackWatchdog = 1 << 30

// procStatus returns the fields of /proc/self/status named, in bytes.
func procStatus(names ...string) ([]int64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return nil, err
	}
	v := make([]int64, len(names))
	for _, line := range strings.Split(string(b), "\n") {
		for i, n := range names {
			if rest, ok := strings.CutPrefix(line, n+":"); ok {
				kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				if err != nil {
					return nil, fmt.Errorf("%s: %q: %v", n, rest, err)
				}
				v[i] = kb << 10
			}
		}
	}
	return v, nil
}

// rssLine reports VmRSS, VmHWM and RssAnon.
func rssLine(tag string) string {
	v, err := procStatus("VmRSS", "VmHWM", "RssAnon")
	if err != nil {
		return "error: " + err.Error()
	}
	return fmt.Sprintf("%s %d %d %d", tag, v[0], v[1], v[2])
}

// attackRoot is the child of TestExchangeStrangerMemory: rank 0 of a world
// of size in mode. It prints its address and baseline RSS, then answers
// "sample" on stdin with its RSS, prints the exchange's result and its
// RSS after it, and exits at "exit".
func attackRoot(mode string, size int) int {
	m, err := ParseMode(mode)
	if err != nil {
		fmt.Println("error:", err)
		return 2
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < 2*attackConns+100 {
		lim.Cur = lim.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur < 2*attackConns+100 {
			fmt.Printf("skip: RLIMIT_NOFILE %d cannot be raised to %d: %v\n", lim.Max, 2*attackConns+100, err)
			return 0
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("addr", ln.Addr())
	// The peak from now on: writing 5 to clear_refs resets VmHWM.
	os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
	base, err := procStatus("VmRSS")
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println(rssLine("baseline"))
	go func() {
		for {
			time.Sleep(5 * time.Millisecond)
			if v, err := procStatus("VmRSS"); err == nil && v[0] > base[0]+attackWatchdog {
				fmt.Printf("error: RSS %d MiB, %d MiB above the baseline: watchdog exit\n", v[0]>>20, (v[0]-base[0])>>20)
				os.Exit(3)
			}
		}
	}()
	addrs := make([]string, size)
	for i := range addrs {
		addrs[i] = "127.0.0.1:1" // rank 0 dials nobody
	}
	addrs[0] = ln.Addr().String()
	type result struct {
		in  [][]byte
		err error
	}
	done := make(chan result, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	go func() {
		in, err := Exchange(ctx, ExchangeConfig{Rank: 0, Size: size, Mode: m, Addrs: addrs, Listener: ln,
			Job: "attack", Token: []byte("token")}, xOut(0, size))
		done <- result{in, err}
	}()
	lines := make(chan string)
	go func() {
		s := bufio.NewScanner(os.Stdin)
		for s.Scan() {
			lines <- s.Text()
		}
		close(lines)
	}()
	for {
		select {
		case r := <-done:
			if r.err != nil {
				fmt.Println("result error", strings.ReplaceAll(r.err.Error(), "\n", " "))
			} else {
				s := "result ok"
				for _, e := range r.in {
					s += " " + hex.EncodeToString(e)
				}
				fmt.Println(s)
			}
			fmt.Println(rssLine("after"))
			done = nil
		case l, ok := <-lines:
			switch {
			case !ok || l == "exit":
				return 0
			case l == "sample":
				fmt.Println(rssLine("sample"))
			}
		}
	}
}

// attackChild is the child process of TestExchangeStrangerMemory.
type attackChild struct {
	t *testing.T
	p *testproc.Proc
}

func (c *attackChild) line(prefix string) []string {
	c.t.Helper()
	for {
		l := c.p.Next(c.t, prefix)
		if strings.HasPrefix(l, "skip:") {
			c.t.Skip(l)
		}
		if strings.HasPrefix(l, "error") {
			c.t.Fatalf("root: %s", l)
		}
		if f := strings.Fields(l); len(f) > 0 && f[0] == prefix {
			return f[1:]
		}
		c.t.Logf("root: %s", l)
	}
}

// rss reads a line of rssLine: VmRSS, VmHWM, RssAnon.
func (c *attackChild) rss(tag string) [3]int64 {
	c.t.Helper()
	if tag == "sample" {
		c.p.Send(c.t, "sample")
	}
	f := c.line(tag)
	var v [3]int64
	for i := range v {
		if i >= len(f) {
			c.t.Fatalf("root: %s %v", tag, f)
		}
		v[i], _ = strconv.ParseInt(f[i], 10, 64)
	}
	c.t.Logf("root %-8s VmRSS %6.1f MiB  VmHWM %6.1f MiB  RssAnon %6.1f MiB", tag, mib(v[0]), mib(v[1]), mib(v[2]))
	return v
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

// captureHello returns the first bytes a rank says to a rendezvous root
// (its hello), captured by a listener that plays the root.
func captureHello(t *testing.T) []byte {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		Exchange(ctx, ExchangeConfig{Rank: 1, Size: 2, Mode: Rendezvous, Root: ln.Addr().String(),
			Job: "attack", Token: []byte("token")}, xOut(1, 2))
	}()
	defer func() { cancel(); <-done }()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(time.Minute))
	b := make([]byte, 100)
	n, err := io.ReadAtLeast(c, b, 44)
	if err != nil {
		t.Fatal(err)
	}
	return b[:n]
}

// TestExchangeStrangerMemory: a root in a child process (all-to-all: rank
// 0) receives attackConns connections without the token, each declaring
// the largest frame of version 1 (with and without some of its body),
// half a hello of version 2, a replay of a real rank's hello, or garbage;
// the attackers keep their connections open. Its peak RSS stays within
// attackRSSBound of its baseline, and the real ranks then complete the
// exchange with the right data. Version 1 allocated every frame's
// declared 64 MiB before checking its HMAC: 40 such connections took a
// root from 5 MB to 2.6 GB.
func TestExchangeStrangerMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("opens a thousand connections")
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	// Go raises the soft limit to the hard one at start: the hard limit
	// is what this process and the root may have.
	if need := uint64(2*attackConns + 100); lim.Cur < need {
		t.Skipf("RLIMIT_NOFILE %d/%d: %d descriptors needed, and only root could raise the hard limit", lim.Cur, lim.Max, need)
	}
	replay := captureHello(t)
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			const n = 3
			p := testproc.Start(t, fmt.Sprintf("%s=attack,%v,%d", procChildEnv, mode, n))
			c := &attackChild{t: t, p: p}
			addr := c.line("addr")[0]
			base := c.rss("baseline")

			// The attack. Version 1's header: magic, version, type,
			// ranks, world size, job length, payload length (the largest
			// a 64 MiB frame holds), nonce.
			v1 := make([]byte, 44)
			copy(v1, "GVCX")
			v1[4], v1[5] = 1, 2 // a data frame (version 1 refused a hello with a payload at once)
			v1[19] = 2
			v1[24], v1[25], v1[26], v1[27] = 0x03, 0xff, 0xff, 0xb4
			payloads := [][]byte{
				append(bytes.Clone(v1), bytes.Repeat([]byte("junk"), 50)...),
				v1,
				append([]byte("GVCX\x03\x01\x00\x00"), bytes.Repeat([]byte{0xee}, 50)...),
				replay,
				bytes.Repeat([]byte("garbage!"), 20),
			}
			// In two waves: the strangers of the first leave when the
			// second comes (as an attacker that reconnects would), those
			// of the second stay.
			conns := make([]net.Conn, attackConns)
			for i := range conns {
				if i == attackConns/2 {
					for _, a := range conns[:i] {
						a.Close()
					}
				}
				a, err := net.Dial("tcp", addr)
				if err != nil {
					t.Fatalf("connection %d: %v", i, err)
				}
				defer a.Close()
				a.Write(payloads[i%len(payloads)])
				conns[i] = a
			}
			during := c.rss("sample")
			// Wait (with a hang guard) until the root has answered the
			// connections it can refuse at once.
			var wg sync.WaitGroup
			var answered atomic.Int32
			for i, a := range conns[attackConns/2:] {
				if k := i % len(payloads); k == 2 || k == 3 {
					continue // half a hello, or a replayed one: they wait for more
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					a.SetReadDeadline(time.Now().Add(2 * time.Minute))
					if b, _ := io.ReadAll(a); len(b) > 0 {
						answered.Add(1)
					}
				}()
			}
			wg.Wait()
			during2 := c.rss("sample")
			t.Logf("%d connections answered before they were closed", answered.Load())

			// The real ranks.
			lns, addrs := xListeners(t, n)
			lns[0].Close()
			addrs[0] = addr
			ctx := xContext(t, 2*time.Minute)
			ins := make([][][]byte, n)
			errs := make([]error, n)
			for r := 1; r < n; r++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ins[r], errs[r] = Exchange(ctx, ExchangeConfig{Rank: r, Size: n, Mode: mode, Addrs: addrs, Listener: lns[r],
						Job: "attack", Token: []byte("token")}, xOut(r, n))
				}()
			}
			wg.Wait()
			res := c.line("result")
			after := c.rss("after")
			p.Send(t, "exit")
			p.Stop(t)

			for r := 1; r < n; r++ {
				if errs[r] != nil {
					t.Errorf("rank %d: %v", r, errs[r])
					continue
				}
				for j := range n {
					if want := xMessage(j, r); !bytes.Equal(ins[r][j], want) {
						t.Errorf("rank %d, entry %d: %q, want %q", r, j, ins[r][j], want)
					}
				}
			}
			if len(res) != n+1 || res[0] != "ok" {
				t.Errorf("root: %v", res)
			} else {
				for j := range n {
					if want := hex.EncodeToString(xMessage(j, 0)); res[1+j] != want {
						t.Errorf("root, entry %d: %s, want %s", j, res[1+j], want)
					}
				}
			}
			peak := max(during[1], during2[1], after[1])
			t.Logf("root: peak RSS %.1f MiB over the baseline (bound %d MiB), RSS after %.1f MiB over it",
				mib(peak-base[0]), attackRSSBound>>20, mib(after[0]-base[0]))
			if peak > base[0]+attackRSSBound {
				t.Errorf("root's peak RSS %.1f MiB is %.1f MiB above its baseline %.1f MiB (bound %d MiB)",
					mib(peak), mib(peak-base[0]), mib(base[0]), attackRSSBound>>20)
			}
		})
	}
}
