package verbs

import (
	"math/rand/v2"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// TestMRIndex fills the lkey index of a PD, removes and re-adds entries
// (leaving removed slots behind, growing the table) and checks every
// lookup against a map, including keys that were never in the index and
// keys whose probe sequences collide.
func TestMRIndex(t *testing.T) {
	var x mrIndex
	if r := x.lookup(1); r != nil {
		t.Fatalf("lookup in an empty index: %+v", r)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	want := map[uint32]*inlineRef{}
	check := func(when string) {
		t.Helper()
		for k, r := range want {
			if got := x.lookup(k); got != r {
				t.Fatalf("%s: lookup(%#x) = %p, want %p", when, k, got, r)
			}
		}
		for range 1000 {
			k := rng.Uint32()
			if _, ok := want[k]; !ok && x.lookup(k) != nil {
				t.Fatalf("%s: lookup(%#x) found an entry that was never added or was removed", when, k)
			}
		}
		tab := x.tab.Load()
		if tab.live != len(want) || 2*tab.used > len(tab.slots) {
			t.Fatalf("%s: table of %d slots has %d used, %d live; want %d live and at most half used", when, len(tab.slots), tab.used, tab.live, len(want))
		}
	}
	add := func(k uint32) {
		if _, ok := want[k]; ok {
			return
		}
		r := &inlineRef{lkey: k}
		x.insert(r)
		want[k] = r
	}
	// Hardware-like keys (index << 8 | variant) and random ones.
	for i := range 300 {
		add(uint32(i)<<8 | uint32(i&0xff))
		add(rng.Uint32())
	}
	check("after 600 insertions")
	// Keys with the same home slot probe past each other.
	tab := x.tab.Load()
	home := tab.home(0xC0FFEE)
	for k := uint32(0); len(want) < 640; k++ {
		if tab.home(k) == home {
			add(k)
		}
	}
	check("after colliding insertions")
	// Remove half, in random order, then churn: removed slots are reused
	// or purged when the table is rebuilt.
	keys := make([]uint32, 0, len(want))
	for k := range want {
		keys = append(keys, k)
	}
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
	for _, k := range keys[:len(keys)/2] {
		x.remove(want[k])
		delete(want, k)
	}
	check("after removing half")
	for range 5000 {
		if rng.IntN(2) == 0 && len(want) > 0 {
			for k, r := range want {
				x.remove(r)
				delete(want, k)
				break
			}
		} else {
			add(rng.Uint32())
		}
	}
	check("after churn")
	// Removing an entry that is not in the index changes nothing.
	x.remove(&inlineRef{lkey: 12345})
	check("after removing an absent entry")
}

// BenchmarkCheckInline measures the inline check of a Submit of 16
// inline requests of one SGE each, all in one MR of a PD with 100 MRs:
// one lookup, one hold and 16 bounds checks, then the release.
func BenchmarkCheckInline(b *testing.B) {
	var x mrIndex
	rng := rand.New(rand.NewPCG(3, 4))
	for range 99 {
		x.insert(&inlineRef{lkey: rng.Uint32(), lo: 1 << 20, hi: 2 << 20})
	}
	r := &inlineRef{lkey: 0xABCD01, lo: 1 << 30, hi: 1<<30 + 4096}
	x.insert(r)
	wrs := make([]prov.SendWR, 16)
	sges := make([]prov.SGE, 16)
	for i := range wrs {
		wrs[i] = prov.SendWR{Opcode: prov.WRWrite, Flags: prov.SendInline, SGEIndex: uint32(i), NumSGE: 1}
		sges[i] = prov.SGE{Addr: r.lo + uint64(64*i), Length: 64, LKey: r.lkey}
	}
	var h inlineHold
	b.ReportAllocs()
	for b.Loop() {
		if k, err := checkInline(&x, &h, wrs, sges, nil, 64); k != len(wrs) || err != nil {
			b.Fatal(k, err)
		}
		h.release()
	}
}
