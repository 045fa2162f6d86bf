package main

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
)

// latResult is one row of a latency test, in microseconds.
type latResult struct {
	Size                        int
	Iters                       int
	Min, Max, Typical, Avg, Std float64
	P99, P999                   float64
	Inline                      bool    // sent inline
	CgoPerMsg                   float64 // cgo calls of this process per iteration
}

// latencyMethod describes how the test measures, for the output header.
func latencyMethod(op string) string {
	switch op {
	case "write":
		return "RDMA write ping-pong, each side polling the last byte of its buffer; latency = round trip / 2"
	case "read":
		return "RDMA read, post to completion"
	}
	return "send ping-pong, each side polling its receive completion; latency = round trip / 2"
}

const latWarmup = 16

// latency runs iters ping-pongs (write, send) or reads of size bytes.
func (lb *loopback) latency(cfg benchConfig, size int) (latResult, error) {
	a, b := lb.a, lb.b
	fillPattern(a.mr.Bytes()[:size])
	fillPattern(b.mr.Bytes()[:size])
	clear(a.mr.Bytes()[a.half : a.half+size])
	clear(b.mr.Bytes()[b.half : b.half+size])
	inline := size <= lb.inline && cfg.op != "read"
	var flags verbs.SendFlags = verbs.Signaled
	if inline {
		flags |= verbs.Inline
	}
	if cfg.op == "send" {
		for _, s := range []*side{a, b} {
			if err := s.fillRecvs(cfg.rxDepth); err != nil {
				return latResult{}, err
			}
			s.recvs = 0
		}
	}

	what := fmt.Sprintf("%s latency of %d bytes", cfg.op, size)
	samples := make([]uint64, 0, cfg.iters)
	clk := startTicks()
	cgo0 := runtime.NumCgoCall()
	for i := -latWarmup; i < cfg.iters; i++ {
		a.yield()
		v := byte((i+latWarmup)%255 + 1) // never 0, never the previous value
		var rtt uint64
		var err error
		switch cfg.op {
		case "write":
			rtt, err = lb.writePingPong(size, v, flags, cfg.txDepth)
		case "send":
			rtt, err = lb.sendPingPong(size, flags, cfg.txDepth, cfg.rxDepth)
		default:
			rtt, err = lb.readOnce(size, cfg.txDepth)
		}
		if err != nil {
			return latResult{}, fmt.Errorf("%s, iteration %d: %w", what, i, err)
		}
		if i >= 0 {
			samples = append(samples, rtt)
		}
	}
	cgo := runtime.NumCgoCall() - cgo0
	clk.stop()
	res := latStatsOf(cfg.op, samples, &clk).result(size, cfg.iters, inline)
	res.CgoPerMsg = float64(cgo) / float64(cfg.iters+latWarmup)
	return res, nil
}

// latStats holds the samples of a latency test, in nanoseconds.
type latStats struct {
	ns  []uint64
	div float64 // 2 for ping-pongs: latency = round trip / 2
}

func newLatStats(op string) *latStats {
	st := &latStats{div: 2}
	if op == "read" {
		st.div = 1
	}
	return st
}

// latStatsOf returns the statistics of samples (ticks of clk), which it
// converts to nanoseconds in place and keeps: a latency test keeps up to
// maxLatIters samples, which are not copied.
func latStatsOf(op string, samples []uint64, clk *tickClock) *latStats {
	for i, d := range samples {
		samples[i] = uint64(max(clk.dur(d), 0))
	}
	st := newLatStats(op)
	st.ns = samples
	return st
}

func (st *latStats) add(d time.Duration) { st.ns = append(st.ns, uint64(max(d, 0))) }

// latTail is perftest's LAT_MEASURE_TAIL: its t_typical and percentiles
// are order statistics of the samples without the largest two.
const latTail = 2

