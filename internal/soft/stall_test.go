package soft

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"testing"
	"time"

	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/testproc"
)

// Tests of what a RC requester takes for its peer's silence (xreq.go,
// retire; conn.showLife).

// TestRequesterStallNotBlamed: a requester whose own timer runs late
// (this process stalled: every tick of its response timer comes 150 ms,
// more than a period, after it was due) does not blame its peer for the
// time it did not run. The target's responder is held for 2 s (both QPs
// in this process, over a forced socket transport: no sign of life but
// frames), longer than five late ticks take; the write must succeed
// once it is released. soft0 charged each late tick as a period of the
// peer's silence and failed it with RETRY_EXC_ERR.
func TestRequesterStallNotBlamed(t *testing.T) {
	const (
		late  = 150 * time.Millisecond // > a period of the 250 ms timeout
		held  = 2 * time.Second
		bytes = 8
	)
	for _, kind := range []string{"tcp", "unix"} {
		t.Run(kind, func(t *testing.T) {
			forceTransport(t, kind)
			forceTLS(t, tlsOff)
			o := defaultConn()
			o.timeout, o.retryCnt = 10, 0 // 4 ms × 1: minRespTimeout, 250 ms
			e, a, b := pair(t, prov.QPTypeRC, o, o)
			src, dst := privMem(t, e, 4096), privMem(t, e, 4096)
			write := func(wrid uint64, v byte) prov.Completion {
				t.Helper()
				for i := range bytes {
					src.b[i] = v
				}
				wr := []prov.SendWR{{WRID: wrid, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
					RemoteAddr: dst.addr(0), RKey: dst.mr.RKey()}}
				if _, err := a.qp.PostSend(wr, []prov.SGE{src.sge(0, bytes)}); err != nil {
					t.Fatal(err)
				}
				return spin(t, a.scq, 1)[0]
			}
			if c := write(1, 1); c.Status != prov.StatusSuccess {
				t.Fatalf("first write: %+v", c)
			}
			f := getFabric()
			f.testTickLate.Store(int64(late))
			t.Cleanup(func() { f.testTickLate.Store(0) })
			bq := b.qp.(*qp)
			bq.rmu.Lock()
			release := time.AfterFunc(held, bq.rmu.Unlock)
			c := write(2, 2)
			if release.Stop() {
				bq.rmu.Unlock()
			}
			if c.Status != prov.StatusSuccess {
				t.Fatalf("write to a target held for %v by a requester whose timer ticks %v late: %+v, want success", held, late, c)
			}
			if dst.b[0] != 2 {
				t.Fatalf("the target holds %d, want 2", dst.b[0])
			}
		})
	}
}

// TestSlowLongWrite: a 2 MiB RDMA write into a peer process whose
// responder sleeps 60 ms before each segment of the message but the last
// (a process that gets a processor now and then) takes about 900 ms to
// arrive, several times the QP's 250 ms response timeout; the peer runs
// all along, and must not be declared dead: the write succeeds and its
// bytes are in the peer's region. Over TCP (and TLS) the requester had no
// sign of the peer's life until the acknowledgement of the last segment,
// and failed the write with RETRY_EXC_ERR; the responder now sends alive
// frames while it handles a long message (conn.showLife).
func TestSlowLongWrite(t *testing.T) {
	const (
		size  = 2 << 20
		delay = 60 // ms per segment
	)
	for _, kind := range append(lifeKinds, "shm-copied") {
		t.Run(kind, func(t *testing.T) {
			env, unshared := lifeEnv(kind), 0
			if kind == "shm-copied" {
				// The payload goes through the ring: the region
				// cannot be mapped, and the responder pulls nothing.
				forceLife(t, "shm")
				t.Setenv(envPull, "0")
				env, unshared = append(lifeEnv("shm"), envPull+"=0"), 1
			} else {
				forceLife(t, kind)
			}
			e := newEnv(t)
			p := testproc.Start(t, env...)
			l := newLifeQP(t, e)
			l.connectChild(t, p, 10, 0) // 4 ms × 1: minRespTimeout, 250 ms
			p.Send(t, "slowregion %d %d %d", size, delay, unshared)
			f := p.Line(t, "region")
			raddr := must(strconv.ParseUint(f[0], 10, 64))
			rkey := must(strconv.ParseUint(f[1], 10, 32))
			src := e.alloc(size, allAccess)
			for i := range src.b {
				src.b[i] = byte(i*13 + i>>12)
			}
			wr := []prov.SendWR{{WRID: 7, Opcode: prov.WRWrite, NumSGE: 1, Flags: prov.SendSignaled,
				RemoteAddr: raddr, RKey: uint32(rkey)}}
			if _, err := l.qp.PostSend(wr, []prov.SGE{src.sge(0, size)}); err != nil {
				t.Fatal(err)
			}
			if c := l.wait(t, 1)[0]; c.Status != prov.StatusSuccess || c.WRID != 7 {
				t.Fatalf("%d KiB write into a peer that handles a segment every %d ms: %+v, want success", size>>10, delay, c)
			}
			h := fnv.New64a()
			h.Write(src.b)
			p.Send(t, "sum")
			if got, want := p.Line(t, "sum")[0], fmt.Sprintf("%x", h.Sum64()); got != want {
				t.Fatalf("the peer's region hashes to %s, want %s (the bytes written)", got, want)
			}
			p.Send(t, "exit")
			p.Stop(t)
		})
	}
}
