/*
 * Verbs data plane (see edgepath_verbs.h). cffi releases the GIL around each
 * call, so a thread waiting here for a completion never holds up the others.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "edgepath_verbs.h"

#define POLL_BATCH 32
#define STASH 256
/* Busy-poll a send CQ this long, then yield the CPU between polls (on rxe the NIC is kernel code
 * that may need this core; measured under TCG: 0, 2, 20 and 200 us give the same p50). */
#define SPIN_BEFORE_YIELD_NS 20000

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- handle checks ------------------------------------------------------- */

int ep_v_check_context(uintptr_t ctx, int cmd_fd)
{
    return ctx && ((struct ibv_context *)ctx)->cmd_fd == cmd_fd ? 0 : -1;
}

int ep_v_check_cq(uintptr_t cq, uintptr_t ctx, int cqe)
{
    struct ibv_cq *c = (struct ibv_cq *)cq;
    return c && (uintptr_t)c->context == ctx && c->cqe == cqe ? 0 : -1;
}

int ep_v_check_qp(uintptr_t qp, uintptr_t ctx, uint32_t qp_num)
{
    struct ibv_qp *q = (struct ibv_qp *)qp;
    return q && (uintptr_t)q->context == ctx && q->qp_num == qp_num && q->qp_type == IBV_QPT_RC ? 0 : -1;
}

int ep_v_check_srq(uintptr_t srq, uintptr_t ctx)
{
    struct ibv_srq *s = (struct ibv_srq *)srq;
    return s && (uintptr_t)s->context == ctx ? 0 : -1;
}

static int set_nonblocking(int fd)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return -1;
    return fd;
}

int ep_v_comp_channel_fd(uintptr_t channel, uintptr_t ctx)
{
    struct ibv_comp_channel *c = (struct ibv_comp_channel *)channel;
    if (!c || (uintptr_t)c->context != ctx)
        return -1;
    return set_nonblocking(c->fd);
}

int ep_v_cm_channel_fd(uintptr_t channel)
{
    struct rdma_event_channel *c = (struct rdma_event_channel *)channel;
    return c ? set_nonblocking(c->fd) : -1;
}

int ep_v_cm_id_check(uintptr_t id, uintptr_t channel)
{
    struct rdma_cm_id *i = (struct rdma_cm_id *)id;
    return i && (uintptr_t)i->channel == channel && i->ps == RDMA_PS_TCP ? 0 : -1;
}

int ep_v_cm_migrate(uintptr_t id, uintptr_t channel)
{
    return rdma_migrate_id((struct rdma_cm_id *)id, (struct rdma_event_channel *)channel) ? -errno : 0;
}

int ep_v_cm_reject(uintptr_t id, const char *data, int length)
{
    if (length < 0 || length > 148)
        return -EINVAL;
    return rdma_reject((struct rdma_cm_id *)id, data, (uint8_t)length) ? -errno : 0;
}

int ep_v_cm_peer(uintptr_t id, char *out, int length)
{
    struct sockaddr *sa = rdma_get_peer_addr((struct rdma_cm_id *)id);
    const void *addr;
    int port;
    char host[INET6_ADDRSTRLEN];

    if (!sa || length < 1)
        return -1;
    if (sa->sa_family == AF_INET) {
        addr = &((struct sockaddr_in *)sa)->sin_addr;
        port = ntohs(((struct sockaddr_in *)sa)->sin_port);
    } else if (sa->sa_family == AF_INET6) {
        addr = &((struct sockaddr_in6 *)sa)->sin6_addr;
        port = ntohs(((struct sockaddr_in6 *)sa)->sin6_port);
    } else {
        return -1;
    }
    if (!inet_ntop(sa->sa_family, addr, host, sizeof host))
        return -1;
    return snprintf(out, (size_t)length, "%s:%d", host, port) < length ? 0 : -1;
}

/* ---- synchronous one-sided operations ------------------------------------ */

/* Wait for the one signaled completion: spin first (lowest latency), then yield the CPU
 * between polls so a soft NIC (rxe) running on the same cores can make progress. */
