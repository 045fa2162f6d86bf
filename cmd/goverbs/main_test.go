package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/goverbs/verbs"
)

// runCmd runs the command line in-process and returns its exit status,
// stdout and stderr.
func runCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	st := run(args, &out, &errb)
	return st, out.String(), errb.String()
}

func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	st, out, errs := runCmd(t, args...)
	if st != 0 {
		t.Fatalf("goverbs %s: exit status %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), st, out, errs)
	}
	return out
}

func TestDevices(t *testing.T) {
	out := mustRun(t, "devices")
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) < 4 {
		t.Fatalf("want a header, a rule, at least one device and the providers line:\n%s", out)
	}
	if f := strings.Fields(lines[0]); strings.Join(f, " ") != "device node GUID transport provider" {
		t.Errorf("header = %q", lines[0])
	}
	found := false
	for _, l := range lines[2 : len(lines)-1] {
		f := strings.Fields(l)
		if len(f) != 4 {
			t.Errorf("device row %q: want 4 columns", l)
			continue
		}
		if _, err := strconv.ParseUint(f[1], 16, 64); err != nil || len(f[1]) != 16 {
			t.Errorf("device row %q: GUID %q is not 16 hex digits", l, f[1])
		}
		if f[0] == verbs.SoftDevice {
			found = true
			if f[2] != "software" || f[3] != "soft" {
				t.Errorf("soft0 row = %q", l)
			}
		}
	}
	if !found {
		t.Errorf("soft0 missing:\n%s", out)
	}
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "providers: ") {
		t.Errorf("last line = %q, want the providers line", last)
	}
	if !verbs.HardwareCompiled && !strings.Contains(last, "build with -tags ibverbs") {
		t.Errorf("providers line %q does not say how to get hardware support", last)
	}
}

// keyValues parses ibv_devinfo-style "key:\tvalue" lines.
func keyValues(out string) map[string]string {
	kv := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(l), ":")
		if ok {
			kv[k] = strings.TrimSpace(v)
		}
	}
	return kv
}

func TestDevinfo(t *testing.T) {
	out := mustRun(t, "devinfo", "-d", verbs.SoftDevice)
	kv := keyValues(out)
	for _, k := range []string{"hca_id", "transport", "fw_ver", "node_guid", "sys_image_guid", "vendor_id",
		"vendor_part_id", "hw_ver", "phys_port_cnt", "port", "state", "max_mtu", "active_mtu", "sm_lid",
		"port_lid", "port_lmc", "link_layer"} {
		if _, ok := kv[k]; !ok {
			t.Errorf("devinfo output lacks %s:\n%s", k, out)
		}
	}
	if kv["hca_id"] != verbs.SoftDevice || kv["state"] != "PORT_ACTIVE (4)" {
		t.Errorf("hca_id = %q, state = %q", kv["hca_id"], kv["state"])
	}
	if _, ok := kv["max_qp"]; ok {
		t.Errorf("max_qp printed without -v")
	}

	out = mustRun(t, "devinfo", "-d", verbs.SoftDevice, "-v")
	kv = keyValues(out)
	for _, k := range []string{"max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_pd",
		"max_qp_rd_atom", "max_srq", "max_srq_wr", "max_srq_sge", "active_width", "active_speed", "GID[  0]"} {
		v, ok := kv[k]
		if !ok {
			t.Errorf("devinfo -v output lacks %s:\n%s", k, out)
			continue
		}
		if strings.HasPrefix(k, "max_") {
			if n, err := strconv.Atoi(v); err != nil || n <= 0 {
				t.Errorf("%s = %q, want a positive number", k, v)
			}
		}
	}
	if g := kv["GID[  0]"]; len(strings.Split(g, ", ")) != 3 {
		t.Errorf("GID[  0] = %q, want GID, type, netdev", g)
	}
}

func TestDevinfoAllDevices(t *testing.T) {
	out := mustRun(t, "devinfo")
	if !strings.Contains(out, "hca_id:\t"+verbs.SoftDevice+"\n\ttransport:\t\t\t") {
		t.Errorf("devinfo without -d does not list soft0:\n%s", out)
	}
}

