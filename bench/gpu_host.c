/*
 * The host side of bench/gpu_check.py, in C so that what is timed is stores, loads and spins, not
 * Python calls (a pure-Python loop costs about 1.5 us p50 and 4 us p99 by itself on these machines).
 * Also the poller's host twin: the kernel's per-slot pass (edgepath_poller.h) compiled for the CPU
 * with C11 atomics, which tests/gpu_twin.py runs under a stand-in for cupy and gpu_check --dry-run
 * runs in place of the GPU.  Built with gcc together with native/edgepath_core.c (pool layout);
 * needs neither Python headers nor cffi, so one build serves every Python (loaded with ctypes).
 *
 * Clocks: CLOCK_MONOTONIC nanoseconds on the host; ep_clock() and ep_timer_ns() of the twin are the same
 * clock, so its "cycles" are nanoseconds and its timer needs no calibration (the GPU's are clock64 cycles
 * and %globaltimer, which bench/gpu_steps.py calibrates against the host clock with the ping-pong).
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
static inline uint64_t ep_timer_ns(void) { return now_ns(); }
#define EP_PFN static inline
#include "edgepath_poller.h"

/* -- the twins: what the GPU runs, on a CPU thread ---------------------------------------------- */

/* ep_gpu_poller's loop with one thread doing every slot, and sched_yield for __nanosleep. */
void ep_twin_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring, uint32_t ring_capacity,
                    uint64_t *ring_tail, uint64_t *ctrl)
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    uint64_t passes = 0;
    ep_st_rlx(&ctrl[EP_CTRL_CLOCK_START], ep_clock());
    ep_st_rlx(&ctrl[EP_CTRL_TIMER_START], ep_timer_ns());
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
    ep_st_rlx(&ctrl[EP_CTRL_CLOCK_STOP], ep_clock());
    ep_st_rlx(&ctrl[EP_CTRL_TIMER_STOP], ep_timer_ns());
    ep_st_rel(&ctrl[EP_CTRL_RUNNING], 2u);
}

/* The check's probe kernels on a CPU thread (gpu_check --dry-run's stand-ins): the same bodies. */
static inline void ep_idle(void) { sched_yield(); }
#include "edgepath_poller_checks.h"

void ep_twin_pingpong(uint64_t *ping, uint64_t *pong, uint64_t *stamp, uint64_t *stop)
{
    ep_check_pingpong_body(ping, pong, stamp, stop);
}

void ep_twin_cas(uint64_t *words, uint64_t *flag, uint64_t *go, uint32_t n) { ep_check_cas_body(words, flag, go, n); }

/* ep_check_atomics' total on one CPU thread: `n` adds. */
void ep_twin_atomics(uint64_t *counter, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        ep_add(counter, 1u);
}

void ep_twin_timer(uint64_t *out, uint64_t window_ns, uint64_t max_reads)
{
    ep_check_timer_body(out, window_ns, max_reads);
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

/* Bare ping-pong and clock calibration: store i+1 into ping, spin until pong says i+1.  Per round trip
 * three words in samples: the host clock before the store, the host clock once the echo was seen, and
 * the kernel's timer when it saw the store (*stamp).  Returns n, or -(i+1) when round trip i did not
 * come back within timeout_ns. */
int64_t ep_chk_pingpong(uint64_t *ping, uint64_t *pong, uint64_t *stamp, uint32_t n, uint64_t *samples,
                        uint64_t timeout_ns)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)i + 1u, t0 = now_ns(), spins = 0;
        ep_st_rel(ping, v);
        while (ep_ld_acq(pong) != v) {
            if (++spins % SPIN_CHECK == 0 && now_ns() - t0 > timeout_ns)
                return -(int64_t)(i + 1u);
        }
        uint64_t t1 = now_ns();
        samples[3u * i] = t0;
        samples[3u * i + 1u] = t1;
        samples[3u * i + 2u] = ep_ld_rlx(stamp);
    }
    return n;
}

