package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
)

const rule = "---------------------------------------------------------------------------------------"

// reporter prints results as a perftest-style table or as JSON lines.
type reporter struct {
	w   io.Writer
	cfg benchConfig
	lb  *loopback
	enc *json.Encoder
}

func newReporter(w io.Writer, cfg benchConfig, lb *loopback) *reporter {
	r := &reporter{w: w, cfg: cfg, lb: lb}
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
	lb, cfg := r.lb, r.cfg
	kind := "BW"
	if cfg.lat {
		kind = "Latency"
	}
	fmt.Fprintln(r.w, rule)
	fmt.Fprintf(r.w, "%*s\n", 20+len(testName(cfg.op))+len(kind)+6, testName(cfg.op)+" "+kind+" Test")
	dev := lb.a.ctx.Name()
	if lb.b.ctx.Name() != dev {
		dev += " -> " + lb.b.ctx.Name()
	}
	inline := 0
	if cfg.lat && cfg.op != "read" {
		inline = lb.inline
	}
	pairs := [][2]string{
		{"Device", dev},
		{"Provider", lb.a.ctx.Provider()},
		{"Number of qps", "1"},
		{"Transport type", lb.transport},
		{"Connection type", "RC"},
		{"Using SRQ", "OFF"},
		{"Loopback", "ON (one process)"},
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
		[2]string{"Mtu", fmt.Sprintf("%d[B]", lb.pathMTU.Bytes())},
		[2]string{"Link type", lb.port.LinkLayer.String()},
		[2]string{"GID index", fmt.Sprint(lb.a.ep.GIDIndex)},
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
	for _, s := range []*side{lb.a, lb.b} {
		label := "local address"
		if s == lb.b {
			label = "remote address"
		}
		fmt.Fprintf(r.w, " %s: LID %#04x QPN %#06x PSN %#06x GID %s\n", label, s.ep.LID, s.ep.QPN, s.ep.PSN, s.ep.GID)
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
			Test: r.cfg.op, Mode: "bw", Device: r.lb.a.ctx.Name(), Device2: r.lb.b.ctx.Name(),
			Provider: r.lb.a.ctx.Provider(), Bytes: res.Size, Iterations: res.Iters,
			TxDepth: r.cfg.txDepth, Batch: r.cfg.batch, MTU: r.lb.pathMTU.Bytes(),
			BWPeakMBps: round(res.PeakMB, 2), BWAverageMBps: round(res.AvgMB, 2),
			MsgRateMpps: round(res.MsgRate, 6), ElapsedSec: round(res.Elapsed.Seconds(), 6),
		})
		return
	}
	r.row(bwColumns, fmt.Sprint(res.Size), fmt.Sprint(res.Iters), f2(res.PeakMB), f2(res.AvgMB), fmt.Sprintf("%.6f", res.MsgRate))
}

func (r *reporter) latRow(res latResult) {
	if r.enc != nil {
		r.enc.Encode(latRow{
			Test: r.cfg.op, Mode: "lat", Method: latencyMethod(r.cfg.op), Device: r.lb.a.ctx.Name(),
			Device2: r.lb.b.ctx.Name(), Provider: r.lb.a.ctx.Provider(), Bytes: res.Size,
			Iterations: res.Iters, MTU: r.lb.pathMTU.Bytes(), Inline: res.Inline,
			TMinUs: round(res.Min, 3), TMaxUs: round(res.Max, 3), TTypicalUs: round(res.Typical, 3),
			TAvgUs: round(res.Avg, 3), TStdevUs: round(res.Std, 3), P99Us: round(res.P99, 3), P999Us: round(res.P999, 3),
		})
		return
	}
	r.row(latColumns, fmt.Sprint(res.Size), fmt.Sprint(res.Iters), f2(res.Min), f2(res.Max), f2(res.Typical),
		f2(res.Avg), f2(res.Std), f2(res.P99), f2(res.P999))
}

func (r *reporter) footer() {
	if r.enc != nil {
		return
	}
	fmt.Fprintln(r.w, rule)
}
