package session

// TEMPORARY stub (not committed): replaced by the allocator branch.

import (
	"fmt"

	"github.com/goverbs/verbs"
)

type AllocatorConfig struct {
	ArenaSize int
	MaxMemory int64
}

type Allocator struct{ pd *verbs.ProtectionDomain }

func NewAllocator(pd *verbs.ProtectionDomain, cfg AllocatorConfig) (*Allocator, error) {
	return &Allocator{pd: pd}, nil
}

type stubRegion struct {
	mr   *verbs.MemoryRegion
	n    int
	live bool
}

type LocalMR struct{ r *stubRegion }

func (a *Allocator) Alloc(n int) (LocalMR, error) {
	mr, err := a.pd.Alloc(max(n, 1), verbs.AccessLocalWrite)
	if err != nil {
		return LocalMR{}, err
	}
	return LocalMR{&stubRegion{mr: mr, n: n, live: true}}, nil
}
func (a *Allocator) Close() error                   { return nil }
func (a *Allocator) PD() *verbs.ProtectionDomain    { return a.pd }
func (m LocalMR) Valid() bool                       { return m.r != nil && m.r.live }
func (m LocalMR) Len() int                          { return m.r.n }
func (m LocalMR) Bytes() []byte                     { return m.r.mr.Bytes()[:m.r.n] }
func (m LocalMR) MemoryRegion() *verbs.MemoryRegion { return m.r.mr }
func (m LocalMR) Free() error                       { m.r.live = false; return m.r.mr.Close() }
func (m LocalMR) All() LocalSlice                   { return LocalSlice{m: m, n: m.r.n} }
func (m LocalMR) Slice(off, n int) (LocalSlice, error) {
	if off < 0 || n < 0 || off+n > m.r.n {
		return LocalSlice{}, fmt.Errorf("%w", ErrOutOfBounds)
	}
	return LocalSlice{m: m, off: off, n: n}, nil
}

type LocalSlice struct {
	m      LocalMR
	off, n int
}

func (s LocalSlice) Len() int      { return s.n }
func (s LocalSlice) MR() LocalMR   { return s.m }
func (s LocalSlice) Bytes() []byte { return s.m.Bytes()[s.off : s.off+s.n] }
func (s LocalSlice) SGE() verbs.SGE {
	mr := s.m.r.mr
	return verbs.SGE{Addr: mr.Addr() + uint64(s.off), Length: uint32(s.n), LKey: mr.LKey()}
}
func (s LocalSlice) Slice(off, n int) (LocalSlice, error) {
	if off < 0 || n < 0 || off+n > s.n {
		return LocalSlice{}, ErrOutOfBounds
	}
	return LocalSlice{m: s.m, off: s.off + off, n: n}, nil
}
