"""The edge service: the asyncio driver of the sans-I/O :class:`~edgepath.edge.lifecycle.EdgeLifecycle`.

Both adapters (QUIC and HTTP/1.1) hand it complete :class:`Request` objects with a :class:`Reply`
(the request's way back to its client).  This module only does what needs an event loop: it reads
the clock, watches the agent port's file descriptor for deliveries, runs the periodic tick, runs
large-prompt tokenization on the worker threads, and carries out the lifecycle's actions on the
replies.  Deliveries are picked up on the event loop from the port's eventfd, so no thread
hand-off sits between the doorbell and the response.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Protocol

from edgepath.dpu.port import AgentPort
from edgepath.edge.body import BodyLimits
from edgepath.edge.body_budget import DEFAULT_BODY_RATE, Dropping
from edgepath.edge.connections import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    ConnectionLimits,
)
from edgepath.edge.http import Headers, HttpError, Request, Response
from edgepath.edge.lifecycle import (
    DEFAULT_FORMATTERS,
    Action,
    EdgeLifecycle,
    EndStream,
    FormatterFactory,
    Respond,
    SendChunk,
    StartStream,
    Tokenize,
)
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.overload import DEFAULT_HIGH_WATER, MemoryGuard, MemoryReading
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.text.tokenizer import Tokenizer
from edgepath.edge.tokenizing import work_on_worker
from edgepath.edge.turns import LARGE_BODY, Turns
from edgepath.native.abi import lib

log = logging.getLogger("edgepath.edge")

_now = lib.ep_now_ns


def _seconds() -> float:
    """The port's clock (CLOCK_MONOTONIC, as ``time.monotonic``) in seconds."""
    return _now() / 1e9


#: worker threads for prompts over INLINE_CHARS; when all are busy a large prompt gets 429, never a wait
TOKENIZER_WORKERS = 2
#: how much nicer than the event loop those workers run: one tenant's large prompt -- templating two thousand
#: messages costs half a second of CPU here -- yields the CPUs to the event loop and the model (a thread 10 nicer
#: than another gets about a tenth of a CPU both want)
WORKER_NICE = 10


def lower_priority() -> None:
    """A tokenizer worker's initializer: run this thread :data:`WORKER_NICE` nicer than it started (Linux sets a
    thread's niceness by its id; lowering it needs no privilege)."""
    thread = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + WORKER_NICE))


#: how often the event loop's lag is sampled: a timer due this often, and how late it ran
#: (``edgepath_event_loop_lag_seconds``)
LAG_PROBE_S = 0.05


class Reply(Protocol):
    """How an adapter sends one request's answer: one complete response, or a stream."""

    def respond(self, response: Response) -> None: ...

    def start(self, status: int, headers: Headers) -> None: ...

    def send(self, data: bytes) -> None: ...

    def end(self, data: bytes) -> None: ...


class Intake(Protocol):
    """What an HTTP adapter sees of the edge (:class:`EdgeService` is one): the body limits it applies
    while a request arrives, the connections it may keep, and where request heads, complete requests, early refusals
    and early resets go."""

    body: BodyLimits
    connections: ConnectionLimits

    def head(self, request: Request, length: int | None, reply: Reply) -> Dropping | None:
        """A request's head arrived (``request.body`` empty; ``length``: its declared Content-Length): when it was
        refused from its headers alone and answered through ``reply``, what its body's bytes cost as they are dropped
        (read no more of it than its tenant's budget allows; HTTP/3 stops the stream); None when its body is to be
        read and the request handed over whole."""
        ...

    def handle(self, request: Request, reply: Reply) -> Ticket:
        """Answer a complete request through ``reply``; cancel the ticket when its client goes away."""
        ...

    def refuse(self, request: Request, error: HttpError, reply: Reply) -> None:
        """Answer a request the adapter refused before it was complete (413, 408), in its route's shape."""
        ...

    def reset_early(self) -> None:
        """A client reset a request before it was complete (nothing was held for it; it is counted)."""
        ...


class Ticket:
    """An adapter's handle on a request it passed in: ``cancel`` when the client went away."""

    __slots__ = ("_service", "rid")

    def __init__(self, service: EdgeService, rid: int) -> None:
        self._service = service
        self.rid = rid

    def cancel(self) -> None:
        self._service.client_gone(self.rid)


