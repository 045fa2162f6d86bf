//go:build ibverbs && linux && cgo

package ibv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// cmRes holds per-device resources for CM tests.
type cmRes struct {
	ctx *devContext
	pd  prov.PD
	cq  prov.CQ
	mr  prov.MR
	buf []byte
}

type cmPool struct {
	t  *testing.T
	mu sync.Mutex
	m  map[string]*cmRes
}

func (p *cmPool) get(dev string) *cmRes {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.m[dev]; r != nil {
		return r
	}
	t := p.t
	r := &cmRes{ctx: openCtx(t, dev, modes[0])}
	var err error
	if r.pd, err = r.ctx.AllocPD(); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "pd", r.pd)
	if r.cq, err = r.ctx.CreateCQ(64, nil, 0); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "cq", r.cq)
	buf, err := unix.Mmap(-1, 0, bufSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(buf) })
	r.buf = buf
	if r.mr, err = r.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: len(buf), FD: -1},
		prov.AccessLocalWrite|prov.AccessRemoteWrite|prov.AccessRemoteRead); err != nil {
		t.Fatal(err)
	}
	closeLater(t, "mr", r.mr)
	p.m[dev] = r
	return r
}

// newQP is a CMParams.NewQP that records the QPs for closing.
func (p *cmPool) newQP(rt Route, _ *CMParams) (prov.QP, error) {
	r := p.get(rt.Device)
	qp, err := r.pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: r.cq, RecvCQ: r.cq,
		Cap: prov.QPCap{MaxSendWR: 16, MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}})
	if err == nil {
		closeLater(p.t, "qp", qp)
	}
	return qp, err
}

