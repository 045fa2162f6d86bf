package soft

import (
	"bufio"
	"bytes"
	"os"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// checkMapped reports whether every byte of [p, p+n) lies in a mapping of
// this process that is readable, and writable if write is set: the check
// ibv_reg_mr makes when the kernel pins the pages (EFAULT otherwise).
// soft0 copies into and out of registered memory with plain loads and
// stores, so a read-only mapping registered for local write (or a
// PROT_NONE one for anything) would crash the process at the first
// receive into it or send from it.
//
// It touches a word of every page (probeMapped: a load, or a
// compare-and-swap of the word with itself, which changes nothing even
// under concurrent writers), with faults turned into panics; in race
// builds, whose compare-and-swap of registered memory is not atomic
// against the application, it reads /proc/self/maps instead (about 40
// µs).
func checkMapped(p unsafe.Pointer, n int, write bool) error {
	if n == 0 {
		return nil
	}
	if !raceDetector {
		return probeMapped(p, n, write)
	}
	return checkMaps(p, n, write)
}

// probeMapped touches one 8-byte word of every page of [p, p+n), within
// the range (a pointer outside it might point into memory the Go heap
// does not hold): a load, or with write a compare-and-swap of the word
// with its own value. A page whose part in the range holds no aligned
// word (a range of a few bytes) sends the whole range to checkMaps.
func probeMapped(p unsafe.Pointer, n int, write bool) (err error) {
	page := uintptr(os.Getpagesize())
	lo, hi := uintptr(p), uintptr(p)+uintptr(n)
	at := lo
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if _, ok := r.(interface{ Addr() uintptr }); !ok {
				panic(r)
			}
			err = notMapped(at, p, n, write)
		}
	}()
	for at < hi {
		end := min((at+page)&^(page-1), hi) // this page's part of the range
		word := (at + 7) &^ 7
		if word+8 > end {
			return checkMaps(p, n, write)
		}
		w := (*uint64)(unsafe.Add(p, word-lo))
		if write {
			for v := atomic.LoadUint64(w); dmaCompareSwap(w, v, v) != v; v = atomic.LoadUint64(w) {
			}
		} else {
			atomic.LoadUint64(w)
		}
		at = end
	}
	return nil
}

func notMapped(at uintptr, p unsafe.Pointer, n int, write bool) error {
	what := "readable"
	if write {
		what = "writable"
	}
	return errnof(syscall.EFAULT, "register mr: the memory at %#x (of %d bytes at %p) is not mapped %s", at, n, p, what)
}

// checkMaps is checkMapped by /proc/self/maps. Without it (not Linux, or
// /proc not mounted) it checks nothing.
func checkMaps(p unsafe.Pointer, n int, write bool) error {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return nil
	}
	defer f.Close()
	lo, hi := uint64(uintptr(p)), uint64(uintptr(p))+uint64(n)
	next := lo // the first byte not yet found in a good mapping
	sc := bufio.NewScanner(f)
	for sc.Scan() && next < hi {
		// 7f0000000000-7f0000021000 rw-p 00000000 00:00 0  [heap]
		line := sc.Bytes()
		dash := bytes.IndexByte(line, '-')
		sp := bytes.IndexByte(line, ' ')
		if dash < 0 || sp < dash || len(line) < sp+3 {
			return nil // a format this code does not know: do not refuse
		}
		start, err1 := strconv.ParseUint(string(line[:dash]), 16, 64)
		end, err2 := strconv.ParseUint(string(line[dash+1:sp]), 16, 64)
		if err1 != nil || err2 != nil {
			return nil
		}
		if end <= next {
			continue
		}
		if start > next {
			break // a hole
		}
		if line[sp+1] != 'r' || (write && line[sp+2] != 'w') {
			break
		}
		next = end
	}
	if next >= hi {
		return nil
	}
	return notMapped(uintptr(next), p, n, write)
}
