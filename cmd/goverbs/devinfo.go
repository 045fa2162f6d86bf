package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/goverbs/verbs"
)

// devinfoJSON is the --json output of devinfo. Field names are stable.
type devinfoJSON struct {
	Devices []deviceInfo `json:"devices"`
}

type deviceInfo struct {
	HCAID        string `json:"hca_id"`
	Provider     string `json:"provider"`
	Transport    string `json:"transport"`
	FWVer        string `json:"fw_ver"`
	NodeGUID     string `json:"node_guid"`
	SysImageGUID string `json:"sys_image_guid"`
	VendorID     uint32 `json:"vendor_id"`
	VendorPartID uint32 `json:"vendor_part_id"`
	HWVer        uint32 `json:"hw_ver"`
	PhysPortCnt  int    `json:"phys_port_cnt"`

	// Verbose fields.
	MaxMRSize       uint64 `json:"max_mr_size"`
	PageSizeCap     uint64 `json:"page_size_cap"`
	MaxQP           int    `json:"max_qp"`
	MaxQPWR         int    `json:"max_qp_wr"`
	MaxSGE          int    `json:"max_sge"`
	MaxSGERD        int    `json:"max_sge_rd"`
	MaxCQ           int    `json:"max_cq"`
	MaxCQE          int    `json:"max_cqe"`
	MaxMR           int    `json:"max_mr"`
	MaxPD           int    `json:"max_pd"`
	MaxQPRDAtom     int    `json:"max_qp_rd_atom"`
	MaxQPInitRDAtom int    `json:"max_qp_init_rd_atom"`
	AtomicCap       string `json:"atomic_cap"`
	MaxAH           int    `json:"max_ah"`
	MaxSRQ          int    `json:"max_srq"`
	MaxSRQWR        int    `json:"max_srq_wr"`
	MaxSRQSGE       int    `json:"max_srq_sge"`
	MaxPKeys        int    `json:"max_pkeys"`
	LocalCAAckDelay int    `json:"local_ca_ack_delay"`
	MaxInlineData   int    `json:"max_inline_data"`
	NumCompVectors  int    `json:"num_comp_vectors"`

	Ports []portInfo `json:"ports"`
}

type portInfo struct {
	Port      int    `json:"port"`
	State     string `json:"state"`
	MaxMTU    int    `json:"max_mtu"`
	ActiveMTU int    `json:"active_mtu"`
	SMLID     uint16 `json:"sm_lid"`
	PortLID   uint16 `json:"port_lid"`
	PortLMC   uint8  `json:"port_lmc"`
	LinkLayer string `json:"link_layer"`

	// Verbose fields.
	MaxMsgSz     uint32    `json:"max_msg_sz"`
	GIDTblLen    int       `json:"gid_tbl_len"`
	PKeyTblLen   int       `json:"pkey_tbl_len"`
	ActiveWidth  string    `json:"active_width"`
	ActiveSpeed  string    `json:"active_speed"`
	PhysState    string    `json:"phys_state"`
	PortCapFlags uint32    `json:"port_cap_flags"`
	GIDs         []gidInfo `json:"gids"`

	// Raw encodings, for the text output.
	stateNum, maxMTUNum, activeMTUNum, widthNum, physNum uint32
	speedNum                                             uint32
}

type gidInfo struct {
	Index  int    `json:"index"`
	GID    string `json:"gid"`
	Type   string `json:"type"`
	Netdev string `json:"netdev"`
}

