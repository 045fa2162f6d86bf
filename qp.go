package verbs

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"github.com/goverbs/verbs/internal/prov"
)

// DefaultQKey is the Q_Key UD queue pairs use unless QPSpec.QKey says otherwise.
const DefaultQKey = 0x11111111

// QPSpec describes a queue pair. Zero values select the documented defaults.
type QPSpec struct {
	// SendCQ receives the completions of send work requests. Required.
	SendCQ *CompletionQueue
	// RecvCQ receives the completions of receives; default SendCQ.
	RecvCQ *CompletionQueue
	// SRQ, when set, supplies the receive buffers (RC and UD).
	SRQ *SharedReceiveQueue

	MaxSendWR     int // outstanding send requests; default 256
	MaxRecvWR     int // outstanding receives; default 256 (ignored with SRQ)
	MaxSendSGE    int // SGEs per send request; default 4
	MaxRecvSGE    int // SGEs per receive; default 4
	MaxInlineData int // bytes a send may inline; default 64, -1 for none

	// SignalAll makes every send request generate a completion. Otherwise
	// only requests marked Signaled (and failures) do.
	SignalAll bool

	// Access is the remote access the QP grants to its peer (RC: write,
	// read, atomic; UC: write). Default: all the transport supports. The
	// MR's own access flags must allow the operation too.
	Access Access
	// DenyRemote grants no remote access at all (Access is ignored).
	DenyRemote bool

	// Port is the device port; default 1.
	Port uint8
	// GIDIndex selects the source GID when FixedGID is set. Otherwise the
	// GID is chosen automatically: on Ethernet a RoCE v2 GID, IPv4-mapped
	// first, then global, then link-local.
	GIDIndex int
	FixedGID bool

	// MTU is the path MTU; default: the smaller active MTU of the two ports.
	MTU MTU
	// PSN is the initial send packet sequence number (24 bits); default random.
	PSN uint32
	// QKey is the UD queue key; default DefaultQKey.
	QKey uint32

	// Timeout is the RC local ACK timeout exponent (4.096 µs × 2^Timeout);
	// default 14 (about 67 ms). TimeoutInfinite waits forever. A request
	// that gets no acknowledgement fails with StatusRetryExcErr after
	// the timeout × (RetryCount+1): about 0.54 s by default. soft0 waits
	// at least 250 ms, however small the timeout (its peer's goroutines,
	// unlike a NIC, need the CPU to answer, and a loaded host can
	// deschedule them for tens of milliseconds), and restarts the wait
	// while the peer process shows signs of life (a peer taking in a long
	// message shows it every 31 ms); its timer's granularity is a quarter
	// of the wait (the failure comes up to 25% later), and a quarter in
	// which this process itself did not run is not counted (up to 16 in a
	// row: 4 more waits at most).
	Timeout uint8
	// RetryCount is how often RC retransmits on timeout; default 7.
	// Use -1 for no retries.
	RetryCount int
	// RNRRetry is how often RC retries when the peer has no receive posted:
	// default 7, which means forever. Use -1 for no retries.
	RNRRetry int
	// MinRNRTimer is the RNR back-off this QP asks its peers for, in the IB
	// encoding (1 = 0.01 ms … 12 = 0.64 ms … 31 = 491.52 ms); default 12.
	MinRNRTimer uint8
	// MaxRDAtomic is the number of outstanding RDMA reads and atomics, both
	// as initiator and responder; default min(16, device limit).
	MaxRDAtomic int
}

// TimeoutInfinite for QPSpec.Timeout disables the RC ACK timeout.
const TimeoutInfinite = 0xff

func orDefault(v, d int) int {
	if v == 0 {
		return d
	}
	if v < 0 {
		return 0
	}
	return v
}

// qpCore is the part shared by every queue pair type.
type qpCore struct {
	res       resource
	pd        *ProtectionDomain
	qp        prov.QP
	transport Transport
	spec      QPSpec
	cap       QPCap
	psn       uint32
	port      PortAttr
	gid       GIDEntry
	hasGID    bool
	maxWR     int // the device's max_qp_wr, 0 if unknown: see batchSize
	// The device's max_qp_rd_atom and max_qp_init_rd_atom (0: unknown),
	// the limits of MaxDestRDAtomic and MaxRDAtomic in Modify.
	maxRDAtom, maxInitRDAtom int

	mu    sync.Mutex // single-request helpers
	oneW  [1]prov.SendWR
	oneR  [1]prov.RecvWR
	sgeW  []prov.SGE
	sgeR  []prov.SGE
	pin   runtime.Pinner // the payload of postData
	hold  inlineHold     // the MRs of postOne's inline SGEs
	devNm string
}

