// Command kv is a key-value store over goverbs sessions: the server keeps
// a hash table in registered memory and grants every client read access
// to it; a client GETs by one-sided RDMA reads (the key's bucket, then
// the entry it points to: two dependent reads, no server CPU) and PUTs by
// messages, which the server applies.
//
// Run a server and a client, each in its own process (or host):
//
//	go build -o kv ./examples/kv
//	./kv -serve 127.0.0.1:7070 &
//	sleep 1 # the client does not retry: let the server listen first
//	./kv -connect 127.0.0.1:7070 -keys 1000
//
// The client PUTs -keys keys, GETs each back and checks it, then
// measures: the latency of one 16-byte RDMA read of the table (the
// baseline) and of GETs, and prints their medians and ratio:
//
//	kv: connected to 127.0.0.1:7070 over soft0/shm
//	kv: 1000 puts, 1000 gets checked
//	kv: read p50 4.1 µs, get p50 8.3 µs (2.02 × read), 20000 each
//
// Flags: -token (or GOVERBS_TOKEN) which both must share; -buckets (at
// most 2^24) and -heap (at most 4 GiB) size the server's table; -n the
// GETs measured; -timeout, the bound of a client's run (default 5
// minutes; 0: none) and, only when given, of a server's: otherwise a
// server serves until it is stopped.
//
// Table layout (little endian), granted read-only to every client:
//
//	index: buckets × 64 bytes, a bucket of 4 slots of 16 bytes: [0:8]
//	       heap offset of the entry + 1 (0: empty), [8:12] entry
//	       length, [12:16] key hash
//	heap:  entries: [0:2] key length, [2:6] value length, [6:10] CRC-32
//	       (Castagnoli) of key and value, [10:12] zero, key, value
//
// A PUT appends an entry to the heap and then points a slot at it: the
// key's own, or the first empty one of its home bucket (the hash picks
// it), else of the buckets after it (linear probing, bucket by bucket).
// A GET reads the whole bucket, one cache line, in one read: a bucket of
// a single slot made a key whose home slot another key held cost a third
// read, 19 % of the GETs at a quarter full (1000 keys in 4096 slots),
// which moved the median GET from 2.0 to 2.2-2.4 reads' time; with 4
// slots a bucket overflows only if 5 of the keys hash to it. A GET that
// reads a slot being changed finds an entry that does not check (length
// or CRC) and reads again.
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"hash/fnv"
	"io"
	"os"
	"strconv"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/session"
)

const (
	slotSize   = 16
	slots      = 4 // per bucket
	bucketSize = slots * slotSize
	// The largest table: bucket numbers are hashed into 32 bits, and the
	// heap's offsets fit the table's region with room to spare.
	maxBuckets = 1 << 24
	maxHeap    = 1 << 32
	entryHdr   = 12
	maxProbe   = 4 // buckets
	maxKey     = 256
	maxValue   = 4096
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// hashKey returns the key's hash as stored in its bucket (never 0, the
// mark of an empty bucket) and the bucket its probe starts at.
func hashKey(k []byte, buckets int) (h uint32, home int) {
	f := fnv.New32a()
	f.Write(k)
	s := f.Sum32()
	// The home bucket from the whole hash: one from the stored value,
	// always odd, left every even bucket to collisions.
	return s | 1, int(s % uint32(buckets))
}

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

// options are what the flags say.
type options struct {
	serve, connect, token  string
	buckets, heap, keys, n int
	// timeout bounds the run; 0: no bound. -timeout bounds a client's
	// run, and a server's only when given: a server keeps serving until
	// it is stopped. Before, the default (5 minutes) bounded a server
	// too, which then quietly exited 0 (TestServerTimeout).
	timeout time.Duration
}

// defaultTimeout is -timeout's default, the bound of a client's run.
const defaultTimeout = 5 * time.Minute

// parseArgs parses the command line; on a usage error it returns false.
func parseArgs(args []string, stderr io.Writer) (options, bool) {
	fs := flag.NewFlagSet("kv", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.serve, "serve", "", "serve on this address (host:port)")
	fs.StringVar(&o.connect, "connect", "", "connect to the server at this address")
	fs.StringVar(&o.token, "token", os.Getenv("GOVERBS_TOKEN"), "shared secret")
	fs.IntVar(&o.buckets, "buckets", 1<<14, "buckets (of 4 keys) of the server's table")
	fs.IntVar(&o.heap, "heap", 64<<20, "bytes of the server's heap")
	fs.IntVar(&o.keys, "keys", 1000, "keys the client puts and checks")
	fs.IntVar(&o.n, "n", 20000, "GETs (and single reads) the client measures")
	fs.DurationVar(&o.timeout, "timeout", defaultTimeout, "bound on a client's whole run, and on a server's if given (otherwise it serves until stopped); 0: none")
	if err := fs.Parse(args); err != nil {
		return o, false
	}
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "timeout" })
	if o.serve != "" && !given || o.timeout < 0 {
		o.timeout = 0
	}
	return o, true
}

