package session

import (
	"fmt"
	"os"
	"time"
)

// Config configures a Listener or a Dial. The zero value is usable: every
// field documents what its zero value means. A negative count, size,
// lease or cap (where the field gives it no meaning) makes Listen and
// Dial fail.
type Config struct {
	// Token is the shared secret both sides must prove, over the
	// handshake, before anything else is read or allocated (HMAC over
	// both sides' nonces, bound to the TLS session when there is one).
	// Empty: no authentication; a Listener on a non-loopback address
	// then logs a warning once.
	Token []byte

	// TLS is the bootstrap connection's encryption: "auto" (or ""):
	// TLS 1.3 when the peer's address is not a loopback one; "on":
	// always; "off": never. The certificate is ephemeral and not
	// verified: the token proof, bound to the TLS session, authenticates
	// the peer (as soft0 does for its own traffic).
	TLS string

	// Device names the RDMA device to use ("soft0", "rxe0", ...). Empty:
	// the device that routes to the peer (a hardware device whose GID
	// matches the bootstrap connection's local address, on both sides),
	// else soft0.
	Device string

	// UseCM connects the queue pairs through the RDMA connection
	// manager (address and path resolution by the CM, as rdma_cm
	// programs do) instead of exchanging endpoints over the bootstrap
	// connection, which still authenticates the peer and carries the
	// keepalives. Hardware only: soft0 has no CM, and Listen (or Dial)
	// fails with an error wrapping verbs.ErrNotSupported. Both sides
	// must set it.
	UseCM bool

	// CMAddr, with UseCM: for a Listener, the IP address (and port) its
	// connection manager listens on; empty: the bootstrap listener's
	// address. For Dial, the address to dial the CM at, when the one the
	// Listener announces is not the right one from here (an IPv6
	// link-local address needs this side's zone); empty: the announced
	// one.
	CMAddr string

	// QueueDepth is how many requests of each direction may be in flight
	// on a session. 0: 128.
	QueueDepth int

	// MessageSize is the size of each posted receive buffer: a message up
	// to this size travels in one send (eager); larger ones go by
	// rendezvous (the receiver reads them). 0: 64 KiB. At most 64 MiB
	// less 64 bytes.
	MessageSize int

	// ReceiveBuffers is how many receive buffers each side posts, hence
	// how many eager messages a sender may have outstanding (its
	// credits). 0: 64. At most 65536.
	ReceiveBuffers int

	// MaxMessage bounds a message (eager or rendezvous) this side
	// accepts. 0: 64 MiB. At most 2 GiB, the largest RDMA message.
	MaxMessage int

	// Keepalive is how long a silent peer stays alive: pings go every
	// third of it, and a peer that answers none within it is
	// ErrPeerUnresponsive. 0: 5 s. Negative: no keepalive; a stopped
	// peer is then found only by a request in flight to it, which fails
	// after the queue pair's transport timeout (ErrPeerUnresponsive
	// too), and a side that only waits in Receive waits for its ctx.
	Keepalive time.Duration

	// HandshakeTimeout bounds the bootstrap handshake of one connection
	// (a stranger that does not complete it is dropped), and at a
	// Listener the session setup Accept runs with the authenticated peer
	// (one that stalls in it is dropped, and Accept takes the next). 0:
	// 5 s.
	HandshakeTimeout time.Duration

	// MaxStrangers bounds the unauthenticated connections a Listener
	// holds at once; over it the oldest is dropped. 0: 64.
	MaxStrangers int

	// Lease is the default lease of granted memory. 0: 1 minute. A
	// lease is at most a year (a longer one is a year).
	Lease time.Duration

	// MaxGranted caps the bytes of this side's memory granted to the peer
	// at once (by SendLocalMR and by serving its RequestRemoteMR; a
	// region served for a request and handed back by the peer counts
	// until ReceiveLocalMR takes it). 0: 256 MiB.
	MaxGranted int64

	// MaxRequest caps one RequestRemoteMR the peer may make of this side.
	// 0: 64 MiB.
	MaxRequest int64

	// Allocator configures the session's memory allocator (the arenas
	// behind Alloc, receive buffers and served requests).
	Allocator AllocatorConfig

	// AgentSpin lets this side's agent (the goroutine that reads the
	// control messages: RequestRemoteMR and its answer, SendLocalMR,
	// releases, keepalives) poll for a while (a thousand polls) after
	// every message before it sleeps. Off (the default) it polls so only
	// in a burst, when the last two control messages came less than a
	// millisecond apart (a request, its answer, the release, the next
	// request), and sleeps at once otherwise: a session whose control
	// messages are far apart costs no processor between them, while
	// each of them wakes a sleeping thread (tens of microseconds on a
	// virtual machine, two per isolated RequestRemoteMR). Set it on both
	// sides for a program whose isolated requests must be fast too.
	AgentSpin bool
}

