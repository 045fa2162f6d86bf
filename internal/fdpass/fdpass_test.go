package fdpass

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func TestRightsAndClose(t *testing.T) {
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer Close(sp[:])
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
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
