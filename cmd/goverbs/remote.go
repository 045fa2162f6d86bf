package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/goverbs/verbs"
)

// Two-process bench, in perftest's topology: a server (--server) and a
// client (given the server's host) each own one RC queue pair on their
// device, exchange endpoints and memory regions over TCP (oob.go) and run
// the test against each other. The client measures and prints the
// results; the server prints the same rows, received from the client.

// remoteVersion is the version of the hello/welcome parameters.
const remoteVersion = 1

// peerParams is the hello (client) and welcome (server) message: what the
// two sides must agree on, and what the peer needs to reach this side.
type peerParams struct {
	Version  int                `json:"version"`
	Test     string             `json:"test"`
	Lat      bool               `json:"lat"`
	Sizes    []int              `json:"sizes"`
	Iters    int                `json:"iters"`
	Device   string             `json:"device"`
	Provider string             `json:"provider"`
	Endpoint []byte             `json:"endpoint"` // verbs.Endpoint.MarshalBinary
	Region   verbs.RemoteRegion `json:"region"`
	// DstOffset is where in Region the peer writes (and, for read,
	// SrcOffset where it reads from).
	DstOffset uint64 `json:"dst_offset"`
	SrcOffset uint64 `json:"src_offset"`
}

// syncMsg paces the sizes: start, ready, done, ok.
type syncMsg struct {
	Phase string `json:"phase"`
	Size  int    `json:"size"`
}

// resultMsg is a result row, sent by the client to the server.
type resultMsg struct {
	BW  *bwResult  `json:"bw,omitempty"`
	Lat *latResult `json:"lat,omitempty"`
}

// remote is this process's side of a two-process bench.
type remote struct {
	cfg     benchConfig
	server  bool
	s       *side
	oob     *oobConn
	closers []func() error

	peer      peerParams
	peerEP    verbs.Endpoint
	transport string
	pathMTU   verbs.MTU
	port      verbs.PortAttr
	inline    int

	// interrupt is ctx's error once it ended (SIGINT): the measurement
	// loops, which do not block, check it.
	interrupt atomic.Pointer[error]
}

// interrupted returns ctx's error once ctx ended.
func (r *remote) interrupted() error {
	if p := r.interrupt.Load(); p != nil {
		return *p
	}
	return nil
}

func (r *remote) Close() error {
	var errs []error
	for i := len(r.closers) - 1; i >= 0; i-- {
		errs = append(errs, r.closers[i]())
	}
	r.closers = nil
	return errors.Join(errs...)
}

// params returns this side's hello/welcome.
func (r *remote) params() (peerParams, error) {
	wire, err := r.s.ep.MarshalBinary()
	if err != nil {
		return peerParams{}, err
	}
	return peerParams{
		Version: remoteVersion, Test: r.cfg.op, Lat: r.cfg.lat, Sizes: r.cfg.sizes, Iters: r.cfg.iters,
		Device: r.s.ctx.Name(), Provider: r.s.ctx.Provider(), Endpoint: wire,
		Region: r.s.mr.Remote(), DstOffset: uint64(r.s.half), SrcOffset: 0,
	}, nil
}

// agree checks that the peer runs the same test. Its errors name the
// sides (server, client), not "this side": the server's go to the
// client too, which prints them.
func (r *remote) agree(p peerParams) error {
	cfg := r.cfg
	me, peer := "the client", "the server"
	if r.server {
		me, peer = peer, me
	}
	mode := func(lat bool) string {
		if lat {
			return "latency (--lat)"
		}
		return "bandwidth"
	}
	switch {
	case p.Version != remoteVersion:
		return fmt.Errorf("%s speaks version %d of the bench parameters, %s version %d", peer, p.Version, me, remoteVersion)
	case p.Test != cfg.op || p.Lat != cfg.lat:
		return fmt.Errorf("%s runs the %s %s test, %s %s %s: run both with the same test", peer, printable(p.Test), mode(p.Lat), me, cfg.op, mode(cfg.lat))
	case !slices.Equal(p.Sizes, cfg.sizes):
		return fmt.Errorf("message sizes differ: %s uses %s, %s %s: give both the same -s or --all", peer, sizesString(p.Sizes), me, sizesString(cfg.sizes))
	case p.Iters != cfg.iters:
		return fmt.Errorf("iterations differ: %s uses -n %d, %s -n %d", peer, p.Iters, me, cfg.iters)
	case !deviceName(p.Device):
		return fmt.Errorf("%s's device name %q is not a device name", peer, p.Device)
	case !fits(p.Region, p.DstOffset, slices.Max(p.Sizes)) || !fits(p.Region, p.SrcOffset, slices.Max(p.Sizes)):
		return fmt.Errorf("%s's memory region (%d bytes) is too small for its offsets", peer, p.Region.Len)
	}
	return nil
}

