package verbs_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// TestRegisterWindow registers part of the memory of an MR from Alloc (a
// window of an arena) with its own keys: RDMA writes through it land in
// the arena's bytes at the window's offset, and the arena cannot be
// closed (unmapping memory the window's MR still refers to) until the
// window is, whichever PD or device context holds the window.
func TestRegisterWindow(t *testing.T) {
	const page = 4096
	const all = verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead | verbs.AccessRemoteAtomic
	for _, where := range []string{"SamePD", "OtherPD", "OtherContext"} {
		t.Run(where, func(t *testing.T) {
			verbstest.CheckLeaks(t)
			p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice, SeparateContexts: true}, verbs.QPSpec{})
			arena, err := p.B.PD.Alloc(3*page, all)
			if err != nil {
				t.Fatal(err)
			}
			defer arena.Close()
			pd := p.B.PD // the PD of the QP the window is written through
			switch where {
			case "OtherPD":
				// Another PD of the arena's context.
				other, err := p.B.Ctx.AllocPD()
				if err != nil {
					t.Fatal(err)
				}
				defer other.Close()
				pd = other
			case "OtherContext":
				// The arena's memory registered with side A's context.
				pd = p.A.PD
			}
			win, err := pd.Register(arena.Bytes()[page:2*page], all)
			if err != nil {
				t.Fatal(err)
			}
			defer win.Close()
			if win.RKey() == arena.RKey() || win.Len() != page || &win.Bytes()[0] != &arena.Bytes()[page] {
				t.Fatalf("window: rkey %#x (arena %#x), %d bytes, bytes at arena offset %d", win.RKey(), arena.RKey(), win.Len(),
					bytes.Index(arena.Bytes(), win.Bytes()[:1]))
			}

			err = arena.Close()
			if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("lkey %#x", win.LKey())) {
				t.Fatalf("closing the arena while a window of it is registered: %v, want an error naming the window", err)
			}

			if where == "SamePD" {
				// The window works as an MR of its own.
				verbstest.Pattern(arena.Bytes(), 0xEE)
				before := bytes.Clone(arena.Bytes())
				src := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
				verbstest.Pattern(src.Bytes(), 0x11)
				if err := p.QA.PostWrite(1, verbs.Signaled, win.Remote().At(10), verbstest.SGE(t, src, 0, 64)); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), verbstest.DefaultTimeout)
				defer cancel()
				wcs, err := verbstest.PollN(ctx, p.A.CQ, 1)
				if err != nil || wcs[0].Status != verbs.StatusSuccess {
					t.Fatalf("write through the window: %v %v", wcs, err)
				}
				want := bytes.Clone(before)
				copy(want[page+10:], src.Bytes())
				if !bytes.Equal(arena.Bytes(), want) {
					t.Errorf("the arena after a 64-byte write at window offset 10 differs from the expected bytes")
				}
			}

			if err := win.Close(); err != nil {
				t.Fatal(err)
			}
			if err := arena.Close(); err != nil {
				t.Fatalf("closing the arena after its window: %v", err)
			}
		})
	}
	t.Run("GoMemory", func(t *testing.T) {
		// Go memory is not the memory of any MR: its MRs are independent.
		verbstest.CheckLeaks(t)
		a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
		buf := make([]byte, 2*page)
		m1, err := a.PD.Register(buf, all)
		if err != nil {
			t.Fatal(err)
		}
		m2, err := a.PD.Register(buf[page:], all)
		if err != nil {
			t.Fatal(err)
		}
		if err := m1.Close(); err != nil {
			t.Errorf("close an MR of Go memory while another covers part of it: %v", err)
		}
		if err := m2.Close(); err != nil {
			t.Error(err)
		}
	})
}
