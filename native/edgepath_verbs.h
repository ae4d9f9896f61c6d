/*
 * The verbs data plane: post/poll hot loops in C over libibverbs objects that
 * pyverbs created (context, PD, CQs, SRQ, QPs) and rdma_cm ids pyverbs owns.
 *
 * pyverbs does not hand out its raw C handles, so the Python side reads them
 * from the pyverbs objects and every handle is checked here against values
 * pyverbs reports independently (cmd_fd, qp_num, cqe, the owning context)
 * before it is used: a pyverbs with another object layout fails at setup,
 * never with a wild pointer on the data path.
 *
 * Built into edgepath.native._verbs (linked with libibverbs and librdmacm)
 * only where their headers are installed; see build.py.
 */
#ifndef EDGEPATH_VERBS_H
#define EDGEPATH_VERBS_H

#include <stdint.h>

/* CDEF-BEGIN */
/* Operation codes for ep_v_post_wait (mapped to IBV_WR_* in the C file). */
#define EP_V_WRITE 0
#define EP_V_WRITE_IMM 1
#define EP_V_READ 2

/* Results besides 0 (success) and a positive ibv_wc_status of a failed completion. */
#define EP_V_E_TIMEOUT -1
#define EP_V_E_POST -2
#define EP_V_E_POLL -3

/* Handle checks: 0 when the pointer is the object pyverbs describes. */
int ep_v_check_context(uintptr_t ctx, int cmd_fd);
int ep_v_check_cq(uintptr_t cq, uintptr_t ctx, int cqe);
int ep_v_check_qp(uintptr_t qp, uintptr_t ctx, uint32_t qp_num);
int ep_v_check_srq(uintptr_t srq, uintptr_t ctx);
int ep_v_comp_channel_fd(uintptr_t channel, uintptr_t ctx);
int ep_v_cm_channel_fd(uintptr_t channel);
int ep_v_cm_id_check(uintptr_t id, uintptr_t channel);
/* Move a connection's rdma_cm id to its own event channel (pyverbs has no rdma_migrate_id). */
int ep_v_cm_migrate(uintptr_t id, uintptr_t channel);
/* Reject a connection request with private data (at most 148 bytes: pyverbs' reject does not pass its own). */
int ep_v_cm_reject(uintptr_t id, const char *data, int length);
/* The peer's address of a connection's rdma_cm id as "IP:PORT" (0), or -1: for a refusal's log line. */
int ep_v_cm_peer(uintptr_t id, char *out, int length);

/* One signaled WRITE / WRITE_WITH_IMM / READ, then wait for its completion on scq. */
int ep_v_post_wait(uintptr_t qp, uintptr_t scq, int op, uint64_t laddr, uint32_t lkey, uint32_t length,
                   uint64_t raddr, uint32_t rkey, uint32_t imm, int64_t timeout_ns);
/* An unsignaled WRITE and a signaled WRITE_WITH_IMM (same lkey and rkey) posted together. */
int ep_v_write_then_imm(uintptr_t qp, uintptr_t scq, uint64_t laddr, uint32_t lkey, uint32_t length, uint64_t raddr,
                        uint32_t rkey, uint64_t bell_laddr, uint32_t bell_length, uint64_t bell_raddr, uint32_t imm,
                        int64_t timeout_ns);
/* Remote 64-bit compare-and-swap; the value found lands in *result (registered with lkey). */
int ep_v_cas(uintptr_t qp, uintptr_t scq, uint64_t *result, uint32_t lkey, uint64_t raddr, uint32_t rkey,
             uint64_t expected, uint64_t desired, int64_t timeout_ns);
const char *ep_v_status_str(int status);

/* Receive side: one CQ (with a completion channel) and one SRQ for all connections. */
struct ep_vcq;
struct ep_vcq *ep_vcq_new(uintptr_t cq, uintptr_t channel, uintptr_t srq, int recv_depth);
void ep_vcq_free(struct ep_vcq *q);
int ep_vcq_fd(struct ep_vcq *q);
/* Entries are (qp_num << 32) | imm; failed receive completions are counted, not returned. */
int ep_vcq_poll(struct ep_vcq *q, uint64_t *out, int max);
int ep_vcq_wait(struct ep_vcq *q, uint64_t *out, int max, int64_t timeout_ns, int64_t spin_ns);
int ep_vcq_arm(struct ep_vcq *q);
uint64_t ep_vcq_errors(struct ep_vcq *q);
/* CDEF-END */

#endif
