package collective_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/goverbs/verbs/collective"
)

// TestSmallMessagesOneWrite: a barrier's empty messages and an 8-byte
// allreduce's go as one write each (small.go), without the write of the
// data count that a chunk needs: apart from ack counts (written every
// other message a peer receives without sending back, or before a long
// wait) and the writes of sleeps (a rank descheduled for longer than
// its spin says it sleeps, and is rung: bells.go), the loop posts exactly
// one write per message, and no data count. Before, every message took two writes, its chunk and its data
// count.
func TestSmallMessagesOneWrite(t *testing.T) {
	const calls = 200
	for _, p := range []int{2, 4} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			cs := world(t, p, collective.Options{})
			for _, c := range cs {
				// The counts below are the butterfly's (ranks that
				// outnumber the processors would gather at rank 0).
				collective.SetBarrierGather(c, false)
			}
			type count struct{ total, counts, acks, sleeps uint64 }
			before := make([]count, p)
			for r, c := range cs {
				before[r].total, before[r].counts, before[r].acks = collective.Writes(c)
				before[r].sleeps = collective.SleepWrites(c)
			}
			noErrors(t, "", parallel(p, func(r int) error {
				for i := range calls {
					if err := collective.Barrier(testCtx(t), cs[r]); err != nil {
						return err
					}
					v := []float32{float32(r), 1}
					if err := collective.Allreduce(testCtx(t), cs[r], nil, v, collective.Sum); err != nil {
						return err
					}
					if want := []float32{float32(p * (p - 1) / 2), float32(p)}; v[0] != want[0] || v[1] != want[1] {
						return fmt.Errorf("allreduce %d: %v, want %v", i, v, want)
					}
				}
				return nil
			}))
			// Barriers: ⌈log2 p⌉ messages per rank; allreduce (recursive
			// doubling): log2 p.
			msgs := uint64(0)
			for d := 1; d < p; d <<= 1 {
				msgs++
			}
			msgs *= 2 * calls
			for r, c := range cs {
				total, counts, acks := collective.Writes(c)
				total -= before[r].total
				counts -= before[r].counts
				acks -= before[r].acks
				sleeps := collective.SleepWrites(c) - before[r].sleeps
				t.Logf("rank %d: %d writes for %d messages: %d data counts, %d ack counts, %d of sleeps", r, total, msgs, counts, acks, sleeps)
				if counts != 0 {
					t.Errorf("rank %d: %d data counts written for %d small messages, want 0", r, counts, msgs)
				}
				if total-acks-sleeps != msgs {
					t.Errorf("rank %d: %d writes besides ack counts and sleeps' for %d small messages, want one each", r, total-acks-sleeps, msgs)
				}
			}
		})
	}
}

// TestSmallAfterLarge: small messages use the slots that chunks of
// larger messages used before, whose data may look like the words of a
// small message (here every 8-byte word of the large vectors carries, in
// its high half, a flag a later small message of the slot will carry).
// The results are exact, and between calls the words small messages take
// are clear in every slot (the receiver clears what each chunk left).
func TestSmallAfterLarge(t *testing.T) {
	for _, p := range []int{2, 3} {
		for _, slots := range []int{2, 4} {
			t.Run(fmt.Sprintf("p=%d/slots=%d", p, slots), func(t *testing.T) {
				cs := world(t, p, collective.Options{ChunkSize: 256, Slots: slots})
				noErrors(t, "", parallel(p, func(r int) error {
					for i := range 60 {
						// Sizes: small (up to 256 bytes: one chunk),
						// chunked, and empty.
						n := []int{1, 32, 33, 200, 0, 4}[i%6]
						v := make([]uint64, n)
						for j := range v {
							// The flags of chunks i..i+8, and this rank.
							v[j] = uint64(i+j%8+1)<<32 | uint64(1)<<r
						}
						if err := collective.Allreduce(testCtx(t), cs[r], nil, v, collective.Or); err != nil {
							return fmt.Errorf("allreduce %d (%d elements): %w", i, n, err)
						}
						for j, x := range v {
							if want := uint64(i+j%8+1)<<32 | uint64(1)<<p - 1; x != want {
								return fmt.Errorf("allreduce %d (%d elements): element %d is %#x, want %#x", i, n, j, x, want)
							}
						}
						if err := collective.Barrier(testCtx(t), cs[r]); err != nil {
							return err
						}
					}
					return nil
				}))
				// Every call has ended everywhere (the last barrier): no
				// chunk is left unconsumed.
				noErrors(t, "", parallel(p, func(r int) error { return collective.Barrier(testCtx(t), cs[r]) }))
				for r, c := range cs {
					if !collective.SmallWordsClear(c) {
						t.Errorf("rank %d: words of small messages left in its slots", r)
					}
				}
			})
		}
	}
}

// TestSmallLargeMismatch: a rank that sends a small message (one write
// of LL words) to a rank that expects a larger one, and the other way
// round, both report the mismatch of lengths, not a corrupted window or
// a hang.
func TestSmallLargeMismatch(t *testing.T) {
	for _, counts := range [][2]int{{2, collective.LLMax}, {collective.LLMax / 8, collective.LLMax/8 + 1}} {
		t.Run(fmt.Sprintf("%d/%d", counts[0], counts[1]), func(t *testing.T) {
			cs := world(t, 2, collective.Options{})
			errs := parallel(2, func(r int) error {
				return collective.Allreduce(context.Background(), cs[r], nil, make([]int64, counts[r]), collective.Sum)
			})
			for r, err := range errs {
				if !errors.Is(err, collective.ErrMismatch) {
					t.Errorf("rank %d: %v, want ErrMismatch", r, err)
				}
				t.Logf("rank %d: %v", r, err)
			}
		})
	}
}
