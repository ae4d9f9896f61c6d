/*
 * One polling pass of the slot poller, shared verbatim by the CUDA kernel
 * (edgepath_poller.cu, device atomics at system scope) and its host twin
 * (tests/gpu_twin.py compiles it with gcc and C11 atomics), so the CPU tests
 * run the kernel's per-slot code, ring hand-off included.
 *
 * The includer defines, before including this file:
 *   EP_PFN                         qualifiers of these functions
 *   uint64_t ep_ld_rlx(uint64_t *p)            load, relaxed, system scope
 *   uint32_t ep_ld_rlx32(uint32_t *p)          load, relaxed, system scope
 *   void ep_fence_acq(void)                    acquire fence, system scope
 *   void ep_st_rel(uint64_t *p, uint64_t v)    store, release, system scope
 *   void ep_st_rlx(uint64_t *p, uint64_t v)    store, relaxed
 *   int ep_cas(uint64_t *p, uint64_t expected, uint64_t desired)   acq_rel CAS; 1 if swapped
 *   uint64_t ep_add(uint64_t *p, uint64_t v)   relaxed fetch-add; the old value
 *   void ep_max(uint64_t *p, uint64_t v)       relaxed fetch-max
 *   uint64_t ep_clock(void)                    a cycle counter of the poller (clock64 on the GPU)
 *   uint64_t ep_timer_ns(void)                 a nanosecond timer the host can calibrate against its
 *                                              own clock (%globaltimer on the GPU, CLOCK_MONOTONIC in
 *                                              the twin): when a doorbell was seen, in the host's terms
 *
 * Memory the pass touches (pointers as the poller sees them):
 *   pool        the slot pool (edgepath_slot.h layout)
 *   seen        u64[slot_count], poller-private: the doorbell value last decided on
 *   expire_req  u64[slot_count], owned by value: the host writes a CLAIMED word it wants expired only
 *               while the entry is 0, the poller stores 0 once it decided; so neither ever overwrites a
 *               value the other wrote, and neither needs a read-modify-write on memory both write
 *   ring        u64[EP_RING_WORDS * capacity], host-read: hand-off entries {seq, value, detect_ns,
 *               cycles}: seq is stored last, with release, so the other words are read after it
 *   ring_tail   u64, poller-private: next ring position
 *   ctrl        u64[EP_CTRL_WORDS], host-shared: stop flag, running flag, counters
 *
 * ctrl is laid out by writer, one 64-byte line each: the host's stop flag alone on line 0; the
 * poller's plain stores (running, loops) on line 1; the poller's atomics (counters) on line 2.  On an
 * x86 host a GPU atomic on mapped memory is not atomic with the CPU's accesses to the same line
 * (cudaDevAttrHostNativeAtomicSupported is 0), so host-written and device-RMW words never share one.
 */
#ifndef EDGEPATH_POLLER_H
#define EDGEPATH_POLLER_H

#include "edgepath_poll.h"

/* ctrl words (u64 indices; tests/test_gpu_poller_layout.py checks the lines). */
#define EP_CTRL_LINE 8              /* u64 words per 64-byte line */
#define EP_CTRL_STOP 0              /* line 0, host-written: non-zero makes the poller return */
#define EP_CTRL_RUNNING 8           /* line 1, poller stores: 1 once polling, 2 when it has stopped */
#define EP_CTRL_LOOPS 9             /* line 1: polling passes, for the host's liveness check */
#define EP_CTRL_CLOCK_START 10      /* line 1: ep_clock() and ep_timer_ns() when the poller started and  */
#define EP_CTRL_TIMER_START 11      /*   when it stopped: cycles per ns of its own SM over its run, i.e.  */
#define EP_CTRL_CLOCK_STOP 12       /*   the SM clock it actually ran at (the rated one can be far off)   */
#define EP_CTRL_TIMER_STOP 13
#define EP_CTRL_ACCEPTED 16         /* line 2, poller atomics: doorbells accepted and handed over */
#define EP_CTRL_REJECTED 17         /* doorbells rejected */
#define EP_CTRL_EXPIRED 18          /* claims expired on the host's request */
#define EP_CTRL_LOST 19             /* a state CAS that found the word changed: an ownership rule broken */
#define EP_CTRL_HANDOFF_CYCLES 20   /* sum over accepted doorbells of EP_RING_CYCLES */
#define EP_CTRL_HANDOFF_MAX 21      /* the largest of those */
#define EP_CTRL_WORDS 24

/* Hand-off ring entries (u64 words each; Python reads EP_RING_* from this header). */
#define EP_RING_WORDS 4
#define EP_RING_SEQ 0               /* position + 1, stored last with release: the entry is complete */
#define EP_RING_VALUE 1             /* generation << 32 | slot */
#define EP_RING_DETECT_NS 2         /* ep_timer_ns() when the doorbell was seen (GPU: %globaltimer) */
#define EP_RING_CYCLES 3            /* ep_clock() cycles from that detection to the entry's first store */

