package channel_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"log"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// endpoint is one side of the examples: a device context, a protection
// domain, 4 KiB of registered memory and a channel.
type endpoint struct {
	dev *verbs.Context
	pd  *verbs.ProtectionDomain
	mem *verbs.MemoryRegion
	ch  *channel.Channel
}

// sge returns the SGE of the n bytes at off of e.mem.
func (e *endpoint) sge(off, n int) verbs.SGE {
	s, err := e.mem.SGE(off, n)
	if err != nil {
		log.Fatal(err)
	}
	return s
}

func openEndpoint() *endpoint {
	dev, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		log.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		log.Fatal(err)
	}
	mem, err := pd.Alloc(4096, verbs.AccessRemoteAll)
	if err != nil {
		log.Fatal(err)
	}
	ch, err := channel.New(pd, channel.Options{})
	if err != nil {
		log.Fatal(err)
	}
	return &endpoint{dev: dev, pd: pd, mem: mem, ch: ch}
}

func (e *endpoint) close() {
	e.ch.Close() // before the PD and the memory it uses
	e.mem.Close()
	e.pd.Close()
	e.dev.Close()
}

// examplePair returns two connected endpoints. Between processes, the
// endpoints (and the peer's verbs.RemoteRegion) travel out of band, for
// example with package cluster.
func examplePair() (a, b *endpoint) {
	a, b = openEndpoint(), openEndpoint()
	ea, err := a.ch.Endpoint()
	if err != nil {
		log.Fatal(err)
	}
	eb, err := b.ch.Endpoint()
	if err != nil {
		log.Fatal(err)
	}
	if err := a.ch.Connect(eb); err != nil {
		log.Fatal(err)
	}
	if err := b.ch.Connect(ea); err != nil {
		log.Fatal(err)
	}
	return a, b
}

