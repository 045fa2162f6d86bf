package soft

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// devContext is an open soft0 device.
type devContext struct {
	f      *fabric
	closed atomic.Bool

	mu   sync.Mutex // children counts vs Close
	npd  int
	ncq  int
	nch  int
	dead bool

	events prov.EventQueue
}

var _ prov.Context = (*devContext)(nil)

func (c *devContext) QueryDevice() (prov.DeviceAttr, error) {
	if c.closed.Load() {
		return prov.DeviceAttr{}, closedErr("query device")
	}
	return c.f.deviceAttr(), nil
}

func (c *devContext) QueryPort(port uint8) (prov.PortAttr, error) {
	if c.closed.Load() {
		return prov.PortAttr{}, closedErr("query port")
	}
	if port != 1 {
		return prov.PortAttr{}, errnof(syscall.EINVAL, "query port: %s has one port (1), not %d", DeviceName, port)
	}
	if infiniBand() {
		return c.f.asInfiniBand(c.f.portAttr()), nil
	}
	return c.f.portAttr(), nil
}

func (c *devContext) QueryGIDTable(port uint8) ([]prov.GIDEntry, error) {
	if c.closed.Load() {
		return nil, closedErr("query gid table")
	}
	if port != 1 {
		return nil, errnof(syscall.EINVAL, "query gid table: %s has one port (1), not %d", DeviceName, port)
	}
	if infiniBand() {
		return []prov.GIDEntry{{GID: c.f.gids[0], Port: 1, Type: prov.GIDTypeIB}}, nil
	}
	out := make([]prov.GIDEntry, numGIDs)
	for i := range out {
		out[i] = prov.GIDEntry{GID: c.f.gids[i], Index: i, Port: 1, Type: prov.GIDTypeRoCEv2, Netdev: "lo", IfIndex: 1}
	}
	return out, nil
}

// hold registers a new child (counter n) unless the context is closed.
func (c *devContext) hold(n *int, op string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return closedErr(op)
	}
	*n++
	return nil
}

func (c *devContext) release(n *int) {
	c.mu.Lock()
	*n--
	c.mu.Unlock()
}

func (c *devContext) AllocPD() (prov.PD, error) {
	if err := c.hold(&c.npd, "alloc pd"); err != nil {
		return nil, err
	}
	return &pd{ctx: c}, nil
}

func (c *devContext) CreateCompChannel() (prov.CompChannel, error) {
	if err := c.hold(&c.nch, "create completion channel"); err != nil {
		return nil, err
	}
	ch := &compChannel{ctx: c, sig: make(chan struct{}, 1), done: make(chan struct{})}
	return ch, nil
}

func (c *devContext) CreateCQ(cqe int, ch prov.CompChannel, vector int) (prov.CQ, error) {
	if cqe < 1 || cqe > maxCQE {
		return nil, errnof(syscall.EINVAL, "create cq: %d entries (1..%d)", cqe, maxCQE)
	}
	if vector != 0 {
		return nil, errnof(syscall.EINVAL, "create cq: completion vector %d (the device has 1)", vector)
	}
	var sch *compChannel
	if ch != nil {
		var ok bool
		sch, ok = ch.(*compChannel)
		if !ok {
			return nil, errnof(syscall.EINVAL, "create cq: completion channel of another provider (%T)", ch)
		}
		if err := sch.attach(); err != nil {
			return nil, err
		}
	}
	if err := c.hold(&c.ncq, "create cq"); err != nil {
		if sch != nil {
			sch.detach(nil)
		}
		return nil, err
	}
	return &cq{ctx: c, ch: sch, size: cqe}, nil
}

func (c *devContext) AsyncEvent(ctx context.Context) (prov.AsyncEvent, error) {
	ev, err := c.events.Wait(ctx)
	switch {
	case errors.Is(err, prov.ErrClosed):
		return ev, closedErr("get async event")
	case err != nil:
		return ev, fmt.Errorf("soft: get async event: %w", err)
	}
	return ev, nil
}

// Close closes the device context. It fails with EBUSY while PDs, CQs or
// completion channels created from it are open.
func (c *devContext) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead {
		return nil
	}
	if n := c.npd + c.ncq + c.nch; n > 0 {
		return busyErr("close device context", n, fmt.Sprintf("objects (%d PDs, %d CQs, %d completion channels)", c.npd, c.ncq, c.nch))
	}
	c.dead = true
	c.closed.Store(true)
	c.events.Close()
	c.f.closeContext()
	return nil
}

// Async event types (enum ibv_event_type).
const (
	evCQErr       = 0
	evQPFatal     = 1
	evQPReqErr    = 2
	evQPAccessErr = 3
	evSQDrained   = 7
	evSRQLimit    = 15
	evQPLastWQE   = 16
)
