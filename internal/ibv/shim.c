//go:build ibverbs && linux && cgo

#include "shim.h"

#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

// Layout checks: gv_* mirror the Go types of internal/prov (checked from Go
// by layout_test.go) and gv_sge/gv_wc are layout-identical to the libibverbs
// structs so that they are used in place.
#define GV_SAME_FIELD(a, fa, b, fb)                                        \
	_Static_assert(offsetof(a, fa) == offsetof(b, fb) &&                  \
			       sizeof(((a *)0)->fa) == sizeof(((b *)0)->fb), \
		       #a "." #fa " != " #b "." #fb)

_Static_assert(sizeof(gv_send_wr) == 72, "gv_send_wr size");
_Static_assert(offsetof(gv_send_wr, opcode) == 40, "gv_send_wr.opcode");
_Static_assert(offsetof(gv_send_wr, remote_qkey) == 68, "gv_send_wr.remote_qkey");
_Static_assert(sizeof(gv_recv_wr) == 16, "gv_recv_wr size");
_Static_assert(sizeof(gv_sge) == sizeof(struct ibv_sge), "gv_sge size");
GV_SAME_FIELD(gv_sge, addr, struct ibv_sge, addr);
GV_SAME_FIELD(gv_sge, length, struct ibv_sge, length);
GV_SAME_FIELD(gv_sge, lkey, struct ibv_sge, lkey);
// gv_wc (prov.Completion, 48 bytes) has the layout of struct ibv_wc, so
// gv_poll_cq polls straight into the caller's array.
_Static_assert(sizeof(gv_wc) == 48, "gv_wc size");
_Static_assert(sizeof(gv_wc) == sizeof(struct ibv_wc), "gv_wc vs ibv_wc size");
GV_SAME_FIELD(gv_wc, wr_id, struct ibv_wc, wr_id);
GV_SAME_FIELD(gv_wc, status, struct ibv_wc, status);
GV_SAME_FIELD(gv_wc, opcode, struct ibv_wc, opcode);
GV_SAME_FIELD(gv_wc, vendor_err, struct ibv_wc, vendor_err);
GV_SAME_FIELD(gv_wc, byte_len, struct ibv_wc, byte_len);
GV_SAME_FIELD(gv_wc, imm, struct ibv_wc, imm_data);
GV_SAME_FIELD(gv_wc, qpn, struct ibv_wc, qp_num);
GV_SAME_FIELD(gv_wc, src_qp, struct ibv_wc, src_qp);
GV_SAME_FIELD(gv_wc, flags, struct ibv_wc, wc_flags);
GV_SAME_FIELD(gv_wc, pkey_index, struct ibv_wc, pkey_index);
GV_SAME_FIELD(gv_wc, slid, struct ibv_wc, slid);
GV_SAME_FIELD(gv_wc, sl, struct ibv_wc, sl);
GV_SAME_FIELD(gv_wc, dlid_bits, struct ibv_wc, dlid_path_bits);
_Static_assert(sizeof(union ibv_gid) == 16, "ibv_gid size");

// Work requests are converted on the C stack in chunks of GV_CHUNK and
// posted with one ibv_post_send/ibv_post_recv per chunk (a doorbell batch).
// The stack keeps concurrent posters on one QP independent, as verbs allow.
#define GV_CHUNK 32
#define GV_MAX_INLINE 4096 // bytes gathered on the stack for an inline WR

static inline int gv_err(int rc)
{
	if (rc < 0)
		rc = -rc;
	return rc ? rc : EIO;
}

static inline int gv_errno(void) { return errno ? errno : EIO; }

// gv_check_sgl returns the index of the first request whose SGL is out of
// range of the nsge entries, or n.
#define GV_FIRST_BAD_SGL(wrs, n, nsge, out)                                          \
	do {                                                                         \
		(out) = (n);                                                         \
		for (int _i = 0; _i < (n); _i++) {                                   \
			if ((uint64_t)(wrs)[_i].sge_index + (wrs)[_i].num_sge >      \
			    (uint64_t)(nsge)) {                                      \
				(out) = _i;                                          \
				break;                                               \
			}                                                            \
		}                                                                    \
	} while (0)

// gv_qkey is the Q_Key a UD request is sent with: a Q_Key with the high
// bit set (a controlled Q_Key) means the sending QP's own (IBA 10.2.4,
// ibv_post_send(3)); rxe sends it as given, so the shim substitutes it.
static inline uint32_t gv_qkey(const gv_qp *q, uint32_t qkey)
{
	if (qkey & 0x80000000u)
		return __atomic_load_n(&q->qkey, __ATOMIC_RELAXED);
	return qkey;
}

// gv_first_bad_wr returns the index of the first request that
// gv_fill_send cannot describe, or n, with the error for it in *rc: an
// opcode other than those it fills (a memory window bind or TSO would
// hand the library the uninitialized bind_mw/tso union of the request:
// rxe dereferences its pointers), or a UD request without an address
// handle (rxe dereferences it). The root package refuses both first;
// this keeps any other caller of the provider from crashing the process.
static inline int gv_first_bad_wr(const gv_send_wr *wrs, int n, int ud, int *rc)
{
	for (int i = 0; i < n; i++) {
		switch (wrs[i].opcode) {
		case IBV_WR_SEND:
		case IBV_WR_SEND_WITH_IMM:
		case IBV_WR_RDMA_WRITE:
		case IBV_WR_RDMA_WRITE_WITH_IMM:
		case IBV_WR_RDMA_READ:
		case IBV_WR_ATOMIC_CMP_AND_SWP:
		case IBV_WR_ATOMIC_FETCH_AND_ADD:
		case IBV_WR_SEND_WITH_INV:
		case IBV_WR_LOCAL_INV:
			break;
		default:
			*rc = EOPNOTSUPP;
			return i;
		}
		if (ud && wrs[i].ah == 0) {
			*rc = EINVAL;
			return i;
		}
	}
	*rc = 0;
	return n;
}

static inline void gv_fill_send(struct ibv_send_wr *s, const gv_send_wr *w,
				const gv_sge *sges, const gv_qp *q, int ud)
{
	s->wr_id = w->wr_id;
	s->next = s + 1;
	s->sg_list = w->num_sge ? (struct ibv_sge *)&sges[w->sge_index] : NULL;
	s->num_sge = (int)w->num_sge;
	s->opcode = (enum ibv_wr_opcode)w->opcode;
	s->send_flags = w->flags;
	switch (w->opcode) {
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_SEND_WITH_IMM:
		s->imm_data = htobe32(w->imm);
		break;
	case IBV_WR_SEND_WITH_INV:
	case IBV_WR_LOCAL_INV:
		s->invalidate_rkey = w->imm;
		break;
	default:
		s->imm_data = 0;
	}
	if (ud) {
		s->wr.ud.ah = (struct ibv_ah *)(uintptr_t)w->ah;
		s->wr.ud.remote_qpn = w->remote_qpn;
		s->wr.ud.remote_qkey = gv_qkey(q, w->remote_qkey);
		return;
	}
	switch (w->opcode) {
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		s->wr.atomic.remote_addr = w->remote_addr;
		s->wr.atomic.compare_add = w->compare_add;
		s->wr.atomic.swap = w->swap;
		s->wr.atomic.rkey = w->rkey;
		break;
	default:
		s->wr.rdma.remote_addr = w->remote_addr;
		s->wr.rdma.rkey = w->rkey;
	}
}

// gv_can_send reports whether the QP's state takes send requests, as far
// as libibverbs knows it (ibv_qp.state, which ibv_modify_qp and
// ibv_query_qp keep up to date; a move to ERR by the device is not seen,
// and posting in ERR is allowed). Some providers do not check it
// themselves before they queue the requests: rxe writes them into the
// send queue and only then has the kernel refuse the doorbell (EINVAL) in
// RESET, INIT or RTR, leaving them queued to run once the QP reaches RTS,
// although the caller was told they were not posted.
static inline int gv_can_send(const struct ibv_qp *qp)
{
	switch (__atomic_load_n(&qp->state, __ATOMIC_RELAXED)) {
	case IBV_QPS_RESET:
	case IBV_QPS_INIT:
	case IBV_QPS_RTR:
		return 0;
	default:
		return 1;
	}
}

int gv_post_send(gv_qp *q, const gv_send_wr *wrs, int n, const gv_sge *sges,
		 int nsge, int *accepted)
{
	struct ibv_send_wr arr[GV_CHUNK];
	struct ibv_send_wr *bad = NULL;
	int ud = q->qp->qp_type == IBV_QPT_UD;
	int lim, done = 0, rc_bad = EINVAL;

	*accepted = 0;
	if (!gv_can_send(q->qp))
		return EINVAL;
	GV_FIRST_BAD_SGL(wrs, n, nsge, lim);
	int rc_wr, lim_wr = gv_first_bad_wr(wrs, lim, ud, &rc_wr);
	if (lim_wr < lim) {
		lim = lim_wr;
		rc_bad = rc_wr;
	}
	while (done < lim) {
		int m = lim - done;
		if (m > GV_CHUNK)
			m = GV_CHUNK;
		for (int i = 0; i < m; i++)
			gv_fill_send(&arr[i], &wrs[done + i], sges, q, ud);
		arr[m - 1].next = NULL;
		bad = NULL;
		int rc = ibv_post_send(q->qp, arr, &bad);
		if (rc) {
			int idx = bad ? (int)(bad - arr) : 0;
			if (idx < 0 || idx >= m)
				idx = 0;
			*accepted = done + idx;
			return gv_err(rc);
		}
		done += m;
	}
	*accepted = done;
	return lim < n ? rc_bad : 0;
}

// gv_post_send_wr posts with the extended work-request API
// (ibv_wr_start/ibv_wr_*/ibv_wr_complete). A batch that ibv_wr_complete
// refuses (nothing of it posted) goes through gv_post_send, which posts
// the requests before the one refused; a batch refused before
// ibv_wr_complete (an unsupported opcode, an SGE list or inline size
// beyond the QP's) is posted not at all and *accepted is 0.
int gv_post_send_wr(gv_qp *q, const gv_send_wr *wrs, int n, const gv_sge *sges,
		    int nsge, int *accepted)
{
	struct ibv_qp_ex *x = q->qpx;
	int ud = q->qp->qp_type == IBV_QPT_UD;
	int lim;

	*accepted = 0;
	if (!gv_can_send(q->qp))
		return EINVAL;
	GV_FIRST_BAD_SGL(wrs, n, nsge, lim);
	if (lim < n)
		return EINVAL;
	int rc_wr;
	if (gv_first_bad_wr(wrs, n, ud, &rc_wr) < n)
		return rc_wr;
	int multi_sge = 0;
	for (int i = 0; i < n; i++) {
		const gv_send_wr *w = &wrs[i];
		if (w->flags & IBV_SEND_INLINE) {
			uint64_t len = 0;
			for (uint32_t j = 0; j < w->num_sge; j++)
				len += sges[w->sge_index + j].length;
			if (len > GV_MAX_INLINE || len > q->max_inline)
				return EINVAL;
		} else if (w->num_sge > q->max_send_sge) {
			return EINVAL;
		} else if (w->num_sge > 1) {
			multi_sge = 1;
		}
	}
	// rxe (rdma-core <= 58 at least) computes the length of an
	// ibv_wr_set_sge_list request from its first SGE only; such batches go
	// through ibv_post_send, which takes the same send-queue lock.
	if (multi_sge && q->sge_list_broken)
		return gv_post_send(q, wrs, n, sges, nsge, accepted);
	ibv_wr_start(x);
	for (int i = 0; i < n; i++) {
		const gv_send_wr *w = &wrs[i];
		x->wr_id = w->wr_id;
		x->wr_flags = w->flags;
		switch (w->opcode) {
		case IBV_WR_RDMA_WRITE:
			if (!(q->ops & IBV_QP_EX_WITH_RDMA_WRITE))
				goto unsupported;
			ibv_wr_rdma_write(x, w->rkey, w->remote_addr);
			break;
		case IBV_WR_RDMA_WRITE_WITH_IMM:
			if (!(q->ops & IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM))
				goto unsupported;
			ibv_wr_rdma_write_imm(x, w->rkey, w->remote_addr, htobe32(w->imm));
			break;
		case IBV_WR_SEND:
			if (!(q->ops & IBV_QP_EX_WITH_SEND))
				goto unsupported;
			ibv_wr_send(x);
			break;
		case IBV_WR_SEND_WITH_IMM:
			if (!(q->ops & IBV_QP_EX_WITH_SEND_WITH_IMM))
				goto unsupported;
			ibv_wr_send_imm(x, htobe32(w->imm));
			break;
		case IBV_WR_RDMA_READ:
			if (!(q->ops & IBV_QP_EX_WITH_RDMA_READ))
				goto unsupported;
			ibv_wr_rdma_read(x, w->rkey, w->remote_addr);
			break;
		case IBV_WR_ATOMIC_CMP_AND_SWP:
			if (!(q->ops & IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP))
				goto unsupported;
			ibv_wr_atomic_cmp_swp(x, w->rkey, w->remote_addr, w->compare_add, w->swap);
			break;
		case IBV_WR_ATOMIC_FETCH_AND_ADD:
			if (!(q->ops & IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD))
				goto unsupported;
			ibv_wr_atomic_fetch_add(x, w->rkey, w->remote_addr, w->compare_add);
			break;
		default:
			goto unsupported;
		}
		if (ud)
			ibv_wr_set_ud_addr(x, (struct ibv_ah *)(uintptr_t)w->ah,
					   w->remote_qpn, gv_qkey(q, w->remote_qkey));
		if ((w->flags & IBV_SEND_INLINE) && w->num_sge > 1) {
			// Gather into one buffer: ibv_wr_set_inline_data_list
			// is broken on some providers (rxe: the total length
			// stays 0), and one buffer is what the HCA copies anyway.
			uint8_t data[GV_MAX_INLINE];
			size_t len = 0;
			for (uint32_t j = 0; j < w->num_sge; j++) {
				const gv_sge *g = &sges[w->sge_index + j];
				memcpy(data + len, (void *)(uintptr_t)g->addr, g->length);
				len += g->length;
			}
			ibv_wr_set_inline_data(x, data, len);
		} else if ((w->flags & IBV_SEND_INLINE) && w->num_sge == 1) {
			const gv_sge *g = &sges[w->sge_index];
			ibv_wr_set_inline_data(x, (void *)(uintptr_t)g->addr, g->length);
		} else if (w->num_sge == 1) {
			const gv_sge *g = &sges[w->sge_index];
			ibv_wr_set_sge(x, g->lkey, g->addr, g->length);
		} else {
			ibv_wr_set_sge_list(x, w->num_sge,
					    (const struct ibv_sge *)&sges[w->sge_index]);
		}
		continue;
	unsupported:
		// Nothing of the batch is posted; the count stays 0.
		ibv_wr_abort(x);
		(void)i;
		return EOPNOTSUPP;
	}
	int rc = ibv_wr_complete(x);
	if (rc) {
		// Nothing of the batch was posted. Post it again the classic
		// way, which posts the requests before the one the device
		// refuses (a full queue: those that fit) and says which, as
		// PostSend promises on every path.
		return gv_post_send(q, wrs, n, sges, nsge, accepted);
	}
	*accepted = n;
	return 0;
}

static inline void gv_fill_recv(struct ibv_recv_wr *r, const gv_recv_wr *w,
				const gv_sge *sges)
{
	r->wr_id = w->wr_id;
	r->next = r + 1;
	r->sg_list = w->num_sge ? (struct ibv_sge *)&sges[w->sge_index] : NULL;
	r->num_sge = (int)w->num_sge;
}

#define GV_POST_RECV(postfn, obj)                                                 \
	do {                                                                      \
		struct ibv_recv_wr arr[GV_CHUNK];                                 \
		struct ibv_recv_wr *bad = NULL;                                   \
		int lim, done = 0;                                                \
		GV_FIRST_BAD_SGL(wrs, n, nsge, lim);                              \
		while (done < lim) {                                              \
			int m = lim - done;                                       \
			if (m > GV_CHUNK)                                         \
				m = GV_CHUNK;                                     \
			for (int i = 0; i < m; i++)                               \
				gv_fill_recv(&arr[i], &wrs[done + i], sges);      \
			arr[m - 1].next = NULL;                                   \
			bad = NULL;                                               \
			int rc = postfn((obj), arr, &bad);                        \
			if (rc) {                                                 \
				int idx = bad ? (int)(bad - arr) : 0;             \
				if (idx < 0 || idx >= m)                          \
					idx = 0;                                  \
				*accepted = done + idx;                           \
				return gv_err(rc);                                \
			}                                                         \
			done += m;                                                \
		}                                                                 \
		*accepted = done;                                                 \
		return lim < n ? EINVAL : 0;                                      \
	} while (0)

int gv_post_recv(gv_qp *q, const gv_recv_wr *wrs, int n, const gv_sge *sges,
		 int nsge, int *accepted)
{
	GV_POST_RECV(ibv_post_recv, q->qp);
}

int gv_post_srq_recv(struct ibv_srq *srq, const gv_recv_wr *wrs, int n,
		     const gv_sge *sges, int nsge, int *accepted)
{
	GV_POST_RECV(ibv_post_srq_recv, srq);
}

static inline void gv_read_ex(struct ibv_cq_ex *x, uint64_t f, gv_wc *d)
{
	d->wr_id = x->wr_id;
	d->status = x->status;
	d->opcode = ibv_wc_read_opcode(x);
	d->vendor_err = ibv_wc_read_vendor_err(x);
	d->flags = ibv_wc_read_wc_flags(x);
	d->byte_len = (f & IBV_WC_EX_WITH_BYTE_LEN) ? ibv_wc_read_byte_len(x) : 0;
	d->imm = 0;
	if ((d->flags & IBV_WC_WITH_IMM) && (f & IBV_WC_EX_WITH_IMM))
		d->imm = be32toh(ibv_wc_read_imm_data(x));
	else if ((d->flags & IBV_WC_WITH_INV) && (f & IBV_WC_EX_WITH_IMM))
		d->imm = ibv_wc_read_invalidated_rkey(x);
	d->qpn = (f & IBV_WC_EX_WITH_QP_NUM) ? ibv_wc_read_qp_num(x) : 0;
	d->src_qp = (f & IBV_WC_EX_WITH_SRC_QP) ? ibv_wc_read_src_qp(x) : 0;
	d->slid = (f & IBV_WC_EX_WITH_SLID) ? (uint16_t)ibv_wc_read_slid(x) : 0;
	d->sl = (f & IBV_WC_EX_WITH_SL) ? ibv_wc_read_sl(x) : 0;
	d->dlid_bits = (f & IBV_WC_EX_WITH_DLID_PATH_BITS) ? ibv_wc_read_dlid_path_bits(x) : 0;
	d->pkey_index = 0;
	memset(d->_pad, 0, sizeof d->_pad);
}

int gv_poll_cq(gv_cq *c, gv_wc *dst, int n)
{
	if (!c->cqx) {
		struct ibv_wc *raw = (struct ibv_wc *)(void *)dst;
		int got = ibv_poll_cq(c->cq, n, raw);
		if (got < 0)
			return -gv_err(got);
		for (int i = 0; i < got; i++)
			if (raw[i].wc_flags & IBV_WC_WITH_IMM)
				dst[i].imm = be32toh(raw[i].imm_data);
		return got;
	}
	struct ibv_poll_cq_attr attr = {0};
	if (c->next_poll_broken) {
		// rxe (rdma-core 44 at least): after ibv_next_poll found the CQ
		// empty, ibv_end_poll moves the consumer index one entry past
		// the producer's, and later polls return stale entries over
		// and over. One ibv_start_poll/ibv_end_poll pair per
		// completion never calls ibv_next_poll.
		int i = 0;
		while (i < n) {
			int rc = ibv_start_poll(c->cqx, &attr);
			if (rc == ENOENT)
				break;
			if (rc)
				return i ? i : -gv_err(rc);
			gv_read_ex(c->cqx, c->wc_flags, &dst[i]);
			i++;
			ibv_end_poll(c->cqx);
		}
		return i;
	}
	int rc = ibv_start_poll(c->cqx, &attr);
	if (rc == ENOENT)
		return 0;
	if (rc)
		return -gv_err(rc);
	int i = 0;
	for (;;) {
		gv_read_ex(c->cqx, c->wc_flags, &dst[i]);
		i++;
		if (i == n)
			break;
		rc = ibv_next_poll(c->cqx);
		if (rc)
			break; // ENOENT: empty; a real error surfaces on the next poll
	}
	ibv_end_poll(c->cqx);
	return i;
}

// gv_poll_cq_busy repeats gv_poll_cq until it finds completions (or an
// error) or spins polls found the CQ empty: a busy-polling loop that
// crosses from Go into C once per spins empty polls.
int gv_poll_cq_busy(gv_cq *c, gv_wc *dst, int n, int spins)
{
	int got;
	do
		got = gv_poll_cq(c, dst, n);
	while (got == 0 && --spins > 0);
	return got;
}

int gv_req_notify_cq(gv_cq *c, int solicited_only)
{
	int rc = ibv_req_notify_cq(c->cq, solicited_only);
	return rc ? gv_err(rc) : 0;
}

int gv_get_cq_event(struct ibv_comp_channel *ch, uint64_t *handle)
{
	struct ibv_cq *cq = NULL;
	void *ctx = NULL;
	errno = 0;
	if (ibv_get_cq_event(ch, &cq, &ctx))
		return gv_errno();
	*handle = (uint64_t)(uintptr_t)ctx;
	// Acknowledge at once: ibv_destroy_cq waits for all events to be
	// acknowledged, and the handle (not the CQ) is all Go needs.
	ibv_ack_cq_events(cq, 1);
	return 0;
}

int gv_get_async_event(struct ibv_context *ctx, uint32_t *type, uint64_t *handle,
		       uint32_t *qpn, uint32_t *port)
{
	struct ibv_async_event ev;
	errno = 0;
	if (ibv_get_async_event(ctx, &ev))
		return gv_errno();
	*type = ev.event_type;
	*handle = 0;
	*qpn = 0;
	*port = 0;
	switch (ev.event_type) {
	case IBV_EVENT_CQ_ERR:
		*handle = (uint64_t)(uintptr_t)ev.element.cq->cq_context;
		break;
	case IBV_EVENT_QP_FATAL:
	case IBV_EVENT_QP_REQ_ERR:
	case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST:
	case IBV_EVENT_SQ_DRAINED:
	case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR:
	case IBV_EVENT_QP_LAST_WQE_REACHED:
		*handle = (uint64_t)(uintptr_t)ev.element.qp->qp_context;
		*qpn = ev.element.qp->qp_num;
		break;
	case IBV_EVENT_SRQ_ERR:
	case IBV_EVENT_SRQ_LIMIT_REACHED:
		*handle = (uint64_t)(uintptr_t)ev.element.srq->srq_context;
		break;
	case IBV_EVENT_PORT_ACTIVE:
	case IBV_EVENT_PORT_ERR:
	case IBV_EVENT_LID_CHANGE:
	case IBV_EVENT_PKEY_CHANGE:
	case IBV_EVENT_SM_CHANGE:
	case IBV_EVENT_CLIENT_REREGISTER:
	case IBV_EVENT_GID_CHANGE:
		*port = (uint32_t)ev.element.port_num;
		break;
	default:
		break;
	}
	ibv_ack_async_event(&ev);
	return 0;
}

int gv_query_port(struct ibv_context *ctx, uint8_t port, gv_port_attr *out)
{
	struct ibv_port_attr a;
	memset(&a, 0, sizeof a);
	int rc = ibv_query_port(ctx, port, &a);
	if (rc)
		return gv_err(rc);
	out->state = a.state;
	out->max_mtu = a.max_mtu;
	out->active_mtu = a.active_mtu;
	out->gid_tbl_len = a.gid_tbl_len;
	out->port_cap_flags = a.port_cap_flags;
	out->max_msg_sz = a.max_msg_sz;
	out->active_speed = a.active_speed;
	out->pkey_tbl_len = a.pkey_tbl_len;
	out->lid = a.lid;
	out->sm_lid = a.sm_lid;
	out->lmc = a.lmc;
	out->active_width = a.active_width;
	out->phys_state = a.phys_state;
	out->link_layer = a.link_layer;
	return 0;
}

// gv_query_device fills out with the device attributes (ibv_query_device_ex
// where the provider implements it, else ibv_query_device); *ports gets the
// extended port count when known.
int gv_query_device(struct ibv_context *ctx, struct ibv_device_attr *out, uint32_t *ports)
{
	struct ibv_device_attr_ex ax;
	memset(&ax, 0, sizeof ax);
	int rc = ibv_query_device_ex(ctx, NULL, &ax);
	if (rc == 0) {
		*out = ax.orig_attr;
		*ports = ax.phys_port_cnt_ex ? ax.phys_port_cnt_ex : ax.orig_attr.phys_port_cnt;
		return 0;
	}
	rc = ibv_query_device(ctx, out);
	if (rc)
		return gv_err(rc);
	*ports = out->phys_port_cnt;
	return 0;
}

static int gv_gid_zero(const union ibv_gid *g)
{
	static const uint8_t zero[16];
	return memcmp(g->raw, zero, 16) == 0;
}

static void gv_copy_gid(gv_gid *d, const struct ibv_gid_entry *e)
{
	memcpy(d->gid, e->gid.raw, 16);
	d->index = e->gid_index;
	d->port = e->port_num;
	d->gid_type = e->gid_type;
	d->ifindex = e->ndev_ifindex;
}

// gv_query_gid_table stores the port's valid, non-zero GID entries in out
// (at most max) and returns their number, or a negative errno. It uses
// ibv_query_gid_table, else ibv_query_gid_ex per index.
int gv_query_gid_table(struct ibv_context *ctx, uint8_t port, int tbl_len, gv_gid *out, int max)
{
	struct ibv_device_attr da;
	uint32_t ports = 0;
	int count = 0;

	if (gv_query_device(ctx, &da, &ports) == 0 && ports > 0) {
		size_t total = 0;
		for (uint32_t p = 1; p <= ports; p++) {
			struct ibv_port_attr pa;
			if (ibv_query_port(ctx, (uint8_t)p, &pa) == 0 && pa.gid_tbl_len > 0)
				total += (size_t)pa.gid_tbl_len;
		}
		if (total > 0) {
			struct ibv_gid_entry *e = calloc(total, sizeof *e);
			if (!e)
				return -ENOMEM;
			ssize_t got = ibv_query_gid_table(ctx, e, total, 0);
			if (got >= 0) {
				for (ssize_t i = 0; i < got && count < max; i++) {
					if (e[i].port_num != port || gv_gid_zero(&e[i].gid))
						continue;
					gv_copy_gid(&out[count++], &e[i]);
				}
				free(e);
				return count;
			}
			free(e);
		}
	}
	for (int i = 0; i < tbl_len && count < max; i++) {
		struct ibv_gid_entry e;
		int rc = ibv_query_gid_ex(ctx, port, (uint32_t)i, &e, 0);
		if (rc == ENODATA || rc == -ENODATA)
			continue;
		if (rc)
			return -gv_err(rc);
		if (gv_gid_zero(&e.gid))
			continue;
		gv_copy_gid(&out[count++], &e);
	}
	return count;
}

struct ibv_mr *gv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
	return ibv_reg_mr(pd, addr, len, access);
}

