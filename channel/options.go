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
	// Doorbells, when positive, is the number of zero-length receives the
	// channel keeps posted on each queue pair for doorbells: every RDMA
	// write with immediate data from the peer (WriteImm, PostWriteImm,
	// Batch.WriteImm) consumes one, which makes a completion here; the
	// channel re-posts it as it polls, and the completion wakes the
	// goroutines sleeping in Wait (and MultiChannel.Wait). A program
	// waiting for words that peers write into its memory can so sleep on
	// the completion channel instead of a timer: the peers write those
	// words with immediate data. The receive queues then belong to the
	// channel: Send, SendImm and Receive (and their Post and Batch forms)
	// fail with an error wrapping verbs.ErrNotSupported, and both ends of
	// a queue pair must use doorbells (a send into a doorbell receive
	// fails the pair). A peer that rings more than Doorbells times before
	// this side polls is delayed by the receiver-not-ready retry of its
	// queue pair (Options.QP.RNRRetry, forever by default). With that
	// retry infinite, a queue pair starts with 4 doorbell receives (at
	// most Doorbells) and gains one at each ring until it has Doorbells:
	// a queue pair no peer rings costs little (a rank of a large world
	// has one to every other rank, and is rung by a few), and the first
	// rings of a burst may wait for the retry. With a finite retry every
	// queue pair gets Doorbells at once. At most QP.MaxRecvWR; not
	// available through the RDMA CM. Default 0: none.
	Doorbells int
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
	if o.Doorbells < 0 || o.Doorbells > o.QP.MaxRecvWR {
		return o, fmt.Errorf("channel: Options.Doorbells %d is not within 0 and the receive queue depth %d", o.Doorbells, o.QP.MaxRecvWR)
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
