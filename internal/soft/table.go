package soft

import (
	"sync/atomic"
)

// table maps a 24-bit index to an object with lock-free lookups. It is two
// levels of 4096 atomic pointers; second-level chunks are allocated on first
// store. Stores must be serialised by the caller.
type table[T any] struct {
	chunks [tblChunkSize]atomic.Pointer[tableChunk[T]]
}

const (
	tblChunkBits = 12
	tblChunkSize = 1 << tblChunkBits
	tblIndexBits = 2 * tblChunkBits // 24
)

type tableChunk[T any] [tblChunkSize]atomic.Pointer[T]

func (t *table[T]) load(i uint32) *T {
	if i >= 1<<tblIndexBits {
		return nil
	}
	c := t.chunks[i>>tblChunkBits].Load()
	if c == nil {
		return nil
	}
	return c[i&(tblChunkSize-1)].Load()
}

func (t *table[T]) store(i uint32, v *T) {
	c := t.chunks[i>>tblChunkBits].Load()
	if c == nil {
		if v == nil {
			return
		}
		c = new(tableChunk[T])
		t.chunks[i>>tblChunkBits].Store(c)
	}
	c[i&(tblChunkSize-1)].Store(v)
}

// indexPool hands out indexes below limit, reusing freed ones in FIFO order
// (so that a freed index, and the key derived from it, is reused as late as
// possible). Not safe for concurrent use.
type indexPool struct {
	next  uint32
	limit uint32
	free  []uint32
	head  int
}

func (p *indexPool) get() (uint32, bool) {
	// Prefer fresh indexes until a quarter of the space is used; then
	// recycle, oldest first.
	if p.next < p.limit && (p.head == len(p.free) || p.next < p.limit/4) {
		i := p.next
		p.next++
		return i, true
	}
	if p.head < len(p.free) {
		i := p.free[p.head]
		p.head++
		if p.head == len(p.free) {
			p.free, p.head = p.free[:0], 0
		} else if p.head > 1024 && p.head*2 > len(p.free) {
			n := copy(p.free, p.free[p.head:])
			p.free, p.head = p.free[:n], 0
		}
		return i, true
	}
	return 0, false
}

func (p *indexPool) put(i uint32) { p.free = append(p.free, i) }

// perm32 is a keyed permutation of 32-bit values (a small Feistel network).
// Memory keys are the permutation of (generation, index): unique while the
// index is live, unpredictable without the random round keys, and mapped
// back to their table slot without a search.
type perm32 struct{ k [6]uint32 }

func (p *perm32) f(r uint16, k uint32) uint16 {
	x := uint32(r)*0x9e3779b1 ^ k
	x ^= x >> 15
	x *= 0x85ebca77
	x ^= x >> 13
	x *= 0xc2b2ae3d
	x ^= x >> 16
	return uint16(x)
}

func (p *perm32) encrypt(v uint32) uint32 {
	l, r := uint16(v>>16), uint16(v)
	for i := range p.k {
		l, r = r, l^p.f(r, p.k[i])
	}
	return uint32(l)<<16 | uint32(r)
}

func (p *perm32) decrypt(v uint32) uint32 {
	l, r := uint16(v>>16), uint16(v)
	for i := len(p.k) - 1; i >= 0; i-- {
		l, r = r^p.f(l, p.k[i]), l
	}
	return uint32(l)<<16 | uint32(r)
}
