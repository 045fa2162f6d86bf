package stream

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	childIfRequested()
	goleak.VerifyTestMain(m)
}