func TestDevinfoJSON(t *testing.T) {
	out := mustRun(t, "devinfo", "-d", verbs.SoftDevice, "--json")
	var raw map[string][]map[string]any
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("decode: %v\n%s", err, out)
	}
	devs := raw["devices"]
	if len(devs) != 1 {
		t.Fatalf("want one device, got %d:\n%s", len(devs), out)
	}
	d := devs[0]
	for _, k := range []string{"hca_id", "transport", "fw_ver", "node_guid", "sys_image_guid", "vendor_id",
		"vendor_part_id", "hw_ver", "phys_port_cnt", "max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe",
		"max_mr", "max_pd", "max_qp_rd_atom", "max_srq", "ports"} {
		if _, ok := d[k]; !ok {
			t.Errorf("JSON lacks %q", k)
		}
	}
	var typed devinfoJSON
	if err := json.Unmarshal([]byte(out), &typed); err != nil {
		t.Fatal(err)
	}
	td := typed.Devices[0]
	if td.HCAID != verbs.SoftDevice || td.Provider != "soft" || td.PhysPortCnt != 1 || len(td.Ports) != 1 {
		t.Fatalf("device = %+v", td)
	}
	p := td.Ports[0]
	if p.Port != 1 || p.State != "PORT_ACTIVE" || p.ActiveMTU == 0 || p.LinkLayer == "" || len(p.GIDs) == 0 {
		t.Errorf("port = %+v", p)
	}
	for _, g := range p.GIDs {
		if _, err := verbs.ParseGID(g.GID); err != nil || g.Type == "" {
			t.Errorf("gid entry %+v: %v", g, err)
		}
	}
}

// table returns the column titles and the rows of a perftest-style table:
// the line starting with " #bytes" and the lines after it up to the rule.
func table(t *testing.T, out string) (header string, rows [][]string) {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(out))
	in := false
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, " #bytes"):
			header, in = l, true
		case in && strings.HasPrefix(l, "---"):
			in = false
		case in:
			rows = append(rows, strings.Fields(l))
		}
	}
	if header == "" {
		t.Fatalf("no table header in output:\n%s", out)
	}
	return header, rows
}

func checkNumbers(t *testing.T, row []string, size, iters int) {
	t.Helper()
	if got, _ := strconv.Atoi(row[0]); got != size {
		t.Errorf("row %q: #bytes %q, want %d", row, row[0], size)
	}
	if got, _ := strconv.Atoi(row[1]); got != iters {
		t.Errorf("row %q: #iterations %q, want %d", row, row[1], iters)
	}
	for _, f := range row[2:] {
		if v, err := strconv.ParseFloat(f, 64); err != nil || v < 0 {
			t.Errorf("row %q: %q is not a non-negative number", row, f)
		}
	}
}

