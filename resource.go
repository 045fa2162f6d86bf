package verbs

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/goverbs/verbs/internal/leak"
)

// resource tracks the lifetime of one verbs object. Its state lives in a
// separately allocated node that never points back at the object, so a
// parent's list of children does not keep a leaked child reachable and the
// leak tracer can see it.
type resource struct{ n *node }

type node struct {
	kind   string
	desc   string
	closed atomic.Bool

	// use is held for reading (enter) by every call that hands the
	// object to its provider, and for writing by close, which therefore
	// waits for those calls before the provider destroys the object (on
	// hardware, a use after free in C) and makes later ones fail.
	use sync.RWMutex

	mu       sync.Mutex
	parents  []*node
	children map[*node]struct{}
}

func (n *node) String() string {
	if n.desc == "" {
		return n.kind
	}
	return n.kind + " (" + n.desc + ")"
}

func (r *resource) String() string { return r.n.String() }

// initResource links r under its parents (the first is the owner's main
// parent; all must be open) and arranges leak tracing for owner.
func initResource[T any](owner *T, r *resource, kind, desc string, parents ...*resource) error {
	n := &node{kind: kind, desc: desc}
	for i, p := range parents {
		if err := p.n.add(n); err != nil {
			for _, q := range parents[:i] {
				q.n.remove(n)
			}
			return err
		}
		n.parents = append(n.parents, p.n)
	}
	r.n = n
	leak.Track(owner, n.String()+" was garbage-collected without Close", &n.closed)
	return nil
}

func (p *node) add(c *node) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return fmt.Errorf("verbs: %s is closed: %w", p, ErrClosed)
	}
	if p.children == nil {
		p.children = make(map[*node]struct{})
	}
	p.children[c] = struct{}{}
	return nil
}

func (p *node) remove(c *node) {
	p.mu.Lock()
	delete(p.children, c)
	p.mu.Unlock()
}

// close runs release once, if r has no live children. It is idempotent:
// later calls return nil.
func (r *resource) close(release func() error) error {
	n := r.n
	if n == nil {
		return nil
	}
	// use before mu: a call that entered n may add a child to it.
	n.use.Lock()
	n.mu.Lock()
	if n.closed.Load() {
		n.mu.Unlock()
		n.use.Unlock()
		return nil
	}
	if len(n.children) > 0 {
		names := make([]string, 0, len(n.children))
		for c := range n.children {
			names = append(names, c.String())
		}
		n.mu.Unlock()
		n.use.Unlock()
		sort.Strings(names)
		return fmt.Errorf("verbs: close %s: still in use by %d object(s): %s", n, len(names), strings.Join(names, ", "))
	}
	if release != nil {
		if err := release(); err != nil {
			n.use.Unlock()
			n.mu.Unlock()
			return err
		}
	}
	n.closed.Store(true)
	n.use.Unlock()
	n.mu.Unlock()
	for _, p := range n.parents {
		p.remove(n)
	}
	return nil
}

func (r *resource) isClosed() bool { return r.n == nil || r.n.closed.Load() }

// enter holds r open for a call into its provider, which the caller ends
// with exit; it fails if r is closed or being closed. It never blocks:
// calls that may block in the provider for long (waiting for events) do
// not enter, and rely on close waking them.
func (r *resource) enter() bool {
	n := r.n
	if n == nil || !n.use.TryRLock() {
		return false
	}
	if n.closed.Load() {
		n.use.RUnlock()
		return false
	}
	return true
}

// exit ends a call begun by a successful enter.
func (r *resource) exit() { r.n.use.RUnlock() }

// enterAll enters every resource of rs, for a call that creates an
// object under them; if one is closed, it enters none and returns it.
func enterAll(rs ...*resource) (closed *resource) {
	for i, r := range rs {
		if !r.enter() {
			exitAll(rs[:i]...)
			return r
		}
	}
	return nil
}

// exitAll exits every resource of rs.
func exitAll(rs ...*resource) {
	for _, r := range rs {
		r.exit()
	}
}

func (r *resource) errClosed(op string) error {
	if r.n == nil {
		return fmt.Errorf("verbs: %s: object not initialised: %w", op, ErrClosed)
	}
	return fmt.Errorf("verbs: %s: %s is closed: %w", op, r.n, ErrClosed)
}
