//go:build ibverbs && linux && cgo

package channel_test

import (
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/vmtest"
)

// TestDoneAfterCloseDevices is TestDoneAfterClose on rxe0 and rxe1,
// whose flushes come from the kernel's tasks, after the call that broke
// the queue pair: with a flush grace of a microsecond, Close gives up on
// them and must complete the handles itself.
func TestDoneAfterCloseDevices(t *testing.T) {
	devs := vmtest.Require(t)
	for _, tc := range []struct {
		name   string
		grace  time.Duration
		rounds int
	}{
		{"flush grace 1µs", time.Microsecond, 20},
		{"default flush grace", 0, 10},
	} {
		t.Run(tc.name, func(t *testing.T) { testDoneAfterClose(t, devs[0], devs[1], tc.grace, tc.rounds) })
	}
}
