package cluster_test

import (
	"testing"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/internal/zerocheck"
)

// TestZeroObjectMethods calls every exported method of the zero value of
// every object type with zero arguments (internal/zerocheck): none may
// panic, and those that return an error return one, except those of
// noError. Before, Close, PD, LocalRanks, BarrierAlgorithm and
// ResetBarrier of a zero Node panicked, and so did OnClose(nil) on a
// closed one.
func TestZeroObjectMethods(t *testing.T) {
	zerocheck.Methods(t, []any{&cluster.Node{}, &cluster.Launch{}, &cluster.Host{}}, map[string]bool{
		// As on a closed Node: Close succeeds, Err reports no failure
		// of a world it is not connected to.
		"Node.Close": true, "Node.Err": true,
	})
}
