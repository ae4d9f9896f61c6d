/*
 * Host implementation of the edgepath data-plane primitives.
 *
 * cffi releases the GIL around every call into this file, so the blocking
 * waits (ep_cq_wait) and loops (ep_scan_leases) never hold up Python threads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "edgepath_core.h"
#include "edgepath_step.h"

#define ALIGN_UP(x) (((x) + (EP_ALIGN - 1)) & ~(uint64_t)(EP_ALIGN - 1))
#define AS_ATOMIC64(p) ((_Atomic uint64_t *)(p))

uint64_t ep_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int ep_step_word(uint64_t cur, int event, uint32_t generation, uint32_t claimant, uint64_t *next)
{
    return ep_step(cur, event, generation, claimant, next);
}

uint64_t ep_claim_next(uint64_t cur, uint32_t claimant)
{
    uint64_t next;
    return ep_step(cur, EP_EV_CLAIM, 0, claimant, &next) == EP_OK ? next : 0;
}

uint64_t ep_doorbell_word(uint32_t generation, uint32_t slot)
{
    return ep_doorbell(generation, slot);
}

uint32_t ep_doorbell_imm_of(uint32_t generation, uint32_t slot)
{
    return ep_doorbell_imm(generation, slot);
}

uint32_t ep_reclaim_imm_of(uint32_t generation, uint32_t slot)
{
    return ep_reclaim_imm(generation, slot);
}

int ep_apply(uint64_t *word, int event, uint32_t generation, uint32_t claimant, uint64_t *prev)
{
    uint64_t cur = atomic_load_explicit(AS_ATOMIC64(word), memory_order_acquire);
    for (;;) {
        uint64_t next;
        int rc = ep_step(cur, event, generation, claimant, &next);
        if (prev)
            *prev = cur;
        if (rc != EP_OK)
            return rc;
        if (atomic_compare_exchange_weak_explicit(AS_ATOMIC64(word), &cur, next,
                                                  memory_order_acq_rel, memory_order_acquire))
            return EP_OK;
    }
}

int ep_apply_owned(uint64_t *word, uint64_t *owned, int event, uint32_t generation, uint32_t holder,
                   uint64_t *restored)
{
    uint64_t cur = atomic_load_explicit(AS_ATOMIC64(word), memory_order_acquire);
    for (;;) {
        uint64_t from = ep_word_reverted(cur, *owned) ? *owned : cur, next;
        int rc = ep_step(from, event, generation, holder, &next);
        if (rc != EP_OK)
            return rc;
        if (atomic_compare_exchange_weak_explicit(AS_ATOMIC64(word), &cur, next,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *restored += from != cur;
            *owned = next;
            return EP_OK;
        }
    }
}

int ep_word_reverted_of(uint64_t cur, uint64_t owned)
{
    return ep_word_reverted(cur, owned);
}

/* Put `owned` back over a word written back to an older value of its generation; 1 if it did. */
static int restore_owned(uint64_t *word, uint64_t *cur, uint64_t owned)
{
    if (!ep_word_reverted(*cur, owned))
        return 0;
    if (!atomic_compare_exchange_strong_explicit(AS_ATOMIC64(word), cur, owned,
                                                 memory_order_acq_rel, memory_order_acquire))
        return 0; /* moved again meanwhile: the next scan looks at it */
    *cur = owned;
    return 1;
}

uint64_t ep_cas64(uint64_t *addr, uint64_t expected, uint64_t desired)
{
    atomic_compare_exchange_strong_explicit(AS_ATOMIC64(addr), &expected, desired,
                                            memory_order_acq_rel, memory_order_acquire);
    return expected; /* the value found, as an RDMA CAS returns it */
}

uint64_t ep_load64(const uint64_t *addr)
{
    return atomic_load_explicit((_Atomic uint64_t *)addr, memory_order_acquire);
}

void ep_store64(uint64_t *addr, uint64_t value)
{
    atomic_store_explicit(AS_ATOMIC64(addr), value, memory_order_release);
}

