package verbs_test

import (
	"context"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/soft"
	"github.com/goverbs/verbs/verbstest"
)

// TestLink checks Link on soft0 with both QPs in this process: "" until
// the QPs are connected, then "local", or with a transport forced through
// the soft service the name of that transport, the same before the first
// request and after traffic both ways; "" for a UD QP, after RESET and
// after Close. ("tls" is checked where TLS is in force from the start:
// TestCrossProcessLink in verbstest and the conformance case Link with
// GOVERBS_SOFT_TLS=on. Here a TCP connection of this process to itself
// that another test left open would carry the QPs' requests unencrypted,
// as established connections keep their transport.)
func TestLink(t *testing.T) {
	for _, tc := range []struct{ transport, want string }{
		{"auto", "local"},
		{"inproc", "local"},
		{"tcp", "tcp"},
		{"unix", "unix"},
		{"shm", "shm"},
	} {
		t.Run(tc.transport, func(t *testing.T) {
			restore, err := soft.ForceTransport(tc.transport)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(restore)
			// Loopback TCP unencrypted, whatever GOVERBS_SOFT_TLS says.
			restore, err = soft.ForceTLS("auto")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(restore)
			verbstest.CheckLeaks(t)
			a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true})
			qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
			ua, ub := a.NewUC(t, verbs.QPSpec{}), b.NewUC(t, verbs.QPSpec{})
			links := func(what, want string, qs ...interface{ Link() string }) {
				t.Helper()
				for i, q := range qs {
					if got := q.Link(); got != want {
						t.Errorf("%s: Link() of QP %d = %q, want %q", what, i, got, want)
					}
				}
			}
			links("in INIT", "", qa, qb, ua, ub)
			verbstest.ConnectRC(t, qa, qb)
			verbstest.ConnectUC(t, ua, ub)
			links("connected", tc.want, qa, qb, ua, ub)

			ma, mb := a.Alloc(t, 64, verbs.AccessLocalWrite), b.Alloc(t, 64, verbs.AccessLocalWrite)
			for _, s := range []struct {
				node     *verbstest.Node
				from, to *verbs.RCQueuePair
				src, dst *verbs.MemoryRegion
			}{{b, qa, qb, ma, mb}, {a, qb, qa, mb, ma}} {
				if err := s.to.PostRecv(1, verbstest.SGE(t, s.dst, 32, 32)); err != nil {
					t.Fatal(err)
				}
				// Unsignaled: the receive is the only completion.
				if err := s.from.PostSend(2, 0, verbstest.SGE(t, s.src, 0, 32)); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), verbstest.DefaultTimeout)
				wcs, err := verbstest.PollN(ctx, s.node.CQ, 1)
				cancel()
				if err != nil || wcs[0].Status != verbs.StatusSuccess || wcs[0].Opcode != verbs.OpRecv {
					t.Fatalf("receive: %v, %v", wcs, err)
				}
			}
			links("after traffic", tc.want, qa, qb)

			links("UD", "", a.NewUD(t, verbs.QPSpec{}))
			if err := qa.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState); err != nil {
				t.Fatal(err)
			}
			links("in RESET", "", qa)
			if err := ub.Close(); err != nil {
				t.Fatal(err)
			}
			links("closed", "", ub)
		})
	}
}
