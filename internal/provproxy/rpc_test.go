package provproxy

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/soft"
)

const testTimeout = 30 * time.Second

func testGuard(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// rawServer serves soft0 in a goroutine on one end of a new connection
// and returns the other end, for a test to speak the protocol by hand, and
// Serve's result.
func rawServer(t *testing.T) (*conn, <-chan error) {
	t.Helper()
	local, remote, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		done <- Serve(remote, soft.New())
	}()
	cn, err := newConn(local)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cn.close()
		select {
		case <-ended:
		case <-testGuard(t).Done():
			t.Errorf("Serve did not return after the connection closed")
		}
	})
	return cn, done
}

// inProcess returns a client of a server running in this process.
func inProcess(t *testing.T) *Client {
	t.Helper()
	local, remote, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- Serve(remote, soft.New()) }()
	c, err := NewClient(testGuard(t), local)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return c
}

// request encodes a request packet.
func request(t *testing.T, op opcode, id uint64, req any) []byte {
	t.Helper()
	b, err := marshal(appendHeader(nil, header{kind: kindRequest, op: op, id: id}), req)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// answer reads the next packet, which must be the response to id, and
// returns its error.
func answer(t *testing.T, cn *conn, op opcode, id uint64) error {
	t.Helper()
	p, fds, err := cn.recv()
	if err != nil || len(fds) > 0 {
		t.Fatalf("reading the response to request %d: %v (%d descriptors)", id, err, len(fds))
	}
	h, payload, err := parseHeader(p)
	if err != nil || h.kind != kindResponse || h.id != id || h.op != op {
		t.Fatalf("response header %+v (%v), want a %s response to request %d", h, err, op, id)
	}
	var w wireError
	resp := respType(op)
	if resp == nil {
		resp = &empty{}
	}
	if err := unmarshal(payload, &w, resp); err != nil {
		t.Fatalf("response payload: %v", err)
	}
	return w.err()
}

// TestServerMalformedRequest sends requests that are malformed or that
// break the rules: each is answered with an error, and the connection
// serves the next request.
func TestServerMalformedRequest(t *testing.T) {
	hello := request(t, opHello, 1, helloReq{Version: protocolVersion})
	qp := request(t, opCreateQP, 1, filled(&createQPReq{}))
	qp[len(qp)-1] = 7 // SignalAll, a bool
	open := appendHeader(nil, header{kind: kindRequest, op: opOpen, id: 1})
	open = binary.AppendUvarint(open, 1<<40)
	for _, tc := range []struct {
		name string
		op   opcode
		pkt  []byte
		fds  func(t *testing.T) []int
		want string
	}{
		{"ShortPayload", opQueryDevice, append(appendHeader(nil, header{kind: kindRequest, op: opQueryDevice, id: 1}), 1, 2, 3), nil, "malformed message"},
		{"TrailingByte", opHello, append(bytes.Clone(hello), 0), nil, "malformed message"},
		{"UnknownOperation", 200, appendHeader(nil, header{kind: kindRequest, op: 200, id: 1}), nil, "unknown operation 200"},
		{"BadBool", opCreateQP, qp, nil, "malformed message: bool 7"},
		{"HugeLength", opOpen, open, nil, "malformed message"},
		{"UnknownObject", opQueryDevice, request(t, opQueryDevice, 1, idReq{ID: 12345}), nil, "no open device context with id 12345"},
		{"DescriptorWithoutRegMR", opHello, hello, pipeFD, "1 file descriptors with the request, want 0"},
		{"RegMRWithoutDescriptor", opRegMR, request(t, opRegMR, 1, regMRReq{PD: 1, Len: 4096}), nil, "0 file descriptors with the request, want 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cn, _ := rawServer(t)
			var fds []int
			if tc.fds != nil {
				fds = tc.fds(t)
			}
			if err := cn.send(tc.pkt, fds...); err != nil {
				t.Fatal(err)
			}
			err := answer(t, cn, tc.op, 1)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("answer: %v, want an error saying %q", err, tc.want)
			}
			// A cancel for a request that is not in flight is ignored, and
			// the connection still serves.
			if err := cn.send(appendHeader(nil, header{kind: kindCancel, id: 99})); err != nil {
				t.Fatal(err)
			}
			if err := cn.send(request(t, opHello, 2, helloReq{Version: protocolVersion})); err != nil {
				t.Fatal(err)
			}
			if err := answer(t, cn, opHello, 2); err != nil {
				t.Fatalf("hello after the malformed request: %v", err)
			}
		})
	}
}

