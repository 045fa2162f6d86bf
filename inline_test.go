package verbs_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// TestInlineCloseRace closes a memory region while another goroutine
// posts inline writes from it, single and batched, again and again. Close
// waits for the posts that are copying from the region, and posts that
// start after it fail naming the closed region (EINVAL: no open region
// has the lkey, or ErrClosed: it is being closed): none reads unmapped
// memory, and every write that was posted delivers the region's bytes.
func TestInlineCloseRace(t *testing.T) {
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{MaxInlineData: 64, MaxSendWR: 64})
	dst := p.B.Alloc(t, 4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	batch := p.QA.NewBatch(4)
	ctx, cancel := context.WithTimeout(context.Background(), verbstest.DefaultTimeout)
	defer cancel()
	for round := range 200 {
		src, err := p.A.PD.Alloc(4096, verbs.AccessLocalWrite)
		if err != nil {
			t.Fatal(err)
		}
		verbstest.Pattern(src.Bytes()[:64], byte(round))
		want := bytes.Clone(src.Bytes()[:64])
		sge := verbstest.SGE(t, src, 0, 64)
		var wg sync.WaitGroup
		var posted atomic.Int32
		var postErr error
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				var err error
				if i%2 == 0 {
					err = p.QA.PostWrite(uint64(i), verbs.Signaled|verbs.Inline, dst.Remote().At(0), sge)
				} else {
					batch.Write(uint64(i), dst.Remote().At(0), sge).Inline().Signaled()
					err = batch.Submit()
				}
				if err != nil {
					postErr = err
					return
				}
				posted.Add(1)
				if _, err := verbstest.PollN(ctx, p.A.CQ, 1); err != nil {
					postErr = err
					return
				}
			}
		}()
		// Close after a few posts (0 to 3), while more are under way.
		for posted.Load() < int32(round%4) && ctx.Err() == nil {
			runtime.Gosched()
		}
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		if !errors.Is(postErr, syscall.EINVAL) && !errors.Is(postErr, verbs.ErrClosed) {
			t.Fatalf("round %d: post after Close: %v, want an error wrapping EINVAL or ErrClosed", round, postErr)
		}
		if posted.Load() > 0 && !bytes.Equal(dst.Bytes()[:64], want) {
			t.Fatalf("round %d: %d inline writes were posted, but the target holds %x, want %x", round, posted.Load(), dst.Bytes()[:64], want)
		}
	}
}

// TestInlineDataEmpty sends empty inline messages, single and batched:
// each consumes a receive with byte_len 0.
func TestInlineDataEmpty(t *testing.T) {
	p := verbstest.NewLoopbackRC(t, verbstest.Config{DeviceA: verbs.SoftDevice}, verbs.QPSpec{})
	rbuf := p.B.Alloc(t, 64, verbs.AccessLocalWrite)
	for i := range 2 {
		if err := p.QB.PostRecv(uint64(i), rbuf.All()); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.QA.PostSendInline(10, verbs.Signaled, nil); err != nil {
		t.Fatal(err)
	}
	b := p.QA.NewBatch(1)
	b.SendInline(11, []byte{}).Signaled()
	if err := b.Submit(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), verbstest.DefaultTimeout)
	defer cancel()
	wcs, err := verbstest.PollN(ctx, p.B.CQ, 2)
	if err != nil {
		t.Fatal(err)
	}
	for i, wc := range wcs {
		if wc.Status != verbs.StatusSuccess || wc.WRID != uint64(i) || wc.ByteLen != 0 {
			t.Errorf("receive %d: %v, want success with byte_len 0", i, wc)
		}
	}
}
