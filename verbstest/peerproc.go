package verbstest

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"testing"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/internal/prov"
	"github.com/goverbs/verbs/internal/provhook"
	"github.com/goverbs/verbs/internal/provproxy"

	"github.com/goverbs/verbs/internal/testproc"
)

// Side B in a peer process (Config.PeerProcessB): the test binary
// re-executed with provproxy.EnvFD naming its end of a unix socket pair,
// on which ServePeerIfRequested serves the soft provider
// (provproxy.Serve). Side B's device context here is a verbs.Context
// over the provproxy client, so the cases use it like any other.

// peerProcess is the peer process of one NewNodes call.
type peerProcess struct {
	cmd    *exec.Cmd
	client *provproxy.Client
	stderr *lockedBuffer
}

// openPeerDevice starts a peer process and opens the device name in it.
// The process is stopped, once every object of the test is closed, when
// the test ends.
func openPeerDevice(t testing.TB, tr *tracker, name string) *verbs.Context {
	t.Helper()
	cmd, err := testproc.Command(nil)
	if err != nil {
		t.Fatalf("verbstest: side B: start the peer process: %v", err)
	}
	p := &peerProcess{cmd: cmd, stderr: &lockedBuffer{}}
	cmd.Stderr = p.stderr
	ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	p.client, err = provproxy.Start(ctx, cmd)
	if err != nil {
		t.Fatalf("verbstest: side B: %v (does the test binary's TestMain call verbstest.ServePeerIfRequested?); stderr:\n%s", err, p.stderr)
	}
	tr.add(levelProcess, fmt.Sprintf("peer process %d of side B", p.client.PID()), p)

	devs, _ := p.client.Devices()
	i := slices.IndexFunc(devs, func(d prov.DeviceInfo) bool { return d.Name == name })
	if i < 0 {
		t.Fatalf("verbstest: side B: the peer process (provider %s) has no device %q: %+v", p.client.Name(), name, devs)
	}
	pc, err := p.client.Open(name)
	if err != nil {
		t.Fatalf("verbstest: side B: open %s in the peer process: %v", name, err)
	}
	v, err := provhook.NewContext(pc, devs[i], p.client.Name())
	if err != nil {
		pc.Close()
		t.Fatalf("verbstest: side B: %v", err)
	}
	c := v.(*verbs.Context)
	tr.add(levelContext, fmt.Sprintf("device context %s of side B (in peer process %d)", name, p.client.PID()), c)
	return c
}

// Close ends the connection, which makes the peer close what is left and
// exit, and waits for it (waitPeer: a peer that does not exit cleanly is an
// error).
func (p *peerProcess) Close() error {
	p.client.Close()
	return waitPeer(p.cmd, p.stderr, "its connection closing", false)
}
