package session_test

import (
	"testing"

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
func TestZeroObjectMethods(t *testing.T) {
	zerocheck.Methods(t, []any{&session.Allocator{}, &session.LocalMR{}, &session.LocalSlice{}, &session.Message{}, &session.Pending{}, &session.RemoteMR{}, &session.RemoteSlice{}, &session.Grant{}, &session.Session{}, &session.Listener{}}, map[string]bool{
		// As on a closed object: Close succeeds; a zero Allocator has
		// nothing to trim; a zero Session has not failed (Err).
		"Allocator.Close": true, "Allocator.Trim": true, "Listener.Close": true,
		"Session.Close": true, "Session.Err": true,
		// A zero Pending is no message: nothing to wait for.
		"Pending.Wait": true,
		// Arithmetic on the recorded range: an empty slice of an empty
		// region fits.
		"RemoteMR.Slice": true,
	})
}