/* Apply `event` to the state word with one CAS; 1 (and *next set) if the word moved. */
EP_PFN int ep_poller_apply(uint64_t *word, uint64_t cur, int event, uint32_t generation, uint64_t *next)
{
    if (ep_step(cur, event, generation, 0u, next) != EP_OK)
        return 0;
    return ep_cas(word, cur, *next);
}

/* CLAIMED -> READY -> RUNNING, both steps through ep_step, published with one CAS: READY has no
 * other observer that acts on it (the kernel is its only writer), and one PCIe round trip less
 * is on the doorbell's path.  1 (and *running set) if the word moved. */
EP_PFN int ep_poller_accept(uint64_t *word, uint64_t cur, uint32_t generation, uint64_t *running)
{
    uint64_t ready;
    if (ep_step(cur, EP_EV_DOORBELL, generation, 0u, &ready) != EP_OK ||
        ep_step(ready, EP_EV_START, generation, 0u, running) != EP_OK)
        return 0;
    return ep_cas(word, cur, *running);
}

/* Publish `value` to the model side with when its doorbell was seen and how long the kernel took:
 * those words first, then the sequence number with release.  The ring cannot overrun: a slot has at
 * most one entry outstanding and capacity >= slot count. */
EP_PFN void ep_poller_hand_off(uint64_t *ring, uint32_t mask, uint64_t *ring_tail, uint64_t value,
                               uint64_t detect_ns, uint64_t cycles)
{
    uint64_t pos = ep_add(ring_tail, 1u);
    uint64_t *entry = ring + EP_RING_WORDS * (uint32_t)(pos & mask);
    ep_st_rlx(&entry[EP_RING_VALUE], value);
    ep_st_rlx(&entry[EP_RING_DETECT_NS], detect_ns);
    ep_st_rlx(&entry[EP_RING_CYCLES], cycles);
    ep_st_rel(&entry[EP_RING_SEQ], pos + 1u);
}

/* Decide on `slot` and act; 1 if it did work (the kernel then skips its back-off). */
EP_PFN int ep_poller_slot(char *pool, const struct ep_pool_header *h, uint32_t slot, uint64_t *seen,
                          uint64_t *expire_req, uint64_t *ring, uint32_t mask, uint64_t *ring_tail, uint64_t *ctrl)
{
    uint64_t *states = (uint64_t *)(pool + h->states_offset);
    uint64_t *doorbells = (uint64_t *)(pool + h->doorbells_offset);
    struct ep_request_header *req =
        (struct ep_request_header *)(pool + h->slots_offset + (uint64_t)slot * h->slot_stride);

    /* Relaxed, so both loads (and the warp's other slots) are in flight at once: one PCIe round
     * trip per pass, not one per acquire. */
    uint64_t bell = ep_ld_rlx(&doorbells[slot]);
    uint64_t expire = ep_ld_rlx(&expire_req[slot]);
    if (bell == seen[slot] && expire == 0)
        return 0;
    uint64_t t_detect = ep_clock(), detect_ns = ep_timer_ns();
    /* The ordering step: everything below is read after the doorbell (stored last, with release)
     * under an acquire fence, so the claim's state word and request header are at least as new. */
    ep_fence_acq();
    uint64_t state = ep_ld_rlx(&states[slot]);
    uint32_t req_gen = ep_ld_rlx32(&req->generation);
    uint32_t gen = ep_word_generation(state);
    uint64_t running, freed;

    switch (ep_poll_decide(state, bell, seen[slot], req_gen, expire, slot)) {
    case EP_POLL_ACCEPT:
        seen[slot] = bell;
        if (!ep_poller_accept(&states[slot], state, gen, &running)) {
            ep_add(&ctrl[EP_CTRL_LOST], 1u);
            return 1;
        }
        t_detect = ep_clock() - t_detect;
        ep_poller_hand_off(ring, mask, ring_tail, ep_ring_value(gen, slot), detect_ns, t_detect);
        ep_add(&ctrl[EP_CTRL_ACCEPTED], 1u);
        ep_add(&ctrl[EP_CTRL_HANDOFF_CYCLES], t_detect);
        ep_max(&ctrl[EP_CTRL_HANDOFF_MAX], t_detect);
        return 1;
    case EP_POLL_REJECT:
        seen[slot] = bell;
        ep_add(&ctrl[EP_CTRL_REJECTED], 1u);
        return 1;
    case EP_POLL_EXPIRE: /* the request is cleared with a plain store: the host writes only while it is 0 */
        ep_add(&ctrl[ep_poller_apply(&states[slot], state, EP_EV_EXPIRE, gen, &freed) ? EP_CTRL_EXPIRED
                                                                                       : EP_CTRL_LOST],
               1u);
        ep_st_rel(&expire_req[slot], 0u);
        return 1;
    case EP_POLL_DROP:
        ep_st_rel(&expire_req[slot], 0u);
        return 1;
    default: /* IDLE, WAIT */
        return 0;
    }
}

#endif
