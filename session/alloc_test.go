package session_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/session"
	"github.com/goverbs/verbs/verbstest"
)

// openPD opens soft0 and allocates a PD, both closed when t ends.
func openPD(t testing.TB) *verbs.ProtectionDomain {
	t.Helper()
	return verbstest.OpenPD(t, verbs.SoftDevice)
}

// newAllocator returns an allocator on a PD of its own, checking for
// leaked verbs objects; everything is closed when t ends.
func newAllocator(t testing.TB, cfg session.AllocatorConfig) *session.Allocator {
	t.Helper()
	verbstest.CheckLeaks(t)
	return newAllocatorOn(t, openPD(t), cfg)
}

func newAllocatorOn(t testing.TB, pd *verbs.ProtectionDomain, cfg session.AllocatorConfig) *session.Allocator {
	t.Helper()
	a, err := session.NewAllocator(pd, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "allocator", a.Close) })
	return a
}

func closeOrFail(t testing.TB, what string, f func() error) {
	t.Helper()
	if err := f(); err != nil {
		t.Errorf("close %s: %v", what, err)
	}
}

func alloc(t testing.TB, a *session.Allocator, n int) session.LocalMR {
	t.Helper()
	m, err := a.Alloc(n)
	if err != nil {
		t.Fatalf("alloc %d: %v", n, err)
	}
	return m
}

func free(t testing.TB, m session.LocalMR) {
	t.Helper()
	if err := m.Free(); err != nil {
		t.Fatalf("free a region of %d bytes: %v", m.Len(), err)
	}
}

// warm allocates and frees a region of n bytes, so that its class has an
// arena with a free slot.
func warm(t testing.TB, a *session.Allocator, n int) {
	t.Helper()
	free(t, alloc(t, a, n))
}

// arenaMappings counts the mappings of MR memory (verbs.ProtectionDomain.
// Alloc's memfds) in this process, from /proc/self/maps.
func arenaMappings(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "memfd:goverbs:mr")
}

func checkStats(t testing.TB, what string, a *session.Allocator, want session.AllocatorStats) {
	t.Helper()
	if got := a.Stats(); got != want {
		t.Errorf("%s: stats %+v, want %+v", what, got, want)
	}
}

// checkInMR checks that s lies in the memory region of its region's
// arena, names it by its lkey, and aliases its memory.
func checkInMR(t testing.TB, what string, s session.LocalSlice) {
	t.Helper()
	mr := s.MR().MemoryRegion()
	if mr == nil {
		t.Fatalf("%s: no memory region", what)
	}
	sge := s.SGE()
	if sge.LKey != mr.LKey() || sge.Length != uint32(s.Len()) {
		t.Fatalf("%s: sge %+v, want lkey %#x and length %d", what, sge, mr.LKey(), s.Len())
	}
	if sge.Addr < mr.Addr() || sge.Addr-mr.Addr() > uint64(mr.Len()) {
		t.Fatalf("%s: sge %+v outside the memory region [%#x, +%d)", what, sge, mr.Addr(), mr.Len())
	}
	off := int(sge.Addr - mr.Addr())
	if _, err := mr.SGE(off, s.Len()); err != nil {
		t.Fatalf("%s: the memory region refuses the slice's range: %v", what, err)
	}
	if b := s.Bytes(); len(b) > 0 && &b[0] != &mr.Bytes()[off] {
		t.Fatalf("%s: Bytes is not the memory at the SGE's address", what)
	}
}

