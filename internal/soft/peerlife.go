package soft

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
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
// SO_PEERCRED) that used processor time since it was last looked at, or
// waited for a processor (it was runnable: starved, not stuck), and is
// not stopped, is alive: it is slow, not gone.
//
// Processor time comes first from /proc/PID/stat, in clock ticks of 10
// ms: one small file. A peer that runs for a few hundred microseconds
// now and then (a handshake's turn, a barrier's poll) on a host with
// hundreds of runnable processes crosses a tick only every few seconds,
// and was declared dead by handshakes that way (soft0 handshakes of 192
// ranks on 2 CPUs: a peer "quiet" for 15 s that was runnable all along).
// When the ticks did not move, the look sums /proc/PID/task/*/schedstat:
// each thread's time on a processor and time waiting on a run queue, in
// nanoseconds. A thread waits on a run queue only once it can run, and
// the sums move only when a thread gets a processor: a peer whose
// threads are all blocked in the kernel (uninterruptible sleep, state D:
// the memory map's lock behind a mapping or a page fault, the file
// table's growth waiting for an RCU grace period) shows no sign, and
// such a wait lasted 2.4 s in a 256-rank all-to-all on 2 CPUs, which
// then failed writes to a live peer with "transport retry counter
// exceeded". So a look that finds no sign also looks for a thread in
// state D, and counts one as a sign of life for up to localBlockedMax
// in a row: a process frozen by a cgroup freezer shows D too, and must
// still be found quiet. A stopped process (SIGSTOP, a debugger) or one
// that waits forever is still found dead by the timeouts. A connection
// to this very process (a forced transport) follows nothing: the process
// runs, whatever its QPs do.

// peerStat reads what /proc/PID/stat says of process pid: the processor
// time it has used so far (clock ticks, user and system: fields 14 and
// 15) and whether it is halted, stopped (SIGSTOP, a debugger) or exited
// (a zombie), so that it answers nothing now whatever it ran before. ok is
// false if the file cannot be read or parsed (the process is gone). One
// small file per look: hundreds of connections may watch their peers at
// once.
func peerStat(pid uint32) (runtime uint64, halted, ok bool) {
	b, err := readStat(pid)
	if err != nil {
		return 0, false, false
	}
	return parseStat(b)
}

// readStat reads /proc/PID/stat.
func readStat(pid uint32) ([]byte, error) {
	return os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/stat")
}

// statFields returns the fields of the contents of /proc/PID/stat after
// the command name, state (field 3) first; nil if they do not start with
// a one-letter state.
func statFields(b []byte) [][]byte {
	// pid (comm) state ppid ...: the command name may hold anything but
	// ends at the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	f := bytes.Fields(b[i+1:])
	if len(f) == 0 || len(f[0]) != 1 {
		return nil
	}
	return f
}

// parseStat parses the contents of /proc/PID/stat for peerStat.
func parseStat(b []byte) (runtime uint64, halted, ok bool) {
	// utime and stime are fields 14 and 15 (f[11] and f[12]).
	f := statFields(b)
	if len(f) < 13 {
		return 0, false, false
	}
	u, err1 := strconv.ParseUint(string(f[11]), 10, 64)
	s, err2 := strconv.ParseUint(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false, false
	}
	switch f[0][0] {
	case 'T', 't', 'Z', 'X', 'x':
		halted = true
	}
	return u + s, halted, true
}

// exited reports whether pa is a process of this host that no longer
// runs: its /proc entry is gone, or it is a zombie.
func (s *service) exited(pa *peerAddr) bool {
	if !pa.hasHost || pa.host != s.host || pa.pid == 0 {
		return false
	}
	b, err := readStat(pa.pid)
	if err != nil {
		return errors.Is(err, fs.ErrNotExist)
	}
	f := statFields(b)
	return f != nil && (f[0][0] == 'Z' || f[0][0] == 'X')
}

