package soft

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// selfPull is a pullSrc reading this process (as a peer reads the
// requester), with a pidfd of it, and claim as its claim's word, which
// holds a new value when it returns.
func selfPull(t *testing.T, claim *atomic.Uint64, pieces ...[]byte) *pullSrc {
	t.Helper()
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Skipf("no pidfd on this kernel: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	ps := &pullSrc{pid: os.Getpid(), pidfd: fd, lost: new(atomic.Uint64), count: new(atomic.Uint64)}
	for _, p := range pieces {
		ps.remote[ps.n] = unix.RemoteIovec{Base: uintptr(unsafe.Pointer(unsafe.SliceData(p))), Len: len(p)}
		ps.n++
	}
	v := newClaim()
	claim.Store(v)
	ps.remote[ps.n] = unix.RemoteIovec{Base: uintptr(unsafe.Pointer(claim)), Len: 8}
	ps.claimed, ps.want = true, v
	var probe [8]byte
	local := []unix.Iovec{{Base: &probe[0]}}
	local[0].SetLen(8)
	remote := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&pullProbe[0])), Len: 8}}
	if _, err := unix.ProcessVMReadv(os.Getpid(), local, remote, 0); err != nil {
		t.Skipf("process_vm_readv is not allowed here: %v", err)
	}
	return ps
}

func spansOf(bufs ...[]byte) []span {
	var s []span
	for _, b := range bufs {
		s = append(s, span{unsafe.Pointer(unsafe.SliceData(b)), len(b)})
	}
	return s
}

// TestPullRead: the pieces of a pulled payload land in the destination's
// spans in order, from an offset on; a destination too short, an
// address that is not mapped, or a process that exited fails the read
// (and writes nothing past the destination).
func TestPullRead(t *testing.T) {
	a, b := bytes.Repeat([]byte{0xA1}, 5000), bytes.Repeat([]byte{0xB2}, 70000)
	want := append(append([]byte{}, a...), b...)
	for _, tc := range []struct {
		name string
		dst  []int // sizes of the destination's spans
		off  int
		ok   bool
	}{
		{"OneSpan", []int{75000}, 0, true},
		{"ThreeSpans", []int{4096, 100, 70804}, 0, true},
		{"Offset", []int{40, 75000}, 40, true},
		{"OffsetInsideASpan", []int{100, 74960}, 60, true},
		{"TooShort", []int{74999}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := selfPull(t, new(atomic.Uint64), a, b)
			var dst [][]byte
			for _, n := range tc.dst {
				dst = append(dst, bytes.Repeat([]byte{0xEE}, n+16)[:n])
			}
			res := pullFailed
			if tc.ok {
				res = pullRead
			}
			if got := ps.read(spansOf(dst...), tc.off); got != res {
				t.Fatalf("read = %v, want %v", got, res)
			}
			all := bytes.Join(dst, nil)
			if !tc.ok {
				if !bytes.Equal(all, bytes.Repeat([]byte{0xEE}, len(all))) {
					t.Errorf("a refused read wrote into the destination")
				}
				return
			}
			if !bytes.Equal(all[tc.off:], want) {
				t.Errorf("pulled bytes differ from the source")
			}
			for i, d := range dst {
				if tail := d[len(d) : len(d)+16]; !bytes.Equal(tail, bytes.Repeat([]byte{0xEE}, 16)) {
					t.Errorf("span %d: bytes past its end changed", i)
				}
			}
		})
	}
	t.Run("UnmappedPiece", func(t *testing.T) {
		m, err := unix.Mmap(-1, 0, 2*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
		if err := unix.MunmapPtr(unsafe.Pointer(&m[4096]), 4096); err != nil { // the second page goes
			t.Fatal(err)
		}
		ps := selfPull(t, new(atomic.Uint64), m[:8192])
		dst := make([]byte, 8192)
		if got := ps.read(spansOf(dst), 0); got != pullFailed {
			t.Errorf("a read of an unmapped page with its claim held = %v, want pullFailed", got)
		}
	})
	t.Run("ProcessExited", func(t *testing.T) {
		cmd := exec.Command("true")
		if err := cmd.Start(); err != nil {
			t.Skip(err)
		}
		fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
		if err != nil {
			t.Skipf("no pidfd: %v", err)
		}
		defer unix.Close(fd)
		if !peerLives(fd) {
			// It may already have ended; the check must say so below.
			t.Log("the child ended before the first look")
		}
		cmd.Wait()
		if peerLives(fd) {
			t.Errorf("peerLives of an exited process = true")
		}
		// A read without a claim (the probe's) from a process that is
		// gone is lost: its pid may be another's now.
		ps := selfPull(t, new(atomic.Uint64), a)
		ps.claimed = false
		ps.pidfd = fd // the data came from a process that is gone
		if got := ps.read(spansOf(make([]byte, len(a))), 0); got != pullLost {
			t.Errorf("a read without a claim from an exited requester = %v, want pullLost", got)
		}
		// A claimed read is the requester's whatever the pidfd says: its
		// claim's word, read in the same call, holds the requester's
		// value (another process at its pid would not: SlotReused in
		// TestPullClaims), so it looks at no pidfd.
		ps = selfPull(t, new(atomic.Uint64), a)
		ps.pidfd = fd
		if got := ps.read(spansOf(make([]byte, len(a))), 0); got != pullRead {
			t.Errorf("a claimed read whose claim holds = %v, want pullRead", got)
		}
	})
}