func TestBenchBandwidth(t *testing.T) {
	for _, op := range []string{"write", "read", "send"} {
		t.Run(op, func(t *testing.T) {
			out := mustRun(t, "bench", op, "-d", verbs.SoftDevice, "-n", "300", "-s", "4K", "--batch", "8", "--tx-depth", "32", "--rx-depth", "16")
			for _, want := range []string{testName(op) + " BW Test", "Device", "Transport type", "Connection type : RC", "Mtu", "local address", "remote address"} {
				if !strings.Contains(strings.Join(strings.Fields(out), " "), strings.Join(strings.Fields(want), " ")) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
			header, rows := table(t, out)
			if strings.Join(strings.Fields(header), " ") != strings.Join(bwColumns, " ") {
				t.Errorf("header = %q", header)
			}
			if len(rows) != 1 || len(rows[0]) != len(bwColumns) {
				t.Fatalf("rows = %q, want one row of %d columns", rows, len(bwColumns))
			}
			checkNumbers(t, rows[0], 4096, 300)
		})
	}
}

func TestBenchLatency(t *testing.T) {
	for _, op := range []string{"write", "read", "send"} {
		t.Run(op, func(t *testing.T) {
			out := mustRun(t, "bench", "--lat", op, "-n", "100", "-d", verbs.SoftDevice)
			if !strings.Contains(out, testName(op)+" Latency Test") || !strings.Contains(out, "Method") {
				t.Errorf("header lacks the test name or method:\n%s", out)
			}
			header, rows := table(t, out)
			if !strings.Contains(header, "99.9% percentile[usec]") || !strings.Contains(header, "t_typical[usec]") {
				t.Errorf("header = %q", header)
			}
			if len(rows) != 1 || len(rows[0]) != len(latColumns) {
				t.Fatalf("rows = %q, want one row of %d columns", rows, len(latColumns))
			}
			checkNumbers(t, rows[0], 2, 100)
			v := func(i int) float64 { f, _ := strconv.ParseFloat(rows[0][i], 64); return f }
			// min <= typical <= p99 <= p99.9 <= max: all are samples (or,
			// typical, the mean of two).
			if lo, typ, p99, p999, hi := v(2), v(4), v(7), v(8), v(3); lo > typ || typ > p99 || p99 > p999 || p999 > hi {
				t.Errorf("inconsistent statistics: min %v typical %v p99 %v p99.9 %v max %v", lo, typ, p99, p999, hi)
			}
		})
	}
}

func TestBenchJSON(t *testing.T) {
	out := mustRun(t, "bench", "write", "--all", "-n", "4", "--json", "-d", verbs.SoftDevice)
	dec := json.NewDecoder(strings.NewReader(out))
	size := 2
	for dec.More() {
		var r bwRow
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("decode: %v\n%s", err, out)
		}
		// The message rate is checked against the iterations and the
		// time by checkBWRow: rounded to 6 decimals, it is 0 when an 8
		// MiB message takes more than 2 s (soft0 in the VM, under load).
		if r.Test != "write" || r.Mode != "bw" || r.Bytes != size || r.Iterations != 4 || r.Device != verbs.SoftDevice || r.ElapsedSec <= 0 {
			t.Errorf("row %+v", r)
		}
		if err := checkBWRow(r); err != nil {
			t.Errorf("row of %d bytes: %v: %+v", size, err, r)
		}
		size *= 2
	}
	if size != 1<<24 {
		t.Errorf("--all stopped before 8M: next size would be %d", size)
	}

	out = mustRun(t, "bench", "send", "--lat", "-n", "20", "-s", "64", "--json")
	var raw map[string]any
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("decode: %v\n%s", err, out)
	}
	for _, k := range []string{"test", "mode", "method", "bytes", "iterations", "t_min_usec", "t_max_usec",
		"t_typical_usec", "t_avg_usec", "t_stdev_usec", "p99_usec", "p99_9_usec"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("latency JSON lacks %q: %s", k, out)
		}
	}
}

// checkBWRow checks that a bandwidth row's rates are its bytes and
// iterations over its elapsed time, as far as the rounding of the JSON
// allows (rates to 2 and 6 decimals, the time to 6: a microsecond).
// (A rate alone may round to 0: 4 writes of 2 bytes under QEMU take
// milliseconds, a few kB/s.)
func checkBWRow(r bwRow) error {
	if r.ElapsedSec <= 0 {
		return fmt.Errorf("elapsed %v s", r.ElapsedSec)
	}
	// The relative error of a rate computed from the rounded time.
	rel := 1e-6/r.ElapsedSec + 1e-9
	bw := float64(r.Bytes) * float64(r.Iterations) / r.ElapsedSec / mb
	if math.Abs(r.BWAverageMBps-bw) > 0.005+bw*rel {
		return fmt.Errorf("average %v MB/s, %d × %d bytes in %v s is %v MB/s", r.BWAverageMBps, r.Iterations, r.Bytes, r.ElapsedSec, bw)
	}
	rate := float64(r.Iterations) / r.ElapsedSec / 1e6
	if math.Abs(r.MsgRateMpps-rate) > 0.5e-6+rate*rel {
		return fmt.Errorf("message rate %v Mpps, %d in %v s is %v Mpps", r.MsgRateMpps, r.Iterations, r.ElapsedSec, rate)
	}
	if r.BWPeakMBps < r.BWAverageMBps {
		return fmt.Errorf("peak %v MB/s below the average", r.BWPeakMBps)
	}
	return nil
}

