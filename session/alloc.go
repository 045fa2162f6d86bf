package session

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/goverbs/verbs"
)

// Defaults of AllocatorConfig.
const (
	// DefaultArenaSize is the arena size when AllocatorConfig.ArenaSize
	// is 0.
	DefaultArenaSize = 4 << 20
	// DefaultMaxMemory is the memory cap when AllocatorConfig.MaxMemory
	// is 0.
	DefaultMaxMemory = 1 << 30
	// MinClassSize is the size of the smallest size class: every region
	// of up to MinClassSize bytes takes a slot of this size.
	MinClassSize = 64
)

// AllocatorConfig configures an Allocator. The zero value of every field
// selects its default.
type AllocatorConfig struct {
	// ArenaSize is the number of bytes allocated and registered at a
	// time: one verbs.ProtectionDomain.Alloc, one memory region, per
	// arena. It is rounded up to the page size. 0 selects
	// DefaultArenaSize (4 MiB). The largest size class is the largest
	// power of two no larger than a quarter of it (1 MiB by default):
	// larger requests get an arena of their own, of their size rounded
	// up to the page size.
	ArenaSize int
	// MaxMemory caps the bytes of all arenas together (Stats.Registered).
	// An Alloc that needs a new arena beyond it fails with an error
	// wrapping ErrLimit. 0 selects DefaultMaxMemory (1 GiB). It must not
	// be smaller than ArenaSize (after rounding).
	MaxMemory int64
}

// AllocatorStats is a snapshot of an allocator's accounting, taken class
// by class (not atomically across classes).
type AllocatorStats struct {
	// Arenas is the number of arenas mapped and registered (including
	// Pinned ones).
	Arenas int
	// Registered is the number of bytes of those arenas; it never
	// exceeds AllocatorConfig.MaxMemory.
	Registered int64
	// InUse is the number of bytes of the regions allocated and not
	// freed, each counted at its class size (the page-rounded size for a
	// region with an arena of its own), not at the size asked for.
	InUse int64
	// Allocs is the number of successful Allocs since the allocator was
	// created.
	Allocs uint64
	// Frees is the number of successful Frees since the allocator was
	// created (not counting regions invalidated by Close).
	Frees uint64
	// Pinned is the number of arenas no longer used for allocation
	// (wholly free and beyond the reserve, or closed by Close) whose
	// memory region could not be closed yet because a memory region
	// registered on part of their memory (a window, see LocalMR.Free)
	// is still open. They stay mapped and counted in Arenas and
	// Registered; every later Free that releases an arena, Trim and Close
	// try again to close them.
	Pinned int
}

// Allocator hands out regions of registered memory from arenas: large
// blocks allocated and registered once each (verbs.ProtectionDomain.Alloc,
// local write access: memory outside the Go heap, memfd-backed, so that
// windows of it can be registered and shared with peer processes on the
// soft device), carved into slots of one size class each. The classes are
// the powers of two from MinClassSize (64 B) to a quarter of the arena
// size; a request above the largest class gets an arena of its own. The
// allocator grows by an arena when a class has no free slot, up to
// AllocatorConfig.MaxMemory, and returns memory: an arena that becomes
// wholly free is closed (its memory region deregistered and its memory
// unmapped) unless it is the one wholly free arena its class keeps in
// reserve; regions with an arena of their own give it back on Free.
//
// Memory handed out by Alloc is not zeroed: a new arena is zero, but a
// slot that was used before holds what its previous region left there.
// Use AllocZeroed (or clear the bytes) for memory that a peer will be
// able to read.
//
// An Allocator is safe for concurrent use: Alloc, Free, Stats and the
// methods of regions may be called from many goroutines (each size class
// has its own lock). Alloc and Free of a class that has a free slot
// allocate nothing. Close invalidates every region still out.
type Allocator struct {
	pd        *verbs.ProtectionDomain
	arenaSize int
	maxMemory int64
	page      int
	classes   []*class // by size, then the class of regions with their own arena
	closed    atomic.Bool

	mu         sync.Mutex // guards the fields below
	arenas     int
	registered int64
	pinned     []*arena // released arenas whose MR could not be closed
}