class EdgeService:
    """Drives the edge lifecycle on one event loop; the adapters' :class:`Intake`."""

    def __init__(
        self,
        core: HttpCore,
        tokenizer: Tokenizer,
        port: AgentPort,
        loop: asyncio.AbstractEventLoop,
        executor: Executor,
        *,
        workers: int,
        check_interval: float = 0.25,
        request_timeout: float = 60.0,
        body_timeout: float = 5.0,
        connections: ConnectionLimits | None = None,
        memory: Callable[[], MemoryReading] | None = None,
        memory_high_water: float = DEFAULT_HIGH_WATER,
        body_rate: int = DEFAULT_BODY_RATE,
        formatters: Mapping[str, FormatterFactory] = DEFAULT_FORMATTERS,
        supervision: Callable[[], tuple[int, int] | None] | None = None,
        gate: TenantGate | None = None,
    ) -> None:
        """``supervision``: (restarts, hangs) of the slot server the app supervises, for /metrics; ``gate``: the
        tenants' slot caps, quotas and usage log (:class:`~edgepath.edge.tenancy.gate.TenantGate`); ``memory``: reads
        the edge's memory and its limit on every tick, new work being shed above ``memory_high_water`` of the limit
        (edge/overload.py; None: never); ``body_rate``: bytes of request bodies one tenant may have read a second
        (edge/body_budget.py; 0: no budget)."""
        self.core = core
        self.tokenizer = tokenizer
        self.port = port
        self.loop = loop
        self.executor = executor
        self.body = BodyLimits(core.limits.max_body, body_timeout)
        self.connections = connections or ConnectionLimits(
            DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, DEFAULT_IDLE_TIMEOUT
        )
        self.metrics = EdgeMetrics(
            lambda: port.free_slots()[0],
            lambda: port.delivery_stats,
            supervision=supervision,
            slot_servers=port.servers,
            clock=_seconds,
            gateway=lambda: (self.pending, *port.free_slots()),
        )
        self.metrics.watch_connections(self.connections)
        self.lifecycle = EdgeLifecycle(
            core,
            tokenizer,
            port,
            self.metrics,
            _now,
            workers=workers,
            request_timeout_ns=int(request_timeout * 1e9),
            formatters=formatters,
            gate=gate,
        )
        self.lifecycle.admission.memory = MemoryGuard(memory_high_water)
        self.lifecycle.admission.budget_bodies(body_rate, core.limits.max_body)
        self.metrics.watch_memory(self.lifecycle.admission.memory)
        self._memory = memory
        self._turns: Turns[tuple[int, Request]] = Turns()  # large requests waiting for their tenant's turn
        self._turn_due = False
        self._replies: dict[int, Reply] = {}
        self._rids = itertools.count(1)
        self._check_interval = check_interval
        self._check_handle: asyncio.TimerHandle | None = None
        self._probe_handle: asyncio.TimerHandle | None = None

    # -- start / stop ----------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.add_reader(self.port.fileno(), self._on_readable)
        self._on_readable()  # arms the port (and drains anything already there)
        self._check_handle = self.loop.call_later(self._check_interval, self._tick)
        if self._memory is not None:
            self.lifecycle.admission.memory.update(self._memory())
        self._probe(self.loop.time())

    def stop(self) -> None:
        self.loop.remove_reader(self.port.fileno())
        for handle in (self._check_handle, self._probe_handle):
            if handle is not None:
                handle.cancel()

    def _probe(self, due: float) -> None:
        """Record how late the loop ran this timer (due at ``due``), and set the next: the loop's lag, which every
        request on it waits out -- the measure that nothing before admission holds the loop."""
        now = self.loop.time()
        self.metrics.loop_lag.observe(max(0.0, now - due))
        self._probe_handle = self.loop.call_at(now + LAG_PROBE_S, self._probe, now + LAG_PROBE_S)

    def drain(self) -> None:
        """Stop taking new requests (503 ``draining``, /health/ready 503) and finish those under way."""
        self.lifecycle.admission.draining = True

    @property
    def pending(self) -> int:
        """Requests not answered yet, or whose frame a tokenizer worker still holds."""
        return len(self.lifecycle.tracked)

    # -- events from adapters --------------------------------------------------------------------
    def head(self, request: Request, length: int | None, reply: Reply) -> Dropping | None:
        """Refuse ``request`` from its head when its headers alone decide it (the lifecycle's reasons, and a large body
        whose tenant's line is full: edge/turns.py), answering through ``reply``, and say who pays for its dropped
        body (its tenant's body budget: edge/body_budget.py); None: read its body."""
        rid = next(self._rids)
        actions = self.lifecycle.head(rid, request, length, _now())
        large = length is not None and length >= LARGE_BODY
        if actions is None and large and self._turns.full(self.core.tenant_of(request)):
            error = self.core.refusals.waiting()
            actions = self.lifecycle.refuse(rid, request, self.core.refusal(request.target, error))
        if actions is None:
            return None
        self._replies[rid] = reply
        self._run(actions)
        return Dropping(self.lifecycle.admission.drops, self.core.tenant_of(request))

    def handle(self, request: Request, reply: Reply) -> Ticket:
        """Start answering ``request``; ``reply`` gets exactly one answer unless the ticket is cancelled.  A large one
        waits for its tenant's turn (edge/turns.py), or is refused at once when its tenant's line is full."""
        rid = next(self._rids)
        self._replies[rid] = reply
        if len(request.body) < LARGE_BODY:
            self._run(self.lifecycle.receive(rid, request, _now()))
        elif not self._turns.add(self.core.tenant_of(request), (rid, request)):
            self._run(
                self.lifecycle.refuse(rid, request, self.core.refusal(request.target, self.core.refusals.waiting()))
            )
        elif not self._turn_due:
            self._turn_due = True
            self.loop.call_soon(self._turn)
        return Ticket(self, rid)

    def _turn(self) -> None:
        """Read the next tenant's large request; the next one in the next loop iteration (other events between)."""
        self._turn_due = False
        waiting = self._turns.next()
        if waiting is not None:
            rid, request = waiting
            if rid in self._replies:  # its client may have gone while it waited
                self._run(self.lifecycle.receive(rid, request, _now()))
        if len(self._turns):
            self._turn_due = True
            self.loop.call_soon(self._turn)

    def refuse(self, request: Request, error: HttpError, reply: Reply) -> None:
        """Answer an adapter's early refusal (413, 408) in its route's shape, counted like the rest."""
        rid = next(self._rids)
        self._replies[rid] = reply
        self._run(self.lifecycle.refuse(rid, request, self.core.refusal(request.target, error)))

    def reset_early(self) -> None:
        self.metrics.resets.inc()

    def client_gone(self, rid: int) -> None:
        if self._replies.pop(rid, None) is not None:
            self._run(self.lifecycle.client_gone(rid, _now()))

    # -- loop callbacks ----------------------------------------------------------------------------
    def _on_readable(self) -> None:
        port = self.port
        while True:
            deliveries = port.poll()
            if deliveries:
                self._run(self.lifecycle.deliveries(deliveries, _now()))
            if not port.arm():
                return

    def _tick(self) -> None:
        # The next tick is scheduled first: one that raised must not end them all -- without ticks no lost link,
        # stalled server or deadline is ever answered, and every stream on such a link waits for its client's
        # idle timeout (the loop's exception handler still logs the error).
        self._check_handle = self.loop.call_later(self._check_interval, self._tick)
        if self._memory is not None:
            self.lifecycle.admission.memory.update(self._memory())
        self._run(self.lifecycle.tick(_now()))

    def _tokenize(self, action: Tokenize) -> None:
        future = self.loop.run_in_executor(self.executor, work_on_worker, self.tokenizer, action)
        future.add_done_callback(lambda f: self._tokenized(action.rid, f))

    def _tokenized(self, rid: int, future: asyncio.Future[tuple[Any, Any]]) -> None:
        words = None
        if future.cancelled():  # the executor shut down under it (the server is stopping)
            outcome: Any = asyncio.CancelledError("tokenizer worker cancelled")
        elif future.exception() is not None:
            outcome = future.exception()
        else:
            outcome, words = future.result()
        self._run(self.lifecycle.tokenized(rid, outcome, _now(), words))

    # -- actions -------------------------------------------------------------------------------------
    def _run(self, actions: list[Action]) -> None:
        replies = self._replies
        for action in actions:
            match action:
                case Tokenize():
                    self._tokenize(action)
                case Respond(rid, response):
                    if (reply := replies.pop(rid, None)) is not None:
                        reply.respond(response)
                case StartStream(rid, status, headers):
                    if (reply := replies.get(rid)) is not None:
                        reply.start(status, headers)
                case SendChunk(rid, data):
                    if (reply := replies.get(rid)) is not None:
                        reply.send(data)
                case EndStream(rid, data):
                    if (reply := replies.pop(rid, None)) is not None:
                        reply.end(data)
