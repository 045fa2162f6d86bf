//go:build ibverbs && linux && cgo

package verbs_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// cmSide is one end of the CM tests: a device with a PD, a CQ and a
// registered buffer.
type cmSide struct {
	name string
	dev  *verbs.Context
	pd   *verbs.ProtectionDomain
	cq   *verbs.CompletionQueue
	mr   *verbs.MemoryRegion
}

// openCMSide opens name and creates its resources. When the test ends
// they are closed, each Close checked: a CM connection that did not
// release its queue pair would make the PD and CQ refuse to close.
func openCMSide(t *testing.T, name string) *cmSide {
	t.Helper()
	s := &cmSide{name: name}
	var err error
	if s.dev, err = verbs.Open(name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { checkClose(t, "device context "+name, s.dev) })
	if s.pd, err = s.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { checkClose(t, "pd of "+name, s.pd) })
	if s.cq, err = s.dev.NewCompletionQueue(verbs.CQSpec{Entries: 64}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { checkClose(t, "cq of "+name, s.cq) })
	if s.mr, err = s.pd.Alloc(64<<10, verbs.AccessRemoteAll); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { checkClose(t, "mr of "+name, s.mr) })
	return s
}

// spec returns the QP spec of the side's connections.
func (s *cmSide) spec() verbs.QPSpec {
	return verbs.QPSpec{SendCQ: s.cq, MaxSendWR: 16, MaxRecvWR: 16}
}

// padded checks that got is want zero-padded to n bytes, as the CM
// delivers private data.
func padded(t *testing.T, what string, got, want []byte, n int) {
	t.Helper()
	if len(got) != n {
		t.Errorf("%s: %d bytes, want %d (padded)", what, len(got), n)
	}
	if !bytes.HasPrefix(got, want) {
		t.Errorf("%s: %q, want prefix %q", what, got, want)
		return
	}
	if rest := got[len(want):]; len(bytes.Trim(rest, "\x00")) != 0 {
		t.Errorf("%s: padding is not zero: %x", what, rest)
	}
}

// acceptResult is what an accepting goroutine hands back.
type acceptResult struct {
	req  *verbs.CMRequest
	conn *verbs.CMConn
	err  error
}

