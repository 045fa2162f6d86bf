package soft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/fdpass"
	"github.com/goverbs/verbs/internal/mem"
	"github.com/goverbs/verbs/internal/prov"
)

// The shared-memory transport (processes of one host): the frames of a
// connection go through two byte rings in a shared memory segment instead
// of a socket, with an eventfd per direction to wake a reader that sleeps.
//
// Handshake. The dialer connects to the target's abstract unix socket and
// checks the target's credentials (SO_PEERCRED) like the unix transport;
// it creates the segment (a sealed memfd: it can neither shrink nor grow)
// and two eventfds and sends them with HELLO (SCM_RIGHTS). The acceptor
// checks the peer as usual, and that the memfd is sealed and of the
// expected size, before it maps it. The unix socket stays open for the life
// of the connection: its end of file is how a process learns that its peer
// died.
//
// Rings. Ring 0 carries the dialer's frames, ring 1 the acceptor's. Each is
// a single-producer single-consumer byte stream: the producer copies bytes
// in and publishes them by storing tail, the consumer copies them out and
// stores head. Both keep their own index privately and only read the
// other's from shared memory, checking it, so a peer that scribbles on the
// segment can garble frames (which the decoders reject) but never make
// this process read or write outside the segment. A consumer that finds
// its ring empty stores sleeping = 1, looks again and waits on its eventfd;
// a producer that finds sleeping = 1 after storing tail clears it and
// writes the eventfd. A producer that finds its ring full polls for room.
//
// Laps. A producer that finds its ring empty with its index at least
// lapSkipAt into the current lap goes on at the start of the next lap: it
// stores the index there in lap before the bytes it puts after it, and
// the consumer, at the end of what it consumed (it consumed everything:
// the ring was empty), skips to it. So a ring that carries small messages
// uses its first pages over and over (about lapSkipAt of it) instead of
// walking through all of it: before, every connection's rings came to
// occupy their whole 8 MiB after 4 MiB of traffic each way (a page
// fault per 4 KiB on the way, a quarter of the time of an oversubscribed
// barrier), 144 MiB per rank of a 512-rank world with 18 connections.
//
// Budget. The pages a ring of small messages uses over and over are
// populated when the connection is set up (newShmLink), and they stay
// until it closes. A process with a few connections gives each
// lapSkipAt of each ring; past populateBudget of them (32 connections)
// a connection's rings lap at lapSkipMin and are faulted in as they are
// used. Before, a dense all-to-all of 256 ranks on one host, 65 280
// connections of 520 KiB each, ran a 24 GiB machine out of memory, and
// 128 ranks spent 41 s of the one write to every peer populating 8 GiB
// (scripts/scale.sh 128). The producer alone decides where its laps end,
// so the two sides of a connection need not agree.
//
//	ring header  [0:8] tail   [64:72] head   [128:132] sleeping   [192:200] lap
//	             [256:264] the consumer's published acknowledgement (ackpage.go)
//	data         [ringHdr:ringHdr+ringCap]

const (
	ringHdr  = 4096
	ringCap  = 4 << 20
	ringSize = ringHdr + ringCap
	// lapSkipAt is how far into a lap a producer that finds its ring
	// empty goes on at the next lap instead (see Laps), on the
	// connections a process populates at set-up while its
	// populateBudget lasts; lapSkipMin on the others (see Budget).
	lapSkipAt  = 256 << 10
	lapSkipMin = 16 << 10
	// populateBudget is how much of its connections' rings a process
	// populates at lapSkipAt each (2 × lapSkipAt a connection).
	populateBudget = 16 << 20
	segSize        = 2 * ringSize

	shmFDs = 3 // memfd, eventfd of ring 0, eventfd of ring 1
)

// ring is one direction of a segment, as seen by one process.
type ring struct {
	tail  *uint64
	head  *uint64
	sleep *uint32
	lap   *uint64 // where the producer went on at a lap's start
	data  []byte
	pos   uint64 // the private index: tail for the producer, head for the consumer
	// skipAt is how far into a lap the producer goes on at the next one
	// (producer, Laps).
	skipAt uint64
	// seen is the head the producer loaded last (producer): the room it
	// knows of. It loads head again only when that room is short or the
	// lap may end (Laps): a load of head at every put brought the line
	// that the consumer stores at every get over to the producer, and back
	// at the consumer's next store, twice per frame.
	seen uint64
}

