//go:build ibverbs && linux && cgo

package verbs_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/leak"
	"github.com/goverbs/verbs/internal/vmtest"
	"github.com/goverbs/verbs/verbstest"
)

// Adversarial tests of the hardware provider (internal/ibv over the
// kernel's SoftRoCE driver, in the VM of scripts/vm/run.sh): misuse that a
// hostile or careless caller makes must give the same error class
// (errors.Is) on rxe as on soft0. Their names end in Devices so that the
// VM tier of scripts/test.sh runs them.

// advDevicePairs returns the device pairs to run a comparison on: soft0
// with itself, and the VM's two rxe devices.
func advDevicePairs(t *testing.T) [][2]string {
	devs := vmtest.Require(t)
	return [][2]string{{verbs.SoftDevice, verbs.SoftDevice}, {devs[0], devs[1]}}
}

// TestAdversarialBadGIDIndexDevices gives an address vector whose source
// GID index names no entry of the GID table, to Modify (INIT -> RTR) and
// to NewAddressHandle: soft0 refuses both with EINVAL, as the verbs layer
// refuses QPSpec.FixedGID with a bad index; on rxe libibverbs fails them
// with ENODATA, which must match EINVAL too.
func TestAdversarialBadGIDIndexDevices(t *testing.T) {
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			verbstest.CheckLeaks(t)
			a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
			eb := verbstest.Endpoint(t, qb)
			ah := verbs.AHAttr{IsGlobal: true, DGID: eb.GID, SGIDIndex: 200, HopLimit: 64, Port: 1, ProviderAddr: eb.Addr}
			err := qa.Modify(verbs.QPAttr{State: verbs.StateRTR, PathMTU: eb.MTU, DestQPN: eb.QPN, RQPSN: eb.PSN,
				MaxDestRDAtomic: 1, MinRNRTimer: 12, AH: ah},
				verbs.AttrState|verbs.AttrAV|verbs.AttrPathMTU|verbs.AttrDestQPN|verbs.AttrRQPSN|verbs.AttrMaxDestAtomic|verbs.AttrMinRNRTimer)
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("Modify to RTR with source GID index 200: %v, want an error wrapping EINVAL", err)
			}
			if st, err := qa.State(); err != nil || st != verbs.StateInit {
				t.Errorf("state after the refused Modify: %v, %v; want INIT", st, err)
			}
			h, err := a.PD.NewAddressHandle(ah)
			if err == nil {
				h.Close()
			}
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("NewAddressHandle with source GID index 200: %v, want an error wrapping EINVAL", err)
			}
		})
	}
}

// forAdvDevices runs f on soft0 and, in each mode of the hardware
// provider, on the VM's rxe devices.
func forAdvDevices(t *testing.T, f func(t *testing.T, cfg verbstest.Config)) {
	for _, devs := range advDevicePairs(t) {
		for _, m := range advModes {
			if devs[0] == verbs.SoftDevice && m.on == "1" {
				continue // soft0 has one data path
			}
			t.Run(devs[0]+"/"+m.name, func(t *testing.T) {
				m.set(t)
				f(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			})
		}
	}
}

func advPollOne(t *testing.T, cq *verbs.CompletionQueue, what string) verbs.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	wcs, err := verbstest.PollN(ctx, cq, 1)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return wcs[0]
}

