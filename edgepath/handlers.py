"""The handler registry: what ``--handler NAME`` means.

The slot server takes a built :class:`~edgepath.dma.handlers.BatchHandler` and never learns a name; the
model side (``edgepath.model``) implements handlers against the API in :mod:`edgepath.dma.handlers`.
Only the app layer knows both and the names that tie them together: the built-ins (``echo``,
``paced-echo``, ``llama``) and ``package.module:attribute`` for anything else.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from edgepath.dma.handlers import (
    BatchHandler,
    FunctionHandler,
    HandlerConfig,
    HandlerError,
    PacedEcho,
    SlotRequest,
    adapt,
    echo,
    seconds_option,
)


def _llama(config: HandlerConfig) -> BatchHandler:
    from edgepath.model.llama import LlamaHandler  # optional extra: imported only when asked for

    return LlamaHandler.from_config(config)


def _echo(config: HandlerConfig) -> BatchHandler:
    """Echo; with ``delay=SECONDS`` each request holds the server for that long first -- a stand-in for a
    model with a known capacity (one request per delay, one at a time)."""
    delay = seconds_option(config, "echo", "delay", 0.0)
    if not delay:
        return FunctionHandler(echo, config.deadline, max(1, config.slots))

    def delayed_echo(request: SlotRequest) -> int:
        time.sleep(delay)
        return echo(request)

    return FunctionHandler(delayed_echo, config.deadline, max(1, config.slots))


BUILTIN: dict[str, Callable[[HandlerConfig], BatchHandler]] = {
    "echo": _echo,
    "paced-echo": PacedEcho.from_config,
    "llama": _llama,
}


def find_handler(spec: str) -> Callable[[HandlerConfig], BatchHandler]:
    """What ``spec`` names -- a built-in (``echo``, ``paced-echo``, ``llama``) or
    ``package.module:attribute`` -- resolved but not built (no model is loaded): a clear error for
    anything else, so a command line can be checked before anything starts."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(f"unknown handler {spec!r}: use a built-in ({', '.join(BUILTIN)}) or 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"handler {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise HandlerError(f"handler {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return lambda config: adapt(obj, config)


def load_handler(spec: str, config: HandlerConfig) -> BatchHandler:
    """The handler ``spec`` names (see :func:`find_handler`), built for ``config``."""
    return find_handler(spec)(config)
