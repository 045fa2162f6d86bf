package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// xNoLeaks fails the test if it leaves goroutines behind (checked after
// every other cleanup).
func xNoLeaks(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
}

// xListeners opens n loopback listeners and returns them with their
// addresses.
func xListeners(t testing.TB, n int) ([]net.Listener, []string) {
	t.Helper()
	lns := make([]net.Listener, n)
	addrs := make([]string, n)
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	return lns, addrs
}

func xMessage(from, to int) []byte { return fmt.Appendf(nil, "from %d to %d", from, to) }

func xOut(rank, n int) [][]byte {
	out := make([][]byte, n)
	for j := range out {
		out[j] = xMessage(rank, j)
	}
	return out
}

func xContext(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// xRun runs Exchange for the given ranks of a world of n concurrently;
// cfgFor adjusts each rank's configuration. It returns results and errors
// by rank.
func xRun(t *testing.T, n int, mode Mode, ranks []int, cfgFor func(r int, c *ExchangeConfig) context.Context) ([][][]byte, []error) {
	t.Helper()
	xNoLeaks(t)
	lns, addrs := xListeners(t, n)
	ins := make([][][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for _, r := range ranks {
		c := ExchangeConfig{Rank: r, Size: n, Mode: mode, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token")}
		ctx := cfgFor(r, &c)
		wg.Add(1)
		go func() {
			defer wg.Done()
			ins[r], errs[r] = Exchange(ctx, c, xOut(r, c.Size))
		}()
	}
	wg.Wait()
	return ins, errs
}

var xModes = []Mode{AllToAll, Rendezvous}

func TestExchange(t *testing.T) {
	for _, mode := range xModes {
		for _, n := range []int{1, 2, 3, 4, 7, 8} {
			t.Run(fmt.Sprintf("%v/%d", mode, n), func(t *testing.T) {
				ctx := xContext(t, time.Minute)
				ins, errs := xRun(t, n, mode, seq(n), func(int, *ExchangeConfig) context.Context { return ctx })
				for r := range n {
					if errs[r] != nil {
						t.Fatalf("rank %d: %v", r, errs[r])
					}
					for j := range n {
						if want := xMessage(j, r); !bytes.Equal(ins[r][j], want) {
							t.Errorf("rank %d, entry %d: %q, want %q", r, j, ins[r][j], want)
						}
					}
				}
			})
		}
	}
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// TestExchangeRefusals: a rank with another token or job is refused with a
// clear error; the others report it when their deadline ends.
func TestExchangeRefusals(t *testing.T) {
	for _, tc := range []struct {
		name  string
		alter func(c *ExchangeConfig)
		want  error
	}{
		{"token", func(c *ExchangeConfig) { c.Token = []byte("wrong") }, ErrAuth},
		{"empty token", func(c *ExchangeConfig) { c.Token = nil }, ErrAuth},
		{"job", func(c *ExchangeConfig) { c.Job = "other job" }, ErrJobMismatch},
	} {
		for _, mode := range xModes {
			t.Run(fmt.Sprintf("%s/%v", tc.name, mode), func(t *testing.T) {
				const n = 3
				short := xContext(t, 1500*time.Millisecond)
				long := xContext(t, time.Minute)
				_, errs := xRun(t, n, mode, seq(n), func(r int, c *ExchangeConfig) context.Context {
					if r == 2 {
						tc.alter(c)
						return long // refused at once: no deadline needed
					}
					if mode == Rendezvous && r == 1 {
						return long // the root aborts it
					}
					return short
				})
				if !errors.Is(errs[2], tc.want) {
					t.Errorf("refused rank: %v, want %v", errs[2], tc.want)
				}
				// The others fail by their deadline, and the ranks that
				// refused the connection name the reason. In all-to-all,
				// rank 2 dials 0 and 1 at once and gives up on the first
				// refusal, so only one of them may have seen its hello.
				var xe *ExchangeError
				if !errors.Is(errs[0], ErrPeerMissing) || !errors.As(errs[0], &xe) || !slices.Equal(xe.Missing, []int{2}) {
					t.Errorf("rank 0: %v, want ErrPeerMissing with rank 2 missing", errs[0])
				}
				switch mode {
				case AllToAll:
					if !errors.Is(errs[1], ErrPeerMissing) {
						t.Errorf("rank 1: %v, want ErrPeerMissing", errs[1])
					}
					if !errors.Is(errs[0], tc.want) && !errors.Is(errs[1], tc.want) {
						t.Errorf("neither rank 0 nor rank 1 names %v", tc.want)
					}
				case Rendezvous:
					if !errors.Is(errs[0], tc.want) {
						t.Errorf("rank 0: %v does not name %v", errs[0], tc.want)
					}
					if !errors.Is(errs[1], ErrAborted) {
						t.Errorf("rank 1: %v, want ErrAborted", errs[1])
					}
				}
				for r, err := range errs {
					t.Logf("rank %d: %v", r, err)
				}
			})
		}
	}
}

// TestExchangeDisagreements: two members of a job (same token and job)
// that disagree on the exchange mode or the world size both fail at once,
// with an error that says so and names both sides' settings (not a
// malformed frame, and not a timeout: the contexts are only hang guards).
func TestExchangeDisagreements(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mode  Mode // rank 0's
		alter func(c *ExchangeConfig, addrs []string)
		want  error
		text  []string
	}{
		{"rendezvous root, all-to-all rank", Rendezvous, func(c *ExchangeConfig, _ []string) { c.Mode = AllToAll }, ErrModeMismatch,
			[]string{"all-to-all exchange", "rendezvous exchange"}},
		{"all-to-all rank 0, rendezvous rank", AllToAll, func(c *ExchangeConfig, _ []string) { c.Mode = Rendezvous }, ErrModeMismatch,
			[]string{"all-to-all exchange", "rendezvous exchange"}},
		{"larger world, all-to-all", AllToAll, func(c *ExchangeConfig, addrs []string) {
			c.Size, c.Addrs = 3, append(slices.Clone(addrs), "127.0.0.1:1")
		}, ErrSizeMismatch, []string{"world of 3", "world of 2"}},
		{"larger world, rendezvous", Rendezvous, func(c *ExchangeConfig, _ []string) { c.Size = 5 }, ErrSizeMismatch,
			[]string{"world of 5", "world of 2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 2
			guard := xContext(t, 2*time.Minute)
			var addrs []string
			_, errs := xRun(t, n, tc.mode, seq(n), func(r int, c *ExchangeConfig) context.Context {
				c.Mode = tc.mode
				if r == 1 {
					addrs = c.Addrs
					tc.alter(c, addrs)
				}
				return guard
			})
			for r, err := range errs {
				t.Logf("rank %d: %v", r, err)
				if !errors.Is(err, tc.want) || errors.Is(err, ErrPeerMissing) || errors.Is(err, ErrBadFrame) {
					t.Errorf("rank %d: %v, want %v at once", r, err, tc.want)
					continue
				}
				for _, text := range tc.text {
					if !strings.Contains(err.Error(), text) {
						t.Errorf("rank %d: %q does not say %q", r, err, text)
					}
				}
			}
		})
	}
}

// TestExchangeNotAnExchange: a rank whose peer's address is served by
// something else (a listener that accepts and never answers, a server of
// another protocol) says that something answered there and does not
// speak the protocol, not just that the peer is missing.
func TestExchangeNotAnExchange(t *testing.T) {
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn) // runs on each accepted connection
		want  []string
	}{
		{"silent", func(c net.Conn) { io.Copy(io.Discard, c) },
			[]string{"accepted the connection but did not answer the hello", "does not speak the goverbs exchange protocol"}},
		{"http", func(c net.Conn) {
			c.Read(make([]byte, helloLen))
			io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n")
		}, []string{"answered, but does not speak the goverbs exchange protocol"}},
	} {
		for _, mode := range xModes {
			t.Run(fmt.Sprintf("%s/%v", tc.name, mode), func(t *testing.T) {
				xNoLeaks(t)
				lns, addrs := xListeners(t, 2)
				var wg sync.WaitGroup
				defer wg.Wait()
				defer lns[0].Close()
				wg.Add(1)
				go func() {
					defer wg.Done()
					var cs []net.Conn
					defer func() {
						for _, c := range cs {
							c.Close()
						}
					}()
					for {
						c, err := lns[0].Accept()
						if err != nil {
							return
						}
						cs = append(cs, c)
						wg.Add(1)
						go func() { defer wg.Done(); tc.serve(c) }()
					}
				}()
				_, err := Exchange(xContext(t, 1500*time.Millisecond), ExchangeConfig{Rank: 1, Size: 2, Mode: mode, Addrs: addrs,
					Listener: lns[1], Job: "job", Token: []byte("token"), HelloTimeout: 200 * time.Millisecond}, xOut(1, 2))
				t.Log(err)
				for _, want := range tc.want {
					if err == nil || !strings.Contains(err.Error(), want) {
						t.Errorf("%v, want %q", err, want)
					}
				}
			})
		}
	}
}

// TestExchangeMissingRank: rank 2 never starts; the others fail by their
// deadline (in a rendezvous, rank 1 is told by the root before its own).
func TestExchangeMissingRank(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			const n = 3
			short := xContext(t, time.Second)
			long := xContext(t, time.Minute)
			_, errs := xRun(t, n, mode, []int{0, 1}, func(r int, c *ExchangeConfig) context.Context {
				if mode == Rendezvous && r == 1 {
					return long
				}
				return short
			})
			for r := range 2 {
				want := ErrPeerMissing
				if mode == Rendezvous && r == 1 {
					want = ErrAborted
				}
				if !errors.Is(errs[r], want) {
					t.Errorf("rank %d: %v, want %v", r, errs[r], want)
				}
				t.Logf("rank %d: %v", r, errs[r])
			}
			if !errors.Is(errs[0], context.DeadlineExceeded) {
				t.Errorf("rank 0: %v does not wrap the context's error", errs[0])
			}
		})
	}
}

