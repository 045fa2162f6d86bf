package verbstest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/soft"
)

// hostPair is two network namespaces joined by a veth pair: two hosts, as
// far as soft0 can tell (their own network stacks, their own abstract unix
// socket namespaces), on one machine.
type hostPair struct {
	ns   [2]string
	addr [2]string
}

// newHostPair creates the namespaces (root and ip(8) needed; the test is
// skipped, saying so, without them) and removes them when the test ends.
func newHostPair(t *testing.T) *hostPair {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("needs ip(8) (iproute2) to create network namespaces")
	}
	id := os.Getpid() % 100000
	h := &hostPair{
		ns:   [2]string{fmt.Sprintf("gvxh%da", id), fmt.Sprintf("gvxh%db", id)},
		addr: [2]string{"10.231.7.1", "10.231.7.2"},
	}
	veth := [2]string{fmt.Sprintf("gvx%da", id), fmt.Sprintf("gvx%db", id)}
	run := func(args ...string) error {
		out, err := exec.Command(ip, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	t.Cleanup(func() {
		for _, ns := range h.ns {
			run("netns", "del", ns)
		}
	})
	steps := [][]string{
		{"netns", "add", h.ns[0]},
		{"netns", "add", h.ns[1]},
		{"link", "add", veth[0], "type", "veth", "peer", "name", veth[1]},
		{"link", "set", veth[0], "netns", h.ns[0]},
		{"link", "set", veth[1], "netns", h.ns[1]},
	}
	for i := range 2 {
		steps = append(steps,
			[]string{"-n", h.ns[i], "addr", "add", h.addr[i] + "/24", "dev", veth[i]},
			[]string{"-n", h.ns[i], "link", "set", veth[i], "up"},
			[]string{"-n", h.ns[i], "link", "set", "lo", "up"})
	}
	for _, s := range steps {
		if err := run(s...); err != nil {
			if s[0] == "netns" && s[1] == "add" {
				t.Skipf("cannot create network namespaces here: %v", err)
			}
			t.Fatal(err)
		}
	}
	return h
}

// peerListen starts a peer process on host i, listening on listen (""
// for the host's address), with the transport choice tr ("" for
// automatic).
func (h *hostPair) peerListen(t *testing.T, i int, tr, listen string) *Peer {
	t.Helper()
	if listen == "" {
		listen = h.addr[i]
	}
	return startPeer(t, []string{"ip", "netns", "exec", h.ns[i]},
		"GOVERBS_SOFT_TRANSPORT="+tr, "GOVERBS_SOFT_LISTEN="+net.JoinHostPort(listen, "0"))
}

// TestCrossProcessHosts runs RC traffic between two peer processes on two
// "hosts" (network namespaces joined by a veth pair), so the only way
// between them is TCP to a routable address: sends, large writes and
// reads, atomics, then the loss of one host's process mid-transfer. With
// the automatic choice, the unix socket of the other host is not reachable
// and soft0 falls back to TCP.
//
// Between hosts, soft0's TCP connections are encrypted by default (TLS
// with the certificate pinned by the endpoint): the links of both peers,
// and their QPs (Link, once traffic has set up the connection), say so. A peer listening on every interface (0.0.0.0) advertises its
// interface address, not the unspecified one, which the other host would
// take for itself.
func TestCrossProcessHosts(t *testing.T) {
	h := newHostPair(t)
	for _, tc := range []struct{ tr, listen string }{{"tcp", ""}, {"auto", ""}, {"tcp", "0.0.0.0"}} {
		name := tc.tr
		if tc.listen != "" {
			name += "-listen-" + tc.listen
		}
		t.Run(name, func(t *testing.T) {
			env := tc.tr
			if tc.tr == "auto" {
				env = ""
			}
			a, b := h.peerListen(t, 0, env, tc.listen), h.peerListen(t, 1, env, tc.listen)
			netns := func(p *Peer) string {
				t.Helper()
				l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", p.Do(PeerReq{Op: "pid"}).PID))
				if err != nil {
					t.Fatal(err)
				}
				return l
			}
			self, _ := os.Readlink("/proc/self/ns/net")
			if na, nb := netns(a), netns(b); na == nb || na == self || nb == self {
				t.Fatalf("the peers are not on hosts of their own: network namespaces %s, %s (this process %s)", na, nb, self)
			}
			const size = 4 << 20
			access := verbs.AccessLocalWrite | verbs.AccessRemoteWrite | verbs.AccessRemoteRead | verbs.AccessRemoteAtomic
			sa := a.Do(PeerReq{Op: "new", Type: "rc", Size: size, Access: access})
			sb := b.Do(PeerReq{Op: "new", Type: "rc", Size: size, Access: access})
			for i, ep := range []*verbs.Endpoint{sa.EP, sb.EP} {
				tcp, err := soft.AddrTCP(ep.Addr)
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(tcp, h.addr[i]+":") || strings.Contains(tcp, "0.0.0.0") || strings.Contains(tcp, "[::]") {
					t.Fatalf("host %d advertises TCP %q, want its address %s", i, tcp, h.addr[i])
				}
			}
			a.Do(PeerReq{Op: "connect", ID: sa.ID, EP: sb.EP})
			b.Do(PeerReq{Op: "connect", ID: sb.ID, EP: sa.EP})
			poll := func(p *Peer, id, n int) []verbs.Completion {
				t.Helper()
				r := p.Do(PeerReq{Op: "poll", ID: id, N: n, MS: int(DefaultTimeout.Milliseconds())})
				for _, wc := range r.WCs {
					if wc.Status != verbs.StatusSuccess {
						t.Fatalf("completion %+v", wc)
					}
				}
				return r.WCs
			}
			pattern := func(n int, seed byte) []byte {
				d := make([]byte, n)
				Pattern(d, seed)
				return d
			}

			// A send of 64 KiB.
			msg := pattern(64<<10, 1)
			b.Do(PeerReq{Op: "recv", ID: sb.ID, WRID: 1, Off: 0, Len: len(msg)})
			a.Do(PeerReq{Op: "fill", ID: sa.ID, Data: msg})
			a.Do(PeerReq{Op: "post", ID: sa.ID, Kind: "send", WRID: 2, Len: len(msg)})
			if wc := poll(b, sb.ID, 1); wc[0].ByteLen != uint32(len(msg)) {
				t.Fatalf("received %d bytes, want %d", wc[0].ByteLen, len(msg))
			}
			poll(a, sa.ID, 1)
			if got := b.Do(PeerReq{Op: "read", ID: sb.ID, Len: len(msg)}).Data; !bytes.Equal(got, msg) {
				t.Fatal("the received message differs from the one sent")
			}
			for i, p := range []*Peer{a, b} {
				links := p.Do(PeerReq{Op: "links"}).Links
				if len(links) == 0 {
					t.Fatalf("host %d has no soft0 connection", i)
				}
				for _, l := range links {
					if l.Kind != "tcp" || !l.Encrypted {
						t.Errorf("host %d: link %+v between hosts, want encrypted TCP", i, l)
					}
				}
				if l := p.Do(PeerReq{Op: "link", ID: []int{sa.ID, sb.ID}[i]}).Link; l != "tls" {
					t.Errorf("host %d: the QP's Link() is %q between hosts, want tls", i, l)
				}
			}

			// A 2 MiB write from A into the second half of B's region, read
			// back by A into the second half of its own.
			half := size / 2
			data := pattern(half, 2)
			a.Do(PeerReq{Op: "fill", ID: sa.ID, Data: data})
			a.Do(PeerReq{Op: "post", ID: sa.ID, Kind: "write", WRID: 3, Len: half, Remote: sb.Region.At(uint64(half))})
			poll(a, sa.ID, 1)
			if got := b.Do(PeerReq{Op: "read", ID: sb.ID, Off: half, Len: half}).Data; !bytes.Equal(got, data) {
				t.Fatal("B's memory differs from what A wrote")
			}
			a.Do(PeerReq{Op: "post", ID: sa.ID, Kind: "read", WRID: 4, Off: half, Len: half, Remote: sb.Region.At(uint64(half))})
			poll(a, sa.ID, 1)
			if got := a.Do(PeerReq{Op: "read", ID: sa.ID, Off: half, Len: half}).Data; !bytes.Equal(got, data) {
				t.Fatal("what A read back differs from what it wrote")
			}

			// Fetch-and-add on B's first word (the message's first bytes).
			before := b.Do(PeerReq{Op: "read", ID: sb.ID, Len: 8}).Data
			a.Do(PeerReq{Op: "post", ID: sa.ID, Kind: "faa", WRID: 5, Off: 0, Len: 8, A1: 5, Remote: sb.Region.At(0)})
			poll(a, sa.ID, 1)
			if got := a.Do(PeerReq{Op: "read", ID: sa.ID, Len: 8}).Data; !bytes.Equal(got, before) {
				t.Fatalf("fetch-and-add returned %x, want %x", got, before)
			}

			// B's process dies with 128 writes of 1 MiB outstanding: every
			// one completes on A, the first with an error, none hangs.
			a.Do(PeerReq{Op: "post", ID: sa.ID, Kind: "write", WRID: 6, Len: 1 << 20, Remote: sb.Region.At(0), Count: 128})
			b.Kill()
			r, err := a.Try(PeerReq{Op: "poll", ID: sa.ID, N: 128, MS: int(DefaultTimeout.Milliseconds())})
			if err != nil {
				t.Fatalf("after the peer died, %d of 128 writes completed: %v", len(r.WCs), err)
			}
			failed := 0
			for _, wc := range r.WCs {
				if wc.Status != verbs.StatusSuccess {
					failed++
				}
			}
			if failed == 0 {
				t.Fatalf("no write failed although the target process died: %+v", r.WCs)
			}
			if st := a.Do(PeerReq{Op: "state", ID: sa.ID}).State; st != verbs.StateError.String() {
				t.Fatalf("A's QP is %s after its peer died, want ERR", st)
			}
		})
	}
}
