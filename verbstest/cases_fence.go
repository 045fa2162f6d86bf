package verbstest

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/goverbs/verbs"
)

// fenceStops is the check, under the Fence case, that a provider lists in
// Config.Deviations when its send queue may stop for good at a fenced
// request although every earlier request has completed (rdma_rxe). With
// it listed, a case whose send queue stops there, and nowhere else, is
// skipped with the reason and the round it reached; every round before
// it was checked in full.
const fenceStops = "StopsAtFence"

// testFence checks the fence flag: a fenced request starts only after
// every RDMA read and atomic posted before it on the QP has completed,
// so it can send what they fetched. Each round, A reads slots of B's
// memory (whose contents change every round) into its own buffers and
// atomically adds to a counter of B, then, fenced, sends and writes
// those buffers back to B; B must receive exactly what was read. The
// slots are of different sizes (up to beyond one packet and the
// provider's thresholds for copying directly) and all are in flight at
// once: a provider that pipelines the fenced requests behind the reads
// sends the stale contents of the buffers. Even rounds use a batch and
// Request.Fenced, odd rounds the single-request helpers and the Fenced
// flag.
func testFence(t *testing.T, c *tcase) {
	const rounds = 40
	sizes := []int{64, 4096, 20000, 70000}
	total := 0
	offs := make([]int, len(sizes))
	for i, n := range sizes {
		offs[i] = total
		total += n
	}
	nslot := len(sizes)
	// Per slot: read, fenced send, fenced write, fetch-add, fenced write
	// of its result.
	const perSlot = 5
	p := NewLoopbackRC(t, c.cfg, verbs.QPSpec{MaxSendWR: 2 * perSlot * nslot, MaxRecvWR: nslot})
	src := p.B.Alloc(t, total, accessAll)     // what A reads
	recv := p.B.Alloc(t, total, accessLocal)  // where A's fenced sends land
	wdst := p.B.Alloc(t, total, accessAll)    // where A's fenced writes land
	ctr := p.B.Alloc(t, 8, accessAll)         // the counter A adds to
	wres := p.B.Alloc(t, 8*nslot, accessAll)  // where A writes the fetched values
	local := p.A.Alloc(t, total, accessLocal) // A's read buffers
	res := p.A.Alloc(t, 8*nslot, accessLocal) // A's fetch-add results
	putWord(ctr.Bytes(), 0, 0)

	stopReason, mayStop := c.cfg.skipReason(c.name + "/" + fenceStops)
	fenced := func(id int) bool { return id%perSlot == 1 || id%perSlot == 2 || id%perSlot == 4 }
	pollA := func(r int) []verbs.Completion {
		wcs, err := PollN(c.guard(t), p.A.CQ, perSlot*nslot)
		if err == nil {
			return wcs
		}
		// Completions of one RC queue come in order: wcs are requests
		// 0 to len(wcs)-1.
		if mayStop && errors.Is(err, context.DeadlineExceeded) && fenced(len(wcs)) {
			t.Skipf("%s: round %d stopped at request %d, which is fenced, after every earlier request completed "+
				"(rounds 0 to %d passed every check)", stopReason, r, len(wcs), r-1)
		}
		t.Fatalf("round %d: %v (got %v)", r, err, wcs)
		return nil
	}

	for r := range rounds {
		Pattern(src.Bytes(), byte(3*r+1))
		Pattern(local.Bytes(), 0xEE)
		Pattern(res.Bytes(), 0xEE)
		Pattern(recv.Bytes(), 0xDD)
		Pattern(wdst.Bytes(), 0xDD)
		for i := range nslot {
			must(t, "post recv", p.QB.PostRecv(uint64(i), SGE(t, recv, offs[i], sizes[i])))
		}
		batch := r%2 == 0
		var b *verbs.RCBatch
		if batch {
			b = p.QA.NewBatch(perSlot * nslot)
		}
		for i := range nslot {
			buf := SGE(t, local, offs[i], sizes[i])
			word := SGE(t, res, 8*i, 8)
			id := uint64(perSlot * i)
			if batch {
				b.Read(id, src.Remote().At(uint64(offs[i])), buf).Signaled()
				b.Send(id+1, buf).Signaled().Fenced()
				b.Write(id+2, wdst.Remote().At(uint64(offs[i])), buf).Signaled().Fenced()
				b.FetchAdd(id+3, ctr.Remote().At(0), 1, word).Signaled()
				b.Write(id+4, wres.Remote().At(uint64(8*i)), word).Signaled().Fenced()
				continue
			}
			must(t, "post read", p.QA.PostRead(id, verbs.Signaled, src.Remote().At(uint64(offs[i])), buf))
			must(t, "post fenced send", p.QA.PostSend(id+1, verbs.Signaled|verbs.Fenced, buf))
			must(t, "post fenced write", p.QA.PostWrite(id+2, verbs.Signaled|verbs.Fenced, wdst.Remote().At(uint64(offs[i])), buf))
			must(t, "post fetch-add", p.QA.PostFetchAdd(id+3, verbs.Signaled, ctr.Remote().At(0), 1, word))
			must(t, "post fenced write", p.QA.PostWrite(id+4, verbs.Signaled|verbs.Fenced, wres.Remote().At(uint64(8*i)), word))
		}
		if batch {
			must(t, "submit batch", b.Submit())
		}
		for _, wc := range pollA(r) {
			if err := wc.Err(); err != nil {
				t.Fatalf("round %d: %v", r, err)
			}
		}
		for _, wc := range c.poll(t, p.B.CQ, nslot) {
			if err := wc.Err(); err != nil {
				t.Fatalf("round %d: receive: %v", r, err)
			}
			if i := int(wc.WRID); i >= nslot || int(wc.ByteLen) != sizes[i] {
				t.Fatalf("round %d: receive %v: want wr_id < %d and byte_len of its slot", r, wc, nslot)
			}
		}
		how := "single requests with the Fenced flag"
		if batch {
			how = "a batch with Request.Fenced"
		}
		what := fmt.Sprintf("round %d (%s)", r, how)
		checkBytes(t, what+": local buffers after the reads", local.Bytes(), src.Bytes())
		checkBytes(t, what+": what the fenced sends delivered", recv.Bytes(), src.Bytes())
		checkBytes(t, what+": what the fenced writes wrote", wdst.Bytes(), src.Bytes())
		got := make([]uint64, nslot)
		for i := range nslot {
			got[i] = word(wres.Bytes(), 8*i)
		}
		// The fetch-adds run in order: slot i fetched r*nslot+i.
		for i := range nslot {
			if want := uint64(r*nslot + i); got[i] != want || word(res.Bytes(), 8*i) != want {
				t.Fatalf("%s: fetch-add of slot %d fetched %#x, its fenced write delivered %#x, want %#x",
					what, i, word(res.Bytes(), 8*i), got[i], want)
			}
		}
		if t.Failed() {
			return
		}
	}
	if got, want := word(ctr.Bytes(), 0), uint64(rounds*nslot); got != want {
		t.Errorf("counter after %d fetch-adds: %d", want, got)
	}
}
