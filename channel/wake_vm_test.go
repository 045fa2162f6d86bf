//go:build ibverbs && linux && cgo

package channel_test

import (
	"testing"

	"github.com/goverbs/verbs/internal/vmtest"
)

// TestWakeDevices runs the tests of wake_test.go on rxe0 and rxe1: the
// poller sleeps on a completion channel of the kernel's, which the
// hardware provider's Wake must end.
func TestWakeDevices(t *testing.T) {
	devs := vmtest.Require(t)
	t.Run("WaitWokenByBreak", func(t *testing.T) { testWaitWokenByBreak(t, devs[0], devs[1]) })
	t.Run("HandleWaitStaleOnRelease", func(t *testing.T) { testHandleWaitStaleOnRelease(t, devs[0], devs[1]) })
}