// TestAdversarialRefusedPostStaysUnpostedDevices posts sends on an RC
// queue pair in INIT and a receive on one in RESET, which fail with
// EINVAL and, for a batch, a PostError saying that none was posted. They
// must indeed never run: on rxe the provider library queued the requests
// before the kernel refused the doorbell, so once the queue pair was
// connected they went out ahead of the next send (which completed after
// them, its message landing in the wrong receive), and a refused receive
// took the next message.
func TestAdversarialRefusedPostStaysUnpostedDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) {
		verbstest.CheckLeaks(t)
		a, b := verbstest.NewNodes(t, cfg)
		qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
		src := a.Alloc(t, 4096, verbs.AccessLocalWrite)
		dst := b.Alloc(t, 4096, verbs.AccessLocalWrite)

		if err := qb.Modify(verbs.QPAttr{State: verbs.StateReset}, verbs.AttrState); err != nil {
			t.Fatal(err)
		}
		if err := qb.PostRecv(66, verbstest.SGE(t, dst, 0, 64)); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("receive posted in RESET: %v, want EINVAL", err)
		}
		if err := qb.Modify(verbs.QPAttr{State: verbs.StateInit, Port: 1, Access: verbs.AccessRemoteWrite},
			verbs.AttrState|verbs.AttrPKeyIndex|verbs.AttrPort|verbs.AttrAccessFlags); err != nil {
			t.Fatal(err)
		}
		if err := qa.PostSend(7, verbs.Signaled, verbstest.SGE(t, src, 0, 8)); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("send posted in INIT: %v, want EINVAL", err)
		}
		bt := qa.NewBatch(4)
		bt.Send(17, verbstest.SGE(t, src, 0, 8)).Signaled()
		bt.Send(18, verbstest.SGE(t, src, 0, 8))
		var pe *verbs.PostError
		if err := bt.Submit(); !errors.Is(err, syscall.EINVAL) || !errors.As(err, &pe) || pe.Posted != 0 {
			t.Errorf("send batch submitted in INIT: %v, want a PostError wrapping EINVAL with nothing posted", err)
		}

		verbstest.ConnectRC(t, qa, qb)
		for i := range 2 {
			if err := qb.PostRecv(uint64(100+i), verbstest.SGE(t, dst, 64*i, 64)); err != nil {
				t.Fatal(err)
			}
		}
		// RC completes in order: a refused request that ran after all
		// would complete (and take a receive) before these.
		for i := range 2 {
			wrid := uint64(8 + i)
			if err := qa.PostSend(wrid, verbs.Signaled, verbstest.SGE(t, src, 0, 8)); err != nil {
				t.Fatal(err)
			}
			if c := advPollOne(t, a.CQ, "send completion"); c.WRID != wrid || c.Status != verbs.StatusSuccess {
				t.Errorf("send completion %v, want wr_id %#x success: a send refused in INIT ran", c, wrid)
			}
			if c := advPollOne(t, b.CQ, "receive completion"); c.WRID != uint64(100+i) || c.Status != verbs.StatusSuccess {
				t.Errorf("receive completion %v, want wr_id %#x success", c, 100+i)
			}
		}
	})
}

// advPoll polls cq with a destination of 16 until it has collected n
// completions (or the hang guard ends), so that the polls ask for more
// completions than the CQ holds.
func advPoll(t *testing.T, cq *verbs.CompletionQueue, n int) []verbs.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []verbs.Completion
	buf := make([]verbs.Completion, 16)
	for len(out) < n {
		k, err := cq.Poll(buf)
		if err != nil {
			t.Fatalf("poll: %v (after %v)", err, out)
		}
		out = append(out, buf[:k]...)
		if k == 0 {
			if ctx.Err() != nil {
				t.Fatalf("hang guard: %d of %d completions: %v", len(out), n, out)
			}
			time.Sleep(time.Millisecond)
		}
	}
	return out
}

// TestAdversarialPollPastLastCompletionDevices polls a CQ with room for
// more completions than it holds, as every polling loop does: each
// completion must come out once. With extended CQs on rxe
// (GOVERBS_IBV_CQ_EX=1), whose ibv_end_poll moves the consumer index one
// entry further after ibv_next_poll found the CQ empty, the next poll
// returned stale entries again and again (three for a CQ of three).
func TestAdversarialPollPastLastCompletionDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) {
		verbstest.CheckLeaks(t)
		a, b := verbstest.NewNodes(t, cfg)
		qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
		verbstest.ConnectRC(t, qa, qb)
		src := a.Alloc(t, 4096, verbs.AccessLocalWrite)
		dst := b.Alloc(t, 4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
		sge := verbstest.SGE(t, src, 0, 8)
		next := uint64(1)
		for _, k := range []int{2, 1, 3} {
			bt := qa.NewBatch(k)
			for range k {
				bt.Write(next, dst.Remote().At(0), sge).Signaled()
				next++
			}
			if err := bt.Submit(); err != nil {
				t.Fatal(err)
			}
			got := advPoll(t, a.CQ, k)
			for i, c := range got {
				if want := next - uint64(k) + uint64(i); i >= k || c.WRID != want || c.Status != verbs.StatusSuccess {
					t.Fatalf("completions %v, want wr_ids %d..%d, success, once each", got, next-uint64(k), next-1)
				}
			}
			// Everything signaled has completed: the CQ is empty.
			if n, err := a.CQ.Poll(make([]verbs.Completion, 16)); n != 0 || err != nil {
				t.Fatalf("poll of an emptied CQ: %d completions, %v; want 0", n, err)
			}
		}
	})
}