struct ibv_mr *gv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len,
				uint64_t iova, int fd, int access)
{
	return ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access);
}

int gv_create_cq(struct ibv_context *ctx, int cqe, struct ibv_comp_channel *ch,
		 int vector, uint64_t handle, int use_ex, gv_cq *out)
{
	memset(out, 0, sizeof *out);
	void *cq_context = (void *)(uintptr_t)handle;
	if (use_ex) {
		static const uint64_t tries[] = {
			IBV_WC_STANDARD_FLAGS,
			IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM |
				IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP,
		};
		for (size_t t = 0; t < sizeof tries / sizeof tries[0]; t++) {
			struct ibv_cq_init_attr_ex a;
			memset(&a, 0, sizeof a);
			a.cqe = (uint32_t)cqe;
			a.cq_context = cq_context;
			a.channel = ch;
			a.comp_vector = (uint32_t)vector;
			a.wc_flags = tries[t];
			struct ibv_cq_ex *x = ibv_create_cq_ex(ctx, &a);
			if (x) {
				out->cqx = x;
				out->cq = ibv_cq_ex_to_cq(x);
				out->wc_flags = tries[t];
				return 0;
			}
			if (errno == EOPNOTSUPP || errno == ENOSYS)
				break;
		}
	}
	errno = 0;
	out->cq = ibv_create_cq(ctx, cqe, cq_context, ch, vector);
	return out->cq ? 0 : gv_errno();
}

