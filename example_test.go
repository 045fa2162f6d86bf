package verbs_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"log"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/goverbs/verbs"
)

// Example is a loopback RDMA write on the soft device: two RC queue pairs
// of one process connected to each other. Between processes or machines,
// the endpoints (and the remote region) are exchanged out of band instead.
// README.md shows this code; TestReadmeExample keeps them in sync.
func Example() {
	dev, err := verbs.Open("soft0")
	if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		log.Fatal(err)
	}
	defer pd.Close()
	cq, err := dev.NewCompletionQueue(verbs.CQSpec{})
	if err != nil {
		log.Fatal(err)
	}
	defer cq.Close()

	// Two RC queue pairs, connected to each other's endpoint.
	a, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()
	b, err := pd.NewRCQueuePair(verbs.QPSpec{SendCQ: cq})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	epA, err := a.Endpoint()
	if err != nil {
		log.Fatal(err)
	}
	epB, err := b.Endpoint()
	if err != nil {
		log.Fatal(err)
	}
	if err := a.Connect(epB); err != nil {
		log.Fatal(err)
	}
	if err := b.Connect(epA); err != nil {
		log.Fatal(err)
	}

	// Registered memory: a source, and a destination peers may write.
	src, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	defer src.Close()
	dst, err := pd.Alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		log.Fatal(err)
	}
	defer dst.Close()

	// RDMA-write 11 bytes of src into dst through a, and wait for the
	// completion.
	n := copy(src.Bytes(), "hello, RDMA")
	sge, err := src.SGE(0, n) // the n bytes at offset 0 of src
	if err != nil {
		log.Fatal(err)
	}
	if err := a.PostWrite(1, verbs.Signaled, dst.Remote().At(0), sge); err != nil {
		log.Fatal(err)
	}
	if err := cq.Wait(context.Background()); err != nil {
		log.Fatal(err)
	}
	wc := make([]verbs.Completion, 1)
	if _, err := cq.Poll(wc); err != nil {
		log.Fatal(err)
	}
	if err := wc[0].Err(); err != nil {
		log.Fatal(err)
	}
	fmt.Println(wc[0].Opcode, wc[0].Status)
	fmt.Printf("%s\n", dst.Bytes()[:n])
	// Output:
	// RDMA_WRITE success
	// hello, RDMA
}

// loopback is the setup of the other examples: two RC queue pairs on
// soft0 connected to each other, each with its own CQ, as in Example.
type loopback struct {
	dev      *verbs.Context
	pd       *verbs.ProtectionDomain
	cqA, cqB *verbs.CompletionQueue
	a, b     *verbs.RCQueuePair
	closers  []func() error
}

func newLoopback() (*loopback, error) {
	l := &loopback{}
	var err error
	if l.dev, err = verbs.Open(verbs.SoftDevice); err != nil {
		return nil, err
	}
	l.closers = append(l.closers, l.dev.Close)
	if l.pd, err = l.dev.AllocPD(); err != nil {
		return nil, l.fail(err)
	}
	l.closers = append(l.closers, l.pd.Close)
	for _, cq := range []**verbs.CompletionQueue{&l.cqA, &l.cqB} {
		if *cq, err = l.dev.NewCompletionQueue(verbs.CQSpec{}); err != nil {
			return nil, l.fail(err)
		}
		l.closers = append(l.closers, (*cq).Close)
	}
	if l.a, err = l.pd.NewRCQueuePair(verbs.QPSpec{SendCQ: l.cqA}); err != nil {
		return nil, l.fail(err)
	}
	l.closers = append(l.closers, l.a.Close)
	if l.b, err = l.pd.NewRCQueuePair(verbs.QPSpec{SendCQ: l.cqB}); err != nil {
		return nil, l.fail(err)
	}
	l.closers = append(l.closers, l.b.Close)
	epA, err := l.a.Endpoint()
	if err != nil {
		return nil, l.fail(err)
	}
	epB, err := l.b.Endpoint()
	if err != nil {
		return nil, l.fail(err)
	}
	if err := l.a.Connect(epB); err != nil {
		return nil, l.fail(err)
	}
	if err := l.b.Connect(epA); err != nil {
		return nil, l.fail(err)
	}
	return l, nil
}