func TestAllocSizes(t *testing.T) {
	const arena = 1 << 20
	page := os.Getpagesize()
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: arena})
	largest := a.MaxClassSize()
	if largest != arena/4 {
		t.Fatalf("MaxClassSize %d, want %d", largest, arena/4)
	}
	for _, tc := range []struct {
		n, class int // class 0: an arena of its own
	}{
		{1, 64}, {63, 64}, {64, 64}, {65, 128}, {1000, 1024},
		{page - 1, page}, {page, page}, {page + 1, 2 * page},
		{largest - 1, largest}, {largest, largest},
		{largest + 1, 0}, {arena, 0}, {3*arena + 5, 0},
	} {
		t.Run(fmt.Sprint(tc.n), func(t *testing.T) {
			before := a.Stats()
			m := alloc(t, a, tc.n)
			defer func() {
				if m.Valid() {
					free(t, m)
				}
			}()
			b := m.Bytes()
			if m.Len() != tc.n || len(b) != tc.n || cap(b) != tc.n || !m.Valid() {
				t.Fatalf("Len %d, len(Bytes) %d, cap(Bytes) %d, Valid %v; want %d for each, and valid", m.Len(), len(b), cap(b), m.Valid(), tc.n)
			}
			verbstest.Pattern(b, byte(tc.n))
			want := bytes.Clone(b)
			checkInMR(t, "whole region", m.All())
			s := a.Stats()
			class := tc.class
			if class == 0 {
				class = (tc.n + page - 1) / page * page
				mr := m.MemoryRegion()
				if mr.Len() != class || s.Arenas != before.Arenas+1 || s.Registered != before.Registered+int64(class) {
					t.Errorf("own arena: MR of %d bytes, stats %+v after %+v; want an arena of %d bytes more", mr.Len(), s, before, class)
				}
			}
			if s.InUse != before.InUse+int64(class) || s.Allocs != before.Allocs+1 {
				t.Errorf("stats %+v after %+v: want %d bytes more in use and one more alloc", s, before, class)
			}
			if !bytes.Equal(m.Bytes(), want) {
				t.Fatal("the region's bytes changed")
			}
			free(t, m)
			s = a.Stats()
			if s.InUse != before.InUse || s.Frees != before.Frees+1 {
				t.Errorf("stats %+v after free, before the alloc %+v: want the same bytes in use and one more free", s, before)
			}
			if tc.class == 0 && (s.Arenas != before.Arenas || s.Registered != before.Registered) {
				t.Errorf("own arena not returned by Free: stats %+v, before the alloc %+v", s, before)
			}
		})
	}
}

func TestAllocInvalid(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{})
	for _, n := range []int{0, -1, math.MinInt} {
		if m, err := a.Alloc(n); err == nil || m.Valid() {
			t.Errorf("Alloc(%d): %v, valid %v; want an error", n, err, m.Valid())
		}
	}
	if _, err := a.Alloc(math.MaxInt); !errors.Is(err, session.ErrLimit) {
		t.Errorf("Alloc(MaxInt): %v, want ErrLimit", err)
	}
	pd := a.PD()
	for _, tc := range []struct {
		name string
		pd   *verbs.ProtectionDomain
		cfg  session.AllocatorConfig
	}{
		{"nil pd", nil, session.AllocatorConfig{}},
		{"negative arena", pd, session.AllocatorConfig{ArenaSize: -1}},
		{"huge arena", pd, session.AllocatorConfig{ArenaSize: math.MaxInt}},
		{"negative max", pd, session.AllocatorConfig{MaxMemory: -1}},
		{"max below arena", pd, session.AllocatorConfig{ArenaSize: 1 << 20, MaxMemory: 1<<20 - 1}},
	} {
		if _, err := session.NewAllocator(tc.pd, tc.cfg); err == nil {
			t.Errorf("%s: NewAllocator succeeded", tc.name)
		}
	}
	// A small arena is rounded up to a page.
	b := newAllocatorOn(t, pd, session.AllocatorConfig{ArenaSize: 1})
	m := alloc(t, b, 1)
	if got := m.MemoryRegion().Len(); got != os.Getpagesize() {
		t.Errorf("arena of %d bytes, want a page", got)
	}
	free(t, m)
}

