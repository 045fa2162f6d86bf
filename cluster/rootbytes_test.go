package cluster_test

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/verbstest"
)

// countingListener counts the bytes read from and written to the
// connections it accepts.
type countingListener struct {
	net.Listener
	in, out atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, l: l}, nil
}

type countingConn struct {
	net.Conn
	l *countingListener
}

func (c *countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.l.in.Add(int64(n))
	return n, err
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.l.out.Add(int64(n))
	return n, err
}

// TestJoinRendezvousRootBytes: in a rendezvous, each rank sends the root
// its card once and a queue pair number per rank, not one whole entry
// per rank: the root of a world of 16 reads at most 1 KiB plus the items
// (16 × ItemSize bytes) from each rank, handshake included. With one
// ~300-byte entry per rank (nodeVersion 1) it read 5 KiB from each.
func TestJoinRendezvousRootBytes(t *testing.T) {
	const n = 16
	verbstest.CheckLeaks(t)
	cfg, lns := loopbackConfig(t, n)
	root := &countingListener{Listener: lns[0]}
	ctx := testContext(t)
	ms := make([]*member, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		ms[i] = &member{}
		o := cluster.JoinOptions{Mode: cluster.Rendezvous, Listener: lns[i], Prepare: ms[i].publish}
		if i == 0 {
			o.Listener = root
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ms[i].node, errs[i] = cluster.Join(ctx, cfg, i, o)
		}()
	}
	wg.Wait()
	for i, m := range ms {
		if errs[i] != nil {
			t.Errorf("rank %d: %v", i, errs[i])
		}
		if m.node != nil {
			defer m.node.Close()
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	in, out := root.in.Load(), root.out.Load()
	t.Logf("the root read %d bytes (%d per rank) and wrote %d (%d per rank)", in, in/(n-1), out, out/(n-1))
	if limit := int64(n-1) * (1024 + n*6); in > limit {
		t.Errorf("the root read %d bytes from %d ranks, want at most %d", in, n-1, limit)
	}
	// Every rank works: a barrier of the world.
	forEach(t, ms, func(i int, m *member) error { return m.node.Barrier(ctx, nil) })
}