// TestAdversarialOversizedCountsDevices asks for queues whose sizes do not
// fit the 32-bit fields of the verbs structs (on a 64-bit int): soft0
// refuses them with EINVAL; the hardware provider converted them, keeping
// the low 32 bits, and made a CQ of 1<<32 + 5 entries one of 5, a queue
// pair of 1<<32 + 4 send WRs one of 4, and armed an SRQ limit of
// 1<<32 + 1 as 1, all without an error.
func TestAdversarialOversizedCountsDevices(t *testing.T) {
	if math.MaxInt == math.MaxInt32 {
		t.Skip("int is 32 bits: every count fits")
	}
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			verbstest.CheckLeaks(t)
			a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			const wrap = 1 << 32
			s := a.NewSRQ(t, verbs.SRQSpec{MaxWR: 16})
			for _, c := range []struct {
				what string
				f    func() (interface{ Close() error }, error)
			}{
				{"CQ entries", func() (interface{ Close() error }, error) {
					return a.Ctx.NewCompletionQueue(verbs.CQSpec{Entries: wrap + 5})
				}},
				{"CQ vector", func() (interface{ Close() error }, error) {
					return a.Ctx.NewCompletionQueue(verbs.CQSpec{Vector: wrap})
				}},
				{"MaxSendWR", func() (interface{ Close() error }, error) {
					return a.PD.NewRCQueuePair(a.QPSpec(verbs.QPSpec{MaxSendWR: wrap + 4}))
				}},
				{"MaxRecvWR", func() (interface{ Close() error }, error) {
					return a.PD.NewUDQueuePair(a.QPSpec(verbs.QPSpec{MaxRecvWR: wrap + 4}))
				}},
				{"MaxInlineData", func() (interface{ Close() error }, error) {
					return a.PD.NewRCQueuePair(a.QPSpec(verbs.QPSpec{MaxInlineData: wrap + 4}))
				}},
				{"SRQ MaxWR", func() (interface{ Close() error }, error) {
					return a.PD.NewSharedReceiveQueue(verbs.SRQSpec{MaxWR: wrap + 8})
				}},
				{"SRQ limit", func() (interface{ Close() error }, error) {
					return nil, s.ArmLimit(wrap + 1)
				}},
			} {
				obj, err := c.f()
				if err == nil && obj != nil {
					obj.Close()
				}
				if !errors.Is(err, syscall.EINVAL) {
					t.Errorf("%s of 1<<32 and more: %v, want an error wrapping EINVAL", c.what, err)
				}
			}
			if q, err := s.Query(); err != nil || q.Limit != 0 {
				t.Errorf("SRQ after the refused ArmLimit: %+v, %v; want limit 0", q, err)
			}
		})
	}
}