int gv_destroy_cq(gv_cq *c)
{
	int rc = ibv_destroy_cq(c->cq);
	return rc ? gv_err(rc) : 0;
}

int gv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr, uint64_t handle,
		 int use_ex, gv_qp *out)
{
	memset(out, 0, sizeof *out);
	attr->qp_context = (void *)(uintptr_t)handle;
	if (use_ex) {
		uint64_t ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
		if (attr->qp_type == IBV_QPT_RC || attr->qp_type == IBV_QPT_UC)
			ops |= IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
		if (attr->qp_type == IBV_QPT_RC)
			ops |= IBV_QP_EX_WITH_RDMA_READ;
		uint64_t atomics = attr->qp_type == IBV_QPT_RC ?
			IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD : 0;
		for (int t = 0; t < 2; t++) {
			struct ibv_qp_init_attr_ex ax;
			memset(&ax, 0, sizeof ax);
			ax.qp_context = attr->qp_context;
			ax.send_cq = attr->send_cq;
			ax.recv_cq = attr->recv_cq;
			ax.srq = attr->srq;
			ax.cap = attr->cap;
			ax.qp_type = attr->qp_type;
			ax.sq_sig_all = attr->sq_sig_all;
			ax.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
			ax.pd = pd;
			ax.send_ops_flags = t == 0 ? ops | atomics : ops;
			errno = 0;
			struct ibv_qp *qp = ibv_create_qp_ex(pd->context, &ax);
			if (qp) {
				struct ibv_qp_ex *x = ibv_qp_to_qp_ex(qp);
				if (!x) {
					ibv_destroy_qp(qp);
					break;
				}
				attr->cap = ax.cap;
				out->qp = qp;
				out->qpx = x;
				out->ops = ax.send_ops_flags;
				out->max_inline = ax.cap.max_inline_data;
				out->max_send_sge = ax.cap.max_send_sge;
				return 0;
			}
			if (errno == EOPNOTSUPP || errno == ENOSYS || !atomics)
				break;
		}
	}
	errno = 0;
	out->qp = ibv_create_qp(pd, attr);
	if (!out->qp)
		return gv_errno();
	out->max_inline = attr->cap.max_inline_data;
	out->max_send_sge = attr->cap.max_send_sge;
	return 0;
}

int gv_destroy_qp(gv_qp *q)
{
	int rc = ibv_destroy_qp(q->qp);
	return rc ? gv_err(rc) : 0;
}

struct ibv_srq *gv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *attr,
			      uint64_t handle)
{
	attr->srq_context = (void *)(uintptr_t)handle;
	return ibv_create_srq(pd, attr);
}

void gv_nop(void)
{
}