// alloc allocates a memory region that Close frees.
func (l *loopback) alloc(n int, access verbs.Access) (*verbs.MemoryRegion, error) {
	mr, err := l.pd.Alloc(n, access)
	if err == nil {
		l.closers = append(l.closers, mr.Close)
	}
	return mr, err
}

func (l *loopback) fail(err error) error {
	l.Close()
	return err
}

// Close closes everything in reverse order of creation.
func (l *loopback) Close() error {
	var first error
	for i := len(l.closers) - 1; i >= 0; i-- {
		if err := l.closers[i](); err != nil && first == nil {
			first = err
		}
	}
	l.closers = nil
	return first
}

// wait blocks until cq has a completion and returns it; a failed
// completion is returned as a *verbs.CompletionError.
func wait(cq *verbs.CompletionQueue) (verbs.Completion, error) {
	var wc [1]verbs.Completion
	for {
		if err := cq.Wait(context.Background()); err != nil {
			return verbs.Completion{}, err
		}
		n, err := cq.Poll(wc[:])
		if err != nil {
			return verbs.Completion{}, err
		}
		if n == 1 {
			return wc[0], wc[0].Err()
		}
	}
}

// Send and receive: the receiver posts a buffer, the sender sends into it.
func ExampleRCQueuePair_PostSend() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	sbuf, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	rbuf, err := l.alloc(4096, verbs.AccessLocalWrite) // receives need LocalWrite
	if err != nil {
		log.Fatal(err)
	}

	// Post the receive before the peer sends.
	if err := l.b.PostRecv(7, rbuf.All()); err != nil {
		log.Fatal(err)
	}
	n := copy(sbuf.Bytes(), "ping")
	sge, err := sbuf.SGE(0, n)
	if err != nil {
		log.Fatal(err)
	}
	if err := l.a.PostSendImm(8, verbs.Signaled, 0xcafe, sge); err != nil {
		log.Fatal(err)
	}
	sent, err := wait(l.cqA)
	if err != nil {
		log.Fatal(err)
	}
	got, err := wait(l.cqB)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("sender:  ", sent.Opcode, sent.WRID, sent.Status)
	fmt.Println("receiver:", got.Opcode, got.WRID, got.Status, got.ByteLen, "bytes", fmt.Sprintf("imm=%#x", got.Imm))
	fmt.Printf("received %q\n", rbuf.Bytes()[:got.ByteLen])
	// Output:
	// sender:   SEND 8 success
	// receiver: RECV 7 success 4 bytes imm=0xcafe
	// received "ping"
}

// RDMA write: the target is not involved; it only handed out dst.Remote().
func ExampleRCQueuePair_PostWrite() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	src, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	dst, err := l.alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		log.Fatal(err)
	}
	remote := dst.Remote() // what b's owner would send to a's owner

	n := copy(src.Bytes(), "written remotely")
	sge, err := src.SGE(0, n)
	if err != nil {
		log.Fatal(err)
	}
	if err := l.a.PostWrite(1, verbs.Signaled, remote.At(100), sge); err != nil {
		log.Fatal(err)
	}
	wc, err := wait(l.cqA)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(wc.Opcode, wc.Status)
	fmt.Printf("%q\n", dst.Bytes()[100:100+n])

	// A write outside the remote region fails at the target with a
	// remote access error, and nothing outside the region is touched.
	if err := l.a.PostWrite(2, verbs.Signaled, remote.At(4090), sge); err != nil {
		log.Fatal(err)
	}
	_, err = wait(l.cqA)
	var ce *verbs.CompletionError
	if errors.As(err, &ce) {
		fmt.Printf("%s (%s)\n", ce.Status, ce.Status.Class())
	}
	// Output:
	// RDMA_WRITE success
	// "written remotely"
	// remote access error (remote error)
}