// TestPullClaims: a pulled payload counts only if the claim's word still
// holds its value after the payload was read; a word cleared (the request
// completed, a region closed) or holding another request's value loses
// it, even when its memory is gone by then, and is counted in
// LinkInfo.PullsLost.
func TestPullClaims(t *testing.T) {
	a := bytes.Repeat([]byte{0xA1}, 70000)
	for _, tc := range []struct {
		name  string
		touch func(w *atomic.Uint64) // before the read
		want  pullResult
	}{
		{"Held", func(*atomic.Uint64) {}, pullRead},
		{"LetGo", func(w *atomic.Uint64) { w.Store(0) }, pullLost},
		{"SlotReused", func(w *atomic.Uint64) { w.Store(newClaim()) }, pullLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := new(atomic.Uint64)
			ps := selfPull(t, w, a[:30000], a[30000:])
			tc.touch(w)
			dst := make([]byte, len(a))
			if got := ps.read(spansOf(dst), 0); got != tc.want {
				t.Fatalf("read = %v, want %v", got, tc.want)
			}
			if tc.want == pullRead && !bytes.Equal(dst, a) {
				t.Errorf("pulled bytes differ from the source")
			}
			wantLost, wantCount := uint64(0), uint64(1)
			if tc.want == pullLost {
				wantLost, wantCount = 1, 0
			}
			if ps.lost.Load() != wantLost || ps.count.Load() != wantCount {
				t.Errorf("pulled %d, lost %d; want %d, %d", ps.count.Load(), ps.lost.Load(), wantCount, wantLost)
			}
		})
	}
	t.Run("UnmappedAfterLetGo", func(t *testing.T) {
		m, err := unix.Mmap(-1, 0, 2*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		w := new(atomic.Uint64)
		ps := selfPull(t, w, m)
		w.Store(0)
		if err := unix.Munmap(m); err != nil {
			t.Fatal(err)
		}
		if got := ps.read(spansOf(make([]byte, 8192)), 0); got != pullLost {
			t.Errorf("read of a let-go request whose memory is gone = %v, want pullLost", got)
		}
	})
}

