package vmtest

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestDevicesOutsideVM(t *testing.T) {
	t.Setenv(EnvVM, "")
	t.Setenv(EnvDevices, "rxe0,rxe1")
	if InVM() || Devices() != nil {
		t.Fatalf("InVM() = %v, Devices() = %v without %s=1", InVM(), Devices(), EnvVM)
	}
	t.Setenv(EnvVM, "1")
	t.Setenv(EnvDevices, " rxe0, ,rxe1 ")
	if got := strings.Join(Devices(), "|"); got != "rxe0|rxe1" {
		t.Fatalf("Devices() = %q, want rxe0|rxe1", got)
	}
	t.Setenv(EnvAddrs, "rxe0=fe80::1%veth0,rxe1=fe80::2%veth1")
	if got := Addr("rxe1"); got != "fe80::2%veth1" {
		t.Fatalf("Addr(rxe1) = %q", got)
	}
	if got := Addr("rxe9"); got != "" {
		t.Fatalf("Addr(rxe9) = %q, want empty", got)
	}
}

// TestCMAddrs (anywhere): CMAddrs derives the listener's address and the
// client's target from the environment run.sh sets.
func TestCMAddrs(t *testing.T) {
	t.Setenv(EnvVM, "1")
	t.Setenv(EnvDevices, "rxe0,rxe1")
	t.Setenv(EnvAddrs, "rxe0=fe80::1%veth0,rxe1=fe80::2%veth1")
	p := CMAddrs(t)
	if p.Server != "rxe0" || p.Client != "rxe1" || p.Listen.String() != "fe80::1%veth0" || p.DialZone != "veth1" {
		t.Fatalf("CMAddrs = %+v", p)
	}
	if got := p.Target(4791); got != "[fe80::1%veth1]:4791" {
		t.Errorf("Target(4791) = %q", got)
	}
	if got := p.ListenAddr(0); got != "[fe80::1%veth0]:0" {
		t.Errorf("ListenAddr(0) = %q", got)
	}
}

// TestGuestEnvironment checks, inside the VM, what the hardware-provider
// tests rely on.
func TestGuestEnvironment(t *testing.T) {
	devs := Require(t)
	for _, d := range devs {
		port := filepath.Join("/sys/class/infiniband", d, "ports/1")
		state, err := os.ReadFile(filepath.Join(port, "state"))
		if err != nil {
			t.Fatalf("%s: %v", d, err)
		}
		if !strings.Contains(string(state), "ACTIVE") {
			t.Errorf("%s port 1 state %q, want ACTIVE", d, strings.TrimSpace(string(state)))
		}
		gid, err := os.ReadFile(filepath.Join(port, "gids/0"))
		if err != nil {
			t.Fatalf("%s gid 0: %v", d, err)
		}
		if !strings.HasPrefix(string(gid), "fe80:") {
			t.Errorf("%s gid 0 = %q, want a link-local fe80:: GID", d, strings.TrimSpace(string(gid)))
		}
		typ, err := os.ReadFile(filepath.Join(port, "gid_attrs/types/0"))
		if err != nil || strings.TrimSpace(string(typ)) != "RoCE v2" {
			t.Errorf("%s gid 0 type %q (%v), want RoCE v2", d, strings.TrimSpace(string(typ)), err)
		}
		t.Logf("%s: %s, gid 0 %s (%s)", d, strings.TrimSpace(string(state)),
			strings.TrimSpace(string(gid)), strings.TrimSpace(string(typ)))
	}
	for _, d := range devs {
		addr := Addr(d)
		if !strings.HasPrefix(addr, "fe80::") || !strings.Contains(addr, "%veth") {
			t.Errorf("Addr(%s) = %q, want fe80::...%%vethN", d, addr)
		}
	}
	if _, err := os.Stat("/dev/infiniband/uverbs0"); err != nil {
		t.Errorf("uverbs device: %v", err)
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(8 /* RLIMIT_MEMLOCK */, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur != ^uint64(0) {
		t.Errorf("RLIMIT_MEMLOCK = %d, want unlimited", lim.Cur)
	}
	f, err := os.CreateTemp("", "vmtest")
	if err != nil {
		t.Fatalf("guest temp dir not writable: %v", err)
	}
	f.Close()
	os.Remove(f.Name())
}
