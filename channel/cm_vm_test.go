//go:build ibverbs && linux && cgo

package channel_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// cmSide is one end of the CM tests: a device, a PD and 64 KiB of memory
// with every access. The test's cleanup closes them, each Close checked: a
// channel that kept its queue pair or CQ would make the PD refuse.
type cmSide struct {
	name string
	dev  *verbs.Context
	pd   *verbs.ProtectionDomain
	buf  *verbs.MemoryRegion
}

func openCMSide(t *testing.T, name string) *cmSide {
	t.Helper()
	s := &cmSide{name: name}
	var err error
	if s.dev, err = verbs.Open(name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "device "+name, s.dev.Close) })
	if s.pd, err = s.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "pd of "+name, s.pd.Close) })
	if s.buf, err = s.pd.Alloc(64<<10, verbs.AccessRemoteAll); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "mr of "+name, s.buf.Close) })
	return s
}

func (s *cmSide) sge(t *testing.T, off, n int) verbs.SGE { return verbstest.SGE(t, s.buf, off, n) }

// region encodes the side's buffer for the private data: address, length,
// rkey (20 bytes).
func (s *cmSide) region() []byte {
	r := s.buf.Remote()
	b := binary.LittleEndian.AppendUint64(nil, r.Addr)
	b = binary.LittleEndian.AppendUint64(b, r.Len)
	return binary.LittleEndian.AppendUint32(b, r.RKey)
}

func decodeRegion(t *testing.T, b []byte) verbs.RemoteRegion {
	t.Helper()
	if len(b) < 20 {
		t.Fatalf("private data of %d bytes, want a region (20)", len(b))
	}
	return verbs.RemoteRegion{Addr: binary.LittleEndian.Uint64(b), Len: binary.LittleEndian.Uint64(b[8:]), RKey: binary.LittleEndian.Uint32(b[16:])}
}

// cmEnv is the listener on the first device and the address the second
// dials it at (see cm_vm_test.go of package verbs: the link-local address
// of the server's netdev with the zone of the client's, so that the client
// device carries the connection).
type cmEnv struct {
	srv, cli *cmSide
	l        *verbs.CMListener
	target   string
}

func newCMEnv(t *testing.T, ctx context.Context) *cmEnv {
	t.Helper()
	cp := vmtest.CMAddrs(t) // skips outside the VM

	env := &cmEnv{srv: openCMSide(t, cp.Server), cli: openCMSide(t, cp.Client)}
	var err error
	if env.l, err = verbs.ListenCM(ctx, cp.ListenAddr(0), verbs.CMListenOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "listener", env.l.Close) })
	env.target = cp.Target(env.l.Addr().Port())
	return env
}

type acceptResult struct {
	ch  *channel.Channel
	err error
}

// accept answers the next request with answer, in a goroutine.
func (env *cmEnv) accept(ctx context.Context, answer func(*verbs.CMRequest) (*channel.Channel, error)) <-chan acceptResult {
	res := make(chan acceptResult, 1)
	go func() {
		r, err := env.l.Accept(ctx)
		if err != nil {
			res <- acceptResult{err: err}
			return
		}
		c, err := answer(r)
		res <- acceptResult{c, err}
	}()
	return res
}

// postReceives is a prepare function that posts n receives of 256 bytes
// at off, after waiting delay (a slow preparation: without the ready
// handshake, the peer's first send would find no receive).
func postReceives(t *testing.T, s *cmSide, off, n int, delay time.Duration, hs *[]channel.Handle) func(*channel.Channel) error {
	return func(c *channel.Channel) error {
		time.Sleep(delay)
		for i := range n {
			h, err := c.PostReceive(s.sge(t, off+256*i, 256))
			if err != nil {
				return err
			}
			*hs = append(*hs, h)
		}
		return nil
	}
}