// qpPlan is a validated queue pair request: the defaulted spec and the
// provider's creation attributes.
type qpPlan struct {
	op   string
	t    Transport
	spec QPSpec
	init prov.QPInitAttr
	port PortAttr
	// maxWR is the device's max_qp_wr (0: unknown): no queue holds
	// more, so no batch needs more room.
	maxWR int
	// maxRDAtom and maxInitRDAtom are the device's max_qp_rd_atom and
	// max_qp_init_rd_atom (0: unknown).
	maxRDAtom, maxInitRDAtom int
}

// planQP validates spec for a QP of transport t in pd and fills in the
// defaults. It creates nothing.
func planQP(pd *ProtectionDomain, t Transport, spec QPSpec) (qpPlan, error) {
	op := "create " + t.String() + " qp"
	if err := pd.check(op); err != nil {
		return qpPlan{}, err
	}
	name := pd.c.name
	if spec.SendCQ == nil {
		return qpPlan{}, opErr(op, name, fmt.Errorf("QPSpec.SendCQ is required: %w", syscall.EINVAL))
	}
	if spec.RecvCQ == nil {
		spec.RecvCQ = spec.SendCQ
	}
	for _, cq := range []*CompletionQueue{spec.SendCQ, spec.RecvCQ} {
		if cq.c == nil { // a zero CompletionQueue, not from NewCompletionQueue
			return qpPlan{}, cq.res.errClosed(op)
		}
		if cq.c != pd.c {
			return qpPlan{}, opErr(op, name, fmt.Errorf("cq belongs to device %s: %w", cq.c.name, syscall.EINVAL))
		}
		if err := cq.check(op); err != nil {
			return qpPlan{}, err
		}
	}
	if spec.SRQ != nil && t == TransportUC {
		// Verbs allows it, but the soft provider models RC/UD only.
		return qpPlan{}, opErr(op, name, fmt.Errorf("SRQ with UC: %w", ErrNotSupported))
	}
	if spec.Port == 0 {
		spec.Port = 1
	}
	port, err := pd.c.QueryPort(spec.Port)
	if err != nil {
		return qpPlan{}, err
	}
	if spec.FixedGID {
		// Refused now rather than by Endpoint or Connect.
		table, err := pd.c.GIDTable(spec.Port)
		if err != nil {
			return qpPlan{}, err
		}
		if _, err := chooseGID(table, port.LinkLayer, true, spec.GIDIndex); err != nil {
			return qpPlan{}, opErr(op, name, fmt.Errorf("port %d: %w", spec.Port, err))
		}
	}
	dev, err := pd.c.QueryDevice()
	if err != nil {
		return qpPlan{}, err
	}
	if err := checkSpecRanges(&spec, dev); err != nil {
		return qpPlan{}, opErr(op, name, fmt.Errorf("%w: %w", err, syscall.EINVAL))
	}
	cap := prov.QPCap{
		MaxSendWR:     orDefault(spec.MaxSendWR, 256),
		MaxRecvWR:     orDefault(spec.MaxRecvWR, 256),
		MaxSendSGE:    orDefault(spec.MaxSendSGE, 4),
		MaxRecvSGE:    orDefault(spec.MaxRecvSGE, 4),
		MaxInlineData: orDefault(spec.MaxInlineData, 64),
	}
	if dev.MaxSGE > 0 {
		cap.MaxSendSGE = min(cap.MaxSendSGE, dev.MaxSGE)
		cap.MaxRecvSGE = min(cap.MaxRecvSGE, dev.MaxSGE)
	}
	if dev.MaxInlineData > 0 && spec.MaxInlineData == 0 {
		cap.MaxInlineData = min(cap.MaxInlineData, dev.MaxInlineData)
	}
	init := prov.QPInitAttr{Type: prov.QPType(t), SendCQ: spec.SendCQ.cq, RecvCQ: spec.RecvCQ.cq, Cap: cap, SignalAll: spec.SignalAll}
	if spec.SRQ != nil {
		if err := spec.SRQ.check(op); err != nil {
			return qpPlan{}, err
		}
		if c := spec.SRQ.pd.c; c != pd.c {
			return qpPlan{}, opErr(op, name, fmt.Errorf("srq belongs to another device context (%s): %w", c.name, syscall.EINVAL))
		}
		init.SRQ = spec.SRQ.srq
		init.Cap.MaxRecvWR, init.Cap.MaxRecvSGE = 0, 0
	}
	if spec.MaxRDAtomic == 0 {
		spec.MaxRDAtomic = 16
		if dev.MaxQPRDAtom > 0 {
			spec.MaxRDAtomic = min(16, dev.MaxQPRDAtom, max(dev.MaxQPInitRDAtom, 1))
		}
	}
	if spec.QKey == 0 {
		spec.QKey = DefaultQKey
	}
	if spec.MinRNRTimer == 0 {
		spec.MinRNRTimer = 12
	}
	if spec.Timeout == 0 {
		spec.Timeout = 14
	}
	if spec.PSN == 0 {
		var b [4]byte
		rand.Read(b[:])
		spec.PSN = binary.LittleEndian.Uint32(b[:]) & 0xFFFFFF
	}
	return qpPlan{op: op, t: t, spec: spec, init: init, port: port, maxWR: dev.MaxQPWR,
		maxRDAtom: dev.MaxQPRDAtom, maxInitRDAtom: dev.MaxQPInitRDAtom}, nil
}

