package session

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"sync"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// Sessions whose queue pairs the RDMA connection manager connects
// (Config.UseCM). The bootstrap connection runs as always (it
// authenticates the peer and carries the keepalives); in its hello the
// acceptor names where its CM listens and a random cookie, which the
// dialer's two CM requests carry in their private data (with a byte
// saying which queue pair: cmData or cmCtrl). The Listener's CM side
// hands each request to the session setup waiting for its cookie and
// rejects the others before anything is allocated for them.

const (
	cmCookieLen = 16
	cmData      = 0
	cmCtrl      = 1
)

// cmListen is a Listener's connection manager.
type cmListen struct {
	l      *verbs.CMListener
	err    error  // why there is no l
	addr   string // where it listens (announced to dialers)
	device string // the device of its address
	mu     sync.Mutex
	waits  map[[cmCookieLen]byte]*cmWait
	wg     sync.WaitGroup
	cancel context.CancelFunc
}

// cmWait is a session setup waiting for its two CM requests.
type cmWait struct {
	cookie [cmCookieLen]byte
	reqs   chan *verbs.CMRequest
}

func listenCM(ctx context.Context, cfg *Config, tcp net.Addr) (*cmListen, error) {
	addr := cfg.CMAddr
	if addr == "" {
		addr = tcp.String()
	}
	r, err := verbs.ResolveCM(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("rdma cm: %w", err)
	}
	l, err := verbs.ListenCM(ctx, addr, verbs.CMListenOptions{})
	if err != nil {
		return nil, err
	}
	lc := &cmListen{l: l, addr: l.Addr().String(), device: r.Device, waits: map[[cmCookieLen]byte]*cmWait{}}
	bg, cancel := context.WithCancel(context.Background())
	lc.cancel = cancel
	lc.wg.Add(1)
	go lc.serve(bg)
	return lc, nil
}

// serve hands CM requests to the setups waiting for them.
func (lc *cmListen) serve(ctx context.Context) {
	defer lc.wg.Done()
	for {
		req, err := lc.l.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		data, err := channel.CMRequestData(req)
		if err != nil || len(data) != cmCookieLen+1 || data[cmCookieLen] > cmCtrl {
			req.Reject(nil)
			continue
		}
		var c [cmCookieLen]byte
		copy(c[:], data)
		lc.mu.Lock()
		w := lc.waits[c]
		lc.mu.Unlock()
		if w == nil {
			req.Reject(nil)
			continue
		}
		select {
		case w.reqs <- req:
		default:
			req.Reject(nil) // more than two requests with one cookie
		}
	}
}

func (lc *cmListen) expect() *cmWait {
	w := &cmWait{reqs: make(chan *verbs.CMRequest, 2)}
	rand.Read(w.cookie[:])
	lc.mu.Lock()
	lc.waits[w.cookie] = w
	lc.mu.Unlock()
	return w
}

func (lc *cmListen) forget(w *cmWait) {
	lc.mu.Lock()
	delete(lc.waits, w.cookie)
	lc.mu.Unlock()
	for {
		select {
		case r := <-w.reqs:
			r.Reject(nil)
		default:
			return
		}
	}
}

func (lc *cmListen) close() {
	lc.cancel()
	lc.l.Close()
	lc.wg.Wait()
}

// dialCM connects the session's two queue pairs through the CM at addr,
// with the acceptor's cookie.
func (s *Session) dialCM(ctx context.Context, addr string, cookie []byte) error {
	pdata := func(which byte) []byte { return append(bytes.Clone(cookie), which) }
	if _, err := channel.DialCM(ctx, addr, s.pd, s.dataOptions(), pdata(cmData), s.postDataAll); err != nil {
		return err
	}
	_, err := channel.DialCM(ctx, addr, s.pd, ctrlOptions(), pdata(cmCtrl), s.postCtrlAll)
	return err
}

// acceptCM accepts the dialer's two CM requests.
func (s *Session) acceptCM(ctx context.Context, w *cmWait) error {
	for range 2 {
		var req *verbs.CMRequest
		select {
		case req = <-w.reqs:
		case <-ctx.Done():
			return ctx.Err()
		}
		data, _ := channel.CMRequestData(req)
		var err error
		switch which := data[cmCookieLen]; {
		case which == cmData && s.data == nil:
			_, err = channel.AcceptCM(ctx, req, s.pd, s.dataOptions(), nil, s.postDataAll)
		case which == cmCtrl && s.agc == nil:
			_, err = channel.AcceptCM(ctx, req, s.pd, ctrlOptions(), nil, s.postCtrlAll)
		default:
			req.Reject(nil)
			err = fmt.Errorf("%w: two CM requests for one queue pair", ErrProtocol)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
