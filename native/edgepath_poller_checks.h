/*
 * The bodies of bench/gpu_check.py's probe kernels, shared verbatim by the CUDA file (edgepath_poller.cu,
 * which wraps each in a one-thread __global__) and the host twin (bench/gpu_host.c), so a dry run runs
 * the code the GPU runs.  Include after edgepath_poller.h, with its atomics and clocks defined, plus
 *   void ep_idle(void)    what a spinning loop does between polls (nothing on the GPU, sched_yield
 *                         in the twin, whose "kernel" shares two cores with the host loop)
 */
#ifndef EDGEPATH_POLLER_CHECKS_H
#define EDGEPATH_POLLER_CHECKS_H

/* Smoke: increment words[0] `n` times by CAS while a CPU thread increments words[1] (same cache line):
 * neither may lose an update.  The two loops overlap by construction: say 1 in *flag, wait (at most 5 s,
 * else say 3 and return) until the host, already adding, sets *go, run the CAS loop, say 2; the host adds
 * until it reads 2 (bench/gpu_host.c ep_chk_add_while_running).  flag and go are on lines of their own. */
EP_PFN void ep_check_cas_body(uint64_t *words, uint64_t *flag, uint64_t *go, uint32_t n)
{
    ep_st_rel(flag, 1u);
    uint64_t t0 = ep_timer_ns();
    while (!ep_ld_rlx(go)) {
        if (ep_timer_ns() - t0 > 5000000000ull) {
            ep_st_rel(flag, 3u);
            return;
        }
        ep_idle();
    }
    for (uint32_t i = 0; i < n;) {
        uint64_t cur = ep_ld_rlx(&words[0]);
        if (ep_cas(&words[0], cur, cur + 1u))
            i++;
    }
    ep_st_rel(flag, 2u);
}

/* The timer's resolution and the clock actually running: read ep_timer_ns() until `window_ns` passed (at
 * most `max_reads` reads) and ep_clock() around it.  out: smallest step of the timer seen, the number of
 * steps, ns elapsed, cycles elapsed, reads made. */
EP_PFN void ep_check_timer_body(uint64_t *out, uint64_t window_ns, uint64_t max_reads)
{
    uint64_t c0 = ep_clock(), g0 = ep_timer_ns(), last = g0, steps = 0, min_step = ~0ull, reads = 0;
    while (last - g0 < window_ns && reads < max_reads) {
        uint64_t g = ep_timer_ns();
        reads++;
        if (g != last) {
            steps++;
            if (g - last < min_step)
                min_step = g - last;
            last = g;
        }
    }
    uint64_t c1 = ep_clock();
    out[0] = min_step;
    out[1] = steps;
    out[2] = last - g0;
    out[3] = c1 - c0;
    out[4] = reads;
}

/* Baseline: the bare cost of noticing a host store and answering, with no slot logic.  Poll *ping and,
 * for each new value, store the timer at that moment into *stamp, then echo the value into *pong
 * (release: the stamp is visible first).  The host's clock read before its store and after the echo
 * bracket the stamp: that calibrates the timer against the host clock.  When the host sets *stop to 1,
 * answer 2 there and return (a bare kernel's stop latency).  ping, pong (+ stamp) and stop sit on
 * separate lines; nobody does a read-modify-write on any of them. */
EP_PFN void ep_check_pingpong_body(uint64_t *ping, uint64_t *pong, uint64_t *stamp, uint64_t *stop)
{
    uint64_t last = 0;
    ep_st_rel(pong, 0u);
    for (;;) {
        uint64_t v = ep_ld_rlx(ping);
        if (v != last) {
            uint64_t t = ep_timer_ns();
            last = v;
            ep_st_rlx(stamp, t);
            ep_st_rel(pong, v);
        } else if (ep_ld_rlx(stop)) {
            ep_st_rel(stop, 2u);
            return;
        } else {
            ep_idle();
        }
    }
}

#endif