// checkSpecRanges refuses QPSpec values that do not fit the fields of
// the QP attributes they become (a wider int would otherwise be truncated
// silently: a RetryCount of 256 would mean no retries), or that the
// device cannot grant, before anything is created: Connect would
// otherwise find them only after moving the QP to RTR.
func checkSpecRanges(spec *QPSpec, dev DeviceAttr) error {
	switch {
	case spec.Timeout > 31 && spec.Timeout != TimeoutInfinite:
		return fmt.Errorf("QPSpec.Timeout %d: want 0..31 or TimeoutInfinite", spec.Timeout)
	case spec.RetryCount < -1 || spec.RetryCount > 7:
		return fmt.Errorf("QPSpec.RetryCount %d: want 0..7, or -1 for no retries", spec.RetryCount)
	case spec.RNRRetry < -1 || spec.RNRRetry > 7:
		return fmt.Errorf("QPSpec.RNRRetry %d: want 0..7 (7: retry forever), or -1 for no retries", spec.RNRRetry)
	case spec.MinRNRTimer > 31:
		return fmt.Errorf("QPSpec.MinRNRTimer %d: want 0..31", spec.MinRNRTimer)
	case spec.PSN > 0xFFFFFF:
		return fmt.Errorf("QPSpec.PSN %#x: want 24 bits (0 for a random one)", spec.PSN)
	case spec.MTU != 0 && spec.MTU.Bytes() == 0:
		return fmt.Errorf("QPSpec.MTU %d: want one of MTU256..MTU4096 (a constant, not a number of bytes), or 0", spec.MTU)
	}
	limit := math.MaxUint8
	if dev.MaxQPRDAtom > 0 {
		limit = min(limit, dev.MaxQPRDAtom)
	}
	if dev.MaxQPInitRDAtom > 0 {
		limit = min(limit, dev.MaxQPInitRDAtom)
	}
	if spec.MaxRDAtomic < 0 || spec.MaxRDAtomic > limit {
		return fmt.Errorf("QPSpec.MaxRDAtomic %d: want 1..%d (0 for the default)", spec.MaxRDAtomic, limit)
	}
	return nil
}

// createProvQP creates the provider QP of a plan.
func (pd *ProtectionDomain) createProvQP(p *qpPlan) (prov.QP, error) {
	pq, err := pd.pd.CreateQP(p.init)
	if err != nil {
		return nil, opErr(p.op, pd.c.name, fmt.Errorf("caps %+v: %w", p.init.Cap, err))
	}
	return pq, nil
}

