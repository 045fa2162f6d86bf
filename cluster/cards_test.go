package cluster

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// xCard is rank r's card in the card tests.
func xCard(r int) []byte { return fmt.Appendf(nil, "card of rank %d", r) }

// xItems is rank r's items of w bytes for a world of n: the item for
// rank j is w bytes of value 16r+j (mod 256).
func xItems(r, n, w int) []byte {
	b := make([]byte, n*w)
	for j := range n {
		for k := range w {
			b[j*w+k] = byte(16*r + j)
		}
	}
	return b
}

// xRunCards runs ExchangeCards for every rank of a world of n (item size
// w) concurrently.
func xRunCards(t *testing.T, n, w int, mode Mode) ([][][]byte, [][]byte, []error) {
	t.Helper()
	xNoLeaks(t)
	lns, addrs := xListeners(t, n)
	ctx := xContext(t, time.Minute)
	cards := make([][][]byte, n)
	cols := make([][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		c := ExchangeConfig{Rank: r, Size: n, Mode: mode, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token")}
		wg.Add(1)
		go func() {
			defer wg.Done()
			cards[r], cols[r], errs[r] = ExchangeCards(ctx, c, xCard(r), xItems(r, n, w))
		}()
	}
	wg.Wait()
	return cards, cols, errs
}

// TestExchangeCards: every rank gets every rank's card and, from each
// rank j, rank j's item for it, in both modes and for several sizes.
func TestExchangeCards(t *testing.T) {
	for _, mode := range xModes {
		for _, n := range []int{1, 2, 3, 5} {
			for _, w := range []int{1, 6} {
				t.Run(fmt.Sprintf("%v/%d ranks/%d-byte items", mode, n, w), func(t *testing.T) {
					cards, cols, errs := xRunCards(t, n, w, mode)
					for r := range n {
						if errs[r] != nil {
							t.Fatalf("rank %d: %v", r, errs[r])
						}
						if len(cards[r]) != n || len(cols[r]) != n*w {
							t.Fatalf("rank %d: %d cards and %d bytes of items", r, len(cards[r]), len(cols[r]))
						}
						for j := range n {
							if !bytes.Equal(cards[r][j], xCard(j)) {
								t.Errorf("rank %d: card %d is %q", r, j, cards[r][j])
							}
							if want := xItems(j, n, w)[r*w : (r+1)*w]; !bytes.Equal(cols[r][j*w:(j+1)*w], want) {
								t.Errorf("rank %d: item of rank %d is %x, want %x", r, j, cols[r][j*w:(j+1)*w], want)
							}
						}
					}
				})
			}
		}
	}
}

// TestExchangeCardsShapeMismatch: a rank that exchanges cards and one
// that exchanges entries (or cards with other items) both fail at once
// with ErrModeMismatch naming both shapes, in both modes (no context
// deadline: the disagreement must end the exchange).
func TestExchangeCardsShapeMismatch(t *testing.T) {
	for _, mode := range xModes {
		for _, other := range []int{0, 4} { // rank 1's item size; 0: Exchange
			t.Run(fmt.Sprintf("%v/%d", mode, other), func(t *testing.T) {
				xNoLeaks(t)
				lns, addrs := xListeners(t, 2)
				ctx := context.Background()
				errs := make([]error, 2)
				var wg sync.WaitGroup
				for r := range 2 {
					c := ExchangeConfig{Rank: r, Size: 2, Mode: mode, Addrs: addrs, Listener: lns[r], Job: "job", Token: []byte("token")}
					wg.Add(1)
					go func() {
						defer wg.Done()
						switch {
						case r == 0:
							_, _, errs[r] = ExchangeCards(ctx, c, xCard(r), xItems(r, 2, 6))
						case other == 0:
							_, errs[r] = Exchange(ctx, c, xOut(r, 2))
						default:
							_, _, errs[r] = ExchangeCards(ctx, c, xCard(r), xItems(r, 2, other))
						}
					}()
				}
				wg.Wait()
				for r, err := range errs {
					if !errors.Is(err, ErrModeMismatch) || !bytes.Contains([]byte(err.Error()), []byte("6-byte items")) {
						t.Errorf("rank %d: %v, want ErrModeMismatch naming the shapes", r, err)
					}
					t.Logf("rank %d: %v", r, err)
				}
			})
		}
	}
}

// xFakeCards is the card exchange of a rank whose messages tests write by
// hand.
func xFakeCards(t testing.TB, mode Mode, rank, n, w int) *exchange {
	x, err := newCardExchange(ExchangeConfig{Rank: rank, Size: n, Mode: mode, Addrs: make([]string, n), Root: "unused",
		Job: "job", Token: []byte("token")}, xCard(rank), xItems(rank, n, w))
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// TestExchangeCardsBadShare: a leaf that authenticates and then sends
// the root a malformed share (a truncated vector, a vector of another
// length, items for another world size, a card over the bound) makes the
// root fail at once (rank 2 never comes), naming it, with ErrBadFrame or
// ErrFrameTooLarge.
func TestExchangeCardsBadShare(t *testing.T) {
	const n, w = 3, 6
	maxCard := maxCardLen(DefaultMaxFrame, n, w)
	good := encodeCardShare(xCard(1), xItems(1, n, w))
	cases := []struct {
		name  string
		share []byte
		want  error
	}{
		{"truncated vector", good[:len(good)-1], ErrBadFrame},
		{"truncated header", good[:3], ErrBadFrame},
		{"three entries", encodeVector([][]byte{xCard(1), xItems(1, n, w), nil}), ErrBadFrame},
		{"one entry", encodeVector([][]byte{xCard(1)}), ErrBadFrame},
		{"items of a smaller world", encodeCardShare(xCard(1), xItems(1, n-1, w)), ErrBadFrame},
		{"items of a larger world", encodeCardShare(xCard(1), xItems(1, n+1, w)), ErrBadFrame},
		{"items of another size", encodeCardShare(xCard(1), xItems(1, n, w+1)), ErrBadFrame},
		{"no items", encodeCardShare(xCard(1), nil), ErrBadFrame},
		{"oversized card", encodeCardShare(make([]byte, maxCard+1), xItems(1, n, w)), ErrFrameTooLarge},
		{"trailing bytes", append(bytes.Clone(good), 0), ErrBadFrame},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := xRootGets(t, Rendezvous, n, w, tc.share)
			var xe *ExchangeError
			if !errors.Is(err, tc.want) || !errors.As(err, &xe) || xe.Peer != 1 {
				t.Errorf("root: %v, want %v naming peer 1", err, tc.want)
			}
			t.Logf("root: %v", err)
		})
	}
}

// xRootGets runs rank 0 of a card exchange of n ranks and items of w
// bytes in mode, sends it share as rank 1 (in all-to-all mode then
// reading rank 0's own share, as a peer does, if rank 0 sends it) and
// returns rank 0's error.
func xRootGets(t *testing.T, mode Mode, n, w int, share []byte) error {
	t.Helper()
	xNoLeaks(t)
	lns, addrs := xListeners(t, n)
	ctx := xContext(t, time.Minute)
	done := make(chan error, 1)
	go func() {
		c := ExchangeConfig{Rank: 0, Size: n, Mode: mode, Addrs: addrs, Listener: lns[0], Job: "job", Token: []byte("token")}
		_, _, err := ExchangeCards(ctx, c, xCard(0), xItems(0, n, w))
		done <- err
	}()
	fx := xFakeCards(t, mode, 1, n, w)
	k, err := fx.dial(ctx, 0, addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer k.c.Close()
	defer k.stopWatch()
	// The root may stop reading before the end: a share over the
	// largest the world allows is refused as it arrives, and then not
	// answered (all-to-all).
	fx.send(k, share)
	if mode == AllToAll {
		fx.recv(ctx, k)
	}
	return <-done
}

// TestExchangeCardsBadAnswer: a root that authenticates and then answers
// a leaf with a malformed table of cards or column of items makes the
// leaf fail at once, naming the root, with ErrBadFrame or
// ErrFrameTooLarge.
func TestExchangeCardsBadAnswer(t *testing.T) {
	const n, w = 3, 6
	maxCard := maxCardLen(DefaultMaxFrame, n, w)
	table := encodeVector([][]byte{xCard(0), xCard(1), xCard(2)})
	column := make([]byte, n*w)
	cases := []struct {
		name string
		msgs [][]byte
		want error
	}{
		{"truncated table", [][]byte{table[:len(table)-2]}, ErrBadFrame},
		{"table of fewer cards", [][]byte{encodeVector([][]byte{xCard(0), xCard(1)})}, ErrBadFrame},
		{"table of more cards", [][]byte{encodeVector([][]byte{xCard(0), xCard(1), xCard(2), xCard(3)})}, ErrBadFrame},
		{"table with an oversized card", [][]byte{encodeVector([][]byte{xCard(0), make([]byte, maxCard+1), xCard(2)})}, ErrFrameTooLarge},
		{"short column", [][]byte{table, column[:n*w-1]}, ErrBadFrame},
		{"long column", [][]byte{table, append(bytes.Clone(column), 0)}, ErrBadFrame},
		{"empty column", [][]byte{table, nil}, ErrBadFrame},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			xNoLeaks(t)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			ctx := xContext(t, time.Minute)
			done := make(chan error, 1)
			go func() {
				c := ExchangeConfig{Rank: 1, Size: n, Mode: Rendezvous, Root: ln.Addr().String(), Job: "job", Token: []byte("token")}
				_, _, err := ExchangeCards(ctx, c, xCard(1), xItems(1, n, w))
				done <- err
			}()
			c, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			fx := xFakeCards(t, Rendezvous, 0, n, w)
			k, err := fx.accept(ctx, c, nil, nil, func(int) error { return nil })
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fx.recv(ctx, k); err != nil {
				t.Fatal(err)
			}
			for _, m := range tc.msgs {
				if err := fx.send(k, m); err != nil {
					t.Fatal(err)
				}
			}
			err = <-done
			var xe *ExchangeError
			if !errors.Is(err, tc.want) || !errors.As(err, &xe) || xe.Peer != 0 {
				t.Errorf("%v, want %v naming the root", err, tc.want)
			}
			t.Log(err)
		})
	}
}

