// Package fdpass holds what the module's unix-socket transports share for
// passing file descriptors with SCM_RIGHTS (the soft provider's
// shared-memory handshake, and the provider proxy): taking the
// descriptors out of a received message's control data, and closing a
// list of them. Neither keeps state; both are safe for concurrent use.
package fdpass

import (
	"encoding/binary"

	"golang.org/x/sys/unix"
)

// Rights returns the descriptors of the SCM_RIGHTS messages in oob, the
// control data of one received message, in order; control messages that
// are not SCM_RIGHTS are ignored, and control data that does not parse
// (a header whose length runs past the data, an SCM_RIGHTS message whose
// data is not a whole number of descriptors) yields none: the
// descriptors found in it are closed, as they cannot be trusted and no
// caller would learn of them. The caller owns the descriptors returned:
// it must close those it does not keep (Close).
func Rights(oob []byte) []int {
	var fds []int
	// As unix.ParseSocketControlMessage, whose result would lose the
	// descriptors of the messages before one that does not parse: a tail
	// shorter than a header is ignored.
	for b := oob; len(b) >= unix.CmsgLen(0); {
		h, data, rest, err := unix.ParseOneSocketControlMessage(b)
		if err != nil {
			Close(fds)
			return nil
		}
		b = rest
		if h.Level != unix.SOL_SOCKET || h.Type != unix.SCM_RIGHTS {
			continue
		}
		for ; len(data) >= 4; data = data[4:] {
			fds = append(fds, int(int32(binary.NativeEndian.Uint32(data))))
		}
		if len(data) != 0 { // unix.ParseUnixRights would panic
			Close(fds)
			return nil
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
