"""Quotas per tenant -- tokens and requests, per minute and per day -- reserved before any work and settled when
the request ends: sans I/O (``now`` is passed in, Unix nanoseconds), over a ledger of words.

Each of a tenant's quotas (``tokens_per_minute``, ``tokens_per_day``, ``requests_per_minute``,
``requests_per_day``) is a bucket holding at most its limit and refilling continuously at limit / period (a
rolling minute, a rolling day, as OpenAI's limits refill).  Admission **reserves** the request's prompt tokens (the
edge knows the exact count) plus its ``max_tokens`` from the token buckets, and one request from the request
buckets -- or refuses at once, before any work, when one of them holds less, saying when enough will have
refilled.  When the request ends (finished, stopped, cancelled, failed) it is **settled**: what it did not use
goes back (all of it when nothing ran).  So a tenant is never served more than its quota (reservations cover the
worst case) and never refused while what it has not reserved covers the request.

A bucket is **one 64-bit word** (:func:`edgepath.contract.wire.bucket_debt`): how far it is ahead of the
bucket's clock, which counts the tokens refilled since the epoch at the bucket's rate.  Taking ``n`` is one
compare-and-swap from the word read to that word plus ``n`` (raised to the clock first: refilled), refused when
that would owe more than the limit; giving back is one CAS the other way.  The check and the debit are the one
CAS, so edges that share the words -- a :class:`Ledger` whose words live in a region every edge CASes over the
transport (:mod:`edgepath.dpu.ledger`) -- enforce one quota together, with no middle layer and no overshoot:
whichever CAS lands first is served, the other reads the new word from its failed CAS and decides again.  One
edge alone keeps the same words in its own memory (:class:`LocalLedger`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from edgepath.contract import wire
from edgepath.dpu.ledger import LedgerUnavailable
from edgepath.edge.tenancy.tenants import Tenant

MINUTE_NS, DAY_NS = 60 * 10**9, 86400 * 10**9


@dataclass(frozen=True, slots=True)
class Window:
    """One kind of quota: its unit (``tokens``, ``requests``), its window (``minute``, ``day``) and the tenant's
    field that holds its limit (0: none)."""

    unit: str
    name: str
    period_ns: int
    field: str

    def limit(self, tenant: Tenant) -> int:
        return int(getattr(tenant, self.field))

    def seconds(self, amount: float, limit: int) -> float:
        """Seconds in which ``amount`` refills at ``limit`` per window."""
        return amount * self.period_ns / limit / 1e9


WINDOWS = (
    Window("tokens", "minute", MINUTE_NS, "tokens_per_minute"),
    Window("tokens", "day", DAY_NS, "tokens_per_day"),
    Window("requests", "minute", MINUTE_NS, "requests_per_minute"),
    Window("requests", "day", DAY_NS, "requests_per_day"),
)
UNITS = ("tokens", "requests")
#: the least one request takes of each unit: a token of prompt and one of answer; the request itself
LEAST = {"tokens": 2, "requests": 1}


class Ledger(Protocol):
    """Where the bucket words live: ``entries`` pairs ``[key][bucket]`` (word ``2 i`` and ``2 i + 1``)."""

    entries: int

    def cas(self, word: int, expected: int, desired: int) -> int:
        """Compare-and-swap word ``word``; the value found (== ``expected`` on success).  A CAS whose ``desired``
        is its ``expected`` is a read.  :class:`LedgerUnavailable` when the words cannot be reached."""
        ...


class LocalLedger:
    """One edge's own words, in its memory: quotas enforced by this edge alone."""

    def __init__(self, entries: int = wire.LEDGER_ENTRIES) -> None:
        self.entries = entries
        self._words = [0] * (2 * entries)

    def cas(self, word: int, expected: int, desired: int) -> int:
        found = self._words[word]
        if found == expected:
            self._words[word] = desired
        return found


@dataclass(frozen=True, slots=True)
class Limits:
    """What the rate-limit headers say of one unit after a decision: its tightest window's limit (the minute's
    when it has one, else the day's), what is left of it, and seconds until it is full again."""

    limit: int
    remaining: int
    reset: float


@dataclass(slots=True)
class Reservation:
    """What one request of ``tenant`` took: ``tokens`` and ``requests`` from each bucket of ``buckets``
    (entry, window, limit); settled once.  ``limits``: the rate-limit headers' values right after it."""

    tenant: str
    tokens: int
    requests: int
    buckets: tuple[tuple[int, Window, int], ...]
    limits: Mapping[str, Limits] = field(default_factory=dict)
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """Over quota: the request needs ``need`` of ``unit``; ``retry_after`` seconds until enough refills (inf: never --
    the request alone is more than the ``limit`` of the ``window`` it is over)."""

    need: int
    unit: str  # "tokens" | "requests"
    window: str  # "minute" | "day"
    limit: int
    remaining: int
    retry_after: float
    limits: Mapping[str, Limits] = field(default_factory=dict)
    least: bool = False  # ``need`` is the least any request takes (:data:`LEAST`): refused before it was read