// TestAllocConcurrent allocates, writes, checks and frees regions of many
// sizes from several goroutines at once, then holds a region of every
// goroutine and checks that no two live regions overlap.
func TestAllocConcurrent(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: 256 << 10})
	const workers, rounds, live = 8, 400, 12
	sizes := []int{1, 63, 64, 65, 200, 1000, 4096, 5000, 64 << 10, 100 << 10}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	held := make([][]session.LocalMR, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			type region struct {
				m    session.LocalMR
				seed byte
			}
			var mine []region
			check := func(r region) error {
				want := make([]byte, r.m.Len())
				verbstest.Pattern(want, r.seed)
				if !bytes.Equal(r.m.Bytes(), want) {
					return fmt.Errorf("worker %d: a region of %d bytes was overwritten", w, r.m.Len())
				}
				return nil
			}
			for i := range rounds {
				if len(mine) == live || (len(mine) > 0 && rng.IntN(3) == 0) {
					k := rng.IntN(len(mine))
					if err := check(mine[k]); err != nil {
						errs <- err
						return
					}
					if err := mine[k].m.Free(); err != nil {
						errs <- err
						return
					}
					mine = slices.Delete(mine, k, k+1)
					continue
				}
				m, err := a.Alloc(sizes[rng.IntN(len(sizes))])
				if err != nil {
					errs <- err
					return
				}
				r := region{m, byte(w*rounds + i)}
				verbstest.Pattern(m.Bytes(), r.seed)
				mine = append(mine, r)
			}
			for _, r := range mine {
				if err := check(r); err != nil {
					errs <- err
					return
				}
				held[w] = append(held[w], r.m)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	type span struct{ lo, hi uint64 }
	var spans []span
	for _, ms := range held {
		for _, m := range ms {
			sge := m.All().SGE()
			spans = append(spans, span{sge.Addr, sge.Addr + uint64(sge.Length)})
		}
	}
	slices.SortFunc(spans, func(x, y span) int { return cmp.Compare(x.lo, y.lo) })
	for i := 1; i < len(spans); i++ {
		if spans[i].lo < spans[i-1].hi {
			t.Errorf("live regions overlap: [%#x, %#x) and [%#x, %#x)", spans[i-1].lo, spans[i-1].hi, spans[i].lo, spans[i].hi)
		}
	}
	for _, ms := range held {
		for _, m := range ms {
			free(t, m)
		}
	}
	if s := a.Stats(); s.InUse != 0 || s.Allocs != s.Frees {
		t.Errorf("stats %+v after freeing everything", s)
	}
}

func TestAllocMaxMemory(t *testing.T) {
	const arena = 64 << 10
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: arena, MaxMemory: 4 * arena})
	// Four arenas of 4 KiB slots, 16 each.
	var ms []session.LocalMR
	for range 4 * arena / 4096 {
		ms = append(ms, alloc(t, a, 4096))
	}
	_, err := a.Alloc(4096)
	if !errors.Is(err, session.ErrLimit) {
		t.Fatalf("alloc beyond MaxMemory: %v, want ErrLimit", err)
	}
	for _, num := range []string{"4096", fmt.Sprint(arena), fmt.Sprint(4 * arena)} {
		if !strings.Contains(err.Error(), num) {
			t.Errorf("error %q does not say %s", err, num)
		}
	}
	if _, err := a.Alloc(64); !errors.Is(err, session.ErrLimit) {
		t.Fatalf("alloc of another class beyond MaxMemory: %v, want ErrLimit", err)
	}
	if _, err := a.Alloc(4*arena + 1); !errors.Is(err, session.ErrLimit) {
		t.Fatalf("alloc of more than MaxMemory: %v, want ErrLimit", err)
	}
	// A freed slot is reused.
	free(t, ms[0])
	ms[0] = alloc(t, a, 4000)
	// A wholly free arena is given back, the reserve of a class to
	// another class too.
	for _, m := range ms[:arena/4096] {
		free(t, m)
	}
	m := alloc(t, a, 64)
	checkStats(t, "at the limit", a, session.AllocatorStats{Arenas: 4, Registered: 4 * arena, InUse: 3*arena + 64, Allocs: 66, Frees: 17})
	if _, err := a.Alloc(4096); !errors.Is(err, session.ErrLimit) {
		t.Fatalf("alloc beyond MaxMemory: %v, want ErrLimit", err)
	}
	free(t, m) // the 64 B class keeps its arena in reserve, until:
	big := alloc(t, a, arena)
	if got := big.MemoryRegion().Len(); got != arena {
		t.Errorf("own arena of %d bytes, want %d", got, arena)
	}
	for _, m := range ms[arena/4096:] {
		free(t, m)
	}
	free(t, big)
	checkStats(t, "after freeing everything", a, session.AllocatorStats{Arenas: 1, Registered: arena, Allocs: 67, Frees: 67})
}