func newRing(seg []byte, i int) ring {
	base := unsafe.Pointer(&seg[i*ringSize])
	return ring{
		tail:   (*uint64)(base),
		head:   (*uint64)(unsafe.Add(base, 64)),
		sleep:  (*uint32)(unsafe.Add(base, 128)),
		lap:    (*uint64)(unsafe.Add(base, 192)),
		data:   seg[i*ringSize+ringHdr : (i+1)*ringSize : (i+1)*ringSize],
		skipAt: lapSkipAt,
	}
}

// ackWord is the word of the ring's header in which its consumer
// publishes the acknowledgements of writes it holds (ackpage.go, Writes).
func (r *ring) ackWord() *uint64 { return (*uint64)(unsafe.Add(unsafe.Pointer(r.tail), 256)) }

var errRingCorrupt = errors.New("soft: shared memory ring corrupted by the peer")

// put copies a prefix of bufs into the ring (producer) and returns its
// length and whether the consumer must be woken.
func (r *ring) put(bufs [][]byte) (int, bool, error) {
	used := r.pos - r.seen
	if r.pos&(ringCap-1) >= r.skipAt || ringCap-used < uint64(total(bufs)) {
		head := atomic.LoadUint64(r.head)
		if head == r.pos && r.pos&(ringCap-1) >= r.skipAt {
			// Empty, and far into the lap: on at the next one (Laps),
			// stored before the tail that publishes what follows.
			r.pos = (r.pos + ringCap) &^ (ringCap - 1)
			atomic.StoreUint64(r.lap, r.pos)
		}
		if used = r.pos - head; used > ringCap {
			return 0, false, errRingCorrupt
		}
		r.seen = head
	}
	free := ringCap - used
	n := 0
	for _, b := range bufs {
		for len(b) > 0 && free > 0 {
			off := r.pos & (ringCap - 1)
			k := copy(r.data[off:min(uint64(len(r.data)), off+free)], b)
			b = b[k:]
			r.pos += uint64(k)
			free -= uint64(k)
			n += k
		}
		if free == 0 {
			break
		}
	}
	if n == 0 {
		return 0, false, nil
	}
	atomic.SwapUint64(r.tail, r.pos) // a full barrier before the load of sleep (see shmLink.sleep)
	wake := atomic.LoadUint32(r.sleep) == 1 && atomic.CompareAndSwapUint32(r.sleep, 1, 0)
	return n, wake, nil
}

// get copies available bytes into p (consumer); 0 means the ring is empty.
func (r *ring) get(p []byte) (int, error) {
	a, err := r.avail()
	if err != nil {
		return 0, err
	}
	n := min(a, uint64(len(p)))
	if n > 0 {
		r.peek(0, p[:n])
		r.skip(n)
	}
	return int(n), nil
}

// avail is how many bytes the consumer may read. At the point where the
// producer went on at the next lap it skips there first (Laps): its
// index is then at the end of all it consumed, a frame's end.
func (r *ring) avail() (uint64, error) {
	tail := atomic.LoadUint64(r.tail)
	if s := atomic.LoadUint64(r.lap); s > r.pos && s <= tail {
		if s&(ringCap-1) != 0 || s-r.pos >= ringCap {
			return 0, errRingCorrupt
		}
		r.pos = s
		atomic.StoreUint64(r.head, s)
	}
	a := tail - r.pos
	if a > ringCap {
		return 0, errRingCorrupt
	}
	return a, nil
}

// peek copies the len(p) bytes at off past the consumer's position, which
// the caller knows are available, without consuming them.
func (r *ring) peek(off uint64, p []byte) {
	pos := r.pos + off
	for n := 0; n < len(p); {
		k := copy(p[n:], r.data[pos&(ringCap-1):])
		n += k
		pos += uint64(k)
	}
}

// pieces returns the n <= ringCap available bytes at off past the
// consumer's position in place: a, and b if they wrap around the end of
// the ring. They stay valid until skip consumes them.
func (r *ring) pieces(off, n uint64) (a, b []byte) {
	o := (r.pos + off) & (ringCap - 1)
	if o+n <= ringCap {
		return r.data[o : o+n : o+n], nil
	}
	k := n - (ringCap - o)
	return r.data[o:ringCap:ringCap], r.data[:k:k]
}

