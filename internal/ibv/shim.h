//go:build ibverbs && linux && cgo

// C shim of the hardware provider. Every libibverbs macro or static inline
// function is called from here, never directly from Go, and the data-path
// loops (post, poll) run here so that a batch costs one cgo crossing.

#ifndef GOVERBS_IBV_SHIM_H
#define GOVERBS_IBV_SHIM_H

#include <stdint.h>
#include <stddef.h>
#include <infiniband/verbs.h>

// gv_send_wr mirrors prov.SendWR (72 bytes, pointer-free).
typedef struct {
	uint64_t wr_id;
	uint64_t remote_addr;
	uint64_t compare_add;
	uint64_t swap;
	uint64_t ah; // struct ibv_ah * as an integer
	uint32_t opcode;
	uint32_t flags;
	uint32_t imm; // host byte order
	uint32_t rkey;
	uint32_t sge_index;
	uint32_t num_sge;
	uint32_t remote_qpn;
	uint32_t remote_qkey;
} gv_send_wr;

// gv_recv_wr mirrors prov.RecvWR (16 bytes).
typedef struct {
	uint64_t wr_id;
	uint32_t sge_index;
	uint32_t num_sge;
} gv_recv_wr;

// gv_sge mirrors prov.SGE; it is also layout-identical to struct ibv_sge,
// so SGE arrays are handed to the library without copying.
typedef struct {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
} gv_sge;

// gv_wc mirrors prov.Completion (48 bytes): exactly the layout of struct
// ibv_wc, except that imm is converted to host byte order.
typedef struct {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm; // host byte order after gv_poll_cq
	uint32_t qpn;
	uint32_t src_qp;
	uint32_t flags;
	uint16_t pkey_index;
	uint16_t slid;
	uint8_t sl;
	uint8_t dlid_bits;
	uint8_t _pad[2];
} gv_wc;

// gv_port_attr is the subset of struct ibv_port_attr reported to Go.
typedef struct {
	uint32_t state;
	uint32_t max_mtu;
	uint32_t active_mtu;
	int32_t gid_tbl_len;
	uint32_t port_cap_flags;
	uint32_t max_msg_sz;
	uint32_t active_speed;
	uint16_t pkey_tbl_len;
	uint16_t lid;
	uint16_t sm_lid;
	uint8_t lmc;
	uint8_t active_width;
	uint8_t phys_state;
	uint8_t link_layer;
} gv_port_attr;

// gv_gid mirrors the fields of struct ibv_gid_entry.
typedef struct {
	uint8_t gid[16];
	uint32_t index;
	uint32_t port;
	uint32_t gid_type;
	uint32_t ifindex;
} gv_gid;

// gv_qp is the provider's per-QP C state.
typedef struct {
	struct ibv_qp *qp;
	struct ibv_qp_ex *qpx; // non-NULL when created with send_ops_flags
	uint64_t ops;          // granted send_ops_flags
	uint32_t max_inline;   // granted caps, checked before ibv_wr_start
	uint32_t max_send_sge;
	int sge_list_broken;   // device quirk: post multi-SGE batches classically
	uint32_t qkey;         // the QP's Q_Key (UD), for controlled Q_Keys
} gv_qp;

// gv_cq is the provider's per-CQ C state.
typedef struct {
	struct ibv_cq *cq;
	struct ibv_cq_ex *cqx; // non-NULL when polled with start/next_poll
	uint64_t wc_flags;     // wc_flags the extended CQ was created with
	int next_poll_broken;  // device quirk: poll with start/end pairs only
} gv_cq;

// Data path (one call per batch).
int gv_post_send(gv_qp *q, const gv_send_wr *wrs, int n, const gv_sge *sges, int nsge, int *accepted);
int gv_post_send_wr(gv_qp *q, const gv_send_wr *wrs, int n, const gv_sge *sges, int nsge, int *accepted);
int gv_post_recv(gv_qp *q, const gv_recv_wr *wrs, int n, const gv_sge *sges, int nsge, int *accepted);
int gv_post_srq_recv(struct ibv_srq *srq, const gv_recv_wr *wrs, int n, const gv_sge *sges, int nsge, int *accepted);
int gv_poll_cq(gv_cq *c, gv_wc *dst, int n);
int gv_poll_cq_busy(gv_cq *c, gv_wc *dst, int n, int spins);

// gv_nop does nothing: the unit of a cgo crossing (CgoNop).
void gv_nop(void);
int gv_req_notify_cq(gv_cq *c, int solicited_only);

// Events (non-blocking fds; EAGAIN when nothing is pending).
int gv_get_cq_event(struct ibv_comp_channel *ch, uint64_t *handle);
int gv_get_async_event(struct ibv_context *ctx, uint32_t *type, uint64_t *handle, uint32_t *qpn, uint32_t *port);

// Control path.
int gv_query_port(struct ibv_context *ctx, uint8_t port, gv_port_attr *out);
int gv_query_device(struct ibv_context *ctx, struct ibv_device_attr *out, uint32_t *ports);
int gv_query_gid_table(struct ibv_context *ctx, uint8_t port, int tbl_len, gv_gid *out, int max);
struct ibv_mr *gv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access);
struct ibv_mr *gv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access);
int gv_create_cq(struct ibv_context *ctx, int cqe, struct ibv_comp_channel *ch, int vector, uint64_t handle, int use_ex, gv_cq *out);
int gv_destroy_cq(gv_cq *c);
int gv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr, uint64_t handle, int use_ex, gv_qp *out);
int gv_destroy_qp(gv_qp *q);
struct ibv_srq *gv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *attr, uint64_t handle);

#endif
