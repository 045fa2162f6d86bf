package verbs

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"runtime"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// ProtectionDomain groups memory regions, queue pairs, SRQs and address
// handles: a QP can use only memory registered in its own PD. It is safe
// for concurrent use.
type ProtectionDomain struct {
	res resource
	c   *Context
	pd  prov.PD
	mrs mrIndex // open MRs by lkey, for the inline check of posts
}

// AllocPD allocates a protection domain.
func (c *Context) AllocPD() (*ProtectionDomain, error) {
	if !c.res.enter() {
		return nil, c.res.errClosed("allocate pd")
	}
	defer c.res.exit()
	p, err := c.ctx.AllocPD()
	if err != nil {
		return nil, opErr("allocate pd", c.name, err)
	}
	pd := &ProtectionDomain{c: c, pd: p}
	if err := initResource(pd, &pd.res, "protection domain", "", &c.res); err != nil {
		p.Close()
		return nil, err
	}
	return pd, nil
}

// Context returns the device context of the PD.
func (pd *ProtectionDomain) Context() *Context { return pd.c }

// Close frees the PD. It fails, naming them, while objects created in the
// PD are open. Close is idempotent.
func (pd *ProtectionDomain) Close() error {
	return pd.res.close(func() error { return opErr("deallocate pd", pd.c.name, pd.pd.Close()) })
}

func (pd *ProtectionDomain) check(op string) error {
	if pd.res.isClosed() {
		return pd.res.errClosed(op)
	}
	return nil
}

// MemoryRegion is registered memory. Local work requests name it with
// SGE values (lkey); peers name it with Remote (rkey). It is safe for
// concurrent use; the bytes themselves are shared with the device, so the
// program must not touch a buffer while a work request that uses it is
// outstanding (the usual verbs contract).
type MemoryRegion struct {
	res    resource
	pd     *ProtectionDomain
	mr     prov.MR
	access Access
	buf    []byte      // nil for dma-buf
	region *mem.Region // owned memory (Alloc)
	mapped bool        // Register of memory from Alloc: unmapped with it
	inl    *inlineRef  // in pd.mrs while open; nil for dma-buf; its pin pins buf (Register)

	// The keys and range, read from the provider's MR at registration:
	// the accessors must not read it after Close, which frees it (on
	// hardware the struct ibv_mr they live in).
	addr       uint64
	length     int
	lkey, rkey uint32
}

// newMR returns the MemoryRegion of pm.
func newMR(pd *ProtectionDomain, pm prov.MR, access Access, buf []byte) *MemoryRegion {
	return &MemoryRegion{pd: pd, mr: pm, access: access, buf: buf,
		addr: pm.Addr(), length: pm.Len(), lkey: pm.LKey(), rkey: pm.RKey()}
}

// Alloc allocates n bytes of zeroed, page-aligned memory outside the Go heap
// (a memfd mapping, not inherited by child processes) and registers it.
// The MR owns the memory: Close unmaps it, so the slice from Bytes must not
// be used afterwards.
func (pd *ProtectionDomain) Alloc(n int, access Access) (*MemoryRegion, error) {
	if !pd.res.enter() {
		return nil, pd.res.errClosed("allocate mr")
	}
	defer pd.res.exit()
	if n <= 0 {
		return nil, opErr("allocate mr", pd.c.name, fmt.Errorf("invalid length %d: %w", n, syscall.EINVAL))
	}
	if pd.c.locks {
		if err := CheckMemlock(n); err != nil {
			return nil, err
		}
	}
	r, err := mem.Alloc(n, "mr", true)
	if err != nil {
		return nil, opErr("allocate mr", pd.c.name, err)
	}
	m, err := pd.register(r.Bytes(), r.FD(), 0, access, "allocate mr")
	if err != nil {
		r.Free()
		return nil, err
	}
	m.region = r
	// Register finds the MR through its memory (memoryOf): the lifetime
	// node, not the MR, so that the registry of regions does not keep a
	// leaked MR reachable.
	r.SetOwner(m.res.n)
	return m, nil
}

