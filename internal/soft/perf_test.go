package soft

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
)

// Several goroutines post sends, writes and receives on a pair of QPs in
// both directions; every message arrives intact and in order per sender.
func TestConcurrentStress(t *testing.T) {
	const (
		perSide  = 3 // goroutines posting on each QP
		msgs     = 300
		msgBytes = 64
	)
	e := newEnv(t)
	caps := prov.QPCap{MaxSendWR: 256, MaxRecvWR: 1024, MaxSendSGE: 1, MaxRecvSGE: 1}
	a := e.newQP(prov.QPTypeRC, caps, nil)
	b := e.newQP(prov.QPTypeRC, caps, nil)
	o := defaultConn()
	o.minRNR = 1
	connectOne(t, a.qp, b.qp, prov.QPTypeRC, o)
	connectOne(t, b.qp, a.qp, prov.QPTypeRC, o)
	mem := e.alloc(1<<20, allAccess)

	var wg sync.WaitGroup
	errc := make(chan error, 16)
	// Receivers: keep receive queues stocked and count arrivals.
	recvd := [2]int{}
	for side, q := range []*ep{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := 512*1024 + side*256*1024
			posted, got := 0, 0
			var dst [32]prov.Completion
			total := perSide * msgs
			for got < total {
				for posted-got < 512 && posted < total {
					off := base + (posted%1024)*msgBytes*2
					_, err := q.qp.PostRecv([]prov.RecvWR{{WRID: uint64(posted), NumSGE: 1}}, []prov.SGE{mem.sge(off%(1<<20), msgBytes)})
					if err != nil {
						errc <- fmt.Errorf("post recv: %w", err)
						return
					}
					posted++
				}
				n, err := q.rcq.Poll(dst[:])
				if err != nil {
					errc <- err
					return
				}
				for _, c := range dst[:n] {
					if c.Status != prov.StatusSuccess || c.ByteLen != msgBytes {
						errc <- fmt.Errorf("recv completion %+v", c)
						return
					}
				}
				got += n
			}
			recvd[side] = got
		}()
	}
	// Senders: alternate sends and writes, signal every 8th; poll their own completions.
	sent := [2][perSide]int{}
	for side, q := range []*ep{a, b} {
		for g := range perSide {
			wg.Add(1)
			go func() {
				defer wg.Done()
				src := (side*perSide + g) * 4096
				for i := 0; i < msgs; i++ {
					wrs := []prov.SendWR{
						{WRID: uint64(i), Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled},
						{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1, RemoteAddr: mem.addr(256*1024 + src), RKey: mem.mr.RKey()},
					}
					for {
						n, err := q.qp.PostSend(wrs, []prov.SGE{mem.sge(src, msgBytes)})
						if n == len(wrs) {
							break
						}
						wrs = wrs[n:]
						if err == nil || !errors.Is(err, prov.ErrQueueFull) {
							errc <- fmt.Errorf("post send: %v", err)
							return
						}
						runtime.Gosched() // wait for room
					}
				}
				sent[side][g] = msgs
			}()
		}
	}
	// Drain send completions.
	for _, q := range []*ep{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var dst [32]prov.Completion
			got := 0
			for got < perSide*msgs {
				n, err := q.scq.Poll(dst[:])
				if err != nil {
					errc <- err
					return
				}
				for _, c := range dst[:n] {
					if c.Status != prov.StatusSuccess {
						errc <- fmt.Errorf("send completion %+v", c)
						return
					}
				}
				got += n
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case err := <-errc:
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		t.Fatal(err)
	default:
	}
	if recvd != [2]int{perSide * msgs, perSide * msgs} {
		t.Fatalf("received %v", recvd)
	}
	if state(t, a.qp) != prov.QPStateRTS || state(t, b.qp) != prov.QPStateRTS {
		t.Fatal("QPs left RTS")
	}
}

// writeBench is a connected loopback pair with a batch of writes ready.
type writeBench struct {
	e      *env
	a      *ep
	wrs    []prov.SendWR
	sges   []prov.SGE
	dst    []prov.Completion
	src    *buf
	target *buf
}

func newWriteBench(tb testing.TB, batch, size int) *writeBench {
	e := newEnv(tb)
	caps := prov.QPCap{MaxSendWR: max(batch, 64), MaxRecvWR: 16, MaxSendSGE: 1, MaxRecvSGE: 1}
	a := e.newQP(prov.QPTypeRC, caps, nil)
	b := e.newQP(prov.QPTypeRC, caps, nil)
	connectOne(tb, a.qp, b.qp, prov.QPTypeRC, defaultConn())
	connectOne(tb, b.qp, a.qp, prov.QPTypeRC, defaultConn())
	w := &writeBench{e: e, a: a, src: e.alloc(size, allAccess), target: e.alloc(size, allAccess),
		dst: make([]prov.Completion, 64)}
	w.sges = []prov.SGE{w.src.sge(0, size)}
	w.wrs = make([]prov.SendWR, batch)
	for i := range w.wrs {
		w.wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: prov.WRWrite, NumSGE: 1,
			RemoteAddr: w.target.addr(0), RKey: w.target.mr.RKey()}
	}
	w.wrs[batch-1].Flags = prov.SendSignaled // one completion per batch
	return w
}

// run posts the batch and polls its completion.
func (w *writeBench) run(tb testing.TB) {
	n, err := w.a.qp.PostSend(w.wrs, w.sges)
	if err != nil || n != len(w.wrs) {
		tb.Fatalf("post: %d %v", n, err)
	}
	for {
		k, err := w.a.scq.Poll(w.dst)
		if err != nil {
			tb.Fatal(err)
		}
		if k > 0 {
			if w.dst[0].Status != prov.StatusSuccess {
				tb.Fatalf("%+v", w.dst[0])
			}
			return
		}
	}
}