// run runs the command with args; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, ok := parseArgs(args, stderr)
	if !ok {
		return 2
	}
	if o.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}
	cfg := session.Config{Token: []byte(o.token)}
	var err error
	switch {
	case o.serve != "" && (o.buckets > maxBuckets || o.heap > maxHeap):
		// Bounded so that the table's size cannot wrap: before, a huge
		// -buckets made a table of a few bytes that the first client's
		// PUTs indexed past (the server panicked: TestServerSizeBounds).
		fmt.Fprintf(stderr, "kv: -buckets is at most %d and -heap at most %d bytes\n", maxBuckets, maxHeap)
		return 2
	case o.serve != "" && o.connect == "" && o.buckets > 0 && o.heap > 0:
		err = runServer(ctx, o.serve, cfg, o.buckets, o.heap, stdout, stderr)
	case o.connect != "" && o.serve == "" && o.keys >= 0 && o.n > 0:
		err = runClient(ctx, o.connect, cfg, o.keys, o.n, stdout)
	default:
		fmt.Fprintln(stderr, "kv: give -serve ADDR or -connect ADDR (and positive sizes)")
		return 2
	}
	if err != nil {
		fmt.Fprintln(stderr, "kv:", err)
		return 1
	}
	return 0
}

// printable returns a peer's text as it is if it is printable, else
// quoted: control characters (terminal escape sequences) from a hostile
// server must not reach the user's terminal.
func printable(b []byte) string {
	for _, r := range string(b) {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return strconv.Quote(string(b))
		}
	}
	return string(b)
}

// table is the server's store.
type table struct {
	mu      sync.Mutex
	mr      *verbs.MemoryRegion
	buckets int
	next    int // the heap's next free byte
}

func (t *table) index() []byte { return t.mr.Bytes()[:t.buckets*bucketSize] }
func (t *table) heap() []byte  { return t.mr.Bytes()[t.buckets*bucketSize:] }

// put stores key = value.
func (t *table) put(key, value []byte) error {
	if len(key) == 0 || len(key) > maxKey || len(value) > maxValue {
		return fmt.Errorf("key of %d bytes or value of %d (at most %d and %d)", len(key), len(value), maxKey, maxValue)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	size := entryHdr + len(key) + len(value)
	heap := t.heap()
	if t.next+size > len(heap) {
		return errors.New("the heap is full")
	}
	h, home := hashKey(key, t.buckets)
	idx := t.index()
	b := -1 // the slot
probe:
	for p := range maxProbe {
		i := (home + p) % t.buckets
		for j := range slots {
			e := idx[i*bucketSize+j*slotSize:]
			off := binary.LittleEndian.Uint64(e)
			if off == 0 {
				b = i*slots + j
				break probe
			}
			if binary.LittleEndian.Uint32(e[12:]) == h {
				ent := heap[off-1:]
				kl := int(binary.LittleEndian.Uint16(ent))
				if string(ent[entryHdr:entryHdr+kl]) == string(key) {
					b = i*slots + j
					break probe
				}
			}
		}
	}
	if b < 0 {
		return fmt.Errorf("no free slot within %d buckets of the key's", maxProbe)
	}
	ent := heap[t.next : t.next+size]
	binary.LittleEndian.PutUint16(ent, uint16(len(key)))
	binary.LittleEndian.PutUint32(ent[2:], uint32(len(value)))
	binary.LittleEndian.PutUint16(ent[10:], 0)
	copy(ent[entryHdr:], key)
	copy(ent[entryHdr+len(key):], value)
	binary.LittleEndian.PutUint32(ent[6:], crc32.Checksum(ent[entryHdr:], castagnoli))
	e := idx[b*slotSize:]
	binary.LittleEndian.PutUint32(e[12:], h)
	binary.LittleEndian.PutUint32(e[8:], uint32(size))
	binary.LittleEndian.PutUint64(e, uint64(t.next)+1)
	t.next += size
	return nil
}

func runServer(ctx context.Context, addr string, cfg session.Config, buckets, heap int, stdout, stderr io.Writer) error {
	dev, err := verbs.Open("")
	if err != nil {
		return err
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		return err
	}
	defer pd.Close()
	mr, err := pd.Alloc(buckets*bucketSize+heap, verbs.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer mr.Close()
	t := &table{mr: mr, buckets: buckets}
	l, err := session.Listen(ctx, addr, cfg)
	if err != nil {
		return err
	}
	defer l.Close()
	fmt.Fprintf(stdout, "kv: serving on %s\n", l.Addr())
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		s, err := l.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.Close()
			if err := serveClient(ctx, s, t); err != nil && !errors.Is(err, session.ErrPeerClosed) {
				fmt.Fprintf(stderr, "kv: client %s: %v\n", s.RemoteAddr(), err)
			}
		}()
	}
}