// result is the row (of at least one sample). t_min, t_max, t_avg and
// t_stdev are over all samples; t_typical and the percentiles are
// perftest's (print_report_lat): of the m = n-2 smallest samples, sorted,
// t_typical is the median (the mean of the middle two for an even m), the
// 99% percentile is sample ceil(0.99 m) (0-based) and the 99.9% one sample
// ceil(0.999 m). Before, they were an HDR histogram's bucket tops, which
// could exceed t_max (TestLatencyPercentilesWithinSamples).
func (st *latStats) result(size, iters int, inline bool) latResult {
	s := st.ns
	slices.Sort(s)
	n := len(s)
	var sum float64
	for _, x := range s {
		sum += float64(x)
	}
	mean := sum / float64(n)
	var sq float64
	for _, x := range s {
		d := float64(x) - mean
		sq += d * d
	}
	m := n - latTail
	if m < 1 {
		m = n // too few samples to leave out a tail
	}
	median := float64(s[m/2])
	if m%2 == 0 {
		median = (float64(s[m/2-1]) + median) / 2
	}
	at := func(q float64) float64 { return float64(s[min(int(math.Ceil(float64(m)*q)), n-1)]) }
	us := func(ns float64) float64 { return ns / st.div / 1e3 }
	return latResult{
		Size: size, Iters: iters,
		Min: us(float64(s[0])), Max: us(float64(s[n-1])),
		Typical: us(median),
		Avg:     us(mean), Std: us(math.Sqrt(sq / float64(n))),
		P99:    us(at(0.99)),
		P999:   us(at(0.999)),
		Inline: inline,
	}
}

// lastByte returns an aligned 32-bit word holding b[i] and the shift of
// that byte in it, so that a spinning reader can load it atomically while
// the device writes the buffer. b must extend to the end of the word.
func lastByte(b []byte, i int) (*uint32, uint) {
	w := i &^ 3
	p := (*uint32)(unsafe.Pointer(&b[w]))
	if littleEndian {
		return p, uint(i-w) * 8
	}
	return p, uint(3-(i-w)) * 8
}

var littleEndian = func() bool { x := uint32(1); return *(*byte)(unsafe.Pointer(&x)) == 1 }()

// waitByte spins until the byte (p, shift) equals v, reaping both sides'
// completions now and then so that errors surface.
func (lb *loopback) waitByte(p *uint32, shift uint, v byte) error {
	for spins := 1; ; spins++ {
		if byte(atomic.LoadUint32(p)>>shift) == v {
			return nil
		}
		if spins&63 == 0 {
			if err := lb.reapBoth(); err != nil {
				return err
			}
			if spins&(1<<16-1) == 0 {
				if err := lb.checkStall(); err != nil {
					return err
				}
			}
		}
	}
}

func (lb *loopback) reapBoth() error {
	if _, err := lb.a.reap(); err != nil {
		return err
	}
	_, err := lb.b.reap()
	return err
}

// checkStall fails when the current operation has been waiting too long:
// the first call of an operation starts its clock (the fast path reads no
// clock).
func (lb *loopback) checkStall() error {
	if lb.opStart.IsZero() {
		lb.opStart = time.Now()
		return nil
	}
	if time.Since(lb.opStart) > progressTimeout {
		return fmt.Errorf("%w for %v: the peer queue pair stopped answering", errNoProgress, progressTimeout)
	}
	return nil
}

// room waits until s may post one more signaled request.
func (lb *loopback) room(s *side, txDepth int) error {
	for s.outstanding >= txDepth {
		if err := lb.reapBoth(); err != nil {
			return err
		}
		if err := lb.checkStall(); err != nil {
			return err
		}
	}
	return nil
}

// startRound begins a round of a ping-pong of size bytes: it makes room
// for one more request in both send queues and returns the SGEs of the
// first size bytes of a's and b's regions, what each side sends.
func (lb *loopback) startRound(size, txDepth int) (aSGE, bSGE verbs.SGE, err error) {
	lb.opStart = time.Time{}
	if err = lb.room(lb.a, txDepth); err != nil {
		return
	}
	if err = lb.room(lb.b, txDepth); err != nil {
		return
	}
	if aSGE, err = lb.a.mr.SGE(0, size); err != nil {
		return
	}
	bSGE, err = lb.b.mr.SGE(0, size)
	return
}