// skip consumes n available bytes.
func (r *ring) skip(n uint64) {
	r.pos += n
	atomic.StoreUint64(r.head, r.pos)
}

// sleep waits on the eventfd for the producer to publish bytes past seen,
// the tail the consumer saw last, unless it has already (consumer).
// With put, this is Dekker's handshake: each side stores its flag (tail,
// sleeping) and then loads the other's, so one of them must see the
// other's store. That needs a full barrier between each store and the
// load after it; a plain (release) store is not one on amd64. Go's
// atomic stores are sequentially consistent, but with the race detector
// on they are release stores (golang.org/issue/58020), and a consumer
// went to sleep on a ring the producer had just filled: so both stores
// are swaps, which are full barriers in every build.
func (l *shmLink) sleep(seen uint64) error {
	in := &l.in
	atomic.SwapUint32(in.sleep, 1)
	if atomic.LoadUint64(in.tail) != seen {
		atomic.StoreUint32(in.sleep, 0)
		return nil
	}
	if err := l.efdRaw.Read(l.readFn); err != nil {
		return err
	}
	return l.readErr
}

// readEventfd is the read of sleep (in the runtime's poller, efdRaw.Read):
// a raw system call, which does not wake the runtime's monitor thread
// (sysmon) as a read through the os.File does (entersyscall): a process
// that sleeps and wakes for every message, as ranks that outnumber the
// processors do, woke it at every wake-up, two more thread switches.
func (l *shmLink) readEventfd(fd uintptr) bool {
	_, _, errno := unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(&l.efdBuf[0])), uintptr(len(l.efdBuf)))
	switch errno {
	case unix.EAGAIN:
		return false // wait for it
	case unix.EINTR:
		return l.readEventfd(fd)
	}
	l.readErr = nil
	if errno != 0 {
		l.readErr = errno
	}
	return true
}

// shmLink is the shared-memory part of a connection.
type shmLink struct {
	seg     []byte
	in, out ring
	efdIn   *os.File // waited on (poller)
	efdRaw  syscall.RawConn
	readFn  func(fd uintptr) bool // readEventfd, bound once
	wakeFn  func(fd uintptr) bool // wakeEventfd, bound once
	readErr error                 // of the last readEventfd
	efdOut  int                   // written to wake the peer
	efdBuf  [8]byte               // what the reader reads from efdIn
	budget  int64                 // of populateBudget this link holds
	// onSignal, if set (by a test), runs at every signal.
	onSignal atomic.Pointer[func()]
}

// populated is how much of populateBudget the process' links hold.
var populated atomic.Int64

// reserve takes 2 × lapSkipAt of populateBudget for a new link and
// returns its rings' lap length: lapSkipAt if the budget had it, else
// lapSkipMin and nothing taken.
func reserve() (skip uint64, budget int64) {
	const n = 2 * lapSkipAt
	if populated.Add(n) <= populateBudget {
		return lapSkipAt, n
	}
	populated.Add(-n)
	return lapSkipMin, 0
}

// newShmLink maps the segment of memfd; dialer says which side this is.
func newShmLink(memfd, efdIn, efdOut int, dialer bool) (*shmLink, error) {
	seg, err := unix.Mmap(memfd, 0, segSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("soft: map shared memory segment: %w", err)
	}
	if err := unix.SetNonblock(efdIn, true); err != nil {
		unix.Munmap(seg)
		return nil, err
	}
	// Within the budget, the pages a ring of small messages uses over
	// and over (its header and its first lapSkipAt bytes, Laps, Budget)
	// are faulted in now rather than one by one on the data path (a
	// fault costs microseconds on a virtual machine: a quarter of an
	// oversubscribed barrier's time went there). A kernel without
	// MADV_POPULATE_WRITE (5.14) faults them in later, as before; so
	// does a connection past the budget, which has few pages to fault
	// in (lapSkipMin) and, in the worlds that make many, carries little.
	skip, budget := reserve()
	if budget > 0 {
		for i := range 2 {
			unix.Madvise(seg[i*ringSize:i*ringSize+ringHdr+int(skip)], unix.MADV_POPULATE_WRITE)
		}
	}
	l := &shmLink{seg: seg, efdIn: os.NewFile(uintptr(efdIn), "eventfd"), efdOut: efdOut, budget: budget}
	raw, err := l.efdIn.SyscallConn()
	if err != nil {
		l.efdIn.Close()
		unix.Munmap(seg)
		populated.Add(-budget)
		return nil, err
	}
	l.efdRaw, l.readFn, l.wakeFn = raw, l.readEventfd, wakeEventfd
	if dialer {
		l.out, l.in = newRing(seg, 0), newRing(seg, 1)
	} else {
		l.out, l.in = newRing(seg, 1), newRing(seg, 0)
	}
	l.out.skipAt = skip
	// Both sides start at 0; a peer's later scribbling is caught by the
	// checks in put and get.
	return l, nil
}