// xFakeRank is the exchange of a rank of a world of n in mode, whose
// handshakes tests run by hand.
func xFakeRank(t testing.TB, mode Mode, rank, n int, token string) *exchange {
	x, err := newExchange(ExchangeConfig{Rank: rank, Size: n, Mode: mode, Addrs: make([]string, n), Root: "unused", Job: "job", Token: []byte(token)}, make([][]byte, n))
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// TestExchangePeerDies: a peer that completes its handshake and then
// dies makes the exchange fail at once with ErrPeerLost, without waiting
// for a deadline (the context here has none).
func TestExchangePeerDies(t *testing.T) {
	cases := []struct {
		name string
		mode Mode
		real int // the rank under test; the fake is the other of a world of 2
	}{
		{"all-to-all acceptor", AllToAll, 0},
		{"all-to-all dialer", AllToAll, 1},
		{"rendezvous root", Rendezvous, 0},
		{"rendezvous leaf", Rendezvous, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, 2)
			fake := 1 - tc.real
			fx := xFakeRank(t, tc.mode, fake, 2, "token")
			done := xGo(context.Background(), ExchangeConfig{Rank: tc.real, Size: 2, Mode: tc.mode, Addrs: addrs,
				Listener: lns[tc.real], Job: "job", Token: []byte("token")})
			ctx := xContext(t, time.Minute)
			var c net.Conn
			if fake == 1 {
				// The fake dials, says hello, reads the answer and dies.
				k, err := fx.dial(ctx, 0, addrs[0])
				if err != nil {
					t.Fatal(err)
				}
				k.stopWatch()
				c = k.c
			} else {
				// The fake accepts, answers the hello and dies.
				lns[0].Close()
				ln, err := net.Listen("tcp", addrs[0])
				if err != nil {
					t.Skipf("cannot listen again on %s: %v", addrs[0], err)
				}
				defer ln.Close()
				if c, err = ln.Accept(); err != nil {
					t.Fatal(err)
				}
				if _, err := fx.accept(ctx, c, nil, nil, func(int) error { return nil }); err != nil {
					t.Fatal(err)
				}
			}
			c.Close()
			err := (<-done).err
			if !errors.Is(err, ErrPeerLost) {
				t.Errorf("%v, want ErrPeerLost", err)
			}
			t.Log(err)
		})
	}
}