// Register registers caller memory. Go memory is pinned (runtime.Pinner)
// until Close; the caller must keep buf alive and must not let the device
// write into it after Close.
//
// buf may also be part of the memory of MRs from Alloc (a window of an
// arena, with keys and access of its own): the new MR then keeps their
// memory mapped, so closing one of them fails, naming it, until it is
// closed. A window that lies in one such MR is registered with its memfd,
// so the soft provider can share it with other processes as it shares
// memory from Alloc.
func (pd *ProtectionDomain) Register(buf []byte, access Access) (*MemoryRegion, error) {
	if !pd.res.enter() {
		return nil, pd.res.errClosed("register mr")
	}
	defer pd.res.exit()
	if len(buf) == 0 {
		return nil, opErr("register mr", pd.c.name, fmt.Errorf("empty buffer: %w", syscall.EINVAL))
	}
	if pd.c.locks {
		if err := CheckMemlock(len(buf)); err != nil {
			return nil, err
		}
	}
	fd, off, owners := memoryOf(buf)
	if r := enterAll(owners...); r != nil {
		return nil, r.errClosed("register mr")
	}
	defer exitAll(owners...)
	p := new(runtime.Pinner)
	p.Pin(unsafe.SliceData(buf))
	m, err := pd.register(buf, fd, off, access, "register mr", owners...)
	if err != nil {
		p.Unpin()
		return nil, err
	}
	m.inl.keepPinned(p) // reachable, if the MR leaks with its PD and Context
	m.mapped = len(owners) > 0
	return m, nil
}

// memoryOf returns what backs caller memory buf: the memfd and offset of
// the region from Alloc that holds all of it (fd -1 if none does), and the
// lifetimes of the MRs from Alloc whose memory it overlaps, which the MR
// of buf must keep from unmapping it.
func memoryOf(buf []byte) (fd int, off int64, owners []*resource) {
	fd = -1
	p := unsafe.Pointer(unsafe.SliceData(buf))
	rs := mem.Overlapping(p, len(buf))
	for _, r := range rs {
		n, ok := r.Owner().(*node)
		if !ok {
			continue
		}
		owners = append(owners, &resource{n: n})
		if o, ok := r.Offset(p, len(buf)); ok && len(rs) == 1 {
			fd, off = r.FD(), o
		}
	}
	return fd, off, owners
}

// register registers buf (backed by the memfd fd at off, or fd -1) under
// the PD and the lifetimes in owners.
func (pd *ProtectionDomain) register(buf []byte, fd int, off int64, access Access, op string, owners ...*resource) (*MemoryRegion, error) {
	pm, err := pd.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(unsafe.SliceData(buf)), Len: len(buf), FD: fd, Offset: off}, prov.Access(access))
	if err != nil {
		return nil, opErr(op, pd.c.name, fmt.Errorf("%d bytes, access %v: %w", len(buf), access, err))
	}
	m := newMR(pd, pm, access, buf)
	parents := append([]*resource{&pd.res}, owners...)
	if err := initResource(m, &m.res, "memory region", fmt.Sprintf("lkey %#x, %d bytes", m.lkey, len(buf)), parents...); err != nil {
		pm.Close()
		return nil, opErr(op, pd.c.name, err)
	}
	m.inl = &inlineRef{lkey: m.lkey, lo: m.addr, hi: m.addr + uint64(m.length), keep: buf}
	pd.mrs.insert(m.inl)
	return m, nil
}

// RegisterDMABuf registers length bytes at offset of a dma-buf file
// descriptor (device memory exported by a GPU driver, for example), mapped
// at iova. The soft provider does not support it.
func (pd *ProtectionDomain) RegisterDMABuf(fd int, offset uint64, length int, iova uint64, access Access) (*MemoryRegion, error) {
	if !pd.res.enter() {
		return nil, pd.res.errClosed("register dma-buf mr")
	}
	defer pd.res.exit()
	pm, err := pd.pd.RegDMABuf(offset, length, iova, fd, prov.Access(access))
	if err != nil {
		return nil, opErr("register dma-buf mr", pd.c.name, err)
	}
	m := newMR(pd, pm, access, nil)
	if err := initResource(m, &m.res, "memory region", fmt.Sprintf("dma-buf lkey %#x", m.lkey), &pd.res); err != nil {
		pm.Close()
		return nil, err
	}
	return m, nil
}