/* The server's CLOCK_MONOTONIC in ns, never less than `after` + 1: a word that carries it still changes at every
   store, as readers that only compare values need, and says when it was stored (ABI 11). */
static uint64_t clock_after(uint64_t after)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    return now > after ? now : after + 1;
}

void ep_load_publish(struct ep_load *dst, const struct ep_load *fields)
{
    uint64_t version = clock_after(atomic_load_explicit(AS_ATOMIC64(&dst->begin), memory_order_relaxed));
    atomic_store_explicit(AS_ATOMIC64(&dst->begin), version, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* begin is seen to change before any field does */
    const char *from = (const char *)fields + offsetof(struct ep_load, overhead_ms);
    char *to = (char *)dst + offsetof(struct ep_load, overhead_ms);
    /* word by word: a reader racing with this copy sees each word old or new, never half of one */
    for (size_t at = 0; at < offsetof(struct ep_load, begin) - offsetof(struct ep_load, overhead_ms); at += 8) {
        uint64_t word;
        memcpy(&word, from + at, 8);
        atomic_store_explicit(AS_ATOMIC64(to + at), word, memory_order_relaxed);
    }
    atomic_store_explicit(AS_ATOMIC64(&dst->end), version, memory_order_release);
}

_Bool ep_load_whole(const struct ep_load *copy)
{
    return copy->end == copy->begin;
}

_Bool ep_heartbeat_tick(void *word)
{
    /* one writer at a time (the server's loop, or llama.cpp's first compute thread while the loop waits in it) */
    uint64_t beat = clock_after(atomic_load_explicit(AS_ATOMIC64(word), memory_order_relaxed));
    atomic_store_explicit(AS_ATOMIC64(word), beat, memory_order_release);
    return 0;
}

void ep_copy(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
    atomic_thread_fence(memory_order_release);
}

int ep_next_free(const uint64_t *words, uint32_t n, uint32_t start)
{
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = (start + k) % n;
        if (ep_word_state(words[i]) == EP_FREE)
            return (int)i;
    }
    return -1;
}

void ep_request_stamp(void *request, uint32_t generation, uint32_t slot, uint32_t reply_index)
{
    struct ep_request_header *req = request;
    req->generation = generation;
    req->doorbell = ep_doorbell(generation, slot);
    req->reply_index = reply_index;
    req->t_written_ns = ep_now_ns();
}

void ep_request_fill(void *request, uint64_t request_id, uint32_t token_count, uint32_t max_new_tokens,
                     uint32_t flags, float temperature, float top_p, uint32_t top_k, uint64_t seed,
                     float min_p, float presence_penalty, float frequency_penalty, float repetition_penalty,
                     uint32_t logit_biases, uint64_t t_receive_ns, uint64_t t_tokenized_ns)
{
    struct ep_request_header *req = request;
    req->request_id = request_id;
    req->token_count = token_count;
    req->max_new_tokens = max_new_tokens;
    req->flags = flags;
    req->temperature = temperature;
    req->top_p = top_p;
    req->top_k = top_k;
    req->seed = seed;
    req->min_p = min_p;
    req->presence_penalty = presence_penalty;
    req->frequency_penalty = frequency_penalty;
    req->repetition_penalty = repetition_penalty;
    req->logit_biases = logit_biases;
    req->t_receive_ns = t_receive_ns;
    req->t_tokenized_ns = t_tokenized_ns;
    req->max_wait_ms = 0;  /* a frame is reused: the writer sets its bound after filling */
    req->predicted_ttft_us = 0;
    req->predicted_wait_us = 0;
    req->output_offset = 0;
    req->migrations = 0;
    req->cache_salt = 0;  /* a frame is reused: the writer sets its salt after filling */
    req->tenant = 0;      /* ... and its tenant's floor (issue 35) */
    req->slot_floor = 0;
}

void ep_result_begin(void *result, uint64_t request_id, uint32_t generation, uint32_t slot)
{
    struct ep_result_header *res = result;
    res->request_id = request_id;
    res->generation = generation;
    res->slot = slot;
    res->t_start_ns = ep_now_ns();
    res->t_first_ns = 0;
    res->cached_tokens = 0;
    res->prefill_us = 0;
    res->progress = (uint64_t)generation << 32;
}

