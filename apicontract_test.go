package verbs_test

// Contracts of the API that a second review found broken (each test failed
// before its fix): a second Wait ignored its ctx, Bytes of a window over
// Alloc'd memory outlived it, endpoints and remote regions from JSON went
// unchecked, AsyncEvent's ctx errors did not match ErrTimeout, Polls of
// a closed CQ with an empty slice succeeded, QPSpec.PSN and MTU were
// truncated or ignored.

import (
	"context"
	"encoding/json"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/verbstest"
)

// TestAsyncEventTimeout: every other wait of the package (CQ.Wait,
// CompletionChannel.Wait, the CM calls) reports the end of its context
// with an error matching both the context's error and verbs.ErrTimeout
// (verbstest.expectCtxErr); Context.AsyncEvent returns the bare context
// error.
func TestAsyncEventTimeout(t *testing.T) {
	c, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.AsyncEvent(cancelled); !errors.Is(err, context.Canceled) || !errors.Is(err, verbs.ErrTimeout) {
		t.Errorf("AsyncEvent with a cancelled context: %v; want an error matching context.Canceled and verbs.ErrTimeout", err)
	}
	short, cancel2 := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel2()
	if _, err := c.AsyncEvent(short); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, verbs.ErrTimeout) {
		t.Errorf("AsyncEvent past its deadline: %v; want an error matching context.DeadlineExceeded and verbs.ErrTimeout", err)
	}
}

// softCQ is a CQ of its own soft0 context, closed (if still open) with
// it when the test ends.
func softCQ(t *testing.T) *verbs.CompletionQueue {
	t.Helper()
	c, err := verbs.Open(verbs.SoftDevice)
	if err != nil {
		t.Fatal(err)
	}
	cq, err := c.NewCompletionQueue(verbs.CQSpec{})
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cq.Close()
		c.Close()
	})
	return cq
}

// TestPollEmptyAfterClose: "the calls after [Close] fail with
// ErrClosed" (doc.go); Poll and PollBusy with an empty slice returned
// (0, nil) on a closed CQ, so a loop polling with an empty slice never
// learned that the CQ was gone.
func TestPollEmptyAfterClose(t *testing.T) {
	cq := softCQ(t)
	if err := cq.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cq.Poll(nil); !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("Poll(nil) on a closed CQ: %v, want ErrClosed", err)
	}
	if _, err := cq.PollBusy([]verbs.Completion{}, 1); !errors.Is(err, verbs.ErrClosed) {
		t.Errorf("PollBusy(empty) on a closed CQ: %v, want ErrClosed", err)
	}
}

func validEndpoint() verbs.Endpoint {
	g, _ := verbs.ParseGID("::ffff:127.0.0.1")
	return verbs.Endpoint{Version: verbs.EndpointVersion, Transport: verbs.TransportRC, LinkLayer: verbs.LinkLayerEthernet,
		Port: 1, GIDIndex: 1, GID: g, QPN: 0x1234, PSN: 0xabcdef, MTU: verbs.MTU4096, Addr: []byte("soft:xyz")}
}

// TestEndpointLinkLayerGarbage: Validate checks version, transport,
// QPN, PSN, MTU and address, but not the link layer, which Connect and
// AddressHandleTo route on: an endpoint with link layer 0xee (neither
// Unspecified, InfiniBand nor Ethernet) decodes from bytes and JSON
// without error.
func TestEndpointLinkLayerGarbage(t *testing.T) {
	good, err := validEndpoint().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	bad := append([]byte(nil), good...)
	bad[6] = 0xee // link layer
	var e verbs.Endpoint
	if err := e.UnmarshalBinary(bad); err == nil {
		t.Errorf("UnmarshalBinary accepted link layer %d: %+v", e.LinkLayer, e)
	}
	var j verbs.Endpoint
	in := `{"version":1,"transport":"RC","link_layer":238,"port":1,"gid":"::ffff:127.0.0.1","qpn":4660,"psn":1,"mtu":5}`
	if err := json.Unmarshal([]byte(in), &j); err == nil {
		t.Errorf("json.Unmarshal accepted link layer %d: %+v", j.LinkLayer, j)
	}
	ee := validEndpoint()
	ee.LinkLayer = 0xee
	if err := ee.Validate(); err == nil {
		t.Errorf("Validate accepted link layer %d", ee.LinkLayer)
	}
}

