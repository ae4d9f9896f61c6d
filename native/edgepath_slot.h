/*
 * edgepath slot ABI: the single source of truth for the memory shared by the
 * agent (writer, via RDMA or loopback) and the slot server / poller (reader).
 *
 * Everything between the CDEF markers is also fed to cffi's cdef, so the
 * Python view of this ABI is generated from this file and checked against the
 * C compiler's layout at build time (cffi API mode) and by tests/test_abi.py
 * (an independent gcc-compiled offset dump).
 *
 * Pool memory (one registered region):
 *   [ep_pool_header][ep_load][u64 state[n]][u64 prefix[m]][u64 doorbell[n]][u64 cancel[n]][u64 reclaim[n]][slots...]
 * each array starts on a 64-byte boundary (the prefix table is there only when m > 0, and then
 * follows the state words, so one READ from the heartbeat gets the load region, the state words and
 * the prefix table); each slot is slot_stride bytes:
 *   [ep_request_header][int32 tokens[input_capacity]][ep_result_header][int32 output[output_capacity]]
 * A requester's reply region uses the same per-entry layout (a "frame"), so
 * the request part is sent with one RDMA WRITE and the result part comes back
 * with one RDMA WRITE.
 */
#ifndef EDGEPATH_SLOT_H
#define EDGEPATH_SLOT_H

#include <stdint.h>

/* CDEF-BEGIN */
#define EP_POOL_MAGIC 0x4c4f4f5045474445
#define EP_ABI_VERSION 14  /* 3: cached_tokens in the result header (issue 19); 4: the pool header's heartbeat (issue 20); 5: the prefix table (issue 19); 6: the load and pace words, the wait bound and predictions (issue 27), a migrated request's output offset (issue 28); 7: the load region replaces the load and pace words: the step policy's costs, knobs and prompts in prefill, tear-free; a refusal's bound and retry time (issue 34); 8: the request's cache salt, which keys the prefix hashes (issue 35); the pool header's draining word (issue 37); log probabilities in the output area, asked for by EP_FLAG_LOGPROBS, and a constraint after the prompt, EP_FLAG_CONSTRAINT (issue 36); 9: the load region's micro-batch costs: decode_context_ms, the decoding streams' runs and longest context (issue 34); 10: the claimant's tenant in the state word (8 bits taken from the generation, now 24), slot floors taken back by a reclaim word and a hand-over (issue 35); 11: the heartbeat word and the load region's version are the server's CLOCK_MONOTONIC in ns when stored, so an agent knows how long the step planned from the load it read had run (issue 34); the load region's floors, 14 prompts listed instead of 15 (issue 35); 12: the load region's lent_ms (was spare): what a borrower's prompt may add to a step while a floor is lent (issue 35); 13: the request header's slot_cap (was spare) and EP_STATUS_SLOT_CAP: a tenant's cap on the slots it holds, counted from the state words across every edge (issue 50); 14: the request header's third cache line: min_p, the presence, frequency and repetition penalties, and the logit biases that follow the prompt; EP_FLAG_IGNORE_EOS (issue 51) */

/* Slot states (low 8 bits of the state word). */
#define EP_FREE 0
#define EP_CLAIMED 1
#define EP_READY 2
#define EP_RUNNING 3
#define EP_DONE 4

/* State-machine events understood by ep_step(). */
#define EP_EV_CLAIM 1
#define EP_EV_DOORBELL 2
#define EP_EV_START 3
#define EP_EV_COMPLETE 4
#define EP_EV_RELEASE 5
#define EP_EV_EXPIRE 6
#define EP_EV_HANDOVER 7  /* DONE -> CLAIMED in the next generation, for a reclaimer (issue 35) */

/* ep_step() results. */
#define EP_OK 0
#define EP_E_STATE -1
#define EP_E_STALE -2
#define EP_E_EVENT -3

/*
 * State word: tenant (bits 56..63) | generation (bits 32..55) | claimant (bits 8..31) | state (bits 0..7).
 * The tenant is the claimer's tenant's id (1..EP_TENANT_MAX for a tenant with a slot floor or a slot cap; 0: neither),
 * set by the claim and kept until the slot is FREE again, so that every agent that reads the state words sees whose
 * slots are taken (issue 35: slot floors; issue 50: slot caps, counted across every edge).  The generation wraps at 2^24 (immediates carry 14 bits of it).
 * A claim or a hand-over names its holder as one 32-bit value: tenant << 24 | claimant.
 */
