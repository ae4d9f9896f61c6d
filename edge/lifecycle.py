"""The edge's request lifecycle, sans I/O: events and ``now`` in, actions out.

A request is received -> routed and validated (:class:`~edgepath.edge.http.HttpCore`) -> given a
frame of the agent port (none free, its tenant at its ``slot_cap``, or no slot it could claim now: 429
before the prompt costs anything) -> tokenized straight
into the frame (inline, or as a :class:`Tokenize` action for a worker thread when the prompt is
large and a worker is free; all busy: 429, never a waiting line) -> submitted -> answered from the
port's deliveries: one response, or a stream started at the first output, one event chunk per
delivery and an end.  A request past its deadline (504) or whose client went away is abandoned on
the port, which fences and frees the frame: the edge holds nothing for it afterwards.

Nothing here reads a clock, opens a socket, starts a thread or waits: the driver
(:class:`~edgepath.edge.service.EdgeService`) passes ``now`` with every event and carries out the
returned actions; the port's calls never block.  Stage durations inside one event (tokenize,
write, claim) are measured with the injected ``clock`` -- the one place fine-grained time is
needed -- so a test can drive everything with a fake port and a fake clock.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.dpu.frame import write_header
from edgepath.dpu.link_state import LinkState, Readiness, readiness
from edgepath.dpu.port import AgentPort, Delivery, SlotServerStatus
from edgepath.edge import quota
from edgepath.edge.actions import Answer, EndStream, Respond, SendChunk, StartStream
from edgepath.edge.choices import ChoiceGroup, choice_sampling
from edgepath.edge.http import (
    GENERATE,
    LIVE,
    METRICS,
    READY,
    ROUTES,
    TOKENIZE,
    Formatter,
    GenerateFormatter,
    Headers,
    HttpCore,
    HttpError,
    Outcome,
    Request,
    Response,
    StateQuery,
    Work,
    error_response,
    timing_headers,
)
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.quota import Quotas, Reservation
from edgepath.edge.tenants import Tenant
from edgepath.edge.tokenizer import INLINE_CHARS, Tokenizer
from edgepath.edge.usage import Usage
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.edge")

# -- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tokenize:
    """Encode ``prompt`` on a worker thread -- into ``out`` (a frame's registered token array) with
    ``encode_into``, or into a fresh array with ``encode`` when ``out`` is None -- then report
    the result (count, array, or the exception) with :meth:`EdgeLifecycle.tokenized`."""

    rid: int
    prompt: str | None
    out: np.ndarray | None
    messages: list[dict[str, Any]] | None = None  # a chat, tokenized with the model's template instead
    tools: list[dict[str, Any]] | None = None  # the tools the chat's template renders, when it has a place for them


Action = Answer | Tokenize

#: the status a request is counted under in ``edgepath_requests_total`` when its client went away
#: before the answer was complete (nginx's "client closed request"; nothing is sent)
CLIENT_GONE = 499

#: ``_forget``'s output count for a request the data path refused before any slot ran it (charged nothing)
NOTHING_RAN = -1

#: how a route's formatter is made for one request (``/v1/generate`` by default)
FormatterFactory = Callable[[Work, Tokenizer], Formatter]
DEFAULT_FORMATTERS: Mapping[str, FormatterFactory] = {GENERATE: lambda work, tok: GenerateFormatter(tok.decode)}


def chat_size(messages: Any, tools: list[dict[str, Any]] | None) -> int:
    """About how many characters a chat's tokenizer reads: its contents, and the tools its template renders."""
    size = sum(len(m.get("content") or "") for m in messages)
    return size + (len(json.dumps(tools)) if tools else 0)


def chat_tools(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """``encode_chat_into``'s keyword for the tools its template renders (none without them)."""
    return {} if tools is None else {"tools": tools}


def _prompt(t: Tracked) -> int:
    """The prompt tokens ``t`` is charged: a request's n choices share one prompt, counted with choice 0."""
    return t.input_count if t.choice == 0 else 0


def _tokens(work: Work, words: int) -> int:
    """Output tokens in ``words`` output words (with log probabilities each token is a record of several)."""
    return words // wire.record_words(wire.logprobs_top(work.flags))


class Phase(Enum):
    TOKENIZING = "tokenizing"  # a worker is encoding the prompt (into the frame, for generate)
    IN_FLIGHT = "in flight"  # submitted; waiting for deliveries
    STREAMING = "streaming"  # the stream is started; chunks go out as deliveries arrive


@dataclass(eq=False, slots=True)
class Tracked:
    """One request the lifecycle still owes an answer or holds a frame for."""

    rid: int
    request: Request
    route: str
    work: Work
    formatter: Formatter | None
    phase: Phase
    timings: dict[str, int] = field(default_factory=dict)
    frame: int | None = None
    request_id: int = 0
    input_count: int = 0
    sent: int = 0  # output tokens already forwarded to a streaming client
    deadline_ns: int = 0
    t_first_ns: int = 0  # first output token seen at the edge
    t_last_ns: int = 0  # latest delivery that carried tokens
    gone: bool = False  # the client went away while a worker held the frame
    waited: bool = False  # its wait for the first token is measured (once)
    reservation: Reservation | None = None  # tokens reserved against its tenant's quota, until settled
    capped: bool = False  # counted in its tenant's requests in flight at this edge (its slot_cap), until forgotten
    limits: Headers = field(default_factory=list)  # the x-ratelimit-* headers of every answer to it
    choice: int = 0  # which of its request's n choices it is (edge/choices.py); only choice 0 counts the prompt
    spares: list[int] = field(default_factory=list)  # the frames of choices 1..n-1, until they become requests
    handover_from: int = 0  # submitted then while a slot was being taken back for it (sent at the hand-over)
    cached_first: int = -1  # cached prompt tokens its slot server reported with its first output (-1: none yet)


@dataclass(eq=False, slots=True)
class Choices:
    """A request of ``n`` choices in flight: its members (one :class:`Tracked` each, choice 0 first, answering under
    keys of their own) and the combiner that makes their answers one (:mod:`edgepath.edge.choices`)."""

    combine: ChoiceGroup
    route: str
    request: Request
    members: list[Tracked]


class EdgeLifecycle:
    """Request tracking, admission, deadlines, streaming and completion for one edge."""

    def __init__(
        self,
        core: HttpCore,
        tokenizer: Tokenizer,
        port: AgentPort,
        metrics: EdgeMetrics,
        clock: Callable[[], int],
        *,
        workers: int,
        request_timeout_ns: int,
        formatters: Mapping[str, FormatterFactory] = DEFAULT_FORMATTERS,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if workers < 1:
            raise ValueError(f"tokenizer workers must be at least 1, got {workers}")
        if request_timeout_ns <= 0:
            raise ValueError(f"request timeout must be positive, got {request_timeout_ns} ns")
        self.core = core
        self.tokenizer = tokenizer
        self.port = port
        self.metrics = metrics
        self.clock = clock
        self.workers = workers
        self.busy_workers = 0
        self.request_timeout_ns = request_timeout_ns
        self.formatters = formatters
        self.tracked: dict[int, Tracked] = {}
        self.by_frame: dict[int, Tracked] = {}
        self._request_ids = itertools.count(1)
        self.unmatched = 0  # deliveries for a frame the edge does not track (a port bug if ever non-zero)
        self.broken = 0  # deliveries whose handling raised (an edge bug if ever non-zero; each one logged)
        self.quotas = Quotas()  # every tenant's quotas: this edge's own words, or a ledger edges share
        self.wall_clock = wall_clock  # Unix ns: the quota buckets' clock, which every edge sharing a ledger reads
        self.in_flight: collections.Counter[str] = collections.Counter()  # tenants' requests held for a slot_cap
        self.usage: Callable[[Usage], None] | None = None  # where each request's usage line goes (--usage-log)
        #: the edge is stopping (SIGTERM): new generations get 503 ``draining``, /health/ready 503, the rest finish
        self.draining = False
        self.groups: dict[int, Choices] = {}  # requests of n choices, by the client's key and by each member's
        self._member_keys = itertools.count(1)  # members of groups answer under -1, -2, ... (clients' keys are >= 0)

    # -- events ----------------------------------------------------------------------------------
    def receive(self, rid: int, request: Request, now: int) -> list[Action]:
        """A complete request arrived (``rid``: the driver's key for its reply channel; ``now``: read
        from the same monotonic clock as ``clock`` and the request's timestamps)."""
        arrival = request.t_arrival_ns if request.t_arrival_ns is not None else request.t_receive_ns
        timings = {"queue": now - arrival}
        handled = self.core.handle(request)
        timings["parse"] = self.clock() - now
        if isinstance(handled, Response):
            return [self._respond(rid, _route_of(request), request, timings, handled)]
        if isinstance(handled, StateQuery):
            return [self._respond(rid, handled.route, request, timings, self._state(handled, now))]
        if handled.kind == "tokenize":
            return self._tokenize_only(rid, request, handled, timings)
        return self._grouped(self._generate(rid, request, handled, timings, now), now)

    def refuse(self, rid: int, request: Request, response: Response) -> list[Action]:
        """An adapter's early refusal (413 while the body arrives, 408 when it comes too slowly),
        answered and counted like every other response."""
        return [self._respond(rid, _route_of(request), request, {}, response)]

    def tokenized(self, rid: int, result: int | np.ndarray | BaseException, now: int) -> list[Action]:
        """A worker finished a :class:`Tokenize` action: the count written into the frame, the ids
        (``/v1/tokenize``), or the exception the tokenizer raised."""
        self.busy_workers -= 1
        t = self.tracked.get(rid)
        if t is None:
            raise KeyError(f"tokenized() for request {rid}, which is not waiting for a tokenizer")
        t.timings["tokenize"] = now - t.timings.pop("tokenize_start")
        if t.gone:
            self._forget(t)
            self._release(t)
            self._count(t, CLIENT_GONE, now)
            return []
        if isinstance(result, BaseException):
            return self._tokenizer_failed(t, result)
        if isinstance(result, np.ndarray):
            self._forget(t)
            return [self._respond(rid, t.route, t.request, t.timings, self.core.tokenize_response(result.tolist()))]
        return self._grouped(self._tokenized_into_frame(t, result, now), now)

    def client_gone(self, rid: int, now: int) -> list[Action]:
        """The client reset its stream, closed its connection or went away mid-stream: abandon the
        frame (the port cancels the slot and frees the frame once the slot server let go of it)."""
        group = self.groups.get(rid)
        if group is not None:  # n choices in flight: every one is abandoned, the request counted once
            self.metrics.resets.inc()
            self._drop_group(group, "cancelled")
            self.metrics.answered(group.route, CLIENT_GONE, now - group.request.t_receive_ns)
            return []
        t = self.tracked.get(rid)
        if t is None:
            return []  # answered already, or never tracked
        self.metrics.resets.inc()
        if t.phase is Phase.TOKENIZING:
            t.gone = True  # a worker is writing into the frame: give it back when the worker is done
            return []
        self._forget(t, finish="cancelled")
        if t.frame is not None:
            self.port.abandon(t.frame)
        self._count(t, CLIENT_GONE, now)
        return []

    def deliveries(self, deliveries: list[Delivery], now: int) -> list[Action]:
        """Output from the port: stream what is new, answer what is final."""
        actions: list[Action] = []
        for delivery in deliveries:
            t = self.by_frame.get(delivery.index)
            if t is None:
                self.unmatched += 1
                log.error("delivery for frame %d, which no request holds: %s", delivery.index, delivery)
                continue
            try:
                actions += self._final(t, now) if delivery.final else self._progress(t, delivery.count, now)
            except Exception:  # one answer's fault must not lose the other answers of the batch with it
                self.broken += 1
                log.exception("answering request %d (frame %d) raised: %s", t.request_id, delivery.index, delivery)
        return self._grouped(actions, now)

    def tick(self, now: int) -> list[Action]:
        """Periodic: frames lost with a slot server -> 503; frames on a slot server that became unresponsive
        -> 504 at once (and abandoned); requests past their deadline -> 504 (and abandoned); a slot server
        that went away is re-attached as soon as it is back."""
        port = self.port
        actions: list[Action] = []
        port.revive()  # a no-op while every link is up; one of several may be down while alive() is True
        lost = [(index, t) for index in port.check_links() if (t := self.by_frame.get(index)) is not None]
        for index, t in lost:  # all of them first: a lost choice's group must not abandon the others lost with it
            self._forget(t)
            port.release(index)
        for _, t in lost:
            actions += self._fail(t, HttpError(503, "unavailable", "the slot server went away"))
        stalled = port.stalled()
        if stalled:
            stuck = [h for h in port.links_health() if h.state is LinkState.UNRESPONSIVE]
            named = "; ".join(f"slot server {h.address}: {h.describe(now / 1e9)}" for h in stuck)
            why = named or "its slot server stopped responding"
            for index in stalled:
                t = self.by_frame.get(index)
                if t is None:
                    continue
                self._forget(t)
                port.abandon(index)
                actions += self._fail(t, HttpError(504, "unresponsive", f"no result: {why}"))
        for t in [t for t in self.tracked.values() if t.phase is not Phase.TOKENIZING and now > t.deadline_ns]:
            if t.rid not in self.tracked:
                continue  # a choice whose group was answered (and abandoned) by another choice's timeout
            self._forget(t, finish="timeout")
            assert t.frame is not None
            port.abandon(t.frame)
            actions += self._fail(t, HttpError(504, "timeout", "no result from the slot server in time"))
        return self._grouped(actions, now)

    # -- generate ----------------------------------------------------------------------------------
    def _generate(self, rid: int, request: Request, work: Work, timings: dict[str, int], now: int) -> list[Action]:
        route = work.route
        factory = self.formatters.get(route)
        if factory is None:
            raise LookupError(f"no formatter for route {route!r}; have {sorted(self.formatters)}")
        formatter = factory(work, self.tokenizer)
        messages = work.options.get("messages")
        tools = work.options.get("tools")  # for a template that renders them (edgepath.edge.tools)
        size = len(work.prompt) if work.prompt is not None else chat_size(messages or (), tools)
        large = size > INLINE_CHARS
        if self.draining:
            error = HttpError(503, "draining", "this edge is stopping: send the request again (another edge takes it)")
            return [self._respond(rid, route, request, timings, formatter.failure(error))]
        if large and self.busy_workers >= self.workers:
            return [self._respond(rid, route, request, timings, formatter.failure(self.core.busy()))]
        frame = self.port.acquire()
        spares = [self.port.acquire() for _ in range(work.choices - 1)]  # n choices: a frame each, all or none
        if frame is None or None in spares:
            for index in [frame, *spares]:
                if index is not None:
                    self.port.release(index)
            return [self._respond(rid, route, request, timings, formatter.failure(self.core.no_slot()))]
        held = [frame, *(index for index in spares if index is not None)]
        refused = self._early_refusal(work, frame, len(held))
        if refused is not None:
            for index in held:
                self.port.release(index)
            response = formatter.failure(refused)
            response.headers += self._limits_seen(work.tenant)
            return [self._respond(rid, route, request, timings, response)]
        t = Tracked(rid, request, route, work, formatter, Phase.TOKENIZING, timings, frame)
        t.spares = held[1:]
        self.tracked[rid] = t
        out = self.port.frames.tokens[frame]  # registered memory: the ids are written here, once
        if messages is not None:  # a chat: the model's own template, tokenized straight into the frame
            if large:
                return [self._to_worker(t, None, out, messages, tools)]
            t0 = self.clock()
            try:
                n = self.tokenizer.encode_chat_into(messages, out, **chat_tools(tools))  # type: ignore[attr-defined]
            except Exception as exc:
                return self._tokenizer_failed(t, exc)
            timings["tokenize"] = self.clock() - t0
            return self._tokenized_into_frame(t, n, now)
        if work.prompt is None:
            assert work.tokens is not None
            t0 = self.clock()
            n = len(work.tokens)
            if n <= len(out):
                out[:n] = work.tokens
            timings["tokenize"] = self.clock() - t0
            return self._tokenized_into_frame(t, n, now)
        if large:
            return [self._to_worker(t, work.prompt, out)]
        t0 = self.clock()
        try:
            n = self.tokenizer.encode_into(work.prompt, out)
        except Exception as exc:
            return self._tokenizer_failed(t, exc)
        timings["tokenize"] = self.clock() - t0
        return self._tokenized_into_frame(t, n, now)

    def _tokenized_into_frame(self, t: Tracked, n: int, now: int) -> list[Action]:
        assert t.frame is not None
        t.input_count = n
        constraint = t.work.constraint
        try:
            self.core.check_length(n, 0 if constraint is None else len(constraint))
        except HttpError as exc:
            self._forget(t)
            self._release(t)
            return [self._answer(t, self._failure(t, exc))]
        over = self._reserve(t)
        if over is not None:
            self._forget(t)
            self._release(t)
            return [self._answer(t, self._failure(t, over))]
        if constraint is not None:  # the grammar goes after the prompt, sent with it in the one WRITE
            self.port.frames.tokens[t.frame, n : n + len(constraint)] = constraint
        if t.spares:
            return self._submit_group(t, now)
        return self._submit(t, now)

    def _reserve(self, t: Tracked) -> HttpError | None:
        """Reserve the request's prompt and ``max_tokens`` (and the request itself: the first of its choices) against
        its tenant's quotas, and a place within its ``slot_cap``, before any work; the 429 ``slot_cap`` or
        ``quota_exceeded`` (503 ``quota_unavailable`` when the quota ledger is out of reach) when that does not fit,
        and the rate-limit headers of its answer either way."""
        tenant, now = t.work.tenant, self.wall_clock()
        tokens = _prompt(t) + _tokens(t.work, t.work.max_tokens)  # max_tokens counts output words
        capped = self._over_cap(tenant)
        if capped is not None:
            t.limits = self._limits_seen(tenant)
            return capped
        got = self.quotas.reserve(tenant, tokens, now, requests=1 if t.choice == 0 else 0)
        if isinstance(got, quota.Unavailable):
            return self.core.quota_unavailable(got.why)
        t.limits = quota.headers(got.limits) if got is not None else []
        if isinstance(got, quota.Refused):
            self.metrics.refused("quota_exceeded")
            return self.core.over_quota(got)
        t.reservation = got
        if tenant.slot_cap:
            t.capped = True
            self.in_flight[tenant.name] += 1
        return None

    def _early_refusal(self, work: Work, frame: int, slots: int) -> HttpError | None:
        """The refusal a request gets before its prompt costs anything (templating, tokenizing): its tenant at its
        ``slot_cap``, or no slot to be had for it now (the agent reads the state words; a tenant under its floor
        takes one back), whatever its prompt.  A flood that never backs off then costs the edge a parse and a READ
        per attempt, not a tokenization -- CPU the model shares on a CPU server (docs/TENANTS.md)."""
        capped = self._over_cap(work.tenant)
        if capped is not None:
            return capped
        status = self.port.early_refusal(frame, work.tenant.floor_id, work.tenant.slot_floor, slots)
        if status is None:
            return None
        return self._refusal(Status(status), frame)

    def _over_cap(self, tenant: Tenant) -> HttpError | None:
        """429 ``slot_cap`` when ``tenant`` holds as many requests as its ``slot_cap`` allows."""
        if tenant.slot_cap and self.in_flight[tenant.name] >= tenant.slot_cap:
            self.metrics.refused("slot_cap")
            return self.core.over_cap(tenant.slot_cap)
        return None

    def _limits_seen(self, tenant: Tenant) -> Headers:
        """The rate-limit headers of an answer refused before it reserved anything: ``tenant``'s quotas as they
        are (none when it has none, or the ledger is out of reach)."""
        seen = self.quotas.limits(tenant, self.wall_clock())
        return quota.headers(seen) if seen is not None and not isinstance(seen, quota.Unavailable) else []

    def _submit(self, t: Tracked, now: int) -> list[Action]:
        port, frame = self.port, t.frame
        assert frame is not None
        t0 = self._write(t)
        req = port.frames.request_headers[frame]
        t1 = self.clock()
        status = port.submit(frame)
        t2 = self.clock()
        t.timings["write"] = t1 - t0
        if status is not None:
            refusal = self._refusal(Status(status), frame)
            self._forget(t)
            port.release(frame)
            t.timings["claim"] = t2 - t1
            return [self._answer(t, self._failure(t, refusal))]
        self._sent(t, req, t1, t2, now)
        return []

    def _write(self, t: Tracked) -> int:
        """Write ``t``'s request header into its frame (the ids are there already); when that began."""
        port, frame, work = self.port, t.frame, t.work
        assert frame is not None
        t0 = self.clock()
        req = port.frames.request_headers[frame]
        t.request_id = next(self._request_ids)
        assert t.formatter is not None
        write_header(
            req,
            request_id=t.request_id,
            token_count=t.input_count,
            max_new_tokens=work.max_tokens,
            flags=(wire.FLAG_STREAM if work.stream or t.formatter.watch else 0)
            | work.flags
            | (wire.constraint_flags(len(work.constraint)) if work.constraint is not None else 0)
            | work.tenant.cache_flags,
            sampling=work.sampling,
            t_receive_ns=t.request.t_receive_ns,
            t_tokenized_ns=t0,
        )
        req.bound(work.max_wait_ms)  # 0: the agent's own bound
        req.salted(work.salt)  # the prefix cache namespace: the tenant's and the request's cache_salt
        req.floored(work.tenant.floor_id, work.tenant.slot_floor)  # whose slot it claims: docs/TENANTS.md
        req.unsent()  # the agent stamps it when it sends the request (not yet, when it takes a slot back)
        return t0

    def _sent(self, t: Tracked, req: wire.RequestHeader, t1: int, t2: int, now: int) -> None:
        """``t`` is in flight (submitted at ``t1``, the port answered at ``t2``): its timings, its deadline."""
        assert t.frame is not None
        written = req.t_written_ns
        if written:
            t.timings["claim"] = written - t1
            t.timings["doorbell"] = t2 - written
        else:  # a slot is being taken back for it (docs/TENANTS.md): sent at the hand-over, its claim timed then
            t.handover_from = t1
        if req.predicted_ttft_us:
            t.timings["predicted_ttft"] = req.predicted_ttft_us * 1000
            t.timings["predicted_wait"] = req.predicted_wait_us * 1000
        t.phase = Phase.IN_FLIGHT
        t.deadline_ns = now + self.request_timeout_ns
        self.by_frame[t.frame] = t

    # -- n choices (edge/choices.py) -------------------------------------------------------------------
    def _submit_group(self, t: Tracked, now: int) -> list[Action]:
        """Make ``t``'s spare frames the requests of choices 1..n-1 (the same ids, their own seeds and formatters),
        then submit all n together: the agent claims n slots of one slot server, all or none."""
        port, frame, rid = self.port, t.frame, t.rid
        assert frame is not None and t.formatter is not None
        words = t.input_count + (0 if t.work.constraint is None else len(t.work.constraint))
        factory = self.formatters[t.route]
        self.tracked.pop(rid)
        t.rid = -next(self._member_keys)
        members = [t]
        for choice, spare in enumerate(t.spares, 1):
            port.frames.tokens[spare, :words] = port.frames.tokens[frame, :words]
            work = replace(
                t.work,
                sampling=choice_sampling(t.work.sampling, choice),
                options={**t.work.options, "choice": (t.formatter, choice)},
            )
            member = Tracked(
                -next(self._member_keys), t.request, t.route, work, factory(work, self.tokenizer), Phase.TOKENIZING,
                dict(t.timings), spare, input_count=t.input_count, choice=choice,
            )  # fmt: skip
            members.append(member)
        t.spares = []
        group = Choices(ChoiceGroup(rid, [m.rid for m in members], t.work.stream), t.route, t.request, members)
        for member in members:
            self.tracked[member.rid] = member
        refusal = next((over for m in members[1:] if (over := self._reserve(m)) is not None), None)
        if refusal is None:
            t0 = self.clock()
            for member in members:
                self._write(member)
            t1 = self.clock()
            status = port.submit_group([m.frame for m in members if m.frame is not None])
            t2 = self.clock()
            t.timings["write"] = t1 - t0
            if status is None:
                for member in members:
                    assert member.frame is not None
                    self.groups[member.rid] = group
                    self._sent(member, port.frames.request_headers[member.frame], t1, t2, now)
                self.groups[rid] = group
                return []
            refusal = self._refusal(Status(status), frame)
            t.timings["claim"] = t2 - t1
        for member in members:
            self._forget(member)
            assert member.frame is not None
            port.release(member.frame)
        response = self._failure(t, refusal)
        response.headers += t.limits
        return [self._respond(rid, t.route, t.request, t.timings, response)]

    def _grouped(self, actions: list[Action], now: int) -> list[Action]:
        """The actions of choices of several made the one answer to their request (:class:`ChoiceGroup`)."""
        out: list[Action] = []
        for action in actions:
            if action.rid >= 0:  # a client's own
                out.append(action)
                continue
            group = self.groups.get(action.rid)
            if group is None:
                continue  # a choice of a request answered already (another choice failed in the same event)
            combine, member = group.combine, action.rid
            formatter: Any = next(m.formatter for m in group.members if m.rid == member)  # a choices.Choice
            match action:
                case StartStream(_, status, headers):
                    out += combine.start(status, headers)
                case SendChunk(_, data):
                    out += combine.chunk(data)
                case EndStream(_, data):
                    out += combine.end(member, data, formatter)
                case Respond(_, response) if response.status == 200:
                    out += combine.whole(member, response, formatter)
                case _:
                    raise AssertionError(f"a choice answered {action!r}: its failures are its request's (_fail)")
            if combine.done:  # every choice answered and forgotten: only the keys are left
                for key in [combine.rid, *combine.members]:
                    self.groups.pop(key, None)
                self.metrics.answered(group.route, 200, now - group.request.t_receive_ns)
        return out

    def _drop_group(self, group: Choices, finish: str) -> None:
        """Forget ``group``; its choices still in flight are abandoned (``finish``: how they ended)."""
        self.groups.pop(group.combine.rid, None)
        for member in group.members:
            self.groups.pop(member.rid, None)
            if member.rid in self.tracked:
                self._forget(member, finish=finish)
                if member.frame is not None and member.phase is not Phase.TOKENIZING:
                    self.port.abandon(member.frame)

    def _release(self, t: Tracked) -> None:
        """Give back every frame ``t`` holds (a request of n choices holds n before it is submitted)."""
        for frame in [t.frame, *t.spares]:
            if frame is not None:
                self.port.release(frame)
        t.spares = []

    def _progress(self, t: Tracked, count: int, now: int) -> list[Action]:
        """A non-final delivery: ``count`` output tokens are placed so far."""
        t.deadline_ns = now + self.request_timeout_ns  # a stream that keeps producing is alive
        count = min(count, t.work.max_tokens)
        if count <= t.sent:
            return []
        if t.cached_first < 0 and t.frame is not None:
            t.cached_first = self.port.frames.result_headers[t.frame].cached_tokens  # placed with every progress word
        self._first_tokens(t, _tokens(t.work, count - t.sent), now)
        if t.work.stream:  # a stream's headers leave with its first tokens: they say when that was
            first_ns = now - t.request.t_receive_ns
            t.timings.setdefault("first_token", first_ns)
            self._waited(t, first_ns, now)
        work, formatter, frame = t.work, t.formatter, t.frame
        assert frame is not None and formatter is not None
        if not (work.stream or formatter.watch):
            t.sent = count  # counted for the first-token time; the answer goes out whole at the end
            return []
        ids = self.port.frames.outputs[frame, t.sent : count]
        t.sent = count
        data = formatter.tokens(ids)
        actions: list[Action] = []
        if work.stream:
            if t.phase is not Phase.STREAMING:
                self._return_path(t, frame, now)
                actions.append(self._start(t))
            if data:
                actions.append(SendChunk(t.rid, data))
        if formatter.done:
            actions.append(self._stopped(t, now))
        return actions

    def _stopped(self, t: Tracked, now: int) -> Action:
        """The formatter saw the end of the answer (a stop string) before the model did: answer with
        what came so far and abandon the frame, which cancels the slot -- it stops costing model time."""
        frame, formatter = t.frame, t.formatter
        assert frame is not None and formatter is not None
        tokens = np.array(self.port.frames.outputs[frame, : t.sent])
        cached = self._cached(t, frame)
        self.port.abandon(frame)
        first_ns = t.t_first_ns - t.request.t_receive_ns
        t.timings["first_token"] = first_ns
        self._waited(t, first_ns, now)
        self._forget(t, t.sent, cached, "stop")
        if t.choice == 0:
            self.metrics.prompt(t.input_count, cached)
        outcome = Outcome(t.request_id, t.input_count, tokens, Status.STOP.name, first_ns, cached)
        if not t.work.stream:
            return self._answer(t, formatter.complete(outcome))
        self._count(t, 200, now)
        return EndStream(t.rid, formatter.end(outcome))

    def _cached(self, t: Tracked, frame: int) -> int:
        """Prompt tokens of ``t`` its slot server took from its prefix cache (placed with every progress word).  A
        request that moved (its server gone, its slot taken back: docs/MIGRATION.md) was sent again with its answer
        so far after its prompt, and that placement counts over both -- its own KV reused, more than its prompt: its
        first placement's count, seen with its first output, else no more than its prompt."""
        cached = int(self.port.frames.result_headers[frame].cached_tokens)
        if not self.port.frames.request_headers[frame].migrations:
            return cached
        return t.cached_first if t.cached_first >= 0 else min(cached, t.input_count)

    def _first_tokens(self, t: Tracked, new: int, now: int) -> None:
        """Time to first token and inter-token latency (a delivery of ``new`` tokens after a gap
        counts as ``new`` tokens spaced evenly over it)."""
        if t.t_first_ns == 0:
            t.t_first_ns = now
            if t.choice == 0:  # a request's time to first token, once for its n choices
                self.metrics.first_token(now - t.request.t_receive_ns, now)
        else:
            self.metrics.inter_token((now - t.t_last_ns) / new, new)
        t.t_last_ns = now

    def _waited(self, t: Tracked, first_ns: int, now: int) -> None:
        """Measure the request's wait for its first token, once: its time to first token (``first_ns``) minus
        what its own uncached prompt takes on an idle server, as the model side's cost model says (sent with
        the first token); with the agent's prediction, for the prediction's error."""
        if t.waited or t.frame is None or first_ns <= 0:
            return
        t.waited = True
        written = self.port.frames.request_headers[t.frame].t_written_ns
        if t.handover_from and written >= t.handover_from:  # the claim: taking the slot back and the hand-over
            t.timings["claim"] = written - t.handover_from
        own = self.port.frames.result_headers[t.frame].prefill_us * 1000
        wait = max(0, first_ns - own)
        t.timings["wait"] = wait
        if t.choice == 0:
            self.metrics.waited(wait, t.timings.get("predicted_ttft", 0), first_ns, now)

    def _return_path(self, t: Tracked, frame: int, now: int) -> None:
        """The return path's cost for a stream's first token: the model side stamped when it produced it
        (same host clock); ``now`` is when its event goes to the transport (in ``Server-Timing`` as ``return``)."""
        produced = self.port.frames.result_headers[frame].t_first_ns
        if 0 < produced <= now:
            t.timings["return"] = now - produced
            self.metrics.return_path(now - produced)

    def _start(self, t: Tracked) -> StartStream:
        assert t.formatter is not None
        status, headers = t.formatter.start()
        t.phase = Phase.STREAMING
        return StartStream(t.rid, status, headers + t.limits + timing_headers(t.timings))

    def _final(self, t: Tracked, now: int) -> list[Action]:
        port, frame = self.port, t.frame
        assert frame is not None and t.formatter is not None
        result = port.frames.result_headers[frame]
        status = result.status
        if status in wire.REFUSALS:  # an agent process answers its refusals through the port
            self._forget(t, NOTHING_RAN)
            refusal = self._refusal(Status(status), frame)
            port.release(frame)
            if t.rid < 0:  # a choice's: its request's answer, the other choices abandoned
                return self._fail(t, refusal)
            return [self._answer(t, self._failure(t, refusal))]
        edge_ns = result.t_ready_ns - port.frames.request_headers[frame].t_receive_ns
        t.timings["edge"] = edge_ns
        self.metrics.edge(edge_ns, now)
        if status not in wire.FINISHED:
            self._forget(t, finish="failed")
            port.release(frame)
            return self._fail(t, HttpError(502, "slot_error", f"slot server answered status {_status_name(status)}"))
        # The client's max_tokens is a contract of this API: a handler that wrote more is cut there.
        count = min(result.output_count, t.work.max_tokens)
        tokens = np.array(port.frames.outputs[frame, :count])
        model_first = result.t_first_ns
        cached = self._cached(t, frame)
        port.release(frame)
        if t.choice == 0:
            self.metrics.prompt(t.input_count, cached)
        if count > t.sent:
            self._first_tokens(t, _tokens(t.work, count - t.sent), now)
        # streamed: when the first token left the edge; whole: the model side's own first-token time
        # when it reports one (same host clock), else when the edge first saw output
        first_at = t.t_first_ns if t.work.stream else (model_first or t.t_first_ns)
        first_ns = first_at - t.request.t_receive_ns if first_at else 0
        if first_ns:
            t.timings["first_token"] = first_ns
            self._waited(t, first_ns, now)
        finish = "stop" if t.formatter.done or status in (Status.STOP, Status.OK) else _status_name(status).lower()
        self._forget(t, count, cached, finish)
        if not t.work.stream:
            outcome = Outcome(t.request_id, t.input_count, tokens, _status_name(status), first_ns, cached)
            return [self._answer(t, t.formatter.complete(outcome))]
        actions: list[Action] = []
        if t.phase is not Phase.STREAMING:
            actions.append(self._start(t))
        last = t.formatter.tokens(tokens[t.sent :]) if count > t.sent else b""
        name = Status.STOP.name if t.formatter.done else _status_name(status)
        outcome = Outcome(t.request_id, t.input_count, tokens, name, first_ns, cached)
        self._count(t, 200, now)
        actions.append(EndStream(t.rid, last + t.formatter.end(outcome)))
        return actions

    # -- tokenize only -------------------------------------------------------------------------------
    def _tokenize_only(self, rid: int, request: Request, work: Work, timings: dict[str, int]) -> list[Action]:
        route = TOKENIZE
        if work.prompt is None:
            assert work.tokens is not None
            return [self._respond(rid, route, request, timings, self.core.tokenize_response(work.tokens))]
        if len(work.prompt) > INLINE_CHARS:
            if self.busy_workers >= self.workers:
                return [self._respond(rid, route, request, timings, error_response(self.core.busy()))]
            t = Tracked(rid, request, route, work, None, Phase.TOKENIZING, timings)
            self.tracked[rid] = t
            return [self._to_worker(t, work.prompt, None)]
        t0 = self.clock()
        try:
            ids = self.tokenizer.encode(work.prompt)
        except Exception as exc:
            return self._tokenizer_failed(Tracked(rid, request, route, work, None, Phase.TOKENIZING, timings), exc)
        timings["tokenize"] = self.clock() - t0
        return [self._respond(rid, route, request, timings, self.core.tokenize_response(ids.tolist()))]

    # -- helpers --------------------------------------------------------------------------------------
    def _to_worker(
        self,
        t: Tracked,
        prompt: str | None,
        out: np.ndarray | None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Tokenize:
        self.busy_workers += 1
        t.timings["tokenize_start"] = self.clock()
        return Tokenize(t.rid, prompt, out, messages, tools)

    def _tokenizer_failed(self, t: Tracked, exc: BaseException) -> list[Action]:
        """A tokenizer exception answers its own request with 500 -- or 400 when the model's chat template
        refused the messages (a ValueError); the server keeps serving."""
        self._forget(t)
        self._release(t)
        if "messages" in t.work.options and isinstance(exc, ValueError):
            error = HttpError(400, "invalid_request", f"the chat could not be rendered: {exc}")
        else:
            log.error("tokenizer failed on a %d-character prompt: %r", len(t.work.prompt or ""), exc)
            error = HttpError(500, "tokenizer_error", f"the tokenizer failed: {exc}")
        failure = self._failure(t, error)
        return [self._answer(t, failure)]

    def _refusal(self, status: Status, frame: int) -> HttpError:
        """The answer to a request the data path refused before any slot ran it (``frame``: its frame, whose
        headers say the bound and, for OVER_BOUND, the least predicted wait)."""
        result = self.port.frames.result_headers[frame]
        if status == Status.NO_SLOT:
            self.metrics.refused("no_slot")
            return self.core.no_slot(result.retry_after_ms)
        if status == Status.OVER_BOUND:
            self.metrics.refused("over_bound")
            return self.core.over_bound(result.refusal_wait_us / 1e3, result.refusal_bound_ms, result.retry_after_ms)
        if status == Status.UNAVAILABLE:
            return HttpError(503, "unavailable", "no slot server is reachable")
        return HttpError(400, "bad_request", "the data path refused this request")

    @staticmethod
    def _failure(t: Tracked, error: HttpError) -> Response:
        """An error answer in the route's shape (its formatter's), or edgepath's for /v1/tokenize."""
        return t.formatter.failure(error) if t.formatter is not None else error_response(error)

    def _fail(self, t: Tracked, error: HttpError) -> list[Action]:
        """An error answer: a response, or the error event that ends a stream already started.  A choice of several
        answers for its whole request (once), and the other choices are abandoned."""
        group = self.groups.get(t.rid)
        if group is not None:
            self._drop_group(group, "failed")
            started = group.combine.started
            self.metrics.answered(group.route, error.status, self.clock() - group.request.t_receive_ns)
            rid = group.combine.rid
            assert t.formatter is not None
            if started:
                return [EndStream(rid, t.formatter.error(error))]
            response = self._failure(t, error)
            response.headers += t.limits + timing_headers(t.timings)
            return [Respond(rid, response)]
        if t.rid < 0:
            return []  # a choice of a request already answered
        if t.phase is Phase.STREAMING:
            assert t.formatter is not None
            self._count(t, error.status, self.clock())
            return [EndStream(t.rid, t.formatter.error(error))]
        return [self._answer(t, self._failure(t, error))]

    def _state(self, query: StateQuery, now: int) -> Response:
        if query.route == METRICS:
            return Response(200, [(b"content-type", self.metrics.content_type.encode())], self.metrics.exposition())
        if query.route == LIVE:
            return self.core.live_response()
        listed = self.port.servers()  # reads the servers' heartbeats too: the verdict is current
        verdict = readiness(self.port.links_health(), now / 1e9)
        if self.draining:
            verdict = Readiness(False, "draining", "this edge is stopping: it takes no new requests")
        if query.route == READY:
            return self.core.ready_response(verdict)
        counts = [(s.free_slots, s.total_slots) for s in listed]
        if listed and all(free is not None and total is not None for free, total in counts):
            free, total = sum(f for f, _ in counts), sum(t for _, t in counts)  # type: ignore[misc]  # the same READs
        else:
            free, total = self.port.free_slots()
        servers = [slot_server_entry(server, now / 1e9) for server in listed]
        return self.core.health_response(
            free,
            total,
            verdict,
            query.query,
            lambda pct: self.metrics.window.percentile(pct, now),
            servers,
            {
                "ttft": lambda pct: self.metrics.ttft_window.percentile(pct, now),
                "wait": lambda pct: self.metrics.wait_window.percentile(pct, now),
            },
        )

    def _forget(self, t: Tracked, output: int | None = None, cached: int = 0, finish: str = "failed") -> None:
        """The edge owes ``t`` nothing more.  A request that ran on a slot (submitted, and not refused by the data
        path: ``output`` :data:`NOTHING_RAN`) is charged its prompt and the tokens of its ``output`` words (None: those
        the client was sent) against its quota, and its usage (``cached`` prompt tokens from the cache, how it ended:
        ``finish``) goes to the per-tenant metrics and the usage log; one that did not run is charged nothing."""
        self.tracked.pop(t.rid, None)
        if t.frame is not None and self.by_frame.get(t.frame) is t:
            del self.by_frame[t.frame]
        if t.capped:
            t.capped = False
            self.in_flight[t.work.tenant.name] -= 1
        ran = t.phase is not Phase.TOKENIZING and output != NOTHING_RAN
        completion = _tokens(t.work, t.sent if output is None else output) if ran else 0  # words to tokens
        if t.reservation is not None:
            self.quotas.settle(t.reservation, _prompt(t) + completion, self.wall_clock(), ran=ran)
            t.reservation = None
        if ran:
            self._account(t, completion, cached, finish)

    def _account(self, t: Tracked, completion: int, cached: int, finish: str) -> None:
        """One request's usage: per-tenant counters, and a line of the usage log (when there is one)."""
        tenant = t.work.tenant.name
        self.metrics.tenant_usage(tenant, finish, _prompt(t), cached if t.choice == 0 else 0, completion)
        if self.usage is not None:
            first, wait = t.timings.get("first_token"), t.timings.get("wait")
            self.usage(
                Usage(
                    tenant,
                    t.request_id,
                    t.route,
                    None if t.formatter is None else t.formatter.model,
                    _prompt(t),
                    cached if t.choice == 0 else 0,
                    completion,
                    finish,
                    None if first is None else round(first / 1e6, 3),
                    None if wait is None else round(wait / 1e6, 3),
                    None if t.formatter is None else t.formatter.answer_id,
                )
            )

    def _count(self, t: Tracked, status: int, now: int) -> None:
        total = now - t.request.t_receive_ns
        t.timings["total"] = total
        if t.rid >= 0:  # a choice of several is counted with its request (_grouped)
            self.metrics.answered(t.route, status, total)

    def _answer(self, t: Tracked, response: Response) -> Respond:
        """The one answer to ``t``, with its rate-limit headers."""
        response.headers += t.limits
        return self._respond(t.rid, t.route, t.request, t.timings, response)

    def _respond(self, rid: int, route: str, request: Request, timings: dict[str, int], response: Response) -> Respond:
        total = self.clock() - request.t_receive_ns
        timings["total"] = total
        if rid >= 0:  # a choice of several is counted with its request (_grouped)
            self.metrics.answered(route, response.status, total)
        response.headers += timing_headers(timings)
        return Respond(rid, response)


def slot_server_entry(server: SlotServerStatus, now: float) -> dict[str, Any]:
    """One slot server in ``/health``: where it is, whether its link is up, its state (up, unresponsive,
    down), why and for how long (``now``: the port's clock, seconds), its slots and what this edge's
    agent claimed there."""
    health = server.health
    entry: dict[str, Any] = {
        "address": health.address,
        "state": health.state.value,
        "link": "down" if health.state is LinkState.DOWN else "up",
        "reason": "" if health.up else health.describe(now),
        "for_s": round(max(0.0, now - health.since), 3),
    }
    counts = {
        "free_slots": server.free_slots,
        "total_slots": server.total_slots,
        "claims": server.claims,
        "reattaches": server.reattaches,
    }
    entry.update((key, value) for key, value in counts.items() if value is not None)  # None: not known here
    return entry


_STATUS_NAMES = {int(status): status.name for status in Status}


def _status_name(status: int) -> str:
    return _STATUS_NAMES.get(status) or str(status)


def _route_of(request: Request) -> str:
    """The metrics label of a request: its path if it is one of the API's, else "other" (bounded cardinality)."""
    path = request.target.split("?", 1)[0]
    return path if path in ROUTES else "other"