// TestAdversarialPartialPostDevices submits a batch of two sends to a send
// queue with one free slot: the first must be posted and the PostError
// say so (Posted 1, ErrQueueFull), in every data path. With the
// work-request API (GOVERBS_IBV_WR_API=1) ibv_wr_complete refused the
// whole batch, so Posted was 0 and a request the classic path and soft0
// post was dropped.
func TestAdversarialPartialPostDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) {
		verbstest.CheckLeaks(t)
		// Sends that find no receive wait at the peer (RNR retries
		// forever), so the send queue fills and stays full.
		p := verbstest.NewLoopbackRC(t, cfg, verbs.QPSpec{MaxSendWR: 16, RNRRetry: 7, MinRNRTimer: 1})
		depth := p.QA.Cap().MaxSendWR
		src := p.A.Alloc(t, 64, verbs.AccessLocalWrite)
		sge := verbstest.SGE(t, src, 0, 8)
		for i := range depth - 1 {
			if err := p.QA.PostSend(uint64(i), verbs.Signaled, sge); err != nil {
				t.Fatalf("post send %d of %d: %v", i+1, depth, err)
			}
		}
		b := p.QA.NewBatch(2)
		b.Send(uint64(depth-1), sge).Signaled()
		b.Send(uint64(depth), sge).Signaled()
		var pe *verbs.PostError
		if err := b.Submit(); !errors.Is(err, verbs.ErrQueueFull) || !errors.As(err, &pe) || pe.Posted != 1 {
			t.Fatalf("batch of 2 with one free slot: %v; want a PostError with Posted 1 matching ErrQueueFull", err)
		}
		dst := p.B.Alloc(t, depth*8, verbs.AccessLocalWrite)
		rb := p.QB.NewRecvBatch(depth)
		for i := range depth {
			rb.Recv(uint64(1000+i), verbstest.SGE(t, dst, i*8, 8))
		}
		if err := rb.Submit(); err != nil {
			t.Fatal(err)
		}
		for i, c := range advPoll(t, p.A.CQ, depth) {
			if c.WRID != uint64(i) || c.Status != verbs.StatusSuccess {
				t.Fatalf("send completion %d: %v, want wr_id %#x success", i, c, i)
			}
		}
	})
}

// TestAdversarialCloseUnderLoadDevices closes a queue pair while
// goroutines post to it with every kind of call, then its CQ while
// goroutines poll and wait on it, on the hardware provider: every call
// must fail with ErrClosed once the object is closed, never reach the
// destroyed C object (a crash or a hang), and Close must succeed.
func TestAdversarialCloseUnderLoadDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) { closeUnderLoad(t, cfg, 256, 60*time.Second) })
}

// advLeakedPDs keeps the protection domains (and through them their
// contexts) of TestAdversarialLeakedRegisterDevices reachable for the rest
// of the process: their leaked MRs keep them from closing, and the leak
// tracer would report them in a later test.
var advLeakedPDs []*verbs.ProtectionDomain

// TestAdversarialLeakedRegisterDevices drops an MR of registered Go memory
// without Close, as a careless program does, and lets the garbage
// collector find it: the leak tracer must report it, and the memory stay
// pinned and registered (the device may still write into it), while the
// program goes on. Its runtime.Pinner was collected with the MR, still
// pinning the buffer, and the runtime then killed the process ("panic:
// runtime.Pinner: found leaking pinned pointer", in the finalizer
// goroutine, which no recover catches).
func TestAdversarialLeakedRegisterDevices(t *testing.T) {
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			c, err := verbs.Open(devs[0])
			if err != nil {
				t.Fatal(err)
			}
			pd, err := c.AllocPD()
			if err != nil {
				t.Fatal(err)
			}
			advLeakedPDs = append(advLeakedPDs, pd)
			start := leak.Count()
			func() {
				if _, err := pd.Register(make([]byte, 4096), verbs.AccessLocalWrite|verbs.AccessRemoteWrite); err != nil {
					t.Fatal(err)
				}
			}()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			for leak.Count() == start {
				if ctx.Err() != nil {
					t.Fatal("hang guard: the dropped MR was never reported as leaked")
				}
				runtime.GC()
				time.Sleep(time.Millisecond)
			}
			if got := leak.Since(start); len(got) != 1 || !strings.Contains(got[0], "memory region") {
				t.Errorf("leaks reported: %q, want the memory region", got)
			}
			// Give the finalizers of the collection their turn.
			for range 10 {
				runtime.GC()
				time.Sleep(time.Millisecond)
			}
			if err := pd.Close(); err == nil || !strings.Contains(err.Error(), "memory region") {
				t.Errorf("close of the PD of a leaked MR: %v, want an error naming the memory region", err)
			}
		})
	}
}

