package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1 // the command ran and failed
	exitUsage = 2 // bad command line
)

type command struct {
	name    string
	summary string
	run     func(args []string, stdout, stderr io.Writer) int
}

func commands() []command {
	return []command{
		{"devices", "list RDMA devices and compiled-in providers", runDevices},
		{"devinfo", "show device and port attributes (like ibv_devinfo)", runDevinfo},
		{"bench", "bandwidth or latency of write, read or send, loopback or server/client (like perftest)", runBench},
		{"coll", "latency and bandwidth of collectives across local ranks, against point-to-point writes (like nccl-tests)", runColl},
	}
}

// run executes the goverbs command line args (without the program name)
// and returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "help", "-h", "-help", "--help":
		if len(args) > 1 && name == "help" {
			for _, c := range commands() {
				if c.name == args[1] {
					return c.run([]string{"-h"}, stdout, stdout)
				}
			}
			fmt.Fprintf(stderr, "goverbs: unknown command %q\n", args[1])
			return exitUsage
		}
		usage(stdout)
		return exitOK
	}
	for _, c := range commands() {
		if c.name == name {
			return c.run(args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "goverbs: unknown command %q\n\n", name)
	usage(stderr)
	return exitUsage
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "goverbs is a tool for RDMA devices and the goverbs library.\n\nUsage:\n\n\tgoverbs <command> [flags]\n\nCommands:\n\n")
	for _, c := range commands() {
		fmt.Fprintf(w, "\t%-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, "\nRun \"goverbs help <command>\" or \"goverbs <command> -h\" for a command's flags.\n")
}

// newFlagSet returns a flag set that reports errors to stderr and does not
// exit.
func newFlagSet(name, usageLine string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("goverbs "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: goverbs %s %s\n\nflags:\n", name, usageLine)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args with fs, allowing positional arguments before,
// between and after flags ("bench write -s 8" and "bench -s 8 write"). It
// returns the positional arguments and the exit status to use when parsing
// failed (-1 when it did not).
func parseFlags(fs *flag.FlagSet, args []string) ([]string, int) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, exitOK
			}
			return nil, exitUsage
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, -1
		}
		if rest[0] == "--" {
			return append(pos, rest[1:]...), -1
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// fail prints a command's error and returns exitError.
func fail(stderr io.Writer, cmd string, err error) int {
	msg := err.Error()
	// Errors of the library start with "verbs: "; keep them whole, they
	// read well after the command name.
	fmt.Fprintf(stderr, "goverbs %s: %s\n", cmd, strings.TrimSpace(msg))
	return exitError
}

// usageErr prints a usage error and returns exitUsage.
func usageErr(stderr io.Writer, cmd, format string, a ...any) int {
	fmt.Fprintf(stderr, "goverbs %s: %s\nRun \"goverbs help %s\" for usage.\n", cmd, fmt.Sprintf(format, a...), cmd)
	return exitUsage
}