// serveClient grants the table and applies the client's PUTs: messages
// [0:2] key length, key, value; the answer is empty (done) or an error
// text.
func serveClient(ctx context.Context, s *session.Session, t *table) error {
	if _, err := s.SendRegion(ctx, t.mr, 0, len(t.mr.Bytes()), verbs.AccessRemoteRead, 24*time.Hour); err != nil {
		return err
	}
	if err := s.Send(ctx, binary.LittleEndian.AppendUint32(nil, uint32(t.buckets))); err != nil {
		return err
	}
	for {
		m, err := s.Receive(ctx)
		if err != nil {
			return err
		}
		b := m.Bytes()
		var perr error
		if len(b) < 2 || int(binary.LittleEndian.Uint16(b))+2 > len(b) {
			perr = errors.New("malformed put")
		} else {
			kl := int(binary.LittleEndian.Uint16(b))
			perr = t.put(b[2:2+kl], b[2+kl:])
		}
		m.Release()
		var answer []byte
		if perr != nil {
			answer = []byte(perr.Error())
		}
		if err := s.Send(ctx, answer); err != nil {
			return err
		}
	}
}

// client GETs with RDMA reads of the granted table.
type client struct {
	s       *session.Session
	table   *session.RemoteMR
	buckets int
	bucket  session.LocalSlice // bucketSize bytes
	entry   session.LocalSlice // the largest entry
}

func runClient(ctx context.Context, addr string, cfg session.Config, keys, n int, stdout io.Writer) error {
	s, err := session.Dial(ctx, addr, cfg)
	if err != nil {
		return err
	}
	defer s.Close()
	fmt.Fprintf(stdout, "kv: connected to %s over %s\n", addr, s.Transport())
	c, err := newClient(ctx, s)
	if err != nil {
		return err
	}
	for i := range keys {
		if err := c.put(ctx, fmt.Appendf(nil, "key-%d", i), fmt.Appendf(nil, "value of key %d", i)); err != nil {
			return err
		}
	}
	for i := range keys {
		v, ok, err := c.get(ctx, fmt.Appendf(nil, "key-%d", i))
		if err != nil {
			return err
		}
		if want := fmt.Sprintf("value of key %d", i); !ok || string(v) != want {
			return fmt.Errorf("get key-%d: %q (found %v), want %q", i, v, ok, want)
		}
	}
	if _, ok, err := c.get(ctx, []byte("no such key")); err != nil || ok {
		return fmt.Errorf("get of a missing key: found %v, %v", ok, err)
	}
	fmt.Fprintf(stdout, "kv: %d puts, %d gets checked\n", keys, keys)
	read, get, err := c.measure(ctx, n, keys)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "kv: read p50 %.1f µs, get p50 %.1f µs (%.2f × read), %d each\n", read, get, get/read, n)
	return nil
}

func newClient(ctx context.Context, s *session.Session) (*client, error) {
	t, err := s.ReceiveRemoteMR(ctx)
	if err != nil {
		return nil, err
	}
	m, err := s.Receive(ctx)
	if err != nil {
		return nil, err
	}
	if m.Len() != 4 {
		m.Release()
		return nil, fmt.Errorf("server's hello of %d bytes", m.Len())
	}
	buckets := int(binary.LittleEndian.Uint32(m.Bytes()))
	m.Release()
	if buckets <= 0 || buckets*bucketSize > t.Len() {
		return nil, fmt.Errorf("server says %d buckets in a table of %d bytes", buckets, t.Len())
	}
	mem, err := s.Alloc(bucketSize + entryHdr + maxKey + maxValue)
	if err != nil {
		return nil, err
	}
	c := &client{s: s, table: t, buckets: buckets}
	c.bucket, _ = mem.Slice(0, bucketSize)
	c.entry, _ = mem.Slice(bucketSize, entryHdr+maxKey+maxValue)
	return c, nil
}

