//go:build ibverbs && linux && cgo

package verbs_test

import (
	"testing"

	"github.com/goverbs/verbs/internal/vmtest"
)

// TestExitAtOnceDevices is TestExitAtOnceCrossProcess on SoftRoCE in the
// VM: this process on rxe0, the peer on rxe1.
func TestExitAtOnceDevices(t *testing.T) {
	devs := vmtest.Require(t)
	exitAtOnce(t, devs[0], devs[1], false)
}
