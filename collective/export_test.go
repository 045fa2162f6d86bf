package collective

import (
	"time"

	"github.com/goverbs/verbs/cluster"
)

// LateWindows returns how many closed communicators of node still hold
// their windows, waiting for their peers to close (see Close).
func LateWindows(node *cluster.Node) int {
	lateMu.Lock()
	defer lateMu.Unlock()
	return len(late[node])
}

// ZeroCopied returns how many chunks c has sent from Buffers.
func ZeroCopied(c *Comm) uint64 { return c.zeroCopied }

// HoldBuffer counts one more call using b, as a call sending from it
// does, until the returned function runs.
func HoldBuffer[T Number](b *Buffer[T]) func() {
	b.reg.users.Add(1)
	return func() { b.reg.users.Add(-1) }
}

// Landed returns how many chunks c has received in place, written by
// the sender straight into a Buffer (land.go).
func Landed(c *Comm) uint64 { return c.landedChunks }

// Writes returns how many RDMA writes c's calls posted, and how many of
// them were data counts (not sent for small messages: small.go) and ack
// counts.
func Writes(c *Comm) (total, counts, acks uint64) { return c.writes, c.countWrites, c.ackWrites }

// SleepWrites returns how many of c's writes announced its sleeps, said
// it woke, or rang a sleeping peer (bells.go).
func SleepWrites(c *Comm) uint64 { return c.sleepWrites }

// SmallWordsClear reports whether the words small messages take in every
// slot of c's window are zero, as they must be between calls (every chunk
// consumed clears what it wrote there).
func SmallWordsClear(c *Comm) bool {
	for p := range c.size {
		for k := range c.slots {
			slot := c.rxSlot(p, uint64(k))
			for _, b := range slot[:min(len(slot), llRegion)] {
				if b != 0 {
					return false
				}
			}
		}
	}
	return true
}

// LLMax is the largest message sent as one write of LL words.
const LLMax = llMax

// Sleeps returns how many times c's waits went to sleep (announced, where
// doorbells are on demand: bells.go).
func Sleeps(c *Comm) uint64 { return c.sleeps.Load() }

// BellsOnDemand reports whether c's writes ring a doorbell only for a
// peer that announced it sleeps.
func BellsOnDemand(c *Comm) bool { return c.onDemand }

// Announcements returns how many sleeps c's waits announced to their
// peers (bells.go).
func Announcements(c *Comm) uint64 { return c.book.Sleeps() }

// RingAlways makes every write of c that doorbells may wake a peer for
// ring one, as where waits do not spin (bells.go).
func RingAlways(c *Comm) { c.onDemand = false }

// SetAlarmEvery sets the interval of the alarms (and probes) of c's
// sleeping waits: a test that makes it long finds whether a sleeper is
// woken by anything else.
func SetAlarmEvery(c *Comm, d time.Duration) { c.spin.Every = d }

// SetBarrierGather makes Barrier on c gather at rank 0 (on) or use the
// butterfly or dissemination barrier (off), whatever the descriptors
// said: every rank of c must be set alike.
func SetBarrierGather(c *Comm, on bool) { c.gather = on }

// Issued returns how many places in c's order of calls were handed out
// (a blocking call takes its place in begin, after it holds its Buffers).
func Issued(c *Comm) uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.issued
}