// adoptQP makes pq, a provider QP created for plan p in pd (by
// createProvQP, or by the connection manager), the QP of q, the core of
// owner: capacities, lifetime tracking under the PD, CQs and SRQ, and
// leak tracing. It leaves the QP's state alone. On failure it closes pq.
func adoptQP[T any](owner *T, q *qpCore, pd *ProtectionDomain, p *qpPlan, pq prov.QP) error {
	spec := p.spec
	q.pd, q.qp, q.transport, q.port, q.devNm = pd, pq, p.t, p.port, pd.c.name
	q.spec, q.psn, q.maxWR = spec, spec.PSN, p.maxWR
	q.maxRDAtom, q.maxInitRDAtom = p.maxRDAtom, p.maxInitRDAtom
	if _, ia, err := pq.Query(); err == nil {
		q.cap = QPCap(ia.Cap)
	} else {
		q.cap = QPCap(p.init.Cap)
	}
	q.sgeW = make([]prov.SGE, max(q.cap.MaxSendSGE, 1))
	q.sgeR = make([]prov.SGE, max(q.cap.MaxRecvSGE, 1))
	// The CQs (and SRQ) count the QP as a child too, so they refuse to
	// close under it.
	parents := []*resource{&pd.res, &spec.SendCQ.res}
	if spec.RecvCQ != spec.SendCQ {
		parents = append(parents, &spec.RecvCQ.res)
	}
	if spec.SRQ != nil {
		parents = append(parents, &spec.SRQ.res)
	}
	if err := initResource(owner, &q.res, p.t.String()+" queue pair", fmt.Sprintf("qpn %d", pq.QPN()), parents...); err != nil {
		pq.Close()
		return err
	}
	return nil
}

// buildQP creates the provider QP of plan p (createProvQP) and adopts
// it into q, the core of owner (adoptQP), holding the objects it is
// created under open meanwhile: the PD, CQs and SRQ, which a concurrent
// Close would otherwise destroy under the provider's create.
func buildQP[T any](owner *T, q *qpCore, pd *ProtectionDomain, p *qpPlan) error {
	parents := []*resource{&pd.res, &p.spec.SendCQ.res}
	if p.spec.RecvCQ != p.spec.SendCQ {
		parents = append(parents, &p.spec.RecvCQ.res)
	}
	if p.spec.SRQ != nil {
		parents = append(parents, &p.spec.SRQ.res)
	}
	if r := enterAll(parents...); r != nil {
		return r.errClosed(p.op)
	}
	defer exitAll(parents...)
	pq, err := pd.createProvQP(p)
	if err != nil {
		return err
	}
	return adoptQP(owner, q, pd, p, pq)
}

// initQP creates the provider QP into q, the core of owner, and moves it
// to INIT.
func initQP[T any](owner *T, q *qpCore, pd *ProtectionDomain, t Transport, spec QPSpec) error {
	p, err := planQP(pd, t, spec)
	if err != nil {
		return err
	}
	if err := buildQP(owner, q, pd, &p); err != nil {
		return err
	}
	// RESET -> INIT.
	a := QPAttr{State: StateInit, PKeyIndex: 0, Port: q.spec.Port}
	mask := AttrState | AttrPKeyIndex | AttrPort
	if t == TransportUD {
		a.QKey = q.spec.QKey
		mask |= AttrQKey
	} else {
		a.Access = q.remoteAccess()
		mask |= AttrAccessFlags
	}
	if err := q.Modify(a, mask); err != nil {
		q.Close()
		return err
	}
	return nil
}

func (q *qpCore) remoteAccess() Access {
	if q.spec.DenyRemote {
		return 0
	}
	if q.spec.Access != 0 {
		return q.spec.Access
	}
	if q.transport == TransportUC {
		return AccessRemoteWrite
	}
	return AccessRemoteWrite | AccessRemoteRead | AccessRemoteAtomic
}

// QPN returns the queue pair number (also after Close); 0 for a zero
// value, which is no queue pair.
func (q *qpCore) QPN() uint32 {
	if q.qp == nil {
		return 0
	}
	return q.qp.QPN()
}

// Cap returns the capacities the device granted.
func (q *qpCore) Cap() QPCap { return q.cap }

// PD returns the protection domain of the QP.
func (q *qpCore) PD() *ProtectionDomain { return q.pd }

