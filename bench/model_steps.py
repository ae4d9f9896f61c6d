"""What one llama_decode step costs on this machine, by tokens per step: the table that chose the step policy's
defaults (docs/MODEL.md).

Contexts are built exactly as the llama handler builds them (:func:`edgepath.model.llama_context.context_params`: one
KV stream per sequence, flash attention as configured); one context per thread count, all in this process,
measured interleaved (A, B, A, B, ...) so that a neighbour's load hits every configuration alike.  Three
shapes of step:

* ``prefill N``: one sequence's first N prompt tokens in one step (the KV cache starts empty);
* ``decode S``: S sequences, each with ``--context`` tokens already cached, one new token each;
* ``mixed P``: ``--slots - 1`` sequences decoding one token each plus P prompt tokens of the last one
  (what a step costs the decoding streams while a new prompt is prefilled).

    python -m edgepath.bench.model_steps [--threads 1,2] [--repeat 3] [--context 256] [--slots 8]
        [--option KEY=VALUE ...] [--variant KEY=VALUE ...]

``--variant flash_attn=on`` adds, per thread count, a context with that handler option changed (measured
interleaved with the others).  Prints a table (the fastest and the median of ``--repeat`` steps, ms; tokens/s
of the fastest) and the least-squares step-cost line ``overhead + per_token * tokens`` per configuration, fitted
to the fastest times: on a shared machine other processes only ever add time, so the fastest of several is the
best estimate of what a step costs.  Timings depend on the machine and on what else runs on it: say where they
were taken.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepath.model.gguf import llama_cpp, load_model
from edgepath.model.llama_context import context_params
from edgepath.model.llama_options import LlamaOptions
from edgepath.slots.handlers import HandlerError

PREFILL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE = (1, 2, 4, 8)
MIXED = (0, 16, 64, 256)


class StepContext:
    """One llama.cpp context and a batch to drive it with; every sequence is filled with fixed token ids."""

    def __init__(self, lib: Any, model: Any, options: LlamaOptions, sequences: int, batch: int) -> None:
        self.lib = lib
        self.ctx = lib.llama_init_from_model(model, context_params(lib, sequences, options, batch))
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {sequences} x {options.ctx_per_slot}")
        self.mem = lib.llama_get_memory(self.ctx)
        n = batch
        self.tokens = np.random.default_rng(0).integers(200, 20000, n).astype(np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        self.seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n)(
            *(ctypes.cast(self.seq.ctypes.data + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n))
        )
        b = self.batch = lib.llama_batch()
        b.embd = None
        b.token = self.tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = self.seq_ptrs
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def decode(self, parts: list[tuple[int, int, int]]) -> float:
        """One step over ``(sequence, first position, tokens)`` parts, logits for each part's last token;
        milliseconds inside llama_decode."""
        n = 0
        self.logits[:] = 0
        for seq, first, length in parts:
            self.seq[n : n + length] = seq
            self.pos[n : n + length] = np.arange(first, first + length)
            n += length
            self.logits[n - 1] = 1
        self.batch.n_tokens = n
        start = time.perf_counter()
        rc = self.lib.llama_decode(self.ctx, self.batch)
        ms = (time.perf_counter() - start) * 1e3
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) on {n} tokens")
        return ms

    def keep(self, seq: int, positions: int) -> None:
        """Sequence ``seq`` holds exactly positions 0..positions-1 afterwards (0: nothing)."""
        self.lib.llama_memory_seq_rm(self.mem, seq, positions, -1)

    def fill(self, seq: int, positions: int, chunk: int) -> None:
        self.keep(seq, 0)
        for first in range(0, positions, chunk):
            self.decode([(seq, first, min(chunk, positions - first))])

    def close(self) -> None:
        self.lib.llama_free(self.ctx)


@dataclass
class Row:
    shape: str  # prefill / decode / mixed
    size: int  # tokens (prefill), sequences (decode), prompt tokens (mixed)
    tokens: int  # tokens in the step
    ms: dict[str, list[float]] = field(default_factory=dict)  # configuration -> step times


def measure(contexts: dict[str, StepContext], slots: int, context: int, repeat: int, ubatch: int) -> list[Row]:
    rows: list[Row] = []

    def run(row: Row, setup: Callable[[StepContext], None], step: Callable[[StepContext], float]) -> None:
        for _ in range(repeat):
            for label, sc in contexts.items():  # interleaved: A, B, A, B
                setup(sc)
                row.ms.setdefault(label, []).append(step(sc))
        rows.append(row)

    def empty(sc: StepContext) -> None:
        sc.keep(0, 0)

    for n in PREFILL:

        def prefill(sc: StepContext, n: int = n) -> float:
            return sc.decode([(0, 0, n)])

        run(Row("prefill", n, n), empty, prefill)
    for sc in contexts.values():
        for seq in range(slots):
            sc.fill(seq, context, ubatch)
    for s in DECODE:

        def trim(sc: StepContext, s: int = s) -> None:
            for seq in range(s):
                sc.keep(seq, context)

        def decode(sc: StepContext, s: int = s) -> float:
            return sc.decode([(q, context, 1) for q in range(s)])

        run(Row("decode", s, s), trim, decode)
    last = slots - 1
    for p in MIXED:

        def reset(sc: StepContext) -> None:
            for seq in range(last):
                sc.keep(seq, context)
            sc.keep(last, 0)

        def mixed(sc: StepContext, p: int = p) -> float:
            parts = [(q, context, 1) for q in range(last)]
            return sc.decode([*parts, (last, 0, p)] if p else parts)

        run(Row("mixed", p, last + p), reset, mixed)
    return rows


# Counting: the model goes on counting rather than ending its answer, so every sequence decodes to the end (as
# in llama-batched-bench, which never stops a sequence early).
TEXT = ", ".join(str(i) for i in range(1, 2000))


@dataclass
class DecodeRun:
    """Timed decode phases through the handler for one sequence count."""

    rates: list[float] = field(default_factory=list)  # generated tokens/s, per round
    widths: list[float] = field(default_factory=list)  # sequences generating per step, per round
    wall_ms: float = 0.0  # the timed phases' wall time, in total, and its split (the handler's own accounting):
    decode_ms: float = 0.0  # inside llama_decode
    sample_ms: float = 0.0
    python_ms: float = 0.0

    def line(self, n: int) -> str:
        return (
            f"{n} sequence(s) {statistics.median(self.rates):.1f} tok/s ({statistics.mean(self.widths):.1f} per step; "
            f"of {self.wall_ms / 1e3:.2f} s: llama_decode {self.decode_ms / 1e3:.2f} s, sampling "
            f"{self.sample_ms / 1e3:.3f} s, python {self.python_ms / 1e3:.3f} s)"
        )


def handler_decode(options: dict[str, str], slots: int, context: int, tokens: int, rounds: int) -> dict[int, DecodeRun]:
    """Decode tokens/s through :class:`~edgepath.model.llama.LlamaHandler` itself (planning, batch building,
    sampling, bookkeeping: what the slot server runs), for 1 and ``slots`` sequences of ``context`` prompt
    tokens each (prefill untimed) -- the figure to set beside llama-batched-bench's S_TG with
    ``-npp context -ntg tokens -npl 1,slots``."""
    from edgepath.contract.wire import Sampling
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.llama import LlamaHandler
    from edgepath.slots.handlers import HandlerConfig, SlotRequest

    # Every prompt in one step, as llama-batched-bench does: the sequences then decode in lockstep and end together.
    lockstep = {"stall_ms": "1e9", "batch": str(slots * context + slots)}
    config = {**options, **lockstep, "ctx_per_slot": str(context + tokens + 16), "prefix_cache": "off"}
    handler = LlamaHandler.from_config(HandlerConfig(slots, context, tokens, config))
    tok = GGUFTokenizer(handler.options.model)
    words = tok.encode(TEXT)
    inputs = np.zeros((slots, context), dtype=np.int32)
    outputs = np.zeros((slots, tokens), dtype=np.int32)
    runs = {1: DecodeRun(), slots: DecodeRun()}
    stats = handler.stats
    try:
        for _ in range(rounds):
            for n, run in runs.items():  # interleaved
                for slot in range(n):
                    inputs[slot] = words[slot : slot + context]  # a different prompt per sequence
                    request = SlotRequest(slot, slot, tokens, 0, inputs[slot], outputs[slot], Sampling())
                    handler.add(request, 0.0)
                started: set[int] = set()
                while len(started) < n and handler.wake_in(0.0) is not None:
                    started.update(e.slot for e in handler.step(0.0))  # prefill (untimed): every first token
                before = (stats.decode_tokens, stats.steps, stats.decode_ms, stats.sample_ms, stats.python_ms)
                start = time.perf_counter()
                for _ in range(10 * tokens):
                    if handler.wake_in(0.0) is None:
                        break
                    handler.step(0.0)
                elapsed = time.perf_counter() - start
                decoded = stats.decode_tokens - before[0]
                run.rates.append(decoded / elapsed)
                run.widths.append(decoded / max(1, stats.steps - before[1]))
                run.wall_ms += elapsed * 1e3
                run.decode_ms += stats.decode_ms - before[2]
                run.sample_ms += stats.sample_ms - before[3]
                run.python_ms += stats.python_ms - before[4]
    finally:
        handler.close()
        tok.close()
    return runs


@dataclass
class ArrivalRun:
    """A prompt arriving at an idle handler and while the other slots generate."""

    idle_ms: list[float] = field(default_factory=list)  # its time to first token, nothing else running
    loaded_ms: list[float] = field(default_factory=list)  # ... while slots - 1 sequences generate
    gaps_ms: list[float] = field(default_factory=list)  # the generating sequences' steps until then

    def line(self) -> str:
        gaps = sorted(self.gaps_ms)
        idle, loaded = statistics.median(self.idle_ms), statistics.median(self.loaded_ms)
        return (
            f"time to first token idle {idle:,.0f} ms, loaded {loaded:,.0f} ms ({loaded / idle:.2f}x); the "
            f"generating streams' gaps meanwhile: median {statistics.median(gaps):,.0f} ms, longest {gaps[-1]:,.0f} "
            f"ms (median of {len(self.idle_ms)})"
        )


def arrival(options: dict[str, str], slots: int, context: int, prompt: int, rounds: int) -> ArrivalRun:
    """Time to first token of a ``prompt``-token request on an idle handler, and while ``slots - 1`` sequences of
    ``context`` prompt tokens generate (the policy's objective 5: near the idle one), with the generating
    sequences' inter-token gaps (one step each) until that first token (objective 2: at most ``stall_ms``)."""
    from edgepath.contract.wire import Sampling
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.llama import LlamaHandler
    from edgepath.slots.handlers import HandlerConfig, SlotRequest

    out_cap = 4096
    config = {**options, "ctx_per_slot": str(max(context, prompt) + out_cap), "prefix_cache": "off"}
    handler = LlamaHandler.from_config(HandlerConfig(slots, max(context, prompt), out_cap, config))
    tok = GGUFTokenizer(handler.options.model)
    words = tok.encode(TEXT)
    inputs = np.zeros((slots, max(context, prompt)), dtype=np.int32)
    outputs = np.zeros((slots, out_cap), dtype=np.int32)
    run = ArrivalRun()
    new = slots - 1

    def first_token() -> tuple[float, list[float]]:
        """Add the arriving request; step until its first token; (ms to it, step times meanwhile)."""
        inputs[new, :prompt] = words[500 : 500 + prompt]
        handler.add(SlotRequest(new, new, out_cap, 0, inputs[new, :prompt], outputs[new], Sampling()), 0.0)
        start = last = time.perf_counter()
        steps = []
        while True:
            emits = handler.step(0.0)
            now = time.perf_counter()
            steps.append((now - last) * 1e3)
            last = now
            if any(e.slot == new for e in emits):
                handler.cancel(new)
                return (now - start) * 1e3, steps

    try:
        for _ in range(rounds):
            run.idle_ms.append(first_token()[0])
            for slot in range(new):
                inputs[slot, :context] = words[slot : slot + context]
                handler.add(SlotRequest(slot, slot, out_cap, 0, inputs[slot, :context], outputs[slot], Sampling()), 0.0)
            started: set[int] = set()
            while len(started) < new:
                started.update(e.slot for e in handler.step(0.0))  # every generating sequence under way
            for _ in range(3):
                handler.step(0.0)
            ms, steps = first_token()
            run.loaded_ms.append(ms)
            run.gaps_ms += steps
            for slot in range(new):
                handler.cancel(slot)
    finally:
        handler.close()
        tok.close()
    return run


def cost_line(rows: list[Row], label: str) -> tuple[float, float]:
    """Least-squares ``overhead_ms + per_token_ms * tokens`` over every measured step (fastest times)."""
    x = np.array([r.tokens for r in rows], dtype=float)
    y = np.array([min(r.ms[label]) for r in rows])
    per_token, overhead = np.polyfit(x, y, 1)
    return float(overhead), float(per_token)


def table(rows: list[Row], labels: list[str]) -> str:
    head = "| step | tokens | " + " | ".join(f"{label}: ms fastest (median) | tok/s" for label in labels)
    lines = [head + " |", "|---|---:|" + "---:|---:|" * len(labels)]
    names = {"prefill": "prefill {} tokens", "decode": "decode {} sequences", "mixed": "{} prompt tokens + decoding"}
    for r in rows:
        cells = []
        for label in labels:
            fastest = min(r.ms[label])
            cells.append(f"{fastest:,.1f} ({statistics.median(r.ms[label]):,.1f}) | {r.tokens / fastest * 1e3:,.0f}")
        lines.append(f"| {names[r.shape].format(r.size)} | {r.tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated llama.cpp thread counts (default 1,2)")
    parser.add_argument("--repeat", type=int, default=5, help="steps per shape and configuration (fastest taken)")
    parser.add_argument("--context", type=int, default=256, help="tokens each decoding sequence already holds")
    parser.add_argument("--slots", type=int, default=8, help="sequences (decode and mixed steps use them all)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a llama handler option")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also measure, per thread count, a context with these handler options changed (KEY=VALUE[,KEY=VALUE])",
    )
    parser.add_argument("--json", default=None, help="also write every step time here")
    parser.add_argument(
        "--handler-decode",
        type=int,
        default=0,
        metavar="TOKENS",
        help="instead: decode tokens/s through the handler, 1 and --slots sequences of --context prompt tokens, "
        "TOKENS generated each (compare llama-batched-bench -npp CONTEXT -ntg TOKENS -npl 1,SLOTS)",
    )
    parser.add_argument(
        "--arrival",
        type=int,
        default=0,
        metavar="TOKENS",
        help="instead: time to first token of a TOKENS-token prompt on an idle handler and while --slots - 1 "
        "sequences generate, and their gaps meanwhile, per configuration (--variant stall_ms=...)",
    )
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if any(t < 1 for t in threads) or args.repeat < 1 or args.slots < 2 or args.context < 1:
        parser.error("need --threads >= 1 each, --repeat >= 1, --slots >= 2, --context >= 1")
    bad = [o for o in args.option + [p for v in args.variant for p in v.split(",")] if "=" not in o]
    if bad:
        parser.error(f"--option and --variant take KEY=VALUE, got {bad}")
    options = dict(o.split("=", 1) for o in args.option)
    if args.arrival:
        for t in threads:
            for variant in ["", *args.variant]:
                changed = dict(pair.split("=", 1) for pair in variant.split(",")) if variant else {}
                got = arrival(
                    {**options, **changed, "threads": str(t)}, args.slots, args.context, args.arrival, args.repeat
                )
                label = f"{t} thread(s)" + (f", {variant}" if variant else "")
                print(f"{label}, a {args.arrival}-token prompt beside {args.slots - 1} generating: {got.line()}")
        return 0
    if args.handler_decode:
        for t in threads:
            runs = handler_decode(
                {**options, "threads": str(t)}, args.slots, args.context, args.handler_decode, args.repeat
            )
            print(
                f"{t} thread(s), LlamaHandler.step, {args.context} prompt + {args.handler_decode} generated, median "
                f"of {args.repeat}: " + "; ".join(run.line(n) for n, run in runs.items())
            )
        return 0
    ctx_per_slot = max(args.context + max(MIXED) + 16, max(PREFILL))
    options.setdefault("ctx_per_slot", str(ctx_per_slot))
    lib = llama_cpp()
    parsed: dict[str, LlamaOptions] = {}
    for t in threads:
        for variant in ["", *args.variant]:
            changed = dict(pair.split("=", 1) for pair in variant.split(",")) if variant else {}
            label = f"{t} thread{'s' if t > 1 else ''}" + (f", {variant}" if variant else "")
            try:
                parsed[label] = LlamaOptions.parse({**options, **changed, "threads": str(t)}, ctx_per_slot)
            except HandlerError as exc:
                parser.error(str(exc))
    labels = list(parsed)
    first = parsed[labels[0]]
    batch = max(PREFILL) + args.slots
    model = load_model(first.model, vocab_only=False)
    contexts = {label: StepContext(lib, model, o, args.slots, batch) for label, o in parsed.items()}
    try:
        for sc in contexts.values():  # warm-up: page the weights in, size llama.cpp's buffers
            sc.decode([(0, 0, 64)])
        rows = measure(contexts, args.slots, args.context, args.repeat, first.ubatch)
    finally:
        for sc in contexts.values():
            sc.close()
        lib.llama_model_free(model)
    print(
        f"{first.model.name}: one llama_decode per step, {args.slots} sequences x {first.ctx_per_slot} cells (one KV "
        f"stream each), flash attention {first.flash_attn}, micro-batch {first.ubatch}; decoding sequences hold "
        f"{args.context} tokens; fastest of {args.repeat} (median in brackets)"
    )
    print(table(rows, labels))
    for label in labels:
        overhead, per_token = cost_line(rows, label)
        print(f"{label}: step ~= {overhead:.1f} ms + {per_token:.2f} ms/token (least squares over every step)")
    if args.json:
        doc = {
            "model": str(first.model),
            "flash_attn": first.flash_attn,
            "ubatch": first.ubatch,
            "context": args.context,
            "slots": args.slots,
            "rows": [{"shape": r.shape, "size": r.size, "tokens": r.tokens, "ms": r.ms} for r in rows],
            "cost": {label: cost_line(rows, label) for label in labels},
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
