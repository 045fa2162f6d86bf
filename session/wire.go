package session

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/goverbs/verbs"
)

// What travels on a session's two queue pairs.
//
// The data queue pair carries the application's messages: each is an
// RDMA write with immediate data into the next slot of the receiver's
// ring (a window of ReceiveBuffers slots of SlotSize bytes, granted for
// remote write at setup; the immediate data is the slot's number, and
// message k goes to slot k mod ReceiveBuffers), which consumes one of
// the receiver's receives (posted without buffers). The write lands
// hdrAt (48) bytes into the slot, so that a payload after its header
// starts at payOff (64), on a cache line, as it does in the sender's
// buffers (a 64 KiB payload copied to 16 bytes into the slot cost
// soft0's unix sockets a tenth more in process_vm_readv: its copy then
// stores across cache lines). It starts with a header:
//
//	[0]     kind: dataEager (the payload follows the header), dataRTS
//	        (a rendezvous: the receiver reads the payload) or dataWrite
//	        (the notice of a WriteImm)
//	[1]     flags: hdrHasImm
//	[2:4]   zero
//	[4:8]   the sender's credits for the reverse direction: how many
//	        of its ring slots it has given back so far (a wrapping
//	        count; it saves the peer waiting for a credit write)
//	[8:12]  eager: payload length; rendezvous: message length; notice:
//	        the length written
//	[12:16] the application's immediate data (hdrHasImm)
//
// and a rendezvous adds [16:24] the address, [24:28] the rkey of a
// window the receiver may read the message from, [28:32] zero, [32:40]
// its id, which the receiver's agent returns in a ctrlFin when it has
// read it.
//
// The control queue pair carries the agents' messages, fixed size
// (ctrlHdr bytes, then an error text in ctrlErr):
//
//	[0]     type (ctrl*)
//	[1]     code (errors: errCode*)
//	[2:4]   access rights (verbs.Access)
//	[4:8]   the sender's control credits (as [4:8] above)
//	[8:16]  request id (the requester's; echoed in the answer)
//	[16:24] grant id (the granter's)
//	[24:32] address
//	[32:40] length
//	[40:44] rkey
//	[44:48] length of the error text that follows the header
//	[48:56] lease, nanoseconds
const (
	dataEager = 1
	dataRTS   = 2
	dataWrite = 3 // the notice of a WriteImm (length and immediate data)

	hdrHasImm = 1 // header flag: [12:16] is immediate data

	dataHdr = 16
	rtsHdr  = 40
	hdrAt   = payOff - dataHdr // where a data write lands in a slot
	payOff  = 64               // where an eager payload starts, in a slot and in a send buffer

	ctrlHdr     = 56
	ctrlTextMax = 200
	ctrlBufSize = ctrlHdr + ctrlTextMax
)

// Control message types.
const (
	ctrlRequest  = 1 // RequestRemoteMR: grant me len bytes with access for lease
	ctrlGrant    = 2 // the answer: a region (grant id, address, length, rkey, access, lease)
	ctrlOffer    = 3 // SendLocalMR: a region for the peer's ReceiveRemoteMR
	ctrlHandBack = 4 // SendRemoteMR: the grantee hands the region back to its owner
	ctrlRelease  = 5 // the grantee gives up a region (RemoteMR.Release)
	ctrlRevoke   = 6 // the granter ends a grant early (Session.Revoke)
	ctrlAck      = 7 // the request id was done
	ctrlErr      = 8 // the request id failed: code and text
	ctrlFin      = 9 // the rendezvous id was read
)

// Error codes of ctrlErr.
const (
	errCodeLimit    = 1 // over a cap of the granter
	errCodeNoMemory = 2 // the granter could not allocate or register
	errCodeUnknown  = 3 // no such grant
	errCodeBusy     = 4 // the peer's queue of offers is full
	errCodeAccess   = 5 // access the region does not allow
	errCodeProtocol = 6
)

