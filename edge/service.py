"""The edge service: the one place where the HTTP core, the tokenizer and the agent meet.

Both adapters (QUIC and HTTP/1.1) hand it complete :class:`Request` objects and a callback for
the response.  Per request: route and validate (sans-I/O core) -> take an agent frame -> tokenize
straight into it, the one write of the token ids into registered memory (inline, or on a worker
thread for large prompts) -> ``agent.submit`` (CAS claim, RDMA WRITE, doorbell) -> answer from the
completion-queue callback.
No queue and no batcher anywhere: a request that cannot claim a frame and a slot right now is
answered 429 right now.  Results are picked up on the event loop from the completion queue's
eventfd, so no thread hand-off sits between the doorbell and the response.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from edgepath.dma.wire import FINISHED, Sampling
from edgepath.dpu.agent import Agent
from edgepath.dpu.agent_client import AgentClient
from edgepath.dpu.frame import write_sampling
from edgepath.edge.http import (
    ROUTES,
    HttpCore,
    HttpError,
    Request,
    Response,
    Work,
    error_response,
    timing_headers,
)
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.tokenizer import INLINE_CHARS, Tokenizer
from edgepath.native.abi import Status, lib

log = logging.getLogger("edgepath.edge")

Respond = Callable[[Response], None]
_now = lib.ep_now_ns


@dataclass(eq=False, slots=True)
class Ticket:
    """One request between arrival and response; ``cancel`` when the client gave up on it."""

    request: Request
    respond: Respond
    route: str
    timings: dict[str, int] = field(default_factory=dict)
    work: Work | None = None
    frame: int | None = None  # the agent frame this request holds
    t_dispatch_ns: int = 0  # when it went to the slot server
    input_count: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class EdgeService:
    """Turns requests into slot submissions and completions into responses, on one event loop."""

    def __init__(
        self,
        core: HttpCore,
        tokenizer: Tokenizer,
        agent: Agent | AgentClient,
        loop: asyncio.AbstractEventLoop,
        executor: Executor,
        check_interval: float = 0.25,
        request_timeout: float = 60.0,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.agent = agent
        self.loop = loop
        self.executor = executor
        self.metrics = EdgeMetrics(lambda: self.agent.free_slots()[0])
        self.inflight: dict[int, Ticket] = {}
        self._ids = itertools.count(1)
        self._check_interval = check_interval
        self._timeout_ns = int(request_timeout * 1e9)
        self._check_handle: asyncio.TimerHandle | None = None
        self._cq = agent.transport.cq

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.add_reader(self._cq.fileno(), self._on_completions)
        self._on_completions()  # arms the queue (and drains anything already there)
        self._check_handle = self.loop.call_later(self._check_interval, self._check_links)

    def stop(self) -> None:
        self.loop.remove_reader(self._cq.fileno())
        if self._check_handle is not None:
            self._check_handle.cancel()

    # -- requests -------------------------------------------------------------------------
    def handle(self, request: Request, respond: Respond) -> Ticket:
        """Start answering ``request``; ``respond`` is called exactly once unless the ticket is cancelled."""
        t0 = _now()
        arrival = request.t_arrival_ns if request.t_arrival_ns is not None else request.t_receive_ns
        ticket = Ticket(request, respond, "other", {"queue": t0 - arrival})
        result = self.core.handle(request)
        ticket.timings["parse"] = _now() - t0
        if isinstance(result, Response):
            ticket.route = _route_of(request)
            self._answer(ticket, result)
        elif isinstance(result, tuple):
            ticket.route = result[0]
            self._answer(ticket, self._state_response(*result))
        else:
            ticket.route = f"/v1/{result.kind}"
            ticket.work = result
            self._tokenize(ticket, result)
        return ticket

    def refuse(self, request: Request, response: Response, respond: Respond) -> None:
        """Answer an adapter's early refusal (e.g. 413 while the body is still arriving), counted like the rest."""
        self._answer(Ticket(request, respond, _route_of(request)), response)

    def _state_response(self, route: str, query: dict[str, list[str]]) -> Response:
        if route == "/metrics":
            return Response(200, [(b"content-type", self.metrics.content_type.encode())], self.metrics.exposition())
        free, total = self.agent.free_slots()
        alive = any(link.alive for link in self.agent.links)
        return self.core.health_response(
            free, total, alive, query, lambda pct: self.metrics.window.percentile(pct, _now())
        )

    def _tokenize(self, ticket: Ticket, work: Work) -> None:
        """Tokenize: /v1/tokenize into a fresh array; /v1/generate straight into a frame taken first
        (no frame free: 429 before spending anything on the prompt)."""
        if work.kind == "tokenize":
            if work.prompt is None:
                assert work.tokens is not None
                self._answer(ticket, self.core.tokenize_response(work.tokens))
            elif len(work.prompt) <= INLINE_CHARS:
                t0 = _now()
                try:
                    ids = self.tokenizer.encode(work.prompt)
                except Exception as exc:
                    self._tokenizer_failed(ticket, exc)
                    return
                ticket.timings["tokenize"] = _now() - t0
                self._answer(ticket, self.core.tokenize_response(ids.tolist()))
            else:
                t0 = _now()
                future = self.loop.run_in_executor(self.executor, self.tokenizer.encode, work.prompt)
                future.add_done_callback(lambda f: self._off_loop_done(ticket, f, t0))
            return
        index = self.agent.acquire()
        if index is None:
            self._answer(ticket, self.core.no_slot())
            return
        ticket.frame = index
        out = self.agent.frames.tokens[index]  # registered memory: the ids are written here once
        t0 = _now()
        if work.prompt is None:
            assert work.tokens is not None
            n = len(work.tokens)
            if n <= len(out):
                out[:n] = work.tokens
            self._tokenized(ticket, n, _now() - t0)
        elif len(work.prompt) <= INLINE_CHARS:
            try:
                n = self.tokenizer.encode_into(work.prompt, out)
            except Exception as exc:
                self._tokenizer_failed(ticket, exc)
                return
            self._tokenized(ticket, n, _now() - t0)
        else:
            future = self.loop.run_in_executor(self.executor, self.tokenizer.encode_into, work.prompt, out)
            future.add_done_callback(lambda f: self._off_loop_done(ticket, f, t0))

    def _off_loop_done(self, ticket: Ticket, future: asyncio.Future[Any], t0: int) -> None:
        """A worker thread finished tokenizing a large prompt (the event loop kept serving meanwhile)."""
        tokenize_ns = _now() - t0
        if ticket.cancelled:
            self._drop_frame(ticket)
            return
        try:
            result = future.result()
        except Exception as exc:
            self._tokenizer_failed(ticket, exc)
            return
        if ticket.frame is None:
            ticket.timings["tokenize"] = tokenize_ns
            self._answer(ticket, self.core.tokenize_response(result.tolist()))
        else:
            self._tokenized(ticket, int(result), tokenize_ns)

    def _tokenizer_failed(self, ticket: Ticket, exc: Exception) -> None:
        """A tokenizer exception answers its own request with 500; the server keeps serving."""
        log.error("tokenizer failed on a %d-character prompt: %r", len((ticket.work and ticket.work.prompt) or ""), exc)
        self._drop_frame(ticket)
        self._answer(ticket, self.core.failure(500, "tokenizer_error", f"the tokenizer failed: {exc}"))

    def _drop_frame(self, ticket: Ticket) -> None:
        if ticket.frame is not None:
            self.agent.release(ticket.frame)
            ticket.frame = None

    def _tokenized(self, ticket: Ticket, n: int, tokenize_ns: int) -> None:
        ticket.timings["tokenize"] = tokenize_ns
        ticket.input_count = n
        try:
            self.core.check_length(n)
        except HttpError as exc:
            self._drop_frame(ticket)
            self._answer(ticket, error_response(exc))
            return
        self._dispatch(ticket, n)

    def _dispatch(self, ticket: Ticket, n: int) -> None:
        agent = self.agent
        timings = ticket.timings
        index = ticket.frame
        work = ticket.work
        assert index is not None and work is not None
        t0 = _now()
        req = agent.frames.requests[index]
        req["request_id"] = next(self._ids)
        req["token_count"] = n
        req["max_new_tokens"] = work.max_tokens
        write_sampling(req, Sampling())
        req["t_receive_ns"] = ticket.request.t_receive_ns
        req["t_tokenized_ns"] = t0
        t1 = _now()
        status = agent.submit(index)
        t2 = _now()
        timings["write"] = t1 - t0
        if status is not None:
            self._drop_frame(ticket)
            timings["claim"] = t2 - t1
            self._answer(ticket, self._refusal(status))
            return
        written = int(req["t_written_ns"])
        timings["claim"] = written - t1
        timings["doorbell"] = t2 - written
        ticket.t_dispatch_ns = t2
        self.inflight[index] = ticket

    # -- completions ------------------------------------------------------------------------
    def _on_completions(self) -> None:
        agent = self.agent
        while True:
            for delivery in agent.poll(0):
                if delivery.final:
                    self._finish(delivery.index)
            if not self._cq.arm():
                return

    def _refusal(self, status: Status) -> Response:
        """The answer to a request the data path refused before any slot ran it."""
        if status == Status.NO_SLOT:
            return self.core.no_slot()
        if status == Status.UNAVAILABLE:
            return self.core.failure(503, "unavailable", "no slot server is reachable")
        return self.core.failure(400, "bad_request", "the data path refused this request")

    def _finish(self, index: int) -> None:
        ticket = self.inflight.pop(index)
        agent = self.agent
        result = agent.frames.results[index]
        req = agent.frames.requests[index]
        status = int(result["status"])
        if status in REFUSALS:  # an agent process answers its refusals through the completion queue
            self._drop_frame(ticket)
            if not ticket.cancelled:
                self._answer(ticket, self._refusal(Status(status)))
            return
        edge_ns = int(result["t_ready_ns"]) - int(req["t_receive_ns"])
        request_id = int(req["request_id"])
        tokens: list[int] = []
        text = ""
        if status in FINISHED and not ticket.cancelled:
            # The client's max_tokens is a contract of this API: a handler that wrote more is cut there.
            output = agent.frames.outputs[index, : min(int(result["output_count"]), int(req["max_new_tokens"]))]
            tokens = output.tolist()
            text = self.tokenizer.decode(output)
        self._drop_frame(ticket)
        ticket.timings["edge"] = edge_ns
        self.metrics.edge(edge_ns, _now())
        if ticket.cancelled:
            return
        if status not in FINISHED:
            self._answer(ticket, self.core.failure(502, "slot_error", f"slot server answered status {status}"))
            return
        assert ticket.work is not None
        self._answer(ticket, self.core.generate_response(ticket.work, request_id, ticket.input_count, tokens, text))

    def _check_links(self) -> None:
        """Periodic: frames lost with a slot server -> 503; requests past their deadline -> 504;
        a slot server that went away is re-attached as soon as it is back."""
        if not all(link.alive for link in self.agent.links):
            self.agent.revive(timeout=0.05)
        for index in self.agent.check_links():
            ticket = self.inflight.pop(index)
            self._drop_frame(ticket)
            if not ticket.cancelled:
                self._answer(ticket, self.core.failure(503, "unavailable", "the slot server went away"))
        now = _now()
        for ticket in self.inflight.values():
            if not ticket.cancelled and now - ticket.t_dispatch_ns > self._timeout_ns:
                # The frame stays in flight (a late result may still be written into it) and is
                # released when that result arrives; the client gets its one answer now.
                self._answer(ticket, self.core.failure(504, "timeout", "no result from the slot server in time"))
                ticket.cancel()
        self._check_handle = self.loop.call_later(self._check_interval, self._check_links)

    def _answer(self, ticket: Ticket, response: Response) -> None:
        total = _now() - ticket.request.t_receive_ns
        ticket.timings["total"] = total
        self.metrics.answered(ticket.route, response.status, total)
        if ticket.cancelled:
            return
        response.headers += timing_headers(ticket.timings)
        ticket.respond(response)


REFUSALS = (Status.NO_SLOT, Status.UNAVAILABLE, Status.BAD_REQUEST)


def _route_of(request: Request) -> str:
    """The metrics label of a request: its path if it is one of the API's, else "other" (bounded cardinality)."""
    path = request.target.split("?", 1)[0]
    return path if path in ROUTES else "other"
