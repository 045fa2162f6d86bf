package session

import (
	"context"
	"sync"
	"testing"
	"time"
)

// TestCloseDuringCalls: Close while other goroutines send, receive,
// release and post on the same session (and its peer) ends every call
// with an error, without touching memory Close released: a Receive that
// read its ring slot while Close unmapped the ring crashed the process
// (SIGSEGV in receive, under the stream package's conformance tests).
func TestCloseDuringCalls(t *testing.T) {
	for run := range 100 {
		a, b := pair(t, Config{ReceiveBuffers: 4, MessageSize: 256})
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var wg sync.WaitGroup
		started := make(chan struct{}, 8)
		loop := func(f func() error) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					if i == 1 {
						started <- struct{}{}
					}
					if f() != nil {
						if i < 1 {
							started <- struct{}{}
						}
						return
					}
				}
			}()
		}
		msg := make([]byte, 200)
		for _, s := range []*Session{a, b} {
			s := s
			loop(func() error { return s.Send(ctx, msg) })
			loop(func() error {
				m, err := s.Receive(ctx)
				m.Release()
				return err
			})
			dst := make([]byte, 100)
			loop(func() error {
				_, _, _, err := s.ReceiveInto(ctx, dst)
				return err
			})
			loop(func() error {
				r, err := s.Alloc(64)
				if err != nil {
					return err
				}
				p, err := s.PostSendSlice(ctx, r.All(), 1, true)
				if err == nil {
					err = p.Wait(ctx)
				}
				r.Free()
				return err
			})
		}
		for range 8 {
			<-started
		}
		if run%2 == 0 {
			a.Close()
		} else {
			b.Close()
		}
		a.Close()
		b.Close()
		wg.Wait()
		cancel()
	}
}
