package session_test

import (
	"context"
	"fmt"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/session"
)

// A server and a client (here in one process; usually two): the client
// sends a message, asks the server's agent for memory, writes into it
// and hands it back, and the server reads what was written.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := session.Config{Token: []byte("a shared secret")}

	l, err := session.Listen(ctx, "127.0.0.1:0", cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer l.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		s, err := l.Accept(ctx)
		if err != nil {
			fmt.Println("accept:", err)
			return
		}
		defer s.Close()
		m, err := s.Receive(ctx)
		if err != nil {
			fmt.Println("receive:", err)
			return
		}
		fmt.Printf("server received %q\n", m.Bytes())
		m.Release()
		// The client's RequestRemoteMR was served by this side's agent;
		// the region comes back with what the client wrote.
		mr, err := s.ReceiveLocalMR(ctx)
		if err != nil {
			fmt.Println("receive local region:", err)
			return
		}
		fmt.Printf("server reads %q\n", mr.Bytes()[:12])
		mr.Free()
		s.Send(ctx, []byte("bye"))
		<-s.Done() // until the client closes
	}()

	c, err := session.Dial(ctx, l.Addr().String(), cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := c.Send(ctx, []byte("hello")); err != nil {
		fmt.Println(err)
		return
	}
	remote, err := c.RequestRemoteMR(ctx, 4096, verbs.AccessRemoteWrite, time.Minute)
	if err != nil {
		fmt.Println(err)
		return
	}
	local, err := c.Alloc(12)
	if err != nil {
		fmt.Println(err)
		return
	}
	copy(local.Bytes(), "written here")
	dst, err := remote.Slice(0, 12)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := c.Write(ctx, dst, local.All()); err != nil {
		fmt.Println(err)
		return
	}
	local.Free()
	if err := c.SendRemoteMR(ctx, remote); err != nil {
		fmt.Println(err)
		return
	}
	m, err := c.Receive(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("client received %q\n", m.Bytes())
	m.Release()
	c.Close()
	<-served
	// Output:
	// server received "hello"
	// server reads "written here"
	// client received "bye"
}
