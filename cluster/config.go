package cluster

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"unicode"
)

// Config errors. A *ConfigError wraps one of them; test with errors.Is.
var (
	// ErrNoHosts: the configuration lists no host.
	ErrNoHosts = errors.New("cluster: config: no hosts")
	// ErrFirstRank: the first host is not rank 0.
	ErrFirstRank = errors.New("cluster: config: first host is not rank 0")
	// ErrRankGap: ranks are not 0, 1, 2, ... in the order of the hosts.
	ErrRankGap = errors.New("cluster: config: ranks are not contiguous")
	// ErrDuplicateRank: two hosts have the same rank.
	ErrDuplicateRank = errors.New("cluster: config: duplicate rank")
	// ErrMissingRank: a host has no rank field.
	ErrMissingRank = errors.New("cluster: config: host has no rank")
	// ErrBadPort: a port is missing or outside 1..65535.
	ErrBadPort = errors.New("cluster: config: bad port")
	// ErrBadHostname: a hostname is empty or is not a host name or IP
	// address.
	ErrBadHostname = errors.New("cluster: config: bad hostname")
	// ErrDuplicateAddress: two hosts have the same address and port (the
	// same IP address, however written, or the same host name in any case).
	ErrDuplicateAddress = errors.New("cluster: config: duplicate address")
	// ErrSyntax: the configuration is not the JSON object described by
	// Config (bad JSON, unknown field, a key twice in one object, wrong
	// type, trailing data).
	ErrSyntax = errors.New("cluster: config: syntax")
)

// MaxConfigSize bounds the size of a configuration file (ReadConfig,
// LoadConfig).
const MaxConfigSize = 16 << 20

// Config is a network configuration: one Host per rank, in rank order.
// Its JSON form is
//
//	{"hosts": [
//	  {"hostname": "node1", "port": 18515, "device": "mlx5_0", "rank": 0},
//	  {"hostname": "node2", "port": 18515, "device": "mlx5_0", "rank": 1}
//	]}
//
// Every rank listens on its host's port for the endpoint exchange (only
// rank 0's in the Rendezvous mode).
type Config struct {
	Hosts []Host `json:"hosts"`
}

// Host is one rank of a Config.
type Host struct {
	// Hostname is a host name or an IP address (IPv6 without brackets;
	// a link-local one with its zone, "fe80::1%eth0").
	Hostname string `json:"hostname"`
	// Port is the TCP port of the endpoint exchange, 1 to 65535.
	Port int `json:"port"`
	// Device is the RDMA device of the rank; empty means
	// verbs.DefaultDevice.
	Device string `json:"device,omitempty"`
	// Rank is the rank, equal to the index of the host in Config.Hosts.
	Rank int `json:"rank"`
}

// Addr returns hostname:port.
func (h Host) Addr() string { return net.JoinHostPort(h.Hostname, strconv.Itoa(h.Port)) }

// Size returns the world size, the number of hosts.
func (c *Config) Size() int { return len(c.Hosts) }

// Addrs returns the exchange address of every rank, indexed by rank.
func (c *Config) Addrs() []string {
	a := make([]string, len(c.Hosts))
	for i, h := range c.Hosts {
		a[i] = h.Addr()
	}
	return a
}

// ConfigError is a validation or syntax error of a Config: the host
// (index in the hosts list, or -1 for the whole configuration), and the
// cause, one of the Err* values of this file (possibly wrapping more).
type ConfigError struct {
	Index int
	Err   error
}

func (e *ConfigError) Error() string {
	if e.Index < 0 {
		return e.Err.Error()
	}
	return fmt.Sprintf("%v (hosts[%d])", e.Err, e.Index)
}

func (e *ConfigError) Unwrap() error { return e.Err }

func cfgErr(i int, sentinel error, format string, args ...any) error {
	if format == "" {
		return &ConfigError{Index: i, Err: sentinel}
	}
	return &ConfigError{Index: i, Err: fmt.Errorf("%w: "+format, append([]any{sentinel}, args...)...)}
}