// TestCMDevices connects channels through the RDMA CM across rxe0 and
// rxe1 and checks what DialCM and AcceptCM promise: private data both
// ways with exact lengths, the route, receives posted by prepare before
// the peer's first message (with RNR retries disabled, a message that
// found no receive would break the channel), sends and RDMA writes in both
// directions, the peer's disconnection breaking the channel with
// ErrDisconnected, refusals, and every resource released.
func TestCMDevices(t *testing.T) {
	verbstest.CheckLeaks(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	env := newCMEnv(t, ctx)
	srv, cli := env.srv, env.cli
	// No RNR retries: a message that arrives before a receive is posted
	// fails the sender at once instead of being retried.
	opts := channel.Options{QP: verbs.QPSpec{RNRRetry: -1, MaxSendWR: 16, MaxRecvWR: 16}}

	t.Run("Transfer", func(t *testing.T) {
		for _, slow := range []string{"dialer", "acceptor"} {
			t.Run("Slow"+slow, func(t *testing.T) {
				// The slow side's prepare takes a while; the other sends
				// as soon as its call returns.
				var dDelay, aDelay time.Duration
				if slow == "dialer" {
					dDelay = 200 * time.Millisecond
				} else {
					aDelay = 200 * time.Millisecond
				}
				dialData := append([]byte("dial:"), cli.region()...)
				acceptData := append(append([]byte("accept:"), srv.region()...), bytes.Repeat([]byte{'x'}, channel.MaxCMAcceptData-27)...)
				var aRecv, dRecv []channel.Handle
				var reqData []byte
				var asendErr error
				amsg := []byte("first message from the acceptor")
				copy(srv.buf.Bytes()[0:], amsg)
				accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
					var err error
					if reqData, err = channel.CMRequestData(r); err != nil {
						r.Reject(nil)
						return nil, err
					}
					c, err := channel.AcceptCM(ctx, r, srv.pd, opts, acceptData, postReceives(t, srv, 8192, 2, aDelay, &aRecv))
					if err == nil {
						// The acceptor sends at once: the dialer's
						// receives are posted, however long its
						// prepare took.
						asendErr = c.Send(ctx, srv.sge(t, 0, len(amsg)))
					}
					return c, err
				})
				dc, err := channel.DialCM(ctx, env.target, cli.pd, opts, dialData, postReceives(t, cli, 8192, 2, dDelay, &dRecv))
				if err != nil {
					t.Fatalf("DialCM: %v", err)
				}
				defer closeOrFail(t, "dialer channel", dc.Close)
				// The dialer sends at once: the acceptor's receives are
				// posted, however long its prepare took.
				dmsg := []byte("first message from the dialer")
				copy(cli.buf.Bytes()[0:], dmsg)
				dsend, err := dc.PostSend(cli.sge(t, 0, len(dmsg)))
				if err != nil {
					t.Fatal(err)
				}
				a := <-accepted
				if a.err != nil {
					t.Fatalf("AcceptCM: %v", a.err)
				}
				ac := a.ch
				defer closeOrFail(t, "acceptor channel", ac.Close)
				if asendErr != nil {
					t.Fatalf("acceptor's first send: %v", asendErr)
				}
				if err := dsend.Wait(ctx); err != nil {
					t.Fatalf("dialer's first send: %v", err)
				}
				dsend.Release()

				// Private data: exact, both ways.
				if !bytes.Equal(reqData, dialData) || !bytes.Equal(ac.CMPrivateData(), dialData) {
					t.Errorf("dialer's private data: CMRequestData %q, acceptor's CMPrivateData %q; want %q", reqData, ac.CMPrivateData(), dialData)
				}
				if !bytes.Equal(dc.CMPrivateData(), acceptData) {
					t.Errorf("acceptor's private data at the dialer: %q, want %q", dc.CMPrivateData(), acceptData)
				}
				// Routes.
				dr, dok := dc.CMRoute()
				ar, aok := ac.CMRoute()
				if !dok || !aok || dr.Device != cli.name || ar.Device != srv.name || dr.RemoteAddr.Port() != env.l.Addr().Port() || ar.LocalAddr.Port() != env.l.Addr().Port() {
					t.Errorf("routes: dialer %+v (%v), acceptor %+v (%v); want %s and %s, port %d", dr, dok, ar, aok, cli.name, srv.name, env.l.Addr().Port())
				}
				for _, c := range []*channel.Channel{dc, ac} {
					if st, err := c.QueuePair().State(); err != nil || st != verbs.StateRTS {
						t.Errorf("queue pair state %v, %v; want RTS", st, err)
					}
					if err := c.Err(); err != nil {
						t.Errorf("Err of a working channel: %v", err)
					}
				}
				// The first messages landed in the receives prepare posted.
				for _, tc := range []struct {
					who string
					hs  []channel.Handle
					s   *cmSide
					msg []byte
				}{{"acceptor", aRecv, srv, dmsg}, {"dialer", dRecv, cli, amsg}} {
					if len(tc.hs) != 2 {
						t.Fatalf("%s's prepare posted %d receives, want 2", tc.who, len(tc.hs))
					}
					if err := tc.hs[0].Wait(ctx); err != nil {
						t.Fatalf("%s's first receive: %v", tc.who, err)
					}
					if r := tc.hs[0].Received(); r.Len != len(tc.msg) || !bytes.Equal(tc.s.buf.Bytes()[8192:8192+r.Len], tc.msg) {
						t.Errorf("%s received %d bytes %q, want %q", tc.who, r.Len, tc.s.buf.Bytes()[8192:8192+r.Len], tc.msg)
					}
					tc.hs[0].Release()
				}

				// RDMA writes both ways, to the regions of the private data.
				srvRegion := decodeRegion(t, dc.CMPrivateData()[len("accept:"):])
				cliRegion := decodeRegion(t, ac.CMPrivateData()[len("dial:"):])
				wd := bytes.Repeat([]byte("write from the dialer "), 100)
				wa := bytes.Repeat([]byte("write from the acceptor "), 100)
				copy(cli.buf.Bytes()[1024:], wd)
				copy(srv.buf.Bytes()[1024:], wa)
				if err := dc.Write(ctx, srvRegion.At(16384), cli.sge(t, 1024, len(wd))); err != nil {
					t.Fatalf("dialer's write: %v", err)
				}
				if err := ac.Write(ctx, cliRegion.At(16384), srv.sge(t, 1024, len(wa))); err != nil {
					t.Fatalf("acceptor's write: %v", err)
				}
				if got := srv.buf.Bytes()[16384 : 16384+len(wd)]; !bytes.Equal(got, wd) {
					t.Errorf("the dialer's write left %q", got[:40])
				}
				if got := cli.buf.Bytes()[16384 : 16384+len(wa)]; !bytes.Equal(got, wa) {
					t.Errorf("the acceptor's write left %q", got[:40])
				}
				// A write with immediate, consuming the second receive.
				if err := dc.WriteImm(ctx, srvRegion.At(20000), 0xfeed, cli.sge(t, 1024, 8)); err != nil {
					t.Fatalf("dialer's write with immediate: %v", err)
				}
				if err := aRecv[1].Wait(ctx); err != nil {
					t.Fatalf("acceptor's receive of the immediate: %v", err)
				}
				if r := aRecv[1].Received(); !r.HasImm || r.Imm != 0xfeed {
					t.Errorf("acceptor received %+v, want immediate 0xfeed", r)
				}
				aRecv[1].Release()

				// The dialer closes: the acceptor's outstanding receive
				// completes (flushed), the channel broken by the
				// disconnection, and later calls fail at once. (The
				// receive is posted before the disconnection: rxe of
				// Linux 6.1 does not flush a receive posted to a queue
				// pair already in the error state.)
				rh, err := ac.PostReceive(srv.sge(t, 32768, 64))
				if err != nil {
					t.Fatal(err)
				}
				if err := dc.Close(); err != nil {
					t.Errorf("dialer Close: %v", err)
				}
				if err := dc.Close(); err != nil {
					t.Errorf("second dialer Close: %v", err)
				}
				rctx, rcancel := context.WithTimeout(ctx, 30*time.Second) // hang guard
				defer rcancel()
				err = rh.Wait(rctx)
				rh.Release()
				t.Logf("acceptor's receive after the dialer closed: %v", err)
				if err == nil || errors.Is(err, verbs.ErrTimeout) || !errors.Is(ac.Err(), channel.ErrBroken) || !errors.Is(ac.Err(), channel.ErrDisconnected) {
					t.Errorf("acceptor's receive after the dialer closed: %v (Err %v); want a flush, and Err wrapping ErrBroken and ErrDisconnected", err, ac.Err())
				}
				if _, err := ac.Receive(ctx, srv.sge(t, 32768, 64)); !errors.Is(err, channel.ErrDisconnected) {
					t.Errorf("Receive on the disconnected channel: %v, want ErrDisconnected", err)
				}
				// The dialer's outstanding receive was flushed by Close.
				if err := dRecv[1].Wait(ctx); err == nil {
					t.Error("the dialer's outstanding receive completed without error after Close")
				}
				if err := ac.Close(); err != nil {
					t.Errorf("acceptor Close: %v", err)
				}
			})
		}
	})

	t.Run("PrepareFails", func(t *testing.T) {
		errPrepare := errors.New("not ready")
		accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
			return channel.AcceptCM(ctx, r, srv.pd, opts, nil, nil)
		})
		c, err := channel.DialCM(ctx, env.target, cli.pd, opts, nil, func(*channel.Channel) error { return errPrepare })
		if err == nil {
			c.Close()
			t.Fatal("DialCM with a failing prepare succeeded")
		}
		if !errors.Is(err, errPrepare) {
			t.Errorf("DialCM: %v, want %v", err, errPrepare)
		}
		a := <-accepted
		if a.err == nil {
			a.ch.Close()
			t.Fatal("AcceptCM succeeded though the dialer gave up")
		}
		t.Logf("AcceptCM: %v", a.err)
		if !errors.Is(a.err, channel.ErrDisconnected) {
			t.Errorf("AcceptCM: %v, want ErrDisconnected", a.err)
		}
	})

	t.Run("HandshakeContext", func(t *testing.T) {
		// The acceptor's prepare does not return until the dialer gave
		// up: the dialer's context ends its wait for the ready word,
		// and the acceptor's handshake then fails with ErrDisconnected.
		gaveUp := make(chan struct{})
		accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
			return channel.AcceptCM(ctx, r, srv.pd, opts, nil, func(*channel.Channel) error { <-gaveUp; return nil })
		})
		dctx, dcancel := context.WithTimeout(ctx, 2*time.Second)
		defer dcancel()
		c, err := channel.DialCM(dctx, env.target, cli.pd, opts, nil, nil)
		close(gaveUp)
		if err == nil {
			c.Close()
			t.Fatal("DialCM succeeded while the acceptor's prepare was blocked")
		}
		if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, verbs.ErrTimeout) {
			t.Errorf("DialCM: %v, want context.DeadlineExceeded and verbs.ErrTimeout", err)
		}
		a := <-accepted
		if a.err == nil {
			a.ch.Close()
			t.Fatal("AcceptCM succeeded though the dialer gave up")
		}
		if !errors.Is(a.err, channel.ErrDisconnected) {
			t.Errorf("AcceptCM: %v, want ErrDisconnected", a.err)
		}
	})

	t.Run("Reject", func(t *testing.T) {
		accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
			return nil, r.Reject([]byte("go away"))
		})
		c, err := channel.DialCM(ctx, env.target, cli.pd, opts, []byte("let me in"), nil)
		if err == nil {
			c.Close()
			t.Fatal("DialCM to a rejecting listener succeeded")
		}
		var rej *verbs.CMRejectError
		if !errors.As(err, &rej) || !rej.ByApplication() || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("DialCM: %v, want a *verbs.CMRejectError by the application", err)
		}
		if a := <-accepted; a.err != nil {
			t.Fatalf("Reject: %v", a.err)
		}
	})

	t.Run("WrongDevice", func(t *testing.T) {
		// The PD of the other device: refused before anything is
		// allocated, and the request rejected.
		accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
			return channel.AcceptCM(ctx, r, cli.pd, opts, nil, nil)
		})
		c, err := channel.DialCM(ctx, env.target, cli.pd, opts, nil, nil)
		if err == nil {
			c.Close()
			t.Fatal("DialCM to an acceptor with the wrong PD succeeded")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("DialCM: %v, want ECONNREFUSED", err)
		}
		if a := <-accepted; !errors.Is(a.err, syscall.EXDEV) {
			t.Errorf("AcceptCM with a PD of %s for a request on %s: %v, want EXDEV", cli.name, srv.name, a.err)
		}
	})

	t.Run("PlainVerbsPeer", func(t *testing.T) {
		// A verbs.DialCM peer does not speak the handshake: refused with
		// EPROTO, the request rejected.
		cq, err := cli.dev.NewCompletionQueue(verbs.CQSpec{Entries: 16})
		if err != nil {
			t.Fatal(err)
		}
		defer closeOrFail(t, "cq", cq.Close)
		spec := verbs.QPSpec{SendCQ: cq, MaxSendWR: 4, MaxRecvWR: 4}
		accepted := env.accept(ctx, func(r *verbs.CMRequest) (*channel.Channel, error) {
			if _, err := channel.CMRequestData(r); !errors.Is(err, syscall.EPROTO) {
				t.Errorf("CMRequestData of a plain request: %v, want EPROTO", err)
			}
			return channel.AcceptCM(ctx, r, srv.pd, opts, nil, nil)
		})
		conn, err := verbs.DialCM(ctx, env.target, cli.pd, spec, []byte("plain hello, long enough to look like a header"))
		if err == nil {
			conn.Close()
			t.Error("a plain verbs.DialCM was accepted")
		} else if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("plain verbs.DialCM: %v, want ECONNREFUSED", err)
		}
		if a := <-accepted; !errors.Is(a.err, syscall.EPROTO) {
			t.Errorf("AcceptCM of a plain request: %v, want EPROTO", a.err)
		}

		// A channel dialing a plain verbs acceptor: the reply has no
		// handshake, DialCM fails with EPROTO and disconnects.
		scq, err := srv.dev.NewCompletionQueue(verbs.CQSpec{Entries: 16})
		if err != nil {
			t.Fatal(err)
		}
		defer closeOrFail(t, "cq", scq.Close)
		plain := make(chan *verbs.CMConn, 1)
		go func() {
			r, err := env.l.Accept(ctx)
			if err != nil {
				t.Error(err)
				plain <- nil
				return
			}
			c, err := r.Accept(ctx, srv.pd, verbs.QPSpec{SendCQ: scq, MaxSendWR: 4, MaxRecvWR: 4}, []byte("plain welcome"))
			if err != nil {
				t.Error(err)
			}
			plain <- c
		}()
		c, err := channel.DialCM(ctx, env.target, cli.pd, opts, nil, nil)
		if err == nil {
			c.Close()
			t.Error("DialCM to a plain verbs acceptor succeeded")
		} else if !errors.Is(err, syscall.EPROTO) {
			t.Errorf("DialCM to a plain verbs acceptor: %v, want EPROTO", err)
		}
		if pc := <-plain; pc != nil {
			if err := pc.WaitDisconnect(ctx); err != nil {
				t.Errorf("the plain acceptor did not see the disconnection: %v", err)
			}
			closeOrFail(t, "plain connection", pc.Close)
		}
	})
}