// class is a size class: its arenas and accounting.
type class struct {
	a       *Allocator
	size    int  // slot size; 0 for the class of own arenas
	reserve int  // wholly free arenas kept
	own     bool // one region per arena, of its own size

	mu     sync.Mutex // guards the fields below
	arenas []*arena   // every open arena of the class
	avail  []*arena   // arenas with a free slot; Alloc takes the last
	empty  int        // arenas with no live slot
	inUse  int64
	allocs uint64
	frees  uint64
}

// arena is one registered block of memory, carved into slots of its
// class's size.
type arena struct {
	cls  *class
	mr   *verbs.MemoryRegion
	mem  []byte // the whole arena
	addr uint64 // of mem[0] as the device sees it
	lkey uint32
	slot int // slot size (len(mem) for an own arena)

	// gen holds each slot's generation: odd while the slot is allocated,
	// even while it is free. A handle carries the odd generation its
	// Alloc set; Free makes it even, and the next Alloc odd again, so a
	// handle to a freed or reused slot no longer matches.
	gen  []atomic.Uint32
	dead atomic.Bool // released or closed: every handle to it is stale

	// Guarded by cls.mu.
	holds    []int32  // per slot: requests in flight that read it (hold)
	deferred []bool   // per slot: freed while held; goes back at the last unhold
	free     []uint32 // free slots below next (a stack)
	next     uint32   // slots from next on were never allocated
	nslots   uint32
	live     int
}

// errStale is the error of every use of a region that was freed, whose
// slot was reused, or whose allocator was closed (and of the zero
// LocalMR).
var errStale = fmt.Errorf("%w: the region was freed, or its allocator closed", ErrClosed)

// NewAllocator returns an allocator of memory registered in pd. It
// allocates no memory until the first Alloc. The allocator must be closed
// (Close) before pd is.
func NewAllocator(pd *verbs.ProtectionDomain, cfg AllocatorConfig) (*Allocator, error) {
	if pd == nil {
		return nil, errors.New("session: new allocator: nil protection domain")
	}
	page := os.Getpagesize()
	size, maxMem, err := cfg.resolve(page)
	if err != nil {
		return nil, fmt.Errorf("session: new allocator: %w", err)
	}
	a := &Allocator{pd: pd, arenaSize: size, maxMemory: maxMem, page: page}
	largest := 1 << (bits.Len(uint(size/4)) - 1) // size ≥ one page: ≥ 1 KiB
	for s := MinClassSize; s <= largest; s *= 2 {
		a.classes = append(a.classes, &class{a: a, size: s, reserve: 1})
	}
	a.classes = append(a.classes, &class{a: a, own: true})
	return a, nil
}

// resolve returns the arena size (rounded up to page) and the memory cap
// cfg selects, or why it is invalid.
func (cfg AllocatorConfig) resolve(page int) (size int, maxMem int64, err error) {
	size = cfg.ArenaSize
	switch {
	case size < 0:
		return 0, 0, fmt.Errorf("negative ArenaSize %d", size)
	case size == 0:
		size = DefaultArenaSize
	case size > math.MaxInt-page:
		return 0, 0, fmt.Errorf("ArenaSize %d too large", size)
	}
	size = (size + page - 1) &^ (page - 1)
	maxMem = cfg.MaxMemory
	switch {
	case maxMem < 0:
		return 0, 0, fmt.Errorf("negative MaxMemory %d", maxMem)
	case maxMem == 0:
		maxMem = DefaultMaxMemory
	}
	if maxMem < int64(size) {
		return 0, 0, fmt.Errorf("MaxMemory %d is below ArenaSize %d", maxMem, size)
	}
	return size, maxMem, nil
}