// TestCheckBWRow: checkBWRow accepts rows as bench writes them, tiny and
// large, and refuses rates that are not the bytes over the time.
func TestCheckBWRow(t *testing.T) {
	row := func(size, iters int, elapsed time.Duration) bwRow {
		res := bwStats(size, iters, elapsed, 0)
		return bwRow{Bytes: size, Iterations: iters, BWPeakMBps: round(res.PeakMB, 2), BWAverageMBps: round(res.AvgMB, 2),
			MsgRateMpps: round(res.MsgRate, 6), ElapsedSec: round(res.Elapsed.Seconds(), 6)}
	}
	for _, tc := range []struct {
		name string
		r    bwRow
		ok   bool
	}{
		{"2 bytes under QEMU", row(2, 4, 3*time.Millisecond), true},
		{"2 bytes on the host", row(2, 4, 7*time.Microsecond+300), true},
		{"8 MiB", row(8<<20, 4, 40*time.Millisecond), true},
		{"zero average", func() bwRow { r := row(8<<20, 4, 40*time.Millisecond); r.BWAverageMBps = 0; return r }(), false},
		{"average off by 10%", func() bwRow { r := row(1<<20, 4, 40*time.Millisecond); r.BWAverageMBps *= 1.1; return r }(), false},
		{"zero rate", func() bwRow { r := row(64, 4, time.Millisecond); r.MsgRateMpps = 0; return r }(), false},
		{"no time", func() bwRow { r := row(64, 4, time.Millisecond); r.ElapsedSec = 0; return r }(), false},
	} {
		if err := checkBWRow(tc.r); (err == nil) != tc.ok {
			t.Errorf("%s: %+v: %v", tc.name, tc.r, err)
		}
	}
}

// A failed completion ends the run with an error that names the status.
func TestBenchCompletionError(t *testing.T) {
	cfg := benchConfig{op: "write", sizes: []int{64}, iters: 100, dev: verbs.SoftDevice, batch: 4, cqMod: 4, txDepth: 16, rxDepth: 16, inline: -1, badRKey: true}
	err := bench(cfg, io.Discard)
	var ce *verbs.CompletionError
	if !errors.As(err, &ce) || ce.Status != verbs.StatusRemAccessErr {
		t.Fatalf("bench with a wrong rkey: %v, want a remote access error", err)
	}
	t.Log(err)
}

func TestUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		status int
		msg    string
	}{
		{nil, exitUsage, "Usage:"},
		{[]string{"frobnicate"}, exitUsage, `unknown command "frobnicate"`},
		{[]string{"help", "frobnicate"}, exitUsage, `unknown command "frobnicate"`},
		{[]string{"devices", "extra"}, exitUsage, `unexpected argument "extra"`},
		{[]string{"devinfo", "--nosuch"}, exitUsage, "flag provided but not defined: -nosuch"},
		{[]string{"devinfo", "-d", "nosuch0"}, exitError, `no device "nosuch0"`},
		{[]string{"bench"}, exitUsage, "missing test"},
		{[]string{"bench", "frob"}, exitUsage, `unknown test "frob"`},
		{[]string{"bench", "write", "127.0.0.1", "extra"}, exitUsage, `unexpected argument "extra"`},
		{[]string{"bench", "write", "--server", "127.0.0.1"}, exitUsage, "--server takes no HOST"},
		{[]string{"bench", "write", "--dev2", "soft0", "127.0.0.1"}, exitUsage, "--dev2 is for the one-process loopback"},
		{[]string{"bench", "write", "--server", "-p", "0"}, exitUsage, "-p must be a TCP port"},
		{[]string{"bench", "write", "--cq-mod", "200"}, exitUsage, "--cq-mod must be between 1 and --tx-depth"},
		{[]string{"bench", "write", "-u", "32"}, exitUsage, "-u must be between 1 and 31"},
		{[]string{"bench", "write", "-I", "5000"}, exitUsage, "-I must be between 0 and 1024"},
		{[]string{"bench", "write", "--server", "--timeout", "0s"}, exitUsage, "--timeout must be positive"},
		{[]string{"bench", "write", "--bind", "127.0.0.1", "127.0.0.1"}, exitUsage, "--bind is for --server"},
		{[]string{"bench", "write", "-s", "abc"}, exitUsage, `invalid size "abc"`},
		{[]string{"bench", "write", "-s", "0"}, exitUsage, `invalid size "0"`},
		{[]string{"bench", "write", "-n", "-1"}, exitUsage, "-n must be at least 1"},
		{[]string{"bench", "write", "--batch", "0"}, exitUsage, "--batch must be between 1"},
		{[]string{"bench", "write", "--batch", "200", "--tx-depth", "100"}, exitUsage, "--batch must be between 1"},
		{[]string{"bench", "write", "--mtu", "1000"}, exitUsage, "invalid MTU 1000"},
		{[]string{"bench", "write", "--all", "-s", "8"}, exitUsage, "exclude each other"},
		{[]string{"bench", "write", "--nosuch"}, exitUsage, "flag provided but not defined: -nosuch"},
		{[]string{"bench", "write", "-d", "nosuch0"}, exitError, "nosuch0: no such device"},
		{[]string{"bench", "write", "--dev2", "nosuch1", "-n", "1"}, exitError, "nosuch1"},
	} {
		st, out, errs := runCmd(t, tc.args...)
		if st != tc.status {
			t.Errorf("goverbs %q: status %d, want %d\nstdout:\n%s\nstderr:\n%s", tc.args, st, tc.status, out, errs)
		}
		if !strings.Contains(errs, tc.msg) {
			t.Errorf("goverbs %q: stderr lacks %q:\n%s", tc.args, tc.msg, errs)
		}
	}
}

