package channel_test

import (
	"encoding/binary"
	"strings"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

type remoteSlot struct {
	Seq  uint32
	Flag uint8
	_    [3]byte
	Val  uint64
}

type remoteShared struct {
	Counter uint64
	Pad     [3]uint16
	Slots   [4]remoteSlot
	Tail    uint64
}

// TestRemoteRefs checks the addresses the typed references compute against
// the Go layout, and that operations through them land on the right bytes
// of the peer's memory (viewed there as the same Go type).
func TestRemoteRefs(t *testing.T) {
	a, b := newPair(t, channel.Options{})
	ctx := testCtx(t)
	const base = 256
	region := b.buf.Remote()
	root, err := channel.RemoteAt[remoteShared](region, base)
	if err != nil {
		t.Fatal(err)
	}
	var zero remoteShared
	if root.Size() != int(unsafe.Sizeof(zero)) || root.Addr() != region.At(base) || !root.Aligned() {
		t.Fatalf("root: size %d addr %+v aligned %v", root.Size(), root.Addr(), root.Aligned())
	}
	counter, err := channel.RemoteField(root, func(s *remoteShared) *uint64 { return &s.Counter })
	if err != nil {
		t.Fatal(err)
	}
	slots, err := channel.RemoteField(root, func(s *remoteShared) *[4]remoteSlot { return &s.Slots })
	if err != nil {
		t.Fatal(err)
	}
	tail, err := channel.RemoteField(root, func(s *remoteShared) *uint64 { return &s.Tail })
	if err != nil {
		t.Fatal(err)
	}
	if got, want := tail.Addr().Addr-region.Addr, uint64(base)+uint64(unsafe.Offsetof(zero.Tail)); got != want {
		t.Errorf("Tail at offset %d, want %d", got, want)
	}
	arr, err := channel.RemoteArrayAt[remoteSlot](region, slots.Addr().Addr-region.Addr, 4)
	if err != nil {
		t.Fatal(err)
	}
	slot2, err := arr.At(2)
	if err != nil {
		t.Fatal(err)
	}
	val2, err := channel.RemoteField(slot2, func(s *remoteSlot) *uint64 { return &s.Val })
	if err != nil {
		t.Fatal(err)
	}

	// Operate through the references...
	if _, err := a.ch.FetchAdd(ctx, counter.Addr(), 5); err != nil {
		t.Fatal(err)
	}
	binary.NativeEndian.PutUint64(a.buf.Bytes(), 0xabcdef)
	if err := a.ch.Write(ctx, val2.Addr(), a.sge(0, val2.Size())); err != nil {
		t.Fatal(err)
	}
	if err := a.ch.Write(ctx, tail.Addr(), a.sge(0, tail.Size())); err != nil {
		t.Fatal(err)
	}
	// ...and look at the peer's memory as the Go type.
	view := (*remoteShared)(unsafe.Pointer(&b.buf.Bytes()[base]))
	if view.Counter != 5 || view.Slots[2].Val != 0xabcdef || view.Tail != 0xabcdef {
		t.Errorf("peer sees %+v", *view)
	}
	for i, s := range view.Slots {
		if i != 2 && s.Val != 0 {
			t.Errorf("slot %d touched: %+v", i, s)
		}
	}

	sub, err := arr.Slice(1, 3)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := sub.At(0)
	second, _ := arr.At(1)
	if sub.Len() != 2 || sub.Size() != 2*int(unsafe.Sizeof(remoteSlot{})) || first != second {
		t.Errorf("slice: len %d size %d first %+v", sub.Len(), sub.Size(), first.Addr())
	}
	if arr.Addr() != slots.Addr() || arr.Len() != 4 {
		t.Errorf("array %+v", arr)
	}
}

func TestRemoteRefErrors(t *testing.T) {
	region := verbs.RemoteRegion{Addr: 0x10000, Len: 64, RKey: 7}
	root, err := channel.RemoteAt[[8]uint64](region, 0)
	if err != nil {
		t.Fatal(err)
	}
	arr, err := channel.RemoteArrayAt[uint32](region, 0, 16)
	if err != nil {
		t.Fatal(err)
	}
	// A peer's announcement can say anything: a region past the end of
	// the address space, or one of 2^63 bytes or more.
	wraps := verbs.RemoteRegion{Addr: ^uint64(0) - 15, Len: 64, RKey: 7}
	huge := verbs.RemoteRegion{Addr: 0x10000, Len: 1 << 63, RKey: 7}
	for _, tc := range []struct {
		name   string
		err    error
		detail string
	}{
		{"value past the end", second(channel.RemoteAt[uint64](region, 57)), "does not fit"},
		{"offset past the end", second(channel.RemoteAt[uint8](region, 65)), "does not fit"},
		{"offset overflow", second(channel.RemoteAt[uint64](region, ^uint64(0)-2)), "does not fit"},
		{"pointer type", second(channel.RemoteAt[*int](region, 0)), "holds a pointer"},
		{"struct with a slice", second(channel.RemoteAt[struct{ B []byte }](region, 0)), ".B (slice)"},
		{"string", second(channel.RemoteAt[string](region, 0)), "holds a pointer"},
		{"array past the end", second(channel.RemoteArrayAt[uint64](region, 8, 8)), "does not fit"},
		{"negative length", second(channel.RemoteArrayAt[uint64](region, 0, -1)), "-1 elements"},
		{"huge array", second(channel.RemoteArrayAt[uint64](region, 0, 1<<62)), "too large"},
		{"array of 2^63 bytes", second(channel.RemoteArrayAt[uint16](huge, 0, 1<<62)), "too large"},
		{"region wraps", second(channel.RemoteAt[uint64](wraps, 0)), "wraps"},
		{"array in a region that wraps", second(channel.RemoteArrayAt[uint64](wraps, 8, 1)), "wraps"},
		{"array of pointers", second(channel.RemoteArrayAt[map[int]int](region, 0, 1)), "holds a pointer"},
		{"index past the end", second(arr.At(16)), "out of range"},
		{"negative index", second(arr.At(-1)), "out of range"},
		{"bad slice", second(arr.Slice(3, 2)), "out of range"},
		{"slice past the end", second(arr.Slice(0, 17)), "out of range"},
		{"nil selector", second(channel.RemoteField[[8]uint64, uint64](root, nil)), "nil selector"},
		{"selector returns nil", second(channel.RemoteField(root, func(*[8]uint64) *uint64 { return nil })), "returned nil"},
		{"selector outside", second(channel.RemoteField(root, func(*[8]uint64) *uint64 { return new(uint64) })), "outside"},
		{"selector panics", second(channel.RemoteField(root, func(s *[8]uint64) *uint64 { i := -1; return &s[i] })), "panicked"},
		{"field with a pointer", second(channel.RemoteField(root, func(s *[8]uint64) **int { return (**int)(unsafe.Pointer(&s[0])) })), "holds a pointer"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.detail) || !strings.HasPrefix(tc.err.Error(), "channel: ") {
			t.Errorf("%s: %v, want an error saying %q", tc.name, tc.err, tc.detail)
		}
	}
	// Unaligned references are allowed but reported.
	odd, err := channel.RemoteAt[uint64](region, 4)
	if err != nil || odd.Aligned() {
		t.Errorf("offset 4: %v aligned %v", err, odd.Aligned())
	}
}

func second[T any](_ T, err error) error { return err }
