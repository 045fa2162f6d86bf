package soft

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// TestShmRingWakeup plays ping-pong over the two rings of a segment, each
// consumer sleeping on its eventfd whenever its ring is empty (as the
// connection's reader does). A lost wake-up (the producer missed the
// sleeping flag while the consumer missed the new tail) stops the game:
// with the race detector on, plain stores made that happen within a few
// thousand rounds. The watchdog only guards against the hang.
func TestShmRingWakeup(t *testing.T) {
	dialer, acceptor := linkPair(t)
	defer closeLinks(dialer, acceptor)

	const rounds = 200000
	var progress, sink atomic.Uint64
	var stop atomic.Bool
	// recv takes one 8-byte message from l's inbound ring, sleeping while
	// it is empty.
	recv := func(l *shmLink) (uint64, bool) {
		var b [8]byte
		got := 0
		for got < len(b) {
			n, err := l.in.get(b[got:])
			if err != nil {
				t.Error(err)
				return 0, false
			}
			got += n
			if n > 0 {
				continue
			}
			if stop.Load() {
				return 0, false
			}
			if err := l.sleep(l.in.pos); err != nil {
				t.Error(err)
				return 0, false
			}
		}
		return binary.LittleEndian.Uint64(b[:]), true
	}
	send := func(l *shmLink, v uint64) {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], v)
		if n, err := l.tryWrite([][]byte{b[:]}); n != len(b) || err != nil {
			t.Errorf("write to the ring: %d bytes, %v", n, err)
		}
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the echo: it spins on its ring (then sleeps) and answers after a varying delay
		defer wg.Done()
		var b [8]byte
		spins := 0
		for i := range rounds {
			got := 0
			for got < len(b) {
				n, err := acceptor.in.get(b[got:])
				if err != nil {
					t.Error(err)
					return
				}
				got += n
				if stop.Load() {
					return
				}
				if n > 0 {
					spins = 0
				} else if spins++; spins > 64 {
					// Then it sleeps too (as the reader does,
					// waitRx): with GOMAXPROCS=1 (-cpu=1) the
					// other side, woken through the poller, ran
					// only when the spin was preempted, 10 ms or
					// more a round: the 200000 rounds outlasted the
					// 30 min timeout.
					if err := acceptor.sleep(acceptor.in.pos); err != nil {
						t.Error(err)
						return
					}
				}
			}
			for j := 0; j < (i*7919)%64; j++ {
				sink.Add(1)
			}
			send(acceptor, binary.LittleEndian.Uint64(b[:])+1)
		}
	}()
	done := make(chan struct{})
	go func() {
		defer wg.Done()
		defer close(done)
		for i := range uint64(rounds) {
			send(dialer, 2*i)
			v, ok := recv(dialer)
			if !ok {
				return
			}
			if v != 2*i+1 {
				t.Errorf("round %d: got %d, want %d", i, v, 2*i+1)
				return
			}
			progress.Store(i + 1)
		}
	}()
	last := uint64(0)
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-time.After(10 * time.Second):
			if p := progress.Load(); p != last {
				last = p
				continue
			}
			t.Errorf("no progress for 10 s after round %d of %d: a wake-up was lost (a consumer sleeps on a ring that holds a message)", last, rounds)
			stop.Store(true)
			dialer.signal()
			acceptor.signal()
			waiting = false
		}
	}
	wg.Wait()
}

// linkPair sets up the two sides of a shared-memory segment in this
// process, as a dialer and an acceptor would (closeLinks undoes it).
func linkPair(t *testing.T) (dialer, acceptor *shmLink) {
	t.Helper()
	fds, err := newShmFDs()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	dup := func(fd int) int {
		d, err := unix.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	// Ring 0 carries the dialer's frames, woken through fds[1]; ring 1
	// the acceptor's, through fds[2].
	if dialer, err = newShmLink(fds[0], fds[2], dup(fds[1]), true); err != nil {
		t.Fatal(err)
	}
	if acceptor, err = newShmLink(fds[0], fds[1], dup(fds[2]), false); err != nil {
		closeLinks(dialer)
		t.Fatal(err)
	}
	return dialer, acceptor
}

func closeLinks(links ...*shmLink) {
	for _, l := range links {
		l.close()
		l.unmap()
	}
}

// TestShmPopulateBudget: a process populates lapSkipAt of each ring for
// its first connections only (Budget in shm.go); past populateBudget a
// connection's rings lap at lapSkipMin and are not populated, and
// closing connections returns the budget's share. Before, every connection
// populated 2 × lapSkipAt: 520 KiB of memory for each of the 65 280
// connections of a 256-rank all-to-all.
func TestShmPopulateBudget(t *testing.T) {
	if !canPopulate() {
		t.Skip("the kernel cannot populate mappings (MADV_POPULATE_WRITE, Linux 5.14)")
	}
	// What the process' other connections (none, unless a test leaked
	// them) left of the budget, in links of two sides each.
	free := int((populateBudget - populated.Load()) / (2 * lapSkipAt))
	var full []*shmLink
	defer func() { closeLinks(full...) }()
	for range free / 2 {
		d, a := linkPair(t)
		full = append(full, d, a)
	}
	for i, l := range full {
		if l.out.skipAt != lapSkipAt || l.budget != 2*lapSkipAt {
			t.Fatalf("link %d of %d within the budget laps at %d, holds %d", i, len(full), l.out.skipAt, l.budget)
		}
	}
	d, a := linkPair(t)
	defer closeLinks(d, a)
	for _, l := range []*shmLink{d, a} {
		if l.out.skipAt != lapSkipMin || l.budget != 0 {
			t.Fatalf("a link past the budget laps at %d, holds %d", l.out.skipAt, l.budget)
		}
	}
	const page = 4096
	for r := range 2 {
		base := r*ringSize + ringHdr
		if n := residentPages(t, d.seg[base:base+ringCap]); n != 0 {
			t.Errorf("ring %d of a link past the budget: %d pages resident before any traffic, want 0", r, n)
		}
	}
	// Closing links returns their share: the next one laps at lapSkipAt.
	if len(full) == 0 {
		t.Fatal("the budget was spent before the test began")
	}
	closeLinks(full[len(full)-2:]...)
	full = full[:len(full)-2]
	d2, a2 := linkPair(t)
	defer closeLinks(d2, a2)
	if d2.out.skipAt != lapSkipAt {
		t.Errorf("after two links closed, a new one laps at %d, want %d", d2.out.skipAt, lapSkipAt)
	}
	// And a producer past the budget laps early: after 4 KiB messages
	// through lapSkipMin and more, one at a time, its ring uses no more
	// pages than lapSkipMin and the message that crossed it.
	msg := make([]byte, 4096)
	got := make([]byte, len(msg))
	for range 64 {
		if n, _, err := d.out.put([][]byte{msg}); err != nil || n != len(msg) {
			t.Fatalf("put %d, %v", n, err)
		}
		if n, err := a.in.get(got); err != nil || n != len(msg) {
			t.Fatalf("get %d, %v", n, err)
		}
	}
	if n, max := residentPages(t, d.seg[ringHdr:ringSize]), (lapSkipMin+len(msg))/page+1; n > max {
		t.Errorf("%d pages of a ring past the budget resident after 256 KiB of traffic, want at most %d", n, max)
	}
}

// canPopulate says whether the kernel populates mappings on request
// (MADV_POPULATE_WRITE, Linux 5.14).
func canPopulate() bool {
	probe, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		return false
	}
	defer unix.Munmap(probe)
	return unix.Madvise(probe, unix.MADV_POPULATE_WRITE) == nil
}

