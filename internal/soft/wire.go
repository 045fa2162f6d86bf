package soft

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/goverbs/verbs/internal/prov"
)

// The wire protocol of the cross-process transports. Every message is a
// frame: a 16-byte header followed by a body whose layout depends on the
// type, and for some types a payload. The same frames travel over TCP and over
// unix sockets.
// All integers are little endian.
//
//	header  [0:2]  magic 0x4756 ("VG")
//	        [2]    version (wireVersion)
//	        [3]    type
//	        [4:8]  length of body and payload
//	        [8:16] id: request sequence number (REQ, RESP)
//
// Decoders reject frames with another magic or version, an unknown type, a
// length that does not suit the type or exceeds its maximum, and bodies with
// invalid field values; the connection is then dropped.

const (
	wireMagic   = 0x4756
	wireVersion = 7 // 2: the handshake of handshake.go; 3: shared-memory rings skip to the next lap (shm.go); 4: pulled payloads (cma.go); 5: their claims; 6: pulled reads; 7: alive frames
	hdrLen      = 16
)

type frameType uint8

const (
	frHello     frameType = 1  // dialer → acceptor: handshake (body helloLen; handshake.go)
	frChallenge frameType = 2  // acceptor → dialer: handshake (body challengeLen)
	frReq       frameType = 3  // request: body reqBodyLen, then a segment of the payload of a send or write
	frResp      frameType = 4  // response: body respBodyLen, then a segment of the data of a read
	frWake      frameType = 5  // a waiting requester may retry (body wakeLen)
	frMap       frameType = 6  // shm: ask for the memory of an rkey (body mapLen)
	frMapAck    frameType = 7  // shm, over the socket: the answer, with the memfd (body mapAckLen)
	frAuth      frameType = 8  // dialer → acceptor: handshake (body authLen)
	frAuthAck   frameType = 9  // acceptor → dialer: handshake (body authAckLen)
	frPullProbe frameType = 10 // shm, unix: may the peer read this process? (body pullProbeLen; cma.go)
	frPullAck   frameType = 11 // shm (over the socket), unix: the answer (body pullAckLen)
	frAlive     frameType = 12 // a responder is handling the segments of a long message (body aliveLen; conn.showLife)
)

const (
	reqBodyLen   = 112
	respBodyLen  = 16
	wakeLen      = 8
	mapLen       = 8
	mapAckLen    = 32
	pullProbeLen = 16 // the address of 8 bytes, and what they hold
	pullAckLen   = 8  // [0] status (pullOK, pullNo), [1:8] 0
	aliveLen     = 8  // the offset of the segment handled in its message (informational)

	// maxPayload is the largest payload of a frame: a message (the
	// payload of a send or write, the data of a read) longer than that
	// travels in several frames, its segments, as a message travels in
	// packets on a RC or UC wire. So no frame is larger than a fixed size
	// that every receive buffer holds whole (see rxSource), and nothing a
	// peer declares makes a process allocate.
	maxPayload = segMax
	segMax     = 128 << 10

	// maxFrame is the largest frame.
	maxFrame = hdrLen + reqBodyLen + maxPayload
)

type frameHdr struct {
	typ    frameType
	length uint32
	id     uint64
}

func putHdr(b []byte, typ frameType, length uint32, id uint64) {
	binary.LittleEndian.PutUint16(b[0:], wireMagic)
	b[2] = wireVersion
	b[3] = byte(typ)
	binary.LittleEndian.PutUint32(b[4:], length)
	binary.LittleEndian.PutUint64(b[8:], id)
}

var (
	errBadMagic   = errors.New("bad frame magic")
	errBadVersion = errors.New("unsupported frame version")
	errBadType    = errors.New("unknown frame type")
	errBadLength  = errors.New("frame length does not suit its type")
)

// parseHdr decodes and checks a frame header.
func parseHdr(b []byte) (frameHdr, error) {
	var h frameHdr
	if len(b) < hdrLen {
		return h, errBadLength
	}
	if binary.LittleEndian.Uint16(b[0:]) != wireMagic {
		return h, errBadMagic
	}
	if b[2] != wireVersion {
		return h, errBadVersion
	}
	h.typ = frameType(b[3])
	h.length = binary.LittleEndian.Uint32(b[4:])
	h.id = binary.LittleEndian.Uint64(b[8:])
	var ok bool
	switch h.typ {
	case frHello:
		ok = h.length == helloLen
	case frChallenge:
		ok = h.length == challengeLen
	case frAuth:
		ok = h.length == authLen
	case frAuthAck:
		ok = h.length == authAckLen
	case frReq:
		ok = h.length >= reqBodyLen && h.length-reqBodyLen <= maxPayload
	case frResp:
		ok = h.length >= respBodyLen && h.length-respBodyLen <= maxPayload
	case frWake:
		ok = h.length == wakeLen
	case frMap:
		ok = h.length == mapLen
	case frMapAck:
		ok = h.length == mapAckLen
	case frPullProbe:
		ok = h.length == pullProbeLen
	case frPullAck:
		ok = h.length == pullAckLen
	case frAlive:
		ok = h.length == aliveLen
	default:
		return h, errBadType
	}
	if !ok {
		return h, fmt.Errorf("%w: type %d, %d bytes", errBadLength, h.typ, h.length)
	}
	return h, nil
}

