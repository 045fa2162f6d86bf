package channel_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if any goroutine is left when every test has
// finished (the channel starts none, except one per channel from DialCM
// or AcceptCM that Close ends; the provider's must have ended).
// Leaked verbs objects are checked per test (verbstest.CheckLeaks). A
// process started as a client of BenchmarkPollKV runs that instead.
func TestMain(m *testing.M) {
	kvClientIfRequested()
	goleak.VerifyTestMain(m)
}
