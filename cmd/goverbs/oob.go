package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"
)

// Out-of-band exchange of a two-process bench (server and client), over
// one TCP connection. Every message is a frame:
//
//	magic   4 bytes  "GVB2" (the last byte is the protocol version)
//	type    1 byte   frameHello, frameWelcome, frameSync, frameResult, frameError, frameAlive
//	zero    3 bytes
//	length  4 bytes  big endian, at most maxFrame (0 for frameAlive)
//	payload length bytes of JSON
//
// The client sends hello (its parameters, endpoint and memory region), the
// server answers welcome (its own) or error. Then, for every message size:
// client sync{start} → server sync{ready} → both measure → client
// sync{done} → server sync{ok} (after checking the data it received) →
// client result (the row the server prints too). An error frame, from
// either side at any point, ends the run on both with its message.
//
// While it measures, the client sends an empty alive frame every
// aliveEvery, which the server skips: its wait for done, which spans the
// measurement, is bounded by --timeout (at least aliveWait) without a
// frame, so a client that stops or vanishes without closing the
// connection (SIGSTOP, a host gone) does not hold the server for ever.
// Version 1 had no alive frames.

const (
	frameMagic = "GVB2"
	maxFrame   = 1 << 20

	frameHello   = 1
	frameWelcome = 2
	frameSync    = 3
	frameResult  = 4
	frameError   = 5
	frameAlive   = 6

	// aliveEvery is how often a measuring client sends frameAlive, and
	// aliveWait the least time the server waits without a frame.
	aliveEvery = 250 * time.Millisecond
	aliveWait  = 4 * aliveEvery
)

var frameNames = map[byte]string{frameHello: "hello", frameWelcome: "welcome", frameSync: "sync", frameResult: "result", frameError: "error", frameAlive: "alive"}

// oobConn is the framed connection. Every call takes a context: its end
// (and deadline) interrupts a blocked read or write. Sends may come from
// two goroutines (the client's alive frames); receives from one.
type oobConn struct {
	c    net.Conn
	peer string
	wmu  sync.Mutex // a frame is written whole
}

// errAlive is what recvOne returns for an alive frame.
var errAlive = errors.New("alive")

// errClosed: the peer closed the connection.
var errClosed = errors.New("the peer closed the connection")

// errPeer is wrapped by the errors the peer reported in an error frame.
var errPeer = errors.New("the peer failed")

func (o *oobConn) Close() error { return o.c.Close() }

// withCtx arranges for ctx's end or deadline to interrupt I/O on o until
// the returned function is called.
func (o *oobConn) withCtx(ctx context.Context) func() {
	dl, _ := ctx.Deadline()
	o.c.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { o.c.SetDeadline(time.Unix(1, 0)) })
	return func() { stop() }
}