// --- REQ ---

//	body    [0]      operation
//	        [1]      QP type of the requester
//	        [2]      flags (req*)
//	        [3]      UD: traffic class   [4] UD: hop limit   [5:8] 0
//	        [8:12]   source QPN          [12:16] destination QPN
//	        [16:20]  PSN of the segment's first packet
//	        [20:24]  packets of the segment
//	        [24:28]  path MTU            [28:32] length of the message
//	        [32:36]  rkey                [36:40] immediate
//	        [40:44]  Q_Key               [44:48] UD: flow label
//	        [48:56]  remote address of the message
//	        [56:64]  compare (FAA: add; a direct write with immediate: the
//	                 serial of the region it was copied into)  [64:72] swap
//	        [72:88]  UD: source GID      [88:104] UD: destination GID
//	        [104:108] offset of the segment in the message  [108:112] 0
//
// A send or write of more than segMax bytes is a sequence of segments:
// frames that repeat the header fields of the message and carry its bytes
// from their offset on, segMax at a time, with reqMore set on all but the
// last. Their PSNs follow each other like those of the message's packets.
// Only the last segment (and a segment the responder refuses) is answered.
// A responder that handles the segments of a RC message slowly sends ALIVE
// frames meanwhile (frAlive: header id the request's, body [0:8] the
// offset of the segment it handled; conn.showLife): they name nothing and
// are skipped, their arrival is a sign of the peer's life (conn.alive).
const (
	reqSolicited = 1 << 0
	reqNoResp    = 1 << 1 // UC, UD: the requester wants no response
	reqDirect    = 1 << 2 // shm RC write or read: no data, the requester copies after the ACK; write with immediate: the requester copied before, compare holds the region's serial
	reqMore      = 1 << 3 // more segments of the message follow
	reqPull      = 1 << 4 // shm, unix RC send or write: the payload is the requester's addresses of its bytes; read: the requester can pull the data (cma.go)
)

// pullPayload reports whether payload bytes fit a pulled request of op:
// a send's or write's claim and 1 to maxSGE pieces, nothing for a read
// (cma.go).
func pullPayload(op reqOp, payload uint32) bool {
	switch {
	case op == opRead:
		return payload == 0
	case hasPayload(op):
		return payload >= pullHead+pullDesc && (payload-pullHead)%pullDesc == 0 && payload <= pullHead+maxSGE*pullDesc
	}
	return false
}

// hasPayload reports whether a request of op carries its message.
func hasPayload(op reqOp) bool { return op <= opWriteImm }

// putReq encodes the body of req (the payload follows it on the wire).
func putReq(b []byte, req *request, flags uint8) {
	b[0] = byte(req.op)
	b[1] = req.qpType
	if req.solicited {
		flags |= reqSolicited
	}
	if req.more {
		flags |= reqMore
	}
	b[2] = flags
	b[3] = req.tclass
	b[4] = req.hopLimit
	b[5], b[6], b[7] = 0, 0, 0
	le := binary.LittleEndian
	le.PutUint32(b[8:], req.srcQPN)
	le.PutUint32(b[12:], req.dstQPN)
	le.PutUint32(b[16:], req.psn)
	le.PutUint32(b[20:], req.npkts)
	le.PutUint32(b[24:], req.mtu)
	le.PutUint32(b[28:], req.length)
	le.PutUint32(b[32:], req.rkey)
	le.PutUint32(b[36:], req.imm)
	le.PutUint32(b[40:], req.qkey)
	le.PutUint32(b[44:], req.flow)
	le.PutUint64(b[48:], req.raddr)
	le.PutUint64(b[56:], req.compare)
	le.PutUint64(b[64:], req.swap)
	copy(b[72:88], req.sgid[:])
	copy(b[88:104], req.dgid[:])
	le.PutUint32(b[104:], req.off)
	le.PutUint32(b[108:], 0)
}

var errBadReq = errors.New("malformed request")