// peerClock follows the processor time of a peer process on this host.
// The zero value follows nobody (pid 0): ran reports false.
type peerClock struct {
	pid     uint32
	last    atomic.Uint64 // the processor time at the last look
	sched   atomic.Uint64 // the threads' run and wait time (ns) at the last look; 0: unknown, schedUnread: no look yet
	changed atomic.Int64  // when a look last found it changed (unix ns)
	blocked atomic.Int64  // since when looks found only threads blocked in the kernel (unix ns); 0: not
}

// localBlockedMax bounds how long a peer whose threads are blocked in the
// kernel (state D) counts as alive without running (see above).
const localBlockedMax = 10 * time.Second

// schedUnread is peerClock.sched before the first look.
const schedUnread = ^uint64(0)

// newPeerClock starts following pid from its clock ticks now. The
// threads' run and wait time, a file per thread, is first read by the
// first look, which has nothing to compare it with: when the ticks did
// not move either, that look gives the peer the benefit of the doubt
// (ran), so a peer that is neither halted nor running is found quiet one
// look later than it could have been. Reading every thread's schedstat
// here cost a third of the processor time of a 128-rank all-to-all that
// set up 16 256 connections (scripts/scale.sh 128), and most connections
// are never looked at.
func newPeerClock(pid uint32) *peerClock {
	p := &peerClock{pid: pid}
	if v, _, ok := peerStat(pid); ok {
		p.last.Store(v)
	}
	p.sched.Store(schedUnread)
	p.changed.Store(time.Now().UnixNano())
	return p
}

// peerSched sums, over the threads of process pid, the time they ran
// and the time they waited on a run queue (the first two fields of
// /proc/PID/task/TID/schedstat, in nanoseconds). ok is false if nothing
// could be read (no schedstat: a kernel without CONFIG_SCHED_INFO, or
// the process is gone).
func peerSched(pid uint32) (sum uint64, ok bool) {
	eachThread(pid, "schedstat", func(b []byte) bool {
		if v, good := parseSchedstat(b); good {
			sum, ok = sum+v, true
		}
		return true
	})
	return sum, ok
}

// eachThread calls fn with the contents of the file name of
// /proc/PID/task/TID of each thread of process pid that still has it,
// until fn returns false.
func eachThread(pid uint32, name string, fn func(b []byte) bool) {
	dir := "/proc/" + strconv.FormatUint(uint64(pid), 10) + "/task/"
	f, err := os.Open(dir)
	if err != nil {
		return
	}
	tids, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return
	}
	for _, tid := range tids {
		b, err := os.ReadFile(dir + tid + "/" + name)
		if err != nil {
			continue // the thread exited
		}
		if !fn(b) {
			return
		}
	}
}