// TestCMDevices connects RC queue pairs with the RDMA connection manager
// across the two SoftRoCE devices of the VM and checks the whole public CM
// API: private data both ways, traffic over the connected QPs, rejections,
// context handling, disconnection and release of every resource.
func TestCMDevices(t *testing.T) {
	verbstest.CheckLeaks(t)
	cp := vmtest.CMAddrs(t) // server on the first device, client on the second
	srvDev, cliDev, srvIP, cliZone := cp.Server, cp.Client, cp.Listen, cp.DialZone
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	srv := openCMSide(t, srvDev)
	cli := openCMSide(t, cliDev)

	l, err := verbs.ListenCM(ctx, cp.ListenAddr(0), verbs.CMListenOptions{Backlog: 8})
	if err != nil {
		t.Fatalf("ListenCM: %v", err)
	}
	t.Cleanup(func() { checkClose(t, "listener", l) })
	if l.Addr().Port() == 0 || l.Addr().Addr() != srvIP {
		t.Fatalf("listener address %v, want %v with a port", l.Addr(), srvIP)
	}
	target := cp.Target(l.Addr().Port())
	t.Logf("listening on %v (%s); dialing %s", l.Addr(), srvDev, target)

	route, err := verbs.ResolveCM(ctx, target)
	if err != nil {
		t.Fatalf("ResolveCM(%s): %v", target, err)
	}
	if route.Device != cliDev || route.Port != 1 || route.RemoteAddr.Port() != l.Addr().Port() {
		t.Fatalf("ResolveCM(%s) = %+v, want device %s port 1 to port %d", target, route, cliDev, l.Addr().Port())
	}

	// accept runs answer on the next request in a goroutine.
	accept := func(ctx context.Context, answer func(*verbs.CMRequest) (*verbs.CMConn, error)) <-chan acceptResult {
		ch := make(chan acceptResult, 1)
		go func() {
			r, err := l.Accept(ctx)
			if err != nil {
				ch <- acceptResult{err: err}
				return
			}
			c, err := answer(r)
			ch <- acceptResult{req: r, conn: c, err: err}
		}()
		return ch
	}

	t.Run("ConnectAndTransfer", func(t *testing.T) {
		dialData := []byte("hello from the dialer")
		// The acceptor hands out its buffer with the reply, as
		// applications do: address, length, rkey, then a greeting.
		rem := srv.mr.Remote()
		acceptData := binary.LittleEndian.AppendUint64(nil, rem.Addr)
		acceptData = binary.LittleEndian.AppendUint64(acceptData, rem.Len)
		acceptData = binary.LittleEndian.AppendUint32(acceptData, rem.RKey)
		acceptData = append(acceptData, "welcome"...)

		var reqData []byte
		var reqDev string
		accepted := accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			reqData, reqDev = r.PrivateData(), r.Device()
			if r.LocalAddr().Port() != l.Addr().Port() {
				t.Errorf("request to %v, want port %d", r.LocalAddr(), l.Addr().Port())
			}
			return r.Accept(ctx, srv.pd, srv.spec(), acceptData)
		})
		dc, err := verbs.DialCM(ctx, target, cli.pd, cli.spec(), dialData)
		if err != nil {
			t.Fatalf("DialCM: %v", err)
		}
		defer checkClose(t, "dialer connection", dc)
		a := <-accepted
		if a.err != nil {
			t.Fatalf("Accept: %v", a.err)
		}
		ac := a.conn
		defer checkClose(t, "acceptor connection", ac)

		// Private data, padded to the CM's sizes.
		padded(t, "request private data (CMRequest)", reqData, dialData, verbs.MaxCMDialData)
		padded(t, "request private data (acceptor's CMConn)", ac.PrivateData(), dialData, verbs.MaxCMDialData)
		padded(t, "reply private data (dialer's CMConn)", dc.PrivateData(), acceptData, verbs.MaxCMAcceptData)

		// Devices, addresses, QPs.
		if reqDev != srvDev || ac.Device() != srvDev || dc.Device() != cliDev {
			t.Errorf("devices: request %s, acceptor %s, dialer %s; want %s, %s, %s", reqDev, ac.Device(), dc.Device(), srvDev, srvDev, cliDev)
		}
		if dc.RemoteAddr().Port() != l.Addr().Port() || ac.LocalAddr().Port() != l.Addr().Port() {
			t.Errorf("ports: dialer remote %v, acceptor local %v; want port %d", dc.RemoteAddr(), ac.LocalAddr(), l.Addr().Port())
		}
		if dc.RemoteQPN() != ac.QP().QPN() || ac.RemoteQPN() != dc.QP().QPN() {
			t.Errorf("QPNs: dialer %d (peer %d), acceptor %d (peer %d)", dc.QP().QPN(), dc.RemoteQPN(), ac.QP().QPN(), ac.RemoteQPN())
		}
		for _, c := range []*verbs.CMConn{dc, ac} {
			if st, err := c.QP().State(); err != nil || st != verbs.StateRTS {
				t.Errorf("%s QP state %v, %v; want RTS", c.Device(), st, err)
			}
			if c.QP().PD() == nil {
				t.Errorf("%s QP has no PD", c.Device())
			}
		}
		// The QP belongs to the connection: it cannot be closed alone.
		if err := dc.QP().Close(); err == nil {
			t.Error("closing the QP of an open CMConn succeeded")
		}

		// The dialer decodes the acceptor's buffer from the reply.
		pd := dc.PrivateData()
		peer := verbs.RemoteRegion{
			Addr: binary.LittleEndian.Uint64(pd[0:]),
			Len:  binary.LittleEndian.Uint64(pd[8:]),
			RKey: binary.LittleEndian.Uint32(pd[16:]),
		}
		if peer != rem {
			t.Fatalf("remote region from the reply %+v, want %+v", peer, rem)
		}

		// Dialer → acceptor: an RDMA write and a send, in order.
		wdata := bytes.Repeat([]byte("rdma write over rdma_cm! "), 40)[:1000]
		sdata := []byte("send over rdma_cm")
		cb, sb := cli.mr.Bytes(), srv.mr.Bytes()
		copy(cb[0:], wdata)
		copy(cb[4096:], sdata)
		if err := ac.QP().PostRecv(100, verbstest.SGE(t, srv.mr, 8192, 64)); err != nil {
			t.Fatal(err)
		}
		if err := dc.QP().PostRecv(200, verbstest.SGE(t, cli.mr, 8192, 64)); err != nil {
			t.Fatal(err)
		}
		b := dc.QP().NewBatch(2)
		b.Write(1, peer.At(1024), verbstest.SGE(t, cli.mr, 0, len(wdata))).Signaled()
		b.Send(2, verbstest.SGE(t, cli.mr, 4096, len(sdata))).Signaled()
		if err := b.Submit(); err != nil {
			t.Fatalf("submit write+send: %v", err)
		}
		sent, err := verbstest.PollN(ctx, cli.cq, 2)
		if err != nil {
			t.Fatal(err)
		}
		want := []struct {
			wrid uint64
			op   verbs.Opcode
		}{{1, verbs.OpWrite}, {2, verbs.OpSend}}
		for i, w := range want {
			if c := sent[i]; c.Status != verbs.StatusSuccess || c.WRID != w.wrid || c.Opcode != w.op || c.QPN != dc.QP().QPN() {
				t.Errorf("dialer completion %d: %v; want wr_id %d %v success on QPN %d", i, c, w.wrid, w.op, dc.QP().QPN())
			}
		}
		recvd, err := verbstest.PollN(ctx, srv.cq, 1)
		if err != nil {
			t.Fatal(err)
		}
		if c := recvd[0]; c.Status != verbs.StatusSuccess || c.WRID != 100 || c.Opcode != verbs.OpRecv ||
			c.ByteLen != uint32(len(sdata)) || c.QPN != ac.QP().QPN() {
			t.Errorf("acceptor receive: %v; want wr_id 100 RECV success len %d on QPN %d", c, len(sdata), ac.QP().QPN())
		}
		if got := sb[1024 : 1024+len(wdata)]; !bytes.Equal(got, wdata) {
			t.Errorf("written bytes %q, want %q", got, wdata)
		}
		if sb[1023] != 0 || sb[1024+len(wdata)] != 0 {
			t.Errorf("the write touched bytes around its target: %#x %#x", sb[1023], sb[1024+len(wdata)])
		}
		if got := sb[8192 : 8192+len(sdata)]; !bytes.Equal(got, sdata) {
			t.Errorf("received bytes %q, want %q", got, sdata)
		}

		// Acceptor → dialer: a send.
		reply := []byte("reply from the acceptor")
		copy(sb[4096:], reply)
		if err := ac.QP().PostSend(3, verbs.Signaled, verbstest.SGE(t, srv.mr, 4096, len(reply))); err != nil {
			t.Fatal(err)
		}
		if c, err := verbstest.PollN(ctx, srv.cq, 1); err != nil {
			t.Fatal(err)
		} else if c[0].Status != verbs.StatusSuccess || c[0].WRID != 3 || c[0].Opcode != verbs.OpSend {
			t.Errorf("acceptor send completion %v", c[0])
		}
		if c, err := verbstest.PollN(ctx, cli.cq, 1); err != nil {
			t.Fatal(err)
		} else if c[0].Status != verbs.StatusSuccess || c[0].WRID != 200 || c[0].Opcode != verbs.OpRecv || c[0].ByteLen != uint32(len(reply)) {
			t.Errorf("dialer receive completion %v", c[0])
		}
		if got := cb[8192 : 8192+len(reply)]; !bytes.Equal(got, reply) {
			t.Errorf("dialer received %q, want %q", got, reply)
		}

		// Disconnect: the peer sees it, outstanding work is flushed.
		if err := ac.QP().PostRecv(101, verbstest.SGE(t, srv.mr, 8192, 64)); err != nil {
			t.Fatal(err)
		}
		if err := dc.QP().PostRecv(201, verbstest.SGE(t, cli.mr, 8192, 64)); err != nil {
			t.Fatal(err)
		}
		if err := dc.Disconnect(); err != nil {
			t.Fatalf("Disconnect: %v", err)
		}
		if err := dc.Disconnect(); err != nil {
			t.Errorf("second Disconnect: %v", err)
		}
		if err := ac.WaitDisconnect(ctx); err != nil {
			t.Fatalf("WaitDisconnect after the peer's Disconnect: %v", err)
		}
		if err := ac.WaitDisconnect(ctx); err != nil {
			t.Errorf("second WaitDisconnect: %v", err)
		}
		if c, err := verbstest.PollN(ctx, cli.cq, 1); err != nil {
			t.Errorf("dialer's outstanding receive after Disconnect: %v", err)
		} else if c[0].WRID != 201 || c[0].Status != verbs.StatusWRFlushErr {
			t.Errorf("dialer's outstanding receive after Disconnect: %v, want wr_id 201 flushed", c[0])
		}
		if st, err := dc.QP().State(); err != nil || st != verbs.StateError {
			t.Errorf("dialer QP after Disconnect: %v, %v; want ERR", st, err)
		}

		// Close releases the QPs: the PDs and CQs can go (checked when the
		// test ends), and the connections report ErrClosed.
		for _, c := range []*verbs.CMConn{ac, dc} {
			if err := c.Close(); err != nil {
				t.Errorf("Close %s: %v", c.Device(), err)
			}
			if err := c.Close(); err != nil {
				t.Errorf("second Close %s: %v", c.Device(), err)
			}
			if err := c.WaitDisconnect(ctx); !errors.Is(err, verbs.ErrClosed) {
				t.Errorf("WaitDisconnect after Close: %v, want ErrClosed", err)
			}
		}
		// The acceptor's outstanding receive went with its QP: nothing
		// is left on either CQ.
		var rest [4]verbs.Completion
		for _, s := range []*cmSide{srv, cli} {
			if n, err := s.cq.Poll(rest[:]); err != nil || n > 1 {
				t.Errorf("%s CQ after Close: %d completions %v, %v", s.name, n, rest[:n], err)
			}
		}
		if a.req != nil {
			if err := a.req.Reject(nil); !errors.Is(err, verbs.ErrClosed) {
				t.Errorf("Reject of an accepted request: %v, want ErrClosed", err)
			}
		}
	})

	t.Run("Reject", func(t *testing.T) {
		rejectData := []byte("no room for you")
		accepted := accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			return nil, r.Reject(rejectData)
		})
		c, err := verbs.DialCM(ctx, target, cli.pd, cli.spec(), []byte("let me in"))
		if err == nil {
			c.Close()
			t.Fatal("DialCM to a rejecting listener succeeded")
		}
		a := <-accepted
		if a.err != nil {
			t.Fatalf("Reject: %v", a.err)
		}
		var rej *verbs.CMRejectError
		if !errors.As(err, &rej) {
			t.Fatalf("DialCM: %v (%T), want a *CMRejectError", err, err)
		}
		t.Logf("rejected: %v", err)
		if !rej.ByApplication() || rej.Reason != 28 {
			t.Errorf("reason %d (by application %v), want 28", rej.Reason, rej.ByApplication())
		}
		padded(t, "reject private data", rej.PrivateData, rejectData, verbs.MaxCMRejectData)
		var oe *verbs.OpError
		if !errors.Is(err, syscall.ECONNREFUSED) || !errors.As(err, &oe) || oe.Device != cliDev {
			t.Errorf("DialCM error %v: want an *OpError on %s wrapping ECONNREFUSED", err, cliDev)
		}
		// Answered once: a second answer fails.
		if _, err := a.req.Accept(ctx, srv.pd, srv.spec(), nil); !errors.Is(err, verbs.ErrClosed) {
			t.Errorf("Accept after Reject: %v, want ErrClosed", err)
		}
		if err := a.req.Reject(nil); !errors.Is(err, verbs.ErrClosed) {
			t.Errorf("Reject after Reject: %v, want ErrClosed", err)
		}
	})

	t.Run("NoListener", func(t *testing.T) {
		// A port that was just listened on and is free again.
		l2, err := verbs.ListenCM(ctx, cp.ListenAddr(0), verbs.CMListenOptions{})
		if err != nil {
			t.Fatal(err)
		}
		port := l2.Addr().Port()
		if err := l2.Close(); err != nil {
			t.Fatal(err)
		}
		c, err := verbs.DialCM(ctx, cp.Target(port), cli.pd, cli.spec(), nil)
		if err == nil {
			c.Close()
			t.Fatal("DialCM to a port without listener succeeded")
		}
		var rej *verbs.CMRejectError
		if !errors.As(err, &rej) {
			t.Fatalf("DialCM: %v (%T), want a *CMRejectError", err, err)
		}
		t.Logf("no listener: %v", err)
		if rej.Reason != 8 || rej.ByApplication() || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("reason %d (by application %v), want 8 (invalid service ID) wrapping ECONNREFUSED", rej.Reason, rej.ByApplication())
		}
	})

	t.Run("PrivateDataTooLong", func(t *testing.T) {
		c, err := verbs.DialCM(ctx, target, cli.pd, cli.spec(), make([]byte, verbs.MaxCMDialData+1))
		if err == nil {
			c.Close()
			t.Fatal("DialCM with too much private data succeeded")
		}
		if !errors.Is(err, syscall.EINVAL) {
			t.Errorf("DialCM with %d bytes: %v, want EINVAL", verbs.MaxCMDialData+1, err)
		}
		accepted := accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			return r.Accept(ctx, srv.pd, srv.spec(), make([]byte, verbs.MaxCMAcceptData+1))
		})
		c, err = verbs.DialCM(ctx, target, cli.pd, cli.spec(), nil)
		if err == nil {
			c.Close()
			t.Error("DialCM succeeded against an Accept with too much private data")
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("DialCM against a failed Accept: %v, want ECONNREFUSED (the request is rejected)", err)
		}
		if a := <-accepted; !errors.Is(a.err, syscall.EINVAL) {
			t.Errorf("Accept with %d bytes: %v, want EINVAL", verbs.MaxCMAcceptData+1, a.err)
		}
		accepted = accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			return nil, r.Reject(make([]byte, verbs.MaxCMRejectData+1))
		})
		// The request is rejected all the same, without private data.
		c, err = verbs.DialCM(ctx, target, cli.pd, cli.spec(), nil)
		if err == nil {
			c.Close()
			t.Error("DialCM succeeded against a Reject with too much private data")
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("DialCM against a Reject with too much private data: %v, want ECONNREFUSED", err)
		}
		if a := <-accepted; !errors.Is(a.err, syscall.EINVAL) {
			t.Errorf("Reject with %d bytes: %v, want EINVAL", verbs.MaxCMRejectData+1, a.err)
		}
	})

	t.Run("AcceptContext", func(t *testing.T) {
		// Nothing dials: Accept returns when its context ends.
		for _, tc := range []struct {
			name string
			ctx  func() (context.Context, context.CancelFunc)
			want error
		}{
			{"Deadline", func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 50*time.Millisecond) }, context.DeadlineExceeded},
			{"Cancel", func() (context.Context, context.CancelFunc) {
				c, cancel := context.WithCancel(ctx)
				go func() { time.Sleep(20 * time.Millisecond); cancel() }()
				return c, cancel
			}, context.Canceled},
			{"AlreadyCanceled", func() (context.Context, context.CancelFunc) {
				c, cancel := context.WithCancel(ctx)
				cancel()
				return c, cancel
			}, context.Canceled},
		} {
			t.Run(tc.name, func(t *testing.T) {
				actx, acancel := tc.ctx()
				defer acancel()
				r, err := l.Accept(actx)
				if err == nil {
					r.Reject(nil)
					t.Fatal("Accept without a dialer succeeded")
				}
				if !errors.Is(err, tc.want) || !errors.Is(err, verbs.ErrTimeout) {
					t.Errorf("Accept: %v, want %v and ErrTimeout", err, tc.want)
				}
			})
		}
	})

	t.Run("DialContext", func(t *testing.T) {
		// The listener takes the request but never answers: the dial
		// waits until its context is canceled.
		dctx, dcancel := context.WithCancel(ctx)
		defer dcancel()
		got := make(chan *verbs.CMRequest, 1)
		accepted := accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			got <- r
			dcancel()
			return nil, nil
		})
		c, err := verbs.DialCM(dctx, target, cli.pd, cli.spec(), []byte("waiting"))
		if err == nil {
			c.Close()
			t.Fatal("DialCM to a listener that never answers succeeded")
		}
		if a := <-accepted; a.err != nil {
			t.Fatalf("Accept: %v", a.err)
		}
		if !errors.Is(err, context.Canceled) || !errors.Is(err, verbs.ErrTimeout) {
			t.Errorf("DialCM canceled while waiting for the answer: %v, want context.Canceled and ErrTimeout", err)
		}
		r := <-got
		if err := r.Reject(nil); err != nil {
			t.Logf("Reject of the abandoned request: %v", err)
		}

		// An address nobody answers (neighbour discovery fails): the
		// deadline ends the dial.
		dctx2, dcancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
		defer dcancel2()
		c, err = verbs.DialCM(dctx2, "[fe80::1234:5678%"+cliZone+"]:4791", cli.pd, cli.spec(), nil)
		if err == nil {
			c.Close()
			t.Fatal("DialCM to an unreachable address succeeded")
		}
		if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, verbs.ErrTimeout) {
			t.Errorf("DialCM to an unreachable address: %v, want context.DeadlineExceeded and ErrTimeout", err)
		}
	})

	t.Run("DialCMFunc", func(t *testing.T) {
		// The setup callback picks the PD by the route's device.
		sides := map[string]*cmSide{srvDev: srv, cliDev: cli}
		var seen verbs.CMRoute
		accepted := accept(ctx, func(r *verbs.CMRequest) (*verbs.CMConn, error) {
			return r.Accept(ctx, sides[r.Device()].pd, sides[r.Device()].spec(), []byte("ok"))
		})
		dc, err := verbs.DialCMFunc(ctx, target, func(rt verbs.CMRoute) (*verbs.ProtectionDomain, verbs.QPSpec, error) {
			seen = rt
			s := sides[rt.Device]
			if s == nil {
				return nil, verbs.QPSpec{}, errors.New("unknown device " + rt.Device)
			}
			return s.pd, s.spec(), nil
		}, nil)
		if err != nil {
			t.Fatalf("DialCMFunc: %v", err)
		}
		a := <-accepted
		if a.err != nil {
			dc.Close()
			t.Fatalf("Accept: %v", a.err)
		}
		if seen.Device != cliDev || dc.Device() != cliDev || a.conn.Device() != srvDev {
			t.Errorf("setup saw %+v; dialer on %s, acceptor on %s", seen, dc.Device(), a.conn.Device())
		}
		padded(t, "reply private data", dc.PrivateData(), []byte("ok"), verbs.MaxCMAcceptData)
		// Closing without Disconnect: the peer sees the disconnection.
		if err := dc.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := a.conn.WaitDisconnect(ctx); err != nil {
			t.Errorf("WaitDisconnect after the peer's Close: %v", err)
		}
		if err := a.conn.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}

		// A setup error ends the dial and is returned as is.
		errSetup := errors.New("no PD for you")
		_, err = verbs.DialCMFunc(ctx, target, func(verbs.CMRoute) (*verbs.ProtectionDomain, verbs.QPSpec, error) {
			return nil, verbs.QPSpec{}, errSetup
		}, nil)
		if !errors.Is(err, errSetup) {
			t.Errorf("DialCMFunc with a failing setup: %v, want %v", err, errSetup)
		}
		// A PD of the wrong device: EXDEV naming the route's device.
		_, err = verbs.DialCM(ctx, target, srv.pd, srv.spec(), nil)
		if !errors.Is(err, syscall.EXDEV) {
			t.Errorf("DialCM with a PD of %s over a route via %s: %v, want EXDEV", srvDev, cliDev, err)
		}
	})

	t.Run("ListenerClose", func(t *testing.T) {
		l2, err := verbs.ListenCM(ctx, cp.ListenAddr(0), verbs.CMListenOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// A request taken by Accept but not answered is rejected by Close.
		got := make(chan error, 1)
		go func() {
			r, err := l2.Accept(ctx)
			if err == nil {
				if err = l2.Close(); err == nil {
					if err = r.Reject(nil); errors.Is(err, verbs.ErrClosed) {
						err = nil
					} else {
						err = errors.New("Reject after the listener's Close did not fail with ErrClosed")
					}
				}
			}
			got <- err
		}()
		c, err := verbs.DialCM(ctx, cp.Target(l2.Addr().Port()), cli.pd, cli.spec(), nil)
		if err == nil {
			c.Close()
			t.Error("DialCM to a listener closed with the request pending succeeded")
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("DialCM to a listener closed with the request pending: %v, want ECONNREFUSED", err)
		}
		if err := <-got; err != nil {
			t.Error(err)
		}
		// A closed listener: Accept fails at once with ErrClosed.
		if _, err := l2.Accept(ctx); !errors.Is(err, verbs.ErrClosed) {
			t.Errorf("Accept on a closed listener: %v, want ErrClosed", err)
		}
		if err := l2.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	})
}
