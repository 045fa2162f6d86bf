package soft

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/goverbs/verbs/internal/prov"
)

// fabric is what every soft0 context in this process is attached to: the
// process is one fabric. QPs created in different contexts reach each other
// through it. It holds the process-wide name spaces (QP numbers, memory
// keys, address handles) and this process' provider address.
//
// It is created on first use and lives as long as the process: it is the
// device, not mutable configuration.
type fabric struct {
	id   uint64 // random; identifies this process' fabric in provider addresses
	pid  uint32
	guid uint64
	gids [numGIDs][16]byte
	addr []byte // encoded provider address (see encodeAddr)

	local localLink // the in-process transport

	wakes atomic.Uint64 // completion events delivered (cq.push)

	// testSegDelay (ns) makes the responder sleep before each segment of
	// a message but the last (tests: a slow responder).
	testSegDelay atomic.Int64
	// testTickLate (ns) makes each tick of a RC requester's response
	// timer that late (tests: a stalled requester).
	testTickLate atomic.Int64

	graces graceWatch // the readers in their grace (progress.go)

	keysMu   sync.Mutex
	keyPerm  perm32
	keyIdx   indexPool
	keyGen   []uint16
	mrs      table[mr]
	mrSerial uint64 // keysMu

	qpMu    sync.Mutex
	nextQPN uint32
	qps     table[qp]

	ahMu  sync.Mutex
	ahIdx indexPool
	ahGen []uint32
	ahs   table[ah]

	// The service that connects this process to others (service.go): it
	// runs while a device context is open and someone needed it.
	svcMu sync.Mutex
	nctx  int
	svc   atomic.Pointer[service]
}

const (
	numGIDs = 2

	mrIndexBits = 20 // 1M live MRs
	mrIndexMask = 1<<mrIndexBits - 1
	mrGenMask   = 1<<(32-mrIndexBits) - 1

	maxQPN   = 1<<24 - 1
	firstQPN = 0x11 // QPN 0 and 1 are the special QPs; rxe also starts at 17
)

var (
	fabricOnce sync.Once
	theFabric  *fabric
)

func getFabric() *fabric {
	fabricOnce.Do(func() { theFabric = newFabric() })
	return theFabric
}

func newFabric() *fabric {
	var seed [8 + 6*4]byte
	if _, err := rand.Read(seed[:]); err != nil {
		panic("soft: crypto/rand: " + err.Error())
	}
	f := &fabric{
		id:      binary.LittleEndian.Uint64(seed[:8]),
		pid:     uint32(os.Getpid()),
		nextQPN: firstQPN,
	}
	for i := range f.keyPerm.k {
		f.keyPerm.k[i] = binary.LittleEndian.Uint32(seed[8+4*i:])
	}
	f.keyIdx.limit = 1 << mrIndexBits
	f.ahIdx.limit = 1 << tblIndexBits
	f.local.f = f
	f.guid = fabricGUID(f.id)
	f.gids = portGIDs(f.id)
	f.addr = encodeAddr(f.id, f.pid)
	return f
}

// fabricGUID is the node GUID of the fabric id: a locally administered
// EUI-64.
func fabricGUID(id uint64) uint64 {
	return (id&0x0000ffffffffffff | 0x0200000000000000) &^ 0x0100000000000000
}

// portGIDs returns the GID table of the port of the fabric id, which is
// also what a peer's provider address (which carries the fabric id) says
// about the GIDs of its port.
func portGIDs(id uint64) [numGIDs][16]byte {
	var g [numGIDs][16]byte
	// GID 0: link-local fe80::/64 with the GUID as interface identifier.
	g[0][0], g[0][1] = 0xfe, 0x80
	binary.BigEndian.PutUint64(g[0][8:], fabricGUID(id))
	// GID 1: IPv4-mapped ::ffff:127.0.0.1.
	g[1][10], g[1][11] = 0xff, 0xff
	copy(g[1][12:], []byte{127, 0, 0, 1})
	return g
}

// --- memory keys ---

