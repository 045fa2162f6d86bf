package verbs_test

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// openEach runs f on every device this binary sees (soft0; in the VM also
// rxe0 and rxe1), each in a subtest.
func openEach(t *testing.T, f func(t *testing.T, c *verbs.Context)) {
	devs, err := verbs.Devices()
	if err != nil && len(devs) == 0 {
		t.Fatal(err)
	}
	for _, d := range devs {
		t.Run(d.Name, func(t *testing.T) {
			c, err := verbs.Open(d.Name)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := c.Close(); err != nil {
					t.Errorf("close: %v", err)
				}
			}()
			f(t, c)
		})
	}
}

// isRXE reports whether c is a SoftRoCE device (the VM tier's).
func isRXE(c *verbs.Context) bool {
	return c.Provider() == "ibverbs" && strings.HasPrefix(c.Name(), "rxe")
}

// TestMissingPortDevices asks every device for a port it does not have: the
// error is EINVAL and says which ports exist, on soft0 and on hardware.
func TestMissingPortDevices(t *testing.T) {
	openEach(t, func(t *testing.T, c *verbs.Context) {
		da, err := c.QueryDevice()
		if err != nil {
			t.Fatal(err)
		}
		n := da.PhysPortCnt
		missing := uint8(n + 8)
		ports := fmt.Sprintf(`has (port 1\b|one port \(1\)|ports 1-%d\b)`, n)
		says := regexp.MustCompile(fmt.Sprintf(`port %d\b.*%s|%s.*\b%d\b`, missing, ports, ports, missing))
		_, qerr := c.QueryPort(missing)
		_, gerr := c.GIDTable(missing)
		for what, err := range map[string]error{"QueryPort": qerr, "GIDTable": gerr} {
			if !errors.Is(err, syscall.EINVAL) || !says.MatchString(err.Error()) {
				t.Errorf("%s(%d) on a device with %d port(s): %v\nwant EINVAL matching %s", what, missing, n, err, says)
			}
		}
	})
}

// TestDMABufBadFDDevices registers a dma-buf with fd -1 on every device.
// Neither soft0 nor SoftRoCE imports dma-bufs: both say ErrNotSupported
// (rxe through libibverbs' EOPNOTSUPP), whatever the fd. A device that
// does import them refuses the fd (EBADF).
func TestDMABufBadFDDevices(t *testing.T) {
	openEach(t, func(t *testing.T, c *verbs.Context) {
		pd, err := c.AllocPD()
		if err != nil {
			t.Fatal(err)
		}
		defer pd.Close()
		mr, err := pd.RegisterDMABuf(-1, 0, 4096, 0, verbs.AccessLocalWrite)
		if err == nil {
			mr.Close()
			t.Fatal("RegisterDMABuf(fd -1) succeeded")
		}
		var oe *verbs.OpError
		if !errors.As(err, &oe) || oe.Device != c.Name() {
			t.Errorf("RegisterDMABuf(fd -1): %v is not an *OpError naming %s", err, c.Name())
		}
		switch {
		case c.Provider() == "soft":
			if !errors.Is(err, verbs.ErrNotSupported) || !errors.Is(err, errors.ErrUnsupported) {
				t.Errorf("soft0: RegisterDMABuf(fd -1) = %v, want ErrNotSupported", err)
			}
		case isRXE(c):
			if !errors.Is(err, verbs.ErrNotSupported) || !errors.Is(err, syscall.EOPNOTSUPP) {
				t.Errorf("rxe: RegisterDMABuf(fd -1) = %v, want ErrNotSupported (EOPNOTSUPP)", err)
			}
		default:
			if !errors.Is(err, verbs.ErrNotSupported) && !errors.Is(err, syscall.EBADF) {
				t.Errorf("%s: RegisterDMABuf(fd -1) = %v, want ErrNotSupported or EBADF", c.Name(), err)
			}
		}
	})
}