// TestAllocReturnsMemory checks that arenas that become wholly free are
// closed and unmapped (beyond one kept per class), and that Trim and
// Close unmap the rest.
func TestAllocReturnsMemory(t *testing.T) {
	const arena = 64 << 10
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: arena})
	maps0 := arenaMappings(t)
	var ms []session.LocalMR
	for range 4 * arena / 4096 {
		ms = append(ms, alloc(t, a, 4096))
	}
	big := alloc(t, a, 1<<20)
	small := alloc(t, a, 64)
	checkStats(t, "allocated", a, session.AllocatorStats{Arenas: 6, Registered: 5*arena + 1<<20, InUse: 4*arena + 1<<20 + 64, Allocs: 66})
	if got := arenaMappings(t) - maps0; got != 6 {
		t.Errorf("%d arena mappings, want 6", got)
	}
	free(t, big)
	for _, m := range ms {
		free(t, m)
	}
	checkStats(t, "freed", a, session.AllocatorStats{Arenas: 2, Registered: 2 * arena, InUse: 64, Allocs: 66, Frees: 65})
	if got := arenaMappings(t) - maps0; got != 2 {
		t.Errorf("%d arena mappings after the frees, want 2", got)
	}
	if err := a.Trim(); err != nil {
		t.Fatal(err)
	}
	checkStats(t, "trimmed", a, session.AllocatorStats{Arenas: 1, Registered: arena, InUse: 64, Allocs: 66, Frees: 65})
	if !small.Valid() {
		t.Fatal("Trim invalidated a live region")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	checkStats(t, "closed", a, session.AllocatorStats{Allocs: 66, Frees: 65})
	if got := arenaMappings(t) - maps0; got != 0 {
		t.Errorf("%d arena mappings after Close, want 0", got)
	}
}

func TestAllocStaleHandles(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{})
	checkStale := func(what string, m session.LocalMR) {
		t.Helper()
		if m.Valid() || m.Bytes() != nil || m.MemoryRegion() != nil || m.All().Bytes() != nil || m.All().SGE() != (verbs.SGE{}) {
			t.Errorf("%s: still usable", what)
		}
		if _, err := m.Slice(0, 0); !errors.Is(err, session.ErrClosed) {
			t.Errorf("%s: Slice: %v, want ErrClosed", what, err)
		}
		if err := m.Free(); !errors.Is(err, session.ErrClosed) {
			t.Errorf("%s: Free: %v, want ErrClosed", what, err)
		}
	}
	checkStale("zero LocalMR", session.LocalMR{})
	if s := (session.LocalSlice{}); s.Bytes() != nil || s.SGE() != (verbs.SGE{}) || s.Len() != 0 {
		t.Error("zero LocalSlice: usable")
	}

	m := alloc(t, a, 100)
	addr := m.All().SGE().Addr
	s := m.All()
	free(t, m)
	checkStale("double free", m)
	if s.Bytes() != nil || s.SGE() != (verbs.SGE{}) {
		t.Error("slice of a freed region still usable")
	}
	// The slot is handed out again: the old handle stays stale and
	// cannot free the new region.
	n := alloc(t, a, 128)
	if got := n.All().SGE().Addr; got != addr {
		t.Fatalf("the freed slot was not reused (%#x, then %#x)", addr, got)
	}
	checkStale("handle to a reused slot", m)
	if !n.Valid() {
		t.Fatal("a stale handle's Free freed the slot's new region")
	}
	verbstest.Pattern(n.Bytes(), 1)
	free(t, n)
	checkStats(t, "end", a, session.AllocatorStats{Arenas: 1, Registered: session.DefaultArenaSize, Allocs: 2, Frees: 2})
}

