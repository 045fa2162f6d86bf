package cluster_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"sync"
	"time"

	"github.com/goverbs/verbs/cluster"
)

// Two ranks, here goroutines of one process, join a world described by a
// network configuration, exchange endpoints over loopback TCP and meet in
// a barrier. In a real job each rank is a process on its own host,
// running cluster.Join(ctx, cfg, rank, opts) with its own rank.
func ExampleJoin() {
	const n = 2
	cfg := &cluster.Config{}
	lns := make([]net.Listener, n)
	for r := range n {
		// Every rank listens on its configured address; the example
		// lets the system pick free ports.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			log.Fatal(err)
		}
		lns[r] = ln
		cfg.Hosts = append(cfg.Hosts, cluster.Host{Hostname: "127.0.0.1", Port: ln.Addr().(*net.TCPAddr).Port, Device: "soft0", Rank: r})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	nodes := make([]*cluster.Node, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			node, err := cluster.Join(ctx, cfg, r, cluster.JoinOptions{
				Job: "example", Token: []byte("shared secret"), Listener: lns[r],
				Prepare: func(*cluster.Node) ([]byte, error) { return fmt.Appendf(nil, "hello from rank %d", r), nil },
			})
			if err != nil {
				log.Fatal(err)
			}
			if err := node.Barrier(ctx, nil); err != nil {
				log.Fatal(err)
			}
			nodes[r] = node
		}()
	}
	wg.Wait()
	for _, node := range nodes {
		peer := 1 - node.Rank()
		fmt.Printf("rank %d of %d: %s\n", node.Rank(), node.Size(), node.PeerData(peer))
		node.Close()
	}
	// Output:
	// rank 0 of 2: hello from rank 1
	// rank 1 of 2: hello from rank 0
}

// Ranks, world size and rank 0's address come from the launcher's
// environment; here a torchrun-style one, injected.
func ExampleParseLaunch() {
	env := map[string]string{"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
	l, err := cluster.ParseLaunch(cluster.EnvOptions{Lookup: func(k string) (string, bool) { v, ok := env[k]; return v, ok }})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(l.Launcher, l.Rank, l.Size, l.LocalRank, l.Root)
	// Output: torchrun 3 8 1 10.0.0.1:29500
}

func ExampleExpandNodeList() {
	hosts, err := cluster.ExpandNodeList("node[01-03,07],login")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(hosts)
	// Output: [node01 node02 node03 node07 login]
}

func ExampleParseConfig() {
	_, err := cluster.ParseConfig([]byte(`{"hosts":[
		{"hostname":"node1","port":18515,"rank":0},
		{"hostname":"node2","port":18515,"rank":2}]}`))
	fmt.Println(err)
	// Output: cluster: config: ranks are not contiguous: rank 2 where 1 was expected (hosts must be listed in rank order) (hosts[1])
}
