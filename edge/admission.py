"""Who the edge refuses before a request costs anything, and why -- apart from the request state machine, sans I/O.

The cheapest reasons first: the edge stopping (503 ``draining``) or shedding for memory (503 ``overloaded``); the
tenant past its budget of body bytes, at its ``slot_cap`` or out of quota; no frame of the port, or no slot the agent
could claim for it now (429s, counted in ``/metrics``).  :class:`~edgepath.edge.lifecycle.EdgeLifecycle` asks at a
request's head, before its prompt is templated or tokenized, and when it reserves the prompt against its quotas.
"""

from __future__ import annotations

from edgepath.dpu.port import AgentPort
from edgepath.edge.body_budget import DEFAULT_BODY_RATE, BodyBudget
from edgepath.edge.http import Formatter, HttpError, Request, Response, Work
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.overload import MemoryGuard
from edgepath.edge.routes import HttpCore
from edgepath.edge.tenancy.gate import TenantGate
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.tracked import Tracked, output_tokens, prompt_charged
from edgepath.native.abi import Status


def draining() -> HttpError:
    """503 for a new request while the edge stops (SIGTERM): another edge takes it."""
    return HttpError(503, "draining", "this edge is stopping: send the request again (another edge takes it)")


class Admission:
    """The refusals before a request runs, from its head, its tenant's gate and the port's load words."""

    def __init__(self, core: HttpCore, port: AgentPort, metrics: EdgeMetrics, gate: TenantGate) -> None:
        self.core, self.refusals, self.port, self.metrics, self.gate = core, core.refusals, port, metrics, gate
        #: the edge is stopping (SIGTERM): new generations get 503 ``draining``, /health/ready 503, the rest finish
        self.draining = False
        #: the edge's memory is over its high-water mark (edge/overload.py): new work gets 503 ``overloaded``
        self.memory = MemoryGuard()
        self.budget_bodies(DEFAULT_BODY_RATE, core.limits.max_body)  # the driver sets --body-rate

    def budget_bodies(self, rate: int, max_body: int) -> None:
        """Each tenant may have ``rate`` bytes of bodies read a second (``--body-rate``; 0: no budget), and as many of
        refused ones thrown away."""
        #: each tenant's budget of body bytes read per second (edge/body_budget.py)
        self.bodies = BodyBudget(rate, max(rate, max_body))
        #: each tenant's bucket for the bodies of its requests refused from their head, read only to be thrown away
        #: (the same rate, a bucket of its own: a refusal's bytes are paced without spending what its next request
        #: may use)
        self.drops = BodyBudget(rate, max(rate, max_body))

    def head(self, request: Request, length: int, now: int) -> Response | None:
        """The answer to a request refused from its head alone (its path, method or API key; the edge stopping or
        shedding; its tenant at its ``slot_cap``, out of quota, or past its budget of body bytes; no slot to be had
        for it now); None: read its body (it is judged again, whole)."""
        try:
            head = self.core.head(request)
        except HttpError as exc:
            return self.core.refusal(request.target, exc)
        if head is None:
            return None
        tenant, admits = head
        error = self._refused_at_head(tenant, admits, length, now)
        if error is None:
            return None
        response = self.core.refusal(request.target, error)
        response.headers += self.gate.limits(tenant)
        return response

    def _refused_at_head(self, tenant: Tenant, admits: bool, length: int, now: int) -> HttpError | None:
        """Why a request of ``tenant`` is refused whatever its body says, cheapest reason first; None: none."""
        overloaded = self.overloaded()
        if overloaded is not None:
            return overloaded
        wait = self.bodies.refused(tenant.name, length, now)
        if wait is not None:
            return self.counted(self.refusals.body_rate(wait, self.bodies.rate))
        if not admits:
            return None
        if self.draining:
            return draining()
        refusal = self.gate.exhausted(tenant)
        if refusal is not None:
            return self.counted(self.refusals.tenant(refusal))
        frame = self.port.acquire()
        if frame is None:
            return self.counted(self.refusals.no_slot())
        try:
            status = self.port.early_refusal(frame, tenant.floor_id, tenant.slot_floor)
            return None if status is None else self.data_path(Status(status), frame)
        finally:
            self.port.release(frame)

    def overloaded(self) -> HttpError | None:
        """503 ``overloaded`` while the edge sheds for memory (edge/overload.py); None: it does not."""
        if not self.memory.shedding:
            return None
        reading = self.memory.reading
        assert reading.limit is not None
        return self.refusals.overloaded(reading.used, reading.limit)

    def frames(self, work: Work, formatter: Formatter) -> list[int] | Response:
        """A frame of the port for each of ``work``'s choices (all or none), unless it is refused before its prompt
        costs anything; else its refusal in its formatter's shape, every frame given back."""
        frame = self.port.acquire()
        spares = [self.port.acquire() for _ in range(work.choices - 1)]  # n choices: a frame each, all or none
        if frame is None or None in spares:
            for index in [frame, *spares]:
                if index is not None:
                    self.port.release(index)
            return formatter.failure(self.refusals.no_slot())
        held = [frame, *(index for index in spares if index is not None)]
        refused = self._before_prompt(work, frame, len(held))
        if refused is None:
            return held
        for index in held:
            self.port.release(index)
        response = formatter.failure(refused)
        response.headers += self.gate.limits(work.tenant)
        return response

    def _before_prompt(self, work: Work, frame: int, slots: int) -> HttpError | None:
        """The refusal a request gets before its prompt costs anything (templating, tokenizing): its tenant at its
        ``slot_cap``, or no slot to be had for it now (the agent reads the state words; a tenant under its floor
        takes one back), whatever its prompt.  A flood that never backs off then costs the edge a parse and a READ
        per attempt, not a tokenization -- CPU the model shares on a CPU server (docs/TENANTS.md)."""
        capped = self.gate.over_cap(work.tenant)
        if capped is not None:
            return self.counted(self.refusals.tenant(capped))
        status = self.port.early_refusal(frame, work.tenant.floor_id, work.tenant.slot_floor, slots)
        return None if status is None else self.data_path(Status(status), frame)

    def admit(self, t: Tracked) -> HttpError | None:
        """Reserve the request's prompt and ``max_tokens`` (and the request itself: the first of its choices) against
        its tenant's quotas, and a place within its ``slot_cap``, before any work (edge/tenancy/gate.py); the
        refusal when that does not fit, and the rate-limit headers of its answer either way."""
        tokens = prompt_charged(t) + output_tokens(t.work, t.work.max_tokens)  # max_tokens counts output words
        hold, refusal = self.gate.admit(t.work.tenant, tokens, requests=1 if t.choice == 0 else 0)
        t.limits = hold.limits
        if refusal is not None:
            return self.counted(self.refusals.tenant(refusal))
        t.hold = hold
        return None

    def data_path(self, status: Status, frame: int) -> HttpError:
        """The answer to a request the data path refused before any slot ran it (``frame``: its frame)."""
        frames = self.port.frames
        slot_cap = frames.request_headers[frame].slot_cap  # the agents count it across every edge
        return self.counted(self.refusals.data_path(status, frames.result_headers[frame], slot_cap))

    def counted(self, error: HttpError) -> HttpError:
        """``error``, counted among the refusals in ``/metrics`` when it is a 429."""
        if error.status == 429:
            self.metrics.refused(error.type)
        return error