// parseSchedstat parses a schedstat file ("run_ns wait_ns slices"): the
// sum of the time on a processor and the time waiting for one.
func parseSchedstat(b []byte) (uint64, bool) {
	f := bytes.Fields(b)
	if len(f) < 2 {
		return 0, false
	}
	run, err1 := strconv.ParseUint(string(f[0]), 10, 64)
	wait, err2 := strconv.ParseUint(string(f[1]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return run + wait, true
}

// look reads the peer's processor time: ran reports whether it changed
// since the last look (or since newPeerClock), or, when the clock ticks
// did not, whether its threads ran or waited for a processor (schedstat)
// or one is blocked in the kernel (inKernel), and halted whether the peer
// is stopped or gone. Safe for concurrent use; a read of /proc, so
// for timeouts, not for the data path.
func (p *peerClock) look() (ran, halted bool) {
	v, halted, ok := peerStat(p.pid)
	if !ok {
		return false, true
	}
	w, _ := peerSched(p.pid) // 0: unknown
	prev := p.sched.Swap(w)
	if p.last.Swap(v) == v {
		// No tick: did it run a little, or wait for a processor?
		// Compared with the last look's sum, also when that look saw
		// ticks: a look that found no sign because its predecessor saw
		// ticks would end a watch whose looks come late (a loaded
		// machine), though the peer ran all along.
		if w == 0 || prev == 0 || prev == w {
			return !halted && p.inKernel(), halted
		}
		// prev == schedUnread: the first look (newPeerClock); w != 0
		// says at least that the peer's threads are there to run.
		// Otherwise the run and wait time moved: it ran, or waited for
		// a processor.
	}
	p.blocked.Store(0)
	p.changed.Store(time.Now().UnixNano())
	return true, halted
}

// inKernel reports whether a look that found no sign of life finds a
// thread of the peer blocked in the kernel (state D) and the looks have
// found it so for less than localBlockedMax; if so, that counts as the
// peer having run (changed).
func (p *peerClock) inKernel() bool {
	if !threadBlocked(p.pid) {
		p.blocked.Store(0)
		return false
	}
	now := time.Now().UnixNano()
	p.blocked.CompareAndSwap(0, now)
	if time.Duration(now-p.blocked.Load()) >= localBlockedMax {
		return false
	}
	p.changed.Store(now)
	return true
}

// threadBlocked reports whether a thread of process pid is in
// uninterruptible sleep (state D of /proc/PID/task/TID/stat).
func threadBlocked(pid uint32) (blocked bool) {
	eachThread(pid, "stat", func(b []byte) bool {
		f := statFields(b)
		blocked = f != nil && f[0][0] == 'D'
		return !blocked
	})
	return blocked
}

// ran reports whether the peer used processor time since the last look
// and is not halted.
func (p *peerClock) ran() bool {
	if p == nil || p.pid == 0 {
		return false
	}
	ran, halted := p.look()
	return ran && !halted
}

// ranWithin reports whether the peer ran within the last d and is not
// halted: the processor time is counted in clock ticks (10 ms), which a
// peer that gets a processor a few ms a second crosses only now and then.
func (p *peerClock) ranWithin(d time.Duration) bool {
	if p == nil || p.pid == 0 {
		return false
	}
	ran, halted := p.look()
	return !halted && (ran || time.Since(time.Unix(0, p.changed.Load())) < d)
}

// localQuiet is how long a peer process on this host may use no processor
// time (by the clock ticks of /proc) and still count as alive.
const localQuiet = 2 * time.Second

// handshakeMax bounds a handshake with a local peer that keeps running;
// one that uses no processor time for localHandshakeQuiet is given up.
const (
	handshakeMax        = 2 * time.Minute
	localHandshakeQuiet = 3 * handshakeTimeout
)

// watchLocal returns a context for connecting to the local process pid:
// it ends when the process halts (stopped, exited), when it used no
// processor time for quiet, or after max. A deadline would also end when
// this process, not the peer, went without a processor for long; a
// process is only found quiet after quiet has passed, as measured here,
// without it running. stop releases the watch (call it when the
// connection is made or has failed; more than once is harmless).
func watchLocal(pid uint32, quiet, max time.Duration) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithTimeout(context.Background(), max)
	// The clock starts at the first look: most handshakes end long
	// before it, and a large world makes thousands of them.
	var clock *peerClock
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(quiet / 2)
		defer t.Stop()
		last := time.Now() // when the peer was last seen running
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-t.C:
				if clock == nil {
					clock = newPeerClock(pid)
				}
				ran, halted := clock.look()
				switch {
				case halted:
					cancel()
					return
				case ran:
					last = now
				case now.Sub(last) >= quiet:
					cancel()
					return
				}
			}
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			cancel()
			<-finished
		})
	}
}

// watchConn ends the I/O of nc (its deadline set to now) when ctx ends
// before stop is called. Call stop before setting nc's deadline
// otherwise.
func watchConn(ctx context.Context, nc net.Conn) (stop func()) {
	var mu sync.Mutex
	stopped := false
	after := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			nc.SetDeadline(time.Now())
		}
	})
	return func() {
		after()
		mu.Lock()
		stopped = true
		mu.Unlock()
	}
}
