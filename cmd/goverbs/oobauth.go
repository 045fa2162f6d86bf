package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/goverbs/verbs/internal/pintls"
)

// The token handshake of the out-of-band exchange (see oob.go): TLS 1.3,
// then the client's proof, then the server's.

const (
	tokenLabel      = "EXPORTER-goverbs-bench-token"
	tokenRoleClient = "goverbs bench client"
	tokenRoleServer = "goverbs bench server"
	authTimeout     = 10 * time.Second
)

// errToken: the peer does not hold the token.
var errToken = errors.New("the peer does not hold the token (--token / " + envBenchToken + ")")

// benchIdentity is the server's TLS identity, made once per process.
var benchIdentity = sync.OnceValues(pintls.NewIdentity)

// secureServer runs the server's side on c: nothing but the TLS handshake
// is sent before the client proved the token.
func secureServer(ctx context.Context, c net.Conn, token string) (net.Conn, error) {
	id, err := benchIdentity()
	if err != nil {
		return nil, err
	}
	tc := tls.Server(c, id.ServerConfig())
	return tokenExchange(ctx, tc, token, true)
}

// secureClient runs the client's side on c.
func secureClient(ctx context.Context, c net.Conn, token string) (net.Conn, error) {
	tc := tls.Client(c, pintls.UnpinnedClientConfig())
	return tokenExchange(ctx, tc, token, false)
}

func tokenExchange(ctx context.Context, tc *tls.Conn, token string, server bool) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, authTimeout)
	defer cancel()
	if err := pintls.Handshake(ctx, tc, authTimeout); err != nil {
		var rh tls.RecordHeaderError
		if !server && errors.As(err, &rh) {
			return nil, fmt.Errorf("the server does not speak TLS: does it run without --token? (%w)", err)
		}
		return nil, fmt.Errorf("TLS: %w", err)
	}
	b, err := pintls.Binding(tc, tokenLabel)
	if err != nil {
		return nil, err
	}
	dl, _ := ctx.Deadline()
	tc.SetDeadline(dl)
	defer tc.SetDeadline(time.Time{})
	key := []byte(token)
	mine, theirs := tokenRoleClient, tokenRoleServer
	if server {
		mine, theirs = theirs, mine
	}
	var got [32]byte
	if server {
		// The client proves first: a stranger learns nothing.
		if _, err := io.ReadFull(tc, got[:]); err != nil {
			return nil, fmt.Errorf("reading the client's token proof: %w", err)
		}
		if !pintls.Equal(got, pintls.Prove(key, theirs, b)) {
			return nil, errToken
		}
	}
	p := pintls.Prove(key, mine, b)
	if _, err := tc.Write(p[:]); err != nil {
		return nil, fmt.Errorf("sending the token proof: %w", err)
	}
	if !server {
		if _, err := io.ReadFull(tc, got[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return nil, fmt.Errorf("the server closed the connection after the token proof: %w", errToken)
			}
			return nil, fmt.Errorf("reading the server's token proof: %w", err)
		}
		if !pintls.Equal(got, pintls.Prove(key, theirs, b)) {
			return nil, errToken
		}
	}
	return tc, nil
}
