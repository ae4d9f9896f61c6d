/*
 * The CUDA persistent poller: one block watches every slot's doorbell word and
 * moves a rung slot CLAIMED -> READY -> RUNNING with the same ep_step the CPU
 * poller uses, then hands it to the model side through a ring in mapped host
 * memory.  Loaded by edgepath.slots.gpu (cupy RawModule, eagerly, from a
 * cubin/fatbin nvcc builds); built with nvcc -std=c++17 -arch=sm_80 or newer.
 *
 * The per-slot pass is edgepath_poller.h, shared with a host twin the CPU tests
 * run; this file adds only the device atomics and the persistent loop.
 * Memory (all pointers are device-visible addresses):
 *   pool        the slot pool (edgepath_slot.h layout): mapped pinned host memory
 *               (loopback lane) or device memory registered via dma-buf (NIC lane)
 *   seen        u64[slot_count] in device memory: last doorbell value decided on
 *   expire_req  u64[slot_count] mapped host memory: host asks to expire a CLAIMED word
 *   ring        u64[EP_RING_WORDS * ring_capacity] mapped host memory: {seq, value, detect_ns, cycles}
 *   ctrl        u64[EP_CTRL_WORDS] mapped host memory: stop flag, counters (one line per writer)
 *   ring_tail   u64 in device memory: next ring position (kernel-only)
 *
 * Also here, so one fatbin carries every kernel bench/gpu_check.py needs: the model side's release
 * store into a device-memory pool (ep_gpu_store), and the check's smoke and baseline kernels.
 *
 * Ordering: a slot's data is trusted only after its doorbell was loaded with
 * acquire at system scope (the writer stored the doorbell last, with release)
 * and, for device memory written by a NIC without GPUDirect RDMA write
 * ordering, after the writer's flush (docs/GPU.md): the header's generation is
 * re-checked after the acquire.  State words are changed with a system-scope
 * CAS, which is correct because each state has one writer (edgepath_poll.h).
 */
#include <cuda/atomic>

#include "edgepath_slot.h"

typedef cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> sys_u64;
typedef cuda::atomic_ref<uint32_t, cuda::thread_scope_system> sys_u32;

static __device__ __forceinline__ sys_u64 sys(uint64_t *p)
{
    return sys_u64(*reinterpret_cast<unsigned long long *>(p));
}
static __device__ __forceinline__ uint64_t ep_ld_rlx(uint64_t *p) { return sys(p).load(cuda::memory_order_relaxed); }
static __device__ __forceinline__ uint32_t ep_ld_rlx32(uint32_t *p)
{
    return sys_u32(*p).load(cuda::memory_order_relaxed);
}
static __device__ __forceinline__ void ep_fence_acq(void)
{
    cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
}
static __device__ __forceinline__ void ep_st_rel(uint64_t *p, uint64_t v) { sys(p).store(v, cuda::memory_order_release); }
static __device__ __forceinline__ void ep_st_rlx(uint64_t *p, uint64_t v) { sys(p).store(v, cuda::memory_order_relaxed); }
static __device__ __forceinline__ uint64_t ep_add(uint64_t *p, uint64_t v)
{
    return sys(p).fetch_add(v, cuda::memory_order_relaxed);
}
static __device__ __forceinline__ void ep_max(uint64_t *p, uint64_t v)
{
    sys(p).fetch_max(v, cuda::memory_order_relaxed);
}
static __device__ __forceinline__ uint64_t ep_clock(void) { return (uint64_t)clock64(); }
/* The GPU's global nanosecond timer: one clock for every SM, which the host calibrates against its own
 * (bench/gpu_check.py's ping-pong), so a doorbell's detection can be put on the host's time line. */
static __device__ __forceinline__ uint64_t ep_timer_ns(void)
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* Thread 0 at start and stop: its SM's cycle counter and the global timer, so the host can tell the
 * clock the SM actually ran at (cycles / ns over the run). */
static __device__ __forceinline__ void ep_stamp_clocks(uint64_t *ctrl, int clock_word, int timer_word)
{
    ep_st_rlx(&ctrl[clock_word], ep_clock());
    ep_st_rlx(&ctrl[timer_word], ep_timer_ns());
}
static __device__ __forceinline__ int ep_cas(uint64_t *p, uint64_t expected, uint64_t desired)
{
    unsigned long long e = expected;
    return sys(p).compare_exchange_strong(e, desired, cuda::memory_order_acq_rel, cuda::memory_order_acquire);
}