// TestRemoteRegionJSONUnvalidated: RemoteRegion "marshals to a compact
// binary form and to JSON"; the binary decoder refuses an empty region
// and one that wraps around the address space, the JSON one (the default
// struct decoding) accepts both.
func TestRemoteRegionJSONUnvalidated(t *testing.T) {
	for _, in := range []string{
		`{"addr":18446744073709551615,"len":9,"rkey":1}`, // wraps
		`{"addr":4096,"len":0,"rkey":1}`,                 // empty
	} {
		var r verbs.RemoteRegion
		if err := json.Unmarshal([]byte(in), &r); err == nil {
			_, berr := r.MarshalBinary()
			t.Errorf("json.Unmarshal(%s) accepted %+v (MarshalBinary of it: %v)", in, r, berr)
		}
	}
}

// TestWindowBytesAfterArenaClose: Bytes of a closed MR from Alloc is
// nil, so that it cannot alias memory mapped later
// (TestAdversarialBytesAfterClose). A window (Register of part of an
// Alloc MR's memory) keeps returning its slice after it and the arena are
// closed: memory that was unmapped, and here the memory of the next MR.
func TestWindowBytesAfterArenaClose(t *testing.T) {
	pd := verbstest.OpenPD(t, verbs.SoftDevice)
	arena, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	win, err := pd.Register(arena.Bytes(), verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := win.Close(); err != nil {
		t.Fatal(err)
	}
	if err := arena.Close(); err != nil {
		t.Fatal(err)
	}
	other, err := pd.Alloc(4096, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if b := win.Bytes(); len(b) != 0 {
		t.Errorf("Bytes of a closed window of a closed arena: %d bytes (aliasing the next MR's memory: %v), want none",
			len(b), &b[0] == &other.Bytes()[0])
	}
}

// TestQPSpecPSNAndMTU: checkSpecRanges refuses QPSpec values that do
// not fit the attributes they become, "a wider int would otherwise be
// truncated silently", and Modify refuses a 25-bit SQPSN; but QPSpec.PSN
// is masked to 24 bits (0x1000000 becomes PSN 0), and an invalid
// QPSpec.MTU (1024, bytes instead of MTU1024) is taken as "no cap".
func TestQPSpecPSNAndMTU(t *testing.T) {
	a, _ := verbstest.NewNodes(t, verbstest.Config{DeviceA: verbs.SoftDevice})
	for _, tc := range []struct {
		name string
		spec verbs.QPSpec
	}{
		{"PSN25bits", verbs.QPSpec{PSN: 0x1234567}},
		{"PSNOnlyBit24", verbs.QPSpec{PSN: 0x1000000}},
		{"MTUInBytes", verbs.QPSpec{MTU: 1024}},
		{"MTU6", verbs.QPSpec{MTU: 6}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q, err := a.PD.NewRCQueuePair(a.QPSpec(tc.spec))
			if err == nil {
				e, _ := q.Endpoint()
				q.Close()
				t.Fatalf("NewRCQueuePair(PSN %#x, MTU %d) succeeded: endpoint PSN %#x, MTU %v", tc.spec.PSN, uint32(tc.spec.MTU), e.PSN, e.MTU)
			}
			if !errors.Is(err, syscall.EINVAL) {
				t.Errorf("NewRCQueuePair: %v, want EINVAL", err)
			}
		})
	}
}

// TestConcurrentWaitHonoursContext: "Poll and Wait are safe for
// concurrent use", and Wait "blocks until the CQ holds at least one
// completion, Wake is called, or ctx ends". A second Wait while one is in
// progress blocked on a mutex without looking at its context: it could
// not time out until the first Wait returned.
func TestConcurrentWaitHonoursContext(t *testing.T) {
	cq := softCQ(t)
	long, cancelLong := context.WithCancel(context.Background())
	defer cancelLong()
	first := make(chan error, 1)
	go func() { first <- cq.Wait(long) }()
	time.Sleep(100 * time.Millisecond) // let the first Wait go to sleep
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	second := make(chan error, 1)
	go func() { second <- cq.Wait(short) }()
	select {
	case err := <-second:
		if !errors.Is(err, verbs.ErrTimeout) {
			t.Errorf("second Wait: %v, want ErrTimeout", err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("a Wait whose context ended 10s ago has not returned: it waits for the other Wait in progress")
		cancelLong()
		<-second
	}
	cancelLong()
	<-first
}
