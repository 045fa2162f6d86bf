//go:build ibverbs

// Command vmprobe lists the RDMA devices that libibverbs finds, with the
// state, active MTU and GID 0 of port 1 of each. It is the smoke test of the
// SoftRoCE VM harness (scripts/vm/run.sh): built on the host with cgo against
// libibverbs and run inside the guest, it must list rxe0 and rxe1.
//
//	go build -tags ibverbs -o .cache/vm/bin/vmprobe ./internal/ibv/vmprobe
//	scripts/vm/run.sh -- .cache/vm/bin/vmprobe
//
// It exits 1 when no device is found.
package main

/*
#cgo LDFLAGS: -libverbs
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

// ibv_query_port is a macro in rdma-core's verbs.h, so it is called from C.
static int probe_port(struct ibv_context *ctx, uint8_t port, int *state, int *mtu, uint8_t gid[16]) {
	struct ibv_port_attr attr;
	union ibv_gid g;
	memset(&attr, 0, sizeof attr);
	int rc = ibv_query_port(ctx, port, &attr);
	if (rc != 0) return rc;
	*state = attr.state;
	*mtu = attr.active_mtu;
	rc = ibv_query_gid(ctx, port, 0, &g);
	if (rc != 0) return rc;
	memcpy(gid, g.raw, 16);
	return 0;
}
*/
import "C"

import (
	"fmt"
	"net"
	"os"
	"unsafe"
)

func main() {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		fmt.Fprintf(os.Stderr, "vmprobe: ibv_get_device_list: %v\n", err)
		os.Exit(1)
	}
	defer C.ibv_free_device_list(list)
	devs := unsafe.Slice(list, int(n))
	fmt.Printf("%d device(s)\n", len(devs))
	for _, d := range devs {
		name := C.GoString(C.ibv_get_device_name(d))
		ctx, err := C.ibv_open_device(d)
		if ctx == nil {
			fmt.Printf("%s: open: %v\n", name, err)
			continue
		}
		var state, mtu C.int
		var gid [16]C.uint8_t
		if rc := C.probe_port(ctx, 1, &state, &mtu, &gid[0]); rc != 0 {
			fmt.Printf("%s: query port 1: errno %d\n", name, rc)
		} else {
			raw := make(net.IP, 16)
			for i := range gid {
				raw[i] = byte(gid[i])
			}
			fmt.Printf("%s: port 1 state %d active_mtu %d gid[0] %s\n",
				name, int(state), 128<<int(mtu), raw)
		}
		C.ibv_close_device(ctx)
	}
	if len(devs) == 0 {
		os.Exit(1)
	}
}
