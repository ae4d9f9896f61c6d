"""Whose large request is read next, sans I/O: tenants take turns.

One event loop reads every tenant's requests, and reading a large body -- parsing a megabyte of JSON, checking two
thousand messages -- holds it for tens of milliseconds.  Taken in arrival order, ten such requests from one tenant
put another tenant's small chat behind all ten.  So a large request (a body of :data:`LARGE_BODY` bytes or more)
waits for its tenant's turn instead: the driver reads one per loop iteration, tenants in turn, each tenant's in
order, while small requests are read at once.  A tenant may have :data:`LARGE_WAITING` large requests waiting; one
more is refused at once (429, before its body is read) -- the line is for fairness, never a queue that grows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")

#: a request whose body is at least this large waits for its tenant's turn to be read
LARGE_BODY = 64 * 1024
#: large requests one tenant may have waiting for their turn
LARGE_WAITING = 2


class Turns(Generic[T]):
    """Items waiting by tenant, handed out round robin between tenants (``per_tenant``: most waiting for one)."""

    def __init__(self, per_tenant: int = LARGE_WAITING) -> None:
        if per_tenant < 1:
            raise ValueError(f"a tenant may have at least 1 request waiting, got {per_tenant}")
        self.per_tenant = per_tenant
        self._waiting: OrderedDict[str, deque[T]] = OrderedDict()

    def add(self, tenant: str, item: T) -> bool:
        """Put ``item`` in ``tenant``'s line; False (and nothing added) when its line is full."""
        line = self._waiting.get(tenant)
        if line is None:
            line = self._waiting[tenant] = deque()
        elif len(line) >= self.per_tenant:
            return False
        line.append(item)
        return True

    def full(self, tenant: str) -> bool:
        """``tenant``'s line holds as many as it may: its next large request is refused (at its head, unread)."""
        line = self._waiting.get(tenant)
        return line is not None and len(line) >= self.per_tenant

    def next(self) -> T | None:
        """The next tenant's first item (that tenant goes to the back), or None when nothing waits."""
        if not self._waiting:
            return None
        tenant, line = self._waiting.popitem(last=False)
        item = line.popleft()
        if line:
            self._waiting[tenant] = line
        return item

    def __len__(self) -> int:
        return sum(len(line) for line in self._waiting.values())
