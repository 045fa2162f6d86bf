package collective

import "github.com/goverbs/verbs/cluster"

// LateWindows returns how many closed communicators of node still hold
// their windows, waiting for their peers to close (see Close).
func LateWindows(node *cluster.Node) int {
	lateMu.Lock()
	defer lateMu.Unlock()
	return len(late[node])
}