func (f *fabric) addMR(m *mr) error {
	f.keysMu.Lock()
	defer f.keysMu.Unlock()
	for {
		idx, ok := f.keyIdx.get()
		if !ok {
			return errnof(syscall.ENOMEM, "register mr: too many memory regions (%d)", 1<<mrIndexBits)
		}
		for int(idx) >= len(f.keyGen) {
			f.keyGen = append(f.keyGen, 0)
		}
		f.keyGen[idx] = (f.keyGen[idx] + 1) & mrGenMask
		key := f.keyPerm.encrypt(uint32(f.keyGen[idx])<<mrIndexBits | idx)
		if key == 0 {
			// Avoid handing out key 0, which programs use as "no key".
			f.keyIdx.put(idx)
			continue
		}
		m.key = key
		f.mrSerial++
		m.serial = f.mrSerial
		f.mrs.store(idx, m)
		return nil
	}
}

func (f *fabric) removeMR(m *mr) {
	idx := f.keyPerm.decrypt(m.key) & mrIndexMask
	f.keysMu.Lock()
	if f.mrs.load(idx) == m {
		f.mrs.store(idx, nil)
		f.keyIdx.put(idx)
	}
	f.keysMu.Unlock()
}

// lookupMR returns the live MR whose key is key, or nil. Lock-free.
func (f *fabric) lookupMR(key uint32) *mr {
	m := f.mrs.load(f.keyPerm.decrypt(key) & mrIndexMask)
	if m == nil || m.key != key {
		return nil
	}
	return m
}

// lookupMRCached is lookupMR with a one-entry cache owned by the caller. A
// cached MR is valid while it is not closed: its key cannot be reused
// before Close removes it from the table.
func (f *fabric) lookupMRCached(key uint32, cache **mr) *mr {
	if m := *cache; m != nil && m.key == key && !m.closed.Load() {
		return m
	}
	m := f.lookupMR(key)
	*cache = m
	return m
}

// --- QP numbers ---

func (f *fabric) addQP(q *qp) error {
	f.qpMu.Lock()
	defer f.qpMu.Unlock()
	for range maxQPN {
		n := f.nextQPN
		f.nextQPN++
		if f.nextQPN > maxQPN {
			f.nextQPN = firstQPN
		}
		if f.qps.load(n) == nil {
			q.qpn = n
			f.qps.store(n, q)
			return nil
		}
	}
	return errnof(syscall.ENOMEM, "create qp: out of QP numbers")
}

func (f *fabric) removeQP(q *qp) {
	f.qpMu.Lock()
	if f.qps.load(q.qpn) == q {
		f.qps.store(q.qpn, nil)
	}
	f.qpMu.Unlock()
}

// --- address handles ---

func (f *fabric) addAH(a *ah) error {
	f.ahMu.Lock()
	defer f.ahMu.Unlock()
	idx, ok := f.ahIdx.get()
	if !ok {
		return errnof(syscall.ENOMEM, "create ah: too many address handles")
	}
	for int(idx) >= len(f.ahGen) {
		f.ahGen = append(f.ahGen, 0)
	}
	f.ahGen[idx]++
	if f.ahGen[idx] == 0 {
		f.ahGen[idx] = 1
	}
	a.handle = uint64(f.ahGen[idx])<<32 | uint64(idx)
	f.ahs.store(idx, a)
	return nil
}

func (f *fabric) removeAH(a *ah) {
	idx := uint32(a.handle)
	f.ahMu.Lock()
	if f.ahs.load(idx) == a {
		f.ahs.store(idx, nil)
		f.ahIdx.put(idx)
	}
	f.ahMu.Unlock()
}

func (f *fabric) lookupAH(h uint64) *ah {
	a := f.ahs.load(uint32(h))
	if a == nil || a.handle != h {
		return nil
	}
	return a
}