// tryWrite writes a prefix of bufs without waiting (wmu held).
func (l *shmLink) tryWrite(bufs [][]byte) (int, error) {
	n, wake, err := l.out.put(bufs)
	if wake {
		l.signal()
	}
	return n, err
}

// writeAll writes all of bufs, polling for room until the deadline or
// until dead is set (wmu held).
func (l *shmLink) writeAll(bufs [][]byte, deadline time.Time, dead *atomic.Bool) error {
	for {
		n, err := l.tryWrite(bufs)
		if err != nil {
			return err
		}
		for n > 0 && len(bufs) > 0 {
			k := min(n, len(bufs[0]))
			bufs[0] = bufs[0][k:]
			n -= k
			if len(bufs[0]) == 0 {
				bufs = bufs[1:]
			}
		}
		for len(bufs) > 0 && len(bufs[0]) == 0 {
			bufs = bufs[1:]
		}
		if len(bufs) == 0 {
			return nil
		}
		if dead.Load() {
			return errConnDown
		}
		if time.Now().After(deadline) {
			return os.ErrDeadlineExceeded
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// eventOne is what a write to an eventfd adds (read only; a variable, not
// a local array, which the race detector's build would allocate).
var eventOne = [8]byte{1}

// signal wakes the peer's reader: a raw system call, which does not wake
// the runtime's monitor thread (see readEventfd); a write to an eventfd
// does not block.
func (l *shmLink) signal() {
	if f := l.onSignal.Load(); f != nil {
		(*f)()
	}
	wakeEventfd(uintptr(l.efdOut))
}

// wakeReader ends the reader's wait on this side's eventfd, as a signal
// of the peer would (a driver takes the ring over: driveShm).
func (l *shmLink) wakeReader() { l.efdRaw.Write(l.wakeFn) }

// wakeEventfd adds one to the eventfd fd.
func wakeEventfd(fd uintptr) bool {
	for {
		_, _, errno := unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(&eventOne[0])), uintptr(len(eventOne)))
		if errno != unix.EINTR {
			return true
		}
	}
}

// close wakes the reader (its eventfd closes); unmap releases the rest
// once nobody uses the segment.
func (l *shmLink) close() { l.efdIn.Close() }

func (l *shmLink) unmap() {
	unix.Close(l.efdOut)
	unix.Munmap(l.seg)
	l.seg = nil
	populated.Add(-l.budget)
	l.budget = 0
}

// --- handshake helpers ---

// newShmFDs creates a sealed segment and two eventfds.
func newShmFDs() (fds [shmFDs]int, err error) {
	fds = [shmFDs]int{-1, -1, -1}
	defer func() {
		if err != nil {
			fdpass.Close(fds[:])
			fds = [shmFDs]int{-1, -1, -1}
		}
	}()
	if fds[0], err = unix.MemfdCreate("goverbs-soft-link", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING); err != nil {
		return fds, fmt.Errorf("soft: memfd_create: %w", err)
	}
	if err = unix.Ftruncate(fds[0], segSize); err != nil {
		return fds, fmt.Errorf("soft: size shared memory segment: %w", err)
	}
	if _, err = unix.FcntlInt(uintptr(fds[0]), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fds, fmt.Errorf("soft: seal shared memory segment: %w", err)
	}
	for i := 1; i < shmFDs; i++ {
		if fds[i], err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			return fds, fmt.Errorf("soft: eventfd: %w", err)
		}
	}
	return fds, nil
}

