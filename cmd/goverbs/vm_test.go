package main

import (
	"strings"
	"testing"

	"github.com/goverbs/verbs/internal/vmtest"
)

// TestInVM runs the command against the kernel's SoftRoCE devices (tier 3:
// scripts/vm/run.sh). Outside the VM it is skipped with the reason.
func TestInVM(t *testing.T) {
	devs := vmtest.Require(t)
	out := mustRun(t, "devices")
	for _, d := range devs {
		if !strings.Contains(out, d) {
			t.Errorf("devices lacks %s:\n%s", d, out)
		}
	}
	t.Logf("goverbs devices:\n%s", out)
	out = mustRun(t, "devinfo", "-v", "-d", devs[0])
	for _, want := range []string{"hca_id:\t" + devs[0], "PORT_ACTIVE", "link_layer:\t\tEthernet", "RoCE v2"} {
		if !strings.Contains(out, want) {
			t.Errorf("devinfo lacks %q:\n%s", want, out)
		}
	}
	t.Logf("goverbs devinfo -v:\n%s", out)
	for _, args := range [][]string{
		{"bench", "write", "-d", devs[0], "--dev2", devs[1], "-n", "200", "-s", "64K"},
		{"bench", "send", "-d", devs[0], "--dev2", devs[1], "-n", "200", "-s", "4K"},
		{"bench", "read", "-d", devs[0], "-n", "200", "-s", "4K"},
		{"bench", "--lat", "write", "-d", devs[0], "--dev2", devs[1], "-n", "100"},
	} {
		out := mustRun(t, args...)
		_, rows := table(t, out)
		if len(rows) != 1 {
			t.Errorf("goverbs %s: want one result row:\n%s", strings.Join(args, " "), out)
		}
		t.Logf("goverbs %s:\n%s", strings.Join(args, " "), out)
	}
}