// TestBatchFlagsWithSmallTxDepth: --batch and --cq-mod are bandwidth
// flags, and without --batch its default (16) fits a small --tx-depth.
// Before, their checks ran in every mode against the default --batch of
// 16, so "bench write --lat -t 1" (perftest's ib_write_lat default) and
// "-t 8" exited 2, and so did "bench write -t 8". An explicit --batch
// above --tx-depth is still refused.
func TestBatchFlagsWithSmallTxDepth(t *testing.T) {
	type tc struct {
		args []string
		msg  string // "" for a run that must succeed
	}
	var cases []tc
	for _, td := range []string{"1", "8"} {
		for _, op := range []string{"write", "read", "send"} {
			cases = append(cases,
				tc{[]string{"bench", op, "--lat", "-d", verbs.SoftDevice, "-n", "50", "-t", td}, ""},
				tc{[]string{"bench", op, "-d", verbs.SoftDevice, "-s", "64", "-n", "200", "-t", td}, ""})
		}
	}
	cases = append(cases,
		tc{[]string{"bench", "write", "-d", verbs.SoftDevice, "-s", "64", "-n", "200", "-t", "3"}, ""},
		tc{[]string{"bench", "write", "-d", verbs.SoftDevice, "-s", "64", "-n", "200", "-t", "8", "--cq-mod", "1"}, ""},
		tc{[]string{"bench", "write", "-d", verbs.SoftDevice, "-n", "200", "-t", "8", "--batch", "16"}, "--batch must be between 1 and --tx-depth (8), not 16"},
		tc{[]string{"bench", "write", "-d", verbs.SoftDevice, "-n", "200", "-t", "8", "--batch", "8"}, "--cq-mod (8) + --batch (8) - 1 must be at most --tx-depth (8)"},
		tc{[]string{"bench", "write", "-d", verbs.SoftDevice, "-n", "200", "-t", "8", "--cq-mod", "9"}, "--cq-mod must be between 1 and --tx-depth (8), not 9"},
	)
	for _, c := range cases {
		st, out, errs := runCmd(t, c.args...)
		if c.msg != "" {
			if st != exitUsage || !strings.Contains(errs, c.msg) {
				t.Errorf("goverbs %s: exit %d, want %d with %q\nstderr: %s", strings.Join(c.args, " "), st, exitUsage, c.msg, errs)
			}
			continue
		}
		if st != exitOK {
			t.Errorf("goverbs %s: exit %d, want 0\nstderr: %s", strings.Join(c.args, " "), st, errs)
			continue
		}
		if _, rows := table(t, out); len(rows) != 1 {
			t.Errorf("goverbs %s: rows %q", strings.Join(c.args, " "), rows)
		}
	}
}

