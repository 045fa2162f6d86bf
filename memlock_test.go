package verbs

import (
	"errors"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func TestParseMemStatus(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     memStatus
		err      bool
	}{
		{name: "both", in: "Name:\tx\nVmPeak:\t  100 kB\nVmLck:\t      64 kB\nVmPin:\t    2048 kB\nVmHWM:\t 9 kB\n",
			want: memStatus{Pinned: 2 << 20, Locked: 64 << 10}},
		{name: "zero", in: "VmLck:\t       0 kB\nVmPin:\t       0 kB\n"},
		{name: "no VmPin", in: "VmLck:\t       8 kB\n", want: memStatus{Locked: 8 << 10}},
		{name: "unit", in: "VmPin:\t 8 MB\n", err: true},
		{name: "number", in: "VmLck:\t x kB\n", err: true},
		{name: "fields", in: "VmPin:\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseMemStatus(strings.NewReader(tc.in))
			if (err != nil) != tc.err || got != tc.want {
				t.Errorf("parseMemStatus = %+v, %v; want %+v, error %v", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestMemlockCheck(t *testing.T) {
	const page = 4096
	for _, tc := range []struct {
		name  string
		n     int
		limit uint64
		st    memStatus
		ok    bool
		says  []string
	}{
		{name: "fits", n: 1 << 20, limit: 8 << 20, ok: true},
		{name: "fits exactly", n: 6 << 20, limit: 8 << 20, st: memStatus{Pinned: 2 << 20}, ok: true},
		{name: "pinned leaves too little", n: 6<<20 + 1, limit: 8 << 20, st: memStatus{Pinned: 2 << 20, Locked: 1 << 20},
			says: []string{"registering 6291457 bytes (6295552 in pages)", "RLIMIT_MEMLOCK is 8388608 bytes",
				"already pin 2097152 (VmPin; 1048576 more are mlock'ed, VmLck), leaving 6291456", "ulimit -l unlimited"}},
		// mlock'ed memory is charged separately: it does not take room.
		{name: "locked is not pinned", n: 4 << 20, limit: 8 << 20, st: memStatus{Locked: 8 << 20}, ok: true},
		{name: "a byte is a page", n: 1, limit: page - 1, says: []string{"registering 1 bytes (4096 in pages)", "leaving 4095"}},
		{name: "over the limit already", n: page, limit: 1 << 20, st: memStatus{Pinned: 2 << 20}, says: []string{"leaving 0"}},
		{name: "nothing", n: 0, limit: 0, ok: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := memlockCheck(tc.n, tc.limit, tc.st, page)
			if tc.ok {
				if err != nil {
					t.Fatalf("memlockCheck: %v", err)
				}
				return
			}
			if !errors.Is(err, syscall.ENOMEM) {
				t.Fatalf("memlockCheck = %v, want ENOMEM", err)
			}
			for _, s := range tc.says {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error lacks %q: %v", s, err)
				}
			}
		})
	}
}

// TestReadMemStatusLocked locks memory and reads the change from
// /proc/self/status.
func TestReadMemStatusLocked(t *testing.T) {
	before, err := readMemStatus()
	if err != nil {
		t.Fatal(err)
	}
	const n = 64 << 10
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	if err := unix.Mlock(b); err != nil {
		t.Skipf("mlock %d bytes: %v (RLIMIT_MEMLOCK too small here)", n, err)
	}
	defer unix.Munlock(b)
	after, err := readMemStatus()
	if err != nil {
		t.Fatal(err)
	}
	if after.Locked < before.Locked+n {
		t.Errorf("VmLck %d after locking %d bytes, was %d", after.Locked, n, before.Locked)
	}
}

// withoutIPCLock runs f on an OS thread of its own whose effective
// capabilities lack CAP_IPC_LOCK, as an unprivileged process' threads do,
// so that the kernel applies RLIMIT_MEMLOCK to it. The thread ends with f
// (its goroutine exits locked to it), so no other code runs without the
// capability. f must not call t.Fatal.
func withoutIPCLock(t *testing.T, f func()) {
	t.Helper()
	done := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			done <- err
			return
		}
		data[0].Effective &^= 1 << unix.CAP_IPC_LOCK
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			done <- err
			return
		}
		f()
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Fatalf("drop CAP_IPC_LOCK: %v", err)
	}
}

// setMemlock sets the soft RLIMIT_MEMLOCK of the process to n bytes until
// the test ends.
func setMemlock(t *testing.T, n uint64) {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &old); err != nil {
		t.Fatal(err)
	}
	lim := unix.Rlimit{Cur: n, Max: old.Max}
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &old); err != nil {
			t.Errorf("restore RLIMIT_MEMLOCK: %v", err)
		}
	})
}

// threadCapIPCLock reads CAP_IPC_LOCK from the calling thread's CapEff in
// /proc/thread-self/status.
func threadCapIPCLock(t *testing.T) bool {
	status, err := os.ReadFile("/proc/thread-self/status")
	if err != nil {
		t.Error(err)
		return false
	}
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			eff, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Error(err)
			}
			return eff&(1<<unix.CAP_IPC_LOCK) != 0
		}
	}
	t.Error("no CapEff in /proc/thread-self/status")
	return false
}

// TestCheckMemlockLimit lowers RLIMIT_MEMLOCK below a registration and
// checks CheckMemlock's answer on a thread without CAP_IPC_LOCK (refused,
// ENOMEM) and, when the process has it, on one with it (allowed: the
// kernel exempts it from the limit).
func TestCheckMemlockLimit(t *testing.T) {
	setMemlock(t, 1<<20)
	withoutIPCLock(t, func() {
		if capIPCLock() || threadCapIPCLock(t) {
			t.Errorf("CAP_IPC_LOCK still effective: capIPCLock() %v, /proc/thread-self/status %v", capIPCLock(), threadCapIPCLock(t))
		}
		err := CheckMemlock(2 << 20)
		if !errors.Is(err, syscall.ENOMEM) || !strings.Contains(err.Error(), "RLIMIT_MEMLOCK is 1048576 bytes") {
			t.Errorf("CheckMemlock(2 MiB) under a 1 MiB limit: %v", err)
		}
		if err := CheckMemlock(64 << 10); err != nil {
			t.Errorf("CheckMemlock(64 KiB) under a 1 MiB limit: %v", err)
		}
	})
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if capLock := threadCapIPCLock(t); capIPCLock() != capLock {
		t.Errorf("capIPCLock() = %v, the thread's CapEff says %v", capIPCLock(), capLock)
	} else if capLock {
		if err := CheckMemlock(2 << 20); err != nil {
			t.Errorf("CheckMemlock with CAP_IPC_LOCK: %v", err)
		}
	}
}
