"""The edge's request lifecycle, sans I/O: events and ``now`` in, actions out.

A request is received -> routed and validated (:class:`~edgepath.edge.routes.HttpCore`) -> given a frame of the
agent port (none free, its tenant at its ``slot_cap``, or no slot it could claim now: 429 before the prompt costs
anything, :mod:`edgepath.edge.admission`) -> tokenized straight into the frame (:mod:`edgepath.edge.tokenizing`:
inline, or on a worker when the prompt is large; all busy: 429, never a waiting line) -> admitted by its tenant's
gate (quotas, slot cap: :mod:`edgepath.edge.tenancy.gate`) -> submitted (alone, or with its other choices:
:mod:`edgepath.edge.choices`) -> answered from the port's deliveries: one response, or a stream started at the
first output, one event chunk per delivery and an end.  A request past its deadline (504) or whose client went
away is abandoned on the port, which fences and frees the frame: the edge holds nothing for it afterwards.

Nothing here reads a clock, opens a socket, starts a thread or waits: the driver
(:class:`~edgepath.edge.service.EdgeService`) passes ``now`` with every event and carries out the
returned actions; the port's calls never block.  Stage durations inside one event (tokenize,
write, claim) are measured with the injected ``clock`` -- the one place fine-grained time is
needed -- so a test can drive everything with a fake port and a fake clock.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping

import numpy as np

from edgepath.contract import wire
from edgepath.dpu.port import AgentPort, Delivery
from edgepath.edge.actions import EndStream, Respond, SendChunk, StartStream
from edgepath.edge.admission import Admission, draining
from edgepath.edge.apis.generate import GenerateFormatter, tokenize_response
from edgepath.edge.billing import Billing
from edgepath.edge.choices import Choices, Groups
from edgepath.edge.grammars import GrammarCache
from edgepath.edge.http import (
    GENERATE,
    Formatter,
    HttpError,
    Outcome,
    Request,
    Response,
    StateQuery,
    Work,
    timing_headers,
)
from edgepath.edge.measure import Measure
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.ops import OpsPages, unresponsive
from edgepath.edge.routes import HttpCore, route_label
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.text.tokenizer import Tokenizer
from edgepath.edge.tokenizing import Tokenizing, tokenizer_error
from edgepath.edge.tracked import (
    CLIENT_GONE,
    NOTHING_RAN,
    Action,
    Phase,
    Tokenize,
    Tracked,
    output_tokens,
    write_request,
)
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.edge")

#: how a route's formatter is made for one request (``/v1/generate`` by default)
FormatterFactory = Callable[[Work, Tokenizer], Formatter]
DEFAULT_FORMATTERS: Mapping[str, FormatterFactory] = {GENERATE: lambda work, tok: GenerateFormatter(tok.decode)}


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
        gate: TenantGate | None = None,
    ) -> None:
        """``gate``: the tenants' slot caps, quotas and usage log (none: quotas in this edge's own words, no log)."""
        if request_timeout_ns <= 0:
            raise ValueError(f"request timeout must be positive, got {request_timeout_ns} ns")
        self.core = core
        self.refusals = core.refusals
        self.tokenizer = tokenizer
        self.port = port
        self.metrics = metrics
        self.clock = clock
        self.tokenizing = Tokenizing(tokenizer, clock, workers)  # where prompts become ids (edge/tokenizing.py)
        self.request_timeout_ns = request_timeout_ns
        self.formatters = formatters
        self.tracked: dict[int, Tracked] = {}
        self.by_frame: dict[int, Tracked] = {}
        self._request_ids = itertools.count(1)
        self.unmatched = 0  # deliveries for a frame the edge does not track (a port bug if ever non-zero)
        self.broken = 0  # deliveries whose handling raised (an edge bug if ever non-zero; each one logged)
        self.gate = gate if gate is not None else TenantGate()
        #: who is refused before a request costs anything: draining, shedding, body budgets, caps, quotas, no slot
        self.admission = Admission(core, port, metrics, self.gate)
        self.ops = OpsPages(port, metrics)
        self.measure = Measure(port.frames, metrics)
        self.billing = Billing(
            self.gate, metrics, self.measure, request_timeout_ns
        )  # what each request is charged, and when
        self.groups = Groups(metrics)  # requests of n choices in flight (edge/choices.py)
        self.grammars = GrammarCache()  # built grammars by tenant and schema digest (edge/grammars.py)

    # -- events ----------------------------------------------------------------------------------
    def head(self, rid: int, request: Request, length: int | None, now: int) -> list[Action] | None:
        """A request's head arrived, its body not read yet (``request.body`` empty; ``length``: its declared
        Content-Length, None: none).  Its answer now when it is refused from its headers alone (edge/admission.py),
        for the price of its headers and a word or two of load state (no parse, no template, no tokenizer: issue 52);
        None: read its body (it is judged again, whole)."""
        response = self.admission.head(request, length or 0, now)
        return None if response is None else [self._respond(rid, route_label(request), request, {}, response)]

    def receive(self, rid: int, request: Request, now: int) -> list[Action]:
        """A complete request arrived (``rid``: the driver's key for its reply channel; ``now``: read
        from the same monotonic clock as ``clock`` and the request's timestamps)."""
        arrival = request.t_arrival_ns if request.t_arrival_ns is not None else request.t_receive_ns
        timings = {"queue": now - arrival}
        handled = self.core.handle(request)
        timings["parse"] = self.clock() - now
        if request.body:  # its tenant's budget pays for the bytes read (edge/body_budget.py)
            tenant = handled.tenant.name if isinstance(handled, Work) else self.core.tenant_of(request)
            self.admission.bodies.take(tenant, len(request.body), now)
        if isinstance(handled, Response):
            return [self._respond(rid, route_label(request), request, timings, handled)]
        if isinstance(handled, StateQuery):
            return [
                self._respond(
                    rid, handled.route, request, timings, self.ops.answer(handled, now, self.admission.draining)
                )
            ]
        error = self.admission.overloaded()  # before any of the work's memory is spent; what is under way goes on
        if error is not None:
            return [
                self._respond(rid, route_label(request), request, timings, self.core.refusal(request.target, error))
            ]
        if handled.kind == "tokenize":
            return self._tokenize_only(rid, request, handled, timings)
        return self.groups.fan_in(self._generate(rid, request, handled, timings, now), now)

    def refuse(self, rid: int, request: Request, response: Response) -> list[Action]:
        """An adapter's early refusal (413 while the body arrives, 408 when it comes too slowly),
        answered and counted like every other response."""
        return [self._respond(rid, route_label(request), request, {}, response)]

    def tokenized(
        self, rid: int, result: int | np.ndarray | BaseException, now: int, words: np.ndarray | None = None
    ) -> list[Action]:
        """A worker finished a :class:`Tokenize` action: the count written into the frame, the ids
        (``/v1/tokenize``), or the exception it raised; ``words``: the grammar it built (kept for its tenant)."""
        t = self.tracked.get(rid)
        if t is None:
            raise KeyError(f"tokenized() for request {rid}, which is not waiting for a tokenizer")
        self.tokenizing.done(t, now)
        grammar = t.work.grammar
        if words is not None and grammar is not None:
            self.grammars.put(t.work.tenant.name, grammar.digest, words)
            refused = _after_prompt(t.work, words)
            if refused is not None and not isinstance(result, BaseException):
                result = refused
        if t.gone:
            self._forget(t)
            self._release(t)
            self._count(t, CLIENT_GONE, now)
            return []
        if isinstance(result, BaseException):
            return self._refused(t, tokenizer_error(t.work, result))
        if isinstance(result, np.ndarray):
            self._forget(t)
            return [self._respond(rid, t.route, t.request, t.timings, _ids_answer(t.work, result))]
        if t.work.counted is not None:  # a count alone, in its API's shape
            self._forget(t)
            return [self._respond(rid, t.route, t.request, t.timings, t.work.counted(result))]
        return self.groups.fan_in(self._tokenized_into_frame(t, result, now), now)

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
        self._abandon(t, "cancelled")
        self._count(t, CLIENT_GONE, now)
        return []

    def deliveries(self, deliveries: list[Delivery], now: int) -> list[Action]:
        """Output from the port: stream what is new, answer what is final."""
        actions: list[Action] = []
        for delivery in deliveries:
            if delivery.abandoned:  # given up before its answer: charged what was computed for it
                self.billing.computed(delivery)
                continue
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
        return self.groups.fan_in(actions, now)

    def tick(self, now: int) -> list[Action]:
        """Periodic: frames lost with a slot server -> 503; frames on a slot server that became unresponsive
        -> 504 at once (and abandoned); requests past their deadline -> 504 (and abandoned); a slot server
        that went away is re-attached as soon as it is back."""
        port = self.port
        actions: list[Action] = []
        port.revive()  # a no-op while every link is up; one of several may be down while alive() is True
        self.billing.expire(now)
        lost = [(index, t) for index in port.check_links() if (t := self.by_frame.get(index)) is not None]
        for index, t in lost:  # all of them first: a lost choice's group must not abandon the others lost with it
            self._forget(t)
            port.release(index)
        for _, t in lost:
            actions += self._fail(t, HttpError(503, "unavailable", "the slot server went away"))
        stalled = port.stalled()
        if stalled:
            why = unresponsive(port.links_health(), now)
            for index in stalled:
                t = self.by_frame.get(index)
                if t is not None:
                    self._abandon(t, "failed")
                    actions += self._fail(t, HttpError(504, "unresponsive", f"no result: {why}"))
        for t in [t for t in self.tracked.values() if t.phase is not Phase.TOKENIZING and now > t.deadline_ns]:
            if t.rid not in self.tracked:
                continue  # a choice whose group was answered (and abandoned) by another choice's timeout
            self._abandon(t, "timeout")
            actions += self._fail(t, HttpError(504, "timeout", "no result from the slot server in time"))
        return self.groups.fan_in(actions, now)

    # -- generate ----------------------------------------------------------------------------------
    def _generate(self, rid: int, request: Request, work: Work, timings: dict[str, int], now: int) -> list[Action]:
        route = work.route
        factory = self.formatters.get(route)
        if factory is None:
            raise LookupError(f"no formatter for route {route!r}; have {sorted(self.formatters)}")
        formatter = factory(work, self.tokenizer)
        if work.grammar is not None:  # its words when its tenant sent the schema before; else a worker builds them
            words = self.grammars.get(work.tenant.name, work.grammar.digest)
            refused = None if words is None else _after_prompt(work, words)
            if refused is not None:
                return [self._respond(rid, route, request, timings, formatter.failure(refused))]
        if self.admission.draining:
            return [self._respond(rid, route, request, timings, formatter.failure(draining()))]
        if self.tokenizing.full(work):
            return [self._respond(rid, route, request, timings, formatter.failure(self.refusals.busy()))]
        held = self.admission.frames(work, formatter)
        if isinstance(held, Response):
            return [self._respond(rid, route, request, timings, held)]
        frame = held[0]
        t = Tracked(rid, request, route, work, formatter, Phase.TOKENIZING, timings, frame)
        t.spares = held[1:]
        self.tracked[rid] = t
        # registered memory: the ids are written here, once (a chat through the model's own template)
        started = self.tokenizing.start(t, self.port.frames.tokens[frame])
        if isinstance(started, Tokenize):
            return [started]
        if isinstance(started, BaseException):
            return self._refused(t, tokenizer_error(t.work, started))
        assert isinstance(started, int)
        return self._tokenized_into_frame(t, started, now)

    def _tokenized_into_frame(self, t: Tracked, n: int, now: int) -> list[Action]:
        assert t.frame is not None
        t.input_count = n
        constraint = t.work.constraint
        try:
            self.core.limits.check_length(n, 0 if constraint is None else len(constraint))
        except HttpError as exc:
            return self._refused(t, exc)
        over = self.admission.admit(t)
        if over is not None:
            return self._refused(t, over)
        if constraint is not None:  # the grammar goes after the prompt, sent with it in the one WRITE
            self.port.frames.tokens[t.frame, n : n + len(constraint)] = constraint
        if t.spares:
            return self._submit_group(t, now)
        refusal = self._submit([t], now)
        return [] if refusal is None else [self._answer(t, self._failure(t, refusal))]

    def _submit(self, members: list[Tracked], now: int) -> HttpError | None:
        """The one way requests go to the agent: every member's header written (its ids are in its frame already),
        then submitted -- one request alone, the choices of one request together (the agent claims them on one
        slot server, all or none).  On a refusal every member is forgotten and its frame released; the refusal
        is returned for the caller to answer."""
        port, lead = self.port, members[0]
        frames = [m.frame for m in members if m.frame is not None]
        assert len(frames) == len(members)
        t0 = self.clock()
        for member in members:
            self._write(member)
        t1 = self.clock()
        status = port.submit(frames[0]) if len(frames) == 1 else port.submit_group(frames)
        t2 = self.clock()
        lead.timings["write"] = t1 - t0
        if status is None:
            for member, frame in zip(members, frames, strict=True):
                self._sent(member, port.frames.request_headers[frame], t1, t2, now)
            return None
        refusal = self.admission.data_path(Status(status), frames[0])
        lead.timings["claim"] = t2 - t1
        for member, frame in zip(members, frames, strict=True):
            self._forget(member)
            port.release(frame)
        return refusal

    def _write(self, t: Tracked) -> None:
        """Write ``t``'s request header into its frame (the ids are there already), under a new request id."""
        assert t.frame is not None
        t.request_id = next(self._request_ids)
        write_request(self.port.frames.request_headers[t.frame], t, self.clock())

    def _sent(self, t: Tracked, req: wire.RequestHeader, t1: int, t2: int, now: int) -> None:
        """``t`` is in flight (submitted at ``t1``, the port answered at ``t2``): its timings, its deadline."""
        assert t.frame is not None
        self.measure.sent(t, req, t1, t2)
        t.phase = Phase.IN_FLIGHT
        t.deadline_ns = now + self.request_timeout_ns
        self.by_frame[t.frame] = t

    # -- n choices (edge/choices.py) -------------------------------------------------------------------
    def _submit_group(self, t: Tracked, now: int) -> list[Action]:
        """Make ``t``'s spare frames the requests of choices 1..n-1 (edge/choices.py), then submit all n together:
        the agent claims n slots of one slot server, all or none."""
        rid, factory = t.rid, self.formatters[t.route]
        self.tracked.pop(rid)
        group = self.groups.fan_out(t, lambda work: factory(work, self.tokenizer), self.port.frames.tokens)
        members = group.members
        for member in members:
            self.tracked[member.rid] = member
        refusal = next((over for m in members[1:] if (over := self.admission.admit(m)) is not None), None)
        if refusal is None:
            refusal = self._submit(members, now)
            if refusal is None:
                self.groups.add(group)
                return []
        else:
            for member in members:
                self._forget(member)
                assert member.frame is not None
                self.port.release(member.frame)
        response = self._failure(t, refusal)
        response.headers += t.limits
        return [self._respond(rid, t.route, t.request, t.timings, response)]

    def _drop_group(self, group: Choices, finish: str) -> None:
        """Forget ``group``; its choices still in flight are abandoned (``finish``: how they ended)."""
        for member in self.groups.drop(group):
            if member.rid in self.tracked:
                self._abandon(member, finish)

    def _abandon(self, t: Tracked, finish: str) -> None:
        """Forget ``t`` and give up its frame on the port, which cancels its slot (``finish``: how it ended); it is
        charged what its slot server computed for it, when that is known (edge/billing.py)."""
        if t.frame is None or t.phase is Phase.TOKENIZING:
            self._forget(t, finish=finish)
            return
        self._untrack(t)
        self.port.abandon(t.frame)
        self.billing.defer(t, finish)

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
        self.measure.progress(t, output_tokens(t.work, count - t.sent), now)
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
                self.measure.return_path(t, frame, now)
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
        cached, first_ns = self.measure.stopped(t, frame, now)
        self.port.abandon(frame)
        self._forget(t, t.sent, cached, "stop")
        outcome = Outcome(t.request_id, t.input_count, tokens, Status.STOP.name, first_ns, cached)
        if not t.work.stream:
            return self._answer(t, formatter.complete(outcome))
        self._count(t, 200, now)
        return EndStream(t.rid, formatter.end(outcome))

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
            refusal = self.admission.data_path(Status(status), frame)
            port.release(frame)
            if t.rid < 0:  # a choice's: its request's answer, the other choices abandoned
                return self._fail(t, refusal)
            return [self._answer(t, self._failure(t, refusal))]
        self.measure.edge(t, frame, now)
        if status not in wire.FINISHED:
            self._forget(t, finish="failed")
            port.release(frame)
            return self._fail(t, HttpError(502, "slot_error", f"slot server answered status {_status_name(status)}"))
        # The client's max_tokens is a contract of this API: a handler that wrote more is cut there.
        count = min(result.output_count, t.work.max_tokens)
        tokens = np.array(port.frames.outputs[frame, :count])
        cached, first_ns = self.measure.final(t, frame, output_tokens(t.work, count - t.sent), now)
        port.release(frame)
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
        """``/v1/tokenize`` (the ids), or a count alone in its API's shape (``work.counted``: Anthropic's
        ``count_tokens``, a chat through the model's template, counted in a scratch array -- never a frame)."""
        route = work.route
        if work.prompt is None and work.counted is None:
            assert work.tokens is not None
            return [self._respond(rid, route, request, timings, tokenize_response(work.tokens))]
        if self.tokenizing.full(work):
            return [
                self._respond(rid, route, request, timings, self.core.refusal(request.target, self.refusals.busy()))
            ]
        t = Tracked(rid, request, route, work, None, Phase.TOKENIZING, timings)
        scratch = np.empty(self.core.limits.input_capacity, np.int32) if work.counted is not None else None
        started = self.tokenizing.start(t, scratch)
        if isinstance(started, Tokenize):
            self.tracked[rid] = t
            return [started]
        if isinstance(started, BaseException):
            return self._refused(t, tokenizer_error(t.work, started))
        if work.counted is not None:
            assert isinstance(started, int)
            return [self._respond(rid, route, request, timings, work.counted(started))]
        assert isinstance(started, np.ndarray)
        return [self._respond(rid, route, request, timings, _ids_answer(work, started))]

    # -- helpers --------------------------------------------------------------------------------------
    def _refused(self, t: Tracked, error: HttpError) -> list[Action]:
        """``t`` refused before it was submitted: forgotten, its frames given back, ``error`` its answer.  A tokenizer
        exception is one (edge/tokenizing.py says how it answers): the server keeps serving."""
        self._forget(t)
        self._release(t)
        return [self._answer(t, self._failure(t, error))]

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

    def _forget(self, t: Tracked, output: int | None = None, cached: int = 0, finish: str = "failed") -> None:
        """The edge owes ``t`` nothing more.  A request that ran on a slot (submitted, and not refused by the data
        path: ``output`` :data:`NOTHING_RAN`) is charged its prompt and the tokens of its ``output`` words (None: those
        the client was sent), with ``cached`` prompt tokens and how it ended (``finish``); one that did not run is
        charged nothing (edge/billing.py)."""
        self._untrack(t)
        ran = t.phase is not Phase.TOKENIZING and output != NOTHING_RAN
        self.billing.charge(t, ran, t.sent if output is None else output, cached, finish)

    def _untrack(self, t: Tracked) -> None:
        self.tracked.pop(t.rid, None)
        if t.frame is not None and self.by_frame.get(t.frame) is t:
            del self.by_frame[t.frame]

    def _failure(self, t: Tracked, error: HttpError) -> Response:
        """An error answer in the route's shape: its formatter's, or (a tokenize call) its path's API's."""
        return t.formatter.failure(error) if t.formatter is not None else self.core.refusal(t.request.target, error)

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


_STATUS_NAMES = {int(status): status.name for status in Status}


def _status_name(status: int) -> str:
    return _STATUS_NAMES.get(status) or str(status)


def _ids_answer(work: Work, ids: np.ndarray) -> Response:
    """A tokenize request's answer: its route's shape (``options["answer"]``: llama-server's ``/tokenize``), else
    ``/v1/tokenize``'s."""
    answer = work.options.get("answer")
    return answer(ids) if answer is not None else tokenize_response(ids.tolist())


def _after_prompt(work: Work, grammar: np.ndarray) -> HttpError | None:
    """``work``'s words after its prompt, now that its grammar's are built: them, then its logit biases; a 400 naming
    both when together they are too many to travel."""
    assert work.grammar is not None
    try:
        work.constraint = wire.grammar_then_biases(grammar, work.sampling.logit_bias)
    except wire.RequestInvalid as exc:
        param = work.grammar.param
        return HttpError(400, "invalid_value", f"'{param}' and 'logit_bias' together: {exc}", param=param)
    return None