// Link names what carries the QP's traffic once it is connected (in RTR
// or a later state; in ERR, what carried it):
//
//   - on soft0, "local" when the peer QP is in this process and reached
//     directly, otherwise the connection to the peer's process: "shm"
//     (shared memory), "unix" (unix socket), "tcp", or "tls" (TCP,
//     encrypted). soft0 connects to a process on the first request that
//     goes there; until then Link names the kind it will try first, which
//     is the one used unless the attempt fails and soft0 falls back to the
//     next (a process on the same host but in another network namespace
//     cannot reach the peer's unix socket, nor its loopback address, and
//     gets TCP to its other addresses). A connection that breaks is set up
//     again by later requests, possibly over another kind.
//   - on other devices, the device, port and link layer, as
//     "<device>/<port> <link layer>" with link layer "infiniband" or
//     "ethernet" (RoCE): "mlx5_0/1 infiniband", "rxe0/1 ethernet"; just
//     "<device>/<port>" when the port does not say.
//
// Link is "" before the QP is connected (RESET, INIT), after Close, and
// for soft0's UD QPs, which reach each destination on its own path (a UD
// QP of another device names its device and port). It is a diagnostic:
// it may query the device, and is safe for concurrent use.
func (q *qpCore) Link() string {
	if !q.res.enter() {
		return ""
	}
	defer q.res.exit()
	if l, ok := q.qp.(prov.Linker); ok {
		return l.Link()
	}
	a, _, err := q.qp.Query()
	switch st := QPState(a.State); {
	case err != nil, st == StateReset, st == StateInit:
		return ""
	case st == StateError && q.transport != TransportUD && a.DestQPN == 0:
		return "" // it never had a peer
	}
	s := fmt.Sprintf("%s/%d", q.devNm, q.spec.Port)
	if ll := q.port.LinkLayer; ll == LinkLayerInfiniBand || ll == LinkLayerEthernet {
		s += " " + strings.ToLower(ll.String())
	}
	return s
}

// Close destroys the QP; outstanding work requests are dropped without
// completions (like ibv_destroy_qp). Idempotent.
func (q *qpCore) Close() error {
	return q.res.close(func() error { return opErr("destroy qp", q.devNm, q.qp.Close()) })
}

// Query returns the current attributes of the QP.
func (q *qpCore) Query() (QPAttr, error) {
	if !q.res.enter() {
		return QPAttr{}, q.res.errClosed("query qp")
	}
	defer q.res.exit()
	a, _, err := q.qp.Query()
	if err != nil {
		return QPAttr{}, opErr("query qp", q.devNm, err)
	}
	return qpAttrFromProv(a), nil
}

// State returns the current state of the QP.
func (q *qpCore) State() (QPState, error) {
	a, err := q.Query()
	return a.State, err
}

// Modify changes the attributes selected by mask, and the state when mask
// has AttrState. The transition and its required attributes are checked
// against the verbs state table before the device sees them.
func (q *qpCore) Modify(attr QPAttr, mask QPAttrMask) error {
	if !q.res.enter() {
		return q.res.errClosed("modify qp")
	}
	defer q.res.exit()
	_, err := q.modify(attr, mask)
	return opErr("modify qp", q.devNm, err)
}

// modify is Modify on an open QP, its error not yet an *OpError; byDevice
// reports that the device refused attributes the state table allowed.
func (q *qpCore) modify(attr QPAttr, mask QPAttrMask) (byDevice bool, err error) {
	cur, _, err := q.qp.Query()
	if err != nil {
		return false, err
	}
	if err := validateTransition(q.transport, QPState(cur.State), &attr, mask); err != nil {
		return false, fmt.Errorf("qpn %d: %v: %w", q.QPN(), err, syscall.EINVAL)
	}
	if err := checkAttrRanges(&attr, mask, q.maxRDAtom, q.maxInitRDAtom); err != nil {
		return false, fmt.Errorf("qpn %d: %v: %w", q.QPN(), err, syscall.EINVAL)
	}
	pa := attr.prov()
	if err := q.qp.Modify(&pa, prov.QPAttrMask(mask)); err != nil {
		return true, fmt.Errorf("qpn %d to %s: %w", q.QPN(), attr.State, err)
	}
	return false, nil
}

// sourceGID picks the GID this QP sends from.
func (q *qpCore) sourceGID() (GIDEntry, error) {
	if q.hasGID {
		return q.gid, nil
	}
	table, err := q.pd.c.GIDTable(q.spec.Port)
	if err != nil {
		return GIDEntry{}, err
	}
	e, err := chooseGID(table, q.port.LinkLayer, q.spec.FixedGID, q.spec.GIDIndex)
	if err != nil {
		return GIDEntry{}, opErr("choose source gid", q.devNm, fmt.Errorf("port %d: %w", q.spec.Port, err))
	}
	q.gid, q.hasGID = e, true
	return e, nil
}

