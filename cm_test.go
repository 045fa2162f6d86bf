package verbs_test

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// hardwareDevices returns the names of the hardware provider's devices.
func hardwareDevices(t *testing.T) []string {
	t.Helper()
	devs, err := verbs.Devices()
	if err != nil {
		t.Logf("verbs.Devices: %v", err)
	}
	var out []string
	for _, d := range devs {
		if d.Provider != "soft" {
			out = append(out, d.Name)
		}
	}
	return out
}

// TestCMNotSupported checks that without a hardware RDMA device (soft0
// only, or a build without the hardware provider) every RDMA CM entry point
// fails with an *OpError wrapping ErrNotSupported that says what is
// missing, and that a soft0 protection domain is refused in every build.
func TestCMNotSupported(t *testing.T) {
	verbstest.CheckLeaks(t)
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	cq, err := dev.NewCompletionQueue(verbs.CQSpec{})
	if err != nil {
		t.Fatal(err)
	}
	defer cq.Close()
	spec := verbs.QPSpec{SendCQ: cq}
	softSetup := func(verbs.CMRoute) (*verbs.ProtectionDomain, verbs.QPSpec, error) { return pd, spec, nil }
	hw := hardwareDevices(t)

	cases := []struct {
		name string
		// needsNoHardware: the call reaches the CM (and fails otherwise)
		// when the process has a hardware device.
		needsNoHardware bool
		call            func(ctx context.Context) error
		want            error  // wrapped by the error
		mention         string // in the message
	}{
		{"ListenCM", true, func(ctx context.Context) error {
			l, err := verbs.ListenCM(ctx, "127.0.0.1:0", verbs.CMListenOptions{})
			if l != nil {
				l.Close()
			}
			return err
		}, verbs.ErrNotSupported, "connection manager"},
		{"ListenCM-AnyAddress", true, func(ctx context.Context) error {
			l, err := verbs.ListenCM(ctx, ":0", verbs.CMListenOptions{Backlog: 4})
			if l != nil {
				l.Close()
			}
			return err
		}, verbs.ErrNotSupported, "connection manager"},
		{"ResolveCM", true, func(ctx context.Context) error {
			_, err := verbs.ResolveCM(ctx, "127.0.0.1:7471")
			return err
		}, verbs.ErrNotSupported, "connection manager"},
		{"DialCMFunc", true, func(ctx context.Context) error {
			c, err := verbs.DialCMFunc(ctx, "127.0.0.1:7471", softSetup, []byte("hello"))
			if c != nil {
				c.Close()
			}
			return err
		}, verbs.ErrNotSupported, "connection manager"},
		{"DialCM-SoftPD", false, func(ctx context.Context) error {
			c, err := verbs.DialCM(ctx, "127.0.0.1:7471", pd, spec, []byte("hello"))
			if c != nil {
				c.Close()
			}
			return err
		}, verbs.ErrNotSupported, "soft0"},
		{"DialCM-SoftPDIPv6", false, func(ctx context.Context) error {
			c, err := verbs.DialCM(ctx, "[::1]:7471", pd, spec, nil)
			if c != nil {
				c.Close()
			}
			return err
		}, verbs.ErrNotSupported, "Endpoint and Connect"},
		{"DialCM-NilPD", false, func(ctx context.Context) error {
			c, err := verbs.DialCM(ctx, "127.0.0.1:7471", nil, spec, nil)
			if c != nil {
				c.Close()
			}
			return err
		}, syscall.EINVAL, "nil protection domain"},
		{"DialCMFunc-NilSetup", false, func(ctx context.Context) error {
			c, err := verbs.DialCMFunc(ctx, "127.0.0.1:7471", nil, nil)
			if c != nil {
				c.Close()
			}
			return err
		}, syscall.EINVAL, "nil setup"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.needsNoHardware && len(hw) > 0 {
				t.Skipf("this process has hardware RDMA devices %v, so the CM is supported (TestCMDevices in cm_vm_test.go tests it)", hw)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			err := tc.call(ctx)
			if err == nil {
				t.Fatal("succeeded, want an error")
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("error %q does not wrap %v", err, tc.want)
			}
			var oe *verbs.OpError
			if !errors.As(err, &oe) {
				t.Errorf("error %q (%T) is not an *OpError", err, err)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("error %q does not mention %q", err, tc.mention)
			}
			if tc.want == verbs.ErrNotSupported && tc.needsNoHardware && !verbs.HardwareCompiled &&
				!strings.Contains(err.Error(), "-tags ibverbs") {
				t.Errorf("error %q does not say how to build with hardware support (-tags ibverbs)", err)
			}
		})
	}
	// The soft PD is still usable: nothing was left behind.
	if err := pd.Close(); err != nil {
		t.Errorf("closing the soft0 PD after the CM calls: %v", err)
	}
}
