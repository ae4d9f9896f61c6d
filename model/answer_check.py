"""The known-answer check run on llama.cpp before a slot server serves: the model's logits computed on a context
of its own and handed to :mod:`edgepath.model.known_answer` (sans I/O), which judges them against the references
or, for a model without one, for self-consistency (docs/MODEL.md, "Right on every CPU")."""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edgepath.model import known_answer
from edgepath.model.convert import sha256
from edgepath.model.known_answer import shipped
from edgepath.model.llama_context import Batch, LlamaContext, context_params
from edgepath.model.llama_options import LlamaOptions
from edgepath.slots.handlers import HandlerError

log = logging.getLogger("edgepath.model.llama")


def check_numbers(model: LlamaContext, options: LlamaOptions) -> None:
    """The known-answer check for ``model``'s model, on a context of its own (one sequence, the serving context's
    settings otherwise) so the serving KV and its sizes are untouched; HandlerError, one line naming the machine and
    the build, when llama.cpp does not compute what it must."""
    lib, path, where = model.lib, options.model, options.known_answer
    references = shipped() if where == "on" else known_answer.load(Path(where))
    reference = references.get(sha256(path))
    if reference is None and where != "on":
        raise HandlerError(f"llama: {where} holds no known answer for {path} (SHA-256 {sha256(path)})")
    probe = [] if reference is not None else _probe_ids(model, options)
    need = len(reference.ids) if reference is not None else len(probe) + known_answer.CONTINUATION
    params = context_params(lib, 1, replace(options, ctx_per_slot=need + 1), need + 1)
    ctx = lib.llama_init_from_model(model.model, params)
    if not ctx:
        raise HandlerError(f"llama: llama.cpp could not create the known-answer check's context for {path}")
    started = time.perf_counter()
    try:
        check = _Check(model, ctx, Batch(lib, need + 1))
        if reference is not None:
            rows = check.decode(list(reference.ids), 0, set(reference.positions))
            worst, problems = known_answer.compare(reference, np.array([rows[p] for p in reference.positions]))
            checked = f"its known answer holds (largest logit error {worst:.3f}, tolerance {reference.tolerance:g})"
        else:
            problems = check.self_consistent(probe)
            checked = "no known answer for it: self-consistency only (one step vs two, a greedy continuation)"
    finally:
        lib.llama_free(ctx)
    if problems:
        raise HandlerError(
            f"llama: {path.name} computes wrong numbers on this machine: {problems[0]}"
            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; CPU {known_answer.cpu_name()}, "
            f"llama-cpp-python {getattr(lib, '__version__', '?')}, llama.cpp "
            f"{lib.llama_print_system_info().decode().strip()}; docs/MODEL.md ('Right on every CPU') says how "
            "to build it right; --handler-option known_answer=off serves anyway"
        )
    log.info("llama: %s: %s (%.0f ms)", path.name, checked, 1e3 * (time.perf_counter() - started))


def _probe_ids(model: LlamaContext, options: LlamaOptions) -> list[int]:
    data = known_answer.PROBE_TEXT.encode()
    out = np.zeros(len(data) + 8, dtype=np.int32)
    n = model.lib.llama_tokenize(
        model.vocab, data, len(data), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(out), True, False
    )
    if n <= 4:
        raise HandlerError(f"llama: the known-answer probe tokenizes to {n} tokens in {options.model.name}")
    return [int(t) for t in out[:n]]


class _Check:
    """The check's context (``ctx``, one sequence) and its batch arrays."""

    def __init__(self, model: LlamaContext, ctx: Any, arrays: Batch) -> None:
        self.model, self.ctx, self.arrays = model, ctx, arrays

    def self_consistent(self, probe: list[int]) -> list[str]:
        """The probe decoded in one step and in two must agree; its greedy continuation must not collapse."""
        lib = self.model.lib
        half = len(probe) // 2
        checked = set(range(half, len(probe)))
        one = self.decode(probe, 0, checked)
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        self.decode(probe[:half], 0, set())
        two = self.decode(probe[half:], half, checked)
        problems = known_answer.consistent(
            np.array([one[p] for p in sorted(checked)]), np.array([two[p] for p in sorted(checked)])
        )
        tokens: list[int] = []
        row = two[len(probe) - 1]
        for _ in range(known_answer.CONTINUATION):
            token = int(row.argmax())
            if self.model.is_eog(token):
                break
            tokens.append(token)
            position = len(probe) + len(tokens) - 1
            row = self.decode([token], position, {position})[position]
        return problems + known_answer.degenerate(tokens)

    def decode(self, ids: list[int], first: int, wanted: set[int]) -> dict[int, np.ndarray]:
        """Decode ``ids`` at positions ``first``.. on sequence 0; copies of the logits at ``wanted``."""
        lib, arrays, n = self.model.lib, self.arrays, len(ids)
        arrays.tokens[:n] = ids
        arrays.fill(0, first, n, 0)
        arrays.logits[:n] = [first + i in wanted for i in range(n)]
        rc = arrays.decode(lib, self.ctx, arrays.tokens.ctypes.data, n)
        if rc != 0:
            raise HandlerError(f"llama: the known-answer check's llama_decode failed ({rc})")
        return {
            first + i: np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), (self.model.n_vocab,)).copy()
            for i in range(n)
            if arrays.logits[i]
        }
