package cluster

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
)

// Second adversarial pass: what a demanding user and a stranger on the
// network try, beyond adversarial_test.go. Helpers of this file are
// prefixed with "adv2". Contexts here are hang guards, never bounds that
// a test asserts.

// TestAdv2NodeListDeep: a node list item made of many bracket groups
// ("a[1][1][1]...") is refused at once, without expanding it: every group
// adds at least a digit to every name it makes, so an item of more groups
// than a host name has characters (253) makes no valid name. Before,
// ExpandNodeList recursed once per group before it found a name too
// long: 100 000 groups (300 KB) took a 100 MB stack, and a list of 3 MB
// (a few more groups) killed the process with "goroutine stack exceeds
// 1000000000-byte limit", which no recover catches.
func TestAdv2NodeListDeep(t *testing.T) {
	for _, groups := range []int{maxNodeName + 1, 40_000, 1 << 20} {
		in := "a" + strings.Repeat("[1]", groups)
		names, err := ExpandNodeList(in)
		if err == nil {
			t.Fatalf("%d groups: %d names, want an error", groups, len(names))
		}
		if !strings.Contains(err.Error(), "253") {
			t.Errorf("%d groups: %.200v, want an error saying names have at most 253 characters", groups, err)
		}
		if len(err.Error()) > 1024 {
			t.Errorf("%d groups: an error of %d bytes", groups, len(err.Error()))
		}
	}
	// As many groups as a name may have characters is fine.
	in := strings.Repeat("[1]", maxNodeName)
	names, err := ExpandNodeList(in)
	if err != nil || len(names) != 1 || names[0] != strings.Repeat("1", maxNodeName) {
		t.Errorf("%d groups: %v, %v; want one name of %d ones", maxNodeName, names, err, maxNodeName)
	}
	// Through the environment (Linux bounds a variable to 128 KiB).
	env := map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n" + strings.Repeat("[0]", 40_000)}
	if _, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)}); !errors.Is(err, ErrEnvValue) {
		t.Errorf("Slurm node list of 40 000 groups: %.200v, want ErrEnvValue", err)
	}
}

// TestAdv2FromEnvClosesListener: FromEnv handed a listener
// (EnvOptions.Join.Listener) closes it when it fails, as Join does
// whatever its error and Exchange does with ExchangeConfig.Listener:
// here when the environment is refused before any exchange (no
// launcher, a bad variable, an unknown launcher forced). Before, a
// failed ParseLaunch returned with the listener still open: the caller,
// told by Join that a failed join releases it, kept its port and
// descriptor.
func TestAdv2FromEnvClosesListener(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		opts EnvOptions
	}{
		{"no launcher", map[string]string{}, EnvOptions{}},
		{"bad size", map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "x", "GOVERBS_ROOT": "127.0.0.1:1"}, EnvOptions{}},
		{"unknown launcher", map[string]string{"GOVERBS_RANK": "0"}, EnvOptions{Launcher: "lsf"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			opts := tc.opts
			opts.Lookup = advLookup(tc.env)
			opts.Join.Listener = ln
			n, err := FromEnv(context.Background(), opts)
			if err == nil {
				n.Close()
				t.Fatal("FromEnv: no error")
			}
			var ee *EnvError
			if !errors.As(err, &ee) {
				t.Errorf("FromEnv: %v, want an *EnvError", err)
			}
			// A closed listener fails Accept at once; an open one would
			// wait for a connection: dial it so that the test cannot hang.
			if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
				c.Close()
			}
			if c, err := ln.Accept(); !errors.Is(err, net.ErrClosed) {
				if c != nil {
					c.Close()
				}
				t.Errorf("after FromEnv failed: Accept: %v, want net.ErrClosed (the listener was left open)", err)
			}
		})
	}
}

// TestAdv2ListenZonedRoot: rank 0 listens on the address of GOVERBS_ROOT
// when it is an IP address, IPv6 with a zone too ([fe80::1%lo]:7000,
// which checkAddr accepts): before, net.ParseIP did not take the zone
// for an IP address, so rank 0 listened on every interface (":7000")
// rather than on the one link-local address it was given.
func TestAdv2ListenZonedRoot(t *testing.T) {
	for root, want := range map[string]string{
		"[fe80::1%lo]:7000":   "[fe80::1%lo]:7000",
		"[::1]:7000":          "[::1]:7000",
		"127.0.0.1:7000":      "127.0.0.1:7000",
		"node-0.cluster:7000": ":7000",
	} {
		env := map[string]string{"GOVERBS_RANK": "0", "GOVERBS_WORLD_SIZE": "2", "GOVERBS_ROOT": root}
		l, err := ParseLaunch(EnvOptions{Lookup: advLookup(env)})
		if err != nil {
			t.Errorf("GOVERBS_ROOT=%s: %v", root, err)
			continue
		}
		if l.Listen != want {
			t.Errorf("GOVERBS_ROOT=%s: Listen %q, want %q", root, l.Listen, want)
		}
	}
}
