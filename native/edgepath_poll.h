/*
 * The GPU poller's per-slot decision, kept pure (no memory access, no atomics)
 * so the CUDA kernel (native/edgepath_poller.cu) and the CPU tests run the same
 * code: tests/test_gpu_poll_logic.py compiles this header with gcc and checks
 * it against a reference model.  State changes themselves go through ep_step.
 *
 * Ownership by state: over PCIe, a GPU atomic on mapped host memory is not
 * atomic against CPU or NIC atomics on the same word (only with
 * cudaDevAttrHostNativeAtomicSupported).  So each state has exactly one
 * possible writer: FREE -> CLAIMED the claimers (NIC / loopback CAS);
 * CLAIMED -> READY -> RUNNING and CLAIMED -> FREE (lease expiry, requested by
 * the host through expire_req) the kernel; RUNNING -> DONE -> FREE the model
 * side.  Nobody ever races a writer of another kind on one word.
 */
#ifndef EDGEPATH_POLL_H
#define EDGEPATH_POLL_H

#include "edgepath_step.h"

/* ep_poll_decide() results. */
#define EP_POLL_IDLE 0    /* nothing new for this slot */
#define EP_POLL_ACCEPT 1  /* a valid doorbell: DOORBELL then START, hand the slot over */
#define EP_POLL_REJECT 2  /* a doorbell that does not belong to the current claim: remember it, change nothing */
#define EP_POLL_WAIT 3    /* a doorbell newer than the state word we read: look again, remember nothing */
#define EP_POLL_EXPIRE 4  /* the host asked to expire this claim and it is still unrung: EXPIRE */
#define EP_POLL_DROP 5    /* the host's expire request no longer matches the state word: forget it */

/*
 * state:    the slot's state word (loaded after the doorbell, acquire)
 * doorbell: the slot's doorbell word (loaded with acquire, system scope)
 * seen:     the doorbell value this slot last decided on (0 at start)
 * req_gen:  ep_request_header.generation of the slot (read after the doorbell)
 * expire:   the host's expire request for the slot: the CLAIMED word to expire, or 0
 *
 * A doorbell is trusted only when it changed since `seen`, carries the valid
 * bit and this slot's index, names the generation of a CLAIMED state word, and
 * the request header says the same generation (the data the writer put there
 * before ringing), as ep_accept_doorbells checks on the CPU path.  A pending
 * expire request wins over a doorbell that is still waiting for its claim
 * (WAIT), so a forged far-future doorbell cannot pin a slot.
 */
EP_HD int ep_poll_decide(uint64_t state, uint64_t doorbell, uint64_t seen, uint32_t req_gen, uint64_t expire,
                         uint32_t slot)
{
    int rung = EP_POLL_IDLE;
    if (doorbell != seen && doorbell != 0) {
        uint32_t dgen = (uint32_t)(doorbell >> 32);
        uint32_t sgen = ep_word_generation(state);
        if ((doorbell & 0xffffffffu) != ((uint64_t)EP_DOORBELL_VALID | slot))
            return EP_POLL_REJECT;
        if (dgen == sgen && ep_word_state(state) == EP_CLAIMED && req_gen == sgen)
            return EP_POLL_ACCEPT;
        uint32_t ahead = (dgen - sgen) & EP_GENERATION_MAX; /* generations wrap at 2^24 */
        if (dgen > EP_GENERATION_MAX || ahead == 0 || ahead > (EP_GENERATION_MAX >> 1))
            return EP_POLL_REJECT; /* late doorbell of an old claim, or a claim that is not CLAIMED */
        rung = EP_POLL_WAIT;       /* the claim's state word is not visible yet */
    }
    if (expire != 0)
        return expire == state && ep_word_state(state) == EP_CLAIMED ? EP_POLL_EXPIRE : EP_POLL_DROP;
    return rung;
}

/* Hand-off ring entry (kernel -> model side): generation << 32 | slot. */
EP_HD uint64_t ep_ring_value(uint32_t generation, uint32_t slot)
{
    return ((uint64_t)generation << 32) | (slot & EP_SLOT_MAX);
}

#endif