func runDevinfo(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("devinfo", "[-d dev] [-v] [--json]", stderr)
	dev := fs.String("d", "", "show only this `device`")
	fs.StringVar(dev, "ib-dev", "", "same as -d")
	verbose := fs.Bool("v", false, "also print device limits, port details and the GID table")
	asJSON := fs.Bool("json", false, "print one JSON object (always with the verbose fields)")
	pos, st := parseFlags(fs, args)
	if st >= 0 {
		return st
	}
	if len(pos) > 0 {
		return usageErr(stderr, "devinfo", "unexpected argument %q", pos[0])
	}

	devs, lerr := verbs.Devices()
	if lerr != nil {
		fmt.Fprintf(stderr, "goverbs devinfo: warning: %v\n", lerr)
	}
	var names []string
	for _, d := range devs {
		if *dev == "" || d.Name == *dev {
			names = append(names, d.Name)
		}
	}
	if *dev != "" && len(names) == 0 {
		return fail(stderr, "devinfo", noDeviceErr(*dev, devs))
	}
	if len(names) == 0 {
		return fail(stderr, "devinfo", verbs.ErrNoDevice)
	}

	var out devinfoJSON
	status := exitOK
	for _, name := range names {
		info, err := queryDevice(name, devs)
		if err != nil {
			fail(stderr, "devinfo", err)
			status = exitError
			continue
		}
		out.Devices = append(out.Devices, info)
	}
	if *asJSON {
		if out.Devices == nil {
			out.Devices = []deviceInfo{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			return fail(stderr, "devinfo", err)
		}
		return status
	}
	for i, d := range out.Devices {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		printDevinfo(stdout, d, *verbose)
	}
	return status
}

// noDeviceErr names the devices that exist.
func noDeviceErr(name string, devs []verbs.Device) error {
	var have []string
	for _, d := range devs {
		have = append(have, d.Name)
	}
	msg := fmt.Sprintf("no device %q (devices: %s)", name, strings.Join(have, ", "))
	if !verbs.HardwareCompiled {
		msg += "; hardware provider not compiled in: build with -tags ibverbs"
	}
	return fmt.Errorf("%s: %w", msg, verbs.ErrNoDevice)
}

func queryDevice(name string, devs []verbs.Device) (deviceInfo, error) {
	c, err := verbs.Open(name)
	if err != nil {
		return deviceInfo{}, err
	}
	defer c.Close()
	a, err := c.QueryDevice()
	if err != nil {
		return deviceInfo{}, err
	}
	d := deviceInfo{
		HCAID: name, Provider: c.Provider(), FWVer: a.FWVersion,
		NodeGUID: guidString(a.NodeGUID), SysImageGUID: guidString(a.SysImageGUID),
		VendorID: a.VendorID, VendorPartID: a.VendorPartID, HWVer: a.HWVersion, PhysPortCnt: a.PhysPortCnt,
		MaxMRSize: a.MaxMRSize, PageSizeCap: a.PageSizeCap, MaxQP: a.MaxQP, MaxQPWR: a.MaxQPWR,
		MaxSGE: a.MaxSGE, MaxSGERD: a.MaxSGERD, MaxCQ: a.MaxCQ, MaxCQE: a.MaxCQE, MaxMR: a.MaxMR,
		MaxPD: a.MaxPD, MaxQPRDAtom: a.MaxQPRDAtom, MaxQPInitRDAtom: a.MaxQPInitRDAtom,
		AtomicCap: atomicCapName(a.AtomicCap), MaxAH: a.MaxAH, MaxSRQ: a.MaxSRQ, MaxSRQWR: a.MaxSRQWR,
		MaxSRQSGE: a.MaxSRQSGE, MaxPKeys: a.MaxPKeys, LocalCAAckDelay: a.LocalCACKDelay,
		MaxInlineData: a.MaxInlineData, NumCompVectors: a.CompletionVectors,
		Ports: []portInfo{},
	}
	for _, dv := range devs {
		if dv.Name == name {
			d.Transport = dv.Transport
		}
	}
	var errs []error
	for p := 1; p <= a.PhysPortCnt && p <= 255; p++ {
		pa, err := c.QueryPort(uint8(p))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		pi := portInfo{
			Port: p, State: pa.State.String(), MaxMTU: pa.MaxMTU.Bytes(), ActiveMTU: pa.ActiveMTU.Bytes(),
			SMLID: pa.SMLID, PortLID: pa.LID, PortLMC: pa.LMC, LinkLayer: pa.LinkLayer.String(),
			MaxMsgSz: pa.MaxMsgSize, GIDTblLen: pa.GIDTableLen, PKeyTblLen: pa.PKeyTableLen,
			ActiveWidth: pa.WidthString(), ActiveSpeed: pa.SpeedString(), PhysState: physStateName(pa.PhysState),
			PortCapFlags: pa.PortCapFlags, GIDs: []gidInfo{},
			stateNum: uint32(pa.State), maxMTUNum: uint32(pa.MaxMTU), activeMTUNum: uint32(pa.ActiveMTU),
			widthNum: uint32(pa.ActiveWidth), speedNum: pa.ActiveSpeed, physNum: uint32(pa.PhysState),
		}
		gids, err := c.GIDTable(uint8(p))
		if err != nil {
			errs = append(errs, err)
		}
		for _, g := range gids {
			pi.GIDs = append(pi.GIDs, gidInfo{Index: g.Index, GID: g.GID.String(), Type: g.Type.String(), Netdev: g.Netdev})
		}
		d.Ports = append(d.Ports, pi)
	}
	return d, errors.Join(errs...)
}

// guidString formats a GUID like ibv_devinfo: 0002:c903:0010:a1b2.
func guidString(g uint64) string {
	return fmt.Sprintf("%04x:%04x:%04x:%04x", g>>48, (g>>32)&0xffff, (g>>16)&0xffff, g&0xffff)
}

func atomicCapName(c int) string {
	switch c {
	case 0:
		return "ATOMIC_NONE"
	case 1:
		return "ATOMIC_HCA"
	case 2:
		return "ATOMIC_GLOB"
	}
	return fmt.Sprintf("ATOMIC_%d", c)
}

func physStateName(s uint8) string {
	names := [...]string{1: "SLEEP", 2: "POLLING", 3: "DISABLED", 4: "PORT_CONFIGURATION_TRAINING",
		5: "LINK_UP", 6: "LINK_ERROR_RECOVERY", 7: "PHY_TEST"}
	if int(s) < len(names) && names[s] != "" {
		return names[s]
	}
	return "invalid physical state"
}

func atomicCapNum(s string) int {
	switch s {
	case "ATOMIC_NONE":
		return 0
	case "ATOMIC_HCA":
		return 1
	case "ATOMIC_GLOB":
		return 2
	}
	return -1
}

// printDevinfo prints one device in the layout of ibv_devinfo.
func printDevinfo(w io.Writer, d deviceInfo, verbose bool) {
	// Like ibv_devinfo: values of device attributes start at column 40,
	// those of port attributes at column 48 (tab stops of 8); hca_id and
	// port take one tab.
	kv := func(indent int, k string, format string, a ...any) {
		tabs := 1
		if target := map[int]int{1: 40, 3: 48}[indent]; target > 0 {
			tabs = 0
			for pos := indent*8 + len(k) + 1; pos < target; pos = (pos/8 + 1) * 8 {
				tabs++
			}
			tabs = max(tabs, 1)
		}
		fmt.Fprintf(w, "%s%s:%s%s\n", strings.Repeat("\t", indent), k, strings.Repeat("\t", tabs), fmt.Sprintf(format, a...))
	}
	kv(0, "hca_id", "%s", d.HCAID)
	kv(1, "transport", "%s", d.Transport)
	kv(1, "provider", "%s", d.Provider)
	kv(1, "fw_ver", "%s", d.FWVer)
	kv(1, "node_guid", "%s", d.NodeGUID)
	kv(1, "sys_image_guid", "%s", d.SysImageGUID)
	kv(1, "vendor_id", "0x%04x", d.VendorID)
	kv(1, "vendor_part_id", "%d", d.VendorPartID)
	kv(1, "hw_ver", "%#x", d.HWVer)
	kv(1, "phys_port_cnt", "%d", d.PhysPortCnt)
	if verbose {
		kv(1, "max_mr_size", "%#x", d.MaxMRSize)
		kv(1, "page_size_cap", "%#x", d.PageSizeCap)
		kv(1, "max_qp", "%d", d.MaxQP)
		kv(1, "max_qp_wr", "%d", d.MaxQPWR)
		kv(1, "max_sge", "%d", d.MaxSGE)
		kv(1, "max_sge_rd", "%d", d.MaxSGERD)
		kv(1, "max_cq", "%d", d.MaxCQ)
		kv(1, "max_cqe", "%d", d.MaxCQE)
		kv(1, "max_mr", "%d", d.MaxMR)
		kv(1, "max_pd", "%d", d.MaxPD)
		kv(1, "max_qp_rd_atom", "%d", d.MaxQPRDAtom)
		kv(1, "max_qp_init_rd_atom", "%d", d.MaxQPInitRDAtom)
		kv(1, "atomic_cap", "%s (%d)", d.AtomicCap, atomicCapNum(d.AtomicCap))
		kv(1, "max_ah", "%d", d.MaxAH)
		kv(1, "max_srq", "%d", d.MaxSRQ)
		kv(1, "max_srq_wr", "%d", d.MaxSRQWR)
		kv(1, "max_srq_sge", "%d", d.MaxSRQSGE)
		kv(1, "max_pkeys", "%d", d.MaxPKeys)
		kv(1, "local_ca_ack_delay", "%d", d.LocalCAAckDelay)
		kv(1, "max_inline_data", "%d", d.MaxInlineData)
		kv(1, "num_comp_vectors", "%d", d.NumCompVectors)
	}
	for _, p := range d.Ports {
		kv(2, "port", "%d", p.Port)
		kv(3, "state", "%s (%d)", p.State, p.stateNum)
		kv(3, "max_mtu", "%d (%d)", p.MaxMTU, p.maxMTUNum)
		kv(3, "active_mtu", "%d (%d)", p.ActiveMTU, p.activeMTUNum)
		kv(3, "sm_lid", "%d", p.SMLID)
		kv(3, "port_lid", "%d", p.PortLID)
		kv(3, "port_lmc", "0x%02x", p.PortLMC)
		kv(3, "link_layer", "%s", p.LinkLayer)
		if !verbose {
			continue
		}
		kv(3, "max_msg_sz", "%#x", p.MaxMsgSz)
		kv(3, "gid_tbl_len", "%d", p.GIDTblLen)
		kv(3, "pkey_tbl_len", "%d", p.PKeyTblLen)
		kv(3, "port_cap_flags", "0x%08x", p.PortCapFlags)
		kv(3, "active_width", "%s (%d)", p.ActiveWidth, p.widthNum)
		kv(3, "active_speed", "%s (%d)", p.ActiveSpeed, p.speedNum)
		kv(3, "phys_state", "%s (%d)", p.PhysState, p.physNum)
		for _, g := range p.GIDs {
			netdev := g.Netdev
			if netdev == "" {
				netdev = "-"
			}
			kv(3, fmt.Sprintf("GID[%3d]", g.Index), "%s, %s, %s", g.GID, g.Type, netdev)
		}
	}
}