// chooseGID selects the source GID: the fixed index if asked for; on
// InfiniBand index 0; on Ethernet RoCE v2 before v1, and within a type
// IPv4-mapped, then global, then link-local.
func chooseGID(table []GIDEntry, ll LinkLayer, fixed bool, index int) (GIDEntry, error) {
	if fixed {
		for _, e := range table {
			if e.Index == index {
				return e, nil
			}
		}
		return GIDEntry{}, fmt.Errorf("gid index %d is not a valid entry of the GID table (%d valid entries; see `goverbs devinfo -v`): %w", index, len(table), syscall.EINVAL)
	}
	if len(table) == 0 {
		if ll == LinkLayerInfiniBand {
			return GIDEntry{}, nil // LID routing works without a GID
		}
		return GIDEntry{}, fmt.Errorf("the GID table is empty: on RoCE, give the network device an IP address or bring it up")
	}
	if ll != LinkLayerEthernet {
		return table[0], nil
	}
	rank := func(e GIDEntry) int {
		r := 0
		if e.Type != GIDTypeRoCEv2 {
			r += 10
		}
		switch {
		case e.GID.IsIPv4Mapped():
		case !e.GID.IsLinkLocal():
			r += 1
		default:
			r += 2
		}
		return r
	}
	best := table[0]
	for _, e := range table[1:] {
		if rank(e) < rank(best) {
			best = e
		}
	}
	return best, nil
}

// Endpoint returns what a peer needs to connect to (or address) this QP.
func (q *qpCore) Endpoint() (Endpoint, error) {
	if !q.res.enter() {
		return Endpoint{}, q.res.errClosed("endpoint")
	}
	defer q.res.exit()
	g, err := q.sourceGID()
	if err != nil {
		return Endpoint{}, err
	}
	mtu := q.port.ActiveMTU
	if q.spec.MTU != 0 {
		mtu = min(mtu, q.spec.MTU)
	}
	e := Endpoint{
		Version: EndpointVersion, Transport: q.transport, LinkLayer: q.port.LinkLayer, Port: q.spec.Port,
		GIDIndex: uint8(g.Index), GID: g.GID, LID: q.port.LID, QPN: q.QPN(), PSN: q.psn, MTU: mtu,
		Addr: q.qp.Address(),
	}
	if q.transport == TransportUD {
		e.QKey = q.spec.QKey
	}
	return e, nil
}

// ConnectOptions adjust how Connect addresses the peer. The zero value is
// automatic addressing.
type ConnectOptions struct {
	// ForceGRH adds a GRH even on InfiniBand (needed across subnets).
	ForceGRH bool
	// HopLimit of the GRH; default 64. On RoCE the kernel replaces it by
	// the hop limit of its IP route to the peer's GID.
	HopLimit uint8
	// TrafficClass of the GRH.
	TrafficClass uint8
	// ServiceLevel on InfiniBand (RoCE: priority).
	ServiceLevel uint8
}

// addressTo builds the address vector to reach remote.
func (q *qpCore) addressTo(remote Endpoint, o ConnectOptions) (AHAttr, error) {
	ah := AHAttr{Port: q.spec.Port, SL: o.ServiceLevel, ProviderAddr: remote.Addr}
	useGRH := o.ForceGRH || q.port.LinkLayer != LinkLayerInfiniBand || remote.LinkLayer != LinkLayerInfiniBand
	if q.port.LinkLayer == LinkLayerInfiniBand && remote.LinkLayer == LinkLayerEthernet {
		return ah, fmt.Errorf("local port %d is InfiniBand but the peer is on Ethernet (RoCE): they cannot reach each other", q.spec.Port)
	}
	if q.port.LinkLayer == LinkLayerEthernet && remote.LinkLayer == LinkLayerInfiniBand {
		return ah, fmt.Errorf("local port %d is Ethernet (RoCE) but the peer is on InfiniBand: they cannot reach each other", q.spec.Port)
	}
	if !useGRH {
		if remote.LID == 0 {
			return ah, fmt.Errorf("peer on InfiniBand has LID 0 (is its subnet manager running?)")
		}
		ah.DLID = remote.LID
		return ah, nil
	}
	if remote.GID.IsZero() {
		return ah, fmt.Errorf("peer endpoint has no GID but the path needs a GRH (RoCE or ForceGRH)")
	}
	g, err := q.sourceGID()
	if err != nil {
		return ah, err
	}
	ah.IsGlobal = true
	ah.DGID = remote.GID
	ah.SGIDIndex = uint8(g.Index)
	ah.HopLimit = o.HopLimit
	if ah.HopLimit == 0 {
		ah.HopLimit = 64
	}
	ah.TrafficClass = o.TrafficClass
	ah.DLID = remote.LID
	return ah, nil
}

