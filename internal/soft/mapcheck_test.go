package soft

import (
	"errors"
	"syscall"
	"testing"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// TestRegMRUnmappable: memory that soft0 could not store into (a
// read-only mapping registered for local write) or not even load from
// (PROT_NONE) is refused with EFAULT at registration, as ibv_reg_mr
// refuses it on rxe. Before, soft0 registered it, and the first receive
// into it (or send from it) killed the process with SIGSEGV in dmaCopy.
func TestRegMRUnmappable(t *testing.T) {
	e := newEnv(t)
	page := syscall.Getpagesize()
	for _, tc := range []struct {
		name   string
		prot   int
		access prov.Access
		ok     bool
	}{
		{"read-only for local write", syscall.PROT_READ, prov.AccessLocalWrite, false},
		{"read-only for remote write", syscall.PROT_READ, prov.AccessLocalWrite | prov.AccessRemoteWrite, false},
		{"read-only, read access only", syscall.PROT_READ, prov.AccessRemoteRead, true},
		{"no access", syscall.PROT_NONE, 0, false},
		{"no access for local write", syscall.PROT_NONE, prov.AccessLocalWrite, false},
		{"read-write", syscall.PROT_READ | syscall.PROT_WRITE, prov.AccessLocalWrite | prov.AccessRemoteWrite, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			buf, err := syscall.Mmap(-1, 0, 2*page, tc.prot, syscall.MAP_PRIVATE|syscall.MAP_ANON)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Munmap(buf)
			m, err := e.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: len(buf), FD: -1}, tc.access)
			if tc.ok {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				m.Close()
				return
			}
			if err == nil {
				m.Close()
				t.Fatal("registered")
			}
			if !errors.Is(err, syscall.EFAULT) {
				t.Errorf("%v, want EFAULT", err)
			}
		})
	}
	// A range that runs from a writable mapping into a read-only one.
	buf, err := syscall.Mmap(-1, 0, 2*page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(buf)
	if err := syscall.Mprotect(buf[page:], syscall.PROT_READ); err != nil {
		t.Fatal(err)
	}
	if m, err := e.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[page-8]), Len: 16, FD: -1}, prov.AccessLocalWrite); !errors.Is(err, syscall.EFAULT) {
		if err == nil {
			m.Close()
		}
		t.Errorf("across a read-only page: %v, want EFAULT", err)
	}
	// A few bytes, no aligned word: checked by /proc/self/maps.
	if m, err := e.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[page+1]), Len: 3, FD: -1}, prov.AccessLocalWrite); !errors.Is(err, syscall.EFAULT) {
		if err == nil {
			m.Close()
		}
		t.Errorf("3 read-only bytes: %v, want EFAULT", err)
	}
	if m, err := e.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[1]), Len: 3, FD: -1}, prov.AccessLocalWrite); err != nil {
		t.Errorf("3 writable bytes: %v", err)
	} else {
		m.Close()
	}
	if m, err := e.pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: page, FD: -1}, prov.AccessLocalWrite); err != nil {
		t.Errorf("the writable page alone: %v", err)
	} else {
		m.Close()
	}
}
