// Command goverbs is the command-line companion of the goverbs RDMA library:
// it lists devices, shows their attributes and measures bandwidth and
// latency with perftest-compatible output, in one process (loopback) or
// between a server and a client process as perftest does.
//
// Usage:
//
//	goverbs devices
//	goverbs devinfo [-d dev] [-v] [--json]
//	goverbs bench write|read|send [flags] [--server | HOST]
//	goverbs coll [-p ranks] [-min size] [-max size] [-ops allreduce,barrier] [-alg A] [-json]
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
// # coll
//
// Measures the collectives of package collective across -p ranks, OS
// processes of this program it starts on this host (or, under a launcher
// such as mpirun or torchrun, the ranks the launcher started, see
// cluster.FromEnv), on soft0 (transport -transport, default shm) or the
// device -d. It prints an nccl-tests style table: per collective and size
// (-min to -max, by -step 2 or 4) the element count, the algorithm, the
// median over -iters iterations of the slowest rank's time, and NCCL's
// algorithm and bus bandwidth (allreduce busbw = algbw x 2(p-1)/p). In the
// same run ranks 0 and 1 measure the point-to-point baseline of the same
// transport (one-way latency of an 8-byte RDMA write, half a ping-pong;
// write bandwidth of 64 KiB to 16 MiB messages), and the table ends with
// issue 15's goals as ratios: allreduce busbw at >= 16 MiB over the peak
// point-to-point bandwidth, and 8-byte allreduce and barrier latency over
// ceil(log2 p) one-way latencies. -json prints one JSON object instead.
// The ranks it starts share out the processors: each runs with
// GOMAXPROCS = max(1, processors / p), unless GOMAXPROCS is set (see
// package collective, Waiting); the first line says which.
//
// # bench
//
// Measures RDMA write, RDMA read or send/receive between two RC queue
// pairs, on the default device (the first hardware device, else soft0;
// GOVERBS_DEVICE overrides it). The output follows perftest: ib_write_bw,
// ib_read_bw and ib_send_bw in bandwidth mode, ib_write_lat, ib_read_lat
// and ib_send_lat with --lat.
//
// Without --server or HOST both queue pairs belong to this process and are
// connected to each other (loopback). In perftest's topology, one process
// runs the server and another, on the same or another host, the client:
//
//	goverbs bench write -d rxe0 -s 65536 --server          # server
//	goverbs bench write -d rxe1 -s 65536 127.0.0.1         # client
//
// The client connects to the server over TCP (port -p, default 18515, as
// perftest), the two exchange their parameters, endpoints and memory
// regions in length-prefixed frames (magic "GVB2", type, length, JSON) and
// then run the test against each other. The test, sizes and iterations must
// be the same on both sides (a difference fails both with a message naming
// it); queue depths are each side's own. The client measures; both print
// the client's rows. Every step of the exchange honours --timeout
// (connecting, the parameter exchange and each message between the
// measurements) and SIGINT; a peer that stops
// answering during the measurement fails the run after 10 s without
// progress. While it measures, the client sends the server a small frame
// every 250 ms: a server whose client stops or vanishes without closing
// the connection (the server may have nothing to do in the measurement,
// as with writes) fails --timeout (at least 1 s) after its last frame. The exchange does not depend on the provider: any device whose
// queue pairs can reach each other's endpoints works.
//
//	--server        run the server side; wait for one client
//	HOST            run the client side against the server on HOST
//	-p, --port N    TCP port of the exchange (default 18515)
//	--bind addr     address the server listens on (default: all)
//	--timeout d     limit for connecting, exchanging parameters, each
//	                message between the measurements and the server's
//	                wait for a word from a measuring client (1m)
//	--token secret  shared secret of server and client (default
//	                $GOVERBS_BENCH_TOKEN, which keeps it out of ps)
//
// What the server exposes: its endpoint (for soft0 it carries the
// connection secret of the server process) and the address, length and
// rkey of its memory region, which the client then writes and reads.
// Without a token, the first client to connect gets them, in clear text;
// a server that listens on a non-loopback address says so on stderr. With
// --token on both sides the exchange runs in TLS 1.3 and the client must
// prove the token (an HMAC over keying material of the TLS session; the
// token never crosses the wire) before the server sends anything of its
// own; clients that fail are dropped and reported, and the server waits
// for the next. It authenticates up to 8 clients at once (each within
// 10 s), so that strangers who connect and say nothing do not keep the
// real client out.
//
// Flags of both modes:
//
//	-d dev          device of both queue pairs (default: the default device)
//	--dev2 dev      loopback: device of the second queue pair (default: -d)
//	-s size         message size in bytes; K, M and G suffixes are binary
//	                (default 65536 for bandwidth, 2 for latency)
//	-n iters        iterations per size (default 5000 for bandwidth, 1000
//	                for latency, which keeps every sample: at most 2^26)
//	--all           sweep sizes 2, 4, 8, ... 8M (2^1 to 2^23)
//	--lat           measure latency instead of bandwidth
//	-t, --tx-depth N  send requests kept outstanding (default 128)
//	--rx-depth N    receives kept posted for send (default 512)
//	--batch N       bandwidth: requests per doorbell (RCBatch.Submit,
//	                perftest's --post_list) (default 16, or fewer to fit a
//	                small --tx-depth: --cq-mod + --batch - 1 must be at
//	                most --tx-depth)
//	--cq-mod N      bandwidth: every Nth request is signaled (perftest -Q;
//	                default --batch)
//	--mtu N         path MTU in bytes (default: the port's active MTU)
//	-u, --qp-timeout N  RC ACK timeout exponent, 4.096 us * 2^N (default 14)
//	-I, --inline-size N max inline data; messages up to N bytes are sent
//	                inline (default 64 for latency, 0 for bandwidth)
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
// inline. t_min, t_max, t_avg and t_stdev are over all samples; t_typical
// and the percentiles are perftest's order statistics, exact: of the
// samples sorted without the largest two (m of them), t_typical is the
// median, 99% is sample ceil(0.99 m) and 99.9% sample ceil(0.999 m),
// counting from 0. In the latency loops of the two-process mode
// every tx-depth/4th request (at most every 64th) is signaled, so an
// iteration costs one post and the polls of the wait.
//
// On hardware devices the table is followed by the cgo calls the measuring
// process made per message in its measured loop (runtime.NumCgoCall): one
// per Submit of a batch and one per Poll, so idle polls while waiting count
// too.
//
// A failed completion, a failed post or a peer that stops answering prints
// the error and exits with status 1; bad flags exit with status 2.
package main
