package collective_test

import (
	"context"
	"fmt"

	"github.com/goverbs/verbs/collective"
)

// inProcessRanks is exampleWorld: n ranks in this process.
func inProcessRanks(n int, f func(c *collective.Comm) error) error { return exampleWorld(n, f) }

// Three ranks transpose a 3×3 matrix distributed by rows: rank r holds
// row r, sends element j to rank j and ends with column r.
func ExampleAlltoall() {
	cols := make([][]int32, 3)
	err := inProcessRanks(3, func(c *collective.Comm) error {
		r := int32(c.Rank())
		row := []int32{10*r + 0, 10*r + 1, 10*r + 2}
		col := make([]int32, 3)
		if err := collective.Alltoall(context.Background(), c, row, col); err != nil {
			return err
		}
		cols[r] = col
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for r, col := range cols {
		fmt.Printf("rank %d: %v\n", r, col)
	}
	// Output:
	// rank 0: [0 10 20]
	// rank 1: [1 11 21]
	// rank 2: [2 12 22]
}

// Four ranks each count their items; an exclusive scan gives each rank
// where its items start in the concatenation of all ranks', an inclusive
// scan where they end.
func ExampleExScan() {
	counts := []int64{3, 0, 5, 2}
	starts, ends := make([]int64, 4), make([]int64, 4)
	err := inProcessRanks(4, func(c *collective.Comm) error {
		r := c.Rank()
		start := []int64{0} // rank 0's is left untouched: 0
		if err := collective.ExScan(context.Background(), c, counts[r:r+1], start, collective.Sum); err != nil {
			return err
		}
		end := []int64{0}
		if err := collective.Scan(context.Background(), c, counts[r:r+1], end, collective.Sum); err != nil {
			return err
		}
		starts[r], ends[r] = start[0], end[0]
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for r := range 4 {
		fmt.Printf("rank %d: items %d to %d\n", r, starts[r], ends[r])
	}
	// Output:
	// rank 0: items 0 to 3
	// rank 1: items 3 to 3
	// rank 2: items 3 to 8
	// rank 3: items 8 to 10
}
