//go:build ibverbs && linux && cgo

package ibv

/*
#include "shim.h"
#cgo noescape gv_poll_cq
#cgo nocallback gv_poll_cq
#cgo noescape gv_poll_cq_busy
#cgo nocallback gv_poll_cq_busy
#cgo noescape gv_req_notify_cq
#cgo nocallback gv_req_notify_cq
#cgo nocallback gv_get_cq_event
*/
import "C"

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// compChannel is a completion channel whose fd waits on the Go poller.
type compChannel struct {
	c  *devContext
	ch *C.struct_ibv_comp_channel
	ev *evFD

	closer closer
}

func (c *devContext) CreateCompChannel() (prov.CompChannel, error) {
	ch, err := C.ibv_create_comp_channel(c.ctx)
	if ch == nil {
		return nil, wrapErr("ibv_create_comp_channel", err)
	}
	ev, err := newEvFD(int(ch.fd), "ibv-comp-channel")
	if err != nil {
		C.ibv_destroy_comp_channel(ch)
		return nil, err
	}
	return &compChannel{c: c, ch: ch, ev: ev}, nil
}

// Wait returns the CQ of the next completion event; the event is
// acknowledged in the shim as soon as it is read. Events of CQs that were
// closed in the meantime are skipped.
func (ch *compChannel) Wait(ctx context.Context) (prov.CQ, error) {
	for {
		var (
			h  C.uint64_t
			rc C.int
		)
		err := ch.ev.wait(ctx, func() bool {
			rc = C.gv_get_cq_event(ch.ch, &h)
			return rc != C.int(syscall.EAGAIN)
		})
		if err != nil {
			return nil, err
		}
		if rc != 0 {
			return nil, errnoErr("ibv_get_cq_event", rc)
		}
		if cq, ok := ch.c.lookup(uint64(h)).(*compQueue); ok {
			return cq, nil
		}
	}
}

// Wake makes a Wait in progress, or the next one, return prov.ErrWoken.
func (ch *compChannel) Wake() { ch.ev.wake() }

func (ch *compChannel) Close() error {
	return ch.closer.do(func() error {
		if ch.ch.refcnt > 0 {
			return fmt.Errorf("ibv_destroy_comp_channel: %d CQs still use the channel: %w", int(ch.ch.refcnt), syscall.EBUSY)
		}
		ch.ev.close()
		if rc := C.ibv_destroy_comp_channel(ch.ch); rc != 0 {
			return errnoErr("ibv_destroy_comp_channel", rc)
		}
		return nil
	})
}

// compQueue is a CQ (prov.CQ).
type compQueue struct {
	c      *devContext
	cq     C.gv_cq
	handle uint64
	cap    int
	// overrun: the device reported CQ_ERR (readEvents): it had no room
	// for a completion and dropped it. Polls fail from then on, as
	// soft0's do after an overflow.
	overrun atomic.Bool

	closer closer
}

// errOverrun is what Poll returns once the CQ overran.
var errOverrun = fmt.Errorf("ibv_poll_cq: the completion queue overran (the device reported CQ_ERR and dropped completions); it is in the error state: %w", syscall.EOVERFLOW)

func (c *devContext) CreateCQ(cqe int, ch prov.CompChannel, vector int) (prov.CQ, error) {
	var cch *C.struct_ibv_comp_channel
	if ch != nil {
		x, ok := ch.(*compChannel)
		if !ok {
			return nil, fmt.Errorf("ibv_create_cq: completion channel of another provider: %w", syscall.EINVAL)
		}
		cch = x.ch
	}
	if err := fitI32("ibv_create_cq", "cqe", cqe); err != nil {
		return nil, err
	}
	if err := fitI32("ibv_create_cq", "comp_vector", vector); err != nil {
		return nil, err
	}
	q := &compQueue{c: c}
	q.handle = c.addHandle(nil) // reserve; published after creation
	useEx := C.int(0)
	if c.cqEx {
		useEx = 1
	}
	if rc := C.gv_create_cq(c.ctx, C.int(cqe), cch, C.int(vector), C.uint64_t(q.handle), useEx, &q.cq); rc != 0 {
		c.dropHandle(q.handle)
		return nil, errnoErr("ibv_create_cq", rc)
	}
	if c.quirkNextPoll {
		q.cq.next_poll_broken = 1
	}
	q.cap = int(q.cq.cq.cqe)
	c.setHandle(q.handle, q)
	return q, nil
}

// Extended reports whether the CQ is polled with ibv_start_poll/next_poll.
func (q *compQueue) Extended() bool { return q.cq.cqx != nil }

// Poll is one cgo call: the shim polls straight into dst.
func (q *compQueue) Poll(dst []prov.Completion) (int, error) {
	if len(dst) == 0 {
		return 0, nil
	}
	if q.overrun.Load() {
		return 0, errOverrun
	}
	countCall(callPollCQ)
	n := C.gv_poll_cq(&q.cq, (*C.gv_wc)(unsafe.Pointer(&dst[0])), C.int(len(dst)))
	if n < 0 {
		return 0, errnoErr("ibv_poll_cq", -n)
	}
	return int(n), nil
}

// maxSpins bounds the spins of one PollBusy (they are a C int).
const maxSpins = 1 << 30

// PollBusy is one cgo call too: the shim repeats the poll, up to spins
// times, until it finds completions.
func (q *compQueue) PollBusy(dst []prov.Completion, spins int) (int, error) {
	if len(dst) == 0 {
		return 0, nil
	}
	if q.overrun.Load() {
		return 0, errOverrun
	}
	spins = min(max(spins, 1), maxSpins)
	countCall(callPollCQ)
	n := C.gv_poll_cq_busy(&q.cq, (*C.gv_wc)(unsafe.Pointer(&dst[0])), C.int(len(dst)), C.int(spins))
	if n < 0 {
		return 0, errnoErr("ibv_poll_cq", -n)
	}
	return int(n), nil
}

func (q *compQueue) Arm(solicitedOnly bool) error {
	so := C.int(0)
	if solicitedOnly {
		so = 1
	}
	if rc := C.gv_req_notify_cq(&q.cq, so); rc != 0 {
		return errnoErr("ibv_req_notify_cq", rc)
	}
	return nil
}

func (q *compQueue) Cap() int { return q.cap }

func (q *compQueue) Close() error {
	return q.closer.do(func() error {
		if rc := C.gv_destroy_cq(&q.cq); rc != 0 {
			return errnoErr("ibv_destroy_cq", rc)
		}
		q.c.dropHandle(q.handle)
		return nil
	})
}
