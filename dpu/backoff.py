"""Bounded exponential back-off, sans I/O: how long to wait before trying again.

One shape for every retry edgepath makes: the agent re-attaching to a slot server that went away
(:class:`Retry`, one per link) and ``serve`` restarting a child that died
(:class:`edgepath.supervisor.RestartPolicy`).  The delay doubles from ``first_delay`` with each failure
in a row and never exceeds ``max_delay``, so a peer that stays away costs one attempt per ``max_delay``
however long it is gone, and one that comes back is noticed within ``max_delay``.  Time is passed in
(any monotonic clock, seconds), never read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_DOUBLINGS = 64  # past this the cap has long been reached; 2**n would overflow a float


@dataclass(frozen=True)
class Backoff:
    """``first_delay`` doubling with each failure in a row, to at most ``max_delay`` (seconds)."""

    first_delay: float = 0.1
    max_delay: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError(f"need 0 < first_delay <= max_delay, got {self.first_delay}, {self.max_delay}")

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (1: after the first)."""
        if failures < 1:
            raise ValueError(f"a delay follows at least one failure, got {failures}")
        return min(self.max_delay, self.first_delay * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))


@dataclass
class Retry:
    """When something that failed may be tried again: :meth:`failed` after each failure (the link went
    down, an attempt failed), :meth:`due` before an attempt, :meth:`reset` once it worked."""

    backoff: Backoff = field(default_factory=Backoff)
    failures: int = 0  # failures in a row
    next_at: float = 0.0  # no attempt before this time

    def failed(self, now: float) -> float:
        """One more failure at ``now``: the delay before the next attempt."""
        self.failures += 1
        delay = self.backoff.delay(self.failures)
        self.next_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def reset(self) -> None:
        self.failures, self.next_at = 0, 0.0
