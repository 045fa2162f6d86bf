package verbstest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/leak"
)

// CheckLeaks records the number of verbs objects reported as leaked so far
// and, when t ends (after the cleanups registered later, which run first),
// collects garbage a few times and fails t listing every object that was
// garbage-collected without Close in the meantime. Call it first in a test.
//
// Leaks are counted process-wide, so tests that call CheckLeaks should not
// run in parallel with tests that leak objects.
func CheckLeaks(t testing.TB) {
	t.Helper()
	start := leak.Count()
	t.Cleanup(func() {
		// Cleanups run on a runtime goroutine after the collection that
		// finds the object unreachable: give them a chance to run.
		for range 4 {
			runtime.GC()
			runtime.Gosched()
			time.Sleep(2 * time.Millisecond)
		}
		if leaks := leak.Since(start); len(leaks) > 0 {
			t.Errorf("verbstest: %d verbs object(s) leaked:\n\t%s", len(leaks), strings.Join(leaks, "\n\t"))
		}
	})
}

// OpenPD opens device dev and allocates a protection domain on it; both
// are closed when t ends, after the cleanups registered later (which
// close what uses the PD), and a close that fails fails t: a test that
// leaves something of the PD open learns it.
func OpenPD(t testing.TB, dev string) *verbs.ProtectionDomain {
	t.Helper()
	c, err := verbs.Open(dev)
	if err != nil {
		t.Fatalf("verbstest: open %s: %v", dev, err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("verbstest: close %s: %v", dev, err)
		}
	})
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatalf("verbstest: alloc pd on %s: %v", dev, err)
	}
	t.Cleanup(func() {
		if err := pd.Close(); err != nil {
			t.Errorf("verbstest: close pd of %s: %v", dev, err)
		}
	})
	return pd
}

// PollN polls cq until it has collected exactly n completions, or ctx ends.
// It takes no more than n completions from the CQ, so later ones stay
// there. It sleeps in cq.Wait when the CQ has a private completion channel
// and otherwise polls, yielding the processor between attempts. On error
// it returns the completions collected so far.
func PollN(ctx context.Context, cq *verbs.CompletionQueue, n int) ([]verbs.Completion, error) {
	out := make([]verbs.Completion, 0, n)
	buf := make([]verbs.Completion, 16)
	canWait := true
	idle := 0
	for len(out) < n {
		m, err := cq.Poll(buf[:min(len(buf), n-len(out))])
		out = append(out, buf[:m]...)
		if err != nil {
			return out, fmt.Errorf("verbstest: poll cq: %w", err)
		}
		if m > 0 {
			idle = 0
			continue
		}
		if len(out) >= n {
			break
		}
		if err := ctx.Err(); err != nil {
			return out, fmt.Errorf("verbstest: got %d of %d completions before the context ended: %w", len(out), n, err)
		}
		if canWait {
			err := cq.Wait(ctx)
			switch {
			case err == nil:
			case errors.Is(err, verbs.ErrNotSupported):
				canWait = false
			case ctx.Err() != nil:
				return out, fmt.Errorf("verbstest: got %d of %d completions before the context ended: %w", len(out), n, err)
			default:
				return out, fmt.Errorf("verbstest: wait on cq: %w", err)
			}
			continue
		}
		idle++
		if idle < 1000 {
			runtime.Gosched()
		} else {
			time.Sleep(50 * time.Microsecond)
		}
	}
	return out, nil
}

// closer is any verbs object.
type closer interface{ Close() error }

// Close levels: objects of a lower level are closed first, so that queue
// pairs stop before the memory, queues and domains they use go away.
const (
	levelQP = iota
	levelAH
	levelSRQ
	levelMR
	levelCQ
	levelChannel
	levelPD
	levelContext
	levelProcess // a peer process, once everything in it is closed
	numLevels
)

// tracker closes the objects of a test in a safe order when the test ends.
type tracker struct {
	mu    sync.Mutex
	items [numLevels][]tracked
}

type tracked struct {
	what string
	c    closer
}

func newTracker(t testing.TB) *tracker {
	tr := new(tracker)
	t.Cleanup(func() { tr.closeAll(t) })
	return tr
}

func (tr *tracker) add(level int, what string, c closer) {
	tr.mu.Lock()
	tr.items[level] = append(tr.items[level], tracked{what, c})
	tr.mu.Unlock()
}

func (tr *tracker) closeAll(t testing.TB) {
	tr.mu.Lock()
	items := tr.items
	tr.items = [numLevels][]tracked{}
	tr.mu.Unlock()
	for _, level := range items {
		for i := len(level) - 1; i >= 0; i-- {
			if err := level[i].c.Close(); err != nil {
				t.Errorf("verbstest: close %s: %v", level[i].what, err)
			}
		}
	}
}

// Node is one side of a loopback test: a device context, a protection
// domain and a completion queue (with its own completion channel). Objects
// created through a Node's methods are closed when the test ends, queue
// pairs first; a failed Close fails the test.
type Node struct {
	Name string // "A" or "B"
	Ctx  *verbs.Context
	PD   *verbs.ProtectionDomain
	CQ   *verbs.CompletionQueue

	cfg Config
	tr  *tracker
}