#define EP_CLAIMANT_MAX 16777215
#define EP_GENERATION_MAX 16777215
#define EP_TENANT_MAX 255

/* Doorbell word (written last): generation << 32 | EP_DOORBELL_VALID | slot. */
#define EP_DOORBELL_VALID 2147483648
#define EP_SLOT_MAX 65535

/*
 * Immediates towards a slot server (32 bits): EP_IMM_CANCEL? | EP_IMM_RECLAIM? | generation_low14 << 16 | slot.
 * A doorbell has bits 31 and 30 clear; a cancel (the agent wrote cancel[slot] = generation << 32 | 1
 * first, for a poller that cannot see a CQ) has bit 31 set; a reclaim (issue 35: the agent wrote
 * reclaim[slot] = the CLAIMED word it asks the slot to be handed over as, in the generation after the
 * running one) has bits 31 and 30 set and names the running generation.
 */
#define EP_IMM_CANCEL 2147483648
#define EP_IMM_RECLAIM 1073741824
#define EP_IMM_GEN_MASK 16383

/*
 * Immediates towards an agent (32 bits): kind (bits 30..31) | reply entry index (bits 0..29).
 * PROGRESS: output tokens [0, count) of the entry are placed and the result header's `progress`
 * word says so (generation << 32 | count).  FINAL: the whole result header is placed (status,
 * counts, times) and nothing will be written into the entry for that generation again.  STALLED
 * (an agent process to its edge only): the slot server running the entry stopped responding; the
 * entry is still in flight (its FINAL comes when that server lets go of it or is lost).  HANDOVER (a slot
 * server to an agent only; bits 0..29 are then a slot, not an entry): the server has acted on the agent's
 * reclaim of that slot -- handed it over, or found it could not: the agent reads the slot's state word.
 */
#define EP_IMM_FINAL 0
#define EP_IMM_PROGRESS 1073741824
#define EP_IMM_STALLED 2147483648  /* agent -> edge only: the entry's slot server is unresponsive (still in flight) */
#define EP_IMM_HANDOVER 3221225472 /* slot server -> agent only: the reclaim of slot (bits 0..29) was acted on */
#define EP_IMM_KIND_MASK 3221225472
#define EP_IMM_INDEX_MASK 1073741823

/* Result status codes (ep_result_header.status). */
#define EP_STATUS_OK 0
#define EP_STATUS_HANDLER_ERROR 1
#define EP_STATUS_BAD_REQUEST 2
#define EP_STATUS_NO_SLOT 3
#define EP_STATUS_UNAVAILABLE 4
#define EP_STATUS_LENGTH 5       /* stopped at max_new_tokens */
#define EP_STATUS_STOP 6         /* the model ended the sequence (end-of-sequence token) */
#define EP_STATUS_CANCELLED 7    /* the requester cancelled; output so far is valid */
#define EP_STATUS_OVER_BOUND 8   /* refused at claim time: no server would give the first token within the bound */
#define EP_STATUS_RECLAIMED 9    /* the slot was taken back for a tenant under its slot floor; output so far is valid */
#define EP_STATUS_SLOT_CAP 10    /* refused at claim time: the request's tenant holds its slot_cap of slots, across every pool */

/* Request flags. */
#define EP_FLAG_STREAM 1         /* stream output tokens as they are produced */
/*
 * Log probabilities (issue 36): with EP_FLAG_LOGPROBS each output token is a record of 2 + 2 * top int32 words,
 * top = (flags >> EP_FLAG_TOP_SHIFT) & EP_FLAG_TOP_MASK (at most EP_TOP_LOGPROBS_MAX): the token id, its log
 * probability (float32 bits), the top likeliest ids, likeliest first, then their log probabilities (float32
 * bits).  max_new_tokens, output counts and progress words then count words, a whole number of records.
 */
#define EP_FLAG_LOGPROBS 2
#define EP_FLAG_TOP_SHIFT 8
#define EP_FLAG_TOP_MASK 0xff
#define EP_TOP_LOGPROBS_MAX 20
/*
 * A constraint (issue 36): with EP_FLAG_CONSTRAINT, the (flags >> EP_FLAG_CONSTRAINT_SHIFT) & EP_FLAG_CONSTRAINT_MASK
 * int32 words after the prompt's token_count ids hold a GBNF grammar (llama.cpp's), UTF-8, zero-padded, that the
 * output must match, then the request's logit biases (ABI 14, issue 51): the request header's logit_biases pairs
 * of words, a token id and the bias added to its logit (float32 bits), the last 2 * logit_biases words.  The
 * grammar takes the words before them (none: no grammar).  The request's input is token_count + those words
 * (within the input capacity), written and sent with the prompt in the one WRITE.
 */