func (c *client) put(ctx context.Context, key, value []byte) error {
	msg := binary.LittleEndian.AppendUint16(nil, uint16(len(key)))
	msg = append(append(msg, key...), value...)
	if err := c.s.Send(ctx, msg); err != nil {
		return err
	}
	m, err := c.s.Receive(ctx)
	if err != nil {
		return err
	}
	defer m.Release()
	if m.Len() > 0 {
		// The server's error text, quoted unless printable: before, it
		// was printed as sent, escape sequences included
		// (TestClientQuotesServerText).
		return fmt.Errorf("put %q: %s", key, printable(m.Bytes()))
	}
	return nil
}

// get looks key up with RDMA reads only.
func (c *client) get(ctx context.Context, key []byte) (value []byte, ok bool, err error) {
	h, home := hashKey(key, c.buckets)
	for p := 0; p < maxProbe; p++ {
		i := (home + p) % c.buckets
		src, err := c.table.Slice(i*bucketSize, bucketSize)
		if err != nil {
			return nil, false, err
		}
		for try := 0; ; try++ {
			if err := c.s.Read(ctx, c.bucket, src); err != nil {
				return nil, false, err
			}
			v, found, end, torn, err := c.lookBucket(ctx, key, h)
			switch {
			case err != nil:
				return nil, false, err
			case found:
				return v, true, nil
			case end:
				return nil, false, nil // an empty slot ends the probe
			}
			if !torn {
				break // a full bucket of other keys: probe on
			}
			if try > 100 {
				return nil, false, fmt.Errorf("get %q: the entry never checks", key)
			}
		}
	}
	return nil, false, nil
}

// lookBucket looks for key (its stored hash h) in the bucket just read
// (c.bucket), reading the entries of the slots with its hash: found
// (with the value), or end (an empty slot: the key is nowhere), or torn
// (an entry that does not check: a PUT changed the slot meanwhile, read
// the bucket again); none of them: the bucket holds other keys only.
func (c *client) lookBucket(ctx context.Context, key []byte, h uint32) (v []byte, found, end, torn bool, err error) {
	heapBase := c.buckets * bucketSize
	b := c.bucket.Bytes()
	for j := range slots {
		sl := b[j*slotSize:]
		off := binary.LittleEndian.Uint64(sl)
		if off == 0 {
			return nil, false, true, false, nil
		}
		if binary.LittleEndian.Uint32(sl[12:]) != h {
			continue // another key's
		}
		size := int(binary.LittleEndian.Uint32(sl[8:]))
		if size < entryHdr || size > c.entry.Len() {
			return nil, false, false, true, nil
		}
		src, serr := c.table.Slice(heapBase+int(off-1), size)
		if serr != nil {
			return nil, false, false, true, nil
		}
		dst, _ := c.entry.Slice(0, size)
		if err := c.s.Read(ctx, dst, src); err != nil {
			return nil, false, false, false, err
		}
		e := dst.Bytes()
		kl, vl := int(binary.LittleEndian.Uint16(e)), int(binary.LittleEndian.Uint32(e[2:]))
		if entryHdr+kl+vl != size || crc32.Checksum(e[entryHdr:], castagnoli) != binary.LittleEndian.Uint32(e[6:]) {
			return nil, false, false, true, nil
		}
		if string(e[entryHdr:entryHdr+kl]) == string(key) {
			return append([]byte(nil), e[entryHdr+kl:]...), true, false, false, nil
		}
	}
	return nil, false, false, false, nil
}

// measure returns the median latency of a single 16-byte read of the
// table (a slot) and of a GET, in µs.
func (c *client) measure(ctx context.Context, n, keys int) (read, get float64, err error) {
	hr := hdrhistogram.New(1, 10_000_000, 3)
	hg := hdrhistogram.New(1, 10_000_000, 3)
	src, err := c.table.Slice(0, slotSize)
	if err != nil {
		return 0, 0, err
	}
	one, _ := c.bucket.Slice(0, slotSize)
	key := make([]byte, 0, 32)
	for i := range n {
		t0 := time.Now()
		if err := c.s.Read(ctx, one, src); err != nil {
			return 0, 0, err
		}
		hr.RecordValue(time.Since(t0).Nanoseconds())
		key = fmt.Appendf(key[:0], "key-%d", i%max(keys, 1))
		t0 = time.Now()
		if _, _, err := c.get(ctx, key); err != nil {
			return 0, 0, err
		}
		hg.RecordValue(time.Since(t0).Nanoseconds())
	}
	return float64(hr.ValueAtQuantile(50)) / 1e3, float64(hg.ValueAtQuantile(50)) / 1e3, nil
}