func (q *qpCore) connect(remote Endpoint, o ConnectOptions) error {
	op := "connect qp"
	if !q.res.enter() {
		return q.res.errClosed(op)
	}
	defer q.res.exit()
	if err := remote.Validate(); err != nil {
		return opErr(op, q.devNm, fmt.Errorf("%w: %w", err, syscall.EINVAL))
	}
	if remote.Transport != q.transport {
		return opErr(op, q.devNm, fmt.Errorf("peer is a %s queue pair, this is %s: %w", remote.Transport, q.transport, syscall.EINVAL))
	}
	ah, err := q.addressTo(remote, o)
	if err != nil {
		return opErr(op, q.devNm, fmt.Errorf("route to %s: %w", remote.GID, err))
	}
	mtu := min(q.port.ActiveMTU, remote.MTU)
	if q.spec.MTU != 0 {
		mtu = min(mtu, q.spec.MTU)
	}
	rtr := QPAttr{State: StateRTR, PathMTU: mtu, DestQPN: remote.QPN, RQPSN: remote.PSN, AH: ah}
	mask := AttrState | AttrAV | AttrPathMTU | AttrDestQPN | AttrRQPSN
	if q.transport == TransportRC {
		rtr.MaxDestRDAtomic = uint8(q.spec.MaxRDAtomic)
		rtr.MinRNRTimer = q.spec.MinRNRTimer
		mask |= AttrMaxDestAtomic | AttrMinRNRTimer
	}
	if byDevice, err := q.modify(rtr, mask); err != nil {
		if byDevice {
			// The device refused the path: say what it was.
			err = fmt.Errorf("%w; %s", err, q.pathInfo(remote, ah, mtu))
		}
		return opErr(op, q.devNm, err)
	}
	rts := QPAttr{State: StateRTS, SQPSN: q.psn}
	mask = AttrState | AttrSQPSN
	if q.transport == TransportRC {
		rts.Timeout = q.spec.Timeout
		if rts.Timeout == TimeoutInfinite {
			rts.Timeout = 0
		}
		rts.RetryCount = uint8(orDefault(q.spec.RetryCount, 7))
		rts.RNRRetry = uint8(orDefault(q.spec.RNRRetry, 7))
		rts.MaxRDAtomic = uint8(q.spec.MaxRDAtomic)
		mask |= AttrTimeout | AttrRetryCount | AttrRNRRetry | AttrMaxRDAtomic
	}
	_, err = q.modify(rts, mask)
	return opErr(op, q.devNm, err)
}

// PostRecv posts one receive whose buffer is the scatter list sgl.
func (q *qpCore) PostRecv(wrid uint64, sgl ...SGE) error {
	if !q.res.enter() {
		return q.res.errClosed("post recv")
	}
	defer q.res.exit()
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(sgl) > len(q.sgeR) {
		return opErr("post recv", q.devNm, fmt.Errorf("%d SGEs exceed max_recv_sge %d: %w", len(sgl), len(q.sgeR), syscall.EINVAL))
	}
	for i, s := range sgl {
		q.sgeR[i] = prov.SGE(s)
	}
	q.oneR[0] = prov.RecvWR{WRID: wrid, NumSGE: uint32(len(sgl))}
	if _, err := q.qp.PostRecv(q.oneR[:], q.sgeR); err != nil {
		return opErr("post recv", q.devNm, err)
	}
	return nil
}

