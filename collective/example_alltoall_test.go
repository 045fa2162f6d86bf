package collective_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// inProcessRanks connects n ranks in this process over soft0 and runs f
// on each, in its own goroutine, with its communicator. A real program
// has one rank per process and gets its node from cluster.FromEnv or
// cluster.Join.
func inProcessRanks(n int, f func(c *collective.Comm) error) error {
	nodes := make([]*cluster.Node, n)
	for i := range n {
		dev, err := verbs.Open(verbs.SoftDevice)
		if err != nil {
			return err
		}
		defer dev.Close()
		pd, err := dev.AllocPD()
		if err != nil {
			return err
		}
		defer pd.Close()
		if nodes[i], err = cluster.NewNode(pd, i, n, cluster.NodeOptions{}); err != nil {
			return err
		}
		defer nodes[i].Close()
	}
	out := make([][][]byte, n)
	for i, nd := range nodes {
		var err error
		if out[i], err = nd.LocalEndpoints(nil); err != nil {
			return err
		}
	}
	for i, nd := range nodes {
		in := make([][]byte, n)
		for j := range n {
			in[j] = out[j][i]
		}
		if err := nd.Connect(in); err != nil {
			return err
		}
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := collective.New(context.Background(), nodes[i], collective.Options{})
			if err != nil {
				errs[i] = err
				return
			}
			defer c.Close()
			errs[i] = f(c)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

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