// TestAdversarialChannelEventOfClosedCQDevices closes a CQ whose
// completion event waits unread in its shared completion channel, then
// makes another CQ of the channel complete: on rxe the close must not
// wait for the unread event (libibverbs waits for the events it handed
// out to be acknowledged), and the channel's Wait must skip the closed
// CQ's event and return the live CQ.
func TestAdversarialChannelEventOfClosedCQDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) {
		verbstest.CheckLeaks(t)
		a, b := verbstest.NewNodes(t, cfg)
		ch := a.NewChannel(t)
		gone, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{Channel: ch})
		if err != nil {
			t.Fatal(err)
		}
		live := a.NewCQ(t, verbs.CQSpec{Channel: ch})
		src := a.Alloc(t, 64, verbs.AccessLocalWrite)
		dst := b.Alloc(t, 64, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
		write := func(cq *verbs.CompletionQueue, wrid uint64) {
			t.Helper()
			qa, qb := a.NewRC(t, verbs.QPSpec{SendCQ: cq}), b.NewRC(t, verbs.QPSpec{})
			verbstest.ConnectRC(t, qa, qb)
			if err := cq.RequestNotify(false); err != nil {
				t.Fatal(err)
			}
			if err := qa.PostWrite(wrid, verbs.Signaled, dst.Remote().At(0), verbstest.SGE(t, src, 0, 8)); err != nil {
				t.Fatal(err)
			}
			if c := advPollOne(t, cq, "write completion"); c.WRID != wrid || c.Status != verbs.StatusSuccess {
				t.Fatalf("write completion %v", c)
			}
			if err := qa.Close(); err != nil {
				t.Fatal(err)
			}
			if err := qb.Close(); err != nil {
				t.Fatal(err)
			}
		}
		write(gone, 1) // its event is in the channel, unread
		if err := gone.Close(); err != nil {
			t.Fatalf("close of a CQ with an unread event: %v", err)
		}
		write(live, 2)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if got, err := ch.Wait(ctx); err != nil || got != live {
			t.Errorf("Wait after the event of a closed CQ: %p, %v; want the live CQ %p", got, err, live)
		}
	})
}

