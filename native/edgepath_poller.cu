/*
 * The CUDA persistent poller: one block watches every slot's doorbell word and
 * moves a rung slot CLAIMED -> READY -> RUNNING with the same ep_step the CPU
 * poller uses, then hands it to the model side through a ring in mapped host
 * memory.  Loaded by edgepath.dma.gpu (cupy RawModule, eagerly, from a
 * cubin/fatbin nvcc builds); built with nvcc -std=c++17 -arch=sm_80 or newer.
 *
 * Memory (all pointers are device-visible addresses):
 *   pool        the slot pool (edgepath_slot.h layout): mapped pinned host memory
 *               (loopback lane) or device memory registered via dma-buf (NIC lane)
 *   seen        u64[slot_count] in device memory: last doorbell value decided on
 *   expire_req  u64[slot_count] mapped host memory: host asks to expire a CLAIMED word
 *   ring        u64[2 * ring_capacity] mapped host memory: {seq, value} entries
 *   ctrl        u64[EP_CTRL_WORDS] mapped host memory: stop flag, counters
 *   ring_tail   u64 in device memory: next ring position (kernel-only)
 *
 * Ordering: a slot's data is trusted only after its doorbell was loaded with
 * acquire at system scope (the writer stored the doorbell last, with release)
 * and, for device memory written by a NIC without GPUDirect RDMA write
 * ordering, after the writer's flush (docs/GPU.md): the header's generation is
 * re-checked after the acquire.  State words are changed with a system-scope
 * CAS, which is correct because each state has one writer (edgepath_poll.h).
 */
#include <cuda/atomic>

#include "edgepath_poll.h"

/* ctrl words. */
#define EP_CTRL_STOP 0      /* host sets non-zero: the kernel returns */
#define EP_CTRL_RUNNING 1   /* kernel sets 1 once polling, 2 when it has stopped */
#define EP_CTRL_ACCEPTED 2  /* doorbells accepted (READY -> RUNNING handed over) */
#define EP_CTRL_REJECTED 3  /* doorbells rejected */
#define EP_CTRL_EXPIRED 4   /* claims expired on the host's request */
#define EP_CTRL_LOST 5      /* state CAS that found a word changed under it (a broken ownership rule) */
#define EP_CTRL_LOOPS 6     /* polling passes, for the host's liveness check */
#define EP_CTRL_WORDS 8

typedef cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> sys_u64;
typedef cuda::atomic_ref<uint32_t, cuda::thread_scope_system> sys_u32;

static __device__ __forceinline__ unsigned long long load_acquire(uint64_t *p)
{
    return sys_u64(*reinterpret_cast<unsigned long long *>(p)).load(cuda::memory_order_acquire);
}

static __device__ __forceinline__ void store_release(uint64_t *p, unsigned long long v)
{
    sys_u64(*reinterpret_cast<unsigned long long *>(p)).store(v, cuda::memory_order_release);
}

static __device__ __forceinline__ void count(uint64_t *ctrl, int which)
{
    sys_u64(*reinterpret_cast<unsigned long long *>(&ctrl[which])).fetch_add(1ull, cuda::memory_order_relaxed);
}

/* Apply `event` to the state word with one CAS; true (and *next set) if the word moved. */
static __device__ bool apply(uint64_t *word, uint64_t cur, int event, uint32_t generation, uint64_t *next)
{
    if (ep_step(cur, event, generation, 0u, next) != EP_OK)
        return false;
    unsigned long long expected = cur;
    return sys_u64(*reinterpret_cast<unsigned long long *>(word))
        .compare_exchange_strong(expected, (unsigned long long)*next, cuda::memory_order_acq_rel,
                                 cuda::memory_order_acquire);
}

static __device__ void hand_off(uint64_t *ring, uint32_t mask, unsigned long long *ring_tail, uint64_t value)
{
    unsigned long long pos = atomicAdd(ring_tail, 1ull);
    uint64_t *entry = ring + 2u * (uint32_t)(pos & mask);
    sys_u64(*reinterpret_cast<unsigned long long *>(&entry[1])).store(value, cuda::memory_order_relaxed);
    store_release(&entry[0], pos + 1ull); /* seq, published after the value */
}

