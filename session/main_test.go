package session_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if any goroutine is left when every test has
// finished. Leaked verbs objects are checked per test
// (verbstest.CheckLeaks).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