#define EP_FLAG_CONSTRAINT 4
#define EP_FLAG_CONSTRAINT_SHIFT 16
#define EP_FLAG_CONSTRAINT_MASK 0xffff
#define EP_LOGIT_BIAS_MAX 300    /* logit biases one request may carry (the bound OpenAI's API applies) */
/*
 * A reader of the shared prefix (issue 35): with EP_FLAG_READ_PUBLIC the model side may also reuse KV written under
 * the public namespace's cache salt (the edge's wire.PUBLIC_SALT: what tenants that share their prefixes write),
 * while everything the request itself writes stays under its own cache_salt.  A model side that does not know the
 * flag reuses its own salt's prefixes only (it computes more, it reads nothing more).
 */
#define EP_FLAG_READ_PUBLIC 8
/*
 * The model's end-of-generation tokens are never drawn (ABI 14, issue 51: vLLM's and llama.cpp's ignore_eos, which
 * load generators send to get answers of a set length): the answer runs to max_new_tokens or the slot's context.
 */
#define EP_FLAG_IGNORE_EOS 16

#define EP_ALIGN 64

/*
 * The penalties' window (ABI 14): the presence, frequency and repetition penalties count a token's occurrences
 * among the sequence's last EP_PENALTY_LAST_N tokens, prompt included (llama-server's default repeat_last_n).
 */
#define EP_PENALTY_LAST_N 64

/*
 * Prefix affinity (issue 19).  A prompt's token ids are cut into blocks of EP_PREFIX_BLOCK; block b's
 * chain hash covers blocks 0..b, so one value names a whole prefix:
 *   h = EP_PREFIX_SEED ^ salt; for each block: for each id t: h = (h ^ (uint32)t) * EP_PREFIX_MUL, h ^= h >> 32;
 *   then h = splitmix64's finaliser of h (0 becomes 1), and that is the block's chain hash (and the next h).
 * `salt` is the request header's cache_salt (ABI 8): prefixes written under one salt are named by other hashes
 * than the same tokens under another, so neither placement nor reuse crosses salts (0: no salt, the hashes of
 * ABI 5..7).  A slot server whose handler keeps KV of earlier requests publishes the chain hashes of what it
 * holds, each under the salt it was written with, in its pool's prefix table (u64 prefix[prefix_entries];
 * 0 = unused entry); an agent claims first on the server that publishes the longest prefix of a request under
 * the request's salt.  A hint only: the handler checks the tokens and the salt.
 */
#define EP_PREFIX_BLOCK 64
#define EP_PREFIX_SEED 0xcbf29ce484222325
#define EP_PREFIX_MUL 0x9e3779b97f4a7c15
#define EP_PREFIX_ENTRIES_MAX 4096

struct ep_pool_header {
    uint64_t magic;
    uint32_t abi_version;
    uint32_t slot_count;
    uint32_t input_capacity;   /* tokens per slot */
    uint32_t output_capacity;  /* tokens per slot */
    uint64_t slot_stride;      /* bytes */
    uint64_t states_offset;
    uint64_t doorbells_offset;
    uint64_t slots_offset;
    uint64_t total_size;
    uint64_t server_epoch;     /* changes on every slot-server start */
    uint64_t lease_ns;         /* CLAIMED without doorbell for longer is reclaimed */
    uint64_t cancels_offset;   /* u64 cancel[slot_count]: generation << 32 | 1, written by the claimer */
    /*
     * u64 reclaim[slot_count] (ABI 10, issue 35), written by agents only: the CLAIMED word (the running generation
     * + 1, the writer's claimant and tenant) a reclaimer asks the running slot to be handed over as, rung with
     * EP_IMM_RECLAIM.  Then a cache line to spare, so that the heartbeat stays in the header's last one.
     */
    uint64_t reclaims_offset;
    uint64_t reserved[7];
    /*
     * Advanced by the slot server at every turn of its loop (so after every model step), never less
     * often than its lease-scan interval: a word that stands still means its CPU side is frozen.
     * Its value is the server's CLOCK_MONOTONIC in ns at the last advance (ABI 11; at least the previous value
     * + 1): minus the load region's version (the same clock when it was published), how long the step planned
     * from that load had run when the word was read.  Readers compare values, never sizes.  Placed in the header's last cache line, right before the load region, so
     * that one READ of [heartbeat .. state[n-1]] gives an agent both (edgepath.dpu.link_state).
     */
    uint64_t heartbeat;
    uint64_t prefixes_offset;  /* u64 prefix[prefix_entries], right after the state words (0: no table) */
    uint64_t prefix_entries;   /* chain hashes the slot server publishes at most (0..EP_PREFIX_ENTRIES_MAX) */
    uint64_t load_offset;      /* the load region (struct ep_load), right after this header */
    /*
     * Nonzero once the slot server is stopping (SIGTERM): agents read it with the heartbeat and claim nothing
     * more there, while it finishes what it runs (issue 37; the reserved word of ABI 7, which read 0).
     */
    uint64_t draining;
};

