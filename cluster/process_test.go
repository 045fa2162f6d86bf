package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// procChildEnv makes the test binary a helper process: "dial,ADDR,RANK,SIZE,
// hello|data,MODE" says hello to ADDR as rank RANK of SIZE in exchange
// mode MODE (a number); "accept,RANK,SIZE,MODE" accepts one hello on the
// listener inherited as fd 3. Either way it then prints
// "ready" and waits to be killed. "attack,MODE,SIZE" is the root of
// TestExchangeStrangerMemory (see attackRoot); "rank,..." a rank of a
// failure test (see failChild).
const procChildEnv = "GOVERBS_CLUSTER_TEST_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(procChildEnv); spec != "" {
		os.Exit(procChild(spec))
	}
	os.Exit(m.Run())
}

func procChild(spec string) int {
	parts := strings.Split(spec, ",")
	atoi := func(s string) int { n, _ := strconv.Atoi(s); return n }
	ctx := context.Background()
	switch parts[0] {
	case "dial":
		rank, size := atoi(parts[2]), atoi(parts[3])
		x := procExchange(Mode(atoi(parts[5])), rank, size)
		k, err := x.dial(ctx, 0, parts[1])
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		k.stopWatch()
		if parts[4] == "data" {
			// A leaf of a rendezvous: send its entries, then wait for
			// the root's answer.
			if err := x.send(k, encodeVector(make([][]byte, size))); err != nil {
				fmt.Println("error:", err)
				return 1
			}
		}
	case "attack":
		return attackRoot(parts[1], atoi(parts[2]))
	case "rank":
		return failChild(parts)
	case "accept":
		rank, size := atoi(parts[1]), atoi(parts[2])
		f := os.NewFile(3, "listener")
		ln, err := net.FileListener(f)
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		c, err := ln.Accept()
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		if _, err := procExchange(Mode(atoi(parts[3])), rank, size).accept(ctx, c, nil, nil, func(int) error { return nil }); err != nil {
			fmt.Println("error:", err)
			return 1
		}
	default:
		fmt.Println("error: bad spec", spec)
		return 2
	}
	fmt.Println("ready")
	select {} // until killed
}

func procExchange(mode Mode, rank, size int) *exchange {
	x, err := newExchange(ExchangeConfig{Rank: rank, Size: size, Mode: mode, Addrs: make([]string, size), Root: "unused",
		Job: "job", Token: []byte("token")}, make([][]byte, size))
	if err != nil {
		panic(err)
	}
	return x
}

// procStart starts a helper process and waits until it is ready.
func procStart(t *testing.T, spec string, files ...*os.File) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), procChildEnv+"="+spec)
	cmd.ExtraFiles = files
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		t.Fatalf("helper %s: %q, %v", spec, line, err)
	}
	return cmd
}

// TestExchangeRankKilled: a rank whose process is killed (SIGKILL) in the
// middle of the exchange, after its handshake, makes the others fail at
// once with ErrPeerLost: their context has no deadline, so an exchange
// that waited for one would hang (and the test time out).
func TestExchangeRankKilled(t *testing.T) {
	for _, tc := range []struct {
		name string
		mode Mode
		real int
	}{
		{"all-to-all acceptor", AllToAll, 0},
		{"all-to-all dialer", AllToAll, 1},
		{"rendezvous root", Rendezvous, 0},
		{"rendezvous leaf", Rendezvous, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, 2)
			done := make(chan error, 1)
			start := func(ln net.Listener) {
				go func() {
					_, err := Exchange(context.Background(), ExchangeConfig{Rank: tc.real, Size: 2, Mode: tc.mode, Addrs: addrs,
						Listener: ln, Job: "job", Token: []byte("token")}, xOut(tc.real, 2))
					done <- err
				}()
			}
			var child *exec.Cmd
			if tc.real == 0 {
				start(lns[0])
				child = procStart(t, fmt.Sprintf("dial,%s,1,2,hello,%d", addrs[0], tc.mode))
			} else {
				// The helper is rank 0: it owns rank 0's listener.
				f, err := lns[0].(*net.TCPListener).File()
				if err != nil {
					t.Fatal(err)
				}
				lns[0].Close()
				start(nil)
				child = procStart(t, fmt.Sprintf("accept,0,2,%d", tc.mode), f)
				f.Close()
			}
			if err := child.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if !errors.Is(err, ErrPeerLost) {
					t.Errorf("%v, want ErrPeerLost", err)
				}
				t.Log(err)
			case <-time.After(5 * time.Minute):
				t.Fatal("the exchange did not notice the killed rank")
			}
		})
	}
}

// TestRendezvousRankKilled: in a rendezvous of 3, rank 2's process is
// killed after its handshake: the root fails with ErrPeerLost, without a
// deadline, and tells rank 1, which fails with ErrAborted (or, if it
// reached the root only after the root gave up, with ErrPeerMissing by
// its deadline).
func TestRendezvousRankKilled(t *testing.T) {
	xNoLeaks(t)
	lns, addrs := xListeners(t, 3)
	errs := make(chan error, 2)
	ctx1, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for r := range 2 {
		ctx := context.Background()
		if r == 1 {
			ctx = ctx1
		}
		go func() {
			_, err := Exchange(ctx, ExchangeConfig{Rank: r, Size: 3, Mode: Rendezvous, Addrs: addrs,
				Listener: lns[r], Job: "job", Token: []byte("token")}, xOut(r, 3))
			errs <- fmt.Errorf("rank %d: %w", r, err)
		}()
	}
	child := procStart(t, fmt.Sprintf("dial,%s,2,3,hello,%d", addrs[0], Rendezvous))
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		err := <-errs
		switch {
		case strings.HasPrefix(err.Error(), "rank 0"):
			if !errors.Is(err, ErrPeerLost) {
				t.Errorf("%v, want ErrPeerLost", err)
			}
		default:
			if !errors.Is(err, ErrAborted) && !errors.Is(err, ErrPeerMissing) {
				t.Errorf("%v, want ErrAborted", err)
			}
		}
		t.Log(err)
	}
}
