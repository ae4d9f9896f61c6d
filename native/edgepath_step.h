/*
 * The slot state machine's transition step, shared verbatim by the CPU poller
 * (native/edgepath_core.c) and the CUDA poller (native/edgepath_poller.cu).
 * Pure functions on a state word: no memory access, no atomics, so the same
 * code runs on host and device and is exhaustively testable on the CPU.
 */
#ifndef EDGEPATH_STEP_H
#define EDGEPATH_STEP_H

#include "edgepath_slot.h"

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD static inline
#endif

/* A state word from its parts; `holder` is tenant << 24 | claimant (the claim's two names, one argument). */
EP_HD uint64_t ep_word(uint32_t generation, uint32_t state, uint32_t holder)
{
    return ((uint64_t)(holder >> 24) << 56) | ((uint64_t)(generation & EP_GENERATION_MAX) << 32) |
           ((uint64_t)(holder & EP_CLAIMANT_MAX) << 8) | (state & 0xffu);
}

EP_HD uint32_t ep_word_state(uint64_t w) { return (uint32_t)(w & 0xffu); }
EP_HD uint32_t ep_word_claimant(uint64_t w) { return (uint32_t)((w >> 8) & EP_CLAIMANT_MAX); }
EP_HD uint32_t ep_word_generation(uint64_t w) { return (uint32_t)((w >> 32) & EP_GENERATION_MAX); }
EP_HD uint32_t ep_word_tenant(uint64_t w) { return (uint32_t)(w >> 56); }
/* The claimant and its tenant as one value (tenant << 24 | claimant): what a claim or a hand-over names. */
EP_HD uint32_t ep_word_holder(uint64_t w) { return (ep_word_tenant(w) << 24) | ep_word_claimant(w); }
/* The generation after `generation` (they wrap at 2^24). */
EP_HD uint32_t ep_next_generation(uint32_t generation) { return (generation + 1u) & EP_GENERATION_MAX; }

EP_HD uint64_t ep_doorbell(uint32_t generation, uint32_t slot)
{
    return ((uint64_t)generation << 32) | (uint64_t)EP_DOORBELL_VALID | (slot & EP_SLOT_MAX);
}

/* 32-bit immediate of a doorbell (WRITE_WITH_IMM): generation's low 15 bits << 16 | slot (bit 31 clear). */
EP_HD uint32_t ep_doorbell_imm(uint32_t generation, uint32_t slot)
{
    return ((generation & EP_IMM_GEN_MASK) << 16) | (slot & EP_SLOT_MAX);
}

/* 32-bit immediate of a reclaim: bits 31 and 30 | the running generation's low 14 bits << 16 | slot. */
EP_HD uint32_t ep_reclaim_imm(uint32_t generation, uint32_t slot)
{
    return (uint32_t)EP_IMM_CANCEL | (uint32_t)EP_IMM_RECLAIM | ep_doorbell_imm(generation, slot);
}

/* One move of the state machine: from state `from` only, to the word `to`. */
EP_HD int ep_move(uint32_t st, uint32_t from, uint64_t to, uint64_t *next)
{
    if (st != from)
        return EP_E_STATE;
    *next = to;
    return EP_OK;
}

/*
 * Next state word for `event` applied to `cur`.  `generation` is the
 * generation the event refers to (ignored for CLAIM, which bumps it);
 * `holder` (tenant << 24 | claimant, the claimant nonzero) is only used by
 * CLAIM and HANDOVER, the two events that begin a generation.  Returns EP_OK
 * and sets *next, or an EP_E_* code and leaves *next untouched: a stale
 * generation (late doorbell, expired lease, old result) is EP_E_STALE, a wrong
 * state is EP_E_STATE.  The tenant stays with the word until it is FREE.
 */
EP_HD int ep_step(uint64_t cur, int event, uint32_t generation, uint32_t holder, uint64_t *next)
{
    uint32_t st = ep_word_state(cur);
    uint32_t gen = ep_word_generation(cur);
    uint32_t who = ep_word_holder(cur);

    if (event == EP_EV_CLAIM) {
        if (st != EP_FREE)
            return EP_E_STATE;
        if ((holder & EP_CLAIMANT_MAX) == 0)
            return EP_E_EVENT;
        *next = ep_word(ep_next_generation(gen), EP_CLAIMED, holder);
        return EP_OK;
    }
    if (event < EP_EV_DOORBELL || event > EP_EV_HANDOVER)
        return EP_E_EVENT;
    if (event == EP_EV_HANDOVER && (holder & EP_CLAIMANT_MAX) == 0)
        return EP_E_EVENT;
    if (generation != gen)
        return EP_E_STALE;
    switch (event) {
    case EP_EV_DOORBELL:
        return ep_move(st, EP_CLAIMED, ep_word(gen, EP_READY, who), next);
    case EP_EV_START:
        return ep_move(st, EP_READY, ep_word(gen, EP_RUNNING, who), next);
    case EP_EV_COMPLETE:
        return ep_move(st, EP_RUNNING, ep_word(gen, EP_DONE, who), next);
    case EP_EV_RELEASE:
        return ep_move(st, EP_DONE, ep_word(gen, EP_FREE, 0), next);
    case EP_EV_HANDOVER: /* a reclaimed slot goes to its reclaimer, claimed, never FREE between (issue 35) */
        return ep_move(st, EP_DONE, ep_word(ep_next_generation(gen), EP_CLAIMED, holder), next);
    default: /* EP_EV_EXPIRE: an unrung claim is reclaimed */
        return ep_move(st, EP_CLAIMED, ep_word(gen, EP_FREE, 0), next);
    }
}

/*
 * Where a word stands in its generation's cycle: CLAIMED 1, READY 2, RUNNING 3, DONE 4, and FREE 5 (a
 * generation's FREE word, written by RELEASE or EXPIRE, comes after everything else in it).
 */
EP_HD uint32_t ep_cycle_rank(uint64_t w)
{
    uint32_t st = ep_word_state(w);
    return st == EP_FREE ? 5u : st;
}

/*
 * True when `cur` is a word its owner already moved past: `owned` is what the owner last stored (0: nothing
 * yet), and `cur` is of the same generation but earlier in its cycle.  Within a generation only the owner
 * moves the word on (the claim that began it is the last remote write), so such a word can only have been
 * written back: soft-RoCE's responder (Linux 6.1, rxe_resp.c atomic_reply) stores the value it read even
 * when a CAS's compare fails, and a failed remote CAS that read the word before the owner's CAS can store
 * it after.  (Remote atomics are serialized with each other, so no claim falls between that read and
 * store: the stale word is always of the current generation -- or, after a HANDOVER, the only step by
 * which the owner stores a CLAIMED word, of the generation before it.)
 */
EP_HD int ep_word_reverted(uint64_t cur, uint64_t owned)
{
    if (owned == 0)
        return 0;
    if (ep_word_state(owned) == EP_CLAIMED && ep_next_generation(ep_word_generation(cur)) == ep_word_generation(owned))
        return 1;
    return ep_word_generation(cur) == ep_word_generation(owned) && ep_cycle_rank(cur) < ep_cycle_rank(owned);
}

#endif