type ctrlMsg struct {
	typ, code uint8
	access    verbs.Access
	credits   uint32
	id        uint64
	grant     uint64
	addr      uint64
	len       uint64
	rkey      uint32
	lease     time.Duration
	text      string
}

// put encodes m into b (ctrlBufSize bytes) and returns the length.
func (m *ctrlMsg) put(b []byte) int {
	clear(b[:ctrlHdr])
	b[0], b[1] = m.typ, m.code
	binary.LittleEndian.PutUint16(b[2:], uint16(m.access))
	binary.LittleEndian.PutUint32(b[4:], m.credits)
	binary.LittleEndian.PutUint64(b[8:], m.id)
	binary.LittleEndian.PutUint64(b[16:], m.grant)
	binary.LittleEndian.PutUint64(b[24:], m.addr)
	binary.LittleEndian.PutUint64(b[32:], m.len)
	binary.LittleEndian.PutUint32(b[40:], m.rkey)
	t := m.text
	if len(t) > ctrlTextMax {
		t = t[:ctrlTextMax]
	}
	binary.LittleEndian.PutUint32(b[44:], uint32(len(t)))
	binary.LittleEndian.PutUint64(b[48:], uint64(m.lease))
	copy(b[ctrlHdr:], t)
	return ctrlHdr + len(t)
}

// parseCtrl decodes a control message of n bytes; a malformed one is an
// error (ErrProtocol), never a panic.
func parseCtrl(b []byte) (ctrlMsg, error) {
	var m ctrlMsg
	if len(b) < ctrlHdr {
		return m, fmt.Errorf("%w: control message of %d bytes (at least %d)", ErrProtocol, len(b), ctrlHdr)
	}
	m.typ, m.code = b[0], b[1]
	if m.typ < ctrlRequest || m.typ > ctrlFin {
		return m, fmt.Errorf("%w: control message type %d", ErrProtocol, m.typ)
	}
	m.access = verbs.Access(binary.LittleEndian.Uint16(b[2:]))
	m.credits = binary.LittleEndian.Uint32(b[4:])
	m.id = binary.LittleEndian.Uint64(b[8:])
	m.grant = binary.LittleEndian.Uint64(b[16:])
	m.addr = binary.LittleEndian.Uint64(b[24:])
	m.len = binary.LittleEndian.Uint64(b[32:])
	m.rkey = binary.LittleEndian.Uint32(b[40:])
	tl := int(binary.LittleEndian.Uint32(b[44:]))
	lease := binary.LittleEndian.Uint64(b[48:])
	if lease > uint64(maxLease) {
		return m, fmt.Errorf("%w: lease of %d ns", ErrProtocol, lease)
	}
	m.lease = time.Duration(lease)
	if tl > ctrlTextMax || ctrlHdr+tl > len(b) {
		return m, fmt.Errorf("%w: error text of %d bytes in a message of %d", ErrProtocol, tl, len(b))
	}
	m.text = sanitize(b[ctrlHdr : ctrlHdr+tl])
	return m, nil
}

// maxLease bounds a lease on the wire (a year).
const maxLease = 365 * 24 * time.Hour

// sanitize keeps printable ASCII of a peer's text.
func sanitize(b []byte) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c >= 0x20 && c < 0x7f {
			out = append(out, c)
		} else {
			out = append(out, '?')
		}
	}
	return string(out)
}

func putDataHdr(b []byte, kind uint8, credits uint32, n uint32) { // flags and immediate data: zero
	clear(b[:dataHdr])
	b[0] = kind
	binary.LittleEndian.PutUint32(b[4:], credits)
	binary.LittleEndian.PutUint32(b[8:], n)
}

func putRTS(b []byte, credits uint32, n uint32, addr uint64, rkey uint32, id uint64) {
	putDataHdr(b, dataRTS, credits, n)
	clear(b[dataHdr:rtsHdr])
	binary.LittleEndian.PutUint64(b[16:], addr)
	binary.LittleEndian.PutUint32(b[24:], rkey)
	binary.LittleEndian.PutUint64(b[32:], id)
}
