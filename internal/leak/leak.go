// Package leak records verbs objects that were garbage-collected without
// Close. verbstest turns the records into test failures.
package leak

import (
	"runtime"
	"sync"
	"sync/atomic"
)

var (
	mu      sync.Mutex
	records []string
	count   atomic.Int64
)

// Track arranges for desc to be recorded as a leak when obj becomes
// unreachable while *closed is still false.
func Track[T any](obj *T, desc string, closed *atomic.Bool) {
	runtime.AddCleanup(obj, func(a arg) {
		if !a.closed.Load() {
			mu.Lock()
			records = append(records, a.desc)
			mu.Unlock()
			count.Add(1)
		}
	}, arg{desc, closed})
}

type arg struct {
	desc   string
	closed *atomic.Bool
}

// Count returns the number of leaks recorded so far.
func Count() int64 { return count.Load() }

// Since returns the descriptions of leaks recorded after the first n.
func Since(n int64) []string {
	mu.Lock()
	defer mu.Unlock()
	if int(n) >= len(records) {
		return nil
	}
	return append([]string(nil), records[n:]...)
}
