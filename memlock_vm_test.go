//go:build ibverbs && linux && cgo

package verbs

import (
	"errors"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/ibv"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/vmtest"
)

// TestMemlockDevices registers memory on rxe under a small
// RLIMIT_MEMLOCK, from a thread without CAP_IPC_LOCK (the VM runs tests as
// root), until the kernel refuses, and checks that CheckMemlock gave the
// kernel's answer before each registration: the memory already registered
// counts (VmPin). The registrations are made with the provider directly,
// so that the verbs layer's own check does not stop them first; then the
// verbs layer's Alloc is refused with ENOMEM and the fix.
func TestMemlockDevices(t *testing.T) {
	devs := vmtest.Require(t)
	pc, err := ibv.New().Open(devs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	pd, err := pc.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	vc, err := Open(devs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer vc.Close()
	vpd, err := vc.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer vpd.Close()

	const chunk, room = 256 << 10, 4
	before, err := readMemStatus()
	if err != nil {
		t.Fatal(err)
	}
	setMemlock(t, before.Pinned+room*chunk)
	var mrs []prov.MR
	defer func() {
		for _, m := range mrs {
			if err := m.Close(); err != nil {
				t.Errorf("close mr: %v", err)
			}
		}
	}()
	withoutIPCLock(t, func() {
		for i := range room + 2 {
			checkErr := CheckMemlock(chunk)
			buf, err := unix.Mmap(-1, 0, chunk, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err != nil {
				t.Error(err)
				return
			}
			t.Cleanup(func() { unix.Munmap(buf) })
			m, regErr := pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&buf[0]), Len: chunk, FD: -1}, prov.AccessLocalWrite)
			st, _ := readMemStatus()
			t.Logf("registration %d: CheckMemlock: %v; ibv_reg_mr: %v; now VmPin %d, VmLck %d", i, checkErr, regErr, st.Pinned, st.Locked)
			if (checkErr == nil) != (regErr == nil) {
				t.Errorf("registration %d of %d bytes (%d pinned before, limit %d): CheckMemlock said %v, the kernel %v",
					i, chunk, before.Pinned, before.Pinned+room*chunk, checkErr, regErr)
			}
			if regErr != nil {
				if !errors.Is(regErr, syscall.ENOMEM) || !errors.Is(checkErr, syscall.ENOMEM) {
					t.Errorf("refused registration: kernel %v, CheckMemlock %v; want ENOMEM from both", regErr, checkErr)
				}
				break
			}
			mrs = append(mrs, m)
			// Registrations are charged to pinned memory, not to locked.
			if want := before.Pinned + uint64(len(mrs))*chunk; st.Pinned != want || st.Locked != before.Locked {
				t.Errorf("after %d registrations: VmPin %d, VmLck %d; want %d and %d", len(mrs), st.Pinned, st.Locked, want, before.Locked)
			}
		}
		if len(mrs) != room {
			t.Errorf("%d registrations of %d bytes fit in a limit of %d more; want %d", len(mrs), chunk, room*chunk, room)
		}
		_, err := vpd.Alloc(chunk, AccessLocalWrite)
		if !errors.Is(err, syscall.ENOMEM) || !strings.Contains(err.Error(), "already pin") || !strings.Contains(err.Error(), "ulimit -l") {
			t.Errorf("Alloc at the limit: %v; want ENOMEM naming what is pinned and the fix", err)
		}
	})
}