// resolve finds the transport to the port named by dgid and a peer's
// provider address, and the fabric id of the destination. A nil link with
// a nil error means the destination is well-formed but unreachable (like an
// unresolvable RoCE GID): RC requests to it fail with RETRY_EXC_ERR, UC/UD
// ones are dropped.
//
// The GID routes, as on hardware: the provider address only says how to
// reach the port that owns dgid. A dgid that is not in the GID table of
// the port the address names (a GID edited in an endpoint, or the GID of
// another port) fails with an error wrapping EHOSTUNREACH, as resolving
// the address of an unreachable RoCE GID does. Without a GRH (global
// false: an InfiniBand-like port, ibport.go) the DLID routes instead:
// without a provider address, dlid reaches this process' port if it is
// its LID.
//
// QPs of this process are reached directly unless a transport is forced
// (see ForceTransport); QPs of other processes through the service.
func (f *fabric) resolve(dgid [16]byte, global bool, dlid uint16, paddr []byte) (link, uint64, error) {
	if len(paddr) == 0 {
		// No provider address: route by GID (or LID), like hardware.
		// Only this process' own port is known.
		if !global {
			if infiniBand() && dlid == portLID(f.id) {
				return &f.local, f.id, nil
			}
			return nil, 0, nil
		}
		for i := range f.gids {
			if dgid == f.gids[i] {
				return &f.local, f.id, nil
			}
		}
		return nil, 0, nil
	}
	pa, err := parseAddr(paddr)
	if err != nil {
		return nil, 0, err
	}
	if gids := portGIDs(pa.fabric); global && !slices.Contains(gids[:], dgid) {
		return nil, 0, fmt.Errorf("no route to GID %s: the provider address names a port whose GIDs are %s and %s "+
			"(was the endpoint's GID changed, or taken from another endpoint?): %w",
			gidString(dgid), gidString(gids[0]), gidString(gids[1]), syscall.EHOSTUNREACH)
	}
	kind, err := transportChoice()
	if err != nil {
		return nil, 0, err
	}
	if pa.fabric == f.id && (kind == transportAuto || kind == transportDirect) {
		return &f.local, f.id, nil
	}
	if kind == transportDirect {
		return nil, 0, nil
	}
	s := f.service()
	if s == nil {
		return nil, 0, nil
	}
	return s.peerFor(&pa, kind), pa.fabric, nil
}

// gidString formats a GID as an IPv6 address (IPv4-mapped ones too).
func gidString(g [16]byte) string {
	if isV4Mapped(&g) {
		return "::ffff:" + net.IP(g[12:]).String()
	}
	return net.IP(g[:]).String()
}

func (f *fabric) deviceAttr() prov.DeviceAttr {
	return prov.DeviceAttr{
		FWVersion:         "1.0.0",
		NodeGUID:          f.guid,
		SysImageGUID:      f.guid,
		MaxMRSize:         1 << 47,
		PageSizeCap:       0xfffff000,
		VendorID:          0xffffff, // like rxe: no IEEE OUI
		VendorPartID:      0,
		HWVersion:         0,
		MaxQP:             1 << 16,
		MaxQPWR:           maxQPWR,
		MaxSGE:            maxSGE,
		MaxSGERD:          maxSGE,
		MaxCQ:             1 << 16,
		MaxCQE:            maxCQE,
		MaxMR:             1 << mrIndexBits,
		MaxPD:             1 << 16,
		MaxQPRDAtom:       maxRDAtomic,
		MaxQPInitRDAtom:   maxRDAtomic,
		MaxSRQ:            1 << 16,
		MaxSRQWR:          maxQPWR,
		MaxSRQSGE:         maxSGE,
		MaxAH:             1 << 16,
		MaxPKeys:          1,
		MaxInlineData:     maxInline,
		AtomicCap:         1,
		PhysPortCnt:       1,
		LocalCACKDelay:    15,
		CompletionVectors: 1,
	}
}

const (
	maxQPWR     = 16384
	maxSGE      = 32
	maxCQE      = 65536
	maxRDAtomic = 16
	maxInline   = 1024
	maxMsgSize  = 1 << 31
	portMTU     = prov.MTU4096

	portCapCMSup = 1 << 16
)

func (f *fabric) portAttr() prov.PortAttr {
	return prov.PortAttr{
		State:        prov.PortActive,
		MaxMTU:       portMTU,
		ActiveMTU:    portMTU,
		GIDTableLen:  numGIDs,
		PKeyTableLen: 1,
		MaxMsgSize:   maxMsgSize,
		ActiveWidth:  2,  // 4x
		ActiveSpeed:  32, // EDR
		PhysState:    5,  // LinkUp
		LinkLayer:    prov.LinkLayerEthernet,
		PortCapFlags: portCapCMSup,
	}
}