/*
 * The poller's round trip, as the agent and the model side see it, with the pool in host memory the
 * poller maps: claim (CAS FREE -> CLAIMED), write header + `tokens` ids, ring the doorbell (release),
 * spin on the hand-off ring until the entry comes, check it and the RUNNING word, then RUNNING -> DONE
 * -> FREE.  Per iteration EP_CHK_SAMPLE words in samples: the host clock before the write, just before
 * the doorbell's store and once the entry was seen, then the entry's detection time (the poller's timer)
 * and its in-kernel cycles.  `head` is the host's ring position, kept across calls.  Returns n, or
 * -(i+1) with a message in err when iteration i failed.
 */
#define EP_CHK_SAMPLE 5u
uint32_t ep_chk_sample_words(void) { return EP_CHK_SAMPLE; }

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
        uint64_t *entry = ring + EP_RING_WORDS * (uint32_t)(*head & mask);
        while (ep_ld_acq(&entry[EP_RING_SEQ]) != *head + 1u) {
            if (++spins % SPIN_CHECK == 0 && now_ns() - t1 > timeout_ns) {
                snprintf(err, errlen, "iteration %u: no hand-off of slot %u within %llu ns (word %#llx)", i, slot,
                         (unsigned long long)timeout_ns, (unsigned long long)ep_ld_acq(&states[slot]));
                return -(int64_t)(i + 1u);
            }
        }
        uint64_t t2 = now_ns();
        uint64_t value = ep_ld_rlx(&entry[EP_RING_VALUE]), word = ep_ld_acq(&states[slot]);
        uint64_t *sample = samples + EP_CHK_SAMPLE * i;
        *head += 1u;
        if (value != ep_ring_value(gen, slot) || ep_word_state(word) != EP_RUNNING) {
            snprintf(err, errlen, "iteration %u: hand-off %#llx for slot %u gen %u, word %#llx", i,
                     (unsigned long long)value, slot, gen, (unsigned long long)word);
            return -(int64_t)(i + 1u);
        }
        sample[0] = t0;
        sample[1] = t1;
        sample[2] = t2;
        sample[3] = ep_ld_rlx(&entry[EP_RING_DETECT_NS]);
        sample[4] = ep_ld_rlx(&entry[EP_RING_CYCLES]);
        uint64_t done = ep_chk_step(word, EP_EV_COMPLETE), freed = done ? ep_chk_step(done, EP_EV_RELEASE) : 0u;
        if (freed == 0) {
            snprintf(err, errlen, "iteration %u: slot %u cannot go RUNNING -> DONE -> FREE", i, slot);
            return -(int64_t)(i + 1u);
        }
        ep_st_rel(&states[slot], freed); /* the model side owns RUNNING and DONE words */
    }
    return n;
}

/* Smoke, the CPU's half of the CAS-neighbour test: wait until the kernel says it started (*flag 1), add
 * 1 to *word once, let the kernel go (*go), and keep adding until it says it finished (*flag 2): every
 * GPU CAS runs while the CPU is in its add loop.  Returns the adds made, -1 if the kernel did not start
 * or finish within timeout_ns, -2 if it gave up waiting for go. */
int64_t ep_chk_add_while_running(uint64_t *word, uint64_t *flag, uint64_t *go, uint64_t timeout_ns)
{
    uint64_t t0 = now_ns(), spins = 0, state;
    int64_t adds = 0;
    while (ep_ld_acq(flag) == 0u) {
        if (++spins % SPIN_CHECK == 0 && now_ns() - t0 > timeout_ns)
            return -1;
    }
    ep_add(word, 1u);
    adds++;
    ep_st_rel(go, 1u);
    while ((state = ep_ld_acq(flag)) == 1u) {
        ep_add(word, 1u);
        if (++adds % SPIN_CHECK == 0 && now_ns() - t0 > timeout_ns)
            return -1;
    }
    return state == 2u ? adds : -2;
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
