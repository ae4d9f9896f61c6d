/*
 * The host side of bench/gpu_check.py, in C so that what is timed is stores, loads and spins, not
 * Python calls (a pure-Python loop costs about 1.5 us p50 and 4 us p99 by itself on these machines).
 * Also the poller's host twin: the kernel's per-slot pass (edgepath_poller.h) compiled for the CPU
 * with C11 atomics, which tests/gpu_twin.py runs under a stand-in for cupy and gpu_check --dry-run
 * runs in place of the GPU.  Built with gcc together with native/edgepath_core.c (pool layout);
 * needs neither Python headers nor cffi, so one build serves every Python (loaded with ctypes).
 *
 * Clocks: CLOCK_MONOTONIC nanoseconds on the host; ep_clock() of the twin is the same clock, so its
 * "cycles" are nanoseconds (the GPU's are clock64 cycles).
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "edgepath_core.h"

#define A64(p) ((_Atomic uint64_t *)(p))
static inline uint64_t ep_ld_acq(uint64_t *p) { return atomic_load_explicit(A64(p), memory_order_acquire); }
static inline uint64_t ep_ld_rlx(uint64_t *p) { return atomic_load_explicit(A64(p), memory_order_relaxed); }
static inline uint32_t ep_ld_rlx32(uint32_t *p)
{
    return atomic_load_explicit((_Atomic uint32_t *)p, memory_order_relaxed);
}
static inline void ep_fence_acq(void) { atomic_thread_fence(memory_order_acquire); }
static inline void ep_st_rel(uint64_t *p, uint64_t v) { atomic_store_explicit(A64(p), v, memory_order_release); }
static inline void ep_st_rlx(uint64_t *p, uint64_t v) { atomic_store_explicit(A64(p), v, memory_order_relaxed); }
static inline uint64_t ep_add(uint64_t *p, uint64_t v)
{
    return atomic_fetch_add_explicit(A64(p), v, memory_order_relaxed);
}
static inline void ep_max(uint64_t *p, uint64_t v)
{
    uint64_t cur = atomic_load_explicit(A64(p), memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak_explicit(A64(p), &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}
static inline int ep_cas(uint64_t *p, uint64_t e, uint64_t d)
{
    return atomic_compare_exchange_strong_explicit(A64(p), &e, d, memory_order_acq_rel, memory_order_acquire);
}
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
static inline uint64_t ep_clock(void) { return now_ns(); }
#define EP_PFN static inline
#include "edgepath_poller.h"

/* -- the twins: what the GPU runs, on a CPU thread ---------------------------------------------- */

/* ep_gpu_poller's loop with one thread doing every slot, and sched_yield for __nanosleep. */
void ep_twin_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring, uint32_t ring_capacity,
                    uint64_t *ring_tail, uint64_t *ctrl)
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    uint64_t passes = 0;
    ep_st_rel(&ctrl[EP_CTRL_RUNNING], 1u);
    while (!ep_ld_acq(&ctrl[EP_CTRL_STOP])) {
        int worked = 0;
        for (uint32_t slot = 0; slot < h->slot_count; slot++)
            worked |= ep_poller_slot(pool, h, slot, seen, expire_req, ring, ring_capacity - 1u, ring_tail, ctrl);
        if ((++passes & 1023u) == 0)
            ep_st_rlx(&ctrl[EP_CTRL_LOOPS], passes);
        if (!worked)
            sched_yield();
    }
    ep_st_rel(&ctrl[EP_CTRL_RUNNING], 2u);
}

/* ep_check_pingpong's loop on a CPU thread (gpu_check --dry-run's stand-in for the GPU). */
void ep_twin_pingpong(uint64_t *ping, uint64_t *pong, uint64_t *stop)
{
    uint64_t last = 0;
    ep_st_rel(pong, 0u);
    for (;;) {
        uint64_t v = ep_ld_acq(ping);
        if (v != last) {
            last = v;
            ep_st_rel(pong, v);
        } else if (ep_ld_acq(stop)) {
            ep_st_rel(stop, 2u);
            return;
        } else {
            sched_yield();
        }
    }
}

/* -- pools, without Python knowing the header's layout ------------------------------------------ */

