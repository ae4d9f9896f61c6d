"""The tenant gate of one edge, sans I/O: what a tenant may start, reserved before any work, and settled when it
ends -- its ``slot_cap`` at this edge, its quotas (this edge's words or a ledger edges share) and the usage line of
every request that ran.

The lifecycle asks the gate twice per request: :meth:`TenantGate.over_cap` before the prompt costs anything (the
early refusal), then :meth:`TenantGate.admit` once the prompt is tokenized (its exact count reserved with
``max_tokens``).  What the gate grants is a :class:`Hold`, which :meth:`TenantGate.settle` gives back when the
request ends, whatever the end: the tokens it did not use return to the quota, its place under the cap frees.  The
gate decides; the lifecycle turns a refusal into its answer (:mod:`edgepath.edge.refusals`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgepath.edge.tenancy import quota
from edgepath.edge.tenancy.quota import Quotas, Refused, Reservation, Unavailable
from edgepath.edge.tenancy.tenants import Tenant
from edgepath.edge.tenancy.usage import Usage

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class CapReached:
    """The tenant already holds ``cap`` requests at this edge, its ``slot_cap``."""

    cap: int


#: why the gate refused a request
Refusal = CapReached | Refused | Unavailable


@dataclass(eq=False, slots=True)
class Hold:
    """What one request holds of its tenant's limits until it is settled."""

    tenant: Tenant
    reservation: Reservation | None = None  # tokens (and the request) reserved against its quotas
    capped: bool = False  # counted in its tenant's requests in flight at this edge (its slot_cap)
    limits: Headers = field(default_factory=list)  # the x-ratelimit-* headers of every answer to it


class TenantGate:
    """Slot caps, quotas and usage for the tenants of one edge (``quotas``: where the buckets live; ``usage``: where
    each request's usage line goes, ``--usage-log``; ``wall_clock``: Unix ns, the clock every edge sharing a
    ledger reads)."""

    def __init__(
        self,
        quotas: Quotas | None = None,
        usage: Callable[[Usage], None] | None = None,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.quotas = quotas if quotas is not None else Quotas()
        self.usage = usage
        self.wall_clock = wall_clock
        self.in_flight: collections.Counter[str] = collections.Counter()  # tenants' requests held for a slot_cap

    def over_cap(self, tenant: Tenant) -> CapReached | None:
        """:class:`CapReached` when ``tenant`` holds as many requests at this edge as its ``slot_cap`` allows."""
        if tenant.slot_cap and self.in_flight[tenant.name] >= tenant.slot_cap:
            return CapReached(tenant.slot_cap)
        return None

    def exhausted(self, tenant: Tenant) -> Refusal | None:
        """Why any request of ``tenant`` would be refused now, whatever it asks (its ``slot_cap`` held, or a quota
        holding less than any request takes: :meth:`Quotas.empty`), or None: decided from its API key alone, before
        its body is read."""
        capped = self.over_cap(tenant)
        if capped is not None:
            return capped
        return self.quotas.empty(tenant, self.wall_clock())

    def limits(self, tenant: Tenant) -> Headers:
        """The rate-limit headers of an answer refused before it reserved anything: ``tenant``'s quotas as they
        are (none when it has none, or the ledger is out of reach)."""
        seen = self.quotas.limits(tenant, self.wall_clock())
        return quota.headers(seen) if seen is not None and not isinstance(seen, Unavailable) else []

    def admit(self, tenant: Tenant, tokens: int, requests: int) -> tuple[Hold, Refusal | None]:
        """Reserve ``tokens`` (a prompt and its ``max_tokens``) and ``requests`` (1 for the first of a request's
        choices) against ``tenant``'s quotas and a place within its ``slot_cap``.  The hold carries the rate-limit
        headers of its answer either way; on a refusal it holds nothing."""
        hold = Hold(tenant)
        capped = self.over_cap(tenant)
        if capped is not None:
            hold.limits = self.limits(tenant)
            return hold, capped
        got = self.quotas.reserve(tenant, tokens, self.wall_clock(), requests=requests)
        if isinstance(got, Unavailable):
            return hold, got
        hold.limits = quota.headers(got.limits) if got is not None else []
        if isinstance(got, Refused):
            return hold, got
        hold.reservation = got
        if tenant.slot_cap:
            hold.capped = True
            self.in_flight[tenant.name] += 1
        return hold, None

    def uncap(self, hold: Hold) -> None:
        """The request of ``hold`` no longer counts under its tenant's ``slot_cap`` (it was given up; its tokens are
        settled later, when what was computed for it is known)."""
        if hold.capped:
            hold.capped = False
            self.in_flight[hold.tenant.name] -= 1

    def settle(self, hold: Hold, used: int, ran: bool) -> None:
        """The request of ``hold`` ended having used ``used`` tokens (``ran``: a slot ran it; one that did not is
        charged nothing): what it reserved and did not use goes back, its place under the cap frees.  Settling
        twice settles once."""
        self.uncap(hold)
        if hold.reservation is not None:
            self.quotas.settle(hold.reservation, used, self.wall_clock(), ran=ran)
            hold.reservation = None

    def record(self, usage: Usage) -> None:
        """One request's usage line, to the usage log when there is one."""
        if self.usage is not None:
            self.usage(usage)
