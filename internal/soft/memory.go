package soft

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// span is a resolved, bounds-checked piece of memory.
type span struct {
	p unsafe.Pointer
	n int
}

func (s span) bytes() []byte { return unsafe.Slice((*byte)(s.p), s.n) }

// copySpans copies min(len(dst)-off, len(src)) bytes from the gather list
// src into the scatter list dst, starting off bytes into dst. It returns the
// number of bytes copied.
func copySpans(dst []span, off int, src []span) int {
	di, doff := 0, off
	for di < len(dst) && doff >= dst[di].n {
		doff -= dst[di].n
		di++
	}
	si, soff, total := 0, 0, 0
	for di < len(dst) && si < len(src) {
		d, s := dst[di], src[si]
		n := dmaCopy(unsafe.Slice((*byte)(unsafe.Add(d.p, doff)), d.n-doff),
			unsafe.Slice((*byte)(unsafe.Add(s.p, soff)), s.n-soff))
		total += n
		doff += n
		soff += n
		if doff == d.n {
			di, doff = di+1, 0
		}
		if soff == s.n {
			si, soff = si+1, 0
		}
	}
	return total
}

// userBytes returns the n bytes at the virtual address addr. It is used only
// for inline data, which verbs reads from the SGE addresses without an lkey
// check while PostSend runs; the caller of PostSend guarantees that the
// memory is valid (non-Go or heap/pinned memory) for the duration of the
// call. The address is reinterpreted, not converted, so that it is never
// treated as the result of pointer arithmetic.
func userBytes(addr uint64, n int) []byte {
	u := uintptr(addr)
	p := *(*unsafe.Pointer)(unsafe.Pointer(&u))
	return unsafe.Slice((*byte)(p), n)
}

// mr is a registered memory region.
type mr struct {
	pd     *pd
	base   unsafe.Pointer
	addr   uint64 // virtual address of base (iova)
	length uint64
	access prov.Access
	key    uint32 // lkey == rkey
	serial uint64 // unique in the process (shm.go tells regions apart by it)
	fd     int
	off    int64

	// mu is held for reading by every access in flight (TryRLock, never
	// blocking) and for writing by Close, which therefore waits until no
	// operation touches the memory and makes later accesses fail.
	mu     sync.RWMutex
	dead   bool
	closed atomic.Bool
	// The pulled requests in flight that read from the region (cma.go):
	// Close clears their claims.
	pullMu sync.Mutex
	pulls  []*sendWQE
	// live holds a claim value until Close: a peer that pulls the data of
	// an RDMA read reads it after the data (cma.go).
	live atomic.Uint64
}

// acquire checks that [addr, addr+n) lies inside the region and pins the
// region against Close; it returns the memory's address. n must be > 0.
// On success the caller must call release.
func (m *mr) acquire(addr, n uint64) (unsafe.Pointer, bool) {
	if addr < m.addr || n > m.length || addr-m.addr > m.length-n {
		return nil, false
	}
	if !m.mu.TryRLock() {
		return nil, false // being closed
	}
	if m.dead {
		m.mu.RUnlock()
		return nil, false
	}
	return unsafe.Add(m.base, addr-m.addr), true
}

func (m *mr) release() { m.mu.RUnlock() }

func (m *mr) Addr() uint64 { return m.addr }
func (m *mr) Len() int     { return int(m.length) }
func (m *mr) LKey() uint32 { return m.key }
func (m *mr) RKey() uint32 { return m.key }

// Close deregisters the region. It waits for operations that are copying
// to or from the region right now; later operations fail (LOC_PROT_ERR
// locally, REM_ACCESS_ERR remotely).
func (m *mr) Close() error {
	if !m.closed.CompareAndSwap(false, true) {
		return nil
	}
	m.pd.ctx.f.removeMR(m)
	m.mu.Lock()
	m.dead = true
	m.live.Store(0)
	m.mu.Unlock()
	m.dropPulls()
	m.pd.release(&m.pd.nmr)
	return nil
}