// parseReq decodes a request body and checks it against the payload length
// of its frame: a segment carries segMax bytes, or the rest of its message
// if it is the last. It sets no srcFabric and no waker: the receiver knows
// the peer and decides.
func parseReq(b []byte, payload uint32, req *request) (flags uint8, err error) {
	if len(b) < reqBodyLen {
		return 0, errBadReq
	}
	le := binary.LittleEndian
	*req = request{
		op:        reqOp(b[0]),
		qpType:    b[1],
		solicited: b[2]&reqSolicited != 0,
		tclass:    b[3],
		hopLimit:  b[4],
		srcQPN:    le.Uint32(b[8:]),
		dstQPN:    le.Uint32(b[12:]),
		psn:       le.Uint32(b[16:]),
		npkts:     le.Uint32(b[20:]),
		mtu:       le.Uint32(b[24:]),
		length:    le.Uint32(b[28:]),
		rkey:      le.Uint32(b[32:]),
		imm:       le.Uint32(b[36:]),
		qkey:      le.Uint32(b[40:]),
		flow:      le.Uint32(b[44:]),
		raddr:     le.Uint64(b[48:]),
		compare:   le.Uint64(b[56:]),
		swap:      le.Uint64(b[64:]),
		off:       le.Uint32(b[104:]),
	}
	copy(req.sgid[:], b[72:88])
	copy(req.dgid[:], b[88:104])
	flags = b[2]
	req.more = flags&reqMore != 0
	switch {
	case req.op > opFAA:
		return 0, fmt.Errorf("%w: operation %d", errBadReq, req.op)
	case req.qpType != uint8(prov.QPTypeRC) && req.qpType != uint8(prov.QPTypeUC) && req.qpType != uint8(prov.QPTypeUD):
		return 0, fmt.Errorf("%w: QP type %d", errBadReq, req.qpType)
	case flags&^(reqSolicited|reqNoResp|reqDirect|reqMore|reqPull) != 0 || b[5]|b[6]|b[7] != 0 || le.Uint32(b[108:]) != 0:
		return 0, fmt.Errorf("%w: flags %#x", errBadReq, flags)
	case flags&reqDirect != 0 && (req.op != opWrite && req.op != opRead && req.op != opWriteImm || req.qpType != uint8(prov.QPTypeRC) || flags&(reqNoResp|reqMore) != 0 || payload != 0 || req.off != 0):
		return 0, fmt.Errorf("%w: a direct request must be a RC write, write with immediate or read without payload", errBadReq)
	case flags&reqPull != 0 && (req.qpType != uint8(prov.QPTypeRC) || flags&(reqNoResp|reqMore|reqDirect) != 0 ||
		req.off != 0 || req.length == 0 || !pullPayload(req.op, payload)):
		return 0, fmt.Errorf("%w: a pulled request must be a RC send or write of 1 to %d pieces, or a RC read without payload", errBadReq, maxSGE)
	case req.srcQPN > maxQPN || req.dstQPN > maxQPN || req.psn > psnMask:
		return 0, fmt.Errorf("%w: QPN or PSN exceeds 24 bits", errBadReq)
	case req.length > maxMsgSize:
		return 0, fmt.Errorf("%w: length %d", errBadReq, req.length)
	case req.npkts == 0 || req.npkts > 1<<23:
		return 0, fmt.Errorf("%w: %d packets", errBadReq, req.npkts)
	case req.mtu < 256 || req.mtu > 4096 || req.mtu&(req.mtu-1) != 0:
		return 0, fmt.Errorf("%w: MTU %d", errBadReq, req.mtu)
	}
	req.direct = flags&reqDirect != 0
	if req.direct || flags&reqPull != 0 && req.op != opRead {
		return flags, nil // checked above
	}
	if hasPayload(req.op) {
		// Segments of segMax bytes, the last with the rest.
		want := req.length - min(req.off, req.length)
		if req.more {
			want = segMax
		}
		if req.off%segMax != 0 || req.off > req.length || payload != want || req.more && req.length-req.off <= segMax ||
			(req.more || req.off > 0) && req.qpType == uint8(prov.QPTypeUD) {
			return 0, fmt.Errorf("%w: a segment of %d bytes at %d (more: %v) of a message of %d", errBadReq, payload, req.off, req.more, req.length)
		}
	} else {
		if payload != 0 || req.more || req.off != 0 {
			return 0, fmt.Errorf("%w: payload on a read or atomic", errBadReq)
		}
		if req.op != opRead && req.length != 8 {
			return 0, fmt.Errorf("%w: atomic of %d bytes", errBadReq, req.length)
		}
	}
	return flags, nil
}

