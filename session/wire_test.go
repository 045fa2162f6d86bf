package session

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/goverbs/verbs"
)

// FuzzParseCtrl: any bytes a peer's agent sends decode to a message or to
// ErrProtocol, never a panic; what decodes encodes to the same message
// again, its text printable ASCII of at most ctrlTextMax bytes.
func FuzzParseCtrl(f *testing.F) {
	var b [ctrlBufSize]byte
	for _, m := range []ctrlMsg{
		{typ: ctrlRequest, access: verbs.AccessRemoteWrite, credits: 3, id: 1, len: 4096, lease: time.Minute},
		{typ: ctrlGrant, id: 1, grant: 9, addr: 1 << 40, len: 4096, rkey: 77, lease: time.Second},
		{typ: ctrlErr, code: errCodeLimit, id: 2, text: "over the cap"},
		{typ: ctrlFin, id: 5},
	} {
		n := m.put(b[:])
		f.Add(append([]byte(nil), b[:n]...))
	}
	f.Add([]byte{})
	f.Add(make([]byte, ctrlHdr))
	f.Fuzz(func(t *testing.T, p []byte) {
		m, err := parseCtrl(p)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("%v: not ErrProtocol", err)
			}
			return
		}
		if m.typ < ctrlRequest || m.typ > ctrlFin || m.lease < 0 || m.lease > maxLease || len(m.text) > ctrlTextMax {
			t.Fatalf("accepted %+v", m)
		}
		for _, c := range []byte(m.text) {
			if c < 0x20 || c >= 0x7f {
				t.Fatalf("text %q is not printable ASCII", m.text)
			}
		}
		var out [ctrlBufSize]byte
		again, err := parseCtrl(out[:m.put(out[:])])
		if err != nil {
			t.Fatalf("%+v does not decode again: %v", m, err)
		}
		if diff := cmp.Diff(m, again, cmp.AllowUnexported(ctrlMsg{})); diff != "" {
			t.Fatalf("round trip (-first +again):\n%s", diff)
		}
	})
}

// setupEndpoint is a well-formed endpoint for the setup messages of the
// tests below.
func setupEndpoint() *verbs.Endpoint {
	return &verbs.Endpoint{Version: verbs.EndpointVersion, Transport: verbs.TransportRC, LinkLayer: verbs.LinkLayerEthernet, Port: 1, QPN: 5, PSN: 1, MTU: verbs.MTU1024}
}

// TestSetupValidate: a peer's setup message that would make this side
// write outside the peer's ring or control block, or hold more than the
// bounds allow, is ErrProtocol, naming what is wrong.
func TestSetupValidate(t *testing.T) {
	ep := setupEndpoint()
	good := func() setup {
		return setup{
			Data: ep, Ctrl: ep,
			Block:       verbs.RemoteRegion{Addr: 4096, Len: 64, RKey: 1},
			Ring:        verbs.RemoteRegion{Addr: 1 << 20, Len: 64 * 4096, RKey: 2},
			RecvBuffers: 64, SlotSize: 4096, CtrlBuffers: 32, MaxMessage: 1 << 20,
		}
	}
	if err := ep.Validate(); err != nil {
		t.Fatalf("the test's endpoint: %v", err)
	}
	for _, tc := range []struct {
		name      string
		change    func(*setup)
		endpoints bool
		want      string // in the error; "" for none
	}{
		{"valid", func(*setup) {}, true, ""},
		{"valid without endpoints (CM)", func(p *setup) { p.Data, p.Ctrl = nil, nil }, false, ""},
		{"no receive buffers", func(p *setup) { p.RecvBuffers = 0 }, true, "receive buffers"},
		{"too many receive buffers", func(p *setup) { p.RecvBuffers = 1<<16 + 1 }, true, "receive buffers"},
		{"slots smaller than a header", func(p *setup) { p.SlotSize = rtsHdr - 1 }, true, "receive buffers are"},
		{"slots too large", func(p *setup) { p.SlotSize = 64<<20 + 1 }, true, "receive buffers are"},
		{"one control buffer", func(p *setup) { p.CtrlBuffers = 1 }, true, "control buffers"},
		{"negative largest message", func(p *setup) { p.MaxMessage = -1 }, true, "largest message"},
		{"largest message over 2 GiB", func(p *setup) { p.MaxMessage = maxMessage + 1 }, true, "largest message"},
		{"control block too small", func(p *setup) { p.Block.Len = 4 }, true, "control block"},
		{"ring smaller than its slots", func(p *setup) { p.Ring.Len = 64*4096 - 1 }, true, "ring is"},
		{"ring overflowing 32 bits of slots", func(p *setup) { p.RecvBuffers, p.SlotSize = 1<<16, 64<<20 }, true, "ring is"},
		{"no endpoints", func(p *setup) { p.Data = nil }, true, "no endpoints"},
		{"bad data endpoint", func(p *setup) { p.Data = &verbs.Endpoint{} }, true, "data endpoint"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := good()
			tc.change(&p)
			err := p.validate(tc.endpoints)
			switch {
			case tc.want == "" && err != nil:
				t.Fatal(err)
			case tc.want != "" && (!errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("%v; want ErrProtocol saying %q", err, tc.want)
			}
		})
	}
}

// FuzzSetup: whatever JSON a peer sends as its setup decodes and
// validates without a panic, and what validates leaves the ring large
// enough for its slots (the bound every write into it relies on).
func FuzzSetup(f *testing.F) {
	ep := setupEndpoint()
	js, _ := json.Marshal(setup{Data: ep, Ctrl: ep, Block: verbs.RemoteRegion{Len: 64}, Ring: verbs.RemoteRegion{Len: 8 * 512},
		RecvBuffers: 8, SlotSize: 512, CtrlBuffers: 4, MaxMessage: 4096})
	f.Add(js)
	f.Add([]byte(`{"recv":-1,"slot":1e9}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, p []byte) {
		var s setup
		if json.Unmarshal(p, &s) != nil {
			return
		}
		if s.validate(true) != nil {
			return
		}
		if s.RecvBuffers < 1 || s.SlotSize < rtsHdr || s.Ring.Len < uint64(s.RecvBuffers)*uint64(s.SlotSize) || s.Block.Len < 8 {
			t.Fatalf("accepted %+v", s)
		}
	})
}
