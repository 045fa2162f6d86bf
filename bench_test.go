package verbs_test

import (
	"fmt"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// benchPair is two connected RC queue pairs on soft0 with poll-only CQs, a
// source region on the sender and a destination region on the target.
type benchPair struct {
	a, b     *verbs.RCQueuePair
	cqA, cqB *verbs.CompletionQueue
	src, dst *verbs.MemoryRegion
	chunks   []verbs.SGE // src in 64-byte pieces
}

const benchDepth = 256 // send queue depth of the benchmark QPs

func newBenchPair(tb testing.TB, size int) *benchPair {
	tb.Helper()
	must := func(err error) {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
	}
	dev, err := verbs.Open(verbs.SoftDevice)
	must(err)
	tb.Cleanup(func() { must(dev.Close()) })
	pd, err := dev.AllocPD()
	must(err)
	tb.Cleanup(func() { must(pd.Close()) })
	p := &benchPair{}
	for _, cq := range []**verbs.CompletionQueue{&p.cqA, &p.cqB} {
		*cq, err = dev.NewCompletionQueue(verbs.CQSpec{Entries: 2 * benchDepth, NoChannel: true})
		must(err)
		tb.Cleanup(func() { must((*cq).Close()) })
	}
	spec := verbs.QPSpec{MaxSendWR: benchDepth, MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}
	spec.SendCQ = p.cqA
	p.a, err = pd.NewRCQueuePair(spec)
	must(err)
	tb.Cleanup(func() { must(p.a.Close()) })
	spec.SendCQ = p.cqB
	p.b, err = pd.NewRCQueuePair(spec)
	must(err)
	tb.Cleanup(func() { must(p.b.Close()) })
	epA, err := p.a.Endpoint()
	must(err)
	epB, err := p.b.Endpoint()
	must(err)
	must(p.a.Connect(epB))
	must(p.b.Connect(epA))
	p.src, err = pd.Alloc(size, verbs.AccessLocalWrite)
	must(err)
	tb.Cleanup(func() { must(p.src.Close()) })
	p.dst, err = pd.Alloc(size, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	must(err)
	tb.Cleanup(func() { must(p.dst.Close()) })
	for i := range p.src.Bytes() {
		p.src.Bytes()[i] = byte(i)
	}
	for off := 0; off+64 <= size; off += 64 {
		p.chunks = append(p.chunks, verbstest.SGE(tb, p.src, off, 64))
	}
	clear(p.dst.Bytes()) // fault the pages in
	return p
}

// submitPoll posts a batch of n 64-byte writes (the last signaled) with
// one Submit and polls until its completion arrives.
func submitPoll(p *benchPair, batch *verbs.RCBatch, wcs []verbs.Completion, n int) error {
	remote := p.dst.Remote()
	for i := range n {
		r := batch.Write(uint64(i), remote.At(uint64(i*64)), p.chunks[i])
		if i == n-1 {
			r.Signaled()
		}
	}
	return submitWait(p, batch, wcs)
}

// BenchmarkSubmitPoll measures one batch of 16 64-byte writes, the last
// signaled, plus the polling of its completion. It must not allocate.
func BenchmarkSubmitPoll(b *testing.B) {
	p := newBenchPair(b, 16*64)
	batch := p.a.NewBatch(16)
	wcs := make([]verbs.Completion, 16)
	b.ReportAllocs()
	for b.Loop() {
		if err := submitPoll(p, batch, wcs, 16); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)*16/b.Elapsed().Seconds()/1e6, "Mmsg/s")
}

// The data path (batch, Submit, Poll) does not allocate.
func TestSubmitPollNoAlloc(t *testing.T) {
	p := newBenchPair(t, 16*64)
	batch := p.a.NewBatch(16)
	wcs := make([]verbs.Completion, 16)
	var err error
	allocs := testing.AllocsPerRun(200, func() {
		if e := submitPoll(p, batch, wcs, 16); e != nil && err == nil {
			err = e
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if allocs != 0 {
		t.Errorf("a batch of 16 writes plus Poll allocates %v times per run, want 0", allocs)
	}
}

// stream writes n messages of size bytes from src to dst, keeping up to
// benchDepth requests outstanding and posting batches of batch requests,
// the last of each signaled.
func stream(p *benchPair, batch *verbs.RCBatch, wcs []verbs.Completion, n, size, per int) error {
	remote := p.dst.Remote().At(0)
	sge, err := p.src.SGE(0, size)
	if err != nil {
		return err
	}
	posted, done := 0, 0
	for done < n {
		for posted < n {
			k := min(per, n-posted)
			if posted+k-done > benchDepth {
				break
			}
			for j := range k {
				r := batch.Write(uint64(posted+j+1), remote, sge)
				if j == k-1 {
					r.Signaled()
				}
			}
			if err := batch.Submit(); err != nil {
				return err
			}
			posted += k
		}
		m, err := p.cqA.Poll(wcs)
		if err != nil {
			return err
		}
		for i := range wcs[:m] {
			if err := wcs[i].Err(); err != nil {
				return err
			}
			done = max(done, int(wcs[i].WRID))
		}
	}
	return nil
}

// BenchmarkWriteMsgRate streams 64-byte writes in batches of 1, 16 and 64
// (one op = one message) and reports millions of messages per second.
func BenchmarkWriteMsgRate(b *testing.B) {
	for _, per := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("batch=%d", per), func(b *testing.B) {
			p := newBenchPair(b, 4096)
			batch := p.a.NewBatch(per)
			wcs := make([]verbs.Completion, 64)
			b.ReportAllocs()
			b.ResetTimer()
			if err := stream(p, batch, wcs, b.N, 64, per); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds()/1e6, "Mmsg/s")
		})
	}
}

var benchSizes = []struct {
	name string
	n    int
}{{"64KiB", 64 << 10}, {"1MiB", 1 << 20}}

// BenchmarkWriteBW streams RDMA writes of 64 KiB and 1 MiB (batches of 16,
// the last signaled) into the same destination. Compare with BenchmarkCopy
// of the same size.
func BenchmarkWriteBW(b *testing.B) {
	for _, s := range benchSizes {
		b.Run("size="+s.name, func(b *testing.B) {
			p := newBenchPair(b, s.n)
			batch := p.a.NewBatch(16)
			wcs := make([]verbs.Completion, 64)
			b.SetBytes(int64(s.n))
			b.ReportAllocs()
			b.ResetTimer()
			if err := stream(p, batch, wcs, b.N, s.n, 16); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkCopy is the baseline of BenchmarkWriteBW: copy() between two
// buffers of the same size.
func BenchmarkCopy(b *testing.B) {
	for _, s := range benchSizes {
		b.Run("size="+s.name, func(b *testing.B) {
			src, dst := make([]byte, s.n), make([]byte, s.n)
			for i := range src {
				src[i] = byte(i)
			}
			b.SetBytes(int64(s.n))
			for b.Loop() {
				copy(dst, src)
			}
		})
	}
}

// submitWait submits the batch and polls until its first completion.
func submitWait(p *benchPair, batch *verbs.RCBatch, wcs []verbs.Completion) error {
	if err := batch.Submit(); err != nil {
		return err
	}
	for {
		k, err := p.cqA.Poll(wcs)
		if err != nil {
			return err
		}
		if k > 0 {
			return wcs[0].Err()
		}
	}
}

// submitPollInline is submitPoll with inline writes: of SGEs of the
// source MR (Inline: each SGE is checked against its MR at Submit), or,
// with data, of Go memory (WriteInline: copied into the batch).
func submitPollInline(p *benchPair, batch *verbs.RCBatch, wcs []verbs.Completion, n int, data [][]byte) error {
	remote := p.dst.Remote()
	for i := range n {
		var r *verbs.Request
		if data != nil {
			r = batch.WriteInline(uint64(i), remote.At(uint64(i*64)), data[i])
		} else {
			r = batch.Write(uint64(i), remote.At(uint64(i*64)), p.chunks[i]).Inline()
		}
		if i == n-1 {
			r.Signaled()
		}
	}
	return submitWait(p, batch, wcs)
}

// inlineData returns n 64-byte buffers of Go memory.
func inlineData(n int) [][]byte {
	d := make([][]byte, n)
	for i := range d {
		d[i] = make([]byte, 64)
	}
	return d
}

// BenchmarkSubmitPollInline is BenchmarkSubmitPoll with inline writes,
// from the source MR ("SGE") and from Go memory ("Data").
func BenchmarkSubmitPollInline(b *testing.B) {
	for _, kind := range []string{"SGE", "Data"} {
		b.Run(kind, func(b *testing.B) {
			p := newBenchPair(b, 16*64)
			batch := p.a.NewBatch(16)
			wcs := make([]verbs.Completion, 16)
			var data [][]byte
			if kind == "Data" {
				data = inlineData(16)
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := submitPollInline(p, batch, wcs, 16, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Inline batches, from an MR or from Go memory, do not allocate either.
func TestSubmitPollInlineNoAlloc(t *testing.T) {
	p := newBenchPair(t, 16*64)
	batch := p.a.NewBatch(16)
	wcs := make([]verbs.Completion, 16)
	for _, data := range [][][]byte{nil, inlineData(16)} {
		// Warm up: soft0 gives each send queue slot its inline buffer
		// when the slot is first used.
		for range 2 * benchDepth / 16 {
			if err := submitPollInline(p, batch, wcs, 16, data); err != nil {
				t.Fatal(err)
			}
		}
		var err error
		allocs := testing.AllocsPerRun(200, func() {
			if e := submitPollInline(p, batch, wcs, 16, data); e != nil && err == nil {
				err = e
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		if allocs != 0 {
			t.Errorf("a batch of 16 inline writes (Go memory: %v) plus Poll allocates %v times per run, want 0", data != nil, allocs)
		}
	}
}