// pipeFD returns the write end of a pipe to send to the server and checks,
// when the test ends, that the server closed its copy: the read end sees
// the end of the pipe once the test's copy is closed too.
func pipeFD(t *testing.T) []int {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.Close()
		defer r.Close()
		r.SetReadDeadline(time.Now().Add(testTimeout))
		if n, err := r.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Errorf("the pipe sent to the server: read %d, %v; want EOF (the server closed its descriptor)", n, err)
		}
	})
	return []int{int(w.Fd())}
}

// TestServerMalformedPacket sends packets that cannot be attributed to a
// request: the server ends the connection and Serve says why.
func TestServerMalformedPacket(t *testing.T) {
	for _, tc := range []struct {
		name string
		pkt  []byte
		want string
	}{
		{"ShortPacket", []byte{kindRequest, 1, 2}, "shorter than a header"},
		{"BadKind", appendHeader(nil, header{kind: 9, op: opHello, id: 1}), "message kind 9"},
		{"Response", appendHeader(nil, header{kind: kindResponse, op: opHello, id: 1}), "message kind 2 sent to the server"},
		{"CancelWithPayload", append(appendHeader(nil, header{kind: kindCancel, id: 1}), 0), "cancel with a 1-byte payload"},
		{"Oversized", make([]byte, maxMsg+1), "packet longer than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cn, done := rawServer(t)
			// Bypass send's own limit.
			if _, _, err := cn.uc.WriteMsgUnix(tc.pkt, nil, nil); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if !errors.Is(err, errMalformed) || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("Serve: %v, want a malformed-message error saying %q", err, tc.want)
				}
			case <-testGuard(t).Done():
				t.Fatal("Serve did not end")
			}
			if _, _, err := cn.recv(); !errors.Is(err, io.EOF) {
				t.Errorf("after the malformed packet: %v, want the end of the connection", err)
			}
		})
	}
}

// fakeServer answers every request of a client with reply.
func fakeServer(t *testing.T, reply func(h header, payload []byte) ([]byte, []int)) *os.File {
	t.Helper()
	local, remote, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	cn, err := newConn(remote)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			p, fds, err := cn.recv()
			if err != nil {
				return
			}
			fdpass.Close(fds)
			h, payload, err := parseHeader(p)
			if err != nil || h.kind != kindRequest {
				continue
			}
			pkt, fds := reply(h, payload)
			if pkt == nil {
				cn.close()
				return
			}
			if _, _, err := cn.uc.WriteMsgUnix(pkt, unixRights(fds), nil); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		cn.close()
		<-done
	})
	return local
}

func unixRights(fds []int) []byte {
	if len(fds) == 0 {
		return nil
	}
	return unix.UnixRights(fds...)
}

// response encodes a response packet.
func response(h header, err error, resp any) []byte {
	b, _ := marshal(appendHeader(nil, header{kind: kindResponse, op: h.op, id: h.id}), toWire(err))
	b, _ = marshal(b, resp)
	return b
}

// goodHello answers a hello as a server would.
func goodHello(h header) []byte {
	return response(h, nil, helloResp{Version: protocolVersion, Provider: "fake", PID: 1})
}