// TestExchangeCardsAllToAllBadShare: in the all-to-all mode, a peer's
// malformed share fails the exchange naming the peer.
func TestExchangeCardsAllToAllBadShare(t *testing.T) {
	const n, w = 2, 6
	for _, tc := range []struct {
		name  string
		share []byte
		want  error
	}{
		{"two items", encodeCardShare(xCard(1), make([]byte, 2*w)), ErrBadFrame},
		{"truncated", encodeCardShare(xCard(1), make([]byte, w))[:10], ErrBadFrame},
		{"oversized card", encodeCardShare(make([]byte, maxCardLen(DefaultMaxFrame, n, w)+1), make([]byte, w)), ErrFrameTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := xRootGets(t, AllToAll, n, w, tc.share)
			var xe *ExchangeError
			if !errors.Is(err, tc.want) || !errors.As(err, &xe) || xe.Peer != 1 {
				t.Errorf("%v, want %v naming peer 1", err, tc.want)
			}
			t.Log(err)
		})
	}
}

// TestExchangeCardsConfigErrors: bad item sizes and cards or items over
// the frame bound fail at once, before any connection.
func TestExchangeCardsConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name        string
		size        int
		max         int
		card, items int
		want        error
	}{
		{"items not a multiple of the size", 3, 0, 10, 7, nil},
		{"no items", 3, 0, 10, 0, nil},
		{"items of 256 bytes", 2, 0, 10, 512, nil},
		{"card over the bound", 4, 1024, maxCardLen(1024, 4, 6) + 1, 24, ErrFrameTooLarge},
		{"items over the bound", 200, 1024, 0, 1200, ErrFrameTooLarge},
		{"world of 0", 0, 0, 1, 1, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ExchangeConfig{Rank: 0, Size: tc.size, Mode: Rendezvous, Root: "127.0.0.1:1", MaxFrame: tc.max}
			_, _, err := ExchangeCards(context.Background(), c, make([]byte, tc.card), make([]byte, tc.items))
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Errorf("%v, want an error (%v)", err, tc.want)
			}
			t.Log(err)
		})
	}
}

