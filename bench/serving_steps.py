"""The llama handler's steps under a serving-like load, each measured against what the step cost model predicted:
how good the cost model the agents' admission replays is, and what the gaps between runs of sequence ids cost.

Drives :class:`~edgepath.model.llama.LlamaHandler` directly (no data path, no clock between steps): before every
step, with probability ``--rate``, a request arrives on a free slot -- a prompt of random ids, 20-200 or 200-900
tokens (half each), 16-160 tokens to generate, prefix cache off so every prompt is computed.  The arrivals depend
on ``--seed`` and the step count only, so two runs (``--no-compact`` against the default) see the same work.
For every step: the time inside ``llama_decode``, the prediction of the calibrated costs and of the costs the
handler planned it with (the calibration followed online, what the load region carries), and the micro-batches
llama.cpp computed it in.

    python -m edgepath.bench.serving_steps [--steps 1500] [--rate 0.15] [--seed 4] [--slots 8] [--threads N]
        [--outputs 16-160] [--no-compact] [--json FILE]

Per request, too: its time to first token (the measured steps from its arrival to its first token) against what
the published load predicted when it arrived (the policy run forward, as admission runs it, but from the next step:
no step is under way here) and against the same with each decoding stream's end known (its ``max_tokens``).  So the
model side's part of admission's prediction error is told apart from the data path's and the agents'.

Prints, per kind of step (decode only, prompt only, both), the median of measured ÷ predicted and the share
within 0.75-1.33x, per request the p10/p50/p90 of measured ÷ predicted and the share in that band, and the
totals: steps in more than one micro-batch, decoded tokens, time in ``llama_decode`` and in moving sequences to
close gaps.  Timings depend on the machine and on what else runs on it: say where they
were taken.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from edgepath.contract.plan import Prompt, Step, StepPolicy, _run
from edgepath.contract.wire import Sampling
from edgepath.model.llama import LlamaHandler
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.sequences import COMPACT_MIN_LEFT
from edgepath.slots.handlers import SlotRequest

IN_CAP, OUT_CAP = 1024, 256
BAND = (0.75, 1.33)


@dataclass(frozen=True, slots=True)
class Measured:
    """One step: its shape, what it took and what the two cost models said it would."""

    prompt: int
    decode: int
    ubatches: int
    ms: float
    calibrated_ms: float
    online_ms: float


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: its time to first token (the steps from its arrival to its first token, as measured) against
    what the published load predicted when it arrived (the policy run forward, the streams ahead decoding on) and
    what it would have predicted knowing when each stream ahead ends (its ``max_tokens``: no stop sequence here)."""

    prompt: int
    ahead: int  # requests running when it arrived
    ms: float
    predicted_ms: float
    known_ends_ms: float


def drive(
    options: dict[str, str], slots: int, steps: int, rate: float, seed: int, generate: tuple[int, int] = (16, 160)
) -> tuple[list[Measured], list[Arrival], dict]:
    """Run the handler for ``steps`` steps under the seeded arrivals; every step and every request measured."""
    handler = LlamaHandler(slots, LlamaOptions.parse(options, IN_CAP + OUT_CAP))
    draw = random.Random(seed)
    inputs = np.zeros((slots, IN_CAP), dtype=np.int32)
    outputs = np.zeros((slots, OUT_CAP), dtype=np.int32)
    measured: list[Measured] = []
    observe = handler.cost.observe

    def recording(step: Step, ms: float, now: float) -> None:
        costs = handler.cost
        measured.append(
            Measured(step.prompt, step.decode, step.ubatches, ms, costs.base.step_ms(step), costs.costs().step_ms(step))
        )
        observe(step, ms, now)

    handler.cost.observe = recording  # type: ignore[method-assign]
    free = list(range(slots))
    pending: dict[int, tuple[int, int, int, float, float]] = {}  # slot: prompt, ahead, first step, predictions
    left: dict[int, int] = {}  # a decoding slot: tokens it may still decode (its max_tokens less what it has)
    limit: dict[int, int] = {}  # slot: its request's max_tokens
    arrivals: list[Arrival] = []
    compact_s = 0.0
    compact = handler.sequences.compact

    def timed_compact() -> bool:
        nonlocal compact_s
        started = time.perf_counter()
        moved = compact()
        compact_s += time.perf_counter() - started
        return moved

    handler.sequences.compact = timed_compact  # type: ignore[method-assign]
    try:
        for i in range(steps):
            if free and draw.random() < rate:
                slot = free.pop(draw.randrange(len(free)))
                n = draw.choice([draw.randint(20, 200), draw.randint(200, 900)])
                inputs[slot, :n] = np.random.default_rng([seed, i]).integers(100, handler.n_vocab - 1, n)
                max_new = draw.randint(*generate)
                request = SlotRequest(slot, i, max_new, 0, inputs[slot, :n], outputs[slot, :max_new], Sampling())
                load = handler.load()
                policy = StepPolicy(load.options)  # type: ignore[arg-type]
                args = (load.costs, policy, load.decoding, load.longest, load.runs, [*load.waiting, Prompt(0, n)])
                predicted = _run(*args, 0.0)
                known = _run(*args, 0.0, sorted(left.values()))
                pending[slot] = (n, slots - len(free) - 1, len(measured), predicted, known)
                limit[slot] = max_new
                free += [e.slot for e in handler.add(request, 0.0) if e.status is not None]
            for emit in handler.step(0.0):
                if emit.slot in pending and emit.count > 0:
                    n, ahead, first, predicted, known = pending.pop(emit.slot)
                    ms = sum(m.ms for m in measured[first:])
                    arrivals.append(Arrival(n, ahead, ms, predicted, known))
                if emit.slot not in pending:
                    left[emit.slot] = limit[emit.slot] - emit.count
                if emit.status is not None:
                    left.pop(emit.slot, None)
                if emit.status is not None and emit.release and emit.slot not in free:
                    free.append(emit.slot)
        stats = handler.stats
        totals = {
            "decoded": stats.decode_tokens,
            "llama_decode_s": stats.decode_ms / 1e3,
            "moves": stats.compactions,
            "moves_s": compact_s,
            "calibration": asdict(handler.cost.base),
        }
    finally:
        handler.close()
    return measured, arrivals, totals


