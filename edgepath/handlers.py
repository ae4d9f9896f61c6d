"""The handler registry: what ``--handler NAME`` means.

The slot server takes a built :class:`~edgepath.slots.handlers.BatchHandler` and never learns a name; the
model side (``edgepath.model``) implements handlers against the API in :mod:`edgepath.slots.handlers`.
Only the app layer knows both and the names that tie them together: the built-ins (``echo``,
``paced-echo``, ``llama``) and ``package.module:attribute`` for anything else.

Each is a :class:`Handler`: how its ``--handler-option`` text becomes typed options (checked where they are
given, so a parent process refuses a wrong option before it starts the slot server that would run it), and
how it is built from those.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgepath.slots.handlers import (
    BatchHandler,
    EchoOptions,
    FunctionHandler,
    HandlerConfig,
    HandlerError,
    PacedEcho,
    PacedEchoOptions,
    SlotRequest,
    adapt,
    echo,
    handler_options,
)


@dataclass(frozen=True)
class Handler:
    """A handler ``--handler`` names: ``options`` reads its typed options from a pool's configuration (a
    HandlerError naming what is allowed), ``build`` makes it from them (a model is loaded here, once)."""

    options: Callable[[HandlerConfig], Any]
    build: Callable[[Any, HandlerConfig], BatchHandler]


def _llama_options(config: HandlerConfig) -> Any:
    from edgepath.model.llama_options import LlamaOptions  # optional extra: imported only when asked for

    return LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity)


def _llama(options: Any, config: HandlerConfig) -> BatchHandler:
    from edgepath.model.llama import LlamaHandler

    return LlamaHandler(config.slots, options)


def _echo(delay: float, config: HandlerConfig) -> BatchHandler:
    """Echo; with ``delay=SECONDS`` each request holds the server for that long first -- a stand-in for a
    model with a known capacity (one request per delay, one at a time)."""
    if not delay:
        return FunctionHandler(echo, config.deadline, max(1, config.slots))

    def delayed_echo(request: SlotRequest) -> int:
        time.sleep(delay)
        return echo(request)

    return FunctionHandler(delayed_echo, config.deadline, max(1, config.slots))


BUILTIN: dict[str, Handler] = {
    "echo": Handler(lambda config: handler_options(EchoOptions, config, "echo").delay, _echo),
    "paced-echo": Handler(
        lambda config: handler_options(PacedEchoOptions, config, "paced-echo").token_delay,
        lambda delay, _: PacedEcho(delay),
    ),
    "llama": Handler(_llama_options, _llama),
}


def find_handler(spec: str) -> Handler:
    """What ``spec`` names -- a built-in (``echo``, ``paced-echo``, ``llama``) or
    ``package.module:attribute`` (its options are its own: handed over as given) -- resolved but not built
    (no model is loaded): a clear error for anything else, so a command line can be checked before anything
    starts."""
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
    return Handler(lambda config: config.options, lambda _, config: adapt(obj, config))


def load_handler(spec: str, config: HandlerConfig) -> BatchHandler:
    """The handler ``spec`` names (see :func:`find_handler`), its options read from ``config`` and built."""
    handler = find_handler(spec)
    return handler.build(handler.options(config), config)


def handler_spec(text: str) -> str:
    """``--handler``: a handler that can be found here (a built-in or ``module:attribute``), checked before
    anything starts, without building it (a model is loaded by the slot server, once); an argparse type."""
    try:
        find_handler(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text
