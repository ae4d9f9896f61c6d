"""What the llama handler's steps did: totals over its life (:class:`StepStats`), a debug line per step (``edgepath
-v``) and, every ``SUMMARY_S`` seconds of activity, one info line summing up the steps and the prefix cache since
the last one (logger ``edgepath.model.llama``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from edgepath.model.prefix import CacheStats, PrefixBook

log = logging.getLogger("edgepath.model.llama")

SUMMARY_S = 60.0  # seconds between the info lines that sum up the steps


@dataclass(slots=True)
class StepStats:
    """Totals over the handler's life (per-step figures go to the debug log)."""

    steps: int = 0
    decode_tokens: int = 0  # tokens decoded for slots already generating
    prompt_tokens: int = 0  # prompt tokens computed (cached ones are not)
    decode_ms: float = 0.0  # inside llama_decode
    sample_ms: float = 0.0  # sampling (numpy argmax or llama.cpp sampler chains)
    python_ms: float = 0.0  # the rest of step(): planning, batch building, bookkeeping
    largest_step: int = 0  # most tokens in one step
    compactions: int = 0  # decoding sequences moved to close a gap between runs of sequence ids (Sequences.compact)
    thread_changes: int = 0  # times the governor changed the thread count (model/threads.py)


class StepLog:
    """Keeps ``stats`` and writes the step lines; ``book``: the prefix cache whose figures the summary adds."""

    def __init__(self, book: PrefixBook) -> None:
        self.stats = StepStats()
        self.book = book
        self._reported: tuple[float, StepStats, CacheStats] | None = None  # (when, totals then) of the last summary
        self._step_ended = 0.0  # when the last step ended (perf_counter): the gap to the next

    def account(
        self,
        n: int,
        prompt: int,
        slots: int,
        started: float,
        decode_start: float,
        decoded: float,
        ended: float,
        ubatches: int,
        threads: int,
    ) -> None:
        """A step of ``n`` tokens (``prompt`` of them prompt tokens) over ``slots`` slots, timed from ``started``
        (``perf_counter``) to ``ended``, its ``llama_decode`` from ``decode_start`` to ``decoded``, in ``ubatches``
        micro-batches on ``threads`` threads.  The line also says how long the loop spent between the last step and
        this one: what a step profile needs (bench/step_profile.py)."""
        between_ms = (started - self._step_ended) * 1e3 if self._step_ended else 0.0
        self._step_ended = ended
        s = self.stats
        decode_ms = (decoded - decode_start) * 1e3
        sample_ms = (ended - decoded) * 1e3
        python_ms = (ended - started) * 1e3 - decode_ms - sample_ms
        s.steps += 1
        s.decode_tokens += n - prompt
        s.prompt_tokens += prompt
        s.decode_ms += decode_ms
        s.sample_ms += sample_ms
        s.python_ms += python_ms
        s.largest_step = max(s.largest_step, n)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d: %d tokens (%d decode, %d prompt) over %d slots: llama_decode %.1f ms, sampling %.2f ms, "
                "python %.2f ms; %d micro-batches, %d threads, %.2f ms since the last step",
                s.steps,
                n,
                n - prompt,
                prompt,
                slots,
                decode_ms,
                sample_ms,
                python_ms,
                ubatches,
                threads,
                between_ms,
            )

    def summary(self, now: float) -> None:
        """Every ``SUMMARY_S`` seconds of activity, one info line with what the steps and the prefix cache did
        since the last one (per-step lines are debug: ``edgepath -v``)."""
        if self._reported is None:
            self._reported = (now, replace(self.stats), replace(self.book.stats))
            return
        then, steps, cache = self._reported
        if now - then < SUMMARY_S:
            return
        s, c = self.stats, self.book.stats
        log.info(
            "llama, last %.0f s: %d steps, %d decode + %d prompt tokens (largest step %d, %d sequences moved to close "
            "gaps); llama_decode %.1f s, sampling %.2f s, python %.2f s; prefix cache: %d hits (%d tokens), %d misses, "
            "%d evicted, %.0f MB held",
            now - then,
            s.steps - steps.steps,
            s.decode_tokens - steps.decode_tokens,
            s.prompt_tokens - steps.prompt_tokens,
            s.largest_step,
            s.compactions - steps.compactions,
            (s.decode_ms - steps.decode_ms) / 1e3,
            (s.sample_ms - steps.sample_ms) / 1e3,
            (s.python_ms - steps.python_ms) / 1e3,
            c.hits - cache.hits,
            c.cached_tokens - cache.cached_tokens,
            c.misses - cache.misses,
            c.evicted - cache.evicted,
            self.book.saved_bytes / 2**20,
        )
        self._reported = (now, replace(s), replace(c))
