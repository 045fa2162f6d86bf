package channel

import (
	"fmt"
	"reflect"
	"unsafe"

	"github.com/goverbs/verbs"
)

// Typed remote addresses. A peer hands out a verbs.RemoteRegion; the
// program knows the Go type laid out in it. RemoteRef and RemoteArray
// compute the address of a value, an array element or a struct field
// from that type (unsafe.Sizeof, and the field's offset measured once,
// when the reference is made), so that no offset is computed by hand:
//
//	type Shared struct {
//		Counter uint64
//		Slots   [16]Slot
//	}
//	root, err := channel.RemoteAt[Shared](region, 0)
//	counter, err := channel.RemoteField(root, func(s *Shared) *uint64 { return &s.Counter })
//	prior, err := ch.FetchAdd(ctx, counter.Addr(), 1)
//
// The layout is the Go layout of the type on this machine, so both sides
// must agree on it: same type definition, same architecture. Types that
// contain pointers (pointers, slices, strings, maps, channels, functions,
// interfaces) are rejected: their values mean nothing in another process.
// Every constructor checks that the value lies inside the region.

// RemoteRef is the address of a value of type T in a peer's memory.
type RemoteRef[T any] struct {
	addr uint64
	rkey uint32
}

// RemoteAt returns a reference to the T at byte offset off of region r.
func RemoteAt[T any](r verbs.RemoteRegion, off uint64) (RemoteRef[T], error) {
	if err := checkPlain[T](); err != nil {
		return RemoteRef[T]{}, err
	}
	if err := checkRegion(r); err != nil {
		return RemoteRef[T]{}, err
	}
	size := uint64(unsafe.Sizeof(*new(T)))
	if off > r.Len || size > r.Len-off {
		return RemoteRef[T]{}, fmt.Errorf("channel: %s (%d bytes) at offset %d does not fit in the remote region of %d bytes", typeName[T](), size, off, r.Len)
	}
	return RemoteRef[T]{addr: r.Addr + off, rkey: r.RKey}, nil
}

// Addr returns the remote address of the value: the target of a Write, a
// Read or an atomic.
func (f RemoteRef[T]) Addr() verbs.RemoteAddr { return verbs.RemoteAddr{Addr: f.addr, RKey: f.rkey} }

// Size returns the size of T in bytes: how much to write or read.
func (f RemoteRef[T]) Size() int { return int(unsafe.Sizeof(*new(T))) }

// Aligned reports whether the remote address is aligned for T (atomics
// need an 8-byte aligned 8-byte word).
func (f RemoteRef[T]) Aligned() bool {
	a := uint64(unsafe.Alignof(*new(T)))
	return a == 0 || f.addr%a == 0
}

// RemoteField returns a reference to the field of *r that sel selects, for
// example func(s *Shared) *uint64 { return &s.Counter }. sel is called
// once, on a zero T, to measure the field's offset; it must return a
// pointer into its argument.
func RemoteField[T, F any](r RemoteRef[T], sel func(*T) *F) (RemoteRef[F], error) {
	if err := checkPlain[F](); err != nil {
		return RemoteRef[F]{}, err
	}
	if sel == nil {
		return RemoteRef[F]{}, fmt.Errorf("channel: RemoteField: nil selector")
	}
	off, err := fieldOffset(sel)
	if err != nil {
		return RemoteRef[F]{}, err
	}
	return RemoteRef[F]{addr: r.addr + off, rkey: r.rkey}, nil
}

func fieldOffset[T, F any](sel func(*T) *F) (off uint64, err error) {
	var zero T
	size := unsafe.Sizeof(zero)
	fsize := unsafe.Sizeof(*new(F))
	base := new(T)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("channel: RemoteField: the selector panicked on a zero %s: %v", typeName[T](), r)
		}
	}()
	fp := sel(base)
	if fp == nil {
		return 0, fmt.Errorf("channel: RemoteField: the selector returned nil")
	}
	b, p := uintptr(unsafe.Pointer(base)), uintptr(unsafe.Pointer(fp))
	if p < b || p-b+fsize > size {
		return 0, fmt.Errorf("channel: RemoteField: the selector returned a pointer outside its %s argument", typeName[T]())
	}
	return uint64(p - b), nil
}