// xResult is what an Exchange run by xGo returned.
type xResult struct {
	in  [][]byte
	err error
}

// xGo runs Exchange for cfg's rank, with its xOut messages, in a
// goroutine; the result comes on the channel.
func xGo(ctx context.Context, cfg ExchangeConfig) <-chan xResult {
	done := make(chan xResult, 1)
	go func() {
		in, err := Exchange(ctx, cfg, xOut(cfg.Rank, cfg.Size))
		done <- xResult{in, err}
	}()
	return done
}

// TestExchangeStrangers: connections that are not peers (garbage, a
// hello for another rank, a replayed frame) are dropped without ending
// the exchange, which completes when the real peer comes.
func TestExchangeStrangers(t *testing.T) {
	for _, mode := range xModes {
		t.Run(mode.String(), func(t *testing.T) {
			xNoLeaks(t)
			lns, addrs := xListeners(t, 2)
			ctx := xContext(t, time.Minute)
			done := xGo(ctx, ExchangeConfig{Rank: 0, Size: 2, Mode: mode, Addrs: addrs, Listener: lns[0],
				Job: "job", Token: []byte("token")})
			// Garbage.
			c, err := net.Dial("tcp", addrs[0])
			if err != nil {
				t.Fatal(err)
			}
			// Exactly a prefix's worth, so that the rank reads all of it
			// and closes cleanly.
			c.Write([]byte("GET / HT"))
			var buf [rejectLen]byte
			b, err := readControl(c, &buf, msgReject)
			if err != nil || b[20] != rejectRank {
				t.Errorf("garbage: answer %q, %v; want a reject", b, err)
			}
			if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
				t.Errorf("garbage: the connection was not closed after the reject (%q, %v)", rest, err)
			}
			c.Close()
			// A hello for another rank.
			k, err := xFakeRank(t, mode, 0, 2, "token").dial(ctx, 1, addrs[0])
			if !errors.Is(err, ErrBadFrame) {
				t.Errorf("hello for another rank: %v, want ErrBadFrame", err)
			}
			if k != nil {
				k.c.Close()
			}
			// The real rank 1.
			in, err := Exchange(ctx, ExchangeConfig{Rank: 1, Size: 2, Mode: mode, Addrs: addrs, Job: "job", Token: []byte("token")}, xOut(1, 2))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(in[0], xMessage(0, 1)) {
				t.Errorf("rank 1 got %q", in[0])
			}
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			if !bytes.Equal(r.in[1], xMessage(1, 0)) {
				t.Errorf("rank 0 got %q", r.in[1])
			}
		})
	}
}

