// Command goverbs is the command-line companion of the goverbs RDMA library:
// it lists devices, shows their attributes and measures loopback bandwidth
// and latency with perftest-compatible output.
//
// Usage:
//
//	goverbs devices
//	goverbs devinfo [-d dev] [-v] [--json]
//	goverbs bench write|read|send [flags]
//	goverbs help [command]
//
// # devices
//
// Lists the devices of every compiled-in provider, like ibv_devices: name,
// node GUID, transport and provider. The soft device soft0 is always
// present; hardware devices (mlx5_0, rxe0, ...) appear when the binary is
// built with -tags ibverbs and libibverbs finds them. The last line says
// which providers this binary has.
//
// # devinfo
//
// Prints what ibv_devinfo prints: hca_id, transport, fw_ver, node_guid,
// sys_image_guid, vendor_id, vendor_part_id, hw_ver, phys_port_cnt and per
// port state, max_mtu, active_mtu, sm_lid, port_lid, port_lmc and
// link_layer.
//
//	-d dev   only this device (default: all)
//	-v       also the device limits (max_qp, max_qp_wr, max_sge, max_cq,
//	         max_cqe, max_mr, max_pd, max_qp_rd_atom, max_srq, ...), the
//	         port's active_width, active_speed, max_msg_sz and the GID table
//	         (index, GID, type, network device)
//	--json   print one JSON object {"devices": [...]} with snake_case field
//	         names; it always holds the verbose fields
//
// # bench
//
// Measures RDMA write, RDMA read or send/receive between two RC queue pairs
// of this process, connected to each other (loopback), on the default
// device (the first hardware device, else soft0; GOVERBS_DEVICE overrides
// it). The output follows perftest: ib_write_bw, ib_read_bw and ib_send_bw
// in bandwidth mode, ib_write_lat, ib_read_lat and ib_send_lat with --lat.
//
//	-d dev          device of both queue pairs (default: the default device)
//	--dev2 dev      device of the second queue pair (default: -d)
//	-s size         message size in bytes; K, M and G suffixes are binary
//	                (default 65536 for bandwidth, 2 for latency)
//	-n iters        iterations per size (default 5000 for bandwidth, 1000
//	                for latency)
//	--all           sweep sizes 2, 4, 8, ... 8M (2^1 to 2^23)
//	--lat           measure latency instead of bandwidth
//	--tx-depth N    send requests kept outstanding (default 128)
//	--rx-depth N    receives kept posted for send (default 512)
//	--batch N       requests per doorbell (RCBatch.Submit); the last
//	                request of each batch is signaled (default 16)
//	--mtu N         path MTU in bytes (default: the port's active MTU)
//	--json          print one JSON object per result row (JSON lines)
//	                instead of the table
//
// Bandwidth is in MB/sec with MB = 2^20 bytes, as in perftest. BW average
// is bytes over the time from the first post to the last completion; BW peak
// is the best rate over windows of about a sixteenth of the run; MsgRate is
// millions of messages per second.
//
// Latency methods, named in the output header: write latency is a ping-pong
// of RDMA writes in which each side polls the last byte of its buffer
// (perftest's method), reported as half the round trip; send latency is a
// ping-pong of sends, each side polling its receive completion, reported as
// half the round trip; read latency is the time from posting an RDMA read
// to its completion. Sizes up to the queue pair's max inline data are sent
// inline. Percentiles come from an HDR histogram (3 significant digits);
// t_typical is the median.
//
// A failed completion, a failed post or a peer that stops answering prints
// the error and exits with status 1; bad flags exit with status 2.
package main
