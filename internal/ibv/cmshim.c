//go:build ibverbs && linux && cgo

#include "cmshim.h"

#include <errno.h>
#include <string.h>
#include <netinet/in.h>

static inline int gv_cm_errno(int rc)
{
	if (rc == 0)
		return 0;
	return errno ? errno : EIO;
}

int gv_cm_get_event(struct rdma_event_channel *ch, gv_cm_event *out)
{
	struct rdma_cm_event *ev = NULL;
	errno = 0;
	if (rdma_get_cm_event(ch, &ev))
		return errno ? errno : EIO;
	memset(out, 0, sizeof *out);
	out->id = ev->id;
	out->listen_id = ev->listen_id;
	out->event = ev->event;
	out->status = ev->status;
	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST:
	case RDMA_CM_EVENT_CONNECT_RESPONSE:
	case RDMA_CM_EVENT_ESTABLISHED:
	case RDMA_CM_EVENT_REJECTED: {
		const struct rdma_conn_param *c = &ev->param.conn;
		uint32_t n = c->private_data ? c->private_data_len : 0;
		if (n > GV_CM_PRIVATE_MAX)
			n = GV_CM_PRIVATE_MAX;
		if (n)
			memcpy(out->private_data, c->private_data, n);
		out->private_data_len = n;
		out->qp_num = c->qp_num;
		out->responder_resources = c->responder_resources;
		out->initiator_depth = c->initiator_depth;
		out->retry_count = c->retry_count;
		out->rnr_retry_count = c->rnr_retry_count;
		out->srq = c->srq;
		break;
	}
	default:
		break;
	}
	rdma_ack_cm_event(ev);
	return 0;
}

int gv_cm_create_id(struct rdma_event_channel *ch, struct rdma_cm_id **id)
{
	errno = 0;
	return gv_cm_errno(rdma_create_id(ch, id, NULL, RDMA_PS_TCP));
}

// gv_to_sockaddr fills ss from a; returns its length.
static socklen_t gv_to_sockaddr(const gv_sockaddr *a, struct sockaddr_storage *ss)
{
	memset(ss, 0, sizeof *ss);
	if (a->family == AF_INET) {
		struct sockaddr_in *s = (struct sockaddr_in *)ss;
		s->sin_family = AF_INET;
		s->sin_port = htons(a->port);
		memcpy(&s->sin_addr, a->addr, 4);
		return sizeof *s;
	}
	struct sockaddr_in6 *s = (struct sockaddr_in6 *)ss;
	s->sin6_family = AF_INET6;
	s->sin6_port = htons(a->port);
	s->sin6_scope_id = a->scope_id;
	memcpy(&s->sin6_addr, a->addr, 16);
	return sizeof *s;
}

static void gv_from_sockaddr(const struct sockaddr *sa, gv_sockaddr *a)
{
	memset(a, 0, sizeof *a);
	if (!sa)
		return;
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)sa;
		a->family = AF_INET;
		a->port = ntohs(s->sin_port);
		memcpy(a->addr, &s->sin_addr, 4);
	} else if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;
		a->family = AF_INET6;
		a->port = ntohs(s->sin6_port);
		a->scope_id = s->sin6_scope_id;
		memcpy(a->addr, &s->sin6_addr, 16);
	}
}

int gv_cm_bind_addr(struct rdma_cm_id *id, const gv_sockaddr *a)
{
	struct sockaddr_storage ss;
	gv_to_sockaddr(a, &ss);
	errno = 0;
	return gv_cm_errno(rdma_bind_addr(id, (struct sockaddr *)&ss));
}

int gv_cm_listen(struct rdma_cm_id *id, int backlog)
{
	errno = 0;
	return gv_cm_errno(rdma_listen(id, backlog));
}

int gv_cm_resolve_addr(struct rdma_cm_id *id, const gv_sockaddr *dst, int timeout_ms)
{
	struct sockaddr_storage ss;
	gv_to_sockaddr(dst, &ss);
	errno = 0;
	return gv_cm_errno(rdma_resolve_addr(id, NULL, (struct sockaddr *)&ss, timeout_ms));
}

int gv_cm_resolve_route(struct rdma_cm_id *id, int timeout_ms)
{
	errno = 0;
	return gv_cm_errno(rdma_resolve_route(id, timeout_ms));
}

int gv_cm_addrs(struct rdma_cm_id *id, gv_sockaddr *local, gv_sockaddr *peer)
{
	gv_from_sockaddr(rdma_get_local_addr(id), local);
	gv_from_sockaddr(rdma_get_peer_addr(id), peer);
	return 0;
}

int gv_cm_init_qp_attr(struct rdma_cm_id *id, int state, struct ibv_qp_attr *attr, int *mask)
{
	memset(attr, 0, sizeof *attr);
	attr->qp_state = (enum ibv_qp_state)state;
	errno = 0;
	return gv_cm_errno(rdma_init_qp_attr(id, attr, mask));
}

static void gv_conn(const gv_conn_param *p, const uint8_t *pdata, uint32_t len,
		    struct rdma_conn_param *c)
{
	memset(c, 0, sizeof *c);
	c->private_data = len ? pdata : NULL;
	c->private_data_len = (uint8_t)len;
	c->responder_resources = p->responder_resources;
	c->initiator_depth = p->initiator_depth;
	c->flow_control = 1;
	c->retry_count = p->retry_count;
	c->rnr_retry_count = p->rnr_retry_count;
	c->srq = p->srq;
	c->qp_num = p->qp_num;
}

int gv_cm_connect(struct rdma_cm_id *id, const gv_conn_param *p, const uint8_t *pdata, uint32_t len)
{
	struct rdma_conn_param c;
	gv_conn(p, pdata, len, &c);
	errno = 0;
	return gv_cm_errno(rdma_connect(id, &c));
}

int gv_cm_accept(struct rdma_cm_id *id, const gv_conn_param *p, const uint8_t *pdata, uint32_t len)
{
	struct rdma_conn_param c;
	gv_conn(p, pdata, len, &c);
	errno = 0;
	return gv_cm_errno(rdma_accept(id, &c));
}

int gv_cm_reject(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len)
{
	errno = 0;
	return gv_cm_errno(rdma_reject(id, len ? private_data : NULL, (uint8_t)len));
}

int gv_cm_establish(struct rdma_cm_id *id)
{
	errno = 0;
	return gv_cm_errno(rdma_establish(id));
}

int gv_cm_disconnect(struct rdma_cm_id *id)
{
	errno = 0;
	return gv_cm_errno(rdma_disconnect(id));
}

int gv_cm_migrate_id(struct rdma_cm_id *id, struct rdma_event_channel *ch)
{
	errno = 0;
	return gv_cm_errno(rdma_migrate_id(id, ch));
}

int gv_cm_destroy_id(struct rdma_cm_id *id)
{
	errno = 0;
	return gv_cm_errno(rdma_destroy_id(id));
}

const char *gv_cm_device_name(struct rdma_cm_id *id)
{
	if (!id->verbs)
		return NULL;
	return ibv_get_device_name(id->verbs->device);
}
