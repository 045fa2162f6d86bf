package verbstest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/provproxy"
	"github.com/goverbs/verbs/internal/soft"

	"github.com/goverbs/verbs/internal/testproc"
)

// A peer process for cross-process tests: the test binary re-executed with
// EnvPeer set, serving commands on its standard input (one JSON object a
// line) and answering on its standard output. The test process drives one
// side of every case; the peer holds the other side's queue pairs, memory
// and completion queues in its own address space, so every byte between the
// two crosses the provider's inter-process transport.
//
// A test package that uses StartPeer calls ServePeerIfRequested first thing
// in its TestMain.

// EnvPeer is the environment variable that makes a test binary a peer.
const EnvPeer = "GOVERBS_VERBSTEST_PEER"

// ServePeerIfRequested serves and exits if the process was started as a
// peer: by StartPeer (peer commands), or as the peer process of side B
// (Config.PeerProcessB: the soft provider's objects, see
// internal/provproxy). Otherwise it returns at once. Call it first thing
// in TestMain.
func ServePeerIfRequested() {
	if served, err := provproxy.ServeEnv(soft.New()); served {
		if err != nil {
			fmt.Fprintln(os.Stderr, "verbstest peer process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(EnvPeer) != "1" {
		return
	}
	if err := ServePeer(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "verbstest peer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// PeerReq is one command to a peer.
type PeerReq struct {
	Op     string          `json:"op"`
	ID     int             `json:"id,omitempty"`     // the side
	Device string          `json:"device,omitempty"` // new: the device (default soft0)
	Type   string          `json:"type,omitempty"`   // new: "rc", "uc" or "ud"
	Size   int             `json:"size,omitempty"`   // new: MR size
	Access verbs.Access    `json:"access,omitempty"` // new: MR access
	Go     bool            `json:"go,omitempty"`     // new: the MR is Go memory (Register), not Alloc
	Spec   *verbs.QPSpec   `json:"spec,omitempty"`   // new: QP spec (CQ fields ignored)
	EP     *verbs.Endpoint `json:"ep,omitempty"`     // connect, ah
	WRID   uint64          `json:"wrid,omitempty"`
	Off    int             `json:"off,omitempty"`
	Len    int             `json:"len,omitempty"`
	Kind   string          `json:"kind,omitempty"` // post: send, sendimm, write, writeimm, read, cas, faa
	Remote verbs.RemoteAddr
	Imm    uint32 `json:"imm,omitempty"`
	A1, A2 uint64 // cas: compare, swap; faa: add
	QPN    uint32 `json:"qpn,omitempty"`
	QKey   uint32 `json:"qkey,omitempty"`
	N      int    `json:"n,omitempty"`
	MS     int    `json:"ms,omitempty"`
	Data   []byte `json:"data,omitempty"`
	Count  int    `json:"count,omitempty"` // post: repeat
}

// PeerResp is a peer's answer.
type PeerResp struct {
	Err    string             `json:"err,omitempty"`
	ID     int                `json:"id,omitempty"`
	EP     *verbs.Endpoint    `json:"ep,omitempty"`
	Region verbs.RemoteRegion `json:"region"`
	WCs    []verbs.Completion `json:"wcs,omitempty"`
	Data   []byte             `json:"data,omitempty"`
	State  string             `json:"state,omitempty"`
	PID    int                `json:"pid,omitempty"`
	Links  []soft.LinkInfo    `json:"links,omitempty"`
	Link   string             `json:"link,omitempty"` // link: the side's QP Link
}

// peerSide is one side held by a peer.
type peerSide struct {
	ctx *verbs.Context
	pd  *verbs.ProtectionDomain
	cq  *verbs.CompletionQueue
	mr  *verbs.MemoryRegion
	rc  *verbs.RCQueuePair
	uc  *verbs.UCQueuePair
	ud  *verbs.UDQueuePair
	ah  *verbs.AddressHandle
}

func (s *peerSide) close() {
	closeIf(s.ah)
	closeIf(s.rc)
	closeIf(s.uc)
	closeIf(s.ud)
	closeIf(s.mr)
	closeIf(s.cq)
	closeIf(s.pd)
	closeIf(s.ctx)
}

// closeIf closes c unless it is nil (a nil pointer in an interface is not
// a nil interface, so the check needs the pointer type).
func closeIf[P interface {
	*E
	Close() error
}, E any](c P) {
	if c != nil {
		c.Close()
	}
}

// ServePeer serves peer commands from r, answering on w, until r ends.
func ServePeer(r io.Reader, w io.Writer) error {
	sides := map[int]*peerSide{}
	defer func() {
		for _, s := range sides {
			s.close()
		}
	}()
	next := 1
	dec := json.NewDecoder(bufio.NewReader(r))
	enc := json.NewEncoder(w)
	for {
		var req PeerReq
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var resp PeerResp
		var err error
		if req.Op == "links" {
			resp.Links = soft.Links()
		} else if req.Op == "new" {
			var s *peerSide
			s, resp, err = newPeerSide(&req)
			if err == nil {
				sides[next] = s
				resp.ID = next
				next++
			}
		} else if s := sides[req.ID]; s == nil && req.Op != "pid" {
			err = fmt.Errorf("no side %d", req.ID)
		} else {
			err = s.do(&req, &resp)
			if req.Op == "close" {
				delete(sides, req.ID)
			}
		}
		if err != nil {
			resp.Err = err.Error()
		}
		if err := enc.Encode(&resp); err != nil {
			return err
		}
		if req.Op == "exitwhen" && err == nil {
			sides[req.ID].exitWhen(&req) // does not return
		}
	}
}

// exitWhen waits for what an "exitwhen" command names and exits at once,
// closing nothing: Kind "recv", one completion (status 0 if it succeeded,
// 3 if not); Kind "word", the 8 bytes at Off of the side's region holding
// A1 (status 0). Status 4 if it did not come within MS milliseconds.
func (s *peerSide) exitWhen(req *PeerReq) {
	end := time.Now().Add(time.Duration(req.MS) * time.Millisecond)
	switch req.Kind {
	case "recv":
		ctx, cancel := context.WithDeadline(context.Background(), end)
		wcs, err := PollN(ctx, s.cq, 1)
		cancel()
		if err != nil {
			os.Exit(4)
		}
		if wcs[0].Status != verbs.StatusSuccess {
			os.Exit(3)
		}
		os.Exit(0)
	case "word":
		// Written by the device: loaded atomically, as another thread's
		// store.
		w := (*uint64)(unsafe.Pointer(&s.mr.Bytes()[req.Off]))
		for atomic.LoadUint64(w) != req.A1 {
			if time.Now().After(end) {
				os.Exit(4)
			}
		}
		os.Exit(0)
	}
	os.Exit(5)
}

func newPeerSide(req *PeerReq) (s *peerSide, resp PeerResp, err error) {
	s = &peerSide{}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	dev := verbs.SoftDevice
	if req.Device != "" {
		dev = req.Device
	}
	if s.ctx, err = verbs.Open(dev); err != nil {
		return
	}
	if s.pd, err = s.ctx.AllocPD(); err != nil {
		return
	}
	if s.cq, err = s.ctx.NewCompletionQueue(verbs.CQSpec{}); err != nil {
		return
	}
	if req.Size > 0 {
		if req.Go {
			s.mr, err = s.pd.Register(make([]byte, req.Size), req.Access)
		} else {
			s.mr, err = s.pd.Alloc(req.Size, req.Access)
		}
		if err != nil {
			return
		}
		resp.Region = s.mr.Remote()
	}
	var spec verbs.QPSpec
	if req.Spec != nil {
		spec = *req.Spec
	}
	spec.SendCQ, spec.RecvCQ, spec.SRQ = s.cq, nil, nil
	var ep verbs.Endpoint
	switch req.Type {
	case "rc":
		if s.rc, err = s.pd.NewRCQueuePair(spec); err == nil {
			ep, err = s.rc.Endpoint()
		}
	case "uc":
		if s.uc, err = s.pd.NewUCQueuePair(spec); err == nil {
			ep, err = s.uc.Endpoint()
		}
	case "ud":
		if s.ud, err = s.pd.NewUDQueuePair(spec); err == nil {
			ep, err = s.ud.Endpoint()
		}
	default:
		err = fmt.Errorf("QP type %q", req.Type)
	}
	resp.EP = &ep
	return
}

func (s *peerSide) sge(req *PeerReq) ([]verbs.SGE, error) {
	if req.Len == 0 || s.mr == nil {
		return nil, nil
	}
	g, err := s.mr.SGE(req.Off, req.Len)
	if err != nil {
		return nil, err
	}
	return []verbs.SGE{g}, nil
}

func (s *peerSide) do(req *PeerReq, resp *PeerResp) error {
	switch req.Op {
	case "pid":
		resp.PID = os.Getpid()
		return nil
	case "connect":
		switch {
		case s.rc != nil:
			return s.rc.Connect(*req.EP)
		case s.uc != nil:
			return s.uc.Connect(*req.EP)
		case s.ud != nil:
			ah, err := s.ud.AddressHandleTo(*req.EP)
			s.ah = ah
			return err
		}
	case "recv":
		sgl, err := s.sge(req)
		if err != nil {
			return err
		}
		for range max(req.Count, 1) {
			var err error
			switch {
			case s.rc != nil:
				err = s.rc.PostRecv(req.WRID, sgl...)
			case s.uc != nil:
				err = s.uc.PostRecv(req.WRID, sgl...)
			default:
				err = s.ud.PostRecv(req.WRID, sgl...)
			}
			if err != nil {
				return err
			}
		}
		return nil
	case "post":
		for range max(req.Count, 1) {
			if err := s.post(req); err != nil {
				return err
			}
		}
		return nil
	case "poll":
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(req.MS)*time.Millisecond)
		defer cancel()
		wcs, err := PollN(ctx, s.cq, req.N)
		resp.WCs = wcs
		return err
	case "read":
		resp.Data = s.mr.Bytes()[req.Off : req.Off+req.Len]
		return nil
	case "fill":
		copy(s.mr.Bytes()[req.Off:], req.Data)
		return nil
	case "state":
		var st verbs.QPState
		var err error
		switch {
		case s.rc != nil:
			st, err = s.rc.State()
		case s.uc != nil:
			st, err = s.uc.State()
		default:
			st, err = s.ud.State()
		}
		resp.State = st.String()
		return err
	case "link":
		switch {
		case s.rc != nil:
			resp.Link = s.rc.Link()
		case s.uc != nil:
			resp.Link = s.uc.Link()
		default:
			resp.Link = s.ud.Link()
		}
		return nil
	case "close":
		s.close()
		return nil
	case "exitwhen": // answered, then served by exitWhen (ServePeer)
		if req.Kind != "recv" && req.Kind != "word" || req.Kind == "word" && (s.mr == nil || req.Off < 0 || req.Off+8 > s.mr.Len() || req.Off%8 != 0) {
			return fmt.Errorf("exitwhen: kind %q at %d", req.Kind, req.Off)
		}
		return nil
	case "toerr": // RC: move the QP to ERR
		if s.rc == nil {
			return fmt.Errorf("toerr: not a RC QP")
		}
		return s.rc.Modify(verbs.QPAttr{State: verbs.StateError}, verbs.AttrState)
	}
	return fmt.Errorf("unknown command %q", req.Op)
}

func (s *peerSide) post(req *PeerReq) error {
	sgl, err := s.sge(req)
	if err != nil {
		return err
	}
	f := verbs.Signaled
	switch {
	case s.rc != nil:
		q := s.rc
		switch req.Kind {
		case "send":
			return q.PostSend(req.WRID, f, sgl...)
		case "sendimm":
			return q.PostSendImm(req.WRID, f, req.Imm, sgl...)
		case "write":
			return q.PostWrite(req.WRID, f, req.Remote, sgl...)
		case "writeimm":
			return q.PostWriteImm(req.WRID, f, req.Remote, req.Imm, sgl...)
		case "read":
			return q.PostRead(req.WRID, f, req.Remote, sgl...)
		case "cas":
			return q.PostCompareSwap(req.WRID, f, req.Remote, req.A1, req.A2, sgl[0])
		case "faa":
			return q.PostFetchAdd(req.WRID, f, req.Remote, req.A1, sgl[0])
		}
	case s.uc != nil:
		switch req.Kind {
		case "send":
			return s.uc.PostSend(req.WRID, f, sgl...)
		case "write":
			return s.uc.PostWrite(req.WRID, f, req.Remote, sgl...)
		}
	case s.ud != nil:
		if req.Kind == "send" {
			return s.ud.PostSend(req.WRID, f, verbs.Destination{AH: s.ah, QPN: req.QPN, QKey: req.QKey}, sgl...)
		}
	}
	return fmt.Errorf("post %q on this QP type", req.Kind)
}

// Peer is a running peer process (see ServePeerIfRequested).
type Peer struct {
	t      testing.TB
	cmd    *exec.Cmd
	in     io.WriteCloser
	dec    *json.Decoder
	enc    *json.Encoder
	mu     sync.Mutex
	Stderr *lockedBuffer
	killed bool
}

// lockedBuffer keeps a peer's stderr, written by os/exec while tests read
// it.
type lockedBuffer = testproc.SyncBuffer

// StartPeer re-executes the test binary as a peer process with env added
// to the environment, and stops it when the test ends.
func StartPeer(t testing.TB, env ...string) *Peer {
	t.Helper()
	return startPeer(t, nil, env...)
}

// startPeer starts the peer under the command prefix wrap (such as
// ip netns exec NAME), if any.
func startPeer(t testing.TB, wrap []string, env ...string) *Peer {
	t.Helper()
	cmd, err := testproc.Command(wrap, append([]string{EnvPeer + "=1"}, env...)...)
	if err != nil {
		t.Fatalf("verbstest: start peer: %v", err)
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatalf("verbstest: start peer: %v", err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("verbstest: start peer: %v", err)
	}
	p := &Peer{t: t, cmd: cmd, in: in, dec: json.NewDecoder(out), enc: json.NewEncoder(in), Stderr: &lockedBuffer{}}
	cmd.Stderr = p.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("verbstest: start peer: %v", err)
	}
	t.Cleanup(p.Stop)
	return p
}

// PID is the peer's process id.
func (p *Peer) PID() int { return p.cmd.Process.Pid }

// Exited waits for the peer to exit by itself (after "exitwhen") and
// returns its exit status, or -1 if it did not exit within
// DefaultTimeout (it is killed then).
func (p *Peer) Exited() int {
	p.killed = true // waited for here: Stop does not judge its status
	if waitPeer(p.cmd, p.Stderr, "exitwhen", true) != nil {
		return -1
	}
	return p.cmd.ProcessState.ExitCode()
}

// Kill kills the peer with SIGKILL and waits for it.
func (p *Peer) Kill() {
	p.killed = true
	p.cmd.Process.Kill()
	p.cmd.Wait()
}

// Stop ends the peer (closing its standard input, which makes it close
// everything and exit) and waits for it.
func (p *Peer) Stop() {
	p.in.Close()
	if err := waitPeer(p.cmd, p.Stderr, "its input closing", p.killed); err != nil {
		p.t.Errorf("verbstest: %v", err)
	}
}

// waitPeer waits for the peer process cmd, told to exit by what happened
// (for the message), and kills it if it has not exited within
// DefaultTimeout. Unless it was killed on purpose (killed), a peer that
// did not exit cleanly (a failure, a panic, objects left open, a data race
// it found: the race detector makes it exit with status 66) is an error.
func waitPeer(cmd *exec.Cmd, stderr *lockedBuffer, what string, killed bool) error {
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(DefaultTimeout):
		cmd.Process.Kill()
		<-done
		return fmt.Errorf("the peer process did not exit within %v of %s; stderr:\n%s", DefaultTimeout, what, stderr)
	}
	if !killed && !cmd.ProcessState.Success() {
		return fmt.Errorf("the peer process %s; stderr:\n%s", cmd.ProcessState, stderr)
	}
	return nil
}

// Do sends a command and returns the answer; a failed command fails the
// test.
func (p *Peer) Do(req PeerReq) PeerResp {
	p.t.Helper()
	resp, err := p.Try(req)
	if err != nil {
		p.t.Fatalf("verbstest: peer %s: %v", req.Op, err)
	}
	return resp
}

// Try sends a command and returns the answer and its error.
func (p *Peer) Try(req PeerReq) (PeerResp, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var resp PeerResp
	if err := p.enc.Encode(&req); err != nil {
		return resp, fmt.Errorf("send: %w (stderr: %s)", err, p.Stderr)
	}
	if err := p.dec.Decode(&resp); err != nil {
		return resp, fmt.Errorf("receive: %w (stderr: %s)", err, p.Stderr)
	}
	if resp.Err != "" {
		return resp, errors.New(resp.Err)
	}
	return resp, nil
}