// Two connected channels on soft0: an RDMA write, an RDMA read and an
// atomic fetch-and-add into the peer's memory, then a message.
func ExampleChannel() {
	a, b := examplePair()
	defer a.close()
	defer b.close()
	ctx := context.Background()
	peer := b.mem.Remote() // handed out by b

	copy(a.mem.Bytes(), "written by a")
	if err := a.ch.Write(ctx, peer.At(100), a.sge(0, 12)); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("b's memory: %q\n", b.mem.Bytes()[100:112])

	if err := a.ch.Read(ctx, peer.At(100), a.sge(1000, 7)); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("read back: %q\n", a.mem.Bytes()[1000:1007])

	for range 3 {
		if _, err := a.ch.FetchAdd(ctx, peer.At(512), 10); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println("counter:", binary.NativeEndian.Uint64(b.mem.Bytes()[512:]))

	// A send needs a receive posted by the peer.
	h, err := b.ch.PostReceive(b.sge(2048, 64))
	if err != nil {
		log.Fatal(err)
	}
	defer h.Release()
	copy(a.mem.Bytes()[3000:], "hello")
	if err := a.ch.SendImm(ctx, 42, a.sge(3000, 5)); err != nil {
		log.Fatal(err)
	}
	if err := h.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	r := h.Received()
	fmt.Printf("received %q with immediate %d\n", b.mem.Bytes()[2048:2048+r.Len], r.Imm)
	// Output:
	// b's memory: "written by a"
	// read back: "written"
	// counter: 30
	// received "hello" with immediate 42
}

// A scope of many operations, posted in doorbell batches and waited for
// together. Whatever fn does (return early, fail, panic), every operation
// it started has completed when Batch returns.
func ExampleChannel_Batch() {
	a, b := examplePair()
	defer a.close()
	defer b.close()
	peer := b.mem.Remote()
	for i := range 8 {
		a.mem.Bytes()[i] = byte('a' + i)
	}

	var prior channel.Handle
	err := a.ch.Batch(context.Background(), func(bt *channel.Batch) error {
		for i := range 8 {
			bt.Write(peer.At(uint64(16*i)), a.sge(i, 1)) // 8 writes...
		}
		prior = bt.FetchAdd(peer.At(1024), 1) // ...and an atomic, posted together
		if err := bt.WaitAll(); err != nil {
			return err
		}
		fmt.Println("prior value:", prior.Value()) // valid until the scope ends
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	for i := range 8 {
		fmt.Printf("%c", b.mem.Bytes()[16*i])
	}
	fmt.Println()
	// Output:
	// prior value: 0
	// abcdefgh
}

// Unpolled operations: the caller owns the completion. A Handle.Wait that
// times out can be resumed; Release gives the slot back.
func ExampleChannel_PostReceive() {
	a, b := examplePair()
	defer a.close()
	defer b.close()
	ctx := context.Background()

	h, err := b.ch.PostReceive(b.sge(0, 64))
	if err != nil {
		log.Fatal(err)
	}
	defer h.Release()
	done, _ := h.Poll()
	fmt.Println("done before the send:", done)

	copy(a.mem.Bytes(), "ping")
	if err := a.ch.Send(ctx, a.sge(0, 4)); err != nil {
		log.Fatal(err)
	}
	if err := h.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("done: %v, got %q\n", h.Done(), b.mem.Bytes()[:h.Received().Len])
	// Output:
	// done before the send: false
	// done: true, got "ping"
}

// Flags without completions: a stream of unsignaled writes, each naming
// a round, the last one with immediate data that the peer's receive
// reports. Writes on a channel arrive in order, so the peer that has the
// immediate sees every flag before it. The source words are rewritten
// only after the receive proved the writes that read them done.
func ExampleChannel_PostWriteUnsignaled() {
	a, b := examplePair()
	defer a.close()
	defer b.close()
	ctx := context.Background()
	peer := b.mem.Remote()

	h, err := b.ch.PostReceive() // for the immediate data
	if err != nil {
		log.Fatal(err)
	}
	defer h.Release()
	for round := range 4 {
		binary.NativeEndian.PutUint64(a.mem.Bytes()[8*round:], uint64(100+round))
		src := a.sge(8*round, 8)
		if round < 3 {
			err = a.ch.PostWriteUnsignaled(peer.At(uint64(8*round)), src)
		} else {
			err = a.ch.PostWriteImmUnsignaled(peer.At(uint64(8*round)), uint32(round), src)
		}
		if err != nil {
			log.Fatal(err) // verbs.ErrQueueFull: poll (Progress) and post again
		}
	}
	if err := h.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("immediate:", h.Received().Imm)
	for round := range 4 {
		fmt.Print(binary.NativeEndian.Uint64(b.mem.Bytes()[8*round:]), " ")
	}
	fmt.Println()
	// Output:
	// immediate: 3
	// 100 101 102 103
}

// Addressing a field of a Go type that lives in the peer's memory, without
// computing its offset by hand.
func ExampleRemoteField() {
	a, b := examplePair()
	defer a.close()
	defer b.close()

	type Stats struct {
		Requests uint64
		Errors   uint64
		Latency  [4]uint64
	}
	root, err := channel.RemoteAt[Stats](b.mem.Remote(), 128)
	if err != nil {
		log.Fatal(err)
	}
	errs, err := channel.RemoteField(root, func(s *Stats) *uint64 { return &s.Errors })
	if err != nil {
		log.Fatal(err)
	}
	if _, err := a.ch.FetchAdd(context.Background(), errs.Addr(), 3); err != nil {
		log.Fatal(err)
	}
	off := errs.Addr().Addr - b.mem.Remote().Addr
	fmt.Println("offset:", off, "value:", binary.NativeEndian.Uint64(b.mem.Bytes()[off:]))
	// Output:
	// offset: 136 value: 3
}

// A MultiChannel per rank, three ranks in one process: every rank writes
// its number into a slot of every other rank's memory with one
// ScatterWrite.
func ExampleMultiChannel() {
	const n = 3
	type rank struct {
		dev *verbs.Context
		pd  *verbs.ProtectionDomain
		mem *verbs.MemoryRegion
		mc  *channel.MultiChannel
	}
	ranks := make([]*rank, n)
	for i := range ranks {
		r := &rank{}
		var err error
		if r.dev, err = verbs.Open(verbs.SoftDevice); err != nil {
			log.Fatal(err)
		}
		if r.pd, err = r.dev.AllocPD(); err != nil {
			log.Fatal(err)
		}
		if r.mem, err = r.pd.Alloc(4096, verbs.AccessRemoteAll); err != nil {
			log.Fatal(err)
		}
		if r.mc, err = channel.NewMulti(r.pd, n, i, channel.Options{}); err != nil {
			log.Fatal(err)
		}
		ranks[i] = r
	}
	defer func() {
		for _, r := range ranks {
			r.mc.Close()
			r.mem.Close()
			r.pd.Close()
			r.dev.Close()
		}
	}()
	// Exchange: rank i connects its queue pair for j to the one j made for i.
	eps := make([][]verbs.Endpoint, n)
	for i, r := range ranks {
		var err error
		if eps[i], err = r.mc.Endpoints(); err != nil {
			log.Fatal(err)
		}
	}
	for i, r := range ranks {
		mine := make([]verbs.Endpoint, n)
		for j := range n {
			mine[j] = eps[j][i]
		}
		if err := r.mc.Connect(mine); err != nil {
			log.Fatal(err)
		}
	}

	ctx := context.Background()
	for i, r := range ranks { // each rank would do this in its own process
		r.mem.Bytes()[0] = byte('A' + i)
		dsts := make([]verbs.RemoteAddr, n) // indexed by peer; the entry of self is ignored
		bufs := make([]verbs.SGE, n)
		first, err := r.mem.SGE(0, 1)
		if err != nil {
			log.Fatal(err)
		}
		for j := range n {
			dsts[j] = ranks[j].mem.Remote().At(uint64(100 + i))
			bufs[j] = first
		}
		if err := r.mc.ScatterWrite(ctx, nil, dsts, bufs); err != nil {
			log.Fatal(err)
		}
	}
	for i, r := range ranks {
		fmt.Printf("rank %d: %q\n", i, r.mem.Bytes()[100:100+n])
	}
	// Output:
	// rank 0: "\x00BC"
	// rank 1: "A\x00C"
	// rank 2: "AB\x00"
}
