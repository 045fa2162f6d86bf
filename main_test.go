package verbs_test

import (
	"os"
	"testing"

	"github.com/goverbs/verbs/verbstest"
)

// TestMain serves as a peer process when the conformance suite started
// the test binary as one (TestConformanceSoftCrossProcess), and otherwise
// runs the tests.
func TestMain(m *testing.M) {
	verbstest.ServePeerIfRequested()
	os.Exit(m.Run())
}

// checkClose closes c, failing t (not at once) if that fails.
func checkClose(t *testing.T, what string, c interface{ Close() error }) {
	t.Helper()
	if err := c.Close(); err != nil {
		t.Errorf("close %s: %v", what, err)
	}
}
