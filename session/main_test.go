package session

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the child program of the cross-process tests when the
// binary was started as one (xchild_test.go), and otherwise the tests,
// failing the run if any goroutine is left when they have all finished
// (goleak). Tests that start sessions also check for leaked goroutines
// and verbs objects one by one.
func TestMain(m *testing.M) {
	childIfRequested()
	goleak.VerifyTestMain(m)
}
