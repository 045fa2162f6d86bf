package soft

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goverbs/verbs/internal/mem"
)

// Acknowledgements held over unix sockets (the acknowledgement page) and
// shared memory (words of the rings' headers).
//
// A request that completes a receive must be acknowledged before its
// completion is visible: the application may exit as soon as it has polled
// it, and a held acknowledgement would die with it, the requester seeing
// RETRY_EXC_ERR for a message that was delivered (ackFirst). Over TCP the
// acknowledgement is corked in the socket, which the kernel sends when the
// process exits; a unix socket has no cork, and writing every
// acknowledgement at once was two system calls of every 8-byte round trip
// (6.8–7.1 µs polling against 4.7–5.1 µs with them held, a raw ping-pong
// 4.3 µs).
//
// So the dialer of a unix connection creates a page of shared memory (a
// sealed memfd, sent with HELLO like the shared-memory transport's
// segment), and each side publishes in its word of it the id of the last
// request whose acknowledgement it holds: ackFirst stores the id there
// instead of writing the acknowledgement, and the acknowledgement waits
// among the held responses for the answer or the next flush (progress.go)
// as over TCP. A process that dies leaves its word behind: when the
// connection fails, the requester reads it (fail) and completes the
// requests in flight up to that id as acknowledged (xreq.go, retireOne).
//
// A shared-memory connection does the same with words of its rings'
// headers (shmAckWords), which outlive the process as the page does.
// There an acknowledgement put in the ring at once costs no system call,
// but it was a frame of its own to put and to handle: held, it goes in
// the same put as the answer (polling 8-byte round trips: 4 ring puts →
// 2, perf probe; 1.09 → 1.07 µs, medians of 21 alternating runs).
//
// That is exact because the responder handles requests in the order of
// their ids and stores an id only when every response before it either
// left (it is in the socket, which the peer reads to its end before the
// connection fails) or is a plain acknowledgement held with it: while a
// response of another kind (a NAK, an atomic's result) is held or
// anything waits in the connection's queue, ackFirst writes at once as
// before. A peer that scribbles on the page can only make this process
// believe that requests it sent to that peer were acknowledged, which
// the peer could do with acknowledgements.
//
//	[0:8] the dialer's word   [64:72] the acceptor's word
//
// Writes. An RDMA write completes nothing at its target, and its
// acknowledgement is held like any other (progress.go): a target process
// that sees the write land in its memory and exits at once, without
// closing anything, took the acknowledgement with it, and the writer
// saw RETRY_EXC_ERR for a write that was executed (a NIC acknowledges
// whatever its process does next). So the responder publishes the id of
// a write in the same word, on the same condition, after its checks and
// before the payload lands (publishWrite): over unix sockets in this
// page, over shared memory in a word of the header of the ring the
// requests arrive on (shmAckWords); if the payload then cannot be read
// (a pull that fails, cma.go), it takes the publication back before
// anything else; so does handleReq when the responder does not
// acknowledge it after all. A write placed straight from a unix socket
// into its region (place.go) is published by placeStart before it reads
// the payload; a message of several segments (over a socket, past
// segMax) when its last segment lands: an application that exits on
// seeing its first bytes, before the rest came, loses it, which did not
// fully execute. TCP has no page: between hosts nothing but the socket
// can carry an acknowledgement, and writing one into it before each
// write's payload lands would be a system call per write. A direct write
// over shared memory (shm.go) is copied by the requester after the
// acknowledgement arrived, so nothing lands before it left.
const ackPageSize = 4096

// ackPage is a mapped acknowledgement page.
type ackPage struct {
	mem  []byte
	mine *uint64 // this side's word (written by the consumer, rmu held)
	peer *uint64 // the peer's word (read when the connection fails)
}

// newAckPageFD creates a sealed acknowledgement page.
func newAckPageFD() (fd int, err error) {
	fd, err = unix.MemfdCreate("goverbs-soft-acks", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("soft: memfd_create: %w", err)
	}
	if err = unix.Ftruncate(fd, ackPageSize); err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
	}
	if err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("soft: acknowledgement page: %w", err)
	}
	return fd, nil
}

// newDialerAckPage creates and maps the page of a unix connection's
// dialer, and returns it with its descriptor, to send with HELLO and
// close. Without one (nil, -1) the connection acknowledges at once, as it
// did before pages.
func newDialerAckPage() (*ackPage, int) {
	fd, err := newAckPageFD()
	if err != nil {
		return nil, -1
	}
	p, err := mapAckPage(fd, true)
	if err != nil {
		unix.Close(fd)
		return nil, -1
	}
	return p, fd
}

// checkAckPageFD checks a descriptor received from a peer: a memfd of
// ackPageSize bytes, sealed against resizing.
func checkAckPageFD(fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != ackPageSize {
		return fmt.Errorf("the acknowledgement page is not a %d-byte file", ackPageSize)
	}
	if !mem.Sealed(fd) {
		return errors.New("the acknowledgement page is not a memfd sealed against resizing")
	}
	return nil
}

// mapAckPage maps the page of fd (which the caller closes).
func mapAckPage(fd int, dialer bool) (*ackPage, error) {
	b, err := unix.Mmap(fd, 0, ackPageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("soft: map acknowledgement page: %w", err)
	}
	w0, w1 := (*uint64)(unsafe.Pointer(&b[0])), (*uint64)(unsafe.Pointer(&b[64]))
	if !dialer {
		w0, w1 = w1, w0
	}
	return &ackPage{mem: b, mine: w0, peer: w1}, nil
}

// held publishes that this side holds the acknowledgement of request id.
func (p *ackPage) held(id uint64) { atomic.StoreUint64(p.mine, id) }

// peerHeld is the last request id whose acknowledgement the peer held.
func (p *ackPage) peerHeld() uint64 { return atomic.LoadUint64(p.peer) }

func (p *ackPage) unmap() {
	if p.mem != nil {
		unix.Munmap(p.mem)
		p.mem = nil
	}
}

// shmAckWords are the words of a shared-memory connection in which each
// side publishes the acknowledgements it holds (of receives, and of RDMA
// writes: see Writes): this side's in the header of the ring it
// consumes, the peer's in the other. They belong to the segment (no
// mapping of their own).
func shmAckWords(l *shmLink) *ackPage {
	return &ackPage{mine: l.in.ackWord(), peer: l.out.ackWord()}
}
