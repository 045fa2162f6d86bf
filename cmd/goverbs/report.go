package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/goverbs/verbs"
)

const rule = "---------------------------------------------------------------------------------------"

// reporter prints results as a perftest-style table or as JSON lines.
type reporter struct {
	w   io.Writer
	cfg benchConfig
	in  *benchInfo
	enc *json.Encoder
	cgo []string // cgo calls per message of each row, for the footer
}

// benchInfo describes the queue pairs of a run for the report.
type benchInfo struct {
	dev, dev2 string // local device, peer's device
	provider  string
	transport string
	mode      string // the "Loopback" line: how the two sides run
	pathMTU   verbs.MTU
	port      verbs.PortAttr
	inline    int // max inline data of the QPs
	local     verbs.Endpoint
	remote    verbs.Endpoint
}

func newReporter(w io.Writer, cfg benchConfig, in *benchInfo) *reporter {
	r := &reporter{w: w, cfg: cfg, in: in}
	if cfg.json {
		r.enc = json.NewEncoder(w)
	}
	return r
}

// header prints the test banner, the parameters and both addresses, then
// the column titles.
func (r *reporter) header() {
	if r.enc != nil {
		return
	}
	in, cfg := r.in, r.cfg
	kind := "BW"
	if cfg.lat {
		kind = "Latency"
	}
	fmt.Fprintln(r.w, rule)
	fmt.Fprintf(r.w, "%*s\n", 20+len(testName(cfg.op))+len(kind)+6, testName(cfg.op)+" "+kind+" Test")
	dev := in.dev
	if in.dev2 != "" && in.dev2 != dev {
		dev += " -> " + in.dev2
	}
	inline := 0
	if cfg.op != "read" {
		inline = in.inline // the queue pair's: 0 unless -I asks for it in a bandwidth test
	}
	pairs := [][2]string{
		{"Device", dev},
		{"Provider", in.provider},
		{"Number of qps", "1"},
		{"Transport type", in.transport},
		{"Connection type", "RC"},
		{"Using SRQ", "OFF"},
		{"Loopback", in.mode},
		{"TX depth", fmt.Sprint(cfg.txDepth)},
	}
	if cfg.lat {
		if cfg.op == "send" {
			pairs = append(pairs, [2]string{"RX depth", fmt.Sprint(cfg.rxDepth)})
		}
	} else {
		pairs = append(pairs, [2]string{"Post batch", fmt.Sprintf("%d (last signaled)", cfg.batch)})
		if cfg.op == "send" {
			pairs = append(pairs, [2]string{"RX depth", fmt.Sprint(cfg.rxDepth)})
		}
	}
	pairs = append(pairs,
		[2]string{"Mtu", fmt.Sprintf("%d[B]", in.pathMTU.Bytes())},
		[2]string{"Link type", in.port.LinkLayer.String()},
		[2]string{"GID index", fmt.Sprint(in.local.GIDIndex)},
		[2]string{"Max inline data", fmt.Sprintf("%d[B]", inline)},
	)
	if len(pairs)%2 == 1 {
		pairs = append(pairs, [2]string{})
	}
	tw := tabwriter.NewWriter(r.w, 0, 8, 1, ' ', 0)
	for i := 0; i < len(pairs); i += 2 {
		l, rr := pairs[i], pairs[i+1]
		if rr[0] == "" {
			fmt.Fprintf(tw, " %-16s: %s\n", l[0], l[1])
			continue
		}
		fmt.Fprintf(tw, " %-16s: %s\t\t%-16s: %s\n", l[0], l[1], rr[0], rr[1])
	}
	tw.Flush()
	if cfg.lat {
		fmt.Fprintf(r.w, " %-16s: %s\n", "Method", latencyMethod(cfg.op))
	}
	fmt.Fprintln(r.w, rule)
	for i, ep := range []verbs.Endpoint{in.local, in.remote} {
		label := "local address"
		if i == 1 {
			label = "remote address"
		}
		fmt.Fprintf(r.w, " %s: LID %#04x QPN %#06x PSN %#06x GID %s\n", label, ep.LID, ep.QPN, ep.PSN, ep.GID)
	}
	fmt.Fprintln(r.w, rule)
	cols := bwColumns
	if cfg.lat {
		cols = latColumns
	}
	for i, c := range cols {
		fmt.Fprintf(r.w, " %-*s", colWidth(c, i == len(cols)-1), c)
	}
	fmt.Fprintln(r.w)
}

// Column titles of perftest.
var (
	bwColumns  = []string{"#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]"}
	latColumns = []string{"#bytes", "#iterations", "t_min[usec]", "t_max[usec]", "t_typical[usec]",
		"t_avg[usec]", "t_stdev[usec]", "99% percentile[usec]", "99.9% percentile[usec]"}
)

func colWidth(title string, last bool) int {
	if last {
		return 0
	}
	return max(len(title), 10) + 2
}

// row prints values under the column titles.
func (r *reporter) row(cols []string, vals ...string) {
	for i, v := range vals {
		fmt.Fprintf(r.w, " %-*s", colWidth(cols[i], i == len(vals)-1), v)
	}
	fmt.Fprintln(r.w)
}