/* Bytes of a pool with these dimensions (0: invalid dimensions). */
uint64_t ep_chk_pool_size(uint32_t slots, uint32_t input_capacity, uint32_t output_capacity)
{
    struct ep_pool_header h;
    if (ep_pool_layout(slots, input_capacity, output_capacity, &h) != EP_OK)
        return 0;
    return h.total_size;
}

/* Initialise `base` as an empty pool; EP_OK or the error of ep_pool_layout / ep_pool_init. */
int ep_chk_pool_create(void *base, uint64_t size, uint32_t slots, uint32_t input_capacity, uint32_t output_capacity,
                       uint64_t lease_ns)
{
    struct ep_pool_header h;
    int rc = ep_pool_layout(slots, input_capacity, output_capacity, &h);
    if (rc != EP_OK)
        return rc;
    h.lease_ns = lease_ns;
    h.server_epoch = 1;
    return ep_pool_init(base, size, &h);
}

/* The offsets a host that copies slot memory needs: states, doorbells, slots, slot stride, the
 * result part's offset in a slot, and the request header's size (where the tokens start). */
void ep_chk_pool_offsets(const void *pool, uint64_t out[6])
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    out[0] = h->states_offset;
    out[1] = h->doorbells_offset;
    out[2] = h->slots_offset;
    out[3] = h->slot_stride;
    out[4] = ep_result_offset(h->input_capacity);
    out[5] = sizeof(struct ep_request_header);
}

/* The claimed word for FREE word `cur` (0 if `cur` cannot be claimed). */
uint64_t ep_chk_claim_word(uint64_t cur, uint32_t claimant)
{
    uint64_t next;
    return ep_step(cur, EP_EV_CLAIM, 0u, claimant, &next) == EP_OK ? next : 0u;
}

/* The word after `event` on `cur` (0 if refused): the model side's COMPLETE and RELEASE. */
uint64_t ep_chk_step(uint64_t cur, int event)
{
    uint64_t next;
    return ep_step(cur, event, ep_word_generation(cur), 0u, &next) == EP_OK ? next : 0u;
}

/* Write a request into `slot` of the pool at `pool` (host memory: the pool itself or a staging
 * copy): header with `generation`, `tokens` ids (i + k) & 0x1ffff, and the doorbell it will ring. */
uint64_t ep_chk_write_request(char *pool, uint32_t slot, uint32_t generation, uint64_t request_id, uint32_t tokens)
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    char *base = pool + h->slots_offset + (uint64_t)slot * h->slot_stride;
    struct ep_request_header *req = (struct ep_request_header *)base;
    int32_t *ids = (int32_t *)(base + sizeof(*req));
    uint64_t bell = ep_doorbell(generation, slot);
    for (uint32_t k = 0; k < tokens; k++)
        ids[k] = (int32_t)((request_id + k) & 0x1ffffu);
    req->request_id = request_id;
    req->token_count = tokens;
    req->max_new_tokens = tokens;
    req->generation = generation;
    req->t_written_ns = now_ns();
    req->doorbell = bell;
    return bell;
}

/* -- timed loops -------------------------------------------------------------------------------- */

#define SPIN_CHECK 4096u /* spins between clock reads while waiting */

/* Bare ping-pong: store i+1 into ping, spin until pong says i+1.  samples[i] = that round trip (ns).
 * Returns n, or -(i+1) when round trip i did not come back within timeout_ns. */
int64_t ep_chk_pingpong(uint64_t *ping, uint64_t *pong, uint32_t n, uint64_t *samples, uint64_t timeout_ns)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)i + 1u, t0 = now_ns(), spins = 0;
        ep_st_rel(ping, v);
        while (ep_ld_acq(pong) != v) {
            if (++spins % SPIN_CHECK == 0 && now_ns() - t0 > timeout_ns)
                return -(int64_t)(i + 1u);
        }
        samples[i] = now_ns() - t0;
    }
    return n;
}

