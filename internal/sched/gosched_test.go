package sched

import (
	"runtime"
	"testing"
)

// TestGoschedOneProc: with one processor, Gosched lets another
// goroutine run (the loop would otherwise hold the processor until the
// runtime preempts it, 10 ms); with more it returns without yielding.
func TestGoschedOneProc(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for range procsEvery {
		procs() // reads GOMAXPROCS again within procsEvery calls
	}
	if p := procs(); p != 1 {
		t.Fatalf("procs %d with GOMAXPROCS 1", p)
	}
	done := make(chan struct{})
	go func() { close(done) }()
	ran := false
	for i := 0; i < 100 && !ran; i++ {
		Gosched()
		ran = ranNow(done)
	}
	if !ran {
		t.Fatal("the other goroutine did not run while the loop called Gosched")
	}
}

func ranNow(done chan struct{}) bool {
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// TestProcsFollows: procs follows a change of GOMAXPROCS within
// procsEvery calls.
func TestProcsFollows(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	seen := false
	for range procsEvery + 1 {
		if procs() == 3 {
			seen = true
			break
		}
	}
	if !seen {
		t.Fatalf("procs stayed %d after GOMAXPROCS 3", procs())
	}
}
