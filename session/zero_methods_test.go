package session_test

import (
	"context"
	"errors"
	"maps"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/zerocheck"
	"github.com/goverbs/verbs/session"
)

// TestZeroObjectMethods calls every exported method of the zero value of
// every object type with zero arguments (internal/zerocheck): none may
// panic, and those that return an error return one (ErrClosed: a zero
// Session, Listener, RemoteMR or Grant is as good as closed), except those
// of noError. Before, Close, LocalAddr, RemoteAddr and Transport of a
// zero Session, every Listener method, RemoteMR.Release, Grant.Revoke and
// Allocator.MaxClassSize panicked.
//
// It then calls every method of a zero Session and a zero Allocator that
// returns an error again, with real arguments (regions of a live session,
// sizes above 0, a context that never ends): each must fail with
// ErrClosed at once. Zero arguments stopped most calls at their checks
// (a size of 0, a cancelled context) before they reached the session;
// with real ones, Session.Alloc and Allocator.Alloc panicked (a nil
// allocator, no size classes), RequestRemoteMR panicked (a nil map), and
// Receive, ReceiveRemoteMR and ReceiveLocalMR waited for ever (on nil
// channels).
func TestZeroObjectMethods(t *testing.T) {
	noError := map[string]bool{
		// As on a closed object: Close succeeds; a zero Allocator has
		// nothing to trim.
		"Allocator.Close": true, "Allocator.Trim": true, "Listener.Close": true,
		"Session.Close": true,
		// A zero Pending is no message: nothing to wait for.
		"Pending.Wait": true,
		// Arithmetic on the recorded range: an empty slice of an empty
		// region fits.
		"RemoteMR.Slice": true,
	}
	zerocheck.Methods(t, []any{&session.Allocator{}, &session.LocalMR{}, &session.LocalSlice{}, &session.Message{}, &session.Pending{}, &session.RemoteMR{}, &session.RemoteSlice{}, &session.Grant{}, &session.Session{}, &session.Listener{}}, noError)

	live, remote := liveSession(t)
	mr, err := live.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	word, err := remote.Slice(0, 8)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background() // never ends: only the zero value may stop a call
	const access = verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	var s session.Session
	var a session.Allocator
	// A zero Session is as good as closed: its Done is closed (it was
	// nil, and a select on it waited for ever), and Err says ErrClosed.
	select {
	case <-s.Done():
	default:
		t.Error("a zero Session's Done is not closed")
	}
	calls := map[string]func() error{
		"Session.Alloc":         func() error { _, err := s.Alloc(64); return err },
		"Session.Send":          func() error { return s.Send(ctx, []byte("message")) },
		"Session.SendImm":       func() error { return s.SendImm(ctx, 7, []byte("message")) },
		"Session.SendSlice":     func() error { return s.SendSlice(ctx, mr.All(), 7, true) },
		"Session.PostSendSlice": func() error { _, err := s.PostSendSlice(ctx, mr.All(), 7, true); return err },
		"Session.Receive":       func() error { _, err := s.Receive(ctx); return err },
		"Session.ReceiveInto": func() error {
			_, _, _, err := s.ReceiveInto(ctx, make([]byte, 64))
			return err
		},
		"Session.Read":            func() error { return s.Read(ctx, mr.All(), remote.All()) },
		"Session.Write":           func() error { return s.Write(ctx, remote.All(), mr.All()) },
		"Session.WriteImm":        func() error { return s.WriteImm(ctx, remote.All(), 7, mr.All()) },
		"Session.CompareSwap":     func() error { _, err := s.CompareSwap(ctx, word, 0, 1); return err },
		"Session.FetchAdd":        func() error { _, err := s.FetchAdd(ctx, word, 1); return err },
		"Session.RequestRemoteMR": func() error { _, err := s.RequestRemoteMR(ctx, 64, access, time.Minute); return err },
		"Session.SendLocalMR":     func() error { _, err := s.SendLocalMR(ctx, mr, access, time.Minute); return err },
		"Session.SendRegion": func() error {
			_, err := s.SendRegion(ctx, mr.MemoryRegion(), 0, 64, access, time.Minute)
			return err
		},
		"Session.ReceiveRemoteMR": func() error { _, err := s.ReceiveRemoteMR(ctx); return err },
		"Session.SendRemoteMR":    func() error { return s.SendRemoteMR(ctx, remote) },
		"Session.ReceiveLocalMR":  func() error { _, err := s.ReceiveLocalMR(ctx); return err },
		"Session.Close":           s.Close,
		"Session.Err":             s.Err,
		"Allocator.Alloc":         func() error { _, err := a.Alloc(64); return err },
		"Allocator.AllocZeroed":   func() error { _, err := a.AllocZeroed(64); return err },
		"Allocator.Trim":          a.Trim,
		"Allocator.Close":         a.Close,
	}
	errType := reflect.TypeFor[error]()
	for _, typ := range []reflect.Type{reflect.TypeFor[*session.Session](), reflect.TypeFor[*session.Allocator]()} {
		for i := range typ.NumMethod() {
			m := typ.Method(i)
			for j := range m.Type.NumOut() {
				if name := typ.Elem().Name() + "." + m.Name; m.Type.Out(j) == errType && calls[name] == nil {
					t.Errorf("%s returns an error: add a call with real arguments", name)
				}
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(calls)) {
		call := calls[name]
		t.Run(name+"/real arguments", func(t *testing.T) {
			done := make(chan error, 1)
			panicked := make(chan any, 1)
			go func() {
				defer func() {
					if p := recover(); p != nil {
						panicked <- p
					}
				}()
				done <- call()
			}()
			select {
			case err := <-done:
				switch {
				case noError[name] && err != nil:
					t.Errorf("%v, want no error", err)
				case !noError[name] && !errors.Is(err, session.ErrClosed):
					t.Errorf("%v, want ErrClosed", err)
				default:
					t.Log(err)
				}
			case p := <-panicked:
				t.Fatalf("panic: %v", p)
			case <-time.After(10 * time.Second):
				t.Fatal("no return in 10 s, with a context that never ends")
			}
		})
	}
}

// liveSession returns a session connected to a peer over loopback, and a
// region the peer's agent granted it (64 bytes, read and write, atomics
// too), for calls that need real arguments. Both sessions are closed when
// t ends.
func liveSession(t *testing.T) (*session.Session, *session.RemoteMR) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l, err := session.Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan *session.Session, 1)
	go func() {
		peer, err := l.Accept(ctx)
		if err != nil {
			t.Error(err)
		}
		accepted <- peer
	}()
	s, err := session.Dial(ctx, l.Addr().String(), session.Config{})
	if err != nil {
		cancel()
		<-accepted
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	peer := <-accepted
	if peer == nil {
		t.FailNow()
	}
	t.Cleanup(func() { peer.Close() })
	r, err := s.RequestRemoteMR(ctx, 64, verbs.AccessRemoteRead|verbs.AccessRemoteWrite|verbs.AccessRemoteAtomic, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return s, r
}