func TestExchangeConfigErrors(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		cfg  ExchangeConfig
		out  int
	}{
		{"size 0", ExchangeConfig{Size: 0}, 0},
		{"rank out of range", ExchangeConfig{Rank: 2, Size: 2, Addrs: []string{"a:1", "b:1"}}, 2},
		{"entries", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1", "b:1"}}, 3},
		{"addresses", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1"}}, 2},
		{"no root", ExchangeConfig{Rank: 0, Size: 2, Mode: Rendezvous}, 2},
		{"mode", ExchangeConfig{Rank: 0, Size: 2, Mode: 7, Addrs: []string{"a:1", "b:1"}}, 2},
		{"job", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1", "b:1"}, Job: string(make([]byte, 300))}, 2},
		{"entry too large", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1", "b:1"}, MaxFrame: 80}, 2},
		{"vector too large", ExchangeConfig{Rank: 0, Size: 2, Mode: Rendezvous, Addrs: []string{"a:1", "b:1"}, MaxFrame: 128}, 2},
		{"negative MaxStrangers", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1", "b:1"}, MaxStrangers: -1}, 2},
		{"negative HelloTimeout", ExchangeConfig{Rank: 0, Size: 2, Addrs: []string{"a:1", "b:1"}, HelloTimeout: -1}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := make([][]byte, tc.out)
			for i := range out {
				out[i] = make([]byte, 64)
			}
			if _, err := Exchange(ctx, tc.cfg, out); err == nil {
				t.Error("no error")
			} else {
				t.Log(err)
			}
		})
	}
}