// ctxErr prefers ctx's error over the I/O error it caused.
func ctxErr(ctx context.Context, err error) error {
	cerr := ctx.Err()
	if dl, ok := ctx.Deadline(); cerr == nil && ok && !time.Now().Before(dl) {
		cerr = context.DeadlineExceeded // the socket's deadline fired first
	}
	if cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

func (o *oobConn) send(ctx context.Context, typ byte, v any) error {
	var payload []byte
	if typ != frameAlive {
		var err error
		if payload, err = json.Marshal(v); err != nil {
			return err
		}
	}
	if len(payload) > maxFrame {
		return fmt.Errorf("out-of-band %s message of %d bytes exceeds %d", frameNames[typ], len(payload), maxFrame)
	}
	buf := make([]byte, 12, 12+len(payload))
	copy(buf, frameMagic)
	buf[4] = typ
	binary.BigEndian.PutUint32(buf[8:], uint32(len(payload)))
	buf = append(buf, payload...)
	o.wmu.Lock()
	defer o.wmu.Unlock()
	if typ != frameAlive {
		// The write deadline only: an alive frame's does not touch the
		// reads (the server's are bounded from its own context).
		defer o.withCtx(ctx)()
	} else {
		o.c.SetWriteDeadline(time.Now().Add(aliveWait))
		defer o.c.SetWriteDeadline(time.Time{})
	}
	if _, err := o.c.Write(buf); err != nil {
		return fmt.Errorf("sending %s to %s: %w", frameNames[typ], o.peer, ctxErr(ctx, err))
	}
	return nil
}

// recv reads the next frame into v, which must be of type want, skipping
// alive frames. An error frame is returned as an error wrapping errPeer.
func (o *oobConn) recv(ctx context.Context, want byte, v any) error {
	for {
		if err := o.recvOne(ctx, want, v); err != errAlive {
			return err
		}
	}
}

// recvIdle is recv, failing when no frame (alive frames included) came
// for idle.
func (o *oobConn) recvIdle(ctx context.Context, want byte, v any, idle time.Duration) error {
	for {
		ictx, cancel := context.WithTimeout(ctx, idle)
		err := o.recvOne(ictx, want, v)
		cancel()
		if err != errAlive {
			if err != nil && ctx.Err() == nil && ictx.Err() != nil {
				return fmt.Errorf("%w: not a word from %s for %v (it sends one every %v while it measures)", err, o.peer, idle, aliveEvery)
			}
			return err
		}
	}
}

// recvOne is recv, returning errAlive for an alive frame.
func (o *oobConn) recvOne(ctx context.Context, want byte, v any) error {
	defer o.withCtx(ctx)()
	var hdr [12]byte
	if _, err := io.ReadFull(o.c, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
			return fmt.Errorf("waiting for %s from %s: %w", frameNames[want], o.peer, errClosed)
		}
		return fmt.Errorf("waiting for %s from %s: %w", frameNames[want], o.peer, ctxErr(ctx, err))
	}
	if string(hdr[:4]) != frameMagic {
		if string(hdr[:3]) == frameMagic[:3] {
			return fmt.Errorf("%s speaks version %d of the goverbs bench protocol, this is version %d", o.peer, hdr[3]-'0', frameMagic[3]-'0')
		}
		if hdr[0] == 0x16 && hdr[1] == 3 { // a TLS handshake record
			return fmt.Errorf("%s speaks TLS: it runs with --token (or $%s); give this side the same token", o.peer, envBenchToken)
		}
		return fmt.Errorf("%s is not a goverbs bench (frame starts with %q, want %q)", o.peer, hdr[:4], frameMagic)
	}
	typ := hdr[4]
	n := binary.BigEndian.Uint32(hdr[8:])
	if n > maxFrame || hdr[5]|hdr[6]|hdr[7] != 0 || typ == frameAlive && n != 0 {
		return fmt.Errorf("malformed frame from %s (type %d, length %d)", o.peer, typ, n)
	}
	if typ == frameAlive {
		return errAlive
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(o.c, payload); err != nil {
		return fmt.Errorf("reading %s from %s: %w", frameNames[typ], o.peer, ctxErr(ctx, err))
	}
	if typ == frameError {
		var e errorMsg
		if err := json.Unmarshal(payload, &e); err != nil {
			return fmt.Errorf("%w: malformed error message: %v", errPeer, err)
		}
		return fmt.Errorf("%w: %s", errPeer, printable(e.Error))
	}
	if typ != want {
		return fmt.Errorf("protocol error: %s sent %s, want %s", o.peer, frameNames[typ], frameNames[want])
	}
	if err := json.Unmarshal(payload, v); err != nil {
		return fmt.Errorf("malformed %s from %s: %w", frameNames[typ], o.peer, err)
	}
	return nil
}

// printable returns the peer's message s as it is if it is one line of
// printable text, else quoted (a control character could drive the
// terminal), and at most maxPeerMsg bytes of it.
func printable(s string) string {
	if len(s) > maxPeerMsg {
		s = s[:maxPeerMsg] + "..."
	}
	if strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return strconv.Quote(s)
	}
	return s
}

const maxPeerMsg = 4096

