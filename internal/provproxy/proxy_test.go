package provproxy_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/verbstest"
)

// crossPair returns an RC pair with side A in this process and side B in
// a peer process (both soft0), connected.
func crossPair(t *testing.T, spec verbs.QPSpec) *verbstest.RCPair {
	t.Helper()
	return verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice, PeerProcessB: true}, spec)
}

func guard(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return ctx
}

func pollOne(t *testing.T, cq *verbs.CompletionQueue) verbs.Completion {
	t.Helper()
	wcs, err := verbstest.PollN(guard(t), cq, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := wcs[0].Err(); err != nil {
		t.Fatalf("completion %v: %v", wcs[0], err)
	}
	return wcs[0]
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestSharedMemory checks that side B's memory is the same pages in both
// processes: bytes the peer's provider writes into it are seen here, and
// bytes written here are what the peer's provider reads, for each way the
// provider touches memory.
func TestSharedMemory(t *testing.T) {
	const n = 3000
	for _, tc := range []struct {
		name string
		// run moves n bytes of src (written here) to dst through the
		// peer's side of p and returns what arrived.
		run func(t *testing.T, p *verbstest.RCPair) (src, dst []byte)
	}{
		{"PeerReceivesRDMAWrite", func(t *testing.T, p *verbstest.RCPair) ([]byte, []byte) {
			src, dst := p.A.Alloc(t, n, verbs.AccessLocalWrite), p.B.Alloc(t, n, verbs.AccessRemoteAll)
			verbstest.Pattern(src.Bytes(), 1)
			must(t, p.QA.PostWrite(1, verbs.Signaled, dst.Remote().At(0), src.All()))
			pollOne(t, p.A.CQ)
			return src.Bytes(), dst.Bytes()
		}},
		{"PeerServesRDMARead", func(t *testing.T, p *verbstest.RCPair) ([]byte, []byte) {
			src, dst := p.B.Alloc(t, n, verbs.AccessRemoteAll), p.A.Alloc(t, n, verbs.AccessLocalWrite)
			verbstest.Pattern(src.Bytes(), 2)
			must(t, p.QA.PostRead(1, verbs.Signaled, src.Remote().At(0), dst.All()))
			pollOne(t, p.A.CQ)
			return src.Bytes(), dst.Bytes()
		}},
		{"PeerReceivesSend", func(t *testing.T, p *verbstest.RCPair) ([]byte, []byte) {
			src, dst := p.A.Alloc(t, n, verbs.AccessLocalWrite), p.B.Alloc(t, n, verbs.AccessLocalWrite)
			verbstest.Pattern(src.Bytes(), 3)
			must(t, p.QB.PostRecv(1, dst.All()))
			must(t, p.QA.PostSend(2, verbs.Signaled, src.All()))
			pollOne(t, p.B.CQ)
			return src.Bytes(), dst.Bytes()
		}},
		{"PeerSends", func(t *testing.T, p *verbstest.RCPair) ([]byte, []byte) {
			src, dst := p.B.Alloc(t, n, verbs.AccessLocalWrite), p.A.Alloc(t, n, verbs.AccessLocalWrite)
			verbstest.Pattern(src.Bytes(), 4)
			must(t, p.QA.PostRecv(1, dst.All()))
			must(t, p.QB.PostSend(2, verbs.Signaled, src.All()))
			pollOne(t, p.A.CQ)
			return src.Bytes(), dst.Bytes()
		}},
		{"PeerWritesAndReadsItsOwnMemory", func(t *testing.T, p *verbstest.RCPair) ([]byte, []byte) {
			// The peer's RDMA read lands in its memory, from A's.
			src, dst := p.A.Alloc(t, n, verbs.AccessRemoteAll), p.B.Alloc(t, n, verbs.AccessLocalWrite)
			verbstest.Pattern(src.Bytes(), 5)
			must(t, p.QB.PostRead(1, verbs.Signaled, src.Remote().At(0), dst.All()))
			pollOne(t, p.B.CQ)
			return src.Bytes(), dst.Bytes()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verbstest.CheckLeaks(t)
			src, dst := tc.run(t, crossPair(t, verbs.QPSpec{}))
			if !bytes.Equal(dst, src) {
				t.Errorf("the %d bytes that arrived differ from those sent", len(dst))
			}
		})
	}
}

// TestRegisterRefused checks the memory the server will not register:
// memory without a file descriptor (Go memory), and descriptors that are
// not memfds sealed at their size or are too small.
func TestRegisterRefused(t *testing.T) {
	p := startPeer(t)
	c := p.open(t)
	defer c.Close()
	pd, err := c.AllocPD()
	must(t, err)
	defer pd.Close()

	buf := make([]byte, 4096)
	if m, err := pd.Register(buf, verbs.AccessLocalWrite); err == nil {
		m.Close()
		t.Errorf("Register of Go memory in a peer process succeeded")
	} else if !errors.Is(err, verbs.ErrNotSupported) || !strings.Contains(err.Error(), "Go memory") {
		t.Errorf("Register of Go memory: %v, want an error wrapping ErrNotSupported that says why", err)
	}

	// Alloc works, and the refusals above left nothing behind.
	m, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	must(t, err)
	must(t, m.Close())

	// The same at the provider level, with descriptors of the wrong kind.
	pc, err := p.c.Open(verbs.SoftDevice)
	must(t, err)
	defer pc.Close()
	ppd, err := pc.AllocPD()
	must(t, err)
	defer ppd.Close()
	unsealed, err := os.CreateTemp(t.TempDir(), "mr")
	must(t, err)
	defer unsealed.Close()
	must(t, unsealed.Truncate(8192))
	r, w, err := os.Pipe()
	must(t, err)
	defer r.Close()
	defer w.Close()
	for _, tc := range []struct {
		name string
		mem  prov.Mem
		want error
	}{
		{"NoDescriptor", prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: len(buf), FD: -1}, prov.ErrNotSupported},
		{"UnsealedFile", prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: 4096, FD: int(unsealed.Fd())}, syscall.EINVAL},
		{"Pipe", prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: 4096, FD: int(w.Fd())}, syscall.EINVAL},
		{"PastTheEnd", prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: 4096, FD: m2fd(t), Offset: 4096}, syscall.EINVAL},
		{"Empty", prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: 0, FD: m2fd(t)}, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mr, err := ppd.RegMR(tc.mem, prov.AccessLocalWrite)
			if err == nil {
				mr.Close()
				t.Fatalf("RegMR succeeded")
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("RegMR: %v, want an error wrapping %v", err, tc.want)
			}
		})
	}
}