// deviceName reports whether the peer's device name is printable in a
// table: at most 64 printable characters without spaces (the report
// prints it; a control character could forge its rows or drive the
// terminal).
func deviceName(s string) bool {
	return s != "" && len(s) <= 64 && !strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) || unicode.IsSpace(r) })
}

// fits reports whether size bytes at off lie within r (off+size may
// wrap around).
func fits(r verbs.RemoteRegion, off uint64, size int) bool {
	return off <= r.Len && r.Len-off >= uint64(size)
}

func sizesString(s []int) string {
	switch len(s) {
	case 0:
		return "no sizes"
	case 1:
		return "-s " + strconv.Itoa(s[0])
	}
	return fmt.Sprintf("%d sizes from %d to %d", len(s), s[0], s[len(s)-1])
}

// benchRemote runs the server or client side of cfg.
func benchRemote(ctx context.Context, cfg benchConfig, w, log io.Writer) (err error) {
	r := &remote{cfg: cfg, server: cfg.server}
	defer context.AfterFunc(ctx, func() {
		err := ctx.Err()
		r.interrupt.Store(&err)
	})()
	defer func() {
		if cerr := r.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	// The handshake is bounded by --timeout; the measurement only by ctx
	// and the progress watchdogs.
	hctx, hcancel := context.WithTimeout(ctx, cfg.timeout)
	defer hcancel()
	if r.server {
		addr := net.JoinHostPort(cfg.bind, strconv.Itoa(cfg.port))
		r.oob, err = acceptOOB(hctx, addr, cfg.token, func(a net.Addr) {
			if cfg.token == "" && !isLoopbackAddr(a) {
				fmt.Fprintf(log, "goverbs bench: warning: no --token: the first client to connect on %v gets this process' endpoint and memory region key, in clear text\n", a)
			}
			fmt.Fprintf(log, "goverbs bench: waiting for a client on %v (%s)\n", a, cfg.op)
		}, log)
	} else {
		r.oob, err = dialOOB(hctx, net.JoinHostPort(cfg.host, strconv.Itoa(cfg.port)), cfg.token)
	}
	if err != nil {
		return err
	}
	r.closers = append(r.closers, r.oob.Close)
	if err := r.setup(hctx); err != nil {
		return r.oob.fail(err)
	}
	out := newReporter(w, cfg, r.info())
	out.header()
	for _, size := range cfg.sizes {
		res, err := r.runSize(ctx, size)
		if err != nil {
			return r.oob.fail(err)
		}
		if res.BW != nil {
			out.bwRow(*res.BW)
		} else {
			out.latRow(*res.Lat)
		}
	}
	out.footer()
	return nil
}

// setup opens the device, creates the QP, exchanges the parameters and
// connects.
func (r *remote) setup(ctx context.Context) error {
	cfg := r.cfg
	dev := cfg.dev
	if dev == "" {
		dev = verbs.DefaultDevice()
	}
	role := "client"
	if r.server {
		role = "server"
	}
	s, err := openSide(role, dev, cfg, slices.Max(cfg.sizes), &r.closers)
	if err != nil {
		return err
	}
	r.s = s
	if s.ep, err = s.qp.Endpoint(); err != nil {
		return err
	}
	mine, err := r.params()
	if err != nil {
		return err
	}
	if r.server {
		if err := r.oob.recv(ctx, frameHello, &r.peer); err != nil {
			return err
		}
		if err := r.agree(r.peer); err != nil {
			return err
		}
		if err := r.oob.send(ctx, frameWelcome, mine); err != nil {
			return err
		}
	} else {
		if err := r.oob.send(ctx, frameHello, mine); err != nil {
			return err
		}
		if err := r.oob.recv(ctx, frameWelcome, &r.peer); err != nil {
			if errors.Is(err, errClosed) && cfg.token == "" {
				return fmt.Errorf("%w (a server with --token closes the connection of a client without it)", err)
			}
			return err
		}
		if err := r.agree(r.peer); err != nil {
			return err
		}
	}
	if err := r.peerEP.UnmarshalBinary(r.peer.Endpoint); err != nil {
		return fmt.Errorf("the peer's endpoint: %w", err)
	}
	if err := s.qp.Connect(r.peerEP); err != nil {
		return err
	}
	attr, err := s.qp.Query()
	if err != nil {
		return err
	}
	r.pathMTU = attr.PathMTU
	if r.port, err = s.ctx.QueryPort(s.ep.Port); err != nil {
		return err
	}
	r.inline = s.qp.Cap().MaxInlineData
	if devs, _ := verbs.Devices(); devs != nil {
		for _, d := range devs {
			if d.Name == s.ctx.Name() {
				r.transport = d.Transport
			}
		}
	}
	return nil
}

func (r *remote) info() *benchInfo {
	mode := "OFF (server; client " + r.oob.c.RemoteAddr().String() + ")"
	if !r.server {
		mode = "OFF (client of " + r.oob.c.RemoteAddr().String() + ")"
	}
	return &benchInfo{
		dev: r.s.ctx.Name(), dev2: r.peer.Device, provider: r.s.ctx.Provider(), transport: r.transport,
		mode: mode, pathMTU: r.pathMTU, port: r.port, inline: r.inline, local: r.s.ep, remote: r.peerEP,
	}
}

// sync sends this side's phase and waits for the peer's.
func (r *remote) sync(ctx context.Context, send, want string, size int) error {
	if err := r.oob.send(ctx, frameSync, syncMsg{Phase: send, Size: size}); err != nil {
		return err
	}
	return r.expect(ctx, want, size)
}

func (r *remote) expect(ctx context.Context, want string, size int) error {
	if want != "done" {
		// The peer answers at once: bound the wait by --timeout. Only the
		// server's wait for done spans the client's measurement.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.cfg.timeout)
		defer cancel()
	}
	var m syncMsg
	var err error
	if want == "done" {
		err = r.oob.recvIdle(ctx, frameSync, &m, max(r.cfg.timeout, aliveWait))
	} else {
		err = r.oob.recv(ctx, frameSync, &m)
	}
	if err != nil {
		return err
	}
	if m.Phase != want || m.Size != size {
		return fmt.Errorf("protocol error: %s sent %s for %d bytes, want %s for %d bytes", r.oob.peer, printable(m.Phase), m.Size, want, size)
	}
	return nil
}

// runSize runs one message size; both sides return the client's results.
func (r *remote) runSize(ctx context.Context, size int) (resultMsg, error) {
	s, cfg := r.s, r.cfg
	// Prepare: the source holds the pattern, the destination is clear,
	// receives are posted.
	fillPattern(s.mr.Bytes()[:size])
	clear(s.mr.Bytes()[s.half : s.half+size])
	s.lastWRID, s.outstanding, s.sendDone, s.recvs = 0, 0, 0, 0
	if cfg.op == "send" {
		if err := s.fillRecvs(cfg.rxDepth); err != nil {
			return resultMsg{}, err
		}
	}
	var res resultMsg
	var err error
	if r.server {
		if err := r.expect(ctx, "start", size); err != nil {
			return res, err
		}
		if err := r.oob.send(ctx, frameSync, syncMsg{Phase: "ready", Size: size}); err != nil {
			return res, err
		}
		switch {
		case cfg.lat && cfg.op == "write":
			_, err = r.writeLat(size)
		case cfg.lat && cfg.op == "send":
			_, err = r.sendLat(size)
		case !cfg.lat && cfg.op == "send":
			err = r.recvBW(ctx, size)
		}
		if err != nil {
			return res, err
		}
		if err := r.expect(ctx, "done", size); err != nil {
			return res, err
		}
		if !cfg.lat && cfg.op != "read" {
			if err := verifyPattern(cfg.op, s.mr.Bytes()[s.half:s.half+size]); err != nil {
				return res, err
			}
		}
		if err := r.oob.send(ctx, frameSync, syncMsg{Phase: "ok", Size: size}); err != nil {
			return res, err
		}
		rctx, cancel := context.WithTimeout(ctx, cfg.timeout)
		defer cancel()
		if err := r.oob.recv(rctx, frameResult, &res); err != nil {
			return res, err
		}
		if err := r.checkResult(res, size); err != nil {
			return res, err
		}
		return res, nil
	}

	if err := r.sync(ctx, "start", "ready", size); err != nil {
		return res, err
	}
	stop := r.alive(ctx)
	switch {
	case cfg.lat && cfg.op == "write":
		var l latResult
		l, err = r.writeLat(size)
		res.Lat = &l
	case cfg.lat && cfg.op == "send":
		var l latResult
		l, err = r.sendLat(size)
		res.Lat = &l
	case cfg.lat:
		var l latResult
		l, err = r.readLat(size)
		res.Lat = &l
	default:
		var b bwResult
		b, err = r.streamBW(size)
		res.BW = &b
	}
	stop()
	if err != nil {
		return res, err
	}
	if err := r.sync(ctx, "done", "ok", size); err != nil {
		return res, err
	}
	if cfg.op == "read" && !cfg.lat {
		if err := verifyPattern(cfg.op, s.mr.Bytes()[s.half:s.half+size]); err != nil {
			return res, err
		}
	}
	return res, r.oob.send(ctx, frameResult, res)
}

// checkResult checks that the client's result row (the server prints it)
// is one of the test the server ran: exactly one row, of its mode, of
// this size and of -n iterations. Before, the server printed any row
// (TestServerChecksResultRow).
func (r *remote) checkResult(res resultMsg, size int) error {
	if (res.BW == nil) == (res.Lat == nil) {
		return fmt.Errorf("protocol error: %s sent a result without exactly one row", r.oob.peer)
	}
	kind, rowSize, rowIters := "bandwidth", 0, 0
	if res.Lat != nil {
		kind, rowSize, rowIters = "latency", res.Lat.Size, res.Lat.Iters
	} else {
		rowSize, rowIters = res.BW.Size, res.BW.Iters
	}
	want := "bandwidth"
	if r.cfg.lat {
		want = "latency"
	}
	if kind != want || rowSize != size || rowIters != r.cfg.iters {
		return fmt.Errorf("protocol error: %s sent a %s result of %d bytes x %d iterations, want %s of %d bytes x %d",
			r.oob.peer, kind, rowSize, rowIters, want, size, r.cfg.iters)
	}
	return nil
}

// alive sends alive frames every aliveEvery until the returned function
// is called, which returns once they stopped (the client, while it
// measures: see oob.go).
func (r *remote) alive(ctx context.Context) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(aliveEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				if r.oob.send(ctx, frameAlive, nil) != nil {
					return // the measurement or done finds out
				}
			case <-quit:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}

// verifyPattern checks that the destination holds fillPattern's bytes.
func verifyPattern(op string, got []byte) error {
	for i, c := range got {
		if c != byte(i*7+1) {
			return fmt.Errorf("%s of %d bytes: data check failed at byte %d: got %#x, want %#x", op, len(got), i, c, byte(i*7+1))
		}
	}
	return nil
}

// streamBW is the client's bandwidth loop: iters messages, up to tx-depth
// outstanding, batches of --batch requests posted with one Submit each
// (the last one signaled), completions polled into a preallocated slice.
// For send, the server keeps receives posted; RNR retries cover a server
// that falls behind.
func (r *remote) streamBW(size int) (bwResult, error) {
	s, cfg := r.s, r.cfg
	iters := cfg.iters
	localOff, remote := 0, r.peer.Region.At(r.peer.DstOffset)
	if cfg.op == "read" {
		localOff, remote = s.half, r.peer.Region.At(r.peer.SrcOffset)
	}
	local, err := s.mr.SGE(localOff, size)
	if err != nil {
		return bwResult{}, err
	}
	posted, completed := 0, 0
	wd := newWatchdog(fmt.Sprintf("%s of %d bytes", cfg.op, size))
	cgo0 := runtime.NumCgoCall()
	start := time.Now()
	meter := newPeakMeter(start, iters, size)
	for completed < iters {
		if err := r.interrupted(); err != nil {
			return bwResult{}, fmt.Errorf("%s of %d bytes: %w", cfg.op, size, err)
		}
		progress := false
		for posted < iters {
			k := min(cfg.batch, iters-posted)
			if posted+k-completed > cfg.txDepth {
				break
			}
			queueBW(s.batch, &cfg, posted, k, iters, r.inline, remote, local)
			if err := s.batch.Submit(); err != nil {
				return bwResult{}, fmt.Errorf("%s of %d bytes: %w", cfg.op, size, err)
			}
			posted += k
			progress = true
			s.yield()
		}
		n, err := s.reap()
		s.yield()
		if err != nil {
			return bwResult{}, fmt.Errorf("%s of %d bytes: %w", cfg.op, size, err)
		}
		if n > 0 {
			completed = int(s.lastWRID)
			progress = true
			meter.update(completed)
		}
		if progress {
			wd.progress()
		} else if err := wd.stalled(); err != nil {
			return bwResult{}, err
		}
	}
	elapsed := time.Since(start)
	res := bwStats(size, iters, elapsed, meter.peak)
	res.CgoPerMsg = float64(runtime.NumCgoCall()-cgo0) / float64(iters)
	return res, nil
}

// recvBW is the server's side of the send bandwidth test: it receives
// iters messages, keeping rx-depth receives posted.
func (r *remote) recvBW(ctx context.Context, size int) error {
	s, cfg := r.s, r.cfg
	wd := newWatchdog(fmt.Sprintf("receiving %d messages of %d bytes", cfg.iters, size))
	for s.recvs < cfg.iters {
		n, err := s.reap()
		s.yield()
		if err != nil {
			return err
		}
		if n == 0 {
			if err := wd.stalled(); err != nil {
				return err
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			continue
		}
		wd.progress()
		if err := s.fillRecvs(cfg.rxDepth); err != nil {
			return err
		}
	}
	return nil
}

// latFlags returns the flags of a latency request of size bytes and
// whether it is sent inline.
func (r *remote) latFlags(size int) (verbs.SendFlags, bool) {
	if size <= r.inline && r.cfg.op != "read" {
		return verbs.Inline, true
	}
	return 0, false
}

// signalEvery is how often a latency loop signals a request: signaling
// every request would cost a completion and a poll per iteration; every
// tx-depth/4th (at most 64th) keeps the send queue from filling.
func (r *remote) signalEvery() int { return max(min(r.cfg.txDepth/4, 64), 1) }

// post posts one latency request on s, signaled every signalEvery
// requests. Before a signaled one it reaps completions until the send
// queue has room for it and the unsignaled requests that follow: each
// outstanding signaled request stands for signalEvery requests.
func (r *remote) post(i int, flags verbs.SendFlags, op func(verbs.SendFlags) error) error {
	s := r.s
	every := r.signalEvery()
	if (i+1)%every == 0 {
		flags |= verbs.Signaled
		for s.outstanding >= max(r.cfg.txDepth/every-1, 1) {
			if _, err := s.reapBusy(); err != nil {
				return err
			}
		}
		s.outstanding++
	}
	return op(flags)
}

// writeLat is the RDMA write ping-pong of both sides (ib_write_lat): the
// client writes iteration i's value into the last byte of the server's
// buffer, the server sees it and writes it back, the client sees it. The
// client's samples are the round trips; the server returns no result.
func (r *remote) writeLat(size int) (latResult, error) {
	s := r.s
	flags, inline := r.latFlags(size)
	src := s.mr.Bytes()[:size]
	dst, shift := lastByte(s.mr.Bytes(), s.half+size-1)
	remote := r.peer.Region.At(r.peer.DstOffset)
	sge, err := s.mr.SGE(0, size)
	if err != nil {
		return latResult{}, err
	}
	write := func(f verbs.SendFlags) error { return s.qp.PostWrite(0, f, remote, sge) }
	n := latWarmup + r.cfg.iters
	samples := make([]uint64, 0, r.cfg.iters)
	clk := startTicks()
	cgo0 := runtime.NumCgoCall()
	for i := range n {
		if err := r.interrupted(); err != nil {
			return latResult{}, fmt.Errorf("%s latency, iteration %d: %w", r.cfg.op, i, err)
		}
		s.yield()
		v := byte(i%255 + 1)
		if r.server {
			if err := r.waitByte(dst, shift, v); err != nil {
				return latResult{}, fmt.Errorf("write latency, iteration %d: %w", i, err)
			}
		}
		t0 := cycles()
		src[size-1] = v
		if err := r.post(i, flags, write); err != nil {
			return latResult{}, fmt.Errorf("write latency, iteration %d: %w", i, err)
		}
		if r.server {
			continue
		}
		if err := r.waitByte(dst, shift, v); err != nil {
			return latResult{}, fmt.Errorf("write latency, iteration %d: %w", i, err)
		}
		if i >= latWarmup {
			samples = append(samples, cycles()-t0)
		}
	}
	res := latSummary(r.cfg.op, size, r.cfg.iters, inline, samples, &clk, cgo0)
	return res, r.drain()
}

// latSummary turns the samples (cycles() ticks, the client's; none on the
// server) into a result row.
func latSummary(op string, size, iters int, inline bool, samples []uint64, clk *tickClock, cgo0 int64) latResult {
	cgo := runtime.NumCgoCall() - cgo0
	clk.stop()
	res := latResult{Size: size, Iters: iters, Inline: inline}
	if len(samples) > 0 {
		res = latStatsOf(op, samples, clk).result(size, iters, inline)
	}
	res.CgoPerMsg = float64(cgo) / float64(iters+latWarmup)
	return res
}

// waitByte spins until the byte (p, shift) is v, reaping completions now
// and then (every 4096 spins: a Poll is a cgo call, and the byte landing
// during one is seen only after it) so that a failed request surfaces, and
// failing when the peer stops answering.
func (r *remote) waitByte(p *uint32, shift uint, v byte) error {
	wd := newWatchdog("waiting for the peer's write")
	for spins := 1; ; spins++ {
		if byte(atomic.LoadUint32(p)>>shift) == v {
			return nil
		}
		if spins&4095 == 0 {
			if err := r.interrupted(); err != nil {
				return err
			}
			if _, err := r.s.reap(); err != nil {
				return err
			}
			if err := wd.stalled(); err != nil {
				return err
			}
		}
	}
}

// sendLat is the send ping-pong of both sides (ib_send_lat): the client
// sends, the server receives and sends back, the client receives.
func (r *remote) sendLat(size int) (latResult, error) {
	s := r.s
	flags, inline := r.latFlags(size)
	sge, err := s.mr.SGE(0, size)
	if err != nil {
		return latResult{}, err
	}
	send := func(f verbs.SendFlags) error { return s.qp.PostSend(0, f, sge) }
	n := latWarmup + r.cfg.iters
	samples := make([]uint64, 0, r.cfg.iters)
	clk := startTicks()
	cgo0 := runtime.NumCgoCall()
	for i := range n {
		if err := r.interrupted(); err != nil {
			return latResult{}, fmt.Errorf("%s latency, iteration %d: %w", r.cfg.op, i, err)
		}
		s.yield()
		if r.server {
			if err := r.waitRecv(); err != nil {
				return latResult{}, fmt.Errorf("send latency, iteration %d: %w", i, err)
			}
		}
		t0 := cycles()
		if err := r.post(i, flags, send); err != nil {
			return latResult{}, fmt.Errorf("send latency, iteration %d: %w", i, err)
		}
		if r.server {
			continue
		}
		if err := r.waitRecv(); err != nil {
			return latResult{}, fmt.Errorf("send latency, iteration %d: %w", i, err)
		}
		if i >= latWarmup {
			samples = append(samples, cycles()-t0)
		}
	}
	res := latSummary(r.cfg.op, size, r.cfg.iters, inline, samples, &clk, cgo0)
	return res, r.drain()
}

// waitRecv polls until a message arrived, consumes it and keeps rx-depth
// receives posted.
func (r *remote) waitRecv() error {
	s := r.s
	wd := newWatchdog("waiting for the peer's send")
	for s.recvs == 0 {
		n, err := s.reapBusy()
		if err != nil {
			return err
		}
		if n == 0 {
			if err := r.interrupted(); err != nil {
				return err
			}
			if err := wd.stalled(); err != nil {
				return err
			}
		}
	}
	s.recvs--
	return s.fillRecvs(r.cfg.rxDepth)
}

// readLat is the client's RDMA read loop (ib_read_lat): post a read, poll
// its completion.
func (r *remote) readLat(size int) (latResult, error) {
	s := r.s
	remote := r.peer.Region.At(r.peer.SrcOffset)
	sge, err := s.mr.SGE(s.half, size)
	if err != nil {
		return latResult{}, err
	}
	n := latWarmup + r.cfg.iters
	samples := make([]uint64, 0, r.cfg.iters)
	clk := startTicks()
	cgo0 := runtime.NumCgoCall()
	for i := range n {
		if err := r.interrupted(); err != nil {
			return latResult{}, fmt.Errorf("%s latency, iteration %d: %w", r.cfg.op, i, err)
		}
		s.yield()
		done := s.sendDone
		t0 := cycles()
		if err := s.qp.PostRead(uint64(i), verbs.Signaled, remote, sge); err != nil {
			return latResult{}, fmt.Errorf("read latency, iteration %d: %w", i, err)
		}
		s.outstanding++
		wd := newWatchdog("waiting for the read")
		for s.sendDone == done {
			m, err := s.reapBusy()
			if err != nil {
				return latResult{}, fmt.Errorf("read latency, iteration %d: %w", i, err)
			}
			if m == 0 {
				if err := r.interrupted(); err != nil {
					return latResult{}, err
				}
				if err := wd.stalled(); err != nil {
					return latResult{}, err
				}
			}
		}
		if i >= latWarmup {
			samples = append(samples, cycles()-t0)
		}
	}
	return latSummary("read", size, r.cfg.iters, false, samples, &clk, cgo0), nil
}

// drain waits for the signaled requests still outstanding.
func (r *remote) drain() error {
	wd := newWatchdog("waiting for the last completions")
	for r.s.outstanding > 0 {
		n, err := r.s.reapBusy()
		if err != nil {
			return err
		}
		if n == 0 {
			if err := r.interrupted(); err != nil {
				return err
			}
			if err := wd.stalled(); err != nil {
				return err
			}
		}
	}
	return nil
}

// isLoopbackAddr reports whether a is a loopback IP address.
func isLoopbackAddr(a net.Addr) bool {
	t, ok := a.(*net.TCPAddr)
	return ok && t.IP.IsLoopback()
}