static int wait_send(struct ibv_cq *cq, int64_t timeout_ns)
{
    struct ibv_wc wc;
    int64_t start = now_ns();
    for (;;) {
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0)
            return EP_V_E_POLL;
        if (n == 1)
            return wc.status == IBV_WC_SUCCESS ? 0 : (int)wc.status;
        int64_t waited = now_ns() - start;
        if (waited > timeout_ns)
            return EP_V_E_TIMEOUT;
        if (waited >= SPIN_BEFORE_YIELD_NS)
            sched_yield();
    }
}

int ep_v_post_wait(uintptr_t qp, uintptr_t scq, int op, uint64_t laddr, uint32_t lkey, uint32_t length,
                   uint64_t raddr, uint32_t rkey, uint32_t imm, int64_t timeout_ns)
{
    struct ibv_sge sge = {.addr = laddr, .length = length, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = length ? 1 : 0;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    switch (op) {
    case EP_V_WRITE:
        wr.opcode = IBV_WR_RDMA_WRITE;
        break;
    case EP_V_WRITE_IMM:
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(imm);
        break;
    case EP_V_READ:
        wr.opcode = IBV_WR_RDMA_READ;
        break;
    default:
        return EP_V_E_POST;
    }
    if (ibv_post_send((struct ibv_qp *)qp, &wr, &bad))
        return EP_V_E_POST;
    return wait_send((struct ibv_cq *)scq, timeout_ns);
}

int ep_v_write_then_imm(uintptr_t qp, uintptr_t scq, uint64_t laddr, uint32_t lkey, uint32_t length, uint64_t raddr,
                        uint32_t rkey, uint64_t bell_laddr, uint32_t bell_length, uint64_t bell_raddr, uint32_t imm,
                        int64_t timeout_ns)
{
    struct ibv_sge sge[2] = {{.addr = laddr, .length = length, .lkey = lkey},
                             {.addr = bell_laddr, .length = bell_length, .lkey = lkey}};
    struct ibv_send_wr wr[2], *bad = NULL;
    memset(wr, 0, sizeof(wr));
    wr[0].wr_id = 4;
    wr[0].next = &wr[1];
    wr[0].sg_list = &sge[0];
    wr[0].num_sge = length ? 1 : 0;
    wr[0].opcode = IBV_WR_RDMA_WRITE; /* unsignaled: a failure errors the QP, so the doorbell fails too */
    wr[0].wr.rdma.remote_addr = raddr;
    wr[0].wr.rdma.rkey = rkey;
    wr[1].wr_id = 5;
    wr[1].sg_list = &sge[1];
    wr[1].num_sge = bell_length ? 1 : 0;
    wr[1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr[1].send_flags = IBV_SEND_SIGNALED;
    wr[1].imm_data = htonl(imm);
    wr[1].wr.rdma.remote_addr = bell_raddr;
    wr[1].wr.rdma.rkey = rkey;
    if (ibv_post_send((struct ibv_qp *)qp, wr, &bad))
        return EP_V_E_POST;
    return wait_send((struct ibv_cq *)scq, timeout_ns);
}

int ep_v_cas(uintptr_t qp, uintptr_t scq, uint64_t *result, uint32_t lkey, uint64_t raddr, uint32_t rkey,
             uint64_t expected, uint64_t desired, int64_t timeout_ns)
{
    struct ibv_sge sge = {.addr = (uintptr_t)result, .length = 8, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = 2;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.atomic.remote_addr = raddr;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = expected;
    wr.wr.atomic.swap = desired;
    if (ibv_post_send((struct ibv_qp *)qp, &wr, &bad))
        return EP_V_E_POST;
    return wait_send((struct ibv_cq *)scq, timeout_ns);
}

const char *ep_v_status_str(int status)
{
    return ibv_wc_status_str((enum ibv_wc_status)status);
}

/* ---- receive completion queue ------------------------------------------- */

struct ep_vcq {
    struct ibv_cq *cq;
    struct ibv_comp_channel *channel;
    struct ibv_srq *srq;
    pthread_mutex_t lock;
    uint64_t stash[STASH];
    int stashed;
    uint64_t errors;
};

/* A receive WR with no buffer: WRITE_WITH_IMM consumes one and writes nothing into it. */
static void repost(struct ep_vcq *q, int n)
{
    struct ibv_recv_wr wr, *bad = NULL;
    for (int i = 0; i < n; i++) {
        memset(&wr, 0, sizeof(wr));
        wr.wr_id = 3;
        if (ibv_post_srq_recv(q->srq, &wr, &bad))
            q->errors++;
    }
}

struct ep_vcq *ep_vcq_new(uintptr_t cq, uintptr_t channel, uintptr_t srq, int recv_depth)
{
    struct ep_vcq *q = calloc(1, sizeof(*q));
    if (!q)
        return NULL;
    q->cq = (struct ibv_cq *)cq;
    q->channel = (struct ibv_comp_channel *)channel;
    q->srq = (struct ibv_srq *)srq;
    pthread_mutex_init(&q->lock, NULL);
    repost(q, recv_depth);
    if (q->errors || ibv_req_notify_cq(q->cq, 0)) {
        free(q);
        return NULL;
    }
    return q;
}

void ep_vcq_free(struct ep_vcq *q)
{
    if (q) {
        pthread_mutex_destroy(&q->lock);
        free(q);
    }
}

int ep_vcq_fd(struct ep_vcq *q)
{
    return q->channel->fd;
}

uint64_t ep_vcq_errors(struct ep_vcq *q)
{
    return q->errors;
}

/* Caller holds q->lock. */
static int poll_locked(struct ep_vcq *q, uint64_t *out, int max)
{
    int got = 0;
    if (q->stashed) {
        int n = q->stashed < max ? q->stashed : max;
        memcpy(out, q->stash, (size_t)n * sizeof(uint64_t));
        memmove(q->stash, q->stash + n, (size_t)(q->stashed - n) * sizeof(uint64_t));
        q->stashed -= n;
        got = n;
    }
    struct ibv_wc wc[POLL_BATCH];
    while (got < max) {
        int want = max - got < POLL_BATCH ? max - got : POLL_BATCH;
        int n = ibv_poll_cq(q->cq, want, wc);
        if (n < 0)
            return EP_V_E_POLL;
        if (n == 0)
            break;
        for (int i = 0; i < n; i++) {
            if (wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM)
                out[got++] = ((uint64_t)wc[i].qp_num << 32) | ntohl(wc[i].imm_data);
            else
                q->errors++;
        }
        repost(q, n);
    }
    return got;
}

int ep_vcq_poll(struct ep_vcq *q, uint64_t *out, int max)
{
    pthread_mutex_lock(&q->lock);
    int n = poll_locked(q, out, max);
    pthread_mutex_unlock(&q->lock);
    return n;
}

/* Consume pending channel events (non-blocking fd), re-arm, and stash anything that arrived
 * before the arm: returns how many entries are waiting (then poll before sleeping). */
int ep_vcq_arm(struct ep_vcq *q)
{
    struct ibv_cq *ev_cq;
    void *ev_ctx;
    pthread_mutex_lock(&q->lock);
    while (ibv_get_cq_event(q->channel, &ev_cq, &ev_ctx) == 0)
        ibv_ack_cq_events(ev_cq, 1);
    int rc = ibv_req_notify_cq(q->cq, 0);
    if (rc == 0 && q->stashed < STASH) {
        int n = poll_locked(q, q->stash + q->stashed, STASH - q->stashed);
        if (n > 0)
            q->stashed += n;
        else if (n < 0)
            rc = n;
    }
    int waiting = rc ? rc : q->stashed;
    pthread_mutex_unlock(&q->lock);
    return waiting;
}

int ep_vcq_wait(struct ep_vcq *q, uint64_t *out, int max, int64_t timeout_ns, int64_t spin_ns)
{
    int64_t start = now_ns();
    int n = ep_vcq_poll(q, out, max);
    while (n == 0 && spin_ns > 0 && now_ns() - start < spin_ns)
        n = ep_vcq_poll(q, out, max);
    while (n == 0) {
        int armed = ep_vcq_arm(q);
        if (armed < 0)
            return armed;
        if (armed == 0) {
            int ms = -1;
            if (timeout_ns >= 0) {
                int64_t left = timeout_ns - (now_ns() - start);
                if (left <= 0)
                    return 0;
                ms = (int)((left + 999999) / 1000000);
            }
            struct pollfd pfd = {.fd = q->channel->fd, .events = POLLIN};
            int r = poll(&pfd, 1, ms);
            if (r < 0 && errno != EINTR)
                return EP_V_E_POLL;
        }
        n = ep_vcq_poll(q, out, max);
        if (n == 0 && timeout_ns >= 0 && now_ns() - start >= timeout_ns)
            return 0;
    }
    return n;
}