// TestClaimWords: pullPieces gives a request's slot a new claim and lists
// it with each of its regions (once); leave clears the claim and the
// lists; closing a region clears the claims of the requests in flight
// from it.
func TestClaimWords(t *testing.T) {
	e := newEnv(t)
	b1, b2 := e.alloc(4096, prov.AccessLocalWrite), e.alloc(4096, prov.AccessLocalWrite)
	m1, m2 := b1.mr.(*mr), b2.mr.(*mr)
	if m1.live.Load() == 0 || m1.live.Load() == m2.live.Load() {
		t.Errorf("regions' words %#x, %#x: want two values, not 0", m1.live.Load(), m2.live.Load())
	}
	var x xstate
	w, w2 := &sendWQE{}, &sendWQE{}
	x.pullPieces(w, spansOf(b1.b[:100], b2.b, b1.b[200:300]), []*mr{m1, m2, m1})
	v := w.claim.Load()
	if v == 0 || !w.pulled {
		t.Fatalf("pullPieces left claim %#x, pulled %v", v, w.pulled)
	}
	if got := binary.LittleEndian.Uint64(x.pullBuf[8:]); got != v {
		t.Errorf("the request carries claim %#x, the slot holds %#x", got, v)
	}
	if len(m1.pulls) != 1 || len(m2.pulls) != 1 || len(w.pmrs) != 2 {
		t.Errorf("listed %d and %d times by its regions, lists %d regions; want 1, 1, 2", len(m1.pulls), len(m2.pulls), len(w.pmrs))
	}
	w.leave()
	if w.claim.Load() != 0 || w.pulled || len(m1.pulls)+len(m2.pulls)+len(w.pmrs) != 0 {
		t.Errorf("after leave: claim %#x, pulled %v, lists %d %d %d", w.claim.Load(), w.pulled, len(m1.pulls), len(m2.pulls), len(w.pmrs))
	}

	x.pullPieces(w, spansOf(b1.b), []*mr{m1})
	x.pullPieces(w2, spansOf(b2.b), []*mr{m2})
	if err := b1.mr.Close(); err != nil {
		t.Fatal(err)
	}
	if w.claim.Load() != 0 || m1.live.Load() != 0 {
		t.Errorf("after Close: the claim of a request from the region %#x, the region's word %#x; want 0, 0", w.claim.Load(), m1.live.Load())
	}
	if w2.claim.Load() == 0 {
		t.Errorf("closing another region cleared a request's claim")
	}
	w.leave()
	w2.leave()
}

// TestParsePull: the pieces must cover the message exactly, lie in the
// address space, and come on a connection that offered pulling.
func TestParsePull(t *testing.T) {
	le := binary.LittleEndian
	piece := func(a, n uint64) []byte {
		var b [pullDesc]byte
		le.PutUint64(b[:], a)
		le.PutUint64(b[8:], n)
		return b[:]
	}
	head := func(a, v uint64, pieces ...[]byte) []byte {
		var b [pullHead]byte
		le.PutUint64(b[:], a)
		le.PutUint64(b[8:], v)
		return append(b[:], bytes.Join(pieces, nil)...)
	}
	claimed := func(pieces ...[]byte) []byte { return head(0x9000, 55, pieces...) }
	for _, tc := range []struct {
		name   string
		pieces []byte
		length uint32
		served bool
		ok     bool
	}{
		{"Exact", claimed(piece(0x10000, 100), piece(0x20000, 28)), 128, true, true},
		{"NotOffered", claimed(piece(0x10000, 128)), 128, false, false},
		{"Short", claimed(piece(0x10000, 100)), 128, true, false},
		{"Long", claimed(piece(0x10000, 200)), 128, true, false},
		{"EmptyPiece", claimed(piece(0x10000, 0), piece(0x20000, 128)), 128, true, false},
		{"Wraps", claimed(piece(^uint64(0)-10, 128)), 128, true, false},
		{"NoPieces", claimed(), 128, true, false},
		{"NoClaim", piece(0x10000, 128), 128, true, false},
		{"ClaimValueZero", head(0x9000, 0, piece(0x10000, 128)), 128, true, false},
		{"ClaimMisaligned", head(0x9004, 55, piece(0x10000, 128)), 128, true, false},
		{"ClaimAtZero", head(0, 55, piece(0x10000, 128)), 128, true, false},
		{"TornPiece", claimed(piece(0x10000, 128))[:pullHead+pullDesc-8], 128, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &conn{pidfd: 3}
			c.pullServed.Store(tc.served)
			_, err := c.parsePull(spansOf(tc.pieces), len(tc.pieces), tc.length)
			if (err == nil) != tc.ok {
				t.Errorf("parsePull: %v, want ok %v", err, tc.ok)
			}
		})
	}
}

