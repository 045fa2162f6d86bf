//go:build ibverbs && linux && cgo

package ibv

/*
#include "shim.h"
#cgo noescape gv_nop
#cgo nocallback gv_nop
*/
import "C"

// CgoNop crosses into C and back once and does nothing there, with the same
// cgo annotations as the data-path calls: the unit cost of a crossing on
// the machine at hand, against which the data path's crossings per
// operation (one per Submit, one per Poll) can be weighed
// (BenchmarkCgoCrossing).
func CgoNop() { C.gv_nop() }
