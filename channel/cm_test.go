package channel_test

import (
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// TestCMNotSupported checks that DialCM and AcceptCM refuse a soft0
// protection domain (and, in a build without the hardware provider, every
// one) with an *OpError wrapping verbs.ErrNotSupported that says how to
// connect instead, and refuse bad arguments with EINVAL, before allocating
// anything: the PD closes afterwards and no verbs object is left.
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
	ctx := testCtx(t)
	prepared := false
	prepare := func(*channel.Channel) error { prepared = true; return nil }

	for _, tc := range []struct {
		name    string
		call    func() (*channel.Channel, error)
		want    error
		mention string
	}{
		{"DialCM-Soft", func() (*channel.Channel, error) {
			return channel.DialCM(ctx, "127.0.0.1:7471", pd, channel.Options{}, []byte("hello"), prepare)
		}, verbs.ErrNotSupported, "New, Endpoint and Connect"},
		{"DialCM-SoftIPv6", func() (*channel.Channel, error) {
			return channel.DialCM(ctx, "[::1]:7471", pd, channel.Options{}, nil, nil)
		}, verbs.ErrNotSupported, verbs.SoftDevice},
		{"AcceptCM-Soft", func() (*channel.Channel, error) {
			return channel.AcceptCM(ctx, nil, pd, channel.Options{}, []byte("welcome"), prepare)
		}, verbs.ErrNotSupported, "New, Endpoint and Connect"},
		{"DialCM-NilPD", func() (*channel.Channel, error) {
			return channel.DialCM(ctx, "127.0.0.1:7471", nil, channel.Options{}, nil, nil)
		}, syscall.EINVAL, "nil protection domain"},
		{"AcceptCM-NilPD", func() (*channel.Channel, error) {
			return channel.AcceptCM(ctx, nil, nil, channel.Options{}, nil, nil)
		}, syscall.EINVAL, "nil protection domain"},
		{"DialCM-PrivateDataTooLong", func() (*channel.Channel, error) {
			return channel.DialCM(ctx, "127.0.0.1:7471", pd, channel.Options{}, make([]byte, channel.MaxCMDialData+1), nil)
		}, syscall.EINVAL, "41 bytes of private data, at most 40"},
		{"AcceptCM-PrivateDataTooLong", func() (*channel.Channel, error) {
			return channel.AcceptCM(ctx, nil, pd, channel.Options{}, make([]byte, channel.MaxCMAcceptData+1), nil)
		}, syscall.EINVAL, "181 bytes of private data, at most 180"},
		{"DialCM-BadOptions", func() (*channel.Channel, error) {
			return channel.DialCM(ctx, "127.0.0.1:7471", pd, channel.Options{MaxOutstanding: -1}, nil, nil)
		}, nil, "MaxOutstanding -1 is negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := tc.call()
			if err == nil {
				c.Close()
				t.Fatal("succeeded, want an error")
			}
			t.Log(err)
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("error %q does not wrap %v", err, tc.want)
			}
			var oe *channel.OpError
			if tc.want != nil && !errors.As(err, &oe) {
				t.Errorf("error %q (%T) is not a *channel.OpError", err, err)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("error %q does not mention %q", err, tc.mention)
			}
			if errors.Is(err, verbs.ErrNotSupported) && !verbs.HardwareCompiled && !strings.Contains(err.Error(), "-tags ibverbs") {
				t.Errorf("error %q does not say how to build with hardware support (-tags ibverbs)", err)
			}
		})
	}
	if prepared {
		t.Error("prepare ran although the call failed before connecting")
	}
	if _, err := channel.CMRequestData(nil); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("CMRequestData(nil): %v, want EINVAL", err)
	}
	// Nothing was allocated in the PD: it closes.
	if err := pd.Close(); err != nil {
		t.Errorf("closing the soft0 PD after the CM calls: %v", err)
	}
}

// TestCMAccessorsWithoutCM checks the CM accessors of a channel that was
// connected with Endpoint and Connect.
func TestCMAccessorsWithoutCM(t *testing.T) {
	a, _ := newPair(t, channel.Options{})
	if d := a.ch.CMPrivateData(); d != nil {
		t.Errorf("CMPrivateData of a channel from New: %q, want nil", d)
	}
	if r, ok := a.ch.CMRoute(); ok {
		t.Errorf("CMRoute of a channel from New: %+v, true; want false", r)
	}
}