// TestInlineChecked checks that an inline send from side B is posted only
// if its SGEs lie in memory registered through B's context; otherwise it
// is refused with EINVAL, nothing of it is posted, and the QP stays usable.
func TestInlineChecked(t *testing.T) {
	for _, tc := range []struct {
		name string
		// sgl returns the inline SGEs and, if they are valid, the bytes
		// they name; mr is B's memory.
		sgl func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte)
	}{
		{"InsideMR", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{verbstest.SGE(t, mr, 100, 40)}, mr.Bytes()[100:140]
		}},
		{"WholeMR", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			small := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
			verbstest.Pattern(small.Bytes(), 8)
			return []verbs.SGE{small.All()}, small.Bytes()
		}},
		{"TwoMRs", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			other := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
			verbstest.Pattern(other.Bytes(), 9)
			return []verbs.SGE{verbstest.SGE(t, mr, 0, 10), verbstest.SGE(t, other, 5, 20)}, append(bytes.Clone(mr.Bytes()[:10]), other.Bytes()[5:25]...)
		}},
		{"AcrossMREnd", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{{Addr: mr.Addr() + uint64(mr.Len()) - 8, Length: 16, LKey: mr.LKey()}}, nil
		}},
		{"BeforeMRStart", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{{Addr: mr.Addr() - 8, Length: 16, LKey: mr.LKey()}}, nil
		}},
		{"GoMemoryOfThisProcess", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			buf := make([]byte, 32)
			return []verbs.SGE{{Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: 32}}, nil
		}},
		{"SideAMemory", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{verbstest.SGE(t, p.A.Alloc(t, 64, verbs.AccessLocalWrite), 0, 32)}, nil
		}},
		{"ClosedMR", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			m, err := p.B.PD.Alloc(64, verbs.AccessLocalWrite)
			must(t, err)
			sge := verbstest.SGE(t, m, 0, 32)
			must(t, m.Close())
			return []verbs.SGE{sge}, nil
		}},
		{"SecondSGEOutside", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{verbstest.SGE(t, mr, 0, 8), {Addr: mr.Addr() + uint64(mr.Len()), Length: 8}}, nil
		}},
		{"AddressWrapsAround", func(t *testing.T, p *verbstest.RCPair, mr *verbs.MemoryRegion) ([]verbs.SGE, []byte) {
			return []verbs.SGE{{Addr: ^uint64(0) - 3, Length: 8}}, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verbstest.CheckLeaks(t)
			p := crossPair(t, verbs.QPSpec{MaxInlineData: 64, MaxSendSGE: 2})
			mr := p.B.Alloc(t, 4096, verbs.AccessLocalWrite)
			verbstest.Pattern(mr.Bytes(), 7)
			rbuf := p.A.Alloc(t, 4096, verbs.AccessLocalWrite)
			must(t, p.QA.PostRecv(1, rbuf.All()))
			sgl, want := tc.sgl(t, p, mr)
			err := p.QB.PostSend(2, verbs.Signaled|verbs.Inline, sgl...)
			if want == nil {
				// The verbs layer checks inline SGEs before the
				// provider (the proxy, whose server checks them too)
				// sees them.
				if !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "inline") {
					t.Fatalf("inline send of %+v: %v, want EINVAL from the check of inline SGEs", sgl, err)
				}
				// Nothing was posted: the next send is the one received.
				must(t, p.QB.PostSend(2, verbs.Signaled|verbs.Inline, verbstest.SGE(t, mr, 0, 24)))
				want = mr.Bytes()[:24]
			} else {
				must(t, err)
			}
			want = bytes.Clone(want)
			// Inline data was copied at the post.
			clear(mr.Bytes())
			if wc := pollOne(t, p.B.CQ); wc.WRID != 2 {
				t.Errorf("send completion %v, want wr_id 2", wc)
			}
			wc := pollOne(t, p.A.CQ)
			if wc.WRID != 1 || int(wc.ByteLen) != len(want) || !bytes.Equal(rbuf.Bytes()[:len(want)], want) {
				t.Errorf("received %v (%q), want the %d inline bytes %q", wc, rbuf.Bytes()[:wc.ByteLen], len(want), want)
			}
		})
	}
}