def report(measured: list[Measured], totals: dict) -> str:
    lines = [
        "| steps | n | calibrated: median measured ÷ predicted, in band | online: median, in band |",
        "|---|---|---|---|",
    ]
    kinds = {
        "all": lambda m: True,
        "decode only": lambda m: m.prompt == 0,
        "prompt only": lambda m: m.decode == 0,
        "prompt and decode": lambda m: m.prompt > 0 and m.decode > 0,
    }
    for name, keep in kinds.items():
        rows = [m for m in measured if keep(m)]
        if not rows:
            continue
        cells = []
        for predicted in ("calibrated_ms", "online_ms"):
            ratios = [m.ms / getattr(m, predicted) for m in rows]
            within = sum(BAND[0] <= r <= BAND[1] for r in ratios) / len(ratios)
            cells.append(f"{statistics.median(ratios):.2f}, {100 * within:.1f} %")
        lines.append(f"| {name} | {len(rows)} | {cells[0]} | {cells[1]} |")
    several = sum(m.ubatches > 1 for m in measured if m.prompt == 0)
    decode_only = sum(m.prompt == 0 for m in measured)
    lines.append("")
    lines.append(
        f"decode-only steps in more than one micro-batch: {several} of {decode_only}; {totals['decoded']} tokens "
        f"decoded, {totals['llama_decode_s']:.1f} s in llama_decode; {totals['moves']} sequences moved to close "
        f"gaps ({totals['moves_s']:.2f} s)"
    )
    return "\n".join(lines)


def report_arrivals(arrivals: list[Arrival]) -> str:
    """Per request: measured time to first token over the prediction, with streams decoding on and with their
    ends known, for the requests that waited behind others and for all."""
    lines = [
        "| requests | n | decoding on: p10 / p50 / p90 of measured ÷ predicted, in band | ends known: same |",
        "|---|---|---|---|",
    ]
    for name, rows in (("all", arrivals), ("behind others", [a for a in arrivals if a.ahead])):
        if not rows:
            continue
        cells = []
        for predicted in ("predicted_ms", "known_ends_ms"):
            ratios = sorted(a.ms / getattr(a, predicted) for a in rows)
            within = sum(BAND[0] <= r <= BAND[1] for r in ratios) / len(ratios)
            p10, p50, p90 = (ratios[min(len(ratios) - 1, int(q * len(ratios)))] for q in (0.1, 0.5, 0.9))
            cells.append(f"{p10:.2f} / {p50:.2f} / {p90:.2f}, {100 * within:.1f} %")
        lines.append(f"| {name} | {len(rows)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500, help="steps to run (default 1500)")
    parser.add_argument("--rate", type=float, default=0.15, help="chance of an arrival before each step (0.15)")
    parser.add_argument("--seed", type=int, default=4, help="the arrivals' seed (default 4)")
    parser.add_argument("--slots", type=int, default=8, help="the handler's slots (default 8)")
    parser.add_argument(
        "--outputs", default="16-160", help="tokens each request generates, drawn from LOW-HIGH (default 16-160)"
    )
    parser.add_argument("--threads", default=None, help="llama.cpp threads (default: the handler's, every CPU)")
    parser.add_argument(
        "--no-compact",
        action="store_true",
        help=f"the handler's compact=off: no sequence moved to close a gap (else one with {COMPACT_MIN_LEFT}+ "
        "tokens left)",
    )
    parser.add_argument("--json", default=None, help="also write every step here")
    args = parser.parse_args(argv)
    low, _, high = args.outputs.partition("-")
    outputs = (int(low), int(high)) if low.isdigit() and high.isdigit() else (0, 0)
    if args.steps < 1 or not 0 < args.rate <= 1 or args.slots < 2 or not 1 <= outputs[0] <= outputs[1] <= OUT_CAP:
        parser.error(
            f"need --steps >= 1, 0 < --rate <= 1, --slots >= 2, --outputs LOW-HIGH within 1-{OUT_CAP}; got "
            f"{args.steps}, {args.rate}, {args.slots}, {args.outputs!r}"
        )
    options = {"prefix_cache": "off"}
    if args.threads:
        options["threads"] = args.threads
    if args.no_compact:
        options["compact"] = "off"
    measured, arrivals, totals = drive(options, args.slots, args.steps, args.rate, args.seed, outputs)
    print(report(measured, totals))
    print(report_arrivals(arrivals))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"totals": totals, "steps": [asdict(m) for m in measured], "requests": [asdict(a) for a in arrivals]},
                out,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