void ep_result_end(void *result, uint32_t generation, int32_t status, uint32_t output_count)
{
    struct ep_result_header *res = result;
    res->status = status;
    res->output_count = output_count;
    res->progress = ((uint64_t)generation << 32) | output_count;
    res->t_done_ns = ep_now_ns();
}

/* ---- pool layout ------------------------------------------------------- */

uint64_t ep_result_offset(uint32_t input_capacity)
{
    return sizeof(struct ep_request_header) + ALIGN_UP((uint64_t)input_capacity * 4u);
}

uint64_t ep_frame_stride(uint32_t input_capacity, uint32_t output_capacity)
{
    return ep_result_offset(input_capacity) + sizeof(struct ep_result_header) +
           ALIGN_UP((uint64_t)output_capacity * 4u);
}

int ep_pool_layout(uint32_t slot_count, uint32_t input_capacity, uint32_t output_capacity,
                   struct ep_pool_header *out)
{
    return ep_pool_layout_prefixes(slot_count, input_capacity, output_capacity, 0, out);
}

int ep_pool_layout_prefixes(uint32_t slot_count, uint32_t input_capacity, uint32_t output_capacity,
                            uint32_t prefix_entries, struct ep_pool_header *out)
{
    if (slot_count == 0 || slot_count > EP_SLOT_MAX + 1u || input_capacity == 0 || output_capacity == 0 ||
        prefix_entries > EP_PREFIX_ENTRIES_MAX)
        return EP_POOL_E_LAYOUT;
    memset(out, 0, sizeof(*out));
    out->magic = EP_POOL_MAGIC;
    out->abi_version = EP_ABI_VERSION;
    out->slot_count = slot_count;
    out->input_capacity = input_capacity;
    out->output_capacity = output_capacity;
    out->slot_stride = ep_frame_stride(input_capacity, output_capacity);
    out->load_offset = ALIGN_UP(sizeof(struct ep_pool_header));
    out->states_offset = out->load_offset + ALIGN_UP(sizeof(struct ep_load));
    uint64_t after_states = out->states_offset + ALIGN_UP((uint64_t)slot_count * 8u);
    out->prefix_entries = prefix_entries;
    out->prefixes_offset = prefix_entries ? after_states : 0;
    out->doorbells_offset = after_states + ALIGN_UP((uint64_t)prefix_entries * 8u);
    out->cancels_offset = out->doorbells_offset + ALIGN_UP((uint64_t)slot_count * 8u);
    out->reclaims_offset = out->cancels_offset + ALIGN_UP((uint64_t)slot_count * 8u);
    out->slots_offset = out->reclaims_offset + ALIGN_UP((uint64_t)slot_count * 8u);
    out->total_size = out->slots_offset + (uint64_t)slot_count * out->slot_stride;
    return EP_OK;
}

int ep_pool_init(void *base, uint64_t size, const struct ep_pool_header *layout)
{
    if (size < layout->total_size)
        return EP_POOL_E_SIZE;
    memset(base, 0, layout->total_size);
    memcpy(base, layout, sizeof(*layout));
    atomic_thread_fence(memory_order_release);
    return EP_OK;
}

int ep_pool_validate(const void *base, uint64_t size)
{
    const struct ep_pool_header *h = base;
    struct ep_pool_header expect;
    if (size < sizeof(*h))
        return EP_POOL_E_SIZE;
    if (h->magic != EP_POOL_MAGIC)
        return EP_POOL_E_MAGIC;
    if (h->abi_version != EP_ABI_VERSION)
        return EP_POOL_E_VERSION;
    if (h->prefix_entries > EP_PREFIX_ENTRIES_MAX ||
        ep_pool_layout_prefixes(h->slot_count, h->input_capacity, h->output_capacity, (uint32_t)h->prefix_entries,
                                &expect) != EP_OK ||
        expect.slot_stride != h->slot_stride || expect.load_offset != h->load_offset ||
        expect.states_offset != h->states_offset ||
        expect.prefixes_offset != h->prefixes_offset ||
        expect.doorbells_offset != h->doorbells_offset || expect.cancels_offset != h->cancels_offset ||
        expect.reclaims_offset != h->reclaims_offset ||
        expect.slots_offset != h->slots_offset ||
        expect.total_size != h->total_size)
        return EP_POOL_E_LAYOUT;
    if (size < h->total_size)
        return EP_POOL_E_SIZE;
    return EP_OK;
}

