package cluster_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
)

// startupCards returns, for a world of n ranks seen by rank 0, what
// ExchangeCards would give it: the card of every rank and the column of
// items for rank 0. Rank 0's own card is card0; the cards of the other
// ranks are copies of the card of a rank-1 node of this process (built
// in pd, closed before return) whose queue pairs' address names another
// process for each rank (a fabric id of its own), as the ranks of a
// world on one host are: connecting to them makes soft0 route to a
// peer process, which it dials only at the first request, never here.
func startupCards(tb testing.TB, pd *verbs.ProtectionDomain, n int, card0 []byte, items0 []byte) ([][]byte, []byte) {
	tb.Helper()
	other, err := cluster.NewNode(pd, 1, n, cluster.NodeOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	defer other.Close()
	card, items, err := other.LocalCard(nil)
	if err != nil {
		tb.Fatal(err)
	}
	eps, err := other.Channel().Endpoints()
	if err != nil {
		tb.Fatal(err)
	}
	addr := eps[0].Addr
	at := bytes.Index(card, addr)
	if at < 0 || len(addr) < 10 {
		tb.Fatalf("the card does not hold the endpoint's address")
	}
	bi := bytes.Index(card, []byte("GVBR")) // the barrier's flag description
	if bi < 0 {
		tb.Fatalf("the card does not hold the barrier's description")
	}
	cards := make([][]byte, n)
	column := make([]byte, n*cluster.ItemSize)
	cards[0] = card0
	copy(column, items0[:cluster.ItemSize])
	for j := 1; j < n; j++ {
		c := bytes.Clone(card)
		binary.BigEndian.PutUint32(c[5:], uint32(j))                           // the card's rank
		binary.LittleEndian.PutUint64(c[at+2:], 0x5eed0000_00000000|uint64(j)) // another process per rank
		binary.LittleEndian.PutUint32(c[bi+8:], uint32(j))                     // the barrier's rank
		cards[j] = c
		copy(column[j*cluster.ItemSize:], items[0:cluster.ItemSize]) // a valid QPN and PSN
	}
	return cards, column
}

// BenchmarkNodeStartup measures what one rank of a world of N ranks
// spends building its node (NewNode), describing it (LocalCard),
// connecting it to the N−1 others (ConnectCards) and closing it, in one
// process on soft0: the per-peer part of a rank's start-up (see the
// package documentation, Scale). It reports the time of each phase per
// peer (ns/peer-new, ns/peer-card, ns/peer-connect, ns/peer-close) and
// the allocations per peer of NewNode and ConnectCards together:
//
//	go test -run '^$' -bench NodeStartup -benchtime 20x ./cluster/
func BenchmarkNodeStartup(b *testing.B) {
	for _, n := range []int{64, 256, 512} {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			dev, err := verbs.Open(verbs.SoftDevice)
			if err != nil {
				b.Fatal(err)
			}
			defer dev.Close()
			pd, err := dev.AllocPD()
			if err != nil {
				b.Fatal(err)
			}
			defer pd.Close()
			var cards [][]byte
			var column []byte
			var tNew, tCard, tConn, tClose time.Duration
			var allocs uint64
			peers := float64(n - 1)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				if i == 0 {
					// The other ranks' cards, once (their queue pair
					// numbers do not matter: nothing is sent).
					nd, err := cluster.NewNode(pd, 0, n, cluster.NodeOptions{})
					if err != nil {
						b.Fatal(err)
					}
					c0, it0, err := nd.LocalCard(nil)
					if err != nil {
						b.Fatal(err)
					}
					cards, column = startupCards(b, pd, n, c0, it0)
					nd.Close()
				}
				m0 := mallocs()
				b.StartTimer()
				t0 := time.Now()
				nd, err := cluster.NewNode(pd, 0, n, cluster.NodeOptions{})
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				c0, _, err := nd.LocalCard(nil)
				if err != nil {
					b.Fatal(err)
				}
				cards[0] = c0
				t2 := time.Now()
				if err := nd.ConnectCards(cards, column); err != nil {
					b.Fatal(err)
				}
				t3 := time.Now()
				allocs += mallocs() - m0
				if err := nd.Close(); err != nil {
					b.Fatal(err)
				}
				t4 := time.Now()
				tNew += t1.Sub(t0)
				tCard += t2.Sub(t1)
				tConn += t3.Sub(t2)
				tClose += t4.Sub(t3)
			}
			b.StopTimer()
			per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N) / peers }
			b.ReportMetric(per(tNew), "ns/peer-new")
			b.ReportMetric(per(tCard), "ns/peer-card")
			b.ReportMetric(per(tConn), "ns/peer-connect")
			b.ReportMetric(per(tClose), "ns/peer-close")
			b.ReportMetric(float64(allocs)/float64(b.N)/peers, "allocs/peer-start")
		})
	}
}

// mallocs returns the number of heap allocations made so far.
func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}