/*
 * The load region (ABI 7): what the model side has to do before a new prompt's first token and how it plans
 * its steps, for the agents' admission, which runs the same step policy forward over it
 * (edgepath.contract.plan).  Rewritten by the slot server whenever it changes (after steps, admissions,
 * cancels), read in the same READ as the heartbeat and the state words.
 *
 * Tear-free by a sequence lock across the region: the writer stores `begin` (the highest word) first, then
 * the fields, then `end` (the lowest word) last, with a release fence between; a reader that copies the region
 * in address order (end first, begin last: loopback's copy and soft-RoCE's READ do) takes it only when `end`
 * equals `begin`, and keeps its previous copy otherwise.  The version is the server's CLOCK_MONOTONIC in ns when
 * it published (ABI 11): the server publishes after each step, so the next step starts then.  All zero: the
 * handler publishes no load (echo).
 *
 * Costs of a step, in ms (ABI 9): overhead_ms * micro-batches + prompt_ms * prompt tokens
 *   + decode_ms * decoded tokens + context_ms * (positions attended by the prompt tokens, summed) / 1000
 *   + decode_context_ms * decoded tokens * (longest + 1) / 1000 (llama.cpp pads a micro-batch's streams to its
 *   longest).
 * llama.cpp with one KV stream per sequence computes a step in one micro-batch per run of consecutive sequence
 * ids, plus one per prompt chunk beside them; `runs` is how many the decoding streams take now.
 */
#define EP_LOAD_PROMPTS 14  /* prompts in prefill listed; more are summed into the last entry (15 until ABI 11) */

struct ep_load {
    uint64_t end;              /* the version, stored last */
    float overhead_ms;
    float prompt_ms;
    float decode_ms;
    float context_ms;
    float decode_context_ms;
    float stall_ms;            /* the policy's bound on a step while streams decode */
    uint32_t min_prefill;      /* prompt tokens a step carries at least while a prompt waits */
    uint32_t batch;            /* tokens at most in one step */
    uint32_t decoding;         /* streams decoding, one token per step each */
    uint32_t runs;             /* micro-batches the decoding streams take (runs of consecutive sequence ids) */
    uint64_t longest;          /* positions the longest decoding stream holds */
    uint32_t prefilling;       /* requests whose prompt is not all computed */
    uint32_t listed;           /* entries of prompts[] in use (at most EP_LOAD_PROMPTS) */
    uint32_t prompts[28];      /* per prompt in prefill, in the order served: positions held, tokens to compute */
    uint32_t floors;           /* the first `floors` listed are within their tenant's slot floor (ABI 11) */
    float lent_ms;             /* while a slot floor is lent out, what other prompts add to a step; 0: none is (ABI 12) */
    uint64_t begin;            /* the version, stored first */
};