// checkShmFDs checks descriptors received from a peer: a sealed memfd of
// the segment's size and two eventfds.
func checkShmFDs(fds []int) error {
	if len(fds) != shmFDs {
		return fmt.Errorf("%d descriptors, want %d", len(fds), shmFDs)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fds[0], &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != segSize {
		return fmt.Errorf("the segment is not a %d-byte file", segSize)
	}
	if _, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GET_SEALS, 0); err != nil {
		return fmt.Errorf("the segment is not a memfd: %w", err)
	}
	if !mem.Sealed(fds[0]) {
		return errors.New("the segment is not sealed against resizing")
	}
	for _, fd := range fds[1:] {
		link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
		if err != nil || link != "anon_inode:[eventfd]" {
			return fmt.Errorf("descriptor %d is not an eventfd (%q)", fd, link)
		}
	}
	return nil
}

// readMsgFDs fills b from c, collecting the descriptors that come with it
// (at most max; more are closed and make it fail).
func readMsgFDs(c *net.UnixConn, b []byte, max int) ([]int, error) {
	oob := make([]byte, unix.CmsgSpace(4*(max+1)))
	var fds []int
	got := 0
	for got < len(b) {
		n, oobn, flags, _, err := c.ReadMsgUnix(b[got:], oob)
		if oobn > 0 {
			fds = append(fds, fdpass.Rights(oob[:oobn])...)
		}
		if err != nil {
			fdpass.Close(fds)
			return nil, err
		}
		if flags&unix.MSG_CTRUNC != 0 || len(fds) > max {
			fdpass.Close(fds)
			return nil, errors.New("too many descriptors")
		}
		if n == 0 {
			fdpass.Close(fds)
			return nil, errors.New("unexpected end of file")
		}
		got += n
	}
	return fds, nil
}

// --- direct writes ---
//
// A RC write or read of at least directMin bytes on a region that the
// target can share (memory from Alloc: a memfd that the region covers from
// its start, registered with remote read access) becomes a direct copy:
// the requester asks the target once for the region (MAP through the
// ring; MAP_ACK with a descriptor over the unix socket) and maps it,
// read-only unless the region allows remote writes (the descriptor of a
// region without remote write access is opened read-only, so the peer
// cannot map it writable). The target hands a region only to a peer with
// a QP connected to one of its QPs in the region's PD (peerConnectedIn:
// a region is reachable only through a QP of its PD); to any other it
// answers "not shared", and the requests go through its service, whose
// responder checks them. Each request then goes without data through
// the ring; the target's responder does every check as for any request
// (QP state, PSN, access, rkey, bounds) and answers; on ACK the requester
// copies the bytes (into its mapping for a write, out of it for a read)
// and completes the request. The responder names the region it accepted
// (its serial number); if it is not the mapped one (the key was reused
// for another region), the mapping is dropped and the request fails with
// RETRY_EXC_ERR. Requests that are not direct wait until the
// direct ones before them in the send queue are copied, so that RC
// ordering holds.
//
// A RC write with immediate of at least directMin bytes on such a region
// cannot wait for its ACK to be copied: the target completes a receive
// when it handles the request, and the data must be there by then. The
// requester copies it into its mapping before the request leaves (after
// the direct writes before it were copied, like any other request), from
// PostSend up to maxNBFrame bytes, from the QP's goroutine beyond, once a
// write of the QP was acknowledged since it left RESET (xstate.wrOK:
// before, the target may refuse remote writes on the QP, which it checks
// first, and the request goes through it), and
// the request carries the serial of the region it mapped: the target
// checks it before it takes a receive, and refuses a request copied into
// another region than the one its key names now (respStale: not
// executed; the requester drops the mapping and sends the request and
// those after it again, maxStale times in a row at most). The copy lands
// before the target checked the request, as the first packets of a
// multi-packet write land on a NIC before the last one's checks: a
// request that fails (an RNR NAK, a QP in error) may have changed the
// region. It may also land before requests posted earlier were executed
// at the target (those that are not direct): the contents of a write's
// target are defined once it completes (InfiniBand's rule for RDMA
// writes), and by then the target has executed the earlier ones, in
// order. The target's process then does no copy at all, where a pull
// (cma.go) made it copy every payload while the requester's waited:
// session's 64 KiB messages between two processes (BenchmarkXprocBandwidth
// /shm, five alternating runs) went from 0.73 to 2.01 times a bare
// channel's RDMA writes (medians; one poster: 0.78 to 2.26). Atomics and everything else go through the target's
// service. The copy is checked against the bounds the target
// gave. A copy can land after the target deregistered the region (which
// frees its memory): it then reaches only pages that the requester's
// mapping keeps alive, never memory the target uses. A peer that shrinks
// its memfd under the mapping can make this process fault, which only a
// process of the same user and job can do. The mapping outlives the
// registration (and the connection): code of a same-user peer that mapped
// a region can still read its memory, and write it if the region allowed
// remote writes, after the region is deregistered, for as long as the
// memory exists, and sees whatever the target keeps in it (a registration
// of the same memory again among them); memory that must not be reached
// after deregistration needs a fresh allocation.

