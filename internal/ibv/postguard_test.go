//go:build ibverbs && linux && cgo

package ibv

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// TestPostRefusesWhatItCannotDescribe: the shim refuses a send request
// that libibverbs would read garbage for, on both post paths, with 0
// posted: a memory window bind (the classic path filled only the wr
// union of struct ibv_send_wr; the bind_mw union, on the C stack, held
// garbage that rxe dereferenced) and a UD send without an address handle
// (rxe dereferenced the NULL AH). Both killed the process with SIGSEGV
// in gv_post_send. The root package refuses both before the provider
// (checkDest; no memory window type), but every other caller of the
// provider did not. Each case runs in a copy of the test binary, so that
// a crash fails it rather than the whole run.
func TestPostRefusesWhatItCannotDescribe(t *testing.T) {
	n0, n1 := testDevices(t)
	for _, m := range modes {
		for _, tc := range []struct {
			name string
			want error
			post func(t *testing.T) (int, error)
		}{
			{"BindMW", syscall.EOPNOTSUPP, func(t *testing.T) (int, error) {
				a, _ := rcPair(t, m, sideOpts{})
				return a.qp.PostSend([]prov.SendWR{{WRID: 1, Opcode: prov.WRBindMW, Flags: prov.SendSignaled}}, nil)
			}},
			{"UDWithoutAH", syscall.EINVAL, func(t *testing.T) (int, error) {
				a := newSide(t, n0, m, sideOpts{typ: prov.QPTypeUD})
				b := newSide(t, n1, m, sideOpts{typ: prov.QPTypeUD})
				const qkey = 0x11111111
				modify(t, a.qp, prov.QPAttr{State: prov.QPStateInit, Port: 1, QKey: qkey}, prov.AttrState|prov.AttrPKeyIndex|prov.AttrPort|prov.AttrQKey)
				modify(t, a.qp, prov.QPAttr{State: prov.QPStateRTR}, prov.AttrState)
				modify(t, a.qp, prov.QPAttr{State: prov.QPStateRTS, SQPSN: 7}, prov.AttrState|prov.AttrSQPSN)
				return a.qp.PostSend([]prov.SendWR{{WRID: 2, Opcode: prov.WRSend, Flags: prov.SendSignaled,
					RemoteQPN: b.qp.QPN(), RemoteQKey: qkey, NumSGE: 1}}, []prov.SGE{a.sge(0, 9)})
			}},
		} {
			name := m.name + "/" + tc.name
			t.Run(name, func(t *testing.T) {
				if os.Getenv(postGuardChild) == name {
					n, err := tc.post(t)
					if n != 0 || !errors.Is(err, tc.want) {
						t.Fatalf("PostSend: %d posted, %v; want 0, %v", n, err, tc.want)
					}
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1")
				cmd.Env = append(os.Environ(), postGuardChild+"="+name)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("the post in a child: %v\n%s", err, crashLines(string(out)))
				}
			})
		}
	}
}

// postGuardChild names the case a copy of the test binary runs.
const postGuardChild = "GOVERBS_IBV_TEST_POST_CHILD"

// crashLines picks the lines of a test's output that say how it failed
// (a test failure, or a Go crash report).
func crashLines(out string) string {
	var b strings.Builder
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "signal") || strings.HasPrefix(l, "SIGSEGV") || strings.HasPrefix(l, "fatal") ||
			strings.Contains(l, "_Cfunc_gv_post") || strings.Contains(l, "postguard_test.go") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}