const (
	defaultQueueDepth     = 128
	defaultMessageSize    = 64 << 10
	defaultReceiveBuffers = 64
	defaultMaxMessage     = 64 << 20
	defaultKeepalive      = 5 * time.Second
	defaultHandshake      = 5 * time.Second
	defaultMaxStrangers   = 64
	defaultLease          = time.Minute
	defaultMaxGranted     = 256 << 20
	defaultMaxRequest     = 64 << 20
)

// validate reports a field of c that no session can use: a negative
// count, size, lease or cap (Keepalive, HandshakeTimeout and
// MaxStrangers give negative values a meaning), or an invalid
// Allocator. Before, a negative QueueDepth crashed the process in
// Accept (makechan), a negative Lease or MaxMessage had the peer end the
// session for a protocol error, and a negative MaxRequest lifted the cap
// (TestAdv2ConfigNegative).
func (c *Config) validate() error {
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"QueueDepth", int64(c.QueueDepth)},
		{"MessageSize", int64(c.MessageSize)},
		{"ReceiveBuffers", int64(c.ReceiveBuffers)},
		{"MaxMessage", int64(c.MaxMessage)},
		{"Lease", int64(c.Lease)},
		{"MaxGranted", c.MaxGranted},
		{"MaxRequest", c.MaxRequest},
	} {
		if f.v < 0 {
			return fmt.Errorf("session: Config.%s is negative (%d)", f.name, f.v)
		}
	}
	// What the peer would refuse of the setup (setup.validate): before,
	// the dialer learnt only that the peer closed the session, and a
	// Listener's Accept dropped every peer (TestAdv2ConfigOverPeerLimits).
	if c.MessageSize > maxSlotSize-payOff {
		return fmt.Errorf("session: Config.MessageSize %d is over the largest a peer takes (%d)", c.MessageSize, maxSlotSize-payOff)
	}
	if c.MaxMessage > maxMessage {
		return fmt.Errorf("session: Config.MaxMessage %d is over the largest RDMA message (%d)", c.MaxMessage, maxMessage)
	}
	if c.ReceiveBuffers > maxRecvBuffers {
		return fmt.Errorf("session: Config.ReceiveBuffers %d is over the most a peer takes (%d)", c.ReceiveBuffers, maxRecvBuffers)
	}
	if _, _, err := c.Allocator.resolve(os.Getpagesize()); err != nil {
		return fmt.Errorf("session: Config.Allocator: %w", err)
	}
	return nil
}

// withDefaults returns c with its zero fields set to their defaults.
func (c Config) withDefaults() Config {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.QueueDepth, defaultQueueDepth)
	def(&c.MessageSize, defaultMessageSize)
	def(&c.ReceiveBuffers, defaultReceiveBuffers)
	def(&c.MaxMessage, defaultMaxMessage)
	def(&c.MaxStrangers, defaultMaxStrangers)
	if c.Keepalive == 0 {
		c.Keepalive = defaultKeepalive
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = defaultHandshake
	}
	if c.Lease == 0 {
		c.Lease = defaultLease
	}
	if c.MaxGranted == 0 {
		c.MaxGranted = defaultMaxGranted
	}
	if c.MaxRequest == 0 {
		c.MaxRequest = defaultMaxRequest
	}
	return c
}
