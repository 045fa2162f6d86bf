package fdpass

import (
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestRightsAndClose(t *testing.T) {
	sp, r, w := socketsAndPipe(t)
	tests := []struct {
		name string
		fds  []int
	}{
		{"none", nil},
		{"one", []int{int(r.Fd())}},
		{"two", []int{int(r.Fd()), int(w.Fd())}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var oob []byte
			if len(tt.fds) > 0 {
				oob = unix.UnixRights(tt.fds...)
			}
			if err := unix.Sendmsg(sp[0], []byte{1}, oob, nil, 0); err != nil {
				t.Fatal(err)
			}
			buf, cbuf := make([]byte, 4), make([]byte, unix.CmsgSpace(4*8))
			_, oobn, _, _, err := unix.Recvmsg(sp[1], buf, cbuf, 0)
			if err != nil {
				t.Fatal(err)
			}
			got := Rights(cbuf[:oobn])
			if len(got) != len(tt.fds) {
				t.Fatalf("Rights returned %d descriptors, want %d", len(got), len(tt.fds))
			}
			for i, fd := range got {
				// Each is a new descriptor of the same open file.
				var a, b unix.Stat_t
				if unix.Fstat(fd, &a) != nil || unix.Fstat(tt.fds[i], &b) != nil || a.Ino != b.Ino {
					t.Errorf("descriptor %d (%d) is not the one sent (%d)", i, fd, tt.fds[i])
				}
			}
			Close(append(got, -1))
			for _, fd := range got {
				if err := unix.Fstat(fd, &unix.Stat_t{}); err != unix.EBADF {
					t.Errorf("descriptor %d still open after Close (fstat: %v)", fd, err)
				}
			}
		})
	}
	if got := Rights([]byte{1, 2, 3}); got != nil {
		t.Errorf("Rights of malformed control data = %v, want none", got)
	}
}

// TestRightsMalformedLength guards Rights against an SCM_RIGHTS message
// whose data is not a whole number of descriptors: it must yield none
// (the doc: control data that does not parse) and close the descriptors
// the whole words of the message name. Before, Rights handed the message
// to unix.ParseUnixRights, which sizes its result by the whole words but
// reads every 4th byte up to the end: it panicked (index out of range).
func TestRightsMalformedLength(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	fd, err := unix.Dup(int(r.Fd())) // as if received: Rights closes it
	if err != nil {
		t.Fatal(err)
	}
	oob := make([]byte, unix.CmsgSpace(8))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.SetLen(unix.CmsgLen(5)) // one descriptor and a byte
	h.Level, h.Type = unix.SOL_SOCKET, unix.SCM_RIGHTS
	*(*int32)(unsafe.Pointer(&oob[unix.CmsgLen(0)])) = int32(fd)
	defer func() {
		if p := recover(); p != nil {
			unix.Close(fd)
			t.Fatalf("Rights panicked on malformed control data: %v", p)
		}
	}()
	if got := Rights(oob[:unix.CmsgLen(5)]); got != nil {
		Close(got)
		t.Fatalf("Rights of malformed control data = %v, want none", got)
	}
	if err := unix.Fstat(fd, &unix.Stat_t{}); err != unix.EBADF {
		unix.Close(fd)
		t.Fatalf("descriptor %d of the malformed message left open (fstat: %v)", fd, err)
	}
}

// TestRightsMalformedTrailerClosesParsed guards against a leak: control
// data whose first message carries descriptors (installed in this
// process by recvmsg) followed by a header that does not parse yields
// none, so Rights must close those descriptors. Before, Rights parsed
// the whole control data with unix.ParseSocketControlMessage, which
// failed and dropped the messages it had parsed: the descriptors stayed
// open with no one knowing them.
func TestRightsMalformedTrailerClosesParsed(t *testing.T) {
	sp, r, w := socketsAndPipe(t)
	if err := unix.Sendmsg(sp[0], []byte{1}, unix.UnixRights(int(r.Fd()), int(w.Fd())), nil, 0); err != nil {
		t.Fatal(err)
	}
	buf, cbuf := make([]byte, 4), make([]byte, unix.CmsgSpace(4*8))
	_, oobn, _, _, err := unix.Recvmsg(sp[1], buf, cbuf, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := unix.ParseSocketControlMessage(cbuf[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatal(err, len(msgs))
	}
	received, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(received) != 2 {
		t.Fatal(err, received)
	}
	// A trailing control message header that does not parse.
	trailer := make([]byte, unix.CmsgSpace(0))
	(*unix.Cmsghdr)(unsafe.Pointer(&trailer[0])).SetLen(1 << 20) // longer than the data
	oob := append(append([]byte(nil), cbuf[:oobn]...), trailer...)

	got := Rights(oob)
	Close(got)
	var open []int
	for _, fd := range received {
		if unix.Fstat(fd, &unix.Stat_t{}) == nil {
			open = append(open, fd)
		}
	}
	Close(open)
	if got != nil {
		t.Errorf("Rights of malformed control data = %v, want none", got)
	}
	if len(open) > 0 {
		t.Errorf("Rights left the %d received descriptors %v open: leaked", len(open), open)
	}
}

// socketsAndPipe returns a connected SOCK_SEQPACKET pair and a pipe's
// ends, closed when the test ends.
func socketsAndPipe(t *testing.T) (sp [2]int, r, w *os.File) {
	t.Helper()
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Close(sp[:]) })
	r, w, err = os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.Close()
		w.Close()
	})
	return sp, r, w
}