@dataclass(frozen=True, slots=True)
class Unavailable:
    """The ledger could not be reached: the request is refused (fail closed), nothing was taken."""

    why: str


@dataclass
class Quotas:
    """Every tenant's buckets in ``ledger``.  A bucket's entry is found (or made) when a tenant with that limit is
    first seen; when a reloaded tenants file changes a limit, the entry of the new limit this edge makes starts
    owing what the old one owed (at most the new limit): what was spent is kept."""

    ledger: Ledger = field(default_factory=LocalLedger)
    #: tokens (and requests) that could not be given back because the ledger was unreachable: the tenant is charged
    #: them, never served more
    lost_refunds: int = 0
    _entries: dict[tuple[str, str, str, int], int] = field(default_factory=dict, repr=False)
    _limits: dict[tuple[str, str, str], int] = field(default_factory=dict, repr=False)
    _words: dict[int, int] = field(default_factory=dict, repr=False)  # entry -> its word as last seen: the next guess

    def reserve(
        self, tenant: Tenant, tokens: int, now: int, requests: int = 1
    ) -> Reservation | Refused | Unavailable | None:
        """Take ``tokens`` and ``requests`` for a request of ``tenant`` from its buckets: a :class:`Reservation`,
        :class:`Refused` when a bucket holds too few (what the earlier ones gave is given back at once),
        :class:`Unavailable`, or None when the tenant has no quota (nothing to settle)."""
        windows = [(window, limit) for window in WINDOWS if (limit := window.limit(tenant))]
        if not windows:
            return None
        taken: list[tuple[int, Window, int]] = []
        seen: dict[Window, tuple[int, int]] = {}  # window -> (limit, debt after the decision)
        try:
            for window, limit in windows:
                entry = self._entry(tenant.name, window, limit, now)
                need = tokens if window.unit == "tokens" else requests
                debt, ok = self._take(entry, window, limit, need, now)
                seen[window] = (limit, debt)
                if not ok:
                    for back in taken:
                        self._give(back, tokens if back[1].unit == "tokens" else requests, now)
                    remaining = max(0, limit - debt)
                    wait = math.inf if need > limit else window.seconds(need - remaining, limit)
                    for other, most in windows:  # the headers say every unit's state, read
                        if other not in seen and (other.unit not in {w.unit for w in seen} or other.name == "minute"):
                            seen[other] = (
                                most,
                                self._take(self._entry(tenant.name, other, most, now), other, most, 0, now)[0],
                            )
                    return Refused(need, window.unit, window.name, limit, remaining, wait, _limits(seen))
                taken.append((entry, window, limit))
        except LedgerUnavailable as exc:
            for back in taken:
                self._give(back, tokens if back[1].unit == "tokens" else requests, now)
            return Unavailable(str(exc))
        return Reservation(tenant.name, tokens, requests, tuple(taken), _limits(seen))

    def settle(self, reservation: Reservation, used: int, now: int, ran: bool = True) -> None:
        """The request has ended having used ``used`` tokens (at most what it reserved): the rest goes back, and
        its request too when nothing ran (``ran`` false: refused by the data path, never computed)."""
        if reservation.settled:
            raise ValueError(f"quota: a reservation of {reservation.tenant} was settled twice")
        reservation.settled = True
        tokens_back = reservation.tokens - min(max(used, 0), reservation.tokens) if ran else reservation.tokens
        for bucket in reservation.buckets:
            self._give(bucket, tokens_back if bucket[1].unit == "tokens" else (0 if ran else reservation.requests), now)

    def limits(self, tenant: Tenant, now: int) -> Mapping[str, Limits] | Unavailable | None:
        """The rate-limit headers' values for ``tenant`` now, by unit (read from the ledger); None without a quota."""
        try:
            seen = self._read(tenant, now)
        except LedgerUnavailable as exc:
            return Unavailable(str(exc))
        return _limits(seen) if seen else None

    def empty(self, tenant: Tenant, now: int) -> Refused | Unavailable | None:
        """:class:`Refused` when one of ``tenant``'s buckets holds less than any request takes (:data:`LEAST`), read
        now and nothing taken: its next request is refused whatever it asks, so the edge refuses it from its headers,
        before its body is read; :class:`Unavailable` when the ledger cannot be reached; None otherwise."""
        try:
            seen = self._read(tenant, now)
        except LedgerUnavailable as exc:
            return Unavailable(str(exc))
        for window, (limit, debt) in seen.items():
            remaining, need = max(0, limit - debt), LEAST[window.unit]
            if remaining < need:
                wait = math.inf if need > limit else window.seconds(need - remaining, limit)
                return Refused(need, window.unit, window.name, limit, remaining, wait, _limits(seen), least=True)
        return None

    def _read(self, tenant: Tenant, now: int) -> dict[Window, tuple[int, int]]:
        """Each of ``tenant``'s buckets as its word is now (a CAS that changes nothing): window -> (limit, debt)."""
        seen: dict[Window, tuple[int, int]] = {}
        for window in WINDOWS:
            limit = window.limit(tenant)
            if limit:
                seen[window] = (
                    limit,
                    self._take(self._entry(tenant.name, window, limit, now), window, limit, 0, now)[0],
                )
        return seen

    # -- the words -------------------------------------------------------------------------------------
    def _take(self, entry: int, window: Window, limit: int, need: int, now: int) -> tuple[int, bool]:
        """Take ``need`` from a bucket in one CAS, retried from the word each failed CAS returns; the bucket's debt
        after it (or, refused, as found) and whether it was taken.  A refusal rests on the word as it is: the
        guess it was made from is confirmed (a CAS that changes nothing) first."""
        word, at = self._words.get(entry, 0), 2 * entry + 1
        clock = wire.bucket_clock(now, limit, window.period_ns)
        while True:
            debt = max(0, wire.bucket_debt(word, clock))
            desired = word if debt + need > limit or not need else wire.bucket_word(clock, debt + need)
            found = self.ledger.cas(at, word, desired)
            if found == word:
                self._words[entry] = desired
                return (debt, False) if desired == word and need else (debt + need, True)
            word = found

    def _give(self, bucket: tuple[int, Window, int], back: int, now: int) -> None:
        """Give ``back`` to a bucket (never beyond full); a ledger out of reach keeps it (counted)."""
        entry, window, limit = bucket
        if back <= 0:
            return
        word, at = self._words.get(entry, 0), 2 * entry + 1
        clock = wire.bucket_clock(now, limit, window.period_ns)
        try:
            while True:
                debt = wire.bucket_debt(word, clock)
                if debt <= 0:
                    return  # full already: what refilled meanwhile covers it
                desired = wire.bucket_word(clock, debt - min(back, debt))
                found = self.ledger.cas(at, word, desired)
                if found == word:
                    self._words[entry] = desired
                    return
                word = found
        except LedgerUnavailable:
            self.lost_refunds += back

    def _entry(self, tenant: str, window: Window, limit: int, now: int) -> int:
        """The entry of ``tenant``'s bucket of ``window`` at ``limit``: found by its key (linear probing from the
        key), or made by one CAS of its key word -- and then, when this edge used another limit for that window
        before, owing what that one owed."""
        name = (tenant, window.unit, window.name, limit)
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        key, entries = wire.ledger_key(*name), self.ledger.entries
        for probe in range(entries):
            entry = (key + probe) % entries
            found = self.ledger.cas(2 * entry, 0, key)
            if found in (0, key):
                break
        else:
            raise LedgerUnavailable(f"every one of the quota ledger's {entries} entries is taken")
        self._entries[name] = entry
        before = self._limits.get(name[:3])
        self._limits[name[:3]] = limit
        if found == 0 and before is not None and before != limit:  # made here: carry over what the old one owed
            old = self._entries[(*name[:3], before)]
            owed = min(
                max(0, wire.bucket_debt(self._words.get(old, 0), wire.bucket_clock(now, before, window.period_ns))),
                limit,
            )
            self._carry(entry, window, limit, owed, now)
        return entry

    def _carry(self, entry: int, window: Window, limit: int, owed: int, now: int) -> None:
        """Make a new bucket owe ``owed`` more (at most its limit): what its tenant spent under its old limit."""
        word, at = self._words.get(entry, 0), 2 * entry + 1
        clock = wire.bucket_clock(now, limit, window.period_ns)
        while owed:
            desired = wire.bucket_word(clock, min(limit, max(0, wire.bucket_debt(word, clock)) + owed))
            found = self.ledger.cas(at, word, desired)
            if found == word:
                self._words[entry] = desired
                return
            word = found


def _limits(seen: Mapping[Window, tuple[int, int]]) -> dict[str, Limits]:
    """Each unit's headers from the buckets seen: its minute window when it has one, else its day."""
    out: dict[str, Limits] = {}
    for window, (limit, debt) in seen.items():
        if window.unit not in out or window.name == "minute":
            owed = min(max(0, debt), limit)
            out[window.unit] = Limits(limit, limit - owed, window.seconds(owed, limit))
    return out


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


def headers(limits: Mapping[str, Limits]) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*-tokens`` and ``x-ratelimit-*-requests`` headers, for the units with a quota."""
    out = []
    for unit in UNITS:
        got = limits.get(unit)
        if got is not None:
            out += [
                (b"x-ratelimit-limit-" + unit.encode(), str(got.limit).encode()),
                (b"x-ratelimit-remaining-" + unit.encode(), str(got.remaining).encode()),
                (b"x-ratelimit-reset-" + unit.encode(), reset_text(got.reset).encode()),
            ]
    return out
