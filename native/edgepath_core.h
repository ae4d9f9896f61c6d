/*
 * Host-side data-plane primitives (built into edgepath.native._core by cffi).
 * Everything between the CDEF markers is the cffi cdef; see edgepath_slot.h.
 */
#ifndef EDGEPATH_CORE_H
#define EDGEPATH_CORE_H

#include <stddef.h>
#include "edgepath_slot.h"

/* CDEF-BEGIN */
uint64_t ep_now_ns(void);

/* State machine (edgepath_step.h) exposed to Python, and applied atomically. */
int ep_step_word(uint64_t cur, int event, uint32_t generation, uint32_t claimant, uint64_t *next);
/* The word a claimer CASes in for `cur` (ep_step's CLAIM), or 0 when `cur` cannot be claimed (a claimed
   word is never 0: its state is CLAIMED). */
uint64_t ep_claim_next(uint64_t cur, uint32_t claimant);
uint64_t ep_doorbell_word(uint32_t generation, uint32_t slot);
uint32_t ep_doorbell_imm_of(uint32_t generation, uint32_t slot);
uint32_t ep_reclaim_imm_of(uint32_t generation, uint32_t slot);
int ep_apply(uint64_t *word, int event, uint32_t generation, uint32_t claimant, uint64_t *prev);
/* The owner's step (the slot server's: any event but CLAIM) on a word it may share with remote CAS: `owned`
   is what the owner last stored there (0: nothing yet), kept by it and updated here.  A word found written
   back to an older value of its generation (ep_word_reverted: soft-RoCE's failed CAS) is stepped from
   `owned` instead, and *restored counts it.  `holder`: HANDOVER's (tenant << 24 | claimant; 0 for the others). */
int ep_apply_owned(uint64_t *word, uint64_t *owned, int event, uint32_t generation, uint32_t holder,
                   uint64_t *restored);
/* ep_word_reverted (edgepath_step.h): whether `cur` is a word its owner, who last stored `owned`, moved past. */
int ep_word_reverted_of(uint64_t cur, uint64_t owned);

/* Loopback "NIC" operations on shared memory. */
uint64_t ep_cas64(uint64_t *addr, uint64_t expected, uint64_t desired);
uint64_t ep_load64(const uint64_t *addr);
void ep_store64(uint64_t *addr, uint64_t value);
void ep_copy(void *dst, const void *src, size_t n);

/* Slot server: publish `fields` (begin and end ignored) as the pool's load region `dst` under its sequence lock:
   begin = next version, release fence, the fields, release fence, end = that version (struct ep_load).  The version
   is the server's CLOCK_MONOTONIC in ns when it published (at least the last one + 1; ABI 11). */
void ep_load_publish(struct ep_load *dst, const struct ep_load *fields);
/* Reader: whether a copy of a load region is whole (end == begin, one version). */
_Bool ep_load_whole(const struct ep_load *copy);

/* Slot server: advance the pool's heartbeat word (release) to the server's CLOCK_MONOTONIC in ns (at least its
   last value + 1; ABI 11: before, it counted ticks).  Returns false, and has the shape of
   ggml's abort callback (bool (*)(void *data)), so a model library can call it while a long step makes
   progress (llama.cpp: between the nodes of its compute graph) and the step is not taken for a hang. */
_Bool ep_heartbeat_tick(void *word);

/* Agent: first FREE word in a cached state array at or after start (wrapping), or -1. */
int ep_next_free(const uint64_t *words, uint32_t n, uint32_t start);

/* Agent: fill the fields a claim decides, just before the request is written. */
void ep_request_stamp(void *request, uint32_t generation, uint32_t slot, uint32_t reply_index);

/* Header operations of the wire contract's typed views (contract/wire/headers.py), one call each on the hot path. */
void ep_request_fill(void *request, uint64_t request_id, uint32_t token_count, uint32_t max_new_tokens,
                     uint32_t flags, float temperature, float top_p, uint32_t top_k, uint64_t seed,
                     float min_p, float presence_penalty, float frequency_penalty, float repetition_penalty,
                     uint32_t logit_biases, uint64_t t_receive_ns, uint64_t t_tokenized_ns);