// Handing out a region: the target encodes dst.Remote() in 25 bytes and
// sends them out of band; the initiator decodes them (UnmarshalBinary
// rejects anything but one well-formed encoding) and writes into it.
func ExampleRemoteRegion_MarshalBinary() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	dst, err := l.alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		log.Fatal(err)
	}
	msg, err := dst.Remote().MarshalBinary() // the target's side
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(len(msg), "bytes")

	var remote verbs.RemoteRegion // the initiator's side
	if err := remote.UnmarshalBinary(msg); err != nil {
		log.Fatal(err)
	}
	fmt.Println("region of", remote.Len, "bytes")
	src, err := l.alloc(64, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	n := copy(src.Bytes(), "hello")
	sge, err := src.SGE(0, n)
	if err != nil {
		log.Fatal(err)
	}
	if err := l.a.PostWrite(1, verbs.Signaled, remote.At(0), sge); err != nil {
		log.Fatal(err)
	}
	if _, err := wait(l.cqA); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%q\n", dst.Bytes()[:n])

	fmt.Println(remote.UnmarshalBinary(msg[:20]))
	// Output:
	// 25 bytes
	// region of 4096 bytes
	// "hello"
	// verbs: remote region: 20 bytes, want 25
}

// RDMA read: fetch bytes of a remote region into local memory.
func ExampleRCQueuePair_PostRead() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	remote, err := l.alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	if err != nil {
		log.Fatal(err)
	}
	local, err := l.alloc(4096, verbs.AccessLocalWrite) // read destinations need LocalWrite
	if err != nil {
		log.Fatal(err)
	}
	copy(remote.Bytes()[512:], "read me")

	sge, err := local.SGE(0, 7)
	if err != nil {
		log.Fatal(err)
	}
	if err := l.a.PostRead(1, verbs.Signaled, remote.Remote().At(512), sge); err != nil {
		log.Fatal(err)
	}
	wc, err := wait(l.cqA)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(wc.Opcode, wc.Status)
	fmt.Printf("%q\n", local.Bytes()[:7])
	// Output:
	// RDMA_READ success
	// "read me"
}

// Atomics operate on an 8-byte aligned word of remote memory and return
// its prior value.
func ExampleRCQueuePair_atomics() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	counter, err := l.alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteAtomic)
	if err != nil {
		log.Fatal(err)
	}
	result, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	word := counter.Bytes()[:8] // the word, in host byte order
	binary.NativeEndian.PutUint64(word, 10)
	prior := func() uint64 { return binary.NativeEndian.Uint64(result.Bytes()[:8]) }
	target := counter.Remote().At(0)
	into, err := result.SGE(0, 8) // where the prior value lands
	if err != nil {
		log.Fatal(err)
	}

	// Fetch-and-add 5: prior value 10.
	if err := l.a.PostFetchAdd(1, verbs.Signaled, target, 5, into); err != nil {
		log.Fatal(err)
	}
	if _, err := wait(l.cqA); err != nil {
		log.Fatal(err)
	}
	fmt.Println("fetch-and-add 5: prior", prior(), "now", binary.NativeEndian.Uint64(word))

	// Compare-and-swap 15 -> 100 succeeds; 15 -> 7 then fails: the word
	// is 100, which the prior value shows.
	for _, swap := range []uint64{100, 7} {
		if err := l.a.PostCompareSwap(2, verbs.Signaled, target, 15, swap, into); err != nil {
			log.Fatal(err)
		}
		if _, err := wait(l.cqA); err != nil {
			log.Fatal(err)
		}
		fmt.Println("compare 15, swap", swap, ": prior", prior(), "now", binary.NativeEndian.Uint64(word))
	}
	// Output:
	// fetch-and-add 5: prior 10 now 15
	// compare 15, swap 100 : prior 15 now 100
	// compare 15, swap 7 : prior 100 now 100
}