// PD returns the protection domain the arenas are registered in.
func (a *Allocator) PD() *verbs.ProtectionDomain { return a.pd }

// MaxClassSize returns the size of the largest size class: Alloc of more
// bytes gives the region an arena of its own.
func (a *Allocator) MaxClassSize() int {
	if len(a.classes) < 2 {
		return 0 // a zero Allocator
	}
	return a.classes[len(a.classes)-2].size
}

// classOf returns the class of a region of n > 0 bytes.
func (a *Allocator) classOf(n int) *class {
	if n <= MinClassSize {
		return a.classes[0]
	}
	i := bits.Len(uint(n-1)) - bits.Len(MinClassSize-1)
	if i >= len(a.classes)-1 {
		return a.classes[len(a.classes)-1]
	}
	return a.classes[i]
}

// Alloc returns a region of n > 0 bytes. The memory is not zeroed (see
// Allocator). It takes a free slot of the smallest size class that holds
// n bytes, or maps and registers a new arena for the class if none is
// free: that fails with an error wrapping ErrLimit if the arena would
// take the allocator beyond AllocatorConfig.MaxMemory (after closing the
// wholly free arenas other classes keep in reserve). n above
// MaxClassSize gets an arena of its own. After Close, Alloc fails with an
// error wrapping ErrClosed.
//
// The region stays valid until its Free or the allocator's Close.
func (a *Allocator) Alloc(n int) (LocalMR, error) {
	if len(a.classes) == 0 {
		// A zero Allocator (not made by NewAllocator) is as good as
		// closed: before, it indexed its classes and panicked
		// (TestZeroObjectMethods).
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: %w (a zero Allocator: make one with NewAllocator)", n, ErrClosed)
	}
	if n <= 0 {
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: the size must be positive", n)
	}
	c := a.classOf(n)
	if c.own {
		return a.allocOwn(c, n)
	}
	c.mu.Lock()
	if a.closed.Load() {
		c.mu.Unlock()
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: the allocator is closed: %w", n, ErrClosed)
	}
	if len(c.avail) == 0 {
		if err := a.grow(c, n); err != nil {
			c.mu.Unlock()
			return LocalMR{}, err
		}
	}
	m := c.take(c.avail[len(c.avail)-1], n)
	c.mu.Unlock()
	return m, nil
}

// AllocZeroed is Alloc with the region's bytes set to zero.
func (a *Allocator) AllocZeroed(n int) (LocalMR, error) {
	m, err := a.Alloc(n)
	if err == nil {
		clear(m.Bytes())
	}
	return m, err
}

// take allocates a slot of ar (which has one free) for a region of n
// bytes. c.mu is held.
func (c *class) take(ar *arena, n int) LocalMR {
	var s uint32
	if k := len(ar.free); k > 0 {
		s = ar.free[k-1]
		ar.free = ar.free[:k-1]
	} else {
		s = ar.next
		ar.next++
	}
	if ar.live == 0 {
		c.empty--
	}
	ar.live++
	if ar.live == int(ar.nslots) {
		c.removeAvail(ar)
	}
	g := ar.gen[s].Add(1)
	c.inUse += int64(ar.slot)
	c.allocs++
	return LocalMR{ar: ar, slot: s, gen: g, n: n}
}

// removeAvail removes ar from c.avail, if it is there. c.mu is held.
func (c *class) removeAvail(ar *arena) {
	if i := slices.Index(c.avail, ar); i >= 0 {
		c.avail = slices.Delete(c.avail, i, i+1)
	}
}