// TestClientMalformedResponse answers the client's greeting with bad
// packets: the greeting fails with a clear error, and the client's
// goroutine ends (TestMain checks for goroutines left behind).
func TestClientMalformedResponse(t *testing.T) {
	for _, tc := range []struct {
		name     string
		reply    func(h header, payload []byte) ([]byte, []int)
		lost     bool // the connection ends (ErrConnLost), not just the call
		wantText string
	}{
		{"GarbagePayload", func(h header, _ []byte) ([]byte, []int) {
			return append(appendHeader(nil, header{kind: kindResponse, op: h.op, id: h.id}), 1, 0xFF), nil
		}, false, "malformed message"},
		{"VersionMismatch", func(h header, _ []byte) ([]byte, []int) {
			return response(h, nil, helloResp{Version: 99}), nil
		}, false, "protocol version 99"},
		{"UnknownID", func(h header, _ []byte) ([]byte, []int) {
			h.id++
			return goodHello(h), nil
		}, true, "not outstanding"},
		{"WrongOperation", func(h header, _ []byte) ([]byte, []int) {
			h.op = opOpen
			return goodHello(h), nil
		}, true, "open device response to a hello request"},
		{"ShortPacket", func(h header, _ []byte) ([]byte, []int) { return []byte{kindResponse}, nil }, true, "shorter than a header"},
		{"RequestToClient", func(h header, _ []byte) ([]byte, []int) {
			return appendHeader(nil, header{kind: kindRequest, op: opHello, id: h.id}), nil
		}, true, "message kind 1 sent to the client"},
		{"Descriptor", func(h header, _ []byte) ([]byte, []int) { return goodHello(h), []int{int(os.Stdin.Fd())} }, true, "file descriptors sent to the client"},
		{"Oversized", func(h header, _ []byte) ([]byte, []int) { return make([]byte, maxMsg+1), nil }, true, "packet longer than"},
		{"Hangup", func(header, []byte) ([]byte, []int) { return nil, nil }, true, "EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := NewClient(testGuard(t), fakeServer(t, tc.reply))
			if err == nil {
				c.Close()
				t.Fatal("NewClient succeeded")
			}
			if !strings.Contains(err.Error(), tc.wantText) || errors.Is(err, ErrConnLost) != tc.lost {
				t.Errorf("NewClient: %v; want an error saying %q, wrapping ErrConnLost: %v", err, tc.wantText, tc.lost)
			}
		})
	}
}

// TestClientMalformedLaterResponse checks that a response that does not
// decode fails only its call: the connection serves the next one.
func TestClientMalformedLaterResponse(t *testing.T) {
	n := 0
	c, err := NewClient(testGuard(t), fakeServer(t, func(h header, _ []byte) ([]byte, []int) {
		n++
		switch n {
		case 1:
			return goodHello(h), nil
		case 2:
			return append(appendHeader(nil, header{kind: kindResponse, op: h.op, id: h.id}), 0, 0xFF, 0xFF), nil
		}
		return response(h, nil, idResp{ID: 5}), nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Open("soft0"); !errors.Is(err, errMalformed) || errors.Is(err, ErrConnLost) {
		t.Errorf("Open answered with garbage: %v, want a malformed-message error for the call only", err)
	}
	x, err := c.Open("soft0")
	if err != nil {
		t.Fatalf("Open after the malformed response: %v", err)
	}
	if x.(*devContext).id != 5 {
		t.Errorf("context id %d, want 5", x.(*devContext).id)
	}
}

// serverBytes returns the n bytes at the server's address addr (the
// server runs in this process).
func serverBytes(addr uint64, n int) []byte {
	u := uintptr(addr)
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&u))), n)
}

// memfdMappings counts this process' mappings of goverbs memfds
// (mem.Mappings).
func memfdMappings(t *testing.T) int {
	t.Helper()
	n, err := mem.Mappings()
	if err != nil {
		t.Skipf("cannot read the mappings: %v", err)
	}
	return n
}