func f2(x float64) string { return fmt.Sprintf("%.2f", x) }

// bwRow is the JSON form of a bandwidth row.
type bwRow struct {
	Test          string  `json:"test"`
	Mode          string  `json:"mode"`
	Device        string  `json:"device"`
	Device2       string  `json:"device2"`
	Provider      string  `json:"provider"`
	Bytes         int     `json:"bytes"`
	Iterations    int     `json:"iterations"`
	TxDepth       int     `json:"tx_depth"`
	Batch         int     `json:"batch"`
	MTU           int     `json:"mtu"`
	BWPeakMBps    float64 `json:"bw_peak_mb_per_sec"`
	BWAverageMBps float64 `json:"bw_average_mb_per_sec"`
	MsgRateMpps   float64 `json:"msg_rate_mpps"`
	ElapsedSec    float64 `json:"elapsed_sec"`
	CgoPerMsg     float64 `json:"cgo_calls_per_msg"`
}

// latRow is the JSON form of a latency row.
type latRow struct {
	Test       string  `json:"test"`
	Mode       string  `json:"mode"`
	Method     string  `json:"method"`
	Device     string  `json:"device"`
	Device2    string  `json:"device2"`
	Provider   string  `json:"provider"`
	Bytes      int     `json:"bytes"`
	Iterations int     `json:"iterations"`
	MTU        int     `json:"mtu"`
	Inline     bool    `json:"inline"`
	TMinUs     float64 `json:"t_min_usec"`
	TMaxUs     float64 `json:"t_max_usec"`
	TTypicalUs float64 `json:"t_typical_usec"`
	TAvgUs     float64 `json:"t_avg_usec"`
	TStdevUs   float64 `json:"t_stdev_usec"`
	P99Us      float64 `json:"p99_usec"`
	P999Us     float64 `json:"p99_9_usec"`
	CgoPerMsg  float64 `json:"cgo_calls_per_msg"`
}

func round(x float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	return float64(int64(x*p+0.5)) / p
}

func (r *reporter) bwRow(res bwResult) {
	if r.enc != nil {
		r.enc.Encode(bwRow{
			Test: r.cfg.op, Mode: "bw", Device: r.in.dev, Device2: r.in.dev2,
			Provider: r.in.provider, Bytes: res.Size, Iterations: res.Iters,
			TxDepth: r.cfg.txDepth, Batch: r.cfg.batch, MTU: r.in.pathMTU.Bytes(),
			BWPeakMBps: round(res.PeakMB, 2), BWAverageMBps: round(res.AvgMB, 2),
			MsgRateMpps: round(res.MsgRate, 6), ElapsedSec: round(res.Elapsed.Seconds(), 6),
			CgoPerMsg: round(res.CgoPerMsg, 3),
		})
		return
	}
	r.cgo = append(r.cgo, fmt.Sprintf("%d B: %.2f", res.Size, res.CgoPerMsg))
	r.row(bwColumns, fmt.Sprint(res.Size), fmt.Sprint(res.Iters), f2(res.PeakMB), f2(res.AvgMB), fmt.Sprintf("%.6f", res.MsgRate))
}

func (r *reporter) latRow(res latResult) {
	if r.enc != nil {
		r.enc.Encode(latRow{
			Test: r.cfg.op, Mode: "lat", Method: latencyMethod(r.cfg.op), Device: r.in.dev,
			Device2: r.in.dev2, Provider: r.in.provider, Bytes: res.Size,
			Iterations: res.Iters, MTU: r.in.pathMTU.Bytes(), Inline: res.Inline,
			TMinUs: round(res.Min, 3), TMaxUs: round(res.Max, 3), TTypicalUs: round(res.Typical, 3),
			TAvgUs: round(res.Avg, 3), TStdevUs: round(res.Std, 3), P99Us: round(res.P99, 3), P999Us: round(res.P999, 3),
			CgoPerMsg: round(res.CgoPerMsg, 3),
		})
		return
	}
	r.cgo = append(r.cgo, fmt.Sprintf("%d B: %.2f", res.Size, res.CgoPerMsg))
	r.row(latColumns, fmt.Sprint(res.Size), fmt.Sprint(res.Iters), f2(res.Min), f2(res.Max), f2(res.Typical),
		f2(res.Avg), f2(res.Std), f2(res.P99), f2(res.P999))
}

func (r *reporter) footer() {
	if r.enc != nil {
		return
	}
	fmt.Fprintln(r.w, rule)
	// runtime.NumCgoCall over the measured loop of the measuring process
	// (both sides in loopback), per message (per iteration for latency).
	if len(r.cgo) > 0 && r.in.provider != "soft" {
		who := "both queue pairs"
		if strings.HasPrefix(r.in.mode, "OFF") {
			who = "client"
		}
		fmt.Fprintf(r.w, " cgo calls per message (%s): %s\n", who, strings.Join(r.cgo, ", "))
	}
}