// Validate checks the configuration: at least one host, ranks 0, 1, 2, ...
// in order without duplicates, valid hostnames, ports from 1 to 65535,
// no address used twice. The error is a *ConfigError.
func (c *Config) Validate() error {
	if len(c.Hosts) == 0 {
		return cfgErr(-1, ErrNoHosts, "")
	}
	seen := make(map[int]int, len(c.Hosts))
	addrs := make(map[string]int, len(c.Hosts))
	for i, h := range c.Hosts {
		if j, dup := seen[h.Rank]; dup {
			return cfgErr(i, ErrDuplicateRank, "rank %d is also hosts[%d]", h.Rank, j)
		}
		seen[h.Rank] = i
		switch {
		case i == 0 && h.Rank != 0:
			return cfgErr(i, ErrFirstRank, "rank %d", h.Rank)
		case h.Rank != i:
			return cfgErr(i, ErrRankGap, "rank %d where %d was expected (hosts must be listed in rank order)", h.Rank, i)
		}
		if err := checkHostname(h.Hostname); err != nil {
			return cfgErr(i, ErrBadHostname, "%v", err)
		}
		if h.Port < 1 || h.Port > 65535 {
			return cfgErr(i, ErrBadPort, "%d (want 1 to 65535)", h.Port)
		}
		a := net.JoinHostPort(hostKey(h.Hostname), strconv.Itoa(h.Port))
		if j, dup := addrs[a]; dup {
			return cfgErr(i, ErrDuplicateAddress, "%s is also hosts[%d] (%s)", h.Addr(), j, c.Hosts[j].Addr())
		}
		addrs[a] = i
	}
	return nil
}

// hostKey is what two spellings of one host have in common: an IP
// address in its canonical form (IPv4-mapped IPv6 addresses as IPv4), a
// host name in lower case (DNS names are case-insensitive).
func hostKey(s string) string {
	if ip, err := netip.ParseAddr(s); err == nil {
		return ip.Unmap().String()
	}
	return strings.ToLower(s)
}

// isIP reports whether s is an IP address: IPv4, or IPv6 possibly with
// a zone (the interface of a link-local address, "fe80::1%eth0") made of
// the characters of an interface name (letters, digits, '.', '-', '_';
// netip takes any, spaces and colons too).
func isIP(s string) bool {
	a, err := netip.ParseAddr(s)
	if err != nil {
		return false
	}
	z := a.Zone()
	if len(z) > 63 {
		return false
	}
	for i := 0; i < len(z); i++ {
		switch ch := z[i]; {
		case ch >= 'a' && ch <= 'z', ch >= 'A' && ch <= 'Z', ch >= '0' && ch <= '9', ch == '.', ch == '-', ch == '_':
		default:
			return false
		}
	}
	return true
}

// checkHostname accepts IP addresses (IPv6 with a zone too, see isIP) and
// RFC 1123 host names.
func checkHostname(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	if isIP(s) {
		return nil
	}
	if strings.Contains(s, ":") {
		if _, err := netip.ParseAddr(s); err == nil {
			return fmt.Errorf("%s has a bad zone (an interface name: letters, digits, '.', '-', '_')", clip(s))
		}
	}
	if len(s) > 253 {
		return fmt.Errorf("%d characters (at most 253)", len(s))
	}
	label := 0
	for i := 0; i < len(s); i++ {
		ch := s[i]
		switch {
		case ch == '.':
			if label == 0 {
				return fmt.Errorf("%q has an empty label", s)
			}
			label = 0
			continue
		case ch >= 'a' && ch <= 'z', ch >= 'A' && ch <= 'Z', ch >= '0' && ch <= '9', ch == '-', ch == '_':
		default:
			return fmt.Errorf("%q has the character %q", s, ch)
		}
		label++
		if label > 63 {
			return fmt.Errorf("%q has a label longer than 63 characters", s)
		}
	}
	if label == 0 {
		return fmt.Errorf("%q ends with a dot", s)
	}
	return nil
}

// hostJSON detects a missing rank or port.
type hostJSON struct {
	Hostname string `json:"hostname"`
	Port     *int   `json:"port"`
	Device   string `json:"device"`
	Rank     *int   `json:"rank"`
}

