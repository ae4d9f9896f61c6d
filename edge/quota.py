"""Token quotas per tenant, reserved before any work and settled when the request ends: sans I/O (``now`` is
passed in, in seconds).

A tenant's ``tokens_per_minute`` and ``tokens_per_day`` are two token buckets: each holds at most its limit and
refills continuously at limit / period (a rolling minute and a rolling day, as OpenAI's token limits refill).
Admission **reserves** the request's prompt tokens (the edge knows the exact count) plus its ``max_tokens`` from
every bucket of its tenant -- or refuses at once, before any work, when one of them holds less, saying when
enough will have refilled.  When the request ends (finished, stopped, cancelled, failed) it is **settled**: what
it did not use goes back.  So a tenant is never served more than its quota (reservations cover the worst case)
and never refused while what it has not reserved covers the request.

One edge process keeps its own books: with several edges (``--workers``, several hosts) each enforces the whole
quota on what passes through it (docs/TENANTS.md: sharing quotas across edges is not built yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgepath.edge.tenants import Tenant

MINUTE, DAY = 60.0, 86400.0


@dataclass(slots=True)
class Bucket:
    """Tokens a tenant may still reserve in one window: ``level`` of ``limit``, refilled at limit / period."""

    limit: int
    period: float
    level: float
    at: float  # when ``level`` was last brought up to date

    @property
    def rate(self) -> float:
        return self.limit / self.period

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(float(self.limit), self.level + (now - self.at) * self.rate)
            self.at = now

    def wait(self, tokens: int) -> float:
        """Seconds until ``tokens`` are in the bucket (0: now; inf: never, more than its limit)."""
        if tokens > self.limit:
            return math.inf
        return max(0.0, (tokens - self.level) / self.rate)

    def reset(self) -> float:
        """Seconds until it is full again (OpenAI's ``x-ratelimit-reset-tokens``)."""
        return (self.limit - self.level) / self.rate


@dataclass(slots=True)
class Reservation:
    """Tokens reserved for one request of ``tenant`` (settled once)."""

    tenant: str
    tokens: int
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """Over quota: the request needs ``tokens``; ``retry_after`` seconds until enough frees (inf: never -- the
    request alone is more than the ``limit`` of the ``window`` it is over)."""

    tokens: int
    window: str  # "minute" | "day"
    limit: int
    remaining: int
    retry_after: float


@dataclass(frozen=True, slots=True)
class Limits:
    """What the rate-limit headers say after a decision: the tightest window's limit, what is left of it, and
    seconds until it is full again."""

    limit: int
    remaining: int
    reset: float


@dataclass
class Quotas:
    """Every tenant's buckets, made when a tenant with a quota is first seen and re-sized when its limits change
    (a reloaded tenants file); tenants without quotas cost nothing here."""

    _buckets: dict[str, dict[str, Bucket]] = field(default_factory=dict)

    def reserve(self, tenant: Tenant, tokens: int, now: float) -> Reservation | Refused | None:
        """Reserve ``tokens`` for a request of ``tenant``: a :class:`Reservation`, :class:`Refused` when a bucket
        holds too few, or None when the tenant has no quota (nothing to settle)."""
        buckets = self._of(tenant, now)
        if not buckets:
            return None
        for window, bucket in buckets.items():
            bucket.refill(now)
            if bucket.level < tokens:
                wait = bucket.wait(tokens)
                return Refused(tokens, window, bucket.limit, int(bucket.level), wait)
        for bucket in buckets.values():
            bucket.level -= tokens
        return Reservation(tenant.name, tokens)

    def settle(self, reservation: Reservation, used: int, now: float) -> None:
        """The request has ended having used ``used`` tokens (at most what it reserved): the rest goes back."""
        if reservation.settled:
            raise ValueError(f"quota: a reservation of {reservation.tenant} was settled twice")
        reservation.settled = True
        back = reservation.tokens - min(max(used, 0), reservation.tokens)
        for bucket in self._buckets.get(reservation.tenant, {}).values():
            bucket.refill(now)
            bucket.level = min(float(bucket.limit), bucket.level + back)

    def limits(self, tenant: Tenant, now: float) -> Limits | None:
        """The rate-limit headers' values for ``tenant`` now: its per-minute window when it has one, else its
        per-day one; None without a quota."""
        buckets = self._of(tenant, now)
        bucket = buckets.get("minute") or buckets.get("day")
        if bucket is None:
            return None
        bucket.refill(now)
        return Limits(bucket.limit, max(0, int(bucket.level)), bucket.reset())

    def _of(self, tenant: Tenant, now: float) -> dict[str, Bucket]:
        want = {"minute": (tenant.tokens_per_minute, MINUTE), "day": (tenant.tokens_per_day, DAY)}
        buckets = self._buckets.setdefault(tenant.name, {})
        for window, (limit, period) in want.items():
            bucket = buckets.get(window)
            if not limit:
                buckets.pop(window, None)
            elif bucket is None:
                buckets[window] = Bucket(limit, period, float(limit), now)
            elif bucket.limit != limit:  # a reloaded file changed it: keep what is spent, within the new limit
                bucket.refill(now)
                spent = bucket.limit - bucket.level
                bucket.limit = limit
                bucket.level = max(0.0, limit - spent)
        if not buckets:
            del self._buckets[tenant.name]
        return buckets


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-tokens``: ``20ms``, ``1.5s``, ``6m0s``, ``2h5m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def headers(limits: Limits) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*-tokens`` headers."""
    return [
        (b"x-ratelimit-limit-tokens", str(limits.limit).encode()),
        (b"x-ratelimit-remaining-tokens", str(limits.remaining).encode()),
        (b"x-ratelimit-reset-tokens", reset_text(limits.reset).encode()),
    ]
