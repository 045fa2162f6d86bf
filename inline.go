package verbs

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// Inline data and memory safety.
//
// A provider reads the payload of an inline request from its SGE
// addresses while the post runs, and libibverbs ignores the lkey of
// inline SGEs. So that no public API reads arbitrary memory, the verbs
// layer checks every inline SGE itself, for every provider, before the
// provider sees it: its lkey must name an open MR of the QP's protection
// domain, and its bytes must lie inside that MR. The MRs named are held
// open (inlineRef.use) until the provider has copied the payload, so a
// concurrent Close waits instead of unmapping memory a post is reading.
// The only other inline payloads a provider gets are those of SendInline
// and its kin: copies in a batch's own memory outside the Go heap, or,
// for the single-request helpers, the caller's bytes, pinned while the
// provider copies them.

// inlineRef is what the inline check needs of an MR. It lives in the
// PD's index (mrIndex) and never points back at the MemoryRegion, so the
// index does not keep a leaked MR reachable.
type inlineRef struct {
	lkey   uint32
	lo, hi uint64 // [Addr, Addr+Len) of the MR as its provider reads it
	keep   []byte // keeps the memory of a leaked MR (never closed) alive
	// pin is the Pinner of an MR of Go memory (Register), nil for other
	// MRs; while the MR is open, pinned holds this inlineRef.
	pin *runtime.Pinner

	// use is held for reading (TryRLock, never blocking) by every post
	// that reads inline data from the MR, and for writing by Close,
	// which therefore waits until those posts return and makes later
	// ones fail (dead).
	use  sync.RWMutex
	dead bool
}

// pinned holds the inlineRefs of the open MRs of Go memory (Register)
// until their Close, whatever becomes of the MR, its PD and its Context: a
// leaked MR's memory stays pinned and alive (the device may still write
// into it), and so does its Pinner, which the runtime would otherwise
// collect still pinning the memory, killing the process ("runtime.Pinner:
// found leaking pinned pointer"). The leak tracer reports such MRs.
var pinned = struct {
	sync.Mutex
	refs map[*inlineRef]struct{}
}{refs: map[*inlineRef]struct{}{}}

// keepPinned records p, which pins the MR's memory, and adds r to
// pinned.
func (r *inlineRef) keepPinned(p *runtime.Pinner) {
	r.pin = p
	pinned.Lock()
	pinned.refs[r] = struct{}{}
	pinned.Unlock()
}

// unpin unpins the MR's memory, if pinned, and removes r from pinned.
func (r *inlineRef) unpin() {
	if r.pin == nil {
		return
	}
	r.pin.Unpin()
	pinned.Lock()
	delete(pinned.refs, r)
	pinned.Unlock()
}

// acquire holds the MR open for a post; it fails if the MR is closed or
// being closed.
func (r *inlineRef) acquire() bool {
	if !r.use.TryRLock() {
		return false
	}
	if r.dead {
		r.use.RUnlock()
		return false
	}
	return true
}

// mrIndex finds the open MRs of a protection domain by lkey. Lookups
// (every post with inline SGEs) take no lock and do not allocate: they
// load the current table and probe its slots (open addressing, linear
// probing, at most half full). Insertions and removals (registration,
// Close) serialise on mu, update slots in place and replace the table
// only to grow it or purge removed entries.
type mrIndex struct {
	mu  sync.Mutex
	tab atomic.Pointer[mrTable]
}

type mrTable struct {
	slots []atomic.Pointer[inlineRef] // length a power of two
	shift uint                        // 32 - log2(len(slots))
	used  int                         // non-nil slots, live or removed (under mrIndex.mu)
	live  int                         // live entries (under mrIndex.mu)
}

// removedRef marks a slot whose entry was removed: probes go on past it.
var removedRef = new(inlineRef)

func newMRTable(n int) *mrTable {
	size, bits := 16, uint(4)
	for size < 4*n {
		size, bits = size*2, bits+1
	}
	return &mrTable{slots: make([]atomic.Pointer[inlineRef], size), shift: 32 - bits}
}

// home is the first slot probed for lkey (Fibonacci hashing: the low
// bits of hardware keys are a per-registration variant, the high bits an
// index; soft keys are random).
func (t *mrTable) home(lkey uint32) int { return int((lkey * 0x9E3779B1) >> t.shift) }

// lookup returns the open MR whose lkey is lkey, or nil.
func (x *mrIndex) lookup(lkey uint32) *inlineRef {
	t := x.tab.Load()
	if t == nil {
		return nil
	}
	mask := len(t.slots) - 1
	for i := t.home(lkey); ; i = (i + 1) & mask {
		r := t.slots[i].Load()
		if r == nil {
			return nil
		}
		if r != removedRef && r.lkey == lkey {
			return r
		}
	}
}

