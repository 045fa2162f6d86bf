// Package fdpass holds what the module's unix-socket transports share for
// passing file descriptors with SCM_RIGHTS (the soft provider's
// shared-memory handshake, and the provider proxy): taking the
// descriptors out of a received message's control data, and closing a
// list of them. Neither keeps state; both are safe for concurrent use.
package fdpass

import "golang.org/x/sys/unix"

// Rights returns the descriptors of the SCM_RIGHTS messages in oob, the
// control data of one received message, in order; control messages that
// are not SCM_RIGHTS are ignored, and control data that does not parse
// yields none. The caller owns the descriptors: it must close those it
// does not keep (Close).
func Rights(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for i := range msgs {
		if r, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, r...)
		}
	}
	return fds
}

// Close closes each descriptor of fds; negative entries (slots already
// given away) are skipped. Errors are ignored: the descriptors are being
// dropped.
func Close(fds []int) {
	for _, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}
