package spinwait

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BenchmarkFloorBarrier is the floor of a barrier between processes of
// one machine that wait as the ranks of package collective and cluster
// do when they outnumber the processors: p processes (GOMAXPROCS=1 each)
// run a dissemination barrier over a plain shared page, each looking at
// its flag and pausing (Policy.Pause with Yield: the Go scheduler, then
// sched_yield) until it is set. No transport, no queue pair, no
// completion: what is left is the context switches. Compare with
// goverbs coll -p P -ops barrier, run at the same moment (README).
func BenchmarkFloorBarrier(b *testing.B) {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range []int{2, 4, 8} {
		b.Run(fmt.Sprintf("p=%d", p), func(b *testing.B) {
			f, err := os.CreateTemp("", "floor")
			if err != nil {
				b.Fatal(err)
			}
			defer os.Remove(f.Name())
			defer f.Close()
			if err := f.Truncate(floorBytes); err != nil {
				b.Fatal(err)
			}
			var kids []*exec.Cmd
			for r := 1; r < p; r++ {
				c := exec.Command(exe)
				c.Env = append(os.Environ(), "GOMAXPROCS=1",
					fmt.Sprintf("%s=%d,%d,%d,%s", floorEnv, r, p, b.N, f.Name()))
				c.Stdout, c.Stderr = os.Stderr, os.Stderr
				if err := c.Start(); err != nil {
					b.Fatal(err)
				}
				kids = append(kids, c)
			}
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
			fl, err := openFloor(f.Name(), 0, p)
			if err != nil {
				b.Fatal(err)
			}
			defer fl.close()
			// A process that fails ends the run (the abort word), not
			// a barrier that waits for it forever.
			errs := make(chan error, len(kids))
			for _, c := range kids {
				go func() {
					err := c.Wait()
					if err != nil {
						atomic.StoreUint64(fl.abort(), 1)
					}
					errs <- err
				}()
			}
			ok := fl.barrier() // every process is up
			b.ResetTimer()
			for i := 0; i < b.N && ok; i++ {
				ok = fl.barrier()
			}
			b.StopTimer()
			for range kids {
				if err := <-errs; err != nil {
					b.Fatal(err)
				}
			}
			if !ok {
				b.Fatal("aborted")
			}
		})
	}
}

// floorEnv makes the test binary a process of BenchmarkFloorBarrier:
// "rank,p,iterations,path".
const floorEnv = "GOVERBS_FLOOR_CHILD"

// floorBytes holds a cache line per flag: rank × round.
const floorBytes = 64*64*32 + 64 // and the abort word

func TestMain(m *testing.M) {
	if v := os.Getenv(floorEnv); v != "" {
		if err := floorChild(v); err != nil {
			fmt.Fprintln(os.Stderr, "floor process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func floorChild(v string) error {
	f := strings.SplitN(v, ",", 4)
	if len(f) != 4 {
		return fmt.Errorf("%s=%q", floorEnv, v)
	}
	var n [3]int
	for i := range n {
		var err error
		if n[i], err = strconv.Atoi(f[i]); err != nil {
			return err
		}
	}
	fl, err := openFloor(f[3], n[0], n[1])
	if err != nil {
		return err
	}
	defer fl.close()
	for range n[2] + 1 {
		if !fl.barrier() {
			return fmt.Errorf("aborted")
		}
	}
	return nil
}

// floor is one process of BenchmarkFloorBarrier.
type floor struct {
	mem         []byte
	rank, p     int
	epoch       uint64
	pause       Policy
	roundsCount int
}

func openFloor(path string, rank, p int) (*floor, error) {
	fd, err := unix.Open(path, unix.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	mem, err := unix.Mmap(fd, 0, floorBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	fl := &floor{mem: mem, rank: rank, p: p, pause: Policy{Yield: true}}
	for 1<<fl.roundsCount < p {
		fl.roundsCount++
	}
	return fl, nil
}

func (fl *floor) close() { unix.Munmap(fl.mem) }

// flag is the word that rank's round-k signal sets.
func (fl *floor) flag(rank, k int) *uint64 {
	return (*uint64)(unsafe.Pointer(&fl.mem[(rank*32+k)*64]))
}

// abort is the word that ends every process's barriers.
func (fl *floor) abort() *uint64 { return (*uint64)(unsafe.Pointer(&fl.mem[floorBytes-64])) }

// barrier: in round k, signal rank+2^k, wait for rank−2^k. It reports
// false if the run was aborted.
func (fl *floor) barrier() bool {
	fl.epoch++
	for k := range fl.roundsCount {
		atomic.StoreUint64(fl.flag((fl.rank+1<<k)%fl.p, k), fl.epoch)
		for atomic.LoadUint64(fl.flag(fl.rank, k)) < fl.epoch {
			if atomic.LoadUint64(fl.abort()) != 0 {
				return false
			}
			fl.pause.Pause()
		}
	}
	return true
}