// writePingPong: a writes to b, b sees the last byte change and writes
// back, a sees it. Returns the round trip in cycles() ticks.
func (lb *loopback) writePingPong(size int, v byte, flags verbs.SendFlags, txDepth int) (uint64, error) {
	a, b := lb.a, lb.b
	aSrc, bSrc := a.mr.Bytes()[:size], b.mr.Bytes()[:size]
	aDst, aShift := lastByte(a.mr.Bytes(), a.half+size-1)
	bDst, bShift := lastByte(b.mr.Bytes(), b.half+size-1)
	aSGE, bSGE, err := lb.startRound(size, txDepth)
	if err != nil {
		return 0, err
	}
	t0 := cycles()
	aSrc[size-1] = v
	if err := a.qp.PostWrite(uint64(v), flags, b.mr.Remote().At(uint64(b.half)), aSGE); err != nil {
		return 0, err
	}
	a.outstanding++
	if err := lb.waitByte(bDst, bShift, v); err != nil {
		return 0, err
	}
	bSrc[size-1] = v
	if err := b.qp.PostWrite(uint64(v), flags, a.mr.Remote().At(uint64(a.half)), bSGE); err != nil {
		return 0, err
	}
	b.outstanding++
	if err := lb.waitByte(aDst, aShift, v); err != nil {
		return 0, err
	}
	rtt := cycles() - t0
	return rtt, lb.reapBoth()
}

// waitRecv spins until s has a receive completion and consumes it,
// reposting one receive.
func (lb *loopback) waitRecv(s *side, rxDepth int) error {
	for spins := 1; s.recvs == 0; spins++ {
		if err := lb.reapBoth(); err != nil {
			return err
		}
		if spins&(1<<14-1) == 0 {
			if err := lb.checkStall(); err != nil {
				return err
			}
		}
	}
	s.recvs--
	return s.fillRecvs(rxDepth)
}

// sendPingPong: a sends to b, b receives and sends back, a receives.
func (lb *loopback) sendPingPong(size int, flags verbs.SendFlags, txDepth, rxDepth int) (uint64, error) {
	a, b := lb.a, lb.b
	aSGE, bSGE, err := lb.startRound(size, txDepth)
	if err != nil {
		return 0, err
	}
	t0 := cycles()
	if err := a.qp.PostSend(1, flags, aSGE); err != nil {
		return 0, err
	}
	a.outstanding++
	if err := lb.waitRecv(b, rxDepth); err != nil {
		return 0, err
	}
	if err := b.qp.PostSend(2, flags, bSGE); err != nil {
		return 0, err
	}
	b.outstanding++
	if err := lb.waitRecv(a, rxDepth); err != nil {
		return 0, err
	}
	return cycles() - t0, nil
}

// readOnce: a reads size bytes of b and waits for the completion.
func (lb *loopback) readOnce(size, txDepth int) (uint64, error) {
	a, b := lb.a, lb.b
	lb.opStart = time.Time{}
	if err := lb.room(a, txDepth); err != nil {
		return 0, err
	}
	dst, err := a.mr.SGE(a.half, size)
	if err != nil {
		return 0, err
	}
	done := a.sendDone
	t0 := cycles()
	if err := a.qp.PostRead(3, verbs.Signaled, b.mr.Remote().At(0), dst); err != nil {
		return 0, err
	}
	a.outstanding++
	for spins := 1; a.sendDone == done; spins++ {
		if _, err := a.reap(); err != nil {
			return 0, err
		}
		if spins&(1<<14-1) == 0 {
			if err := lb.checkStall(); err != nil {
				return 0, err
			}
		}
	}
	return cycles() - t0, nil
}