// postOne posts a single send request wr with the scatter list sgl. An
// inline request is checked first, like those of a batch.
func (q *qpCore) postOne(wr prov.SendWR, sgl []SGE) error {
	if !q.res.enter() {
		return q.res.errClosed("post send")
	}
	defer q.res.exit()
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(sgl) > len(q.sgeW) {
		return opErr("post send", q.devNm, fmt.Errorf("%d SGEs exceed max_send_sge %d: %w", len(sgl), len(q.sgeW), syscall.EINVAL))
	}
	for i, s := range sgl {
		q.sgeW[i] = prov.SGE(s)
	}
	wr.SGEIndex, wr.NumSGE = 0, uint32(len(sgl))
	q.oneW[0] = wr
	_, err := checkInline(&q.pd.mrs, &q.hold, q.oneW[:], q.sgeW, nil, q.cap.MaxInlineData)
	if err == nil {
		_, err = q.qp.PostSend(q.oneW[:], q.sgeW)
	}
	q.hold.release()
	return opErr("post send", q.devNm, err)
}

// postData posts a single inline send request wr whose payload is data,
// pinned while the provider copies it.
func (q *qpCore) postData(wr prov.SendWR, data []byte) error {
	if !q.res.enter() {
		return q.res.errClosed("post send")
	}
	defer q.res.exit()
	if len(data) > q.cap.MaxInlineData {
		return opErr("post send", q.devNm, fmt.Errorf("%d bytes of inline data, the queue pair allows %d (max_inline_data): %w",
			len(data), max(q.cap.MaxInlineData, 0), syscall.EINVAL))
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	wr.SGEIndex, wr.NumSGE = 0, 0
	if len(data) > 0 { // empty: a plain send or write of nothing
		wr.Flags |= prov.SendInline
		p := unsafe.Pointer(unsafe.SliceData(data))
		q.pin.Pin(p)
		defer q.pin.Unpin()
		q.sgeW[0] = prov.SGE{Addr: uint64(uintptr(p)), Length: uint32(len(data))}
		wr.NumSGE = 1
	}
	q.oneW[0] = wr
	_, err := q.qp.PostSend(q.oneW[:], q.sgeW)
	return opErr("post send", q.devNm, err)
}

// RCQueuePair is a reliable connected queue pair: send and receive with
// immediate data, RDMA write (with immediate), RDMA read and atomics. It is
// safe for concurrent use.
type RCQueuePair struct{ connectedQP }

// UCQueuePair is an unreliable connected queue pair: send and RDMA write
// (with immediate); no reads, no atomics, no retries: lost or rejected
// messages are dropped silently.
type UCQueuePair struct{ connectedQP }

// UDQueuePair is an unreliable datagram queue pair: sends to any UD QP,
// named by an AddressHandle, QPN and Q_Key, each message at most one MTU.
// Receive buffers must start with 40 bytes of room for the GRH.
type UDQueuePair struct{ qpCore }

// NewRCQueuePair creates a reliable connected QP in the INIT state. Hand
// its Endpoint to the peer and Connect it to the peer's endpoint.
func (pd *ProtectionDomain) NewRCQueuePair(spec QPSpec) (*RCQueuePair, error) {
	q := new(RCQueuePair)
	if err := initQP(q, &q.qpCore, pd, TransportRC, spec); err != nil {
		return nil, err
	}
	return q, nil
}

// NewUCQueuePair creates an unreliable connected QP in the INIT state.
func (pd *ProtectionDomain) NewUCQueuePair(spec QPSpec) (*UCQueuePair, error) {
	q := new(UCQueuePair)
	if err := initQP(q, &q.qpCore, pd, TransportUC, spec); err != nil {
		return nil, err
	}
	return q, nil
}

// NewUDQueuePair creates an unreliable datagram QP and brings it to RTS:
// it needs no connection. Address peers with Destination values.
func (pd *ProtectionDomain) NewUDQueuePair(spec QPSpec) (*UDQueuePair, error) {
	u := new(UDQueuePair)
	if err := initQP(u, &u.qpCore, pd, TransportUD, spec); err != nil {
		return nil, err
	}
	if err := u.Modify(QPAttr{State: StateRTR}, AttrState); err != nil {
		u.Close()
		return nil, err
	}
	if err := u.Modify(QPAttr{State: StateRTS, SQPSN: u.psn}, AttrState|AttrSQPSN); err != nil {
		u.Close()
		return nil, err
	}
	return u, nil
}
