//go:build ibverbs && linux && cgo

package ibv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/prov"
)

// evFD waits for readiness of a libibverbs event fd (completion channel,
// async events, rdma_cm event channel) on the Go runtime poller. The fd is
// set O_NONBLOCK and a dup of it is wrapped in an *os.File, which registers
// it with the poller; the library keeps reading from the original fd (same
// open file description), and the reads return EAGAIN when nothing is
// pending, so no OS thread ever blocks in C.
type evFD struct {
	f   *os.File
	rc  syscall.RawConn
	sem chan struct{} // one waiter at a time: the read deadline is per file

	closed atomic.Bool
	woken  atomic.Bool // wake: the next wait returns prov.ErrWoken
}

func newEvFD(fd int, name string) (*evFD, error) {
	if err := unix.SetNonblock(fd, true); err != nil {
		return nil, fmt.Errorf("%s: set non-blocking: %w", name, err)
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: dup: %w", name, err)
	}
	f := os.NewFile(uintptr(dup), name)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return &evFD{f: f, rc: rc, sem: make(chan struct{}, 1)}, nil
}

// wait calls try (a non-blocking attempt, false when it would block) until
// it returns true, parking the goroutine on the poller between attempts. It
// returns ctx.Err() when ctx ends first and prov.ErrClosed after close.
func (e *evFD) wait(ctx context.Context, try func() bool) error {
	select {
	case e.sem <- struct{}{}:
	default:
		select {
		case e.sem <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer func() { <-e.sem }()
	if e.closed.Load() {
		return prov.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	dl, _ := ctx.Deadline()
	if err := e.f.SetReadDeadline(dl); err != nil {
		if e.closed.Load() {
			return prov.ErrClosed
		}
		return closedErr(err)
	}
	// After the deadline is set: a wake from now on ends the read below
	// (its deadline in the past), one before it is seen here.
	if e.woken.Swap(false) {
		return prov.ErrWoken
	}
	var fired chan struct{}
	if ctx.Done() != nil {
		fired = make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			defer close(fired)
			e.f.SetReadDeadline(time.Unix(1, 0)) // wake the reader
		})
		defer func() {
			if !stop() {
				<-fired // let it finish before the next waiter resets the deadline
			}
		}()
	}
	err := e.rc.Read(func(uintptr) bool { return try() })
	if err == nil {
		return nil
	}
	if e.woken.Swap(false) {
		return prov.ErrWoken
	}
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return context.DeadlineExceeded
	}
	if e.closed.Load() {
		return prov.ErrClosed
	}
	return closedErr(err)
}

// wake makes a wait in progress, or the next one, return prov.ErrWoken: a
// read deadline in the past ends the read a wait is in (a wait that starts
// later sets its own, and then sees woken).
func (e *evFD) wake() {
	e.woken.Store(true)
	e.f.SetReadDeadline(time.Unix(1, 0))
}

func closedErr(err error) error {
	if errors.Is(err, os.ErrClosed) {
		return prov.ErrClosed
	}
	return err
}

// close unregisters the fd from the poller (closing the dup; the original
// stays with its libibverbs object), wakes any waiter with ErrClosed and
// returns once no waiter can touch the libibverbs object any more, so the
// caller may destroy it.
func (e *evFD) close() {
	if e.closed.Swap(true) {
		return
	}
	e.f.Close()
	e.sem <- struct{}{} // wait for a current waiter to leave
	<-e.sem
}

// closer makes Close idempotent while letting a failed destroy (EBUSY) be
// retried.
type closer struct {
	mu   sync.Mutex
	done bool
}

func (c *closer) do(f func() error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return nil
	}
	if err := f(); err != nil {
		return err
	}
	c.done = true
	return nil
}
