package channel

import (
	"fmt"
	"time"

	"github.com/goverbs/verbs"
)

// Options configure a Channel or MultiChannel. The zero value is usable:
// every field documents its default.
type Options struct {
	// QP is the template of every queue pair. SendCQ, RecvCQ and SRQ must
	// be nil: the channel creates the completion queue itself (one CQ for
	// sends and receives of every peer, so that one poller serves all).
	// Zero fields take the verbs.QPSpec defaults, except MaxSendWR and
	// MaxRecvWR, which default to 128 per peer.
	QP verbs.QPSpec
	// Connect adjusts how Connect addresses peers (GRH, traffic class...).
	Connect verbs.ConnectOptions
	// MaxOutstanding bounds the operations in flight at once (handles
	// not yet released) over the whole channel. Default: the CQ size (the
	// sum of every queue pair's send and receive depths, limited by the
	// device) or 4096, whichever is smaller.
	MaxOutstanding int
	// SpinPolls is how a waiting goroutine that polls the completion
	// queue and finds nothing waits for more: it spins (polls again,
	// yielding the processor in between) or sleeps on the completion
	// channel. Spinning trades processor time for latency.
	//
	// SpinAdaptive (0, the default) chooses for each wait, from how long
	// recent waits took, between spinning for at most 50 µs and sleeping
	// at once; it sleeps when waits are long or when spinners outnumber
	// the processors (see the package documentation, Waiting). A
	// positive value spins that many empty polls, then sleeps;
	// SpinNever (any negative value) always sleeps at once; SpinAlways
	// never sleeps. Every wait honours its context.
	SpinPolls int
	// FlushGrace bounds how long tearing down in-flight operations waits
	// for their flush completions (after a cancelled blocking call, a
	// cancelled Batch, Break and Close): a device flushes within
	// microseconds, so this only matters for a wedged device. Default 1s.
	FlushGrace time.Duration
}

const (
	defaultQueueDepth     = 128
	defaultMaxOutstanding = 4096
	defaultFlushGrace     = time.Second
)

func (o Options) withDefaults() (Options, error) {
	if o.QP.SendCQ != nil || o.QP.RecvCQ != nil || o.QP.SRQ != nil {
		return o, fmt.Errorf("channel: Options.QP must not set SendCQ, RecvCQ or SRQ (the channel creates its own completion queue)")
	}
	if o.QP.MaxSendWR == 0 {
		o.QP.MaxSendWR = defaultQueueDepth
	}
	if o.QP.MaxRecvWR == 0 {
		o.QP.MaxRecvWR = defaultQueueDepth
	}
	if o.QP.MaxSendWR < 0 || o.QP.MaxRecvWR < 0 {
		return o, fmt.Errorf("channel: Options.QP: negative queue depth (send %d, receive %d)", o.QP.MaxSendWR, o.QP.MaxRecvWR)
	}
	if o.MaxOutstanding < 0 {
		return o, fmt.Errorf("channel: Options.MaxOutstanding %d is negative", o.MaxOutstanding)
	}
	if o.SpinPolls < 0 {
		o.SpinPolls = SpinNever
	}
	if o.FlushGrace <= 0 {
		o.FlushGrace = defaultFlushGrace
	}
	return o, nil
}