// grow adds an arena to class c, for an Alloc of n bytes; on success
// c.avail is not empty. c.mu is held; at MaxMemory, grow releases it while
// it closes the reserves of every class to make room (trim), and takes
// it again.
func (a *Allocator) grow(c *class, n int) error {
	for try := 0; ; try++ {
		err := a.reserveBytes(int64(a.arenaSize), n)
		if err == nil {
			break
		}
		if try > 0 || !errors.Is(err, ErrLimit) {
			return err
		}
		// Room may be held by wholly free arenas in reserve: give them
		// back and try once more. Another Alloc of c may have added an
		// arena meanwhile.
		c.mu.Unlock()
		a.trim()
		c.mu.Lock()
		if a.closed.Load() {
			return fmt.Errorf("session: alloc of %d bytes: the allocator is closed: %w", n, ErrClosed)
		}
		if len(c.avail) > 0 {
			return nil
		}
	}
	ar, err := a.newArena(c, a.arenaSize, c.size)
	if err != nil {
		a.unreserveBytes(int64(a.arenaSize))
		return fmt.Errorf("session: alloc of %d bytes: %w", n, err)
	}
	c.arenas = append(c.arenas, ar)
	c.avail = append(c.avail, ar)
	c.empty++
	return nil
}

// allocOwn allocates a region of n bytes with an arena of its own.
func (a *Allocator) allocOwn(c *class, n int) (LocalMR, error) {
	if int64(n) > a.maxMemory {
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: more than MaxMemory (%d bytes): %w", n, a.maxMemory, ErrLimit)
	}
	size := (n + a.page - 1) &^ (a.page - 1)
	if a.closed.Load() {
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: the allocator is closed: %w", n, ErrClosed)
	}
	if err := a.reserveBytes(int64(size), n); err != nil {
		if !errors.Is(err, ErrLimit) {
			return LocalMR{}, err
		}
		a.trim()
		if err := a.reserveBytes(int64(size), n); err != nil {
			return LocalMR{}, err
		}
	}
	ar, err := a.newArena(c, size, size)
	if err != nil {
		a.unreserveBytes(int64(size))
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: %w", n, err)
	}
	c.mu.Lock()
	if a.closed.Load() {
		// Close ran meanwhile and did not see this arena.
		c.mu.Unlock()
		ar.dead.Store(true)
		a.closeArena(ar)
		return LocalMR{}, fmt.Errorf("session: alloc of %d bytes: the allocator is closed: %w", n, ErrClosed)
	}
	c.arenas = append(c.arenas, ar)
	c.empty++
	m := c.take(ar, n)
	c.mu.Unlock()
	return m, nil
}

// reserveBytes accounts for a new arena of size bytes, for an Alloc of n,
// or fails with ErrLimit.
func (a *Allocator) reserveBytes(size int64, n int) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.registered+size > a.maxMemory {
		return fmt.Errorf("session: alloc of %d bytes: a new arena of %d bytes would take the %d bytes registered beyond MaxMemory (%d bytes): %w",
			n, size, a.registered, a.maxMemory, ErrLimit)
	}
	a.registered += size
	a.arenas++
	return nil
}

func (a *Allocator) unreserveBytes(size int64) {
	a.mu.Lock()
	a.registered -= size
	a.arenas--
	a.mu.Unlock()
}

// newArena maps and registers an arena of size bytes in slots of slot
// bytes.
func (a *Allocator) newArena(c *class, size, slot int) (*arena, error) {
	mr, err := a.pd.Alloc(size, verbs.AccessLocalWrite)
	if err != nil {
		return nil, fmt.Errorf("new arena of %d bytes: %w", size, err)
	}
	nslots := size / slot
	ar := &arena{
		cls:      c,
		mr:       mr,
		mem:      mr.Bytes()[:size:size],
		addr:     mr.Addr(),
		lkey:     mr.LKey(),
		slot:     slot,
		gen:      make([]atomic.Uint32, nslots),
		holds:    make([]int32, nslots),
		deferred: make([]bool, nslots),
		free:     make([]uint32, 0, nslots),
		nslots:   uint32(nslots),
	}
	return ar, nil
}

