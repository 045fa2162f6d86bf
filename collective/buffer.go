package collective

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/goverbs/verbs"
)

// ErrBufferBusy is returned by Buffer.Close while a call uses the buffer.
var ErrBufferBusy = errors.New("collective: buffer in use by a call")

// zeroCopyMin is the length from which a message whose data lies in a
// Buffer is sent from there: below it the copy into the staging slots
// costs less than the wait at the end of the step (run) for the writes
// reading the caller's memory.
const zeroCopyMin = 64 << 10

// Buffer is memory for the data of collectives, registered once with the
// protection domain of the communicator that allocated it (Alloc). A
// call whose data to send lies in a Buffer (Slice, or any part of it)
// sends it from there, in place: the RDMA writes read the caller's
// memory, where data in other memory is first copied into the
// communicator's registered staging slots, chunk by chunk. A ring
// allreduce whose vector lies in a Buffer also receives in place: the
// neighbour that sends it the allgather's blocks writes them straight
// into the Buffer (so a Buffer is registered for remote writes and
// reads; its key goes to that neighbour only, for the call). The results
// are the same either way; only the copies differ.
//
// Every communicator made from the allocating one (Split, Dup, and
// theirs) uses the buffer in the same way.
//
// A call that sends from a Buffer returns once the writes reading it
// have been executed: the caller may then change the memory. Close the
// Buffer when no call uses it any more (Close fails with ErrBufferBusy
// while one does); its memory must not be used after Close. A Buffer is
// safe for concurrent use by the communicators' calls; its elements are
// the caller's to synchronise, as those of any slice.
type Buffer[T Number] struct {
	set  *bufSet
	reg  *registered
	data []T
}

// Alloc returns a Buffer of n elements of T, zeroed, registered with c's
// protection domain.
func Alloc[T Number](c *Comm, n int) (*Buffer[T], error) {
	var z T
	esz := int(unsafe.Sizeof(z))
	if n < 0 || n > (1<<40)/esz {
		return nil, fmt.Errorf("%w: Alloc of %d elements", ErrArgs, n)
	}
	if c.ranks == nil {
		return nil, fmt.Errorf("collective: alloc: %w", errZeroComm)
	}
	// Remote write: a peer's ring allreduce writes its results straight
	// into the buffer (land.go); remote read: soft0 then maps the region
	// into a peer process on the host and copies into it directly.
	m, err := c.node.PD().Alloc(max(n*esz, 1), verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead)
	if err != nil {
		return nil, fmt.Errorf("collective: alloc %d bytes: %w", n*esz, err)
	}
	b := m.Bytes()
	reg := &registered{mr: m, base: uintptr(unsafe.Pointer(unsafe.SliceData(b))), n: uintptr(len(b))}
	c.bufs.add(reg)
	return &Buffer[T]{set: c.bufs, reg: reg, data: unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n)}, nil
}

// Slice returns the buffer's elements (nil after Close).
func (b *Buffer[T]) Slice() []T { return b.data }

// Close deregisters the buffer and frees its memory. It fails with
// ErrBufferBusy while a call whose send or receive slice lies in it is
// in progress: from its issue (a blocking call's start, a non-blocking
// twin's return), waiting for its turn included, until it returns or its
// Request completes. Closing twice is harmless.
func (b *Buffer[T]) Close() error {
	if b.reg == nil {
		return nil
	}
	if err := b.set.remove(b.reg); err != nil {
		return err
	}
	m := b.reg.mr
	b.reg, b.data = nil, nil
	return m.Close()
}

// registered is the region of a Buffer.
type registered struct {
	mr    *verbs.MemoryRegion
	base  uintptr
	n     uintptr
	users atomic.Int32 // steps sending from it (run)
}

// bufSet is the Buffers of a communicator and of those made from it.
type bufSet struct {
	mu   sync.Mutex
	regs []*registered
	n    atomic.Int32 // len(regs)
}

func (s *bufSet) add(r *registered) {
	s.mu.Lock()
	s.regs = append(s.regs, r)
	s.n.Add(1)
	s.mu.Unlock()
}

// callHold is what a call holds of the Buffers its slices lie in (at
// most two: send and recv), from its begin to its end, or a non-blocking
// request from its issue to its completion (start).
type callHold struct {
	regs [2]*registered
	n    int
}

// holdCall counts the call as a user of the Buffers bs lie in, into h
// (without allocating, and without a lock where no Buffer exists).
func (s *bufSet) holdCall(h *callHold, bs ...[]byte) {
	if s.n.Load() == 0 {
		return
	}
	for _, b := range bs {
		if h.n == len(h.regs) {
			return
		}
		if r, _ := s.use(b); r != nil {
			h.regs[h.n] = r
			h.n++
		}
	}
}

// release ends the uses of h.
func (h *callHold) release() {
	for i := range h.n {
		h.regs[i].users.Add(-1)
		h.regs[i] = nil
	}
	h.n = 0
}

func (s *bufSet) remove(r *registered) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r.users.Load() > 0 {
		return ErrBufferBusy
	}
	for i, x := range s.regs {
		if x == r {
			s.regs[i] = s.regs[len(s.regs)-1]
			s.regs[len(s.regs)-1] = nil
			s.regs = s.regs[:len(s.regs)-1]
			s.n.Add(-1)
			break
		}
	}
	return nil
}

// use returns the registered region that holds all of b, counting one
// more user of it, and the offset of b in it; nil if none does.
func (s *bufSet) use(b []byte) (*registered, int) {
	if len(b) == 0 {
		return nil, 0
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.regs {
		if p >= r.base && p-r.base < r.n && uintptr(len(b)) <= r.n-(p-r.base) {
			r.users.Add(1)
			return r, int(p - r.base)
		}
	}
	return nil, 0
}
