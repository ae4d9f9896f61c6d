"""Slot handlers: the model side, driven by the slot server as a continuous batcher.

Every handler is a :class:`BatchHandler`: slots join with :meth:`~BatchHandler.add`, all running
slots advance together in :meth:`~BatchHandler.step` (one model step: prefill chunks and decode
tokens mixed), and leave when they finish or are cancelled.  The handler writes output tokens in
place into ``request.output`` (the slot's output area in registered memory) and reports, per slot,
how many it has written so far; the slot server streams the new ones back to the requester.
Nothing here reads a clock: ``now`` (monotonic seconds) comes in as an argument.

Three simpler shapes are adapted to it, so a handler can be as small as a function:

* a function ``f(request) -> int | array-like`` (one shot: the output count, or the tokens);
* a generator function ``f(request)`` that yields tokens (an int or an array of ints) over time,
  advanced once per step;
* a class implementing :class:`BatchHandler`, constructed with a :class:`HandlerConfig`.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from edgepath.contract.plan import Load
from edgepath.contract.wire import Sampling, readable_salts
from edgepath.native.abi import Status
from edgepath.options import OptionError, non_negative_float, option, read_pairs

log = logging.getLogger("edgepath.handlers")
T = TypeVar("T")


@dataclass(slots=True)
class SlotRequest:
    """One running slot, as the model side sees it: views into the slot, nothing copied."""

    slot: int
    request_id: int
    max_new_tokens: int
    flags: int
    tokens: np.ndarray  # int32 view of the slot's input tokens
    output: np.ndarray  # int32 view of the slot's output area, exactly max_new_tokens long
    sampling: Sampling = field(default_factory=Sampling)
    salt: int = 0  # the prefix cache namespace (the header's cache_salt): reuse KV only from the same salt
    constraint: str | None = None  # a GBNF grammar the output must match (None: unconstrained)
    tenant: int = 0  # its tenant's floor id (0: a tenant without a slot floor; docs/TENANTS.md) ...
    floor: int = 0  # ... and that tenant's slot floor: within it, its prompt is computed first

    @property
    def readable(self) -> tuple[int, ...]:
        """The cache salts it may reuse KV from: its own, and the public one for a reader of the shared prefix
        (``FLAG_READ_PUBLIC``); what it writes is kept under its own only."""
        return readable_salts(self.salt, self.flags)


@dataclass(frozen=True, slots=True)
class Emit:
    """A handler's report for one slot: ``count`` output tokens are written so far (never fewer than
    last time); ``status`` set means the slot is finished (OK, LENGTH, STOP, HANDLER_ERROR).
    ``release=False`` with a status: answer the request now, but the handler still touches the slot's
    memory -- the server keeps the slot until a later ``Emit`` for it with ``release=True``.
    ``cached_tokens``: how many of the prompt's tokens the handler took from a cache instead of computing
    them (a model's prefix cache); the last non-zero value reported for a slot goes into its result."""

    slot: int
    count: int
    status: Status | None = None
    release: bool = True
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class HandlerConfig:
    """What a handler may size itself by: the pool's dimensions, and ``--handler-option`` values."""

    slots: int
    input_capacity: int
    output_capacity: int
    options: dict[str, str] = field(default_factory=dict)
    deadline: float = 0.0  # > 0: one-shot functions run on worker threads and are answered after this long


@runtime_checkable
class BatchHandler(Protocol):
    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        """A slot starts running; what is already known about it (a one-shot handler finishes here)."""
        ...

    def step(self, now: float) -> list[Emit]:
        """Advance every running slot by one step."""
        ...

    def cancel(self, slot: int) -> bool:
        """Stop ``slot`` at once. True: the handler no longer touches its memory; False: it still does,
        and a later step reports ``Emit(slot, ..., release=True)`` when it lets go."""
        ...

    def wake_in(self, now: float) -> float | None:
        """Seconds until :meth:`step` has something to do (0: at once), or None: nothing is running."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """How a handler advances the slot server's heartbeat from inside a long step: ``function`` is the address
    of a C function ``bool f(void *word)`` that advances the word at ``word`` and returns false -- the shape
    of ggml's abort callback, so llama.cpp can call it between the nodes of its compute graph.  Without it,
    the heartbeat moves between steps only, and one step longer than the agents' hang timeout makes the
    server look hung; with it, a step that makes progress keeps the word moving."""

    function: int
    word: int


@runtime_checkable
class BeatsWithinSteps(Protocol):
    """A batch handler that can advance the heartbeat while a step runs (optional)."""

    def beat_within_steps(self, heartbeat: Heartbeat) -> None:
        """Advance the heartbeat with ``heartbeat`` while a step makes progress, from now on."""
        ...


@runtime_checkable
class ReportsLoad(Protocol):
    """Optional for a batch handler with a step cost model (a model): what it has to do before a new
    prompt's first token, which the slot server publishes in its pool header for the agents' admission
    (:class:`~edgepath.contract.plan.Load`).  Handlers that answer at once (echo) leave it out."""

    def load(self) -> Load:
        """Now: prompt tokens admitted and not computed, streams decoding, the cost model (cheap: asked after
        every step and every admitted request)."""
        ...


@runtime_checkable
class HoldsPrefixes(Protocol):
    """Optional for a batch handler that keeps the KV of earlier requests (a model's prefix cache): what it
    holds, so the slot server can publish it (the pool's prefix table) and agents claim first where a
    request's prefix is already computed.  Handlers that hold nothing (echo, paced-echo) leave it out."""

    def prefixes_version(self) -> int:
        """A number that changes whenever what :meth:`prefixes` returns may have changed (cheap: asked after
        every step)."""
        ...

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        """The token sequences whose KV the handler could reuse for a new request, each with the salt it was
        written under (a request with another salt cannot reuse it), the most useful first (the table keeps
        the first ones when it cannot hold all)."""
        ...


class HandlerError(ValueError):
    """A handler spec that cannot be loaded, or options it does not accept."""


def handler_options(cls: type[T], config: HandlerConfig, handler: str) -> T:
    """A handler's typed options, read from its ``--handler-option`` pairs as ``cls`` declares them
    (:func:`edgepath.options.option`, the one way every option is declared); an unknown key or a wrong value is a
    HandlerError naming the handler, the option and what is allowed."""
    try:
        return cls(**read_pairs(cls, config.options))
    except OptionError as exc:
        raise HandlerError(f"{handler}: {exc}") from None


# -- one-shot functions -------------------------------------------------------------------------------
OneShot = Callable[[SlotRequest], Any]


def _place(request: SlotRequest, produced: Any) -> int:
    """Validate what a one-shot function returned, put its tokens in place; the output count."""
    cap = len(request.output)
    if isinstance(produced, (int, np.integer)):
        n = int(produced)
        if not 0 <= n <= cap:
            raise ValueError(f"handler reported {n} output tokens, capacity is {cap}")
        return n
    values = np.asarray(produced, dtype=np.int32).ravel()
    if len(values) > cap:
        raise ValueError(f"handler returned {len(values)} tokens, capacity is {cap}")
    request.output[: len(values)] = values
    return len(values)


class FunctionHandler:
    """A one-shot function as a batch handler: it runs inside :meth:`add` (no thread hop), or with a
    ``deadline`` on a worker thread; one past its deadline is answered HANDLER_ERROR and keeps its
    slot until it returns."""

    POLL = 0.001  # seconds between checks of worker-thread handlers

    def __init__(self, func: OneShot, deadline: float = 0.0, workers: int = 1) -> None:
        self.func = func
        self.deadline = deadline
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="handler")
            if deadline > 0
            else None
        )
        self._running: dict[int, tuple[concurrent.futures.Future[Any], SlotRequest, float]] = {}
        self._overdue: dict[int, concurrent.futures.Future[Any]] = {}
        self._poll_at = 0.0  # worker threads cannot wake the server: their futures are polled this often

    def _call(self, request: SlotRequest) -> Emit:
        try:
            n = _place(request, self.func(request))
        except Exception:
            log.exception("handler failed on slot %d (request %d)", request.slot, request.request_id)
            return Emit(request.slot, 0, Status.HANDLER_ERROR)
        return Emit(request.slot, n, Status.OK)

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        if self._pool is None:
            return [self._call(request)]
        future = self._pool.submit(self._call, request)
        self._running[request.slot] = (future, request, now + self.deadline)
        return self._collect(now)

    def _collect(self, now: float) -> list[Emit]:
        self._poll_at = now + self.POLL
        out = []
        for slot, (future, _, due) in list(self._running.items()):
            if future.done():
                del self._running[slot]
                out.append(future.result())
            elif now >= due:
                del self._running[slot]
                self._overdue[slot] = future
                log.warning("handler on slot %d missed its %.3f s deadline", slot, self.deadline)
                out.append(Emit(slot, 0, Status.HANDLER_ERROR, release=False))
        for slot, future in list(self._overdue.items()):
            if future.done():
                del self._overdue[slot]
                out.append(Emit(slot, 0, Status.HANDLER_ERROR, release=True))
        return out

    def step(self, now: float) -> list[Emit]:
        return self._collect(now)

    def cancel(self, slot: int) -> bool:
        running = self._running.pop(slot, None)
        if running is None:
            return slot not in self._overdue
        if running[0].cancel() or running[0].done():
            return True
        self._overdue[slot] = running[0]
        return False

    def wake_in(self, now: float) -> float | None:
        if not self._running and not self._overdue:
            return None
        return max(0.0, min([self._poll_at, *(due for _, _, due in self._running.values())]) - now)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# -- generators ------------------------------------------------------------------------------------
class GeneratorHandler:
    """A generator function as a batch handler: each step advances every running generator once; what
    it yields (an int or an array of ints) is appended to the slot's output."""

    def __init__(self, func: Callable[[SlotRequest], Generator[Any, None, Any]]) -> None:
        self.func = func
        self._running: dict[int, tuple[Generator[Any, None, Any], SlotRequest, int]] = {}

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        self._running[request.slot] = (self.func(request), request, 0)
        return []

    def step(self, now: float) -> list[Emit]:
        out = []
        for slot, (gen, request, count) in list(self._running.items()):
            try:
                values = np.atleast_1d(np.asarray(next(gen), dtype=np.int32))
            except StopIteration:
                del self._running[slot]
                out.append(Emit(slot, count, Status.OK))
                continue
            except Exception:
                log.exception("handler failed on slot %d (request %d)", slot, request.request_id)
                del self._running[slot]
                out.append(Emit(slot, count, Status.HANDLER_ERROR))
                continue
            room = len(request.output) - count
            take = values[:room]
            request.output[count : count + len(take)] = take
            count += len(take)
            if len(values) > room or count == len(request.output):
                gen.close()
                del self._running[slot]
                out.append(Emit(slot, count, Status.LENGTH))
            else:
                self._running[slot] = (gen, request, count)
                out.append(Emit(slot, count))
        return out

    def cancel(self, slot: int) -> bool:
        running = self._running.pop(slot, None)
        if running is not None:
            running[0].close()
        return True

    def wake_in(self, now: float) -> float | None:
        return 0.0 if self._running else None

    def close(self) -> None:
        for gen, _, _ in self._running.values():
            gen.close()
        self._running.clear()


# -- built-ins -------------------------------------------------------------------------------------
def echo(request: SlotRequest) -> int:
    """Return the input tokens (up to max_new_tokens), so integrity can be checked end to end."""
    n = min(len(request.tokens), len(request.output))
    request.output[:n] = request.tokens[:n]
    return n


@dataclass(frozen=True)
class EchoOptions:
    """``--handler echo``'s option."""

    delay: float = option(
        0.0,
        type=non_negative_float,
        help="SECONDS >= 0 each request holds the server before it is echoed, one at a time: a stand-in for a model "
        "with a known capacity (one request per delay)",
    )


@dataclass(frozen=True)
class PacedEchoOptions:
    """``--handler paced-echo``'s option."""

    token_delay: float = option(
        0.005,
        type=non_negative_float,
        help="SECONDS >= 0 between one slot's tokens, the first at once: a model stand-in with a known pace",
    )


class PacedEcho:
    """Echo one token per slot every ``token_delay`` seconds, the first at once: a model stand-in with
    a known pace, so streaming, cancellation and time to first token are testable without a model."""

    def __init__(self, token_delay: float) -> None:
        if token_delay < 0:
            raise HandlerError(f"paced-echo: token_delay must be >= 0 seconds, got {token_delay}")
        self.token_delay = token_delay
        self._running: dict[int, tuple[SlotRequest, int, float]] = {}  # slot -> (request, count, next due)

    @classmethod
    def from_config(cls, config: HandlerConfig) -> PacedEcho:
        return cls(handler_options(PacedEchoOptions, config, "paced-echo").token_delay)

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        total = min(len(request.tokens), len(request.output))
        if total == 0:
            return [Emit(request.slot, 0, Status.LENGTH if len(request.output) == 0 else Status.OK)]
        self._running[request.slot] = (request, 0, now)
        return []

    def step(self, now: float) -> list[Emit]:
        out = []
        for slot, (request, count, due) in list(self._running.items()):
            if now < due:
                continue
            request.output[count] = request.tokens[count]
            count += 1
            total = min(len(request.tokens), len(request.output))
            if count == total:
                del self._running[slot]
                out.append(Emit(slot, count, Status.LENGTH if count == len(request.output) else Status.OK))
            else:
                self._running[slot] = (request, count, due + self.token_delay)
                out.append(Emit(slot, count))
        return out

    def cancel(self, slot: int) -> bool:
        self._running.pop(slot, None)
        return True

    def wake_in(self, now: float) -> float | None:
        if not self._running:
            return None
        return max(0.0, min(due for _, _, due in self._running.values()) - now)

    def close(self) -> None:
        self._running.clear()


def adapt(obj: Any, config: HandlerConfig) -> BatchHandler:
    """Turn a loaded object into a batch handler: a BatchHandler class or factory, a generator
    function, or a one-shot function."""
    if inspect.isclass(obj):
        factory: Callable[[HandlerConfig], Any] = getattr(obj, "from_config", obj)
        handler = factory(config)
        if not isinstance(handler, BatchHandler):
            raise HandlerError(f"{obj.__name__} does not implement add/step/cancel/wake_in/close")
        return handler
    if isinstance(obj, BatchHandler):
        return obj
    if inspect.isgeneratorfunction(obj):
        return GeneratorHandler(obj)
    if callable(obj):
        return FunctionHandler(obj, config.deadline, max(1, config.slots))
    raise HandlerError(f"{obj!r} is not a handler: expected a function, a generator function or a BatchHandler")