/* One decision and its action for `slot`; true if it did work. */
static __device__ bool poll_slot(char *pool, const ep_pool_header &h, uint32_t slot, uint64_t *seen, uint64_t *expire_req,
                                 uint64_t *ring, uint32_t mask, unsigned long long *ring_tail, uint64_t *ctrl)
{
    uint64_t *states = reinterpret_cast<uint64_t *>(pool + h.states_offset);
    uint64_t *doorbells = reinterpret_cast<uint64_t *>(pool + h.doorbells_offset);
    auto *req = reinterpret_cast<ep_request_header *>(pool + h.slots_offset + (uint64_t)slot * h.slot_stride);

    uint64_t bell = load_acquire(&doorbells[slot]);
    uint64_t expire = load_acquire(&expire_req[slot]);
    if (bell == seen[slot] && expire == 0)
        return false;
    uint64_t state = load_acquire(&states[slot]);
    uint32_t req_gen = sys_u32(req->generation).load(cuda::memory_order_acquire);

    switch (ep_poll_decide(state, bell, seen[slot], req_gen, expire, slot)) {
    case EP_POLL_ACCEPT: {
        uint32_t gen = ep_word_generation(state);
        seen[slot] = bell;
        uint64_t ready, running;
        if (!apply(&states[slot], state, EP_EV_DOORBELL, gen, &ready) ||
            !apply(&states[slot], ready, EP_EV_START, gen, &running)) {
            count(ctrl, EP_CTRL_LOST);
            return true;
        }
        hand_off(ring, mask, ring_tail, ep_ring_value(gen, slot));
        count(ctrl, EP_CTRL_ACCEPTED);
        return true;
    }
    case EP_POLL_REJECT:
        seen[slot] = bell;
        count(ctrl, EP_CTRL_REJECTED);
        return true;
    case EP_POLL_EXPIRE: {
        uint64_t freed;
        if (apply(&states[slot], state, EP_EV_EXPIRE, ep_word_generation(state), &freed))
            count(ctrl, EP_CTRL_EXPIRED);
        else
            count(ctrl, EP_CTRL_LOST);
        store_release(&expire_req[slot], 0ull);
        return true;
    }
    case EP_POLL_DROP:
        store_release(&expire_req[slot], 0ull);
        return true;
    default: /* IDLE, WAIT */
        return false;
    }
}

/*
 * Persistent poller: launch with one block (threads stride over slots) on a
 * non-blocking stream; returns when the host sets ctrl[EP_CTRL_STOP].  Idle
 * passes back off with __nanosleep from min_sleep_ns doubling to max_sleep_ns.
 */
extern "C" __global__ void ep_gpu_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring,
                                         uint32_t ring_capacity, unsigned long long *ring_tail, uint64_t *ctrl,
                                         uint32_t min_sleep_ns, uint32_t max_sleep_ns)
{
    __shared__ ep_pool_header h;
    __shared__ int stop;
    if (threadIdx.x == 0) {
        h = *reinterpret_cast<const ep_pool_header *>(pool);
        store_release(&ctrl[EP_CTRL_RUNNING], 1ull);
    }
    __syncthreads();
    const uint32_t mask = ring_capacity - 1u;
    uint32_t sleep_ns = min_sleep_ns;
    for (;;) {
        bool worked = false;
        for (uint32_t slot = threadIdx.x; slot < h.slot_count; slot += blockDim.x)
            worked |= poll_slot(pool, h, slot, seen, expire_req, ring, mask, ring_tail, ctrl);
        int any = __syncthreads_or(worked);
        if (threadIdx.x == 0) {
            stop = load_acquire(&ctrl[EP_CTRL_STOP]) != 0;
            count(ctrl, EP_CTRL_LOOPS);
        }
        __syncthreads();
        if (stop)
            break;
        if (any) {
            sleep_ns = min_sleep_ns;
        } else {
            if (sleep_ns)
                __nanosleep(sleep_ns);
            sleep_ns = sleep_ns * 2u > max_sleep_ns ? max_sleep_ns : (sleep_ns ? sleep_ns * 2u : 0u);
        }
    }
    if (threadIdx.x == 0)
        store_release(&ctrl[EP_CTRL_RUNNING], 2ull);
}

/* ep_step evaluated on the device for a table of inputs: the GPU tests compare it
 * with the host's ep_step (which the CPU tests check exhaustively). */
extern "C" __global__ void ep_gpu_step_table(const uint64_t *words, const int *events, const uint32_t *generations,
                                             const uint32_t *claimants, int n, int *rc, uint64_t *next)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    uint64_t out = 0;
    rc[i] = ep_step(words[i], events[i], generations[i], claimants[i], &out);
    next[i] = out;
}