/* ---- prefix affinity --------------------------------------------------- */

uint32_t ep_prefix_chain(uint64_t salt, const int32_t *tokens, uint32_t count, uint64_t *out, uint32_t max_blocks)
{
    uint32_t blocks = count / EP_PREFIX_BLOCK;
    if (blocks > max_blocks)
        blocks = max_blocks;
    uint64_t h = EP_PREFIX_SEED ^ salt;
    for (uint32_t b = 0; b < blocks; b++) {
        const int32_t *t = tokens + (uint64_t)b * EP_PREFIX_BLOCK;
        for (uint32_t i = 0; i < EP_PREFIX_BLOCK; i++) {
            h = (h ^ (uint32_t)t[i]) * EP_PREFIX_MUL;
            h ^= h >> 32;
        }
        h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
        h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
        h ^= h >> 31;
        if (h == 0)
            h = 1;
        out[b] = h;
    }
    return blocks;
}

uint32_t ep_prefix_match(const uint64_t *table, uint32_t entries, const uint64_t *chain, uint32_t blocks)
{
    for (uint32_t j = blocks; j > 0; j--) {
        uint64_t want = chain[j - 1];
        for (uint32_t e = 0; e < entries; e++)
            if (table[e] == want)
                return j;
    }
    return 0;
}

/* ---- completion queue -------------------------------------------------- */
/*
 * Bounded multi-producer single-consumer ring (Vyukov): a producer reserves a
 * position with fetch_add on tail and publishes by storing seq = pos + 1; the
 * consumer owns head.  The consumer "arms" the queue before sleeping on the
 * eventfd; a producer writes the eventfd only when it disarms it, so a busy
 * consumer costs producers no system call (like ibv_req_notify_cq).
 */
struct ep_cq_entry {
    _Atomic uint64_t seq;
    uint64_t value;
};

struct ep_cq {
    uint64_t capacity;
    uint64_t mask;
    char pad0[EP_ALIGN - 16];
    _Atomic uint64_t tail;
    char pad1[EP_ALIGN - 8];
    _Atomic uint64_t head;
    char pad2[EP_ALIGN - 8];
    _Atomic uint32_t armed;
    char pad3[EP_ALIGN - 4];
    struct ep_cq_entry entries[];
};

uint64_t ep_cq_size(uint32_t capacity)
{
    return sizeof(struct ep_cq) + (uint64_t)capacity * sizeof(struct ep_cq_entry);
}