// NewNodes opens the two sides described by cfg. Side A opens cfg.DeviceA;
// side B opens cfg.DeviceB, sharing A's context when the devices are the
// same and cfg.SeparateContexts is false, or in a peer process of its own
// with cfg.PeerProcessB. Each side gets its own PD and CQ.
func NewNodes(t testing.TB, cfg Config) (a, b *Node) {
	t.Helper()
	cfg = cfg.withDefaults()
	tr := newTracker(t)
	ctxA := openDevice(t, tr, cfg.DeviceA, "A")
	ctxB := ctxA
	switch {
	case cfg.PeerProcessB:
		ctxB = openPeerDevice(t, tr, cfg.DeviceB)
	case cfg.DeviceB != cfg.DeviceA || cfg.SeparateContexts:
		ctxB = openDevice(t, tr, cfg.DeviceB, "B")
	}
	return newNode(t, tr, cfg, "A", ctxA), newNode(t, tr, cfg, "B", ctxB)
}

func openDevice(t testing.TB, tr *tracker, name, side string) *verbs.Context {
	t.Helper()
	c, err := verbs.Open(name)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", side, err)
	}
	tr.add(levelContext, "device context "+name, c)
	return c
}

func newNode(t testing.TB, tr *tracker, cfg Config, name string, c *verbs.Context) *Node {
	t.Helper()
	n := &Node{Name: name, Ctx: c, cfg: cfg, tr: tr}
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", name, err)
	}
	tr.add(levelPD, "pd of side "+name, pd)
	n.PD = pd
	n.CQ = n.NewCQ(t, verbs.CQSpec{})
	return n
}

// NewCQ creates a CQ in the node's context.
func (n *Node) NewCQ(t testing.TB, spec verbs.CQSpec) *verbs.CompletionQueue {
	t.Helper()
	cq, err := n.Ctx.NewCompletionQueue(spec)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelCQ, "cq of side "+n.Name, cq)
	return cq
}

// NewChannel creates a completion channel in the node's context.
func (n *Node) NewChannel(t testing.TB) *verbs.CompletionChannel {
	t.Helper()
	ch, err := n.Ctx.NewCompletionChannel()
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelChannel, "completion channel of side "+n.Name, ch)
	return ch
}

// Alloc allocates and registers size bytes in the node's PD.
func (n *Node) Alloc(t testing.TB, size int, access verbs.Access) *verbs.MemoryRegion {
	t.Helper()
	mr, err := n.PD.Alloc(size, access)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelMR, fmt.Sprintf("mr of side %s (%d bytes)", n.Name, size), mr)
	return mr
}

// Register registers buf in the node's PD.
func (n *Node) Register(t testing.TB, buf []byte, access verbs.Access) *verbs.MemoryRegion {
	t.Helper()
	mr, err := n.PD.Register(buf, access)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelMR, fmt.Sprintf("registered mr of side %s (%d bytes)", n.Name, len(buf)), mr)
	return mr
}

// NewSRQ creates a shared receive queue in the node's PD.
func (n *Node) NewSRQ(t testing.TB, spec verbs.SRQSpec) *verbs.SharedReceiveQueue {
	t.Helper()
	s, err := n.PD.NewSharedReceiveQueue(spec)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelSRQ, "srq of side "+n.Name, s)
	return s
}

// QPSpec completes spec with the node's defaults: the node's CQ, and the
// port and GID selection of the Config.
func (n *Node) QPSpec(spec verbs.QPSpec) verbs.QPSpec {
	if spec.SendCQ == nil {
		spec.SendCQ = n.CQ
	}
	if spec.Port == 0 {
		spec.Port = n.cfg.Port
	}
	if !spec.FixedGID && n.cfg.FixedGID {
		spec.FixedGID, spec.GIDIndex = true, n.cfg.GIDIndex
	}
	return spec
}

// NewRC creates an RC queue pair (in INIT) with n.QPSpec(spec).
func (n *Node) NewRC(t testing.TB, spec verbs.QPSpec) *verbs.RCQueuePair {
	t.Helper()
	q, err := n.PD.NewRCQueuePair(n.QPSpec(spec))
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelQP, "rc qp of side "+n.Name, q)
	return q
}

// NewUC creates a UC queue pair (in INIT) with n.QPSpec(spec).
func (n *Node) NewUC(t testing.TB, spec verbs.QPSpec) *verbs.UCQueuePair {
	t.Helper()
	q, err := n.PD.NewUCQueuePair(n.QPSpec(spec))
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelQP, "uc qp of side "+n.Name, q)
	return q
}

// NewUD creates a UD queue pair (in RTS) with n.QPSpec(spec).
func (n *Node) NewUD(t testing.TB, spec verbs.QPSpec) *verbs.UDQueuePair {
	t.Helper()
	q, err := n.PD.NewUDQueuePair(n.QPSpec(spec))
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelQP, "ud qp of side "+n.Name, q)
	return q
}

