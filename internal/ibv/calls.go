//go:build ibverbs && linux && cgo

package ibv

// callKind names a data-path C call of the shim.
type callKind int

const (
	callPostSend    callKind = iota // gv_post_send, gv_post_send_wr: one per Submit
	callPostRecv                    // gv_post_recv: one per receive batch
	callPostSRQRecv                 // gv_post_srq_recv: one per SRQ receive batch
	callPollCQ                      // gv_poll_cq, gv_poll_cq_busy: one per Poll or PollBusy
	numCallKinds
)

// Calls counts data-path C calls by kind (DataPathCalls). Each is exactly
// one cgo crossing: the batch loops (post a list of work requests, poll up
// to n completions) run in C.
type Calls struct {
	PostSend, PostRecv, PostSRQRecv, PollCQ uint64
}

// Sub returns c - o, field by field.
func (c Calls) Sub(o Calls) Calls {
	return Calls{c.PostSend - o.PostSend, c.PostRecv - o.PostRecv, c.PostSRQRecv - o.PostSRQRecv, c.PollCQ - o.PollCQ}
}

// Total is the sum of all kinds.
func (c Calls) Total() uint64 { return c.PostSend + c.PostRecv + c.PostSRQRecv + c.PollCQ }