// --- RESP ---
//
//	body    [0]     code (resp*)       [1] RNR NAK timer
//	        [2]     flags (respMore)   [3] 0
//	        [4:8]   the requester's QPN
//	        [8:16]  atomics: the prior value; read data: the offset of the
//	                segment in the message
//
// The data of an RDMA read travels in segments like the payload of a
// write (see REQ): ACKs with respMore set and segMax bytes, then one with
// the rest. A read whose region goes away while its data is sent ends
// with a NAK after the segments sent so far. A read that offered to pull
// (reqPull) may instead be answered with one ACK with respPulled set and
// pulledReadLen bytes: the address of the data in the responder's
// memory, and the address and value of its region's claim word (cma.go).

const (
	respMore   = 1 << 0 // read data: more segments follow
	respPulled = 1 << 1 // read: the requester reads the data at the address given (cma.go)

	pulledReadLen = 24
)

func putResp(b []byte, qpn uint32, r *response) {
	b[0] = byte(r.code)
	b[1] = r.rnrTimer
	b[2], b[3] = 0, 0
	if r.more {
		b[2] = respMore
	}
	if r.pulled {
		b[2] |= respPulled
	}
	binary.LittleEndian.PutUint32(b[4:], qpn)
	binary.LittleEndian.PutUint64(b[8:], r.orig)
}

var errBadResp = errors.New("malformed response")

// parseResp decodes a response body and checks it against the payload
// length of its frame: only an ACK carries data, and a segment that
// announces more carries segMax bytes.
func parseResp(b []byte, payload uint32, r *response) (qpn uint32, err error) {
	if len(b) < respBodyLen {
		return 0, errBadResp
	}
	r.code = respCode(b[0])
	r.rnrTimer = b[1]
	r.more = b[2]&respMore != 0
	r.pulled = b[2]&respPulled != 0
	qpn = binary.LittleEndian.Uint32(b[4:])
	r.orig = binary.LittleEndian.Uint64(b[8:])
	if r.code > respStale || r.rnrTimer > 31 || qpn > maxQPN || b[2]&^(respMore|respPulled) != 0 || b[3] != 0 {
		return 0, fmt.Errorf("%w: code %d, RNR timer %d, flags %#x, QPN %#x", errBadResp, r.code, r.rnrTimer, b[2], qpn)
	}
	if r.pulled {
		if r.code != respACK || r.more || payload != pulledReadLen || r.orig != 0 {
			return 0, fmt.Errorf("%w: a pulled read's answer with code %d, %d bytes", errBadResp, r.code, payload)
		}
		return qpn, nil
	}
	if payload > 0 && r.code != respACK || r.more && payload != segMax || payload > 0 && (r.orig%segMax != 0 || r.orig > maxMsgSize-uint64(payload)) {
		return 0, fmt.Errorf("%w: %d bytes of data at %d (more: %v) with code %d", errBadResp, payload, r.orig, r.more, r.code)
	}
	return qpn, nil
}

// --- MAP, MAP_ACK (shared memory) ---

// MAP_ACK results.
const (
	mapOK       = 0
	mapNotShare = 1 // no such region, or it cannot be mapped: go through the service
)

type mapAck struct {
	status uint8
	access prov.Access // the region's access flags
	addr   uint64      // the region's address (iova)
	serial uint64      // the region's serial number (see respond)
	length uint64      // its length; the memfd maps it from offset 0
}

func putMapAck(b []byte, m *mapAck) {
	clear(b[:mapAckLen])
	b[0] = m.status
	binary.LittleEndian.PutUint32(b[4:], uint32(m.access))
	binary.LittleEndian.PutUint64(b[8:], m.addr)
	binary.LittleEndian.PutUint64(b[16:], m.length)
	binary.LittleEndian.PutUint64(b[24:], m.serial)
}

var errBadMap = errors.New("malformed map answer")

func parseMapAck(b []byte) (mapAck, error) {
	var m mapAck
	if len(b) < mapAckLen {
		return m, errBadMap
	}
	m.status = b[0]
	m.access = prov.Access(binary.LittleEndian.Uint32(b[4:]))
	m.addr = binary.LittleEndian.Uint64(b[8:])
	m.length = binary.LittleEndian.Uint64(b[16:])
	m.serial = binary.LittleEndian.Uint64(b[24:])
	if m.status > mapNotShare || m.status == mapOK && (m.length == 0 || m.length > 1<<40 || m.addr+m.length < m.addr) {
		return m, fmt.Errorf("%w: status %d, %d bytes at %#x", errBadMap, m.status, m.length, m.addr)
	}
	return m, nil
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic("soft: crypto/rand: " + err.Error())
	}
	return b
}
