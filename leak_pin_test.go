package verbs_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/leak"
	"github.com/goverbs/verbs/internal/vmtest"
)

// TestAdversarialLeakedEverythingDevices drops a Context, its PD and an MR of Go
// memory (Register) without closing any of them: the leak tracer reports
// them, and the process lives on. The MR's Pinner and memory stay
// reachable (the device may still write into the memory): before, with
// the PD unreachable too, the runtime collected the Pinner still pinning
// the buffer and killed the process ("runtime.Pinner: found leaking
// pinned pointer"), on every provider.
func TestAdversarialLeakedEverythingDevices(t *testing.T) {
	devices := []string{verbs.SoftDevice}
	if devs := vmtest.Devices(); len(devs) > 0 {
		devices = append(devices, devs[0])
	}
	for _, dev := range devices {
		t.Run(dev, func(t *testing.T) {
			start := leak.Count()
			func() {
				c, err := verbs.Open(dev)
				if err != nil {
					t.Fatal(err)
				}
				pd, err := c.AllocPD()
				if err != nil {
					t.Fatal(err)
				}
				if _, err := pd.Register(make([]byte, 4096), verbs.AccessLocalWrite|verbs.AccessRemoteWrite); err != nil {
					t.Fatal(err)
				}
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			for leak.Count() < start+3 {
				if ctx.Err() != nil {
					t.Fatalf("hang guard: leaks reported %q, want the context, the PD and the MR", leak.Since(start))
				}
				runtime.GC()
				time.Sleep(time.Millisecond)
			}
			// Give the collector and the finalizers of what is left
			// their turns: a Pinner collected while pinning kills the
			// process here.
			for range 20 {
				runtime.GC()
				time.Sleep(time.Millisecond)
			}
			t.Logf("leaks reported: %q", leak.Since(start))
		})
	}
}