func TestNoAllocs(t *testing.T) {
	for _, batch := range []int{1, 64} {
		w := newWriteBench(t, batch, 64)
		w.run(t) // warm up
		if n := testing.AllocsPerRun(100, func() { w.run(t) }); n != 0 {
			t.Errorf("batch %d: %v allocs per PostSend+Poll", batch, n)
		}
	}
	// Sends with receives too.
	_, a, b := pair(t, prov.QPTypeRC, defaultConn(), defaultConn())
	m := a.e.alloc(4096, allAccess)
	swr := []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
	rwr := []prov.RecvWR{{NumSGE: 1}}
	sg := []prov.SGE{m.sge(0, 64)}
	rsg := []prov.SGE{m.sge(1024, 64)}
	var dst [4]prov.Completion
	f := func() {
		b.qp.PostRecv(rwr, rsg)
		a.qp.PostSend(swr, sg)
		a.scq.Poll(dst[:])
		b.rcq.Poll(dst[:])
	}
	f()
	if n := testing.AllocsPerRun(100, f); n != 0 {
		t.Errorf("send/recv: %v allocs", n)
	}
	if !bytes.Equal(m.b[1024:1088], m.b[:64]) {
		t.Error("data")
	}
}

func BenchmarkWrite64(b *testing.B) {
	for _, batch := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			w := newWriteBench(b, batch, 64)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				w.run(b)
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds()/1e6, "Mops/s")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/wr")
		})
	}
}

func BenchmarkWriteBandwidth(b *testing.B) {
	for _, size := range []int{64 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			w := newWriteBench(b, 1, size)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				w.run(b)
			}
		})
	}
}

// BenchmarkCopy is the baseline for BenchmarkWriteBandwidth: a plain copy
// between the same kind of memory.
func BenchmarkCopy(b *testing.B) {
	for _, size := range []int{64 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("size=%dKiB", size>>10), func(b *testing.B) {
			e := newEnv(b)
			src, dst := e.alloc(size, allAccess), e.alloc(size, allAccess)
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				copy(dst.b, src.b)
			}
		})
	}
}

// Traffic in both directions while an MR is deregistered and a QP is moved
// to ERR: nothing hangs and every signaled request completes exactly once.
func TestChaos(t *testing.T) {
	for iter := range 5 {
		e := newEnv(t)
		caps := prov.QPCap{MaxSendWR: 64, MaxRecvWR: 256, MaxSendSGE: 1, MaxRecvSGE: 1}
		a := e.newQP(prov.QPTypeRC, caps, nil)
		b := e.newQP(prov.QPTypeRC, caps, nil)
		connectOne(t, a.qp, b.qp, prov.QPTypeRC, defaultConn())
		connectOne(t, b.qp, a.qp, prov.QPTypeRC, defaultConn())
		m := e.alloc(1<<16, allAccess)
		r := e.alloc(1<<16, allAccess)
		victim := must(e.pd.RegMR(prov.Mem{Ptr: r.mr.(*mr).base, Len: 1 << 16, FD: -1}, allAccess))
		vkey, vaddr := victim.RKey(), victim.Addr()

		stop := make(chan struct{})
		var wg, senders sync.WaitGroup
		var posted [2]int64
		var mu sync.Mutex
		for side, q := range []*ep{a, b} {
			for g := range 2 {
				senders.Add(1)
				go func() {
					defer senders.Done()
					for i := 0; i < 400; i++ {
						op := prov.WRWrite
						if i%3 == 0 {
							op = prov.WRSend
						}
						wr := []prov.SendWR{{WRID: uint64(i), Opcode: op, NumSGE: 1, Flags: prov.SendSignaled,
							RemoteAddr: vaddr + uint64(g*64), RKey: vkey}}
						n, err := q.qp.PostSend(wr, []prov.SGE{m.sge(side*4096+g*64, 64)})
						if n == 1 {
							mu.Lock()
							posted[side]++
							mu.Unlock()
						} else if !errors.Is(err, prov.ErrQueueFull) {
							t.Errorf("post: %v", err)
							return
						} else {
							runtime.Gosched()
						}
					}
				}()
			}
			wg.Add(1)
			go func() { // receiver
				defer wg.Done()
				var dst [32]prov.Completion
				for {
					select {
					case <-stop:
						return
					default:
					}
					q.qp.PostRecv([]prov.RecvWR{{NumSGE: 1}}, []prov.SGE{m.sge(32768+side*4096, 64)})
					q.rcq.Poll(dst[:])
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(iter) * 200 * time.Microsecond)
			victim.Close()
			time.Sleep(time.Duration(iter) * 100 * time.Microsecond)
			a.qp.Modify(&prov.QPAttr{State: prov.QPStateErr}, prov.AttrState)
		}()
		senders.Wait()
		// Every posted request completes.
		for side, q := range []*ep{a, b} {
			mu.Lock()
			want := int(posted[side])
			mu.Unlock()
			got := poll(t, q.scq, want)
			for _, c := range got {
				if c.Status != prov.StatusSuccess && c.Status != prov.StatusWRFlushErr && c.Status != prov.StatusRemAccessErr &&
					c.Status != prov.StatusRetryExcErr && c.Status != prov.StatusRemOpErr {
					t.Errorf("side %d: %+v", side, c)
				}
			}
			expectEmpty(t, q.scq)
		}
		close(stop)
		wg.Wait()
		if st := state(t, a.qp); st != prov.QPStateErr {
			t.Fatalf("a in %v", st)
		}
	}
}
