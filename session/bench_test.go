package session

import (
	"context"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// BenchmarkPingPong is an 8-byte message round trip: Send, the peer's
// Receive and Send back, Receive — on a session and, as its baseline,
// on bare channels (Send with a receive posted ahead, as a session
// does), in this process.
func BenchmarkPingPong(b *testing.B) {
	b.Run("session", func(b *testing.B) {
		a, c := pair(b, Config{})
		ctx := context.Background()
		go func() {
			for {
				m, err := c.Receive(ctx)
				if err != nil {
					return
				}
				m.Release()
				if c.Send(ctx, make8) != nil {
					return
				}
			}
		}()
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if err := a.Send(ctx, make8); err != nil {
				b.Fatal(err)
			}
			m, err := a.Receive(ctx)
			if err != nil {
				b.Fatal(err)
			}
			m.Release()
		}
	})
	b.Run("channel", func(b *testing.B) {
		x, y, bx, by := channelPair(b)
		ctx := context.Background()
		go func() {
			for {
				h, err := y.PostReceive(by.All())
				if err != nil {
					return
				}
				if h.Wait(ctx) != nil || h.Err() != nil {
					return
				}
				h.Release()
				if y.Send(ctx, by.All()) != nil {
					return
				}
			}
		}()
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			h, err := x.PostReceive(bx.All())
			if err != nil {
				b.Fatal(err)
			}
			if err := x.Send(ctx, bx.All()); err != nil {
				b.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil || h.Err() != nil {
				b.Fatal(err, h.Err())
			}
			h.Release()
		}
	})
}

var make8 = make([]byte, 8)

func channelPair(b *testing.B) (x, y *channel.Channel, bx, by *verbs.MemoryRegion) {
	dev, err := verbs.Open("soft0")
	if err != nil {
		b.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		b.Fatal(err)
	}
	if x, err = channel.New(pd, channel.Options{}); err != nil {
		b.Fatal(err)
	}
	if y, err = channel.New(pd, channel.Options{}); err != nil {
		b.Fatal(err)
	}
	ex, _ := x.Endpoint()
	ey, _ := y.Endpoint()
	if err := x.Connect(ey); err != nil {
		b.Fatal(err)
	}
	if err := y.Connect(ex); err != nil {
		b.Fatal(err)
	}
	bx, _ = pd.Alloc(8, verbs.AccessLocalWrite)
	by, _ = pd.Alloc(8, verbs.AccessLocalWrite)
	b.Cleanup(func() {
		x.Close()
		y.Close()
		bx.Close()
		by.Close()
		pd.Close()
		dev.Close()
	})
	return x, y, bx, by
}