// AddressHandle creates an address handle from q (a UD QP of this node) to
// the remote endpoint.
func (n *Node) AddressHandle(t testing.TB, q *verbs.UDQueuePair, remote verbs.Endpoint) *verbs.AddressHandle {
	t.Helper()
	ah, err := q.AddressHandleTo(remote)
	if err != nil {
		t.Fatalf("verbstest: side %s: %v", n.Name, err)
	}
	n.tr.add(levelAH, "address handle of side "+n.Name, ah)
	return ah
}

// Endpoint returns q's endpoint or fails the test.
func Endpoint(t testing.TB, q interface {
	Endpoint() (verbs.Endpoint, error)
}) verbs.Endpoint {
	t.Helper()
	e, err := q.Endpoint()
	if err != nil {
		t.Fatalf("verbstest: %v", err)
	}
	return e
}

// SGE returns m.SGE(off, n) or fails the test.
func SGE(t testing.TB, m *verbs.MemoryRegion, off, n int) verbs.SGE {
	t.Helper()
	s, err := m.SGE(off, n)
	if err != nil {
		t.Fatalf("verbstest: %v", err)
	}
	return s
}

// rawSGE is an SGE of n bytes at off of m that MemoryRegion.SGE would
// refuse (it lies partly or wholly outside m): for the checks of what a
// device does with such an element.
func rawSGE(m *verbs.MemoryRegion, off, n int) verbs.SGE {
	return verbs.SGE{Addr: uint64(int64(m.Addr()) + int64(off)), Length: uint32(n), LKey: m.LKey()}
}

// ConnectRC connects a and b to each other (INIT → RTR → RTS).
func ConnectRC(t testing.TB, a, b *verbs.RCQueuePair) {
	t.Helper()
	ea, eb := Endpoint(t, a), Endpoint(t, b)
	if err := a.Connect(eb); err != nil {
		t.Fatalf("verbstest: connect A: %v", err)
	}
	if err := b.Connect(ea); err != nil {
		t.Fatalf("verbstest: connect B: %v", err)
	}
}

// ConnectUC connects a and b to each other (INIT → RTR → RTS).
func ConnectUC(t testing.TB, a, b *verbs.UCQueuePair) {
	t.Helper()
	ea, eb := Endpoint(t, a), Endpoint(t, b)
	if err := a.Connect(eb); err != nil {
		t.Fatalf("verbstest: connect A: %v", err)
	}
	if err := b.Connect(ea); err != nil {
		t.Fatalf("verbstest: connect B: %v", err)
	}
}

// RCPair is two connected RC queue pairs: QA on side A, QB on side B.
type RCPair struct {
	A, B   *Node
	QA, QB *verbs.RCQueuePair
}

// NewLoopbackRC opens the two sides of cfg and returns an RC queue pair on
// each, both created from spec (completed by Node.QPSpec) and connected to
// each other. Everything is closed when the test ends.
func NewLoopbackRC(t testing.TB, cfg Config, spec verbs.QPSpec) *RCPair {
	t.Helper()
	a, b := NewNodes(t, cfg)
	p := &RCPair{A: a, B: b, QA: a.NewRC(t, spec), QB: b.NewRC(t, spec)}
	ConnectRC(t, p.QA, p.QB)
	return p
}

// UCPair is two connected UC queue pairs: QA on side A, QB on side B.
type UCPair struct {
	A, B   *Node
	QA, QB *verbs.UCQueuePair
}

// NewLoopbackUC is NewLoopbackRC for UC queue pairs.
func NewLoopbackUC(t testing.TB, cfg Config, spec verbs.QPSpec) *UCPair {
	t.Helper()
	a, b := NewNodes(t, cfg)
	p := &UCPair{A: a, B: b, QA: a.NewUC(t, spec), QB: b.NewUC(t, spec)}
	ConnectUC(t, p.QA, p.QB)
	return p
}

// Pattern fills b with a byte pattern derived from seed, distinct for
// different seeds and not constant within b.
func Pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7+i>>8) ^ seed
	}
}

// firstDiff describes the first difference between got and want, or "".
func firstDiff(got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("length %d, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			n := 0
			for j := i; j < len(got); j++ {
				if got[j] != want[j] {
					n++
				}
			}
			return fmt.Sprintf("%d byte(s) differ, the first at offset %d: got %#02x, want %#02x", n, i, got[i], want[i])
		}
	}
	return ""
}

// checkBytes fails t if got differs from want.
func checkBytes(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if d := firstDiff(got, want); d != "" {
		t.Errorf("%s: %s", what, d)
	}
}

// Until polls cond every 200 µs until it holds, and returns nil, or ctx
// ends, and returns ctx's error: a wait for a condition another goroutine
// or process brings about, bounded by ctx (a hang guard, not a timing).
func Until(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Microsecond):
		}
	}
	return nil
}
