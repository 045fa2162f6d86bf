package session

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the child of a cross-process benchmark or test if this
// process is one, else the tests, failing the run if a goroutine is left
// when they have all finished.
func TestMain(m *testing.M) {
	benchChildIfRequested()
	childIfRequested()
	goleak.VerifyTestMain(m)
}