func TestAllocClose(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: 64 << 10})
	maps0 := arenaMappings(t)
	var ms []session.LocalMR
	for _, n := range []int{1, 4096, 4096, 1 << 20} {
		ms = append(ms, alloc(t, a, n))
	}
	s := ms[1].All()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.Valid() || m.Bytes() != nil || m.MemoryRegion() != nil {
			t.Errorf("region of %d bytes usable after Close", m.Len())
		}
		if err := m.Free(); !errors.Is(err, session.ErrClosed) {
			t.Errorf("Free after Close: %v, want ErrClosed", err)
		}
	}
	if s.Bytes() != nil || s.SGE() != (verbs.SGE{}) {
		t.Error("slice usable after Close")
	}
	if _, err := s.Slice(0, 1); !errors.Is(err, session.ErrClosed) {
		t.Errorf("Slice after Close: %v, want ErrClosed", err)
	}
	for _, n := range []int{1, 1 << 20} {
		if _, err := a.Alloc(n); !errors.Is(err, session.ErrClosed) {
			t.Errorf("Alloc(%d) after Close: %v, want ErrClosed", n, err)
		}
	}
	if err := a.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	checkStats(t, "closed", a, session.AllocatorStats{Allocs: 4})
	if got := arenaMappings(t) - maps0; got != 0 {
		t.Errorf("%d arena mappings after Close, want 0", got)
	}
}

func TestAllocSlices(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{})
	m := alloc(t, a, 1000)
	defer free(t, m)
	verbstest.Pattern(m.Bytes(), 7)
	for _, tc := range []struct {
		off, n int
		ok     bool
	}{
		{0, 1000, true}, {0, 0, true}, {1000, 0, true}, {999, 1, true}, {10, 20, true},
		{-1, 1, false}, {0, -1, false}, {0, 1001, false}, {1, 1000, false}, {1001, 0, false},
		{500, math.MaxInt, false}, {math.MaxInt, 1, false}, {math.MinInt, 0, false},
	} {
		s, err := m.Slice(tc.off, tc.n)
		if !tc.ok {
			if !errors.Is(err, session.ErrOutOfBounds) {
				t.Errorf("Slice(%d, %d): %v, want ErrOutOfBounds", tc.off, tc.n, err)
				continue
			}
			for _, num := range []int{tc.off, tc.n, 1000} {
				if !strings.Contains(err.Error(), fmt.Sprint(num)) {
					t.Errorf("Slice(%d, %d): error %q does not name %d", tc.off, tc.n, err, num)
				}
			}
			continue
		}
		if err != nil {
			t.Errorf("Slice(%d, %d): %v", tc.off, tc.n, err)
			continue
		}
		if s.Len() != tc.n || !bytes.Equal(s.Bytes(), m.Bytes()[tc.off:tc.off+tc.n]) || s.MR() != m {
			t.Errorf("Slice(%d, %d): Len %d, bytes %v", tc.off, tc.n, s.Len(), s.Bytes())
		}
		if s.SGE().Addr != m.All().SGE().Addr+uint64(tc.off) {
			t.Errorf("Slice(%d, %d): SGE %+v, region's %+v", tc.off, tc.n, s.SGE(), m.All().SGE())
		}
		checkInMR(t, fmt.Sprintf("Slice(%d, %d)", tc.off, tc.n), s)
	}
	// Slices of slices are bounded by the outer slice.
	s, err := m.Slice(100, 200)
	if err != nil {
		t.Fatal(err)
	}
	in, err := s.Slice(50, 150)
	if err != nil {
		t.Fatal(err)
	}
	if in.Len() != 150 || in.SGE().Addr != m.All().SGE().Addr+150 || &in.Bytes()[0] != &m.Bytes()[150] {
		t.Errorf("slice of a slice: Len %d, SGE %+v", in.Len(), in.SGE())
	}
	if b := in.Bytes(); cap(b) != 150 {
		t.Errorf("cap of a slice's bytes %d, want 150", cap(b))
	}
	if _, err := s.Slice(50, 151); !errors.Is(err, session.ErrOutOfBounds) {
		t.Errorf("slice past the end of a slice: %v, want ErrOutOfBounds", err)
	}
	want := bytes.Clone(m.Bytes())
	clear(want[150:300])
	clear(in.Bytes())
	if !bytes.Equal(m.Bytes(), want) {
		t.Error("writing through a slice did not write exactly its bytes of the region")
	}
}

func TestAllocZeroed(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{})
	m := alloc(t, a, 300)
	verbstest.Pattern(m.Bytes(), 3)
	free(t, m)
	z, err := a.AllocZeroed(300)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(z.Bytes(), make([]byte, 300)) {
		t.Error("AllocZeroed: memory not zero")
	}
	free(t, z)
}