// TestMaxCardLen: a table of cards of maxCardLen bytes, and a share of
// such a card with its items, fit in a message; with cards one byte
// longer, one of them does not.
func TestMaxCardLen(t *testing.T) {
	for _, tc := range []struct{ max, n, w int }{
		{DefaultMaxFrame, 2, 6}, {DefaultMaxFrame, 4096, 6}, {DefaultMaxFrame, 10000, 6},
		{1 << 16, 3, 1}, {1 << 16, 1000, 6}, {4096, 7, 255},
	} {
		l := maxCardLen(tc.max, tc.n, tc.w)
		if l < 0 {
			t.Errorf("%+v: %d", tc, l)
			continue
		}
		cards := make([][]byte, tc.n)
		for i := range cards {
			cards[i] = make([]byte, l)
		}
		table := vectorSize(cards)
		share := vectorSize([][]byte{cards[0], make([]byte, tc.n*tc.w)})
		if table > tc.max || share > tc.max {
			t.Errorf("%+v: card of %d bytes: table %d, share %d bytes", tc, l, table, share)
		}
		for i := range cards {
			cards[i] = make([]byte, l+1)
		}
		if vectorSize(cards) <= tc.max && vectorSize([][]byte{cards[0], make([]byte, tc.n*tc.w)}) <= tc.max {
			t.Errorf("%+v: a card of %d bytes still fits", tc, l+1)
		}
	}
}