// RemoteArray is the address of n consecutive values of type T (a Go
// array or slice backing: element i at i × unsafe.Sizeof(T)) in a peer's
// memory.
type RemoteArray[T any] struct {
	addr uint64
	rkey uint32
	n    int
}

// RemoteArrayAt returns a reference to n values of type T at byte offset
// off of region r.
func RemoteArrayAt[T any](r verbs.RemoteRegion, off uint64, n int) (RemoteArray[T], error) {
	if err := checkPlain[T](); err != nil {
		return RemoteArray[T]{}, err
	}
	if n < 0 {
		return RemoteArray[T]{}, fmt.Errorf("channel: remote array of %d elements", n)
	}
	if err := checkRegion(r); err != nil {
		return RemoteArray[T]{}, err
	}
	size := uint64(unsafe.Sizeof(*new(T)))
	if size != 0 && uint64(n) > (1<<63-1)/size { // Size, an int, holds n × size
		return RemoteArray[T]{}, fmt.Errorf("channel: remote array of %d %s is too large", n, typeName[T]())
	}
	total := size * uint64(n)
	if off > r.Len || total > r.Len-off {
		return RemoteArray[T]{}, fmt.Errorf("channel: %d × %s (%d bytes) at offset %d does not fit in the remote region of %d bytes", n, typeName[T](), total, off, r.Len)
	}
	return RemoteArray[T]{addr: r.Addr + off, rkey: r.RKey, n: n}, nil
}

// Len returns the number of elements.
func (a RemoteArray[T]) Len() int { return a.n }

// Size returns the size of the whole array in bytes.
func (a RemoteArray[T]) Size() int { return a.n * int(unsafe.Sizeof(*new(T))) }

// Addr returns the remote address of the first element.
func (a RemoteArray[T]) Addr() verbs.RemoteAddr { return verbs.RemoteAddr{Addr: a.addr, RKey: a.rkey} }

// At returns a reference to element i.
func (a RemoteArray[T]) At(i int) (RemoteRef[T], error) {
	if i < 0 || i >= a.n {
		return RemoteRef[T]{}, fmt.Errorf("channel: index %d out of range [0, %d) of a remote array of %s", i, a.n, typeName[T]())
	}
	return RemoteRef[T]{addr: a.addr + uint64(i)*uint64(unsafe.Sizeof(*new(T))), rkey: a.rkey}, nil
}

// Slice returns elements i to j-1.
func (a RemoteArray[T]) Slice(i, j int) (RemoteArray[T], error) {
	if i < 0 || j < i || j > a.n {
		return RemoteArray[T]{}, fmt.Errorf("channel: slice [%d:%d] out of range of a remote array of %d %s", i, j, a.n, typeName[T]())
	}
	return RemoteArray[T]{addr: a.addr + uint64(i)*uint64(unsafe.Sizeof(*new(T))), rkey: a.rkey, n: j - i}, nil
}

// checkRegion rejects a region whose bytes would run past the end of the
// address space (a peer's announcement can say anything): offsets into
// it would wrap around to low addresses.
func checkRegion(r verbs.RemoteRegion) error {
	if r.Addr > ^uint64(0)-r.Len {
		return fmt.Errorf("channel: the remote region of %d bytes at %#x wraps past the end of the address space", r.Len, r.Addr)
	}
	return nil
}

func typeName[T any]() string { return reflect.TypeFor[T]().String() }

// checkPlain rejects types whose values contain pointers.
func checkPlain[T any]() error {
	t := reflect.TypeFor[T]()
	if p := pointerPath(t, t.String()); p != "" {
		return fmt.Errorf("channel: %s cannot live in remote memory: %s holds a pointer", t, p)
	}
	return nil
}

func pointerPath(t reflect.Type, path string) string {
	switch t.Kind() {
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr,
		reflect.Float32, reflect.Float64, reflect.Complex64, reflect.Complex128:
		return ""
	case reflect.Array:
		if t.Len() == 0 {
			return ""
		}
		return pointerPath(t.Elem(), path+"[i]")
	case reflect.Struct:
		for i := range t.NumField() {
			f := t.Field(i)
			if p := pointerPath(f.Type, path+"."+f.Name); p != "" {
				return p
			}
		}
		return ""
	}
	return path + " (" + t.Kind().String() + ")"
}