// TestDeliverPulled: the answer to a read that offered to pull names the
// data in the target's memory and its region's claim: the requester reads
// it into the read's local pieces (this process stands for the target);
// a region closed before the read fails it with REM_ACCESS_ERR; an answer
// to a read that did not offer to pull is malformed.
func TestDeliverPulled(t *testing.T) {
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Skipf("no pidfd on this kernel: %v", err)
	}
	defer unix.Close(fd)
	for _, tc := range []struct {
		name  string
		offer bool
		close bool
		want  prov.Status
	}{
		{"Read", true, false, prov.StatusSuccess},
		{"RegionClosed", true, true, prov.StatusRemAccessErr},
		{"NotOffered", false, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			q := e.newQP(prov.QPTypeRC, defaultCaps(), nil).qp.(*qp)
			const n = 3 * 4096
			target := e.alloc(n, prov.AccessLocalWrite|prov.AccessRemoteRead)
			for i := range target.b {
				target.b[i] = byte(i * 7)
			}
			local := e.alloc(n+100, prov.AccessLocalWrite)
			m := target.mr.(*mr)
			c := &conn{peerPID: uint32(os.Getpid()), pidfd: fd}
			w := &sendWQE{sge: []prov.SGE{local.sge(0, 1000), local.sge(1100, n-1000)}}
			w.wr.NumSGE = 2
			q.x.addRead(w, c, 9, n, tc.offer)
			var d [pulledReadLen]byte
			le := binary.LittleEndian
			le.PutUint64(d[:], uint64(uintptr(m.base)))
			le.PutUint64(d[8:], uint64(uintptr(unsafe.Pointer(&m.live))))
			le.PutUint64(d[16:], m.live.Load())
			if tc.close {
				if err := target.mr.Close(); err != nil {
					t.Fatal(err)
				}
			}
			err := q.deliverPulled(c, 9, spansOf(d[:]))
			if !tc.offer {
				if !errors.Is(err, errBadResp) {
					t.Fatalf("deliverPulled for a read that did not offer to pull: %v, want errBadResp", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			rd := q.x.dropRead(w)
			if rd.st != tc.want || rd.got != n || !rd.done {
				t.Fatalf("read: status %v, %d bytes, done %v; want %v, %d, true", rd.st, rd.got, rd.done, tc.want, n)
			}
			if tc.want == prov.StatusSuccess {
				got := append(append([]byte{}, local.b[:1000]...), local.b[1100:n+100]...)
				if !bytes.Equal(got, target.b) {
					t.Errorf("the read's local pieces differ from the target's bytes")
				}
			}
		})
	}
}

// TestSRQGiveBack: a receive taken from an SRQ for a pulled message
// whose claim was lost goes back to the SRQ's front (the oldest again,
// with its SGEs), also when the ring must grow for it; a full SRQ
// refuses it.
func TestSRQGiveBack(t *testing.T) {
	e := newEnv(t)
	p, err := e.pd.CreateSRQ(prov.SRQAttr{MaxWR: 16, MaxSGE: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	s := p.(*srq)
	post := func(wrids ...uint64) {
		t.Helper()
		for _, id := range wrids {
			sg := []prov.SGE{{Addr: id * 100, Length: uint32(id), LKey: 7}, {Addr: id * 1000, Length: 1, LKey: 8}}
			if _, err := s.PostRecv([]prov.RecvWR{{WRID: id, NumSGE: 2}}, sg); err != nil {
				t.Fatal(err)
			}
		}
	}
	var buf [2]prov.SGE
	take := func(want uint64) []prov.SGE {
		t.Helper()
		id, sg, ok := s.take(buf[:], nil)
		if !ok || id != want || len(sg) != 2 || sg[0].Addr != want*100 || sg[1].Addr != want*1000 {
			t.Fatalf("take: %d %v %v, want wr_id %d and its SGEs", id, sg, ok, want)
		}
		return append([]prov.SGE(nil), sg...)
	}
	post(1, 2, 3, 4) // the ring's first 4 slots
	sg := take(1)
	post(5) // the ring is full again: giving back grows it
	if !s.giveBack(1, sg) {
		t.Fatal("giveBack refused with room")
	}
	for _, id := range []uint64{1, 2, 3, 4, 5} {
		take(id)
	}
	post(11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26)
	sg = take(11)
	post(27) // full: 16 of 16
	if s.giveBack(11, sg) {
		t.Error("giveBack to a full SRQ succeeded")
	}
}
