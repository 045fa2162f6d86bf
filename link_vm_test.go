//go:build ibverbs && linux && cgo

package verbs_test

import (
	"context"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// TestLinkDevices checks Link on the hardware provider (rxe0 and rxe1 in
// the VM, RoCE): "" in INIT, then "<device>/<port> ethernet" on each side
// once connected, after traffic, and in ERR; "" again in RESET and after
// Close. A UD QP, in RTS from its creation, names its device and port.
func TestLinkDevices(t *testing.T) {
	devs := vmtest.Require(t)
	a, b := openCMSide(t, devs[0]), openCMSide(t, devs[1])
	qa, err := a.pd.NewRCQueuePair(a.spec())
	if err != nil {
		t.Fatal(err)
	}
	defer checkClose(t, "qp of "+devs[0], qa)
	qb, err := b.pd.NewRCQueuePair(b.spec())
	if err != nil {
		t.Fatal(err)
	}
	defer checkClose(t, "qp of "+devs[1], qb)
	wantA, wantB := devs[0]+"/1 ethernet", devs[1]+"/1 ethernet"
	link := func(what string, q interface{ Link() string }, want string) {
		t.Helper()
		if got := q.Link(); got != want {
			t.Errorf("%s: Link() = %q, want %q", what, got, want)
		}
	}
	link("RC of "+devs[0]+" in INIT", qa, "")
	ea, err := qa.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	eb, err := qb.Endpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := qa.Connect(eb); err != nil {
		t.Fatal(err)
	}
	if err := qb.Connect(ea); err != nil {
		t.Fatal(err)
	}
	link("RC of "+devs[0]+", connected", qa, wantA)
	link("RC of "+devs[1]+", connected", qb, wantB)

	// A message from A to B.
	sgeB, err := b.mr.SGE(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	sgeA, err := a.mr.SGE(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	if err := qb.PostRecv(1, sgeB); err != nil {
		t.Fatal(err)
	}
	if err := qa.PostSend(2, verbs.Signaled, sgeA); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*cmSide{a, b} {
		ctx, cancel := context.WithTimeout(context.Background(), verbstest.DefaultTimeout)
		wcs, err := verbstest.PollN(ctx, s.cq, 1)
		cancel()
		if err != nil || wcs[0].Status != verbs.StatusSuccess {
			t.Fatalf("completion on %s: %+v, %v", s.name, wcs, err)
		}
	}
	link("RC of "+devs[0]+", after traffic", qa, wantA)
	if err := qa.Modify(verbs.QPAttr{State: verbs.StateError}, verbs.AttrState); err != nil {
		t.Fatal(err)
	}
	link("RC of "+devs[0]+" in ERR", qa, wantA)
	if err := qa.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState); err != nil {
		t.Fatal(err)
	}
	link("RC of "+devs[0]+" in RESET", qa, "")

	ud, err := a.pd.NewUDQueuePair(a.spec())
	if err != nil {
		t.Fatal(err)
	}
	link("UD of "+devs[0], ud, wantA)
	checkClose(t, "ud qp of "+devs[0], ud)
	link("UD of "+devs[0]+", closed", ud, "")
}
