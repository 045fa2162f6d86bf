package session

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
)

// TestSessionDevices runs sessions between rxe0 and rxe1 (the VM tier):
// over the TCP bootstrap with the devices named, and with the queue
// pairs connected by the RDMA CM. Each exchanges messages (eager and
// rendezvous, with immediate data), uses memory the other side's agent
// grants (write, atomics, read back after a hand-back) and ends with a
// close the other side sees.
func TestSessionDevices(t *testing.T) {
	devs := vmtest.Require(t)
	if len(devs) < 2 {
		t.Skip("needs two RDMA devices (rxe0, rxe1)")
	}
	t.Run("tcp", func(t *testing.T) {
		a, b := pairWith(t, Config{Device: devs[0]}, Config{Device: devs[1]}, nil)
		exercise(t, a, b, devs)
	})
	t.Run("cm", func(t *testing.T) {
		cp := vmtest.CMAddrs(t)
		lcfg := Config{UseCM: true, CMAddr: cp.ListenAddr(0)}
		dcfg := Config{UseCM: true}
		a, b := pairWith(t, lcfg, dcfg, func(l *Listener, d *Config) {
			// The listener's link-local address, with the zone of the
			// dialer's netdev, so that rxe1 carries the connection.
			d.CMAddr = cp.Target(netip.MustParseAddrPort(l.cm.addr).Port())
		})
		exercise(t, a, b, devs)
	})
}

// pairWith is pair with a configuration per side; adjust, if not nil,
// may change the dialer's after the Listener exists.
func pairWith(t testing.TB, lcfg, dcfg Config, adjust func(*Listener, *Config)) (a, b *Session) {
	t.Helper()
	return pairAt(t, "127.0.0.1:0", func(l *Listener) string { return l.Addr().String() }, lcfg, dcfg, adjust)
}

// pairAt is pairWith with the Listener on listen and the dialer dialing
// target(l).
func pairAt(t testing.TB, listen string, target func(*Listener) string, lcfg, dcfg Config, adjust func(*Listener, *Config)) (a, b *Session) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	l, err := Listen(ctx, listen, lcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if adjust != nil {
		adjust(l, &dcfg)
	}
	type res struct {
		s   *Session
		err error
	}
	ch := make(chan res, 1)
	go func() {
		s, err := l.Accept(ctx)
		ch <- res{s, err}
	}()
	b, err = Dial(ctx, target(l), dcfg)
	if err != nil {
		t.Fatal(err)
	}
	r := <-ch
	if r.err != nil {
		b.Close()
		t.Fatal(r.err)
	}
	t.Cleanup(func() { b.Close(); r.s.Close() })
	return r.s, b
}

func exercise(t *testing.T, a, b *Session, devs []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, s := range []*Session{a, b} {
		if tr := s.Transport(); !strings.HasPrefix(tr, "rc/rxe") || !strings.HasSuffix(tr, "ethernet") {
			t.Errorf("transport %q, want rc/rxeN/1 ethernet", tr)
		}
	}
	for _, n := range []int{0, 100, 70000} {
		data := bytes.Repeat([]byte{byte(n) + 1}, n)
		errc := make(chan error, 1)
		go func() { errc <- a.SendImm(ctx, uint32(n), data) }()
		m, err := b.Receive(ctx)
		if err != nil {
			t.Fatalf("%d bytes: %v", n, err)
		}
		if imm, ok := m.Imm(); !bytes.Equal(m.Bytes(), data) || !ok || imm != uint32(n) {
			t.Fatalf("%d bytes: received %d bytes, imm %d %v", n, m.Len(), imm, ok)
		}
		m.Release()
		if err := <-errc; err != nil {
			t.Fatalf("send %d bytes: %v", n, err)
		}
	}
	r, err := b.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteRead|verbs.AccessRemoteWrite|verbs.AccessRemoteAtomic, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	loc, err := b.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer loc.Free()
	copy(loc.Bytes(), "from the client")
	dst, _ := r.Slice(64, 64)
	if err := b.Write(ctx, dst, loc.All()); err != nil {
		t.Fatal(err)
	}
	word, _ := r.Slice(0, 8)
	if v, err := b.FetchAdd(ctx, word, 7); err != nil || v != 0 {
		t.Fatalf("fetch and add: %d, %v", v, err)
	}
	if v, err := b.CompareSwap(ctx, word, 7, 9); err != nil || v != 7 {
		t.Fatalf("compare and swap: %d, %v", v, err)
	}
	if err := b.Read(ctx, loc.All(), r.All().mustSlice(t, 64, 64)); err != nil {
		t.Fatal(err)
	}
	if err := b.SendRemoteMR(ctx, r); err != nil {
		t.Fatal(err)
	}
	back, err := a.ReceiveLocalMR(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := back.Bytes(); got[0] != 9 || string(got[64:79]) != "from the client" {
		t.Fatalf("the server reads %v / %q", got[:8], got[64:79])
	}
	back.Free()
	a.Close()
	<-b.Done()
	if !errors.Is(b.Err(), ErrPeerClosed) {
		t.Fatalf("after the peer's Close: %v", b.Err())
	}
}

func (s RemoteSlice) mustSlice(t *testing.T, off, n int) RemoteSlice {
	t.Helper()
	r, err := s.Slice(off, n)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestCMNeedsHardware: on soft0 a Listener asking for the CM fails with
// ErrNotSupported, saying so.
func TestCMNeedsHardware(t *testing.T) {
	if vmtest.InVM() {
		t.Skip("the VM has a CM")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := Listen(ctx, "127.0.0.1:0", Config{UseCM: true})
	if !errors.Is(err, verbs.ErrNotSupported) {
		t.Fatalf("Listen with UseCM on soft0: %v", err)
	}
}

// TestSessionAutoDevices: with no device named in Config, each side picks
// the device that routes to its peer: a session bootstrapped over the
// link-local addresses of the VM's netdevs runs on rxe0 (the listener's
// side) and rxe1 (the dialer's), and one bootstrapped over 127.0.0.1,
// which no RDMA device routes, on soft0.
func TestSessionAutoDevices(t *testing.T) {
	cp := vmtest.CMAddrs(t)
	for _, c := range []struct {
		name, listen   string
		target         func(port uint16) string
		server, client string
	}{
		{"link-local", cp.ListenAddr(0), cp.Target, "rc/" + cp.Server + "/", "rc/" + cp.Client + "/"},
		{"loopback", "127.0.0.1:0", func(port uint16) string { return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port).String() }, softDevice, softDevice},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := pairAt(t, c.listen, func(l *Listener) string {
				return c.target(netip.MustParseAddrPort(l.Addr().String()).Port())
			}, Config{}, Config{}, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			for _, x := range []struct {
				side string
				s    *Session
				want string
			}{{"listener's", a, c.server}, {"dialer's", b, c.client}} {
				if got := x.s.Transport(); !strings.HasPrefix(got, x.want) {
					t.Errorf("the %s session runs on %q, want %s...", x.side, got, x.want)
				}
			}
			errc := make(chan error, 1)
			go func() { errc <- a.Send(ctx, []byte("on the device it chose")) }()
			m, err := b.Receive(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got := string(m.Bytes()); got != "on the device it chose" {
				t.Errorf("received %q", got)
			}
			m.Release()
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
		})
	}
}