// Bytes returns the registered memory (nil for a dma-buf MR). For an MR
// from Alloc it is nil after Close, which unmaps the memory (its address
// range may then be reused by other memory, another MR's for example): a
// slice taken before Close must not be used after it, as a slice of
// memory from syscall.Mmap must not be after syscall.Munmap. So is it for
// an MR that Register made of memory from Alloc, whose owner may be
// closed by then.
func (m *MemoryRegion) Bytes() []byte {
	if (m.region != nil || m.mapped) && m.res.isClosed() {
		return nil
	}
	return m.buf
}

// Addr returns the address of the first byte as the device sees it.
func (m *MemoryRegion) Addr() uint64 { return m.addr }

// Len returns the length in bytes.
func (m *MemoryRegion) Len() int { return m.length }

// LKey returns the local key.
func (m *MemoryRegion) LKey() uint32 { return m.lkey }

// RKey returns the remote key.
func (m *MemoryRegion) RKey() uint32 { return m.rkey }

// Access returns the access flags the MR was registered with.
func (m *MemoryRegion) Access() Access { return m.access }

// PD returns the protection domain of the MR.
func (m *MemoryRegion) PD() *ProtectionDomain { return m.pd }

// SGE returns a scatter/gather element for the n bytes at offset off of
// the MR. It fails at once, with an error wrapping syscall.EINVAL that
// names off, n and the MR's length, if off or n is negative, off+n
// exceeds Len, or n does not fit an SGE's 32-bit length; the SGE is then
// zero.
func (m *MemoryRegion) SGE(off, n int) (SGE, error) {
	l := m.length
	if off < 0 || n < 0 || off > l || n > l-off || uint64(n) > math.MaxUint32 {
		return SGE{}, fmt.Errorf("verbs: sge of %d bytes at offset %d: outside the memory region (lkey %#x, %d bytes): %w",
			n, off, m.lkey, l, syscall.EINVAL)
	}
	return SGE{Addr: m.addr + uint64(off), Length: uint32(n), LKey: m.lkey}, nil
}

// All returns one SGE covering the whole MR. An SGE's length has 32 bits:
// for an MR of 4 GiB or more, All covers its first 4 GiB - 1 bytes (use
// SGE for the rest).
func (m *MemoryRegion) All() SGE {
	return SGE{Addr: m.addr, Length: uint32(min(uint64(m.length), math.MaxUint32)), LKey: m.lkey}
}

// Remote returns what a peer needs to access the MR with RDMA operations.
func (m *MemoryRegion) Remote() RemoteRegion {
	return RemoteRegion{Addr: m.addr, Len: uint64(m.length), RKey: m.rkey}
}

// Close deregisters the MR, unpins Go memory and frees memory from Alloc.
// It fails, naming them, while MRs registered on part of its memory
// (Register) are open. It waits for posts that are copying inline data
// from the MR (a post holds the MRs of its inline SGEs until its provider
// has copied the data, which it does before the post returns); inline
// posts that name the MR later fail, with an error wrapping ErrClosed
// while Close runs and EINVAL (no open MR has the lkey) after it. It is
// idempotent.
func (m *MemoryRegion) Close() error {
	return m.res.close(func() error {
		if r := m.inl; r != nil {
			// Wait for the posts reading inline data from the MR, and
			// make later ones fail, before the memory can go away.
			r.use.Lock()
			defer r.use.Unlock()
			m.pd.mrs.remove(r)
		}
		if err := m.mr.Close(); err != nil {
			if m.inl != nil {
				m.pd.mrs.insert(m.inl)
			}
			return opErr("deregister mr", m.pd.c.name, err)
		}
		if m.inl != nil {
			m.inl.dead = true
			m.inl.unpin()
		}
		if m.region != nil {
			if err := m.region.Free(); err != nil {
				return opErr("free mr memory", m.pd.c.name, err)
			}
		}
		return nil
	})
}

// SGE is a scatter/gather element: Length bytes at Addr of the MR whose
// local key is LKey.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// RemoteRegion is a peer's memory region as handed out by MemoryRegion.Remote.
// Exchange it out of band: it marshals to a compact binary form
// (MarshalBinary, AppendBinary) and to JSON.
type RemoteRegion struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
	RKey uint32 `json:"rkey"`
}