// TestMemoryShared registers ranges of a memfd through an in-process
// server: the server maps the descriptor at the range's offset (aligned or
// not), so bytes written through either mapping are seen through the
// other, and closing the MR unmaps the server's mapping.
func TestMemoryShared(t *testing.T) {
	c := inProcess(t)
	pc, err := c.Open(soft.DeviceName)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	pd, err := pc.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	page := mem.PageSize
	for _, tc := range []struct {
		name   string
		off, n int
	}{
		{"Whole", 0, 3 * page},
		{"SecondPage", page, page},
		{"UnalignedStart", page + 123, 1000},
		{"UnalignedBoth", 5, 2*page - 7},
		{"OneByte", 3*page - 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := mem.Alloc(3*page, "test", false)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Free()
			maps := memfdMappings(t)
			local := r.Bytes()[tc.off : tc.off+tc.n]
			mr, err := pd.RegMR(prov.Mem{Ptr: unsafe.Pointer(&local[0]), Len: tc.n, FD: r.FD(), Offset: int64(tc.off)}, prov.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			if mr.Len() != tc.n || mr.Addr() == uint64(uintptr(unsafe.Pointer(&local[0]))) {
				t.Fatalf("MR of %d bytes at %#x: want %d bytes in the server's own mapping", mr.Len(), mr.Addr(), tc.n)
			}
			if got := memfdMappings(t); got != maps+1 {
				t.Errorf("%d memfd mappings after the registration, want %d", got, maps+1)
			}
			remote := serverBytes(mr.Addr(), tc.n)
			for i := range local {
				local[i] = byte(i*7 + 1)
			}
			if !bytes.Equal(remote, local) {
				t.Errorf("the server's mapping does not show the bytes written here")
			}
			for i := range remote {
				remote[i] = byte(i*3 + 2)
			}
			if !bytes.Equal(local, remote) {
				t.Errorf("this mapping does not show the bytes written through the server's")
			}
			if err := mr.Close(); err != nil {
				t.Fatal(err)
			}
			if got := memfdMappings(t); got != maps {
				t.Errorf("%d memfd mappings after closing the MR, want %d (the server unmaps its mapping)", got, maps)
			}
		})
	}
	if _, err := pd.RegMR(prov.Mem{Ptr: nil, Len: 10, FD: -1}, 0); !errors.Is(err, prov.ErrNotSupported) {
		t.Errorf("RegMR without a descriptor: %v, want ErrNotSupported", err)
	}
	if _, err := pc.QueryPort(2); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("QueryPort(2) through the proxy: %v, want EINVAL", err)
	}
}

// TestClientClosedMidCall closes the client while a call waits in the
// server: the call fails with an error wrapping prov.ErrClosed, later calls
// fail the same way, and the server cancels the wait, closes what was left
// open and says so.
func TestClientClosedMidCall(t *testing.T) {
	local, remote, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- Serve(remote, soft.New()) }()
	c, err := NewClient(testGuard(t), local)
	if err != nil {
		t.Fatal(err)
	}
	pc, err := c.Open(soft.DeviceName)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := pc.CreateCompChannel()
	if err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { _, err := ch.Wait(testGuard(t)); waited <- err }()
	for Outstanding(c) < 1 {
		if testGuard(t).Err() != nil {
			t.Fatal("the wait was not sent")
		}
		time.Sleep(time.Millisecond)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	select {
	case err := <-waited:
		if !errors.Is(err, prov.ErrClosed) {
			t.Errorf("Wait when the client closed: %v, want an error wrapping ErrClosed", err)
		}
	case <-testGuard(t).Done():
		t.Fatal("Wait did not return after Close")
	}
	if _, err := pc.QueryDevice(); !errors.Is(err, prov.ErrClosed) {
		t.Errorf("QueryDevice after Close: %v, want an error wrapping ErrClosed", err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	select {
	case err := <-served:
		if err == nil || !strings.Contains(err.Error(), "left objects open (completion channel 2, device context 1)") {
			t.Errorf("Serve: %v, want an error naming the objects left open", err)
		}
	case <-testGuard(t).Done():
		t.Fatal("Serve did not return after the client closed")
	}
}