// closeArena closes the MR of a released arena (dead, in no class) and
// accounts for it; if the MR cannot be closed (a window registered on its
// memory is open), the arena is kept in a.pinned, still accounted for. It
// returns that error.
func (a *Allocator) closeArena(ar *arena) error {
	err := ar.mr.Close()
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.pinned = append(a.pinned, ar)
		return fmt.Errorf("session: close arena of %d bytes: %w", len(ar.mem), err)
	}
	a.arenas--
	a.registered -= int64(len(ar.mem))
	return nil
}

// retryPinned tries again to close the pinned arenas, and returns the
// errors of those that still cannot be closed.
func (a *Allocator) retryPinned() error {
	a.mu.Lock()
	ps := a.pinned
	a.pinned = nil
	a.mu.Unlock()
	var errs []error
	for _, ar := range ps {
		errs = append(errs, a.closeArena(ar))
	}
	return errors.Join(errs...)
}

// trim releases the wholly free arenas of every class, reserves included,
// and retries the pinned arenas. It returns the errors of arenas that
// could not be closed.
func (a *Allocator) trim() error {
	var rel []*arena
	for _, c := range a.classes {
		c.mu.Lock()
		for i := 0; i < len(c.arenas) && c.empty > 0; {
			ar := c.arenas[i]
			if ar.live != 0 {
				i++
				continue
			}
			c.release(ar)
			rel = append(rel, ar)
		}
		c.mu.Unlock()
	}
	errs := []error{a.retryPinned()}
	for _, ar := range rel {
		errs = append(errs, a.closeArena(ar))
	}
	return errors.Join(errs...)
}

// Trim closes every wholly free arena, including the reserve of each
// class, and tries again to close the Pinned arenas (see
// AllocatorStats.Pinned). It returns an error naming the memory regions
// that keep arenas from closing.
func (a *Allocator) Trim() error { return a.trim() }

// release removes ar, which has no live slot, from c and marks it dead.
// c.mu is held; the caller closes it (closeArena) after unlocking.
func (c *class) release(ar *arena) {
	if i := slices.Index(c.arenas, ar); i >= 0 {
		c.arenas = slices.Delete(c.arenas, i, i+1)
	}
	c.removeAvail(ar)
	c.empty--
	ar.dead.Store(true)
}

// Stats returns a snapshot of the allocator's accounting.
func (a *Allocator) Stats() AllocatorStats {
	var s AllocatorStats
	for _, c := range a.classes {
		c.mu.Lock()
		s.InUse += c.inUse
		s.Allocs += c.allocs
		s.Frees += c.frees
		c.mu.Unlock()
	}
	a.mu.Lock()
	s.Arenas = a.arenas
	s.Registered = a.registered
	s.Pinned = len(a.pinned)
	a.mu.Unlock()
	return s
}

// Close closes every arena: the regions still out become invalid (their
// methods return ErrClosed or zero values, and memory from their Bytes
// must no longer be used), and later Allocs fail with ErrClosed. An arena
// whose memory a window still uses (a memory region registered on part of
// it, see LocalMR.Free) cannot be closed: Close then returns an error
// naming the window, and the arena stays mapped (Stats.Pinned) until a
// later Close, after the window is closed, closes it. Close is idempotent
// and safe to call concurrently with other methods: Allocs fail as soon as
// it begins, while methods of regions may see them valid (and a Free
// succeed) until it returns. It must be called before the protection
// domain is closed.
func (a *Allocator) Close() error {
	a.closed.Store(true)
	var rel []*arena
	for _, c := range a.classes {
		c.mu.Lock()
		for _, ar := range c.arenas {
			ar.dead.Store(true)
			c.inUse -= int64(ar.live) * int64(ar.slot)
		}
		rel = append(rel, c.arenas...)
		c.arenas, c.avail, c.empty = nil, nil, 0
		c.mu.Unlock()
	}
	errs := []error{a.retryPinned()}
	for _, ar := range rel {
		errs = append(errs, a.closeArena(ar))
	}
	return errors.Join(errs...)
}