// TestInlineBatch checks that in a batch whose second inline send names
// memory outside B's MRs, the first is posted and reported as such.
func TestInlineBatch(t *testing.T) {
	verbstest.CheckLeaks(t)
	p := crossPair(t, verbs.QPSpec{MaxInlineData: 64})
	mr := p.B.Alloc(t, 4096, verbs.AccessLocalWrite)
	verbstest.Pattern(mr.Bytes(), 3)
	want := bytes.Clone(mr.Bytes()[:16])
	rbuf := p.A.Alloc(t, 4096, verbs.AccessLocalWrite)
	must(t, p.QA.PostRecv(1, verbstest.SGE(t, rbuf, 0, 64)))
	must(t, p.QA.PostRecv(2, verbstest.SGE(t, rbuf, 64, 64)))
	b := p.QB.NewBatch(3)
	b.Send(10, verbstest.SGE(t, mr, 0, 16)).Inline().Signaled()
	b.Send(11, verbs.SGE{Addr: mr.Addr() + 4096, Length: 16}).Inline().Signaled()
	b.Send(12, verbstest.SGE(t, mr, 16, 16)).Inline().Signaled()
	err := b.Submit()
	var pe *verbs.PostError
	if !errors.As(err, &pe) || pe.Posted != 1 || !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Submit: %v, want a *PostError with Posted 1 wrapping EINVAL", err)
	}
	if wc := pollOne(t, p.B.CQ); wc.WRID != 10 {
		t.Errorf("send completion %v, want wr_id 10", wc)
	}
	wc := pollOne(t, p.A.CQ)
	if wc.WRID != 1 || wc.ByteLen != 16 || !bytes.Equal(rbuf.Bytes()[:16], want) {
		t.Errorf("received %v, want the first send's 16 bytes", wc)
	}
	// Nothing after the refused request was posted.
	var more [1]verbs.Completion
	if n, err := p.B.CQ.Poll(more[:]); n != 0 || err != nil {
		t.Errorf("poll after the refused request: %d, %v (%v); want nothing", n, err, more[0])
	}
}

// m2fd returns the descriptor of a new 4096-byte memfd sealed at its size.
func m2fd(t *testing.T) int {
	t.Helper()
	r, err := mem.Alloc(4096, "test", false)
	must(t, err)
	t.Cleanup(func() { r.Free() })
	return r.FD()
}