const (
	directMin  = 16 << 10
	maxImports = 256 // mapped regions per connection
)

// mrImport is a peer's region mapped in this process.
type mrImport struct {
	addr, length uint64
	mem          []byte // nil: the region cannot be mapped (go through the service)
	writable     bool   // mapped writable (the region allows remote writes)
	serial       uint64 // the region's serial in the peer
}

type mapReply struct {
	ack mapAck
	fd  int
	err error
}

// importRegion returns the mapping of the peer's region rkey, asking the
// peer for it if needed (this waits, timeout at most, or handshakeTimeout
// if 0: only the QP's goroutine may call it with wait). nil means: not
// mapped (yet). A request whose region is not mapped goes through the
// service, under its QP's response timer: a peer that does not answer
// (stopped, or busy) makes the request wait for the QP's transport
// timeout twice at most, not for handshakeTimeout. A refusal is kept (the
// region is not asked for again on c) only with keep, never an unanswered
// MAP: the peer shares a region
// only with a peer connected to a QP of its PD (serveMap), and a QP
// whose requests were not acknowledged yet may have asked before its
// destination was connected (xstate.ackOK); its requests go through the
// service meanwhile.
func (c *conn) importRegion(rkey uint32, wait, keep bool, timeout time.Duration) *mrImport {
	c.impMu.RLock()
	imp := c.imports[rkey]
	c.impMu.RUnlock()
	if imp != nil || !wait {
		return imp
	}
	if timeout <= 0 {
		timeout = handshakeTimeout
	}
	r := c.callMap(rkey, min(timeout, handshakeTimeout))
	imp = &mrImport{}
	if r.err == nil && r.ack.status == mapOK && r.fd >= 0 {
		var st unix.Stat_t
		// Only a sealed memfd: a peer that could shrink it would make the
		// copies into the mapping fault.
		if unix.Fstat(r.fd, &st) == nil && uint64(st.Size) >= r.ack.length && mem.Sealed(r.fd) {
			prot := unix.PROT_READ
			if r.ack.access&prov.AccessRemoteWrite != 0 {
				prot |= unix.PROT_WRITE
			}
			if mem, err := unix.Mmap(r.fd, 0, int(r.ack.length), prot, unix.MAP_SHARED); err == nil {
				imp.addr, imp.length, imp.mem, imp.serial = r.ack.addr, r.ack.length, mem, r.ack.serial
				imp.writable = prot&unix.PROT_WRITE != 0
			}
		}
	}
	if r.fd >= 0 {
		unix.Close(r.fd)
	}
	if imp.mem == nil && (!keep || r.err != nil) {
		return imp
	}
	c.impMu.Lock()
	defer c.impMu.Unlock()
	if c.imports == nil || len(c.imports) >= maxImports || c.dead.Load() {
		if imp.mem != nil {
			unix.Munmap(imp.mem)
		}
		return nil
	}
	if old := c.imports[rkey]; old != nil {
		if imp.mem != nil {
			unix.Munmap(imp.mem)
		}
		return old
	}
	c.imports[rkey] = imp
	return imp
}

// callMap sends MAP for rkey and waits for MAP_ACK, timeout at most.
func (c *conn) callMap(rkey uint32, timeout time.Duration) mapReply {
	ch := make(chan mapReply, 1)
	c.callMu.Lock()
	if c.dead.Load() {
		c.callMu.Unlock()
		return mapReply{fd: -1, err: errConnDown}
	}
	id := c.nextID.Add(1)
	if c.calls == nil {
		c.calls = map[uint64]chan mapReply{}
	}
	c.calls[id] = ch
	c.callMu.Unlock()
	var b [hdrLen + mapLen]byte
	putHdr(b[:], frMap, mapLen, id)
	binary.LittleEndian.PutUint32(b[hdrLen:], rkey)
	if err := c.writeFrame([][]byte{b[:]}, timeout); err != nil {
		c.callMu.Lock()
		delete(c.calls, id)
		c.callMu.Unlock()
		return mapReply{fd: -1, err: err}
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case r := <-ch:
		return r
	case <-c.done:
		return mapReply{fd: -1, err: errConnDown}
	case <-t.C:
		c.callMu.Lock()
		delete(c.calls, id)
		c.callMu.Unlock()
		return mapReply{fd: -1, err: errors.New("soft: no answer to MAP")}
	}
}