// LocalMR is a region of registered memory from an Allocator. It is a
// small value (no heap allocation per Alloc): the arena, the slot in it
// and the slot's generation. Copies of a LocalMR name the same region.
//
// A region is valid from its Alloc until its Free or its allocator's
// Close. Using it afterwards is detected: its methods return an error
// wrapping ErrClosed, or nil and zero values, also once the slot was
// handed out again to another region (the generation no longer matches;
// the generation has 32 bits, so a handle kept across 2³¹ reuses of one
// slot could match again). The zero LocalMR is invalid in the same way.
// The detection is no license to race: a region must not be used
// concurrently with its Free, nor memory from its Bytes after it.
//
// The methods are safe for concurrent use. The bytes themselves follow
// the verbs contract: the program must not touch memory that a posted
// work request uses until its completion.
type LocalMR struct {
	ar   *arena
	slot uint32
	gen  uint32
	n    int
}

// valid reports whether m is still allocated.
func (m LocalMR) valid() bool {
	return m.ar != nil && !m.ar.dead.Load() && m.ar.gen[m.slot].Load() == m.gen
}

// Valid reports whether the region is allocated: not freed, nor its
// allocator closed.
func (m LocalMR) Valid() bool { return m.valid() }

// Len returns the size asked for at Alloc (not the class size). It is 0
// for the zero LocalMR, and stays the same after Free.
func (m LocalMR) Len() int { return m.n }

// Bytes returns the memory of the region (Len bytes; appending to it
// never reaches other memory), or nil if the region is no longer valid.
func (m LocalMR) Bytes() []byte {
	if !m.valid() {
		return nil
	}
	off := int(m.slot) * m.ar.slot
	return m.ar.mem[off : off+m.n : off+m.n]
}

// Slice returns the n bytes at offset off of the region. It fails with
// an error wrapping ErrOutOfBounds, naming off, n and Len, unless
// 0 ≤ off ≤ off+n ≤ Len, and with one wrapping ErrClosed if the region is
// no longer valid.
func (m LocalMR) Slice(off, n int) (LocalSlice, error) {
	return m.All().Slice(off, n)
}

// All returns a slice of the whole region.
func (m LocalMR) All() LocalSlice { return LocalSlice{m: m, n: m.n} }

// MemoryRegion returns the memory region of the region's arena (nil if
// the region is no longer valid): its LKey is the one of the region's
// SGEs. It is shared by every region of the arena: do not close it. To
// give a peer access to a region, register a window of it with the
// access it needs (pd.Register(m.Bytes(), access), see
// verbs.ProtectionDomain.Register), and close the window before Free.
func (m LocalMR) MemoryRegion() *verbs.MemoryRegion {
	if !m.valid() {
		return nil
	}
	return m.ar.mr
}

// Free returns the region to its allocator; the region and its copies
// become invalid. Freeing a region that is no longer valid (a double
// Free, a Free after Close, or of the zero LocalMR) changes nothing and
// returns an error wrapping ErrClosed.
//
// Every memory region registered on part of the region's memory (a
// window) must be closed before Free: the allocator cannot see windows,
// and hands the slot out again, so a peer holding the window's key could
// reach the next region of the slot. A window does keep the memory
// mapped: the arena's memory region cannot be closed while one is open,
// so an arena that should be released stays mapped, counted in
// AllocatorStats.Pinned, until the window is closed (Free itself still
// succeeds), and Close reports it.
func (m LocalMR) Free() error {
	ar := m.ar
	if ar == nil {
		return errStale
	}
	c := ar.cls
	c.mu.Lock()
	if ar.dead.Load() || ar.gen[m.slot].Load() != m.gen {
		c.mu.Unlock()
		return errStale
	}
	ar.gen[m.slot].Add(1)
	if ar.holds[m.slot] > 0 {
		// A request in flight still reads it (hold): the slot goes
		// back at the last unhold.
		ar.deferred[m.slot] = true
		c.mu.Unlock()
		return nil
	}
	c.putLocked(ar, m.slot)
	return nil
}