#define EP_PFN static __device__ __forceinline__
#include "edgepath_poller.h"

/*
 * Persistent poller: launch with one block (threads stride over slots) on a
 * non-blocking stream; returns when the host sets ctrl[EP_CTRL_STOP].  Idle
 * passes back off with __nanosleep from min_sleep_ns doubling to max_sleep_ns
 * (min_sleep_ns = 0: spin without sleeping).
 */
extern "C" __global__ void ep_gpu_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring,
                                         uint32_t ring_capacity, uint64_t *ring_tail, uint64_t *ctrl,
                                         uint32_t min_sleep_ns, uint32_t max_sleep_ns)
{
    __shared__ ep_pool_header h;
    if (threadIdx.x == 0) {
        h = *reinterpret_cast<const ep_pool_header *>(pool);
        ep_stamp_clocks(ctrl, EP_CTRL_CLOCK_START, EP_CTRL_TIMER_START);
        ep_st_rel(&ctrl[EP_CTRL_RUNNING], 1u);
    }
    __syncthreads();
    const uint32_t mask = ring_capacity - 1u;
    uint32_t sleep_ns = min_sleep_ns;
    uint64_t passes = 0;
    for (;;) {
        /* The stop flag's load is issued with the pass's own loads (relaxed), not after them. */
        uint64_t stop_word = threadIdx.x == 0 ? ep_ld_rlx(&ctrl[EP_CTRL_STOP]) : 0u;
        int worked = 0;
        for (uint32_t slot = threadIdx.x; slot < h.slot_count; slot += blockDim.x)
            worked |= ep_poller_slot(pool, &h, slot, seen, expire_req, ring, mask, ring_tail, ctrl);
        int any = __syncthreads_or(worked);
        if (__syncthreads_or(stop_word != 0u))
            break;
        if (threadIdx.x == 0 && (++passes & 1023u) == 0) /* a liveness sign, no PCIe atomic per pass */
            ep_st_rlx(&ctrl[EP_CTRL_LOOPS], passes);
        if (any) {
            sleep_ns = min_sleep_ns;
        } else {
            if (sleep_ns)
                __nanosleep(sleep_ns);
            sleep_ns = sleep_ns * 2u > max_sleep_ns ? max_sleep_ns : (sleep_ns ? sleep_ns * 2u : 0u);
        }
    }
    if (threadIdx.x == 0) {
        ep_stamp_clocks(ctrl, EP_CTRL_CLOCK_STOP, EP_CTRL_TIMER_STOP);
        ep_st_rel(&ctrl[EP_CTRL_RUNNING], 2u);
    }
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

/* One system-scope release store of `value` into `word` (a device-memory pool's state word, or a
 * header/doorbell the check writes): launched on a side stream after the copies it must follow, so
 * the word is published after them and in one 8-byte store, never torn by a copy engine. */
extern "C" __global__ void ep_gpu_store(uint64_t *word, uint64_t value) { ep_st_rel(word, value); }

/* Smoke: every thread adds 1 to *counter `n` times at system scope: the total must be exact. */
extern "C" __global__ void ep_check_atomics(uint64_t *counter, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        ep_add(counter, 1u);
}

/* The check's probe kernels: the bodies are shared with the host twin (edgepath_poller_checks.h); one
 * thread runs each. */
static __device__ __forceinline__ void ep_idle(void) {}
#include "edgepath_poller_checks.h"

extern "C" __global__ void ep_check_cas(uint64_t *words, uint64_t *flag, uint64_t *go, uint32_t n)
{
    if (threadIdx.x == 0 && blockIdx.x == 0)
        ep_check_cas_body(words, flag, go, n);
}

extern "C" __global__ void ep_check_timer(uint64_t *out, uint64_t window_ns, uint64_t max_reads)
{
    if (threadIdx.x == 0 && blockIdx.x == 0)
        ep_check_timer_body(out, window_ns, max_reads);
}

extern "C" __global__ void ep_check_pingpong(uint64_t *ping, uint64_t *pong, uint64_t *stamp, uint64_t *stop)
{
    if (threadIdx.x == 0 && blockIdx.x == 0)
        ep_check_pingpong_body(ping, pong, stamp, stop);
}
