"""The llama handler's warm-up: throw-away steps before the first request, the first to page the weights in, then
the ones that measure the step cost model (:class:`~edgepath.model.cost.CostModel`) on this machine -- twice, each
step's fastest time fitted.  The agents' admission predicts from that model before any request has run; start
values from another machine mispredicted the first prompts by tens of percent (docs/ADMISSION.md)."""

from __future__ import annotations

import logging
import time

import numpy as np

from edgepath.contract.plan import Costs, Step, chunk_attended
from edgepath.model.cost import CostModel
from edgepath.model.llama_context import LlamaContext
from edgepath.model.prefix import runs

log = logging.getLogger("edgepath.model.llama")

#: start values of the step-cost model on one thread (docs/MODEL.md, measured on this project's 2-core machine) until
#: the warm-up steps measure it here (a context too small for them keeps these); it then follows the steps as they run
START_COSTS_ONE_THREAD = Costs(overhead_ms=12.0, prompt_ms=2.0, decode_ms=4.0, context_ms=1.2, decode_context_ms=9.0)
#: positions of the warm-up steps that measure the step cost model on this machine: a short and a long prompt from
#: position 0, the long one continued to a deep context, the long one again after it (what attending a longer
#: context adds), streams decoding after it
CALIBRATION_TOKENS = (16, 128, 512)
#: sequences decoding together in the warm-up's decode steps (at most the slots)
CALIBRATION_STREAMS = 8
#: times the warm-up's measuring steps run; each step's fastest time is the one fitted
CALIBRATION_PASSES = 2


def warm_up(context: LlamaContext, cost: CostModel, slots: int, batch: int, ctx_per_slot: int) -> None:
    """Throw-away steps on ``context`` before the first request.  The first, as llama-server does at start: the
    weights are paged in and llama.cpp's compute buffers allocated now, not inside the first request's time to
    first token.  Then the steps that measure ``cost`` on this machine (:meth:`CostModel.calibrate`): decode steps
    of one and of several streams at the start of their sequences (a decoded token also computes its logits),
    prompts of two sizes from position 0 and the long one again after itself (what a longer context adds to a prompt
    token), then the same several streams decoding after that context (copied into each: what it adds to a decoded
    token, several times a prompt token's) -- in one run of sequence ids and in every other one (a micro-batch
    each: what a step costs beyond its tokens); all of it twice, each step's fastest time fitted.  The KV cache is
    emptied afterwards."""
    lib = context.lib
    bos, eos = int(lib.llama_vocab_bos(context.vocab)), int(lib.llama_vocab_eos(context.vocab))
    started = time.perf_counter()
    first = [t for t in (bos, eos) if t >= 0] or [0]
    context.timed_step([(0, 0, len(first), False)], np.array(first, dtype=np.int32))
    context.clear()
    log.info("llama: warm-up step %.0f ms", 1e3 * (time.perf_counter() - started))
    short, long, deep = (min(n, batch, ctx_per_slot // 4 - 2) for n in CALIBRATION_TOKENS)
    streams = min(CALIBRATION_STREAMS, slots, batch)
    if short < 2 or long <= short:
        return  # a context too small to measure in: the start values stay
    ids = np.arange(deep + long + 8, dtype=np.int32) * 7919 % context.n_vocab  # which ids does not change the cost
    # each step's fastest of the passes: a neighbour (or the process that just left the CPUs) only makes a
    # step slower, and one step slowed so during the warm-up skewed the whole fit (docs/ADMISSION.md)
    passes = [_measure(context, ids, streams, short, long, deep) for _ in range(CALIBRATION_PASSES)]
    steps = passes[0][0]  # a pass that took other steps (a state copy failed in one) is left out
    times = [min(ms) for ms in zip(*(t for s, t in passes if s == steps), strict=True)]
    if not cost.calibrate(steps, times):
        log.warning("llama: the warm-up steps made no cost model (%s ms); the start values stay", times)
        return
    c = cost.base
    log.info(
        "llama: step cost model from %d warm-up steps (each the fastest of %d): %.2f ms per micro-batch + %.3f ms "
        "per prompt token + "
        "%.3f ms per decoded token + %.3f ms per 1,000 positions a prompt token attends + %.3f ms per 1,000 "
        "positions a decoded token attends",
        len(steps), CALIBRATION_PASSES, c.overhead_ms, c.prompt_ms, c.decode_ms, c.context_ms, c.decode_context_ms,
    )  # fmt: skip


def _measure(
    context: LlamaContext, ids: np.ndarray, streams: int, short: int, long: int, deep: int
) -> tuple[list[Step], list[float]]:
    """One pass of the measuring steps: their shapes and milliseconds, the KV cache emptied afterwards."""
    steps: list[Step] = []
    times: list[float] = []
    held = [0] * streams  # positions each calibration stream holds

    def decode(which: list[int]) -> None:
        times.append(context.timed_step([(seq, held[seq], 1, True) for seq in which], ids))
        steps.append(Step(0, len(which), 0, len(which) * (max(held[seq] for seq in which) + 1), runs(which)))
        for seq in which:
            held[seq] += 1

    for _ in range(2):  # one stream decoding, then all of them; twice
        decode([0])
        decode(list(range(streams)))
    context.clear()
    # a short prompt (cleared), a long one, continued to the deep context, the long one again after it
    for first_position, length in ((0, short), (0, long), (long, deep - long), (deep, long)):
        if length < 1:
            continue
        times.append(context.timed_step([(0, first_position, length, False)], ids))
        steps.append(Step(length, 0, chunk_attended(first_position, length)))
        if length == short:
            context.clear()
    blob = context.state_of(0)
    if blob is not None:
        copied = all(context.set_state(blob, s) for s in range(1, streams))
        context.blobs.give(blob)
        held = [deep + long] * streams
        for _ in range(2 if copied else 0):  # after the context: all streams (one run), every other one
            decode(list(range(streams)))
            decode(list(range(0, streams, 2)))
    context.clear()
    return steps, times
