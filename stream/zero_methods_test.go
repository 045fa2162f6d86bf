package stream_test

import (
	"testing"

	"github.com/goverbs/verbs/internal/zerocheck"
	"github.com/goverbs/verbs/stream"
)

// TestZeroObjectMethods calls every exported method of the zero value of
// every object type with zero arguments (internal/zerocheck): none may
// panic, and those that return an error return one (wrapping
// net.ErrClosed: a zero Conn or Listener is as good as closed). Before,
// Close, Read, Write and CloseWrite of a zero Conn and every method of a
// zero Listener panicked.
func TestZeroObjectMethods(t *testing.T) {
	zerocheck.Methods(t, []any{&stream.Conn{}, &stream.Listener{}}, nil)
}