/* A slot starts a request: whose, when, nothing produced yet (progress = generation << 32). */
void ep_result_begin(void *result, uint64_t request_id, uint32_t generation, uint32_t slot);
/* The final result: status, output count (progress = generation << 32 | count), the time. */
void ep_result_end(void *result, uint32_t generation, int32_t status, uint32_t output_count);

/* Pool layout (ep_pool_layout: without a prefix table). */
int ep_pool_layout(uint32_t slot_count, uint32_t input_capacity, uint32_t output_capacity,
                   struct ep_pool_header *out);
int ep_pool_layout_prefixes(uint32_t slot_count, uint32_t input_capacity, uint32_t output_capacity,
                            uint32_t prefix_entries, struct ep_pool_header *out);
uint64_t ep_frame_stride(uint32_t input_capacity, uint32_t output_capacity);
uint64_t ep_result_offset(uint32_t input_capacity);
int ep_pool_init(void *base, uint64_t size, const struct ep_pool_header *layout);
int ep_pool_validate(const void *base, uint64_t size);

/* Completion queue: bounded MPSC ring in shared memory plus an eventfd. */
uint64_t ep_cq_size(uint32_t capacity);
int ep_cq_init(void *ring, uint32_t capacity);
int ep_cq_push(void *ring, uint64_t value, int efd);
int ep_cq_poll(void *ring, uint64_t *out, int max);
int ep_cq_arm(void *ring);
/* Drain the consumer's eventfd (non-blocking), then arm: what a consumer does before it sleeps on
   the eventfd again.  1 if an entry is already waiting (poll again instead of sleeping). */
int ep_cq_rearm(void *ring, int efd);
int ep_cq_wait(void *ring, int efd, uint64_t *out, int max, int64_t timeout_ns, int64_t spin_ns);

/* Loopback WRITE_WITH_IMM: copy then post the completion (conn << 32 | imm). */
int ep_write_imm(void *dst, const void *src, size_t n, void *ring, uint64_t value, int efd);
/* Loopback WRITE then WRITE_WITH_IMM (a request and its doorbell): both copies, then the completion. */
int ep_write_then_imm(void *dst, const void *src, size_t n, void *bell_dst, const void *bell_src, size_t bell_n,
                      void *ring, uint64_t value, int efd);

/* Slot-server poller core; `owned` and `restored` as ep_apply_owned's, one owned word per slot. */
int ep_accept_doorbells(void *pool, uint64_t *owned, uint64_t *restored, const uint64_t *entries, int n,
                        uint32_t *ready_slots, uint32_t *ready_conns, uint64_t now_ns, int *rejected);
int ep_scan_leases(void *pool, uint64_t *owned, uint64_t *restored, uint64_t *seen_word, uint64_t *seen_ns,
                   uint64_t now_ns, uint32_t *expired, int max);

/* Prefix affinity (edgepath_slot.h): the chain hashes under `salt` of the first min(count / EP_PREFIX_BLOCK,
   max_blocks) whole blocks of `tokens` into out; how many. */
uint32_t ep_prefix_chain(uint64_t salt, const int32_t *tokens, uint32_t count, uint64_t *out, uint32_t max_blocks);
/* How many leading blocks of a chain a prefix table holds: the largest j with chain[j - 1] among its entries. */
uint32_t ep_prefix_match(const uint64_t *table, uint32_t entries, const uint64_t *chain, uint32_t blocks);

/* Pool validation failures (ep_pool_validate) and CQ errors. */
#define EP_POOL_E_SIZE -10
#define EP_POOL_E_MAGIC -11
#define EP_POOL_E_VERSION -12
#define EP_POOL_E_LAYOUT -13
#define EP_CQ_E_FULL -20
#define EP_CQ_E_WAIT -21
/* CDEF-END */

#endif