// TestShmRingWorkingSet: a shared-memory connection that carries small
// messages one at a time uses the first pages of its rings over and over
// (lapSkipAt of each, Laps in shm.go): after 16 MiB of 4 KiB writes, 4
// laps of a ring, few of the segment's pages are resident (mincore).
// Before, the rings walked through all their pages: all 2 × 1024 of
// them resident, a page fault each on the way.
func TestShmRingWorkingSet(t *testing.T) {
	forceTransport(t, "shm")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	const size, n = 4 << 10, 4096                        // 16 MiB
	src, dst := privMem(t, e, size), privMem(t, e, size) // not mappable: the data goes through the ring
	for i := range n {
		src.b[0] = byte(i)
		wr := []prov.SendWR{{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
			RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
		if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, size)}); err != nil {
			t.Fatal(err)
		}
		if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess || dst.b[0] != byte(i) {
			t.Fatalf("write %d: %+v, first byte %d", i, c, dst.b[0])
		}
	}
	c := a.qp.(*qp).x.rev.Load()
	if c == nil {
		c = b.qp.(*qp).x.rev.Load()
	}
	if c == nil || c.shm == nil {
		t.Fatal("no shared-memory connection")
	}
	const page = 4096
	for r := range 2 {
		resident := residentPages(t, c.shm.seg[r*ringSize+ringHdr:(r+1)*ringSize])
		// lapSkipAt, and the frame that crossed it.
		if max := (lapSkipAt+size)/page + 2; resident > max {
			t.Errorf("ring %d: %d of its %d pages resident after 16 MiB of traffic, want at most %d", r, resident, ringCap/page, max)
		}
	}
}

// residentPages counts the pages of b (page-aligned) that are resident
// (mincore).
func residentPages(t *testing.T, b []byte) int {
	t.Helper()
	vec := make([]byte, (len(b)+4095)/4096)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatalf("mincore: %v", errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// TestShmRingPrefaulted: the pages a ring of small messages uses over and
// over (its first skipAt bytes) are resident once the connection is
// up, faulted in at its set-up rather than one by one on the data path.
// Before, a connection that had carried one message had one page of
// each ring resident.
func TestShmRingPrefaulted(t *testing.T) {
	if !canPopulate() {
		t.Skip("the kernel cannot populate mappings (MADV_POPULATE_WRITE, Linux 5.14)")
	}
	forceTransport(t, "shm")
	e, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	src, dst := privMem(t, e, 8), privMem(t, e, 8)
	wr := []prov.SendWR{{Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled, RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
	if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, 8)}); err != nil {
		t.Fatal(err)
	}
	if c := spin(t, a.scq, 1)[0]; c.Status != prov.StatusSuccess {
		t.Fatalf("write: %+v", c)
	}
	c := a.qp.(*qp).x.rev.Load()
	if c == nil {
		c = b.qp.(*qp).x.rev.Load()
	}
	if c == nil || c.shm == nil {
		t.Fatal("no shared-memory connection")
	}
	if c.shm.budget == 0 {
		t.Fatalf("the connection is past the populate budget: %d bytes of it held by others", populated.Load())
	}
	for r := range 2 {
		base := r*ringSize + ringHdr
		skip := int(c.shm.out.skipAt)
		if n, want := residentPages(t, c.shm.seg[base:base+skip]), skip/4096; n < want {
			t.Errorf("ring %d: %d of its first %d pages resident", r, n, want)
		}
	}
}