// failAfterDrain takes the connection down once the frames complete in
// the inbound ring are handled: the peer is gone, what it sent before is
// delivered (the acknowledgements of its last requests among them).
func (c *conn) failAfterDrain(err error) {
	// A driver may hold rmu, waiting on the eventfd: end its wait, and it
	// gives the ring up (driveShm).
	c.failing.Store(true)
	c.dlMu.Lock()
	if c.driver != nil {
		c.endWaitLocked()
	}
	c.dlMu.Unlock()
	c.rmu.Lock()
	if !c.dead.Load() {
		if _, derr := c.drain(false); derr != nil {
			err = derr
		}
		c.flushResps()
	}
	c.rmu.Unlock()
	c.fail(err)
}

// serveMap answers MAP (target side, reader goroutine).
func (c *conn) serveMap(id uint64, body []byte) error {
	rkey := binary.LittleEndian.Uint32(body)
	ack := mapAck{status: mapNotShare}
	var fds []int
	if m := c.f.lookupMR(rkey); m != nil && m.fd >= 0 && m.off == 0 && m.access&prov.AccessRemoteRead != 0 && c.peerConnectedIn(m.pd) {
		var st unix.Stat_t
		if unix.Fstat(m.fd, &st) == nil && uint64(st.Size) == uint64(mem.RoundUp(int(m.length))) && mem.Sealed(m.fd) {
			if m.access&prov.AccessRemoteWrite != 0 {
				fds = []int{m.fd}
			} else if fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", m.fd), unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
				// Remote read only: a descriptor that cannot map the
				// memory writable.
				fds = []int{fd}
				defer unix.Close(fd)
			}
			if fds != nil {
				ack = mapAck{status: mapOK, access: m.access, addr: m.addr, length: m.length, serial: m.serial}
			}
		}
	}
	var b [hdrLen + mapAckLen]byte
	putHdr(b[:], frMapAck, mapAckLen, id)
	putMapAck(b[hdrLen:], &ack)
	return c.writeSocket(b[:], fds)
}

// peerConnectedIn reports whether the peer on c has a QP connected to a
// QP of this process in pd: an RC or UC QP of pd, in RTR or RTS, whose
// destination is the peer, as the peer proved (fromPeer). Only then may
// the peer map a region of pd (serveMap): a region is reachable only
// through a QP of its PD, and a peer connected to QPs of other PDs alone
// must not get its memory (it goes through the service, where the
// responder refuses it). A scan over the QPs: MAP comes once per region
// and connection, never on the data path.
func (c *conn) peerConnectedIn(pd *pd) bool {
	found := false
	c.f.qps.each(func(q *qp) {
		if found || q.pd != pd || q.typ == prov.QPTypeUD || q.closed.Load() {
			return
		}
		q.rmu.Lock()
		if st := prov.QPState(q.state.Load()); st == prov.QPStateRTR || st == prov.QPStateRTS {
			found = c.leadsTo(q)
		}
		q.rmu.Unlock()
	})
	return found
}

// writeSocket writes the frame b, with the descriptors fds, to the unix
// socket of a shared-memory connection (MAP_ACK, PULL_ACK: the frames
// that do not go through the ring).
func (c *conn) writeSocket(b []byte, fds []int) error {
	c.sockMu.Lock()
	defer c.sockMu.Unlock()
	c.nc.SetWriteDeadline(time.Now().Add(handshakeTimeout))
	_, _, err := c.nc.(*net.UnixConn).WriteMsgUnix(b, unix.UnixRights(fds...), nil)
	c.nc.SetWriteDeadline(time.Time{})
	return err
}