int ep_cq_init(void *ring, uint32_t capacity)
{
    struct ep_cq *q = ring;
    if (capacity == 0 || (capacity & (capacity - 1)) != 0)
        return EP_POOL_E_LAYOUT;
    memset(q, 0, ep_cq_size(capacity));
    q->capacity = capacity;
    q->mask = capacity - 1u;
    for (uint64_t i = 0; i < capacity; i++)
        atomic_store_explicit(&q->entries[i].seq, i, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    return EP_OK;
}

static void cq_notify(struct ep_cq *q, int efd)
{
    if (efd >= 0 && atomic_exchange_explicit(&q->armed, 0u, memory_order_seq_cst)) {
        uint64_t one = 1;
        ssize_t rc;
        do {
            rc = write(efd, &one, sizeof(one));
        } while (rc < 0 && errno == EINTR);
    }
}

int ep_cq_push(void *ring, uint64_t value, int efd)
{
    struct ep_cq *q = ring;
    uint64_t pos = atomic_load_explicit(&q->tail, memory_order_relaxed);
    for (;;) {
        struct ep_cq_entry *e = &q->entries[pos & q->mask];
        uint64_t seq = atomic_load_explicit(&e->seq, memory_order_acquire);
        int64_t dif = (int64_t)seq - (int64_t)pos;
        if (dif == 0) {
            if (atomic_compare_exchange_weak_explicit(&q->tail, &pos, pos + 1, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                e->value = value;
                atomic_store_explicit(&e->seq, pos + 1, memory_order_seq_cst);
                cq_notify(q, efd);
                return EP_OK;
            }
        } else if (dif < 0) {
            return EP_CQ_E_FULL; /* a CQ overrun: fatal on a NIC, an error here */
        } else {
            pos = atomic_load_explicit(&q->tail, memory_order_relaxed);
        }
    }
}

int ep_cq_poll(void *ring, uint64_t *out, int max)
{
    struct ep_cq *q = ring;
    uint64_t head = atomic_load_explicit(&q->head, memory_order_relaxed);
    int n = 0;
    while (n < max) {
        struct ep_cq_entry *e = &q->entries[head & q->mask];
        if (atomic_load_explicit(&e->seq, memory_order_acquire) != head + 1)
            break;
        out[n++] = e->value;
        atomic_store_explicit(&e->seq, head + q->capacity, memory_order_release);
        head++;
    }
    atomic_store_explicit(&q->head, head, memory_order_relaxed);
    return n;
}

/* Ask for an eventfd write on the next push; returns 1 if entries are already pending. */
int ep_cq_arm(void *ring)
{
    struct ep_cq *q = ring;
    atomic_store_explicit(&q->armed, 1u, memory_order_seq_cst);
    uint64_t head = atomic_load_explicit(&q->head, memory_order_relaxed);
    return atomic_load_explicit(&q->entries[head & q->mask].seq, memory_order_acquire) == head + 1;
}

static void drain_eventfd(int efd)
{
    uint64_t v;
    while (read(efd, &v, sizeof(v)) == sizeof(v))
        ;
}

int ep_cq_rearm(void *ring, int efd)
{
    drain_eventfd(efd);
    return ep_cq_arm(ring);
}

int ep_cq_wait(void *ring, int efd, uint64_t *out, int max, int64_t timeout_ns, int64_t spin_ns)
{
    struct ep_cq *q = ring;
    uint64_t start = ep_now_ns();
    int n = ep_cq_poll(ring, out, max);
    while (n == 0 && spin_ns > 0 && (int64_t)(ep_now_ns() - start) < spin_ns) {
        __builtin_ia32_pause();
        n = ep_cq_poll(ring, out, max);
    }
    while (n == 0) {
        int64_t left = timeout_ns < 0 ? -1 : timeout_ns - (int64_t)(ep_now_ns() - start);
        if (timeout_ns >= 0 && left <= 0)
            return 0;
        atomic_store_explicit(&q->armed, 1u, memory_order_seq_cst);
        n = ep_cq_poll(ring, out, max);
        if (n > 0)
            break;
        struct pollfd pfd = {.fd = efd, .events = POLLIN};
        int ms = left < 0 ? -1 : (int)((left + 999999) / 1000000);
        int rc = poll(&pfd, 1, ms);
        if (rc < 0 && errno != EINTR)
            return EP_CQ_E_WAIT;
        if (rc > 0)
            drain_eventfd(efd);
        n = ep_cq_poll(ring, out, max);
    }
    return n;
}

int ep_write_imm(void *dst, const void *src, size_t n, void *ring, uint64_t value, int efd)
{
    if (n > 0)
        memcpy(dst, src, n);
    atomic_thread_fence(memory_order_release);
    return ep_cq_push(ring, value, efd);
}

int ep_write_then_imm(void *dst, const void *src, size_t n, void *bell_dst, const void *bell_src, size_t bell_n,
                      void *ring, uint64_t value, int efd)
{
    if (n > 0)
        memcpy(dst, src, n);
    return ep_write_imm(bell_dst, bell_src, bell_n, ring, value, efd);
}

/* ---- slot-server poller core ------------------------------------------- */

static inline uint64_t *pool_states(void *pool)
{
    struct ep_pool_header *h = pool;
    return (uint64_t *)((char *)pool + h->states_offset);
}

static inline struct ep_request_header *pool_request(void *pool, uint32_t slot)
{
    struct ep_pool_header *h = pool;
    return (struct ep_request_header *)((char *)pool + h->slots_offset + (uint64_t)slot * h->slot_stride);
}

/*
 * Turn doorbell completions (conn << 32 | generation_low16 << 16 | slot) into
 * READY slots.  A doorbell is accepted only if the slot is CLAIMED by the
 * connection that rang it, in the generation it names, and the request
 * header carries that same generation; anything else (a slot never claimed, a
 * late doorbell after a lease expired, a peer ringing someone else's slot)
 * is counted in *rejected and changes nothing.
 */
int ep_accept_doorbells(void *pool, uint64_t *owned, uint64_t *restored, const uint64_t *entries, int n,
                        uint32_t *ready_slots, uint32_t *ready_conns, uint64_t now_ns, int *rejected)
{
    struct ep_pool_header *h = pool;
    uint64_t *states = pool_states(pool);
    int ready = 0;
    *rejected = 0;
    for (int i = 0; i < n; i++) {
        uint32_t conn = (uint32_t)(entries[i] >> 32);
        uint32_t slot = (uint32_t)(entries[i] & 0xffffu);
        if (slot >= h->slot_count) {
            (*rejected)++;
            continue;
        }
        uint64_t cur = atomic_load_explicit(AS_ATOMIC64(&states[slot]), memory_order_acquire);
        uint32_t gen = ep_word_generation(cur);
        struct ep_request_header *req = pool_request(pool, slot);
        if (ep_doorbell_imm(gen, slot) != (uint32_t)(entries[i] & 0xffffffffu) || ep_word_claimant(cur) != conn || req->generation != gen) {
            (*rejected)++;
            continue;
        }
        if (ep_apply_owned(&states[slot], &owned[slot], EP_EV_DOORBELL, gen, 0, restored) != EP_OK) {
            (*rejected)++;
            continue;
        }
        struct ep_result_header *res =
            (struct ep_result_header *)((char *)req + ep_result_offset(h->input_capacity));
        res->t_ready_ns = now_ns;
        ready_slots[ready] = slot;
        ready_conns[ready] = conn;
        ready++;
    }
    return ready;
}

/*
 * Reclaim slots left CLAIMED longer than the pool's lease.  The lease runs
 * from the first scan that saw the slot CLAIMED in that generation, so the
 * server needs no clock shared with its writers.  First, a word written back
 * to one the server had already moved past (ep_word_reverted) gets the
 * server's word again: nothing else would, when it was the last of a cycle.
 */
int ep_scan_leases(void *pool, uint64_t *owned, uint64_t *restored, uint64_t *seen_word, uint64_t *seen_ns,
                   uint64_t now_ns, uint32_t *expired, int max)
{
    struct ep_pool_header *h = pool;
    uint64_t *states = pool_states(pool);
    int n = 0;
    for (uint32_t i = 0; i < h->slot_count; i++) {
        uint64_t cur = atomic_load_explicit(AS_ATOMIC64(&states[i]), memory_order_acquire);
        *restored += restore_owned(&states[i], &cur, owned[i]);
        if (ep_word_state(cur) != EP_CLAIMED) {
            seen_word[i] = cur;
            continue;
        }
        if (seen_word[i] != cur) {
            seen_word[i] = cur;
            seen_ns[i] = now_ns;
            continue;
        }
        if (now_ns - seen_ns[i] >= h->lease_ns && n < max &&
            ep_apply_owned(&states[i], &owned[i], EP_EV_EXPIRE, ep_word_generation(cur), 0, restored) == EP_OK)
            expired[n++] = i;
    }
    return n;
}
