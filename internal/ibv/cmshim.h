//go:build ibverbs && linux && cgo

// C shim for the RDMA connection manager (librdmacm).

#ifndef GOVERBS_IBV_CMSHIM_H
#define GOVERBS_IBV_CMSHIM_H

#include <stdint.h>
#include <rdma/rdma_cma.h>

#define GV_CM_PRIVATE_MAX 256

// gv_cm_event is a copy of the parts of struct rdma_cm_event Go needs; the
// event itself is acknowledged in the shim.
typedef struct {
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	uint32_t event;
	int32_t status;
	uint32_t qp_num;
	uint32_t private_data_len;
	uint8_t responder_resources;
	uint8_t initiator_depth;
	uint8_t retry_count;
	uint8_t rnr_retry_count;
	uint8_t srq;
	uint8_t private_data[GV_CM_PRIVATE_MAX];
} gv_cm_event;

// gv_sockaddr is an IPv4 or IPv6 socket address (addr holds 4 or 16 bytes).
typedef struct {
	uint16_t family; // AF_INET or AF_INET6
	uint16_t port;   // host byte order
	uint32_t scope_id;
	uint8_t addr[16];
} gv_sockaddr;

typedef struct {
	uint32_t qp_num;
	uint8_t responder_resources;
	uint8_t initiator_depth;
	uint8_t retry_count;
	uint8_t rnr_retry_count;
	uint8_t srq;
} gv_conn_param;

int gv_cm_get_event(struct rdma_event_channel *ch, gv_cm_event *out);
int gv_cm_create_id(struct rdma_event_channel *ch, struct rdma_cm_id **id);
int gv_cm_bind_addr(struct rdma_cm_id *id, const gv_sockaddr *a);
int gv_cm_listen(struct rdma_cm_id *id, int backlog);
int gv_cm_resolve_addr(struct rdma_cm_id *id, const gv_sockaddr *dst, int timeout_ms);
int gv_cm_resolve_route(struct rdma_cm_id *id, int timeout_ms);
int gv_cm_addrs(struct rdma_cm_id *id, gv_sockaddr *local, gv_sockaddr *peer);
int gv_cm_init_qp_attr(struct rdma_cm_id *id, int state, struct ibv_qp_attr *attr, int *mask);
int gv_cm_connect(struct rdma_cm_id *id, const gv_conn_param *p, const uint8_t *pdata, uint32_t len);
int gv_cm_accept(struct rdma_cm_id *id, const gv_conn_param *p, const uint8_t *pdata, uint32_t len);
int gv_cm_reject(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len);
int gv_cm_establish(struct rdma_cm_id *id);
int gv_cm_disconnect(struct rdma_cm_id *id);
int gv_cm_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *ch);
int gv_cm_destroy_id(struct rdma_cm_id *id);
const char *gv_cm_device_name(struct rdma_cm_id *id);

#endif
