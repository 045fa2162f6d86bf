package main

import (
	"fmt"
	"runtime"
	"time"

	"github.com/goverbs/verbs"
)

// bwResult is one row of a bandwidth test.
type bwResult struct {
	Size    int
	Iters   int
	PeakMB  float64 // MB/s, MB = 2^20 bytes
	AvgMB   float64
	MsgRate float64 // million messages per second
	Elapsed time.Duration

	CgoPerMsg float64 // cgo calls of this process per message in the measured loop
}

const mb = 1 << 20

// bandwidth streams iters messages of size bytes from a to b (write and
// send) or from b to a (read), keeping up to tx-depth requests outstanding,
// posting batches of --batch requests with one Submit each (the last one
// signaled) and polling completions into a preallocated slice.
func (lb *loopback) bandwidth(cfg benchConfig, size int) (bwResult, error) {
	a, b := lb.a, lb.b
	iters := cfg.iters
	// Touch the buffers so that page faults stay out of the measurement.
	// write, send: a's first half → b's second half; read: b's first half
	// → a's second half.
	fillPattern(a.mr.Bytes()[:size])
	fillPattern(b.mr.Bytes()[:size])
	clear(a.mr.Bytes()[a.half : a.half+size])
	clear(b.mr.Bytes()[b.half : b.half+size])
	localOff, remote := 0, b.mr.Remote().At(uint64(b.half))
	if cfg.op == "read" {
		localOff, remote = a.half, b.mr.Remote().At(0)
	}
	local, err := a.mr.SGE(localOff, size)
	if err != nil {
		return bwResult{}, err
	}
	if cfg.badRKey {
		remote.RKey = ^remote.RKey
	}
	if cfg.op == "send" {
		if err := b.fillRecvs(cfg.rxDepth); err != nil {
			return bwResult{}, err
		}
	}
	a.lastWRID, a.outstanding = 0, 0
	b.recvs = 0

	posted, completed := 0, 0
	wd := newWatchdog(fmt.Sprintf("%s of %d bytes", cfg.op, size))

	cgo0 := runtime.NumCgoCall()
	start := time.Now()
	meter := newPeakMeter(start, iters, size)
	for completed < iters || (cfg.op == "send" && b.recvs < iters) {
		// Post as many batches as the send queue (and, for send, the
		// receiver's posted receives) allow.
		progress := false
		for posted < iters {
			k := min(cfg.batch, iters-posted)
			if posted+k-completed > cfg.txDepth {
				break
			}
			if cfg.op == "send" && posted+k-b.recvs > b.recvPosted {
				break
			}
			queueBW(a.batch, &cfg, posted, k, iters, lb.inline, remote, local)
			if err := a.batch.Submit(); err != nil {
				return bwResult{}, fmt.Errorf("%s of %d bytes: %w", cfg.op, size, err)
			}
			posted += k
			progress = true
			a.yield()
		}
		n, err := a.reap()
		a.yield()
		if err != nil {
			return bwResult{}, fmt.Errorf("%s of %d bytes: %w", cfg.op, size, err)
		}
		if n > 0 {
			completed = int(a.lastWRID)
			progress = true
			meter.update(completed)
		}
		if cfg.op == "send" {
			before := b.recvs
			if _, err := b.reap(); err != nil {
				return bwResult{}, fmt.Errorf("%s of %d bytes: receiver: %w", cfg.op, size, err)
			}
			if b.recvs > before {
				progress = true
				if err := b.fillRecvs(cfg.rxDepth); err != nil {
					return bwResult{}, fmt.Errorf("%s of %d bytes: receiver: %w", cfg.op, size, err)
				}
			}
		}
		if progress {
			wd.progress()
		} else if err := wd.stalled(); err != nil {
			return bwResult{}, err
		}
	}
	elapsed := time.Since(start)
	cgo := runtime.NumCgoCall() - cgo0
	if err := lb.verify(cfg.op, size); err != nil {
		return bwResult{}, err
	}
	res := bwStats(size, iters, elapsed, meter.peak)
	res.CgoPerMsg = float64(cgo) / float64(iters)
	return res, nil
}

// bwStats computes a bandwidth row as perftest does: bytes over the time
// from the first post to the last completion.
func bwStats(size, iters int, elapsed time.Duration, peak float64) bwResult {
	sec := elapsed.Seconds()
	res := bwResult{Size: size, Iters: iters, Elapsed: elapsed}
	if sec > 0 {
		res.AvgMB = float64(iters) * float64(size) / sec / mb
		res.MsgRate = float64(iters) / sec / 1e6
	}
	res.PeakMB = max(peak, res.AvgMB)
	return res
}

// fillPattern writes a recognisable pattern (and faults the pages in).
func fillPattern(b []byte) {
	for i := range b {
		b[i] = byte(i*7 + 1)
	}
}

// verify checks that the data arrived: the destination holds the pattern.
func (lb *loopback) verify(op string, size int) error {
	dst := lb.b
	if op == "read" {
		dst = lb.a
	}
	got := dst.mr.Bytes()[dst.half : dst.half+size]
	for i, c := range got {
		if c != byte(i*7+1) {
			return fmt.Errorf("%s of %d bytes: data check failed at byte %d: got %#x, want %#x", op, size, i, c, byte(i*7+1))
		}
	}
	return nil
}

// queueBW queues the bandwidth test's requests posted+1 .. posted+k of
// iters on batch (ids are 1-based), signaling every cfg.cqMod-th one and
// the last; writes and sends of at most inline bytes (the queue pair's
// max inline data: -I) go inline, as perftest's do. Before, -I did
// nothing in the bandwidth tests (TestBenchInlineBandwidth).
func queueBW(batch *verbs.RCBatch, cfg *benchConfig, posted, k, iters, inline int, remote verbs.RemoteAddr, local verbs.SGE) {
	inl := cfg.op != "read" && int(local.Length) <= inline
	for j := range k {
		id := uint64(posted + j + 1)
		var r *verbs.Request
		switch cfg.op {
		case "write":
			r = batch.Write(id, remote, local)
		case "read":
			r = batch.Read(id, remote, local)
		default:
			r = batch.Send(id, local)
		}
		if int(id)%cfg.cqMod == 0 || int(id) == iters {
			r.Signaled()
		}
		if inl {
			r.Inline()
		}
	}
}

// peakMeter tracks perftest's BW peak: the best bandwidth over windows of
// about a sixteenth of the iterations, sampled as completions arrive.
type peakMeter struct {
	iters, size  int
	window, next int
	markT        time.Time
	markN        int
	peak         float64 // MB/s
}

func newPeakMeter(start time.Time, iters, size int) peakMeter {
	w := max(iters/16, 1)
	return peakMeter{iters: iters, size: size, window: w, next: w, markT: start}
}

// update records that completed requests have completed; it reads the
// clock only when a window ends.
func (m *peakMeter) update(completed int) {
	if completed < m.next && completed != m.iters {
		return
	}
	now := time.Now()
	if dt := now.Sub(m.markT).Seconds(); dt > 0 {
		m.peak = max(m.peak, float64(completed-m.markN)*float64(m.size)/dt/mb)
	}
	m.markT, m.markN = now, completed
	m.next = completed + m.window
}
