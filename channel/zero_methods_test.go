package channel_test

import (
	"testing"

	"github.com/goverbs/verbs/channel"
	"github.com/goverbs/verbs/internal/zerocheck"
)

// TestZeroObjectMethods calls every exported method of the zero value of
// every object type with zero arguments (internal/zerocheck): none may
// panic, and those that return an error return one (wrapping ErrClosed:
// a zero Channel or MultiChannel is as good as closed; a zero Batch is
// one whose scope ended), except Close. Before, 49 methods of the zero
// Batch, Channel, MultiChannel and MultiBatch panicked.
func TestZeroObjectMethods(t *testing.T) {
	zerocheck.Methods(t, []any{&channel.Batch{}, &channel.Channel{}, &channel.Handle{}, &channel.Received{}, &channel.MultiChannel{}, &channel.MultiBatch{}}, map[string]bool{"Channel.Close": true, "MultiChannel.Close": true})
}
