"""How many of llama.cpp's threads a model step runs on, while other processes take CPUs.

llama.cpp's threads meet at a barrier after every operation of a step, and (built with OpenMP, as its users build
it) a thread at a barrier spins before it sleeps.  When another process takes one of the CPUs the model's threads
were counting on -- a load tool in a session of its own, spinning on refusals -- one thread waits in the run
queue while the other spins for it, and a step goes 10-100x slower instead of 2x (docs/MODEL.md, "Sharing the
CPUs": on the 2-core VM a 256-token prompt at 35 ms a token instead of 1.5, a decoded token at 1.8 s instead of
11 ms; on one thread 3.4 ms and 17 ms).  The kernel says when that happens: the time the model's threads spent
runnable but not running (``/proc/self/task/*/schedstat``).  :class:`ThreadGovernor` (no I/O) runs the next steps
on fewer threads while that share is large, and on all of them again once the CPUs it gave up have been idle for
a while; :func:`read_sample` is its adapter, and :func:`next_threads` what the step loop asks it after a step.
Logits do not depend on the thread count (each row of a product is one thread's), so a step's answer is the same
on any of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

#: a step shorter than this says too little about waiting to act on (a decoded token takes 10+ ms)
MIN_STEP_S = 0.002
_USER_HZ = os.sysconf("SC_CLK_TCK")

log = logging.getLogger("edgepath.model.llama")


@dataclass(frozen=True, slots=True)
class CpuSample:
    """What the kernel says at one instant: ``waited_s``, the run-queue time of this process's threads so far;
    ``idle_s``, the idle CPU time of the whole machine so far (every CPU's, in seconds); ``at``, monotonic time."""

    waited_s: float
    idle_s: float
    at: float


def read_sample(at: float, proc: str = "/proc") -> CpuSample | None:
    """This process's threads' run-queue time and the machine's idle time at ``at``; None where the kernel does
    not keep them (no schedstat: the governor then leaves the thread count alone)."""
    tasks = f"{proc}/self/task"
    waited = 0
    try:
        for task in os.listdir(tasks):
            try:
                with open(f"{tasks}/{task}/schedstat", "rb") as stat:
                    waited += int(stat.read().split()[1])
            except FileNotFoundError:  # a thread that ended between the listing and the read
                continue
        with open(f"{proc}/stat", "rb") as stat:
            fields = stat.readline().split()
    except (OSError, IndexError, ValueError):
        return None
    idle = int(fields[4]) + int(fields[5])  # idle + iowait, in USER_HZ ticks, summed over CPUs
    return CpuSample(waited / 1e9, idle / _USER_HZ, at)


class ThreadGovernor:
    """The thread count for the next step, from what the last ones waited and how fast they went.

    Each step's speed is its time over what the warm-up's calibration (on all ``full`` threads) says it takes;
    ``ratios[t]`` follows that ratio on ``t`` threads (starting at ``full / t``, and there again when the count
    comes back to ``t``).  After a step on ``t`` threads whose threads waited for a CPU more than ``wait_share`` of
    ``t`` times its length, while steps on ``t`` go slower than steps on fewer threads went, the next runs on ``t``
    less the CPUs they waited for (at least 1): a neighbour that only slows the model (the edge answering a flood
    beside it) keeps all threads, one that makes their barriers spin (another session taking a CPU: 10x and more)
    does not, from its first step.  The ratios, not one step's, are compared: the slowest of many steps is slower
    than the average of fewer threads' steps whatever the count.  Below ``full``, once the machine has had
    ``idle_share`` of a CPU idle or more, on average, over ``hold`` seconds, the next runs on that many more (up to
    ``full``).  A raise that is taken back within ``hold`` doubles ``hold`` (up to ``hold_max``), so a machine whose
    idle CPU vanishes whenever the model asks for it is not probed every second; one that lasts ``hold_max`` resets
    it."""

    #: how much of each step's ratio goes into ``ratios`` (the rest is what came before)
    WEIGHT = 0.3

    def __init__(
        self,
        full: int,
        wait_share: float = 0.25,
        idle_share: float = 0.5,
        hold: float = 1.0,
        hold_max: float = 30.0,
    ) -> None:
        self.full = full
        self.threads = full
        self.wait_share = wait_share
        self.idle_share = idle_share
        self.base_hold = self.hold = hold
        self.hold_max = hold_max
        self.ratios = {t: full / t for t in range(1, full + 1)}
        self.last_wait = 0.0  # the last step's waited share (for the log)
        self.last_ratio = 0.0  # the last step's time over the calibration's (for the log)
        self.last_idle = 0.0  # the idle CPUs behind the last raise, on average over last_window s (for the log)
        self.last_window = 0.0
        self._mark: CpuSample | None = None  # where the window for a raise starts
        self._raised_at: float | None = None

    def after_step(self, before: CpuSample, after: CpuSample, calibrated_s: float) -> int:
        """The thread count for the next step, given samples taken around the step just computed and the time
        the calibration gives a step of its shape on all threads."""
        if self._mark is None:
            self._mark = before
        length = after.at - before.at
        if length < MIN_STEP_S or calibrated_s <= 0:
            return self.threads
        t = self.threads
        self.last_wait = (after.waited_s - before.waited_s) / (length * t)
        self.last_ratio = length / calibrated_s
        fewer = self.ratios.get(t - 1, 0.0)  # how fast steps on fewer threads went
        self.ratios[t] += self.WEIGHT * (self.last_ratio - self.ratios[t])
        if t > 1 and self.last_wait > self.wait_share and self.ratios[t] > fewer:
            if self._raised_at is not None and after.at - self._raised_at < self.hold:
                self.hold = min(2 * self.hold, self.hold_max)
            self._raised_at = None
            self.threads = max(1, t - max(1, round(self.last_wait * t)))
            self._mark = after
            return self.threads
        if self._raised_at is not None and after.at - self._raised_at >= self.hold_max:
            self.hold, self._raised_at = self.base_hold, None
        if t < self.full and after.at - self._mark.at >= self.hold:
            self.last_window = after.at - self._mark.at
            self.last_idle = (after.idle_s - self._mark.idle_s) / self.last_window
            if self.last_idle >= self.idle_share:
                self.threads = min(self.full, t + max(1, round(self.last_idle)))
                self.ratios[self.threads] = self.full / self.threads  # what went on there is over
                self._raised_at = after.at
            self._mark = after
        return self.threads


def next_threads(governor: ThreadGovernor, before: CpuSample, decoded: float, calibrated_s: float) -> int | None:
    """The thread count the next steps run on when the governor changes it after the step sampled ``before`` and
    decoded at ``decoded`` (``perf_counter``), whose shape the calibration gives ``calibrated_s`` on all threads;
    None when it stays.  A change is logged: why the model runs on fewer of its threads, or on more again."""
    after = read_sample(decoded)
    if after is None:
        return None
    threads = governor.threads
    chosen = governor.after_step(before, after, calibrated_s)
    if chosen == threads:
        return None
    if chosen < threads:
        log.warning(
            "llama: the model's %d threads waited for a CPU %.0f%% of a %.0f ms step, %.1fx the calibration's "
            "time (another process takes CPUs): the next steps run on %d of %d",
            threads,
            100 * governor.last_wait,
            1e3 * (after.at - before.at),
            governor.last_ratio,
            chosen,
            governor.full,
        )
    else:
        log.warning(
            "llama: %.1f CPUs idle on average for %.1f s: the next steps run on %d of %d threads",
            governor.last_idle,
            governor.last_window,
            chosen,
            governor.full,
        )
    return chosen
