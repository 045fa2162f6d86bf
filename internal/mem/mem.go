// Package mem allocates page-aligned memory outside the Go heap, backed by a
// memfd so that another process may map the same pages.
package mem

import (
	"bytes"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Seals are the seals of a Region's memfd: its size is fixed for good.
const Seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// Sealed reports whether fd is a memfd whose size can never change.
func Sealed(fd int) bool {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	return err == nil && seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW) == unix.F_SEAL_SHRINK|unix.F_SEAL_GROW
}

// Region is an anonymous shared mapping of a memfd.
type Region struct {
	b    []byte
	full []byte // the whole mapping (whole pages)
	fd   int

	owner any // guarded by live.mu
}

// live holds the regions mapped and not yet freed, for Overlapping: a
// mapping belongs to the whole process, and so does the question which
// region an address lies in (memory from one device context may be
// registered with another).
var live struct {
	mu sync.Mutex
	rs map[*Region]struct{}
}

// PageSize is the system page size.
var PageSize = os.Getpagesize()

// RoundUp rounds n up to a multiple of the page size.
func RoundUp(n int) int { return (n + PageSize - 1) &^ (PageSize - 1) }

// Alloc maps n bytes (rounded up to whole pages) of zeroed memory, backed
// by a memfd sealed at that size (Seals). With
// dontfork, the mapping is not inherited by child processes (MADV_DONTFORK,
// required by RDMA hardware). The returned slice has length n.
func Alloc(n int, name string, dontfork bool) (*Region, error) {
	if n <= 0 {
		return nil, fmt.Errorf("allocate %d bytes: %w", n, unix.EINVAL)
	}
	size := RoundUp(n)
	fd, err := unix.MemfdCreate("goverbs:"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate memfd to %d bytes: %w", size, err)
	}
	// Sealed at its size: whoever holds the descriptor (a peer process
	// the memory is shared with) cannot truncate it under a mapping,
	// which would make accesses to the lost pages fault.
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Seals); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("seal memfd: %w", err)
	}
	b, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
	}
	if dontfork {
		if err := unix.Madvise(b, unix.MADV_DONTFORK); err != nil {
			unix.Munmap(b)
			unix.Close(fd)
			return nil, fmt.Errorf("madvise(MADV_DONTFORK): %w", err)
		}
	}
	r := &Region{b: b[:n:n], full: b, fd: fd}
	live.mu.Lock()
	if live.rs == nil {
		live.rs = make(map[*Region]struct{})
	}
	live.rs[r] = struct{}{}
	live.mu.Unlock()
	return r, nil
}

// Mappings counts this process' mappings of the module's memfds: regions
// ("goverbs:NAME") and the soft provider's shared-memory links
// ("goverbs-soft-link"), its own and those mapped from peer processes, as
// /proc/self/maps lists them. Tests use it to check that nothing is left
// mapped.
func Mappings() (int, error) {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0, err
	}
	return bytes.Count(b, []byte("/memfd:goverbs")), nil
}

// Overlapping returns the live regions whose mapping overlaps the n bytes
// at p (none for memory that no region maps, such as Go memory). The
// regions may be freed at any time after it returns; callers that must
// keep one mapped arrange it with the region's owner.
func Overlapping(p unsafe.Pointer, n int) []*Region {
	lo := uintptr(p)
	hi := lo + uintptr(n)
	live.mu.Lock()
	defer live.mu.Unlock()
	var rs []*Region
	for r := range live.rs {
		start := uintptr(unsafe.Pointer(unsafe.SliceData(r.full)))
		if lo < start+uintptr(len(r.full)) && start < hi {
			rs = append(rs, r)
		}
	}
	return rs
}

// Offset returns the offset in the region's memfd of the n bytes at p, and
// whether the region maps all of them.
func (r *Region) Offset(p unsafe.Pointer, n int) (int64, bool) {
	start := uintptr(unsafe.Pointer(unsafe.SliceData(r.full)))
	lo := uintptr(p)
	if n < 0 || lo < start || lo-start > uintptr(len(r.full)) || uintptr(n) > uintptr(len(r.full))-(lo-start) {
		return 0, false
	}
	return int64(lo - start), true
}

// SetOwner records what owns the region (for the verbs package, the
// lifetime of the memory region whose memory it is), for Owner.
func (r *Region) SetOwner(v any) {
	live.mu.Lock()
	r.owner = v
	live.mu.Unlock()
}

// Owner returns what SetOwner recorded, or nil.
func (r *Region) Owner() any {
	live.mu.Lock()
	defer live.mu.Unlock()
	return r.owner
}

// Bytes returns the memory.
func (r *Region) Bytes() []byte { return r.b }

// Ptr returns the start address.
func (r *Region) Ptr() unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(r.b)) }

// FD returns the memfd backing the region.
func (r *Region) FD() int { return r.fd }

// Free unmaps the memory and closes the memfd.
func (r *Region) Free() error {
	if r.b == nil {
		return nil
	}
	live.mu.Lock()
	delete(live.rs, r)
	live.mu.Unlock()
	b := r.full
	r.b, r.full = nil, nil
	err := unix.Munmap(b)
	if cerr := unix.Close(r.fd); err == nil {
		err = cerr
	}
	return err
}