// TestAdversarialModifyRangesDevices moves a queue pair to RTR and RTS by
// hand (Modify) with attributes outside their ranges: a 25-bit QPN or
// PSN (the fields are 24 bits), more outstanding reads and atomics than
// the device allows, an ACK timeout or retry count wider than its field.
// soft0 refuses them with EINVAL; rxe accepted some (the packets then name
// another QP, or the limits the device advertised do not hold), so the
// verbs layer checks them for every provider. The QP stays where it was.
func TestAdversarialModifyRangesDevices(t *testing.T) {
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			verbstest.CheckLeaks(t)
			a, b := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			da, err := a.Ctx.QueryDevice()
			if err != nil {
				t.Fatal(err)
			}
			qa, qb := a.NewRC(t, verbs.QPSpec{}), b.NewRC(t, verbs.QPSpec{})
			ea, eb := verbstest.Endpoint(t, qa), verbstest.Endpoint(t, qb)
			rtr := func() verbs.QPAttr {
				return verbs.QPAttr{State: verbs.StateRTR, PathMTU: eb.MTU, DestQPN: eb.QPN, RQPSN: eb.PSN,
					MaxDestRDAtomic: 1, MinRNRTimer: 12,
					AH: verbs.AHAttr{IsGlobal: true, DGID: eb.GID, SGIDIndex: ea.GIDIndex, HopLimit: 64, Port: 1, ProviderAddr: eb.Addr}}
			}
			rtrMask := verbs.AttrState | verbs.AttrAV | verbs.AttrPathMTU | verbs.AttrDestQPN | verbs.AttrRQPSN |
				verbs.AttrMaxDestAtomic | verbs.AttrMinRNRTimer
			bad := func(what string, want verbs.QPState, attr verbs.QPAttr, mask verbs.QPAttrMask) {
				t.Helper()
				if err := qa.Modify(attr, mask); !errors.Is(err, syscall.EINVAL) {
					t.Errorf("Modify with %s: %v, want an error wrapping EINVAL", what, err)
				}
				if st, err := qa.State(); err != nil || st != want {
					t.Errorf("state after Modify with %s: %v, %v; want %v", what, st, err, want)
				}
			}
			a1 := rtr()
			a1.DestQPN = 1<<24 | eb.QPN
			bad("a 25-bit destination QPN", verbs.StateInit, a1, rtrMask)
			a2 := rtr()
			a2.RQPSN = 1 << 24
			bad("a 25-bit receive PSN", verbs.StateInit, a2, rtrMask)
			if da.MaxQPRDAtom > 0 && da.MaxQPRDAtom < 255 {
				a3 := rtr()
				a3.MaxDestRDAtomic = uint8(da.MaxQPRDAtom + 1)
				bad(fmt.Sprintf("MaxDestRDAtomic %d (the device allows %d)", a3.MaxDestRDAtomic, da.MaxQPRDAtom), verbs.StateInit, a3, rtrMask)
			}
			a4 := rtr()
			a4.MinRNRTimer = 32
			bad("MinRNRTimer 32", verbs.StateInit, a4, rtrMask)
			if err := qa.Modify(rtr(), rtrMask); err != nil {
				t.Fatal(err)
			}
			rtsMask := verbs.AttrState | verbs.AttrSQPSN | verbs.AttrTimeout | verbs.AttrRetryCount | verbs.AttrRNRRetry | verbs.AttrMaxRDAtomic
			rts := verbs.QPAttr{State: verbs.StateRTS, SQPSN: ea.PSN, Timeout: 14, RetryCount: 7, RNRRetry: 7, MaxRDAtomic: 1}
			for _, c := range []struct {
				what string
				set  func(*verbs.QPAttr)
			}{
				{"a 25-bit send PSN", func(a *verbs.QPAttr) { a.SQPSN = 1 << 24 }},
				{"Timeout 32", func(a *verbs.QPAttr) { a.Timeout = 32 }},
				{"RetryCount 8", func(a *verbs.QPAttr) { a.RetryCount = 8 }},
				{"RNRRetry 8", func(a *verbs.QPAttr) { a.RNRRetry = 8 }},
				{"MaxRDAtomic 255", func(a *verbs.QPAttr) {
					if da.MaxQPInitRDAtom > 0 && da.MaxQPInitRDAtom < 255 {
						a.MaxRDAtomic = 255
					} else {
						a.Timeout = 32 // no limit to exceed: refused anyway
					}
				}},
			} {
				attr := rts
				c.set(&attr)
				bad(c.what, verbs.StateRTR, attr, rtsMask)
			}
			if err := qa.Modify(rts, rtsMask); err != nil {
				t.Fatalf("Modify to RTS with attributes in range: %v", err)
			}
		})
	}
}

// TestAdversarialZeroObjectsDevices hands zero values of CompletionQueue
// and CompletionChannel (not from their constructors) to the calls that
// take them, as a careless caller might: each must fail with an error
// wrapping ErrClosed ("object not initialised"), as the zero values of
// the other objects do, not panic on a nil pointer.
func TestAdversarialZeroObjectsDevices(t *testing.T) {
	for _, devs := range advDevicePairs(t) {
		t.Run(devs[0], func(t *testing.T) {
			verbstest.CheckLeaks(t)
			a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: devs[0], DeviceB: devs[1], SeparateContexts: true})
			for _, c := range []struct {
				what string
				f    func() error
			}{
				{"NewRCQueuePair with a zero SendCQ", func() error {
					q, err := a.PD.NewRCQueuePair(verbs.QPSpec{SendCQ: &verbs.CompletionQueue{}})
					if err == nil {
						q.Close()
					}
					return err
				}},
				{"NewUDQueuePair with a zero RecvCQ", func() error {
					q, err := a.PD.NewUDQueuePair(verbs.QPSpec{SendCQ: a.CQ, RecvCQ: &verbs.CompletionQueue{}})
					if err == nil {
						q.Close()
					}
					return err
				}},
				{"NewCompletionQueue with a zero Channel", func() error {
					cq, err := a.Ctx.NewCompletionQueue(verbs.CQSpec{Channel: &verbs.CompletionChannel{}})
					if err == nil {
						cq.Close()
					}
					return err
				}},
				{"Wait on a zero CompletionQueue", func() error {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					return (&verbs.CompletionQueue{}).Wait(ctx)
				}},
			} {
				func() {
					defer func() {
						if r := recover(); r != nil {
							t.Errorf("%s: panic: %v", c.what, r)
						}
					}()
					if err := c.f(); !errors.Is(err, verbs.ErrClosed) {
						t.Errorf("%s: %v, want an error wrapping ErrClosed", c.what, err)
					}
				}()
			}
		})
	}
}