// TestAllocNoAllocs checks that the hot path allocates nothing: Alloc and
// Free of a class with a free slot, and the methods of regions and slices.
func TestAllocNoAllocs(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{})
	for _, n := range []int{64, 4 << 10, 64 << 10} {
		warm(t, a, n)
		var err error
		got := testing.AllocsPerRun(1000, func() {
			var m session.LocalMR
			if m, err = a.Alloc(n); err != nil {
				return
			}
			s, _ := m.Slice(1, n-1)
			_ = s.SGE()
			_ = s.Bytes()
			_ = m.MemoryRegion()
			err = m.Free()
		})
		if err != nil {
			t.Fatal(err)
		}
		if got != 0 {
			t.Errorf("Alloc/Free of %d bytes: %v allocations per run, want 0", n, got)
		}
	}
}

// TestAllocRDMA writes and reads between regions of two allocators with
// an RC queue pair on soft0: the slices' SGEs name the right memory.
func TestAllocRDMA(t *testing.T) {
	verbstest.CheckLeaks(t)
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{})
	aa := newAllocatorOn(t, p.A.PD, session.AllocatorConfig{})
	ab := newAllocatorOn(t, p.B.PD, session.AllocatorConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Neighbours on both sides must stay untouched.
	var guards []session.LocalMR
	for range 3 {
		guards = append(guards, alloc(t, aa, 5000), alloc(t, ab, 5000))
	}
	src, dst := alloc(t, aa, 5000), alloc(t, ab, 5000)
	for _, m := range append(guards, src, dst) {
		verbstest.Pattern(m.Bytes(), byte(m.All().SGE().Addr))
	}
	want := bytes.Clone(dst.Bytes())
	window, err := p.B.PD.Register(dst.Bytes(), verbs.AccessRemoteAll)
	if err != nil {
		t.Fatal(err)
	}
	poll := func(what string, wrid uint64) {
		t.Helper()
		wc, err := verbstest.PollN(ctx, p.A.CQ, 1)
		if err != nil {
			t.Fatal(err)
		}
		if wc[0].Status != verbs.StatusSuccess || wc[0].WRID != wrid {
			t.Fatalf("%s: completion %v", what, wc[0])
		}
	}
	s, err := src.Slice(100, 3000)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.QA.PostWrite(1, verbs.Signaled, window.Remote().At(1000), s.SGE()); err != nil {
		t.Fatal(err)
	}
	poll("write", 1)
	copy(want[1000:], src.Bytes()[100:3100])
	if !bytes.Equal(dst.Bytes(), want) {
		t.Error("the target region does not hold the written bytes")
	}
	// Read back 4000 bytes of the target into the end of the source.
	r, err := src.Slice(1000, 4000)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.QA.PostRead(2, verbs.Signaled, window.Remote().At(1000), r.SGE()); err != nil {
		t.Fatal(err)
	}
	poll("read", 2)
	if !bytes.Equal(r.Bytes(), want[1000:5000]) {
		t.Error("the source region does not hold the bytes read")
	}
	for _, m := range guards {
		w := make([]byte, m.Len())
		verbstest.Pattern(w, byte(m.All().SGE().Addr))
		if !bytes.Equal(m.Bytes(), w) {
			t.Error("a neighbouring region was written")
		}
	}
	closeOrFail(t, "window", window.Close)
	for _, m := range append(guards, src, dst) {
		free(t, m)
	}
}

