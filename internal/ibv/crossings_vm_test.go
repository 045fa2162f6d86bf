//go:build ibverbs && linux && cgo

package ibv_test

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/ibv"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// crossings runs f and returns the cgo calls the process made meanwhile
// (runtime.NumCgoCall: every call from Go into C, whoever made it) and the
// data-path C calls by kind (counted only with the build tag ibv_count).
func crossings(f func()) (int64, ibv.Calls) {
	c0, k0 := runtime.NumCgoCall(), ibv.DataPathCalls()
	f()
	return runtime.NumCgoCall() - c0, ibv.DataPathCalls().Sub(k0)
}

// TestCgoCrossings proves the data-path contract of the hardware provider
// on the VM's rxe devices: a Submit of a batch of N work requests is one
// cgo crossing whatever N is, a receive batch too, and so is a Poll or a
// PollBusy, whether it finds completions or not. It counts with the Go runtime's
// own counter of cgo calls, which sees every crossing of the process, and,
// built with -tags ibverbs,ibv_count, with the shim's per-call counters.
func TestCgoCrossings(t *testing.T) {
	devs := vmtest.Require(t)
	verbstest.CheckLeaks(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1]})
	// Poll-only CQs: no completion channel, so no event goroutine.
	acq := a.NewCQ(t, verbs.CQSpec{NoChannel: true, Entries: 1024})
	bcq := b.NewCQ(t, verbs.CQSpec{NoChannel: true, Entries: 1024})
	qa := a.NewRC(t, verbs.QPSpec{SendCQ: acq, MaxSendWR: 256, MaxRecvWR: 256})
	qb := b.NewRC(t, verbs.QPSpec{SendCQ: bcq, MaxSendWR: 256, MaxRecvWR: 256})
	verbstest.ConnectRC(t, qa, qb)
	src := a.Alloc(t, 1<<16, verbs.AccessLocalWrite)
	dst := b.Alloc(t, 1<<16, verbs.AccessRemoteAll)
	verbstest.Pattern(src.Bytes(), 3)
	wcs := make([]verbs.Completion, 256)
	t.Logf("per-call counters compiled in (-tags ibv_count): %v", ibv.CountingCalls)

	// check asserts that f made exactly one cgo crossing, of kind want.
	check := func(what string, want ibv.Calls, f func()) {
		t.Helper()
		n, k := crossings(f)
		if n != 1 {
			t.Errorf("%s: %d cgo calls, want 1", what, n)
		}
		if ibv.CountingCalls && k != want {
			t.Errorf("%s: data-path C calls %+v, want %+v", what, k, want)
		}
	}
	// drain polls acq until it has n completions, all successful.
	drain := func(n int) {
		t.Helper()
		got, err := verbstest.PollN(ctx, acq, n)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range got {
			if c.Status != verbs.StatusSuccess {
				t.Fatalf("completion %v", c)
			}
		}
	}

	for _, n := range []int{1, 2, 16, 64, 128} {
		t.Run(fmt.Sprintf("Submit%d", n), func(t *testing.T) {
			batch := qa.NewBatch(n)
			for i := range n {
				r := batch.Write(uint64(i), dst.Remote().At(uint64(i*64)), verbstest.SGE(t, src, i*64, 64))
				if i == n-1 {
					r.Signaled()
				}
			}
			check(fmt.Sprintf("Submit of %d writes", n), ibv.Calls{PostSend: 1}, func() {
				if err := batch.Submit(); err != nil {
					t.Fatal(err)
				}
			})
			drain(1)
			if got, want := dst.Bytes()[:n*64], src.Bytes()[:n*64]; string(got) != string(want) {
				t.Errorf("the %d writes did not land", n)
			}
		})
	}

	t.Run("SubmitMixed", func(t *testing.T) {
		// Writes, reads and sends with inline data in one batch.
		rb := qb.NewRecvBatch(8)
		for i := range 8 {
			rb.Recv(uint64(i), verbstest.SGE(t, dst, 32768+i*64, 64))
		}
		check("Submit of 8 receives", ibv.Calls{PostRecv: 1}, func() {
			if err := rb.Submit(); err != nil {
				t.Fatal(err)
			}
		})
		batch := qa.NewBatch(24)
		for i := range 8 {
			batch.Write(uint64(i), dst.Remote().At(uint64(16384+i*64)), verbstest.SGE(t, src, i*64, 64))
			batch.Read(uint64(100+i), dst.Remote().At(uint64(i*64)), verbstest.SGE(t, src, 8192+i*64, 64))
			batch.Send(uint64(200+i), verbstest.SGE(t, src, i*8, 8)).Inline()
		}
		check("Submit of 24 mixed requests", ibv.Calls{PostSend: 1}, func() {
			if err := batch.Submit(); err != nil {
				t.Fatal(err)
			}
		})
		got, err := verbstest.PollN(ctx, bcq, 8)
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range got {
			if c.Status != verbs.StatusSuccess || c.Opcode != verbs.OpRecv || c.ByteLen != 8 {
				t.Errorf("receive %d: %v", i, c)
			}
		}
	})

	t.Run("SubmitInlineData", func(t *testing.T) {
		// Sends of Go memory (no MR) in one batch: one crossing, and the
		// receiver gets the bytes, although the sender's buffers were
		// overwritten as soon as Submit returned.
		rb := qb.NewRecvBatch(8)
		for i := range 8 {
			rb.Recv(uint64(i), verbstest.SGE(t, dst, 40960+i*64, 64))
		}
		if err := rb.Submit(); err != nil {
			t.Fatal(err)
		}
		batch := qa.NewBatch(8)
		msgs := make([][]byte, 8)
		for i := range msgs {
			msgs[i] = fmt.Appendf(nil, "inline message %d from Go memory", i)
			batch.SendInline(uint64(300+i), msgs[i])
		}
		check("Submit of 8 inline sends of Go memory", ibv.Calls{PostSend: 1}, func() {
			if err := batch.Submit(); err != nil {
				t.Fatal(err)
			}
		})
		want := make([][]byte, 8)
		for i, m := range msgs {
			want[i] = bytes.Clone(m)
			clear(m)
		}
		got, err := verbstest.PollN(ctx, bcq, 8)
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range got {
			off := 40960 + int(c.WRID)*64
			if c.Status != verbs.StatusSuccess || c.Opcode != verbs.OpRecv || int(c.ByteLen) != len(want[c.WRID]) ||
				!bytes.Equal(dst.Bytes()[off:off+int(c.ByteLen)], want[c.WRID]) {
				t.Errorf("receive %d: %v, %q; want %q", i, c, dst.Bytes()[off:off+int(c.ByteLen)], want[c.WRID])
			}
		}
	})

	t.Run("PostSingle", func(t *testing.T) {
		check("PostWrite", ibv.Calls{PostSend: 1}, func() {
			if err := qa.PostWrite(7, verbs.Signaled, dst.Remote().At(0), verbstest.SGE(t, src, 0, 64)); err != nil {
				t.Fatal(err)
			}
		})
		drain(1)
		check("PostRecv", ibv.Calls{PostRecv: 1}, func() {
			if err := qb.PostRecv(9, verbstest.SGE(t, dst, 0, 64)); err != nil {
				t.Fatal(err)
			}
		})
	})

	t.Run("Poll", func(t *testing.T) {
		// Empty CQ, a CQ with fewer completions than the slice holds,
		// and one with more: always one crossing.
		check("Poll of an empty CQ", ibv.Calls{PollCQ: 1}, func() {
			if n, err := acq.Poll(wcs); err != nil || n != 0 {
				t.Fatalf("Poll: %d, %v", n, err)
			}
		})
		batch := qa.NewBatch(100)
		for i := range 100 {
			batch.Write(uint64(i), dst.Remote().At(uint64(i*64)), verbstest.SGE(t, src, i*64, 64)).Signaled()
		}
		if err := batch.Submit(); err != nil {
			t.Fatal(err)
		}
		// Reap the 100 completions in Polls of up to 40: each Poll, full,
		// partial or empty, is one crossing.
		got := 0
		for got < 100 {
			var n int
			c, _ := crossings(func() {
				var err error
				if n, err = acq.Poll(wcs[:min(40, 100-got)]); err != nil {
					t.Fatal(err)
				}
			})
			if c != 1 {
				t.Errorf("Poll returning %d completions: %d cgo calls, want 1", n, c)
			}
			for _, w := range wcs[:n] {
				if w.Status != verbs.StatusSuccess {
					t.Fatalf("completion %v", w)
				}
			}
			got += n
			if n == 0 {
				runtime.Gosched()
			}
		}
	})

	t.Run("PollBusy", func(t *testing.T) {
		// A busy poll is one crossing whether its spins all find the CQ
		// empty or it returns completions.
		check("PollBusy of an empty CQ, 1000 spins", ibv.Calls{PollCQ: 1}, func() {
			if n, err := acq.PollBusy(wcs, 1000); err != nil || n != 0 {
				t.Fatalf("PollBusy: %d, %v", n, err)
			}
		})
		if err := qa.PostWrite(8, verbs.Signaled, dst.Remote().At(0), verbstest.SGE(t, src, 0, 64)); err != nil {
			t.Fatal(err)
		}
		for got := 0; got == 0; {
			var err error
			c, _ := crossings(func() { got, err = acq.PollBusy(wcs, 1<<16) })
			if err != nil {
				t.Fatal(err)
			}
			if c != 1 {
				t.Errorf("PollBusy returning %d completions: %d cgo calls, want 1", got, c)
			}
			if ctx.Err() != nil {
				t.Fatal("no completion")
			}
			if got == 1 && wcs[0].Status != verbs.StatusSuccess {
				t.Fatalf("completion %v", wcs[0])
			}
		}
	})

	t.Run("Loop", func(t *testing.T) {
		// A bandwidth-style loop: 1000 writes in batches of 16, the last
		// signaled, polled into a slice. Crossings = Submits + Polls.
		const total, per = 1000, 16
		batch := qa.NewBatch(per)
		submits, polls, done := 0, 0, 0
		n, _ := crossings(func() {
			posted := 0
			for done < (total+per-1)/per {
				for posted < total && (posted-done*per) < 128-per {
					k := min(per, total-posted)
					for i := range k {
						r := batch.Write(uint64(posted+i), dst.Remote().At(uint64(i*64)), verbstest.SGE(t, src, i*64, 64))
						if i == k-1 {
							r.Signaled()
						}
					}
					if err := batch.Submit(); err != nil {
						t.Fatal(err)
					}
					submits++
					posted += k
				}
				m, err := acq.Poll(wcs)
				polls++
				if err != nil {
					t.Fatal(err)
				}
				done += m
			}
		})
		t.Logf("%d writes: %d submits, %d polls, %d cgo calls (%.3f per write)", total, submits, polls, n, float64(n)/total)
		if n != int64(submits+polls) {
			t.Errorf("%d cgo calls, want submits + polls = %d", n, submits+polls)
		}
	})
}
