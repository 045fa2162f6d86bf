package collective_test

import (
	"context"
	"fmt"
	"log"
	"sync"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/cluster"
	"github.com/goverbs/verbs/collective"
)

// exampleWorld connects n ranks in this process over soft0 and runs f on
// each, in its own goroutine, with its communicator. A real program has
// one rank per process and gets its node from cluster.FromEnv or
// cluster.Join.
func exampleWorld(n int, f func(c *collective.Comm) error) error {
	ctx := context.Background()
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
			c, err := collective.New(ctx, nodes[i], collective.Options{})
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

// Four ranks average their gradients: every rank ends with the same
// mean.
func ExampleAllreduce() {
	var mu sync.Mutex
	results := make([][]float32, 4)
	err := exampleWorld(4, func(c *collective.Comm) error {
		r := float32(c.Rank())
		grad := []float32{r, 2 * r, 10}
		if err := collective.Allreduce(context.Background(), c, nil, grad, collective.Sum); err != nil {
			return err
		}
		for i := range grad {
			grad[i] /= float32(c.Size())
		}
		mu.Lock()
		results[c.Rank()] = grad
		mu.Unlock()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	for r, g := range results {
		fmt.Println("rank", r, g)
	}
	// Output:
	// rank 0 [1.5 3 10]
	// rank 1 [1.5 3 10]
	// rank 2 [1.5 3 10]
	// rank 3 [1.5 3 10]
}

// Split groups the even and the odd ranks; each group reduces on its own.
func ExampleComm_Split() {
	var mu sync.Mutex
	sums := make([]int64, 6)
	err := exampleWorld(6, func(c *collective.Comm) error {
		ctx := context.Background()
		sub, err := c.Split(ctx, c.Rank()%2, c.Rank())
		if err != nil {
			return err
		}
		defer sub.Close()
		v := []int64{int64(c.Rank())}
		if err := collective.Allreduce(ctx, sub, nil, v, collective.Sum); err != nil {
			return err
		}
		mu.Lock()
		sums[c.Rank()] = v[0]
		mu.Unlock()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(sums)
	// Output:
	// [6 9 6 9 6 9]
}

// Two ranks sum a vector kept in registered memory: its chunks are sent
// from the Buffer itself, without the copy into the staging slots.
func ExampleAlloc() {
	var mu sync.Mutex
	sums := make([]float64, 2)
	err := exampleWorld(2, func(c *collective.Comm) error {
		b, err := collective.Alloc[float64](c, 1<<17) // 1 MiB
		if err != nil {
			return err
		}
		defer b.Close()
		v := b.Slice()
		for i := range v {
			v[i] = float64(c.Rank() + 1)
		}
		if err := collective.Allreduce(context.Background(), c, nil, v, collective.Sum); err != nil {
			return err
		}
		mu.Lock()
		sums[c.Rank()] = v[0] + v[len(v)-1]
		mu.Unlock()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(sums)
	// Output:
	// [6 6]
}
