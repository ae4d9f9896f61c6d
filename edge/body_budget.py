"""How many bytes of request bodies each tenant may have read per second, sans I/O (``now`` passed in, ns).

Reading a body is the edge's own work before anything else is known: its bytes cross the transport, then the JSON
shape scan, the parser and the shape's walk cost CPU in proportion to them -- CPU every tenant shares on one event
loop, and the model shares on a CPU server.  A tenant that sends a megabyte body in a loop (issue 49's flood: ten
clients, 880 KB each) made every other tenant wait behind it.  So each tenant has a budget of body bytes per second:
a bucket of ``rate`` bytes a second, holding at most ``burst`` (at least ``--max-body``, so one request of any
allowed size is read when the bucket is full).  A request's head is refused (429 ``body_rate``, with when to come
back) while its tenant's bucket holds less than its declared ``Content-Length`` -- before the body is read, so the
refusal costs its headers only; the bytes of the bodies read are taken when each is complete, so a body that declared
no length pays too, and the bucket may owe (later heads wait until it refills).

A refused request's body still comes: over HTTP/1.1 the connection can go on only once it is read (and thrown away),
and those bytes cost the loop what any body's bytes cost.  So they are paced too, as they are read
(:class:`Dropping`), by a bucket of their own at the same rate (``Admission.drops``): while it owes, the
connection stops reading until it refills, the kernel's flow control holds the flooding client back, and the edge
reads a tenant's refused bytes no faster than its budget -- not 330 MB/s of them (issue 49's flood).  A bucket of
their own, so a refusal never spends what the tenant's next request may use: a client refused once and then sending
within its budget is served.  HTTP/3 stops the stream instead (STOP_SENDING).
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes of request bodies one tenant may have read per second (``--body-rate``), by default
DEFAULT_BODY_RATE = 8 << 20


class BodyBudget:
    """Every tenant's bucket of body bytes: ``rate`` bytes a second, at most ``burst`` held (0 rate: no budget)."""

    def __init__(self, rate: int, burst: int) -> None:
        if rate < 0:
            raise ValueError(f"a body budget is 0 (none) or a positive number of bytes per second, got {rate}")
        if rate and burst < 1:
            raise ValueError(f"a body budget's burst must be at least 1 byte, got {burst}")
        self.rate = rate
        self.burst = max(burst, rate)
        self._buckets: dict[str, tuple[float, int]] = {}  # tenant -> (bytes held, when they were counted)

    def refused(self, tenant: str, length: int, now: int) -> float | None:
        """Seconds until ``tenant``'s bucket holds ``length`` bytes (a body it declared, 0 when it declared none), or
        None: it holds them now and the body may be read."""
        if not self.rate:
            return None
        held = self._held(tenant, now)
        need = max(1, min(length, self.burst))  # at least a byte: a bucket that owes refuses every head
        return None if held >= need else (need - held) / self.rate

    def take(self, tenant: str, size: int, now: int) -> None:
        """A body of ``size`` bytes of ``tenant``'s was read: its bucket pays for it (and may owe)."""
        if self.rate:
            self._buckets[tenant] = (self._held(tenant, now) - size, now)

    def owes(self, tenant: str, now: int) -> float:
        """Seconds until ``tenant``'s bucket owes nothing (0.0: it owes nothing now)."""
        if not self.rate:
            return 0.0
        held = self._held(tenant, now)
        return 0.0 if held >= 0 else -held / self.rate

    def _held(self, tenant: str, now: int) -> float:
        held, then = self._buckets.get(tenant, (self.burst, now))
        held = min(self.burst, held + (now - then) * self.rate / 1e9)
        if held >= self.burst:
            self._buckets.pop(tenant, None)  # full: nothing to remember (tenants come and go)
        else:
            self._buckets[tenant] = (held, now)
        return held


@dataclass(frozen=True, slots=True)
class Dropping:
    """The body of a request refused from its head, read only to be thrown away, paced by its tenant's bucket of
    refused bytes."""

    budget: BodyBudget
    tenant: str

    def drop(self, size: int, now: int) -> float:
        """``size`` more bytes of it were read: seconds to stop reading before the next (0.0: read on)."""
        self.budget.take(self.tenant, size, now)
        return self.budget.owes(self.tenant, now)

    def owes(self, now: int) -> float:
        """Seconds still to wait before reading on (the tenant's other requests may have spent more meanwhile)."""
        return self.budget.owes(self.tenant, now)