/*
 * The poller's round trip, as the agent and the model side see it, with the pool in host memory the
 * poller maps: claim (CAS FREE -> CLAIMED), write header + `tokens` ids, ring the doorbell (release),
 * spin on the hand-off ring until the entry comes, check it and the RUNNING word, then RUNNING -> DONE
 * -> FREE.  samples[2i] = doorbell -> hand-off seen, samples[2i+1] = write + doorbell -> hand-off seen
 * (ns, round trips).  `head` is the host's ring position, kept across calls.  Returns n, or -(i+1)
 * with a message in err when iteration i failed.
 */
int64_t ep_chk_poller_rtt(char *pool, uint64_t *ring, uint32_t ring_capacity, uint64_t *head, uint32_t n,
                          uint32_t tokens, uint64_t *samples, uint64_t timeout_ns, char *err, size_t errlen)
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    uint64_t *states = (uint64_t *)(pool + h->states_offset);
    uint64_t *doorbells = (uint64_t *)(pool + h->doorbells_offset);
    uint32_t mask = ring_capacity - 1u;
    if (tokens > h->input_capacity) {
        snprintf(err, errlen, "%u tokens: the pool holds at most %u per slot", tokens, h->input_capacity);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t slot = i % h->slot_count;
        uint64_t cur = ep_ld_acq(&states[slot]), claimed = ep_chk_claim_word(cur, 1u);
        if (claimed == 0 || !ep_cas(&states[slot], cur, claimed)) {
            snprintf(err, errlen, "iteration %u: slot %u not claimable (word %#llx)", i, slot,
                     (unsigned long long)ep_ld_acq(&states[slot]));
            return -(int64_t)(i + 1u);
        }
        uint32_t gen = ep_word_generation(claimed);
        uint64_t t0 = now_ns();
        uint64_t bell = ep_chk_write_request(pool, slot, gen, i, tokens);
        uint64_t t1 = now_ns(), spins = 0;
        ep_st_rel(&doorbells[slot], bell);
        uint64_t *entry = ring + 2u * (uint32_t)(*head & mask);
        while (ep_ld_acq(&entry[0]) != *head + 1u) {
            if (++spins % SPIN_CHECK == 0 && now_ns() - t1 > timeout_ns) {
                snprintf(err, errlen, "iteration %u: no hand-off of slot %u within %llu ns (word %#llx)", i, slot,
                         (unsigned long long)timeout_ns, (unsigned long long)ep_ld_acq(&states[slot]));
                return -(int64_t)(i + 1u);
            }
        }
        uint64_t t2 = now_ns();
        uint64_t value = ep_ld_rlx(&entry[1]), word = ep_ld_acq(&states[slot]);
        *head += 1u;
        if (value != ep_ring_value(gen, slot) || ep_word_state(word) != EP_RUNNING) {
            snprintf(err, errlen, "iteration %u: hand-off %#llx for slot %u gen %u, word %#llx", i,
                     (unsigned long long)value, slot, gen, (unsigned long long)word);
            return -(int64_t)(i + 1u);
        }
        samples[2u * i] = t2 - t1;
        samples[2u * i + 1u] = t2 - t0;
        uint64_t done = ep_chk_step(word, EP_EV_COMPLETE), freed = done ? ep_chk_step(done, EP_EV_RELEASE) : 0u;
        if (freed == 0) {
            snprintf(err, errlen, "iteration %u: slot %u cannot go RUNNING -> DONE -> FREE", i, slot);
            return -(int64_t)(i + 1u);
        }
        ep_st_rel(&states[slot], freed); /* the model side owns RUNNING and DONE words */
    }
    return n;
}

/* Smoke: `n` atomic increments of *word (the CPU's half of the CAS-neighbour test). */
void ep_chk_increment(uint64_t *word, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        ep_add(word, 1u);
}

/* Stop latency: set *stop, spin until *running reads 2 (the poller's "stopped"; the ping-pong kernel
 * answers in *stop itself); ns, or -1 on timeout. */
int64_t ep_chk_stop(uint64_t *stop, uint64_t *running, uint64_t timeout_ns)
{
    uint64_t t0 = now_ns(), spins = 0;
    ep_st_rel(stop, 1u);
    while (ep_ld_acq(running) != 2u) {
        if (++spins % SPIN_CHECK == 0 && now_ns() - t0 > timeout_ns)
            return -1;
    }
    return (int64_t)(now_ns() - t0);
}