// TestAdversarialUDControlledQKeyDevices sends a datagram whose
// Destination.QKey has its high bit set: verbs (ibv_post_send(3), IBA
// 10.2.4) then send with the sending QP's own Q_Key, which here matches
// the receiver's, so it must be delivered. soft0 does so; rdma_rxe sent
// the Q_Key as given and the receiver dropped the datagram, so the
// hardware provider substitutes the QP's Q_Key itself.
func TestAdversarialUDControlledQKeyDevices(t *testing.T) {
	forAdvDevices(t, func(t *testing.T, cfg verbstest.Config) {
		verbstest.CheckLeaks(t)
		a, b := verbstest.NewNodes(t, cfg)
		qa, qb := a.NewUD(t, verbs.QPSpec{}), b.NewUD(t, verbs.QPSpec{})
		eb := verbstest.Endpoint(t, qb)
		ah := a.AddressHandle(t, qa, eb)
		src := a.Alloc(t, 64, verbs.AccessLocalWrite)
		dst := b.Alloc(t, 3*128, verbs.AccessLocalWrite)
		copy(src.Bytes(), "controlled.....ordinary.......")
		for i := range 3 {
			if err := qb.PostRecv(uint64(1+i), verbstest.SGE(t, dst, 128*i, 128)); err != nil {
				t.Fatal(err)
			}
		}
		bt := qa.NewBatch(2)
		bt.Send(2, verbs.Destination{AH: ah, QPN: eb.QPN, QKey: 0x80000000}, verbstest.SGE(t, src, 0, 15)).Signaled()
		bt.SendInline(3, verbs.Destination{AH: ah, QPN: eb.QPN, QKey: 0x80000000 | 0x1234}, []byte("inline")).Signaled()
		if err := bt.Submit(); err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			if c := advPollOne(t, a.CQ, "send completion"); c.Status != verbs.StatusSuccess {
				t.Fatalf("send completion %d: %v", i, c)
			}
		}
		// Datagrams between two QPs over one path arrive in order: if the
		// first two were dropped, the first receive takes this one.
		if err := qa.PostSend(4, verbs.Signaled, verbs.Destination{AH: ah, QPN: eb.QPN, QKey: eb.QKey}, verbstest.SGE(t, src, 15, 15)); err != nil {
			t.Fatal(err)
		}
		advPollOne(t, a.CQ, "send completion")
		c := advPollOne(t, b.CQ, "receive completion")
		if got := string(dst.Bytes()[40 : 40+15]); c.Status != verbs.StatusSuccess || got != "controlled....." {
			t.Errorf("first datagram received: %v, %q; want the one sent with a controlled Q_Key (%q)", c, got, "controlled.....")
		}
		c = advPollOne(t, b.CQ, "receive completion")
		if got := string(dst.Bytes()[128+40 : 128+40+6]); c.Status != verbs.StatusSuccess || got != "inline" {
			t.Errorf("second datagram received: %v, %q; want the inline one sent with a controlled Q_Key", c, got)
		}
		c = advPollOne(t, b.CQ, "receive completion")
		if got := string(dst.Bytes()[256+40 : 256+40+15]); c.Status != verbs.StatusSuccess || got != "ordinary......." {
			t.Errorf("third datagram received: %v, %q; want the ordinary one", c, got)
		}
	})
}
