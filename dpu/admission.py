"""Which slot server a request is claimed on, and in which order the others are tried: the admission policy.

Sans I/O: the policy sees what the agent last read of each candidate server (its free slots and its prefix
table, cached from the READ that also carries the heartbeat) and the request's token ids, and returns the
claim order; the agent then tries a compare-and-swap on each in turn and answers 429 when none succeeds.
No queue and no extra round trip: everything it needs was read already.

The order: servers with a free slot (as last seen) first; among them the one whose prefix table holds the
longest prefix of the request (its model reuses that prefix's KV instead of computing it), then the one
with the most free slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgepath.dma import wire


class Server(Protocol):
    """What the policy reads of one candidate (a :class:`~edgepath.dpu.links.ServerLink` is one)."""

    @property
    def free_hint(self) -> int: ...

    @property
    def prefixes(self) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Choice:
    """One candidate in claim order: its index among those given, and the prefix blocks of the request it
    holds (0: none, or it has no free slot)."""

    server: int
    matched: int


class Admission:
    """The claim order for requests of at most ``input_capacity`` tokens."""

    def __init__(self, input_capacity: int) -> None:
        self._chain = wire.PrefixChain(input_capacity)

    def order(self, tokens: np.ndarray, servers: Sequence[Server]) -> list[Choice]:
        """Every server of ``servers`` once, best first, for a request of ``tokens``."""
        chain = self._chain
        chain.blocks = 0
        if len(tokens) >= wire.PREFIX_BLOCK and any(len(server.prefixes) for server in servers):
            chain.compute(tokens)
        free = [server.free_hint for server in servers]
        matched = [chain.matched(server.prefixes) if free[i] else 0 for i, server in enumerate(servers)]
        ranked = sorted(range(len(servers)), key=lambda i: (not free[i], -matched[i], -free[i]))
        return [Choice(i, matched[i]) for i in ranked]