// TestAllocWindow registers windows of regions with remote access, and
// checks what a window still open at Free does: the region is freed, but
// its arena's memory stays mapped (Pinned) until the window is closed,
// and Close reports it.
func TestAllocWindow(t *testing.T) {
	const arena = 64 << 10
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: arena})
	pd := a.PD()
	maps0 := arenaMappings(t)

	m := alloc(t, a, 1000)
	w, err := pd.Register(m.Bytes(), verbs.AccessRemoteAll)
	if err != nil {
		t.Fatal(err)
	}
	if rr := w.Remote(); rr.Addr != m.All().SGE().Addr || rr.Len != 1000 || w.Access() != verbs.AccessRemoteAll {
		t.Errorf("window %+v (access %v) of region at %#x", rr, w.Access(), m.All().SGE().Addr)
	}
	s, _ := m.Slice(10, 20)
	w2, err := pd.Register(s.Bytes(), verbs.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	closeOrFail(t, "window", w.Close)
	closeOrFail(t, "window of a slice", w2.Close)
	free(t, m)

	// A window left open on a region with an arena of its own: Free
	// succeeds, the arena stays mapped and pinned.
	big := alloc(t, a, arena+1)
	w, err = pd.Register(big.Bytes()[4096:8192], verbs.AccessRemoteWrite|verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	free(t, big)
	checkStats(t, "freed with a window open", a, session.AllocatorStats{Arenas: 2, Registered: arena + arena + 4096, Allocs: 2, Frees: 2, Pinned: 1})
	verbstest.Pattern(w.Bytes(), 9) // still mapped
	if got := arenaMappings(t) - maps0; got != 2 {
		t.Errorf("%d arena mappings, want 2", got)
	}
	if err := a.Trim(); err == nil || !strings.Contains(err.Error(), "memory region") {
		t.Errorf("Trim with a window open: %v, want an error naming it", err)
	}
	checkStats(t, "trimmed with a window open", a, session.AllocatorStats{Arenas: 1, Registered: arena + 4096, Allocs: 2, Frees: 2, Pinned: 1})

	// Close reports it, and closes the arena once the window is closed.
	if err := a.Close(); err == nil {
		t.Error("Close with a window open succeeded")
	}
	checkStats(t, "closed with a window open", a, session.AllocatorStats{Arenas: 1, Registered: arena + 4096, Allocs: 2, Frees: 2, Pinned: 1})
	closeOrFail(t, "window", w.Close)
	if err := a.Close(); err != nil {
		t.Errorf("Close after closing the window: %v", err)
	}
	checkStats(t, "closed", a, session.AllocatorStats{Allocs: 2, Frees: 2})
	if got := arenaMappings(t) - maps0; got != 0 {
		t.Errorf("%d arena mappings after Close, want 0", got)
	}
}

// TestAllocCloseConcurrent closes the allocator while goroutines allocate
// and free: every call either works or fails with ErrClosed, and every
// arena is closed in the end.
func TestAllocCloseConcurrent(t *testing.T) {
	a := newAllocator(t, session.AllocatorConfig{ArenaSize: 64 << 10})
	maps0 := arenaMappings(t)
	sizes := []int{64, 4096, 16 << 10, 20 << 10} // the last: own arenas
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	started := make(chan struct{}, 4)
	closed := make(chan struct{})
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var held []session.LocalMR
			i := 0
			defer func() {
				if i < 100 { // failed early: do not keep Close waiting
					started <- struct{}{}
				}
			}()
			for ; ; i++ {
				if i == 100 {
					started <- struct{}{}
				}
				m, err := a.Alloc(sizes[(w+i)%len(sizes)])
				if err != nil {
					if !errors.Is(err, session.ErrClosed) {
						errs <- err
					}
					break
				}
				held = append(held, m)
				if len(held) > 8 {
					if err := held[0].Free(); err != nil && !errors.Is(err, session.ErrClosed) {
						errs <- err
					}
					held = held[1:]
				}
			}
			// Alloc fails as soon as Close begins; the regions still
			// out are invalid once it has returned.
			<-closed
			for _, m := range held {
				if err := m.Free(); !errors.Is(err, session.ErrClosed) {
					errs <- fmt.Errorf("free of %d bytes after Close: %v, want ErrClosed (valid %v, closed %v)", m.Len(), err, m.Valid(), a.Stats())
				}
			}
		}()
	}
	for range 4 {
		<-started
	}
	if err := a.Close(); err != nil {
		t.Error(err)
	}
	close(closed)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if s := a.Stats(); s.Arenas != 0 || s.Registered != 0 || s.InUse != 0 {
		t.Errorf("stats after Close: %+v", s)
	}
	if got := arenaMappings(t) - maps0; got != 0 {
		t.Errorf("%d arena mappings after Close, want 0", got)
	}
}
