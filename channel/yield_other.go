//go:build !linux

package channel

// osYield offers the thread's processor to another thread (on Linux).
func osYield() {}