// handleMapAck hands a MAP_ACK (with its descriptor, if any) to its caller.
func (c *conn) handleMapAck(id uint64, body []byte, fds []int) error {
	ack, err := parseMapAck(body)
	if err != nil || len(fds) > 1 || (ack.status == mapOK) != (len(fds) == 1) {
		fdpass.Close(fds)
		if err == nil {
			err = fmt.Errorf("%w: %d descriptors with status %d", errBadMap, len(fds), ack.status)
		}
		return err
	}
	fd := -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	c.callMu.Lock()
	ch := c.calls[id]
	delete(c.calls, id)
	c.callMu.Unlock()
	if ch == nil {
		fdpass.Close(fds)
		return nil
	}
	ch <- mapReply{ack: ack, fd: fd}
	return nil
}

// unmapImports releases the peer's regions (the connection is down and
// nobody copies: see copyDirect).
func (c *conn) unmapImports() {
	c.impMu.Lock()
	defer c.impMu.Unlock()
	for _, imp := range c.imports {
		if imp.mem != nil {
			unix.Munmap(imp.mem)
		}
	}
	c.imports = nil
}

// dropImport forgets the mapping of rkey: the peer accepted a direct
// request for another region with the same key (the key was reused).
// Copies into it fail from now on.
func (c *conn) dropImport(rkey uint32, imp *mrImport) {
	c.impMu.Lock()
	defer c.impMu.Unlock()
	if c.imports != nil && c.imports[rkey] == imp {
		delete(c.imports, rkey)
	}
	if imp.mem != nil {
		unix.Munmap(imp.mem)
		imp.mem = nil
	}
}

// copyDirect copies between local (the requester's SGEs) and the peer's
// region at raddr: into the region for a write, out of it for a read. It
// fails if the mapping is gone, the range is outside it, or a write meets
// a read-only mapping.
func (c *conn) copyDirect(imp *mrImport, raddr uint64, local []span, write bool) bool {
	c.impMu.RLock()
	defer c.impMu.RUnlock()
	if c.imports == nil || imp.mem == nil || write && !imp.writable {
		return false
	}
	n := 0
	for _, s := range local {
		n += s.n
	}
	if n == 0 {
		return true
	}
	if raddr < imp.addr || uint64(n) > imp.length || raddr-imp.addr > imp.length-uint64(n) {
		return false
	}
	remote := [1]span{{unsafe.Pointer(&imp.mem[raddr-imp.addr]), n}}
	if write {
		copySpans(remote[:], 0, local)
	} else {
		copySpans(local, 0, remote[:])
	}
	return true
}

// watchSocket reads the unix socket of a shared-memory connection: only
// MAP_ACK and PULL_ACK frames come over it.
// Its end is how a process learns that its peer died or closed the
// connection; the frames the peer left in the
// ring are handled first (failAfterDrain), as a socket's reader reads
// up to its end of file.
func (c *conn) watchSocket() {
	uc := c.nc.(*net.UnixConn)
	var b [hdrLen + mapAckLen]byte
	for {
		fds, err := readMsgFDs(uc, b[:hdrLen], 1)
		if err != nil {
			// What the peer put in the ring before it went is
			// delivered (and answered) first.
			c.failAfterDrain(readErr(c, err))
			return
		}
		h, err := parseHdr(b[:hdrLen])
		if err == nil && h.typ == frPullAck && len(fds) == 0 {
			if _, err = io.ReadFull(uc, b[hdrLen:hdrLen+pullAckLen]); err != nil {
				c.failAfterDrain(readErr(c, err))
				return
			}
			if err = c.handlePullAck(b[hdrLen : hdrLen+pullAckLen]); err != nil {
				c.fail(fmt.Errorf("soft: bad frame from process %d: %w", c.peerPID, err))
				return
			}
			continue
		}
		if err == nil && h.typ != frMapAck {
			err = fmt.Errorf("%w: type %d on the socket of a shared-memory connection", errBadType, h.typ)
		}
		if err != nil {
			fdpass.Close(fds)
			c.fail(fmt.Errorf("soft: malformed frame from process %d: %w", c.peerPID, err))
			return
		}
		more, err := readMsgFDs(uc, b[hdrLen:], 1-len(fds))
		fds = append(fds, more...)
		if err == nil {
			err = c.handleMapAck(h.id, b[hdrLen:], fds)
		} else {
			fdpass.Close(fds)
		}
		if err != nil {
			c.fail(fmt.Errorf("soft: bad frame from process %d: %w", c.peerPID, err))
			return
		}
	}
}