// putLocked puts slot of ar back in c's pool (c.mu held; it unlocks it),
// and releases ar if it is wholly free and c keeps no more in reserve.
func (c *class) putLocked(ar *arena, slot uint32) {
	ar.free = append(ar.free, slot)
	ar.live--
	c.inUse -= int64(ar.slot)
	c.frees++
	if ar.live == int(ar.nslots)-1 && !c.own {
		c.avail = append(c.avail, ar)
	}
	if ar.live > 0 {
		c.mu.Unlock()
		return
	}
	c.empty++
	if c.empty <= c.reserve && !c.own {
		c.mu.Unlock()
		return
	}
	c.release(ar)
	c.mu.Unlock()
	// The region is freed whatever happens to the arena: an arena a
	// window keeps from closing is pinned and tried again later (Stats,
	// Trim, Close report it).
	_ = c.a.closeArena(ar)
	_ = c.a.retryPinned()
}

// hold keeps the memory of m from going back to the allocator until
// unhold, even if m is freed meanwhile: a request in flight reads it (a
// send whose wait was cancelled). It reports whether m was valid.
func (m LocalMR) hold() bool {
	ar := m.ar
	if ar == nil {
		return false
	}
	c := ar.cls
	c.mu.Lock()
	defer c.mu.Unlock()
	if ar.dead.Load() || ar.gen[m.slot].Load() != m.gen {
		return false
	}
	ar.holds[m.slot]++
	return true
}

// unhold ends a hold; a region freed while held goes back to the
// allocator at its last unhold.
func (m LocalMR) unhold() {
	ar := m.ar
	c := ar.cls
	c.mu.Lock()
	ar.holds[m.slot]--
	if ar.holds[m.slot] > 0 || !ar.deferred[m.slot] || ar.dead.Load() {
		c.mu.Unlock()
		return
	}
	ar.deferred[m.slot] = false
	c.putLocked(ar, m.slot)
}

// LocalSlice is a bounds-checked part of a LocalMR: off and n bytes of
// it. It is valid as long as its region is; its methods return nil or
// zero values (or ErrClosed) once the region is not. It is safe for
// concurrent use.
type LocalSlice struct {
	m      LocalMR
	off, n int
}

// Len returns the length of the slice in bytes.
func (s LocalSlice) Len() int { return s.n }

// Bytes returns the memory of the slice, or nil if its region is no
// longer valid.
func (s LocalSlice) Bytes() []byte {
	b := s.m.Bytes()
	if b == nil {
		return nil
	}
	return b[s.off : s.off+s.n : s.off+s.n]
}

// SGE returns the scatter/gather element of the slice: its address and
// length, and the local key of its arena's memory region. It is the zero
// SGE if the region is no longer valid. A slice of 4 GiB or more gets an
// SGE of its first 4 GiB - 1 bytes (an SGE's length has 32 bits).
func (s LocalSlice) SGE() verbs.SGE {
	m := s.m
	if !m.valid() {
		return verbs.SGE{}
	}
	return verbs.SGE{
		Addr:   m.ar.addr + uint64(m.slot)*uint64(m.ar.slot) + uint64(s.off),
		Length: uint32(min(uint64(s.n), math.MaxUint32)),
		LKey:   m.ar.lkey,
	}
}

// Slice returns the n bytes at offset off of the slice, with the errors
// of LocalMR.Slice.
func (s LocalSlice) Slice(off, n int) (LocalSlice, error) {
	if off < 0 || n < 0 || off > s.n || n > s.n-off {
		return LocalSlice{}, fmt.Errorf("session: slice of %d bytes at offset %d of a %d-byte slice (at offset %d of a %d-byte region): %w",
			n, off, s.n, s.off, s.m.n, ErrOutOfBounds)
	}
	if !s.m.valid() {
		return LocalSlice{}, errStale
	}
	return LocalSlice{m: s.m, off: s.off + off, n: n}, nil
}

// MR returns the region of the slice.
func (s LocalSlice) MR() LocalMR { return s.m }
