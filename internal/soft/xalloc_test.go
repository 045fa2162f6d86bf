package soft

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/goverbs/verbs/internal/prov"
)

// The data path of every inter-process transport allocates nothing once
// it runs: not the poster, not the connection's reader, flusher or the
// QP's goroutine (testing.AllocsPerRun counts the whole process). The
// operations are those of BenchmarkXprocWriteBandwidth and
// BenchmarkXprocSendRTT: batches of RDMA writes of every size class (one
// frame written by the poster, a frame of a segment's size, a message in
// segments written by the QP's goroutine), RDMA reads, and 8-byte sends
// answered by sends, waiting in the completion channel as an application
// that sleeps does and polling as one that spins does.
func TestXprocNoAllocs(t *testing.T) {
	type op struct {
		name string
		op   prov.WROpcode
		size int
	}
	ops := []op{
		{"write/8B", prov.WRWrite, 8},
		{"write/64KiB", prov.WRWrite, 64 << 10},
		{"write/1MiB", prov.WRWrite, 1 << 20},
		{"read/64KiB", prov.WRRead, 64 << 10},
		{"read/1MiB", prov.WRRead, 1 << 20},
		{"send/8B/sleep", prov.WRSend, 8},
		{"send/8B/spin", prov.WRSend, -8},
	}
	for _, kind := range xprocKinds {
		for _, o := range ops {
			if o.size >= 1<<20 && kind != "shm" && testing.Short() || o.size > 8 && raceEnabled {
				continue // hundreds of MiB (the race detector copies slowly)
			}
			t.Run(kind+"/"+o.name, func(t *testing.T) {
				forceTransport(t, kind)
				forceTLS(t, tlsOff)
				e := newEnv(t)
				qa, cqa, cha := xprocSide(t, e)
				qb, cqb, chb := xprocSide(t, e)
				connectOne(t, qa, qb, prov.QPTypeRC, defaultConn())
				connectOne(t, qb, qa, prov.QPTypeRC, defaultConn())
				var f func()
				if o.op == prov.WRSend {
					f = sendPingPong(t, e, qa, qb, [2]prov.CQ{cqa, cqb}, [2]prov.CompChannel{cha, chb}, o.size < 0)
				} else {
					f = oneSidedBatch(t, e, qa, cqa, cha, o.op, o.size)
				}
				// Fewer allocations than operations by far: a run is
				// 16 one-sided operations (fewer than one
				// allocation per run passes) or two sends (fewer than
				// one per 2 runs: a per-message allocation makes 400),
				// which is stricter than testing.AllocsPerRun's 0
				// (fewer than one per run). What the runtime and soft0
				// allocate now and then on their own account passes:
				// the records of goroutines that wait for a channel or
				// a mutex, refilled when a processor's cache runs dry,
				// a slice that grows to a new largest burst, a QP's
				// goroutine or response timer started at its first
				// use. On a loaded machine (CI: the race detector,
				// other packages' tests beside) those came to 51 in
				// 200 ping-pongs once, against a limit of 50 then
				// (0-35 on an idle machine, 12-30 with two busy loops
				// beside).
				warm, runs, limit := 100, 200, uint64(100)
				if o.op != prov.WRSend {
					warm, runs, limit = 20, 40, 40
				}
				if n := allocsIn(warm, runs, f); n >= limit {
					t.Errorf("%d allocations in %d runs", n, runs)
				}
			})
		}
	}
}

