package soft

import (
	"bytes"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Signs of life of a peer process on this host.
//
// A NIC answers for its host whatever the host's processes do; soft0's
// peer answers only when the peer process gets a processor. On a host
// with many more busy processes than processors (hundreds of ranks of a
// job on a laptop or a CI runner) a live peer can go without one for
// longer than a response timeout or a handshake's deadline, and it must
// not be declared dead for that. A peer process on this host (unix and
// shared-memory connections, whose process id the kernel vouched for,
// SO_PEERCRED) that used processor time since it was last looked at, and
// is not stopped, is alive: it is slow, not gone. A stopped process
// (SIGSTOP, a debugger) or one that waits forever is still found dead by
// the timeouts. A connection to this very process (a forced transport)
// follows nothing: the process runs, whatever its QPs do.

// peerRuntime returns the processor time the threads of process pid have
// used so far (ns, the sum of /proc/PID/task/*/schedstat), and whether it
// could be read. Threads that exited leave the sum: compare for change,
// not growth.
func peerRuntime(pid uint32) (uint64, bool) {
	dir := "/proc/" + strconv.FormatUint(uint64(pid), 10) + "/task"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, false
	}
	var sum uint64
	var buf [64]byte
	for _, e := range ents {
		f, err := os.Open(dir + "/" + e.Name() + "/schedstat")
		if err != nil {
			continue // the thread exited
		}
		n, _ := f.Read(buf[:])
		f.Close()
		i := 0
		for i < n && buf[i] >= '0' && buf[i] <= '9' {
			i++
		}
		v, err := strconv.ParseUint(string(buf[:i]), 10, 64)
		if err == nil {
			sum += v
		}
	}
	return sum, true
}

// peerClock follows the processor time of a peer process on this host.
// The zero value follows nobody (pid 0): ran reports false.
type peerClock struct {
	pid  uint32
	last atomic.Uint64
}

func newPeerClock(pid uint32) *peerClock {
	p := &peerClock{pid: pid}
	if v, ok := peerRuntime(pid); ok {
		p.last.Store(v)
	}
	return p
}

// ran reports whether the peer used processor time since the last call
// (or since newPeerClock). Safe for concurrent use; a read of /proc, so
// for timeouts, not for the data path.
func (p *peerClock) ran() bool {
	if p == nil || p.pid == 0 {
		return false
	}
	v, ok := peerRuntime(p.pid)
	if !ok {
		return false
	}
	return p.last.Swap(v) != v && !peerHalted(p.pid)
}

// peerHalted reports whether process pid is stopped (SIGSTOP, a
// debugger) or exited (a zombie): whatever it ran before, it answers
// nothing now.
func peerHalted(pid uint32) bool {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/stat")
	if err != nil {
		return true
	}
	// pid (comm) state ...: the state follows the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return true
	}
	switch b[i+2] {
	case 'T', 't', 'Z', 'X', 'x':
		return true
	}
	return false
}

// handshakeMax bounds a handshake with a local peer that keeps running:
// its deadline moves on by handshakeTimeout while the peer uses processor
// time, up to this.
const handshakeMax = 2 * time.Minute

// extendWhileRunning moves the deadline of nc, a handshake with the local
// process pid that started at start, by period whenever the peer ran in
// the last half period, until max after start (handshakeTimeout and
// handshakeMax). The returned function stops it, and may be called more
// than once: call it before setting nc's deadline otherwise.
func extendWhileRunning(nc net.Conn, pid uint32, start time.Time, period, max time.Duration) (stop func()) {
	clock := newPeerClock(pid)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(period / 2)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case now := <-t.C:
				if now.Add(period).After(start.Add(max)) {
					return
				}
				if clock.ran() {
					nc.SetDeadline(now.Add(period))
				}
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			<-finished
		})
	}
}
