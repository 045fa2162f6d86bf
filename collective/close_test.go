package collective_test

import (
	"testing"

	"github.com/goverbs/verbs/collective"
	"github.com/goverbs/verbs/verbstest"
)

// TestCloseReleasesWindows: communicators closed one rank after the
// other (each Close returning before the next rank's starts, so that the
// first ranks' peers have not closed yet) keep their windows only until
// every rank closed: the next New or Close on the node releases them, so
// that they do not pile up until the node closes; the node's Close
// releases the last ones (CheckLeaks).
func TestCloseReleasesWindows(t *testing.T) {
	verbstest.CheckLeaks(t)
	const p = 3
	ns := nodes(t, p)
	for i := range 20 {
		cs := make([]*collective.Comm, p)
		noErrors(t, "new", parallel(p, func(r int) error {
			var err error
			cs[r], err = collective.New(testCtx(t), ns[r], collective.Options{})
			return err
		}))
		noErrors(t, "allreduce", parallel(p, func(r int) error {
			v := make([]int64, 1000)
			return collective.Allreduce(testCtx(t), cs[r], nil, v, collective.Sum)
		}))
		for r, c := range cs {
			if err := c.Close(); err != nil {
				t.Fatalf("communicator %d, rank %d: Close: %v", i, r, err)
			}
		}
		for r, nd := range ns {
			if n := collective.LateWindows(nd); n > 1 {
				t.Fatalf("after communicator %d, rank %d holds the windows of %d closed communicators", i, r, n)
			}
		}
	}
}
