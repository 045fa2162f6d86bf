package provproxy_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/goverbs/verbs/internal/provproxy"
	"github.com/goverbs/verbs/internal/soft"
)

// TestMain serves as the peer process when started as one by startPeer
// (or by verbstest for side B), and otherwise runs the tests, failing on
// goroutines left behind.
func TestMain(m *testing.M) {
	if served, err := provproxy.ServeEnv(soft.New()); served {
		if err != nil {
			fmt.Fprintln(os.Stderr, "provproxy test peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}
