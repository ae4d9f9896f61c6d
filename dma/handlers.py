"""Slot handlers: the model side's entry point, called with an in-place view of a slot.

A handler is ``def handler(request: SlotRequest) -> int | array-like``: it reads
``request.tokens`` (a view of the slot's token area, nothing copied) and either
writes into ``request.output`` and returns how many tokens it wrote, or returns
the output tokens for the server to place there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class SlotRequest:
    slot: int
    request_id: int
    max_new_tokens: int
    flags: int
    tokens: np.ndarray  # int32 view of the slot's input tokens
    output: np.ndarray  # int32 view of the slot's output area (capacity = len(output))


Handler = Callable[[SlotRequest], Any]


class HandlerError(ValueError):
    """A handler name that cannot be loaded."""


def echo(request: SlotRequest) -> int:
    """Return the input tokens unchanged, so integrity can be checked end to end."""
    n = min(len(request.tokens), len(request.output))
    request.output[:n] = request.tokens[:n]
    return n


BUILTIN: dict[str, Handler] = {"echo": echo}


def load_handler(spec: str) -> Handler:
    """``echo`` or ``package.module:function``; a clear error for anything else."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(f"unknown handler {spec!r}: use a built-in ({', '.join(BUILTIN)}) or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"handler {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    func = getattr(module, attr, None)
    if not callable(func):
        raise HandlerError(f"handler {spec!r}: module {module_name!r} has no callable {attr!r}")
    return func
