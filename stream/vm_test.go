package stream

import (
	"bytes"
	"io"
	"net"
	"strings"
	"testing"

	"golang.org/x/net/nettest"

	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/session"
)

// TestStreamDevices runs the net.Conn conformance tests, and 1 MiB each
// way, over sessions between rxe0 and rxe1 (the VM tier): the hardware
// provider under the stream.
func TestStreamDevices(t *testing.T) {
	devs := vmtest.Require(t)
	lcfg, dcfg := session.Config{Device: devs[0]}, session.Config{Device: devs[1]}
	mp := func() (net.Conn, net.Conn, func(), error) { return pipeWith(lcfg, dcfg) }
	t.Run("transport", func(t *testing.T) {
		c1, c2, stop, err := mp()
		if err != nil {
			t.Fatal(err)
		}
		defer stop()
		for _, c := range []net.Conn{c1, c2} {
			if tr := c.(*Conn).Session().Transport(); !strings.HasPrefix(tr, "rc/") {
				t.Fatalf("transport %q, want an RC queue pair of a device", tr)
			}
		}
		want := make([]byte, 1<<20)
		for i := range want {
			want[i] = byte(i * 31)
		}
		go func() {
			if _, err := c1.Write(want); err != nil {
				t.Error(err)
			}
			c1.(*Conn).CloseWrite()
		}()
		got, err := io.ReadAll(c2)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("read %d bytes of %d: %v", len(got), len(want), err)
		}
	})
	t.Run("nettest", func(t *testing.T) { nettest.TestConn(t, mp) })
}
