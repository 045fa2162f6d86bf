//go:build ibverbs && linux && cgo && ibv_count

package ibv

import "sync/atomic"

// CountingCalls reports whether this build counts the data-path C calls
// (build tag ibv_count).
const CountingCalls = true

var calls [numCallKinds]atomic.Uint64

func countCall(k callKind) { calls[k].Add(1) }

// DataPathCalls returns how many data-path C calls (each one cgo
// crossing) the process made so far, by kind. It counts only with the
// build tag ibv_count; otherwise it returns zeros.
func DataPathCalls() Calls {
	return Calls{
		PostSend:    calls[callPostSend].Load(),
		PostRecv:    calls[callPostRecv].Load(),
		PostSRQRecv: calls[callPostSRQRecv].Load(),
		PollCQ:      calls[callPollCQ].Load(),
	}
}
