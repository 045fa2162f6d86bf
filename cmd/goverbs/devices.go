package main

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/goverbs/verbs"
)

func runDevices(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("devices", "", stderr)
	pos, st := parseFlags(fs, args)
	if st >= 0 {
		return st
	}
	if len(pos) > 0 {
		return usageErr(stderr, "devices", "unexpected argument %q", pos[0])
	}
	devs, err := verbs.Devices()
	if err != nil {
		// Devices returns what it found along with the errors of the
		// providers that failed; show both.
		fmt.Fprintf(stderr, "goverbs devices: warning: %v\n", err)
		if len(devs) == 0 {
			return exitError
		}
	}
	tw := tabwriter.NewWriter(stdout, 0, 8, 3, ' ', 0)
	fmt.Fprintln(tw, "    device\tnode GUID\ttransport\tprovider")
	fmt.Fprintln(tw, "    ------\t---------\t---------\t--------")
	for _, d := range devs {
		fmt.Fprintf(tw, "    %s\t%016x\t%s\t%s\n", d.Name, d.GUID, d.Transport, d.Provider)
	}
	tw.Flush()
	fmt.Fprintln(stdout, providersLine())
	return exitOK
}

// providersLine says which providers this binary has.
func providersLine() string {
	if verbs.HardwareCompiled {
		return "providers: ibverbs (hardware, libibverbs), soft (" + verbs.SoftDevice + ")"
	}
	return "providers: soft (" + verbs.SoftDevice + "); hardware provider not compiled in: build with -tags ibverbs"
}
