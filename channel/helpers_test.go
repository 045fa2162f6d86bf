package channel_test

import (
	"context"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/verbstest"
)

// side is one end of a test: its own device context, PD and memory.
type side struct {
	t   testing.TB
	dev *verbs.Context
	pd  *verbs.ProtectionDomain
	ch  *channel.Channel
	buf *verbs.MemoryRegion // 64 KiB, every access
}

// sge returns the SGE of n bytes at off of s.buf, or fails the test.
func (s *side) sge(off, n int) verbs.SGE { return verbstest.SGE(s.t, s.buf, off, n) }

func newSide(t testing.TB, opts channel.Options) *side {
	t.Helper()
	return newSideOn(t, verbs.SoftDevice, opts)
}

// newSideOn is newSide on the device named dev.
func newSideOn(t testing.TB, dev string, opts channel.Options) *side {
	t.Helper()
	s := &side{t: t}
	var err error
	if s.dev, err = verbs.Open(dev); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "device", s.dev.Close) })
	if s.pd, err = s.dev.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "pd", s.pd.Close) })
	if s.buf, err = s.pd.Alloc(64<<10, verbs.AccessRemoteAll); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "mr", s.buf.Close) })
	if s.ch, err = channel.New(s.pd, opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOrFail(t, "channel", s.ch.Close) })
	return s
}

func closeOrFail(t testing.TB, what string, f func() error) {
	t.Helper()
	if err := f(); err != nil {
		t.Errorf("close %s: %v", what, err)
	}
}

// newPair returns two connected channels, each in its own device context.
func newPair(t testing.TB, opts channel.Options) (a, b *side) {
	t.Helper()
	return newPairOn(t, verbs.SoftDevice, verbs.SoftDevice, opts)
}

// newPairOn is newPair with side a on device devA and b on devB.
func newPairOn(t testing.TB, devA, devB string, opts channel.Options) (a, b *side) {
	t.Helper()
	verbstest.CheckLeaks(t)
	a, b = newSideOn(t, devA, opts), newSideOn(t, devB, opts)
	connect(t, a.ch, b.ch)
	return a, b
}

func connect(t testing.TB, a, b *channel.Channel) {
	t.Helper()
	ea, err := a.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	eb, err := b.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Connect(eb); err != nil {
		t.Fatal(err)
	}
	if err := b.Connect(ea); err != nil {
		t.Fatal(err)
	}
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}