// xNodeCard is a well-formed card of rank j of a world of size, with
// endpoint tmpl.
func xNodeCard(t *testing.T, j, size int, tmpl []byte, probe []byte) []byte {
	t.Helper()
	card := append([]byte(cardMagic), nodeVersion)
	card = binary.BigEndian.AppendUint32(card, uint32(j))
	card = binary.BigEndian.AppendUint32(card, uint32(size))
	return append(card, encodeVector([][]byte{tmpl, []byte("barrier"), []byte("data"), probe})...)
}

// TestDecodeCard: a node's card and item decode to the peer's endpoint
// (the card's, with the item's numbers), barrier info, data and probe
// region; malformed cards and items fail with an error naming the rank.
func TestDecodeCard(t *testing.T) {
	ep := verbs.Endpoint{Version: verbs.EndpointVersion, Transport: verbs.TransportRC, LinkLayer: verbs.LinkLayerEthernet,
		Port: 1, GID: verbs.GID{15: 1}, QPN: 99, PSN: 5, MTU: verbs.MTU1024, Addr: []byte("soft0 address")}
	tmpl, err := ep.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	probe := binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, 0x1000), 64)
	probe = binary.BigEndian.AppendUint32(probe, 7)
	item := make([]byte, ItemSize)
	putItem(item, 0xabcdef, 0x123456)
	const j, self, size = 2, 0, 4

	p, err := decodeCard(xNodeCard(t, j, size, tmpl, probe), item, j, self, size)
	if err != nil {
		t.Fatal(err)
	}
	want := ep
	want.QPN, want.PSN = 0xabcdef, 0x123456
	if !sameButNumbers(p.ep, want) || p.ep.QPN != want.QPN || p.ep.PSN != want.PSN || string(p.info) != "barrier" ||
		string(p.data) != "data" || p.probe != (verbs.RemoteRegion{Addr: 0x1000, Len: 64, RKey: 7}) {
		t.Errorf("decoded %+v, want endpoint %+v", p, want)
	}

	good := xNodeCard(t, j, size, tmpl, probe)
	mod := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	zero := make([]byte, ItemSize)
	for _, tc := range []struct {
		name       string
		card, item []byte
		want       string
	}{
		{"empty", nil, item, "not a node's card"},
		{"magic", mod(func(b []byte) []byte { b[0] = 'X'; return b }), item, "not a node's card"},
		{"version 1", mod(func(b []byte) []byte { b[4] = 1; return b }), item, "version 1"},
		{"other rank", xNodeCard(t, 3, size, tmpl, probe), item, "card of rank 3"},
		{"other world", xNodeCard(t, j, size+1, tmpl, probe), item, "world of 5"},
		{"truncated", good[:len(good)-3], item, "malformed"},
		{"trailing byte", append(bytes.Clone(good), 0), item, "malformed"},
		{"short item", good, item[:ItemSize-1], "item of 5 bytes"},
		{"long item", good, append(bytes.Clone(item), 0), "item of 7 bytes"},
		{"zero queue pair number", good, zero, "invalid qpn"},
		{"bad endpoint", xNodeCard(t, j, size, tmpl[:10], probe), item, "endpoint"},
		{"short probe", xNodeCard(t, j, size, tmpl, probe[:19]), item, "probe region of 19 bytes"},
		{"tiny probe region", xNodeCard(t, j, size, tmpl, append(binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, 1), 4), 0, 0, 0, 7)), item, "4 bytes long"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeCard(tc.card, tc.item, j, self, size)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "rank 2's card") {
				t.Errorf("%v, want an error about rank 2's card with %q", err, tc.want)
			}
		})
	}
}

