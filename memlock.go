package verbs

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// CheckMemlock reports, before registering n bytes with a hardware device,
// whether RLIMIT_MEMLOCK leaves room for them, with the fix when it does
// not (the error wraps ENOMEM, which the device would return).
//
// It counts what the process has already pinned: the kernel charges the
// pages of every memory registration to the process' pinned memory (VmPin
// in /proc/self/status) and refuses one that would take it above the limit,
// unless the calling thread has CAP_IPC_LOCK. Memory locked with mlock
// (VmLck) is counted separately by the kernel and does not reduce the room
// for registrations; the error reports it as well. n is rounded up to whole
// pages. (The soft provider does not lock memory and skips the check.)
//
// CheckMemlock is safe for concurrent use; its answer is a snapshot, as
// other goroutines may register or release memory at the same time.
func CheckMemlock(n int) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return nil // cannot tell; let registration decide
	}
	if lim.Cur == unix.RLIM_INFINITY || capIPCLock() {
		return nil
	}
	st, err := readMemStatus()
	if err != nil {
		st = memStatus{} // cannot tell what is pinned: check n alone
	}
	return memlockCheck(n, lim.Cur, st, os.Getpagesize())
}

// memStatus is the locked and pinned memory of a process, in bytes.
type memStatus struct {
	Pinned uint64 // VmPin: pinned pages, memory registrations among them
	Locked uint64 // VmLck: mlock'ed pages
}

// memlockCheck is the decision of CheckMemlock: n bytes (rounded up to
// pages) fit under limit when added to what st says is pinned.
func memlockCheck(n int, limit uint64, st memStatus, pageSize int) error {
	if n <= 0 {
		return nil
	}
	need := (uint64(n) + uint64(pageSize) - 1) / uint64(pageSize) * uint64(pageSize)
	if st.Pinned <= limit && need <= limit-st.Pinned {
		return nil
	}
	left := uint64(0)
	if st.Pinned < limit {
		left = limit - st.Pinned
	}
	return fmt.Errorf("verbs: registering %d bytes (%d in pages) exceeds the locked-memory limit: RLIMIT_MEMLOCK is %d bytes, "+
		"registrations of this process already pin %d (VmPin; %d more are mlock'ed, VmLck), leaving %d: "+
		"raise it with `ulimit -l unlimited` (shell), LimitMEMLOCK=infinity (systemd unit), "+
		"`* - memlock unlimited` in /etc/security/limits.conf, or --ulimit memlock=-1 (containers), "+
		"or close memory regions no longer needed: %w",
		n, need, limit, st.Pinned, st.Locked, left, unix.ENOMEM)
}

// readMemStatus reads the process' pinned and locked memory from
// /proc/self/status.
func readMemStatus() (memStatus, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return memStatus{}, err
	}
	defer f.Close()
	return parseMemStatus(f)
}

// parseMemStatus reads the VmPin and VmLck lines ("VmPin:   1024 kB") of
// a /proc/<pid>/status file. A missing line counts as 0 (kernels before
// 3.2 have no VmPin); a malformed one is an error.
func parseMemStatus(r io.Reader) (memStatus, error) {
	var st memStatus
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Bytes()
		var dst *uint64
		switch {
		case bytes.HasPrefix(line, []byte("VmPin:")):
			dst = &st.Pinned
		case bytes.HasPrefix(line, []byte("VmLck:")):
			dst = &st.Locked
		default:
			continue
		}
		f := bytes.Fields(line[6:])
		if len(f) != 2 || string(f[1]) != "kB" {
			return memStatus{}, fmt.Errorf("verbs: /proc/self/status: malformed line %q", line)
		}
		kb, err := strconv.ParseUint(string(f[0]), 10, 64)
		if err != nil {
			return memStatus{}, fmt.Errorf("verbs: /proc/self/status: malformed line %q: %w", line, err)
		}
		*dst = kb << 10
	}
	if err := sc.Err(); err != nil {
		return memStatus{}, fmt.Errorf("verbs: /proc/self/status: %w", err)
	}
	return st, nil
}

// capIPCLock reports whether the calling thread has CAP_IPC_LOCK in its
// effective set, which exempts it from RLIMIT_MEMLOCK.
func capIPCLock() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[unix.CAP_IPC_LOCK/32].Effective&(1<<(unix.CAP_IPC_LOCK%32)) != 0
}