// ParseConfig decodes and validates a JSON configuration. Unknown fields,
// a key twice in one object (in any case), trailing data, missing ranks
// or ports, and every condition of Validate are errors (*ConfigError).
func ParseConfig(data []byte) (*Config, error) {
	if len(data) > MaxConfigSize {
		return nil, cfgErr(-1, ErrSyntax, "%d bytes (at most %d)", len(data), MaxConfigSize)
	}
	var raw struct {
		Hosts []hostJSON `json:"hosts"`
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, cfgErr(-1, ErrSyntax, "the configuration is empty (want a JSON object with a \"hosts\" list)")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, cfgErr(-1, ErrSyntax, "%s: %v", position(data, errorOffset(data, dec, err)), err)
	}
	if end := dec.InputOffset(); dec.More() {
		return nil, cfgErr(-1, ErrSyntax, "%s: trailing data after the configuration object", position(data, skipSpace(data, end)))
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, cfgErr(-1, ErrSyntax, "%s: trailing data after the configuration object", position(data, skipSpace(data, dec.InputOffset())))
	}
	if off, key := duplicateKey(data); off >= 0 {
		return nil, cfgErr(-1, ErrSyntax, "%s: key %s twice in one object (keys match their fields in any case)", position(data, off), clip(key))
	}
	c := &Config{Hosts: make([]Host, len(raw.Hosts))}
	for i, h := range raw.Hosts {
		if h.Rank == nil {
			return nil, cfgErr(i, ErrMissingRank, "")
		}
		if h.Port == nil {
			return nil, cfgErr(i, ErrBadPort, "missing")
		}
		c.Hosts[i] = Host{Hostname: h.Hostname, Port: *h.Port, Device: h.Device, Rank: *h.Rank}
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// ReadConfig reads a configuration (at most MaxConfigSize bytes) from r
// and parses it.
func ReadConfig(r io.Reader) (*Config, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxConfigSize+1))
	if err != nil {
		return nil, fmt.Errorf("cluster: config: %w", err)
	}
	return ParseConfig(data)
}

// LoadConfig reads and parses the configuration file at path.
func LoadConfig(path string) (*Config, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("cluster: config: %w", err)
	}
	defer f.Close()
	c, err := ReadConfig(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// errorOffset returns the offset in data of the byte where the JSON error
// err of dec is: the last byte the decoder read when it noticed (the
// offsets errors carry count the bytes read), the key of an unknown
// field, or the end of a truncated input.
func errorOffset(data []byte, dec *json.Decoder, err error) int64 {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		return se.Offset - 1
	case errors.As(err, &te):
		return te.Offset - 1
	case errors.Is(err, io.ErrUnexpectedEOF):
		return int64(len(data))
	}
	// "json: unknown field \"name\"": the field's key.
	const prefix = "json: unknown field "
	if msg := err.Error(); strings.HasPrefix(msg, prefix) {
		if i := bytes.Index(data, []byte(msg[len(prefix):])); i >= 0 {
			return int64(i)
		}
	}
	return dec.InputOffset()
}

// duplicateKey returns the offset in data, valid JSON, of the first key
// that repeats a key of its object, in any case (encoding/json matches
// fields without regard to case, and keeps the last of duplicates
// silently), and the key; -1 if there is none.
func duplicateKey(data []byte) (int64, string) {
	type frame struct {
		obj  bool
		keys map[string]bool
		key  bool // an object's next token is a key
	}
	var stack []*frame
	dec := json.NewDecoder(bytes.NewReader(data))
	for {
		off := dec.InputOffset()
		tok, err := dec.Token()
		if err != nil {
			return -1, ""
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if k, isKey := tok.(string); isKey && top != nil && top.obj && top.key {
			if top.keys[foldKey(k)] {
				// off is where the previous token ended: the key is
				// after the blanks and the comma.
				for off < int64(len(data)) && strings.IndexByte(" \t\r\n,", data[off]) >= 0 {
					off++
				}
				return off, k
			}
			top.keys[foldKey(k)] = true
			top.key = false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &frame{obj: true, keys: map[string]bool{}, key: true})
			continue
		case json.Delim('['):
			stack = append(stack, &frame{})
			continue
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
		// A value ended: in an object, a key comes next.
		if len(stack) > 0 && stack[len(stack)-1].obj {
			stack[len(stack)-1].key = true
		}
	}
}

// skipSpace returns the offset of the first byte at or after off that is
// not JSON white space.
func skipSpace(data []byte, off int64) int64 {
	for off < int64(len(data)) && strings.IndexByte(" \t\r\n", data[off]) >= 0 {
		off++
	}
	return off
}

// position describes the byte at offset off of data (or the end) as
// "line L, column C", both from 1; a column counts bytes.
func position(data []byte, off int64) string {
	off = min(max(off, 0), int64(len(data)))
	before := data[:off]
	line := bytes.Count(before, []byte("\n")) + 1
	col := len(before) - bytes.LastIndexByte(before, '\n')
	return fmt.Sprintf("line %d, column %d", line, col)
}

// foldKey is k folded as encoding/json matches keys to fields (its
// foldName: each rune lowered, then raised): two keys that fold alike
// fill the same field. strings.ToLower, used before, left the long s
// (U+017F) as it is, which json matches to s: {"hostname": "a",
// "ho\u017ftname": "evil"} passed as one key, and the second won
// (TestAdv2ConfigDuplicateKeys).
func foldKey(k string) string {
	return strings.Map(func(r rune) rune { return unicode.ToUpper(unicode.ToLower(r)) }, k)
}