// TestSameButNumbers: endpoints share a card's template when they differ
// in their queue pair and packet sequence numbers only; any other field
// (of the encoding) that differs keeps them apart.
func TestSameButNumbers(t *testing.T) {
	base := verbs.Endpoint{Version: verbs.EndpointVersion, Transport: verbs.TransportRC, LinkLayer: verbs.LinkLayerEthernet,
		Port: 1, GID: verbs.GID{15: 1}, QPN: 99, PSN: 5, MTU: verbs.MTU1024, Addr: []byte("soft0 address")}
	for _, c := range []struct {
		name   string
		change func(e *verbs.Endpoint)
		same   bool
	}{
		{"equal", func(*verbs.Endpoint) {}, true},
		{"numbers", func(e *verbs.Endpoint) { e.QPN, e.PSN = 100, 6 }, true},
		{"port", func(e *verbs.Endpoint) { e.Port = 2 }, false},
		{"gid index", func(e *verbs.Endpoint) { e.GIDIndex = 1 }, false},
		{"gid", func(e *verbs.Endpoint) { e.GID[14] = 1 }, false},
		{"lid", func(e *verbs.Endpoint) { e.LID = 3 }, false},
		{"mtu", func(e *verbs.Endpoint) { e.MTU = verbs.MTU2048 }, false},
		{"qkey", func(e *verbs.Endpoint) { e.QKey = 7 }, false},
		{"link layer", func(e *verbs.Endpoint) { e.LinkLayer = verbs.LinkLayerInfiniBand }, false},
		{"address", func(e *verbs.Endpoint) { e.Addr = []byte("soft0 addresS") }, false},
		{"invalid", func(e *verbs.Endpoint) { e.Version = 0 }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := base
			e.Addr = bytes.Clone(base.Addr)
			c.change(&e)
			if got := sameButNumbers(e, base); got != c.same {
				t.Errorf("sameButNumbers(%+v, %+v) = %v, want %v", e, base, got, c.same)
			}
		})
	}
}