struct ep_request_header {
    uint64_t request_id;
    uint32_t token_count;
    uint32_t max_new_tokens;
    uint32_t flags;
    uint32_t generation;       /* generation the writer claimed */
    uint64_t t_receive_ns;     /* CLOCK_MONOTONIC, edge */
    uint64_t t_tokenized_ns;
    uint64_t t_written_ns;
    uint64_t doorbell;         /* value rung into doorbell[slot] */
    uint32_t reply_index;      /* entry of the requester's reply region */
    uint32_t top_k;            /* sampling: 0 = off */
    /* -- sampling parameters, read by the model side (second cache line) -- */
    float temperature;         /* 0 = greedy */
    float top_p;               /* 0 or 1 = off (a zeroed header means: no nucleus cut) */
    uint64_t seed;             /* sampling seed (per request) */
    uint32_t stream_window_us; /* coalesce streamed tokens within this window (0: server default) */
    uint32_t max_wait_ms;      /* the requester's bound on waiting for the first token (0: the agent's default) */
    uint32_t predicted_ttft_us;/* the agent's prediction of this request's time to first token, at claim time */
    uint32_t predicted_wait_us;/* of it, the wait: the prediction minus its own uncached prompt on an idle server */
    uint32_t output_offset;    /* a migrated request: output tokens its answer has already (the prompt's tail);
                                  the slot server places its output from there in the reply entry and counts it */
    uint32_t migrations;       /* how often the request has moved to another slot server */
    uint64_t cache_salt;       /* the prefix cache's namespace (the edge's tenant and the request's cache_salt):
                                  KV is reused only from prefixes written under the same salt (0: no salt) */
    uint32_t tenant;           /* the request's tenant's id in the state words (1..EP_TENANT_MAX for a tenant with a
                                  slot floor or a slot cap; 0: neither), claimed with */
    uint32_t slot_floor;       /* that tenant's slot floor: slots it may always have (0: none) */
    uint32_t slot_cap;         /* that tenant's slot cap: slots it may hold at most, across every pool (0: none; ABI 13) */
    uint32_t reserved[1];
    /* -- sampling parameters, continued (third cache line, ABI 14): a zeroed line changes nothing -- */
    float min_p;               /* drop tokens less likely than min_p x the likeliest's probability (0 = off) */
    float presence_penalty;    /* subtracted from the logit of a token among the last EP_PENALTY_LAST_N (0 = off) */
    float frequency_penalty;   /* ... times its count there (0 = off) */
    float repetition_penalty;  /* ... divides a positive logit, multiplies a negative one (0 or 1 = off) */
    uint32_t logit_biases;     /* (id, bias) pairs at the end of the constraint words after the prompt (0: none) */
    uint32_t reserved32;
    uint64_t reserved_sampling[5];
};

struct ep_result_header {
    uint64_t request_id;
    uint32_t generation;
    uint32_t slot;
    int32_t status;
    uint32_t output_count;
    uint64_t t_ready_ns;       /* poller saw the doorbell */
    uint64_t t_start_ns;       /* handler started */
    uint64_t t_done_ns;        /* handler finished */
    uint64_t progress;         /* generation << 32 | output tokens placed so far */
    uint64_t t_first_ns;       /* first output token produced (0: none); sent with every progress word */
    /* -- second cache line: written with the final result -- */
    uint32_t cached_tokens;    /* prompt tokens the model side took from its prefix cache (not recomputed) */
    uint32_t prefill_us;       /* what its uncached prompt costs on an idle server (the step cost model) */
    uint32_t refusal_wait_us;  /* OVER_BOUND: the least predicted wait among the servers tried */
    uint32_t refusal_bound_ms; /* OVER_BOUND: the bound on waiting the agent applied (the request's or its own) */
    uint32_t retry_after_ms;   /* NO_SLOT, OVER_BOUND, SLOT_CAP: when the agent predicts a retry would be admitted */
    uint32_t reserved32;
    uint64_t reserved[5];
};
/* CDEF-END */

/* The fixed parts are whole cache lines, so token areas stay 64-byte aligned. */
#ifdef __cplusplus
#define EP_STATIC_ASSERT static_assert
#else
#define EP_STATIC_ASSERT _Static_assert
#endif
EP_STATIC_ASSERT(sizeof(struct ep_pool_header) == 192, "ep_pool_header must be 192 bytes");
EP_STATIC_ASSERT(sizeof(struct ep_load) == 192, "ep_load must be 192 bytes (three cache lines)");
EP_STATIC_ASSERT(sizeof(((struct ep_load *)0)->prompts) == 8 * EP_LOAD_PROMPTS, "prompts: two words per entry");
EP_STATIC_ASSERT(sizeof(struct ep_request_header) == 192, "ep_request_header must be 192 bytes (three cache lines)");
EP_STATIC_ASSERT(sizeof(struct ep_result_header) == 128, "ep_result_header must be 128 bytes");

#endif