// oneSidedBatch returns a function that posts 16 RDMA operations of size
// bytes from q (the last signaled), waits for their completion sleeping in
// ch, and checks the bytes moved. One batch is in flight: with
// BenchmarkXprocWriteBandwidth's bwDepth of 64 KiB writes over TCP the
// send queue can outgrow the buffer pool (bufPoolMax, which the memory
// bounds of TestAmplification count on), and a buffer is allocated now
// and then.
func oneSidedBatch(t *testing.T, e *env, q prov.QP, cq prov.CQ, ch prov.CompChannel, op prov.WROpcode, size int) func() {
	const batch = 16
	src, dst := e.alloc(size, allAccess), e.alloc(size, allAccess)
	local, remote := src, dst
	if op == prov.WRRead {
		local, remote = dst, src
	}
	wrs := make([]prov.SendWR, batch)
	for i := range wrs {
		wrs[i] = prov.SendWR{WRID: uint64(i), Opcode: op, NumSGE: 1, RemoteAddr: remote.addr(0), RKey: remote.mr.RKey()}
	}
	wrs[batch-1].Flags = prov.SendSignaled
	sges := []prov.SGE{local.sge(0, size)}
	var wcs [4]prov.Completion
	round := byte(0)
	return func() {
		round++
		src.b[0], src.b[size-1] = round, ^round
		if n, err := q.PostSend(wrs, sges); err != nil || n != batch {
			t.Fatalf("post: %d %v", n, err)
		}
		waitCQ(t, cq, ch, wcs[:], 1)
		if dst.b[0] != round || dst.b[size-1] != ^round {
			t.Fatalf("round %d: the data did not arrive", round)
		}
	}
}

// sendPingPong returns a function that sends 8 bytes from a to b and
// back, waiting for the completions polling (spin) or sleeping in the
// channels, and checks the bytes.
func sendPingPong(t *testing.T, e *env, a, b prov.QP, cqs [2]prov.CQ, chs [2]prov.CompChannel, spin bool) func() {
	m := e.alloc(4096, allAccess)
	qps := [2]prov.QP{a, b}
	swr := []prov.SendWR{{Opcode: prov.WRSend, NumSGE: 1, Flags: prov.SendSignaled}}
	rwr := []prov.RecvWR{{NumSGE: 1}}
	ssg := [2][]prov.SGE{{m.sge(0, 8)}, {m.sge(8, 8)}}
	rsg := [2][]prov.SGE{{m.sge(1024, 8)}, {m.sge(2048, 8)}}
	var dst [4]prov.Completion
	wait := func(i, n int) {
		if !spin {
			waitCQ(t, cqs[i], chs[i], dst[:], n)
			return
		}
		for n > 0 {
			k, err := cqs[i].Poll(dst[:min(n, len(dst))])
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range dst[:k] {
				if c.Status != prov.StatusSuccess {
					t.Fatalf("%+v", c)
				}
			}
			n -= k
		}
	}
	round := byte(0)
	return func() {
		round++
		m.b[0], m.b[8] = round, ^round
		for i := range qps {
			if n, err := qps[i].PostRecv(rwr, rsg[i]); err != nil || n != 1 {
				t.Fatalf("post recv: %d %v", n, err)
			}
		}
		if n, err := a.PostSend(swr, ssg[0]); err != nil || n != 1 {
			t.Fatalf("post send: %d %v", n, err)
		}
		wait(1, 1) // b's receive
		if n, err := b.PostSend(swr, ssg[1]); err != nil || n != 1 {
			t.Fatalf("post send: %d %v", n, err)
		}
		wait(0, 2) // a's send and receive
		wait(1, 1) // b's send
		if m.b[2048] != round || m.b[1024] != ^round {
			t.Fatalf("round %d: got %d and %d", round, m.b[2048], m.b[1024])
		}
	}
}

// allocsIn counts the allocations of the whole process while f runs runs
// times, after warm runs that let pools and queues reach their steady
// size (testing.AllocsPerRun rounds the average down: it would miss an
// allocation every other run). No collection runs meanwhile: a collection
// empties the runtime's caches (of the records of goroutines waiting for
// a mutex, for example), which are then allocated again.
func allocsIn(warm, runs int, f func()) uint64 {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	for range warm {
		f()
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&after)
	return after.Mallocs - before.Mallocs
}