// insert adds r.
func (x *mrIndex) insert(r *inlineRef) {
	x.mu.Lock()
	defer x.mu.Unlock()
	t := x.tab.Load()
	if t == nil || 2*(t.used+1) > len(t.slots) {
		live := 0
		if t != nil {
			live = t.live
		}
		nt := newMRTable(live + 1)
		if t != nil {
			for i := range t.slots {
				if o := t.slots[i].Load(); o != nil && o != removedRef {
					nt.put(o)
				}
			}
		}
		x.tab.Store(nt)
		t = nt
	}
	t.put(r)
}

// put stores r in the first free or removed slot of its probe sequence.
// Called with mrIndex.mu held.
func (t *mrTable) put(r *inlineRef) {
	mask := len(t.slots) - 1
	for i := t.home(r.lkey); ; i = (i + 1) & mask {
		switch t.slots[i].Load() {
		case nil:
			t.used++
		case removedRef:
		default:
			continue
		}
		t.slots[i].Store(r)
		t.live++
		return
	}
}

// remove removes r, if it is in the index.
func (x *mrIndex) remove(r *inlineRef) {
	x.mu.Lock()
	defer x.mu.Unlock()
	t := x.tab.Load()
	if t == nil {
		return
	}
	mask := len(t.slots) - 1
	for i := t.home(r.lkey); ; i = (i + 1) & mask {
		switch t.slots[i].Load() {
		case nil:
			return
		case r:
			t.slots[i].Store(removedRef)
			t.live--
			return
		}
	}
}

// inlineHold is the set of MRs a post holds open while its provider
// reads their inline data. Its slice is reused: steady-state posts do
// not allocate.
type inlineHold struct{ refs []*inlineRef }

func (h *inlineHold) release() {
	for i, r := range h.refs {
		r.use.RUnlock()
		h.refs[i] = nil
	}
	h.refs = h.refs[:0]
}

var (
	errInlineOp = fmt.Errorf("inline is valid only for sends and writes: %w", syscall.EINVAL)
	errMRClosed = errors.New("is closed")
)

// checkInline checks the inline requests of wrs (their SGE lists index
// sges) in order, except those whose bit is set in own (payloads the
// batch staged itself): a send or a write, at most maxInline bytes, every
// SGE of non-zero length inside an open MR of pd, named by its lkey. The
// MRs named are held in h, which the caller releases once the provider
// has taken the requests. It returns len(wrs) and nil, or the index of
// the first request that fails and why (the MRs of the requests before
// it stay held).
func checkInline(pd *mrIndex, h *inlineHold, wrs []prov.SendWR, sges []prov.SGE, own []uint64, maxInline int) (int, error) {
	var last *inlineRef // held: cannot be closed under us
	for i := range wrs {
		wr := &wrs[i]
		if wr.Flags&prov.SendInline == 0 || (own != nil && own[i>>6]&(1<<(i&63)) != 0) {
			continue
		}
		switch wr.Opcode {
		case prov.WRSend, prov.WRSendImm, prov.WRWrite, prov.WRWriteImm:
		default:
			return i, errInlineOp
		}
		var total uint64
		for j, s := range sges[wr.SGEIndex : wr.SGEIndex+wr.NumSGE] {
			total += uint64(s.Length)
			if s.Length == 0 {
				continue
			}
			if last == nil || last.lkey != s.LKey {
				r := pd.lookup(s.LKey)
				if r == nil {
					return i, fmt.Errorf("inline SGE %d (%d bytes at %#x): lkey %#x names no open memory region of the queue pair's protection domain: %w",
						j, s.Length, s.Addr, s.LKey, syscall.EINVAL)
				}
				if !r.acquire() {
					return i, fmt.Errorf("inline SGE %d (%d bytes at %#x): the memory region of lkey %#x %w: %w",
						j, s.Length, s.Addr, s.LKey, errMRClosed, ErrClosed)
				}
				h.refs = append(h.refs, r)
				last = r
			}
			if s.Addr < last.lo || s.Addr > last.hi || uint64(s.Length) > last.hi-s.Addr {
				return i, fmt.Errorf("inline SGE %d (%d bytes at %#x) lies outside its memory region (lkey %#x, %d bytes at %#x): %w",
					j, s.Length, s.Addr, s.LKey, last.hi-last.lo, last.lo, syscall.EINVAL)
			}
		}
		if total > uint64(max(maxInline, 0)) {
			return i, fmt.Errorf("%d bytes inline, the queue pair allows %d (max_inline_data): %w", total, max(maxInline, 0), syscall.EINVAL)
		}
	}
	return len(wrs), nil
}