// A batch posts many work requests with one Submit (one doorbell, one cgo
// crossing on hardware). Only the last is signaled: its completion means
// every earlier request of the RC queue pair completed too.
func ExampleRCBatch() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	src, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	dst, err := l.alloc(4096, verbs.AccessLocalWrite|verbs.AccessRemoteWrite)
	if err != nil {
		log.Fatal(err)
	}
	copy(src.Bytes(), "abcdefgh")

	// Eight 1-byte writes, scattering src into every other byte of dst.
	b := l.a.NewBatch(8)
	for i := range 8 {
		sge, err := src.SGE(i, 1)
		if err != nil {
			log.Fatal(err)
		}
		req := b.Write(uint64(i), dst.Remote().At(uint64(2*i)), sge)
		if i == 7 {
			req.Signaled()
		}
	}
	fmt.Println("requests in batch:", b.Len())
	if err := b.Submit(); err != nil {
		log.Fatal(err)
	}
	wc, err := wait(l.cqA)
	if err != nil {
		log.Fatal(err)
	}
	var more [8]verbs.Completion
	n, _ := l.cqA.Poll(more[:])
	fmt.Println("completions:", 1+n, "wr_id", wc.WRID, wc.Status)
	fmt.Printf("%q\n", bytes.ReplaceAll(dst.Bytes()[:16], []byte{0}, []byte(".")))
	// Output:
	// requests in batch: 8
	// completions: 1 wr_id 7 success
	// "a.b.c.d.e.f.g.h."
}

// An SGE names bytes of a memory region; SGE refuses a range that does
// not lie inside it.
func ExampleMemoryRegion_SGE() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	mr, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	sge, err := mr.SGE(4000, 96)
	fmt.Println(sge.Length, sge.Addr == mr.Addr()+4000, err)
	_, err = mr.SGE(4000, 97)
	fmt.Println(errors.Is(err, syscall.EINVAL))
	// Output:
	// 96 true <nil>
	// true
}

// Inline data needs no memory region: small messages from Go memory are
// copied into the work request when it is posted, so the buffer may be
// reused as soon as the call returns.
func ExampleRCQueuePair_PostSendInline() {
	l, err := newLoopback()
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	rbuf, err := l.alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		log.Fatal(err)
	}
	if err := l.b.PostRecv(1, rbuf.All()); err != nil {
		log.Fatal(err)
	}
	msg := []byte("small and inline")
	if err := l.a.PostSendInline(2, verbs.Signaled, msg); err != nil {
		log.Fatal(err)
	}
	copy(msg, "overwritten now!") // the bytes were copied at the post
	if _, err := wait(l.cqA); err != nil {
		log.Fatal(err)
	}
	got, err := wait(l.cqB)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%q\n", rbuf.Bytes()[:got.ByteLen])

	// More than the queue pair's MaxInlineData is refused before
	// anything is posted.
	err = l.a.PostSendInline(3, verbs.Signaled, make([]byte, l.a.Cap().MaxInlineData+1))
	fmt.Println(errors.Is(err, syscall.EINVAL))
	// Output:
	// "small and inline"
	// true
}

// TestReadmeExample checks that README.md shows the code of Example: the
// body of its main function must equal Example's body without the Output
// comment.
func TestReadmeExample(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Skipf("no README.md: %v", err)
	}
	m := regexp.MustCompile("(?s)```go\n(package main.*?)```").FindSubmatch(readme)
	if m == nil {
		t.Fatal("README.md has no ```go block with a package main program")
	}
	fset := token.NewFileSet()
	prog, err := parser.ParseFile(fset, "README.md", m[1], 0)
	if err != nil {
		t.Fatalf("the README example does not parse: %v", err)
	}
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	file, err := parser.ParseFile(fset, "example_test.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	body := func(f *ast.File, code []byte, name string) string {
		for _, d := range f.Decls {
			if fn, ok := d.(*ast.FuncDecl); ok && fn.Name.Name == name {
				s := string(code[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset])
				var lines []string
				for _, l := range strings.Split(s, "\n") {
					if l = strings.TrimSpace(l); l != "" {
						lines = append(lines, l)
					}
				}
				if i := indexOf(lines, "// Output:"); i >= 0 {
					lines = lines[:i]
				}
				return strings.Join(lines, "\n")
			}
		}
		t.Fatalf("no func %s", name)
		return ""
	}
	if got, want := body(prog, m[1], "main"), body(file, src, "Example"); got != want {
		t.Errorf("README.md's example differs from Example in example_test.go.\nREADME:\n%s\n\nExample:\n%s", got, want)
	}
}

func indexOf(lines []string, s string) int {
	for i, l := range lines {
		if l == s {
			return i
		}
	}
	return -1
}
