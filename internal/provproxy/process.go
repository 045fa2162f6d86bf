package provproxy

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"

	"github.com/goverbs/verbs/internal/prov"
)

// EnvFD is the environment variable through which Start tells the peer
// process which of its file descriptors is its end of the connection.
const EnvFD = "GOVERBS_PROVPROXY_FD"

// Start starts cmd as the peer process that serves the provider objects
// of a new Client: it passes the server's end of a new connection in
// cmd.ExtraFiles, says which descriptor it is in EnvFD (added to
// cmd.Env, or to this process' environment if cmd.Env is nil), and
// greets the server, bounded by ctx. The peer process must call ServeEnv.
// On error a process that was started is killed and waited for; on
// success, the caller waits for it (it exits when the Client is closed).
func Start(ctx context.Context, cmd *exec.Cmd) (*Client, error) {
	local, remote, err := Pair()
	if err != nil {
		return nil, err
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, remote)
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, EnvFD+"="+strconv.Itoa(2+len(cmd.ExtraFiles)))
	err = cmd.Start()
	// The child has its copy: without this one, the client sees the end
	// of the connection when the child exits.
	remote.Close()
	if err != nil {
		local.Close()
		return nil, fmt.Errorf("provproxy: start peer process: %w", err)
	}
	c, err := NewClient(ctx, local)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("%w (the peer process must call provproxy.ServeEnv first thing)", err)
	}
	return c, nil
}

// ServeEnv serves provider p (Serve) on the descriptor that EnvFD names,
// if it is set, and returns served true with Serve's error once the
// client closed the connection. Without EnvFD it returns false at once.
func ServeEnv(p prov.Provider) (served bool, err error) {
	s := os.Getenv(EnvFD)
	if s == "" {
		return false, nil
	}
	os.Unsetenv(EnvFD) // not for the server's own children
	fd, err := strconv.Atoi(s)
	if err != nil || fd < 3 {
		return true, fmt.Errorf("provproxy: %s=%q: want a descriptor number from 3", EnvFD, s)
	}
	return true, Serve(os.NewFile(uintptr(fd), "provproxy-server"), p)
}