func TestCM(t *testing.T) {
	_, n1 := testDevices(t)
	pool := &cmPool{t: t, m: map[string]*cmRes{}}
	gids, err := pool.get(n1).ctx.QueryGIDTable(1)
	if err != nil || len(gids) == 0 || gids[0].Netdev == "" {
		t.Skipf("no RDMA CM address: %s GID table %v, %v", n1, gids, err)
	}
	ip := netip.AddrFrom16(gids[0].GID)
	if ip.Is4In6() {
		ip = ip.Unmap()
	} else if ip.IsLinkLocalUnicast() {
		ip = ip.WithZone(gids[0].Netdev)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	l, err := Listen(ctx, netip.AddrPortFrom(ip, 0).String(), 8)
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	defer l.Close()
	t.Logf("listening on %v", l.Addr())
	target := l.Addr().String()

	type acc struct {
		c   *Conn
		err error
	}

	// Dial the listener's address through its own interface (the kernel
	// treats it as local: both ends use the listener's device) and through
	// the other device's interface (across the veth pair when the kernel
	// routes it there).
	targets := []string{target}
	n0, _ := testDevices(t)
	if g0, err := pool.get(n0).ctx.QueryGIDTable(1); err == nil && len(g0) > 0 && g0[0].Netdev != "" && ip.Zone() != "" {
		targets = append(targets, netip.AddrPortFrom(ip.WithZone(g0[0].Netdev), l.Addr().Port()).String())
	}
	for _, target := range targets {
		t.Run("connect "+target, func(t *testing.T) {
			accepted := make(chan acc, 1)
			go func() {
				r, err := l.Next(ctx)
				if err != nil {
					accepted <- acc{nil, err}
					return
				}
				if !bytes.HasPrefix(r.PrivateData(), []byte("hello")) {
					r.Reject(nil)
					accepted <- acc{nil, fmt.Errorf("request private data %q", r.PrivateData())}
					return
				}
				t.Logf("request on %s port %d from %v (%d bytes of private data)", r.Device(), r.Port(), r.RemoteAddr(), len(r.PrivateData()))
				c, err := r.Accept(ctx, CMParams{NewQP: pool.newQP, PrivateData: []byte("welcome")})
				accepted <- acc{c, err}
			}()
			dc, err := Dial(ctx, target, CMParams{NewQP: pool.newQP, PrivateData: []byte("hello")})
			if err != nil {
				t.Fatalf("Dial: %v", err)
			}
			a := <-accepted
			if a.err != nil {
				t.Fatalf("Accept: %v", a.err)
			}
			ac := a.c
			t.Logf("dialer %s/%d %v -> %v, QPN %d (peer %d); acceptor %s QPN %d (peer %d)",
				dc.Device(), dc.Port(), dc.LocalAddr(), dc.RemoteAddr(), dc.QP().QPN(), dc.RemoteQPN(), ac.Device(), ac.QP().QPN(), ac.RemoteQPN())
			if !bytes.HasPrefix(dc.PrivateData(), []byte("welcome")) {
				t.Errorf("reply private data %q", dc.PrivateData())
			}
			if dc.RemoteQPN() != ac.QP().QPN() || ac.RemoteQPN() != dc.QP().QPN() {
				t.Errorf("QPNs do not match")
			}
			for _, c := range []*Conn{dc, ac} {
				attr, _, err := c.QP().Query()
				if err != nil || attr.State != prov.QPStateRTS {
					t.Errorf("QP state %d, %v", attr.State, err)
				}
			}

			// Traffic: a send and an RDMA write over the CM-connected QPs.
			dr, ar := pool.get(dc.Device()), pool.get(ac.Device())
			postRecv(t, ac.QP(), []prov.RecvWR{{WRID: 1, NumSGE: 1}},
				[]prov.SGE{{Addr: ar.mr.Addr() + 4096, Length: 64, LKey: ar.mr.LKey()}})
			copy(dr.buf, "over rdma_cm")
			postSend(t, dc.QP(), []prov.SendWR{
				{WRID: 2, Opcode: prov.WRSend, Flags: prov.SendSignaled, NumSGE: 1},
				{WRID: 3, Opcode: prov.WRWrite, Flags: prov.SendSignaled, RemoteAddr: ar.mr.Addr() + 8192, RKey: ar.mr.RKey(), NumSGE: 1},
			}, []prov.SGE{{Addr: dr.mr.Addr(), Length: 12, LKey: dr.mr.LKey()}})
			var sent []prov.Completion
			var recvd []prov.Completion
			if dc.Device() == ac.Device() {
				all := pollN(t, dr.cq, 3)
				for _, c := range all {
					if c.Opcode == prov.WCRecv {
						recvd = append(recvd, c)
					} else {
						sent = append(sent, c)
					}
				}
			} else {
				sent = pollN(t, dr.cq, 2)
				recvd = pollN(t, ar.cq, 1)
			}
			if len(sent) != 2 || len(recvd) != 1 || sent[0].Status != 0 || sent[1].Status != 0 || recvd[0].Status != 0 {
				t.Fatalf("completions: sent %+v, received %+v", sent, recvd)
			}
			if string(ar.buf[4096:4096+12]) != "over rdma_cm" || string(ar.buf[8192:8192+12]) != "over rdma_cm" {
				t.Errorf("payloads %q %q", ar.buf[4096:4096+12], ar.buf[8192:8192+12])
			}

			// Disconnect: the acceptor sees it.
			if err := dc.Close(); err != nil {
				t.Fatal(err)
			}
			wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
			defer wcancel()
			if err := ac.WaitDisconnect(wctx); err != nil {
				t.Errorf("WaitDisconnect: %v", err)
			}
			ac.Close()
		})
	}

	t.Run("reject", func(t *testing.T) {
		go func() {
			if r, err := l.Next(ctx); err == nil {
				r.Reject([]byte("nope"))
			}
		}()
		_, err := Dial(ctx, target, CMParams{NewQP: pool.newQP, PrivateData: []byte("hello")})
		var rej *RejectError
		if !errors.As(err, &rej) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("Dial to a rejecting listener: %v", err)
		}
		t.Logf("rejected: %v (status %d, %d bytes of private data)", err, rej.Status, len(rej.PrivateData))
		if !bytes.HasPrefix(rej.PrivateData, []byte("nope")) {
			t.Errorf("reject private data %q", rej.PrivateData)
		}
	})

	t.Run("no-listener", func(t *testing.T) {
		ap := netip.AddrPortFrom(l.Addr().Addr(), l.Addr().Port()+1)
		dctx, dcancel := context.WithTimeout(ctx, 20*time.Second)
		defer dcancel()
		_, err := Dial(dctx, ap.String(), CMParams{NewQP: pool.newQP})
		if err == nil {
			t.Fatal("Dial to a port without listener succeeded")
		}
		t.Logf("no listener: %v", err)
	})

	t.Run("cancel", func(t *testing.T) {
		// An unreachable link-local address: the context ends the dial.
		dctx, dcancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer dcancel()
		dst := "[fe80::1234:5678%" + gids[0].Netdev + "]:4791"
		if ip.Is4() {
			dst = "10.255.255.1:4791"
		}
		start := time.Now()
		_, err := Dial(dctx, dst, CMParams{NewQP: pool.newQP})
		if err == nil {
			t.Fatal("Dial to nowhere succeeded")
		}
		t.Logf("unreachable after %v: %v", time.Since(start).Round(time.Millisecond), err)
	})

	t.Run("wrong-pd", func(t *testing.T) {
		// CMParams with a PD of a device the route does not use.
		n0, _ := testDevices(t)
		other := pool.get(n0)
		go func() {
			if r, err := l.Next(ctx); err == nil {
				_, err := r.Accept(ctx, CMParams{PD: other.pd, SendCQ: other.cq, RecvCQ: other.cq,
					Cap: prov.QPCap{MaxSendWR: 4, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1}})
				if r.Device() != n0 && !errors.Is(err, syscall.EXDEV) {
					t.Errorf("Accept with a PD of %s on %s: %v", n0, r.Device(), err)
				}
			}
		}()
		_, err := Dial(ctx, target, CMParams{NewQP: pool.newQP})
		t.Logf("dial against a mismatched acceptor: %v", err)
	})
}