// TestLatencyPercentilesWithinSamples: t_typical and the percentiles are
// perftest's exact order statistics (print_report_lat): of the samples
// sorted without the largest two (m), the median, sample ceil(0.99 m) and
// sample ceil(0.999 m). Before, they came from an HDR histogram, whose
// bucket tops exceeded t_max: a run of "bench send --lat --all -n 20"
// printed, for 8 MiB, t_max 11801.00 and a 99% percentile of 11804.67.
func TestLatencyPercentilesWithinSamples(t *testing.T) {
	const rtt = 23592960 * time.Nanosecond // 1440 * 2^14: the lowest value of its HDR bucket
	// us returns round trips of 2*u microseconds: latencies of u.
	us := func(rtts ...int) []time.Duration {
		d := make([]time.Duration, len(rtts))
		for i, u := range rtts {
			d[i] = time.Duration(2*u) * time.Microsecond
		}
		return d
	}
	var shuffled []int // 1 .. 1000 us, in another order
	for i := range 1000 {
		shuffled = append(shuffled, (i*337)%1000+1)
	}
	for _, tc := range []struct {
		name    string
		op      string
		samples []time.Duration
		// min, max, typical, p99, p99.9 in usec
		want [5]float64
	}{
		{"equal samples", "send", slices.Repeat([]time.Duration{rtt}, 20), [5]float64{11796.48, 11796.48, 11796.48, 11796.48, 11796.48}},
		{"equal samples read", "read", slices.Repeat([]time.Duration{rtt}, 20), [5]float64{23592.96, 23592.96, 23592.96, 23592.96, 23592.96}},
		// m = 998: median (s[498]+s[499])/2, s[ceil(988.02)], s[ceil(997.002)]
		{"1000 samples", "write", us(shuffled...), [5]float64{1, 1000, 499.5, 990, 999}},
		// m = 19 (odd): median s[9], s[ceil(18.81)], s[ceil(18.981)]
		{"21 samples", "write", us(5, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 1000), [5]float64{1, 1000, 10, 20, 20}},
		{"one sample", "write", us(7), [5]float64{7, 7, 7, 7, 7}},
		{"two samples", "write", us(9, 7), [5]float64{7, 9, 8, 9, 9}},
	} {
		st := newLatStats(tc.op)
		for _, d := range tc.samples {
			st.add(d)
		}
		res := st.result(64, len(tc.samples), false)
		got := [5]float64{res.Min, res.Max, res.Typical, res.P99, res.P999}
		for i, name := range []string{"t_min", "t_max", "t_typical", "99%", "99.9%"} {
			if f2(got[i]) != f2(tc.want[i]) {
				t.Errorf("%s: %s = %s usec, want %s", tc.name, name, f2(got[i]), f2(tc.want[i]))
			}
		}
		if res.Typical > res.Max || res.P99 > res.Max || res.P999 > res.Max || res.Typical < res.Min {
			t.Errorf("%s: statistics outside [t_min, t_max]: %+v", tc.name, res)
		}
	}
}

func TestHelp(t *testing.T) {
	if st, out, _ := runCmd(t, "help"); st != 0 || !strings.Contains(out, "bench") {
		t.Errorf("help: status %d, output:\n%s", st, out)
	}
	for _, c := range []string{"devices", "devinfo", "bench"} {
		st, out, errs := runCmd(t, "help", c)
		if st != 0 || !strings.Contains(out, "usage: goverbs "+c) {
			t.Errorf("help %s: status %d\nstdout:\n%s\nstderr:\n%s", c, st, out, errs)
		}
		if st, _, errs := runCmd(t, c, "-h"); st != 0 || !strings.Contains(errs, "usage: goverbs "+c) {
			t.Errorf("%s -h: status %d, stderr:\n%s", c, st, errs)
		}
		// No sentinel shown as a default (-I printed "(default -1)"
		// beside "default 64 for latency, 0 for bandwidth").
		if strings.Contains(out, "(default -1)") {
			t.Errorf("help %s shows a default of -1:\n%s", c, out)
		}
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int{"2": 2, "4096": 4096, "64K": 65536, "64k": 65536, "1M": 1 << 20, "8MiB": 8 << 20, "1G": 1 << 30, "512B": 512} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "0", "2G", "1.5K"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) succeeded", in)
		}
	}
}