// fail tells the peer why this side gives up (best effort, bounded) and
// returns err.
func (o *oobConn) fail(err error) error {
	if errors.Is(err, errPeer) {
		return err // the peer knows
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	o.send(ctx, frameError, errorMsg{Error: err.Error()})
	return err
}

type errorMsg struct {
	Error string `json:"error"`
}

// dialOOB connects to addr, retrying while nothing listens there yet (the
// server may start a moment after the client), until ctx ends. With a
// token, it authenticates the server (see above).
func dialOOB(ctx context.Context, addr, token string) (*oobConn, error) {
	var d net.Dialer
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			o := &oobConn{c: c, peer: "server " + addr}
			if token != "" {
				if o.c, err = secureClient(ctx, c, token); err != nil {
					c.Close()
					return nil, fmt.Errorf("connecting to the server %s: %w", addr, err)
				}
			}
			return o, nil
		}
		var ne net.Error
		if ctx.Err() != nil || (errors.As(err, &ne) && ne.Timeout()) {
			cerr := ctx.Err()
			if cerr == nil {
				cerr = context.DeadlineExceeded // the dialer saw the deadline first
			}
			return nil, fmt.Errorf("connecting to the server: nothing listens on %s (%v): %w", addr, err, cerr)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("connecting to the server: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("connecting to the server: nothing listens on %s: %w", addr, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// acceptOOB listens on addr and accepts one client, or fails when ctx
// ends. ready is called with the bound address once listening. With a
// token, clients that do not prove it are dropped (and reported to log)
// until one does.
func acceptOOB(ctx context.Context, addr, token string, ready func(net.Addr), log io.Writer) (*oobConn, error) {
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listening for the client: %w", err)
	}
	defer l.Close()
	if ready != nil {
		ready(l.Addr())
	}
	if token != "" {
		return acceptToken(ctx, l, token, log)
	}
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	c, err := l.Accept()
	if err != nil {
		return nil, fmt.Errorf("waiting for a client on %s: %w", l.Addr(), ctxErr(ctx, err))
	}
	return &oobConn{c: c, peer: "client " + c.RemoteAddr().String()}, nil
}

// maxPending is how many clients a server with a token authenticates at
// once; past it, it drops the oldest.
const maxPending = 8

// acceptToken accepts clients on l and authenticates them side by side
// (a stranger that says nothing must not keep the real client waiting)
// until one proves the token.
func acceptToken(ctx context.Context, l net.Listener, token string, log io.Writer) (*oobConn, error) {
	log = &lockedWriter{w: log}
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(ctx)
	context.AfterFunc(ctx, func() { l.Close() })
	defer func() {
		cancel() // closes l and the clients still authenticating
		wg.Wait()
	}()
	won := make(chan *oobConn, 1)
	acceptErr := make(chan error, 1)
	// The clients authenticating, oldest first: past maxPending the
	// oldest is dropped, so that strangers that say nothing cannot keep
	// the real client out (they would have to connect faster than it
	// completes its handshake). A dropped one is marked, and says so.
	var mu sync.Mutex
	var pending []net.Conn
	dropped := map[net.Conn]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				acceptErr <- err
				return
			}
			peer := "client " + c.RemoteAddr().String()
			mu.Lock()
			if len(pending) == maxPending {
				old := pending[0]
				pending = pending[1:]
				dropped[old] = true
				old.Close()
			}
			pending = append(pending, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				closeOnEnd := context.AfterFunc(ctx, func() { c.Close() })
				sc, err := secureServer(ctx, c, token)
				mu.Lock()
				pending = slices.DeleteFunc(pending, func(p net.Conn) bool { return p == c })
				drop := dropped[c]
				delete(dropped, c)
				mu.Unlock()
				if closeOnEnd() && err == nil && !drop {
					select {
					case won <- &oobConn{c: sc, peer: peer}:
						return
					default: // another client won
					}
				}
				c.Close()
				switch {
				case drop:
					fmt.Fprintf(log, "goverbs bench: dropped %s: %d newer clients are authenticating\n", peer, maxPending)
				case err != nil && ctx.Err() == nil:
					fmt.Fprintf(log, "goverbs bench: dropped %s: %v\n", peer, err)
				}
			}()
		}
	}()
	select {
	case o := <-won:
		return o, nil
	case err := <-acceptErr:
		select {
		case o := <-won:
			o.Close()
		default:
		}
		return nil, fmt.Errorf("waiting for a client on %s: %w", l.Addr(), ctxErr(ctx, err))
	}
}
