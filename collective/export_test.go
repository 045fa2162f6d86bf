package collective

import "github.com/goverbs/verbs/cluster"

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