// At returns the remote address off bytes into the region. It does not
// check bounds: the target rejects out-of-bounds access with a remote
// access error.
func (r RemoteRegion) At(off uint64) RemoteAddr {
	return RemoteAddr{Addr: r.Addr + off, RKey: r.RKey}
}

// The binary encoding of a RemoteRegion: magic "GVRR", version, then
// Addr, Len and RKey in network byte order.
const (
	remoteRegionMagic   = "GVRR"
	remoteRegionVersion = 1
	remoteRegionSize    = 4 + 1 + 8 + 8 + 4
)

// validate checks what every registered region satisfies: it is not
// empty (Alloc and Register refuse empty memory) and does not wrap
// around the end of the address space.
// UnmarshalJSON decodes {"addr":…,"len":…,"rkey":…} and checks the region
// as UnmarshalBinary does (not empty, not wrapping around the address
// space); the zero RemoteRegion (no region) decodes as such. On error r
// is left unchanged.
func (r *RemoteRegion) UnmarshalJSON(b []byte) error {
	type plain RemoteRegion
	var v plain
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("verbs: remote region: %w", err)
	}
	if rr := RemoteRegion(v); rr != (RemoteRegion{}) {
		if err := rr.validate(); err != nil {
			return fmt.Errorf("verbs: remote region: %w", err)
		}
	}
	*r = RemoteRegion(v)
	return nil
}

func (r RemoteRegion) validate() error {
	switch {
	case r.Len == 0:
		return errors.New("empty region")
	case r.Addr > math.MaxUint64-r.Len:
		return fmt.Errorf("region of %d bytes at %#x wraps around the address space", r.Len, r.Addr)
	}
	return nil
}

// AppendBinary implements encoding.BinaryAppender: it appends the
// region's binary encoding (see MarshalBinary) to b. It allocates only
// when b lacks the capacity, and on error returns b unchanged.
func (r RemoteRegion) AppendBinary(b []byte) ([]byte, error) {
	if err := r.validate(); err != nil {
		return b, fmt.Errorf("verbs: remote region: %w", err)
	}
	b = append(b, remoteRegionMagic...)
	b = append(b, remoteRegionVersion)
	b = binary.BigEndian.AppendUint64(b, r.Addr)
	b = binary.BigEndian.AppendUint64(b, r.Len)
	return binary.BigEndian.AppendUint32(b, r.RKey), nil
}

// MarshalBinary encodes the region in 25 bytes (magic "GVRR", version,
// Addr, Len and RKey in network byte order), for a peer to decode with
// UnmarshalBinary. An empty region, or one that wraps around the address
// space, is an error.
func (r RemoteRegion) MarshalBinary() ([]byte, error) {
	return r.AppendBinary(make([]byte, 0, remoteRegionSize))
}

// UnmarshalBinary decodes and validates a region encoded by MarshalBinary.
// data must be exactly one encoding; on error r is unchanged.
func (r *RemoteRegion) UnmarshalBinary(data []byte) error {
	if len(data) != remoteRegionSize {
		return fmt.Errorf("verbs: remote region: %d bytes, want %d", len(data), remoteRegionSize)
	}
	if string(data[:4]) != remoteRegionMagic {
		return fmt.Errorf("verbs: remote region: bad magic %q", data[:4])
	}
	if v := data[4]; v != remoteRegionVersion {
		return fmt.Errorf("verbs: remote region: version %d not supported (want %d)", v, remoteRegionVersion)
	}
	v := RemoteRegion{
		Addr: binary.BigEndian.Uint64(data[5:]),
		Len:  binary.BigEndian.Uint64(data[13:]),
		RKey: binary.BigEndian.Uint32(data[21:]),
	}
	if err := v.validate(); err != nil {
		return fmt.Errorf("verbs: remote region: %w", err)
	}
	*r = v
	return nil
}

// RemoteAddr is the target of an RDMA read, write or atomic.
type RemoteAddr struct {
	Addr uint64
	RKey uint32
}
