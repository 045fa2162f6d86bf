package stream_test

import (
	"bufio"
	"context"
	"fmt"
	"log"

	"github.com/goverbs/verbs/session"
	"github.com/goverbs/verbs/stream"
)

// A line-based server and client over a stream, as over TCP: the
// Listener and Conn are a net.Listener and a net.Conn (here over soft0,
// in one process; between two machines with RDMA NICs, over them).
func Example() {
	ctx := context.Background()
	l, err := stream.Listen(ctx, "127.0.0.1:0", session.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		in := bufio.NewScanner(c)
		for in.Scan() {
			fmt.Fprintf(c, "echo: %s\n", in.Text())
		}
	}()

	c, err := stream.Dial(ctx, l.Addr().String(), session.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintln(c, "hello")
	fmt.Fprintln(c, "world")
	c.CloseWrite() // the server's Scan ends after the two lines
	out := bufio.NewScanner(c)
	for out.Scan() {
		fmt.Println(out.Text())
	}
	// Output:
	// echo: hello
	// echo: world
}
